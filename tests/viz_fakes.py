"""Synthetic runs for the figure, widget and export tests: a Run's client-side shape
(history, done, cfg, ranks, result) without engines."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from nbpar.config import TrainConfig
from nbpar.train.loop import is_metered

MB = 2**20


def record(
    step: int,
    rank: int,
    *,
    comm_s: float = 0.01,
    tokens: bool = True,
    local: bool = False,
    metered: bool = False,
) -> dict:
    """One step record like nbpar.train.loop publishes; values differ per step and rank
    (``loss`` as published: the same on every rank after averaging; ``local=True`` adds
    each rank's own ``local_loss``; ``metered=True`` the metered step's in-flight time
    ``comm_s``, half of it exposed and a quarter waiting for the other rank, in a
    metered step three times as long as a normal one; every step was blocked on
    communication for 60% of ``comm_s``, as `nbpar.measure.blocked` times it)."""
    step_s = 0.05 + 0.001 * step + 0.01 * rank
    samples = 16 / step_s
    extra = {"local_loss": 5.0 / (1 + step) + 0.1 * (rank - 0.5)} if local else {}
    return {
        "step": step,
        "rank": rank,
        "loss": 5.0 / (1 + step),
        **extra,
        "step_time_s": step_s,
        "compute_s": step_s - comm_s,
        "comm_s": comm_s,
        "exposed_comm_s": comm_s / 2,
        "comm_blocked_s": 0.6 * comm_s,
        "samples_per_s": samples,
        "tokens_per_s": samples * 32 if tokens else None,
        "param_bytes": (4 + rank) * MB,
        "grad_bytes": 4 * MB,
        "optim_bytes": 8 * MB,
        "rss_bytes": (100 + step + rank) * MB,
        "peak_bytes": (120 + step + rank) * MB,
        "time": 1000.0 + 0.1 * step,
        **(
            {
                "comm_metered": True,
                "comm_in_flight_s": comm_s,
                "comm_wait_s": comm_s / 4,
                "comm_window_s": 3 * step_s,  # a metered step runs slower
            }
            if metered
            else {}
        ),
    }


def history(
    steps: int, ranks=(0, 1), comm=(0.01, 0.03), tokens: bool = True, local: bool = False
) -> list[dict]:
    """Records ordered by (step, rank), as Run.history returns them; the steps a run
    meters (`nbpar.train.loop.is_metered`) carry the metered figures."""
    return [
        record(s, r, comm_s=comm[i], tokens=tokens, local=local, metered=is_metered(s, 0, steps))
        for s in range(steps)
        for i, r in enumerate(ranks)
    ]


@dataclass
class FakeRun:
    cfg: TrainConfig = field(default_factory=lambda: TrainConfig(strategy="ddp", steps=20))
    ranks: list = field(default_factory=lambda: [0, 1])
    history: list = field(default_factory=list)
    finished: bool = False
    stops: int = 0

    def done(self) -> bool:
        return self.finished

    def stop(self) -> None:
        self.stops += 1

    def result(self) -> dict:
        mine = {r: [rec for rec in self.history if rec["rank"] == r] for r in self.ranks}
        last = mine[self.ranks[-1]]
        total_step = sum(rec["step_time_s"] for rec in self.history)
        total_comm = sum(rec["comm_s"] for rec in self.history)
        return {
            "config": self.cfg.to_dict(),
            "losses": [rec["loss"] for rec in last],
            "ranks": [
                {
                    "rank": r,
                    **{k: mine[r][-1][k] for k in ("param_bytes", "grad_bytes", "optim_bytes")},
                    "peak_bytes": max(rec["peak_bytes"] for rec in mine[r]),
                    "comm_bytes": 1000 * (r + 1),
                }
                for r in self.ranks
            ],
            "step_time_s": max(
                statistics.median(rec["step_time_s"] for rec in mine[r]) for r in self.ranks
            ),
            "comm_fraction": total_comm / total_step,
            "exposed_comm_fraction": sum(rec["exposed_comm_s"] for rec in self.history)
            / total_step,
            "bubble_fraction": None,
        }
