"""Which ranks of a layout hold the same thing, and the one rank simulated for each.

Ranks are laid out pp-major, tp fastest (`nbpar.dims.ParallelDims`). Ranks of
one pipeline stage hold the same layers, and tensor- and data-parallel ranks hold equal
shares of them (FSDP2 pads uneven shards; `check_tp` refuses a tp that does not divide
heads and widths), so one rank per stage stands for the stage: its first rank.
ZeroRedundancyOptimizer (zero1) is the exception the numbers mention: it hands whole
tensors to dp ranks greedily, largest first, so their optimizer shares differ, by a lot
when one tensor outweighs an even share (the ZeRO paper's 7.5B model on 64 ranks: 2.1 GB
of Adam state on rank 0, which gets one of the largest weights, against 0.9 GB on
average). The simulated rank 0 holds the most.

Pipeline stages that hold the same module (as many layers, the same ends: not the first,
not the last) differ only in their schedule: one rank is simulated for all of them and
each one's step is composed from its segments in its own order
(`nbpar.simulate.segments`), except under FSDP2, whose stages each run every micro-batch.
"""

from __future__ import annotations


def roles(dims) -> list[tuple[int, list[int]]]:
    """[(rank simulated, ranks it stands for)] — one entry per pipeline stage."""
    per_stage = dims.world_size // dims.pp
    return [
        (stage * per_stage, list(range(stage * per_stage, (stage + 1) * per_stage)))
        for stage in range(dims.pp)
    ]


def stage_roles(cfg, dims, compose: bool = True) -> list[tuple[int, list[int] | None]]:
    """[(rank simulated, the pipeline stages it stands for)]: one per group of stages
    that hold the same module, their first stage's first rank, its step composed from
    segments; (rank, None) where every micro-batch runs: one per stage without a
    pipeline, with ``compose`` False, under FSDP2 over dp, or when the config does not
    say the model's layers."""
    from nbpar.model.registry import known_shape
    from nbpar.parallel.pipeline_cut import layer_ranges
    from nbpar.strategies import reshard_after_forward

    per_stage, pp = dims.world_size // dims.pp, dims.pp
    layers, _ = known_shape(cfg)
    fsdp = dims.dp > 1 and reshard_after_forward(cfg.strategy, cfg.fsdp_reshard) is not None
    if pp == 1 or not compose or fsdp or layers is None:
        return [(stage * per_stage, None) for stage in range(pp)]
    groups: dict[tuple, list[int]] = {}
    for stage, held in enumerate(layer_ranges(layers, pp)):
        groups.setdefault((stage == 0, stage == pp - 1, len(held)), []).append(stage)
    return [(stages[0] * per_stage, stages) for stages in groups.values()]


def describe(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: a short label for people."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)
