"""The live page in a real browser (headless Chromium, Selenium) against lesson 20's server.

The server runs in this process (the embedded SmolLM2, eager, a 40-block KV pool); eight
completions share a 64-token prefix and together need more blocks than the pool holds. The
test reads the page's DOM: rows appear and finish, shared blocks carry a reference count > 1,
the preemption is shown, and at the end the grid's counts equal the block manager's books."""
import io

import pytest

from minivllm_support.watch.browser import browser_missing


@pytest.mark.slow
def test_the_page_shows_sharing_preemption_and_balanced_books(tmp_path, no_leftovers):
    if (why := browser_missing()) is not None:
        pytest.skip(f"no browser test: {why}")
    from step20_http_serve.watch_demo import BURST, run_demo
    png = tmp_path / "dashboard.png"
    r = run_demo(png)
    during, end, books = r.during, r.end, r.books
    # in the middle of the run: requests running, a block shared, a preemption shown
    assert sum(row["queue"] == "running" for row in during["rows"]) >= 2
    assert during["shared_cells"] and max(during["shared_cells"]) > 1
    assert during["preemptions"] >= 1 and during["preempt_log"] >= 1
    assert during["tree_nodes"] >= 4                              # the shared prefix's blocks, at least
    assert r.answers == BURST
    # at the end: every request a finished row, every block free, as the block manager says
    finished = [row for row in end["rows"] if row["queue"] == "finished"]
    assert len(finished) == BURST and end["finished"] == BURST
    assert any(row["preemptions"] > 0 for row in finished)
    assert end["max_ref"] > 1
    kv = end["kv"]
    assert kv["used"] == books["used"] == 0
    assert kv["cached"] + kv["free"] == books["free"] == books["num_blocks"]
    assert kv["cached"] == books["cached"] and kv["total"] - kv["scratch"] == books["num_blocks"] == end["cells"]
    # the screenshot decodes to an image of the window's size
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) == r.screenshot_bytes < 200_000
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        assert img.size[0] >= 1000 and img.size[1] >= 600
