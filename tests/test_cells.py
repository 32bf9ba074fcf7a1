"""The direct cell channel (`nbpar.pool.cells`): a cell sent straight to the engines shows
what the same cell shows through ipyparallel's controller, and nothing but this pool's
engines can pass for one of them."""

from __future__ import annotations

import hashlib
import hmac
import json
import re

import pytest

from nbpar.pool import cells

CELL = (
    "import sys, torch, torch.distributed as dist, nbpar\n"
    "from IPython.display import display, HTML\n"
    "r = dist.get_rank()\n"
    "print('out', r)\n"
    "print('err', r, file=sys.stderr)\n"
    "display(HTML(f'<b>{r}</b>'))\n"
    "nbpar.log(step=0, loss=float(r))\n"
    "t = torch.ones(1) * (r + 1); dist.all_reduce(t)\n"
    "t.item()\n"
)
FAILING = "import torch.distributed as dist\nif dist.get_rank() == 1:\n    1 / 0\n"


def _seen(result) -> dict:
    return {
        "text": result.text(),
        "stderr": result.stderr,
        "outputs": result.outputs,
    }


def _both_ways(pool, code):
    """(what ``code`` shows through the direct channel, through ipyparallel)."""
    direct = pool.execute(code)
    channel, pool.cells = pool.cells, None
    try:
        routed = pool.execute(code)
    finally:
        pool.cells = channel
    return direct, routed


def test_a_cell_shows_through_the_channel_what_it_shows_through_the_controller(pool):
    assert pool.cells is not None, "the pool runs cells through ipyparallel"
    direct, routed = _both_ways(pool, CELL)
    assert _seen(direct) == _seen(routed)
    assert direct.text() == "[rank 0] out 0\n[rank 0] Out: 3.0\n[rank 1] out 1\n[rank 1] Out: 3.0"


def test_a_failing_rank_raises_the_same_error_both_ways(pool):
    from nbpar.errors import RankError

    errors = []
    for channel in (pool.cells, None):
        saved, pool.cells = pool.cells, channel
        try:
            with pytest.raises(RankError) as info:
                pool.execute(FAILING)
            errors.append(info.value)
        finally:
            pool.cells = saved
    direct, routed = errors
    assert direct.ranks == routed.ranks == [1]
    assert direct.errors[1][:2] == routed.errors[1][:2] == ("ZeroDivisionError", "division by zero")
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", e.errors[1][2][0]) for e in errors]
    assert all("----> 3     1 / 0" in text for text in plain), plain
    assert pool.execute("print('fine')").text() == "[rank 0] fine\n[rank 1] fine"


def _forged(channel, identity: bytes, key: bytes, message: dict) -> list[bytes]:
    payload = json.dumps(message).encode()
    return [identity, hmac.new(key, identity + payload, hashlib.sha256).digest(), payload]


def test_a_message_not_signed_by_one_of_the_engines_is_dropped():
    import zmq

    channel = cells.CellChannel()
    try:
        identity = channel.engine_args(0)[2].encode()
        results, whole = _submit_offline(channel)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(channel.urls[1])
        reply = {"cell": 1, "kind": "reply", "result": {}, "error": None}
        push.send_multipart(_forged(channel, identity, b"not the key", reply))
        push.send_multipart(_forged(channel, b"9-someone", channel.key, reply))
        channel.pump(0.5)
        assert not results[0].ready()  # neither the wrong key nor an unknown identity
        push.send_multipart(_forged(channel, identity, channel.key, reply))
        assert whole.wait(5) and results[0].successful()
        push.close()
    finally:
        channel.close()


def _submit_offline(channel):
    """Cell 1 on rank 0 with no engine connected: nothing is sent (ROUTER_MANDATORY would
    refuse), the results are waiting for replies."""
    results = {0: cells.CellResult(channel)}
    channel._cells[1] = results
    return results, cells.CellResult(channel, list(results.values()))


class _SilentEngines:
    """An ipyparallel client whose engines never serve the channel."""

    class _Call:
        def wait(self, timeout=None):
            return True

        def successful(self):
            return True

    def __getitem__(self, eid):
        return self

    def apply_async(self, fn, *args):
        return self._Call()


def test_engines_that_never_say_hello_leave_the_pool_on_ipyparallel(monkeypatch):
    monkeypatch.setattr(cells, "HELLO_S", 0.3)
    engines = [{"host": __import__("socket").gethostname(), "addr": "127.0.0.1"}]
    assert cells.open_channel(_SilentEngines(), [0], engines) is None
