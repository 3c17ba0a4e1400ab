"""The call table keeps its totals in step with its tables under any sequence of moves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.core.calls import CallTable
from talaria.schedule import Request
from talaria.types import Call, TokenSeq
from tests.helpers import examples

MODELS = ("A", "B")


def request(i: int, model: str, prompt: int, out: int) -> Request:
    return Request(Call(f"s{i}", 0, model, TokenSeq(tuple(range(prompt))), out), None, out, 0.0)


def test_totals_follow_each_move_exactly() -> None:
    t = CallTable(MODELS)
    a, b = request(1, "A", 10, 3), request(2, "B", 7, 2)
    t.enqueue(a)
    t.enqueue(b)
    assert (t.queued_tokens("A"), t.queued_tokens("B"), t.load_tokens) == (10, 7, 22)
    assert t.pop_waiting("A") is a and t.queued_tokens("A") == 0 and t.load_tokens == 22
    t.start(a)
    assert t.running_of("A") == 1 and t.any_waiting() and not t.any_waiting(but="B")
    t.finish(a)
    assert t.running_of("A") == 0 and t.load_tokens == 9 and list(t.finished) == [a]
    assert t.remove(b.key) == (b, False) and t.load_tokens == 0 and t.remove(b.key) is None
    assert t.changes == 6 and t.problems() == []


def test_a_new_queue_order_must_hold_the_same_calls() -> None:
    t = CallTable(MODELS)
    a, b = request(1, "A", 10, 3), request(2, "A", 5, 3)
    t.enqueue(a)
    t.enqueue(b)
    with pytest.raises(ValueError, match="same calls"):
        t.replace_queue("A", [a, a])
    t.replace_queue("A", [b, a])
    assert list(t.waiting["A"]) == [b, a] and t.problems() == []


def test_problems_name_each_total_that_disagrees() -> None:
    t = CallTable(MODELS)
    t.enqueue(request(1, "A", 10, 3))
    t._queued_tokens["A"] = 11
    t._load_tokens = 0
    assert t.problems() == ["A: 11 queued tokens counted, 10", "load 0 tokens counted, 13 held"]


_ops = st.lists(
    st.tuples(
        st.sampled_from(["enqueue", "admit", "finish", "remove", "reorder"]),
        st.sampled_from(MODELS),
        st.integers(1, 50),
        st.integers(1, 9),
    ),
    max_size=60,
)


@settings(max_examples=examples(200), deadline=None)
@given(ops=_ops)
def test_any_sequence_of_moves_keeps_every_total(ops: list[tuple[str, str, int, int]]) -> None:
    t = CallTable(MODELS, recent=4)
    before = t.changes
    for i, (op, model, prompt, out) in enumerate(ops):
        if op == "enqueue":
            t.enqueue(request(i, model, prompt, out))
        elif op == "admit" and t.waiting[model]:
            t.start(t.pop_waiting(model))
        elif op == "finish" and t.running:
            t.finish(next(iter(t.running.values())))
        elif op == "remove" and (held := list(t.held())):
            t.remove(held[prompt % len(held)].key)
        elif op == "reorder":
            order = list(t.waiting[model])
            t.reorder(model, lambda r: -r.prompt_len)
            if list(t.waiting[model]) == order:  # the same table: the same memo key
                assert t.changes == before
                continue
        else:
            continue
        assert t.changes > before  # every move is seen by the memos keyed on it
        before = t.changes
        assert t.problems() == []
        assert len(t.finished) <= 4


def test_the_tenants_waiting_per_model_follow_the_queue() -> None:
    t = CallTable(MODELS)
    a = Request(Call("a1", 0, "A", TokenSeq((1, 2)), 2, tenant="x"), None, 2, 0.0)
    b = Request(Call("b1", 0, "A", TokenSeq((3, 4)), 2, tenant="y"), None, 2, 0.0)
    c = Request(Call("c1", 0, "A", TokenSeq((5, 6)), 2, tenant="x"), None, 2, 0.0)
    for r in (a, b, c):
        t.enqueue(r)
    assert (t.tenants_waiting("A"), t.tenants_waiting("B")) == (2, 0)
    t.start(t.pop_waiting("A"))  # a: x still has c waiting
    assert t.tenants_waiting("A") == 2
    assert t.remove(b.key) == (b, False)
    assert t.tenants_waiting("A") == 1 and t.problems() == []
    t._waiting_tenants["A"]["z"] = 1
    assert t.problems() == ["A: waiting tenants {'x': 1, 'z': 1} counted, {'x': 1} queued"]
