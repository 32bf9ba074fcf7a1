"""A validated parallel topology and the named DeviceMesh built from it.

After torchtitan's ``ParallelDims``: degrees dp, tp, pp (1 = off) whose product
must equal the world size; ranks are laid out pp-major, tp fastest, so the
ranks of one tensor-parallel group are neighbours (on GPUs: the same host).
"""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp", "tp")


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def require_hybrid_degrees(strategy: str, dp, tp, pp) -> None:
    """The one rule: a hybrid layout cannot be guessed, its degrees must be given."""
    if strategy == "hybrid" and dp is None and tp is None and pp is None:
        raise ValueError(
            "strategy 'hybrid' needs explicit degrees: set at least two of dp, "
            "tp and pp so that dp x tp x pp equals the number of engines"
        )


INTERLEAVED_CHUNKS = 2  # model chunks per rank in the interleaved 1F1B schedule


def check_pipeline_schedule(
    schedule: str, pp: int, micro_batches: int, n_layers: int, backend: str = "torch"
) -> int:
    """The one rule for a pipeline's schedule; returns the model chunks per rank.

    1F1B and interleaved keep at most pp micro-batches in flight, so they need at
    least pp of them (DeepSpeed's engine runs any number); every stage needs a layer.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not supported; choose one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if backend == "torch" and schedule != "gpipe" and micro_batches < pp:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many micro-batches "
            f"(grad_accum={micro_batches}) as pipeline stages (pp={pp}); "
            f"raise grad_accum or use schedule='gpipe'"
        )
    virtual = INTERLEAVED_CHUNKS if schedule == "interleaved" else 1
    if pp * virtual > n_layers:
        raise ValueError(
            f"schedule {schedule!r} with pp={pp} needs {pp * virtual} "
            f"layers, gpt.n_layers={n_layers}"
        )
    return virtual


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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = "
                f"{self.dp * self.tp * self.pp} must equal the number of engines "
                f"({self.world_size})"
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
