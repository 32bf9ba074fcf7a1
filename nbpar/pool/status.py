"""How a pool looks: one row per rank (rank, host, device, pid, memory, state)."""

from __future__ import annotations

import html
import socket

from nbpar import device
from nbpar.estimate import format_bytes

COLUMNS = ("rank", "host", "device", "pid", "memory", "state")


def _rss(pid: int, host: str) -> int | None:
    return device.rss_bytes(pid) if host == socket.gethostname() else None


def human_bytes(n: int | None) -> str:
    return "?" if n is None else format_bytes(n)


def pool_status(pool) -> list[dict]:
    """Rows of facts the client already knows; engine memory read from /proc locally."""
    if pool.closed:
        return [{**e, "state": "shut down", "memory": None} for e in pool.engines]
    dead = set(pool.dead_ranks())
    busy_ranks = set(pool.busy_ranks(range(len(pool.engines))))
    rows = []
    for rank, eng in enumerate(pool.engines):
        busy = rank in busy_ranks
        state = "dead" if rank in dead else "busy" if busy else "ready"
        rows.append(
            {
                "rank": rank,
                "host": eng["host"],
                "pid": eng["pid"],
                "device": eng["device"],
                "state": state,
                "memory": None if rank in dead else _rss(eng["pid"], eng["host"]),
                "backend": eng["backend"],
                "engine_id": eng["engine_id"],
                "env": {k: v for k, v in pool.env.items()},
            }
        )
    return rows


def _cells(row) -> list[str]:
    return [
        str(row["rank"]),
        row["host"],
        row["device"],
        str(row["pid"]),
        human_bytes(row["memory"]),
        row["state"],
    ]


def status_text(pool) -> str:
    rows = pool_status(pool)
    head = f"nbpar.Pool: {pool.n} engine(s), backend {pool.backend}, launcher {pool.launcher}" + (
        " (shut down)" if pool.closed else ""
    )
    table = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    note = [pool.note] if getattr(pool, "note", None) else []
    return "\n".join([head, *note, *lines])


def status_html(pool) -> str:
    rows = pool_status(pool)
    esc = html.escape
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in _cells(r)) + "</tr>" for r in rows
    )
    env = ""
    if pool.env:
        env = "<br>env: " + esc(", ".join(f"{k}={v}" for k, v in sorted(pool.env.items())))
    return (
        f"<div class='nbpar-pool'><b>nbpar.Pool</b>: {pool.n} engine(s), backend "
        f"<code>{esc(pool.backend)}</code>, launcher <code>{esc(pool.launcher)}</code>"
        f"{' (shut down)' if pool.closed else ''}{env}"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def busy_message(pool, busy: list[int], asked: str) -> str:
    """Why ``busy`` ranks cannot take ``asked`` now, and what to do: the training run
    that holds them (stop or wait for it: a restart would end it), or a cell."""
    run = pool.holder(busy)
    if run is None:
        return (
            f"rank(s) {busy} are still running an earlier cell (maybe stuck in a "
            f"collective): wait for it, or run `%dist restart`"
        )
    return (
        f"rank(s) {busy} are training {run!r}: {asked} can start once it ends; "
        f"wait for it (run.wait()) or stop it (run.stop(), or the picker's Stop); "
        f"`%dist restart` would end it"
    )
