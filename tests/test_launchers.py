"""Launchers: a real MPI pool, clear errors before anything starts, env on engines, gpu_check."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import nbpar
from nbpar import device
from nbpar.pool import launchers
from tests.distributed import children

ROOT = pathlib.Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
MPI_MISSING = shutil.which("mpiexec") is None or launchers.find_spec("mpi4py") is None


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    MPI_MISSING,
    reason="MPI not installed: run `sh scripts/install_mpi.sh .venv/bin/python` (OpenMPI + mpi4py)",
)
def test_mpi_pool_ranks_are_mpi_ranks_and_restart_keeps_them():
    pool = nbpar.Pool(2, launcher="mpi", replace=False, start_timeout=120)
    try:
        assert pool.launcher == "mpi" and pool._engine_ids == [0, 1]
        res = pool.execute(
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
            "print(t.item(), mpi_rank, mpi_size)"
        )
        assert res.text() == "[rank 0] 3.0 0 2\n[rank 1] 3.0 1 2"
        if os.geteuid() == 0:
            assert pool.run(lambda: __import__("os").environ.get("OMPI_ALLOW_RUN_AS_ROOT")) == [
                "1",
                "1",
            ]
        old = [e["pid"] for e in pool.engines]
        pool.restart()  # MPI engines ask for their rank as id again: ids 0, 1 come back
        assert pool._engine_ids == [0, 1]
        assert not set(old) & {e["pid"] for e in pool.engines}
        assert pool.run(lambda: __import__("torch.distributed").distributed.get_rank()) == [0, 1]
    finally:
        pool.shutdown()


def test_mpi_without_mpiexec_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no mpiexec, no sbatch
    before = children()
    with pytest.raises(
        ValueError,
        match=r"launcher='mpi' needs `mpiexec`.*apt-get install "
        r"openmpi-bin.*pip install mpi4py",
    ):
        nbpar.Pool(2, launcher="mpi")
    assert children() <= before


def test_mpi_without_mpi4py_names_the_fix(monkeypatch, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    real = launchers.find_spec
    monkeypatch.setattr(
        launchers, "find_spec", lambda name: None if name == "mpi4py" else real(name)
    )
    with pytest.raises(ValueError, match=r"needs mpi4py.*-m pip install mpi4py"):
        nbpar.Pool(2, launcher="mpi")


@pytest.mark.parametrize(
    "launcher, tool, fix",
    [
        ("slurm", "sbatch", "Slurm cluster.*Pool.connect"),
        ("ssh", "ssh", "ssh client"),
        ("pbs", "qsub", "PBS"),
    ],
)
def test_batch_launcher_outside_its_cluster_fails_before_starting(
    monkeypatch, tmp_path, launcher, tool, fix
):
    monkeypatch.setenv("PATH", str(tmp_path))
    before = children()
    with pytest.raises(ValueError, match=rf"launcher='{launcher}' needs `{tool}`.*{fix}"):
        nbpar.Pool(16, launcher=launcher)
    assert children() <= before


def _slurm_script(cfg, backend: str = "gloo", n: int = 4, env=None, slurm=None) -> tuple[str, dict]:
    """The engine batch script a Slurm pool of ``n`` would submit, and its engines' env."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, engines="slurm", config=cfg, log_level=40)
    launchers.configure(cluster, "slurm", n, env or {}, backend, slurm)
    es = cluster.engine_launcher_class(
        parent=cluster, profile_dir=str(ROOT / ".tmp"), cluster_id="t", n=n
    )
    es.n = n
    es.write_batch_script(n)
    script = pathlib.Path(es.batch_file).read_text()
    os.unlink(es.batch_file)
    return script, es.get_env()


def test_launcher_options_reach_ipyparallel():
    """Slurm options in config= survive, and the batch script runs nbpar's engine."""
    from traitlets.config import Config

    cfg = Config()
    cfg.SlurmLauncher.account = "proj42"
    cfg.SlurmEngineSetLauncher.batch_template = (
        "#!/bin/sh\n#SBATCH --account={account}\n#SBATCH --ntasks={n}\nsrun {program_and_args}\n"
    )
    script, env = _slurm_script(cfg, n=16, env={"NCCL_IB_DISABLE": "1"})
    assert "--account=proj42" in script and "--ntasks=16" in script
    assert f"{sys.executable} -m nbpar.pool.engine" in script
    assert env["NCCL_IB_DISABLE"] == "1"


