"""Analytic per-rank memory estimate for DDP, ZeRO-1/2/3, tensor, pipeline and hybrid training.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Fig. 1): with mixed precision a
parameter costs 2 bytes (16-bit weights) + 2 (16-bit gradients) + K = 12 (fp32 master weights,
Adam momentum and variance); stage 1 shards the optimizer states over the data-parallel group,
stage 2 also the gradients, stage 3 also the parameters. Activations follow Korthikanti et al.
2022 (Megatron-LM, "Reducing Activation Recomputation in Large Transformer Models"), eqs. 1-5.
Pure Python: no torch at import, matplotlib only inside `MemoryEstimate.plot`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from nbpar.checks import positive_int
from nbpar.ds_partition import gradient_elements_held
from nbpar.measure.records import MEMORY_PARTS
from nbpar.strategies import (
    BACKENDS,
    DATA_PARALLEL,
    STRATEGIES,
    ZERO_STAGE,
    check_offload,
    resolve_degrees,
)

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}  # fp32 tensors/param
PRECISIONS = {"fp32": "fp32", "mixed": "mixed", "bf16": "mixed", "fp16": "mixed"}
ACTIVATION_KEYS = ("batch", "seq_len", "hidden", "layers", "heads")
ZERO_NAMES = ("baseline", "P_os", "P_os+g", "P_os+g+p")  # ZeRO paper, Fig. 1 columns
GB = 1e9  # tables use decimal GB, as the papers do: 13e9 fp32 params = 52 GB


def format_bytes(n: float) -> str:
    """Decimal units everywhere nbpar prints bytes, as the papers' tables: 1.5 MB, 52.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_bytes_or_dash(n: float | None) -> str:
    """`format_bytes`, or "-" for a figure that was not measured (the CLI's tables)."""
    return "-" if n is None else format_bytes(n)


_MEASURED = dict(zip(("params", "grads", "optim"), MEMORY_PARTS))  # estimate key -> record key


def _choice(name: str, value, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}; allowed: {', '.join(allowed)}.")
    return value


def bytes_per_param(optimizer: str = "adam", precision: str = "fp32") -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter: fp32 Adam 4+4+8, mixed Adam 2+2+12."""
    states = 4 * OPTIMIZER_STATES[_choice("optimizer", optimizer, OPTIMIZER_STATES)]
    if PRECISIONS[_choice("precision", precision, PRECISIONS)] == "fp32":
        return 4, 4, states
    return 2, 2, 4 + states  # the optimizer also keeps the fp32 master weights


def activation_bytes_per_layer(
    batch: int,
    seq_len: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    element_bytes: int = 2,
    sequence_parallel: bool = True,
    selective: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022).

    16-bit activations give eq. 1, s*b*h*(34 + 5*a*s/h): tensors of e bytes plus 1-byte
    dropout masks, so e = 4 (fp32) gives s*b*h*(66 + 9*a*s/h). With tensor parallelism and
    sequence parallelism everything divides by t (eq. 4); without it the layer-norm and
    linear inputs and the dropout masks stay replicated (eq. 2: 10 + 24/t + 5*a*s/(h*t)).
    ``selective`` recomputation (sec. 4.3) keeps none of the attention core's s x s
    tensors, the 5*a*s^2*b term: 34*s*b*h (/t with sequence parallelism). A fused
    attention kernel (FlashAttention, or the flash kernels scaled_dot_product_attention
    picks, as in nbpar's runs) never stores that term either, so a measured run without
    recomputation keeps about the selective figure. nbpar's sequence parallelism (DTensor's,
    as torchtitan's) keeps the all-gathered inputs of the attention and the MLP whole,
    2*e*s*b*h*(1 - 1/t) beyond eq. 4, where Megatron gathers them again in backward.
    An approximation: embeddings, the output head and the loss are left out.
    """
    s, b, h, a = seq_len, batch, hidden, heads
    replicated = 4 * element_bytes + 2  # 2 layer-norm in, QKV in, MLP in (e), 2 masks (1)
    sharded = 12 * element_bytes  # Q, K, V, proj in (e sbh each), GeLU in/out (4e sbh)
    scores = 0 if selective else (2 * element_bytes + 1) * a * s / h  # softmax, dropout
    if sequence_parallel:
        return s * b * h * (replicated + sharded + scores) / tp
    return s * b * h * (replicated + (sharded + scores) / tp)


