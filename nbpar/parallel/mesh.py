"""The named DeviceMesh of a `nbpar.dims.ParallelDims` layout, one per layout per process
group (its topology rules live in `nbpar.dims`)."""

from __future__ import annotations

from nbpar.dims import ParallelDims

# Process-wide registry (one per engine process): the mesh of each layout, for the life
# of the default process group.
_MESHES: dict = {}


def cached_mesh(dims: ParallelDims, device_type: str):
    """One DeviceMesh per layout for the life of the process group.

    Destroying a mesh's sub-groups after a run breaks the next mesh of the same
    layout (DTensor resolves groups by registered name); keeping one mesh per
    layout costs a few sub-groups and nothing per run. `nbpar.pool.worker.leave` clears
    it when the default group goes away.
    """
    import torch.distributed as dist

    key = (dims.shape, device_type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = dims.build_mesh(device_type)
    return _MESHES[key]


def forget_meshes() -> None:
    """Drop cached meshes (their groups die with the default process group)."""
    _MESHES.clear()