def test_a_gpu_pool_on_slurm_asks_for_one_gpu_per_engine_task():
    """ipyparallel's Slurm script asks for no GPU; an nccl pool's asks for one per task
    (each task then sees its GPU as device 0), a gloo pool's for none, and a batch
    script of the user's own is kept as written."""
    from traitlets.config import Config

    gpu, _ = _slurm_script(Config(), "nccl")
    assert "#SBATCH --gpus-per-task=1" in gpu and "#SBATCH --ntasks=4" in gpu
    assert gpu.startswith("#!/bin/sh\n") and f"{sys.executable} -m nbpar.pool.engine" in gpu
    assert "gpus" not in _slurm_script(Config(), "gloo")[0]
    cfg = Config()
    cfg.SlurmEngineSetLauncher.batch_template = (
        "#!/bin/sh\n#SBATCH --gres=gpu:4\nsrun {program_and_args}\n"
    )
    theirs, _ = _slurm_script(cfg, "nccl")
    assert "--gres=gpu:4" in theirs and "gpus-per-task" not in theirs


def test_slurm_options_become_sbatch_lines_and_config_still_counts():
    """slurm= options and ipyparallel's own SlurmLauncher settings in config= both reach
    the script nbpar writes (slurm= wins), each once, with the engine tasks' lines."""
    from traitlets.config import Config

    cfg = Config()
    cfg.SlurmLauncher.account = "from_config"
    cfg.SlurmLauncher.queue = "short"
    options = {"partition": "gpu", "time": "1-00:00:00", "qos": "high"}
    extra = ["--nodes=2", "#SBATCH --exclusive", "--comment={braces kept}"]
    script, _ = _slurm_script(cfg, "nccl", n=16, slurm={**options, "extra": extra})
    lines = [x for x in script.splitlines() if x.startswith("#SBATCH")]
    assert lines == [
        "#SBATCH --ntasks=16",
        f"#SBATCH --output={lines[1].split('=', 1)[1]}",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --account=from_config",
        "#SBATCH --qos=high",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --nodes=2",
        "#SBATCH --exclusive",
        "#SBATCH --comment={braces kept}",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-t",
    ]
    assert f"srun {sys.executable} -m nbpar.pool.engine" in script


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (dict(launcher="local", slurm={"partition": "gpu"}), r"slurm= options are for launcher"),
        (dict(launcher="slurm", slurm=["gpu"]), r"slurm= must be a dict"),
        (dict(launcher="slurm", slurm={"account": "a b"}), r"account 'a b' is not a Slurm name"),
        (dict(launcher="slurm", slurm={"time": "-5"}), r"time '-5' is not a Slurm time limit"),
        (dict(launcher="slurm", slurm={"extra": ["nodes=2"]}), r"is not one sbatch option"),
        (dict(launcher="slurm", slurm={"extra": ["--a\n--b"]}), r"is not one sbatch option"),
        (dict(launcher="slurm", slurm={"extra": ["--output=x"]}), r"the pool sets --output"),
        (dict(launcher="slurm", slurm={"extra": ["--time=5"]}), r"slurm=\{'time': \.\.\.\}"),
    ],
)
def test_bad_slurm_options_are_refused_before_anything_starts(monkeypatch, tmp_path, kwargs, said):
    sbatch = tmp_path / "sbatch"  # present, so the launcher check passes; never run
    sbatch.write_text("#!/bin/sh\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    before = children()
    with pytest.raises(ValueError, match=said):
        nbpar.Pool(2, **kwargs)
    assert children() <= before


def test_slurm_options_and_a_script_of_ones_own_do_not_mix(monkeypatch, tmp_path):
    from traitlets.config import Config

    from nbpar.pool import slurm

    cfg = Config()
    cfg.SlurmEngineSetLauncher.batch_template = "#!/bin/sh\nsrun {program_and_args}\n"
    with pytest.raises(ValueError, match=r"put the options in your script"):
        slurm.check_options({"partition": "gpu"}, "slurm", cfg)
    assert slurm.check_options(None, "slurm", cfg) == {"extra": []}


def test_mpi_launch_settings_are_configurable():
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=4, engines="mpi", log_level=40)
    launchers.configure(cluster, "mpi", 4, {"NCCL_DEBUG": "INFO"})
    env = cluster.config.EngineLauncher.environment
    assert env["NCCL_DEBUG"] == "INFO"
    assert (env.get("OMPI_ALLOW_RUN_AS_ROOT") == "1") == (os.geteuid() == 0)
    from traitlets.config import Config

    mine = ipp.Cluster(
        n=4,
        engines="mpi",
        log_level=40,
        config=Config({"MPIEngineSetLauncher": {"mpi_args": ["--hostfile", "h"]}}),
    )
    launchers.configure(mine, "mpi", 4, {})
    assert mine.config.MPIEngineSetLauncher.mpi_args == ["--hostfile", "h"]


