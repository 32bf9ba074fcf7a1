"""What each rank of a projected run sends by op, and how long it takes on the hardware:
the communication half of `nbpar.project`. Bytes come from `nbpar.comm_estimate` (a
config) or from what a run measured; each op is timed by `nbpar.hardware`'s alpha-beta
model on the link its group uses, and `OVERLAP` says how much of it compute can hide.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.errors import ConfigError
from nbpar.hardware import Hardware, ring
from nbpar.strategies import ZERO_STAGE

BACKWARD = 2 / 3  # backward is twice the forward's FLOPs: 2/3 of a step's compute


def bad(field: str, message: str) -> ConfigError:
    return ConfigError(message, fields=(field,))


# the collective of the gradients, how many times Psi x (n-1)/n it sends a step of K
# micro-batches, and the parameters' collective: the rest of `comm_bytes_per_step`
GRADIENT_OPS = {
    ("ddp", "torch"): ("all_reduce", lambda k: 2, None),
    ("zero1", "torch"): ("all_reduce", lambda k: 2, "broadcast"),
    ("zero2", "torch"): ("reduce_scatter", lambda k: 1, "all_gather"),
    ("zero3", "torch"): ("reduce_scatter", lambda k: 1, "all_gather"),
    ("zero1", "deepspeed"): ("all_reduce", lambda k: 2, "all_gather"),
    ("zero2", "deepspeed"): ("all_reduce", lambda k: 2 * k, "all_gather"),
    ("zero3", "deepspeed"): ("reduce_scatter", lambda k: k, "all_gather"),
}

# What compute can hide: row -> (ops it hides, window as a share of compute, why)
OVERLAP = {
    "ddp": (("all_reduce",), BACKWARD, "DDP all-reduces gradient buckets while backward "
            "still runs: up to the backward's 2/3 of the compute hides them."),
    "zero1": (("all_reduce", "reduce_scatter"), BACKWARD, "ZeRO-1/2 reduce gradients during "
              "backward like DDP (2/3 of the compute); the updated partitions' all-gather "
              "or broadcast after the optimizer step is on the critical path."),
    "zero3": (("all_gather", "reduce_scatter"), 1.0, "ZeRO-3 / FSDP prefetches the next "
              "layer's all-gather during forward and backward and reduce-scatters gradients "
              "during backward: the whole compute can hide them."),
    "tp": ((), 0.0, "Tensor parallelism's all-reduces sit between a block's matmuls: on "
           "the critical path, none hidden."),
    "pipeline": ((), 0.0, "Pipeline stages send activations and gradients point to point: "
                 "small messages, counted exposed; the bubble is a term of its own."),
}  # fmt: skip


@dataclass(frozen=True)
class Comm:
    """One kind of communication of one rank in a step, and its estimated time."""

    name: str  # "<dim> <op>", e.g. "dp all_reduce"
    sent_bytes: float  # per rank per step
    group: int  # ranks in the op's group
    link: str
    calls: float  # collectives per step (latency counted per call)
    latency_s: float  # calls x ring steps x latency
    transfer_s: float  # sent bytes / bandwidth
    overlap: str  # its `OVERLAP` row
    hidden: bool  # whether compute may hide it (else: on the critical path)

    seconds = property(lambda self: self.latency_s + self.transfer_s)


def sent_by_op(cfg, measured, dims, params, layers, d_model) -> tuple[list, str]:
    """(name, bytes sent, whole tensor of one call or None) per op, and where from."""
    split = [d for d in ("dp", "tp", "pp") if getattr(dims, d) > 1]
    if not split:
        return [], "One GPU: no communication."
    if measured is not None and len(split) == 1:
        return _measured(measured, split[0], dims.world_size)
    sent, note = _from_config(cfg, dims, params, layers, d_model)
    if measured is not None:
        note += " The run's bytes by op do not say which of its groups sent them."
    return sent, note


def _measured(ranks: list, dim: str, world: int) -> tuple[list, str]:
    """(name, bytes, None) per op, from the busiest rank that measured it."""
    rows = [r["comm_bytes_by_op"] for r in ranks if r.get("comm_bytes_by_op") is not None]
    if not rows:
        raise bad("run_or_config", "the run metered no step (comm_bytes_by_op is None "
                   "on every rank): project its config instead")  # fmt: skip
    ops = sorted({op for row in rows for op in row})
    sent = [(f"{dim} {op}", max(row.get(op, 0) for row in rows), None) for op in ops]
    note = (
        f"Bytes per step by op as the run measured them on its busiest rank ({world} "
        f"ranks, its element sizes); a run counts bytes, not calls: each op is one call."
    )
    return [s for s in sent if s[1] > 0], note


def _from_config(cfg: dict, dims, params, layers, d_model) -> tuple[list, str]:
    """(name, bytes sent, whole tensor of one call) per op from `comm_bytes_per_step`."""
    strategy, backend = cfg.get("strategy", "ddp"), cfg.get("backend", "torch")
    k, half, sent = cfg.get("grad_accum", 1), cfg.get("precision", "fp32") != "fp32", []
    grad_bytes = 2 if half and backend == "deepspeed" else 4
    if dims.dp > 1:
        if params is None:
            raise bad("params", "params is needed for data-parallel bytes")
        dp_strategy = "zero3" if strategy == "hybrid" and cfg.get("fsdp_reshard") else strategy
        dp_strategy = dp_strategy if dp_strategy in ZERO_STAGE else "ddp"
        dp_backend = backend if dp_strategy != "ddp" else "torch"
        whole = params * grad_bytes / (dims.tp * dims.pp)
        total = comm_bytes_per_step(
            dp_strategy, param_bytes=whole, dp=dims.dp, backend=dp_backend, grad_accum=k
        )
        grad_op, rings, param_op = GRADIENT_OPS[(dp_strategy, dp_backend)]
        grads = rings(k) * (dims.dp - 1) / dims.dp * whole
        sent.append((f"dp {grad_op}", grads, whole))
        if param_op and total > grads:
            sent.append((f"dp {param_op}", total - grads, whole))
    if dims.tp > 1 or dims.pp > 1:
        n_layers, act = _activation(cfg, layers, d_model, 2 if half else 4)
        if dims.tp > 1:
            kw = dict(tp=dims.tp, grad_accum=k, activation_bytes=act, layers=n_layers / dims.pp)
            sent.append(("tp all_reduce", comm_bytes_per_step("tp", param_bytes=0, **kw), act))
        if dims.pp > 1:
            stage = 1 if dims.pp > 2 else 0  # a middle stage sends both ways
            kw = dict(pp=dims.pp, grad_accum=k, activation_bytes=act, pp_stage=stage)
            sent.append(("pp send_recv", comm_bytes_per_step("pipeline", param_bytes=0, **kw), act))
    note = (
        f"Bytes per step from the config by nbpar.comm_estimate (the ZeRO paper's ring "
        f"accounting, with what nbpar's implementations move beyond it), gradients of "
        f"{grad_bytes} bytes a parameter (torch keeps fp32 gradients under autocast, "
        f"DeepSpeed reduces 16-bit ones); a collective of the whole tensor is one call."
    )
    return sent, note


def _activation(cfg: dict, layers, d_model, element: int) -> tuple[int, float]:
    """(layers, bytes of one micro-batch's hidden states b x s x d) for tp and pp."""
    gpt, mc = cfg.get("gpt") or {}, cfg.get("model_config") or {}
    if cfg.get("model", "tiny_gpt") == "tiny_gpt":
        mc = {"n_layer": gpt.get("n_layers"), "n_embd": gpt.get("d_model")}
    layers = layers or mc.get("num_hidden_layers") or mc.get("n_layer")
    d_model = d_model or mc.get("hidden_size") or mc.get("n_embd")
    for name, value in (("layers", layers), ("d_model", d_model)):
        if not value:
            raise bad(name, f"{name} is needed to size tp and pipeline messages: give {name}=")
    seq = gpt.get("seq_len", 32)
    return layers, cfg.get("micro_batch", 8) * seq * d_model * element


def _overlap(dim: str, cfg: dict) -> str:
    """The `OVERLAP` row of the ops of dimension ``dim`` under ``cfg``'s strategy."""
    strategy, backend = cfg.get("strategy", "ddp"), cfg.get("backend", "torch")
    if dim == "tp" or strategy == "tp":
        return "tp"
    if dim == "pp" or strategy == "pipeline":
        return "pipeline"
    if strategy == "zero3" or (strategy == "zero2" and backend == "torch"):
        return "zero3"  # FSDP2's zero2 gathers in forward like zero3 (no reshard after it)
    if strategy == "hybrid":
        return "zero3" if cfg.get("fsdp_reshard") else "ddp"
    return "ddp" if strategy == "ddp" else "zero1"


def timed(name: str, sent: float, whole, cfg: dict, dims, hw: Hardware) -> Comm:
    """Alpha-beta time of ``sent`` bytes: calls x ring steps x latency + bytes / bandwidth."""
    dim, op = name.split(" ", 1)
    group = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp}[dim]
    span = {"tp": dims.tp, "dp": dims.dp * dims.tp, "pp": dims.world_size}[dim]
    calls = 1.0 if whole is None else sent / (ring(op, group)[1] * whole)
    link, latency, transfer = hw.call_seconds(op, group, span, sent, calls)
    row = _overlap(dim, cfg)
    return Comm(
        name=name,
        sent_bytes=sent,
        group=group,
        link=link,
        calls=calls,
        latency_s=latency,
        transfer_s=transfer,
        overlap=row,
        hidden=op in OVERLAP[row][0],
    )


def comm_notes(hw: Hardware, source: str, comms) -> list[str]:
    notes = [source, *(hw.assumptions() if comms else ())]
    notes += [OVERLAP[row][2] for row in sorted({c.overlap for c in comms})]
    if any(c.hidden for c in comms):
        notes.append(
            "One stream for communication: what can hide is at most the window compute "
            "leaves it; exposed = max(0, hideable comm - window) + comm on the critical path."
        )
    return notes
