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
"""

from __future__ import annotations


def roles(dims) -> list[tuple[int, list[int]]]:
    """[(rank simulated, ranks it stands for)] — one entry per pipeline stage."""
    per_stage = dims.dp * dims.tp
    return [
        (stage * per_stage, list(range(stage * per_stage, (stage + 1) * per_stage)))
        for stage in range(dims.pp)
    ]


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
