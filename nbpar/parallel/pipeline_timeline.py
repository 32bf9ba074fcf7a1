"""Every pipeline step's spans on each pp rank, gathered into the run's timelines; the
same for torch's schedules and DeepSpeed's PipelineEngine.

A runner's stages append one span per micro-batch and pass (`span`: stage, microbatch,
kind "F", "B", "I" or "W" (`timeline.KINDS`), start and end marks of
`nbpar.measure.clocks`); `PipelineSpans` opens each step (its spans cleared, the pp ranks
lined up by a barrier), then reads the marks as seconds on pp rank 0's clock (an offset
measured once, `clocks.clock_offset`) and gathers every rank's spans into
`timeline.StepTimelines`, which keeps the typical step. `SpanReports` gives a runner its
``timeline()``, bubbles and formula bubbles from them.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

from nbpar.measure import timeline as _timeline
from nbpar.measure.bubble_formulas import formula_bubbles
from nbpar.measure.clocks import HostClock, clock_offset


def read_spans(events: list[dict], marks: HostClock, offset: float) -> None:
    """Each span's marks as seconds on pp rank 0's clock (``offset``: this rank's clock
    minus rank 0's), in place, once the step's work is done."""
    for e in events:
        e["start"] = marks.seconds(e["start"]) - offset
        e["end"] = marks.seconds(e["end"]) - offset


def span(stage: int, microbatch: int, kind: str, start, end) -> dict:
    """One pass of a micro-batch on a stage, as marks: forward ("F"), backward ("B"), or
    a split backward's input gradient ("I") or weight gradient ("W")."""
    return dict(stage=stage, microbatch=microbatch, kind=kind, start=start, end=end)


class PipelineSpans:
    """The spans of this rank's stages (``events``, appended by them) for the pp group."""

    def __init__(self, pp_group, events: list, clock: list, marks: HostClock):
        self.pp_group, self.pp_size = pp_group, dist.get_world_size(pp_group)
        self.events, self.clock, self.marks = events, clock, marks
        self.timelines = _timeline.StepTimelines()
        self.clock[0] = clock_offset(pp_group)  # to pp rank 0's clock

    def begin(self) -> tuple[float, bool]:
        """Open a step: (its start on pp rank 0's clock, whether it is metered: a metered
        step runs every op through a Python dispatch mode, `CommMeter`)."""
        self.events.clear()
        metered = _get_current_dispatch_mode() is not None
        dist.barrier(group=self.pp_group)
        self.marks.start()
        return time.perf_counter() - self.clock[0], metered

    def end(self, t0: float, metered: bool) -> None:
        """Close the step: every pp rank's spans, from pp rank 0's step start, to
        ``timelines``."""
        self.marks.settle()
        read_spans(self.events, self.marks, self.clock[0])
        gathered: list = [None] * self.pp_size
        dist.all_gather_object(gathered, (t0, self.events, metered), group=self.pp_group)
        start = gathered[0][0]
        events = sorted(
            (
                dict(e, rank=r, start=e["start"] - start, end=e["end"] - start)
                for r, (_, events, _) in enumerate(gathered)
                for e in events
            ),
            key=lambda e: (e["rank"], e["start"]),
        )
        self.timelines.add(events, metered=any(m for _, _, m in gathered))


class SpanReports:
    """``timeline()`` and the bubbles of a runner whose ``spans`` is a `PipelineSpans`."""

    spans: PipelineSpans

    @property
    def timelines(self) -> _timeline.StepTimelines:
        return self.spans.timelines

    def timeline(self) -> list[dict]:
        """Events of the typical step on every pp rank: stage, rank, microbatch, kind,
        start, end, stall (`timeline.mark_stalls`); which step: ``timelines.about()``."""
        return self.timelines.typical()

    def _bubble(self, measure, **kwargs) -> float | None:
        events = self.timelines.typical()  # empty: no step yet, or only metered ones
        return measure(events, self.spans.pp_size, **kwargs) if events else None

    def bubble_fraction(self) -> float | None:
        """Measured idle share of the pp ranks over the typical step, stalls left out."""
        return self._bubble(_timeline.bubble_fraction)

    def bubble_fraction_with_stalls(self) -> float | None:
        """The same step's measured idle share with its stalls as they ran."""
        return self._bubble(_timeline.bubble_fraction, with_stalls=True)

    def schedule_bubble_fraction(self) -> float | None:
        """The part of it the schedule forces with these stage times (no gaps, no stalls)."""
        return self._bubble(_timeline.schedule_bubble)

    def formula_bubbles(self) -> dict | None:
        """The same step's bubble by the 1F1B and ZB-H1 formulas in time, with its mean
        F, I and W boxes (`bubble_formulas.formula_bubbles`)."""
        return self._bubble(formula_bubbles)
