"""The small MLP every data-parallel strategy test trains: model, global batches, each dp
rank's share, the single-process Adam reference and the comparison with it."""

from __future__ import annotations

import types

import torch
from torch import nn

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
            {str(i): nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for i in range(4)}
        )

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


def rank_micro_batches(step: int, dp_rank: int, b: int = B, accum: int = ACCUM, dp: int = WORLD):
    """This dp rank's ``accum`` micro-batches of ``b`` rows (b * accum * dp rows in all)."""
    assert b * accum * dp == B * ACCUM * WORLD
    x, y = global_batch(step)
    return [
        (
            x[(m * dp + dp_rank) * b : (m * dp + dp_rank + 1) * b],
            y[(m * dp + dp_rank) * b : (m * dp + dp_rank + 1) * b],
        )
        for m in range(accum)
    ]


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
    fields = dict(
        model="test",
        strategy=strategy,
        backend=backend,
        micro_batch=B,
        grad_accum=ACCUM,
        lr=LR,
        optimizer="adam",
        precision="fp32",
        offload="none",
        fsdp_reshard=None,
        deepspeed_config=None,
        optimizer_params=None,
        grad_clip=0.0,
        lr_schedule=None,
        steps=STEPS,
    )
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


def full_bytes():
    return sum(p.numel() * 4 for p in make_model().parameters())


def check_against_reference(result, ref, loss_atol=1e-5, param_atol=1e-5):
    ref_losses, ref_params = ref
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(ref_losses), atol=loss_atol, rtol=0
    )
    assert result["params"].keys() == ref_params.keys()
    for name, p in ref_params.items():
        torch.testing.assert_close(
            torch.tensor(result["params"][name]),
            p,
            atol=param_atol,
            rtol=0,
            msg=lambda m: f"{name}: {m}",
        )