def test_more_gpu_engines_than_gpus_is_an_error():
    n = device.accelerator_count() + 1
    before = children()
    with pytest.raises(
        ValueError,
        match=rf"{n} GPU engines asked for but this machine has "
        rf"{n - 1} GPU\(s\): use Pool\({n - 1}\) or "
        r"backend='gloo'",
    ):
        nbpar.Pool(n, backend="nccl")
    assert children() <= before


@pytest.mark.timeout(180)
def test_env_reaches_engines_status_and_html():
    with nbpar.Pool(2, env=NCCL_ENV, replace=False) as pool:
        seen = pool.run(
            lambda keys: {k: __import__("os").environ.get(k) for k in keys}, list(NCCL_ENV)
        )
        assert seen == [NCCL_ENV, NCCL_ENV]
        assert [r["env"] for r in pool.status()] == [NCCL_ENV, NCCL_ENV]
        html = pool._repr_html_()
        assert all(f"{k}={v}" in html for k, v in NCCL_ENV.items())
        pool.restart()  # fresh engines get the same environment
        assert pool.run(lambda: __import__("os").environ.get("NCCL_P2P_DISABLE")) == ["1", "1"]


def test_peak_flops_table():
    assert device.peak_flops_hint("NVIDIA H200") == 989e12
    assert device.peak_flops_hint("NVIDIA H100 80GB HBM3") == 989e12
    assert device.peak_flops_hint("NVIDIA A100-SXM4-80GB") == 312e12
    assert device.peak_flops_hint("Some Future GPU") is None


def _gpu_check(*args, timeout=150):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_gpu_check_help():
    out = _gpu_check("--help", timeout=60)
    assert out.returncode == 0 and "--peak-tflops" in out.stdout and "--dry-run" in out.stdout


