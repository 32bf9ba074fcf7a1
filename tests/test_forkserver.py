"""Local engines forked from one warm process: who their parent is, that each still
has a working nanny (signals relayed, its death reported at once), that the server
goes with the pool, and the way back to one process per engine."""

from __future__ import annotations

import os
import signal
import time
from functools import partialmethod

import psutil
import pytest

import nbpar
from nbpar.errors import PoolError
from nbpar.pool import forked
from nbpar.pool.controller import handle_pong, start_fast
from nbpar.pool.forked import ForkServer
from nbpar.pool.forkserver import ENGINE_NAME, NANNY_NAME, SERVER_NAME, is_engine

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not forked.usable("local"), reason="engines are forked on Linux only"),
]


def test_engines_are_forked_by_the_pools_server_each_with_its_nanny(pool):
    server = psutil.Process(pool._forkserver.pid)
    assert server.name() == SERVER_NAME
    assert server.ppid() == os.getpid()  # the kernel's child: it goes when the kernel goes
    for e in pool.engines:
        engine = psutil.Process(e["pid"])
        assert engine.ppid() == server.pid and engine.name() == ENGINE_NAME
        assert is_engine(engine)
        nannies = [p for p in engine.children() if p.name() == NANNY_NAME]
        assert len(nannies) == 1, engine.children()
    assert pool._forkserver.torch_error is None


def test_forked_engines_run_torch_on_several_threads(pool):
    # OpenMP is not started before the fork: each engine starts its own thread pool
    res = pool.execute(
        "import torch\ntorch.set_num_threads(2)\n"
        "a = torch.arange(256 * 256, dtype=torch.float64).reshape(256, 256) % 7\n"
        "print(torch.get_num_threads(), int((a @ a).sum().item()))"
    )
    import torch

    a = torch.arange(256 * 256, dtype=torch.float64).reshape(256, 256) % 7
    want = int((a @ a).sum().item())
    assert res.text() == f"[rank 0] 2 {want}\n[rank 1] 2 {want}"


def test_the_nanny_relays_a_signal_sent_through_the_controller(pool):
    # ipyparallel's remote signal goes to an engine's nanny, which signals the engine
    ar = pool.client[pool.engine_id(1)].execute("import time\ntime.sleep(30)", block=False)
    time.sleep(0.5)
    pool.client.send_signal(signal.SIGINT, targets=pool.engine_id(1), block=True)
    assert ar.wait(10), "the engine did not stop"
    with pytest.raises(Exception, match="KeyboardInterrupt"):
        ar.get()


