"""Cheap per-step measurements: process memory and a compute/communication split.

No profiler: memory comes from the OS (RSS, peak RSS) and the device module;
communication time comes from timestamps taken around collectives, either
blocking ones (`CommTimer.span`) or asynchronous ones whose Future completes
later (`CommTimer.watch`, used by the DDP comm hook on every gradient bucket).
"""

from __future__ import annotations

import contextlib
import threading
import time

from nbpar import device
from nbpar.measure.clocks import HostClock
from nbpar.measure.comm import union_s
from nbpar.measure.records import model_state_bytes


def memory_snapshot(pg_backend: str) -> dict[str, int]:
    """This process's resident bytes (``rss_bytes``) and, on a GPU, the allocator's
    figures (``device_allocated_bytes``; ``device_peak_bytes`` since the last
    `nbpar.device.reset_peak`, which the train loop calls at each step's start)."""
    return {"rss_bytes": device.rss_bytes() or 0, **device.memory_stats(pg_backend)}


def step_peak_bytes(record: dict) -> int:
    """The peak of tracked memory in a step: the device allocator's on a GPU; on a CPU
    the tracked step's peak (`nbpar.measure.memtrack`) or, on other steps, the model
    states held after the step. Never the process's RSS, which is reported apart."""
    if record.get("device_peak_bytes") is not None:
        return record["device_peak_bytes"]
    return max(model_state_bytes(record), record.get("tracked_peak_bytes") or 0)


class CommTimer:
    """Wall time during which at least one collective of this rank was in flight.

    What is measured, exactly: each collective contributes the interval from
    its launch to its completion (for async ones: until its Future's callback
    runs). ``comm_s`` is the length of the union of those intervals inside the
    step, so overlapping buckets are not double counted. It includes comm that
    overlaps with backward compute (DDP's bucketed all-reduce) as well as
    exposed comm (the loss all-reduce). It runs on every step (each record's
    ``comm_s``) but sees only what it wraps; a run's reported ``comm_s``/``exposed_comm_s``
    and the live view's split come from the metered steps' `nbpar.measure.comm.CommMeter`,
    which sees every strategy's ops.

    ``marks`` (`nbpar.measure.clocks.step_clock`) times the collectives: the host's clock
    on a CPU; on a GPU the device stream's, where a collective's Future completes when it
    is queued, so its end is an event recorded in the Future's callback, which CUDA
    orders after the collective. The intervals are read in `comm_s`, after the step
    synchronized.
    """

    def __init__(self, marks: HostClock | None = None):
        self._lock = threading.Lock()
        self._intervals: list[tuple] = []
        self._t0 = self._t1 = 0.0
        self.marks = marks if marks is not None else HostClock()

    def start_step(self) -> None:
        with self._lock:
            self._intervals = []
        self.marks.start()
        self._t0 = time.perf_counter()

    def end_step(self) -> float:
        """Closes the step; returns its wall time in seconds."""
        self._t1 = time.perf_counter()
        return self._t1 - self._t0

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    @contextlib.contextmanager
    def span(self):
        """Time a blocking collective: ``with timer.span(): dist.all_reduce(t)``."""
        start = self.marks.mark()
        try:
            yield
        finally:
            self.record(start, self.marks.mark())

    def watch(self, fut):
        """Time an async collective from now until ``fut`` completes; returns the
        chained Future (its value is ``fut``'s value)."""
        start = self.marks.mark()

        def done(f):
            self.record(start, self.marks.mark())
            return f.value()

        return fut.then(done)

    def comm_s(self) -> float:
        """Seconds of the step with a collective in flight (read once the step's work is
        done: on a GPU after it synchronized)."""
        seconds = self.marks.seconds
        with self._lock:
            intervals = [(seconds(a), seconds(b)) for a, b in self._intervals]
        return union_s(
            [
                (max(a, self._t0), min(b, self._t1))
                for a, b in intervals
                if min(b, self._t1) > max(a, self._t0)
            ]
        )

    def fraction(self) -> float:
        """``comm_s`` over the step: at most 1 because the intervals are cut to the step."""
        step = self._t1 - self._t0
        return self.comm_s() / step if step > 0 else 0.0


def timed_allreduce_hook(state, bucket):
    """DDP comm hook: the default all-reduce (sum / group size) of one gradient
    bucket, timed on ``state.timer``; ``state.group`` is the dp process group."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return state.timer.watch(allreduce_hook(state.group, bucket))


class HookState:
    """State of `timed_allreduce_hook`: the dp process group and the step timer."""

    def __init__(self, group, timer: CommTimer):
        self.group = group
        self.timer = timer
