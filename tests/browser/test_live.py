"""The live dashboard is live in a real browser. A ~20 s run started from the picker's Run
button shows data in every panel at 25% and 50% of the run (screenshots in
artifacts/browser/); the figure is drawn within about a second of the engines' steps;
and what showing it costs is recorded side by side with the same run not shown (the
CPU the kernel, the Jupyter server and Chromium spend, as a share of the machine, and
the engines' step time) in artifacts/browser/live_cost.json; the repeated measurement
of that cost is benchmarks/dashboard_overhead.py."""

from __future__ import annotations

import json
import os
import statistics
import time

import psutil
import pytest

from tests.browser.conftest import ARTIFACTS, ENGINE_MARKERS
from tests.browser.notebook_driver import (
    LIVE_STATE,
    SAMPLER,
    Picker,
    open_fresh,
    progress,
    run_cell,
    start_picker,
)

STEPS = 1500  # tiny_gpt ddp on 2 idle CPU cores: about 13 ms a step, 20 s
CELLS = [
    "import json, statistics\nimport nbpar\npool = nbpar.Pool(2)\npool",
    f"picker = nbpar.StrategyPicker(pool, model='tiny_gpt', strategy='ddp', steps={STEPS})\npicker",
    "def step_s(run):  # the slowest rank's median step time, set-up steps left out\n"
    "    per = run.per_rank()\n"
    "    return max(statistics.median(r['step_time_s'] for r in p['history'][10:])\n"
    "               for p in per.values())\n"
    "quiet = pool.train(picker.config()).wait()  # the same run, not shown\n"
    "print(json.dumps({'quiet': step_s(quiet)}))",
    "print(json.dumps({'shown': step_s(picker.run)}))",
    "pool.shutdown()",
]
PANELS = ("loss", "step", "comm", "throughput", "states", "process")
# The promise: data within 1 s of the first step, then at least once a second; 0.1 s
# for the page's own sampling. The worst sample may be twice that on a shared machine.
FIRST_S, LAG_S = 1.1, 1.1
NEW_RUN = """() => {
  const label = document.querySelector('.nbpar-dashboard .nbpar-progress-text');
  return !!label && !/^(done|stopped)/.test(label.textContent);
}"""


def _viewer_processes(lab) -> list:
    """The processes that show a run: the Jupyter server, its kernels (not the engines
    they start) and the Chromium this test drives."""
    server = psutil.Process(lab.proc.pid)
    procs = [server] + [
        p
        for p in server.children(recursive=True)
        if not any(m in " ".join(p.cmdline()) for m in ENGINE_MARKERS)
    ]
    procs += [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name()]
    return procs


def _cpu_s(procs) -> dict:
    """CPU seconds so far of the kernel, the server and Chromium (and their sum)."""
    out = {"kernel": 0.0, "server": 0.0, "chromium": 0.0}
    for p in procs:
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        kind = "chromium" if "chrom" in p.name() else "kernel" if "ipykernel" in cmd else "server"
        out[kind] += t.user + t.system
    out["all"] = sum(out.values())
    return out


def _cores(before: dict, after: dict, wall_s: float) -> dict:
    return {k: (after[k] - before[k]) / wall_s for k in before}


def _watch(page, shots: dict | None = None) -> None:
    """Poll the page until the run is done; at 25% and 50% keep what it shows and take a
    screenshot (``shots``: fraction -> state, filled in)."""
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        state = page.evaluate(LIVE_STATE)
        done = progress(state["label"])
        if state["label"].startswith(("done", "stopped")):
            return
        for mark in sorted(shots or {}):
            if done and shots[mark] is None and done[0] >= mark * done[1]:
                shots[mark] = state
                page.locator(".nbpar-dashboard").screenshot(
                    path=str(ARTIFACTS / f"live_{int(mark * 100)}.png")
                )
        page.wait_for_timeout(250)
    raise AssertionError(f"the run did not finish in 420 s: {state}")


