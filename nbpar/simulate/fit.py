"""Will it fit: simulate each layout of a model on N devices and keep those whose peak fits.

Every candidate is a real simulation (`nbpar.simulate.run`), so what fits is what the
strategy code would hold, not a formula; a layout the model cannot take (heads that tp
does not divide, fewer layers than stages) is listed with its reason.
"""

from __future__ import annotations

import copy

from nbpar.strategies import STRATEGIES

# every strategy that has default degrees (hybrid needs them given)
DEFAULT_STRATEGIES = tuple(s for s in STRATEGIES if s != "hybrid")


def candidate_configs(cfg, world_size: int, strategies=DEFAULT_STRATEGIES) -> list:
    """A config per candidate strategy at its default degrees on ``world_size`` ranks."""
    out = []
    for strategy in strategies:
        if (strategy == "single") != (world_size == 1):
            continue
        c = copy.deepcopy(cfg)
        c.strategy, c.dp, c.tp, c.pp, c.fsdp_reshard = strategy, None, None, None, None
        if strategy == "pipeline":  # 1F1B needs a micro-batch per stage in flight
            c.grad_accum = max(c.grad_accum, world_size)
        out.append(c)
    return out


def what_fits(
    cfg, world_size: int, device_memory_gb: float, *, strategies=DEFAULT_STRATEGIES
) -> list[dict]:
    """One row per layout, those that fit first, largest margin first: ``strategy``,
    ``dp``, ``tp``, ``pp``, ``peak_bytes``, ``fits``, ``margin_bytes`` (or ``error``)."""
    from nbpar.simulate.run import capacity_bytes, simulate

    capacity_bytes(device_memory_gb)
    rows = []
    for c in candidate_configs(cfg, world_size, strategies):
        row = {"strategy": c.strategy}
        try:
            sim = simulate(c, world_size, device_memory_gb=device_memory_gb)
        except ValueError as err:
            rows.append({**row, "fits": False, "error": str(err)})
            continue
        conf = sim["config"]
        rows.append(
            {
                **row,
                "dp": conf["dp"],
                "tp": conf["tp"],
                "pp": conf["pp"],
                "peak_bytes": max(r["peak_bytes"] for r in sim["ranks"]),
                "fits": sim["fits"],
                "margin_bytes": sim["margin_bytes"],
            }
        )
    return sorted(rows, key=lambda r: (not r["fits"], -r.get("margin_bytes", -(2**62))))
