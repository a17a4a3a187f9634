"""A PNG of a replay (``--trace-html``) as headless Chromium shows it: docs/replay.png.

    make replay                                                  # writes replay.html
    .venv/bin/python scripts/replay_screenshot.py replay.html docs/replay.png

Opens the replay offline, goes to the step where prefix-shared blocks and the pool's use peak
together, selects a request holding a shared block, and saves the page. Needs /usr/bin/chromium
and /usr/bin/chromedriver (Debian's chromium, chromium-driver) and the ``test`` extra (selenium).
"""

import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

FLAGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
    "--disable-background-networking --disable-component-update --disable-sync "
    "--window-size=1400,1250 --hide-scrollbars"
).split()
# the frame with the most shared blocks, then the most blocks in use; a sequence sharing one
PICK_JS = """let best = 0, score = -1;
for (let k = 0; k < F.length; k++) {
  const own = owners(stateAt(k).tab, NB);
  const s = own.filter((o) => o.length > 1).length * NB + own.filter((o) => o.length).length;
  if (s > score) { score = s; best = k; }
}
const own = owners(stateAt(best).tab, NB), shared = own.find((o) => o.length > 1);
return [best, shared ? shared[shared.length - 1] : 0];"""


def screenshot(html: Path, png: Path) -> None:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='replay-chromium-')}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    try:
        driver.get(html.resolve().as_uri())
        frame, seq = driver.execute_script(PICK_JS)
        driver.execute_script("select(arguments[1]); show(arguments[0]);", frame, seq)
        driver.save_screenshot(str(png))
    finally:
        driver.quit()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: replay_screenshot.py REPLAY_HTML OUT_PNG")
    screenshot(Path(sys.argv[1]), Path(sys.argv[2]))
