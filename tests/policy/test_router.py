"""Router: the expected-completion breakdown by hand, and each routing rule's choice.

Rates are round numbers (prefill 1000 tok/s, restore 10000 tok/s, decode step 0.01 s) so
every expected value below is computable on paper.
"""

from __future__ import annotations

import math
import sys

import attrs
import pytest

from talaria.config import Routing
from talaria.errors import Overloaded
from talaria.memory.kv import PrefixMatch
from talaria.policy.router import InstanceView, estimate, route
from talaria.types import Residency
from tests.helpers import examples

PROMPT = 10_000  # tokens of the call's prompt in every view below


def view(
    name: str,
    *,
    device: int = 0,
    host: int = 0,
    residency: Residency = Residency.ACTIVE,
    slot_wait_s: float = 0.0,
    switch_s: float = 0.0,
    queue_s: float = 0.0,
    load: int = 0,
    served_last: bool = False,
    wake_s: float = 0.0,
    mine: int = 0,
    others: int = 0,
) -> InstanceView:
    return InstanceView(
        name=name,
        residency=residency,
        slot_wait_s=slot_wait_s,
        switch_s=switch_s,
        queue_s=queue_s,
        match=PrefixMatch(PROMPT, device, host, 16),
        prefill_tok_s=1000.0,
        restore_tok_s=10_000.0,
        decode_step_s=0.01,
        load_tokens=load,
        served_last=served_last,
        wake_s=wake_s,
        model_calls=mine,
        other_calls=others,
    )


# ---------------------------------------------------------------------------- estimate


def test_estimate_breakdown_matches_the_formula() -> None:
    v = view("a", device=4000, host=2000, slot_wait_s=1.5, switch_s=0.5, queue_s=0.25)
    e = estimate(v, known_tokens=8000, expected_output=100)
    # had 8000, 6000 still there -> 2000 recomputed; the last 2000 prompt tokens are new
    assert (e.reused_tokens, e.restore_tokens, e.recompute_tokens, e.new_tokens) == (
        4000,
        2000,
        2000,
        2000,
    )
    assert e.slot_wait_s == 1.5
    assert e.switch_s == 0.5
    assert e.queue_s == 0.25
    assert e.kv_prep_s == pytest.approx(2000 / 10_000 + 2000 / 1000)  # restore + recompute
    assert e.service_s == pytest.approx(2000 / 1000 + 100 * 0.01)  # new prefill + answer
    assert e.total_s == pytest.approx(1.5 + 0.5 + 2.2 + 0.25 + 3.0)
    assert e.instance == "a"


def test_estimate_cold_session_is_all_new_tokens() -> None:
    e = estimate(view("a"), known_tokens=0, expected_output=10)
    assert (e.reused_tokens, e.restore_tokens, e.recompute_tokens, e.new_tokens) == (
        0,
        0,
        0,
        PROMPT,
    )
    assert e.kv_prep_s == 0.0
    assert e.service_s == pytest.approx(10.0 + 0.1)


def test_estimate_known_tokens_beyond_the_prompt_are_capped() -> None:
    # a session that knew more than this prompt (e.g. a shorter retry): all gone is recompute
    e = estimate(view("a", device=1000), known_tokens=50_000, expected_output=0)
    assert (e.recompute_tokens, e.new_tokens) == (PROMPT - 1000, 0)
    assert e.kv_prep_s == pytest.approx(9.0)
    assert e.service_s == 0.0


def test_estimate_cached_beyond_known_is_not_recompute() -> None:
    # another session's shared prefix can cover more than this session computed itself
    e = estimate(view("a", device=6000), known_tokens=3000, expected_output=0)
    assert (e.reused_tokens, e.recompute_tokens, e.new_tokens) == (6000, 0, 4000)


# ---------------------------------------------------------------------------- routing


def test_expected_completion_prefers_active_model_with_device_prefix() -> None:
    known = 8000
    views = [
        view("d-gone", slot_wait_s=0.0),  # active, prefix gone: 8 s recompute
        view("c-host", host=8000),  # active, prefix on host: 0.8 s restore
        view("b-weights-on-host", device=8000, switch_s=3.0, slot_wait_s=2.0),
        view("a-best", device=8000),
    ]
    decision = route(views, Routing.EXPECTED_COMPLETION, known, expected_output=100)
    assert decision.instance == "a-best"
    assert decision.routing is Routing.EXPECTED_COMPLETION
    totals = {e.instance: e.total_s for e in decision.estimates}
    # new prefill 2 s + answer 1 s everywhere; the rest is what differs
    assert totals == pytest.approx(
        {"a-best": 3.0, "c-host": 3.8, "b-weights-on-host": 8.0, "d-gone": 11.0}
    )
    assert decision.chosen.instance == "a-best"
    assert decision.chosen.reused_tokens == 8000


