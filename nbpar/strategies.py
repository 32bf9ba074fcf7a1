"""Strategies and degrees: which strategies, backends and schedules exist, what each
strategy splits, and the (dp, tp, pp, cp, ep) it gets on N engines.

The one place for these rules: `TrainConfig.validate` and `TrainConfig.dims`, the memory
estimator, the CLI and the StrategyPicker ask here, and the runners in `nbpar.parallel`
trust what passed. Pure Python: nothing heavy is imported here.
"""

from __future__ import annotations

import math

from nbpar.checks import choice, positive_int
from nbpar.dims import ParallelDims
from nbpar.errors import ConfigError

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "hybrid", "cp", "ep")
BACKENDS = ("torch", "deepspeed")
OFFLOADS = ("none", "optimizer", "params")
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")
#: the ZeRO stage (Rajbhandari et al. 2020) of each data-parallel strategy; ddp is stage 0
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
PIPELINED = ("pipeline", "hybrid")
DEEPSPEED_STRATEGIES = DATA_PARALLEL + PIPELINED + ("cp", "ep")
GPT_ONLY = ("pipeline", "tp", "hybrid", "cp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
DEFAULT_SCHEDULE = "1f1b"
INTERLEAVED_CHUNKS = 2  # model chunks per rank in the interleaved 1F1B schedule
#: schedules whose ranks each hold two model chunks in a V (stage r and 2p-1-r)
V_SCHEDULES = ("zbv", "dualpipev")
#: the zero-bubble schedules (Qi et al. 2023): backward split into input and weight parts
ZERO_BUBBLE = V_SCHEDULES
DEGREES = ("dp", "tp", "pp", "cp", "ep")
#: the degrees whose product is the world size (ep is carved out of dp)
WORLD_DEGREES = ("dp", "tp", "pp", "cp")
ATTENTIONS = ("ring", "ulysses")
DEFAULT_ATTENTION = "ring"
#: models whose attention context parallelism replaces (it needs to know their positions)
CP_MODELS = ("tiny_gpt", "hf:llama")
#: models that declare a sequence-parallel split of their blocks (ModelPlan.sp)
SP_MODELS = ("tiny_gpt", "hf:llama")
#: the degree a strategy splits along, which takes the engines the other degrees leave
OWN_DEGREE = {
    "ddp": "dp",
    "zero1": "dp",
    "zero2": "dp",
    "zero3": "dp",
    "pipeline": "pp",
    "tp": "tp",
    "cp": "cp",
    "ep": "dp",
}
HEAD_WORDS = {"heads": "attention heads", "kv_heads": "key/value heads"}
#: strategies the torch backend runs with FSDP2 (`fully_shard`) when asked to
FSDP_STRATEGIES = ("zero2", "zero3", "hybrid", "cp")


def engines_for(strategy: str, pool_size: int) -> int:
    """How many of a pool's engines a run of ``strategy`` uses: 'single' is the
    one-process reference and runs on one, every other strategy on all of them."""
    return 1 if strategy == "single" else pool_size


def reshard_after_forward(strategy: str, fsdp_reshard: bool | None) -> bool | None:
    """FSDP2's ``reshard_after_forward`` for ``strategy``: an explicit ``fsdp_reshard``
    wins; ZeRO-3 frees the gathered parameters after forward (True), ZeRO-1/2 keep them
    (False: FSDP2 without resharding, as torch ZeRO over tensor-parallel shards runs);
    None = the strategy uses no FSDP2 (replicas that all-reduce their gradients)."""
    if fsdp_reshard is not None:
        return fsdp_reshard
    if strategy in ZERO_STAGE and strategy != "ddp":
        return strategy == "zero3"
    return None


def is_moe(model) -> bool:
    """Whether ``model`` names a mixture-of-experts model (its name says "moe", or it is
    a transformers MoE family), the kind expert parallelism splits."""
    from nbpar.model.registry import MOE_MODELS

    return isinstance(model, str) and ("moe" in model.lower() or model in MOE_MODELS)


def check_degrees(
    strategy: str, dp=None, tp=None, pp=None, cp=None, ep=None
) -> dict[str, int | None]:
    """The degrees as given ({"dp", "tp", "pp", "cp", "ep"}: a positive integer or None),
    checked against what holds on any number of engines."""
    values = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    given = {k: positive_int(k, v, optional=True) for k, v in values.items()}
    if strategy == "hybrid" and all(given[k] is None for k in WORLD_DEGREES):
        raise ConfigError(
            "strategy 'hybrid' needs explicit degrees: set at least two of dp, "
            "tp, pp and cp so that dp x tp x pp x cp equals the number of engines",
            fields=WORLD_DEGREES,
        )
    if strategy == "single":
        for k, v in given.items():
            if v not in (None, 1):
                raise ConfigError(
                    f"strategy 'single' requires dp=tp=pp=cp=ep=1, got {k}={v}",
                    fields=(k, "strategy"),
                )
    return given


def splits(strategy: str, backend: str) -> tuple[str, ...]:
    """The degrees nbpar runs ``strategy`` with on ``backend``: its own one; torch ZeRO
    also over tensor-parallel shards (FSDP + TP, as torchtitan); context parallel over
    data-parallel replicas (dp x cp), expert parallel inside data parallel (ep of dp);
    hybrid every degree (DeepSpeed's PipelineModule: pp x dp)."""
    if strategy == "hybrid":
        return ("pp", "dp") if backend == "deepspeed" else DEGREES
    if strategy == "cp":
        return ("cp", "dp")
    if strategy == "ep":
        return ("dp", "ep")
    own = OWN_DEGREE.get(strategy)
    if own is None:
        return ()
    if strategy.startswith("zero") and backend == "torch":
        return (own, "tp")
    return (own,)


def settable_degrees(strategy: str, backend: str) -> tuple[str, ...]:
    """The degrees a user sets for ``strategy`` on ``backend``: those it `splits` along,
    less its own one, which takes what the others leave. Context parallelism is set by
    its own degree (how many ranks split a sequence), data parallelism taking the rest."""
    if strategy == "cp":
        return ("cp",)
    return tuple(d for d in splits(strategy, backend) if d != OWN_DEGREE.get(strategy))


def _check_splits(strategy: str, backend: str, given: dict) -> None:
    allowed = splits(strategy, backend)
    for k, v in given.items():
        if v in (None, 1) or k in allowed:
            continue
        if strategy == "hybrid":
            what = "tensor" if k == "tp" else {"cp": "context", "ep": "expert"}.get(k, k)
            raise ConfigError(
                f"the DeepSpeed pipeline backend has no {what} parallelism ({k}={v}); "
                f"use backend 'torch' with strategy 'hybrid'",
                fields=(k, "backend"),
            )
        raise ConfigError(
            f"strategy {strategy!r} does not split along {k} ({k}={v}); "
            f"use strategy 'hybrid' to combine dimensions",
            fields=(k, "strategy"),
        )


def resolve_degrees(
    strategy: str,
    world_size: int,
    dp=None,
    tp=None,
    pp=None,
    cp=None,
    ep=None,
    *,
    backend: str | None = None,
) -> ParallelDims:
    """The (pp, dp, cp, tp) topology, and ep, of ``strategy`` on ``world_size`` engines.

    The strategy's own degree (dp for ddp/zero*/ep, pp for pipeline, tp for tp, cp for
    cp) takes what the given others leave: zero3 with tp=2 on 8 engines is dp=4 x tp=2.
    'single' is one engine; 'hybrid' takes the degrees given, 1 where none is. dp, tp,
    pp and cp multiply to ``world_size``; ep divides dp, and strategy 'ep' shares the
    experts over every data-parallel rank unless ep says fewer. ``backend`` None resolves
    any layout (the estimator's, as in the papers); with a backend, only the splits nbpar
    runs on it (`splits`) pass.
    """
    world_size = positive_int("world_size", world_size)
    given = check_degrees(strategy, dp, tp, pp, cp, ep)
    if backend is not None:
        _check_splits(strategy, backend, given)
    if engines_for(strategy, world_size) != world_size:
        raise ConfigError(
            f"strategy 'single' runs on exactly one engine, got world size {world_size}",
            fields=("strategy",),
        )
    own = OWN_DEGREE.get(strategy)
    if strategy == "cp" and given["cp"] is not None and given["dp"] is None:
        own = "dp"  # cp as given: data parallelism takes the engines it leaves
    if own is not None and given[own] is None:
        others = {
            k: v for k, v in given.items() if k in WORLD_DEGREES and k != own and v not in (None, 1)
        }
        product = math.prod(others.values())
        if world_size % product:
            named = " x ".join(f"{k}={v}" for k, v in others.items())
            raise ConfigError(
                f"{named} must be a positive divisor of the number of engines "
                f"({world_size}); {world_size} is not divisible by {product}",
                fields=tuple(others),
            )
        given[own] = world_size // product
    if strategy == "ep" and given["ep"] is None:
        given["ep"] = given["dp"]
    return ParallelDims(**{k: v or 1 for k, v in given.items()}, world_size=world_size)


def check_pipeline_schedule(
    schedule: str, pp: int, micro_batches: int, n_layers: int, backend: str = "torch"
) -> int:
    """The one rule for a pipeline's schedule; returns the model chunks per rank.

    1F1B and interleaved keep at most pp micro-batches in flight, so they need at
    least pp of them (DeepSpeed's engine runs any number); ZB-V runs any number (torch
    leaves the missing ones' slots empty); DualPipeV needs one per stage, 2 x pp (torch's
    ScheduleDualPipeV refuses fewer); every stage needs a layer.
    """
    choice("schedule", schedule, SCHEDULES)
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ConfigError(
            f"schedule 'dualpipev' needs at least one micro-batch per stage, 2 x pp = "
            f"{2 * pp} (grad_accum={micro_batches}); raise grad_accum or use schedule='zbv'",
            fields=("grad_accum", "schedule", "pp"),
        )
    if backend == "torch" and schedule in ("1f1b", "interleaved") and micro_batches < pp:
        raise ConfigError(
            f"schedule {schedule!r} needs at least as many micro-batches "
            f"(grad_accum={micro_batches}) as pipeline stages (pp={pp}); "
            f"raise grad_accum or use schedule='gpipe'",
            fields=("grad_accum", "schedule", "pp"),
        )
    virtual = INTERLEAVED_CHUNKS if schedule in ("interleaved", *V_SCHEDULES) else 1
    if pp * virtual > n_layers:
        raise ConfigError(
            f"schedule {schedule!r} with pp={pp} needs {pp * virtual} "
            f"layers, gpt.n_layers={n_layers}",
            fields=("schedule", "pp", "gpt.n_layers"),
        )
    return virtual


def check_combination(cfg) -> None:
    """Raise ValueError when ``cfg``'s strategy, backend, model, schedule, offload and
    precision do not go together (what nbpar's runners can run)."""
    s, b = cfg.strategy, cfg.backend
    _check_new_dimensions(cfg)
    if s not in PIPELINED and cfg.schedule != DEFAULT_SCHEDULE:
        raise ConfigError(
            f"schedule={cfg.schedule!r} applies only to strategies pipeline and hybrid, not {s!r}",
            fields=("schedule", "strategy"),
        )
    if s in GPT_ONLY and cfg.model == "simple_cnn":
        # hf:* and models declaring a parallel plan are split too (checked when built)
        raise ConfigError(
            f"strategy {s!r} needs model 'tiny_gpt', 'hf:llama', 'hf:gpt2' or one with a "
            f"parallel_plan() (it splits transformer layers), got {cfg.model!r}",
            fields=("model", "strategy"),
        )
    if b == "deepspeed" and s not in DEEPSPEED_STRATEGIES:
        raise ConfigError(
            f"backend 'deepspeed' supports strategies {', '.join(DEEPSPEED_STRATEGIES)}, not {s!r}",
            fields=("backend", "strategy"),
        )
    if s in PIPELINED and b == "deepspeed":
        _check_deepspeed_pipeline(cfg)
    if cfg.offload != "none":
        if b != "deepspeed":
            raise ConfigError(
                f"offload={cfg.offload!r} needs backend='deepspeed'", fields=("offload", "backend")
            )
        check_offload(cfg.offload, s)
    if cfg.precision == "fp16" and b != "deepspeed":
        raise ConfigError(
            "precision='fp16' needs backend='deepspeed' (its loss scaler); "
            "use 'bf16' or 'fp32' with backend='torch'",
            fields=("precision", "backend"),
        )
    if cfg.fsdp_reshard is not None and not (b == "torch" and s in FSDP_STRATEGIES):
        raise ConfigError(
            f"fsdp_reshard applies only to strategies {', '.join(FSDP_STRATEGIES)} with "
            f"backend 'torch', not {s!r}/{b!r}",
            fields=("fsdp_reshard", "strategy", "backend"),
        )
    if cfg.deepspeed_config is not None and b != "deepspeed":
        raise ConfigError(
            "deepspeed_config needs backend='deepspeed'", fields=("deepspeed_config", "backend")
        )


def _check_new_dimensions(cfg) -> None:
    """What context parallelism, expert parallelism and the zero-bubble schedules need
    of the rest of the config (their degrees' fit to the model is `check_model_degrees`)."""
    s, b = cfg.strategy, cfg.backend
    choice("attention", cfg.attention, ATTENTIONS)
    has_cp = s == "cp" or (s == "hybrid" and (cfg.cp or 1) > 1)
    if cfg.attention != DEFAULT_ATTENTION and not has_cp:
        raise ConfigError(
            f"attention={cfg.attention!r} chooses how context parallelism attends over a "
            f"split sequence: it applies to strategy 'cp' (or 'hybrid' with cp > 1), not {s!r}",
            fields=("attention", "strategy"),
        )
    if has_cp and cfg.model not in CP_MODELS:
        raise ConfigError(
            f"context parallelism replaces the model's attention: it runs "
            f"{' and '.join(CP_MODELS)}, not {cfg.model!r}",
            fields=("model", "strategy"),
        )
    if has_cp and b == "deepspeed" and cfg.attention != "ulysses":
        raise ConfigError(
            "DeepSpeed's context parallelism is Ulysses (its DistributedAttention): use "
            "attention='ulysses' with backend='deepspeed', or backend='torch' for the ring",
            fields=("attention", "backend"),
        )
    has_ep = s == "ep" or (s == "hybrid" and (cfg.ep or 1) > 1)
    if has_ep and not is_moe(cfg.model):
        raise ConfigError(
            f"expert parallelism shares out the experts of a mixture-of-experts model "
            f"(a name with 'moe', e.g. 'tiny_moe'), not {cfg.model!r}",
            fields=("model", "strategy"),
        )
    if has_ep:
        _check_ep(cfg)
    if cfg.schedule in ZERO_BUBBLE and b != "torch":
        raise ConfigError(
            f"schedule {cfg.schedule!r} runs on backend 'torch' (DeepSpeed's pipeline "
            f"engine runs 1f1b)",
            fields=("schedule", "backend"),
        )


def _check_ep(cfg) -> None:
    """What expert parallelism runs with: its own gradient average (no FSDP), no
    checkpoints, and on DeepSpeed, DeepSpeed-MoE in place of tiny_moe's feed-forwards on
    ZeRO stage 0."""
    if cfg.fsdp_reshard is not None:
        raise ConfigError(
            "expert parallelism averages the replicated and the expert gradients itself: "
            "fsdp_reshard does not apply to it",
            fields=("fsdp_reshard", "ep"),
        )
    if cfg.checkpoint_every or cfg.resume_from is not None:
        raise ConfigError(
            "nbpar does not checkpoint expert-parallel runs yet (each rank holds other "
            "experts under the same names): leave checkpoint_every and resume_from unset",
            fields=("checkpoint_every", "resume_from", "ep"),
        )
    if cfg.backend != "deepspeed":
        return
    if cfg.model != "tiny_moe":
        raise ConfigError(
            f"backend 'deepspeed' runs expert parallelism with DeepSpeed-MoE layers in "
            f"place of tiny_moe's feed-forwards; run {cfg.model!r} on backend 'torch'",
            fields=("backend", "model"),
        )
    ds = cfg.deepspeed_config if isinstance(cfg.deepspeed_config, dict) else {}
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, "auto"):
        raise ConfigError(
            f"DeepSpeed expert parallelism runs on ZeRO stage 0 (its optimizer needs "
            f"separate expert parameter groups above it), not stage {stage}",
            fields=("deepspeed_config", "strategy"),
        )


