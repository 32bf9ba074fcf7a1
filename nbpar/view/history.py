"""Per-step training records, grouped the way every figure reads them.

A run publishes one record per (step, rank): loss, step/compute/comm seconds,
throughput and memory bytes (`nbpar.measure.records.StepRecord`, written by
`nbpar.train.loop`; the memory rules are that module's too). The dashboard, the static
plots, the comparison table and the exporters all start from these helpers,
so they agree on what "the latest step" or "the loss of a run" means.
"""

from __future__ import annotations

from nbpar.measure.records import held_bytes, model_state_bytes, model_states
from nbpar.measure.step_split import SECONDS, step_shares

#: Communication above this share of the step time is worth a look (Megatron-LM
#: and ZeRO report healthy data/tensor parallel runs well below it).
COMM_HEALTH = 0.2


def as_history(obj) -> list[dict]:
    """The list of step records of a Run (``.history``) or of a list of records."""
    if hasattr(obj, "history") and not isinstance(obj, dict):
        history = obj.history
    elif isinstance(obj, dict) and isinstance(obj.get("history"), list):
        history = obj["history"]
    else:
        history = obj
    if not isinstance(history, (list, tuple)) or not all(isinstance(r, dict) for r in history):
        raise TypeError(
            f"expected a Run or a list of step records (dicts), got {type(obj).__name__}"
        )
    for rec in history:
        if "step" not in rec or "rank" not in rec:
            raise ValueError(f"step record {rec!r} lacks 'step' or 'rank'")
    return list(history)


def by_rank(history: list[dict]) -> dict[int, list[dict]]:
    """rank -> its records in step order (ranks ascending)."""
    out: dict[int, list[dict]] = {}
    for rec in history:  # one pass; a run's history is in step order already
        out.setdefault(rec["rank"], []).append(rec)
    for recs in out.values():
        if any(a["step"] > b["step"] for a, b in zip(recs, recs[1:])):
            recs.sort(key=lambda r: r["step"])
    return dict(sorted(out.items()))


def other_bytes(rec: dict) -> float:
    """Memory that is none of params/grads/optimizer (activations, buffers, runtime):
    of the device's allocated memory on a GPU, of the process's RSS on CPU."""
    return max(0.0, (held_bytes(rec) or 0) - model_state_bytes(rec))


def memory_parts(rec: dict) -> dict[str, float]:
    """{"params", "grads", "optimizer", "other"} bytes of one record."""
    return {**model_states(rec), "other": other_bytes(rec)}


def comm_split(records: list[dict]) -> tuple[float, float, float, float]:
    """(exposed_s, wait_s, hidden_s, step_s) of one rank, as its latest metered step
    measured them.

    A run meters some steps' collectives at the c10d layer (`nbpar.measure.comm.CommMeter`,
    which sees every strategy's ops; `nbpar.train.loop.is_metered` says which steps):
    ``exposed_s`` is the time with an op in flight, every rank of its group joined, and no
    compute running; ``wait_s`` the time no compute ran while every op in flight still
    waited for a slower rank to join; ``hidden_s`` the rest of the in-flight time
    (overlapped by compute); ``step_s`` the metered step itself, which holds them all
    (it runs slower than a normal step: every op passes through Python). Nothing is
    scaled (`nbpar.measure.step_split`). All zero before the first metered step.
    """
    metered = [r for r in records if step_shares(r) is not None]
    if not metered:
        return 0.0, 0.0, 0.0, 0.0
    last = metered[-1]
    in_flight, exposed, wait = (last.get(k) or 0.0 for k in SECONDS)
    return exposed, wait, in_flight - exposed - wait, last["comm_window_s"]


def steps_done(history: list[dict]) -> int:
    """Steps every rank has finished (the slowest rank's count)."""
    ranks = by_rank(history)
    return min((len(v) for v in ranks.values()), default=0)


def throughput(history: list[dict]) -> tuple[list[int], list[float], str]:
    """(steps, values, unit): per step the slowest rank's rate, tokens/s when known."""
    unit = "tokens/s" if any(r.get("tokens_per_s") is not None for r in history) else "samples/s"
    key = "tokens_per_s" if unit == "tokens/s" else "samples_per_s"
    per_step: dict[int, float] = {}
    for rec in history:
        value = rec.get(key)
        if value is not None:
            per_step[rec["step"]] = min(per_step.get(rec["step"], value), value)
    steps = sorted(per_step)
    return steps, [per_step[s] for s in steps], unit


def run_label(obj) -> str:
    """ "strategy/backend" of a Run, a result dict or a TrainConfig-like object."""
    cfg = getattr(obj, "cfg", None)
    if cfg is None and isinstance(obj, dict):
        cfg = obj.get("config")
    if cfg is None:
        return "run"
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    return f"{get('strategy', '?')}/{get('backend', '?')}"
