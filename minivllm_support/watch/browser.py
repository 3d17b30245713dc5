"""Drive the page in a real browser: headless Chromium through Selenium and the system chromedriver.

Debian's packages `chromium` and `chromium-driver` (.ci/run installs them); Selenium from pip.
Nothing is downloaded: the driver is the one on PATH (Selenium's own driver manager would
fetch one from the internet, so it is never asked).
"""
from __future__ import annotations

import importlib.util
import shutil
import time

PAGE_STATE_JS = """
const rows = [...document.querySelectorAll('#requests tr')].map(tr => ({
  id: +tr.dataset.id, queue: tr.dataset.queue, phase: tr.dataset.phase, preemptions: +tr.dataset.preemptions}));
const num = (id) => { const el = document.getElementById(id); return el ? +el.textContent : null; };
return {status: document.getElementById('status').textContent, step: num('step'), rows: rows,
        preemptions: num('total-preemptions'), finished: num('total-finished'), max_ref: num('max-ref'),
        shared_cells: [...document.querySelectorAll('#kv-grid .cell.shared')].map(c => +c.dataset.ref),
        cells: document.querySelectorAll('#kv-grid .cell').length,
        kv: {used: num('kv-used'), cached: num('kv-cached'), free: num('kv-free'), scratch: num('kv-scratch'),
             total: num('kv-total')},
        tree_nodes: document.querySelectorAll('#tree g.node').length,
        preempt_log: [...document.querySelectorAll('#log li.preempt')].length,
        events: window.watchState ? window.watchState.events : 0};
"""


def browser_missing() -> str | None:
    """Why no browser test can run here, or None when it can."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install selenium)"
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"{exe} is not on PATH (apt-get install chromium chromium-driver)"
    return None


def open_browser(width: int = 1360, height: int = 900):
    """A headless Chromium (as root it needs --no-sandbox); call .quit() when done."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    return driver


def page_state(driver) -> dict:
    """What the page shows, read from its DOM."""
    return driver.execute_script(PAGE_STATE_JS)


def wait_until(driver, condition, timeout_s: float, every_s: float = 0.1) -> dict:
    """Poll page_state until condition(state) holds; return the last state (check it yourself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = page_state(driver)
        if condition(state) or time.monotonic() > deadline:
            return state
        time.sleep(every_s)


def save_small_png(driver, path, max_bytes: int = 200_000) -> int:
    """Screenshot to `path`; with Pillow, reduced to a 256-colour palette (a page of flat colours
    loses nothing visible) when it would be over max_bytes. Returns its size in bytes."""
    import io
    from pathlib import Path

    png = driver.get_screenshot_as_png()
    if len(png) > max_bytes and importlib.util.find_spec("PIL") is not None:
        from PIL import Image
        img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256)
        out = io.BytesIO()
        img.save(out, format="PNG", optimize=True)
        png = out.getvalue()
    Path(path).write_bytes(png)
    return len(png)
