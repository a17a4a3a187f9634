"""Debian's headless Chromium through selenium, for the replay's and the web page's browser
tests (apt-get install -y chromium chromium-driver; .ci/run installs them)."""

from __future__ import annotations

import shutil
import tempfile

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
    "--disable-background-networking --disable-component-update --disable-sync "
    "--window-size=1400,1100"
).split()


def chromium(prefix: str) -> webdriver.Chrome:
    """A fresh headless Chromium (its own profile directory) that keeps the page's console."""
    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} missing: apt-get install -y chromium chromium-driver"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix=prefix)}"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
