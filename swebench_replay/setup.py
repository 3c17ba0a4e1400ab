"""Assemble a replay workload: real traces when present, synthesized sessions otherwise.

The paper-like default: 30 sessions, about 960 calls, spread over the three paper-scale
models. Sessions whose history would not fit the smallest context of those models are left
out (and the description says how many), so no call is refused for its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from talaria.sim.catalog import PAPER_MODELS
from talaria.swebench_replay.split import PARTS, Part, select_part
from talaria.swebench_replay.synth import synthesize
from talaria.swebench_replay.traces import ToolTimeTable, TraceSession, find_traces, load_trace
from talaria.swebench_replay.workload import (
    MIN_CALLS,
    ReplaySet,
    build_replay_set,
    parse_arrival,
    select_sessions,
)

TOOL_TABLE_FILE = "tool_time_by_kind.json"


@attrs.frozen
class Workload:
    replay: ReplaySet
    tool_table: ToolTimeTable
    source: str  # "traces: PATH" or "synthetic"


def _fits(session: TraceSession, max_context: int, token_scale: float) -> bool:
    longest = max(c.prompt_tokens + c.output_tokens for c in session.calls)
    return longest * token_scale <= max_context


def _tool_table(path: Path | None) -> ToolTimeTable:
    if path is not None:
        folder = path if path.is_dir() else path.parent
        if (folder / TOOL_TABLE_FILE).exists():
            return ToolTimeTable.load(folder / TOOL_TABLE_FILE)
    return ToolTimeTable.published()


def _context_limit(max_context: int | None) -> int:
    return max_context or min(m.max_context for m in PAPER_MODELS)


def playable_sessions(
    trace: Path | None = None,
    part: Part = Part.ALL,
    max_context: int | None = None,
    token_scale: float = 1.0,
) -> int | None:
    """How many sessions of ``part`` of the traces a replay can draw (those that fit the
    context and have ``MIN_CALLS`` calls); None when there are no traces (synthetic
    sessions are made as many as asked)."""
    path = find_traces(trace)
    if path is None:
        return None
    limit = _context_limit(max_context)
    return sum(
        1
        for s in select_part(load_trace(path), part)
        if s.n_calls >= MIN_CALLS and _fits(s, limit, token_scale)
    )


def load_workload(
    trace: Path | None = None,
    synthetic: bool = False,
    n_sessions: int = 30,
    target_calls: int = 960,
    seed: int = 0,
    arrival: str = "all",
    models: Sequence[str] | None = None,
    max_context: int | None = None,
    token_scale: float = 1.0,
    vocab_size: int = 32000,
    part: Part = Part.ALL,
) -> Workload:
    """The replay set for a run (deterministic in its arguments), drawn from ``part`` of the
    sessions (:mod:`talaria.swebench_replay.split`; synthetic sessions are split alike)."""
    names = tuple(models) if models else tuple(m.name for m in PAPER_MODELS)
    limit = _context_limit(max_context)
    path = None if synthetic else find_traces(trace)
    table = _tool_table(path)
    if path is not None:
        sessions = select_part(load_trace(path), part)
        source = f"traces: {path}"
    else:
        wanted = max(2 * n_sessions, n_sessions + 10) * (1 if part is Part.ALL else PARTS)
        sessions = select_part(synthesize(wanted, seed, tool_table=table), part)
        source = "synthetic (published trace statistics)"
    if part is not Part.ALL:
        source += f", {part.value} part"
    fitting = [s for s in sessions if _fits(s, limit, token_scale)]
    chosen = select_sessions(fitting, n_sessions, target_calls, seed)
    dropped = len(sessions) - len(fitting)
    desc = f"{source} ({len(sessions)} sessions"
    desc += f", {dropped} longer than {limit:,} tokens left out)" if dropped else ")"
    replay = build_replay_set(
        chosen,
        names,
        parse_arrival(arrival),
        seed,
        token_scale=token_scale,
        vocab_size=vocab_size,
        tool_table=table,
        trace=desc,
    )
    return Workload(replay, table, source)
