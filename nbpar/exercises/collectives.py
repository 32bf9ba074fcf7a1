"""Collectives by hand: a ring all-reduce from send/recv, an all-reduce from a
reduce-scatter and an all-gather. Each is checked against torch's all_reduce on the
same inputs, and its traffic against what the algorithm sends."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem

FLOAT = 4  # bytes per fp32 element


def _inputs(numel: int | None):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = numel or 12 * world
    x = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))
    expected = x.clone()
    dist.all_reduce(expected)  # outside the meter: the reference
    return x, expected, world


def _run(fn, numel):
    """The learner's fn on a fresh copy of this rank's input; (facts, world)."""
    x, expected, world = _inputs(numel)
    given = x.clone()
    out, comm, error = runner.metered(fn, given)
    result = out if out is not None else given  # in place, or returned
    chunks = expected.chunk(world)
    facts = {"error": error, "numel": x.numel(), **comm}
    if error is None:
        facts.update(
            off=far(result, expected),
            own=far(result, x),
            mean=far(result, expected / world),
            full_chunks=sum(
                far(c, e) < 1e-4 for c, e in zip(result.chunk(world), chunks, strict=False)
            ),
        )
    return runner.gather(facts), world


def _values(facts, world) -> list[str]:
    """What is wrong with the results, rank by rank."""
    out = []
    for r, f in enumerate(facts):
        if f["off"] == float("inf"):
            out.append(f"rank {r}'s result has another shape than its input")
        elif f["off"] > 1e-4:
            if f["mean"] < 1e-4:
                out.append(f"rank {r} holds the mean, not the sum: all_reduce sums")
            elif f["own"] < 1e-6:
                out.append(f"rank {r} still holds its own input: nothing it received was kept")
            elif 0 < f["full_chunks"] < world:
                out.append(
                    f"only {f['full_chunks']} of {world} chunks are the full sum on rank {r}: "
                    f"a ring takes {world - 1} reduce-scatter steps, then {world - 1} "
                    f"all-gather steps that pass the finished chunks on"
                )
            else:
                out.append(f"rank {r}'s result is {f['off']:.3g} from the sum over ranks")
    return out


def check_ring_all_reduce(fn, numel: int | None = None):
    """``fn(t)`` sums ``t`` over all ranks using only send/recv (or isend/irecv)."""
    facts, world = _run(fn, numel)
    problems = runner.errors(facts)
    theory = 2 * (world - 1) / world * facts[0]["numel"] * FLOAT
    for r, f in enumerate(facts):
        others = sorted(op for op in f["calls"] if op != "send_recv")
        if others:
            problems.append(
                f"rank {r} called {', '.join(others)}: write the ring from send and recv only"
            )
    if not runner.errors(facts):
        problems += _values(facts, world)
    for r, f in enumerate(facts):
        sent, calls = f["bytes"].get("send_recv", 0), f["calls"].get("send_recv", 0)
        if sent > 1.1 * theory:
            problems.append(
                f"rank {r} sent {sent} B where a ring sends 2(N-1)/N of the tensor, "
                f"{theory:.0f} B: send one chunk (1/{world} of it) per step, not the whole tensor"
            )
        elif calls != 4 * (world - 1):
            problems.append(
                f"rank {r} took {calls / 2:g} steps of one send and one receive: a ring of "
                f"{world} takes 2(N-1) = {2 * (world - 1)}, each passing one chunk"
            )
    verdict = first_problem(
        "ring all-reduce",
        problems,
        f"every rank holds the sum; each sent {theory:.0f} B, 2(N-1)/N of the tensor, "
        f"in {2 * (world - 1)} steps, as a ring does",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict


def check_all_reduce_from_halves(fn, numel: int | None = None):
    """``fn(t)`` sums ``t`` over all ranks with one reduce-scatter and one all-gather."""
    facts, world = _run(fn, numel)
    problems = runner.errors(facts)
    for r, f in enumerate(facts):
        if "all_reduce" in f["calls"]:
            problems.append(f"rank {r} called all_reduce: build it from the two halves")
        missing = [op for op in ("reduce_scatter", "all_gather") if op not in f["calls"]]
        if missing:
            problems.append(f"rank {r} never called {' or '.join(missing)}")
    if not runner.errors(facts):
        problems += _values(facts, world)
    theory = 2 * (world - 1) / world * facts[0]["numel"] * FLOAT
    sent = facts[0]["bytes"].get("reduce_scatter", 0) + facts[0]["bytes"].get("all_gather", 0)
    verdict = first_problem(
        "all-reduce = reduce-scatter + all-gather",
        problems,
        f"every rank holds the sum; the two halves moved {sent} B a rank, what one "
        f"all_reduce moves ({theory:.0f} B): (N-1)/N of the tensor each",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict
