"""The serving side of a Ray instance: the ``Executor`` whose execute runs in an actor.

:class:`RayExecutor` executes each work of an instance whose core stays in the serving
process (the router, the session table and every decision stay there) by one call to its
actor (:class:`~talaria.backends.ray.actor.InstanceWorker`): a call's prompt and sampling
params go with the first work that runs it, then each work carries its plan and block tables
only; the actor answers with the sampled ids.

Loss: an actor that does not answer a step within ``step_timeout_s``, or whose process or
node is gone (Ray's actor errors), raises :class:`~talaria.errors.InstanceLost`; so does a
health ping (every ``health_every_s``, before each step and while one runs) that fails or
goes unanswered for ``ping_timeout_s``, so an idle instance is noticed at its next step.
An error raised by the engine inside the actor is an ordinary failed step
(``RuntimeError``). ``restart`` re-attaches: Ray restarts a lost actor on a node with the
instance's resource free (the node back, or one that joined), the actor reloads its models
into buffers of the layout it is sent.

Threading as the protocol says: ``execute`` and ``restart`` on a worker thread, one at a
time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import ray
import ray.exceptions

from talaria.backends.ray.actor import WorkerInfo
from talaria.backends.ray.wire import NewCall, WireResult, WireSchedule
from talaria.errors import ConfigError, InstanceLost
from talaria.executor import CallRecord, Layout, Work
from talaria.memory.kv import CallKey
from talaria.schedule import Executed, Request

__all__ = ["RayExecutor"]

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


class RayExecutor:
    """One instance's engine in ``actor`` (a Ray actor handle of an ``InstanceWorker`` that
    was attached with ``layout``: ``info``)."""

    def __init__(
        self,
        name: str,
        layout: Layout,
        actor: Any,
        info: WorkerInfo,
        *,
        step_timeout_s: float = STEP_TIMEOUT_S,
        health_every_s: float = HEALTH_EVERY_S,
        ping_timeout_s: float = PING_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.actor = actor
        self.step_timeout_s = step_timeout_s
        self.ping_timeout_s = min(ping_timeout_s, step_timeout_s)
        self.health_every_s = health_every_s
        self._clock = clock
        self.info = self._checked(info, layout)
        self._shipped: set[CallKey] = set()  # calls whose prompt the actor holds
        self._ping: Any = None  # the health ping in flight
        self._ping_s = clock()
        self.steps = 0
        self.wire_s = 0.0  # seconds the steps spent beyond the actor's own execution

    def _checked(self, info: WorkerInfo, layout: Layout) -> WorkerInfo:
        if info.layout != layout:
            raise ConfigError(
                f"instance {self.name}: the actor's memory layout {info.layout} is not "
                f"the serving core's {layout} (different models, dtype or budgets on that node)"
            )
        return info

    # ------------------------------------------------------------------ protocol
    @property
    def executes_kv_moves(self) -> bool:
        """Whether the actor's engine copies the planned KV moves (the embedded engine, block
        by block) or keeps its own cache (vLLM)."""
        return self.info.executes_kv_moves

    @property
    def eos(self) -> Mapping[str, Collection[int]]:
        return self.info.eos_token_ids

    def vocab_size(self, model: str) -> int | None:
        return self.info.vocab_sizes.get(model)

    def execute(self, work: Work) -> Executed:
        """One round trip: the work to the actor, the sampled ids back (first the health
        ping: ``InstanceLost`` when the actor is gone)."""
        self._check_health()
        if work.empty:
            return Executed()
        wire = self._wire(work)
        started = time.perf_counter()
        result: WireResult = self._await_step(self.actor.execute.remote(wire))
        self.steps += 1
        self.wire_s += time.perf_counter() - started
        reqs = work.schedule.requests
        sampled: tuple[tuple[Request, int], ...] = tuple(
            (reqs[key], token) for key, token in result.sampled
        )
        failed = tuple((reqs[key], why) for key, why in result.failed)
        return Executed(sampled, failed, result.logprobs, result.silent, result.cached)

    def restart(self, layout: Layout) -> None:
        """Re-attach the actor (Ray restarted it, or it never died: then its calls' state is
        dropped); ``InstanceLost`` while it is still gone."""
        info = self._get(self.actor.attach.remote(layout), ATTACH_TIMEOUT_S)
        self.info = self._checked(info, layout)
        self._shipped.clear()
        self._ping = None

    # ------------------------------------------------------------------ internals
    def _wire(self, work: Work) -> WireSchedule:
        sched = work.schedule
        self._shipped.difference_update(work.dropped)
        blocks = []
        new = []
        for key, req in sched.requests.items():
            blocks.append((key, req.blocks))
            if key not in self._shipped:
                self._shipped.add(key)
                new.append(_new_call(req, work.calls.get(key)))
        return WireSchedule(
            kv_moves=sched.kv_moves,
            step=sched.step,
            switch=sched.switch,
            stage=sched.stage,
            placement=work.where,
            blocks=tuple(blocks) if sched.step is not None else (),
            new=tuple(new),
            drop=work.dropped,
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
                    f"instance {self.name}: no answer to a step in {self.step_timeout_s:g} s"
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
                f"instance {self.name}: no answer to a ping in {self.ping_timeout_s:g} s"
            )

    def _get(self, ref: Any, timeout_s: float) -> Any:
        name = self.name
        try:
            return ray.get(ref, timeout=timeout_s if timeout_s > 0 else None)
        except _LOST as exc:
            raise InstanceLost(
                f"instance {name}: its Ray actor is gone ({type(exc).__name__})"
            ) from exc
        except ray.exceptions.RayTaskError as exc:  # the engine raised inside the actor
            raise RuntimeError(f"instance {name}: {exc.cause!r}") from exc


def _new_call(req: Request, rec: CallRecord | None) -> NewCall:
    if rec is None:
        return NewCall(req.key, req.call.model, req.call.prompt.tokens(), req.target_output)
    return NewCall(
        req.key,
        req.call.model,
        rec.prompt,
        req.target_output,
        rec.params,
        rec.vocab_limit,
        rec.forced,
        rec.resumed,
    )
