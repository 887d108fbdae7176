"""The desktop files are valid and agree with each other and with the app.

A launcher whose ``Icon=`` names no installed icon, or an autostart entry without
``--hidden``, fails quietly on a user's desktop; these checks fail here instead.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moetray.app.autostart import APP_ID, TEMPLATE
from moetray.app.main import APP_ID as MAIN_APP_ID

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
DESKTOP = PACKAGING / f"{APP_ID}.desktop"
AUTOSTART = PACKAGING / f"{APP_ID}.autostart.desktop"
METAINFO = PACKAGING / f"{APP_ID}.metainfo.xml"
RUNTIME_AUTOSTART = ROOT / "resources" / TEMPLATE


def entry(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(path)
    return dict(parser["Desktop Entry"])


def test_one_application_id_everywhere():
    # Qt's desktop file name maps the window to the launcher; a mismatch shows a generic icon.
    assert MAIN_APP_ID == APP_ID
    assert entry(DESKTOP)["Icon"] == APP_ID == entry(AUTOSTART)["Icon"] == entry(RUNTIME_AUTOSTART)["Icon"]
    assert (PACKAGING / "icons" / f"{APP_ID}.svg").is_file()
    root = ET.parse(METAINFO).getroot()
    assert root.findtext("id") == APP_ID
    assert root.find("launchable").text == DESKTOP.name


def test_autostart_entries_start_hidden():
    assert entry(AUTOSTART)["Exec"] == "moetray --hidden"
    assert entry(RUNTIME_AUTOSTART)["Exec"] == "@EXEC@"  # filled with this install's command + --hidden


def test_launcher_runs_the_tray():
    assert entry(DESKTOP)["Exec"] == "moetray" and entry(DESKTOP)["Type"] == "Application"


def test_metainfo_screenshots_exist_in_the_repository():
    root = ET.parse(METAINFO).getroot()
    for image in root.iter("image"):
        name = image.text.rsplit("/packaging/", 1)[1]
        assert (PACKAGING / name).is_file(), name


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_files_pass_desktop_file_validate():
    result = subprocess.run(["desktop-file-validate", str(DESKTOP), str(AUTOSTART), str(RUNTIME_AUTOSTART)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "error" not in result.stdout, result.stdout


@pytest.mark.skipif(shutil.which("appstreamcli") is None, reason="appstream not installed")
def test_metainfo_passes_appstream_validation():
    result = subprocess.run(["appstreamcli", "validate", "--no-net", str(METAINFO)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_desktop_integration_script_installs_an_entry_pointing_at_this_moetray(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data"),
           "MOETRAY_BIN": "/opt/moetray/bin/moetray"}
    subprocess.run(["sh", str(PACKAGING / "install-desktop-integration.sh")], env=env, check=True,
                   capture_output=True, timeout=60)
    installed = tmp_path / "data" / "applications" / DESKTOP.name
    assert entry(installed)["Exec"] == "/opt/moetray/bin/moetray"
    assert (tmp_path / "data" / "icons" / "hicolor" / "scalable" / "apps" / f"{APP_ID}.svg").is_file()
    subprocess.run(["sh", str(PACKAGING / "install-desktop-integration.sh"), "--uninstall"], env=env,
                   check=True, capture_output=True, timeout=60)
    assert not installed.exists()