@pytest.mark.timeout(180)
def test_gpu_check_dry_run_prints_one_json_object_on_cpu(tmp_path):
    """Everything the first GPU session runs, on the CPU: detection, the engine's join
    path twice, every strategy at world size 1 (losses agreeing), the meter's clock
    against known work, and the file it writes with its date and commit."""
    out = _gpu_check("--dry-run", "--out", str(tmp_path / "gpu"))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["dry_run"] and res["device"] == "cpu" and res["peak_tflops"] is None
    strategies = ["single", "ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "hybrid"]
    assert [r["strategy"] for r in res["runs"]] == strategies
    assert all("error" not in r for r in res["runs"]), res["runs"]
    assert res["detect"]["torch"] and res["detect"]["default_backend"] == "gloo"
    assert [a["attempt"] for a in res["join"]["attempts"]] == ["join", "join again"]
    assert res["join"]["ok"] and res["join"]["attempts"][1]["group_backend"] == "gloo"
    assert res["losses"]["ok"] and set(res["losses"]["max_abs_diff"]) == set(strategies)
    meter = res["meter"]  # on a CPU the host's clock is the work's: most of the wall time
    assert not meter["timed_at_launch"] and meter["meter_compute_s"] <= meter["wall_s"]
    pipeline = next(r for r in res["runs"] if r["strategy"] == "pipeline")
    assert 0 < pipeline["spans_share_of_step"] <= 1
    (written,) = (tmp_path / "gpu").iterdir()
    saved = json.loads(written.read_text())
    assert saved["runs"] == res["runs"] and saved["date"] and "commit" in saved
    params = res["model"]["params"]
    assert res["flops_per_token"] == 6 * params + 12 * 2 * 32 * 32
    for run in res["runs"]:
        assert run["mfu"] is None and len(run["losses"]) == 2
        tokens = res["micro_batch"] * res["model"]["seq_len"]  # per step
        assert run["tokens_per_s"] == pytest.approx(tokens / run["step_time_s"])
        assert run["tflops"] == pytest.approx(run["tokens_per_s"] * res["flops_per_token"] / 1e12)
    # world size 1: ddp is the single-process computation
    assert res["runs"][0]["losses"] == pytest.approx(res["runs"][1]["losses"], rel=1e-5)
    assert "duplicate GPU" in res["shared_gpu"]["skipped"]
    for run in res["runs"]:  # a CPU has no allocator figures; the tracked ones are there
        check = run["allocator"]
        assert check["step"] == 1 and check["tracked_peak_bytes"] > check["states_bytes"] > 0
        assert check["device_peak_bytes"] is check["peak_ratio"] is None


@pytest.mark.timeout(120)
def test_gpu_check_refuses_a_cpu_torch_on_a_machine_with_an_nvidia_device(tmp_path):
    """A GPU machine whose torch has no CUDA would measure the CPU and call it the GPU's:
    the check says so and exits non-zero (here: a fake device file, this CPU torch)."""
    import os

    fake = tmp_path / "nvidia0"
    fake.write_text("")
    env = {**os.environ, "NBPAR_NVIDIA_DEV": str(fake)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--strategies", "single"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    res = json.loads(out.stdout)
    assert res["runs"] == [] and "was built without CUDA" in res["error"]
    from nbpar import device

    assert device.cpu_torch_on_a_gpu_machine() is None or device.nvidia_present()


def test_gpu_check_sets_tracked_memory_beside_the_allocators():
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        allocator_check = importlib.import_module("gpu_check").allocator_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    states = dict(param_bytes=100, grad_bytes=100, optim_bytes=200)
    history = [
        dict(step=0, **states, device_peak_bytes=900, device_allocated_bytes=500),
        dict(
            step=2,
            **states,
            tracked_peak_bytes=800,
            device_peak_bytes=1000,
            device_allocated_bytes=500,
        ),
    ]
    check = allocator_check(history)
    assert check["step"] == 2 and check["states_bytes"] == 400
    assert check["peak_ratio"] == 0.8 and check["states_ratio"] == 0.8
    assert "no metered step" in allocator_check(history[:1])["error"]


def test_gpu_check_fails_on_a_meter_that_times_launches():
    """A compute time far below the synchronized wall time (GPU work timed when it was
    queued) fails the check, as a failed run, join or loss disagreement does."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        gpu_check = importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    good = {
        "runs": [{"strategy": "single"}],
        "join": {"ok": True},
        "losses": {"ok": True},
        "meter": {"timed_at_launch": False},
    }
    assert not gpu_check.failed(good)
    assert gpu_check.failed({**good, "meter": {"timed_at_launch": True}})
    assert gpu_check.failed({**good, "losses": {"ok": False}})
    assert gpu_check.failed({**good, "runs": [{"strategy": "tp", "error": "boom"}]})
    assert not gpu_check.failed({**good, "runs": [{"strategy": "tp", "skipped": "fp16"}]})
    args = gpu_check.parse_args(["--dry-run", "--precision", "fp16"])
    assert gpu_check.measure("tp", args, 1, None) == {
        "strategy": "tp",
        "skipped": gpu_check.FP16_SKIPPED,
    }
    assert gpu_check.losses_agree(
        [{"strategy": "single", "losses": [2.0, 1.0]}, {"strategy": "ddp", "losses": [2.0, 1.2]}],
        "fp32",
    ) == {
        "max_abs_diff": {"single": 0.0, "ddp": pytest.approx(0.2)},
        "tolerance": 1e-4,
        "ok": False,
    }


def test_the_controller_writes_its_connection_file_whole(tmp_path):
    """Local engines read the file as soon as it exists: it appears complete, the
    owner's only, and nothing half-written is left beside it."""
    import json
    import stat
    import types

    from nbpar.pool.controller import save_connection_dict

    controller = types.SimpleNamespace(profile_dir=types.SimpleNamespace(security_dir=tmp_path))
    save_connection_dict(controller, "ipcontroller-x-engine.json", {"key": "k", "ports": [1]})
    path = tmp_path / "ipcontroller-x-engine.json"
    assert json.loads(path.read_text()) == {"key": "k", "ports": [1]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
