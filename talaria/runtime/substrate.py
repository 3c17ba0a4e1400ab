"""The substrate protocol: what the live cluster loop calls to execute one instance.

An instance's decisions come from its :class:`~talaria.runtime.instance.InstanceCore`; a
substrate executes them. The loop drives every substrate the same way, in three phases, so
that routing never races a running step:

* ``plan(now) -> Schedule`` on the event loop: asks the core for the next decision (the
  substrate may fold in its own events first: a background stage that finished);
* ``execute(schedule) -> Executed`` on a worker thread: the device work (KV moves, weight
  switch or stage, the forward, sampling); touches only the substrate's own state and the
  schedule's captured requests, never the core;
* ``commit(schedule, executed, now, ends) -> finished`` on the event loop: reports to the
  core; ``ends(request, token)`` says whether a sampled token ends its call (stop strings
  and end ids, which the loop's stop checkers know).

A call is announced with ``prepare`` before its first step (how to sample it, and, for a
replay, the exact answer ids to emit); its generated ids accumulate in ``outputs`` and are
taken once with ``take_output`` (or dropped with ``forget``). The embedded PyTorch engine
(``talaria.engine.runner.EngineRunner``) is one substrate; a vLLM engine set is the next.
A substrate whose instance lives in another process (``talaria.backends.ray``) raises
:class:`~talaria.errors.InstanceLost` when that process is gone; the loop then re-routes what
it can and, once the process is back (its memory empty), hands the substrate a fresh core
with ``restart``. :func:`commit_schedule` is the commit every substrate shares;
:class:`SubstrateWrapper` defers every call to another substrate, for the ones that only
watch or alter a few (a replay's switch log, a test's vanishing instance).

Nothing here imports a tensor library. Not thread-safe beyond the split above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.schedule import Executed, Request, Schedule

if TYPE_CHECKING:
    from talaria.runtime.instance import InstanceCore

__all__ = ["Substrate", "SubstrateWrapper", "commit_schedule"]


class Substrate(Protocol):
    @property
    def core(self) -> InstanceCore: ...

    @property
    def idle(self) -> bool:
        """Nothing running, nothing to report (a background copy finished or none)."""
        ...

    @property
    def executes_kv_moves(self) -> bool:
        """Whether the core's planned KV moves really run here (the embedded engine copies
        them; vLLM manages its own cache, so the loop does not count them as moved)."""
        ...

    @property
    def outputs(self) -> Mapping[CallKey, Sequence[int]]:
        """Generated ids of the calls in flight (read on the event loop between phases)."""
        ...

    @property
    def logprobs(self) -> Mapping[CallKey, Sequence[TokenLogprob]]:
        """Of the calls in flight whose params ask for logprobs: one entry per generated id,
        in ``outputs`` order (read on the event loop between phases)."""
        ...

    def vocab_size(self, model: str) -> int | None:
        """Token ids ``model`` accepts (None: not served here)."""
        ...

    def prepare(
        self,
        key: CallKey,
        params: SamplingParams,
        vocab_limit: int | None = None,
        forced: Sequence[int] | None = None,
        resumed: int = 0,
    ) -> None:
        """Announce a call: sample it with ``params`` (ids below ``vocab_limit`` only), or
        emit exactly ``forced`` (a replay's answer; the forward still runs). ``resumed``:
        the prompt's last ``resumed`` ids are the call's own answer so far, drawn on an
        instance that was lost; the substrate continues it as if it had never moved
        (exactly, where its sampling can: see each substrate)."""
        ...

    def plan(self, now: float) -> Schedule: ...

    def execute(self, sched: Schedule) -> Executed: ...

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        ends: Callable[[Request, int], bool] | None = None,
    ) -> list[Request]: ...

    def take_output(self, key: CallKey) -> tuple[int, ...]: ...

    def forget(self, key: CallKey) -> None: ...

    def restart(self, core: InstanceCore) -> None:
        """After ``InstanceLost``: serve ``core`` (a fresh core of the same instance: no
        weights resident, no KV) from now on, every call's state dropped. Raises
        ``InstanceLost`` while the instance is still gone (the loop tries again later)."""
        ...


class SubstrateWrapper:
    """A substrate that defers everything to ``inner``; subclasses override what they
    watch or change. Adds no state and no locking of its own."""

    def __init__(self, inner: Substrate) -> None:
        self.inner = inner

    @property
    def core(self) -> InstanceCore:
        return self.inner.core

    @property
    def idle(self) -> bool:
        return self.inner.idle

    @property
    def executes_kv_moves(self) -> bool:
        return self.inner.executes_kv_moves

    @property
    def outputs(self) -> Mapping[CallKey, Sequence[int]]:
        return self.inner.outputs

    @property
    def logprobs(self) -> Mapping[CallKey, Sequence[TokenLogprob]]:
        return self.inner.logprobs

    def vocab_size(self, model: str) -> int | None:
        return self.inner.vocab_size(model)

    def prepare(
        self,
        key: CallKey,
        params: SamplingParams,
        vocab_limit: int | None = None,
        forced: Sequence[int] | None = None,
        resumed: int = 0,
    ) -> None:
        self.inner.prepare(key, params, vocab_limit, forced, resumed)

    def plan(self, now: float) -> Schedule:
        return self.inner.plan(now)

    def execute(self, sched: Schedule) -> Executed:
        return self.inner.execute(sched)

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        ends: Callable[[Request, int], bool] | None = None,
    ) -> list[Request]:
        return self.inner.commit(sched, done, now, ends)

    def take_output(self, key: CallKey) -> tuple[int, ...]:
        return self.inner.take_output(key)

    def forget(self, key: CallKey) -> None:
        self.inner.forget(key)

    def restart(self, core: InstanceCore) -> None:
        self.inner.restart(core)


def commit_schedule(
    core: InstanceCore,
    sched: Schedule,
    done: Executed,
    now: float,
    outputs: Mapping[CallKey, Sequence[int]],
    ends: Callable[[Request, int], bool],
    stage_copied: bool,
) -> list[Request]:
    """:meth:`InstanceCore.commit` for a substrate whose sampled tokens end a call when
    ``ends(request, token)`` says so (the loop's stop checkers, or the model's end ids)."""
    stopped = {req.key for req, token in done.sampled if ends(req, token)}
    return core.commit(
        sched, done, now, outputs=outputs, stopped=stopped, stage_copied=stage_copied
    )