def test_expected_completion_weighs_residency_against_locality() -> None:
    # a cheap staged switch beats recomputing the whole history elsewhere
    views = [
        view("gone-but-active"),
        view("staged", device=8000, residency=Residency.STAGED, switch_s=0.1),
    ]
    assert route(views, Routing.EXPECTED_COMPLETION, 8000, 100).instance == "staged"


def test_expected_completion_ties_break_by_name() -> None:
    views = [view("b", device=5000), view("a", device=5000), view("c", device=5000)]
    assert route(views, Routing.EXPECTED_COMPLETION, 5000, 10).instance == "a"


def test_every_routing_reports_the_same_breakdown() -> None:
    views = [view("a", device=8000, load=9000), view("b", host=8000, load=10)]
    expected = route(views, Routing.EXPECTED_COMPLETION, 8000, 10).estimates
    for routing in Routing:
        assert route(views, routing, 8000, 10).estimates == expected


def test_least_loaded_ignores_locality_and_breaks_ties_by_name() -> None:
    views = [view("a", device=9000, load=500), view("c", load=100), view("b", load=100)]
    assert route(views, Routing.LEAST_LOADED, 9000, 10).instance == "b"


def test_sticky_keeps_the_last_instance_even_when_loaded() -> None:
    views = [view("a", load=0), view("b", load=10_000, served_last=True)]
    assert route(views, Routing.STICKY, 0, 10).instance == "b"


def test_sticky_without_history_is_least_loaded() -> None:
    views = [view("a", load=300), view("b", load=200), view("c", load=200)]
    assert route(views, Routing.STICKY, 0, 10).instance == "b"


def test_cache_affinity_takes_longest_device_prefix_under_the_cap() -> None:
    views = [
        view("a", device=2000, load=100),
        view("b", device=6000, load=150, host=0),
        view("c", host=9000, load=100),  # host tokens do not count as affinity
    ]
    assert route(views, Routing.CACHE_AFFINITY, 9000, 10, load_cap=2.0).instance == "b"


def test_cache_affinity_at_the_cap_stays_and_over_it_goes_least_loaded() -> None:
    at_cap = [view("a", device=6000, load=200), view("b", load=100)]
    assert route(at_cap, Routing.CACHE_AFFINITY, 6000, 10, 2.0, 0).instance == "a"
    over = [view("a", device=6000, load=201), view("b", load=100)]
    assert route(over, Routing.CACHE_AFFINITY, 6000, 10, 2.0, 0).instance == "b"


def test_cache_affinity_needs_both_relative_and_absolute_imbalance() -> None:
    small = [view("a", device=6000, load=300), view("b", load=100)]  # 3x but only 200 apart
    assert route(small, Routing.CACHE_AFFINITY, 6000, 10, 2.0, 200).instance == "a"
    large = [view("a", device=6000, load=301), view("b", load=100)]
    assert route(large, Routing.CACHE_AFFINITY, 6000, 10, 2.0, 200).instance == "b"


def test_cache_affinity_equal_prefixes_prefer_the_lighter_instance() -> None:
    views = [view("a", device=6000, load=150), view("b", device=6000, load=100)]
    assert route(views, Routing.CACHE_AFFINITY, 6000, 10).instance == "b"


def test_cache_affinity_without_any_device_prefix_is_least_loaded() -> None:
    views = [view("a", host=9000, load=50), view("b", load=40)]
    assert route(views, Routing.CACHE_AFFINITY, 9000, 10).instance == "b"


