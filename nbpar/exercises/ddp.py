"""DDP by hand: average the gradients over ranks after backward, as DDP's hooks do."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem


def _model():
    return runner.mlp(8, 16, 4)


def _backward(model, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


def check_average_gradients(fn):
    """``fn(model)``, called after ``loss.backward()``, leaves every parameter's ``.grad``
    equal to DDP's: the mean over ranks of the ranks' gradients."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(_model())
    _, ddp_comm, _ = runner.metered(_backward, ddp, rank)
    want = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    local = _model()
    _backward(local, rank)
    own = {n: p.grad.clone() for n, p in local.named_parameters()}
    _, comm, error = runner.metered(fn, local)
    facts = {"error": error, "ddp_bytes": ddp_comm["bytes"], "ddp_calls": ddp_comm["calls"]}
    facts.update(comm)
    if error is None:
        got = {n: p.grad for n, p in local.named_parameters()}
        facts["off"] = {n: far(got[n], want[n]) for n in want}
        facts["times_world"] = max(far(got[n], want[n] * world) for n in want)
        facts["own"] = max(far(got[n], own[n]) for n in want)
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    if not problems:
        problems = _problems(facts, world)
    f = facts[0]
    calls, sent = f["calls"].get("all_reduce", 0), f["bytes"].get("all_reduce", 0)
    ddp_calls, ddp_sent = f["ddp_calls"].get("all_reduce", 0), f["ddp_bytes"].get("all_reduce", 0)
    verdict = first_problem(
        "DDP by hand",
        problems,
        f"gradients equal DDP's on every rank; you called all_reduce {calls} time(s) and "
        f"sent {sent} B, DDP {ddp_calls} time(s) (its gradients packed in buckets) and "
        f"{ddp_sent} B",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict


def _problems(facts, world) -> list[str]:
    out = []
    for r, f in enumerate(facts):
        worst = max(f["off"], key=f["off"].get)
        if f["off"][worst] <= 1e-5:
            continue
        if f["times_world"] <= 1e-5:
            out.append(
                f"the gradients are {world}x DDP's: all_reduce sums, so divide by the "
                f"world size ({world})"
            )
        elif f["own"] <= 1e-7:
            out.append(
                f"rank {r}'s gradients are still its own: all_reduce every parameter's .grad"
            )
        else:
            out.append(f"{worst}.grad on rank {r} is {f['off'][worst]:.3g} from DDP's")
        break
    f = facts[0]
    sent, ddp_sent = f["bytes"].get("all_reduce", 0), f["ddp_bytes"].get("all_reduce", 0)
    if not out and ddp_sent and sent > 1.5 * ddp_sent:
        out.append(
            f"you called all_reduce {f['calls'].get('all_reduce', 0)} times and sent "
            f"{sent / ddp_sent:.1f}x the bytes DDP sends ({sent} B against {ddp_sent} B): "
            f"all_reduce each gradient once"
        )
    return out


def _micro_batches(rank: int, k: int):
    import torch

    g = torch.Generator().manual_seed(2000 + rank)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)) for _ in range(k)]


def check_accumulate(fn, k: int = 4):
    """``fn(ddp_model, micro_batches)`` runs forward and backward on each of the ``k``
    (x, y) micro-batches (MSE loss) so that the gradients equal one step on all of them
    at once, and DDP all-reduces only once: ``no_sync()`` on all but the last."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    batches = _micro_batches(rank, k)
    whole = DDP(_model())

    def one_step():
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(whole(x), y).backward()

    _, ref, _ = runner.metered(one_step)
    want = {n: p.grad.clone() for n, p in whole.module.named_parameters()}
    model = DDP(_model())
    _, comm, error = runner.metered(fn, model, batches)
    facts = {"error": error, "ref_calls": ref["calls"], "ref_bytes": ref["bytes"], **comm}
    if error is None:
        got = {n: p.grad for n, p in model.module.named_parameters()}
        facts["off"] = max(far(got[n], want[n]) for n in want)
        facts["times_k"] = max(far(got[n], want[n] * k) for n in want)
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    f = facts[0]
    calls, ref_calls = f["calls"].get("all_reduce", 0), f["ref_calls"].get("all_reduce", 0)
    if not problems:
        if f["off"] > 1e-5 and f["times_k"] <= 1e-5:
            problems.append(
                f"the gradients are {k}x one step's: each micro-batch's loss is a mean over "
                f"1/{k} of the batch, so divide it by {k} before backward"
            )
        elif f["off"] > 1e-5:
            problems.append(f"the gradients are {f['off']:.3g} from one step on all {k}")
        elif calls > ref_calls:
            problems.append(
                f"you all-reduced {calls} times where one step does {ref_calls}: "
                f"{calls / ref_calls:g}x the bytes; run all but the last micro-batch "
                f"inside model.no_sync()"
            )
    verdict = first_problem(
        "gradient accumulation with no_sync",
        problems,
        f"{k} micro-batches give one step's gradients, with {calls} all_reduce call(s), "
        f"as one step makes",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict
