"""A pipeline stage's step as segments, so that what repeats is simulated once.

The micro-batches of a step have one shape and run the same code, so each one's forward
does to the memory meter and the communication meter what the others' do, and so does
each backward; only the first backward differs (it creates the gradients, the others add
into them). A stage's step is therefore metered as segments: the step's start (the
gradients freed), the forward and the backward of micro-batches 0 and 1, and the end
(the data-parallel gradient all-reduce and the optimizer step). Each segment records how
far live memory and saved activations rose above where they stood when it began, where
they ended, and the bytes it sent. Replaying the segments in a schedule's order (`compose`,
micro-batch 1's for every later one) gives the peak, the activation peak and the bytes
that running every micro-batch gives, exactly: the meter only adds and subtracts. And the
stages that hold the same module (the same number of layers, the same ends) differ only
in that order, so one simulated rank stands for all of them (`nbpar.simulate.roles`).

FSDP2 is left out: whether it keeps gathered parameters depends on the order of forwards
and backwards, so its stages run every micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass
class Segment:
    """What one part of a step did to the meters, relative to where they stood."""

    rise: int = 0
    """how far live memory rose above its level at the start"""
    saved_rise: int = 0
    """how far saved activations rose above theirs"""
    saved_at_rise: int = 0
    """saved activations at the highest live memory, relative to the start"""
    comm_at_rise: int = 0
    """live communication buffers then, relative to the start"""
    net: int = 0
    """live memory at the end minus at the start"""
    saved_net: int = 0
    comm_net: int = 0
    sent: dict[str, float] = field(default_factory=dict)
    """bytes sent, by op"""


class SegmentMeter:
    """Meters the segments of one step on a `SimMemory` and a `CommMeter`, both active."""

    def __init__(self, mem, comm):
        self.mem, self.comm = mem, comm
        self.segments: dict = {}
        self.start = {"live": mem.live, "saved": mem.saved, "comm": mem.comm}

    @contextlib.contextmanager
    def measure(self, key):
        """Meter the code run inside as segment ``key``."""
        sent = dict(self.comm.bytes_by_op)
        self.mem.begin_segment()
        try:
            yield
        finally:
            seg = self.mem.end_segment()
            seg.sent = {
                op: n - sent.get(op, 0.0)
                for op, n in self.comm.bytes_by_op.items()
                if n != sent.get(op, 0.0)
            }
            self.segments[key] = seg


def micro_batch_segment(segments: dict, kind: str, i: int) -> Segment:
    """The segment of micro-batch ``i``'s ``kind`` ("F" or "B"): its own where it ran,
    else micro-batch 1's (every later one repeats it)."""
    return segments.get((kind, i)) or segments[(kind, 1)]


def compose(segments: dict, start: dict, order) -> dict:
    """Replay ``segments`` ("head", ("F"|"B", i), "tail") from the meters' ``start``
    (live, saved, comm bytes) in ``order`` ([("F"|"B", i)], a stage's schedule): the
    step's peak, its activation peak, what was live at the peak, the bytes it sent."""
    live, saved, comm = start["live"], start["saved"], start["comm"]
    peak, saved_peak = live, saved
    at_peak = {"activations": saved, "comm": comm}
    sent: dict[str, float] = {}
    steps = [segments["head"], *(micro_batch_segment(segments, k, i) for k, i in order)]
    for seg in (*steps, segments["tail"]):
        if live + seg.rise > peak:
            peak = live + seg.rise
            at_peak = {"activations": saved + seg.saved_at_rise, "comm": comm + seg.comm_at_rise}
        saved_peak = max(saved_peak, saved + seg.saved_rise)
        live, saved, comm = live + seg.net, saved + seg.saved_net, comm + seg.comm_net
        for op, n in seg.sent.items():
            sent[op] = sent.get(op, 0.0) + n
    return {"peak": peak, "saved_peak": saved_peak, "at_peak": at_peak, "sent": sent}
