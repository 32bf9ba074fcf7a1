"""Tensor parallelism by hand: a column-parallel linear then a row-parallel one (the
Megatron MLP), and the dp x tp DeviceMesh whose groups such layers talk in."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem

D_IN, HIDDEN, D_OUT, BATCH = 8, 12, 6, 4


def _weights():
    import torch

    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(HIDDEN, D_IN, generator=g)  # (hidden, in)
    w2 = torch.randn(D_OUT, HIDDEN, generator=g)  # (out, hidden)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, w1, w2


def check_tp_mlp(fn):
    """``fn(x, w1_shard, w2_shard)`` returns ``relu(x @ W1.T) @ W2.T`` on every rank,
    where ``w1_shard`` holds this rank's rows of W1 (column parallel: its share of the
    hidden features) and ``w2_shard`` the matching columns of W2 (row parallel)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if HIDDEN % world:
        raise ValueError(f"the tp exercise splits {HIDDEN} hidden features: use 2, 3 or 4 ranks")
    x, w1, w2 = _weights()
    full = torch.relu(x @ w1.T) @ w2.T
    part = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    partial = torch.relu(x @ w1[part].T) @ w2[:, part].T
    out, comm, error = runner.metered(fn, x.clone(), w1[part].clone(), w2[:, part].clone())
    facts = {"error": error, **comm}
    if error is None:
        facts.update(off=far(out, full), partial=far(out, partial), shape=list(out.shape))
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    out_bytes = BATCH * D_OUT * 4 * 2 * (world - 1) // world
    for r, f in enumerate(facts):
        if problems:
            break
        calls = f["calls"].get("all_reduce", 0)
        if f["off"] <= 1e-5 and calls == 1 and f["bytes"].get("all_reduce", 0) == out_bytes:
            continue
        if f["partial"] <= 1e-6:
            problems.append(
                f"rank {r} returns its partial sum: the row-parallel linear's outputs add up "
                f"over ranks, so all_reduce them (once, after the second linear)"
            )
        elif f["off"] > 1e-5:
            problems.append(
                f"rank {r}'s output is {f['off']:.3g} from nn.Linear's: the ReLU works on "
                f"the column-parallel shard as it is; only the row-parallel output is reduced"
            )
        elif calls != 1 or f["bytes"].get("all_reduce", 0) != out_bytes:
            problems.append(
                f"rank {r} called all_reduce {calls} times, moving "
                f"{f['bytes'].get('all_reduce', 0)} B: one all_reduce of the output "
                f"({BATCH}x{D_OUT}, {out_bytes} B) is all a column + row pair needs"
            )
    verdict = first_problem(
        "column- and row-parallel linears",
        problems,
        f"every rank's output equals the unsplit MLP's, with one all_reduce of the "
        f"{BATCH}x{D_OUT} output ({out_bytes} B) and none between the two linears",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict


def check_mesh(fn, dp: int = 2):
    """``fn(dp, tp)`` returns a 2-D DeviceMesh named ("dp", "tp") over all ranks, tp the
    inner dimension: a tp group is ``tp`` consecutive ranks (one node's GPUs)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world % dp:
        raise ValueError(f"the mesh exercise needs dp ({dp}) to divide the world ({world})")
    tp = world // dp
    mesh, _, error = runner.metered(fn, dp, tp)
    facts = {"error": error}
    if error is None:
        try:
            facts.update(
                names=list(mesh.mesh_dim_names or ()),
                shape=list(mesh.mesh.shape),
                tp=sorted(dist.get_process_group_ranks(mesh.get_group("tp"))),
                dp=sorted(dist.get_process_group_ranks(mesh.get_group("dp"))),
            )
        except Exception as e:  # no such dimension name
            facts["error"] = f"{type(e).__name__}: {e}"
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    want_tp = [list(range(r // tp * tp, r // tp * tp + tp)) for r in range(world)]
    want_dp = [list(range(r % tp, world, tp)) for r in range(world)]
    for r, f in enumerate(facts):
        if problems:
            break
        if f["names"] != ["dp", "tp"] or f["shape"] != [dp, tp]:
            problems.append(
                f"the mesh is {f['shape']} named {f['names']}: make it ({dp}, {tp}) named "
                f"('dp', 'tp')"
            )
        elif f["tp"] != want_tp[r]:
            problems.append(
                f"rank {r}'s tp group is ranks {f['tp']}, not {want_tp[r]}: tp must be the "
                f"inner (last) dimension, so its ranks are consecutive and stay on one node"
            )
        elif f["dp"] != want_dp[r]:
            problems.append(f"rank {r}'s dp group is ranks {f['dp']}, not {want_dp[r]}")
    verdict = first_problem(
        "a dp x tp DeviceMesh",
        problems,
        f"{dp} x {tp}: tp groups {sorted({tuple(g) for g in want_tp})} (consecutive ranks), "
        f"dp groups {sorted({tuple(g) for g in want_dp})}",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict
