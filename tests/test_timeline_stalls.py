"""Stalls in a pipeline timeline and the typical step a run draws (`nbpar.measure.timeline`).

Every expected bubble here is counted by hand from the boxes (each device's busy time as
a union, against p x the step's span) or is the schedule's formula written out.
"""

from __future__ import annotations

import pytest

from nbpar.measure import timeline
from nbpar.measure.timeline import (
    StepTimelines,
    bubble_fraction,
    mark_stalls,
    plot_timeline,
    schedule_bubble,
)

MS = 1e-3
# GPipe, p = 2 stages, m = 4 micro-batches: lengths[kind][stage][micro-batch], 2-4 ms
LENGTHS = {
    "F": [[3, 3, 3, 2], [2.5, 3, 3.5, 3]],
    "B": [[4, 3.5, 4, 3], [4, 4, 3.5, 4]],
}
STALL = ("F", 0, 1)  # stage 0's forward of micro-batch 1 ...
STALL_MS = 130  # ... takes 130 ms instead of 3


def _gpipe(lengths, stall_ms=None):
    """A GPipe step (all forwards, then all backwards) that starts every box as soon as
    its device is free and its input exists; ``stall_ms`` replaces the STALL box's length."""
    p, m = len(lengths["F"]), len(lengths["F"][0])
    done, free, events = {}, [0.0] * p, []

    def run(kind, s, mb, after):
        ms = stall_ms if (kind, s, mb) == STALL and stall_ms else lengths[kind][s][mb]
        start = max([free[s]] + [done[d] for d in after])
        done[(kind, s, mb)] = free[s] = start + ms * MS
        events.append(dict(stage=s, rank=s, microbatch=mb, kind=kind, start=start, end=free[s]))

    for mb in range(m):
        for s in range(p):
            run("F", s, mb, [("F", s - 1, mb)] if s else [])
    for mb in range(m):
        for s in reversed(range(p)):
            run("B", s, mb, [("F", s, mb)] + ([("B", s + 1, mb)] if s < p - 1 else []))
    return events


def _by_hand(events, p):
    """1 - (each device's busy seconds, overlaps once) / (p x the step's span)."""
    busy = 0.0
    for row in range(p):
        end = float("-inf")
        for e in sorted((e for e in events if e["rank"] == row), key=lambda e: e["start"]):
            start = max(e["start"], end)
            busy, end = busy + max(0.0, e["end"] - start), max(end, e["end"])
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    return 1 - busy / (p * span)


def test_a_130_ms_forward_among_2_to_4_ms_boxes_is_a_stall_left_out_of_the_bubble():
    marked = mark_stalls(_gpipe(LENGTHS, stall_ms=STALL_MS))
    stalls = [e for e in marked if e["stall"]]
    assert [(e["kind"], e["stage"], e["microbatch"]) for e in stalls] == [STALL]
    assert stalls[0]["typical_s"] == pytest.approx(3 * MS)  # median of 3, 130, 3, 2 ms
    assert all(e["stall"] is False and "typical_s" not in e for e in marked if e not in stalls)
    # without the stall: the bubble of the same step had that box taken its 3 ms
    without = _by_hand(_gpipe(LENGTHS), 2)
    assert bubble_fraction(marked, 2) == pytest.approx(without)
    assert without == pytest.approx((2 - 1) / (4 + 2 - 1), abs=0.05)  # (p-1)/(m+p-1)
    # with it: stage 1 idles the 127 ms stage 0 stalled
    with_stall = bubble_fraction(marked, 2, with_stalls=True)
    assert with_stall == pytest.approx(_by_hand(marked, 2))
    assert with_stall > without + 0.2  # 0.44 against 0.22
    # the schedule's bubble leaves it out alike and stays a lower bound of the measured
    assert schedule_bubble(marked, 2) <= bubble_fraction(marked, 2) + 1e-12
    assert schedule_bubble(marked, 2, with_stalls=True) > schedule_bubble(marked, 2) + 0.2
    # an unmarked timeline is measured as it ran
    assert bubble_fraction(_gpipe(LENGTHS, STALL_MS), 2) == pytest.approx(with_stall)


