"""Time the training thread spent blocked in a step: communication compute did not hide.

On a CPU the step's compute runs on the thread that calls ``train_step`` (autograd runs
a CPU backward on the calling thread), and the collectives run on the backend's own
threads (gloo's workers). So while that thread neither runs nor waits for a core, it is
waiting for something else, and inside a step that is communication: DDP's finalize
waiting for the last bucket's all-reduce, FSDP waiting for an all-gather, a pipeline
stage waiting for its activations (its bubble), or a rank waiting for a slower one to
join a collective. The kernel keeps both clocks for every thread (``/proc/<pid>/task/
<tid>/schedstat``: nanoseconds on a CPU, nanoseconds waiting in its run queue), so

    blocked = wall - on a CPU - waiting for a core

is measured on every step (``on a CPU`` from `time.thread_time`, the run queue from
schedstat) for the price of two small file reads (tens of microseconds,
`benchmarks/meter_cost.py` measures it against the step). It is exposed communication
and waiting for a slower rank together (the metered step's `CommMeter` tells the two
apart); it is not scaled from another step. What else can block the thread: another
Python thread holding the GIL (a live view's publisher, a comm hook's callback), a page
fault, or, with several intra-op threads, the calling thread waiting for the others at
the end of a parallel region; with one thread per engine the last does not happen.
The two clocks are kept apart by the kernel and can disagree by about a scheduler tick,
so on a loaded machine a short step can read a few milliseconds below zero; that is
kept as measured (not clipped), and the median over a run's steps is what is reported.

Where the kernel keeps no schedstat, the clock falls back on the thread's CPU time
(`time.thread_time`), and waiting for a core then counts as blocked (``method``
"thread_time" says so). On a GPU the host thread also waits for its kernels, so the
clock is not used there (`nbpar.device` backends other than gloo on a CPU).
"""

from __future__ import annotations

import threading
import time


def _run_queue_ns(tid: int) -> int | None:
    """Nanoseconds thread ``tid`` has waited in the run queue for a core, or None.

    (The file's first field, time on a CPU, is not used: for the running thread it lags
    by up to a scheduler tick; `time.thread_time` reads the same clock up to date. The
    second only grows when the thread is scheduled in, so it is exact while it runs.)"""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class BlockedClock:
    """Seconds the calling thread was blocked between `start` and `stop` (module doc).

    ``method`` is "schedstat" (run queue waits left out) or "thread_time" (counted in)."""

    def __init__(self):
        self.tid = threading.get_native_id()
        self.method = "schedstat" if _run_queue_ns(self.tid) is not None else "thread_time"
        self._start: tuple[float, float, float] | None = None

    def _clocks(self) -> tuple[float, float, float]:
        """(wall, on a CPU, waiting for a core) in seconds, now."""
        queued = _run_queue_ns(self.tid) if self.method == "schedstat" else None
        return time.perf_counter(), time.thread_time(), (queued or 0) / 1e9

    def start(self) -> None:
        if threading.get_native_id() != self.tid:  # the loop may run on another thread
            self.__init__()
        self._start = self._clocks()

    def stop(self) -> float:
        """Blocked seconds since `start`."""
        if self._start is None:
            raise RuntimeError("BlockedClock.stop() before start()")
        end = self._clocks()
        wall, run, queued = (b - a for a, b in zip(self._start, end))
        self._start = None
        return wall - run - queued
