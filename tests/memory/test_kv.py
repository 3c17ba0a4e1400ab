"""KV block manager: exact plans on tiny hand-built pools, typed errors, and a random-operation
state machine that checks integrity and conservation of every session's tokens after each step.

Block ids are predictable: each tier hands out its lowest free id first, and ids freed later are
handed out again last-freed-first.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from talaria.config import Eviction
from talaria.errors import BadRequest, OutOfBlocks
from talaria.memory.kv import KVManager, PrefixMatch, SessionKV
from talaria.memory.kv.types import KVHeld
from talaria.types import Link, TokenSeq
from tests.helpers import examples

BLOCK_BYTES = 100
TPB = {"m": 4, "w": 8}


def make(
    device: int = 8, host: int = 8, eviction: Eviction = Eviction.VALUE, **tpb: int
) -> KVManager:
    return KVManager(device, host, BLOCK_BYTES, tpb or TPB, eviction=eviction)


def seq(n: int, start: int = 0) -> TokenSeq:
    """``n`` distinct token ids from ``start`` (sessions use disjoint ranges)."""
    return TokenSeq(range(start, start + n))


def cached(kv: KVManager, model: str, tenant: str, tokens: TokenSeq) -> PrefixMatch:
    """What of ``tokens`` is cached, whole: the match of a call that extends ``tokens`` by
    one token (a call of exactly ``tokens`` never reuses the block holding its last token)."""
    m = kv.match(model, tenant, tokens.extend([10**6]))
    return PrefixMatch(len(tokens), m.device_tokens, m.host_tokens, m.tokens_per_block)


def run_call(
    kv: KVManager,
    session: str,
    index: int,
    prompt: TokenSeq,
    extra: int,
    now: float,
    output: int | None = None,
    model: str = "m",
    tenant: str = "t",
) -> tuple[TokenSeq, Any]:
    """Allocate and finish one call; the output is ``output`` (default ``extra``) tokens."""
    alloc = kv.allocate((session, index), model, tenant, prompt, extra, now)
    n_out = extra if output is None else output
    history = prompt.extend(range(10_000 + 100 * index, 10_000 + 100 * index + n_out))
    kv.finish((session, index), history, now)
    kv.check_integrity()
    return history, alloc


def snapshot(kv: KVManager) -> Any:
    """Everything observable plus the internal block map: equal before and after a refusal."""
    sessions = {
        sid: (
            kv.session_kv(sid),
            kv.dropped_tokens(sid),
            kv.is_pinned(sid),
            s.running,
            s.table,
            s.priority,
        )
        for sid, s in kv.sessions.items()
    }
    blocks = {h: (b.bid, b.on_device, b.ref, b.pin, b.computed) for h, b in kv._blocks.items()}
    return (
        kv.device_free,
        kv.host_free,
        kv.device_evictable,
        kv.lent_blocks,
        attrs.astuple(kv.counters),
        sessions,
        blocks,
        tuple(sorted(kv._calls)),
    )


# ---------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "args",
    [
        (0, 4, 100, {"m": 4}),
        (-1, 4, 100, {"m": 4}),
        (8, -1, 100, {"m": 4}),
        (8, 4, 0, {"m": 4}),
        (8, 4, 100, {}),
        (8, 4, 100, {"m": 0}),
        (8, 4, 100, {"m": 4, "w": -8}),
    ],
)
def test_constructor_rejects_invalid_arguments(args: tuple[Any, ...]) -> None:
    with pytest.raises(BadRequest):
        KVManager(*args)


def test_fresh_manager_is_empty() -> None:
    kv = make(device=16, host=0)
    kv.check_integrity()
    assert (kv.device_free, kv.host_free, kv.device_evictable) == (16, 0, 0)
    assert kv.match("m", "t", seq(10)) == PrefixMatch(10, 0, 0, 4)
    assert kv.match("m", "t", seq(10)).gone_tokens == 10
    assert kv.session_kv("nobody") == SessionKV(0, 0, 0)
    assert kv.dropped_tokens("nobody") == 0
    assert kv.blocks_needed("m", "t", seq(10), 6) == 4
    assert kv.blocks_needed("w", "t", seq(10), 6) == 2


# ---------------------------------------------------------------------------- calls


def test_first_call_computes_everything_and_is_matchable_once_computed() -> None:
    kv = make()
    prompt = seq(10)
    alloc = kv.allocate(("a", 0), "m", "t", prompt, 6, now=1.0)
    assert (alloc.reused_tokens, alloc.restored_tokens, alloc.computed_tokens) == (0, 0, 10)
    assert alloc.device_blocks == (0, 1, 2, 3)  # 16 tokens = 4 blocks, lowest ids first
    assert len(alloc.restore) == 0 and len(alloc.evicted.demoted) == 0
    assert alloc.evicted.dropped_blocks == 0
    assert (kv.device_free, kv.device_evictable, kv.counters.allocated_blocks) == (4, 0, 4)
    # Not computed yet: nothing to reuse.
    assert kv.match("m", "t", prompt).device_tokens == 0
    kv.mark_computed(("a", 0))
    assert kv.match("m", "t", prompt) == PrefixMatch(10, 8, 0, 4)
    kv.check_integrity()


def test_holds_prefix_is_the_match_being_empty_or_not_in_one_lookup() -> None:
    kv = make(device=16, host=0)
    run_call(kv, "a", 0, seq(8), extra=0, now=1.0, output=0)  # two full blocks, computed
    assert kv.match("m", "t", seq(4)) == PrefixMatch(4, 0, 0, 4)  # its one block holds its last
    assert not kv.holds_prefix("m", "t", seq(4))
    assert kv.holds_prefix("m", "t", seq(5))  # the first block is before the last token's
    assert not kv.holds_prefix("m", "bob", seq(5))  # another tenant's blocks never match
    assert not kv.holds_prefix("m", "t", seq(5, 1))  # another first block
    kv.allocate(("b", 0), "m", "t", seq(9, 100), 0, now=2.0)  # allocated, not yet computed
    assert kv.match("m", "t", seq(9, 100)).gone_tokens == 9
    assert not kv.holds_prefix("m", "t", seq(9, 100))
    kv.check_integrity()


def test_finish_registers_output_so_the_next_call_matches_all_but_the_partial_tail() -> None:
    kv = make(device=16, host=0)
    prompt0 = seq(10)
    history0, _ = run_call(kv, "a", 0, prompt0, extra=6, now=1.0, output=5)
    assert len(history0) == 15  # 3 full blocks, 3 tokens in a partial one
    assert kv.session_kv("a") == SessionKV(12, 0, 12)
    assert kv.device_free == 13 and kv.device_evictable == 3  # the partial block was freed
    prompt1 = history0.extend(range(500, 507))  # 22 tokens
    assert kv.match("m", "t", prompt1) == PrefixMatch(22, 12, 0, 4)
    alloc = kv.allocate(("a", 1), "m", "t", prompt1, 2, now=2.0)
    assert (alloc.reused_tokens, alloc.restored_tokens, alloc.computed_tokens) == (12, 0, 10)
    # The table is positional: block 2 (prompt tail + first output) was registered where the
    # first call wrote it, block 2; the partial block 3 went back and is handed out again.
    assert alloc.device_blocks == (0, 1, 2, 3, 4, 5)
    kv.finish(("a", 1), prompt1.extend([600, 601]), now=2.0)
    assert kv.session_kv("a") == SessionKV(24, 0, 24)
    kv.check_integrity()


def test_output_longer_than_allocated_registers_only_allocated_blocks() -> None:
    kv = make(device=8, host=0)
    prompt = seq(8)
    kv.allocate(("a", 0), "m", "t", prompt, 4, now=1.0)  # 3 blocks
    kv.finish(("a", 0), prompt.extend(range(100, 112)), now=1.0)  # 20 tokens: 5 full blocks
    assert kv.session_kv("a") == SessionKV(12, 0, 12)
    assert kv.device_free == 5
    kv.check_integrity()


def test_models_use_their_own_block_size_and_never_share() -> None:
    kv = make(device=16, host=0)
    prompt = seq(16)
    run_call(kv, "a", 0, prompt, extra=0, now=1.0, model="w")
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    assert kv.session_device_blocks("a") == 2
    assert cached(kv, "w", "t", prompt) == PrefixMatch(16, 16, 0, 8)
    assert cached(kv, "m", "t", prompt) == PrefixMatch(16, 0, 0, 4)


def test_tenants_never_share_blocks() -> None:
    kv = make(device=16, host=0)
    prompt = seq(12)
    run_call(kv, "a", 0, prompt, extra=0, now=1.0, tenant="alice")
    assert cached(kv, "m", "alice", prompt).device_tokens == 12
    assert kv.match("m", "bob", prompt).device_tokens == 0
    alloc = kv.allocate(("b", 0), "m", "bob", prompt, 0, now=2.0)
    assert alloc.reused_tokens == 0 and alloc.computed_tokens == 12
    assert set(alloc.device_blocks).isdisjoint({0, 1, 2})
    kv.check_integrity()


def test_shared_prefix_is_reused_and_reference_counted() -> None:
    kv = make(device=8, host=0)
    system = seq(8, start=1000)
    a0 = system.extend(range(0, 4))
    history_a, _ = run_call(kv, "a", 0, a0, extra=4, now=1.0)  # 4 blocks, 2 shared
    b0 = system.extend(range(200, 204))
    assert kv.match("m", "t", b0).device_tokens == 8
    alloc = kv.allocate(("b", 0), "m", "t", b0, 4, now=2.0)
    assert (alloc.reused_tokens, alloc.computed_tokens) == (8, 4)
    assert alloc.device_blocks[:2] == (0, 1) and kv.device_free == 2
    # B runs on the shared blocks: only A's own two blocks (tail first) may be evicted.
    assert kv.device_evictable == 2
    assert not kv.can_allocate("m", "t", seq(20, start=3000), 0)  # needs 5, 4 available
    alloc_c = kv.allocate(("c", 0), "m", "t", seq(16, start=3000), 0, now=3.0)
    assert alloc_c.evicted.dropped_blocks == 2 and alloc_c.device_blocks == (2, 3, 6, 7)
    assert kv.session_kv("a") == SessionKV(8, 0, 16)
    assert kv.dropped_tokens("a") == 8 and kv.dropped_tokens("b") == 0
    kv.finish(("b", 0), b0.extend(range(300, 304)), now=4.0)
    kv.finish(("c", 0), seq(16, start=3000), now=4.0)
    assert kv.session_kv("b") == SessionKV(16, 0, 16)
    # Both tables list the shared blocks; ending one session keeps them for the other.
    assert kv.end_session("b")
    assert kv.match("m", "t", history_a).device_tokens == 8
    kv.check_integrity()


def test_eviction_demotes_to_host_and_allocate_restores_with_exact_plans() -> None:
    kv = make(device=8, host=8)
    a0 = seq(16)
    history_a, _ = run_call(kv, "a", 0, a0, extra=0, now=1.0)
    b0 = seq(24, start=1000)
    alloc_b = kv.allocate(("b", 0), "m", "t", b0, 0, now=2.0)
    # A's tail (blocks 3, 2) goes to host blocks 0, 1; B gets the rest, lowest first.
    assert alloc_b.evicted.demoted.moves == ((3, 0), (2, 1))
    assert alloc_b.evicted.demoted.link is Link.DEVICE_TO_HOST
    assert alloc_b.evicted.demoted.nbytes == 2 * BLOCK_BYTES
    assert alloc_b.evicted.dropped_blocks == 0
    assert alloc_b.device_blocks == (2, 3, 4, 5, 6, 7)
    assert kv.session_kv("a") == SessionKV(8, 8, 16)
    assert cached(kv, "m", "t", history_a) == PrefixMatch(16, 8, 8, 4)
    kv.finish(("b", 0), b0, now=2.0)

    a1 = history_a.extend([7, 7])  # 18 tokens: 2 on device, 2 on host, 2 new
    alloc_a = kv.allocate(("a", 1), "m", "t", a1, 2, now=3.0)
    assert (alloc_a.reused_tokens, alloc_a.restored_tokens, alloc_a.computed_tokens) == (8, 8, 2)
    assert alloc_a.evicted.demoted.moves == ((7, 2), (6, 3), (5, 4))  # B's tail to host
    assert alloc_a.restore.link is Link.HOST_TO_DEVICE
    assert alloc_a.restore.moves == ((1, 5), (0, 6))  # block 2 sits in host 1
    assert alloc_a.restore.nbytes == 2 * BLOCK_BYTES
    assert alloc_a.device_blocks == (0, 1, 5, 6, 7)
    assert (kv.counters.demoted_blocks, kv.counters.restored_blocks) == (5, 2)
    assert kv.session_kv("b") == SessionKV(12, 12, 24)
    kv.finish(("a", 1), a1.extend([8, 8]), now=3.0)
    assert kv.session_kv("a") == SessionKV(20, 0, 20)
    assert kv.dropped_tokens("a") == kv.dropped_tokens("b") == 0
    kv.check_integrity()


def test_without_host_eviction_drops_and_charges_the_session() -> None:
    kv = make(device=8, host=0)
    history_a, _ = run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    alloc = kv.allocate(("b", 0), "m", "t", seq(24, start=1000), 0, now=2.0)
    assert alloc.evicted.dropped_blocks == 2 and len(alloc.evicted.demoted) == 0
    assert kv.counters.dropped_blocks == 2 and kv.counters.demoted_blocks == 0
    assert kv.dropped_tokens("a") == 8
    assert kv.session_kv("a") == SessionKV(8, 0, 16)
    assert kv.session_kv("a").gone_tokens == 8
    assert kv.match("m", "t", history_a).gone_tokens == 8
    kv.check_integrity()


def test_full_host_drops_the_least_valuable_not_the_victims_prefix() -> None:
    kv = make(device=8, host=2)
    run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    kv.set_priority("a", 0.9)
    run_call(kv, "b", 0, seq(16, start=1000), extra=0, now=2.0)
    kv.set_priority("b", 0.1)
    # 4 blocks needed: B (least valuable) goes, tail first; host holds 2, so B's tail is
    # dropped and its prefix demoted (its host run stays reachable).
    alloc = kv.allocate(("c", 0), "m", "t", seq(16, start=2000), 0, now=3.0)
    assert alloc.evicted.dropped_blocks == 2
    assert alloc.evicted.demoted.moves == ((5, 0), (4, 1))
    assert kv.session_kv("b") == SessionKV(0, 8, 16)
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    kv.finish(("c", 0), seq(16, start=2000), now=3.0)
    # Orphans and cheap sessions never displace a more valuable session's host blocks:
    kv.set_priority("c", 0.0)
    assert kv.end_session("c")
    alloc = kv.allocate(("d", 0), "m", "t", seq(8, start=3000), 0, now=4.0)
    assert alloc.evicted.dropped_blocks == 2 and len(alloc.evicted.demoted) == 0
    assert kv.session_kv("b") == SessionKV(0, 8, 16)
    kv.check_integrity()


@pytest.mark.parametrize(
    ("eviction", "victim", "kept"), [(Eviction.VALUE, "b", "a"), (Eviction.LRU, "a", "b")]
)
def test_value_eviction_uses_priority_lru_uses_recency(
    eviction: Eviction, victim: str, kept: str
) -> None:
    kv = make(device=8, host=0, eviction=eviction)
    run_call(kv, "a", 0, seq(16), extra=0, now=1.0)  # older, valuable
    run_call(kv, "b", 0, seq(16, start=1000), extra=0, now=2.0)  # recent, unlikely back
    kv.set_priority("a", 0.9)
    kv.set_priority("b", 0.1)
    kv.allocate(("c", 0), "m", "t", seq(8, start=2000), 0, now=3.0)
    assert kv.session_kv(victim) == SessionKV(8, 0, 16)
    assert kv.session_kv(kept) == SessionKV(16, 0, 16)
    assert kv.dropped_tokens(victim) == 8
    kv.check_integrity()


def test_eviction_is_tail_first_so_what_stays_is_a_prefix() -> None:
    kv = make(device=8, host=8)
    history_a, _ = run_call(kv, "a", 0, seq(24), extra=0, now=1.0)
    for n_needed, on_device in [(3, 20), (5, 12)]:
        kv.allocate(("x", n_needed), "m", "t", seq(4 * n_needed, start=1000), 0, now=2.0)
        kv.abort(("x", n_needed))
        kv.end_session("x")
        kv.check_integrity()
        assert cached(kv, "m", "t", history_a) == PrefixMatch(24, on_device, 24 - on_device, 4)


# ---------------------------------------------------------------------------- sessions


def test_pin_protects_blocks_and_refusal_changes_nothing() -> None:
    kv = make(device=8, host=8)
    history_a, _ = run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    assert kv.pin("a") == 4
    assert kv.is_pinned("a") and kv.pin("a") == 0
    assert kv.device_evictable == 0 and kv.device_available == 4
    big = seq(24, start=1000)
    assert not kv.can_allocate("m", "t", big, 0)
    before = snapshot(kv)
    with pytest.raises(OutOfBlocks):
        kv.allocate(("b", 0), "m", "t", big, 0, now=2.0)
    assert snapshot(kv) == before
    assert "b" not in kv.sessions
    kv.check_integrity()
    # A reservation reclaimed: unpin and offload; nothing is lost.
    kv.unpin("a")
    assert not kv.is_pinned("a")
    result = kv.offload("a", now=3.0)
    assert result.demoted.moves == ((3, 0), (2, 1), (1, 2), (0, 3))
    assert result.dropped_blocks == 0
    assert kv.session_kv("a") == SessionKV(0, 16, 16)
    kv.allocate(("b", 0), "m", "t", big, 0, now=4.0)
    kv.finish(("b", 0), big, now=4.0)
    a1 = history_a.extend([1, 2])
    alloc = kv.allocate(("a", 1), "m", "t", a1, 2, now=5.0)
    assert alloc.reused_tokens + alloc.restored_tokens == 16
    assert (alloc.reused_tokens, alloc.restored_tokens, alloc.computed_tokens) == (0, 16, 2)
    assert kv.dropped_tokens("a") == 0
    kv.check_integrity()


def test_pinned_blocks_stay_through_pressure_until_unpinned() -> None:
    kv = make(device=8, host=0)
    run_call(kv, "a", 0, seq(8), extra=0, now=1.0)
    run_call(kv, "b", 0, seq(8, start=1000), extra=0, now=2.0)
    kv.set_priority("a", 0.0)  # A is the cheapest, but pinned
    kv.pin("a")
    kv.allocate(("c", 0), "m", "t", seq(24, start=2000), 0, now=3.0)
    assert kv.session_kv("a") == SessionKV(8, 0, 8)
    assert kv.session_kv("b") == SessionKV(0, 0, 8) and kv.dropped_tokens("b") == 8
    kv.finish(("c", 0), seq(24, start=2000), now=3.0)
    kv.end_session("a")  # ending a session releases its pin
    assert not kv.is_pinned("a") and kv.device_evictable == 8
    kv.check_integrity()


def test_restore_prefetches_the_host_run() -> None:
    kv = make(device=8, host=8)
    history_a, _ = run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    kv.offload("a", now=2.0)
    assert kv.restore_blocks_needed("a") == 4 and kv.can_restore("a")
    plan, evicted = kv.restore("a", now=3.0)
    assert plan.link is Link.HOST_TO_DEVICE and plan.nbytes == 4 * BLOCK_BYTES
    assert plan.moves == ((3, 0), (2, 1), (1, 2), (0, 3))
    assert len(evicted.demoted) == 0
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    assert kv.restore_blocks_needed("a") == 0
    assert cached(kv, "m", "t", history_a).device_tokens == 16
    assert kv.device_evictable == 4 and kv.host_free == 8
    kv.check_integrity()


def test_restore_never_evicts_the_sessions_own_device_run() -> None:
    kv = make(device=8, host=8)
    run_call(kv, "a", 0, seq(24), extra=0, now=1.0)
    b0 = seq(16, start=1000)
    kv.allocate(("b", 0), "m", "t", b0, 8, now=2.0)  # 6 blocks: A keeps 2 on device
    kv.finish(("b", 0), b0, now=2.0)  # B keeps 4, frees 2
    kv.pin("b")
    assert kv.session_kv("a") == SessionKV(8, 16, 24)
    # Only A's own device run could make room for A's host run: refuse.
    assert kv.device_available == 4 and kv.restore_blocks_needed("a") == 4
    assert not kv.can_restore("a")
    before = snapshot(kv)
    with pytest.raises(OutOfBlocks):
        kv.restore("a", now=3.0)
    assert snapshot(kv) == before
    kv.unpin("b")
    assert kv.can_restore("a")
    plan, evicted = kv.restore("a", now=4.0)
    assert len(plan) == 4 and len(evicted.demoted) == 2
    assert kv.session_kv("a") == SessionKV(24, 0, 24)
    kv.check_integrity()


def test_abort_frees_uncomputed_blocks_and_keeps_the_table() -> None:
    kv = make(device=8, host=0)
    history_a, _ = run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    a1 = history_a.extend(range(100, 108))
    alloc = kv.allocate(("a", 1), "m", "t", a1, 4, now=2.0)
    assert alloc.reused_tokens == 16 and kv.device_free == 1
    kv.abort(("a", 1))
    assert kv.device_free == 4 and kv.device_evictable == 4
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    assert kv.match("m", "t", a1).device_tokens == 16
    assert not kv.sessions["a"].running
    kv.check_integrity()
    # A computed prompt survives an abort as orphan blocks: matchable, evicted first.
    kv.allocate(("a", 2), "m", "t", a1, 0, now=3.0)
    kv.mark_computed(("a", 2))
    kv.abort(("a", 2))
    assert cached(kv, "m", "t", a1).device_tokens == 24
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    alloc = kv.allocate(("z", 0), "m", "t", seq(8, start=5000), 0, now=4.0)
    assert alloc.evicted.dropped_blocks == 0  # two blocks were still free
    kv.finish(("z", 0), seq(8, start=5000), now=4.0)
    kv.allocate(("y", 0), "m", "t", seq(8, start=6000), 0, now=5.0)
    assert kv.session_kv("a") == SessionKV(16, 0, 16)  # the orphans went, not A's table
    kv.check_integrity()


def test_end_session_orphans_blocks_which_are_evicted_first() -> None:
    kv = make(device=8, host=0)
    run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    history_b, _ = run_call(kv, "b", 0, seq(16, start=1000), extra=0, now=2.0)
    kv.set_priority("a", 0.0)
    kv.set_priority("b", 1.0)
    assert kv.end_session("b") and "b" not in kv.sessions
    assert kv.end_session("b")  # unknown: nothing to do
    kv.allocate(("c", 0), "m", "t", seq(8, start=2000), 0, now=3.0)
    assert kv.session_kv("a") == SessionKV(16, 0, 16)
    # Orphans go tail-first too: the shareable prefix of B survives longest.
    assert kv.match("m", "t", history_b).device_tokens == 8
    assert kv.dropped_tokens("a") == 0 and kv.counters.dropped_blocks == 2
    kv.check_integrity()


def test_end_session_refuses_while_running() -> None:
    kv = make()
    kv.allocate(("a", 0), "m", "t", seq(8), 0, now=1.0)
    before = snapshot(kv)
    assert kv.end_session("a") is False
    assert snapshot(kv) == before
    kv.check_integrity()


def test_concurrent_identical_prompts_shadow_and_abort_cleanly() -> None:
    kv = make(device=16, host=0)
    prompt = seq(12)
    kv.allocate(("a", 0), "m", "t", prompt, 0, now=1.0)
    alloc_b = kv.allocate(("b", 0), "m", "t", prompt, 0, now=1.0)  # A has not computed yet
    assert alloc_b.reused_tokens == 0 and alloc_b.computed_tokens == 12
    assert alloc_b.device_blocks == (3, 4, 5)  # private copies
    kv.finish(("b", 0), prompt, now=2.0)
    # B's copies were private: its table holds only computed blocks (none yet).
    assert kv.session_kv("b") == SessionKV(0, 0, 0)
    kv.abort(("a", 0))
    assert kv.device_free == 16 and kv.match("m", "t", prompt).device_tokens == 0
    kv.check_integrity()


def test_lent_blocks_are_neither_free_nor_evictable_until_returned() -> None:
    kv = make(device=8, host=0)
    run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    assert kv.lend(3) == (4, 5, 6)
    assert (kv.lent_blocks, kv.device_free, kv.device_evictable) == (3, 1, 4)
    assert not kv.can_allocate("m", "t", seq(24, start=1000), 0)
    assert kv.can_allocate("m", "t", seq(20, start=1000), 0)
    before = snapshot(kv)
    with pytest.raises(OutOfBlocks):
        kv.lend(2)
    with pytest.raises(OutOfBlocks):
        kv.allocate(("b", 0), "m", "t", seq(24, start=1000), 0, now=2.0)
    assert snapshot(kv) == before
    kv.check_integrity()
    alloc = kv.allocate(("b", 0), "m", "t", seq(20, start=1000), 0, now=2.0)
    assert 4 not in alloc.device_blocks and kv.dropped_tokens("a") == 16
    assert kv.return_lent() == 3
    assert (kv.lent_blocks, kv.device_free) == (0, 3)
    kv.check_integrity()


def test_vacate_demotes_every_device_block_and_refuses_while_one_is_held() -> None:
    kv = make(device=8, host=6)
    history_a, _ = run_call(kv, "a", 0, seq(16), extra=0, now=1.0)  # device 0-3
    kv.allocate(("b", 0), "m", "t", seq(8, start=1000), 0, now=2.0)  # device 4, 5: running
    kv.lend(1)
    assert not kv.can_vacate()
    before = snapshot(kv)
    with pytest.raises(KVHeld):
        kv.vacate()
    assert snapshot(kv) == before
    kv.finish(("b", 0), seq(8, start=1000), now=2.0)
    assert not kv.can_vacate()  # the loan still holds block 6
    assert kv.return_lent() == 1
    kv.pin("a")
    assert not kv.can_vacate()  # a pin holds a's blocks
    kv.unpin("a")
    assert kv.can_vacate()
    # six host blocks for six device blocks, nothing dropped: in eviction order, the least
    # recent session (a) first, each tail first
    result = kv.vacate()
    assert result.demoted.link is Link.DEVICE_TO_HOST
    assert result.demoted.moves == ((3, 0), (2, 1), (1, 2), (0, 3), (5, 4), (4, 5))
    assert result.dropped_blocks == 0
    assert (kv.device_free, kv.device_evictable, kv.host_free) == (8, 0, 0)
    assert kv.session_kv("a") == SessionKV(0, 16, 16)
    assert cached(kv, "m", "t", history_a) == PrefixMatch(16, 0, 16, 4)
    assert kv.vacate().demoted.moves == ()  # an empty device: nothing to do
    kv.check_integrity()


def test_vacate_drops_what_host_cannot_hold_and_charges_the_sessions() -> None:
    kv = make(device=8, host=2)
    run_call(kv, "a", 0, seq(16), extra=0, now=1.0)
    result = kv.vacate()
    assert (len(result.demoted.moves), result.dropped_blocks) == (2, 2)
    assert kv.session_kv("a") == SessionKV(0, 8, 16)  # the prefix stays, the tail is gone
    assert kv.dropped_tokens("a") == 8
    kv.check_integrity()


def test_set_priority_of_unknown_session_is_ignored() -> None:
    kv = make()
    before = snapshot(kv)
    kv.set_priority("nobody", 1.0)
    assert snapshot(kv) == before


def test_a_nan_priority_is_the_lowest_value_and_eviction_stays_ordered() -> None:
    """A policy that computed NaN (0/0, inf - inf) must not make eviction order undefined:
    the NaN session is evicted first, as if its value were 0."""
    kv = make(device=4, host=8)
    for i, name in enumerate(("nan", "likely")):
        run_call(kv, name, 0, seq(7, 100 * i), 1, now=float(i))
    kv.set_priority("nan", float("nan"))
    kv.set_priority("likely", 0.9)
    run_call(kv, "new", 0, seq(7, 500), 1, now=5.0)  # needs 2 blocks: evicts "nan" first
    assert kv.match("m", "t", seq(7, 0)).device_tokens == 0  # demoted to host
    assert kv.match("m", "t", seq(7, 0)).host_tokens == 4
    assert kv.match("m", "t", seq(7, 100)).device_tokens == 4  # its full block stayed
    kv.check_integrity()


# ---------------------------------------------------------------------------- bad input


def _busy_manager() -> tuple[KVManager, TokenSeq]:
    kv = make(device=8, host=4)
    history_a, _ = run_call(kv, "a", 0, seq(12), extra=4, now=1.0)
    kv.allocate(("b", 0), "m", "t", seq(8, start=1000), 4, now=2.0)
    return kv, history_a


BAD_CALLS: list[tuple[str, Any, type[Exception]]] = [
    ("finish unknown call", lambda kv, h: kv.finish(("zz", 0), h, 3.0), BadRequest),
    ("abort unknown call", lambda kv, h: kv.abort(("a", 7)), BadRequest),
    ("mark unknown call", lambda kv, h: kv.mark_computed(("zz", 0)), BadRequest),
    (
        "duplicate call key",
        lambda kv, h: kv.allocate(("b", 0), "m", "t", seq(8, start=1000), 4, 3.0),
        BadRequest,
    ),
    (
        "second concurrent call",
        lambda kv, h: kv.allocate(("b", 1), "m", "t", seq(8, start=1000), 4, 3.0),
        BadRequest,
    ),
    (
        "negative extra tokens",
        lambda kv, h: kv.allocate(("a", 1), "m", "t", h.extend([1]), -1, 3.0),
        BadRequest,
    ),
    ("unknown model", lambda kv, h: kv.allocate(("c", 0), "x", "t", h, 0, 3.0), BadRequest),
    ("unknown model match", lambda kv, h: kv.match("x", "t", h), BadRequest),
    ("unknown model check", lambda kv, h: kv.can_allocate("x", "t", h, 0), BadRequest),
    (
        "session of another model",
        lambda kv, h: kv.allocate(("a", 1), "w", "t", h, 0, 3.0),
        BadRequest,
    ),
    (
        "session of another tenant",
        lambda kv, h: kv.allocate(("a", 1), "m", "u", h, 0, 3.0),
        BadRequest,
    ),
    (
        "history not extending the prompt",
        lambda kv, h: kv.finish(("b", 0), seq(12, start=7000), 3.0),
        BadRequest,
    ),
    ("history shorter than the prompt", lambda kv, h: kv.finish(("b", 0), seq(4), 3.0), BadRequest),
    ("pin unknown session", lambda kv, h: kv.pin("zz"), BadRequest),
    ("unpin unknown session", lambda kv, h: kv.unpin("zz"), BadRequest),
    ("offload unknown session", lambda kv, h: kv.offload("zz", 3.0), BadRequest),
    ("restore unknown session", lambda kv, h: kv.restore("zz", 3.0), BadRequest),
    ("can_restore unknown session", lambda kv, h: kv.can_restore("zz"), BadRequest),
    (
        "allocate past the pool",
        lambda kv, h: kv.allocate(("c", 0), "m", "t", seq(40, start=9000), 0, 3.0),
        OutOfBlocks,
    ),
]


@pytest.mark.parametrize(
    ("call", "error"), [(c, e) for _, c, e in BAD_CALLS], ids=[n for n, _, _ in BAD_CALLS]
)
def test_bad_input_raises_typed_error_and_changes_nothing(
    call: Any, error: type[Exception]
) -> None:
    kv, history_a = _busy_manager()
    before = snapshot(kv)
    with pytest.raises(error):
        call(kv, history_a)
    assert snapshot(kv) == before
    kv.check_integrity()


# ---------------------------------------------------------------------------- state machine

SESSIONS = {  # session -> (tenant, model); s0 and s1 share a tenant, model and system prompt
    "s0": ("t1", "m"),
    "s1": ("t1", "m"),
    "s2": ("t2", "m"),
    "s3": ("t1", "w"),
}
SYSTEM = TokenSeq([9, 9, 9, 9, 8, 8])
session_names = st.sampled_from(sorted(SESSIONS))
# A tiny alphabet: sessions often send identical blocks (sharing, shadows, recreated hashes).
new_tokens = st.lists(st.integers(0, 2), min_size=0, max_size=12)


def _live(kv: KVManager) -> dict[int, bool]:
    """Live hashed blocks -> computed."""
    return {h: b.computed for h, b in kv._blocks.items()}


class KVMachine(RuleBasedStateMachine):
    """Random operations over four sessions, two tenants and two block sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = make(device=12, host=6)
        self.history: dict[str, TokenSeq] = {}  # last finished history per known session
        self.running: dict[str, tuple[tuple[str, int], TokenSeq]] = {}
        self.index: dict[str, int] = dict.fromkeys(SESSIONS, 0)
        self.now = 0.0
        self.prev_live: dict[int, bool] = {}
        self.prev_tables: dict[str, tuple[int, ...]] = {}
        self.prev_dropped: dict[str, int] = {}
        self.prev_counter = 0
        self.prev_pins: dict[str, tuple[tuple[int, ...], int]] = {}

    @initialize(eviction=st.sampled_from(Eviction), host=st.sampled_from([0, 3, 6]))
    def setup(self, eviction: Eviction, host: int) -> None:
        self.kv = make(device=12, host=host, eviction=eviction)
        self._remember()

    # ---- helpers
    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def _prompt(self, s: str, tokens: list[int]) -> TokenSeq:
        return self.history.get(s, SYSTEM).extend(tokens)

    def _remember(self) -> None:
        kv = self.kv
        self.prev_live = _live(kv)
        self.prev_tables = {s: x.table for s, x in kv.sessions.items()}
        self.prev_dropped = {s: kv.dropped_tokens(s) for s in kv.sessions}
        self.prev_counter = kv.counters.dropped_blocks
        self.prev_pins = {
            s: (x.pinned, self._pinned_on_device(s)) for s, x in kv.sessions.items() if x.pinned
        }

    def _pinned_on_device(self, s: str) -> int:
        return sum(self.kv._blocks[h].on_device for h in self.kv.sessions[s].pinned)

    # ---- calls
    @rule(s=session_names, tokens=new_tokens, extra=st.integers(0, 9))
    def allocate(self, s: str, tokens: list[int], extra: int) -> None:
        kv = self.kv
        tenant, model = SESSIONS[s]
        if s in self.running:
            before = snapshot(kv)
            with pytest.raises(BadRequest):
                kv.allocate((s, self.index[s]), model, tenant, self._prompt(s, tokens), 0, 0.0)
            assert snapshot(kv) == before
            return
        prompt = self._prompt(s, tokens)
        key = (s, self.index[s])
        match = kv.match(model, tenant, prompt)
        # the router's one-lookup test agrees with the match: some KV, or none at all
        assert kv.holds_prefix(model, tenant, prompt) == (match.gone_tokens < len(prompt))
        own = kv.session_kv(s)
        if not kv.can_allocate(model, tenant, prompt, extra):
            before = snapshot(kv)
            with pytest.raises(OutOfBlocks):
                kv.allocate(key, model, tenant, prompt, extra, self._tick())
            assert snapshot(kv) == before
            return
        tpb = TPB[model]
        n_blocks = -(-(len(prompt) + extra) // tpb)
        assert kv.blocks_needed(model, tenant, prompt, extra) == n_blocks - match.device_blocks
        alloc = kv.allocate(key, model, tenant, prompt, extra, self._tick())
        self.index[s] += 1
        self.running[s] = (key, prompt)
        assert alloc.reused_tokens == match.device_tokens
        assert alloc.restored_tokens == match.host_tokens == len(alloc.restore) * tpb
        assert alloc.computed_tokens == match.gone_tokens
        # The session's own KV is reused up to the block holding the prompt's last token: a
        # call always computes that token (for its logits) in a block of its own, so a prompt
        # that adds nothing to the history recomputes its last block (vLLM's rule too: its
        # prefix-cache hit is capped at the prompt's length minus one, in whole blocks).
        reusable = max(0, len(prompt) - 1) // tpb * tpb
        own_reusable = min(own.device_tokens + own.host_tokens, reusable)
        assert alloc.reused_tokens + alloc.restored_tokens >= own_reusable
        assert len(alloc.device_blocks) == n_blocks == len(set(alloc.device_blocks))
        assert all(0 <= b < kv.device_blocks for b in alloc.device_blocks)
        restored_to = [dst for _, dst in alloc.restore.moves]
        assert restored_to == list(
            alloc.device_blocks[match.device_blocks : match.device_blocks + match.host_blocks]
        )
        assert alloc.restore.nbytes == len(alloc.restore) * BLOCK_BYTES
        assert alloc.evicted.demoted.nbytes == len(alloc.evicted.demoted) * BLOCK_BYTES

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.running)))
        self.kv.mark_computed(self.running[s][0])

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), n_out=st.integers(0, 12))
    def finish(self, data: st.DataObject, n_out: int) -> None:
        s = data.draw(st.sampled_from(sorted(self.running)))
        key, prompt = self.running.pop(s)
        history = prompt.extend(
            data.draw(st.lists(st.integers(0, 2), min_size=n_out, max_size=n_out))
        )
        self.kv.finish(key, history, self._tick())
        self.history[s] = history
        tenant, model = SESSIONS[s]
        table = self.kv.sessions[s].table
        assert table == self.kv.hashes(model, tenant, history)[: len(table)]
        assert self.kv.session_kv(s).table_tokens == len(table) * TPB[model] <= len(history)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.running)))
        key, _ = self.running.pop(s)
        table = self.kv.sessions[s].table
        self.kv.abort(key)
        assert self.kv.sessions[s].table == table

    # ---- sessions
    def _known(self) -> list[str]:
        return sorted(self.kv.sessions)

    @precondition(lambda self: bool(self.kv.sessions))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._known()))
        was = self.kv.is_pinned(s)
        n = self.kv.pin(s)
        if was:
            assert n == 0
        else:
            assert n == self._pinned_on_device(s)

    @precondition(lambda self: bool(self.kv.sessions))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._known()))
        self.kv.unpin(s)
        assert not self.kv.is_pinned(s)

    @rule(s=session_names, value=st.floats(0, 1))
    def set_priority(self, s: str, value: float) -> None:
        self.kv.set_priority(s, value)

    @precondition(lambda self: bool(self.kv.sessions))
    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._known()))
        kv = self.kv
        before = kv.session_kv(s)
        result = kv.offload(s, self._tick())
        assert kv.session_kv(s).device_tokens <= before.device_tokens
        assert result.demoted.link is Link.DEVICE_TO_HOST
        # What stays on device is held: by a running call or a pin (this session's or not).
        for h in kv.sessions[s].table:
            b = kv._blocks.get(h)
            assert b is None or not b.on_device or b.ref or b.pin

    @precondition(lambda self: bool(self.kv.sessions))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self._known()))
        kv = self.kv
        before_kv = kv.session_kv(s)
        need = kv.restore_blocks_needed(s)
        if not kv.can_restore(s):
            before = snapshot(kv)
            with pytest.raises(OutOfBlocks):
                kv.restore(s, self._tick())
            assert snapshot(kv) == before
            return
        plan, _evicted = kv.restore(s, self._tick())
        assert len(plan) == need
        after = kv.session_kv(s)
        assert after.device_tokens >= before_kv.device_tokens + before_kv.host_tokens

    @rule(data=st.data())
    def lend(self, data: st.DataObject) -> None:
        free = self.kv.device_free
        n = data.draw(st.integers(0, free + 1))
        if n > free:
            before = snapshot(self.kv)
            with pytest.raises(OutOfBlocks):
                self.kv.lend(n)
            assert snapshot(self.kv) == before
            return
        lent = self.kv.lent_blocks
        assert len(self.kv.lend(n)) == n
        assert self.kv.lent_blocks == lent + n and self.kv.device_free == free - n

    @rule()
    def return_lent(self) -> None:
        lent, free = self.kv.lent_blocks, self.kv.device_free
        assert self.kv.return_lent() == lent
        assert self.kv.device_free == free + lent and self.kv.lent_blocks == 0

    @rule()
    def vacate(self) -> None:
        kv = self.kv
        if not kv.can_vacate():
            before = snapshot(kv)
            with pytest.raises(KVHeld):
                kv.vacate()
            assert snapshot(kv) == before
            return
        evictable, host_free = kv.device_evictable, kv.host_free
        result = kv.vacate()
        assert kv.device_free == kv.device_blocks and kv.device_evictable == 0
        assert len(result.demoted.moves) + result.dropped_blocks >= evictable
        assert len(result.demoted.moves) <= evictable
        if evictable <= host_free:
            assert result.dropped_blocks == 0 and len(result.demoted.moves) == evictable

    @rule(s=session_names)
    def end_session(self, s: str) -> None:
        before = snapshot(self.kv)
        ended = self.kv.end_session(s)
        assert ended == (s not in self.running)
        if ended:
            self.history.pop(s, None)
            assert s not in self.kv.sessions
        else:
            assert snapshot(self.kv) == before

    @rule(
        what=st.sampled_from(
            ["unknown call", "abort unknown", "negative extra", "unknown model", "wrong model"]
        ),
        s=session_names,
    )
    def bad_input(self, what: str, s: str) -> None:
        kv = self.kv
        tenant, model = SESSIONS[s]
        if what == "wrong model" and s not in kv.sessions:
            return  # a new session may use any model
        before = snapshot(kv)
        prompt = self._prompt(s, [1])
        with pytest.raises(BadRequest):
            if what == "unknown call":
                kv.finish(("nobody", 0), prompt, 0.0)
            elif what == "abort unknown":
                kv.abort((s, 10_000))
            elif what == "negative extra":
                kv.allocate((s, 10_000), model, tenant, prompt, -1, 0.0)
            elif what == "unknown model":
                kv.allocate((s, 10_000), "nope", tenant, prompt, 0, 0.0)
            else:
                kv.allocate((s, 10_000), "w" if model == "m" else "m", tenant, prompt, 0, 0.0)
        assert snapshot(kv) == before

    # ---- invariants
    @invariant()
    def integrity(self) -> None:
        kv = self.kv
        kv.check_integrity()
        evictable = [h for h, b in kv._blocks.items() if b.on_device and not b.ref and not b.pin]
        assert kv.device_evictable == len(evictable)
        # Eviction can really find every evictable block.
        assert len(list(kv._victims(on_device=True, limit=10**9))) == len(evictable)
        held = sum(len(c.private) for c in kv._calls.values()) + sum(
            1 for b in kv._blocks.values() if b.on_device and (b.ref or b.pin)
        )
        assert kv.device_free + held + kv.device_evictable + kv.lent_blocks == kv.device_blocks
        assert sorted(self.running) == sorted(s for s, x in kv.sessions.items() if x.running)

    @invariant()
    def matches_stay_within_the_prompt(self) -> None:
        for s, history in self.history.items():
            tenant, model = SESSIONS[s]
            m = self.kv.match(model, tenant, history)
            reusable = max(0, len(history) - 1) // TPB[model] * TPB[model]
            assert 0 <= m.device_tokens + m.host_tokens <= reusable  # never the last block
            assert m.device_tokens % TPB[model] == m.host_tokens % TPB[model] == 0
            whole = cached(self.kv, model, tenant, history)
            assert m.device_tokens == min(whole.device_tokens, reusable)
            skv = self.kv.session_kv(s)
            assert skv.device_tokens + skv.host_tokens <= skv.table_tokens <= len(history)
            assert whole.device_tokens >= skv.device_tokens

    @invariant()
    def tokens_are_conserved(self) -> None:
        """Every table block that was live and computed before the step is still live and
        computed, or its drop was charged to each session listing it and counted once."""
        kv = self.kv
        live = _live(kv)
        lost = {h for h, computed in self.prev_live.items() if computed and not live.get(h)}
        assert kv.counters.dropped_blocks - self.prev_counter == len(lost)
        for s, table in self.prev_tables.items():
            if s not in kv.sessions:
                continue
            _tenant, model = SESSIONS[s]
            charged = kv.dropped_tokens(s) - self.prev_dropped[s]
            assert charged == TPB[model] * sum(h in lost for h in table)
        for s, (pinned, on_device) in self.prev_pins.items():
            if s in kv.sessions and kv.sessions[s].pinned is pinned:
                assert self._pinned_on_device(s) >= on_device
        self._remember()