def test_startup_time_takes_the_soonest_start_whatever_the_cache() -> None:
    """Start = slot wait + model load + queue: a (8.0 s, the whole prompt cached) loses to
    c (0.5 + 1.0 + 0.25 = 1.75 s, nothing cached); b ties c at 1.75 s with more load."""
    views = [
        view("a", device=PROMPT, slot_wait_s=8.0, load=0),
        view("b", slot_wait_s=1.75, load=200),
        view("c", slot_wait_s=0.5, switch_s=1.0, queue_s=0.25, load=100),
    ]
    assert route(views, Routing.STARTUP_TIME, PROMPT, 10).instance == "c"
    # the answer and the KV do not count: expected completion would take a
    assert route(views, Routing.EXPECTED_COMPLETION, PROMPT, 10).instance == "a"
    tie = [view("y", switch_s=1.0, load=5), view("x", queue_s=1.0, load=5)]
    assert route(tie, Routing.STARTUP_TIME, 0, 10).instance == "x"


def test_a_wake_is_charged_once_over_the_sessions_calls_left() -> None:
    """A warm instance 10 s from its slot with a 2 s switch, against one at zero: 30 s to
    provision plus the same 2 s load. The call itself finishes sooner on the warm one (the
    estimate); a session expected to make 30 more calls is charged a thirtieth of the wake
    (2 + 30 / 30 = 3 s) and keeps the instance it woke."""
    warm = view("a", slot_wait_s=10.0, switch_s=2.0)
    zero = view("b", switch_s=32.0, wake_s=30.0)
    service = 10.0 + 100 * 0.01  # the whole prompt's prefill and the answer, on either
    alone = route([warm, zero], Routing.EXPECTED_COMPLETION, 0, 100)
    assert alone.instance == "a" and alone.chosen.total_s == pytest.approx(12.0 + service)
    kept = route([warm, zero], Routing.EXPECTED_COMPLETION, 0, 100, calls_left=30.0)
    assert kept.instance == "b"
    assert kept.chosen.total_s == pytest.approx(32.0 + service)  # still the call's estimate
    assert kept.chosen.charge_s(30.0) == pytest.approx(3.0 + service)
    assert kept.chosen.charge_s(1.0) == kept.chosen.total_s
    # a per-request rule sees only this call: the start-up time picks the warm instance
    assert route([warm, zero], Routing.STARTUP_TIME, 0, 100, calls_left=30.0).instance == "a"


def test_a_wake_charge_keeps_the_call_on_an_instance_already_up() -> None:
    """The same two instances, the session's 30 calls left: b is charged 3 s of switch and
    wake share against a's 12 s. A price of 8 s on a wake still leaves b cheaper (11 s);
    at 10 s the call waits on a (13 s against 12); the price is not shared and touches no
    instance that is up. The estimates stay the call's expected completion."""
    warm = view("a", slot_wait_s=10.0, switch_s=2.0)
    zero = view("b", switch_s=32.0, wake_s=30.0)
    service = 10.0 + 100 * 0.01
    cheap = route(
        [warm, zero], Routing.EXPECTED_COMPLETION, 0, 100, calls_left=30.0, wake_charge_s=8.0
    )
    assert cheap.instance == "b" and cheap.chosen.charge_s(30.0, 8.0) == pytest.approx(
        11.0 + service
    )
    dear = route(
        [warm, zero], Routing.EXPECTED_COMPLETION, 0, 100, calls_left=30.0, wake_charge_s=10.0
    )
    assert dear.instance == "a"
    assert dear.chosen.charge_s(30.0, 10.0) == dear.chosen.total_s == pytest.approx(12.0 + service)
    assert {e.instance: e.total_s for e in dear.estimates} == {
        e.instance: e.total_s for e in cheap.estimates
    }


def test_a_pack_slack_joins_the_models_batch_within_the_slack() -> None:
    """a is idle (11 s: the whole prompt's prefill and the answer); b runs 3 calls of the
    model and its slot holds it 1 s longer (12 s); c is as dear as b with another model's
    calls only. No slack: a. A slack of 10% (12.1 s): b, its model's batch. 5% (11.55 s):
    a again; c is never a join."""
    views = [
        view("a"),
        view("b", queue_s=1.0, mine=3),
        view("c", queue_s=1.0, others=3),
    ]
    pick = {
        slack: route(views, Routing.EXPECTED_COMPLETION, 0, 100, pack_slack=slack).instance
        for slack in (0.0, 0.05, 0.1, 10.0)
    }
    assert pick == {0.0: "a", 0.05: "a", 0.1: "b", 10.0: "b"}
    without_b = [views[0], views[2]]
    assert route(without_b, Routing.EXPECTED_COMPLETION, 0, 100, pack_slack=10.0).instance == "a"


