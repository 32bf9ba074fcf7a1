"""nbpar: see distributed training work, cell by cell, from a notebook.

Public API: Pool, TrainConfig, compare, estimate_memory, StrategyPicker, FitPicker, log,
register_model, simulate, project (a step on real GPUs, estimated), days_to_train and
hardware (the devices, links and machines project knows).
Importing nbpar is cheap: torch and ipyparallel load when first needed, and
nothing starts processes or touches devices at import time.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Pool": ("nbpar.pool.pool", "Pool"),
    "TrainConfig": ("nbpar.config", "TrainConfig"),
    "GPTConfig": ("nbpar.config", "GPTConfig"),
    "MoEConfig": ("nbpar.config", "MoEConfig"),
    "ParallelDims": ("nbpar.dims", "ParallelDims"),
    "estimate_memory": ("nbpar.estimate", "estimate_memory"),
    "compare": ("nbpar.view.compare", "compare"),
    "StrategyPicker": ("nbpar.view.widgets", "StrategyPicker"),
    "FitPicker": ("nbpar.view.fit_picker", "FitPicker"),
    "log": ("nbpar.train.userlog", "log"),
    # the package itself, callable: nbpar.simulate(cfg, world_size=N), nbpar.simulate.what_fits
    "simulate": ("nbpar.simulate", None),
    "register_model": ("nbpar.model.registry", "register_model"),
    # the module itself, callable: nbpar.project(cfg_or_run, "8xH100-SXM", params=...)
    "project": ("nbpar.project", None),
    "days_to_train": ("nbpar.hardware", "days_to_train"),
    "hardware": ("nbpar.hardware", None),
    # exercises checked on the pool: nbpar.exercises.check("ring_all_reduce", fn)
    "exercises": ("nbpar.exercises", None),
    "EngineDied": ("nbpar.errors", "EngineDied"),
    "DistTimeout": ("nbpar.errors", "DistTimeout"),
    "RankError": ("nbpar.errors", "RankError"),
    "PoolError": ("nbpar.errors", "PoolError"),
}

__all__ = [
    "Pool",
    "TrainConfig",
    "compare",
    "estimate_memory",
    "StrategyPicker",
    "FitPicker",
    "log",
    "register_model",
    "simulate",
    "project",
    "days_to_train",
    "hardware",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nbpar' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython):
    """``%load_ext nbpar``: register ``%%dist`` and ``%dist``."""
    from nbpar.pool.magics import load_ipython_extension as load

    load(ipython)
