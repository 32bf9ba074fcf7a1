"""Strategies and degrees: which strategies, backends and schedules exist, what each
strategy splits, and the (dp, tp, pp) it gets on N engines.

The one place for these rules: `TrainConfig.validate` and `TrainConfig.dims`, the memory
estimator, the CLI and the StrategyPicker ask here, and the runners in `nbpar.parallel`
trust what passed. Pure Python: nothing heavy is imported here.
"""

from __future__ import annotations

import math
from numbers import Integral

from nbpar.dims import ParallelDims

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "hybrid")
BACKENDS = ("torch", "deepspeed")
OFFLOADS = ("none", "optimizer", "params")
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")
#: the ZeRO stage (Rajbhandari et al. 2020) of each data-parallel strategy; ddp is stage 0
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
PIPELINED = ("pipeline", "hybrid")
DEEPSPEED_STRATEGIES = DATA_PARALLEL + PIPELINED
GPT_ONLY = ("pipeline", "tp", "hybrid")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DEFAULT_SCHEDULE = "1f1b"
INTERLEAVED_CHUNKS = 2  # model chunks per rank in the interleaved 1F1B schedule
DEGREES = ("dp", "tp", "pp")
#: the degree a strategy splits along, which takes the engines the other degrees leave
OWN_DEGREE = {
    "ddp": "dp",
    "zero1": "dp",
    "zero2": "dp",
    "zero3": "dp",
    "pipeline": "pp",
    "tp": "tp",
}
HEAD_WORDS = {"heads": "attention heads", "kv_heads": "key/value heads"}


def check_degrees(strategy: str, dp=None, tp=None, pp=None) -> dict[str, int | None]:
    """The degrees as given ({"dp", "tp", "pp"}: a positive integer or None), checked
    against what holds on any number of engines."""
    given = {"dp": dp, "tp": tp, "pp": pp}
    for k, v in given.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, Integral) or v < 1):
            raise ValueError(f"{k} must be a positive integer or None, got {v!r}")
        given[k] = None if v is None else int(v)
    if strategy == "hybrid" and dp is None and tp is None and pp is None:
        raise ValueError(
            "strategy 'hybrid' needs explicit degrees: set at least two of dp, "
            "tp and pp so that dp x tp x pp equals the number of engines"
        )
    if strategy == "single":
        for k, v in given.items():
            if v not in (None, 1):
                raise ValueError(f"strategy 'single' requires dp=tp=pp=1, got {k}={v}")
    return given


def splits(strategy: str, backend: str) -> tuple[str, ...]:
    """The degrees nbpar runs ``strategy`` with on ``backend``: its own one; torch ZeRO
    also over tensor-parallel shards (FSDP + TP, as torchtitan); hybrid pp x dp x tp
    (DeepSpeed's PipelineModule: pp x dp)."""
    if strategy == "hybrid":
        return ("pp", "dp") if backend == "deepspeed" else DEGREES
    own = OWN_DEGREE.get(strategy)
    if own is None:
        return ()
    if strategy.startswith("zero") and backend == "torch":
        return (own, "tp")
    return (own,)


def settable_degrees(strategy: str, backend: str) -> tuple[str, ...]:
    """The degrees a user sets for ``strategy`` on ``backend``: those it `splits` along,
    less its own one, which takes what the others leave."""
    return tuple(d for d in splits(strategy, backend) if d != OWN_DEGREE.get(strategy))


def _check_splits(strategy: str, backend: str, given: dict) -> None:
    allowed = splits(strategy, backend)
    for k, v in given.items():
        if v in (None, 1) or k in allowed:
            continue
        if strategy == "hybrid":
            raise ValueError(
                f"the DeepSpeed pipeline backend has no tensor parallelism ({k}={v}); "
                f"use backend 'torch' with strategy 'hybrid'"
            )
        raise ValueError(
            f"strategy {strategy!r} does not split along {k} ({k}={v}); "
            f"use strategy 'hybrid' to combine dimensions"
        )


def resolve_degrees(
    strategy: str, world_size: int, dp=None, tp=None, pp=None, *, backend: str | None = None
) -> ParallelDims:
    """The (pp, dp, tp) topology of ``strategy`` on ``world_size`` engines.

    The strategy's own degree (dp for ddp/zero*, pp for pipeline, tp for tp) takes what
    the given others leave: zero3 with tp=2 on 8 engines is dp=4 x tp=2. 'single' is one
    engine; 'hybrid' takes the degrees given, 1 where none is. The degrees multiply to
    ``world_size``. ``backend`` None resolves any layout (the estimator's, as in the
    papers); with a backend, only the splits nbpar runs on it (`splits`) pass.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    world_size = int(world_size)
    given = check_degrees(strategy, **{"dp": dp, "tp": tp, "pp": pp})
    if backend is not None:
        _check_splits(strategy, backend, given)
    if strategy == "single" and world_size != 1:
        raise ValueError(
            f"strategy 'single' runs on exactly one engine, got world size {world_size}"
        )
    own = OWN_DEGREE.get(strategy)
    if own is not None and given[own] is None:
        others = {k: v for k, v in given.items() if k != own and v not in (None, 1)}
        product = math.prod(others.values())
        if world_size % product:
            named = " x ".join(f"{k}={v}" for k, v in others.items())
            raise ValueError(
                f"{named} must be a positive divisor of the number of engines "
                f"({world_size}); {world_size} is not divisible by {product}"
            )
        given[own] = world_size // product
    return ParallelDims(**{k: v or 1 for k, v in given.items()}, world_size=world_size)


def check_pipeline_schedule(
    schedule: str, pp: int, micro_batches: int, n_layers: int, backend: str = "torch"
) -> int:
    """The one rule for a pipeline's schedule; returns the model chunks per rank.

    1F1B and interleaved keep at most pp micro-batches in flight, so they need at
    least pp of them (DeepSpeed's engine runs any number); every stage needs a layer.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}"
        )
    if backend == "torch" and schedule != "gpipe" and micro_batches < pp:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many micro-batches "
            f"(grad_accum={micro_batches}) as pipeline stages (pp={pp}); "
            f"raise grad_accum or use schedule='gpipe'"
        )
    virtual = INTERLEAVED_CHUNKS if schedule == "interleaved" else 1
    if pp * virtual > n_layers:
        raise ValueError(
            f"schedule {schedule!r} with pp={pp} needs {pp * virtual} "
            f"layers, gpt.n_layers={n_layers}"
        )
    return virtual


