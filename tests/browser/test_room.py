"""A workshop room's first hour in a real JupyterLab, done as a participant does it: two
pickers on one pool, a `%%dist` cell while a run trains, a mistyped command, a FitPicker
given 0 devices, and a stored notebook opened before anything ran. What the page shows
is checked (screenshots in artifacts/browser/room_*.png)."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.browser.conftest import ARTIFACTS, REPO
from tests.browser.notebook_driver import (
    OUTPUT_TEXT,
    RUN_CELL,
    Picker,
    open_fresh,
    run_cell,
)
from tests.browser.test_jupyterlab import open_notebook

try:
    from playwright.sync_api import expect
except ImportError:  # the `browser` fixture fails with how to install it
    expect = None

CELLS = [
    "%load_ext nbpar\nimport nbpar\npool = nbpar.Pool(2)\npool",
    "picker = nbpar.StrategyPicker(pool, model='tiny_gpt', steps=3000)\npicker",
    "second = nbpar.StrategyPicker(pool, model='tiny_gpt', steps=20)\nsecond",
    "%%dist\nprint('hello')",
    "%dist bogus",
    "%dist debug 7",
    "fit = nbpar.FitPicker(world_size=8)\nfit",
    "pool.shutdown()",
]
T = 30_000  # ms for the kernel to answer a click
#: what the issue allows above an error's own line in a notebook
LINES_BEFORE_MESSAGE = 5


def _error_text(page, i: int) -> str:
    """Run cell ``i``, which must fail; the text its output area shows."""
    outputs = page.evaluate(RUN_CELL, i)
    assert any(o["output_type"] == "error" for o in outputs), (i, outputs)
    return page.evaluate(OUTPUT_TEXT, i)


def _message_first(text: str, message: str) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    at = next((k for k, line in enumerate(lines) if message in line), None)
    assert at is not None, text
    assert at <= LINES_BEFORE_MESSAGE, f"{at} lines before the message:\n{text}"


def _two_pickers_and_a_cell_during_a_run(page) -> None:
    """Items 1 and 2: a second run and a `%%dist` cell on ranks a run holds are refused
    with the run named and how to stop it (never a restart, which would end it)."""
    first, second = Picker(page, 0), Picker(page, 1)
    expect(second.run_button).to_be_enabled(timeout=T)
    first.run_button.click()
    expect(first.run_button).to_have_text(re.compile("running..."), timeout=T)
    second.run_button.click()
    expect(second.explanation).to_contain_text("could not start", timeout=T)
    said = second.explanation.inner_text()
    assert "are training <nbpar.Run ddp/torch" in said and "a new run can start once" in said
    assert "run.stop(), or the picker's Stop" in said, said
    expect(second.run_button).to_be_enabled(timeout=T)  # nothing queued behind the first
    assert second.runs() == [], second.runs()
    text = _error_text(page, 3)
    page.screenshot(path=str(ARTIFACTS / "room_busy.png"), full_page=True)
    _message_first(text, "a cell can start once it ends")
    assert "maybe stuck in a collective" not in text and "are training" in text, text
    first.stop_button.click()
    expect(first.run_button).to_have_text(re.compile(r"^\s*Run\s*$"), timeout=120_000)
    assert first.runs()[0][5] == "stopped", first.runs()


def _fit_picker_keeps_what_was_typed(page) -> None:
    """Item 4: 0 devices and -80 GB are refused in the labels' words, left as typed."""
    root = page.locator(".jp-OutputArea-output .widget-vbox").filter(
        has=page.locator("button", has_text="Simulate")
    )
    box = {
        label: root.locator(".widget-inline-hbox").filter(
            has=page.locator("label", has_text=re.compile(rf"^{label}$"))
        )
        for label in ("devices", "GB per device")
    }
    box["devices"].locator("input").fill("0")
    box["GB per device"].locator("input").fill("-80")
    box["GB per device"].locator("input").press("Tab")
    page.wait_for_timeout(1000)  # the kernel takes the typed values
    root.locator("button", has_text="Simulate").click()
    result = root.locator(".widget-html")
    expect(result).to_contain_text("devices must be a whole number of at least 1, got 0", timeout=T)
    expect(result).to_contain_text("GB per device must be more than 0, got -80")
    assert box["devices"].locator("input").input_value() == "0"
    assert box["GB per device"].locator("input").input_value() == "-80"
    page.screenshot(path=str(ARTIFACTS / "room_fit.png"), full_page=True)


@pytest.mark.browser
@pytest.mark.timeout(800)
def test_a_room_first_hour_reads_clearly(lab, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, console = open_fresh(browser, lab, "room.ipynb", CELLS)
    try:
        for i in (0, 1, 2):
            run_cell(page, i)
        _two_pickers_and_a_cell_during_a_run(page)
        # item 3: nbpar's own errors lead with their line
        _message_first(_error_text(page, 4), "bogus")
        _message_first(_error_text(page, 5), "7")
        run_cell(page, 6)
        _fit_picker_keeps_what_was_typed(page)
        run_cell(page, 7)
    finally:
        page.screenshot(path=str(ARTIFACTS / "room_end.png"), full_page=True)
        (ARTIFACTS / "room.console.log").write_text("\n".join(console))
        page.close()


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_a_stored_notebook_opened_before_it_ran_shows_no_widget_repr(lab, browser):
    """Item 9: notebook 08 as the repository stores it, opened with nothing run: its
    picker's output reads as a picker (saved state or its plain line), never a repr."""
    name = "stored_08.ipynb"
    shutil.copy(REPO / "notebooks" / "08_strategy_explorer.ipynb", lab.notebooks / name)
    page = browser.new_page()
    try:
        open_notebook(page, lab, name)
        page.wait_for_timeout(3000)  # the widget manager restores what it can
        page.screenshot(path=str(ARTIFACTS / "room_stored_08.png"), full_page=True)
        text = page.locator(".jp-NotebookPanel").inner_text()
        assert "VBox(children" not in text and "HBox(children" not in text
        drawn = page.locator(".jp-OutputArea-output .nbpar-picker").count()
        assert drawn or "nbpar StrategyPicker: model tiny_gpt" in text, text[:2000]
    finally:
        page.close()
