"""What a model declares so strategies can cut it: its parallel plan.

A model that defines ``parallel_plan() -> ModelPlan`` tells the strategies
- which repeated blocks it has (FSDP units, pipeline cut points, checkpointing),
- how to split a block for tensor parallelism (Megatron-LM, Shoeybi et al. 2019:
  DTensor ``ColwiseParallel``/``RowwiseParallel`` styles keyed by submodule path) and
  which widths the tp degree must divide,
- which parts only the first and the last pipeline stage keep (GPipe, Huang et al.
  2019: embeddings in front, norm and head at the back),
- how a block splits with sequence parallelism (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models"), and which output layer tensor
  parallelism splits by columns.

Data parallelism needs no plan. Without one, tensor and pipeline parallelism are
refused with `require`'s message naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from nbpar.checks import checkpointing_kind


@dataclass
class ModelPlan:
    """A model's declared structure (see the module docstring)."""

    layers: nn.ModuleDict
    """the repeated blocks, keyed "0".."L-1", run in key order"""
    tp: dict | None = None
    """block-relative submodule path -> DTensor ParallelStyle; None = no tensor parallel"""
    tp_widths: dict[str, int] = field(default_factory=dict)
    """what the tp degree must divide, e.g. {"attention heads": 8, "key/value heads": 2}"""
    first: tuple[str, ...] = ()
    """attributes only the first pipeline stage keeps (set to None elsewhere)"""
    last: tuple[str, ...] = ()
    """attributes only the last pipeline stage keeps"""
    no_pipeline: str | None = None
    """why this model cannot be cut into stages (e.g. tied embeddings), or None"""
    no_tp: str | None = None
    """why this model has no tensor-parallel plan, or None"""
    experts: str | None = None
    """block-relative path of a mixture-of-experts block's experts module (called as
    transformers calls its experts: hidden, top-k ids, top-k weights), which expert
    parallelism shares out; None = no experts"""
    sp: dict | None = None
    """the block split with sequence parallelism (norms on s/tp tokens, each sub-layer's
    input all-gathered, its output reduce-scattered); None = no sequence parallelism"""
    head: str | None = None
    """the output layer tensor parallelism splits by columns, its logits gathered
    (transformers' ``colwise_gather_output``); None = kept whole"""
    embed: str | None = None
    """the token embedding tensor parallelism splits by vocabulary rows (Megatron's
    VocabParallelEmbedding), its (b, s, d) output summed over the ranks; None = whole"""
    norm: str | None = None
    """the final norm, which sequence parallelism runs on s/tp tokens"""
    sp_inputs: dict[str, int] = field(default_factory=dict)
    """the modules whose outputs make the first block's input, each with the dim of its
    output that runs along the sequence: sequence parallelism keeps this rank's s/tp"""


def plan_of(model: nn.Module) -> ModelPlan | None:
    """The model's declared plan, or None."""
    declare = getattr(model, "parallel_plan", None)
    return declare() if callable(declare) else None


def require(model: nn.Module, what: str) -> ModelPlan:
    """The plan ``what`` ("tensor", "pipeline" or "expert") needs, or a one-line
    ValueError."""
    plan = plan_of(model)
    name = type(model).__name__
    if plan is None:
        raise ValueError(
            f"{what} parallelism needs a model that declares its blocks: "
            f"{name} has no parallel_plan() method (see nbpar.model.plan.ModelPlan)"
        )
    if what == "tensor" and (plan.tp is None or plan.no_tp):
        raise ValueError(
            f"tensor parallelism needs a tensor-parallel plan: {name} "
            f"{plan.no_tp or 'declares none (ModelPlan.tp)'}"
        )
    if what == "expert" and plan.experts is None:
        raise ValueError(
            f"expert parallelism needs a mixture-of-experts model: {name}'s plan names "
            f"no experts module (ModelPlan.experts)"
        )
    if what == "pipeline" and plan.no_pipeline:
        raise ValueError(f"pipeline parallelism cannot cut {name}: {plan.no_pipeline}")
    return plan


