"""The step's meters time work with the clock of the device it runs on
(`nbpar.measure.clocks`). On a CPU the host's clock is the work's; on a GPU the host only
queues work, and NCCL's Futures complete when an op is queued. Those paths are tested
here on the CPU with stand-ins: a Work whose Future completes before the work does, and
a clock whose marks can be read only once the step's work is settled."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nbpar.measure.clocks import DeviceClock, HostClock, clock_for_device, step_clock
from nbpar.measure.comm import CommMeter
from nbpar.measure.metrics import CommTimer
from nbpar.parallel.pipeline_timeline import read_spans

WORK_S = 0.06  # how long the stand-in collective runs after its Future completed


class EarlyFutureWork:
    """A collective as NCCL's looks to the host: its Future completes at once (when
    the op is queued), ``is_completed()`` only once the device finished it."""

    def __init__(self, seconds: float = WORK_S):
        self._done_at = time.perf_counter() + seconds

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._done_at

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class QueuedClock(HostClock):
    """A device clock on the CPU: a mark is a token; it reads as the host time it was
    taken plus ``lag`` (the device running behind the host), and only after `settle`
    (reading it earlier raises, as reading an unreached CUDA event would)."""

    completes_at_launch = True

    def __init__(self, lag: float = 0.5):
        super().__init__()
        self.lag, self.taken, self.settled, self.starts = lag, [], False, 0

    def start(self) -> None:
        self.starts += 1
        self.settled = False

    def mark(self):
        self.taken.append(self.clock())
        return ("mark", len(self.taken) - 1)

    def settle(self) -> None:
        self.settled = True

    def seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        assert self.settled, "a mark was read before the step's work was settled"
        return self.taken[mark[1]] + self.lag


def _watched(meter: CommMeter, work) -> list:
    """An op's interval, launched now and ended when ``meter`` says ``work`` is done."""
    interval = [meter.marks.mark(), None]
    meter._flight.append(interval)
    meter.watch(work, interval)
    return interval


def test_each_backend_gets_its_devices_clock():
    assert type(step_clock("gloo")) is HostClock and not step_clock("gloo").completes_at_launch
    nccl = step_clock("nccl")
    assert isinstance(nccl, DeviceClock) and nccl.completes_at_launch
    assert type(clock_for_device("cpu")) is HostClock
    assert isinstance(clock_for_device("meta"), DeviceClock)  # built without a device call
    host = HostClock(clock=lambda: 7.0)
    assert host.mark() == 7.0 and host.seconds(host.mark()) == 7.0
    assert DeviceClock().seconds(3.5) == 3.5  # a host time (a Work seen done) reads as itself


def test_a_future_that_completes_at_launch_is_not_trusted_where_it_does():
    """On the host's clock a Work's Future ends its interval (gloo completes it with the
    op). On a device clock the Future completes when the op is queued: the meter asks
    the Work instead, and the interval lasts as long as the work."""
    with CommMeter() as host:
        trusted = _watched(host, EarlyFutureWork())
        time.sleep(WORK_S * 1.5)
    assert trusted[1] - trusted[0] < WORK_S / 2  # the Future's word: at once
    clock = QueuedClock(lag=0.0)
    with CommMeter(marks=clock) as device:
        asked = _watched(device, EarlyFutureWork())
        time.sleep(WORK_S * 1.5)
    assert asked[1] - asked[0] >= WORK_S  # polled until is_completed()
    assert device.comm_s() >= WORK_S and clock.starts == 1


def test_marks_are_read_once_the_step_settled_and_on_the_device_time():
    """Compute ops and collectives are marked while the step runs and read after it:
    with the device 0.5 s behind the host, every interval is where the device ran it."""
    clock = QueuedClock(lag=0.5)
    with CommMeter(marks=clock) as meter:
        opened = time.perf_counter()
        torch.ones(4) + 1  # a compute op, through the meter
        op = _watched(meter, None)  # an op without a Work: done when it returned
    assert clock.settled and meter._compute
    (a, b), *_ = meter._compute
    assert a >= opened + 0.5 and b >= a  # read as device times, not launch times
    assert op[0] >= opened + 0.5 and op[1] >= op[0]


def test_the_hooks_timer_reads_its_marks_after_the_step():
    """`CommTimer` (the DDP hook's every-step figure) ends an async collective in the
    Future's callback: on a GPU that mark is an event CUDA orders after the collective,
    read once the step synchronized."""
    clock = QueuedClock(lag=0.05)
    timer = CommTimer(marks=clock)
    timer.start_step()
    fut = torch.futures.Future()
    chained = timer.watch(fut)
    threading.Timer(0.04, lambda: fut.set_result(3)).start()
    assert chained.wait() == 3
    time.sleep(0.1)  # the step ends once the device is done (it synchronizes)
    timer.end_step()
    with pytest.raises(AssertionError, match="before the step's work was settled"):
        timer.comm_s()
    clock.settle()
    between = clock.taken[1] - clock.taken[0]  # launch to the Future's callback, >= 40 ms
    assert between >= 0.04 and timer.comm_s() == pytest.approx(between)


def test_pipeline_spans_read_as_seconds_on_rank_0s_clock():
    clock = QueuedClock(lag=0.1)
    spans = [dict(stage=0, microbatch=0, kind="F", start=clock.mark(), end=clock.mark())]
    clock.settle()
    read_spans(spans, clock, offset=2.0)
    (span,) = spans
    assert span["start"] == pytest.approx(clock.taken[0] + 0.1 - 2.0)
    assert span["end"] == pytest.approx(clock.taken[1] + 0.1 - 2.0)
