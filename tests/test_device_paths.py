"""The GPU paths of `nbpar.device`, run on a CPU: the device side is faked (torch.cuda's
functions monkeypatched, a "one-GPU machine" by ``accelerator_count``), the decisions
around it are real. Issue #29: what was read but never run."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

from nbpar import device
from nbpar.config import ConfigError, TrainConfig
from nbpar.train import checkpoint
from nbpar.train.context import RankContext


@pytest.fixture
def one_gpu_machine(monkeypatch):
    """A host whose torch sees one GPU: the default backend there is nccl."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(device, "accelerator_count", lambda: 1)
    gpu = types.SimpleNamespace(total_memory=80 * 10**9)  # an 80 GB GPU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    assert device.default_backend() == "nccl" and device.total_memory("nccl") == gpu.total_memory


@pytest.fixture
def gloo_group():
    """A one-rank gloo default group in this process, left at teardown."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    from nbpar.parallel.mesh import forget_meshes

    forget_meshes()
    dist.destroy_process_group()


@pytest.fixture
def fake_allocator(monkeypatch):
    """torch.cuda's allocator and RNG, faked: every call is appended to the list."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    return calls


# ---- item 2: the default group carries gloo beside nccl ------------------------------
def test_a_gpu_pool_group_carries_gloo_for_cpu_tensors():
    assert device.process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend("gloo") == "gloo"
    for backend in ("gloo", "nccl"):  # what dist.get_backend() says maps back
        assert device.backend_of(device.process_group_backend(backend)) == backend
    assert device.backend_of("fake") == "fake"  # nbpar.simulate's fake ranks


def test_the_group_backend_reads_as_nccl(monkeypatch, gloo_group):
    assert device.current_backend() == "gloo"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert device.current_backend() == "nccl"


