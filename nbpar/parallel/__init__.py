"""Parallel strategies, one module per dimension, and the dispatch between them.

`build_runner(model, cfg, mesh)` picks the strategy module named by
``cfg.strategy``/``cfg.backend`` and imports it only then, so this package
stays cheap to import and a strategy's heavy dependencies (DeepSpeed) load
only on the engines that use it. The shared helpers every strategy needs to
build its optimizer and autocast the same way live here too:
`make_optimizer(params, cfg)` and `autocast_dtype(cfg)`.
"""

from __future__ import annotations

import importlib

# (strategy, backend) -> module under nbpar.parallel whose build_runner to call;
# backend None = any backend.
DISPATCH = {
    ("ddp", "torch"): "ddp",
    ("zero1", "torch"): "zero",
    ("zero2", "torch"): "zero",
    ("zero3", "torch"): "zero",
    ("ddp", "deepspeed"): "deepspeed",
    ("zero1", "deepspeed"): "deepspeed",
    ("zero2", "deepspeed"): "deepspeed",
    ("zero3", "deepspeed"): "deepspeed",
    ("pipeline", "torch"): "pipeline",
    ("pipeline", "deepspeed"): "ds_pipeline",
    ("tp", None): "tensor",
    ("hybrid", None): "hybrid",
}


def optimizer_spec(cfg):
    """(torch optimizer class, its keyword arguments) of ``cfg``: Adam, AdamW or SGD with
    ``cfg.lr`` and ``cfg.optimizer_params``; weight decay 0 unless given (DeepSpeed's
    default, so a ds_config's optimizer and this one agree)."""
    import torch

    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.optimizer not in classes:
        raise ValueError(
            f"optimizer={cfg.optimizer!r} is not supported; choose {', '.join(classes)}"
        )
    kwargs = {"lr": cfg.lr, "weight_decay": 0.0, **(cfg.optimizer_params or {})}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return classes[cfg.optimizer], kwargs


def make_optimizer(params, cfg):
    """The torch optimizer of ``cfg`` (see `optimizer_spec`), the same on every strategy."""
    cls, kwargs = optimizer_spec(cfg)
    return cls(params, **kwargs)


def autocast_dtype(cfg):
    """The autocast dtype of ``cfg.precision`` (None for fp32)."""
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]


def model_device_type(model) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def build_single_runner(model, cfg, mesh=None):
    """Plain one-process training: the base StepRunner."""
    from nbpar.parallel.runner import StepRunner
    from nbpar.train.models import loss_fn

    return StepRunner(
        model,
        make_optimizer(model.parameters(), cfg),
        loss_fn(cfg),
        autocast_dtype=autocast_dtype(cfg),
        device_type=model_device_type(model),
    )


def strategy_module(strategy: str, backend: str) -> str | None:
    """Name of the module under nbpar.parallel that builds this strategy's runner."""
    if strategy == "single":
        return None
    name = DISPATCH.get((strategy, backend)) or DISPATCH.get((strategy, None))
    if name is None:
        raise ValueError(f"no runner for strategy={strategy!r} with backend={backend!r}")
    return name


def build_runner(model, cfg, mesh):
    """The StepRunner of ``cfg.strategy`` on ``cfg.backend`` for this rank.

    ``mesh`` is the 3-D ("pp", "dp", "tp") DeviceMesh (None allowed for single).
    """
    name = strategy_module(cfg.strategy, cfg.backend)
    if name is None:
        return build_single_runner(model, cfg, mesh)
    if name == "zero" and mesh is not None and mesh["tp"].size() > 1:
        name = "tensor"  # ZeRO/FSDP on dp over tensor-parallel shards
    module = importlib.import_module(f"{__name__}.{name}")
    return module.build_runner(model, cfg, mesh)