def check_tp_degree(model: nn.Module, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides every width the plan names."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel degree must be a positive integer, got {tp!r}")
    for what, width in require(model, "tensor").tp_widths.items():
        if width % tp:
            raise ValueError(
                f"tensor-parallel degree {tp} must divide the {what} ({width}); "
                f"use a tp that divides {width}"
            )


def split_ends(model: nn.Module, plan: ModelPlan) -> dict[str, nn.Module]:
    """The embedding and the output layer tensor parallelism splits, by attribute name:
    those this stage holds and the plan declares, unless they are tied (one weight:
    splitting it by rows for one and by columns for the other cannot both hold)."""
    ends = {name: getattr(model, name, None) for name in (plan.embed, plan.head) if name}
    ends = {name: m for name, m in ends.items() if m is not None}
    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))]
    tied = {id(w) for w in weights if sum(x is w for x in weights) > 1}
    return {name: m for name, m in ends.items() if id(m.weight) not in tied}


def tp_replicated_parameters(model: nn.Module) -> int:
    """Parameters tensor parallelism leaves whole on every rank: all but the weights its
    plan splits (a colwise Linear's weight and bias, a rowwise Linear's weight, the
    embedding and the output layer)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = require(model, "tensor")
    split = 0
    for block in plan.layers.values():
        for path, style in plan.tp.items():
            if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue  # a style that splits no weight (e.g. one that sets an attribute)
            module = block.get_submodule(path)
            split += module.weight.numel()
            if isinstance(style, ColwiseParallel) and getattr(module, "bias", None) is not None:
                split += module.bias.numel()
    for end in split_ends(model, plan).values():
        split += sum(p.numel() for p in end.parameters())
    return sum(p.numel() for p in model.parameters()) - split


def expert_parameter_count(model: nn.Module) -> int:
    """Parameters of the experts modules the model's plan names (`ModelPlan.experts`),
    those expert parallelism shares out; 0 for a model without experts."""
    plan = plan_of(model)
    if plan is None or plan.experts is None:
        return 0
    return sum(
        p.numel()
        for block in plan.layers.values()
        for p in block.get_submodule(plan.experts).parameters()
    )


def token_positions(positions: torch.Tensor | None, s: int, device) -> torch.Tensor:
    """The global positions of ``s`` tokens: ``positions`` where context parallelism set
    them (their count must be ``s``), else 0..s-1."""
    if positions is None:
        return torch.arange(s, device=device)
    if positions.numel() != s:
        raise ValueError(
            f"this rank holds {positions.numel()} tokens of each sequence under context "
            f"parallelism, got {s}: every sequence must have the run's seq_len"
        )
    return positions.to(device)


def run_layers(layers: nn.ModuleDict, h, checkpointing=False, **kwargs):
    """Run ``layers`` in key order. ``checkpointing`` (see `checkpointing_kind`): "full"
    recomputes each block's activations in backward instead of keeping them (Chen et al.
    2016, non-reentrant), keeping only its input; "selective" keeps every linear layer's
    output and recomputes only the attention core, softmax(q k^T) v, whose s x s scores
    are the bulk of a block's activations at long sequences (Korthikanti et al. 2022)."""
    from torch.utils.checkpoint import checkpoint

    kind = checkpointing_kind(checkpointing)
    for key in sorted(layers.keys(), key=int):
        layer = layers[key]
        if kind == "full" and h.requires_grad:
            h = checkpoint(layer, h, use_reentrant=False, **kwargs)
        elif kind == "selective" and h.requires_grad:
            with RecomputedAttention():
                h = layer(h, **kwargs)
        else:
            h = layer(h, **kwargs)
        if isinstance(h, tuple):  # some decoder layers return (hidden, ...)
            h = h[0]
    return h


class RecomputedAttention(TorchFunctionMode):
    """Runs every ``scaled_dot_product_attention`` inside a checkpoint: its inputs q, k
    and v are kept, what the attention saves itself is dropped and computed again in
    backward (selective recomputation, Korthikanti et al. 2022)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)
