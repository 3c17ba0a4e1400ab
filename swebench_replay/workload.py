"""The replay set: which sessions, on which model, when they start, and their token ids.

Three steps turn trace sessions into something a substrate can serve:

1. :func:`select_sessions` picks a paper-like set (by default 30 sessions, about 960 calls);
2. :func:`build_replay_set` assigns models, start times and tool gaps, and synthesizes token
   ids so that each call's prompt really is the previous prompt + the previous output + new
   tokens (built with :meth:`TokenSeq.extend`, so prefix hashes are shared, not recomputed);
3. the replay driver (elsewhere) sends :meth:`ReplayCall.to_call` requests.

Token counts follow the trace's own tokenizer counts; ids are random (seeded), because the
replay measures serving, not text. Units: tokens, seconds.
"""

from __future__ import annotations

import enum
import math
import random
import re
import statistics
import zlib
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from talaria.errors import BadRequest
from talaria.swebench_replay.traces import (
    ToolKind,
    ToolTimeTable,
    TraceSession,
    fill_missing_tool_times,
)
from talaria.types import Call, TokenSeq

# --------------------------------------------------------------------------- arrivals

_ARRIVAL_FORMS = "all, staggered:SECONDS (e.g. staggered:5), poisson:RATE_PER_S (e.g. poisson:0.1)"

MIN_CALLS = 5  # a session shorter than this is no agent session (select_sessions)


class ArrivalKind(enum.Enum):
    ALL_AT_ONCE = "all"
    STAGGERED = "staggered"
    POISSON = "poisson"


def _number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@attrs.frozen
class Arrival:
    """When sessions start: all at 0 s; every ``interval_s``; or a Poisson process of
    ``rate_per_s`` sessions per second (the first session starts at 0 s)."""

    kind: ArrivalKind = ArrivalKind.ALL_AT_ONCE
    interval_s: float | None = None
    rate_per_s: float | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, ArrivalKind):
            raise BadRequest(f"arrival kind must be an ArrivalKind, got {self.kind!r}")
        interval, rate = self.interval_s, self.rate_per_s
        if self.kind is ArrivalKind.STAGGERED:
            if rate is not None or not _finite(interval) or interval < 0:  # type: ignore[operator]
                raise BadRequest(f"staggered arrival needs interval_s >= 0, got {interval!r}")
        elif self.kind is ArrivalKind.POISSON:
            if interval is not None or not _finite(rate) or rate <= 0:  # type: ignore[operator]
                raise BadRequest(f"poisson arrival needs rate_per_s > 0, got {rate!r}")
        elif interval is not None or rate is not None:
            raise BadRequest("all-at-once arrival takes neither interval_s nor rate_per_s")

    @classmethod
    def staggered(cls, interval_s: float) -> Arrival:
        return cls(ArrivalKind.STAGGERED, interval_s=interval_s)

    @classmethod
    def poisson(cls, rate_per_s: float) -> Arrival:
        return cls(ArrivalKind.POISSON, rate_per_s=rate_per_s)

    def start_times(self, n: int, rng: random.Random) -> list[float]:
        """``n`` non-decreasing start times in seconds (``rng`` is used by Poisson only)."""
        if self.kind is ArrivalKind.STAGGERED and self.interval_s is not None:
            return [i * self.interval_s for i in range(n)]
        if self.kind is ArrivalKind.POISSON and self.rate_per_s is not None:
            times, t = [], 0.0
            for i in range(n):
                if i:
                    t += rng.expovariate(self.rate_per_s)
                times.append(t)
            return times
        return [0.0] * n

    def describe(self) -> str:
        """The canonical text form, which :func:`parse_arrival` reads back."""
        if self.kind is ArrivalKind.STAGGERED and self.interval_s is not None:
            return f"staggered:{_number_text(self.interval_s)}"
        if self.kind is ArrivalKind.POISSON and self.rate_per_s is not None:
            return f"poisson:{_number_text(self.rate_per_s)}"
        return "all"


def _finite(value: object) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value)  # type: ignore[arg-type]


def parse_arrival(text: str) -> Arrival:
    """``"all"``, ``"staggered:5"`` (seconds between starts) or ``"poisson:0.1"`` (per s)."""
    spec = text.strip().lower() if isinstance(text, str) else ""
    if spec in ("all", "all-at-once", "all_at_once"):
        return Arrival()
    name, _, value = spec.partition(":")
    if name in ("staggered", "poisson") and value:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        try:
            return Arrival.staggered(number) if name == "staggered" else Arrival.poisson(number)
        except BadRequest as e:
            raise BadRequest(f"arrival {text!r}: {e}; use one of: {_ARRIVAL_FORMS}") from None
    raise BadRequest(f"arrival {text!r} not understood; use one of: {_ARRIVAL_FORMS}")


