"""The StrategyPicker in a real browser, clicked and typed into as a person would: every
strategy starts valid with only the controls that apply, every invalid input of the
issue is refused with a message in the labels' words (the box keeps what was typed),
advice given is advice that runs, and Run cannot start a second run while one goes."""

from __future__ import annotations

import re

import pytest

from tests.browser.conftest import ARTIFACTS
from tests.browser.notebook_driver import open_fresh, run_cell, start_picker

try:
    from playwright.sync_api import expect
except ImportError:  # the `browser` fixture fails with how to install it
    expect = None

CELLS = [
    "import nbpar\npool = nbpar.Pool(2)\npool",
    "picker = nbpar.StrategyPicker(pool, model='tiny_gpt', steps=300)\npicker",
    "pool.shutdown()",
]
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "hybrid")
BAD_NUMBERS = [
    ("micro-batch", "0", "micro-batch must be a whole number of at least 1, got 0"),
    ("micro-batch", "-5", "micro-batch must be a whole number of at least 1, got -5"),
    ("micro-batch", "100000", "micro-batch 100000 is more than this picker runs (at most 4096)"),
    ("micro-batch", "7.5", "micro-batch must be a whole number, not 7.5"),
    ("steps", "0", "steps must be a whole number of at least 1, got 0"),
    ("grad accum", "", "grad accum is empty: type a whole number"),
]
T = 20_000  # ms for the kernel to answer a change


def _ready(picker, strategy: str) -> None:
    expect(picker.explanation).to_have_text(re.compile(rf"^ready: {strategy}/"), timeout=T)
    expect(picker.run_button).to_be_enabled(timeout=T)


def _problems(picker, expected: list[str]) -> None:
    expect(picker.explanation.locator("li")).to_have_text(expected, timeout=T)
    expect(picker.run_button).to_be_disabled(timeout=T)


def _every_strategy(picker) -> None:
    for strategy in STRATEGIES:
        picker.choose("strategy", strategy)
        _ready(picker, strategy)
        assert picker.shown("schedule") == (strategy in ("pipeline", "hybrid")), strategy
        assert picker.shown("dp") == picker.shown("pp") == (strategy == "hybrid"), strategy
        assert not picker.shown("offload")  # backend torch


def _schedule_and_back(picker) -> None:
    picker.choose("strategy", "pipeline")
    _ready(picker, "pipeline")
    picker.choose("schedule", "1f1b")
    _problems(
        picker,
        [
            "schedule 1f1b needs at least as many micro-batches (grad accum 1) as "
            "pipeline stages (pp 2); raise grad accum or use schedule gpipe"
        ],
    )
    picker.type("grad accum", "2")
    _ready(picker, "pipeline")
    picker.type("grad accum", "1")
    picker.choose("schedule", "gpipe")
    for strategy in ("ddp", "zero2", "pipeline", "zero1"):
        picker.choose("strategy", strategy)
        _ready(picker, strategy)


def _hybrid_advice(picker) -> None:
    picker.choose("strategy", "hybrid")
    _ready(picker, "hybrid")
    picker.choose("dp", "2")
    expect(picker.explanation.locator("li")).to_have_count(1, timeout=T)
    (problem,) = picker.problems()
    advice = re.search(r"e\.g\. dp (\d) × tp (\d) × pp (\d)", problem)
    assert (
        problem.startswith("dp × tp × pp = 2 × 1 × 2 = 4 must equal the number of engines (2)")
        and advice
    ), problem
    for label, value in zip(("dp", "tp", "pp"), advice.groups()):
        picker.choose(label, value)
    _ready(picker, "hybrid")


def _bad_numbers(page, picker) -> None:
    picker.choose("strategy", "ddp")
    for label, text, problem in BAD_NUMBERS:
        picker.type(label, text)
        _problems(picker, [problem])
        assert picker.control(label).locator("input").input_value() == text
        picker.type(label, {"micro-batch": "8", "steps": "300", "grad accum": "1"}[label])
        _ready(picker, "ddp")
    picker.choose("model", "simple_cnn")
    picker.choose("strategy", "tp")
    picker.choose("precision", "fp16")
    picker.type("grad accum", "two")
    _problems(
        picker,
        [
            "grad accum must be a whole number, not two",
            "strategy tp needs model tiny_gpt, hf:llama, hf:gpt2 or one with a parallel_plan() "
            "(it splits transformer layers), got simple_cnn",
            "precision fp16 needs backend deepspeed (its loss scaler); use bf16 or fp32 with "
            "backend torch",
        ],
    )
    page.locator(".nbpar-picker").screenshot(path=str(ARTIFACTS / "picker_problems.png"))
    picker.type("grad accum", "1")
    picker.choose("precision", "fp32")
    picker.choose("model", "tiny_gpt")
    picker.choose("strategy", "ddp")
    _ready(picker, "ddp")


def _run_stop_and_run_again(page, picker) -> None:
    picker.run_button.click()
    expect(picker.run_button).to_have_text(re.compile("running..."), timeout=T)
    expect(picker.run_button).to_be_disabled()
    expect(picker.stop_button).to_be_visible()
    expect(picker.explanation).to_have_text(re.compile(r"^running picker\.runs\[0\]"))
    picker.choose("strategy", "zero1")  # editing the form while it runs: Run stays off
    page.wait_for_timeout(1000)
    expect(picker.run_button).to_be_disabled()
    page.locator(".nbpar-picker").screenshot(path=str(ARTIFACTS / "picker_running.png"))
    picker.stop_button.click()
    expect(picker.run_button).to_have_text(re.compile(r"^\s*Run\s*$"), timeout=120_000)
    _ready(picker, "zero1")
    expect(picker.stop_button).to_be_hidden()
    rows = picker.runs()
    assert len(rows) == 1 and rows[0][1] == "ddp/torch tiny_gpt", rows
    assert rows[0][5] in ("stopped", "done"), rows  # a run can end before Stop lands
    picker.run_button.click()
    # The button reads "Run" until the kernel takes the click: wait for the run to start
    # before waiting for it to end.
    expect(picker.run_button).to_have_text(re.compile("running..."), timeout=T)
    expect(picker.run_button).to_have_text(re.compile(r"^\s*Run\s*$"), timeout=180_000)
    expect(picker.root.locator(".nbpar-runs-list tr")).to_have_count(3, timeout=T)
    status = picker.root.locator(".nbpar-runs-list tr").nth(2).locator("td").nth(5)
    expect(status).to_have_text("done", timeout=T)
    rows = picker.runs()
    assert [r[0] for r in rows] == ["picker.runs[0]", "picker.runs[1]"], rows
    assert rows[1][1:3] == ["zero1/torch tiny_gpt", "300/300"] and rows[1][5] == "done", rows
    page.locator(".nbpar-picker").screenshot(path=str(ARTIFACTS / "picker_runs.png"))


@pytest.mark.browser
@pytest.mark.timeout(800)
def test_picker_explains_every_state_and_never_traps(lab, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, console = open_fresh(browser, lab, "picker.ipynb", CELLS)
    try:
        picker = start_picker(page)
        _ready(picker, "ddp")
        page.locator(".nbpar-picker").screenshot(path=str(ARTIFACTS / "picker_ready.png"))
        _every_strategy(picker)
        _schedule_and_back(picker)
        _hybrid_advice(picker)
        _bad_numbers(page, picker)
        _run_stop_and_run_again(page, picker)
        run_cell(page, 2)
    finally:
        page.screenshot(path=str(ARTIFACTS / "picker.png"), full_page=True)
        (ARTIFACTS / "picker.console.log").write_text("\n".join(console))
        page.close()
