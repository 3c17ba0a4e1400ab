"""Open-loop load: real agent sessions arriving over time, each on a model of a Zipf catalog.

Sessions arrive by an :class:`ArrivalPattern` at ``rate_per_s`` sessions a second:

* ``poisson``: exponential inter-arrival times (coefficient of variation 1);
* ``gamma:CV``: Gamma inter-arrival times of mean ``1 / rate`` and coefficient of variation
  ``CV`` (shape ``1 / CV^2``): CV above 1 is burstier than Poisson. The Gamma shape is the
  one AlpaServe (Li et al., OSDI'23) fits to production model-serving traffic and sweeps by
  its CV, and the one BurstGPT (Wang et al., arXiv 2401.17644, Azure OpenAI GPT traffic)
  fits to its request inter-arrivals; no fitted CV for *agent sessions* is published, so the
  CV is a knob and the documented runs say which they used (:data:`DEFAULT_BURSTY_CV`, 2, is
  an assumption, not a fitted value).

Arrival ``k`` (``k = 0, 1, ...``) draws its model from the catalog's Zipf law, then a trace
session uniformly among the sessions of the chosen part that fit that model's context, from
random streams of ``seed`` alone; its start time is a unit-mean draw of ``seed`` divided by
the rate. So two rates of one seed play the same sessions on the same models in the same
order, only closer together (common random numbers: a sweep's points differ in load only).
Each arrival is a real session from the traces: its calls, token counts and tool gaps
(:func:`~talaria.swebench_replay.workload.build_replay_set` builds the token ids).

Pure but for reading the trace files; nothing passed in is mutated.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs
import numpy as np

from talaria.errors import BadRequest, ConfigError
from talaria.sim.pool_catalog import PoolCatalog
from talaria.swebench_replay.driver import to_scripts
from talaria.swebench_replay.setup import TOOL_TABLE_FILE
from talaria.swebench_replay.split import Part, select_part
from talaria.swebench_replay.traces import ToolTimeTable, TraceSession, find_traces, load_trace
from talaria.swebench_replay.workload import MIN_CALLS, Arrival, build_replay_set
from talaria.types import SessionScript

DEFAULT_BURSTY_CV: Final = 2.0
"""The ``gamma`` pattern's default coefficient of variation: an assumption (module doc)."""

_PATTERN_FORMS = "poisson, gamma:CV (e.g. gamma:2)"


class PatternKind(enum.Enum):
    POISSON = "poisson"
    GAMMA = "gamma"


@attrs.frozen
class ArrivalPattern:
    """The shape of the inter-arrival times (module docstring); the rate is given apart."""

    kind: PatternKind = PatternKind.POISSON
    cv: float = 1.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, PatternKind):
            raise BadRequest(f"pattern kind must be a PatternKind, got {self.kind!r}")
        if not _positive(self.cv):
            raise BadRequest(f"an arrival pattern's CV must be a positive number, got {self.cv!r}")
        if self.kind is PatternKind.POISSON and self.cv != 1.0:
            raise BadRequest("a Poisson pattern has CV 1; use gamma:CV for another")

    def describe(self) -> str:
        """The text :func:`parse_pattern` reads back."""
        return "poisson" if self.kind is PatternKind.POISSON else f"gamma:{self.cv:g}"

    def start_times(self, n: int, rate_per_s: float, seed: int) -> list[float]:
        """``n`` non-decreasing start times (seconds, the first at 0) at ``rate_per_s``
        sessions a second: unit-mean draws of ``seed``, divided by the rate. ``BadRequest``
        for a rate that is not a positive finite number."""
        check_rate(rate_per_s)
        rng = np.random.default_rng([seed, 0xA771])
        if self.kind is PatternKind.POISSON:
            unit = rng.exponential(1.0, size=max(0, n - 1))
        else:
            shape = 1.0 / self.cv**2
            unit = rng.gamma(shape, 1.0 / shape, size=max(0, n - 1))
        gaps = unit / rate_per_s
        return [0.0, *np.cumsum(gaps).tolist()][:n]


