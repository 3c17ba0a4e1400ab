"""Tool-time priors per tool kind: the numbers a gap predictor starts from.

``tool_priors.json`` (package data) holds percentiles of the measured tool time of the
3,365 mini-swe-agent steps of the tune part of the bundled traces, per kind, plus ``ALL``
(every kind together); ``benchmarks/tool_priors.py`` writes it. Only ``n``, ``mean`` and
``p50`` are used here. Units: seconds.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

import attrs

from talaria.errors import ConfigError
from talaria.session.kinds import ToolKind

__all__ = ["PRIORS_FILE", "KindPrior", "ToolPriors", "load_tool_priors"]

PRIORS_FILE = "tool_priors.json"


def _positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{attribute.name} must be a positive finite number of seconds, got {value!r}"
        )


@attrs.frozen
class KindPrior:
    """Tool time of one kind: ``n`` steps measured, their ``mean_s`` and median ``p50_s``."""

    n: int
    mean_s: float = attrs.field(validator=_positive_seconds)
    p50_s: float = attrs.field(validator=_positive_seconds)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise ConfigError(f"n must be a non-negative integer, got {self.n!r}")


@attrs.frozen
class ToolPriors:
    """Priors for every :class:`ToolKind` and for all kinds together (``overall``)."""

    kinds: tuple[tuple[ToolKind, KindPrior], ...]
    overall: KindPrior
    source: str = ""

    def __attrs_post_init__(self) -> None:
        have = [k for k, _ in self.kinds]
        missing = [k.value for k in ToolKind if k not in have]
        if missing or len(have) != len(set(have)):
            raise ConfigError(
                f"tool priors need exactly one entry per kind; missing {missing or 'none'}, "
                f"given {[k.value for k in have]}"
            )

    def prior(self, kind: ToolKind) -> KindPrior:
        """The prior of ``kind`` (every kind has one: checked at construction)."""
        for k, p in self.kinds:
            if k is kind:
                return p
        raise AssertionError(f"unreachable: no prior for {kind}")  # pragma: no cover

    def median_s(self, kind: ToolKind) -> float:
        """Median tool time of ``kind`` in seconds."""
        return self.prior(kind).p50_s

    @classmethod
    def from_json(cls, data: object, where: str = "tool priors") -> ToolPriors:
        """Build from the parsed ``tool_time_by_kind.json`` object; :class:`ConfigError`
        names ``where`` and the key at fault."""
        kinds = data.get("kinds") if isinstance(data, dict) else None
        if not isinstance(kinds, dict):
            raise ConfigError(f"{where}: kinds: missing (expected an object of tool kinds)")
        names = [*(k.value for k in ToolKind), "ALL"]
        parsed: dict[str, KindPrior] = {}
        for name in names:
            entry = kinds.get(name)
            if not isinstance(entry, dict) or not {"n", "mean", "p50"} <= entry.keys():
                raise ConfigError(f"{where}: kinds.{name}: expected an object with n, mean, p50")
            try:
                parsed[name] = KindPrior(n=entry["n"], mean_s=entry["mean"], p50_s=entry["p50"])
            except ConfigError as e:
                raise ConfigError(f"{where}: kinds.{name}: {e}") from None
        source = data.get("source", "") if isinstance(data, dict) else ""
        return cls(
            kinds=tuple((k, parsed[k.value]) for k in ToolKind),
            overall=parsed["ALL"],
            source=str(source),
        )


def load_tool_priors() -> ToolPriors:
    """The priors shipped with the package (``talaria/session/tool_priors.json``).

    Reads the package resource on every call (about 1 KB); share the result, or the
    :class:`~talaria.session.gaps.GapPredictor` built from it, rather than calling this per
    session.
    """
    resource = resources.files("talaria.session").joinpath(PRIORS_FILE)
    data = json.loads(resource.read_text(encoding="utf-8"))
    return ToolPriors.from_json(data, where=f"talaria/session/{PRIORS_FILE}")