def check_offload(offload: str, strategy: str) -> None:
    """ZeRO-Offload moves what ZeRO partitions: offload='optimizer' needs ZeRO stage 1, 2
    or 3, offload='params' stage 3."""
    choice("offload", offload, OFFLOADS)
    if offload == "none":
        return
    least = 3 if offload == "params" else 1
    need = [s for s, stage in ZERO_STAGE.items() if stage >= least]
    if strategy not in need:
        raise ConfigError(
            f"offload={offload!r} needs strategy {' or '.join(need)}, got {strategy!r}",
            fields=("offload", "strategy"),
        )


def _check_deepspeed_pipeline(cfg) -> None:
    """What DeepSpeed's PipelineModule runs here: a model with a plan (checked when it is
    built), 1F1B, fp32 or bf16."""
    if cfg.schedule != "1f1b":
        raise ConfigError(
            f"DeepSpeed's pipeline engine runs only the 1f1b schedule, got {cfg.schedule!r}",
            fields=("schedule", "backend"),
        )
    if cfg.precision == "fp16":
        raise ConfigError(
            "DeepSpeed pipeline runs here in precision fp32 or bf16, got 'fp16'",
            fields=("precision", "backend"),
        )


def check_model_degrees(cfg, world_size: int | None) -> None:
    """Raise ValueError when ``cfg``'s degrees do not fit its model: tp must divide the
    heads and widths, pp stages need layers and a schedule that fits them."""
    if world_size is not None:
        d = cfg.dims(world_size)
        tp, pp, cp, ep = d.tp, d.pp, d.cp, d.ep
    else:
        check_degrees(cfg.strategy, cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.ep)
        tp, pp, cp, ep = cfg.tp or 1, cfg.pp or 1, cfg.cp or 1, cfg.ep or 1
    tp_known = world_size is not None or cfg.tp is not None or OWN_DEGREE.get(cfg.strategy) != "tp"
    if tp_known:
        _check_sequence_parallel(cfg, tp)
    if cp > 1:
        _check_cp_fits(cfg, cp, tp)
    if ep > 1:
        _check_ep_fits(cfg, ep)
    from nbpar.model.registry import known_shape

    layers, where = known_shape(cfg)
    gpt = cfg.gpt
    if cfg.model in ("tiny_gpt", "tiny_moe") and tp > 1 and (gpt.n_heads % tp or gpt.d_model % tp):
        raise ConfigError(
            f"tp={tp} must divide gpt.n_heads={gpt.n_heads} and gpt.d_model={gpt.d_model}",
            fields=("tp", "gpt.n_heads", "gpt.d_model"),
        )
    if tp > 1 and where:  # a transformers family: heads from its config
        from nbpar.model.hf import shape

        for k in ("heads", "kv_heads"):
            n = shape(cfg.model, cfg.model_config)[k]
            if n % tp:
                raise ConfigError(
                    f"tp={tp} must divide the {HEAD_WORDS[k]} of {cfg.model} ({n})",
                    fields=("tp", "model_config"),
                )
    if layers is not None and pp > layers:
        where = where or "gpt.n_layers"
        raise ConfigError(
            f"pp={pp} pipeline stages need at least {pp} layers, {where}={layers}",
            fields=("pp", "gpt.n_layers" if where == "gpt.n_layers" else "model_config"),
        )
    if cfg.strategy in PIPELINED and pp > 1 and layers is not None:
        check_pipeline_schedule(cfg.schedule, pp, cfg.grad_accum, layers, cfg.backend)


