"""``Pool(n)`` says what it is doing while it starts, in one area that ends empty (a
saved notebook holds the same output however fast the engines came)."""

from __future__ import annotations

import re

import pytest

import nbpar

pytestmark = pytest.mark.timeout(180)


def test_start_up_stages_are_said_in_place_then_the_area_is_emptied(pub, monkeypatch):
    monkeypatch.setattr("nbpar.pool.progress.in_kernel", lambda: True)
    pool = nbpar.Pool(2, replace=False)
    try:
        live = [o for o in pub if o["transient"]]
        assert len({o["transient"]["display_id"] for o in live}) == 1  # one area
        assert live[0]["data"] == {"text/plain": ""} and not live[0]["update"]  # opened empty
        texts = [o["data"]["text/plain"] for o in live[1:]]
        assert all(o["update"] for o in live[1:])
        assert re.fullmatch(
            r"nbpar: starting a controller and 2 engine\(s\) \(local\), \d+ s", texts[0]
        )
        assert any(re.fullmatch(r"nbpar: [01]/2 engines registered, \d+ s", t) for t in texts)
        assert re.fullmatch(
            r"nbpar: 2/2 engines registered; joining the process group \(gloo\), \d+ s", texts[-2]
        )
        assert texts[-1] == ""  # emptied once the pool is ready
        assert pool.run(lambda: 1) == [1, 1]
    finally:
        pool.shutdown()


def test_outside_a_kernel_it_stays_quiet(pub):
    pool = nbpar.Pool(2, replace=False)
    pool.shutdown()
    assert not [o for o in pub if o["transient"]]


def test_engines_that_register_between_two_counts_are_never_waited_for_twice():
    """An engine may register between reading the count and asking for one more: the
    wait asks for the count it said plus one, never past n (it once asked for 3 of 2)."""
    from nbpar.pool.startup import wait_registered

    class Client:
        def __init__(self):
            self.registered, self.asked = 0, []

        @property
        def ids(self):
            self.registered = min(2, self.registered + 1)  # one more at every read
            return list(range(self.registered))

        def wait_for_engines(self, k, timeout, interactive):
            assert k <= 2, f"asked for {k} engines of 2"
            self.asked.append(k)

    said, client = [], Client()
    wait_registered(client, 2, 10.0, said.append)
    assert said == ["1/2 engines registered"] and client.asked == [2]
