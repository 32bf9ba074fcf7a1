"""nbpar: see distributed training work, cell by cell, from a notebook.

Public API: Pool, TrainConfig, compare, estimate_memory, StrategyPicker, FitPicker, log,
register_model, simulate.
Importing nbpar is cheap: torch and ipyparallel load when first needed, and
nothing starts processes or touches devices at import time.
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"

_LAZY = {
    "Pool": ("nbpar.pool.pool", "Pool"),
    "TrainConfig": ("nbpar.config", "TrainConfig"),
    "GPTConfig": ("nbpar.config", "GPTConfig"),
    "ParallelDims": ("nbpar.parallel.mesh", "ParallelDims"),
    "estimate_memory": ("nbpar.estimate", "estimate_memory"),
    "compare": ("nbpar.view.compare", "compare"),
    "StrategyPicker": ("nbpar.view.widgets", "StrategyPicker"),
    "FitPicker": ("nbpar.view.fit_picker", "FitPicker"),
    "log": ("nbpar.train.userlog", "log"),
    # the package itself, callable: nbpar.simulate(cfg, world_size=N), nbpar.simulate.what_fits
    "simulate": ("nbpar.simulate", None),
    "register_model": ("nbpar.train.registry", "register_model"),
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
]

# Modules that moved when the package was grouped by where code runs (pool/: the kernel
# drives engines, train/: inside the engines, parallel/: the strategies, view/: what
# draws). The old paths keep working: ``import nbpar.memory`` is ``nbpar.estimate``.
MOVED = {
    "memory": "estimate",
    "execute": "pool.execute",
    "magics": "pool.magics",
    "launchers": "pool.launchers",
    "status": "pool.status",
    "run": "pool.run",
    "worker": "pool.worker",
    "models": "train.models",
    "data": "train.data",
    "checkpoint": "train.checkpoint",
    "checkpoint_meta": "train.checkpoint_meta",
    "metrics": "train.metrics",
    "lr_schedule": "train.lr_schedule",
    "userlog": "train.userlog",
    "timeline": "train.timeline",
    "ds_config": "parallel.ds_config",
    "dashboard": "view.dashboard",
    "panels": "view.panels",
    "plots": "view.plots",
    "compare": "view.compare",
    "widgets": "view.widgets",
    "history": "view.history",
    "memory_plot": "view.memory_plot",
    "export": "view.export",
    "teaching": "view.teaching",
}


class _MovedModules:
    """Import hook: ``nbpar.<old name>`` resolves to the module at its new place."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        import importlib.util

        old = name.partition("nbpar.")[2] if name.startswith("nbpar.") else None
        if old not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, _MovedModules)

    @staticmethod
    def create_module(spec):
        import importlib

        return importlib.import_module("nbpar." + MOVED[spec.name.partition(".")[2]])

    @staticmethod
    def exec_module(module):
        pass


sys.meta_path.append(_MovedModules)


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
