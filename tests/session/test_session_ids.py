"""Session ids: generation, checking, and extraction from framework fields."""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import BadRequest
from talaria.session import (
    MAX_SESSION_ID_LEN,
    check_session_id,
    new_session_id,
    normalize_session_id,
    resolve_session_id,
    session_id_from_instance,
    session_id_from_langchain,
    session_id_from_litellm,
)
from tests.helpers import examples


def test_new_session_id_is_prefixed_uuid4_hex_and_unique() -> None:
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100
    for sid in ids:
        assert re.fullmatch(r"sess-[0-9a-f]{32}", sid)
        assert uuid.UUID(sid.removeprefix("sess-")).version == 4
        assert check_session_id(sid) == sid


@pytest.mark.parametrize(
    "bad",
    ["", " x", "x ", "a b", "é", "a\nb", "a\x00b", "x" * (MAX_SESSION_ID_LEN + 1), 12, None, b"ab"],
)
def test_check_session_id_rejects(bad: object) -> None:
    with pytest.raises(BadRequest):
        check_session_id(bad)


def test_check_session_id_accepts_url_unsafe_but_printable_ascii() -> None:
    assert check_session_id("a/b%c?d#e") == "a/b%c?d#e"
    assert check_session_id("x" * MAX_SESSION_ID_LEN) == "x" * MAX_SESSION_ID_LEN


def test_normalize_session_id() -> None:
    assert normalize_session_id("django__django-11099") == "django__django-11099"
    mapped = normalize_session_id("user 42 chat")
    assert re.fullmatch(r"sess-[0-9a-f]{32}", mapped)
    assert normalize_session_id("user 42 chat") == mapped  # deterministic
    assert normalize_session_id("user 43 chat") != mapped
    assert check_session_id(normalize_session_id("x" * 1000))
    assert check_session_id(normalize_session_id(""))
    assert check_session_id(normalize_session_id("\ud800"))  # lone surrogate


def test_extracted_ids_are_normalized() -> None:
    assert session_id_from_langchain({"thread_id": "chat with bob"}) == normalize_session_id(
        "chat with bob"
    )
    assert session_id_from_instance("é") == normalize_session_id("é")


# --------------------------------------------------------------------------- LiteLLM


def test_litellm_session_id_first() -> None:
    kwargs = {"litellm_session_id": "s1", "metadata": {"session_id": "s2"}}
    assert session_id_from_litellm(kwargs) == "s1"


def test_litellm_metadata_session_id() -> None:
    assert session_id_from_litellm({"metadata": {"session_id": " s2 "}}) == "s2"


def test_litellm_callback_kwargs_under_litellm_params() -> None:
    kwargs = {"model": "m", "litellm_params": {"litellm_session_id": "s3", "metadata": {}}}
    assert session_id_from_litellm(kwargs) == "s3"
    nested = {"litellm_params": {"metadata": {"session_id": "s4"}}}
    assert session_id_from_litellm(nested) == "s4"
    # litellm_session_id anywhere beats metadata anywhere
    mixed = {"metadata": {"session_id": "meta"}, "litellm_params": {"litellm_session_id": "d"}}
    assert session_id_from_litellm(mixed) == "d"


@pytest.mark.parametrize(
    "kwargs",
    [
        None,
        {},
        {"litellm_session_id": None},
        {"litellm_session_id": ""},
        {"litellm_session_id": "   "},
        {"metadata": None},
        {"metadata": "session_id"},
        {"metadata": {"session_id": {"nested": 1}}},
        {"metadata": {"session_id": True}},
    ],
)
def test_litellm_absent_is_none(kwargs: dict[str, object] | None) -> None:
    assert session_id_from_litellm(kwargs) is None


def test_litellm_falls_through_blank_to_metadata() -> None:
    assert session_id_from_litellm({"litellm_session_id": "", "metadata": {"session_id": 7}}) == "7"


# --------------------------------------------------------------------------- LangChain


def test_langchain_session_id_beats_thread_id() -> None:
    assert session_id_from_langchain({"thread_id": "t", "session_id": "s"}) == "s"
    assert session_id_from_langchain({"thread_id": "t", "configurable": {"session_id": "c"}}) == "c"


def test_langchain_thread_id_and_configurable() -> None:
    assert session_id_from_langchain({"thread_id": "t1"}) == "t1"
    assert session_id_from_langchain({"configurable": {"thread_id": "t2"}}) == "t2"
    tid = uuid.UUID(int=5)
    config = {"metadata": {"user": "u"}, "configurable": {"thread_id": tid}}
    assert session_id_from_langchain(config) == str(tid)
    assert session_id_from_langchain({"metadata": {"session_id": "m"}}) == "m"


@pytest.mark.parametrize(
    "metadata",
    [None, {}, {"configurable": None}, {"configurable": {"checkpoint_ns": "x"}}, {"thread_id": ""}],
)
def test_langchain_absent_is_none(metadata: dict[str, object] | None) -> None:
    assert session_id_from_langchain(metadata) is None


# --------------------------------------------------------------------------- instance ids


def test_instance_id() -> None:
    assert session_id_from_instance("django__django-11099") == "django__django-11099"
    assert session_id_from_instance("  ") is None
    assert session_id_from_instance(None) is None
    assert session_id_from_instance(42) == "42"
    assert session_id_from_instance(3.5) is None


def test_resolve_session_id() -> None:
    assert resolve_session_id(None, "b", "c") == "b"
    assert resolve_session_id(None, None).startswith("sess-")
    assert resolve_session_id().startswith("sess-")
    with pytest.raises(BadRequest):
        resolve_session_id("x" * (MAX_SESSION_ID_LEN + 1))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=20), inner),
    max_leaves=10,
)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "litellm_session_id",
                "metadata",
                "litellm_params",
                "session_id",
                "thread_id",
                "configurable",
                "other",
            ]
        ),
        json_values,
    )
)
def test_extractors_never_raise_and_return_usable_ids(kwargs: dict[str, object]) -> None:
    for extract in (session_id_from_litellm, session_id_from_langchain):
        found = extract(kwargs)
        assert found is None or check_session_id(found) == found
