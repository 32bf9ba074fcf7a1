"""`nbpar.log(loss=...)` from your own ``%%dist`` code (the engine side).

On an engine, each call publishes one record: to the kernel's direct cell channel while a
``%%dist`` cell runs through it (`set_publisher`), else through ipyparallel's data
publication (the running cell's AsyncResult gains it in ``.data`` without a round trip);
anywhere else (plain Python, a normal kernel) records stay in `RECORDS` and nothing else
happens.
`nbpar.view.logplot.LogPlot` draws them in the kernel, one line per rank.
"""

from __future__ import annotations

import itertools
import os
import sys
from numbers import Real

from nbpar.checks import positive_int

PREFIX = "log/"
#: Records logged outside an engine (nothing to publish to).
RECORDS: list[dict] = []
_seq = itertools.count()
_next_step = 0
# Process-wide (one per engine): where records go while a direct-channel cell runs.
_publisher: dict = {"send": None}


def set_publisher(send) -> None:
    """Send each record's ``{key: record}`` with ``send`` from now on (None: stop)."""
    _publisher["send"] = send


def _rank() -> int:
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def _on_engine() -> bool:
    """True inside an ipyparallel engine (its kernel installs a data publisher)."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()  # a plain IPython shell (not a kernel) has no data publisher
    return shell is not None and "_data_pub" in vars(shell)


def _number(key: str, value):
    if hasattr(value, "item") and callable(value.item):  # 1-element tensor, numpy scalar
        value = value.item()
    if value is None or (isinstance(value, Real) and not isinstance(value, bool)):
        return value
    raise TypeError(f"nbpar.log: {key}={value!r} is not a number (or one-element tensor)")


def log(step: int | None = None, **metrics) -> dict:
    """Record ``metrics`` for this rank at ``step`` (default: one more than the last call)."""
    global _next_step
    if not metrics:
        raise ValueError("nbpar.log needs at least one metric, e.g. nbpar.log(loss=loss)")
    if "rank" in metrics:
        raise ValueError("nbpar.log: 'rank' is filled in automatically; use another name")
    if step is None:
        step = _next_step
    else:
        positive_int("nbpar.log: step", step, minimum=0)
    _next_step = step + 1
    record = {"rank": _rank(), "step": step, **{k: _number(k, v) for k, v in metrics.items()}}
    data = {f"{PREFIX}{next(_seq):08d}": record}
    if _publisher["send"] is not None:
        _publisher["send"](data)
    elif _on_engine():
        from ipyparallel.datapub import publish_data

        publish_data(data)
    else:
        RECORDS.append(record)
    return record


def reset() -> None:
    """Start step numbering at 0 again and forget local records."""
    global _next_step
    _next_step = 0
    RECORDS.clear()
