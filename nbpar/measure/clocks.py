"""Clocks for the step's meters: when the host did something, or when the device did.

On a CPU (gloo) an op runs while the host waits, so the time the host launches and
returns from it is the time it ran: `HostClock`. On a GPU (NCCL) the host only queues
kernels and collectives: the time a launch returns says nothing of when the device ran
it, and a collective's Future completes when it is queued, not when it finishes. There
`DeviceClock` marks a point of the current stream with an event; once the step's work is
done (`settle`, one synchronize) each mark reads as the host-clock time the device reached
it, through a base event recorded at `start` while host and device were in step. A
meter therefore records marks while the step runs and reads them as seconds only after
it, and watches a collective's Work until ``is_completed()`` (which asks the device)
rather than trusting its Future (``completes_at_launch``).

Every meter that times the step (`nbpar.measure.comm.CommMeter`, `metrics.CommTimer`, the
pipeline's forward and backward spans) takes its clock from `step_clock(backend)`.
Processes on several hosts put their times on one axis with `clock_offset`.
"""

from __future__ import annotations

import time


class HostClock:
    """The host's clock: a mark is the time now, and reads as itself."""

    #: a collective's Future completes when the collective does
    completes_at_launch = False

    def __init__(self, clock=time.perf_counter):
        self.clock = clock

    def start(self) -> None:
        """Nothing to line up: host and its work share one clock."""

    def mark(self):
        return self.clock()

    def settle(self) -> None:
        """Nothing is queued: every mark already reads as its time."""

    def seconds(self, mark) -> float:
        return mark


class DeviceClock(HostClock):
    """The current device stream's clock, read on the host's: a mark is an event
    recorded on the stream now; `seconds` reads it after `settle` (an event not yet
    reached cannot be read). A mark may also be a host time (a float: when the host saw
    a Work complete), which reads as itself."""

    completes_at_launch = True  # NCCL: the Future completes when the op is queued

    def __init__(self, clock=time.perf_counter):
        super().__init__(clock)
        self._base = None
        self._base_s = 0.0

    def start(self) -> None:
        """Line the clocks up: wait for the device, record the base event, read the host."""
        import torch

        torch.cuda.synchronize()
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        self._base.synchronize()
        self._base_s = self.clock()

    def mark(self):
        import torch

        if self._base is None:
            self.start()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        import torch

        torch.cuda.synchronize()

    def seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        return self._base_s + self._base.elapsed_time(mark) / 1e3  # ms after the base


def step_clock(backend: str, clock=time.perf_counter) -> HostClock:
    """The clock that times a step's work on ``backend``'s device: the device's stream
    under NCCL, the host's otherwise."""
    return DeviceClock(clock) if backend == "nccl" else HostClock(clock)


def clock_for_device(device_type: str) -> HostClock:
    """`step_clock` for work on a torch device type: the host's for the CPU, the
    device stream's for any other."""
    return HostClock() if device_type == "cpu" else DeviceClock()


def clock_offset(group=None, rounds: int = 8) -> float:
    """This rank's ``time.perf_counter()`` minus that of rank 0 of ``group``.

    Processes of one machine share its monotonic clock (perf_counter), so the
    offset is exactly 0 there; across machines it is estimated with
    ``cristian_offset``. Collective over ``group``; lets spans measured in
    different processes share one time axis.
    """
    import torch.distributed as dist

    machines: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, _machine_id(), group=group)
    if len(set(machines)) == 1:
        return 0.0
    return cristian_offset(group, rounds)[0]


def cristian_offset(group=None, rounds: int = 8) -> tuple[float, float]:
    """(clock offset to rank 0 of ``group``, round trip it was measured with).

    Cristian's algorithm: rank 0 pings every peer ``rounds`` times and keeps
    the estimate of the fastest round trip; its error is at most half that
    round trip. Rank 0 itself gets (0.0, 0.0). Collective over ``group``.
    """
    import time

    import torch
    import torch.distributed as dist

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    me, size = dist.get_rank(group), dist.get_world_size(group)
    buf = torch.zeros(2, dtype=torch.float64)
    result = (0.0, 0.0)
    for peer in range(1, size):
        if me == 0:
            best = (float("inf"), 0.0)
            for _ in range(rounds):
                t1 = time.perf_counter()
                dist.send(buf, dst=global_rank(peer), group=group)
                dist.recv(buf, src=global_rank(peer), group=group)
                t2 = time.perf_counter()
                best = min(best, (t2 - t1, buf[0].item() - (t1 + t2) / 2))
            buf[0], buf[1] = best[1], best[0]
            dist.send(buf, dst=global_rank(peer), group=group)
        elif me == peer:
            for _ in range(rounds):
                dist.recv(buf, src=global_rank(0), group=group)
                buf[0] = time.perf_counter()
                dist.send(buf, dst=global_rank(0), group=group)
            dist.recv(buf, src=global_rank(0), group=group)
            result = (buf[0].item(), buf[1].item())
    return result


def _machine_id() -> str:
    """Identifies one booted kernel: processes with equal ids share CLOCK_MONOTONIC."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()
