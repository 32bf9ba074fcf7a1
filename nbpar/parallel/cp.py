"""Context parallelism: every sequence split over the ``cp`` ranks of a group, as torchtitan
composes it (its ``cp`` mesh dimension, FSDP2 over the flattened ``dp_shard_cp``).

Each cp rank takes its own tokens of every micro-batch (x and y alike): for ring
attention (Liu et al. 2023) chunks r and 2cp-1-r of 2cp, so every rank has the same
causal work (the split of Llama 3's context parallelism, Dubey et al. 2024, sec. 3.3.2);
for Ulysses (Jacobs et al. 2023) the r-th contiguous share. Everything but attention is
per-token and runs on the local tokens as it is; attention calls the kernels of
`nbpar.parallel.context` through the model's hook (`set_context_attention`), and the
position embeddings (tiny_gpt's learned ones, Llama's RoPE) read the tokens' global
positions (the model's ``positions``). A rank's loss is the mean over its tokens; cp ranks
hold equal shares, so the mean over dp x cp ranks is the global batch's loss, and the
gradients of the replicated parameters are averaged over the same dp x cp ranks: one
all-reduce per step (DDP's math), or FSDP2 over the flattened "dp_cp" mesh where
``fsdp_reshard`` asks for it. Tensor parallelism composes: it splits the heads, context
parallelism the sequence, and the kernels attend over the local heads.
"""

from __future__ import annotations

import torch
from torch import nn

from nbpar.model.plan import require
from nbpar.strategies import reshard_after_forward

from .context import local_positions, ring_attention, ulysses_attention
from .runner import StepRunner
from .tensor import TensorParallelRunner, apply_fsdp_on_dp, apply_tp


def data_mesh(mesh):
    """The 1-D mesh over which the replicated parameters' gradients are averaged: every
    data and context rank ("dp_cp") where cp > 1, else "dp"."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    # the flattened mesh `ParallelDims.build_mesh` made (flattening again returns it;
    # torch deprecates slicing it off the root mesh)
    return mesh["dp", "cp"]._flatten("dp_cp")


def own_positions(cp_mesh, attention: str, seq_len: int) -> torch.Tensor:
    """The global positions (s/cp,) of this rank's tokens of every sequence: zigzag for
    the ring, contiguous for Ulysses (`nbpar.parallel.context.local_positions`)."""
    rank = cp_mesh.get_local_rank()
    positions = local_positions(attention, seq_len, cp_mesh.size(), rank)
    return positions.to(torch.device(cp_mesh.device_type))


def context_attend(attention: str, group, seq_len: int):
    """The model's attention hook: ``(q, k, v) -> out`` over ``group``'s split sequence,
    each (b, local heads, s/cp, head dim)."""
    if attention == "ring":
        return lambda q, k, v: ring_attention(q, k, v, group, seq_len=seq_len)
    if attention == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    raise ValueError(f"attention={attention!r} is not supported; choose ring, ulysses")


def apply_cp(model: nn.Module, cp_mesh, attention: str, seq_len: int, attend=None):
    """Make ``model`` (tiny_gpt or hf:llama, or a pipeline stage of one) attend over the
    1-D ``cp_mesh``'s split of ``seq_len``-token sequences, in place: its attention calls
    ``attend`` (default: nbpar's ring or Ulysses kernel) and its positions are this rank's
    global ones. Returns those positions (s/cp,)."""
    if not hasattr(model, "set_context_attention"):
        raise ValueError(
            f"context parallelism replaces a model's attention: {type(model).__name__} has "
            f"no set_context_attention(attend) (tiny_gpt and hf:llama have)"
        )
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp needs a 1-D cp mesh, got {cp_mesh.ndim} dims; pass mesh['cp']")
    positions = own_positions(cp_mesh, attention, seq_len)
    if attend is None:
        attend = context_attend(attention, cp_mesh.get_group(), seq_len)
    model.set_context_attention(attend)
    model.positions = positions
    return positions


class OwnTokens:
    """A runner (mixed in before it) whose step takes this rank's tokens of every
    micro-batch: x, y (b, s) -> (b, s/cp) at ``positions``."""

    def __init__(self, *args, positions: torch.Tensor, seq_len: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions, self.seq_len = positions, seq_len

    def own_tokens(self, micro_batches) -> list:
        """This rank's share of each (x, y) (b, s), as (b, s/cp) pairs."""
        out = []
        for x, y in micro_batches:
            if x.shape[1] != self.seq_len:
                raise ValueError(
                    f"context parallelism splits sequences of seq_len={self.seq_len} "
                    f"tokens; a micro-batch holds {x.shape[1]}"
                )
            pos = self.positions.to(x.device)
            out.append((x[:, pos], y[:, pos]))
        return out

    def train_step(self, micro_batches) -> torch.Tensor:
        """The wrapped runner's step on this rank's tokens; its mean loss over them."""
        return super().train_step(self.own_tokens(micro_batches))


class ContextParallelRunner(OwnTokens, TensorParallelRunner):
    """Context (x tensor, x data) parallel step: the tensor-parallel runner's step (one
    gradient all-reduce over ``dp_group``, here every dp x cp rank, or FSDP2's
    reduce-scatter) on this rank's tokens."""


def build_runner(model: nn.Module, cfg, mesh, *, loss_fn=None) -> StepRunner:
    """Context parallel on ``mesh["cp"]`` (tensor parallel on ``mesh["tp"]`` where tp >
    1), the replicated gradients averaged over dp x cp: one all-reduce a step, or FSDP2
    on "dp_cp" (ZeRO-3 resharding or ZeRO-2 keeping) where ``cfg.fsdp_reshard`` is set.
    (Backend deepspeed is `nbpar.parallel.ds_cp`'s.)"""
    from nbpar.parallel.common import autocast_dtype, make_optimizer, model_device_type

    if loss_fn is None:
        from nbpar.model.models import loss_fn as model_loss

        loss_fn = model_loss(cfg)
    require(model, "tensor")  # its blocks: the FSDP units, and where tp splits
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    seq_len = cfg.gpt.seq_len
    positions = apply_cp(model, mesh["cp"], cfg.attention, seq_len)
    data = data_mesh(mesh)
    dp_group, fsdp = None, False
    if data.size() > 1:
        reshard = reshard_after_forward(cfg.strategy, cfg.fsdp_reshard)
        if reshard is None:
            dp_group = data.get_group()
        else:
            apply_fsdp_on_dp(model, data, reshard)
            fsdp = True
    return ContextParallelRunner(
        model,
        make_optimizer(model.parameters(), cfg),
        loss_fn,
        autocast_dtype=autocast_dtype(cfg),
        device_type=model_device_type(model),
        dp_group=dp_group,
        fsdp=fsdp,
        positions=positions,
        seq_len=seq_len,
    )
