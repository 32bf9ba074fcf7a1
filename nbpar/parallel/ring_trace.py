"""What one rank's ring attention did when, step by step: the block it computed and the
next block travelling meanwhile (from the send being posted to its arrival as the rank
saw it). Forward overlaps the two; a transfer that outlasts its compute shows as the
rank waiting. On a GPU the marks are events of the stream (`nbpar.measure.clocks`).

    with RingTrace() as trace:
        loss = model(x) ...; loss.backward()
    trace.spans  # [{"pass", "step", "kind": "compute" | "transfer", "start", "end"}]
"""

from __future__ import annotations

from nbpar.measure.clocks import clock_for_device


class RingTrace:
    """Records the ring attention calls made inside ``with`` (this process only)."""

    active: RingTrace | None = None

    def __init__(self):
        self.clock = None
        self._marks: list[tuple[str, int, str, object, object]] = []
        self.spans: list[dict] = []

    def __enter__(self) -> RingTrace:
        RingTrace.active = self
        return self

    def __exit__(self, *exc) -> None:
        RingTrace.active = None
        if self.clock is not None:
            self.clock.settle()
            t0 = min(self.clock.seconds(m[3]) for m in self._marks)
            self.spans = [
                {
                    "pass": p,
                    "step": step,
                    "kind": kind,
                    "start": self.clock.seconds(a) - t0,
                    "end": self.clock.seconds(b) - t0,
                }
                for p, step, kind, a, b in self._marks
            ]

    def mark(self, tensor):
        """A mark of now on the clock of ``tensor``'s device."""
        if self.clock is None:
            self.clock = clock_for_device(tensor.device.type)
            self.clock.start()
        return self.clock.mark()

    def add(self, pass_: str, step: int, kind: str, start, end) -> None:
        self._marks.append((pass_, step, kind, start, end))
