"""Will it fit: simulate each layout of a model on N devices and keep those whose peak fits.

Every candidate is a real simulation (`nbpar.simulate.run`), so what fits is what the
strategy code would hold, not a formula; a layout the model cannot take (heads that tp
does not divide, fewer layers than stages) is listed with its reason.
"""

from __future__ import annotations

import copy

from nbpar.strategies import STRATEGIES, is_moe

# every strategy that has default degrees (hybrid needs them given); context parallelism
# where the model reads sequences, expert parallelism where it has experts
DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s != "hybrid")


def applies(strategy: str, model) -> bool:
    """Whether ``strategy`` splits something ``model`` has: cp a sequence (not
    simple_cnn's images), ep experts (a mixture-of-experts model)."""
    if strategy == "ep":
        return is_moe(model)
    return strategy != "cp" or model != "simple_cnn"


def candidate_configs(cfg, world_size: int, strategies=DEFAULT_STRATEGIES) -> list:
    """A config per candidate strategy at its default degrees on ``world_size`` ranks."""
    out = []
    for strategy in strategies:
        if (strategy == "single") != (world_size == 1) or not applies(strategy, cfg.model):
            continue
        c = copy.deepcopy(cfg)
        c.strategy, c.dp, c.tp, c.pp, c.fsdp_reshard = strategy, None, None, None, None
        c.cp, c.ep = None, None
        c.sequence_parallel = c.sequence_parallel and strategy == "tp"  # needs tp > 1
        if strategy == "pipeline":  # 1F1B needs a micro-batch per stage in flight
            c.grad_accum = max(c.grad_accum, world_size)
        out.append(c)
    return out


def what_fits(
    cfg,
    world_size: int,
    device_memory_gb: float,
    *,
    strategies=DEFAULT_STRATEGIES,
    on_row=None,
) -> list[dict]:
    """One row per layout, those that fit first, largest margin first: ``strategy``,
    ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``peak_bytes``, ``activation_bytes``, ``fits``,
    ``margin_bytes`` (or ``error``).
    ``on_row(rows_so_far, total)`` is called as each layout's simulation ends."""
    from nbpar.simulate.run import capacity_bytes

    capacity_bytes(device_memory_gb)
    rows = []
    candidates = candidate_configs(cfg, world_size, strategies)
    for c in candidates:
        rows.append(_fit_row(c, world_size, device_memory_gb))
        if on_row is not None:
            on_row(order(rows), len(candidates))
    return order(rows)


def _fit_row(c, world_size: int, device_memory_gb: float) -> dict:
    """One layout's row: its degrees, simulated peak and margin, or why it cannot run."""
    from nbpar.simulate.run import simulate

    try:
        sim = simulate(c, world_size, device_memory_gb=device_memory_gb)
    except ValueError as err:
        return {"strategy": c.strategy, "fits": False, "error": str(err)}
    conf = sim["config"]
    return {
        "strategy": c.strategy,
        "dp": conf["dp"],
        "tp": conf["tp"],
        "pp": conf["pp"],
        "cp": conf["cp"],
        "ep": conf["ep"],
        "peak_bytes": max(r["peak_bytes"] for r in sim["ranks"]),
        "activation_bytes": max(r["activation_bytes"] for r in sim["ranks"]),
        "fits": sim["fits"],
        "margin_bytes": sim["margin_bytes"],
    }


def order(rows: list[dict]) -> list[dict]:
    """Those that fit first, largest margin first; refused layouts last."""
    return sorted(rows, key=lambda r: (not r["fits"], -r.get("margin_bytes", -(2**62))))
