"""The shared field checks: exact domains over every float, and the field named in errors."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from talaria import validators as valid
from talaria.errors import ConfigError


@attrs.frozen
class _Knobs:
    rate: float = attrs.field(default=1.0, validator=valid.positive)
    wait: float = attrs.field(default=0.0, validator=valid.non_negative)
    share: float = attrs.field(default=1.0, validator=valid.fraction)
    count: int = attrs.field(default=1, validator=valid.positive_int)
    bound: float = attrs.field(default=1.0, validator=valid.positive_or_infinite)
    timer: float = attrs.field(default=0.0, validator=valid.non_negative_or_infinite)
    cap: float | None = attrs.field(default=None, validator=valid.optional_positive)
    name: str = attrs.field(default="a", validator=valid.name)


def _accepts(**field: object) -> bool:
    try:
        _Knobs(**field)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_each_number_check_accepts_exactly_its_domain(x: float) -> None:
    finite = math.isfinite(x)
    assert _accepts(rate=x) == (finite and x > 0)
    assert _accepts(wait=x) == (finite and x >= 0)
    assert _accepts(share=x) == (finite and 0 < x <= 1)
    assert _accepts(bound=x) == (x == math.inf or (finite and x > 0))
    assert _accepts(timer=x) == (x == math.inf or (finite and x >= 0))
    assert _accepts(cap=x) == (finite and x > 0)


@given(st.integers())
def test_positive_int_accepts_exactly_the_positive_integers(n: int) -> None:
    assert _accepts(count=n) == (n > 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rate", True),
        ("timer", True),
        ("timer", "inf"),
        ("count", True),
        ("count", 2.0),
        ("rate", "1"),
        ("name", " a"),
        ("name", ""),
    ],
)
def test_bools_strings_and_floats_where_an_int_belongs_are_refused(
    field: str, value: object
) -> None:
    assert not _accepts(**{field: value})


def test_the_error_names_the_class_and_field_and_the_value() -> None:
    with pytest.raises(
        ConfigError, match=r"^_Knobs\.rate must be a positive finite number, got -1$"
    ):
        _Knobs(rate=-1)
    assert _accepts(cap=None) and _accepts(bound=math.inf)
