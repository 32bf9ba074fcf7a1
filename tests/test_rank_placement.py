"""Rank placement across hosts: ranks by (host, engine id), a routable rendezvous address."""

import pytest

from nbpar.errors import PoolError
from nbpar.pool.startup import rank_order, store_peer


def test_ranks_follow_host_then_engine_id_not_registration_order():
    # registration interleaves two nodes (Slurm/SSH): a, b, a, b
    hosts = {0: "node-a", 1: "node-b", 2: "node-a", 3: "node-b"}
    assert rank_order([0, 1, 2, 3], hosts) == [0, 2, 1, 3]
    assert rank_order([3, 1, 2, 0], hosts) == [0, 2, 1, 3]


def test_consecutive_ranks_share_a_host_so_tp_groups_stay_on_one_node():
    hosts = {i: f"n{i % 2}" for i in range(8)}
    order = rank_order(list(range(8)), hosts)
    placed = [hosts[e] for e in order]
    assert placed == ["n0"] * 4 + ["n1"] * 4
    local = [placed[:r].count(h) for r, h in enumerate(placed)]  # what worker.join computes
    assert local == [0, 1, 2, 3, 0, 1, 2, 3]


def _engines(*pairs):
    return [{"host": h, "addr": a} for h, a in pairs]


def test_a_routable_controller_is_used_as_is():
    two = _engines(("a", "10.0.0.2"), ("b", "10.0.0.3"))
    assert store_peer("10.0.0.1", two, "login") == "10.0.0.1"


@pytest.mark.parametrize("controller", ["0.0.0.0", "127.0.0.1", "localhost", ""])
def test_wildcard_controller_with_engines_on_other_hosts_routes_to_another_node(controller):
    engines = _engines(("a", "10.0.0.2"), ("a", "10.0.0.2"), ("b", "10.0.0.3"))
    assert store_peer(controller, engines, "login") == "10.0.0.3"


def test_wildcard_controller_with_all_engines_on_one_host_stays_on_loopback():
    assert store_peer("0.0.0.0", _engines(("here", None), ("here", None)), "here") == "127.0.0.1"
    assert store_peer("0.0.0.0", _engines(("a", None), ("a", None)), "login") == "127.0.0.1"


def test_engine_0s_own_address_when_the_other_nodes_report_none():
    assert store_peer("0.0.0.0", _engines(("a", "10.0.0.2"), ("b", None)), "login") == "10.0.0.2"


def test_no_routable_address_is_a_clear_error():
    with pytest.raises(PoolError, match=r"'0\.0\.0\.0'.*\['a', 'b'\].*pass ip="):
        store_peer("0.0.0.0", _engines(("a", None), ("b", None)), "login")
