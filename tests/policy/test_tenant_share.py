"""Fair share between tenants: the order in which a model's waiting calls are admitted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from talaria.policy.tenant_share import fair_order


def tenant(call: str) -> str:
    return call[0]


def test_one_tenants_backlog_does_not_stand_before_another_tenants_call() -> None:
    queue = ["a1", "a2", "a3", "a4", "b1", "a5", "c1", "b2"]
    assert fair_order(queue, tenant, {}) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4", "a5"]


def test_calls_in_the_batch_count_against_their_tenant() -> None:
    queue = ["a1", "a2", "b1", "b2"]
    # a already runs 3 calls, b none: b's two come first, then a's
    assert fair_order(queue, tenant, {"a": 3}) == ["b1", "b2", "a1", "a2"]
    assert fair_order(queue, tenant, {"a": 1}) == ["b1", "a1", "b2", "a2"]


def test_one_tenant_keeps_its_order() -> None:
    queue = ["a3", "a1", "a2"]
    assert fair_order(queue, tenant, {"a": 7}) == queue


@given(
    queue=st.lists(st.sampled_from("abcd"), max_size=40).map(
        lambda ts: [f"{t}{i}" for i, t in enumerate(ts)]
    ),
    running=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 10)),
)
def test_fair_order_is_a_fair_permutation(queue: list[str], running: dict[str, int]) -> None:
    out = fair_order(queue, tenant, running)
    assert sorted(out) == sorted(queue)
    for t in "abcd":  # a tenant's own calls keep their order
        assert [c for c in out if c[0] == t] == [c for c in queue if c[0] == t]
    # admitting in this order, each call's tenant has the fewest calls in the batch among the
    # tenants still waiting (so nobody waits behind a tenant that holds more)
    batch = dict(running)
    for i, call in enumerate(out):
        waiting = {c[0] for c in out[i:]}
        least = min(batch.get(t, 0) for t in waiting)
        assert batch.get(call[0], 0) == least
        batch[call[0]] = batch.get(call[0], 0) + 1