def _shown_run(page, lab, shots=None) -> dict:
    """Press Run, follow the run to its end; what the viewers spent and the page saw."""
    procs = _viewer_processes(lab)
    page.evaluate(SAMPLER)
    cpu, wall, clicked = _cpu_s(procs), time.monotonic(), time.time()
    Picker(page).run_button.click()
    page.wait_for_function(NEW_RUN, timeout=60_000)  # this run's dashboard, not the last
    before = page.evaluate(LIVE_STATE)
    if shots is not None:
        page.locator(".nbpar-dashboard").screenshot(path=str(ARTIFACTS / "live_start.png"))
    _watch(page, shots)
    out = {
        "cores": _cores(cpu, _cpu_s(procs), time.monotonic() - wall),
        "before": before,
        "after": page.evaluate(LIVE_STATE),
        "lag": [
            s
            for s in page.evaluate(
                "() => { clearInterval(window.__nbparSampler); return window.__nbparLag; }"
            )
            if s[1] >= clicked
        ],
    }  # this run's steps, not the last run's
    Picker(page).run_button.filter(has_text="Run").wait_for(timeout=60_000)
    return out


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_picker_run_grows_the_curves_while_it_trains(lab, browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, console = open_fresh(browser, lab, "live_dashboard.ipynb", CELLS)
    try:
        start_picker(page)
        shots = {0.25: None, 0.5: None}
        first = _shown_run(page, lab, shots)  # what a participant sees, screenshots taken
        page.locator(".nbpar-dashboard").screenshot(path=str(ARTIFACTS / "live_done.png"))
        procs = _viewer_processes(lab)
        cpu, wall = _cpu_s(procs), time.monotonic()
        quiet = json.loads(run_cell(page, 2).strip().splitlines()[-1])["quiet"]
        quiet_cores = _cores(cpu, _cpu_s(procs), time.monotonic() - wall)
        measured = _shown_run(page, lab)  # the same run shown again, only watched
        shown = json.loads(run_cell(page, 3).strip().splitlines()[-1])["shown"]
        run_cell(page, 4)
    finally:
        page.screenshot(path=str(ARTIFACTS / "live_dashboard.png"), full_page=True)
        (ARTIFACTS / "live_dashboard.console.log").write_text("\n".join(console))
        page.close()

    (ARTIFACTS / "live_lag.json").write_text(json.dumps(measured["lag"]))
    stats = _lag_stats(measured["lag"])
    cores = {"shown": measured["cores"]["all"], "quiet": quiet_cores["all"]}
    share = (cores["shown"] - cores["quiet"]) / (os.cpu_count() or 2)
    print(
        "cores used shown:",
        {k: round(v, 3) for k, v in measured["cores"].items()},
        "not shown:",
        {k: round(v, 3) for k, v in quiet_cores.items()},
    )
    print(
        f"first step drawn {stats['first']:.2f} s after it ran; newest step drawn median "
        f"{stats['median']:.2f} s, p95 {stats['p95']:.2f} s, max {stats['max']:.2f} s old "
        f"({stats['n']} samples; the kernel sent it median {stats['kernel']:.2f} s after "
        f"the step); {measured['after']['draws']} draws, slowest "
        f"{measured['after']['slowest_ms']:.0f} ms; viewers' CPU {cores['shown']:.3f} vs "
        f"{cores['quiet']:.3f} cores shown vs not: {share:.1%} of the machine; step time shown "
        f"{shown * 1e3:.2f} ms vs not shown {quiet * 1e3:.2f} ms (ratio {shown / quiet:.3f})"
    )
    _check_shots(first["before"], shots)
    assert stats["first"] < FIRST_S, f"first step drawn {stats['first']:.2f} s after it ran"
    assert stats["p95"] < LAG_S, f"the figure was {stats['p95']:.2f} s behind (95th percentile)"
    assert stats["max"] < 2 * LAG_S, f"the figure fell {stats['max']:.2f} s behind the engines"
    # What showing costs (viewers' CPU, step time shown vs not) is a speed figure: it is
    # written next to the screenshots and measured with repeats in
    # benchmarks/dashboard_overhead.py, not asserted here, where other work shares the cores.
    (ARTIFACTS / "live_cost.json").write_text(
        json.dumps(
            {"cpu_share": share, "cores": cores, "step_s_shown": shown, "step_s_quiet": quiet}
        )
    )


def _check_shots(before: dict, shots: dict) -> None:
    if before["last"] is None:  # before the first step: panels say so (no fake axes)
        assert before["waiting"] == ["waiting for the first step"] * len(PANELS), before
    for mark, state in shots.items():
        assert state is not None, f"no sample at {mark:.0%} of the run"
        assert progress(state["label"])[1] == STEPS
        for panel in PANELS:
            assert state["points"][panel] > 0, f"{panel} empty at {mark:.0%}: {state}"
        behind = state["now"] - state["last"]
        assert behind < 2 * LAG_S, f"at {mark:.0%} the newest step drawn is {behind:.2f} s old"
    assert shots[0.5]["points"]["loss"] > shots[0.25]["points"]["loss"]


def _lag_stats(lag: list) -> dict:
    """From the page's samples [now, first step time, newest step time, loss points, sent,
    newest chunk's sent time, frames]: how far the figure is behind the engines."""
    drawn = [s for s in lag if s[3] > 0]
    assert drawn, "the page never drew a step"
    running = drawn[:-20]  # the last 2 s: the run has ended, the newest step ages
    ages = sorted(s[0] - s[2] for s in running)
    return {
        "first": drawn[0][0] - drawn[0][1],
        "n": len(ages),
        "median": statistics.median(ages),
        "p95": ages[int(0.95 * (len(ages) - 1))],
        "max": ages[-1],
        "kernel": statistics.median(s[4] - s[2] for s in running),
    }
