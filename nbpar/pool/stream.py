"""Live output of a running ``%%dist`` cell.

While the cell runs, each rank's new stdout and stderr lines appear, prefixed
``[rank N]``, in one display area that is updated in place (as ``%px`` streams).
When the cell ends, the area is emptied and the output grouped per rank in rank
order replaces it. The area is opened empty when the cell starts and only ever
updated in place afterwards, so every saved or checked notebook holds the same
output however fast the ranks were: one empty area, then the grouped output (a
runner that applies updates, like nbconvert, and one that ignores them, like nbval,
agree). Nothing is read before the first poll.
"""

from __future__ import annotations

from collections import deque

#: Lines the live area keeps (the grouped output at the end has all of them).
LIVE_LINES = 200
STREAMS = ("stdout", "stderr")


def metadata_of(ar) -> dict:
    """One engine's metadata (an AsyncResult over a one-engine list view gives a list).

    ipyparallel appends each ``stream`` message to it as the message arrives.
    """
    md = ar.metadata
    return md[0] if isinstance(md, list) else md


def in_kernel() -> bool:
    """True inside a Jupyter kernel, where a display area can be updated in place."""
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def in_terminal() -> bool:
    """True in the ``ipython`` terminal, where lines are printed as they come."""
    from IPython import get_ipython

    return type(get_ipython()).__name__ == "TerminalInteractiveShell"


class LiveOutput:
    """New complete lines of every rank, shown while a cell runs: in one display area
    in Jupyter; in the ``ipython`` terminal, printed as they come (as ``%px --stream``
    does), and then left out of the grouped output (`printed`)."""

    def __init__(self, ars: dict, show: bool | None = None, ranks=None, fresh: bool = False):
        """``ranks``: the ranks whose lines are shown (default: all of ``ars``); ``fresh``:
        the cell has shown nothing before (a ``%%dist`` cell: the magic is all of it)."""
        self.ars = ars if ranks is None else {r: ar for r, ar in ars.items() if r in ranks}
        self.prints = show is not False and in_terminal() and not in_kernel()
        self.show = not self.prints and (in_kernel() if show is None else show)
        self.seen = {(r, name): 0 for r in self.ars for name in STREAMS}
        self.lines: deque[str] = deque(maxlen=LIVE_LINES)
        self.footer = ""  # shown under the lines: the hang watch's word (`hangwatch`)
        self.handle = None
        self.fresh = fresh

    def new_lines(self, name=None) -> list[str]:
        """Lines completed since the last call, ``[rank N]``-prefixed, rank by rank
        (``name``: of that stream only)."""
        out = []
        for r, ar in self.ars.items():
            md = metadata_of(ar)
            for stream in STREAMS if name is None else (name,):
                text = md.get(stream) or ""
                start, end = self.seen[r, stream], text.rfind("\n") + 1
                if end > start:
                    out += [f"[rank {r}] {line}" for line in text[start:end].splitlines()]
                    self.seen[r, stream] = end
        return out

    @property
    def printed(self) -> dict:
        """(rank, stream) -> characters already printed (terminal only; else none)."""
        return dict(self.seen) if self.prints else {}

    def start(self) -> None:
        """Open the (empty) live area; every later change is an in-place update."""
        if self.show and self.handle is None:
            from IPython.display import display

            self.handle = (self.fresh and _fresh_area()) or display(
                {"text/plain": ""}, raw=True, display_id=True
            )

    def poll(self) -> None:
        if self.prints:
            import sys

            for name in STREAMS:
                if lines := self.new_lines(name):
                    out = getattr(sys, name)
                    out.write("".join(f"{line}\n" for line in lines))
                    out.flush()
            return
        if not self.show:
            return
        new = self.new_lines()
        if not new:
            return
        self.lines.extend(new)
        self._update()

    def set_footer(self, text: str) -> None:
        """Show ``text`` under the lines ('' takes it away), updated in place."""
        if self.show and text != self.footer:
            self.footer = text
            self._update()

    def _update(self) -> None:
        self.start()
        text = "\n".join(self.lines)
        if self.footer:
            text = f"{text}\n\n{self.footer}" if text else self.footer
        self.handle.update({"text/plain": text}, raw=True)

    def finish(self) -> None:
        """Empty the live area: the grouped output that follows replaces it. An area
        that never showed a line is empty already (and an update costs a flush of the
        kernel's output streams)."""
        if self.handle is not None and (self.lines or self.footer):
            self.handle.update({"text/plain": ""}, raw=True)
        self.handle = None


def _fresh_area():
    """An empty display area opened as `IPython.display.display` would, but without its
    first step: the display publisher flushes stdout and stderr (two round trips to the
    kernel's output thread, most of a trivial ``%%dist`` cell's own time), which keeps
    earlier output of the cell ahead of the display. A fresh cell has none. None where the
    kernel is not one this knows (then `display` does it)."""
    import uuid

    from IPython import get_ipython
    from IPython.display import DisplayHandle

    shell = get_ipython()
    try:
        kernel, pub = shell.kernel, shell.display_pub
        handle = DisplayHandle(uuid.uuid4().hex)
        content = {"data": {"text/plain": ""}, "metadata": {}}
        content["transient"] = {"display_id": handle.display_id}
        kernel.session.send(
            kernel.iopub_socket, "display_data", content, pub.parent_header, ident=pub.topic
        )
    except AttributeError:
        return None
    return handle