def test_concurrency_target_scales_out_at_the_target_and_places_by_startup_time() -> None:
    """a serves the model (2 calls); b is idle with another model loaded (2 s to switch); c
    is at zero (30 s to provision + 2 s); d is busy with another model. With this call 3 are
    in flight: a target of 2 wants 2 instances, so the model scales out to the free
    instance that starts soonest (b); a target of 3 or more keeps it on a."""
    views = [
        view("a", mine=2, load=300),
        view("b", residency=Residency.HOST, switch_s=2.0),
        view("c", residency=Residency.HOST, switch_s=32.0, wake_s=30.0),
        view("d", residency=Residency.HOST, switch_s=2.0, slot_wait_s=5.0, others=3),
    ]
    for target, chosen in ((1, "b"), (2, "b"), (3, "a"), (64, "a")):
        d = route(views, Routing.CONCURRENCY_TARGET, 0, 10, concurrency_target=target)
        assert d.instance == chosen, target
    # with b gone, scaling out wakes c rather than sharing d with its model
    rest = views[:1] + views[2:]
    assert route(rest, Routing.CONCURRENCY_TARGET, 0, 10, concurrency_target=1).instance == "c"


def test_concurrency_target_counts_an_idle_loaded_instance_and_queues_when_full() -> None:
    """An idle instance with the model loaded is one of its instances (a replica kept
    alive): at target 1 with 2 in flight it takes the call. With every other instance busy,
    the call queues on the model's least-loaded instance, over the target; with none of the
    model's, it shares the soonest start."""
    busy = view("z", residency=Residency.HOST, switch_s=2.0, others=1)
    idle = view("e")
    a = view("a", mine=1)

    def chosen(views: list[InstanceView]) -> str:
        return route(views, Routing.CONCURRENCY_TARGET, 0, 10, concurrency_target=1).instance

    assert chosen([a, idle, busy]) == "e"
    full = [view("a", mine=3, load=900), view("b", mine=2, load=100), busy]
    assert chosen(full) == "b"
    shared = [busy, view("y", residency=Residency.HOST, switch_s=1.0, others=4, load=5)]
    assert chosen(shared) == "y"
    # the model loaded but another's calls held there: not its instance, not free
    taken = view("t", others=2, queue_s=0.0)
    assert chosen([taken, busy]) == "t"


def test_a_concurrency_target_below_one_is_refused() -> None:
    from talaria.errors import ConfigError

    with pytest.raises(ConfigError, match="at least 1"):
        route([view("a")], Routing.CONCURRENCY_TARGET, 0, 10, concurrency_target=0)


def test_single_view_is_chosen_by_every_routing() -> None:
    for routing in Routing:
        assert route([view("only", load=10**9)], routing, 0, 10).instance == "only"


@pytest.mark.parametrize("routing", list(Routing))
def test_no_view_raises_overloaded(routing: Routing) -> None:
    with pytest.raises(Overloaded):
        route([], routing, 0, 10)


def test_decision_is_plain_data() -> None:
    views = [view("a", device=8000), view("b")]
    d1 = route(views, Routing.EXPECTED_COMPLETION, 8000, 10)
    d2 = route(list(reversed(views)), Routing.EXPECTED_COMPLETION, 8000, 10)
    assert d1.instance == d2.instance == "a"
    assert attrs.asdict(d1.chosen) == attrs.asdict(d2.chosen)


# ---------------------------------------------------------------------------- properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_seconds = st.floats(0.0, 1e6)
_rates = st.floats(1e-3, 1e9)


@st.composite
def _views(draw: st.DrawFn, name: str) -> InstanceView:
    total = draw(st.integers(1, 200_000))
    device = draw(st.integers(0, total))
    host = draw(st.integers(0, total - device))
    switch_s = draw(_seconds)
    return InstanceView(
        name=name,
        residency=draw(st.sampled_from(list(Residency))),
        slot_wait_s=draw(_seconds),
        switch_s=switch_s,
        wake_s=draw(st.sampled_from([0.0, switch_s]) | st.floats(0.0, switch_s)),
        queue_s=draw(_seconds),
        match=PrefixMatch(total, device, host, 16),
        prefill_tok_s=draw(_rates),
        restore_tok_s=draw(_rates),
        decode_step_s=draw(st.floats(0.0, 10.0)),
        load_tokens=draw(st.integers(0, 10**7)),
        served_last=draw(st.booleans()),
        model_calls=draw(st.just(0) | st.integers(0, 64)),  # idle instances are common
        other_calls=draw(st.just(0) | st.integers(0, 64)),
    )


