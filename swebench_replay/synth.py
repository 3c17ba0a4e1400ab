"""Synthetic agent sessions drawn from the statistics of the published SWE-bench traces.

For workloads larger than (or without) the real traces. Each session is a chain of calls
whose prompts grow as the real ones do: prompt ``i`` = prompt ``i-1`` + output ``i-1`` + new
tokens (tool observation and the next instruction). The defaults of :class:`SynthStats` are
measured on ``shared/traces`` (132 sessions, 10,422 calls, mini-swe-agent 2.2.7, SWE-bench
Lite):

- calls per session: log-normal, median 73, log-sd 0.46 (real: median 73-74, log-sd 0.46);
- first prompt (system prompt + task): log-normal, median 1,600 tokens, log-sd 0.21 (real:
  median 1,604, range 1,390-3,399). The first ``system_prompt_tokens`` = 320 are shared by
  every session (the median provider-reported ``cached_tokens`` of real first calls);
- output: log-normal, median 90 tokens, log-sd 0.92 (real: median 90, log-sd 0.92);
- new tokens per turn: log-normal, median 180, log-sd 1.11. Real new tokens have median
  123, but they rise with the previous output (a long edit gets a long observation); drawn
  independently, median 180 reproduces the real per-turn prompt growth: median ~320 tokens
  (real 322), mean ~470 (real 454);
- tool kinds: the step counts of ``tool_time_by_kind.json``; tool times drawn from its
  per-kind percentiles (:class:`~talaria.swebench_replay.traces.ToolTimeTable`).
"""

from __future__ import annotations

import math
import random

import attrs

from talaria import validators as valid
from talaria.errors import ConfigError
from talaria.swebench_replay.traces import ToolKind, ToolTimeTable, TraceCall, TraceSession

_PUBLISHED_KIND_COUNTS: tuple[tuple[ToolKind, float], ...] = (
    (ToolKind.SHELL_READ_EDIT, 7321.0),
    (ToolKind.PYTHON_SCRIPT, 2262.0),
    (ToolKind.TESTS, 316.0),
    (ToolKind.INSTALL, 289.0),
    (ToolKind.OTHER, 107.0),
)


