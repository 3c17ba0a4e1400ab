"""The live cluster loop: the cluster core and real engines on anyio, with the wall clock.

:class:`LiveCluster` is the simulator's event loop made real. Calls are routed by the same
:class:`~talaria.core.cluster.ClusterCore` (router, admission with soft reservations,
round scheduler with session-prefill); each instance has one driver task that asks its
core for the next decision, executes it on a worker thread (the tensors), and reports back.
Only the executor (a :class:`~talaria.executor.Executor` per instance: the embedded
engine's ``EngineRunner``, vLLM engines, an engine in a Ray actor) and the clock differ from
the simulation. This module imports no tensor library.

Ownership and locking: the loop owns every core and every call's record. Every mutation of
the cluster core, instance cores, session table and call records happens on the event loop
thread (``submit``, ``event``, ``cancel`` and the driver tasks' plan and commit); the worker
thread runs the executor's ``execute`` only, which reads the work's records and touches the
device, never the core. Aborts of a call (client gone, failure) are applied by its
instance's driver between steps. No lock is needed beyond that rule. The loop's thread runs
no torch: what builds an engine runs on a thread that exits (:mod:`talaria.engine.threads`),
so the worker's OpenMP team is the only one alive while steps run.

A call's tokens reach its caller through an unbounded memory stream of :class:`Delta`,
then one :class:`Finished` or :class:`Failed`. Text is produced by the call's
:class:`~talaria.generation.StopChecker` (stop strings, end tokens, max tokens).

Sessions: a session starts with its first call; ``event(..., END)`` ends it and returns its
completion time. Sessions whose clients never send ``end`` expire after ``session_idle_s``
without a call. A call whose session has one in flight waits for it (calls of one session
are sequential, as an agent's are).

Keep-alive: an instance with no call asks its core when it scales to zero
(``InstanceCore.release_at``, the policy's ``keep_alive_s``; never by default); then its KV
is demoted to host for real and the next call there switches its model in again, as in the
simulator. The engine keeps its preallocated device memory: on this machine giving it back
is bookkeeping, the reload and the restore are real.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from talaria.clock import Clock, WallClock
from talaria.core.cluster import ClusterCore
from talaria.core.instance import InstanceCore
from talaria.errors import (
    BadRequest,
    CallFailed,
    InstanceFailed,
    InstanceLost,
    ShuttingDown,
    TalariaError,
    UnknownSession,
)
from talaria.executor import CallRecord, Executor, Work
from talaria.generation import SamplingParams, StopChecker
from talaria.memory.kv import CallKey
from talaria.policy.gaps import check_hint_s, check_seconds
from talaria.runtime.driver import Driver
from talaria.runtime.gate import AdmissionGate
from talaria.runtime.local import commit_executed
from talaria.runtime.sessions import LiveSession, SessionSummary
from talaria.runtime.step_log import STEP_LOG, StepTiming
from talaria.runtime.streams import Delta, Event, Failed, Finished, LiveCall, deliver, log_call
from talaria.schedule import Executed, Placement, Request, Schedule
from talaria.types import Call, EventKind, HintFields, SessionKey, TokenSeq

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # an instance with work it may not start yet re-checks this often
IDLE_WAIT_S = 0.25  # an instance with no work wakes this often (staging, reservations)
MAX_CONSECUTIVE_FAILURES = 3  # an instance failing this many steps in a row is taken out
RECOVER_AFTER_S = 5.0  # a downed instance is checked and brought back after this long ...
RECOVER_MAX_S = 300.0  # ... doubling each time it goes down again, up to this
DEFAULT_MAX_CALLS = 1024  # calls in flight (queued or running) the loop takes at most


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
        runners: Mapping[str, Executor],
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
        self.drivers = {name: Driver(r, backoff_s=recover_after_s) for name, r in runners.items()}
        self.calls: dict[CallKey, LiveCall] = {}
        self.sessions: dict[SessionKey, LiveSession] = {}
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
        self.kv_bytes_moved = 0  # KV block bytes copied by the executors (offload, restore)
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
    def session(self, session: SessionKey) -> LiveSession:
        """The live session (created on first use)."""
        s = self.sessions.get(session)
        if s is None:
            now = self.clock.now()
            s = self.sessions[session] = LiveSession(now, now)
        return s

    async def submit(
        self,
        session: SessionKey,
        model: str,
        prompt: TokenSeq,
        params: SamplingParams,
        checker: StopChecker,
        *,
        vocab_limit: int | None = None,
        forced: tuple[int, ...] | None = None,
    ) -> tuple[LiveCall, MemoryObjectReceiveStream[Event]]:
        """Route one call and queue it. Raises the typed errors of routing (unknown model,
        context too long, token outside the vocabulary) and the admission gate's
        ``TooManyRequests`` (:class:`~talaria.runtime.gate.AdmissionGate`: the server's or the
        tenant's share of calls, the tenant's token budget, its open sessions), before
        anything changes; the caller must hold the session's lock (``session(key).lock``)
        until the call ends. The session's tenant is the key's.

        ``forced`` (trace replay) makes the call answer exactly these token ids, one per
        step, whatever the logits say: the engine does the same work, and the session's next
        prompt (which the trace built from this answer) finds its prefix cached."""
        cap = params.cap  # BadRequest when unresolved
        if forced is not None and len(forced) < cap:
            raise BadRequest(f"forced answer of {len(forced)} ids < max_tokens {cap}")
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; retry on another server")
        now = self.clock.now()
        cost = len(prompt) + cap
        tenant = session.tenant
        known = self.sessions.get(session)
        opens = known is None or (known.calls == 0 and known.in_flight == 0)
        try:
            self.gate.admit(
                tenant,
                cost,
                now,
                (lc.call.tenant for lc in self.calls.values()),
                (k.tenant for k, s in self.sessions.items() if s.calls) if opens else None,
            )
            sess = self.session(session)
            call = Call(session.id, sess.calls, model, prompt, cap, None, tenant, now)
            self._check_vocab(call)
            inst, req, _ = self.core.place(call, cap, None, now)
        except TalariaError:
            if opens:
                self.sessions.pop(session, None)  # nothing was started under this id
            raise
        self.gate.charge(tenant, cost, now)
        name = inst.spec.name
        record = CallRecord(call.key, model, prompt.tokens(), params, vocab_limit, forced)
        send, receive = anyio.create_memory_object_stream[Event](math.inf)
        lc = LiveCall(call, req, name, record, checker, send)
        self.calls[call.key] = lc
        sess.calls += 1
        sess.in_flight += 1
        sess.last_s = now
        self._kick(name)
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
        self, session: SessionKey, kind: EventKind, **hint: Unpack[HintFields]
    ) -> SessionSummary | None:
        """A client hint. ``UnknownSession`` if the session never sent a call or ended.
        Returns the session's summary on ``END``."""
        unknown = hint.keys() - HintFields.__annotations__.keys()
        if unknown:  # as a keyword-only signature would refuse them
            raise TypeError(f"event() got unexpected hint fields {sorted(unknown)}")
        expected_s, measured_s = hint.get("expected_s"), hint.get("measured_s")
        check_hint_s("expected_s", expected_s)
        check_seconds("measured_s", measured_s)
        sess = self.sessions.get(session)
        if sess is None:
            raise UnknownSession(
                f"unknown session {session.id!r}: send a call with this session id first "
                "(sessions also end after an 'end' event or when idle too long)"
            )
        now = self.clock.now()
        self.core.event(
            session, kind, expected_s, now, tool=hint.get("tool"), measured_s=measured_s
        )
        self.events[kind.value] = self.events.get(kind.value, 0) + 1
        for d in self.drivers.values():
            d.wake.set()
        if kind is not EventKind.END:
            sess.last_s = now
            return None
        return self._end(session, sess, now, expired=False)

    def tool_calls(self, session: SessionKey, tools: Sequence[str]) -> None:
        """The session's last answer ended in calls of ``tools`` (the API parsed them): its
        gap is theirs, predicted and learned under their names without a client hint
        (``ClusterCore.tool_calls``). Nothing for a session that ended or never called."""
        info = self.core.sessions.get(session)
        if session not in self.sessions or info is None or info.ended:
            return
        self.core.tool_calls(session, tools, self.clock.now())
        for d in self.drivers.values():
            d.wake.set()

    def _end(
        self, session: SessionKey, sess: LiveSession, now: float, expired: bool
    ) -> SessionSummary:
        del self.sessions[session]
        self.core.forget(session)
        self.ended_sessions += 1
        self.expired_sessions += expired
        summary = SessionSummary(session.id, now - sess.start_s, sess.calls, expired)
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

    async def until_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until every instance's driver waits for work: a replay starts its clock
        there, as a simulated run starts with idle instances (a call placed on a driver
        busy with its start-up plans at that driver's next step, not at once)."""
        with anyio.fail_after(timeout_s):
            while not all(d.idle for d in self.drivers.values()):
                await anyio.sleep(0.001)

    def _kick(self, name: str) -> None:
        """A call was placed on ``name``: an idle instance plans its next schedule now, as
        the simulator does, so calls routed after it in the same tick (a burst) see the
        switch it starts. A plan that raises takes the instance down, as in the driver."""
        d = self.drivers[name]
        if d.idle and d.planned is None and not d.down and not d.aborts:
            try:
                d.planned = self.core.instances[name].schedule(self.clock.now())
            except Exception as exc:
                log.exception("instance %s stopped: planning a placed call failed", name)
                self._take_down(name, exc)
        d.wake.set()

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
        continues. The new executor catches the call's sampling up with those ids (the
        record's ``resumed``): greedy and seeded answers come out exactly as without the loss
        (on the embedded engine; vLLM's sampler goes on afresh). False (nothing changed) when
        there is nothing left to generate or no instance can take it.
        """
        old, rec = lc.instance, lc.record
        streamed = tuple(rec.outputs[: lc.sent_tokens])
        left = rec.params.cap - len(streamed)
        if left <= 0:
            return False
        c = lc.call
        call = Call(c.session_id, c.index, c.model, c.prompt.extend(streamed), left, None,
                    c.tenant, c.arrival_s)  # fmt: skip
        with contextlib.suppress(Exception):  # the lost core is discarded at restart
            self.core.instances[old].abort(lc.key, str(cause))
        self.drivers[old].dropped.append(lc.key)
        try:
            inst, req, _ = self.core.place(call, left, None, self.clock.now())
        except TalariaError:
            return False
        forced = rec.forced[len(streamed) :] if rec.forced is not None else None
        params = attrs.evolve(rec.params, max_tokens=left)
        done = rec.resumed + len(streamed)
        lc.record = CallRecord(
            lc.key, c.model, call.prompt.tokens(), params, rec.vocab_limit, forced, done
        )
        lc.call, lc.req, lc.instance = call, req, inst.spec.name
        lc.sent_tokens, lc.sent_logprobs = 0, 0
        self.calls_resumed += 1
        self._kick(lc.instance)
        return True

    def _reroute(self, lc: LiveCall, cause: InstanceLost) -> None:
        """Move a call that streamed nothing from its lost instance to another one (routed
        afresh, its arrival time kept); with no healthy instance left it fails."""
        old = lc.instance
        with contextlib.suppress(Exception):  # the lost core is discarded at restart
            self.core.instances[old].abort(lc.key, str(cause))
        self.drivers[old].dropped.append(lc.key)
        lc.record.outputs.clear()
        lc.record.logprobs.clear()
        try:
            inst, req, _ = self.core.place(lc.call, lc.params.cap, None, self.clock.now())
        except TalariaError as exc:
            self.calls.pop(lc.key, None)
            self.calls_failed += 1
            self._session_done(lc.key[0])
            deliver(lc, Failed(exc))
            lc.send.close()
            return
        lc.instance, lc.req = inst.spec.name, req
        self.calls_rerouted += 1
        self._kick(lc.instance)

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
        """Plan on the loop, execute on a thread, commit on the loop. With nothing to do the
        executor still gets the (empty) work between waits: the calls to drop, and a chance
        to report what happened meanwhile (a stage landed, its process was lost). A plan
        made at a placement (``_kick``) is in flight: aborts wait until it ran."""
        d = self.drivers[name]
        while True:
            sched, d.planned = d.planned, None  # a plan from a placement runs first
            if sched is not None and d.down:  # taken down before it ran
                self._abandon(name, sched)
                sched = None
            if sched is None:
                self._apply_aborts(d)
                if d.down:
                    await self._recover(name, d)
                    continue
                sched = self.core.instances[name].schedule(self.clock.now())
            inst = self.core.instances[name]
            work = self._work(name, sched)
            started, loop_cpu = self.clock.now(), time.thread_time()
            try:
                done = await anyio.to_thread.run_sync(d.runner.execute, work, limiter=d.limiter)
                elapsed = self.clock.now() - started
                # the loop's own Python work meanwhile holds the GIL the step's ops need
                loop_cpu = time.thread_time() - loop_cpu
            except InstanceLost:
                self._abandon(name, sched)
                raise
            except Exception as exc:  # the instance failed: its calls fail, others go on
                log.exception("instance %s failed a step", name)
                d.dropped.extend(work.dropped)
                self._step_failed(name, d, sched, exc)
                continue
            self._committed(name, sched, done)
            if sched.empty:
                wait = self._keep_alive(d, inst) if inst.idle else IDLE_POLL_S
                if wait > 0:
                    await d.wait(wait)
                continue
            d.failures, d.idle_since = 0, None
            self._timed(name, d, sched, started, elapsed, loop_cpu)
            await anyio.lowlevel.checkpoint()

    def _keep_alive(self, d: Driver, inst: InstanceCore) -> float:
        """The instance has no call: once its keep-alive runs out (``release_at``) it
        scales to zero, and its KV demotions run as the next schedule. Returns how long to
        wait before looking again (0: the demotions are planned)."""
        now = self.clock.now()
        if inst.released:  # at zero (a pool that scales to zero starts there): nothing to give
            return IDLE_WAIT_S
        if d.idle_since is None:
            d.idle_since = now
        at = inst.release_at(d.idle_since, now)
        if at > now:
            return min(IDLE_WAIT_S, at - now)
        if not inst.can_scale_to_zero() or d.planned is not None:
            return IDLE_WAIT_S
        demotions = inst.scale_to_zero()
        d.idle_since = None
        if not len(demotions):
            return IDLE_WAIT_S
        d.planned = Schedule(kv_moves=(demotions,))
        return 0.0

    def _work(self, name: str, sched: Schedule) -> Work:
        """``sched`` as the executor takes it: where it sits, its calls' records, and the
        calls ended since the last step."""
        d, inst = self.drivers[name], self.core.instances[name]
        dropped, d.dropped = tuple(d.dropped), []
        calls = {k: self.calls[k].record for k in sched.requests if k in self.calls}
        return Work(sched, Placement.of(inst, sched), calls, dropped)

    def _timed(
        self, name: str, d: Driver, sched: Schedule, started: float, elapsed: float, loop: float
    ) -> None:
        est = self.core.instances[name].estimator
        self.steps.append(StepTiming.of(name, sched, started, elapsed, est, loop))
        if d.runner.executes_kv_moves:
            self.kv_bytes_moved += sum(m.nbytes for m in sched.kv_moves)
            if sched.step is not None:
                self.kv_bytes_moved += sum(m.nbytes for m in sched.step.kv_moves)

    def _committed(self, name: str, sched: Schedule, done: Executed) -> None:
        stopped: set[CallKey] = set()
        for req, token in done.sampled:  # each token through its call's stop checker
            lc = self.calls.get(req.key)
            if lc is None:
                continue
            update = lc.checker.update(token)
            if update.text:
                lc.text.append(update.text)
            if update.finish_reason is not None:
                stopped.add(req.key)
        for req, why in done.failed:  # released first: the core commits the rest
            self._fail(name, req.key, CallFailed(f"sampling this call failed ({why})"))
        records = {req.key: self.calls[req.key].record for req, _ in done.sampled
                   if req.key in self.calls}  # fmt: skip
        inst = self.core.instances[name]
        finished = commit_executed(inst, sched, done, self.clock.now(), records, stopped)
        for req, _ in done.sampled:
            self._send_delta(req.key)
        for req in finished:
            self._finished(name, req)

    def _send_delta(self, key: CallKey) -> None:
        lc = self.calls.get(key)
        if lc is None:
            return
        out, every = lc.record.outputs, lc.record.logprobs
        text = "".join(lc.text)
        lc.text.clear()
        ids = tuple(out[lc.sent_tokens :])
        lc.sent_tokens = len(out)
        logprobs = tuple(every[lc.sent_logprobs :])
        lc.sent_logprobs = len(every)
        if text or ids:
            deliver(lc, Delta(text, ids, logprobs))

    def _finished(self, name: str, req: Request) -> None:
        self.core.on_finished(req)
        self.tokens_recomputed += req.recomputed_tokens
        self.drivers[name].dropped.append(req.key)
        lc = self.calls.pop(req.key, None)
        if lc is None:
            return
        out = lc.record.outputs
        self._session_done(req.call.session)
        reason = lc.checker.finish_reason or ("stop" if req.stopped else "length")
        arrival = req.call.arrival_s
        first = req.first_token_s if req.first_token_s is not None else req.finished_s
        prompt_len = req.prompt_len - lc.resumed  # a resumed call's prompt ends with its ids
        done = Finished(
            reason,
            prompt_len,
            lc.resumed + len(out),
            min(prompt_len, req.reused_tokens + req.restored_tokens),
            name,
            (first or arrival) - arrival,
            (req.finished_s or arrival) - arrival,
            lc.checker.stop_string,
        )
        log_call(req.key, req.call.model, done)
        deliver(lc, done)
        lc.send.close()

    def _session_done(self, session: SessionKey) -> None:
        sess = self.sessions.get(session)
        if sess is not None:
            sess.in_flight -= 1
            sess.last_s = self.clock.now()

    def _fail(self, name: str, key: CallKey, error: TalariaError) -> None:
        """Release ``key`` from its instance and tell its caller."""
        inst = self.core.instances[name]
        inst.abort(key, str(error))
        self.drivers[name].dropped.append(key)
        lc = self.calls.pop(key, None)
        self.calls_failed += 1
        if lc is not None:
            self._session_done(key[0])
            deliver(lc, Failed(error))
            lc.send.close()

    def _apply_aborts(self, d: Driver) -> None:
        aborts, d.aborts = d.aborts, []
        for key, error in aborts:
            lc = self.calls.get(key)
            if lc is not None:
                self._fail(lc.instance, key, error)

    def _step_failed(self, name: str, d: Driver, sched: Schedule, exc: Exception) -> None:
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

    def _mark_down(self, name: str, d: Driver) -> None:
        if not d.down:
            d.down = True
            d.downs += 1
            self.core.mark_down(name)

    async def _recover(self, name: str, d: Driver) -> None:
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
        d.failures, d.idle_since = 0, None
        self.core.mark_up(name)
        log.warning("instance %s is back in service", name)

    async def _rejoin(self, name: str, d: Driver) -> None:
        """A lost instance asks its executor to restart every ``recover_after_s`` (its
        process came back, or its actor was placed on a node that joined); then it serves a
        fresh core, its memory empty, and is routed to again."""
        await anyio.sleep(self.recover_after_s)
        fresh = self.core.fresh_instance(name)
        try:
            await anyio.to_thread.run_sync(d.runner.restart, fresh.layout, limiter=d.limiter)
        except InstanceLost as exc:
            log.info("instance %s is still gone: %s", name, exc)
            return
        self.core.replace_instance(fresh)
        d.lost = d.down = False
        d.failures = 0
        d.dropped.clear()  # the restarted executor holds no call
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
            revived = set(d.dropped) & mine
            if revived:
                raise RuntimeError(
                    f"instance {name}: calls {sorted(revived)} run but are to be dropped"
                )
