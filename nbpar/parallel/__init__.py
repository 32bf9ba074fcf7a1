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

# (strategy, backend, over tensor-parallel shards) -> the module under nbpar.parallel whose
# build_runner to call; backend None = any backend, tp None = any tp degree. torch ZeRO
# with tp > 1 is FSDP2 on dp over DTensor shards (as torchtitan), which `tensor` builds.
DISPATCH = {
    ("ddp", "torch", None): "ddp",
    ("zero1", "torch", False): "zero",
    ("zero2", "torch", False): "zero",
    ("zero3", "torch", False): "zero",
    ("zero1", "torch", True): "tensor",
    ("zero2", "torch", True): "tensor",
    ("zero3", "torch", True): "tensor",
    ("ddp", "deepspeed", None): "deepspeed",
    ("zero1", "deepspeed", None): "deepspeed",
    ("zero2", "deepspeed", None): "deepspeed",
    ("zero3", "deepspeed", None): "deepspeed",
    ("pipeline", "torch", None): "pipeline",
    ("pipeline", "deepspeed", None): "ds_pipeline",
    ("tp", None, None): "tensor",
    ("hybrid", None, None): "hybrid",
    ("cp", "torch", None): "cp",
    ("cp", "deepspeed", None): "ds_cp",
    ("ep", "torch", None): "expert",
    ("ep", "deepspeed", None): "ds_expert",
}


def strategy_module(strategy: str, backend: str, tp: int = 1) -> str | None:
    """Name of the module under nbpar.parallel that builds this strategy's runner on
    ``tp``-way tensor-parallel shards; None for single (`build_single_runner`)."""
    if strategy == "single":
        return None
    for key in ((strategy, backend, tp > 1), (strategy, backend, None), (strategy, None, None)):
        if key in DISPATCH:
            return DISPATCH[key]
    raise ValueError(f"no runner for strategy={strategy!r} with backend={backend!r}")


def build_runner(model, cfg, mesh):
    """The StepRunner of ``cfg.strategy`` on ``cfg.backend`` for this rank.

    ``mesh`` is the 3-D ("pp", "dp", "tp") DeviceMesh (None allowed for single).
    """
    tp = mesh["tp"].size() if mesh is not None else 1
    name = strategy_module(cfg.strategy, cfg.backend, tp)
    if name is None:
        return build_single_runner(model, cfg, mesh)
    module = importlib.import_module(f"{__name__}.{name}")
    return module.build_runner(model, cfg, mesh)
