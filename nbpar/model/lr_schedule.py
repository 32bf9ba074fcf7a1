"""Learning-rate schedules in DeepSpeed's ``"scheduler"`` format, for every backend.

A ds_config's scheduler (``{"type": "WarmupLR", "params": {...}}``) is run by
DeepSpeed itself on the DeepSpeed backend; the torch strategies and the
single-process reference run the same formulas here, so a curve trained with a
schedule is still comparable across strategies. Semantics follow
``deepspeed/runtime/lr_schedules.py`` (0.19): the schedule is built before the
first step (``last_batch_iteration = -1``) and stepped after every optimizer
step, so optimizer step ``k`` (0-based) runs with the value at iteration ``k-1``.
Pure Python: the client checks a schedule without importing torch.
"""

from __future__ import annotations

import math

from nbpar.checks import positive_int

# type -> {param: default}; None = required (or filled by "auto")
SCHEDULES = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": None,
        "cycle_max_lr": None,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
}


def auto_values(lr: float, steps: int) -> dict:
    """What ``"auto"`` means in a scheduler's params, as the Hugging Face Trainer fills
    them: the peak is the TrainConfig's lr, the length its steps, warm-up a tenth of them."""
    return {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": lr,
        "total_num_steps": steps,
        "warmup_num_steps": max(1, steps // 10),
    }


def resolve(section: dict, lr: float, steps: int) -> dict:
    """``section`` with "auto" filled in and every parameter checked: a new dict
    ``{"type": T, "params": {...}}`` that DeepSpeed and `Schedule` both accept."""
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError(f"a scheduler must be {{'type': ..., 'params': {{...}}}}, got {section!r}")
    kind = section["type"]
    if kind not in SCHEDULES:
        raise ValueError(
            f"scheduler type {kind!r} is not supported; choose one of {', '.join(SCHEDULES)}"
        )
    params = dict(section.get("params") or {})
    unknown = sorted(set(params) - set(SCHEDULES[kind]))
    if unknown:
        raise ValueError(f"scheduler {kind} has no parameter {', '.join(unknown)}")
    auto = auto_values(lr, steps)
    for key, value in params.items():
        if value == "auto":
            if key not in auto:
                raise ValueError(
                    f"scheduler.params.{key}='auto' has no TrainConfig value to "
                    f"take; write a number"
                )
            params[key] = auto[key]
    for key, default in SCHEDULES[kind].items():
        if (
            default is None
            and params.get(key) is None
            and key not in ("warmup_max_lr", "cycle_second_step_size", "cycle_second_stair_count")
        ):
            raise ValueError(f"scheduler {kind} needs params.{key}")
    n = params.get("warmup_num_steps", 1)
    positive_int("scheduler.params.warmup_num_steps", n)
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ValueError(
            f"scheduler.params.warmup_type must be 'log' or 'linear', got {params['warmup_type']!r}"
        )
    return {"type": kind, "params": params}


class Schedule:
    """Learning rate (and, for OneCycle, Adam's beta1) at an iteration of a resolved
    schedule; ``base_lr`` is the optimizer's own lr (WarmupLR's default peak,
    WarmupCosineLR's reference)."""

    def __init__(self, section: dict, base_lr: float):
        self.kind = section["type"]
        self.p = {**SCHEDULES[self.kind], **section.get("params", {})}
        self.base_lr = base_lr
        if self.kind == "WarmupLR" and self.p["warmup_max_lr"] is None:
            self.p["warmup_max_lr"] = base_lr

    def _warmup(self, it: int) -> float | None:
        """DeepSpeed's warm-up fraction at ``it``, or None once warm-up is over."""
        n = max(2, self.p["warmup_num_steps"])
        if it >= n:
            return None
        if self.p["warmup_type"] == "linear":
            return it / n
        return math.log(it + 1) / math.log(n)

    def lr(self, it: int) -> float:
        """The learning rate after ``it + 1`` scheduler steps (it = -1: before any)."""
        p = self.p
        if self.kind in ("WarmupLR", "WarmupDecayLR"):
            lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]
            if it < 0:
                return lo
            gamma = self._warmup(it)
            if gamma is None:
                gamma = (
                    1.0
                    if self.kind == "WarmupLR"
                    else max(
                        0.0,
                        (p["total_num_steps"] - it)
                        / max(1.0, p["total_num_steps"] - max(2, p["warmup_num_steps"])),
                    )
                )
            return lo + (hi - lo) * gamma
        if self.kind == "WarmupCosineLR":
            return self.base_lr * self._cosine_ratio(it)
        return self._one_cycle_lr(it)

    def _cosine_ratio(self, it: int) -> float:
        p = self.p
        if it < 0:
            return 0.0
        ratio = self._warmup(it)
        if ratio is not None:
            return p["warmup_min_ratio"] + ratio * (1.0 - p["warmup_min_ratio"])
        n = max(2, p["warmup_num_steps"])
        progress = min(1.0, (it - n + 1) / max(1, p["total_num_steps"] - n))
        cos = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * cos)

    # ---- OneCycle (Smith 2018, "A disciplined approach to neural network
    # hyper-parameters"): lr up then down over one cycle, momentum the other way
    def _cycle(self):
        first = float(self.p["cycle_first_step_size"])
        second = self.p["cycle_second_step_size"]
        second = first if second is None else float(second)
        return first, second, first + second

    def _scale(self, it: int) -> float:
        first, second, total = self._cycle()
        b = it + 1
        x = 1.0 + b / total - math.floor(1 + b / total)
        ratio = first / total
        if x <= ratio:
            scale, stairs = x / ratio, self.p["cycle_first_stair_count"]
        else:
            scale = (x - 1) / (ratio - 1)
            stairs = self.p["cycle_second_stair_count"]
            stairs = self.p["cycle_first_stair_count"] if stairs is None else stairs
        if stairs > 0:
            ci = b % total
            pos = ci * stairs / first if ci <= first else (total - ci) * stairs / second
            scale = math.floor(pos) / stairs
        return scale

    def _one_cycle_lr(self, it: int) -> float:
        p = self.p
        lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
        if it < 0:
            return lo
        _, _, total = self._cycle()
        if it < total:
            return lo + (hi - lo) * self._scale(it)
        if p["decay_step_size"] == 0 or p["decay_lr_rate"] == 0:
            return lo
        return lo / (1 + p["decay_lr_rate"] * (it - total + 1) / p["decay_step_size"])

    def betas(self, it: int) -> tuple[float, float] | None:
        """OneCycle's (beta1, beta2) at ``it`` (DeepSpeed sets beta2 to 0.99); else None."""
        p = self.p
        if self.kind != "OneCycle" or not p["cycle_momentum"]:
            return None
        lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
        if it < 0:
            return (lo, 0.99)
        _, _, total = self._cycle()
        if it < total:
            return (hi - (hi - lo) * self._scale(it), 0.99)
        if p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0:
            return (hi, 0.99)
        return (hi * (1 + p["decay_mom_rate"] * (it - total + 1) / p["decay_step_size"]), 0.99)
