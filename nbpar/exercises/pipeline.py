"""A two-stage GPipe schedule by hand: micro-batches forward through both stages with
send/recv, then backward, the gradients of the stage boundary sent back."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem

D_IN, HIDDEN, D_OUT, BATCH = 8, 16, 4, 8


def _model():
    return runner.mlp(D_IN, HIDDEN, D_OUT, seed=3)


def _data():
    import torch

    g = torch.Generator().manual_seed(4)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def check_gpipe(fn, micro: int = 4, timeout: float = 10.0):
    """``fn(stage, rank, data, group)`` on 2 ranks: rank 0's ``stage`` is Linear + ReLU
    and ``data`` its input micro-batches; rank 1's ``stage`` is the last Linear and
    ``data`` the targets. All forwards, then all backwards (GPipe), each micro-batch's MSE
    divided by their number; every send and recv on ``group``. The stages' gradients
    must equal one process's on the whole batch."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise ValueError(f"the GPipe exercise has 2 stages: run it on 2 ranks, not {world}")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    full = _model()
    x, y = _data()
    torch.nn.functional.mse_loss(full(x), y).backward()
    layers = list(full)
    stage = _model()
    stage = torch.nn.Sequential(*list(stage)[:2]) if rank == 0 else list(stage)[2]
    want = layers[0] if rank == 0 else layers[2]
    data = list(x.chunk(micro)) if rank == 0 else list(y.chunk(micro))
    _, comm, error = runner.metered(fn, stage, rank, data, group)
    if error and ("timed out" in error.lower() or "timeout" in error.lower()):
        error = "timeout"
    facts = {"error": error, **comm}
    if error is None:
        mine = stage[0] if rank == 0 else stage
        facts["off"] = max(
            far(mine.weight.grad, want.weight.grad), far(mine.bias.grad, want.bias.grad)
        )
        facts["times_m"] = far(mine.weight.grad, want.weight.grad * micro)
        facts["sends"] = comm["calls"].get("send_recv", 0)
    facts = runner.gather(facts)
    problems = []
    for r, f in enumerate(facts):
        made = f["calls"].get("send_recv", 0)
        if f["error"] is None and made < 2 * micro:  # a stage that finished: its count
            problems.append(
                f"stage {r} made {made} sends and receives where GPipe makes 2m = {2 * micro} "
                f"({micro} activations one way, {micro} gradients back): "
                + (
                    "does it send every micro-batch, and receive each gradient?"
                    if r == 0
                    else "does it receive every micro-batch, and send back each gradient?"
                )
            )
    if any(f["error"] == "timeout" for f in facts):  # which rank gives up first is a race
        problems.append(
            f"a send or recv waited {timeout:g} s with nobody answering: does stage 1 "
            f"receive every micro-batch stage 0 sends, and send back each gradient?"
        )
    problems += [p for p in runner.errors(facts) if "raised timeout" not in p]
    if not problems:
        for r, f in enumerate(facts):
            if f["off"] <= 1e-5:
                continue
            if f["times_m"] <= 1e-5:
                problems.append(
                    f"stage {r}'s gradients are {micro}x one step's: divide each "
                    f"micro-batch's loss by the number of micro-batches ({micro})"
                )
            else:
                problems.append(f"stage {r}'s gradients are {f['off']:.3g} from one process's")
            break
    bubble = 1 / (micro + 1)
    verdict = first_problem(
        "a two-stage GPipe",
        problems,
        f"both stages' gradients equal one process's; {micro} micro-batches each way, "
        f"{2 * micro} sends and receives a stage; the schedule idles (p-1)/(m+p-1) = "
        f"{bubble:.0%} of its time (more micro-batches, less bubble)",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict
