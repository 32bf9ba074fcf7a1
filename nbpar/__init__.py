"""nbpar: see distributed training work, cell by cell, from a notebook.

Public API: Pool, TrainConfig, compare, estimate_memory, StrategyPicker, log.
Importing nbpar is cheap: torch and ipyparallel load when first needed, and
nothing starts processes or touches devices at import time.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Pool": ("nbpar.pool", "Pool"),
    "TrainConfig": ("nbpar.config", "TrainConfig"),
    "GPTConfig": ("nbpar.config", "GPTConfig"),
    "ParallelDims": ("nbpar.parallel.mesh", "ParallelDims"),
    "estimate_memory": ("nbpar.memory", "estimate_memory"),
    "compare": ("nbpar.compare", "compare"),
    "StrategyPicker": ("nbpar.widgets", "StrategyPicker"),
    "log": ("nbpar.userlog", "log"),
    "EngineDied": ("nbpar.errors", "EngineDied"),
    "DistTimeout": ("nbpar.errors", "DistTimeout"),
    "RankError": ("nbpar.errors", "RankError"),
    "PoolError": ("nbpar.errors", "PoolError"),
}

__all__ = ["Pool", "TrainConfig", "compare", "estimate_memory", "StrategyPicker", "log"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nbpar' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython):
    """``%load_ext nbpar``: register ``%%dist`` and ``%dist``."""
    from nbpar.magics import load_ipython_extension as load

    load(ipython)
