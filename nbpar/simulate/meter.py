"""The memory meter of a real run, plus the communication buffers a simulated step holds.

`SimMemory` is `nbpar.measure.memtrack.StepMemory` (same peak, same activations, so a
simulated rank and a real one are measured alike) that also follows the storages a
collective reads or writes (FSDP2's all-gather outputs and reduce-scatter inputs, the
flat gradient of an all-reduce, pipeline send/recv buffers) while they live, and
remembers what the peak was made of. It also meters parts of a step apart (`begin_segment`,
`end_segment`): how high memory rose in each, for `nbpar.simulate.segments`.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from nbpar.measure.memtrack import StepMemory, _storage

COMM_NAMESPACES = ("c10d", "_c10d_functional")


class SimMemory(StepMemory):
    """StepMemory + ``comm_buffer_bytes`` (live collective buffers at the peak)."""

    def __init__(self, runner):
        self.comm_keys: set[int] = set()
        self.comm = 0
        self.at_peak = {"activations": 0, "comm": 0}
        self._segment: dict | None = None  # the levels at its start and its highs
        super().__init__(runner)

    def _add(self, t, kind: str) -> None:
        before = self.peak
        super()._add(t, kind)
        self._note_peak(before)

    def _resized(self, t) -> None:
        before = self.peak
        super()._resized(t)
        self._note_peak(before)

    def _pack(self, t):
        out = super()._pack(t)
        self._note_segment()
        return out

    def _note_peak(self, before: int) -> None:
        if self.peak > before:
            self.at_peak = {"activations": self.saved, "comm": self.comm}
        self._note_segment()

    def _note_segment(self) -> None:
        seg = self._segment
        if seg is None:
            return
        if self.live > seg["high"]:
            seg.update(high=self.live, saved_at=self.saved, comm_at=self.comm)
        seg["saved_high"] = max(seg["saved_high"], self.saved)

    def begin_segment(self) -> None:
        """Start metering a part of the step apart (see `end_segment`)."""
        self._segment = {
            "live": self.live,
            "saved": self.saved,
            "comm": self.comm,
            "high": self.live,
            "saved_at": self.saved,
            "comm_at": self.comm,
            "saved_high": self.saved,
        }

    def end_segment(self):
        """The `nbpar.simulate.segments.Segment` since `begin_segment`."""
        from nbpar.simulate.segments import Segment

        seg, self._segment = self._segment, None
        return Segment(
            rise=seg["high"] - seg["live"],
            saved_rise=seg["saved_high"] - seg["saved"],
            saved_at_rise=seg["saved_at"] - seg["saved"],
            comm_at_rise=seg["comm_at"] - seg["comm"],
            net=self.live - seg["live"],
            saved_net=self.saved - seg["saved"],
            comm_net=self.comm - seg["comm"],
        )

    def _free(self, key: int) -> None:
        if key in self.comm_keys:
            self.comm_keys.discard(key)
            self.comm -= self.kind.get(key, (0, ""))[0]
        super()._free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.error is None and func.namespace in COMM_NAMESPACES:
            for t in tree_leaves((args, kwargs, out)):
                st = _storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None and st._cdata in self.kind and st._cdata not in self.comm_keys:
                    self.comm_keys.add(st._cdata)
                    self.comm += self.kind[st._cdata][0]
        return out

    def breakdown(self, states: int) -> dict:
        """The peak split: activations and communication buffers live at that moment,
        and temporaries = the rest beyond the model states (``states`` bytes)."""
        acts, comm = self.at_peak["activations"], self.at_peak["comm"]
        return {"comm_buffer_bytes": comm, "temp_bytes": max(0, self.peak - states - acts - comm)}
