"""What the same run would cost on real GPUs: an estimate from FLOPs and bytes, never a
measurement, with every assumption printed beside the answer.

Compute: 6 FLOPs a parameter and token (Kaplan et al. 2020) over peak bf16 FLOP/s times
an assumed utilisation. Communication (`nbpar.project_comm`): the bytes each rank sends
by op (`nbpar.comm_estimate` or what a run measured), timed by `nbpar.hardware`'s
alpha-beta model on the link its group uses; `OVERLAP` says how much of it compute can
hide. Pure Python, no torch.
"""

from __future__ import annotations

import sys
import textwrap
import types
from dataclasses import asdict, dataclass

from nbpar.checks import checkpointing_kind, choice, positive_int
from nbpar.hardware import Hardware, lookup, positive_number
from nbpar.project_comm import OVERLAP, Comm, bad, comm_notes, sent_by_op, timed
from nbpar.strategies import STRATEGIES, resolve_degrees

DEFAULT_UTILISATION = 0.4
HEALTHY_SHARE = 0.2  # exposed communication under 20% of the step: the classic tutorial's line
TEXT_MODELS = ("tiny_gpt", "hf:gpt2", "hf:llama")
BUBBLE = (
    "Pipeline bubble: (pp - 1) / m = {p}/{k} of the compute idle for m = {k} micro-batches "
    "(GPipe and 1F1B alike; Huang et al. 2019, Narayanan et al. 2021)."
)


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
        raise bad("run_or_config", f"run_or_config must be a TrainConfig, a dict of its "
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
    sent, source = sent_by_op(cfg, measured, dims, params, layers, d_model)
    comms = tuple(timed(name, b, whole, cfg, dims, hw) for name, b, whole in sent)
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
        *comm_notes(hw, source, comms),
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
        raise bad("world_size", f"world_size={world} is more than {hw.name}'s {hw.gpus} GPUs")
    dims = resolve_degrees(strategy, world, cfg.get("dp"), cfg.get("tp"), cfg.get("pp"))
    return cfg, measured, dims


def _flops(cfg, dims, params, tokens, flops) -> tuple[float, str]:
    """The whole step's FLOPs over all GPUs, and how they were found."""
    if flops is not None:
        return flops, f"Compute: {flops:.3g} FLOP a step as given, split evenly over the GPUs."
    if params is None:
        raise bad("params", "params (the parameter count) is needed for 6 x params x "
                   "tokens; or give flops_per_step")  # fmt: skip
    if tokens is None:
        if cfg.get("model", "tiny_gpt") not in TEXT_MODELS:
            raise bad("tokens_per_step", f"model={cfg.get('model')!r} reads no tokens: "
                       f"give tokens_per_step or flops_per_step")  # fmt: skip
        seq = (cfg.get("gpt") or {}).get("seq_len", 32)
        tokens = cfg.get("micro_batch", 8) * cfg.get("grad_accum", 1) * seq * dims.dp
    # full recomputation runs each forward again; selective recomputes only the attention
    # core, which the 6 N D count leaves out anyway (Korthikanti et al. 2022)
    per = 8 if checkpointing_kind(cfg.get("activation_checkpointing")) == "full" else 6
    note = (
        f"Compute: {per} x {params:.3g} parameters x {tokens:,.0f} tokens a step "
        f"(forward 2 + backward 4 FLOPs a parameter and token, Kaplan et al. 2020 as the "
        f"Chinchilla paper uses it"
        + ("; +2 to recompute the forward under full activation checkpointing" if per == 8 else "")
        + f"), split evenly over the {dims.world_size} GPUs: each dp rank its tokens, "
        f"tp x pp their share of the parameters."
    )
    return per * params * tokens, note


class _CallableModule(types.ModuleType):
    """``nbpar.project`` is this module and, called, `project`: importing the module
    rebinds the name on ``nbpar``, so the module itself answers the call."""

    def __call__(self, *args, **kwargs) -> Projection:
        return project(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