def test_an_engine_joins_with_both_backends_on_a_gpu_pool(tmp_path):
    """`worker.join` on an nccl pool asks for "cpu:gloo,cuda:nccl" (the GPU faked: the
    group made is gloo), in a child process: joining changes the process's environment."""
    script = textwrap.dedent(
        """
        import json
        import torch.distributed as dist
        from nbpar import device
        from nbpar.pool import worker

        asked, real = [], dist.init_process_group
        def init(backend, **kw):
            asked.append(backend)
            real("gloo", **kw)
        dist.init_process_group = init
        device.bind = lambda local_rank, backend: f"gpu {local_rank}"
        addr, port = worker.open_store("127.0.0.1", 0, 20)
        facts = worker.join(0, 1, addr, port, "nccl", 20, {})
        print(json.dumps({"asked": asked, "backend": facts["backend"]}))
        worker.leave()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == {"asked": ["cpu:gloo,cuda:nccl"], "backend": "nccl"}


# ---- item 5: the pool's backend decides, not "a GPU is present" ----------------------
def test_deepspeed_stays_on_cpu_for_a_gloo_pool_on_a_gpu_machine(monkeypatch, one_gpu_machine):
    monkeypatch.setenv("DS_ACCELERATOR", "unset")
    monkeypatch.delenv("DS_ACCELERATOR")
    device.deepspeed_env("nccl")
    assert "DS_ACCELERATOR" not in device.os.environ  # DeepSpeed finds the GPU itself
    device.deepspeed_env("gloo")
    assert device.os.environ["DS_ACCELERATOR"] == "cpu"


@pytest.mark.spawn  # DeepSpeed's first import probes the linker for libaio: it runs gcc
def test_import_deepspeed_follows_the_groups_backend(monkeypatch, one_gpu_machine, gloo_group):
    from nbpar.parallel import deepspeed

    seen = []
    monkeypatch.setattr(device, "deepspeed_env", seen.append)
    deepspeed.import_deepspeed()
    deepspeed.import_deepspeed("nccl")
    assert seen == ["gloo", "nccl"]


def _fp16_on_gpus_only(monkeypatch) -> list:
    asked: list = []

    def support(backend):
        asked.append(backend)
        return {"bf16": True, "fp16": backend == "nccl"}

    monkeypatch.setattr(device, "half_precision_support", support)
    monkeypatch.setattr(device, "cpu_model", lambda: "Test CPU")
    return asked


FP16 = dict(strategy="zero1", backend="deepspeed", precision="fp16", model="simple_cnn")


def test_precision_is_judged_for_the_pools_backend(monkeypatch, one_gpu_machine):
    asked = _fp16_on_gpus_only(monkeypatch)
    TrainConfig(**FP16).validate(2)  # no backend named: this host's (nccl)
    with pytest.raises(ConfigError, match="on this CPU \\(Test CPU\\)"):
        TrainConfig(**FP16).validate(2, pg_backend="gloo")
    assert asked == ["nccl", "gloo"]


def test_a_gloo_pool_checks_precision_for_its_cpus(monkeypatch, one_gpu_machine):
    """`Pool.train` (`start_run`) passes the pool's backend to the check."""
    from nbpar.pool.run import start_run

    _fp16_on_gpus_only(monkeypatch)

    class GlooPool:
        n, backend = 2, "gloo"

        def busy_ranks(self, ranks):
            raise RuntimeError("checked: would start")

    with pytest.raises(ConfigError, match="on this CPU"):
        start_run(GlooPool(), TrainConfig(**FP16))
    GlooPool.backend = "nccl"
    with pytest.raises(RuntimeError, match="would start"):
        start_run(GlooPool(), TrainConfig(**FP16))


def test_an_engine_of_a_gloo_group_computes_on_cpu(monkeypatch, one_gpu_machine, gloo_group):
    asked = _fp16_on_gpus_only(monkeypatch)
    ctx, _ = RankContext.build(TrainConfig(strategy="ddp", precision="bf16", model="simple_cnn"))
    assert (ctx.backend, ctx.device.type, ctx.mesh.device_type) == ("gloo", "cpu", "cpu")
    assert asked == ["gloo"]


# ---- item 6: the GPU peak is per step, with garbage collected first ------------------
def test_reset_peak_collects_garbage_first(fake_allocator):
    device.reset_peak("nccl")
    assert fake_allocator == ["gc", "reset"]
    device.reset_peak("nccl", collect=False)
    device.reset_peak("gloo")  # no GPU in use: nothing to reset
    assert fake_allocator == ["gc", "reset", "reset"]


def test_the_device_peak_is_reset_at_each_steps_start(monkeypatch):
    from nbpar.train.loop import run_training

    events = []
    monkeypatch.setattr(
        device, "reset_peak", lambda backend, collect=True: events.append(("reset", collect))
    )
    stats = device.memory_stats
    monkeypatch.setattr(
        device, "memory_stats", lambda backend: events.append(("read",)) or stats(backend)
    )
    run_training(TrainConfig(model="simple_cnn", strategy="single", micro_batch=4, steps=3))
    steps = [("reset", False), ("read",)] * 3
    assert events == [("reset", True), *steps]


# ---- item 7: checkpoints keep the GPU's random state, consolidate on a CPU -----------
class _Runner:
    """A runner that saves nothing but the RNG files `checkpoint` writes itself."""

    def save_checkpoint(self, path, *, distributed):
        pass

    def load_checkpoint(self, path, *, distributed):
        pass


class _Batches:
    def seek(self, epoch, batches):
        self.at = (epoch, batches)


def _ctx(backend):
    cfg = TrainConfig(model="simple_cnn")
    return RankContext(0, 1, cfg.dims(1), None, torch.device("cpu"), backend, False)


def _save_then_draw(tmp_path, backend) -> tuple[TrainConfig, torch.Tensor]:
    cfg = TrainConfig(model="simple_cnn", micro_batch=4, steps=4, checkpoint_dir=str(tmp_path))
    torch.manual_seed(7)
    torch.rand(5)
    checkpoint.save(cfg, _Runner(), 2, {"epoch": 0, "batches_in_epoch": 2}, _ctx(backend))
    after = torch.rand(5)
    resume = TrainConfig(**{**cfg.to_dict(), "resume_from": str(tmp_path)})
    return resume, after


def test_a_resumed_run_draws_what_the_saved_one_drew(tmp_path):
    resume, after = _save_then_draw(tmp_path, "gloo")
    torch.rand(100)  # move on: the resume must put the generator back
    assert checkpoint.resume(resume, _Runner(), _Batches(), _ctx("gloo")) == 2
    torch.testing.assert_close(torch.rand(5), after, atol=0, rtol=0)


def test_a_checkpoint_with_the_cpu_state_alone_still_resumes(tmp_path, monkeypatch, fake_allocator):
    resume, after = _save_then_draw(tmp_path, "gloo")
    rng = tmp_path / "step_000002" / "rng" / "rank_00000.pt"
    state = torch.load(rng, weights_only=True)
    torch.save(state["cpu"], rng)  # how checkpoints were written before: a plain tensor
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    torch.rand(100)
    checkpoint.resume(resume, _Runner(), _Batches(), _ctx("nccl"))
    torch.testing.assert_close(torch.rand(5), after, atol=0, rtol=0)
    assert restored == []  # no GPU state in the file: none restored


def test_a_gpu_runs_checkpoint_keeps_its_device_random_state(tmp_path, monkeypatch, fake_allocator):
    gpu_state = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpu_state.clone())
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    resume, after = _save_then_draw(tmp_path, "nccl")
    torch.rand(100)
    checkpoint.resume(resume, _Runner(), _Batches(), _ctx("nccl"))
    torch.testing.assert_close(torch.rand(5), after, atol=0, rtol=0)
    assert len(restored) == 1
    torch.testing.assert_close(restored[0], gpu_state, atol=0, rtol=0)
    restored.clear()
    checkpoint.resume(resume, _Runner(), _Batches(), _ctx("gloo"))  # a CPU pool: CPU only
    assert restored == []


