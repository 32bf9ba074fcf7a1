"""DDP by hand: average the gradients over ranks after backward, as DDP's hooks do."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem


def _model():
    import torch

    torch.manual_seed(0)  # the same weights on every rank, as DDP's first broadcast makes
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


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
