"""Chaos: SIGKILL a random engine at a random step of ``pool.train``, again and again.

Each kill ends the run with `EngineDied`; a ``Pool(restart="auto")`` has already
brought itself back (with spare engines kept ready), and the run starts again from
its last checkpoint. The loss curve stitched from all the runs (each step's loss from
the last run that computed it) must equal an uninterrupted run's. Per kill: which
rank, at which step, the checkpoint it resumed from, seconds until the pool was back
(``recovery_s``) and until the resumed run was again at the step of the kill
(``lost_s``: the restart plus the steps done again).
"""

from __future__ import annotations

import os
import random
import signal
import time

from nbpar.errors import EngineDied


def _reached(run) -> int:
    """The highest step any rank has published (-1: none yet)."""
    return max((rec["step"] for rec in run.history), default=-1)


def _wait(run, step: int, timeout: float) -> None:
    """Until some rank has published ``step`` (or the run ended)."""
    deadline = time.monotonic() + timeout
    while _reached(run) < step and not run.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run made no progress within {timeout:g} s")
        time.sleep(0.02)


def chaos_train(pool, cfg, kills: int, seed: int = 0, timeout: float = 300.0) -> dict:
    """Train ``cfg`` (with checkpoint_dir and checkpoint_every) to the end while
    killing a random engine ``kills`` times; {"losses": stitched curve, "kills": [...]}."""
    from nbpar.checkpoint_meta import latest, read_meta

    if not (pool.auto_restart and cfg.checkpoint_dir and cfg.checkpoint_every):
        raise ValueError(
            "chaos needs Pool(restart='auto') and a config with checkpoint_dir and checkpoint_every"
        )
    rng = random.Random(seed)
    curve: dict[int, float] = {}
    events: list[dict] = []
    while True:
        step_dir = latest(cfg.checkpoint_dir)
        start = read_meta(step_dir)["step"] if step_dir else 0
        run = pool.train(cfg, resume_from=cfg.checkpoint_dir if step_dir else None)
        if events and events[-1]["lost_s"] is None:  # back where the last kill struck?
            last = events[-1]
            _wait(run, last["step"], timeout)
            last["lost_s"] = time.time() - last["time"]
            last["resumed_from"] = start
        if len(events) == kills:
            run.result()
            curve.update({rec["step"]: rec["loss"] for rec in run.history})
            return {"losses": [curve[s] for s in range(cfg.steps)], "kills": events}
        # a step ahead, within two checkpoints (so 20 kills still leave progress)
        target = rng.randint(start + 1, min(start + 2 * cfg.checkpoint_every, cfg.steps - 3))
        _wait(run, target, timeout)
        rank = rng.randrange(pool.n)
        step = _reached(run)
        t_kill, wall = time.monotonic(), time.time()
        os.kill(pool.engines[rank]["pid"], signal.SIGKILL)
        try:
            run.wait(timeout)
        except EngineDied:
            pass
        else:
            raise RuntimeError("the run finished although an engine was killed")
        curve.update({rec["step"]: rec["loss"] for rec in run.history})
        events.append(
            {
                "rank": rank,
                "step": step,
                "time": wall,
                "lost_s": None,
                "recovery_s": time.monotonic() - t_kill,
            }
        )
