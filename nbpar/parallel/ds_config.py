"""DeepSpeed config (ds_config.json) checking and building, on the client.

`validate_ds_config` catches typos and bad JSON before any engine starts;
`ds_config_for` turns a TrainConfig into the config DeepSpeed gets, using a
user's ``deepspeed_config`` as written; `train_settings` and `fit_train_batch_size`
read what it decides for the TrainConfig. Rule for fields both set: the
TrainConfig drives the data loader and the step loop, so a ds_config value
that disagrees with it (batch sizes, ZeRO stage, precision, offload, lr) is a
ValueError naming both, never silently overridden. Imports neither torch nor
deepspeed, so the client can check a config cheaply.
"""

from __future__ import annotations

import copy
import difflib
import json

from nbpar.parallel.ds_keys import TOP_LEVEL_KEYS, ZERO_KEYS, check_half_masters
from nbpar.strategies import PIPELINED, ZERO_STAGE

OFFLOAD_DEVICES = ("cpu", "nvme", "none")
PIPELINE_ZERO_STAGES = (0, 1)
STRATEGY_OF_STAGE = {v: k for k, v in ZERO_STAGE.items()}
# DeepSpeed optimizer types nbpar runs as a client torch optimizer (no compiled ops).
TORCH_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
# optimizer params nbpar passes on to torch (besides lr), per kind; DeepSpeed-only
# switches that change nothing for a torch optimizer are dropped
OPTIMIZER_PARAMS = {
    "adam": ("betas", "eps", "weight_decay", "amsgrad"),
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
}
OPTIMIZER_PARAMS["adamw"] = OPTIMIZER_PARAMS["adam"]
DEEPSPEED_ONLY_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction", "fused")
# zero_optimization sizes that the Hugging Face integration writes as "auto" (it
# derives them from the hidden size); nbpar leaves them to DeepSpeed's defaults
AUTO_SIZES = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
)


def _check_keys(d: dict, known, where: str) -> None:
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"unknown DeepSpeed config key '{key}'{where}{hint}")


def load_ds_config(d: dict | str) -> dict:
    """``d`` itself (deep-copied) or the JSON object in the file at path ``d``."""
    if isinstance(d, dict):
        return copy.deepcopy(d)
    if not isinstance(d, str):
        raise TypeError(
            f"deepspeed_config must be a dict or a path to a JSON file, got {type(d).__name__}"
        )
    try:
        with open(d) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read DeepSpeed config file {d!r}: {e.strerror}") from None
    try:
        out = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"DeepSpeed config file {d!r} is not valid JSON: line {e.lineno} "
            f"column {e.colno}: {e.msg}"
        ) from None
    if not isinstance(out, dict):
        raise ValueError(
            f"DeepSpeed config file {d!r} must hold a JSON object, got {type(out).__name__}"
        )
    return out


def validate_ds_config(d: dict | str) -> dict:
    """The config as a dict after checking its key names and basic values.

    Rejects unknown top-level and ``zero_optimization`` keys with a
    did-you-mean hint, a stage outside 0-3 and an unknown offload device.
    """
    d = load_ds_config(d)
    _check_keys(d, TOP_LEVEL_KEYS, "")
    zero = d.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization must be a JSON object, got {zero!r}")
    _check_keys(zero, ZERO_KEYS, " in zero_optimization")
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
    for what in ("offload_optimizer", "offload_param"):
        sec = zero.get(what)
        if sec is None:
            continue
        dev = sec.get("device", "none") if isinstance(sec, dict) else sec
        if dev not in OFFLOAD_DEVICES:
            raise ValueError(
                f"zero_optimization.{what}.device must be one of "
                f"{', '.join(OFFLOAD_DEVICES)}, got {dev!r}"
            )
    return d


def offload_device(zero: dict, what: str) -> str:
    """Device of ``zero[what]`` ("none" when absent)."""
    sec = zero.get(what)
    return (sec or {}).get("device", "none") if isinstance(sec, dict) else "none"


def _set(value) -> bool:
    """A value the config decides (not absent, not "auto")."""
    return value is not None and value != "auto"


