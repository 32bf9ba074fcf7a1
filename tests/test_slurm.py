"""Pools through a real Slurm: a private one-node cluster (`tests/slurm_cluster.py`).

The engines are tasks of a real Slurm job: sbatch submits it, srun starts them,
scancel ends them. Skipped, saying why, without root or without Slurm installed.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import socket
import subprocess
import time

import pytest
import torch

import nbpar
from nbpar.errors import EngineDied
from tests.distributed import children
from tests.slurm_cluster import LocalSlurm, missing

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    cluster = LocalSlurm(folder)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()  # daemons by pid, whatever happened
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_pool(slurm):
    pool = nbpar.Pool(2, launcher="slurm", replace=False, start_timeout=90)
    yield pool
    pool.shutdown()


def _job_of(pool) -> str:
    (engines,) = [s for s in pool.cluster.engines.values() if s.job_id]
    return engines.job_id


def test_a_dist_cell_all_reduces_on_engines_slurm_started(slurm, slurm_pool, ip, capsys):
    job = _job_of(slurm_pool)
    assert any(line.startswith(f"{job} RUNNING ipengine-") for line in slurm.jobs())
    running = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%D %C"], capture_output=True, text=True
    ).stdout.split()
    assert running == ["1", "2"]  # one node, a CPU per engine task
    slurm_pool.activate()
    ip.run_cell_magic(
        "dist",
        "",
        "import os, torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
        "print(t.item(), os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID'])",
    )
    out = capsys.readouterr().out.splitlines()
    got = sorted(line.split()[2:] for line in out)
    assert [line.split()[2] for line in out] == ["3.0", "3.0"]
    assert sorted(g[1:] for g in got) == [[job, "0"], [job, "1"]]  # two tasks of one job
    assert [r["host"] for r in slurm_pool.status()] == [socket.gethostname()] * 2


def test_training_through_slurm_equals_single(slurm_pool):
    common = dict(model="simple_cnn", steps=20, seed=3)
    ddp = slurm_pool.train(nbpar.TrainConfig(strategy="ddp", micro_batch=4, **common)).result()
    single = slurm_pool.train(
        nbpar.TrainConfig(strategy="single", micro_batch=8, **common)
    ).result()
    torch.testing.assert_close(
        torch.tensor(ddp["losses"]), torch.tensor(single["losses"]), atol=1e-5, rtol=0
    )


def test_a_killed_job_step_is_engine_died_and_restart_submits_a_new_job(slurm, slurm_pool):
    old = _job_of(slurm_pool)
    res = slurm_pool.execute("import time\nprint('up')")
    assert res.text() == "[rank 0] up\n[rank 1] up"
    # the step srun started: its tasks are the engines
    subprocess.run(["scancel", "--signal=KILL", f"{old}.0"], check=True, timeout=10)
    with pytest.raises(EngineDied, match=r"rank"):
        for _ in range(100):  # the controller notices within its heartbeat period
            slurm_pool.execute("print(1)", timeout=30)
            time.sleep(0.2)
    slurm_pool.restart()
    new = _job_of(slurm_pool)
    assert new != old
    res = slurm_pool.execute(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t); print(t.item())"
    )
    assert res.text() == "[rank 0] 3.0\n[rank 1] 3.0"
    assert not any(line.startswith(f"{old} ") and "RUNNING" in line for line in slurm.jobs())


def test_options_reach_the_job_and_shutdown_leaves_no_job(slurm):
    pool = nbpar.Pool(
        2,
        launcher="slurm",
        replace=False,
        start_timeout=90,
        slurm={
            "partition": slurm.partition,
            "time": "0:30:00",
            "extra": ['--comment="nbpar check"', "--nice=5"],
        },
    )
    try:
        job = _job_of(pool)
        seen = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%P|%l|%k|%y"], capture_output=True, text=True
        ).stdout.strip()
        assert seen == f"{slurm.partition}|30:00|nbpar check|5"
        script = pool.cluster.config.SlurmEngineSetLauncher.batch_file_name
        assert script.startswith(pool.cluster.profile_dir)  # not in the notebook's folder
        assert "#SBATCH --time=0:30:00" in pathlib.Path(script).read_text()
        assert not pathlib.Path("slurm_engine.sbatch").exists()
    finally:
        pool.shutdown()
    assert slurm.wait_no_jobs(job=job) == []  # cancelled and gone, not queued or running


@pytest.mark.parametrize(
    "options, said",
    [
        (
            {"partition": "nosuch"},
            r"Slurm would not take the engines' job of 2 task\(s\): "
            r"invalid partition specified: nosuch",
        ),
        ({"time": "120"}, r"would not take.*time limit"),  # over the partition's 60 min
        ({"extra": ["--nodes=3"]}, r"would not take.*Node count specification invalid"),
        ({"extra": ["--no-such-option"]}, r"would not take.*unrecognized option"),
        ({"time": "2h"}, r"slurm time '2h' is not a Slurm time limit"),
        ({"partiton": "gpu"}, r"unknown slurm option\(s\) 'partiton': known are partition"),
        ({"extra": ["--ntasks=4"]}, r"the pool sets --ntasks"),
        ({"extra": ["-p gpu"]}, r"pass it as slurm=\{'partition': \.\.\.\}"),
    ],
)
def test_a_bad_option_is_one_line_before_anything_starts(slurm, options, said):
    before, queued = children(), slurm.jobs()
    with pytest.raises(ValueError, match=said) as err:
        nbpar.Pool(2, launcher="slurm", replace=False, start_timeout=30, slurm=options)
    assert "\n" not in str(err.value)
    assert children() <= before  # no controller, no engine
    assert slurm.jobs() == queued  # nothing submitted


def test_a_job_slurm_holds_back_says_so_at_the_start_timeout(slurm):
    with pytest.raises(TimeoutError, match=r"Slurm job (\d+) is PENDING \(BeginTime\)") as err:
        nbpar.Pool(
            2,
            launcher="slurm",
            replace=False,
            start_timeout=4,
            slurm={"extra": ["--begin=now+1hour"]},
        )
    job = re.search(r"Slurm job (\d+)", str(err.value)).group(1)
    assert slurm.wait_no_jobs(job=job) == []  # the queued job was cancelled
