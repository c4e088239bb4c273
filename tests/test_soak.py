"""The short version of benchmarks/soak.py: two jobs through a relay that drops, duplicates and
reorders; every step exact, memory flat, counters adding up (the 10-minute run is the benchmark)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.soak import soak, soak_netns
from topologies.netem import require_root

# Memory growth and counters over a run of fixed length: alone.
pytestmark = pytest.mark.alone


def test_short_soak_through_a_hostile_relay() -> None:
    res = soak(argparse.Namespace(minutes=0.1, dim=1 << 14, drop=0.02, dup=0.02, reorder=0.03, max_growth_mib=16.0))
    assert res["errors"] == [] and res["exact"], res
    assert res["counters_add_up"] and res["memory_flat"], res
    assert res["steps"] >= 20 and res["uses_finished"] > 0
    relay = res["relay"]
    assert relay["dropped"] > 0 and relay["duplicated"] > 0 and relay["reordered"] > 0, relay
    assert res["aggregator"]["retained"] > 0 and res["aggregator"]["duplicate"] > 0  # the network was hostile
    assert res["passed"]


@pytest.mark.skipif(require_root() is not None, reason=f"netns soak: {require_root()}")
def test_short_soak_across_namespaces() -> None:
    """The same across network namespaces: a 1 Gbit/s tbf link dropping 1 % each way (nftables) under
    the relay; the aggregator's counters come over its control socket from another namespace."""
    res = soak_netns(argparse.Namespace(minutes=0.1, dim=1 << 14, drop=0.02, dup=0.02, reorder=0.03,
                                        max_growth_mib=16.0, netns=1000.0, link_loss=1))
    assert res["errors"] == [] and res["exact"] and res["counters_add_up"] and res["memory_flat"], res
    assert res["steps"] >= 20 and res["link"]["frames_dropped"] > 0, res
    assert res["passed"]