KVMachine.TestCase.settings = settings(
    max_examples=examples(200),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


def test_a_whole_cached_prompt_recomputes_its_last_block_in_a_private_block() -> None:
    """Calls whose prompt is cached whole (n > 1 choices, a retry) reuse all but the block
    holding the last token, and each computes that block in a block of its own: none writes
    the shared block, so two of them in one batch never write the same KV slot."""
    kv = make(device=16, host=0)
    prompt = seq(8)  # two full blocks
    _, first = run_call(kv, "a", 0, prompt, extra=0, now=1.0, output=0)
    assert cached(kv, "m", "t", prompt).device_tokens == 8
    assert kv.match("m", "t", prompt) == PrefixMatch(8, 4, 0, 4)
    assert kv.blocks_needed("m", "t", prompt, 2) == 2  # the last prompt block + an output one
    b = kv.allocate(("b", 0), "m", "t", prompt, 2, now=2.0)
    c = kv.allocate(("c", 0), "m", "t", prompt, 2, now=2.0)
    for alloc in (b, c):
        assert (alloc.reused_tokens, alloc.restored_tokens, alloc.computed_tokens) == (4, 0, 4)
        assert alloc.device_blocks[0] == first.device_blocks[0]  # the shared first block
    last = {first.device_blocks[1], b.device_blocks[1], c.device_blocks[1]}
    assert len(last) == 3  # three different blocks hold the last four tokens
    kv.check_integrity()
    for key in (("b", 0), ("c", 0)):
        kv.mark_computed(key)
        kv.finish(key, prompt.extend([7, 7]), now=3.0)
    kv.check_integrity()
    assert cached(kv, "m", "t", prompt).device_tokens == 8


def test_a_session_resending_its_history_reuses_all_but_the_last_block() -> None:
    """The sequence hypothesis found: a session sends its whole history again, adding
    nothing, three times. Each call reuses the session's KV up to the block holding its last
    token and recomputes that block privately (as vLLM caps a prefix hit at the prompt's
    length minus one), and the session keeps its whole table after each call."""
    kv = make(device=12, host=0)
    history = TokenSeq([9, 9, 9, 9, 8, 8, 8, 8])  # two full blocks
    expected_reuse = [0, 4, 4]  # nothing cached yet, then all but the last block
    for index, reuse in enumerate(expected_reuse):
        alloc = kv.allocate(("s0", index), "m", "t1", history, 0, now=float(index))
        assert (alloc.reused_tokens, alloc.restored_tokens) == (reuse, 0)
        assert alloc.computed_tokens == 8 - reuse
        kv.finish(("s0", index), history, now=float(index) + 0.5)
        kv.check_integrity()
        assert kv.session_kv("s0") == SessionKV(8, 0, 8)