def check_combination(cfg) -> None:
    """Raise ValueError when ``cfg``'s strategy, backend, model, schedule, offload and
    precision do not go together (what nbpar's runners can run)."""
    s, b = cfg.strategy, cfg.backend
    if s not in PIPELINED and cfg.schedule != DEFAULT_SCHEDULE:
        raise ValueError(
            f"schedule={cfg.schedule!r} applies only to strategies pipeline and hybrid, not {s!r}"
        )
    if s in GPT_ONLY and cfg.model == "simple_cnn":
        # hf:* and models declaring a parallel plan are split too (checked when built)
        raise ValueError(
            f"strategy {s!r} needs model 'tiny_gpt' (it splits transformer "
            f"layers), got {cfg.model!r}"
        )
    if b == "deepspeed" and s not in DEEPSPEED_STRATEGIES:
        raise ValueError(
            f"backend 'deepspeed' supports strategies {', '.join(DEEPSPEED_STRATEGIES)}, not {s!r}"
        )
    if s in PIPELINED and b == "deepspeed":
        _check_deepspeed_pipeline(cfg)
    if cfg.offload != "none":
        if b != "deepspeed":
            raise ValueError(f"offload={cfg.offload!r} needs backend='deepspeed'")
        check_offload(cfg.offload, s)
    if cfg.precision == "fp16" and b != "deepspeed":
        raise ValueError(
            "precision='fp16' needs backend='deepspeed' (its loss scaler); "
            "use 'bf16' or 'fp32' with backend='torch'"
        )
    if cfg.fsdp_reshard is not None and not (b == "torch" and s in ("zero2", "zero3")):
        raise ValueError(
            f"fsdp_reshard applies only to strategies zero2/zero3 with backend "
            f"'torch', not {s!r}/{b!r}"
        )
    if cfg.deepspeed_config is not None and b != "deepspeed":
        raise ValueError("deepspeed_config needs backend='deepspeed'")


def check_offload(offload: str, strategy: str) -> None:
    """ZeRO-Offload moves what ZeRO partitions: offload='optimizer' needs ZeRO stage 1, 2
    or 3, offload='params' stage 3."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}.")
    if offload == "none":
        return
    least = 3 if offload == "params" else 1
    need = [s for s, stage in ZERO_STAGE.items() if stage >= least]
    if strategy not in need:
        raise ValueError(
            f"offload={offload!r} needs strategy {' or '.join(need)}, got {strategy!r}"
        )


def _check_deepspeed_pipeline(cfg) -> None:
    """What DeepSpeed's PipelineModule runs here: a model with a plan (checked when it is
    built), 1F1B, fp32 or bf16."""
    if cfg.schedule != "1f1b":
        raise ValueError(
            f"DeepSpeed's pipeline engine runs only the 1f1b schedule, got {cfg.schedule!r}"
        )
    if cfg.precision == "fp16":
        raise ValueError("DeepSpeed pipeline runs here in precision fp32 or bf16, got 'fp16'")


def check_model_degrees(cfg, world_size: int | None) -> None:
    """Raise ValueError when ``cfg``'s degrees do not fit its model: tp must divide the
    heads and widths, pp stages need layers and a schedule that fits them."""
    if world_size is not None:
        d = cfg.dims(world_size)
        tp, pp = d.tp, d.pp
    else:
        check_degrees(cfg.strategy, cfg.dp, cfg.tp, cfg.pp)
        tp, pp = cfg.tp or 1, cfg.pp or 1
    from nbpar.model.registry import known_shape

    layers, where = known_shape(cfg)
    gpt = cfg.gpt
    if cfg.model == "tiny_gpt" and tp > 1 and (gpt.n_heads % tp or gpt.d_model % tp):
        raise ValueError(
            f"tp={tp} must divide gpt.n_heads={gpt.n_heads} and gpt.d_model={gpt.d_model}"
        )
    if tp > 1 and where:  # a transformers family: heads from its config
        from nbpar.model.hf import shape

        for k in ("heads", "kv_heads"):
            n = shape(cfg.model, cfg.model_config)[k]
            if n % tp:
                raise ValueError(f"tp={tp} must divide the {HEAD_WORDS[k]} of {cfg.model} ({n})")
    if layers is not None and pp > layers:
        raise ValueError(
            f"pp={pp} pipeline stages need at least {pp} layers, {where or 'gpt.n_layers'}={layers}"
        )
    if cfg.strategy in PIPELINED and pp > 1 and layers is not None:
        check_pipeline_schedule(cfg.schedule, pp, cfg.grad_accum, layers, cfg.backend)
