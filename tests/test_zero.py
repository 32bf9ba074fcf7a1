"""Torch-native ZeRO-1/2/3 on 2 gloo processes against single-process Adam.

The helpers here (model, data, reference, worker loop) are shared with
tests/test_deepspeed.py.
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tests.distributed import run_distributed

B, ACCUM, WORLD, STEPS, LR, DIM = 4, 2, 2, 20, 1e-2, 32
# bf16 compute vs the fp32 reference after 20 Adam steps: measured max |diff| ~1.5e-3 on
# the loss and ~2.1e-2 on a parameter (torch and DeepSpeed alike)
BF16_LOSS_ATOL, BF16_PARAM_ATOL = 1e-2, 5e-2


class Stack(nn.Module):
    """Four (Linear 32->32, tanh) blocks under ``layers``, like TinyGPT's; every
    weight has 32 rows, so both FSDP and ZeroRedundancyOptimizer split it evenly."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for i in range(4)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Stack()


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits, y)


def global_batch(step: int):
    """The (x, y) of one optimizer step: ACCUM * WORLD micro-batches of B rows."""
    g = torch.Generator().manual_seed(1000 + step)
    n = B * ACCUM * WORLD
    return torch.randn(n, DIM, generator=g), torch.randint(0, DIM, (n,), generator=g)


def rank_micro_batches(step: int, dp_rank: int, b: int = B, accum: int = ACCUM,
                       dp: int = WORLD):
    """This dp rank's ``accum`` micro-batches of ``b`` rows (b * accum * dp rows in all)."""
    assert b * accum * dp == B * ACCUM * WORLD
    x, y = global_batch(step)
    return [(x[(m * dp + dp_rank) * b:(m * dp + dp_rank + 1) * b],
             y[(m * dp + dp_rank) * b:(m * dp + dp_rank + 1) * b]) for m in range(accum)]


def reference(lr: float = LR):
    """Plain model + torch.optim.Adam on the whole global batch: (losses, params)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def make_cfg(strategy, backend="torch", **kw):
    fields = dict(model="test", strategy=strategy, backend=backend, micro_batch=B,
                  grad_accum=ACCUM, lr=LR, optimizer="adam", precision="fp32",
                  offload="none", fsdp_reshard=None, deepspeed_config=None,
                  optimizer_params=None, grad_clip=0.0, lr_schedule=None, steps=STEPS)
    return types.SimpleNamespace(**{**fields, **kw})


def train(runner, rank, cfg, dp_mesh=None):
    """STEPS steps; returns the per-step loss averaged over the dp ranks."""
    import torch.distributed as dist

    dp_rank, dp = (rank, WORLD) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())
    group = None if dp_mesh is None else dp_mesh.get_group()
    losses = []
    for step in range(STEPS):
        batches = rank_micro_batches(step, dp_rank, cfg.micro_batch, cfg.grad_accum, dp)
        loss = runner.train_step(batches).clone()
        dist.all_reduce(loss, group=group)
        losses.append(loss.item() / dp)
    return losses


def _run_torch(rank, world, cfgs):
    from nbpar.parallel.mesh import ParallelDims
    from nbpar.parallel.zero import build_runner

    mesh = ParallelDims(dp=world, world_size=world).build_mesh("cpu")
    results = []
    for cfg in cfgs:
        runner = build_runner(make_model(), cfg, mesh, loss=loss_fn)
        losses = train(runner, rank, cfg)
        # nested lists: tensors would travel between processes through shared memory
        params = {n: t.tolist() for n, t in runner.full_parameters().items()}
        results.append({"losses": losses, "params": params,
                        "memory": runner.memory(),
                        "dtensor": all(hasattr(p, "to_local") for p in runner.parameters())})
        runner.close()
    return results


def full_bytes():
    return sum(p.numel() * 4 for p in make_model().parameters())


def check_against_reference(result, ref, loss_atol=1e-5, param_atol=1e-5):
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                               atol=loss_atol, rtol=0)
    assert result["params"].keys() == ref_params.keys()
    for name, p in ref_params.items():
        torch.testing.assert_close(torch.tensor(result["params"][name]), p, atol=param_atol, rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(180)
def test_torch_zero_stages_match_single_process_adam():
    cfgs = [make_cfg("zero1"), make_cfg("zero2"), make_cfg("zero3")]
    out = run_distributed(_run_torch, WORLD, cfgs, timeout=170)
    ref = reference()
    full = full_bytes()
    for i, cfg in enumerate(cfgs):
        for rank in range(WORLD):
            check_against_reference(out[rank][i], ref)
        mem = [out[rank][i]["memory"] for rank in range(WORLD)]
        if cfg.strategy == "zero1":
            # params and grads whole; Adam's two moments split between the ranks
            assert all(m["param_bytes"] == full for m in mem)
            assert [m["optim_bytes"] for m in mem] == [full, full]  # 2 moments x 1/2
        else:
            assert all(out[r][i]["dtensor"] for r in range(WORLD))
            for m in mem:  # sharded params, grads and moments: 1/2 each, no padding here
                assert m["param_bytes"] == full // 2
                assert m["grad_bytes"] == full // 2
                assert m["optim_bytes"] == full


@pytest.mark.timeout(180)
def test_torch_zero_bf16_within_tolerance_and_reshard_override():
    cfgs = [make_cfg("zero1", precision="bf16"), make_cfg("zero3", precision="bf16"),
            make_cfg("zero3", fsdp_reshard=False)]
    out = run_distributed(_run_torch, WORLD, cfgs, timeout=170)
    ref = reference()
    for rank in range(WORLD):
        for i in (0, 1):
            check_against_reference(out[rank][i], ref, loss_atol=BF16_LOSS_ATOL,
                                    param_atol=BF16_PARAM_ATOL)
            # bf16 really changed the numerics (not silently fp32)
            assert max(abs(a - b) for a, b in zip(out[rank][i]["losses"], ref[0])) > 1e-6
        check_against_reference(out[rank][2], ref)


@pytest.mark.parametrize("kw, match", [
    (dict(precision="fp16"), "fp16"),
    (dict(offload="optimizer"), "deepspeed"),
    (dict(optimizer="lamb"), "lamb"),
])
def test_torch_zero_rejects_bad_config_before_any_work(kw, match):
    from nbpar.parallel.zero import build_runner

    with pytest.raises(ValueError, match=match):
        build_runner(make_model(), make_cfg("zero2", **kw), mesh=None, loss=loss_fn)


def test_model_blocks_are_the_layers():
    from nbpar.parallel.zero import model_blocks

    model = make_model()
    assert model_blocks(model) == list(model.layers.values())
    assert model_blocks(nn.Linear(2, 2)) == []
