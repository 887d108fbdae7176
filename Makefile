# The README's two commands: `make run` (set up, then start the tray app) and
# `make test` (set up, then run every check CI runs; `make test-fast` skips the tests
# marked slow). Both are idempotent: the virtual environment at .venv/ is rebuilt only
# when pyproject.toml changes.
PY      ?= python3
VENV    := .venv
STAMP   := $(VENV)/.installed
# Debian packages the GUI tests need: a real X server, a tray host, screenshots.
# g++: inductor builds the compiled decode kernel (engine/experts/fused.py), which the tests assert.
APT_PKGS := xvfb trayer imagemagick x11-utils libxcb-cursor0 libxkbcommon-x11-0 \
            libegl1 libgl1 libfontconfig1 libdbus-1-3 libxcb-icccm4 libxcb-keysyms1 \
            desktop-file-utils appstream g++

.PHONY: run test test-fast setup system-deps lint bench
.DEFAULT_GOAL := run

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# pyproject pins torch==2.13.0: the CPU build lying on this machine's disk, no download.
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

# Installs the Debian packages the GUI tests need when they are missing (root only;
# elsewhere it says what is missing and the real-X test reports the gap by name).
system-deps:
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing Debian packages (install them as root): $$missing"; fi; \
	fi

run: setup
	$(VENV)/bin/moetray $(ARGS)

# mypy reads the rooms as the moetray package through links (it cannot follow the editable
# install's finder; see [tool.mypy] in pyproject.toml).
MYPY_ROOMS := policy engine app ui resources

lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	@mkdir -p .mypy-src/moetray && for room in $(MYPY_ROOMS); do ln -sfn ../../$$room .mypy-src/moetray/$$room; done
	$(VENV)/bin/python -m mypy

test: setup system-deps lint
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The inner loop: every test not marked `slow` (CI runs `make test`, which runs them all).
test-fast: setup lint
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/moetray bench all