@settings(max_examples=examples(300), deadline=None)
@given(v=_views("a"), known=st.integers(0, 10**6), out=st.integers(0, 10**5))
def test_estimates_are_finite_non_negative_and_account_for_every_token(
    v: InstanceView, known: int, out: int
) -> None:
    e = estimate(v, known, out)
    parts = (e.slot_wait_s, e.switch_s, e.kv_prep_s, e.queue_s, e.service_s)
    assert all(math.isfinite(p) and p >= 0.0 for p in parts)
    assert e.total_s == pytest.approx(sum(parts))
    tokens = (e.reused_tokens, e.restore_tokens, e.recompute_tokens, e.new_tokens)
    assert min(tokens) >= 0 and sum(tokens) == v.match.total_tokens


@settings(max_examples=examples(300), deadline=None)
@given(
    v=_views("a"),
    known=st.integers(0, 10**6),
    out=st.integers(0, 10**5),
    left=st.floats(1.0, 1e6),
    more=st.floats(0.0, 1e6),
    price=st.floats(0.0, 1e6),
)
def test_a_charge_is_the_estimate_less_at_most_the_wake_and_falls_with_calls_left(
    v: InstanceView, known: int, out: int, left: float, more: float, price: float
) -> None:
    """... and a wake charge adds its price to a wake's charge, to no other."""
    e = estimate(v, known, out)
    assert e.charge_s(1.0) == e.total_s
    charge = e.charge_s(left)
    assert e.total_s - e.wake_s - 1e-9 * e.total_s <= charge <= e.total_s
    assert e.charge_s(left + more) <= charge
    assert charge >= 0.0 and math.isfinite(charge)
    assert e.charge_s(left, price) == (charge + price if e.wake_s else charge)


@settings(max_examples=examples(300), deadline=None)
@given(v=_views("a"), known=st.integers(0, 10**6), out=st.integers(0, 10**5), k=st.integers(0))
def test_more_kv_on_device_is_never_slower(v: InstanceView, known: int, out: int, k: int) -> None:
    """Turning ``k`` tokens that must be computed into device-cached ones cannot raise the
    estimate: device tokens cost nothing, every other tier costs time."""
    m = v.match
    k = min(k, m.gone_tokens)
    better = attrs.evolve(v, match=attrs.evolve(m, device_tokens=m.device_tokens + k))
    assert estimate(better, known, out).total_s <= estimate(v, known, out).total_s * (1 + 1e-12)


@settings(max_examples=examples(200), deadline=None)
@given(
    vs=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True).flatmap(
        lambda names: st.tuples(*[_views(n) for n in names])
    ),
    routing=st.sampled_from(list(Routing)),
    known=st.integers(0, 10**6),
    out=st.integers(0, 10**4),
    left=st.sampled_from([1.0]) | st.floats(1.0, 1e4),
)
def test_every_rule_picks_a_candidate_and_talaria_picks_the_minimum(
    vs: tuple[InstanceView, ...], routing: Routing, known: int, out: int, left: float
) -> None:
    d = route(vs, routing, known, out, calls_left=left)
    assert d.instance in {v.name for v in vs} and len(d.estimates) == len(vs)
    if routing is Routing.EXPECTED_COMPLETION:
        assert d.chosen.charge_s(left) == min(e.charge_s(left) for e in d.estimates)


