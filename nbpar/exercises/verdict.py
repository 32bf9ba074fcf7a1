"""What a checker answers: passed or not, and the one hint that says what to look at."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    """One exercise checked on every rank. ``hint``: the first thing that is off (which
    rank, which tensor, how far, what the c10d meter saw); ``facts``: what was measured,
    by rank, for a learner who wants to look further."""

    exercise: str
    passed: bool
    hint: str
    facts: dict = field(default_factory=dict)

    def __str__(self) -> str:
        mark = "passed" if self.passed else "not yet"
        return f"{self.exercise}: {mark}: {self.hint}"

    def __bool__(self) -> bool:
        return self.passed


def first_problem(exercise: str, problems: list[str], ok: str, facts: dict) -> Verdict:
    """A Verdict from the judge's findings in order of importance: the first is the hint."""
    if problems:
        return Verdict(exercise, False, problems[0], facts)
    return Verdict(exercise, True, ok, facts)


def far(a, b) -> float:
    """Largest absolute difference of two tensors (inf when their shapes differ)."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
