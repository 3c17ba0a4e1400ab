"""Agent-session traces (schema ``talaria-trace/1``): load, validate, locate, fill tool times.

A trace file holds one JSON object per line, one agent session each (see
``swebench_replay/data/README.md``). :func:`load_trace` validates every field and raises
:class:`~talaria.errors.TraceError` naming the file, the 1-based line and the field path at
fault, e.g. ``traces.jsonl:12: calls[3].output_tokens: expected a non-negative integer, got
"x"``. Units: token counts in tokens, times in seconds.

``tool_seconds`` of a call is the tool run *after* that call returned, before the next call;
the last call of a session has no next call, so its ``tool_seconds`` is ignored by the replay.
A slightly negative duration (down to ``-CLOCK_SKEW_TOLERANCE_S``; five such tool times occur
in the published traces, from timestamps taken on different clocks) is loaded as ``None``,
i.e. not measured, and :func:`fill_missing_tool_times` draws it like any missing one.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from talaria.errors import TraceError

SCHEMA = "talaria-trace/1"
TRACES_ENV = "TALARIA_TRACES"
# The real traces that ship with the package (data/README.md says where they come from).
BUNDLED_TRACES = Path(__file__).resolve().parent / "data"
# Durations down to this many seconds below zero are clock skew, read as "not measured".
CLOCK_SKEW_TOLERANCE_S = 10.0


class ToolKind(enum.Enum):
    """What ran in the tool gap after a call (the schema's five kinds)."""

    SHELL_READ_EDIT = "shell_read_edit"
    PYTHON_SCRIPT = "python_script"
    TESTS = "tests"
    INSTALL = "install"
    OTHER = "other"


_KIND_NAMES = ", ".join(k.value for k in ToolKind)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0


def _calls_tuple(calls: Iterable[TraceCall]) -> tuple[TraceCall, ...]:
    return tuple(calls)


@attrs.frozen
class TraceCall:
    """One LLM call of a traced session (token counts in tokens, times in seconds).

    ``prompt_tokens`` is the whole history sent; ``cached_tokens`` the provider-reported
    prefix-cache hit (``None``: not reported); ``tool_seconds`` the tool run after this call
    (``None``: not measured; see :func:`fill_missing_tool_times`).
    """

    prompt_tokens: int
    output_tokens: int
    tool_kind: ToolKind = ToolKind.OTHER
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    llm_seconds: float | None = None
    tool_seconds: float | None = None

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.prompt_tokens) or self.prompt_tokens < 1:
            raise TraceError(
                f"prompt_tokens must be a positive integer, got {self.prompt_tokens!r}"
            )
        if not _is_int(self.output_tokens) or self.output_tokens < 0:
            raise TraceError(
                f"output_tokens must be a non-negative integer, got {self.output_tokens!r}"
            )
        if not isinstance(self.tool_kind, ToolKind):
            raise TraceError(f"tool_kind must be a ToolKind, got {self.tool_kind!r}")
        for name in ("cached_tokens", "reasoning_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise TraceError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.cached_tokens is not None and self.cached_tokens > self.prompt_tokens:
            raise TraceError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        for name in ("llm_seconds", "tool_seconds"):
            value = getattr(self, name)
            if value is not None and not _is_seconds(value):
                raise TraceError(f"{name} must be a finite number >= 0 or None, got {value!r}")


@attrs.frozen
class TraceSession:
    """One agent session: its calls in order, and where it came from (``source``)."""

    session_id: str
    source: str
    agent: str
    model: str
    exit_status: str | None
    calls: tuple[TraceCall, ...] = attrs.field(converter=_calls_tuple)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise TraceError(f"session_id must be a non-empty string, got {self.session_id!r}")
        if not self.calls:
            raise TraceError(f"session {self.session_id}: a session needs at least one call")
        for call in self.calls:
            if not isinstance(call, TraceCall):
                raise TraceError(f"session {self.session_id}: calls must be TraceCall objects")

    @property
    def n_calls(self) -> int:
        return len(self.calls)


# --------------------------------------------------------------------------- loading


class _Bad(Exception):
    """Internal: a field at ``field`` failed validation (re-raised as TraceError)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)


def _got(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _get(obj: Mapping[str, Any], key: str, field: str, expected: str) -> Any:
    if key not in obj:
        raise _Bad(field, f"missing (expected {expected})")
    return obj[key]


def _int_field(obj: Mapping[str, Any], key: str, field: str, minimum: int, nullable: bool) -> Any:
    expected = "a positive integer" if minimum == 1 else "a non-negative integer"
    if nullable:
        expected += " or null"
    value = _get(obj, key, field, expected)
    if value is None and nullable:
        return None
    if not _is_int(value) or value < minimum:
        raise _Bad(field, f"expected {expected}, got {_got(value)}")
    return value


def _seconds_field(obj: Mapping[str, Any], key: str, field: str) -> float | None:
    """A duration; a small negative one (clock skew between the agent's and the tool's
    timestamps, seen in the published traces) is read as not measured (``None``)."""
    expected = f"a finite number of seconds >= -{CLOCK_SKEW_TOLERANCE_S:g} or null"
    value = _get(obj, key, field, expected)
    if value is None:
        return None
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or not math.isfinite(value) or value < -CLOCK_SKEW_TOLERANCE_S:
        raise _Bad(field, f"expected {expected}, got {_got(value)}")
    return float(value) if value >= 0 else None


def _str_field(obj: Mapping[str, Any], key: str, field: str, nullable: bool = False) -> Any:
    expected = "a non-empty string" + (" or null" if nullable else "")
    value = _get(obj, key, field, expected)
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value:
        raise _Bad(field, f"expected {expected}, got {_got(value)}")
    return value


def _parse_call(obj: object, field: str) -> TraceCall:
    if not isinstance(obj, dict):
        raise _Bad(field, f"expected an object, got {_got(obj)}")
    prompt = _int_field(obj, "prompt_tokens", f"{field}.prompt_tokens", 1, False)
    cached = _int_field(obj, "cached_tokens", f"{field}.cached_tokens", 0, True)
    output = _int_field(obj, "output_tokens", f"{field}.output_tokens", 0, False)
    reasoning = _int_field(obj, "reasoning_tokens", f"{field}.reasoning_tokens", 0, True)
    if cached is not None and cached > prompt:
        raise _Bad(
            f"{field}.cached_tokens",
            f"expected at most prompt_tokens ({prompt}), got {cached}",
        )
    kind_value = _get(obj, "tool_kind", f"{field}.tool_kind", f"one of {_KIND_NAMES}")
    try:
        kind = ToolKind(kind_value)
    except ValueError:
        raise _Bad(
            f"{field}.tool_kind", f"expected one of {_KIND_NAMES}, got {_got(kind_value)}"
        ) from None
    return TraceCall(
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        reasoning_tokens=reasoning,
        llm_seconds=_seconds_field(obj, "llm_seconds", f"{field}.llm_seconds"),
        tool_seconds=_seconds_field(obj, "tool_seconds", f"{field}.tool_seconds"),
        tool_kind=kind,
    )


def _parse_session(obj: object) -> TraceSession:
    if not isinstance(obj, dict):
        raise _Bad("", f"expected a JSON object (one session per line), got {_got(obj)}")
    schema = _get(obj, "schema", "schema", f'"{SCHEMA}"')
    if schema != SCHEMA:
        raise _Bad("schema", f'expected "{SCHEMA}", got {_got(schema)}')
    calls = _get(obj, "calls", "calls", "a non-empty array of calls")
    if not isinstance(calls, list) or not calls:
        raise _Bad("calls", f"expected a non-empty array of calls, got {_got(calls)}")
    return TraceSession(
        session_id=_str_field(obj, "session_id", "session_id"),
        source=_str_field(obj, "source", "source"),
        agent=_str_field(obj, "agent", "agent"),
        model=_str_field(obj, "model", "model"),
        exit_status=_str_field(obj, "exit_status", "exit_status", nullable=True),
        calls=tuple(_parse_call(c, f"calls[{i}]") for i, c in enumerate(calls)),
    )


def _load_file(path: Path) -> list[TraceSession]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace file: {e}") from e
    sessions: list[TraceSession] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            session = _parse_session(json.loads(line))
        except json.JSONDecodeError as e:
            raise TraceError(
                f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
            ) from None
        except _Bad as e:
            raise TraceError(f"{path}:{lineno}: {e}") from None
        if session.session_id in first_line:
            raise TraceError(
                f"{path}:{lineno}: session_id: {session.session_id!r} repeats the session "
                f"of line {first_line[session.session_id]}"
            )
        first_line[session.session_id] = lineno
        sessions.append(session)
    if not sessions:
        raise TraceError(f"{path}: the trace file holds no sessions")
    return sessions


def load_trace(path: Path | str) -> list[TraceSession]:
    """Load and validate a trace file, or every ``*.jsonl`` of a directory (sorted by name).

    Raises :class:`TraceError` naming the file, the 1-based line and the field at fault.
    A session id may repeat across the files of a directory (the same task run by two
    models) but not within one file.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise TraceError(f"{path}: the directory holds no *.jsonl trace files")
        return [s for f in files for s in _load_file(f)]
    if not path.exists():
        raise TraceError(f"{path}: no such trace file or directory")
    return _load_file(path)


def _has_traces(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.jsonl"))


def find_traces(explicit: Path | str | None = None) -> Path | None:
    """The trace directory (or file) to use, or ``None`` when there is none.

    Order: ``explicit``; else the ``TALARIA_TRACES`` environment variable; else the real
    traces bundled with the package (:data:`BUNDLED_TRACES`, ``swebench_replay/data``), so a
    bare clone or install replays real sessions. An explicit path or a set variable that
    does not exist raises :class:`TraceError` (it is never silently replaced by a default);
    ``None`` only when the bundled folder is missing too (a stripped install).
    """
    if explicit is not None:
        path = Path(explicit)
        if not path.exists():
            raise TraceError(f"{path}: no such trace file or directory (given explicitly)")
        return path
    env = os.environ.get(TRACES_ENV)
    if env:
        path = Path(env)
        if not path.exists():
            raise TraceError(f"{TRACES_ENV}={env}: no such trace file or directory")
        return path
    return BUNDLED_TRACES if _has_traces(BUNDLED_TRACES) else None


# --------------------------------------------------------------------------- tool times

_QUANTILE_KEYS: tuple[tuple[float, str], ...] = (
    (0.10, "p10"),
    (0.25, "p25"),
    (0.50, "p50"),
    (0.75, "p75"),
    (0.90, "p90"),
    (0.95, "p95"),
    (0.99, "p99"),
    (1.00, "max"),
)

# The per-kind percentiles every replay and server starts from live in one file, the
# package data talaria/session/tool_priors.json, measured on the tune part of the bundled
# traces by benchmarks/tool_priors.py (tool_time_document).
PRIORS_PACKAGE = "talaria.session"
PRIORS_FILE = (
    "tool_priors.json"  # = talaria.session.priors.PRIORS_FILE (talaria.session imports us)
)


def tool_time_document(sessions: Iterable[TraceSession], source: str) -> dict[str, Any]:
    """Tool-time percentiles per kind and over all kinds (``ALL``) of ``sessions``, in the
    ``tool_priors.json`` format: ``n``, ``mean``, ``p10`` .. ``p99`` (numpy's linear
    percentiles) and ``max``, in seconds rounded to the millisecond. Every measured tool time
    counts but a session's last (no call follows it). ``TraceError`` for a kind with none."""
    times: dict[str, list[float]] = {k.value: [] for k in ToolKind}
    for s in sessions:
        for c in s.calls[:-1]:
            if c.tool_seconds is not None:
                times[c.tool_kind.value].append(c.tool_seconds)
    times["ALL"] = [t for k in ToolKind for t in times[k.value]]
    kinds: dict[str, dict[str, float | int]] = {}
    for kind, values in times.items():
        if not values:
            raise TraceError(f"no measured tool time of kind {kind!r} to take percentiles of")
        xs = np.asarray(values, dtype=float)
        entry: dict[str, float | int] = {"n": len(values), "mean": round(float(xs.mean()), 3)}
        for q, key in _QUANTILE_KEYS[:-1]:
            entry[key] = round(float(np.percentile(xs, 100 * q)), 3)
        entry["max"] = round(float(xs.max()), 3)
        kinds[kind] = entry
    return {
        "source": source,
        "definition": "seconds from an LLM response received to the next request's tool "
        "output recorded (every command of the step); a session's last call excluded",
        "kinds": kinds,
    }


@attrs.frozen
class ToolTimeDist:
    """Tool time of one kind as an inverse CDF, piecewise linear through ``knots``.

    ``knots`` are ``(cumulative probability, seconds)`` pairs from ``(0, 0.5 * p10)`` through
    the published percentiles to ``(1, max)``; ``n`` is how many steps they were measured on.
    """

    n: int
    knots: tuple[tuple[float, float], ...]

    def quantile(self, u: float) -> float:
        """Seconds at cumulative probability ``u`` in [0, 1]."""
        u = min(max(u, 0.0), 1.0)
        for (p0, s0), (p1, s1) in itertools.pairwise(self.knots):
            if u <= p1:
                return s0 + (s1 - s0) * (u - p0) / (p1 - p0)
        return self.knots[-1][1]

    @property
    def median(self) -> float:
        return self.quantile(0.5)


def _dist_from(values: Sequence[float], n: int, where: str) -> ToolTimeDist:
    """``values`` are the seconds at ``_QUANTILE_KEYS`` (p10 .. max), non-decreasing."""
    keyed = list(zip(_QUANTILE_KEYS, values, strict=True))
    for (_, key), value in keyed:
        if not _is_seconds(value) or value <= 0:
            raise TraceError(f"{where}.{key}: expected a positive number of seconds, got {value!r}")
    for ((_, k0), v0), ((_, k1), v1) in itertools.pairwise(keyed):
        if v1 < v0:
            raise TraceError(f"{where}.{k1}: must not be below {k0} ({v0}), got {v1}")
    knots = ((0.0, 0.5 * values[0]), *((p, float(v)) for (p, _), v in keyed))
    return ToolTimeDist(n=n, knots=knots)


@attrs.frozen
class ToolTimeTable:
    """Tool-time distributions per :class:`ToolKind` (from ``tool_time_by_kind.json``)."""

    dists: tuple[tuple[ToolKind, ToolTimeDist], ...]
    source: str = ""

    @classmethod
    def published(cls) -> ToolTimeTable:
        """The packaged percentiles (``talaria/session/tool_priors.json``: the tune part of
        the bundled traces), the same the server's gap priors start from."""
        text = resources.files(PRIORS_PACKAGE).joinpath(PRIORS_FILE).read_text("utf-8")
        return cls.from_json(json.loads(text), where=f"{PRIORS_PACKAGE}/{PRIORS_FILE}")

    @classmethod
    def from_json(cls, data: object, where: str = "tool times") -> ToolTimeTable:
        """Build from the parsed JSON object; errors name ``where`` and the key path."""
        kinds = data.get("kinds") if isinstance(data, dict) else None
        if not isinstance(kinds, dict):
            raise TraceError(f"{where}: kinds: missing (expected an object of tool kinds)")
        dists = []
        for kind in ToolKind:
            entry = kinds.get(kind.value)
            field = f"{where}: kinds.{kind.value}"
            if not isinstance(entry, dict):
                raise TraceError(f"{field}: missing (expected an object with n, p10..p99, max)")
            missing = [k for k in ("n", *(k for _, k in _QUANTILE_KEYS)) if k not in entry]
            if missing:
                raise TraceError(f"{field}.{missing[0]}: missing")
            n = entry["n"]
            if not _is_int(n) or n < 0:
                raise TraceError(f"{field}.n: expected a non-negative integer, got {n!r}")
            values = [entry[k] for _, k in _QUANTILE_KEYS]
            dists.append((kind, _dist_from(values, n, field)))
        source = data.get("source", "") if isinstance(data, dict) else ""
        return cls(dists=tuple(dists), source=str(source))

    @classmethod
    def load(cls, path: Path | str) -> ToolTimeTable:
        """Load ``tool_time_by_kind.json``; raises :class:`TraceError` on a malformed file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise TraceError(f"{path}: cannot read the tool-time table: {e}") from e
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        return cls.from_json(data, where=str(path))

    def dist(self, kind: ToolKind) -> ToolTimeDist:
        for k, d in self.dists:
            if k is kind:
                return d
        raise TraceError(f"tool-time table has no entry for kind {kind.value!r}")

    def sample(self, kind: ToolKind, rng: random.Random) -> float:
        """One tool time in seconds for ``kind``, drawn by inverse CDF (one ``rng.random()``)."""
        return self.dist(kind).quantile(rng.random())

    def median(self, kind: ToolKind) -> float:
        """The median tool time of ``kind`` in seconds (p50; a client's gap hint)."""
        return self.dist(kind).median

    def quantile(self, kind: ToolKind, u: float) -> float:
        """Seconds at cumulative probability ``u`` for ``kind``."""
        return self.dist(kind).quantile(u)

    def counts(self) -> tuple[tuple[ToolKind, int], ...]:
        """How many steps each kind was measured on (the kind mix of the source runs)."""
        return tuple((k, d.n) for k, d in self.dists)


def fill_missing_tool_times(
    sessions: Iterable[TraceSession], table: ToolTimeTable, seed: int
) -> tuple[list[TraceSession], int]:
    """Sessions with every missing ``tool_seconds`` (except each last call's) drawn from
    ``table`` by the call's tool kind, and how many were filled.

    Deterministic in ``seed``: each session draws from its own generator seeded by
    ``(seed, session_id, source)``, so the result does not depend on the order of sessions.
    The input sessions are not changed; a session needing no fill is returned as is.
    """
    out: list[TraceSession] = []
    filled = 0
    for session in sessions:
        last = len(session.calls) - 1
        todo = [i for i, c in enumerate(session.calls) if c.tool_seconds is None and i < last]
        if not todo:
            out.append(session)
            continue
        rng = random.Random(f"{seed}\x00{session.session_id}\x00{session.source}")
        calls = list(session.calls)
        for i in todo:
            calls[i] = attrs.evolve(calls[i], tool_seconds=table.sample(calls[i].tool_kind, rng))
        filled += len(todo)
        out.append(attrs.evolve(session, calls=tuple(calls)))
    return out, filled


def session_to_json(session: TraceSession) -> dict[str, Any]:
    """The schema's JSON object for one session (what :func:`load_trace` reads back)."""
    return {
        "schema": SCHEMA,
        "session_id": session.session_id,
        "source": session.source,
        "agent": session.agent,
        "model": session.model,
        "exit_status": session.exit_status,
        "calls": [
            {
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "output_tokens": c.output_tokens,
                "reasoning_tokens": c.reasoning_tokens,
                "llm_seconds": c.llm_seconds,
                "tool_seconds": c.tool_seconds,
                "tool_kind": c.tool_kind.value,
            }
            for c in session.calls
        ],
    }