def test_a_killed_engine_is_reported_by_its_nanny_not_after_heartbeats():
    with nbpar.Pool(2, replace=False) as pool:
        eid = pool.engine_id(1)
        os.kill(pool.engines[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 5  # heartbeats alone would take 10 s
        while eid in pool.client.ids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eid not in pool.client.ids
        assert pool.dead_ranks() == [1]
        pool.restart()  # fresh engines from the same warm server
        assert len({e["pid"] for e in pool.engines}) == 2
        assert all(psutil.Process(e["pid"]).ppid() == pool._forkserver.pid for e in pool.engines)
        res = pool.execute("import torch.distributed as dist\ndist.get_world_size()")
        assert [res.results[r]["text/plain"] for r in (0, 1)] == ["2", "2"]
        server = pool._forkserver.proc
    assert server.poll() is not None  # the pool's shutdown stopped its server


def test_the_pool_env_reaches_forked_engines_and_the_switch_turns_forking_off(monkeypatch):
    monkeypatch.setenv(forked.SWITCH, "0")
    with nbpar.Pool(2, replace=False, env={"NBPAR_TEST_MARK": "seen"}) as pool:
        assert pool._forkserver is None
        for e in pool.engines:
            assert "nbpar.pool.engine" in " ".join(psutil.Process(e["pid"]).cmdline())
        res = pool.execute("import os\nos.environ['NBPAR_TEST_MARK']")
        assert [res.results[r]["text/plain"] for r in (0, 1)] == ["'seen'"] * 2


@pytest.mark.spawn  # the server is a process
def test_a_server_that_is_gone_says_so():
    server = ForkServer({})
    try:
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(PoolError, match="fork server exited"):
            server.fork(["--help"], dict(os.environ), os.getcwd(), os.devnull, timeout=10)
    finally:
        server.close()


def test_forking_is_for_local_engines_on_linux_only(monkeypatch):
    assert forked.usable("local") and forked.usable("Local")
    assert not forked.usable("mpi") and not forked.usable("ssh")
    monkeypatch.setattr(forked.sys, "platform", "darwin")
    assert not forked.usable("local")


class _Monitor:
    """The part of ipyparallel's HeartMonitor that `handle_pong` touches."""

    def __init__(self, hearts):
        self.hearts, self.responses, self.told = set(hearts), set(), []

    def _pong(self, msg):
        self.responses.add(msg[0])

    def handle_new_hearts(self, hearts):
        self.told.append(set(hearts))
        self.hearts |= set(hearts)

    handle_pong = partialmethod(handle_pong, _pong=_pong)


def test_a_new_heart_is_registered_at_its_first_answer():
    monitor = _Monitor(hearts={b"old"})
    monitor.handle_pong([b"old", b"1.0"])
    assert monitor.told == []  # a known heart: nothing new
    monitor.handle_pong([b"new", b"1.0"])
    assert monitor.told == [{b"new"}]
    monitor.handle_pong([b"new", b"1.2"])
    assert monitor.told == [{b"new"}]  # told once


class _Beating:
    """A heart monitor's beat, start and pong, as `start_fast` and `handle_pong` use them."""

    period, max_heartmonitor_misses = 200, 50  # nbpar's: 10 s of silence

    def __init__(self):
        self.beats, self.on_probation = [], {b"slow": 8}
        self.hearts, self.responses = set(), set()

    def beat(self):
        self.beats.append(self.period)

    def _start(self):  # as HeartMonitor.start makes its caller
        from tornado import ioloop

        self.caller = ioloop.PeriodicCallback(self.beat, self.period)
        self.caller.start()

    def _pong(self, msg):
        self.responses.add(msg[0])

    def handle_new_hearts(self, hearts):
        self.hearts |= set(hearts)

    start = partialmethod(start_fast, _start=_start)
    handle_pong = partialmethod(handle_pong, _pong=_pong)


def _beat_for(seconds: float, new_heart_at: float | None = None) -> _Beating:
    import asyncio

    async def run():
        monitor = _Beating()
        monitor.start()
        assert (monitor.period, monitor.max_heartmonitor_misses) == (50, 200)  # still 10 s
        if new_heart_at is not None:
            await asyncio.sleep(new_heart_at)
            monitor.handle_pong([b"engine", b"1.0"])
        await asyncio.sleep(seconds - (new_heart_at or 0))
        monitor.caller.stop()
        return monitor

    return asyncio.run(run())


def test_the_heart_monitor_beats_fast_while_engines_register_then_at_its_period(monkeypatch):
    from nbpar.pool import controller

    monkeypatch.setattr(controller, "QUIET_S", 0.4)
    monkeypatch.setattr(controller, "FAST_FOR_S", 5.0)
    monitor = _beat_for(1.4, new_heart_at=0.2)  # quiet from 0.2 s: slow from ~0.6-0.7 s
    fast, slow = monitor.beats.count(50), monitor.beats.count(200)
    # fast, then slow; a busy machine only beats less often, never more (28 fast: no end)
    assert monitor.beats == sorted(monitor.beats) and 4 <= fast <= 15 and slow >= 1, monitor.beats
    assert (monitor.period, monitor.max_heartmonitor_misses) == (200, 50)
    assert monitor.on_probation == {b"slow": 2}  # 8 fast misses are 2 slow ones
    assert monitor.hearts == {b"engine"}


def test_with_no_engine_the_fast_beat_still_ends(monkeypatch):
    from nbpar.pool import controller

    monkeypatch.setattr(controller, "FAST_FOR_S", 0.5)
    monitor = _beat_for(1.2)
    assert monitor.beats == sorted(monitor.beats), monitor.beats
    assert monitor.beats.count(50) <= 11 and monitor.beats.count(200) >= 1, monitor.beats