def _sigma(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 <= value <= 5:
        raise ConfigError(f"SynthStats.{attr.name} must be a log-sd in [0, 5], got {value!r}")


def _weights(value: object) -> tuple[tuple[ToolKind, float], ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"SynthStats.tool_kind_weights must be (kind, weight) pairs: {value!r}")
    return tuple((ToolKind(k), float(w)) for k, w in value)


@attrs.frozen
class SynthStats:
    """Distributions of synthetic sessions (token counts in tokens); see the module docstring.

    Log-normal draws are ``median * exp(sigma * N(0, 1))``. A session ends after its drawn
    number of calls, or earlier when the next prompt would exceed ``max_prompt_tokens``.
    """

    calls_median: float = attrs.field(default=73.0, validator=valid.positive)
    calls_sigma: float = attrs.field(default=0.46, validator=_sigma)
    calls_min: int = attrs.field(default=5, validator=valid.positive_int)
    calls_max: int = attrs.field(default=250, validator=valid.positive_int)
    first_prompt_median: float = attrs.field(default=1600.0, validator=valid.positive)
    first_prompt_sigma: float = attrs.field(default=0.21, validator=_sigma)
    system_prompt_tokens: int = attrs.field(default=320, validator=valid.positive_int)
    output_median: float = attrs.field(default=90.0, validator=valid.positive)
    output_sigma: float = attrs.field(default=0.92, validator=_sigma)
    new_tokens_median: float = attrs.field(default=180.0, validator=valid.positive)
    new_tokens_sigma: float = attrs.field(default=1.11, validator=_sigma)
    max_prompt_tokens: int = attrs.field(default=128_000, validator=valid.positive_int)
    tool_kind_weights: tuple[tuple[ToolKind, float], ...] = attrs.field(
        default=_PUBLISHED_KIND_COUNTS, converter=_weights
    )

    def __attrs_post_init__(self) -> None:
        if self.calls_min > self.calls_max:
            raise ConfigError(
                f"SynthStats.calls_min ({self.calls_min}) exceeds calls_max ({self.calls_max})"
            )
        if self.system_prompt_tokens >= self.first_prompt_median:
            raise ConfigError(
                f"SynthStats.system_prompt_tokens ({self.system_prompt_tokens}) must be below "
                f"first_prompt_median ({self.first_prompt_median})"
            )
        if self.max_prompt_tokens <= 2 * self.first_prompt_median:
            raise ConfigError(
                f"SynthStats.max_prompt_tokens ({self.max_prompt_tokens}) must exceed twice "
                f"first_prompt_median ({self.first_prompt_median})"
            )
        kinds = [k for k, _ in self.tool_kind_weights]
        weights = [w for _, w in self.tool_kind_weights]
        if len(set(kinds)) != len(kinds):
            raise ConfigError("SynthStats.tool_kind_weights names a tool kind twice")
        if any(not math.isfinite(w) or w < 0 for w in weights) or not sum(weights) > 0:
            raise ConfigError(
                "SynthStats.tool_kind_weights must be finite, >= 0, with a positive sum"
            )


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _session(rng: random.Random, stats: SynthStats, table: ToolTimeTable) -> list[TraceCall]:
    """The calls of one session (the last call has no tool after it: ``tool_seconds=None``)."""
    n_calls = round(_lognormal(rng, stats.calls_median, stats.calls_sigma))
    n_calls = min(max(n_calls, stats.calls_min), stats.calls_max)
    kinds = [k for k, _ in stats.tool_kind_weights]
    weights = [w for _, w in stats.tool_kind_weights]
    first = round(_lognormal(rng, stats.first_prompt_median, stats.first_prompt_sigma))
    prompt = max(first, stats.system_prompt_tokens + 1)
    cached = stats.system_prompt_tokens
    calls: list[TraceCall] = []
    for i in range(n_calls):
        output = max(1, round(_lognormal(rng, stats.output_median, stats.output_sigma)))
        kind = rng.choices(kinds, weights)[0]
        calls.append(
            TraceCall(
                prompt_tokens=prompt,
                cached_tokens=cached,
                output_tokens=output,
                tool_kind=kind,
                tool_seconds=table.sample(kind, rng) if i < n_calls - 1 else None,
            )
        )
        new = max(1, round(_lognormal(rng, stats.new_tokens_median, stats.new_tokens_sigma)))
        if prompt + output + new > stats.max_prompt_tokens:
            calls[-1] = attrs.evolve(calls[-1], tool_seconds=None)  # the context is full: stop
            break
        cached = prompt + output
        prompt = prompt + output + new
    return calls


def synthesize(
    n_sessions: int,
    seed: int,
    stats: SynthStats | None = None,
    model: str = "synthetic",
    tool_table: ToolTimeTable | None = None,
) -> list[TraceSession]:
    """``n_sessions`` synthetic sessions, deterministic in ``seed``.

    Session ``k`` draws from its own generator seeded by ``(seed, k)``, so the first sessions
    are the same whatever ``n_sessions`` is. ``tool_table`` defaults to the published
    per-kind percentiles. Ids are ``synth-<seed>-<k>``; ``llm_seconds`` is ``None``.
    """
    if isinstance(n_sessions, bool) or not isinstance(n_sessions, int) or n_sessions < 0:
        raise ConfigError(f"n_sessions must be a non-negative integer, got {n_sessions!r}")
    if not model:
        raise ConfigError("model must be a non-empty name")
    stats = stats if stats is not None else SynthStats()
    table = tool_table if tool_table is not None else ToolTimeTable.published()
    sessions = []
    for k in range(n_sessions):
        rng = random.Random(f"talaria-synth\x00{seed}\x00{k}")
        sessions.append(
            TraceSession(
                session_id=f"synth-{seed}-{k:04d}",
                source=f"synthetic(seed={seed})",
                agent="talaria synth",
                model=model,
                exit_status=None,
                calls=tuple(_session(rng, stats, table)),
            )
        )
    return sessions
