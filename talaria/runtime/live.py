"""The live cluster loop: the cluster core and real engines on anyio, with the wall clock.

:class:`LiveCluster` is the simulator's event loop made real. Calls are routed by the same
:class:`~talaria.runtime.cluster.ClusterCore` (router, admission with soft reservations,
round scheduler with session-prefill); each instance has one driver task that asks its
core for the next decision, executes it on a worker thread (the tensors), and reports back.
Only the substrate (a :class:`~talaria.runtime.substrate.Substrate` per instance: the
embedded engine's ``EngineRunner``, or any engine that plans, executes and commits the same
way) and the clock differ from the simulation. This module imports no tensor library.

Ownership and locking: every mutation of the cluster core, instance cores and session table
happens on the event loop thread (``submit``, ``event``, ``cancel`` and the driver tasks'
``plan`` / ``commit``); the worker thread runs the substrate's ``execute`` only, which
touches the device and the substrate's outputs, never the core. Aborts of a call (client
gone, failure) are applied by its instance's driver between steps. No lock is needed beyond
that rule.

A call's tokens reach its caller through an unbounded memory stream of :class:`Delta`,
then one :class:`Finished` or :class:`Failed`. Text is produced by the call's
:class:`~talaria.generation.StopChecker` (stop strings, end tokens, max tokens).

Sessions: a session starts with its first call; ``event(..., END)`` ends it and returns its
completion time. Sessions whose clients never send ``end`` expire after ``session_idle_s``
without a call. A call whose session has one in flight waits for it (calls of one session
are sequential, as an agent's are).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from talaria.clock import Clock, WallClock
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import price
from talaria.errors import (
    BadRequest,
    CallFailed,
    InstanceFailed,
    InstanceLost,
    ShuttingDown,
    TalariaError,
    UnknownSession,
)
from talaria.generation import SamplingParams, StopChecker
from talaria.memory.kv import CallKey
from talaria.policy.gaps import check_hint_s, check_seconds
from talaria.runtime.cluster import ClusterCore
from talaria.runtime.gate import AdmissionGate
from talaria.runtime.instance import Request, Schedule
from talaria.runtime.sessions import LiveSession, SessionSummary
from talaria.runtime.streams import Delta, Event, Failed, Finished, LiveCall, deliver
from talaria.runtime.substrate import Substrate
from talaria.schedule import Executed
from talaria.types import Call, EventKind, SessionId, TokenSeq

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # an instance with work it may not start yet re-checks this often
IDLE_WAIT_S = 0.25  # an instance with no work wakes this often (staging, reservations)
MAX_CONSECUTIVE_FAILURES = 3  # an instance failing this many steps in a row is taken out
RECOVER_AFTER_S = 5.0  # a downed instance is checked and brought back after this long ...
RECOVER_MAX_S = 300.0  # ... doubling each time it goes down again, up to this
STEP_LOG = 100_000  # executed schedules remembered for inspection (StepTiming)
DEFAULT_MAX_CALLS = 1024  # calls in flight (queued or running) the loop takes at most


@attrs.frozen
class StepTiming:
    """One executed schedule: what it did and how long the substrate took (seconds)."""

    instance: str
    start_s: float
    seconds: float
    model: str | None
    prefill_tokens: int
    decodes: int
    context_tokens: int
    switch_bytes: int
    stage_bytes: int
    kv_bytes: int
    predicted_s: float  # the simulator's price of it (``talaria.cost.pricing``), serial part

    @classmethod
    def of(
        cls, instance: str, sched: Schedule, start_s: float, seconds: float, est: Estimator
    ) -> StepTiming:
        step = sched.step
        moves = list(sched.kv_moves) + (list(step.kv_moves) if step is not None else [])
        kv = sum(m.nbytes for m in moves)
        # the simulator's price of the same schedule: a stage runs alongside, not in series
        predicted = price(est, sched).serial_s
        return cls(
            instance,
            start_s,
            seconds,
            step.model if step is not None else None,
            step.prefill_tokens if step is not None else 0,
            len(step.decode) if step is not None else 0,
            step.decode_context_tokens if step is not None else 0,
            sched.switch.total_bytes if sched.switch is not None else 0,
            sched.stage.total_bytes if sched.stage is not None else 0,
            kv,
            predicted,
        )


@attrs.define
class _Driver:
    runner: Substrate
    wake: anyio.Event = attrs.field(factory=anyio.Event)
    aborts: list[tuple[CallKey, TalariaError]] = attrs.field(factory=list)
    failures: int = 0
    down: bool = False
    backoff_s: float = 0.0  # wait before the next recovery attempt (set by the cluster)
    downs: int = 0  # times taken out of service
    lost: bool = False  # its process is gone (InstanceLost): it comes back with restart
    limiter: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))


class LiveCluster:
    """Routes calls into instance cores and drives one engine runner per instance.

    Use as ``async with LiveCluster(...) as live:``; leaving the block shuts down gracefully
    (calls in flight get ``shutdown_grace_s`` to finish, then fail with ``ShuttingDown``).
    An instance taken out of service (a driver bug, or ``MAX_CONSECUTIVE_FAILURES`` failed
    steps) comes back after ``recover_after_s`` seconds once its state checks out, the wait
    doubling each time it goes down again (up to ``RECOVER_MAX_S``).
    """

    def __init__(
        self,
        core: ClusterCore,
        runners: Mapping[str, Substrate],
        *,
        clock: Clock | None = None,
        session_idle_s: float = 600.0,
        shutdown_grace_s: float = 30.0,
        on_session_end: Callable[[SessionSummary], None] | None = None,
        recover_after_s: float = RECOVER_AFTER_S,
        max_calls: int = DEFAULT_MAX_CALLS,
        max_calls_per_tenant: int | None = None,
        tokens_per_minute_per_tenant: int | None = None,
        max_sessions_per_tenant: int | None = None,
    ) -> None:
        if set(runners) != set(core.instances):
            raise BadRequest(
                f"runners {sorted(runners)} differ from instances {sorted(core.instances)}"
            )
        if not session_idle_s > 0:
            raise BadRequest(f"session_idle_s must be positive, got {session_idle_s}")
        self.core = core
        self.clock: Clock = clock or WallClock()
        self.session_idle_s = session_idle_s
        self.shutdown_grace_s = shutdown_grace_s
        self.on_session_end = on_session_end
        if not recover_after_s > 0:
            raise BadRequest(f"recover_after_s must be positive, got {recover_after_s}")
        self.gate = AdmissionGate(
            max_calls, max_calls_per_tenant, tokens_per_minute_per_tenant, max_sessions_per_tenant
        )
        self.recover_after_s = recover_after_s
        self.drivers = {name: _Driver(r, backoff_s=recover_after_s) for name, r in runners.items()}
        self.calls: dict[CallKey, LiveCall] = {}
        self.sessions: dict[SessionId, LiveSession] = {}
        self.accepting = False
        self.ended_sessions = 0
        self.expired_sessions = 0
        self.calls_failed = 0
        self.calls_rerouted = 0  # calls of a lost instance placed on another (none streamed)
        self.calls_resumed = 0  # calls of a lost instance that had streamed, resumed elsewhere
        # prompt tokens of finished calls their session had computed before, recomputed
        # because the KV was gone (evicted, or lost with its instance)
        self.tokens_recomputed = 0
        self.instances_lost = 0
        self.kv_bytes_moved = 0  # KV block bytes copied by the substrates (offload, restore)
        self.events: dict[str, int] = {}  # hint events accepted, by kind
        self.steps: collections.deque[StepTiming] = collections.deque(maxlen=STEP_LOG)
        self._tg: anyio.abc.TaskGroup | None = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> LiveCluster:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for name in self.drivers:
            self._tg.start_soon(self._drive, name, name=f"talaria-driver-{name}")
        self._tg.start_soon(self._expire_sessions, name="talaria-session-expiry")
        self.accepting = True
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.shutdown()
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        tg.cancel_scope.cancel()
        return await tg.__aexit__(*exc_info)

    async def shutdown(self) -> None:
        """Take no new calls; let calls in flight finish for up to ``shutdown_grace_s``;
        fail the rest with ``ShuttingDown``."""
        self.accepting = False
        with anyio.move_on_after(self.shutdown_grace_s):
            while self.calls:
                await anyio.sleep(0.05)
        for lc in list(self.calls.values()):
            self.cancel(lc.key, ShuttingDown("the server shut down before the call finished"))
        for d in self.drivers.values():
            self._apply_aborts(d)

    # ------------------------------------------------------------------ calls
    def session(self, session_id: SessionId) -> LiveSession:
        """The live session (created on first use)."""
        s = self.sessions.get(session_id)
        if s is None:
            now = self.clock.now()
            s = self.sessions[session_id] = LiveSession(now, now)
        return s

    async def submit(
        self,
        session_id: SessionId,
        model: str,
        prompt: TokenSeq,
        params: SamplingParams,
        checker: StopChecker,
        *,
        tenant: str = "default",
        vocab_limit: int | None = None,
        forced: tuple[int, ...] | None = None,
    ) -> tuple[LiveCall, MemoryObjectReceiveStream[Event]]:
        """Route one call and queue it. Raises the typed errors of routing (unknown model,
        context too long, token outside the vocabulary) and the admission gate's
        ``TooManyRequests`` (:class:`~talaria.runtime.gate.AdmissionGate`: the server's or the
        tenant's share of calls, the tenant's token budget, its open sessions), before
        anything changes; the caller must hold the session's lock (``session(id).lock``)
        until the call ends.

        ``forced`` (trace replay) makes the call answer exactly these token ids, one per
        step, whatever the logits say: the engine does the same work, and the session's next
        prompt (which the trace built from this answer) finds its prefix cached."""
        if forced is not None and len(forced) < params.max_tokens:
            raise BadRequest(f"forced answer of {len(forced)} ids < max_tokens {params.max_tokens}")
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; retry on another server")
        now = self.clock.now()
        cost = len(prompt) + params.max_tokens
        known = self.sessions.get(session_id)
        opens = known is None or (known.calls == 0 and known.in_flight == 0)
        try:
            self.gate.admit(
                tenant,
                cost,
                now,
                (lc.call.tenant for lc in self.calls.values()),
                (s.tenant for s in self.sessions.values() if s.tenant) if opens else None,
            )
            sess = self.session(session_id)
            call = Call(session_id, sess.calls, model, prompt, params.max_tokens, None, tenant, now)
            self._check_vocab(call)
            inst, req, _ = self.core.place(call, params.max_tokens, None, now)
        except TalariaError:
            if opens:
                self.sessions.pop(session_id, None)  # nothing was started under this id
            raise
        self.gate.charge(tenant, cost, now)
        sess.tenant = tenant
        name = inst.spec.name
        self.drivers[name].runner.prepare(call.key, params, vocab_limit, forced)
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        lc = LiveCall(call, req, name, params, checker, send, vocab_limit, forced)
        self.calls[call.key] = lc
        sess.calls += 1
        sess.in_flight += 1
        sess.last_s = now
        self._wake(name)
        return lc, receive

    def _check_vocab(self, call: Call) -> None:
        sizes = [d.runner.vocab_size(call.model) for d in self.drivers.values()]
        vocab = next((v for v in sizes if v is not None), None)
        if vocab is None:
            return  # the core raises UnknownModel
        bad = next((t for t in call.prompt.tokens() if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside {call.model}'s vocabulary of {vocab}")

    def cancel(self, key: CallKey, error: TalariaError | None = None) -> None:
        """Stop a call (its caller went away, or shutdown). Its instance drops it between
        steps; the caller's stream gets ``Failed(error)`` if an error is given."""
        lc = self.calls.get(key)
        if lc is None:
            return
        d = self.drivers[lc.instance]
        d.aborts.append((key, error or BadRequest("the client cancelled the call")))
        self._wake(lc.instance)

    # ------------------------------------------------------------------ events
    def event(
        self,
        session_id: SessionId,
        kind: EventKind,
        expected_s: float | None = None,
        *,
        tool: str | None = None,
        measured_s: float | None = None,
    ) -> SessionSummary | None:
        """A client hint. ``UnknownSession`` if the session never sent a call or ended.
        Returns the session's summary on ``END``."""
        check_hint_s("expected_s", expected_s)
        check_seconds("measured_s", measured_s)
        sess = self.sessions.get(session_id)
        if sess is None:
            raise UnknownSession(
                f"unknown session {session_id!r}: send a call with this session id first "
                "(sessions also end after an 'end' event or when idle too long)"
            )
        now = self.clock.now()
        self.core.event(session_id, kind, expected_s, now, tool=tool, measured_s=measured_s)
        self.events[kind.value] = self.events.get(kind.value, 0) + 1
        for d in self.drivers.values():
            d.wake.set()
        if kind is not EventKind.END:
            sess.last_s = now
            return None
        return self._end(session_id, sess, now, expired=False)

    def _end(
        self, session_id: SessionId, sess: LiveSession, now: float, expired: bool
    ) -> SessionSummary:
        del self.sessions[session_id]
        self.core.forget(session_id)
        self.ended_sessions += 1
        self.expired_sessions += expired
        summary = SessionSummary(session_id, now - sess.start_s, sess.calls, expired)
        if self.on_session_end is not None:
            self.on_session_end(summary)
        return summary

    async def _expire_sessions(self) -> None:
        period = min(10.0, self.session_idle_s / 4)
        while True:
            await anyio.sleep(period)
            now = self.clock.now()
            for sid, sess in list(self.sessions.items()):
                if sess.in_flight == 0 and now - sess.last_s > self.session_idle_s:
                    if self.core.sessions.get(sid) is not None:
                        self.core.event(sid, EventKind.END, None, now)
                    self._end(sid, sess, now, expired=True)

    # ------------------------------------------------------------------ drivers
    def _wake(self, name: str) -> None:
        self.drivers[name].wake.set()

    async def _idle(self, d: _Driver, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await d.wake.wait()
        d.wake = anyio.Event()

    async def _drive(self, name: str) -> None:
        """One instance's driver. A bug that escapes a step (in planning or committing,
        where the core's state can no longer be trusted) takes the instance out of routing
        and fails its calls; the other instances and the loop go on, and the instance comes
        back once its state checks out (``_recover``), so no input takes it down for ever."""
        while True:
            try:
                await self._drive_loop(name)
                return
            except InstanceLost as exc:
                log.error("instance %s lost: %s", name, exc)
                self._lose(name, exc)
            except Exception as exc:
                log.exception("instance %s stopped: its driver failed", name)
                self._take_down(name, exc)

    def _lose(self, name: str, exc: InstanceLost) -> None:
        """The instance's process is gone: out of routing at once; each of its calls that
        streamed nothing yet is routed to another instance (its session's KV is recomputed
        there), and each that streamed is resumed on another instance (``_resume``: its
        prompt plus what it streamed is prefilled there and the answer goes on); only a
        call that cannot be placed anywhere fails with ``InstanceLost``."""
        d = self.drivers[name]
        self._mark_down(name, d)
        d.lost = True
        self.instances_lost += 1
        error = InstanceLost(
            f"instance {name} was lost ({exc}) after the call had streamed tokens; retry it"
        )
        for lc in [lc for lc in self.calls.values() if lc.instance == name]:
            if lc.sent_tokens == 0 and lc.checker.num_tokens == 0:
                self._reroute(lc, exc)
            elif not self._resume(lc, exc):
                self._fail(name, lc.key, error)

    def _resume(self, lc: LiveCall, cause: InstanceLost) -> bool:
        """Move a call that had streamed from its lost instance to another one: its prompt
        becomes the prompt plus the ids it streamed, which the new instance prefills, and
        it goes on generating the rest of its budget there; the client's stream just
        continues. The new substrate catches the call's sampling up with those ids
        (``Substrate.prepare(resumed=...)``): greedy and seeded answers come out exactly as
        without the loss (on the embedded engine; vLLM's sampler goes on afresh). False
        (nothing changed) when there is nothing left to generate or no instance can take it.
        """
        old = lc.instance
        streamed = tuple(self.drivers[old].runner.outputs.get(lc.key, ()))[: lc.sent_tokens]
        done = lc.resumed + len(streamed)
        left = lc.params.max_tokens - done
        if left <= 0:
            return False
        c = lc.call
        call = Call(c.session_id, c.index, c.model, c.prompt.extend(streamed), left, None,
                    c.tenant, c.arrival_s)  # fmt: skip
        with contextlib.suppress(Exception):  # the lost core is discarded at restart
            self.core.instances[old].abort(lc.key, str(cause))
        self.drivers[old].runner.forget(lc.key)
        try:
            inst, req, _ = self.core.place(call, left, None, self.clock.now())
        except TalariaError:
            return False
        forced = lc.forced[done:] if lc.forced is not None else None
        params = attrs.evolve(lc.params, max_tokens=left)
        self.drivers[inst.spec.name].runner.prepare(
            lc.key, params, lc.vocab_limit, forced, resumed=done
        )
        lc.call, lc.req, lc.instance = call, req, inst.spec.name
        lc.resumed, lc.sent_tokens, lc.sent_logprobs = done, 0, 0
        self.calls_resumed += 1
        self._wake(lc.instance)
        return True

    def _reroute(self, lc: LiveCall, cause: InstanceLost) -> None:
        """Move a call that streamed nothing from its lost instance to another one (routed
        afresh, its arrival time kept); with no healthy instance left it fails."""
        old = lc.instance
        with contextlib.suppress(Exception):  # the lost core is discarded at restart
            self.core.instances[old].abort(lc.key, str(cause))
        self.drivers[old].runner.forget(lc.key)
        try:
            inst, req, _ = self.core.place(lc.call, lc.params.max_tokens, None, self.clock.now())
        except TalariaError as exc:
            self.calls.pop(lc.key, None)
            self.calls_failed += 1
            self._session_done(lc.key[0])
            deliver(lc, Failed(exc))
            lc.send.close()
            return
        lc.instance, lc.req = inst.spec.name, req
        self.drivers[lc.instance].runner.prepare(lc.key, lc.params, lc.vocab_limit, lc.forced)
        self.calls_rerouted += 1
        self._wake(lc.instance)

    def _take_down(self, name: str, exc: Exception) -> None:
        d = self.drivers[name]
        self._mark_down(name, d)
        error = InstanceFailed(
            f"instance {name} stopped ({type(exc).__name__}: {exc}); retry the call"
        )
        for lc in [lc for lc in self.calls.values() if lc.instance == name]:
            try:
                self._fail(name, lc.key, error)
            except Exception:  # its state is suspect: still tell the caller
                self.calls.pop(lc.key, None)
                self._session_done(lc.key[0])
                deliver(lc, Failed(error))
                lc.send.close()

    async def _drive_loop(self, name: str) -> None:
        """Plan on the loop, execute on a thread, commit on the loop."""
        d = self.drivers[name]
        runner = d.runner
        while True:
            self._apply_aborts(d)
            if d.down:
                await self._recover(name, d)
                continue
            sched = runner.plan(self.clock.now())
            if sched.empty:
                busy = not runner.idle
                await self._idle(d, IDLE_POLL_S if busy else IDLE_WAIT_S)
                continue
            started = self.clock.now()
            try:
                done = await anyio.to_thread.run_sync(runner.execute, sched, limiter=d.limiter)
            except InstanceLost:
                self._abandon(name, sched)
                raise
            except Exception as exc:  # the instance failed: its calls fail, others go on
                log.exception("instance %s failed a step", name)
                self._step_failed(name, d, sched, exc)
                continue
            d.failures = 0
            self.steps.append(
                StepTiming.of(
                    name, sched, started, self.clock.now() - started, runner.core.estimator
                )
            )
            if runner.executes_kv_moves:
                self.kv_bytes_moved += sum(m.nbytes for m in sched.kv_moves)
                if sched.step is not None:
                    self.kv_bytes_moved += sum(m.nbytes for m in sched.step.kv_moves)
            self._committed(name, sched, done)
            await anyio.lowlevel.checkpoint()

    def _committed(self, name: str, sched: Schedule, done: Executed) -> None:
        runner = self.drivers[name].runner
        ended: set[CallKey] = set()

        def ends(req: Request, token: int) -> bool:
            lc = self.calls.get(req.key)
            if lc is None:
                return False
            update = lc.checker.update(token)
            if update.text:
                lc.text.append(update.text)
            if update.finish_reason is not None:
                ended.add(req.key)
                return True
            return False

        for req, why in done.failed:  # released first: the core commits the rest
            self._fail(name, req.key, CallFailed(f"sampling this call failed ({why})"))
        finished = runner.commit(sched, done, self.clock.now(), ends)
        for req, _ in done.sampled:
            self._send_delta(req.key, runner)
        for req in finished:
            self._finished(name, req)

    def _send_delta(self, key: CallKey, runner: Substrate) -> None:
        lc = self.calls.get(key)
        if lc is None:
            return
        out = runner.outputs.get(key, [])
        text = "".join(lc.text)
        lc.text.clear()
        ids = tuple(out[lc.sent_tokens :])
        lc.sent_tokens = len(out)
        every = runner.logprobs.get(key, ())
        logprobs = tuple(every[lc.sent_logprobs :])
        lc.sent_logprobs = len(every)
        if text or ids:
            deliver(lc, Delta(text, ids, logprobs))

    def _finished(self, name: str, req: Request) -> None:
        runner = self.drivers[name].runner
        self.core.on_finished(req)
        self.tokens_recomputed += req.recomputed_tokens
        out = runner.take_output(req.key)
        lc = self.calls.pop(req.key, None)
        if lc is None:
            return
        self._session_done(req.call.session_id)
        reason = lc.checker.finish_reason or ("stop" if req.stopped else "length")
        arrival = req.call.arrival_s
        first = req.first_token_s if req.first_token_s is not None else req.finished_s
        prompt_len = req.prompt_len - lc.resumed  # a resumed call's prompt ends with its ids
        deliver(
            lc,
            Finished(
                reason,
                prompt_len,
                lc.resumed + len(out),
                min(prompt_len, req.reused_tokens + req.restored_tokens),
                name,
                (first or arrival) - arrival,
                (req.finished_s or arrival) - arrival,
                lc.checker.stop_string,
            ),
        )
        lc.send.close()

    def _session_done(self, session_id: SessionId) -> None:
        sess = self.sessions.get(session_id)
        if sess is not None:
            sess.in_flight -= 1
            sess.last_s = self.clock.now()

    def _fail(self, name: str, key: CallKey, error: TalariaError) -> None:
        """Release ``key`` from its instance and tell its caller."""
        inst = self.core.instances[name]
        inst.abort(key, str(error))
        self.drivers[name].runner.forget(key)
        lc = self.calls.pop(key, None)
        self.calls_failed += 1
        if lc is not None:
            self._session_done(key[0])
            deliver(lc, Failed(error))
            lc.send.close()

    def _apply_aborts(self, d: _Driver) -> None:
        aborts, d.aborts = d.aborts, []
        for key, error in aborts:
            lc = self.calls.get(key)
            if lc is not None:
                self._fail(lc.instance, key, error)

    def _step_failed(self, name: str, d: _Driver, sched: Schedule, exc: Exception) -> None:
        """Fail the calls of the step that raised; after ``MAX_CONSECUTIVE_FAILURES`` take the
        instance out of routing and fail everything it holds."""
        d.failures += 1
        self.core.instances[name].release(sched, self.clock.now())
        error = InstanceFailed(
            f"instance {name} failed while running the call ({type(exc).__name__}: {exc}); "
            "the call was released, retry it"
        )
        keys = list(sched.requests) if sched.step is not None else []
        if d.failures >= MAX_CONSECUTIVE_FAILURES:
            self._mark_down(name, d)
            keys = [lc.key for lc in self.calls.values() if lc.instance == name]
            log.error("instance %s taken out of service after %d failures", name, d.failures)
        for key in keys:
            if key in self.calls:
                self._fail(name, key, error)

    def _abandon(self, name: str, sched: Schedule) -> None:
        """A schedule whose instance was lost while it ran: the core hears its switch and
        stage ended (they never will), so its calls can be released."""
        with contextlib.suppress(Exception):
            self.core.instances[name].release(sched, self.clock.now())

    def _mark_down(self, name: str, d: _Driver) -> None:
        if not d.down:
            d.down = True
            d.downs += 1
            self.core.mark_down(name)

    async def _recover(self, name: str, d: _Driver) -> None:
        """A downed instance waits ``d.backoff_s`` (doubling up to ``RECOVER_MAX_S`` each
        time it goes down again), then comes back into routing if its memory managers'
        invariants hold and it holds no call; else it stays down and says why."""
        if d.lost:
            await self._rejoin(name, d)
            return
        await anyio.sleep(d.backoff_s)
        self._apply_aborts(d)
        inst = self.core.instances[name]
        d.backoff_s = min(2.0 * d.backoff_s, RECOVER_MAX_S)
        try:
            inst.check_integrity()
            if not inst.idle:
                raise RuntimeError(f"it still holds calls {sorted(inst.running)}")
        except Exception as exc:
            log.error("instance %s stays out of service: %s", name, exc)
            return
        d.down = False
        d.failures = 0
        self.core.mark_up(name)
        log.warning("instance %s is back in service", name)

    async def _rejoin(self, name: str, d: _Driver) -> None:
        """A lost instance asks its substrate to restart every ``recover_after_s`` (its
        process came back, or its actor was placed on a node that joined); then it serves a
        fresh core, its memory empty, and is routed to again."""
        await anyio.sleep(self.recover_after_s)
        fresh = self.core.fresh_instance(name)
        try:
            await anyio.to_thread.run_sync(d.runner.restart, fresh, limiter=d.limiter)
        except InstanceLost as exc:
            log.info("instance %s is still gone: %s", name, exc)
            return
        self.core.replace_instance(fresh)
        d.lost = d.down = False
        d.failures = 0
        self.core.mark_up(name)
        log.warning("instance %s rejoined with empty memory", name)

    # ------------------------------------------------------------------ inspection
    async def check_integrity_between_steps(self) -> None:
        """``check_integrity`` while no engine step runs (it waits for each instance's step
        in flight to end and holds the next back): safe under load, from the loop's thread."""
        async with contextlib.AsyncExitStack() as stack:
            for d in self.drivers.values():
                await stack.enter_async_context(d.limiter)
            self.check_integrity()

    def check_integrity(self) -> None:
        """Every memory manager's invariants, and no call tracked twice or leaked. Call it
        between steps (``check_integrity_between_steps`` waits for one to end)."""
        self.core.check_integrity()
        for name, d in self.drivers.items():
            inst = self.core.instances[name]
            held = set(inst.running) | {r.key for q in inst.waiting.values() for r in q}
            mine = {k for k, lc in self.calls.items() if lc.instance == name}
            if held != mine:
                raise RuntimeError(
                    f"instance {name}: core holds {sorted(held)} but the loop tracks {sorted(mine)}"
                )
            stray = set(d.runner.outputs) - mine
            if stray:
                raise RuntimeError(
                    f"instance {name}: outputs of finished calls kept: {sorted(stray)}"
                )
