"""Switching layouts releases the previous layout's communicators (issue: every mesh
layout's groups lived as long as the default group): on 4 gloo processes, runs of four
layouts in turn keep at most one layout's sub-groups, and a layout run again after its
groups were destroyed trains exactly as it did the first time."""

from __future__ import annotations

from nbpar.config import GPTConfig, TrainConfig
from tests.distributed import run_distributed

GPT = GPTConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16)
LAYOUTS = [
    dict(strategy="hybrid", dp=2, tp=2),
    dict(strategy="ddp"),
    dict(strategy="hybrid", dp=2, tp=2),  # again, on new groups
    dict(strategy="pipeline", schedule="1f1b", grad_accum=4),
    dict(strategy="zero3"),
    dict(strategy="tp"),
    dict(strategy="hybrid", dp=2, tp=2),
]


def _in_turn(rank, world):
    from torch.distributed import distributed_c10d as c10d

    from nbpar.train.loop import run_training

    out = []
    for layout in LAYOUTS:
        cfg = TrainConfig(model="tiny_gpt", gpt=GPT, micro_batch=2, steps=3, seed=0, **layout)
        losses = run_training(cfg)["losses"]
        out.append((losses, len(c10d._world.pg_map)))
    return out


def test_a_new_layout_releases_the_last_ones_groups_and_a_layout_runs_again_the_same():
    per_rank = run_distributed(_in_turn, 4, timeout=300)
    for rank, runs in enumerate(per_rank):
        groups = [n for _, n in runs]
        # the default group plus one mesh's pp, dp, cp and tp groups at most
        assert max(groups) <= 5, (rank, groups)
        first, again, last = (runs[i][0] for i in (0, 2, 6))
        assert again == first and last == first, rank  # bit for bit, on new groups


def _groups_of_new_dimensions(rank, world):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from nbpar.dims import ParallelDims
    from nbpar.parallel.mesh import cached_expert_mesh, cached_mesh, release_meshes

    dims = ParallelDims(dp=2, cp=2, ep=2, world_size=world)
    mesh, experts = cached_mesh(dims, "cpu"), cached_expert_mesh(dims, "cpu")
    ranks = {
        name: dist.get_process_group_ranks(m.get_group(name))
        for m, names in ((mesh, ("dp", "cp", "dp_cp")), (experts, ("ep", "edp")))
        for name in names
    }
    before = len(c10d._world.pg_map)
    release_meshes()
    return ranks, before, len(c10d._world.pg_map)


def test_context_and_expert_groups_follow_the_layout_and_are_released():
    """dp 2 x cp 2 on 4 ranks: cp groups are neighbours, dp_cp is every rank, ep (of dp)
    pairs the ranks of the same cp place; releasing leaves the default group alone."""
    per_rank = run_distributed(_groups_of_new_dimensions, 4)
    for rank, (ranks, before, after) in enumerate(per_rank):
        assert ranks["cp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ranks["dp"] == [rank % 2, rank % 2 + 2]
        assert ranks["dp_cp"] == [0, 1, 2, 3]
        assert ranks["ep"] == ranks["dp"] and len(ranks["edp"]) == 1
        assert before > after == 1
