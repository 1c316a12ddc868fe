#!/usr/bin/env sh
# Headless Chromium and its WebDriver for the chat UI's browser tests (Debian packages).
# Does nothing when both are already on PATH; uses sudo when not run as root.
set -e
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" = "0" ] || SUDO="sudo"
echo "==> Installing Chromium and ChromeDriver for the chat page's browser tests (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null
    $SUDO apt-get install -y -q chromium chromium-driver >/dev/null
}
