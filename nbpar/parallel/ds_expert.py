"""Expert parallelism on DeepSpeed: tiny_moe's feed-forwards become DeepSpeed-MoE layers
(``deepspeed.moe.layer.MoE``, Rajbhandari et al. 2022) on the engine of ZeRO stage 0.

DeepSpeed's gate is GShard's, with a capacity and token dropping by default; here it runs
dropless (``drop_tokens=False``: the capacity is the largest count any expert of the ep
group got), without random token selection (``use_rts=False``) and without the Gumbel
noise on the second expert (``top2_2nd_expert_sampling=False``), so it chooses the same
experts with the same weights as tiny_moe's router (k = 1: the probability; k = 2: the
two renormalised). Its gate shares tiny_moe's router weight, and its experts take their
slices of tiny_moe's stacked expert weights. DeepSpeed's own balance loss is a statistic
of the rank's batch; tiny_moe's per-sequence loss is computed beside it, from the same
weight, so the run equals the torch backend's. The engine averages the expert gradients
over the ranks holding the same experts and divides by dp, as `expert.GradSync` does.
DeepSpeed's all-to-alls move E x capacity rows, padding included.
"""

from __future__ import annotations

import contextlib
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nbpar.measure.holdings import tensor_bytes
from nbpar.model.moe import balance_loss
from nbpar.model.plan import require

from .deepspeed import DeepSpeedRunner, import_deepspeed, initialize
from .ds_config import ds_config_for


class ExpertFFN(nn.Module):
    """One expert of tiny_moe's `Experts` (expert ``e`` of its stacked weights) as the
    module DeepSpeed copies per local expert: (..., d) -> (..., d)."""

    def __init__(self, experts: nn.Module, e: int):
        super().__init__()
        for name in ("w1", "b1", "w2", "b2"):
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[e].clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class DeepSpeedMoEFeedForward(nn.Module):
    """tiny_moe's `MoEFeedForward` on DeepSpeed-MoE: same input, output and ``aux``."""

    def __init__(self, ffn: nn.Module, ep: int, ep_rank: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        experts, self.router = ffn.experts, ffn.router
        self.aux_loss_coef, self.aux = ffn.aux_loss_coef, None
        n = experts.num_experts
        self.moe = MoE(
            hidden_size=experts.w1.shape[-1],
            expert=ExpertFFN(experts, 0),
            num_experts=n,
            ep_size=ep,
            k=self.router.top_k,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        layer = self.moe.deepspeed_moe
        layer.gate.wg.weight = self.router.weight  # one parameter, two readers
        local = layer.experts.deepspeed_experts
        for i, expert in enumerate(local):
            mine = ExpertFFN(experts, ep_rank * len(local) + i)
            for name, p in mine.named_parameters():
                getattr(expert, name).data.copy_(p.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        out, _, _ = self.moe(x)  # (b, s, d); DeepSpeed's batch balance loss is not used
        logits, _, index = self.router(x.reshape(b * s, d))  # the same routing, counted
        self.aux = self.aux_loss_coef * balance_loss(logits.view(b, s, -1), index.view(b, s, -1))
        return out


class DeepSpeedExpertRunner(DeepSpeedRunner):
    """DeepSpeedRunner that also reports the bytes of the experts this rank holds (the
    parameters DeepSpeed-MoE keeps out of the data-parallel all-reduce)."""

    def memory(self) -> dict[str, int]:
        experts = [p for p in self.parameters() if getattr(p, "allreduce", True) is False]
        return {**super().memory(), "expert_param_bytes": tensor_bytes(experts)}


def build_runner(model: nn.Module, cfg, mesh, loss=None) -> DeepSpeedRunner:
    """tiny_moe with DeepSpeed-MoE feed-forwards over cfg's ep ranks, on an engine of
    ZeRO stage 0 over ``mesh["dp"]``."""
    import_deepspeed()
    dims = cfg.dims(dist.get_world_size())
    ep_rank = dims.coords(dist.get_rank())["ep"]
    for block in require(model, "expert").layers.values():
        block.ffn = DeepSpeedMoEFeedForward(block.ffn, dims.ep, ep_rank)
    config = ds_config_for(cfg, mesh["dp"].size())
    if loss is None:
        from nbpar.model.models import loss_fn

        loss = loss_fn(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # "creating a new group named ep_size_2"
        engine = initialize(model, config, mesh)
    return DeepSpeedExpertRunner(engine, loss, config)
