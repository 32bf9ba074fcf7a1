"""The named DeviceMesh of a `nbpar.dims.ParallelDims` layout (its topology rules live in
`nbpar.dims`): the last layout's mesh is kept for the next run of the same layout, and a
run of another layout releases its communicators first."""

from __future__ import annotations

from nbpar.dims import ParallelDims

# Process-wide (one per engine process): the meshes of the layout used last, under the key
# (layout, device type, default group): (the mesh, its expert mesh or None). At most one
# entry.
_MESHES: dict = {}
#: the dimensions of a mesh whose groups `release_meshes` destroys (flattened ones too)
_NAMES = ("pp", "dp", "cp", "tp", "dp_cp")
_EXPERT_NAMES = ("edp", "ep")


def cached_mesh(dims: ParallelDims, device_type: str):
    """The DeviceMesh of ``dims``: the previous run's when the layout is the same,
    otherwise a new one, after `release_meshes` destroyed the previous layout's groups.

    One layout at a time bounds what the meshes hold (on GPUs, every NCCL communicator
    has its own buffers) to the layout in use, while re-running a cell of the same
    layout builds nothing. A model or optimizer of an earlier run of another layout
    cannot communicate any more: its groups are gone.
    """
    import torch.distributed as dist

    key = (dims.key, device_type, id(dist.group.WORLD))
    if key not in _MESHES:
        release_meshes()
        mesh = dims.build_mesh(device_type)
        _MESHES[key] = (mesh, dims.build_expert_mesh(mesh))
    return _MESHES[key][0]


def cached_expert_mesh(dims: ParallelDims, device_type: str):
    """The ("edp", "ep") split of `cached_mesh`'s "dp" (`ParallelDims.build_expert_mesh`),
    None where ep is 1."""
    import torch.distributed as dist

    cached_mesh(dims, device_type)
    return _MESHES[(dims.key, device_type, id(dist.group.WORLD))][1]


def release_meshes() -> None:
    """Destroy the cached mesh's sub-groups (a dimension that spans the whole world uses
    the default group, which stays), and forget DTensor's shardings that name them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = {}
    for mesh, experts in _MESHES.values():
        for m, names in ((mesh, _NAMES), (experts, _EXPERT_NAMES)):
            for name in names if m is not None else ():
                try:
                    group = m.get_group(name)
                except (KeyError, ValueError, RuntimeError):
                    continue  # a dimension this mesh has not (dp_cp without cp)
                groups[id(group)] = group
    for group in groups.values():
        if group is not dist.group.WORLD and group in c10d._world.pg_map:
            dist.destroy_process_group(group)
    if _MESHES:
        forget_shardings()
    _MESHES.clear()


def forget_meshes() -> None:
    """Drop cached meshes without destroying anything: their groups die with the default
    process group, which the caller is about to destroy."""
    _MESHES.clear()


def forget_shardings() -> None:
    """Drop DTensor's sharding caches: their entries hold the meshes they were computed
    on, whose groups a later mesh of the same shape must not be handed."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
