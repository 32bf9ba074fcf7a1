"""Faults injected for real: a killed engine, a hung collective, an interrupt."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nbpar.errors import DistTimeout, EngineDied

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt here, as in a kernel (a shell that runs the tests
    as a background job makes them ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _allreduce_ok(pool) -> float:
    res = pool.execute(
        "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    return float(res.results[0]["text/plain"])


def test_killed_engine_gives_a_clear_error_fast_and_restart_recovers(pool):
    victim = pool.engines[1]["pid"]
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    t = time.monotonic()
    with pytest.raises(EngineDied, match=r"rank\(s\) \[1\] died") as info:
        pool.execute(
            "import time, torch, torch.distributed as dist\n"
            "for _ in range(100):\n    dist.all_reduce(torch.ones(1))\n"
            "    time.sleep(0.1)"
        )
    assert time.monotonic() - t < 10
    assert info.value.ranks == [1]
    assert pool.status()[1]["state"] == "dead"
    pool.restart()
    assert [r["state"] for r in pool.status()] == ["ready", "ready"]
    assert _allreduce_ok(pool) == 2.0


def test_hung_collective_times_out_then_pool_is_usable_after_restart(pool):
    t = time.monotonic()
    with pytest.raises(DistTimeout, match=r"\[0\] did not finish within 3 s"):
        pool.execute(
            "import torch, torch.distributed as dist\n"
            "if dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))",
            timeout=3,
        )
    assert time.monotonic() - t < 8
    pool.restart()
    assert _allreduce_ok(pool) == 2.0


def test_interrupt_stops_a_long_cell_and_keeps_the_pool(pool, sigint_raises):
    # what the notebook's interrupt button does: SIGINT to the kernel while it waits
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        pool.execute("import time\nfor _ in range(600):\n    time.sleep(0.05)")
    assert time.monotonic() - t < 8
    # shown as one line that says what the ranks were told, not threading.py's frames
    assert info.value._render_traceback_() == [
        "Interrupted: rank(s) [0, 1] were sent the interrupt (SIGINT)"
    ]
    assert [r["state"] for r in pool.status()] == ["ready", "ready"]
    assert _allreduce_ok(pool) == 2.0


def test_interrupt_of_a_hung_collective_returns_within_2_s_with_the_diagnosis(
    pool, sigint_raises, capsys
):
    import torch.distributed  # noqa: F401  # as in a kernel where a cell has run a while

    fired = {}

    def interrupt_kernel():
        fired["t"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    # rank 0 never calls the all_reduce that rank 1 waits in; SIGINT cannot end that wait
    threading.Timer(1.5, interrupt_kernel).start()
    with pytest.raises(KeyboardInterrupt) as info:
        pool.execute(
            "import torch, torch.distributed as dist\n"
            "if dist.get_rank() != 0:\n    dist.all_reduce(torch.ones(1))"
        )
    took = time.monotonic() - fired["t"]
    assert took < 2.0, f"the interrupt returned after {took:.2f} s"
    assert info.value._render_traceback_() == [
        "Interrupted: rank(s) [1] were sent the interrupt (SIGINT)"
    ]
    said = capsys.readouterr().err
    assert "nbpar: rank(s) [1] did not stop" in said
    assert "rank 0 is not in a collective" in said
    assert "rank 1 waits in all_reduce" in said and "cell line 3" in said
    assert pool.busy_ranks() == [1]
    pool.restart()
    assert not pool.busy_ranks()
    assert _allreduce_ok(pool) == 2.0


def test_no_engine_outlives_a_killed_kernel(tmp_path):
    """The kernel that made the pool dies without any cleanup: its engines exit too."""
    import subprocess
    import sys

    import psutil

    script = (
        "import os, signal, sys, nbpar\n"
        "pool = nbpar.Pool(2, replace=False)\n"
        "print(' '.join(str(e['pid']) for e in pool.engines), flush=True)\n"
        "print(pool.cluster.controller.process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    lines = out.stdout.split("\n")
    pids = [int(p) for p in lines[0].split()] + [int(lines[1])]
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"engines/controller outlived their kernel: {alive}"


def test_interrupt_during_train_stops_every_rank_at_a_step_boundary(pool, sigint_raises):
    import nbpar

    run = pool.train(
        nbpar.TrainConfig(model="tiny_gpt", strategy="ddp", micro_batch=4, steps=100_000)
    )
    while len(run.history) < 4:
        time.sleep(0.1)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        run.wait()
    assert run.done()
    res = run.per_rank()
    assert len(res[0]["losses"]) == len(res[1]["losses"]) < 100_000
    assert [r["state"] for r in pool.status()] == ["ready", "ready"]
    assert _allreduce_ok(pool) == 2.0


def test_restart_auto_brings_the_pool_back_after_an_engine_dies():
    import nbpar

    with pytest.raises(ValueError, match="restart must be None or 'auto'"):
        nbpar.Pool(1, restart="sometimes")
    with nbpar.Pool(2, restart="auto", replace=False) as auto:
        victim = auto.engines[0]["pid"]
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(EngineDied, match="restarted"):
            auto.execute(
                "import time, torch, torch.distributed as dist\n"
                "for _ in range(200):\n    dist.all_reduce(torch.ones(1))\n"
                "    time.sleep(0.05)"
            )
        assert victim not in [e["pid"] for e in auto.engines]
        assert [r["state"] for r in auto.status()] == ["ready", "ready"]
        assert _allreduce_ok(auto) == 2.0
