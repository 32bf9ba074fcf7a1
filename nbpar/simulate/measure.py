"""One simulated rank: build, warm up, measure one step, report what a real run reports.

The figures have the keys of a real run's per-rank result (`nbpar.train.loop`):
``param_bytes``, ``grad_bytes``, ``optim_bytes`` held after the step (the runner's own
count), ``activation_bytes`` and ``peak_bytes`` from the same meter
(`nbpar.measure.memtrack.StepMemory`), ``comm_bytes`` and ``comm_bytes_by_op`` from
`nbpar.measure.comm.CommMeter`; plus what only a simulation splits out:
``comm_buffer_bytes`` and ``temp_bytes`` at the peak (`nbpar.simulate.meter`).

A mixture-of-experts model routes its tokens uniformly here (`nbpar.model.moe.uniform_routing`):
which expert a token picks is data, and fake tensors have none.
"""

from __future__ import annotations

import torch
from torch import nn


def example_batch(cfg, model: nn.Module):
    """One micro-batch of the shape the model trains on: token ids for language models
    (targets the same shape), 32x32 images with labels for simple_cnn."""
    b = cfg.micro_batch
    if cfg.model == "simple_cnn":
        return torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(
            f"model {cfg.model!r} takes no token ids (no nn.Embedding); "
            f"simulate knows the inputs of simple_cnn and language models"
        )
    tokens = torch.randint(0, emb.num_embeddings, (b, cfg.gpt.seq_len))
    return tokens, tokens


def failing_module(tb) -> str | None:
    """The innermost nn.Module whose code was running when ``tb`` was raised."""
    name = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            name = type(owner).__name__
        tb = tb.tb_next
    return name


def explain(err: Exception, what: str, model_name) -> ValueError:
    """One line: which model, which step, which module, what went wrong."""
    where = failing_module(err.__traceback__)
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ValueError(
        f"model {model_name!r} cannot be {what} on fake tensors"
        + (f": in module {where}" if where else "")
        + f": {type(err).__name__}: {first}"
    )


def warm_up(runner, batches) -> None:
    """Create what the measured step inherits, as a real run's first step does: the
    optimizer state and gradients (an optimizer step on zero gradients, no forward
    needed) or, under FSDP2, whose lazy init needs a forward, a step on ``batches``."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in runner.model.modules()):
        runner.train_step(batches)
        return
    for p in runner.parameters():
        p.grad = torch.zeros_like(p)
    runner.optimizer_step()


def simulate_rank(cfg, dims, rank: int, stages=None) -> list[dict]:
    """Figures of ``rank`` after a warm-up step and one measured step of ``grad_accum``
    micro-batches: one row, or with ``stages`` (pipeline stages holding the same module
    as rank's, its own first) one row per stage, each composed from the step's segments
    in that stage's schedule order (`nbpar.simulate.segments`)."""
    from nbpar.measure.comm import CommMeter
    from nbpar.model.models import build_model
    from nbpar.model.moe import assume_uniform_routing, uniform_routing
    from nbpar.simulate.meter import SimMemory
    from nbpar.simulate.runners import make_runner
    from nbpar.simulate.segments import SegmentMeter
    from nbpar.simulate.world import fake_rank

    with fake_rank(rank, dims) as (mesh, _mode), uniform_routing():
        try:
            model = assume_uniform_routing(build_model(cfg))
        except Exception as err:
            raise explain(err, "built", cfg.model) from None
        # the batches first: a pipeline stage is cut from the model itself
        batches = [example_batch(cfg, model) for _ in range(cfg.grad_accum)]
        runner = make_runner(model, cfg, mesh, rank)
        runner.set_update_rule(cfg, None)
        try:
            warm_up(runner, batches[:1])
            with CommMeter() as comm, SimMemory(runner) as mem:
                meter = SegmentMeter(mem, comm) if stages is not None else None
                if meter is None:
                    runner.train_step(batches)
                else:
                    runner.segments_step(batches, meter)
        except Exception as err:
            raise explain(err, "trained", cfg.model) from None
        if mem.error is not None:
            raise ValueError(f"the memory meter could not follow this step: {mem.error}")
        states = runner.memory()
        runner.close()
    if meter is None:
        figures = {"peak": mem.peak, "saved_peak": mem.saved_peak, "at_peak": mem.at_peak}
        return [_row(rank, states, {**figures, "sent": comm.bytes_by_op})]
    per_stage = dims.world_size // dims.pp
    return [_row(stage * per_stage, states, _composed(cfg, dims, meter, stage)) for stage in stages]


def _composed(cfg, dims, meter, stage: int) -> dict:
    """Pipeline stage ``stage``'s step: the segments replayed in its schedule order."""
    from nbpar.simulate.segments import compose
    from nbpar.simulate.stages import schedule_order

    order = schedule_order(cfg.schedule, stage, dims.pp, cfg.grad_accum)
    return compose(meter.segments, meter.start, order)


def _row(rank: int, states: dict, step: dict) -> dict:
    """A simulated rank's figures, keyed as a real run's (plus the peak's breakdown)."""
    from nbpar.measure.metrics import step_peak_bytes
    from nbpar.measure.records import model_state_bytes

    out = {
        "rank": rank,
        **states,
        "tracked_peak_bytes": step["peak"],
        "activation_bytes": step["saved_peak"],
    }
    out["peak_bytes"] = step_peak_bytes(out)
    acts, comm = step["at_peak"]["activations"], step["at_peak"]["comm"]
    temp = max(0, step["peak"] - model_state_bytes(out) - acts - comm)
    out.update(comm_buffer_bytes=comm, temp_bytes=temp)
    sent = step["sent"]  # as `CommMeter.total` and `CommMeter.by_op` round them
    by_op = {op: int(round(n)) for op, n in sorted(sent.items())}
    out.update(comm_bytes=int(round(sum(sent.values()))), comm_bytes_by_op=by_op)
    return out