def _activations(spec, tp: int, pp: int, element_bytes: int, cp: int = 1) -> float:
    """The activations of one stage: Korthikanti et al.'s per-layer bytes, 34*s*b*h +
    5*a*s^2*b without recomputation, 34*s*b*h with selective recomputation, 2*s*b*h (the
    16-bit layer input) with full recomputation plus one layer rebuilt in backward; all
    / t with sequence parallelism. Times the layers of a stage and the micro-batches it
    holds in flight."""
    from nbpar.checks import checkpointing_kind

    if not isinstance(spec, dict):
        raise ValueError(f"activations must be a dict with keys {ACTIVATION_KEYS}, got {spec!r}.")
    extra = set(spec) - set(ACTIVATION_KEYS) - {"sequence_parallel", "in_flight", "recompute"}
    missing = [k for k in ACTIVATION_KEYS if k not in spec]
    if extra or missing:
        raise ValueError(
            f"activations needs keys {ACTIVATION_KEYS} (optional sequence_parallel, "
            f"in_flight, recompute); missing {missing}, unknown {sorted(extra)}."
        )
    v = {k: positive_int(f"activations[{k!r}]", spec[k]) for k in ACTIVATION_KEYS}
    in_flight = positive_int("activations['in_flight']", spec.get("in_flight", 1))
    if v["layers"] < pp:
        raise ValueError(f"activations['layers']={v['layers']} must be >= pp={pp}.")
    if v["seq_len"] % cp:
        raise ValueError(f"activations['seq_len']={v['seq_len']} must be divisible by cp={cp}.")
    v["seq_len"] //= cp  # each cp rank holds its own tokens
    sp = bool(spec.get("sequence_parallel", True))
    kind = checkpointing_kind(spec.get("recompute", False))
    shape = (v["batch"], v["seq_len"], v["hidden"], v["heads"])
    per_layer = activation_bytes_per_layer(
        *shape, tp=tp, element_bytes=element_bytes, sequence_parallel=sp
    )
    layers = math.ceil(v["layers"] / pp) * in_flight
    if kind == "selective":
        return layers * activation_bytes_per_layer(
            *shape, tp=tp, element_bytes=element_bytes, sequence_parallel=sp, selective=True
        )
    if kind == "full":
        # full recomputation (Chen et al. 2016; Korthikanti et al. 2022, sec. 5): each
        # layer keeps only its input (s*b*h elements, split over t with sequence
        # parallelism), plus the one layer whose activations backward is rebuilding
        layer_input = v["seq_len"] * v["batch"] * v["hidden"] * element_bytes / (tp if sp else 1)
        return layers * layer_input + per_layer
    return layers * per_layer


