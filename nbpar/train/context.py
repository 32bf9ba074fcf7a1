"""Where one rank trains: its place in the world, the topology and its device.

`RankContext.build(cfg)` is made once per run by `nbpar.train.loop.run_training`; the
step loop and `nbpar.train.checkpoint` read it instead of a loose bag of arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from nbpar import device
from nbpar.parallel.mesh import cached_expert_mesh, cached_mesh

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from nbpar.config import TrainConfig
    from nbpar.dims import ParallelDims


@dataclass(frozen=True)
class RankContext:
    """One rank of a run, fixed for the run's life."""

    rank: int
    """this process's rank in the run (0 for strategy single)"""
    world: int
    """ranks in the run (1 for strategy single)"""
    dims: ParallelDims
    """the run's parallel degrees (``cfg.dims(world)``)"""
    mesh: DeviceMesh | None
    """the named ("pp", "dp", "cp", "tp") mesh of ``dims`` (with "dp_cp" where cp > 1);
    None without a process group"""
    device: torch.device
    """where this rank computes"""
    backend: str
    """the process group's backend (gloo, nccl), or this machine's default without one"""
    distributed: bool
    """whether the run uses the default process group (False for strategy single)"""
    expert_mesh: DeviceMesh | None = None
    """the ("edp", "ep") split of the mesh's dp where ep > 1, else None"""

    @classmethod
    def build(cls, cfg: TrainConfig) -> tuple[RankContext, TrainConfig]:
        """This rank's context for ``cfg``, and ``cfg`` as it runs on this world
        (`TrainConfig.validate`'s checked config).

        Strategy single is the one-process reference: on an engine of a larger pool it
        ignores the pool's process group (only rank 0 runs it)."""
        group = dist.is_available() and dist.is_initialized()
        on = group and cfg.strategy != "single"
        world, rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)
        backend = device.current_backend()  # gloo or nccl, whatever the group carries
        cfg = cfg.validate(world, pg_backend=backend)
        if not on and cfg.strategy != "single":
            raise ValueError(
                f"strategy {cfg.strategy!r} needs a torch.distributed process group "
                f"(run it on a Pool's engines); only 'single' runs without one"
            )
        here = device.current_device(backend)
        dims = cfg.dims(world)
        kind = device.device_type(backend)
        mesh = cached_mesh(dims, kind) if on else None
        experts = cached_expert_mesh(dims, kind) if on else None
        return cls(rank, world, dims, mesh, here, backend, on, experts), cfg

    def degree(self, dim: str) -> int:
        """The number of ranks in a group of ``dim``: a mesh dimension ("pp", "dp", "cp",
        "tp"), "dp_cp" (every data and context rank) or the expert split's "ep", "edp"."""
        d = self.dims
        return {"dp_cp": d.dp * d.cp, "edp": d.dp // d.ep}.get(dim) or getattr(d, dim)

    def group(self, dim: str):
        """The process group of ``dim`` (see `degree`) where it has more than one rank,
        else None (nothing to talk to)."""
        if self.degree(dim) == 1:
            return None
        mesh = self.expert_mesh if dim in ("ep", "edp") else self.mesh
        return mesh.get_group(dim)

    def data_group(self):
        """The ranks over which the loss and the replicated parameters' gradients are
        averaged: every data-parallel rank, and every context rank where cp > 1."""
        return self.group("dp_cp" if self.dims.cp > 1 else "dp")
