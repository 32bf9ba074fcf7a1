"""What the same run would cost on real GPUs: an estimate from FLOPs and bytes, never a
measurement, with every assumption printed beside the answer.

Compute: 6 FLOPs a parameter and token (Kaplan et al. 2020) over peak bf16 FLOP/s times
an assumed utilisation. Communication: the bytes each rank sends by op (`nbpar.comm_estimate`
or what a run measured), timed by `nbpar.hardware`'s alpha-beta model on the link its group
uses; `OVERLAP` says how much of it compute can hide. Pure Python, no torch.
"""

from __future__ import annotations

import sys
import textwrap
import types
from dataclasses import asdict, dataclass

from nbpar.checks import choice, positive_int
from nbpar.comm_estimate import comm_bytes_per_step
from nbpar.errors import ConfigError
from nbpar.hardware import Hardware, lookup, positive_number, ring
from nbpar.strategies import STRATEGIES, ZERO_STAGE, resolve_degrees

DEFAULT_UTILISATION = 0.4
HEALTHY_SHARE = 0.2  # exposed communication under 20% of the step: the classic tutorial's line
BACKWARD = 2 / 3  # backward is twice the forward's FLOPs: 2/3 of a step's compute
TEXT_MODELS = ("tiny_gpt", "hf:gpt2", "hf:llama")
BUBBLE = (
    "Pipeline bubble: (pp - 1) / m = {p}/{k} of the compute idle for m = {k} micro-batches "
    "(GPipe and 1F1B alike; Huang et al. 2019, Narayanan et al. 2021)."
)


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


@dataclass(frozen=True)
class Projection:
    """A step on real hardware, estimated: compute, communication by op, what is exposed."""

    hardware: str
    layout: str
    utilisation: float
    flops_per_rank: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # "<dim> <op>" -> seconds
    comms: tuple[Comm, ...]
    hideable_s: float  # compute time that can hide communication
    exposed_s: float  # communication no compute hides
    step_s: float  # compute + bubble + exposed
    exposed_share: float  # exposed_s / step_s
    healthy: bool  # exposed_share < HEALTHY_SHARE
    assumptions: tuple[str, ...]

    def table(self) -> str:
        """Every figure with how it was found, the verdict, then every assumption."""
        rows = [
            f"estimate (not a measurement): {self.layout}",
            f"on {self.hardware}",
            f"  {'compute':22s} {_s(self.compute_s)}  {self.flops_per_rank:.3g} FLOP per GPU "
            f"at {self.utilisation:g} of peak",
        ]
        for c in self.comms:
            rows.append(
                f"  {c.name:22s} {_s(c.seconds)}  {c.sent_bytes / 1e9:.3g} GB over "
                f"{c.link}, {c.group} ranks, {c.calls:.3g} call(s): latency "
                f"{_s(c.latency_s).strip()} + transfer {_s(c.transfer_s).strip()}, "
                + ("hideable" if c.hidden else "critical path")
            )
        if self.bubble_s:
            rows.append(f"  {'pipeline bubble':22s} {_s(self.bubble_s)}")
        total = sum(self.comm_s.values())
        rows += [
            f"  {'exposed communication':22s} {_s(self.exposed_s)}  of {_s(total).strip()} "
            f"in flight, {_s(self.hideable_s).strip()} of compute can hide it",
            f"  {'step':22s} {_s(self.step_s)}  exposed communication "
            f"{self.exposed_share:.1%} of the step: "
            + ("healthy" if self.healthy else "not healthy")
            + f" (healthy: under {HEALTHY_SHARE:.0%})",
            "assumptions:",
        ]
        return "\n".join(rows + [describe_assumptions(self.assumptions)])

    __str__ = table

    def to_json(self) -> dict:
        comms = [{**asdict(c), "seconds": c.seconds} for c in self.comms]
        return {**asdict(self), "comms": comms, "assumptions": list(self.assumptions)}


_WRAP = textwrap.TextWrapper(96, initial_indent="  - ", subsequent_indent="    ")
_WRAP.break_on_hyphens = False


