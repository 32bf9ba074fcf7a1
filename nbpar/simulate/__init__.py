"""Simulate a cluster you don't have: fake ranks, real strategy code.

``nbpar.simulate(cfg, world_size=N)`` runs one rank of each role of an N-rank job on
fake tensors under a fake process group and reports what it holds and sends
(`nbpar.simulate.run`); `nbpar.simulate.fit.what_fits` lists the layouts whose simulated
peak fits a device. Nothing heavy loads until a simulation runs.
"""

from __future__ import annotations

import sys
import types

__all__ = ["simulate", "what_fits"]


def simulate(cfg, world_size: int, *, device_memory_gb: float | None = None, compose: bool = True):
    """See `nbpar.simulate.run.simulate`."""
    from nbpar.simulate.run import simulate as run

    return run(cfg, world_size, device_memory_gb=device_memory_gb, compose=compose)


def what_fits(cfg, world_size: int, device_memory_gb: float, **kwargs):
    """See `nbpar.simulate.fit.what_fits`."""
    from nbpar.simulate.fit import what_fits as fits

    return fits(cfg, world_size, device_memory_gb, **kwargs)


class _CallableModule(types.ModuleType):
    """``nbpar.simulate`` is this package and, called, the function of the same name:
    importing a submodule rebinds the package's name on ``nbpar``, so the package
    itself must answer the call."""

    def __call__(self, cfg, world_size: int, **kwargs):
        return simulate(cfg, world_size, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
