"""A pipeline step's bubble by the schedules' own formulas, from its measured boxes.

The formulas give one device's idle time in a step of m micro-batches from the time F,
I and W one micro-batch's forward, input gradient and weight gradient take on a device
(its stages together; a full backward B is I + W), all devices alike:

- 1F1B (PipeDream-Flush, Narayanan et al. 2021): (p-1)(F+I+W);
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Section 2): (p-1)(F+I-W),
  one third of 1F1B's when F = I = W. DeepSeek-V3's table writes it (p-1)(F+B-2W) with
  B the full backward: the same formula.

As a share of the step: bubble / (bubble + m(F+I+W)); 1F1B's is (p-1)/(m+p-1). ZB-V (no
bubble at F = I = W in its paper) and DualPipeV get no formula here: torch's orders of
both, replayed with equal boxes, idle (p-1) forwards of one stage a device (the first
micro-batch's way down the V). What they idle with real boxes is what
`nbpar.measure.timeline.schedule_bubble` replays from the order the ranks ran.
F, I and W are the mean box lengths of each stage (stalls left out), summed over a
device's stages and averaged over the devices. torch computes no input gradient on stage
0 (its input is token ids): there an I box is empty and W holds the whole backward.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def _stage_means(events: list[dict]) -> dict[int, dict[str, float]]:
    """{stage: {"F", "I", "W"} mean seconds per micro-batch}; a stage's full backward
    boxes (B) count as I + W, W taken from its W boxes (0 without any)."""
    lengths: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in events:
        if not e.get("stall"):
            lengths[(e["stage"], e["kind"])].append(e["end"] - e["start"])
    means = {key: statistics.fmean(v) for key, v in lengths.items()}
    out = {}
    for stage in {s for s, _ in lengths}:
        w = means.get((stage, "W"), 0.0)
        i = means[(stage, "I")] if (stage, "I") in means else means.get((stage, "B"), w) - w
        out[stage] = {"F": means.get((stage, "F"), 0.0), "I": i, "W": w}
    return out


def device_box_means(events: list[dict]) -> dict[str, float]:
    """Mean seconds of one micro-batch's F, I and W on a device: each stage's means
    summed over the stages a device (``rank``, else the stage) runs, averaged over the
    devices."""
    stages = _stage_means(events)
    rows: dict[int, set[int]] = defaultdict(set)
    for e in events:
        rows[e.get("rank", e["stage"])].add(e["stage"])
    return {
        kind: statistics.fmean(sum(stages[s][kind] for s in held) for held in rows.values())
        for kind in ("F", "I", "W")
    }


def formula_bubbles(events: list[dict], p: int, m: int | None = None) -> dict | None:
    """The step's bubble by each formula, in seconds and as a share of the step:
    ``{"F", "I", "W", "1f1b_s", "1f1b", "zb_h1_s", "zb_h1"}``; the ZB-H1 figures only for
    a step that split its backward (W boxes). None for an empty step. ``m`` defaults to
    the micro-batches seen."""
    if not events:
        return None
    m = m or len({e["microbatch"] for e in events})
    t = device_box_means(events)
    work = m * (t["F"] + t["I"] + t["W"])
    out = dict(t)
    bubbles = {"1f1b": (p - 1) * (t["F"] + t["I"] + t["W"])}
    if any(e["kind"] == "W" for e in events):
        bubbles["zb_h1"] = max(0.0, (p - 1) * (t["F"] + t["I"] - t["W"]))
    for name, seconds in bubbles.items():
        out[f"{name}_s"] = seconds
        out[name] = seconds / (seconds + work) if seconds + work > 0 else 0.0
    return out