def _check_sequence_parallel(cfg, tp: int) -> None:
    """Sequence parallelism splits the sequence over the tensor-parallel ranks: it needs
    tp > 1, a model that declares the split, and a sequence that divides by tp."""
    sp = cfg.sequence_parallel
    if not isinstance(sp, bool):
        raise ConfigError(
            f"sequence_parallel must be True or False, got {sp!r}", fields=("sequence_parallel",)
        )
    if not sp:
        return
    if tp == 1:
        raise ConfigError(
            "sequence_parallel splits the sequence over the tensor-parallel ranks: it needs "
            "tp > 1 (strategy 'tp', 'hybrid' with tp, or torch zero* with tp), got tp=1",
            fields=("sequence_parallel", "tp"),
        )
    from nbpar.model.registry import kind

    if kind(cfg.model) in ("builtin", "hf") and cfg.model not in SP_MODELS:
        raise ConfigError(
            f"sequence_parallel runs {' and '.join(SP_MODELS)} (or a model whose plan "
            f"declares the split, ModelPlan.sp), not {cfg.model!r}",
            fields=("sequence_parallel", "model"),
        )
    if kind(cfg.model) in ("builtin", "hf") and cfg.gpt.seq_len % tp:
        raise ConfigError(
            f"sequence_parallel gives each of the tp={tp} ranks seq_len / tp tokens: "
            f"gpt.seq_len={cfg.gpt.seq_len} does not divide by {tp}",
            fields=("sequence_parallel", "gpt.seq_len"),
        )


