"""Running a learner's function on every rank, and gathering what each rank saw.

A check is collective: every rank of the `%%dist` cell calls it. Each rank runs the
learner's code under nbpar's c10d meter (`nbpar.measure.comm.CommMeter`: calls and
bytes by op), reports its facts, and every rank gathers every rank's facts, so each
judges the same and returns the same Verdict; rank 0 prints it.
"""

from __future__ import annotations

import traceback


def metered(fn, *args, **kwargs) -> tuple[object, dict, str | None]:
    """(fn's result, {"calls": {op: n}, "bytes": {op: sent}}, its error or None)."""
    from nbpar.measure.comm import CommMeter

    meter = CommMeter()
    out, error = None, None
    with meter:
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # the learner's code: its error is the hint
            frame = traceback.extract_tb(e.__traceback__)[-1]
            error = f"{type(e).__name__}: {e} (line {frame.lineno}: {frame.line})"
    return out, {"calls": dict(meter.calls), "bytes": meter.by_op()}, error


def gather(facts: dict) -> list[dict]:
    """Every rank's ``facts``, in rank order, on every rank."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, facts)
    return everyone


def announce(verdict) -> None:
    """Rank 0 prints the verdict (a `%%dist` cell shows it once); without a process
    group (the sizing exercises, in the notebook's own process) it is printed here."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(verdict)


def mlp(*widths: int, seed: int = 0):
    """Linear layers of ``widths`` with ReLUs between, the same weights on every rank
    (as DDP's first broadcast makes them), drawn without touching the learner's RNG."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])


def errors(facts: list[dict]) -> list[str]:
    """'rank 1 raised ...' for each rank whose code raised."""
    return [f"rank {r} raised {f['error']}" for r, f in enumerate(facts) if f.get("error")]
