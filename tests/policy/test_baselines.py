"""Baselines and ablations: the names docs/design.md uses, and what each one turns off."""

from __future__ import annotations

import attrs
import pytest

from talaria.config import Eviction, PolicyConfig, QueueOrder, Routing, SlotOrder
from talaria.errors import ConfigError
from talaria.policy.baselines import (
    ABLATIONS,
    BASELINES,
    POLICIES,
    POOL_BASELINES,
    TALARIA,
    parse_policies,
    policy,
)

DESIGN_NAMES = (
    "talaria",
    "round",
    "talaria-no-sp",
    "talaria-no-hostkv",
    "talaria-no-staging",
    "talaria-no-reserve",
    "talaria-no-slot-order",
    "least-loaded",
    "sticky",
    "ttl-pin",
    "cache-affinity",
    "oldest-first",
    "serverless",
    "autoscale",
)


def differences(p: PolicyConfig, base: PolicyConfig = TALARIA) -> dict[str, object]:
    """Fields of ``p`` that differ from ``base`` (its name aside), with ``p``'s values."""
    mine, theirs = attrs.asdict(p, recurse=False), attrs.asdict(base, recurse=False)
    return {k: v for k, v in mine.items() if k != "name" and v != theirs[k]}


def test_every_design_name_is_a_policy_and_nothing_else() -> None:
    assert tuple(POLICIES) == DESIGN_NAMES
    assert all(POLICIES[n].name == n for n in POLICIES)
    assert set(ABLATIONS) | set(BASELINES) | set(POOL_BASELINES) | {"talaria"} == set(DESIGN_NAMES)
    assert POLICIES["talaria"] is TALARIA


def test_talaria_has_every_mechanism_on() -> None:
    t = TALARIA
    assert t.routing is Routing.EXPECTED_COMPLETION and t.eviction is Eviction.VALUE
    assert t.session_prefill and t.host_kv and t.weight_staging and t.soft_reservations
    assert t.kv_pin_ttl_s == 0.0
    assert t.slot_order is SlotOrder.SHORTEST_REMAINING


def test_round_is_the_paper_baseline() -> None:
    """The paper's "otherwise identical round scheduler with SP, host-KV restoration and D2D
    staging disabled": talaria with those three off and a round-robin order, nothing else."""
    assert differences(POLICIES["round"]) == {
        "session_prefill": False,
        "host_kv": False,
        "weight_staging": False,
        "slot_order": SlotOrder.ROUND_ROBIN,
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("talaria-no-sp", {"session_prefill": False}),
        ("talaria-no-hostkv", {"host_kv": False}),
        ("talaria-no-staging", {"weight_staging": False}),
        # lingering exists to keep a slot for reserved sessions expected back: it goes too
        ("talaria-no-reserve", {"soft_reservations": False, "slot_linger_s": 0.0}),
        ("talaria-no-slot-order", {"slot_order": SlotOrder.ROUND_ROBIN}),
    ],
)
def test_each_ablation_differs_from_talaria_in_its_mechanism_only(
    name: str, expected: dict[str, object]
) -> None:
    assert differences(POLICIES[name]) == expected


def test_per_request_baselines_route_by_their_idea_without_talarias_mechanisms() -> None:
    routing = {
        "least-loaded": Routing.LEAST_LOADED,
        "sticky": Routing.STICKY,
        "ttl-pin": Routing.STICKY,
        "cache-affinity": Routing.CACHE_AFFINITY,
        "oldest-first": Routing.LEAST_LOADED,
        "serverless": Routing.STARTUP_TIME,
        "autoscale": Routing.CONCURRENCY_TARGET,
    }
    for name, how in routing.items():
        p = POLICIES[name]
        assert p.routing is how, name
        oldest = name in ("oldest-first", "serverless", "autoscale")
        order = SlotOrder.OLDEST_WAITING if oldest else SlotOrder.ROUND_ROBIN
        assert p.slot_order is order, name
        # a host KV tier, as vLLM's offloading connector, LMCache or SGLang's HiCache keep;
        # no staging and no reservations: those are session-aware ideas
        assert p.host_kv and not p.weight_staging and not p.soft_reservations, name
        assert p.eviction is Eviction.LRU and p.slot_linger_s == 0.0, name
    # serverless is oldest-first placed by startup time, nothing else
    assert differences(POLICIES["serverless"], POLICIES["oldest-first"]) == {
        "routing": Routing.STARTUP_TIME
    }
    # autoscale is oldest-first scaled by concurrency: its routing (and target) differ
    assert differences(POLICIES["autoscale"], POLICIES["oldest-first"]) == {
        "routing": Routing.CONCURRENCY_TARGET
    }
    ttl = POLICIES["ttl-pin"]  # Continuum as published: its TTL rule and program-level FCFS
    assert ttl.continuum_ttl and ttl.queue_order is QueueOrder.PROGRAM_FCFS
    assert all(not POLICIES[n].continuum_ttl for n in POLICIES if n != "ttl-pin")
    assert all(POLICIES[n].queue_order is QueueOrder.FCFS for n in POLICIES if n != "ttl-pin")
    assert all(POLICIES[n].kv_pin_ttl_s == 0.0 for n in POLICIES)


def test_policy_by_name() -> None:
    assert policy("round") is POLICIES["round"]
    with pytest.raises(ConfigError) as err:
        policy("talaria-fast")
    message = str(err.value)
    assert "talaria-fast" in message
    assert all(name in message for name in DESIGN_NAMES)


def test_parse_policies() -> None:
    assert parse_policies("all") == tuple(POLICIES.values())
    assert parse_policies(" all ") == tuple(POLICIES.values())
    assert parse_policies("round") == (POLICIES["round"],)
    assert parse_policies(" talaria , round,,ttl-pin ") == (
        POLICIES["talaria"],
        POLICIES["round"],
        POLICIES["ttl-pin"],
    )


@pytest.mark.parametrize(("spec", "bad"), [("talaria,nope", "nope"), ("All", "All")])
def test_parse_policies_names_the_unknown_one_and_the_known_ones(spec: str, bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policies(spec)
    message = str(err.value)
    assert repr(bad) in message
    assert all(name in message for name in DESIGN_NAMES)


@pytest.mark.parametrize("spec", ["", " , "])
def test_parse_policies_rejects_an_empty_list(spec: str) -> None:
    with pytest.raises(ConfigError, match="no policy named"):
        parse_policies(spec)
