"""Checks of configured numbers and names, each raising ``ConfigError`` with the field's name.

Two forms of the same checks: ``require_*(name, value)`` for code that validates by hand, and
attrs validators (``positive``, ``positive_int``, ...) for ``attrs.field(validator=...)``, which
name the field as ``Class.field``. A number here is an int or a float, never a bool; every
bound excludes NaN, and "finite" excludes the infinities too.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import attrs

from talaria.errors import ConfigError

__all__ = [
    "fraction",
    "is_number",
    "name",
    "non_negative",
    "non_negative_or_infinite",
    "optional_positive",
    "optional_positive_int",
    "positive",
    "positive_int",
    "positive_or_infinite",
    "require_fraction",
    "require_non_negative",
    "require_positive",
    "require_positive_int",
]


def is_number(value: object) -> TypeGuard[float]:
    """A finite int or float (bools are not numbers here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def require_positive(name: str, value: object) -> None:
    """ConfigError unless ``value`` is a positive finite number."""
    if not is_number(value) or not value > 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


def require_non_negative(name: str, value: object) -> None:
    """ConfigError unless ``value`` is zero or a positive finite number."""
    if not is_number(value) or not value >= 0:
        raise ConfigError(f"{name} must be zero or a positive finite number, got {value!r}")


def require_positive_int(name: str, value: object) -> None:
    """ConfigError unless ``value`` is a positive integer (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def require_fraction(name: str, value: object) -> None:
    """ConfigError unless ``value`` is in (0, 1]."""
    if not is_number(value) or not 0 < value <= 1:
        raise ConfigError(f"{name} must be in (0, 1], got {value!r}")


def _field(inst: object, attr: attrs.Attribute[Any]) -> str:
    return f"{type(inst).__name__}.{attr.name}"


def positive(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    require_positive(_field(inst, attr), value)


def positive_or_infinite(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    """A positive number, where infinity means "no bound" (NaN rejected)."""
    if value != math.inf:
        positive(inst, attr, value)


def non_negative_or_infinite(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    """Zero or a positive number, where infinity means "never" (NaN rejected)."""
    if value != math.inf and not (is_number(value) and value >= 0):
        raise ConfigError(
            f"{_field(inst, attr)} must be zero, a positive number or inf, got {value!r}"
        )


def non_negative(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    require_non_negative(_field(inst, attr), value)


def positive_int(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    require_positive_int(_field(inst, attr), value)


def fraction(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    require_fraction(_field(inst, attr), value)


def optional_positive(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive(inst, attr, value)


def optional_positive_int(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive_int(inst, attr, value)


def name(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    """A non-empty string without surrounding spaces."""
    if not isinstance(value, str) or not value or value != value.strip():
        raise ConfigError(
            f"{_field(inst, attr)} must be a non-empty string without surrounding spaces"
        )