def _heads(cfg) -> int:
    """The attention heads of ``cfg``'s model (tiny_gpt's gpt, an hf family's config)."""
    if isinstance(cfg.model, str) and cfg.model.startswith("hf:"):
        from nbpar.model.hf import shape

        return shape(cfg.model, cfg.model_config)["heads"]
    return cfg.gpt.n_heads


def _check_cp_fits(cfg, cp: int, tp: int = 1) -> None:
    """The ring deals every sequence in 2 cp chunks (zigzag); Ulysses splits the
    sequence in cp parts and each tensor-parallel rank's heads over the cp ranks; the
    context-parallel kernels have no attention dropout."""
    seq = cfg.gpt.seq_len
    parts = 2 * cp if cfg.attention == "ring" else cp
    if seq % parts:
        how = "2 x cp chunks (the zigzag split)" if cfg.attention == "ring" else "cp parts"
        raise ConfigError(
            f"cp={cp} with attention={cfg.attention!r} deals each sequence in {how}: "
            f"gpt.seq_len={seq} does not divide by {parts}",
            fields=("cp", "gpt.seq_len"),
        )
    heads = _heads(cfg)
    if cfg.attention == "ulysses" and heads % (cp * tp):
        split = f"{cp}" if tp == 1 else f"cp x tp = {cp * tp}"
        raise ConfigError(
            f"Ulysses gives each of the cp={cp} ranks its share of the heads"
            f"{' of a tensor-parallel rank' if tp > 1 else ''}: the {heads} attention "
            f"heads of {cfg.model} do not divide by {split} (use attention='ring', or a "
            f"cp that divides {heads // tp if heads % tp == 0 else heads})",
            fields=("cp", "attention") + (("tp",) if tp > 1 else ()),
        )
    if cfg.model == "tiny_gpt" and cfg.gpt.dropout > 0:
        raise ConfigError(
            f"context-parallel attention has no dropout: set gpt.dropout=0 with cp={cp} "
            f"(got {cfg.gpt.dropout})",
            fields=("gpt.dropout", "cp"),
        )


def _check_ep_fits(cfg, ep: int) -> None:
    """Every expert-parallel rank holds the same number of experts."""
    from nbpar.model.registry import expert_count

    experts = expert_count(cfg)
    if experts is not None and experts % ep:
        raise ConfigError(
            f"ep={ep} must divide the {experts} experts of {cfg.model} (each expert-"
            f"parallel rank holds experts / ep of them)",
            fields=("ep", "model"),
        )
