"""The serving side of a Ray instance: the ``Substrate`` whose execute runs in an actor.

:class:`RaySubstrate` keeps the instance's :class:`~talaria.runtime.instance.InstanceCore`
in the serving process (the router, the session table and every decision stay there) and
executes each schedule by one call to its actor (:class:`~talaria.backends.ray.actor.
InstanceWorker`): a call's prompt goes with the first schedule that runs it, then each
schedule carries its plan and block tables only; the actor answers with the sampled ids,
which this substrate appends to its ``outputs`` as the embedded runner does.

Loss: an actor that does not answer a step within ``step_timeout_s``, or whose process or
node is gone (Ray's actor errors), raises :class:`~talaria.errors.InstanceLost`; so does a
health ping (every ``health_every_s``, from ``plan``) that fails or goes unanswered for
``step_timeout_s``, so an idle instance is noticed too. An error raised by the engine inside
the actor is an ordinary failed step (``RuntimeError``). ``restart`` re-attaches: Ray
restarts a lost actor on a node with the instance's resource free (the node back, or one
that joined), the actor reloads its models, and the substrate serves the fresh core it is
given.

Threading as the protocol says: ``plan``, ``commit``, ``prepare``, ``take_output`` and
``forget`` on the event loop, ``execute`` and ``restart`` on a worker thread; the calls to
drop and the set of calls the actor holds are shared between them under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import ray
import ray.exceptions

from talaria.backends.ray.actor import Layout, WorkerInfo, layout_of
from talaria.backends.ray.wire import NewCall, WireResult, WireSchedule
from talaria.errors import ConfigError, InstanceLost
from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.runtime.instance import InstanceCore
from talaria.runtime.substrate import commit_schedule
from talaria.schedule import Executed, Placement, Request, Schedule

__all__ = ["RaySubstrate"]

STEP_TIMEOUT_S: Final = 60.0  # a step unanswered this long: the instance is lost
PING_TIMEOUT_S: Final = 20.0  # a ping unanswered this long: lost (a dead node or a partition)
HEALTH_EVERY_S: Final = 1.0  # how often the actor is pinged, between steps and during one
ATTACH_TIMEOUT_S: Final = 600.0  # loading the models on a (re)started actor

# the actor (or its process, or its node) is gone, or will not answer
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
)


class RaySubstrate:
    """One instance: its core here, its engine in ``actor`` (a Ray actor handle of an
    ``InstanceWorker`` that was attached: ``info``)."""

    def __init__(
        self,
        core: InstanceCore,
        actor: Any,
        info: WorkerInfo,
        *,
        step_timeout_s: float = STEP_TIMEOUT_S,
        health_every_s: float = HEALTH_EVERY_S,
        ping_timeout_s: float = PING_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = core
        self.actor = actor
        self.step_timeout_s = step_timeout_s
        self.ping_timeout_s = min(ping_timeout_s, step_timeout_s)
        self.health_every_s = health_every_s
        self._clock = clock
        self.info = self._checked(info, core)
        self.outputs: dict[CallKey, list[int]] = {}
        self.logprobs: dict[CallKey, list[TokenLogprob]] = {}
        self._prepared: dict[
            CallKey, tuple[SamplingParams, int | None, tuple[int, ...] | None, int]
        ]
        self._prepared = {}
        self._lock = threading.Lock()
        self._shipped: set[CallKey] = set()  # calls whose prompt the actor holds
        self._drops: list[CallKey] = []  # calls the actor may forget, sent with the next step
        self._ping: Any = None  # the health ping in flight
        self._ping_s = clock()
        self.steps = 0
        self.wire_s = 0.0  # seconds the steps spent beyond the actor's own execution

    @staticmethod
    def _checked(info: WorkerInfo, core: InstanceCore) -> WorkerInfo:
        want: Layout = layout_of(core)
        if info.layout != want:
            raise ConfigError(
                f"instance {core.spec.name}: the actor's memory layout {info.layout} is not "
                f"the serving core's {want} (different models, dtype or budgets on that node)"
            )
        return info

    # ------------------------------------------------------------------ protocol
    @property
    def core(self) -> InstanceCore:
        return self._core

    @property
    def idle(self) -> bool:
        return self._core.idle

    @property
    def executes_kv_moves(self) -> bool:
        """The actor copies the planned KV moves block by block, as the embedded engine."""
        return True

    @property
    def eos(self) -> Mapping[str, Collection[int]]:
        return self.info.eos_token_ids

    def vocab_size(self, model: str) -> int | None:
        return self.info.vocab_sizes.get(model)

    def prepare(
        self,
        key: CallKey,
        params: SamplingParams,
        vocab_limit: int | None = None,
        forced: Sequence[int] | None = None,
        resumed: int = 0,
    ) -> None:
        pinned = tuple(forced) if forced is not None else None
        self._prepared[key] = (params, vocab_limit, pinned, resumed)
        self.outputs.setdefault(key, [])

    def plan(self, now: float) -> Schedule:
        """The core's next decision; first the health ping (``InstanceLost`` when the
        actor is gone)."""
        self._check_health()
        return self._core.schedule(now)

    def execute(self, sched: Schedule) -> Executed:
        """One round trip: the schedule to the actor, the sampled ids back."""
        wire = self._wire(sched)
        started = time.perf_counter()
        result: WireResult = self._await_step(self.actor.execute.remote(wire))
        self.steps += 1
        self.wire_s += time.perf_counter() - started
        sampled: list[tuple[Request, int]] = []
        for key, token in result.sampled:
            req = sched.requests[key]
            self.outputs.setdefault(key, []).append(token)
            sampled.append((req, token))
        for key, entry in result.logprobs:
            self.logprobs.setdefault(key, []).append(entry)
        failed = tuple((sched.requests[key], why) for key, why in result.failed)
        return Executed(tuple(sampled), failed)

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        ends: Callable[[Request, int], bool] | None = None,
    ) -> list[Request]:
        eos = self.eos.get(sched.step.model, ()) if sched.step is not None else ()
        return commit_schedule(
            self._core,
            sched,
            done,
            now,
            self.outputs,
            ends or (lambda _req, token: token in eos),
            stage_copied=True,
        )

    def take_output(self, key: CallKey) -> tuple[int, ...]:
        out = tuple(self.outputs.pop(key, ()))
        self.forget(key)
        return out

    def forget(self, key: CallKey) -> None:
        self.outputs.pop(key, None)
        self.logprobs.pop(key, None)
        self._prepared.pop(key, None)
        with self._lock:
            if key in self._shipped:
                self._shipped.discard(key)
                self._drops.append(key)

    def restart(self, core: InstanceCore) -> None:
        """Re-attach the actor (Ray restarted it, or it never died: then its calls' state is
        dropped); ``InstanceLost`` while it is still gone. Then serve ``core``."""
        info = self._get(self.actor.attach.remote(), ATTACH_TIMEOUT_S)
        self.info = self._checked(info, core)
        with self._lock:
            self._shipped.clear()
            self._drops.clear()
        self.outputs.clear()
        self.logprobs.clear()
        self._prepared.clear()
        self._ping = None
        self._core = core

    # ------------------------------------------------------------------ internals
    def _wire(self, sched: Schedule) -> WireSchedule:
        blocks = []
        new = []
        with self._lock:
            drops, self._drops = tuple(self._drops), []
            for key, req in sched.requests.items():
                blocks.append((key, req.blocks))
                if key not in self._shipped:
                    self._shipped.add(key)
                    new.append(self._new_call(req))
        return WireSchedule(
            kv_moves=sched.kv_moves,
            step=sched.step,
            switch=sched.switch,
            stage=sched.stage,
            placement=Placement.of(self._core, sched),
            blocks=tuple(blocks) if sched.step is not None else (),
            new=tuple(new),
            drop=drops,
        )

    def _new_call(self, req: Request) -> NewCall:
        params, vocab_limit, forced, resumed = self._prepared.get(req.key, (None, None, None, 0))
        return NewCall(
            req.key,
            req.call.model,
            req.call.prompt.tokens(),
            req.target_output,
            params,
            vocab_limit,
            forced,
            resumed,
        )

    def _await_step(self, ref: Any) -> Any:
        """A step's answer; meanwhile the actor keeps being pinged (it answers pings beside a
        step), so a node that dies or is cut off is lost after ``ping_timeout_s``, not after
        the step timeout, which bounds a step that is only slow."""
        started = self._clock()
        while True:
            ready, _ = ray.wait([ref], timeout=min(0.5, self.health_every_s))
            if ready:
                return self._get(ref, 0.0)
            self._check_health()
            if self._clock() - started > self.step_timeout_s:
                raise InstanceLost(
                    f"instance {self._core.spec.name}: no answer to a step in "
                    f"{self.step_timeout_s:g} s"
                )

    def _check_health(self) -> None:
        now = self._clock()
        if self._ping is None:
            if now - self._ping_s >= self.health_every_s:
                self._ping, self._ping_s = self.actor.ping.remote(), now
            return
        ready, _ = ray.wait([self._ping], timeout=0)
        if ready:
            ping, self._ping = self._ping, None
            self._get(ping, 0.0)
        elif now - self._ping_s > self.ping_timeout_s:
            self._ping = None
            raise InstanceLost(
                f"instance {self._core.spec.name}: no answer to a ping in {self.ping_timeout_s:g} s"
            )

    def _get(self, ref: Any, timeout_s: float) -> Any:
        name = self._core.spec.name
        try:
            return ray.get(ref, timeout=timeout_s if timeout_s > 0 else None)
        except _LOST as exc:
            raise InstanceLost(
                f"instance {name}: its Ray actor is gone ({type(exc).__name__})"
            ) from exc
        except ray.exceptions.RayTaskError as exc:  # the engine raised inside the actor
            raise RuntimeError(f"instance {name}: {exc.cause!r}") from exc
