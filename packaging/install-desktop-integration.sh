#!/bin/sh
# Install (or with --uninstall, remove) moetray's launcher entry, icon and AppStream
# metadata for the current user, after `pipx install .` or `uv tool install .` from a checkout.
# Exec= points at the `moetray` found on PATH (or $MOETRAY_BIN), so the launcher runs the
# same installation. Autostart is a separate, opt-in switch in the dashboard's Settings tab.
set -eu
ID=io.github.moetray.Moetray
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${XDG_DATA_HOME:-$HOME/.local/share}
APPS=$DATA/applications
ICONS=$DATA/icons/hicolor/scalable/apps
META=$DATA/metainfo

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$APPS/$ID.desktop" "$ICONS/$ID.svg" "$META/$ID.metainfo.xml"
    echo "removed the moetray launcher, icon and metadata"
    exit 0
fi

BIN=${MOETRAY_BIN:-$(command -v moetray || true)}
if [ -z "$BIN" ]; then
    echo "moetray is not on PATH: install it first (from a checkout: pipx install . or uv tool install .)" >&2
    exit 1
fi
mkdir -p "$APPS" "$ICONS" "$META"
sed "s|^Exec=moetray|Exec=$BIN|" "$HERE/$ID.desktop" > "$APPS/$ID.desktop"
cp "$HERE/icons/$ID.svg" "$ICONS/$ID.svg"
cp "$HERE/$ID.metainfo.xml" "$META/$ID.metainfo.xml"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database "$APPS" || true
command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q "$DATA/icons/hicolor" 2>/dev/null || true
echo "installed $APPS/$ID.desktop (Exec=$BIN)"
