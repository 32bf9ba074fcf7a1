#!/bin/sh
# Install what the browser test (tests/browser) needs, skipping what is present:
# Debian's chromium (/usr/bin/chromium) and the playwright Python package that
# drives it. The browser is never downloaded by playwright (no `playwright install`).
# Usage: sh scripts/install_browser.sh .venv/bin/python
set -eu
PY=${1:-python3}
if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
else
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    # Wait for another apt/dpkg run to finish instead of failing on its lock.
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y chromium
fi
if "$PY" -c "import playwright.sync_api" 2>/dev/null; then
    echo "playwright already installed: $("$PY" -m pip show playwright 2>/dev/null | sed -n 's/^Version: //p')"
else
    "$PY" -m pip install -q playwright
fi
