"""A fake world: one rank of an N-rank job, in this process, on fake tensors.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) answers every
collective at once without moving data, and ``FakeTensorMode`` gives tensors shapes,
dtypes and storages but no memory, so the real strategy code (FSDP2, DTensor, the
optimizer) runs its step for any world size on a laptop. The DeviceMesh is built before
fake mode is entered (inside it, mesh creation fails). On leaving, the group and its
meshes are destroyed, DTensor's caches forgotten, and the process is left as it was
found: a real run may follow.
"""

from __future__ import annotations

import contextlib
import warnings

from nbpar.parallel.mesh import cached_mesh, forget_shardings, release_meshes


def check_free() -> None:
    """Refuse, in one line, to replace a process group this process already runs."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "this process already has a torch.distributed process group; "
            "simulate in a process without one (e.g. the notebook kernel, "
            "not a %%dist cell)"
        )


@contextlib.contextmanager
def fake_rank(rank: int, dims, device_type: str = "cpu"):
    """``with fake_rank(r, dims) as (mesh, mode):`` rank ``r`` of ``dims.world_size``
    under a fake process group, its ("pp", "dp", "tp") mesh and a FakeTensorMode."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_free()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        # the expert mesh too (`cached_mesh` builds both): neither can be built inside
        mesh = cached_mesh(dims, device_type)
        with warnings.catch_warnings():
            # fake tensors have no data: torch warns whenever code asks for an address
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                yield mesh, mode
    finally:
        release_meshes()  # their groups first, then the default group
        dist.destroy_process_group()
        forget_shardings()
