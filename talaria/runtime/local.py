"""One instance driven step by step in the caller's thread: for tests, scripts and benchmarks.

:class:`LocalInstance` is the smallest driver of the executor protocol
(:mod:`talaria.executor`): it owns an :class:`~talaria.core.instance.InstanceCore`, the
records of its calls and an executor, and each ``step`` is plan -> execute -> commit, with
the calls' records growing from what the executor sampled. The live loop
(:mod:`talaria.runtime.live`) does the same for many instances under load, with routing,
streaming and failures; this one has none of that. A call ends at one of its model's end
ids (``eos_token_ids``) or at its answer length.

Not thread-safe: one caller drives it.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from typing import Final, Generic, TypeVar

from talaria.core.instance import InstanceCore
from talaria.errors import BadRequest
from talaria.executor import CallRecord, Executor, Work
from talaria.generation import SamplingParams
from talaria.memory.kv import CallKey
from talaria.schedule import Executed, Placement, Request, Schedule
from talaria.types import Call

__all__ = ["LocalInstance", "commit_executed"]

E = TypeVar("E", bound=Executor)

MAX_STEPS: Final = 100_000
STAGE_POLL_S: Final = 0.001  # how often ``generate`` looks whether a stage it waits on landed


def commit_executed(
    core: InstanceCore,
    sched: Schedule,
    done: Executed,
    now: float,
    records: Mapping[CallKey, CallRecord],
    stopped: Collection[CallKey],
) -> list[Request]:
    """Grow the records by what ``done`` sampled, then report it to ``core``; returns the
    calls that finished (the one commit every driver of an executor shares)."""
    logprobs = dict(done.logprobs)
    for req, token in done.sampled:
        rec = records.get(req.key)
        if rec is not None:
            rec.add(token, logprobs.get(req.key))
    outputs = {key: rec.outputs for key, rec in records.items()}
    return core.commit(sched, done, now, outputs=outputs, stopped=stopped)


class LocalInstance(Generic[E]):
    """An instance core and its executor, stepped by the caller (module docstring)."""

    def __init__(
        self,
        core: InstanceCore,
        executor: E,
        eos_token_ids: Mapping[str, Collection[int]] | None = None,
    ) -> None:
        self.core = core
        self.executor = executor
        self.eos = {m: frozenset(ids) for m, ids in (eos_token_ids or {}).items()}
        self.records: dict[CallKey, CallRecord] = {}
        self._dropped: list[CallKey] = []

    @property
    def idle(self) -> bool:
        """The core holds no call."""
        return self.core.idle

    def submit(
        self,
        call: Call,
        now: float,
        known_tokens: int = 0,
        params: SamplingParams | None = None,
        *,
        vocab_limit: int | None = None,
        forced: tuple[int, ...] | None = None,
    ) -> Request:
        """Queue ``call`` (up to ``call.max_new_tokens`` tokens, greedy unless ``params``
        say otherwise; exactly ``forced`` if given). Raises ``BadRequest`` for a token id
        outside the model's vocabulary and the core's errors (``ContextTooLong``,
        ``UnknownModel``) before anything is queued."""
        ids = call.prompt.tokens()
        vocab = self.executor.vocab_size(call.model)
        bad = next((t for t in ids if t >= vocab), None) if vocab is not None else None
        if bad is not None:
            raise BadRequest(
                f"call {call.key}: token id {bad} is outside {call.model}'s vocabulary of {vocab}"
            )
        req = Request(call, None, call.max_new_tokens, now, known_tokens=known_tokens)
        self.core.submit(req)
        how = params or SamplingParams(max_tokens=call.max_new_tokens, temperature=0.0)
        self.records[call.key] = CallRecord(call.key, call.model, ids, how, vocab_limit, forced)
        return req

    def take_output(self, key: CallKey) -> tuple[int, ...]:
        """The ids a call generated; its record is dropped (the executor hears at its next
        step)."""
        rec = self.records.pop(key)
        self._dropped.append(key)
        return tuple(rec.outputs)

    def step(self, now: float) -> list[Request]:
        """One plan -> execute -> commit; returns the calls that finished in it."""
        sched = self.core.schedule(now)
        return self.run(sched, now)

    def run(self, sched: Schedule, now: float) -> list[Request]:
        """Execute and commit ``sched``, which ``core.schedule`` just made."""
        return self.commit(sched, self.executor.execute(self.work(sched)), now)

    def commit(self, sched: Schedule, done: Executed, now: float) -> list[Request]:
        """Report ``done`` (``sched`` executed) to the core; returns the calls it finished."""
        eos = self.eos.get(sched.step.model, frozenset()) if sched.step is not None else ()
        stopped = {req.key for req, token in done.sampled if token in eos}
        return commit_executed(self.core, sched, done, now, self.records, stopped)

    def work(self, sched: Schedule) -> Work:
        """``sched`` as the executor takes it (the calls dropped since the last step go too)."""
        dropped, self._dropped = tuple(self._dropped), []
        calls = {key: self.records[key] for key in sched.requests if key in self.records}
        return Work(sched, Placement.of(self.core, sched), calls, dropped)

    def generate(
        self,
        calls: Iterable[Call],
        now: float = 0.0,
        tick_s: float = 0.01,
        max_steps: int = MAX_STEPS,
    ) -> dict[CallKey, tuple[int, ...]]:
        """Submit ``calls`` and step (the clock moving ``tick_s`` a step) until each has
        finished; returns each call's generated ids. While the core waits for a background
        stage to land, each step sleeps a little instead of spinning."""
        keys = [self.submit(call, now).key for call in calls]
        pending = set(keys)
        for _ in range(max_steps):
            if not pending:
                break
            sched = self.core.schedule(now)
            for req in self.run(sched, now):
                pending.discard(req.key)
            if sched.waiting_for_stage:
                time.sleep(STAGE_POLL_S)  # the next step reports the stage once it landed
            now += tick_s
        else:
            raise RuntimeError(f"calls {sorted(pending)} did not finish in {max_steps} steps")
        return {key: self.take_output(key) for key in keys}
