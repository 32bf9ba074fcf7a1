"""Parallel strategies, one module per dimension, and the dispatch between them.

`build_runner(model, cfg, mesh)` picks the strategy module named by
``cfg.strategy``/``cfg.backend`` and imports it only then, so this package
stays cheap to import and a strategy's heavy dependencies (DeepSpeed) load
only on the engines that use it. The helpers every strategy shares (its optimizer,
its autocast dtype) live in `nbpar.parallel.common`; they are re-exported here for
code that imported them from the package.
"""

from __future__ import annotations

import importlib

from nbpar.parallel.common import (
    autocast_dtype,
    build_single_runner,
    make_optimizer,
    model_device_type,
    optimizer_spec,
)

__all__ = [
    "DISPATCH",
    "build_runner",
    "strategy_module",
    "autocast_dtype",
    "build_single_runner",
    "make_optimizer",
    "model_device_type",
    "optimizer_spec",
]

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