def describe_assumptions(notes) -> str:
    """Assumptions as the table prints them, one wrapped bullet each, repeats once."""
    return "\n".join(_WRAP.fill(a) for a in dict.fromkeys(notes))


def _bad(field: str, message: str) -> ConfigError:
    return ConfigError(message, fields=(field,))


def _s(seconds: float) -> str:
    return f"{seconds:9.3g} s"


def _as_dict(run_or_config) -> dict:
    """A TrainConfig, a dict of its fields, a Run or its ``result()`` as a plain dict."""
    if callable(getattr(run_or_config, "result", None)):
        run_or_config = run_or_config.result()
    if hasattr(run_or_config, "to_dict"):
        return run_or_config.to_dict()
    if not isinstance(run_or_config, dict):
        what = type(run_or_config).__name__
        raise _bad("run_or_config", f"run_or_config must be a TrainConfig, a dict of its "
                   f"fields or a run's result, got {what}")  # fmt: skip
    return dict(run_or_config)


def project(
    run_or_config,
    hardware="8xH100-SXM",
    *,
    params: float | None = None,
    tokens_per_step: float | None = None,
    flops_per_step: float | None = None,
    utilisation: float = DEFAULT_UTILISATION,
    world_size: int | None = None,
    layers: int | None = None,
    d_model: int | None = None,
) -> Projection:
    """One optimizer step of ``run_or_config`` on ``hardware`` (a `nbpar.hardware` preset
    or `Hardware`), estimated. ``run_or_config``: a TrainConfig or a dict of its fields
    (bytes by `nbpar.comm_estimate`), or a finished run (`Run`, its ``result()``, ``nbpar
    train --json``, ``nbpar.simulate(...)``: its measured bytes by op where one dimension is
    split). ``params``: the parameter count; ``tokens_per_step``: the global batch (default
    micro_batch x grad_accum x seq_len x dp); ``flops_per_step``: the whole step's FLOPs
    instead of 6 x params x tokens; ``world_size``: a config's GPUs (default: all);
    ``layers``, ``d_model``: size tp and pipeline messages where the config does not."""
    hw = lookup(hardware)
    utilisation = positive_number("utilisation", utilisation, upper=1.0)
    params = positive_number("params", params, optional=True)
    tokens_per_step = positive_number("tokens_per_step", tokens_per_step, optional=True)
    flops_per_step = positive_number("flops_per_step", flops_per_step, optional=True)
    cfg, measured, dims = _layout(run_or_config, world_size, hw)
    flops, compute_note = _flops(cfg, dims, params, tokens_per_step, flops_per_step)
    compute = flops / dims.world_size / (hw.device.bf16_tflops * 1e12 * utilisation)
    sent, source = _sent(cfg, measured, dims, params, layers, d_model)
    comms = tuple(_timed(name, b, whole, cfg, dims, hw) for name, b, whole in sent)
    k = cfg.get("grad_accum", 1)
    bubble = compute * (dims.pp - 1) / k
    hideable = compute * max((OVERLAP[c.overlap][1] for c in comms if c.hidden), default=0)
    hidden = sum(c.seconds for c in comms if c.hidden)
    exposed = max(0.0, hidden - hideable) + sum(c.seconds for c in comms if not c.hidden)
    step = compute + bubble + exposed
    notes = [
        compute_note,
        f"Each GPU sustains {utilisation:g} of its {hw.device.bf16_tflops:g} TFLOP/s dense "
        f"bf16 peak ({hw.device.name}, datasheet): the utilisation is an assumption "
        f"(well-tuned large runs report 0.3-0.5).",
        *_comm_notes(hw, source, comms),
        *[BUBBLE.format(p=dims.pp - 1, k=k)] * (dims.pp > 1),
        f"Healthy: exposed communication under {HEALTHY_SHARE:.0%} of the step (the "
        f"classic DDP tutorial's rule of thumb).",
    ]
    return Projection(
        hardware=hw.describe(),
        layout=f"{cfg.get('strategy', 'ddp')} dp {dims.dp} x tp {dims.tp} x pp {dims.pp}",
        utilisation=utilisation,
        flops_per_rank=flops / dims.world_size,
        compute_s=compute,
        bubble_s=bubble,
        comm_s={c.name: c.seconds for c in comms},
        comms=comms,
        hideable_s=hideable,
        exposed_s=exposed,
        step_s=step,
        exposed_share=exposed / step,
        healthy=exposed / step < HEALTHY_SHARE,
        assumptions=tuple(notes),
    )


