"""Engine side of the direct cell channel: ``%%dist`` cells without the controller hop.

ipyparallel routes every request and every output through its controller, a Python
process of its own: a trivial cell costs two hops each way, 6-10 ms on a laptop. Here
the kernel sends a cell straight to each engine (a DEALER socket on the engine's main
event loop, so the cell runs on the main thread like any ipyparallel request) and each
engine sends its output and its reply straight back (a PUSH socket owned by one sender
thread, so output printed while a long cell computes still streams, and the reply
always follows the last output). Everything else (registration, heartbeats, `pool.run`,
training runs, restarts) stays ipyparallel's.

What a cell shows is captured as ipyparallel's engine would publish it, but sent here:
stdout and stderr (every `FLUSH_S` while the cell runs), displays and the execute result
(the kernel's display hooks, asked to send nothing), `nbpar.log` records, and an error's
name, value and traceback (which IPython also keeps in ``sys.last_traceback`` for
``%dist debug``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import signal
import sys
import threading

#: Seconds between two sends of a running cell's new output.
FLUSH_S = 0.05
# Process-wide (one per engine): the channel this engine serves now; a re-join replaces it.
_serving: dict = {}


class _Sender(threading.Thread):
    """Owns the PUSH socket to the kernel and sends in order: queued messages, and while a
    cell runs (``active``) the text its streams gathered, every `FLUSH_S`. Text written
    before a message is queued goes before it."""

    def __init__(self, context, url: str, identity: bytes, key: bytes):
        super().__init__(name="nbpar-cell-sender", daemon=True)
        self.context, self.url, self.identity, self.key = context, url, identity, key
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending: list[tuple[object, str, str]] = []  # (cell, stream name, text)
        self.active = False

    def write(self, cell, name: str, text: str) -> None:
        with self.lock:
            self.pending.append((cell, name, text))

    def _texts(self) -> list[dict]:
        """The gathered text as stream messages, one per cell and stream (call locked)."""
        merged: dict = {}
        for cell, name, text in self.pending:
            merged.setdefault((cell, name), []).append(text)
        self.pending.clear()
        return [{"cell": c, "kind": n, "text": "".join(v)} for (c, n), v in merged.items()]

    def put(self, message: dict | None) -> None:
        """Queue ``message`` after the text written so far (None: close the channel)."""
        with self.lock:
            for text in self._texts():
                self.queue.put(text)
            self.queue.put(message)

    def run(self) -> None:
        import zmq

        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.url)
        try:
            while True:
                try:
                    message = self.queue.get(timeout=FLUSH_S if self.active else None)
                except queue.Empty:
                    with self.lock:
                        texts = self._texts()
                    for text in texts:
                        self._send(sock, text)
                    continue
                if message is None:  # the channel is closed
                    return
                if message:  # ({} only wakes the thread: a cell started)
                    self._send(sock, message)
        finally:
            sock.close()

    def _send(self, sock, message: dict) -> None:
        payload = json.dumps(message).encode()
        signature = hmac.new(self.key, self.identity + payload, hashlib.sha256).digest()
        sock.send_multipart([self.identity, signature, payload])


class _Stream:
    """A cell's sys.stdout or sys.stderr: text goes to the sender."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, name: str, sender: _Sender, cell):
        self.name, self.sender, self.cell = name, sender, cell

    def write(self, text) -> int:
        if text:
            self.sender.write(self.cell, self.name, str(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:  # the sender sends every FLUSH_S and before the reply
        pass

    def isatty(self) -> bool:
        return False


def serve(requests_url: str, replies_url: str, identity: str, key: str) -> str:
    """Serve cells from the kernel on this engine (replacing an earlier channel): connect
    to the kernel's request and reply sockets, say hello, run each cell that arrives;
    ``identity`` names this engine, ``key`` (hex) signs what it sends."""
    import zmq
    from IPython import get_ipython
    from zmq.eventloop.zmqstream import ZMQStream

    stop()
    shell = get_ipython()
    context = zmq.Context.instance()
    sender = _Sender(context, replies_url, identity.encode(), bytes.fromhex(key))
    sender.start()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, identity.encode())
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(requests_url)
    stream = ZMQStream(dealer)  # this (the main) thread's event loop runs the cells
    stream.on_recv(lambda frames: _on_request(shell, sender, frames[-1]))
    _serving.update(stream=stream, sender=sender)
    dealer.send(b"hello")
    return identity


def stop() -> None:
    """Close the channel this engine serves, if any (safe to call twice)."""
    stream, sender = _serving.pop("stream", None), _serving.pop("sender", None)
    if stream is not None:
        stream.close()
    if sender is not None:
        sender.put(None)


def _on_request(shell, sender: _Sender, frame) -> None:
    request = json.loads(bytes(frame))
    reply = run_cell(shell, sender, request["cell"], request["code"])
    sender.put(reply)


def run_cell(shell, sender: _Sender, cell, code: str) -> dict:
    """Run ``code`` in the engine's namespace, its outputs sent as they come; the reply."""
    from nbpar.train import userlog

    sender.active = True
    sender.queue.put({})  # from now on its streams are sent every FLUSH_S
    result: dict = {}
    error: dict = {}
    saved = sys.stdout, sys.stderr

    def on_display(msg):  # the kernel's display hooks: keep it, send nothing to iopub
        content = msg.get("content", {})
        if msg.get("msg_type") == "execute_result":
            result["data"] = content.get("data", {})
        elif msg.get("msg_type") == "display_data":
            sender.put({"cell": cell, "kind": "display", "output": _display(content)})
        return None

    def on_traceback(etype, evalue, stb):
        error.update(ename=etype.__name__, evalue=str(evalue), traceback="\n".join(stb))

    hooks = [h for h in (shell.displayhook, shell.display_pub) if hasattr(h, "register_hook")]
    for hook in hooks:
        hook.register_hook(on_display)
    shell._showtraceback = on_traceback
    userlog.set_publisher(lambda data: sender.put({"cell": cell, "kind": "data", "data": data}))
    sys.stdout, sys.stderr = _Stream("stdout", sender, cell), _Stream("stderr", sender, cell)
    # the kernel ignores SIGINT between its own requests: an interrupt must reach the cell
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        outcome = shell.run_cell(code, store_history=False, silent=False)
    finally:
        signal.signal(signal.SIGINT, sigint)
        sys.stdout, sys.stderr = saved
        userlog.set_publisher(None)
        del shell._showtraceback  # the class's own again
        for hook in hooks:
            hook.unregister_hook(on_display)
        sender.active = False
    if not outcome.success and not error:  # an error IPython did not show
        err = outcome.error_in_exec or outcome.error_before_exec
        error.update(ename=type(err).__name__, evalue=str(err), traceback="")
    return {"cell": cell, "kind": "reply", "result": result, "error": error or None}


def _display(content: dict) -> dict:
    """A display as ipyparallel's client keeps it."""
    return {k: content.get(k, {}) for k in ("data", "metadata", "transient")}
