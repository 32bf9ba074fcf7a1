"""The step runner a simulated rank uses: the real strategy code wherever it runs fake.

FSDP2 (zero2, zero3), DTensor tensor parallelism and their combinations are built by
`nbpar.parallel.build_runner`, exactly as on an engine. Two pieces need real storage and
get a stand-in that does the same work:

- DDP's C++ reducer (ddp, and zero1 which is DDP + ZeroRedundancyOptimizer) reads
  parameter data at construction. The stand-in is DDP's math without its buckets: one
  all-reduce of every gradient after backward (`TensorParallelRunner`'s data-parallel
  path), with ZeroRedundancyOptimizer itself for zero1.
- torch's pipeline schedules agree on shapes through object collectives, which a fake
  group cannot answer; pipeline ranks run `nbpar.simulate.stages`.

DeepSpeed is refused: its engine flattens and copies real parameters at initialize.
"""

from __future__ import annotations

from nbpar.measure.holdings import optimizer_state_tensors, tensor_bytes
from nbpar.parallel.tensor import TensorParallelRunner
from nbpar.strategies import PIPELINED

#: the pipeline schedules `nbpar.simulate.stages` walks (one stage a rank)
SIMULATED = ("gpipe", "1f1b")


class Zero1StandIn(TensorParallelRunner):
    """Gradients all-reduced over dp, then ZeroRedundancyOptimizer's sharded step."""

    def memory(self) -> dict[str, int]:
        out = super().memory()
        out["optim_bytes"] = tensor_bytes(optimizer_state_tensors(self.optimizer.optim))
        return out


def check_simulable(cfg) -> None:
    """One line for what a fake world cannot run."""
    if cfg.backend != "torch":
        raise ValueError(
            "backend 'deepspeed' cannot be simulated: its engine flattens and "
            "copies real parameters at initialize; simulate backend 'torch'"
        )
    pipelined = cfg.strategy == "pipeline" or (cfg.strategy in PIPELINED and (cfg.pp or 1) > 1)
    if pipelined and cfg.schedule not in SIMULATED:
        raise ValueError(f"schedule {cfg.schedule!r} is not simulated; use 'gpipe' or '1f1b'")
    if pipelined and (cfg.cp or 1) > 1:
        raise ValueError(
            "context parallelism inside a pipeline is not simulated yet: simulate cp "
            "with pp 1 (dp, tp and cp)"
        )


def _data_parallel_standin(model, cfg, mesh):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nbpar.model.models import loss_fn
    from nbpar.parallel.common import autocast_dtype, make_optimizer, optimizer_spec

    dp = mesh["dp"]
    group = dp.get_group() if dp.size() > 1 else None
    if cfg.strategy == "zero1":
        cls, kwargs = optimizer_spec(cfg)
        opt = ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=cls, process_group=dp.get_group(), **kwargs
        )
        runner_cls = Zero1StandIn
    else:
        opt, runner_cls = make_optimizer(model.parameters(), cfg), TensorParallelRunner
    return runner_cls(
        model,
        opt,
        loss_fn(cfg.model),
        autocast_dtype=autocast_dtype(cfg),
        device_type="cpu",
        dp_group=group,
    )


def make_runner(model, cfg, mesh, rank: int):
    """This rank's runner for ``cfg`` on ``mesh`` (see the module docstring)."""
    from nbpar.parallel import build_runner

    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    if pp > 1:
        from nbpar.simulate.stages import build_stage_runner

        return build_stage_runner(model, cfg, mesh, rank)
    if cfg.strategy in ("ddp", "zero1") and tp == 1:
        return _data_parallel_standin(model, cfg, mesh)
    return build_runner(model, cfg, mesh)
