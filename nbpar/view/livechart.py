"""A chart widget that draws in the browser and receives only the new points.

`LiveChart` is an anywidget whose front end (``static/livechart.js``) draws panels of
series over training steps with uPlot, bundled in ``static/`` (MIT; nothing is fetched
at run time). The kernel never renders an image: `push` sends the points added since the
last push as one numbered "chunk" (a few hundred bytes), so a busy 2-core machine can
keep the figure current. A view that misses a chunk (a reloaded page) asks for
everything once ("resync"). ``spec`` names the panels and their series::

    {"waiting": "waiting for the first step",
     "panels": [{"id": "loss", "title": "loss", "unit": "",
                 "series": [{"label": "loss", "color": "#222", "width": 2}]}]}
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from pathlib import Path

import anywidget
import traitlets

STATIC = Path(__file__).with_name("static")


def _read(*names: str) -> str:
    return "\n".join((STATIC / name).read_text(encoding="utf-8") for name in names)


def clean(value):
    """A JSON-safe number: NaN and infinities (a diverged loss) become None (a gap)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


class LiveChart(anywidget.AnyWidget):
    """Panels of series over steps, drawn client-side; ``push`` appends new points."""

    _esm = _read("uPlot.iife.min.js", "livechart.js")
    _css = _read("uPlot.min.css", "livechart.css")
    uid = traitlets.Unicode().tag(sync=True)
    chunk = traitlets.Dict().tag(sync=True)

    def __init__(self, spec: dict):
        super().__init__(uid=uuid.uuid4().hex)
        self._lock = threading.Lock()
        self.spec = spec
        self.x: list[int] = []
        self.cols: dict[str, list[list]] = {}
        self.notes: dict[str, str] = {}
        self.seq = -1
        self.times: tuple | None = None
        self.status: dict | None = None
        self.sent = 0  # chunks sent (tests and benchmarks read it)
        self.on_msg(self._on_msg)
        self._send_all()

    def points(self, panel: str) -> int:
        """Steps of ``panel`` that have at least one value (what the browser draws)."""
        cols = self.cols.get(panel, [])
        return sum(any(c[i] is not None for c in cols) for i in range(len(self.x)))

    def push(
        self,
        x: list[int],
        cols: dict[str, list[list]],
        notes: dict | None = None,
        spec: dict | None = None,
        times: tuple | None = None,
        status: dict | None = None,
    ) -> None:
        """Append steps ``x`` with one column of values per series of each panel
        (``cols[panel][series][i]`` belongs to ``x[i]``); a new ``spec`` replaces the
        panels (sent once, with the first data). ``times``: (first, latest) wall-clock
        time of the records drawn; the browser shows them as ``data-first-time`` and
        ``data-last-time`` (how far behind the engines the figure is), and the time this
        chunk left the kernel as ``data-sent-time``. ``status``: the progress line above
        the panels ({"text", "value", "max", "style"}), sent in the same message."""
        with self._lock:
            if spec is not None:
                self.spec = spec
                self.cols = {
                    p["id"]: [[None] * len(self.x) for _ in p["series"]] for p in spec["panels"]
                }
            chunk_cols = {}
            for panel in self.spec["panels"]:
                incoming = cols.get(panel["id"], [])
                mine = self.cols.setdefault(
                    panel["id"], [[None] * len(self.x) for _ in panel["series"]]
                )
                chunk_cols[panel["id"]] = []
                for i, col in enumerate(mine):
                    values = (
                        [clean(v) for v in incoming[i]] if i < len(incoming) else [None] * len(x)
                    )
                    col.extend(values)
                    chunk_cols[panel["id"]].append(values)
            self.x.extend(x)
            self.notes.update(notes or {})
            self.seq += 1
            self.times = times or self.times
            self.status = status or self.status
            chunk = {
                "seq": self.seq,
                "x": list(x),
                "cols": chunk_cols,
                "notes": notes or {},
                "times": self.times,
                "status": self.status,
                "sent": time.time(),
            }
            if spec is not None:
                chunk["spec"] = spec
            self.chunk = chunk
            self.sent += 1

    def reset(self, spec: dict) -> None:
        """Start over with ``spec`` and no data (a new run in the same view)."""
        with self._lock:
            self.spec, self.x, self.cols, self.notes, self.times = spec, [], {}, {}, None
            self.status = None
        self._send_all()

    def _send_all(self) -> None:
        """One chunk with everything (reset), for a new or reloaded view."""
        with self._lock:
            self.seq += 1
            self.chunk = {
                "seq": self.seq,
                "reset": True,
                "spec": self.spec,
                "x": list(self.x),
                "cols": {k: [list(c) for c in v] for k, v in self.cols.items()},
                "notes": dict(self.notes),
                "times": self.times,
                "status": self.status,
                "sent": time.time(),
            }
            self.sent += 1

    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "resync":
            self._send_all()

    def __repr__(self) -> str:
        return f"<nbpar LiveChart: {len(self.x)} steps, {self.sent} updates sent>"