def _legacy_offload(zero: dict) -> None:
    """Keys DeepSpeed still accepts: ``cpu_offload`` / ``cpu_offload_param`` (bools)
    become the ``offload_optimizer`` / ``offload_param`` sections they stand for."""
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in zero:
            if zero.pop(old) is True and new not in zero:
                zero[new] = {"device": "cpu"}
    zero.pop("cpu_offload_use_pin_memory", None)


def optimizer_kind(section: dict) -> str:
    """ "adam", "adamw" or "sgd" as DeepSpeed reads an "optimizer" section: its
    "Adam" is decoupled (AdamW) unless ``adam_w_mode`` is false."""
    kind = str(section.get("type", "")).lower()
    if kind not in TORCH_OPTIMIZERS:
        raise ValueError(
            f"optimizer type {section.get('type')!r} needs DeepSpeed's compiled "
            f"ops; use one of {', '.join(TORCH_OPTIMIZERS.values())}"
        )
    if kind == "adam" and (section.get("params") or {}).get("adam_w_mode", True):
        return "adamw"
    return kind


def _precision_of(d: dict) -> str | None:
    sections = {
        "bf16" if n == "bfloat16" else n: d[n]
        for n in ("fp16", "bf16", "bfloat16")
        if isinstance(d.get(n), dict)
    }
    on = [n for n, sec in sections.items() if sec.get("enabled") is True]
    if len(on) > 1:
        raise ValueError("deepspeed_config enables both fp16 and bf16; enable one")
    if on:
        return on[0]
    if sections and all(sec.get("enabled") is False for sec in sections.values()):
        return "fp32"
    return None


def train_settings(d: dict) -> dict:
    """The TrainConfig fields a ds_config decides: the values it sets (never "auto").

    Stage -> strategy, micro-batch, accumulation, precision, offload (legacy keys
    too), optimizer kind, lr and params, gradient clipping and the scheduler.
    """
    d = validate_ds_config(d)
    zero = d.get("zero_optimization") or {}
    _legacy_offload(zero)
    out = {}
    if zero.get("stage") in STRATEGY_OF_STAGE:
        out["strategy"] = STRATEGY_OF_STAGE[zero["stage"]]
    for key, name in (
        ("train_micro_batch_size_per_gpu", "micro_batch"),
        ("gradient_accumulation_steps", "grad_accum"),
    ):
        if _set(d.get(key)):
            out[name] = d[key]
    precision = _precision_of(d)
    if precision:
        out["precision"] = precision
    if offload_device(zero, "offload_param") == "cpu":
        out["offload"] = "params"
    elif offload_device(zero, "offload_optimizer") == "cpu":
        out["offload"] = "optimizer"
    elif "offload_param" in zero or "offload_optimizer" in zero:
        out["offload"] = "none"
    if isinstance(d.get("optimizer"), dict):
        sec = d["optimizer"]
        kind = out["optimizer"] = optimizer_kind(sec)
        params = sec.get("params") or {}
        if _set(params.get("lr")):
            out["lr"] = params["lr"]
        extra = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in params.items()
            if k in OPTIMIZER_PARAMS[kind] and _set(v)
        }
        if extra:
            out["optimizer_params"] = extra
    if _set(d.get("gradient_clipping")):
        out["grad_clip"] = float(d["gradient_clipping"])
    if isinstance(d.get("scheduler"), dict):
        out["lr_schedule"] = copy.deepcopy(d["scheduler"])
    return out


