"""A validated parallel topology: degrees per dimension and each rank's place.

After torchtitan's ``ParallelDims``: degrees dp, cp, tp, pp (1 = off) whose product
must equal the world size; ranks are laid out pp-major, then dp, then cp, tp fastest, so
the ranks of one tensor-parallel group are neighbours (on GPUs: the same host), and the
ranks that split one sequence (cp) next to them. Expert parallelism does not multiply
the world: as in DeepSpeed-MoE, the ``ep`` ranks that share out the experts are
data-parallel ranks (``ep`` divides ``dp``), and the ``dp / ep`` ranks holding the same
experts ("edp") average their gradients. Pure Python at import (`build_mesh` imports torch
when called); `nbpar.parallel.mesh` keeps the mesh of the layout in use.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbpar.checks import positive_int
from nbpar.errors import ConfigError

MESH_DIMS = ("pp", "dp", "cp", "tp")


def layout_words(degrees: dict) -> str:
    """ "dp 8 x tp 1 x pp 4", then " x cp 2 (ring)" and ", ep 8" where they split: the
    degrees of a result's config, estimate or what-fits row, for people."""
    out = f"dp {degrees['dp']} x tp {degrees['tp']} x pp {degrees['pp']}"
    if (degrees.get("cp") or 1) > 1:
        attention = degrees.get("attention")
        out += f" x cp {degrees['cp']}" + (f" ({attention})" if attention else "")
    if (degrees.get("ep") or 1) > 1:
        out += f", ep {degrees['ep']}"
    return out


#: the dimensions a layout has a degree for (ep is carved out of dp)
DIMS = ("dp", "tp", "pp", "cp", "ep")


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of each parallel dimension; ``dp * cp * tp * pp == world_size``."""

    dp: int = 1
    """data-parallel degree (DDP / ZeRO shard groups); 1 = off"""
    tp: int = 1
    """tensor-parallel degree (Megatron-style column/row splits); 1 = off"""
    pp: int = 1
    """pipeline-parallel degree (number of stages); 1 = off"""
    cp: int = 1
    """context-parallel degree (ranks that split every sequence); 1 = off"""
    ep: int = 1
    """expert-parallel degree (data-parallel ranks sharing out the experts; divides dp);
    1 = off"""
    world_size: int

    def __post_init__(self):
        for name in (*DIMS, "world_size"):
            positive_int(name, getattr(self, name))
        product = self.dp * self.cp * self.tp * self.pp
        if product != self.world_size:
            named = [f"{k}" for k in ("dp", "cp", "tp", "pp") if k != "cp" or self.cp > 1]
            values = "*".join(str(getattr(self, k)) for k in named)
            raise ConfigError(
                f"{'*'.join(named)} = {values} = {product} must equal the number of "
                f"engines ({self.world_size})",
                fields=tuple(named),
            )
        if self.dp % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide dp={self.dp}: the expert-parallel ranks are "
                f"data-parallel ranks that share out the experts",
                fields=("ep", "dp"),
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh's shape, in `MESH_DIMS` order."""
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def key(self) -> tuple[int, ...]:
        """What tells two layouts' meshes apart (the shape and the expert split)."""
        return (*self.shape, self.ep)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on each named dimension (``ep``: its place among the
        ranks sharing out the experts, ``edp``: which copy of its experts it holds)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        dp = (rank // (self.cp * self.tp)) % self.dp
        return {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": dp,
            "cp": (rank // self.tp) % self.cp,
            "tp": rank % self.tp,
            "ep": dp % self.ep,
            "edp": dp // self.ep,
        }

    def build_mesh(self, device_type: str = "cpu"):
        """The 4-D DeviceMesh with dims ("pp", "dp", "cp", "tp"), and, where cp > 1, the
        flattened "dp_cp" (the ranks whose replicated parameters' gradients are averaged:
        every data and context rank); needs a process group. The expert split is
        `build_expert_mesh`'s."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        if self.cp > 1:
            mesh["dp", "cp"]._flatten("dp_cp")
        return mesh

    def build_expert_mesh(self, mesh):
        """``mesh``'s "dp" split into ("edp", "ep"): dp / ep copies of ep ranks; the ranks
        of an "ep" group are neighbours in dp, so they exchange tokens, and the ranks of
        an "edp" group hold the same experts. None where ep is 1."""
        if self.ep == 1:
            return None
        return mesh._unflatten("dp", (self.dp // self.ep, self.ep), ("edp", "ep"))