def _positive(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value > 0


def check_rate(rate_per_s: object) -> float:
    """``rate_per_s`` as a float; ``BadRequest`` unless it is a positive finite number."""
    if not _positive(rate_per_s):
        raise BadRequest(
            f"an arrival rate must be a positive number of sessions a second, got {rate_per_s!r}"
        )
    return float(rate_per_s)  # type: ignore[arg-type]


def parse_pattern(text: str) -> ArrivalPattern:
    """``"poisson"`` or ``"gamma:CV"``; ``"gamma"`` alone takes :data:`DEFAULT_BURSTY_CV`."""
    spec = text.strip().lower() if isinstance(text, str) else ""
    if spec == "poisson":
        return ArrivalPattern()
    name, _, value = spec.partition(":")
    if name == "gamma":
        try:
            cv = float(value) if value else DEFAULT_BURSTY_CV
        except ValueError:
            cv = math.nan
        return ArrivalPattern(PatternKind.GAMMA, cv)
    raise BadRequest(f"arrival pattern {text!r} not understood; use one of: {_PATTERN_FORMS}")


@attrs.frozen
class Draw:
    """Arrival ``index``: the trace session ``trace`` on ``model``, starting at ``start_s``
    (``trace_id`` names it; a task's id may repeat across the traces' sources)."""

    index: int
    trace: TraceSession = attrs.field(eq=False, repr=False)
    model: str
    start_s: float

    @property
    def trace_id(self) -> str:
        return self.trace.session_id

    @property
    def session_id(self) -> str:
        return f"a{self.index:05d}:{self.trace_id}"


@attrs.frozen
class OpenLoad:
    """An open-loop workload: the arrivals and the scripts the simulator plays (one per
    arrival, ordered by start time), with the source described."""

    draws: tuple[Draw, ...]
    scripts: tuple[SessionScript, ...]
    n_calls: int
    source: str

    @property
    def by_session(self) -> Mapping[str, Draw]:
        return {d.session_id: d for d in self.draws}


def tool_table(trace_path: Path | None) -> ToolTimeTable:
    """The per-kind tool times beside the traces (as a replay reads them), else the
    published ones."""
    if trace_path is not None:
        folder = trace_path if trace_path.is_dir() else trace_path.parent
        if (folder / TOOL_TABLE_FILE).exists():
            return ToolTimeTable.load(folder / TOOL_TABLE_FILE)
    return ToolTimeTable.published()


PREFIX_MARGIN: Final = 1024
"""Tokens of shared system-prompt prefix a built session may start with, at most, as far as
the context check goes (a replay's default is the traces' median cached prefix, 320)."""


def longest_built(session: TraceSession, token_scale: float = 1.0) -> int:
    """An upper bound on the longest call (prompt + answer, tokens) of ``session`` once
    built: a history that only grew keeps growing by at least one token a call even where
    the trace's count is smaller, after a shared prefix of at most :data:`PREFIX_MARGIN`."""
    history, longest, prev = PREFIX_MARGIN, 0, None
    for call in session.calls:
        target = max(1, round(call.prompt_tokens * token_scale))
        output = max(1, round(call.output_tokens * token_scale))
        grew = prev is None or call.prompt_tokens >= prev.prompt_tokens + prev.output_tokens
        length = max(target, history + 1) if grew else target
        longest = max(longest, length + output)
        history, prev = length + output, call
    return longest


def _fits(session: TraceSession, max_context: int, token_scale: float) -> bool:
    return longest_built(session, token_scale) <= max_context


def trace_sessions(trace: Path | None, part: Part) -> tuple[list[TraceSession], Path]:
    """The sessions of ``part`` of the traces (``MIN_CALLS`` calls or more) and the trace
    path; ``ConfigError`` when there are no traces."""
    path = find_traces(trace)
    if path is None:
        raise ConfigError("open-loop load plays real sessions and found no traces")
    sessions = [s for s in select_part(load_trace(path), part) if s.n_calls >= MIN_CALLS]
    if not sessions:
        raise ConfigError(f"the {part.value} part of {path} has no session to play")
    return sessions, path


def draw_arrivals(
    sessions: Sequence[TraceSession],
    catalog: PoolCatalog,
    n: int,
    rate_per_s: float,
    pattern: ArrivalPattern,
    seed: int,
    token_scale: float = 1.0,
) -> tuple[Draw, ...]:
    """``n`` arrivals (module docstring). ``ConfigError`` when a drawn model's context
    fits none of ``sessions``; ``BadRequest`` for a bad rate or count."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"an open-loop load needs at least one session, got {n!r}")
    starts = pattern.start_times(n, rate_per_s, seed)
    rng = np.random.default_rng([seed, 0x5E55])
    ordered = sorted(sessions, key=lambda s: (s.session_id, s.source, s.model))
    fitting: dict[str, list[TraceSession]] = {}
    draws = []
    for k in range(n):
        m = int(rng.choice(len(catalog.models), p=catalog.probabilities))
        spec = catalog.models[m]
        if spec.name not in fitting:
            fitting[spec.name] = [s for s in ordered if _fits(s, spec.max_context, token_scale)]
        pool = fitting[spec.name]
        if not pool:
            raise ConfigError(
                f"no trace session fits the {spec.max_context}-token context of {spec.name}"
            )
        pick = pool[int(rng.integers(len(pool)))]
        draws.append(Draw(k, pick, spec.name, starts[k]))
    return tuple(draws)


def build_load(
    draws: Sequence[Draw],
    seed: int,
    *,
    trace_path: Path | None = None,
    token_scale: float = 1.0,
    gap_scale: float = 1.0,
    hints: bool = True,
) -> OpenLoad:
    """The scripts of ``draws``: each model's arrivals built into one replay set (so the
    sessions of a model share its system-prompt prefix, as in a replay), renamed to their
    arrival and started at their draw's time."""
    table = tool_table(trace_path)
    groups: dict[str, list[TraceSession]] = {}
    for d in draws:
        groups.setdefault(d.model, []).append(attrs.evolve(d.trace, session_id=d.session_id))
    start = {d.session_id: d.start_s for d in draws}
    scripts: list[SessionScript] = []
    for model, members in groups.items():
        built = build_replay_set(members, [model], Arrival(), seed, token_scale, tool_table=table)
        placed = attrs.evolve(
            built,
            sessions=tuple(attrs.evolve(s, start_s=start[s.session_id]) for s in built.sessions),
        )
        scripts += to_scripts(placed, table, gap_scale, hints)
    scripts.sort(key=lambda s: (s.start_s, s.session_id))
    n_calls = sum(len(s.calls) for s in scripts)
    source = f"traces: {trace_path}" if trace_path is not None else "traces"
    return OpenLoad(tuple(draws), tuple(scripts), n_calls, source)