def fit_train_batch_size(d: dict, dp: int, sizes: dict, given) -> dict:
    """What a ds_config's ``train_batch_size`` decides when it sets only one of the
    micro-batch and the accumulation, or neither: global = micro x accumulation x dp
    (DeepSpeed's rule). ``sizes``: {"micro_batch", "grad_accum"} now; ``given``: the
    fields set explicitly, which it never decides. Returns {field: value}, at most one."""
    total = d.get("train_batch_size")
    if not isinstance(total, int) or isinstance(total, bool):
        return {}
    for name, key, other in (
        ("micro_batch", "train_micro_batch_size_per_gpu", "grad_accum"),
        ("grad_accum", "gradient_accumulation_steps", "micro_batch"),
    ):
        if name in given or isinstance(d.get(key), int):
            continue
        per = sizes[other] * dp
        if total % per:
            raise ValueError(
                f"deepspeed_config's train_batch_size={total} is not a "
                f"multiple of {other}={sizes[other]} x dp={dp}"
            )
        return {name: total // per}
    return {}


def _agree(d: dict, key: str, want, label: str) -> None:
    """Set ``d[key] = want`` unless it is already set to something else ("auto" is
    filled in, as the Hugging Face Trainer does)."""
    if key in d and d[key] != "auto" and d[key] != want:
        raise ValueError(
            f"deepspeed_config sets {label}={d[key]!r} but the TrainConfig asks "
            f"for {want!r}; make them agree"
        )
    d[key] = want


def _precision(d: dict, precision: str) -> None:
    if isinstance(d.get("amp"), dict) and d["amp"].get("enabled"):
        raise ValueError(
            "deepspeed_config enables 'amp' (NVIDIA Apex), which nbpar does not "
            "support; use precision='fp16' or 'bf16' instead"
        )
    for name in ("fp16", "bf16", "bfloat16"):
        check_half_masters(name, sec := d.get(name))
        if isinstance(sec, dict) and sec.get("enabled") == "auto":
            sec["enabled"] = ("bf16" if name == "bfloat16" else name) == precision
    have = _precision_of(d)
    if have is not None and have != precision:
        raise ValueError(
            f"deepspeed_config enables {have} but the TrainConfig asks for "
            f"precision={precision!r}; make them agree"
        )
    if precision != "fp32" and have is None:
        d[precision] = {**d.get(precision, {}), "enabled": True}


def _offload(zero: dict, offload: str, stage: int) -> None:
    """Map TrainConfig.offload ("none" | "optimizer" | "params") onto zero_optimization.

    "params" offloads parameters *and* optimizer state (ZeRO-Infinity's CPU mode).
    """
    want_opt = "cpu" if offload in ("optimizer", "params") else "none"
    want_par = "cpu" if offload == "params" else "none"
    for what, want in (("offload_optimizer", want_opt), ("offload_param", want_par)):
        have = offload_device(zero, what)
        if have == "nvme":
            raise ValueError(
                "NVMe offload needs DeepSpeed's compiled async_io op, which "
                "nbpar never builds; use device 'cpu'"
            )
        if what in zero and have != want:
            raise ValueError(
                f"deepspeed_config sets zero_optimization.{what}.device="
                f"{have!r} but the TrainConfig asks for offload={offload!r}"
            )
        if want != "none":
            zero.setdefault(what, {"device": want})
    if want_opt != "none" and stage < 1:
        raise ValueError(
            "optimizer offload needs ZeRO stage 1, 2 or 3 (strategy zero1/zero2/zero3), not stage 0"
        )
    if want_par != "none" and stage != 3:
        raise ValueError(
            f"parameter offload needs ZeRO stage 3 (strategy zero3), got stage {stage}"
        )


def same_optimizer(a: str, b: str, params: dict) -> bool:
    """Adam and AdamW are one update rule while weight decay is 0."""
    if a == b:
        return True
    return {a, b} == {"adam", "adamw"} and not params.get("weight_decay")


def _optimizer(d: dict, cfg) -> None:
    """Make the "optimizer" section the one the TrainConfig asks for, as DeepSpeed
    reads it; nbpar runs it as a client torch optimizer."""
    extra = dict(cfg.optimizer_params or {})
    sec = d.setdefault("optimizer", {"type": TORCH_OPTIMIZERS[cfg.optimizer], "params": {}})
    if not isinstance(sec, dict):
        raise ValueError(f"deepspeed_config's optimizer must be a JSON object, got {sec!r}")
    params = sec.setdefault("params", {})
    kind = optimizer_kind(sec)
    if not same_optimizer(kind, cfg.optimizer, {**params, **extra}):
        raise ValueError(
            f"deepspeed_config's optimizer type {sec['type']!r} (DeepSpeed runs "
            f"it as {kind}) disagrees with the TrainConfig's "
            f"optimizer={cfg.optimizer!r}; make them agree"
        )
    _agree(params, "lr", cfg.lr, "optimizer.params.lr")
    for key, want in extra.items():
        if isinstance(params.get(key), (list, tuple)):
            params[key] = list(params[key])
        _agree(
            params, key, list(want) if isinstance(want, tuple) else want, f"optimizer.params.{key}"
        )
    for key in [k for k, v in params.items() if v == "auto"]:
        del params[key]  # the torch optimizer's default, as for the TrainConfig


def _scheduler(d: dict, cfg) -> None:
    from nbpar.model.lr_schedule import resolve

    have = resolve(d["scheduler"], cfg.lr, cfg.steps) if d.get("scheduler") else None
    want = resolve(cfg.lr_schedule, cfg.lr, cfg.steps) if cfg.lr_schedule else None
    if have and want and have != want:
        raise ValueError(
            f"deepspeed_config's scheduler {have} differs from the TrainConfig's "
            f"lr_schedule {want}; make them agree"
        )
    if have or want:
        d["scheduler"] = have or want


def _no_auto_left(d, where: str = "") -> None:
    for key, value in d.items():
        if value == "auto":
            raise ValueError(
                f"deepspeed_config's {where}{key}='auto' has no TrainConfig value "
                f"to take; write a value"
            )
        if isinstance(value, dict):
            _no_auto_left(value, f"{where}{key}.")


def check_pipeline_stage(ds_config: dict) -> int:
    """The ZeRO stage ``ds_config`` asks of DeepSpeed's PipelineModule: 0 or 1 only
    (stage 2/3 would shard gradients that the pipeline still accumulates)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(
            f"DeepSpeed's PipelineModule supports ZeRO stage 0 or 1 only (got stage {stage})"
        )
    return stage


def ds_config_for(cfg, dp_size: int) -> dict:
    """The DeepSpeed config for ``cfg`` (a TrainConfig) on ``dp_size`` dp ranks.

    Starts from ``cfg.deepspeed_config`` as written, fills what it leaves out or
    writes as "auto" from the TrainConfig, refuses what disagrees; adds the
    CPU-safe settings nbpar needs (client optimizer allowed with offload, ZeRO-3
    partitions every parameter however small).
    """
    d = validate_ds_config(cfg.deepspeed_config) if cfg.deepspeed_config is not None else {}
    _agree(d, "train_micro_batch_size_per_gpu", cfg.micro_batch, "train_micro_batch_size_per_gpu")
    # for DeepSpeed's PipelineEngine gradient_accumulation_steps is the number of
    # micro-batches in flight, which is TrainConfig.grad_accum there too
    _agree(d, "gradient_accumulation_steps", cfg.grad_accum, "gradient_accumulation_steps")
    _agree(d, "train_batch_size", cfg.micro_batch * cfg.grad_accum * dp_size, "train_batch_size")
    zero = d.setdefault("zero_optimization", {})
    _legacy_offload(zero)
    if cfg.strategy in ZERO_STAGE:
        _agree(zero, "stage", ZERO_STAGE[cfg.strategy], "zero_optimization.stage")
    stage = zero.setdefault("stage", 0)
    if cfg.strategy in PIPELINED:  # validate checked it; a caller may skip validate
        check_pipeline_stage(d)
    for key in AUTO_SIZES:
        if zero.get(key) == "auto":
            del zero[key]
    _precision(d, cfg.precision)
    _offload(zero, cfg.offload, stage)
    _optimizer(d, cfg)
    _scheduler(d, cfg)
    # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise; nbpar
    # clips only when the TrainConfig (or the config) asks, on every backend alike
    _agree(d, "gradient_clipping", float(cfg.grad_clip), "gradient_clipping")
    if stage == 3 and zero.get("stage3_param_persistence_threshold", 0) in (0, "auto"):
        zero["stage3_param_persistence_threshold"] = 0
    d.setdefault("zero_force_ds_cpu_optimizer", False)
    # the client optimizer is a torch one (`deepspeed.client_optimizer`); ZeRO refuses
    # torch.optim.SGD at init ("untested ZeRO Optimizer") unless allowed
    d.setdefault("zero_allow_untested_optimizer", True)
    d.setdefault("steps_per_print", 10**9)
    _no_auto_left(d)
    return d
