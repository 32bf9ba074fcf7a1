"""ZeRO by hand: the optimizer state sharded over ranks (ZeRO-1), and FSDP2's
``fully_shard`` applied layer by layer (ZeRO-3)."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import far, first_problem

NUMEL = 48


def check_zero1_step(fn, lr: float = 0.1):
    """``fn(flat_params, flat_grad, lr)`` takes one Adam step the ZeRO-1 way: an Adam over
    this rank's 1/N slice of the flat parameter vector only, then an all-gather of the
    updated slices; it returns (the full updated vector, that optimizer)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    params, grad = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    full = params.clone().requires_grad_()
    full.grad = grad.clone()
    torch.optim.Adam([full], lr=lr).step()
    (out, opt), comm, error = _unpack(runner.metered(fn, params.clone(), grad.clone(), lr))
    facts = {"error": error, **comm}
    if error is None:
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        facts.update(
            off=far(out.detach(), full.detach()),
            unchanged=int((out.detach() == params).sum()),
            state_bytes=sum(t.numel() * t.element_size() for t in state if t.numel() > 1),
        )
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    shard_state = 2 * NUMEL // world * 4  # exp_avg and exp_avg_sq of one slice, fp32
    gathered = (world - 1) * NUMEL // world * 4
    for r, f in enumerate(facts):
        if problems:
            break
        if f["state_bytes"] > shard_state:
            problems.append(
                f"rank {r}'s Adam holds {f['state_bytes']} B of state: ZeRO-1 keeps only its "
                f"slice's, 2 x {NUMEL // world} x 4 = {shard_state} B; build the Adam over "
                f"flat_params[rank * n // world : (rank + 1) * n // world]"
            )
        elif f["unchanged"] >= NUMEL // world:
            problems.append(
                f"{f['unchanged']} of rank {r}'s {NUMEL} parameters did not change: each rank "
                f"updates only its slice, so all_gather the updated slices"
            )
        elif f["off"] > 1e-6:
            problems.append(f"rank {r}'s parameters are {f['off']:.3g} from one Adam step's")
        elif f["bytes"].get("all_gather", 0) != gathered:
            problems.append(
                f"rank {r} gathered {f['bytes'].get('all_gather', 0)} B: an all-gather of the "
                f"slices brings the other (N-1)/N, {gathered} B"
            )
    verdict = first_problem(
        "ZeRO-1 by hand",
        problems,
        f"one Adam step equal to the unsharded one; each rank kept {shard_state} B of "
        f"Adam state (1/{world} of it) and gathered {gathered} B of parameters",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict


def _unpack(result):
    out, comm, error = result
    if error is None and not (isinstance(out, tuple) and len(out) == 2):
        return (None, None), comm, "the function must return (flat_params, optimizer)"
    return (out if error is None else (None, None)), comm, error


def _mlp():
    return runner.mlp(8, 32, 32, 4)


def check_fully_shard(fn, steps: int = 3):
    """``fn(model)`` applies FSDP2's ``fully_shard`` to each Linear, then to the model,
    and returns it; training it on every rank's batch equals one process on all of them."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [
        (
            torch.randn(4, 8, generator=torch.Generator().manual_seed(50 + r)),
            torch.randn(4, 4, generator=torch.Generator().manual_seed(90 + r)),
        )
        for r in range(world)
    ]
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    want = []
    for _ in range(steps):
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    model, _, error = runner.metered(fn, _mlp())
    facts = {"error": error}
    if error is None:
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        facts["units"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        facts["linears"] = linears
        local = sum(
            p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            for p in model.parameters()
        )
        facts["local_params"] = local
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        x, y = batches[rank]
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        facts["off"] = max(abs(a - b) for a, b in zip(losses, want, strict=True))
    facts = runner.gather(facts)
    problems = runner.errors(facts)
    total = sum(p.numel() for p in _mlp().parameters())
    f = facts[0]
    if not problems:
        if "" not in f["units"]:
            problems.append("the model itself is not sharded: call fully_shard(model) last")
        missing = [n for n in f["linears"] if n not in f["units"]]
        if not problems and missing:
            problems.append(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not an FSDP "
                f"unit of its own: fully_shard each layer before the model, or the whole "
                f"model is gathered at once (its peak memory is every parameter)"
            )
        if not problems and f["off"] > 1e-5:
            problems.append(f"the losses are {f['off']:.3g} from one process on every batch")
    verdict = first_problem(
        "FSDP2 fully_shard",
        problems,
        f"{len(f.get('linears', []))} layer units and the root; each rank holds "
        f"{f.get('local_params')} of {total} parameters between steps, and the losses "
        f"equal one process on all {world} batches",
        {"by_rank": facts},
    )
    runner.announce(verdict)
    return verdict