def _layout(run_or_config, world_size, hw: Hardware):
    """(config dict, measured ranks or None, ParallelDims), checked."""
    given = _as_dict(run_or_config)
    measured = given.get("ranks") if "config" in given else None
    cfg = given["config"] if measured is not None else given
    strategy = cfg.get("strategy", "ddp")
    choice("strategy", strategy, STRATEGIES)
    world = (1 if strategy == "single" else hw.gpus) if world_size is None else world_size
    if measured is not None:  # a run keeps its own world (a simulation says it)
        world = cfg.get("world_size") or len(measured)
    if positive_int("world_size", world) > hw.gpus:
        raise _bad("world_size", f"world_size={world} is more than {hw.name}'s {hw.gpus} GPUs")
    dims = resolve_degrees(strategy, world, cfg.get("dp"), cfg.get("tp"), cfg.get("pp"))
    return cfg, measured, dims


def _sent(cfg, measured, dims, params, layers, d_model) -> tuple[list, str]:
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


def _flops(cfg, dims, params, tokens, flops) -> tuple[float, str]:
    """The whole step's FLOPs over all GPUs, and how they were found."""
    if flops is not None:
        return flops, f"Compute: {flops:.3g} FLOP a step as given, split evenly over the GPUs."
    if params is None:
        raise _bad("params", "params (the parameter count) is needed for 6 x params x "
                   "tokens; or give flops_per_step")  # fmt: skip
    if tokens is None:
        if cfg.get("model", "tiny_gpt") not in TEXT_MODELS:
            raise _bad("tokens_per_step", f"model={cfg.get('model')!r} reads no tokens: "
                       f"give tokens_per_step or flops_per_step")  # fmt: skip
        seq = (cfg.get("gpt") or {}).get("seq_len", 32)
        tokens = cfg.get("micro_batch", 8) * cfg.get("grad_accum", 1) * seq * dims.dp
    per = 8 if cfg.get("activation_checkpointing") else 6
    note = (
        f"Compute: {per} x {params:.3g} parameters x {tokens:,.0f} tokens a step "
        f"(forward 2 + backward 4 FLOPs a parameter and token, Kaplan et al. 2020 as the "
        f"Chinchilla paper uses it"
        + ("; +2 to recompute the forward under activation checkpointing" if per == 8 else "")
        + f"), split evenly over the {dims.world_size} GPUs: each dp rank its tokens, "
        f"tp x pp their share of the parameters."
    )
    return per * params * tokens, note


def _measured(ranks: list, dim: str, world: int) -> tuple[list, str]:
    """(name, bytes, None) per op, from the busiest rank that measured it."""
    rows = [r["comm_bytes_by_op"] for r in ranks if r.get("comm_bytes_by_op") is not None]
    if not rows:
        raise _bad("run_or_config", "the run metered no step (comm_bytes_by_op is None "
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
            raise _bad("params", "params is needed for data-parallel bytes")
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
            raise _bad(name, f"{name} is needed to size tp and pipeline messages: give {name}=")
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


def _timed(name: str, sent: float, whole, cfg: dict, dims, hw: Hardware) -> Comm:
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


def _comm_notes(hw: Hardware, source: str, comms) -> list[str]:
    notes = [source, *(hw.assumptions() if comms else ())]
    notes += [OVERLAP[row][2] for row in sorted({c.overlap for c in comms})]
    if any(c.hidden for c in comms):
        notes.append(
            "One stream for communication: what can hide is at most the window compute "
            "leaves it; exposed = max(0, hideable comm - window) + comm on the critical path."
        )
    return notes


class _CallableModule(types.ModuleType):
    """``nbpar.project`` is this module and, called, `project`: importing the module
    rebinds the name on ``nbpar``, so the module itself answers the call."""

    def __call__(self, *args, **kwargs) -> Projection:
        return project(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