@settings(max_examples=examples(300), deadline=None)
@given(
    vs=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True).flatmap(
        lambda names: st.tuples(*[_views(n) for n in names])
    ),
    slack=st.floats(0.0, 4.0),
    left=st.sampled_from([1.0]) | st.floats(1.0, 1e4),
)
def test_a_packed_call_costs_at_most_the_slack_and_joins_where_it_can(
    vs: tuple[InstanceView, ...], slack: float, left: float
) -> None:
    """The choice is the least (charge, name), a join's charge divided by ``1 + slack``. So
    (up to the division's rounding: relative, and absolute below the smallest normal float,
    where a quotient keeps fewer digits) it costs at most the slack over the least charge, it
    is a join where a join is clearly within the slack, the cheapest such, and else the
    least."""
    d = route(vs, Routing.EXPECTED_COMPLETION, 7, 50, calls_left=left, pack_slack=slack)
    charge = {e.instance: e.charge_s(left) for e in d.estimates}
    joins = {v.name for v in vs if v.model_calls}
    key = {n: c / (1 + slack) if n in joins and slack else c for n, c in charge.items()}
    assert d.instance == min(key, key=lambda n: (key[n], n))
    least = min(charge.values())

    def up_to_rounding(x: float) -> float:
        return x * (1 + 1e-12) + sys.float_info.min

    assert charge[d.instance] <= up_to_rounding(least * (1 + slack))
    clearly = [n for n in joins if up_to_rounding(charge[n]) < least * (1 + slack)]
    if clearly:
        assert d.instance in joins
        assert charge[d.instance] <= up_to_rounding(min(charge[n] for n in clearly))
    elif d.instance not in joins:
        assert charge[d.instance] == least


