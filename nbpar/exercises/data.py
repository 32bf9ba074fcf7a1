"""A DistributedSampler by hand: which samples each rank reads, epoch by epoch."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import first_problem


def reference_indices(n: int, rank: int, world: int, epoch: int, seed: int) -> list[int]:
    """torch's DistributedSampler(shuffle=True) after set_epoch(epoch)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), world, rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_shard_indices(fn, n: int = 10, seed: int = 0):
    """``fn(n, rank, world, epoch, seed)`` returns the sample indices ``rank`` reads in
    ``epoch``: its own shard, shuffled anew each epoch, every rank the same count."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine, error = {}, None
    for epoch in (0, 1):
        got, _, error = runner.metered(fn, n, rank, world, epoch, seed)
        if error:
            break
        mine[epoch] = [int(i) for i in got]
    facts = runner.gather({"error": error, "epochs": mine})
    problems = runner.errors(facts)
    if not problems:
        problems = _problems(facts, n, world, seed)
    verdict = first_problem(
        "a DistributedSampler by hand",
        problems,
        f"each of {world} ranks reads its own {len(facts[0]['epochs'][0])} samples, "
        f"in DistributedSampler's order, shuffled anew in epoch 1",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict


def _problems(facts, n, world, seed) -> list[str]:
    out = []
    epochs = [f["epochs"] for f in facts]
    for r in range(1, world):
        if epochs[r][0] == epochs[0][0]:
            out.append(
                f"rank {r} read the same samples as rank 0: did each rank get its own "
                f"shard (every {world}th index, starting at its rank)?"
            )
    lengths = sorted({len(e[0]) for e in epochs})
    if len(lengths) > 1:
        out.append(
            f"ranks read different numbers of samples ({', '.join(map(str, lengths))}): "
            f"pad to ceil(n / world) = {-(-n // world)} each, as DistributedSampler does, "
            f"or the ranks fall out of step at the last batch"
        )
    missing = sorted(set(range(n)) - {i for e in epochs for i in e[0]})
    if missing:
        out.append(f"samples {missing[:5]} are read by no rank in epoch 0")
    for r in range(world):
        if epochs[r][1] == epochs[r][0]:
            out.append(
                f"epoch 1 repeated epoch 0's order on rank {r}: did you call set_epoch "
                f"(seed the shuffle with seed + epoch)?"
            )
            break
    for r in range(world):
        for epoch in (0, 1):
            if epochs[r][epoch] != reference_indices(n, r, world, epoch, seed):
                out.append(
                    f"rank {r}'s epoch {epoch} differs from DistributedSampler's: shuffle with "
                    f"torch.randperm(n, generator=torch.Generator().manual_seed(seed + "
                    f"epoch)), pad with the first indices, take indices[rank::world]"
                )
                return out
    return out
