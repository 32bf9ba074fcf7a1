"""DeepSpeed ZeRO 0-3 (+ offload, bf16, fp16) on 2 gloo processes against
single-process Adam. DeepSpeed's start-up is slow on CPU, so one pair of
processes runs several configurations in a row."""

from __future__ import annotations

import copy
import weakref

import pytest

from tests.distributed import run_distributed
from tests.reference.mlp import (
    BF16_LOSS_ATOL,
    BF16_PARAM_ATOL,
    WORLD,
    check_against_reference,
    full_bytes,
    loss_fn,
    make_cfg,
    make_model,
    reference,
    train,
)

# the classic ds_config of DeepSpeed's tutorials, used as written
CLASSIC = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}
# fp16 (with fp32 master weights) vs the fp32 reference: measured ~6e-5 on the loss and
# ~1e-3 on a parameter; bf16 tolerances are in tests/test_zero.py
FP16_LOSS_ATOL, FP16_PARAM_ATOL = 1e-3, 5e-3


def _run_ds(rank, world, cfgs):
    from nbpar.dims import ParallelDims
    from nbpar.parallel.deepspeed import build_runner

    meshes = {}
    results = []
    for cfg in cfgs:
        dp = getattr(cfg, "dp", world)  # dp < world: the rest is a (replicated) tp dim
        if dp not in meshes:
            meshes[dp] = ParallelDims(dp=dp, tp=world // dp, world_size=world).build_mesh("cpu")
        runner = build_runner(make_model(), cfg, meshes[dp], loss=loss_fn)
        losses = train(runner, rank, cfg, meshes[dp]["dp"])
        params = {n: t.tolist() for n, t in runner.full_parameters().items()}
        memory = runner.memory()
        engine = weakref.ref(runner.engine)
        runner.close()
        runner.close()  # idempotent
        results.append(
            {"losses": losses, "params": params, "memory": memory, "engine_freed": engine() is None}
        )
    return results


def ds_cfg(strategy, **kw):
    return make_cfg(strategy, backend="deepspeed", **kw)


@pytest.mark.timeout(180)
def test_deepspeed_stages_match_single_process_adam():
    cfgs = [
        ds_cfg("ddp"),
        ds_cfg("zero1"),
        ds_cfg("zero2"),
        ds_cfg("zero3"),
        ds_cfg("zero2", offload="optimizer"),
        ds_cfg("zero3", offload="optimizer"),
    ]
    out = run_distributed(_run_ds, WORLD, cfgs, timeout=175)
    ref, full = reference(), full_bytes()
    for i, cfg in enumerate(cfgs):
        for rank in range(WORLD):
            res = out[rank][i]
            check_against_reference(res, ref)
            assert res["engine_freed"], f"{cfg.strategy}: engine still referenced after close"
            mem = res["memory"]
            if cfg.strategy == "ddp":  # stage 0: everything whole, Adam's 2 moments
                assert mem["param_bytes"] == full and mem["optim_bytes"] == 2 * full
            else:  # fp32 master partition + 2 moments, 1/2 each (+ alignment padding)
                assert 1.5 * full <= mem["optim_bytes"] <= 1.5 * full + 256
            if cfg.strategy == "zero3":  # parameter partitions only
                assert full / 2 <= mem["param_bytes"] <= full / 2 + 256
            elif cfg.strategy in ("zero1", "zero2"):
                assert mem["param_bytes"] == full
            want_off = mem["optim_bytes"] if cfg.offload == "optimizer" else 0
            assert mem["offload_bytes"] == want_off


# whether this CPU computes fp16 (AVX512-FP16 / AMX-FP16): DeepSpeed refuses fp16 without
FP16 = __import__("nbpar.device").device.half_precision_support("gloo")["fp16"]


@pytest.mark.timeout(180)
def test_deepspeed_half_precision_classic_config_param_offload_and_dp_group():
    classic = ds_cfg(
        "zero3",
        precision="fp16",
        offload="optimizer",
        micro_batch=8,
        grad_accum=1,
        lr=1e-3,
        deepspeed_config=copy.deepcopy(CLASSIC),
    )
    half = [ds_cfg("zero3", precision="bf16"), ds_cfg("zero1", precision="bf16")]
    if FP16:  # the fp16 leg runs where the hardware has fp16 ...
        half.append(classic)
    else:  # ... and is refused on the client, in one line, where it does not
        from nbpar.config import TrainConfig

        with pytest.raises(ValueError, match="needs AVX512-FP16 or AMX-FP16.*'bf16'"):
            TrainConfig(deepspeed_config=copy.deepcopy(CLASSIC)).validate(2)
    cfgs = half + [
        ds_cfg("zero3", offload="params"),
        ds_cfg("zero2", dp=1, micro_batch=8, grad_accum=2),
    ]  # dp group via MeshMPU
    out = run_distributed(_run_ds, WORLD, cfgs, timeout=175)
    ref, n = reference(), len(half)
    for rank in range(WORLD):
        check_against_reference(out[rank][n], ref)
        check_against_reference(out[rank][n + 1], ref)
        mem, full = out[rank][n]["memory"], full_bytes()
        assert full / 2 <= mem["param_bytes"] <= full / 2 + 256
        assert mem["offload_bytes"] == mem["param_bytes"] + mem["optim_bytes"]
    refs = [ref, ref, reference(lr=1e-3)]
    atols = [(BF16_LOSS_ATOL, BF16_PARAM_ATOL)] * 2 + [(FP16_LOSS_ATOL, FP16_PARAM_ATOL)]
    for i, (ref, (loss_atol, param_atol)) in enumerate(zip(refs[:n], atols)):
        for rank in range(WORLD):
            check_against_reference(out[rank][i], ref, loss_atol=loss_atol, param_atol=param_atol)
            # half precision really changed the numerics
            diff = max(abs(a - b) for a, b in zip(out[rank][i]["losses"], ref[0]))
            assert diff > 1e-6


def test_each_deepspeed_strategy_goes_to_its_runner():
    """ZeRO stages to the DeepSpeed engine, pipelines to its PipelineModule; what neither
    runs is refused by name (the runners trust `nbpar.parallel.strategy_module`)."""
    from nbpar.parallel import strategy_module

    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        assert strategy_module(strategy, "deepspeed") == "deepspeed"
    assert strategy_module("pipeline", "deepspeed") == "ds_pipeline"
    assert strategy_module("hybrid", "deepspeed") == "hybrid"
    with pytest.raises(ValueError, match="no runner for strategy='ring'"):
        strategy_module("ring", "deepspeed")


def test_client_optimizer_follows_deepspeed_semantics():
    import torch

    from nbpar.parallel.deepspeed import client_optimizer

    params = list(make_model().parameters())
    opt = client_optimizer({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, params)
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.0
    opt = client_optimizer({"type": "Adam", "params": {"adam_w_mode": False}}, params)
    assert type(opt) is torch.optim.Adam
    with pytest.raises(ValueError, match="Lamb"):
        client_optimizer({"type": "Lamb", "params": {}}, params)
