"""Kernel side of the direct cell channel (the engine side and the why are in
`nbpar.pool.cells_engine`): a ``%%dist`` cell goes straight to the engines and their
output straight back, without ipyparallel's controller in between.

The kernel binds two sockets: a ROUTER that sends each cell to the engines' DEALERs, and
a PULL their sender threads push output and replies to. An engine is addressed by an
identity with a random part the kernel gave it through ipyparallel, and every message it
sends carries an HMAC of a key given the same way, so nothing else that connects can
receive the cells or pass for an engine. Nothing here is a thread: messages are read when
the kernel asks (`CellChannel.pump`), from the cell's wait loop.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import time

#: Seconds the engines get to say hello before the pool runs cells through ipyparallel.
HELLO_S = 5.0


class CellResult:
    """One rank's answer to a cell, read as `nbpar.pool.execute` reads an ipyparallel
    AsyncResult: ``ready``, ``successful``, ``get``, ``wait``, ``wait_for_output`` and a
    ``metadata`` dict (stdout, stderr, outputs, execute_result) whose ``data`` holds the
    cell's `nbpar.log` records."""

    def __init__(self, channel: CellChannel, cells: list[CellResult] | None = None):
        self.channel = channel
        self.parts = cells  # a whole cell: the ranks' results; None: one rank's
        self.metadata: dict = {"stdout": "", "stderr": "", "outputs": [], "data": {}}
        self.data = self.metadata["data"]
        self.error: dict | None = None
        self.done = False

    def ready(self) -> bool:
        if not self._done():
            self.channel.pump(0)
        return self._done()

    def _done(self) -> bool:
        return all(p.done for p in self.parts) if self.parts is not None else self.done

    def wait(self, timeout: float | None = -1) -> bool:
        """Wait up to ``timeout`` seconds (None or negative: for ever) until done."""
        forever = timeout is None or timeout < 0
        deadline = time.monotonic() + (0.0 if forever else timeout)
        while not self.ready():
            left = 1.0 if forever else deadline - time.monotonic()
            if left <= 0:
                return False
            self.channel.pump(left)
        return True

    # the reply follows the last output on the engine's one socket: done is complete
    wait_for_output = wait

    def successful(self) -> bool:
        if self.parts is not None:
            return all(p.successful() for p in self.parts)
        return self.ready() and self.error is None

    def get(self, timeout: float | None = -1):
        if not self.wait(timeout):
            raise TimeoutError("the cell has not finished")
        if self.error is not None:
            from ipyparallel.error import RemoteError

            e = self.error
            raise RemoteError(e["ename"], e["evalue"], e["traceback"] or None)
        return None


class CellChannel:
    """The kernel's two sockets and the engines' identities (see the module doc)."""

    def __init__(self, ip: str = "127.0.0.1"):
        import zmq

        context = zmq.Context.instance()
        self.key = secrets.token_bytes(32)
        self.requests = context.socket(zmq.ROUTER)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an engine gone: an error
        self.replies = context.socket(zmq.PULL)
        for sock in (self.requests, self.replies):
            sock.setsockopt(zmq.LINGER, 0)
        self.urls = tuple(
            f"tcp://{ip}:{sock.bind_to_random_port(f'tcp://{ip}')}"
            for sock in (self.requests, self.replies)
        )
        self.identities: dict[int, bytes] = {}  # rank -> the engine's identity
        self._ranks: dict[bytes, int] = {}
        self._cells: dict[int, dict[int, CellResult]] = {}  # cell -> rank -> result
        self._ids = itertools.count(1)
        self.poller = zmq.Poller()
        self.poller.register(self.replies, zmq.POLLIN)
        self.closed = False

    def engine_args(self, rank: int) -> tuple[str, str, str, str]:
        """What `cells_engine.serve` needs on the engine of ``rank``: the two addresses,
        its identity and the key (hex)."""
        identity = f"{rank}-{secrets.token_hex(8)}".encode()
        self.identities[rank] = identity
        self._ranks[identity] = rank
        return (*self.urls, identity.decode(), self.key.hex())

    def wait_hello(self, timeout: float | None = None) -> bool:
        """Wait until every engine given `engine_args` said hello; False after
        ``timeout`` seconds (`HELLO_S`)."""
        import zmq

        waiting = set(self.identities.values())
        deadline = time.monotonic() + (HELLO_S if timeout is None else timeout)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or not self.requests.poll(int(left * 1000), zmq.POLLIN):
                return False
            identity, _ = self.requests.recv_multipart()
            waiting.discard(identity)
        return True

    def submit(self, code: str, ranks) -> tuple[dict[int, CellResult], CellResult]:
        """Send ``code`` to ``ranks``; (rank -> its result, the whole cell's result)."""
        import zmq

        cell = next(self._ids)
        for old in [c for c, rs in self._cells.items() if all(r.done for r in rs.values())]:
            del self._cells[old]  # finished: nothing more will come for them
        results = {r: CellResult(self) for r in ranks}
        self._cells[cell] = results
        payload = json.dumps({"cell": cell, "code": code}).encode()
        for r in ranks:
            try:
                self.requests.send_multipart([self.identities[r], payload])
            except zmq.ZMQError:  # its engine has gone: what ipyparallel would say
                results[r].error = {
                    "ename": "EngineError",
                    "evalue": "engine gone",
                    "traceback": "",
                }
                results[r].done = True
        return results, CellResult(self, list(results.values()))

    def pump(self, timeout: float) -> None:
        """Take in every message that has arrived, waiting up to ``timeout`` seconds for
        the first."""
        wait_ms = max(0, int(timeout * 1000))
        while not self.closed and self.poller.poll(wait_ms):
            wait_ms = 0
            identity, signature, payload = self.replies.recv_multipart()
            rank = self._ranks.get(identity)
            good = hmac.new(self.key, identity + payload, hashlib.sha256).digest()
            if rank is None or not hmac.compare_digest(signature, good):
                continue  # not one of this channel's engines
            message = json.loads(payload)
            result = self._cells.get(message["cell"], {}).get(rank)
            if result is not None:
                _take(result, message)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.requests.close()
            self.replies.close()


def _take(result: CellResult, message: dict) -> None:
    """Add one engine message to its rank's result."""
    md, kind = result.metadata, message["kind"]
    if kind in ("stdout", "stderr"):
        md[kind] += message["text"]
    elif kind == "display":
        md["outputs"].append(message["output"])
    elif kind == "data":
        md["data"].update(message["data"])
    elif kind == "reply":
        if message["result"]:
            md["execute_result"] = {"data": message["result"]["data"]}
        result.error = message["error"]
        result.done = True


def open_channel(client, engine_ids: list[int], engines: list[dict]) -> CellChannel | None:
    """A channel to the engines of ``engine_ids`` (rank order; ``engines``: what each
    reported when it joined), or None where one cannot be had (an engine that does not
    answer within `HELLO_S`): the pool then runs cells through ipyparallel."""
    import socket

    from nbpar.pool import cells_engine, worker

    here = socket.gethostname()
    local = all(e["host"] == here for e in engines)
    try:
        # where engines on other hosts reach this kernel: the route to the rendezvous host
        channel = CellChannel("127.0.0.1" if local else worker.routable_address(engines[0]["addr"]))
    except Exception:
        return None
    try:
        calls = [
            client[eid].apply_async(cells_engine.serve, *channel.engine_args(rank))
            for rank, eid in enumerate(engine_ids)
        ]
        if channel.wait_hello() and all(c.wait(HELLO_S) and c.successful() for c in calls):
            return channel
    except Exception:
        pass
    channel.close()
    return None