@pytest.mark.spawn  # imports DeepSpeed, whose first import runs gcc (the libaio probe)
def test_a_deepspeed_stage0_checkpoint_consolidates_on_a_cpu(tmp_path, monkeypatch):
    """Its module state holds GPU tensors: loading it anywhere but to the CPU fails on
    a machine without a GPU, so the load must say map_location="cpu"."""
    (tmp_path / "ds").mkdir()
    weights = {"w": torch.arange(4, dtype=torch.float16)}
    torch.save({"module": weights}, tmp_path / "ds" / "mp_rank_00_model_states.pt")
    load = torch.load

    def cpu_only(*args, map_location=None, **kw):
        if map_location != "cpu":
            raise RuntimeError("Attempting to deserialize object on a GPU device")
        return load(*args, map_location=map_location, **kw)

    monkeypatch.setattr(torch, "load", cpu_only)
    full = checkpoint._deepspeed_weights(str(tmp_path))
    assert full["w"].dtype == torch.float32
    torch.testing.assert_close(full["w"], weights["w"].float(), atol=0, rtol=0)


def test_an_engine_takes_its_local_ranks_gpu_or_the_one_its_task_was_bound_to():
    """8 engines on an 8-GPU host take GPUs 0-7 by local rank. Under Slurm with one GPU
    bound per task (``--gpus-per-task=1``) each task sees one device, device 0, whatever
    its local rank; a local rank with no GPU and no such binding is a clear error."""
    assert [device.gpu_index(r, 8, {}) for r in range(8)] == list(range(8))
    assert device.gpu_index(3, 1, {"CUDA_VISIBLE_DEVICES": "3"}) == 0
    with pytest.raises(RuntimeError, match="local rank 1 has no GPU: this host shows 1"):
        device.gpu_index(1, 1, {})  # two engines, one GPU, nothing bound: not silently shared
    with pytest.raises(RuntimeError, match=r"shows 2 \(CUDA_VISIBLE_DEVICES=0,1\)"):
        device.gpu_index(2, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_tensor_parallel_steps_where_the_optimizer_defaults_to_foreach(monkeypatch, gloo_group):
    """On a GPU torch's Adam defaults to its foreach step, which cannot take DTensors and
    plain tensors in one call (tp's sharded layers beside its replicated ones: the first
    GPU run failed so). make_optimizer steps such a mix one parameter at a time; here the
    GPU's default is forced on the CPU, and tp and hybrid train as the reference does."""
    import nbpar.parallel.common as common
    from nbpar.train.loop import run_training

    spec = common.optimizer_spec
    monkeypatch.setattr(
        common, "optimizer_spec", lambda cfg: (spec(cfg)[0], {**spec(cfg)[1], "foreach": True})
    )
    base = dict(model="tiny_gpt", steps=3, micro_batch=4)
    ref = run_training(TrainConfig(strategy="single", **base))["losses"]
    for strategy, extra in (("tp", {}), ("hybrid", dict(dp=1, tp=1, pp=1))):
        losses = run_training(TrainConfig(strategy=strategy, **base, **extra))["losses"]
        assert losses == pytest.approx(ref, abs=1e-5), strategy
