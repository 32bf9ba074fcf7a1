"""Sizing by hand, no pool needed: the memory of mixed-precision Adam training per rank
(16 bytes a parameter, split by the ZeRO stages) against `nbpar.estimate_memory`, and
training time from FLOPs (6 N D) against the same formula the projections use."""

from __future__ import annotations

from nbpar.exercises import runner
from nbpar.exercises.verdict import first_problem

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
PARTS = ("params", "grads", "optim")


def check_memory(fn):
    """``fn(n_params, world, stage)`` returns {"params", "grads", "optim"}: bytes per rank
    for bf16 mixed-precision Adam at ZeRO stage 0-3."""
    from nbpar.estimate import estimate_memory

    problems = []
    for n, world, stage in [(1e9, 1, 0), (1e9, 8, 0), (1e9, 8, 1), (1e9, 8, 2), (7e9, 64, 3)]:
        want = estimate_memory(n, world, STAGES[stage], precision="bf16").per_rank_bytes
        try:
            got = fn(n, world, stage)
        except Exception as e:
            problems.append(f"fn({n:.0e}, {world}, {stage}) raised {type(e).__name__}: {e}")
            break
        bad = [p for p in PARTS if abs(float(got.get(p, -1)) - want[p]) > 1e-6 * want[p]]
        if not bad:
            continue
        per = {p: float(got.get(p, 0)) / n for p in PARTS}  # bytes a parameter
        if stage == 0 and [round(per[p]) for p in PARTS] == [4, 4, 8]:
            problems.append(
                "that is fp32 training's 4 + 4 + 8 B: with mixed precision the parameters "
                "and gradients are bf16 (2 B each) and Adam keeps an fp32 master copy, "
                "momentum and variance (12 B): 16 B a parameter"
            )
        else:
            part = bad[0]
            problems.append(
                f"{n:.0e} parameters, {world} ranks, ZeRO stage {stage}: your {part} is "
                f"{float(got.get(part, 0)):.4g} B a rank, the ZeRO paper's {want[part]:.4g} B"
                + (
                    f" (stage {stage} splits it over the {world} ranks)"
                    if PARTS.index(part) >= 3 - stage
                    else ""
                )
            )
        break
    verdict = first_problem(
        "model memory by hand",
        problems,
        "2 + 2 + 12 = 16 B a parameter, split over ranks as each ZeRO stage says: "
        "what nbpar.estimate_memory says",
        {},
    )
    runner.announce(verdict)
    return verdict


def check_training_time(fn):
    """``fn(n_params, tokens, gpus, peak_flops, mfu)`` returns the seconds training takes."""
    from nbpar.hardware import days_to_train, training_seconds

    problems = []
    cases = [(1e9, 20e9, 1, 312e12, 0.4), (7e9, 1e12, 64, 989e12, 0.45), (1e8, 1e9, 8, 1e14, 0.3)]
    for case in cases:
        want = training_seconds(*case)
        try:
            got = float(fn(*case))
        except Exception as e:
            problems.append(f"fn{case} raised {type(e).__name__}: {e}")
            break
        ratio = got / want
        if abs(ratio - 1) < 1e-6:
            continue
        if abs(ratio - 1 / 3) < 1e-3:
            problems.append(
                "you counted the forward pass only (2 N D): backward costs twice the "
                "forward, 6 N D FLOPs in all"
            )
        elif abs(ratio - case[2]) < 1e-3 * case[2] and case[2] > 1:
            problems.append(f"{case}: {case[2]}x too long: the {case[2]} GPUs share the work")
        else:
            problems.append(f"fn{case} = {got:.4g} s, 6 N D / (gpus x peak x MFU) = {want:.4g} s")
        break
    chinchilla = days_to_train(1e9, 20e9, "A100-80GB", gpus=1, utilisation=0.4)
    if not problems and abs(float(fn(1e9, 20e9, 1, 312e12, 0.4)) / 86400 - chinchilla) > 1e-3:
        problems.append(f"nbpar.days_to_train says {chinchilla:.1f} days for 1B on 20B tokens")
    days = 28
    tokens = days * 86400 * 312e12 * 0.4 / 6e9
    verdict = first_problem(
        "training time by hand",
        problems,
        f"6 N D / (gpus x peak x MFU), as nbpar.days_to_train: 1B parameters on 20B tokens "
        f"take {chinchilla:.1f} days on one A100 at 40% MFU, and {days} days are "
        f"{tokens / 1e9:.0f}B tokens",
        {},
    )
    runner.announce(verdict)
    return verdict
