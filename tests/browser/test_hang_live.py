"""A %%dist cell that hangs without a --timeout, in a real JupyterLab: within seconds its
output says who waits where and how to get out; the toolbar's stop button interrupts it
and names the rank that stays stuck; `%dist restart` gives the pool back (screenshot in
artifacts/browser/hang_live.png)."""

from __future__ import annotations

import time

import pytest

from tests.browser.conftest import ARTIFACTS
from tests.browser.notebook_driver import OUTPUT_TEXT, START_CELL, open_fresh, run_cell

CELLS = [
    "%load_ext nbpar\nimport nbpar\npool = nbpar.Pool(2)\npool",
    "%%dist\nimport time, torch, torch.distributed as dist\nt = torch.ones(3)\ndist.all_reduce(t)",
    "%%dist\nif dist.get_rank() == 1:\n    time.sleep(600)\ndist.all_reduce(t)",
    "%dist restart",
    "%%dist\nimport torch, torch.distributed as dist\nt = torch.ones(3)\ndist.all_reduce(t)\n"
    "print(int(t[0]))",
    "pool.shutdown()",
]
KERNEL_IDLE = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
# The word comes at the second look (4 s apart): about 8 s in; room for a loaded machine.
SHOWN_WITHIN_S = 30


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_a_hang_without_timeout_says_who_waits_where_and_stops(lab, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, console = open_fresh(browser, lab, "hang_live.ipynb", CELLS)
    try:
        run_cell(page, 0)
        run_cell(page, 1)
        started = time.monotonic()
        page.evaluate(START_CELL, 2)
        page.wait_for_function(
            f"() => ({OUTPUT_TEXT})(2).includes('waits in all_reduce')",
            timeout=SHOWN_WITHIN_S * 1000,
        )
        shown_after = time.monotonic() - started
        text = page.evaluate(OUTPUT_TEXT, 2)
        page.screenshot(path=str(ARTIFACTS / "hang_live.png"), full_page=True)
        assert "rank 1 is at cell line 2: time.sleep(600), not in a collective" in text, text
        assert "press the stop button" in text and "diagnosis: rank 1" in text, text
        assert page.evaluate(KERNEL_IDLE) == "busy"  # shown while the cell still runs
        # what a participant does: the toolbar's stop button
        page.locator("[data-command='notebook:interrupt-kernel']").first.click()
        page.wait_for_function(f"() => ({KERNEL_IDLE})() === 'idle'", timeout=60_000)
        after = page.evaluate(OUTPUT_TEXT, 2)
        assert "press the stop button" not in after, after  # the watch's word is gone
        assert "Interrupted" in after and "did not stop" in after, after
        assert "restarted 2 engine(s)" in run_cell(page, 3)
        assert run_cell(page, 4).strip().endswith("[rank 1] 2")
        run_cell(page, 5)
    finally:
        page.screenshot(path=str(ARTIFACTS / "hang_live_end.png"), full_page=True)
        (ARTIFACTS / "hang_live.console.log").write_text("\n".join(console))
        page.close()
    print(f"the hang's word was on the page {shown_after:.1f} s after the cell started")
