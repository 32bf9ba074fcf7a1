"""A validated parallel topology: degrees per dimension and each rank's place.

After torchtitan's ``ParallelDims``: degrees dp, tp, pp (1 = off) whose product
must equal the world size; ranks are laid out pp-major, tp fastest, so the
ranks of one tensor-parallel group are neighbours (on GPUs: the same host).
Pure Python at import (`build_mesh` imports torch when called); `nbpar.parallel.mesh`
keeps one mesh per layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbpar.checks import positive_int
from nbpar.errors import ConfigError

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each parallel dimension; ``dp * tp * pp == world_size``."""

    dp: int = 1
    """data-parallel degree (DDP / ZeRO shard groups); 1 = off"""
    tp: int = 1
    """tensor-parallel degree (Megatron-style column/row splits); 1 = off"""
    pp: int = 1
    """pipeline-parallel degree (number of stages); 1 = off"""
    world_size: int

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "world_size"):
            positive_int(name, getattr(self, name))
        if self.dp * self.tp * self.pp != self.world_size:
            raise ConfigError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = "
                f"{self.dp * self.tp * self.pp} must equal the number of engines "
                f"({self.world_size})",
                fields=("dp", "tp", "pp"),
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on each named dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": (rank // self.tp) % self.dp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str = "cpu"):
        """The 3-D DeviceMesh with dims ("pp", "dp", "tp"); needs a process group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
