"""The blocked clock (`nbpar.measure.blocked`): seconds the training thread neither ran nor
waited for a core. A thread that sleeps or waits on another thread is blocked; one that
computes is not, however busy the cores are."""

import threading
import time

import pytest

from nbpar.measure.blocked import BlockedClock


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def test_a_waiting_thread_is_blocked_and_a_computing_one_is_not():
    clock = BlockedClock()
    clock.start()
    time.sleep(0.05)
    slept = clock.stop()
    clock.start()
    _spin(0.05)
    spun = clock.stop()
    assert slept == pytest.approx(0.05, abs=0.01)
    assert abs(spun) < 0.005, clock.method


def test_waiting_for_another_thread_counts_as_blocked():
    """What a step does when it waits for a collective: another thread (the backend's
    worker) does the work while this one waits on it."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (time.sleep(0.04), done.set()))
    clock = BlockedClock()
    clock.start()
    worker.start()
    _spin(0.02)  # compute that hides half of the wait
    done.wait()
    blocked = clock.stop()
    worker.join()
    assert blocked == pytest.approx(0.02, abs=0.01)


def test_stop_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="before start"):
        BlockedClock().stop()


def test_a_clock_made_on_one_thread_times_the_thread_that_starts_it():
    clock = BlockedClock()
    out = {}

    def on_other():
        clock.start()
        time.sleep(0.03)
        out["blocked"] = clock.stop()
        out["tid"] = threading.get_native_id()

    t = threading.Thread(target=on_other)
    t.start()
    t.join()
    assert clock.tid == out["tid"]
    assert out["blocked"] == pytest.approx(0.03, abs=0.01)


def test_normal_steps_leave_out_set_up_and_metered_steps():
    from nbpar.measure.step_split import SETUP_STEPS, blocked_shares, normal_step_times

    records = [
        {
            "step": i,
            "step_time_s": 0.1 * (i + 1),
            "comm_blocked_s": 0.01 * (i + 1),
            "comm_metered": i == 3,
        }
        for i in range(6)
    ]
    assert SETUP_STEPS == 2
    assert normal_step_times(records) == [0.1 * 3, 0.1 * 5, 0.1 * 6]  # steps 2, 4, 5
    assert blocked_shares(records) == pytest.approx([0.1, 0.1, 0.1])
    records[4]["comm_blocked_s"] = None  # a step without the clock counts as normal, no share
    assert len(normal_step_times(records)) == 3 and len(blocked_shares(records)) == 2