# --------------------------------------------------------------------------- replay set


@attrs.frozen
class ReplayCall:
    """One call to replay: the whole ``prompt``, the known answer length ``output_tokens``,
    and the tool gap after it (``tool_seconds``; 0 for a session's last call).

    ``history`` is ``prompt`` followed by the answer's ``output_tokens`` ids: the next
    call's prompt starts with it (unless the agent cut its history there).
    """

    index: int
    prompt: TokenSeq = attrs.field(eq=False)
    history: TokenSeq = attrs.field(eq=False)
    output_tokens: int
    tool_seconds: float
    tool_kind: ToolKind

    def to_call(
        self, session_id: str, model: str, arrival_s: float = 0.0, tenant: str = "default"
    ) -> Call:
        """The :class:`~talaria.types.Call` to send (``max_new_tokens = output_tokens``)."""
        return Call(
            session_id=session_id,
            index=self.index,
            model=model,
            prompt=self.prompt,
            max_new_tokens=self.output_tokens,
            output_tokens=self.output_tokens,
            tenant=tenant,
            arrival_s=arrival_s,
        )


@attrs.frozen
class ReplaySession:
    """A session to replay on ``model``, first call sent at ``start_s``."""

    session_id: str
    model: str
    start_s: float
    calls: tuple[ReplayCall, ...]
    source: str

    @property
    def n_calls(self) -> int:
        return len(self.calls)


@attrs.frozen
class ReplaySet:
    """The whole workload. ``trace`` describes where it came from and what was changed
    (truncations, history resets, scaling, tool times drawn); ``tool_times_filled`` counts
    tool times drawn from the per-kind table because the trace had none."""

    sessions: tuple[ReplaySession, ...]
    models: tuple[str, ...]
    seed: int
    trace: str
    arrival: Arrival
    tool_times_filled: int
    token_scale: float
    shared_prefix_tokens: int = 0
    history_resets: int = 0
    truncated_sessions: int = 0

    @property
    def n_calls(self) -> int:
        return sum(s.n_calls for s in self.sessions)


# --------------------------------------------------------------------------- selection

_PREFIX_MARK = re.compile(r"#prefix:(\d+)/(\d+)$")


def _key(session: TraceSession) -> tuple[str, str, str]:
    return (session.session_id, session.source, session.model)


def _swap_search(lengths: Sequence[int], n: int, target: int, rng: random.Random) -> list[int]:
    """Indices of ``n`` lengths whose sum is as close to ``target`` as single swaps get,
    starting from a seeded random subset (best-improvement swaps until none improves)."""
    chosen = set(rng.sample(range(len(lengths)), n))
    total = sum(lengths[i] for i in chosen)
    while total != target:
        best = (abs(total - target), -1, -1)
        for out in sorted(chosen):
            for inn in range(len(lengths)):
                if inn not in chosen:
                    gap = abs(total - lengths[out] + lengths[inn] - target)
                    best = min(best, (gap, out, inn))
        if best[1] < 0:
            break
        _, out, inn = best
        chosen.remove(out)
        chosen.add(inn)
        total += lengths[inn] - lengths[out]
    return sorted(chosen)


def _prefix_lengths(lengths: Sequence[int], target: int, min_calls: int) -> list[int]:
    """Prefix lengths, in proportion to ``lengths``, summing exactly to ``target``; each in
    ``[min_calls, length]`` (largest-remainder rounding)."""
    raw = [n * target / sum(lengths) for n in lengths]
    keep = [min(n, max(min_calls, math.floor(r))) for n, r in zip(lengths, raw, strict=True)]
    by_remainder = sorted(range(len(raw)), key=lambda i: keep[i] - raw[i])
    while sum(keep) < target:
        i = next(i for i in by_remainder if keep[i] < lengths[i])
        keep[i] += 1
        by_remainder.remove(i)
        by_remainder.append(i)
    while sum(keep) > target:
        i = next(i for i in reversed(by_remainder) if keep[i] > min_calls)
        keep[i] -= 1
        by_remainder.remove(i)
        by_remainder.insert(0, i)
    return keep


def _truncate(session: TraceSession, keep: int) -> TraceSession:
    if keep >= session.n_calls:
        return session
    return attrs.evolve(
        session,
        source=f"{session.source}#prefix:{keep}/{session.n_calls}",
        calls=session.calls[:keep],
    )


