"""The timings' verdict: what a host did over a run's steps decides whether its time
figures are trusted (no pool: the rules on numbers, and this process's own clocks)."""

from __future__ import annotations

import time

from nbpar.measure import machine


def rank(host="h", cores=2, threads=1, wall=10.0, cpu=9.0, busy=18.6):
    return dict(host=host, cores=cores, threads=threads, wall_s=wall, cpu_s=cpu, host_busy_s=busy)


def test_engines_alone_on_their_cores_are_reliable():
    ok, note = machine.timing_verdict([rank(), rank()], spread=0.05)
    assert ok
    assert note == (
        "timings reliable here: other processes took 3% of the cores, step times within 5% "
        "of their median; memory and bytes are exact"
    )


def test_other_processes_on_the_cores_make_timings_unreliable():
    # the host was busy 19 of its 20 core-seconds; the engines had 10 of them
    ok, note = machine.timing_verdict([rank(cpu=5.0, busy=19.0), rank(cpu=5.0, busy=19.0)], 0.1)
    assert not ok
    assert note == (
        "timings unreliable: other processes took 45% of the 2 cores; memory and bytes are exact"
    )


def test_oversubscribed_threads_and_a_wide_spread_are_both_said():
    ok, note = machine.timing_verdict([rank(threads=2), rank(threads=2)], spread=0.6)
    assert not ok
    assert "2 engines x 2 threads shared 2 cores" in note
    assert "step times spread 60% around their median" in note


def test_hosts_are_judged_apart():
    """Two hosts of 2 cores, one engine each: neither oversubscribed, busy counted per host."""
    quiet = [rank(host="a", cpu=9.0, busy=9.5), rank(host="b", cpu=9.0, busy=9.5)]
    assert machine.timing_verdict(quiet, None)[0]
    loud = [rank(host="a", cpu=9.0, busy=9.5), rank(host="b", cpu=4.0, busy=19.0)]
    ok, note = machine.timing_verdict(loud, None)
    assert not ok and "other processes took 75% of the 2 cores" in note


def test_step_spread_needs_enough_steps_and_reads_the_quartiles():
    assert machine.step_spread([1.0, 1.0, 1.0, 1.0]) is None
    assert machine.step_spread([1.0] * 8) == 0.0
    # quartiles 1 and 2 around a median of 1.5
    assert machine.step_spread([1.0, 1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0]) == 1 / 1.5


def test_usage_reads_this_process_and_the_host():
    start = machine.snapshot()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # 0.2 s of this process's own CPU, however busy
        pass
    u = machine.usage(start, threads=1)
    assert 0.15 < u["wall_s"] < 30
    assert 0.15 < u["cpu_s"] <= u["wall_s"] + 0.05
    assert u["host_busy_s"] >= u["cpu_s"] - 0.05  # the host was busy at least with us
    assert u["cores"] >= 1 and u["threads"] == 1 and u["host"]