@settings(max_examples=examples(300), deadline=None)
@given(
    vs=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True).flatmap(
        lambda names: st.tuples(*[_views(n) for n in names])
    ),
    target=st.integers(1, 70),
)
def test_the_autoscaler_shares_an_instance_with_another_model_only_as_a_last_resort(
    vs: tuple[InstanceView, ...], target: int
) -> None:
    """With fewer instances of its model than ceil(in flight / target) and a free instance,
    the model scales out to a free one; with enough, the call goes to the one of its
    instances holding the fewest of its calls; it lands where only another model's calls
    are held only if no instance is free and none holds its model's calls."""
    name = route(vs, Routing.CONCURRENCY_TARGET, 0, 10, concurrency_target=target).instance
    chosen = next(v for v in vs if v.name == name)
    free = [v for v in vs if not v.model_calls and not v.other_calls]
    mine = [
        v
        for v in vs
        if v.model_calls or (v.residency is Residency.ACTIVE and not v.other_calls and not v.wake_s)
    ]
    desired = -(-(sum(v.model_calls for v in vs) + 1) // target)
    if mine and len(mine) >= desired:
        assert chosen in mine and chosen.model_calls == min(v.model_calls for v in mine)
    elif free:
        assert chosen in free
    if chosen.other_calls and not chosen.model_calls:
        assert not free and not any(v.model_calls for v in vs)


def test_an_unknown_routing_is_refused_not_treated_as_cache_affinity() -> None:
    from talaria.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown routing"):
        route([view("a")], "cache-affinity", 0, 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the search

from talaria.config import PolicyConfig  # noqa: E402
from talaria.policy.router import pack_key, search  # noqa: E402
from talaria.types import Call, TokenSeq  # noqa: E402


@attrs.define
class _Candidate:
    """A candidate whose exact view is fixed and whose bound is at most its key (its
    charge, discounted by a pack slack where the view holds the model's calls)."""

    exact: InstanceView
    slack: float  # how far below the exact estimate the bound is
    tight: float = 0.5  # how far from the bound to the estimate ``prefill_bound_s`` goes
    viewed: int = 0

    @property
    def name(self) -> str:
        return self.exact.name

    def _key(self, charge_s: float, pack_slack: float) -> float:
        return pack_key(charge_s, self.exact.model_calls > 0, pack_slack)

    def bound_s(
        self,
        model: str,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        charge = estimate(self.exact, 0, expected_output).charge_s(calls_left, wake_charge_s)
        return self._key(max(0.0, charge - self.slack), pack_slack)

    def prefill_bound_s(
        self,
        call: Call,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        charge = estimate(self.exact, 0, expected_output).charge_s(calls_left, wake_charge_s)
        bound = max(0.0, charge - self.slack)
        return self._key(bound + self.tight * (charge - bound), pack_slack)

    def view(self, call: Call, now: float, served_last: bool) -> InstanceView:
        self.viewed += 1
        return attrs.evolve(self.exact, served_last=served_last)


@settings(max_examples=examples(200), deadline=None)
@given(
    vs=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True).flatmap(
        lambda names: st.tuples(*[_views(n) for n in names])
    ),
    slack=st.lists(st.floats(0.0, 1e6), min_size=6, max_size=6),
    routing=st.sampled_from(list(Routing)),
    out=st.integers(1, 10**4),
    last=st.sampled_from([None, "a", "b", "z"]),
    left=st.sampled_from([1.0]) | st.floats(1.0, 1e4),
    shared=st.booleans(),
    price=st.sampled_from([0.0]) | st.floats(0.0, 1e4),
    pack=st.sampled_from([0.0]) | st.floats(0.0, 2.0),
)
def test_the_pruned_search_decides_as_ranking_every_view(
    vs: tuple[InstanceView, ...],
    slack: list[float],
    routing: Routing,
    out: int,
    last: str | None,
    left: float,
    shared: bool,
    price: float,
    pack: float,
) -> None:
    """``known_tokens`` is 0 so that each candidate's bound (its charge at no history, less
    a slack) is a true lower bound, as the instance's optimistic view guarantees. A policy
    that does not share wakes ranks by the whole estimate whatever the calls left; a wake
    charge is left out of the bounds (they stay lower bounds) and decides as in ``route``."""
    cands = [_Candidate(v, s) for v, s in zip(vs, slack, strict=False)]
    policy = PolicyConfig(
        name="p", routing=routing, wake_shared=shared, wake_charge_s=price, pack_slack=pack
    )
    call = Call("s", 0, "m", TokenSeq((1, 2, 3)), out)
    d = search(
        cands,
        call,
        0.0,
        policy,
        last_instance=last,
        known_tokens=0,
        expected_output=out,
        calls_left=left,
    )
    every = [attrs.evolve(c.exact, served_last=c.name == last) for c in cands]
    full = route(
        every,
        routing,
        0,
        out,
        policy.cache_affinity_load_cap,
        policy.cache_affinity_abs_tokens,
        calls_left=left if shared else 1.0,
        wake_charge_s=price,
        pack_slack=pack,
    )
    assert d.instance == full.instance
    assert d.chosen.total_s == full.chosen.total_s
    if routing is not Routing.EXPECTED_COMPLETION:
        assert all(c.viewed == 1 for c in cands)  # the baselines rank every view


def test_the_search_views_the_joins_within_the_slack_and_no_dearer_non_join() -> None:
    """The pack slack discounts the joins' bounds as their charges: with a 10% slack b (its
    model's batch, 12 s, its bound exact) ranks first at 10.9 s, is viewed and chosen, and
    nothing else is viewed: a (11 s), c (11.5 s, within the slack but another model's calls,
    never a choice) and d (13.5 s, 12.3 s discounted) cannot beat it. With no slack only a
    is viewed."""
    a, b = _Candidate(view("a"), 0.0), _Candidate(view("b", queue_s=1.0, mine=3), 0.0)
    c = _Candidate(view("c", queue_s=0.5, others=2), 0.0)
    d = _Candidate(view("d", queue_s=2.5, mine=1), 0.0)
    call = Call("s", 0, "m", TokenSeq((1, 2, 3)), 100)
    for slack, chosen, viewed in ((0.1, "b", [0, 1, 0, 0]), (0.0, "a", [1, 0, 0, 0])):
        for cand in (a, b, c, d):
            cand.viewed = 0
        policy = PolicyConfig(name="p", pack_slack=slack)
        got = search(
            [a, b, c, d], call, 0.0, policy, last_instance=None, known_tokens=0, expected_output=100
        )
        assert got.instance == chosen and [cand.viewed for cand in (a, b, c, d)] == viewed


def test_a_tightened_bound_spares_the_exact_views_of_instances_without_the_prefix() -> None:
    """Twenty instances, every optimistic bound 0 (each could be idle with the model
    active); only c07 holds the session's KV. The prefill bounds of the other nineteen are
    their estimates, so c07 is the one exact view, where ranking by the optimistic bound
    alone would view all twenty."""
    cands = []
    for i in range(20):
        kv = 2_000 if i == 7 else 0
        exact = view(f"c{i:02d}", device=kv)
        cands.append(_Candidate(exact, slack=1e9, tight=0.0 if i == 7 else 1.0))
    policy = PolicyConfig(name="p", routing=Routing.EXPECTED_COMPLETION)
    call = Call("s", 1, "m", TokenSeq(range(2_001)), 10)
    d = search(
        cands, call, 0.0, policy, last_instance="c07", known_tokens=2_000, expected_output=10
    )
    assert d.instance == "c07"
    assert [c.name for c in cands if c.viewed] == ["c07"]