def _check_selection_args(n_sessions: int, target_calls: int, min_calls: int) -> None:
    for name, value in (("n_sessions", n_sessions), ("target_calls", target_calls)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    if isinstance(min_calls, bool) or not isinstance(min_calls, int) or min_calls < 1:
        raise BadRequest(f"min_calls must be a positive integer, got {min_calls!r}")
    if target_calls < n_sessions * min_calls:
        raise BadRequest(
            f"target_calls={target_calls} is below n_sessions * min_calls "
            f"({n_sessions} * {min_calls}); raise target_calls or lower n_sessions"
        )


def select_sessions(
    sessions: Iterable[TraceSession],
    n_sessions: int = 30,
    target_calls: int = 960,
    seed: int = 0,
    *,
    min_calls: int = MIN_CALLS,
    tolerance: float = 0.05,
) -> list[TraceSession]:
    """``n_sessions`` sessions with about ``target_calls`` calls in all; deterministic in
    ``seed`` and independent of the input order.

    Method: sessions with fewer than ``min_calls`` calls are left out; the rest are sorted
    by (id, source, model). If some ``n_sessions`` of them can sum to within ``tolerance``
    of the target, a seeded random subset is improved by best single swaps until the sum is
    as close as swaps get (whole sessions, no truncation). Otherwise (sessions longer than
    the target allows: the published traces have a median of 73 calls, the paper's set 32),
    ``n_sessions`` are drawn (seeded) from the ``2 * n_sessions`` shortest and each is
    truncated to a prefix in proportion to its length so the total is exactly the target;
    a truncated session's ``source`` ends with ``#prefix:KEPT/ORIGINAL`` and
    :func:`build_replay_set` reports it. Raises :class:`BadRequest` when the target cannot
    be met (too few sessions, or the longest sessions are too short).
    """
    _check_selection_args(n_sessions, target_calls, min_calls)
    if not _finite(tolerance) or not 0 <= tolerance < 1:
        raise BadRequest(f"tolerance must be in [0, 1), got {tolerance!r}")
    eligible = sorted((s for s in sessions if s.n_calls >= min_calls), key=_key)
    if len(eligible) < n_sessions:
        raise BadRequest(
            f"only {len(eligible)} sessions have at least {min_calls} calls; "
            f"ask for at most that many (n_sessions={n_sessions})"
        )
    lengths = sorted(s.n_calls for s in eligible)
    longest, shortest = sum(lengths[-n_sessions:]), sum(lengths[:n_sessions])
    if longest < target_calls * (1 - tolerance):
        raise BadRequest(
            f"the {n_sessions} longest sessions have only {longest} calls, fewer than "
            f"target_calls={target_calls}; lower target_calls or raise n_sessions"
        )
    rng = random.Random(seed)
    if shortest <= target_calls * (1 + tolerance):
        for _restart in range(10):
            found = _swap_search([s.n_calls for s in eligible], n_sessions, target_calls, rng)
            picked = [eligible[i] for i in found]
            if abs(sum(s.n_calls for s in picked) - target_calls) <= tolerance * target_calls:
                return picked
    pool = sorted(eligible, key=lambda s: (s.n_calls, _key(s)))[: 2 * n_sessions]
    picked = sorted(rng.sample(pool, n_sessions), key=_key)
    if sum(s.n_calls for s in picked) < target_calls:
        raise BadRequest(
            f"no {n_sessions} sessions found with about {target_calls} calls "
            f"(tolerance {tolerance:.0%}); change target_calls or n_sessions"
        )
    keep = _prefix_lengths([s.n_calls for s in picked], target_calls, min_calls)
    return [_truncate(s, k) for s, k in zip(picked, keep, strict=True)]


# --------------------------------------------------------------------------- building


@attrs.frozen
class _Step:
    """How to build one prompt: cut the history to ``keep`` tokens first (``None``: keep
    it all), then add ``new`` fresh tokens; the answer has ``output`` tokens."""

    keep: int | None
    new: int
    output: int


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _plan(session: TraceSession, scale: float, shared: int) -> tuple[list[_Step], int]:
    """The build steps of a session and how many history resets it has.

    Lengths follow the (scaled) trace: prompt ``i`` has the trace's token count, at least
    one more than prompt ``i-1`` + output ``i-1`` when the trace's history only grew. A
    reset is a call whose trace prompt is shorter than the previous prompt + output (the
    agent cut its history): its prompt keeps the longest prefix of that history that
    leaves room for one new token.
    """
    steps: list[_Step] = []
    resets = 0
    history = shared  # tokens available to extend: the prefix, then prompt + output
    for i, call in enumerate(session.calls):
        target, output = _scaled(call.prompt_tokens, scale), _scaled(call.output_tokens, scale)
        prev = session.calls[i - 1] if i else None
        if prev is None or call.prompt_tokens >= prev.prompt_tokens + prev.output_tokens:
            step = _Step(None, max(1, target - history), output)
            length = history + step.new
        else:
            keep = max(0, min(history, target - 1))
            step = _Step(keep, target - keep, output)
            length = target
            resets += 1
        steps.append(step)
        history = length + output
    return steps, resets


def _cut(base: TokenSeq, chain: list[TokenSeq], keep: int) -> tuple[TokenSeq, list[TokenSeq]]:
    """The first ``keep`` tokens of ``base``, reusing its longest ancestor in ``chain``."""
    kept = [node for node in chain if len(node) <= keep]
    root = kept[-1] if kept else TokenSeq()
    if len(root) == keep:
        return root, kept
    cut = root.extend(base.tokens()[len(root) : keep])
    return cut, [*kept, cut]


def _build_calls(
    session: TraceSession, steps: Sequence[_Step], prefix: TokenSeq, ids: list[int]
) -> tuple[ReplayCall, ...]:
    """The calls of a session, consuming fresh token ids from ``ids`` in order."""
    pos = 0
    base = prefix
    chain = [prefix]  # ancestors of ``base``, shortest first
    calls = []
    last = len(steps) - 1
    for i, (step, call) in enumerate(zip(steps, session.calls, strict=True)):
        if step.keep is not None:
            base, chain = _cut(base, chain, step.keep)
        prompt = base.extend(ids[pos : pos + step.new])
        pos += step.new
        base = prompt.extend(ids[pos : pos + step.output])
        pos += step.output
        chain += [prompt, base]
        tool_s = call.tool_seconds if i < last and call.tool_seconds is not None else 0.0
        calls.append(ReplayCall(i, prompt, base, step.output, tool_s, call.tool_kind))
    return tuple(calls)


def _token_ids(seed: int, label: str, n: int, vocab_size: int) -> list[int]:
    """``n`` random token ids in ``[0, vocab_size)``, deterministic in (seed, label)."""
    entropy = [seed % 2**64, zlib.crc32(label.encode()), len(label), zlib.adler32(label.encode())]
    rng = np.random.default_rng(entropy)
    ids: list[int] = rng.integers(0, vocab_size, size=n, dtype=np.int64).tolist()
    return ids


def _unique_ids(sessions: Sequence[TraceSession]) -> list[str]:
    """Session ids, with ``~2``, ``~3`` ... added to repeats (one task run by two models)."""
    seen: dict[str, int] = {}
    out = []
    for s in sessions:
        seen[s.session_id] = seen.get(s.session_id, 0) + 1
        k = seen[s.session_id]
        out.append(s.session_id if k == 1 else f"{s.session_id}~{k}")
    return out


def _shared_prefix(sessions: Sequence[TraceSession], scale: float, requested: int | None) -> int:
    cap = min(_scaled(s.calls[0].prompt_tokens, scale) for s in sessions) - 1
    if requested is None:
        cached = [s.calls[0].cached_tokens or 0 for s in sessions]
        return max(0, min(cap, round(statistics.median(cached) * scale)))
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise BadRequest(f"shared_prefix_tokens must be an integer >= 0, got {requested!r}")
    if requested > cap:
        raise BadRequest(
            f"shared_prefix_tokens={requested} must leave at least one new token in the "
            f"smallest first prompt ({cap + 1} tokens after scaling); pass at most {cap}"
        )
    return requested


def _replay_sessions(
    ordered: Sequence[TraceSession],
    models: Sequence[str],
    starts: Sequence[float],
    shared: int,
    seed: int,
    scale: float,
    vocab_size: int,
) -> tuple[list[ReplaySession], int]:
    """The replay sessions (models round-robin over ``ordered``) and their history resets."""
    prefixes = {m: TokenSeq(_token_ids(seed, f"prefix\x00{m}", shared, vocab_size)) for m in models}
    out, resets = [], 0
    for k, (session, sid) in enumerate(zip(ordered, _unique_ids(ordered), strict=True)):
        model = models[k % len(models)]
        steps, n_resets = _plan(session, scale, shared)
        resets += n_resets
        n_ids = sum(st.new + st.output for st in steps)
        ids = _token_ids(seed, f"session\x00{sid}", n_ids, vocab_size)
        calls = _build_calls(session, steps, prefixes[model], ids)
        out.append(ReplaySession(sid, model, starts[k], calls, session.source))
    return out, resets


def _check_build_args(
    models: Sequence[str], seed: int, token_scale: float, vocab_size: int
) -> tuple[str, ...]:
    names = tuple(models) if not isinstance(models, str) else (models,)
    if not names or any(not isinstance(m, str) or not m for m in names):
        raise BadRequest(f"models must be one or more non-empty names, got {models!r}")
    if len(set(names)) != len(names):
        raise BadRequest(f"models must not repeat a name, got {list(names)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    if not _finite(token_scale) or not 0 < token_scale <= 100:
        raise BadRequest(f"token_scale must be in (0, 100], got {token_scale!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise BadRequest(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    return names


def _describe(
    trace: str, sessions: Sequence[TraceSession], built: ReplaySet, table: ToolTimeTable
) -> str:
    parts = [f"{trace}: {len(built.sessions)} sessions, {built.n_calls} calls"]
    marks = [m for m in (_PREFIX_MARK.search(s.source) for s in sessions) if m is not None]
    if marks:
        kept, orig = sum(int(m.group(1)) for m in marks), sum(int(m.group(2)) for m in marks)
        parts.append(f"{len(marks)} sessions truncated to a prefix ({kept} of {orig} calls kept)")
    if built.history_resets:
        parts.append(f"{built.history_resets} history resets (prompt shorter than the history)")
    if built.token_scale != 1.0:
        parts.append(f"token counts scaled by {built.token_scale:g}")
    parts.append(f"shared prefix {built.shared_prefix_tokens} tokens per model")
    if built.tool_times_filled:
        parts.append(f"{built.tool_times_filled} tool times drawn from {table.source or 'table'}")
    parts.append(f"arrival {built.arrival.describe()}, seed {built.seed}")
    return "; ".join(parts)


def build_replay_set(
    sessions: Sequence[TraceSession],
    models: Sequence[str],
    arrival: Arrival,
    seed: int,
    token_scale: float = 1.0,
    vocab_size: int = 32000,
    shared_prefix_tokens: int | None = None,
    *,
    tool_table: ToolTimeTable | None = None,
    trace: str = "trace",
) -> ReplaySet:
    """The replay set of ``sessions`` (deterministic in ``seed``; inputs are not changed).

    - Order: sessions sorted by (id, source, model), then shuffled with ``seed``; models are
      assigned round-robin in that order and start times drawn from ``arrival`` in it.
      Repeated ids get ``~2``, ``~3`` ... appended.
    - Tokens: every count is multiplied by ``token_scale`` and rounded, keeping at least one
      output token and one new token per call. Ids are random in ``[0, vocab_size)``; prompt
      ``i`` = prompt ``i-1`` + output ``i-1`` + new tokens, built with ``TokenSeq.extend``
      (see :func:`_plan` for histories the agent cut; they are counted in
      ``history_resets``).
    - Shared prefix: every session of one model starts with the same ``shared_prefix_tokens``
      ids (the system prompt and task preamble); different models get different ids. By
      default it is the median ``cached_tokens`` of the sessions' first calls (the provider
      found that much already cached from other sessions: 320 tokens in the published
      traces), capped to leave one new token in the smallest first prompt.
    - Tool gaps: missing tool times (except each last call's) are drawn from ``tool_table``
      (default: the published per-kind percentiles) and counted in ``tool_times_filled``; a
      session's last call has ``tool_seconds = 0``.

    ``trace`` names the source in the set's description. Raises :class:`BadRequest` on bad
    arguments.
    """
    names = _check_build_args(models, seed, token_scale, vocab_size)
    if not sessions:
        raise BadRequest("no sessions to replay")
    table = tool_table if tool_table is not None else ToolTimeTable.published()
    filled, n_filled = fill_missing_tool_times(sessions, table, seed)
    ordered = sorted(filled, key=_key)
    random.Random(seed).shuffle(ordered)
    shared = _shared_prefix(ordered, token_scale, shared_prefix_tokens)
    starts = arrival.start_times(len(ordered), random.Random(f"arrival\x00{seed}"))
    out, resets = _replay_sessions(ordered, names, starts, shared, seed, token_scale, vocab_size)
    built = ReplaySet(
        sessions=tuple(out),
        models=names,
        seed=seed,
        trace=trace,
        arrival=arrival,
        tool_times_filled=n_filled,
        token_scale=float(token_scale),
        shared_prefix_tokens=shared,
        history_resets=resets,
        truncated_sessions=sum(1 for s in ordered if _PREFIX_MARK.search(s.source)),
    )
    return attrs.evolve(built, trace=_describe(trace, ordered, built, table))