def count_parameters(model) -> int:
    """Elements of ``model``'s parameters, each tensor counted once (tied weights once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def estimate_memory(
    params: float,
    world_size: int = 1,
    strategy: str = "ddp",
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    optimizer: str = "adam",
    precision: str = "fp32",
    offload: str = "none",
    activations: dict | None = None,
    backend: str | None = None,
    tp_replicated: float = 0,
    param_sizes: Sequence[int] | None = None,
    dp_rank: int = 0,
    cp: int | None = None,
    ep: int | None = None,
    expert_params: float = 0,
    fsdp_reshard: bool | None = None,
) -> MemoryEstimate:
    """Bytes each rank holds for parameters, gradients, optimizer states (and activations).

    ``params`` is a count or a model (an ``nn.Module``, e.g. ``build_model(cfg)``: its
    parameters are counted).

    Psi = params / (tp * pp) per model-parallel rank, then the ZeRO stage of `strategy`
    divides over dp. offload="optimizer" moves optimizer states (with mixed precision the
    fp32 master copy too) to the host; "params" (stage 3 only) moves the parameters as well.
    Offloaded bytes go to per_rank_bytes["host"], not "total". `activations` is an optional
    dict(batch=, seq_len=, hidden=, layers=, heads=[, sequence_parallel=True, in_flight=1,
    recompute=False]): in_flight is how many micro-batches a stage holds at once (pp on
    1F1B's first stage); recompute "full" (or True) models full activation checkpointing
    (each layer keeps only its input; backward rebuilds one layer at a time), "selective"
    the attention core recomputed (no s x s scores kept; see `activation_bytes_per_layer`).
    `backend` None follows the ZeRO paper; "torch" or "deepspeed" models what those
    implementations hold between steps: FSDP2's zero2 (no resharding after forward)
    reshards parameters after backward; DeepSpeed reduces gradients into this rank's
    partition from stage 1 on and keeps an fp32 master partition even in fp32 training.
    ``tp_replicated``: how many of the parameters tensor parallelism leaves whole on every
    tp rank (`nbpar.model.plan.tp_replicated_parameters` counts them from a model's plan);
    the paper's Psi / tp assumes 0. ``param_sizes`` (each parameter's element count, in
    the module's order) and ``dp_rank``: with DeepSpeed ZeRO-1/2 (no offload, tp = pp = 1)
    the gradients data-parallel rank ``dp_rank`` holds are the whole of every parameter
    its partition touches (`nbpar.ds_partition`), not Psi / dp.

    Context parallelism (``cp``) splits every sequence: a rank keeps the activations of
    seq_len / cp tokens, and the cp ranks are data-parallel ranks for the parameters
    (their gradients averaged over dp x cp, FSDP2 over dp x cp where ``fsdp_reshard`` is
    given, as torchtitan composes them). Expert parallelism (``ep``): ``expert_params``
    of the ``params`` are the experts', each rank holds expert_params / ep of them per
    stage, whole on every tensor-parallel rank (as nbpar's MoE plans keep them);
    ``tp_replicated`` counts the other parameters tp leaves whole. ``fsdp_reshard`` (any
    value) shards every state over dp x cp, as FSDP2 does in a hybrid or cp run.
    """
    params = count_parameters(params) if hasattr(params, "parameters") else params
    if (
        isinstance(params, bool)
        or not isinstance(params, Real)
        or not math.isfinite(params)
        or params <= 0
    ):
        raise ValueError(
            f"params must be a positive finite number or a model (nn.Module), got {params!r}."
        )
    _choice("strategy", strategy, STRATEGIES)
    check_offload(offload, strategy)
    p_b, g_b, o_b = bytes_per_param(optimizer, precision)
    dims = resolve_degrees(strategy, world_size, dp, tp, pp, cp, ep)
    dp, tp, pp, cp, ep = dims.dp, dims.tp, dims.pp, dims.cp, dims.ep
    stage = ZERO_STAGE.get(strategy, 0)
    if fsdp_reshard is not None and strategy in ("hybrid", "cp"):
        stage = 3  # FSDP2 shards parameters, gradients and optimizer state alike
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be None or one of {', '.join(BACKENDS)}, got {backend!r}.")
    shard = {"params": stage >= 3, "grads": stage >= 2, "optim": stage >= 1}
    if backend == "torch" and stage == 2:
        shard["params"] = True
    if backend == "deepspeed" and stage >= 1:
        shard["grads"] = True
        if p_b == 4:  # fp32 training: the master copy is an extra fp32 partition
            o_b += 4
    if (
        isinstance(tp_replicated, bool)
        or not isinstance(tp_replicated, Real)
        or not 0 <= tp_replicated <= params
    ):
        raise ValueError(
            f"tp_replicated must be a number of parameters in [0, params], got {tp_replicated!r}."
        )
    if (
        isinstance(expert_params, bool)
        or not isinstance(expert_params, Real)
        or not 0 <= expert_params <= params - tp_replicated
    ):
        raise ValueError(
            f"expert_params must be a number of parameters in [0, params - tp_replicated], "
            f"got {expert_params!r}."
        )
    # Megatron splits the blocks' weight matrices over tp; what it does not split
    # (embeddings, norms, the output head, row-parallel biases) every tp rank holds whole;
    # the experts divide over ep instead
    dense = params - tp_replicated - expert_params
    psi = (dense / tp + tp_replicated + expert_params / ep) / pp
    data = dp * cp  # the ranks that average (or shard) the same parameters
    nbytes = {
        "params": p_b * psi / (data if shard["params"] else 1),
        "grads": g_b * psi / (data if shard["grads"] else 1),
        "optim": o_b * psi / (data if shard["optim"] else 1),
    }
    if param_sizes is not None:
        if sum(param_sizes) != params:
            raise ValueError(f"param_sizes must add up to params={params}, got {sum(param_sizes)}.")
        if backend == "deepspeed" and stage in (1, 2) and offload == "none" and tp == pp == 1:
            nbytes["grads"] = g_b * gradient_elements_held(param_sizes, dp, dp_rank)
    moved = {"none": (), "optimizer": ("optim",), "params": ("optim", "params")}[offload]
    host = sum(nbytes[key] for key in moved)
    nbytes.update({key: 0.0 for key in moved})
    if activations is not None:  # activations are kept in the compute dtype
        nbytes["activations"] = _activations(activations, tp, pp, p_b, cp)
    nbytes["total"] = sum(nbytes.values())
    if offload != "none":
        nbytes["host"] = host
    return MemoryEstimate(
        per_rank_bytes=nbytes,
        params=params,
        world_size=dp * tp * pp * cp,
        strategy=strategy,
        dp=dp,
        tp=tp,
        pp=pp,
        zero_stage=stage,
        optimizer=optimizer,
        precision=precision,
        offload=offload,
        activations=None if activations is None else dict(activations),
        cp=cp,
        ep=ep,
    )


def estimate_config(
    cfg,
    world_size: int,
    params,
    *,
    tp_replicated: float = 0,
    param_sizes: Sequence[int] | None = None,
    dp_rank: int = 0,
    expert_params: float = 0,
) -> MemoryEstimate:
    """`estimate_memory` for a TrainConfig's run on ``world_size`` engines: its degrees
    (`TrainConfig.dims`, cp and ep included), optimizer, offload, backend and
    ``fsdp_reshard``; bf16 and fp16 count as mixed."""
    dims = cfg.dims(world_size)
    return estimate_memory(
        params,
        world_size,
        cfg.strategy,
        dp=dims.dp,
        tp=dims.tp,
        pp=dims.pp,
        optimizer=cfg.optimizer,
        precision="fp32" if cfg.precision == "fp32" else "mixed",
        offload=cfg.offload,
        backend=cfg.backend,
        tp_replicated=tp_replicated,
        param_sizes=param_sizes,
        dp_rank=dp_rank,
        cp=dims.cp,
        ep=dims.ep,
        expert_params=expert_params,  # whole on every tp rank, whatever ep is
        fsdp_reshard=cfg.fsdp_reshard,
    )


def zero_table(
    params: float, dp: int, optimizer: str = "adam", precision: str = "mixed"
) -> list[dict]:
    """The ZeRO paper's Fig. 1 rows: per-device GB for baseline, P_os, P_os+g, P_os+g+p."""
    rows = []
    for name, strategy in zip(ZERO_NAMES, DATA_PARALLEL):
        est = estimate_memory(params, dp, strategy, optimizer=optimizer, precision=precision)
        row = {"name": name, "stage": est.zero_stage}
        row.update({f"{k}_gb": v / GB for k, v in est.per_rank_bytes.items()})
        rows.append(row)
    return rows


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes (raw, keys params/grads/optim/total[/activations][/host]) and the inputs."""

    per_rank_bytes: dict
    params: float
    world_size: int
    strategy: str
    dp: int
    tp: int
    pp: int
    zero_stage: int
    optimizer: str
    precision: str
    offload: str
    activations: dict | None = None
    cp: int = 1
    ep: int = 1

    def to_json(self) -> dict:
        """A JSON-ready dict: {"per_rank_bytes": {...}, "strategy": ..., ...}."""
        out = {"per_rank_bytes": dict(self.per_rank_bytes)}
        for key in (
            "params",
            "world_size",
            "strategy",
            "dp",
            "tp",
            "pp",
            "cp",
            "ep",
            "zero_stage",
            "optimizer",
            "precision",
            "offload",
            "activations",
        ):
            value = getattr(self, key)
            out[key] = dict(value) if isinstance(value, dict) else value
        return out

    def _title(self) -> str:
        return (
            f"{self.params / 1e9:g}B params, {self.strategy} (ZeRO stage {self.zero_stage}), "
            f"dp={self.dp} tp={self.tp} pp={self.pp}"
            + (f" cp={self.cp}" if self.cp > 1 else "")
            + (f" ep={self.ep}" if self.ep > 1 else "")
            + f", {self.optimizer}, {self.precision}"
            + (f", offload={self.offload}" if self.offload != "none" else "")
        )

    def table(self) -> str:
        """Human table of GB per rank, one line per key, e.g. 'params 52.00 GB' (two
        decimals, so the parts of a few-GB estimate visibly add up to its total)."""
        width = max(len(k) for k in self.per_rank_bytes)
        lines = [
            f"{k:<{width}} {v / GB:.2f} GB" + (" (host, not in total)" if k == "host" else "")
            for k, v in self.per_rank_bytes.items()
        ]
        return "\n".join([f"Per-rank memory: {self._title()}", *lines])

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>"
            f"{v / GB:.2f} GB</td><td style='text-align:right'>{v:,.0f}</td></tr>"
            for k, v in self.per_rank_bytes.items()
        )
        return (
            f"<table><caption>Per-rank memory: {html.escape(self._title())}</caption>"
            f"<tr><th>part</th><th>GB</th><th>bytes</th></tr>{rows}</table>"
        )

    def __repr__(self) -> str:
        return (
            f"MemoryEstimate(strategy={self.strategy!r}, dp={self.dp}, tp={self.tp}, "
            f"pp={self.pp}, total={self.per_rank_bytes['total'] / GB:.2f} GB/rank)"
        )

    def plot(self, ax=None):
        """Stacked bar (GB) of params/grads/optim/activations per rank; returns the Figure."""
        from nbpar.estimate_plot import plot_estimate

        return plot_estimate(self, ax)

    def compare(self, measured: dict) -> dict:
        """Measured (param_bytes, grad_bytes, optim_bytes of one rank) vs this estimate.

        Returns {key: {"measured", "estimated", "rel_error"}} for each key given, with
        rel_error = (measured - estimated) / estimated (0 when both are 0, inf if only the
        estimate is 0).
        """
        if not isinstance(measured, dict) or not any(m in measured for m in _MEASURED.values()):
            raise ValueError(
                f"measured must be a dict with any of {tuple(_MEASURED.values())}, "
                f"got {measured!r}."
            )
        out = {}
        for key, mkey in _MEASURED.items():
            if mkey not in measured:
                continue
            m = measured[mkey]
            if isinstance(m, bool) or not isinstance(m, Real) or m < 0:
                raise ValueError(f"measured[{mkey!r}] must be a number >= 0, got {m!r}.")
            est = self.per_rank_bytes[key]
            rel = (m - est) / est if est else (0.0 if m == 0 else math.inf)
            out[key] = {"measured": m, "estimated": est, "rel_error": rel}
        return out