def test_leaving_a_stall_out_can_raise_the_bubble_of_a_mostly_idle_step():
    """A stall is a busy box: while stage 0 stalls 9 s, stage 1 idles, so that stretch is
    half busy, more than this step as a whole (13 of 44 device-seconds). Cut it and the
    idle share rises, 1 - 13/44 = 0.705 to 1 - 4/26 = 0.846: the two figures are
    different questions, neither a bound of the other."""

    def box(stage, start, end, **stall):
        return {"stage": stage, "rank": stage, "kind": "F", "start": start, "end": end, **stall}

    events = [
        box(0, 0.0, 10.0, stall=True, typical_s=1.0),
        box(0, 10.0, 11.0, stall=False),
        box(1, 20.0, 21.0, stall=False),
        box(1, 21.0, 22.0, stall=False),
    ]
    assert bubble_fraction(events, 2, with_stalls=True) == pytest.approx(1 - 13 / 44)
    assert bubble_fraction(events, 2) == pytest.approx(1 - 4 / 26)


def test_stalls_are_judged_per_stage_and_kind():
    # the last stage's boxes are all 4x stage 0's: slower, not stalled
    slow_last = {"F": [[2, 2, 2, 2], [8, 8, 8, 8]], "B": [[3, 3, 3, 3], [12, 12, 12, 12]]}
    assert not any(e["stall"] for e in mark_stalls(_gpipe(slow_last)))
    # one box of a stage with a single micro-batch has a median only across steps
    one = [e for e in _gpipe(LENGTHS, stall_ms=STALL_MS) if e["microbatch"] == 1]
    assert not any(e["stall"] for e in mark_stalls(one))
    reference = one + [e for e in _gpipe(LENGTHS) if e["microbatch"] == 1] * 2
    assert [e["stall"] for e in mark_stalls(one, reference)].count(True) == 1


def test_a_stall_is_drawn_hatched_with_a_red_edge():
    marked = mark_stalls(_gpipe(LENGTHS, stall_ms=STALL_MS))
    ax = plot_timeline(marked).axes[0]
    assert len(ax.patches) == len(marked)
    hatched = [bar for bar in ax.patches if bar.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_width() == pytest.approx(STALL_MS * MS)
    assert hatched[0].get_edgecolor()[:3] == pytest.approx((0xC4 / 255, 0x4E / 255, 0x52 / 255))
    assert "with 1 stall" in ax.get_title()
    assert "stall" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "stall" not in plot_timeline(_gpipe(LENGTHS)).axes[0].get_title()


def _step(ms: float):
    """A step of two boxes whose span is ``ms`` milliseconds."""
    return [
        dict(stage=0, rank=0, microbatch=0, kind="F", start=0.0, end=ms * MS / 2),
        dict(stage=1, rank=1, microbatch=0, kind="F", start=ms * MS / 2, end=ms * MS),
    ]


def test_typical_step_is_the_normal_step_nearest_the_median():
    steps = StepTimelines()
    assert steps.typical() == [] and steps.about()["step"] is None
    steps.add(_step(900), metered=False)  # set-up
    assert steps.about() == dict(step=0, typical=False, normal_steps=0, metered=[], stalls=0)
    steps.add(_step(800), metered=False)  # set-up
    steps.add(_step(500), metered=True)
    assert steps.about()["step"] == 1  # only set-up steps so far: the latest
    for ms in (10, 14, 12, 30, 11):  # steps 3..7: median 12 ms
        steps.add(_step(ms), metered=False)
    about = steps.about()
    assert about == dict(step=5, typical=True, normal_steps=5, metered=[2], stalls=0)
    assert steps.typical()[-1]["end"] == pytest.approx(12 * MS)
    assert all(e["stall"] is False for e in steps.typical())
    for _ in range(3 * timeline.KEEP_STEPS):  # memory stays bounded
        steps.add(_step(20), metered=False)
    assert len(steps.normal) == timeline.KEEP_STEPS and steps.about()["step"] == steps.steps - 1
