"""The cluster core: routes calls to instance cores and keeps per-session state.

Pure like the instance cores: the live runtime drives it with the wall clock and real
engines, the simulator with a virtual clock and the cost model. Mutates its session table
and the chosen instance's queue; raises typed errors (``UnknownModel``, ``ContextTooLong``,
``UnknownSession``) before changing anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from talaria.config import ClusterConfig, PolicyConfig
from talaria.core.instance import InstanceCore
from talaria.cost.estimator import Estimator
from talaria.errors import ContextTooLong, Overloaded, UnknownSession
from talaria.policy.gaps import GapModel
from talaria.policy.remaining import SessionLengths
from talaria.policy.router import Decision, search
from talaria.schedule import Request
from talaria.types import Call, EventKind, SessionKey, TokenSeq

DEFAULT_EXPECTED_OUTPUT = 128  # tokens, before a session has answered once
UNTOLD_KEY = "untold"  # the learner's key for gaps no hint described (answer to next call)


class GapLearner(Protocol):
    """What the server learns tool gaps with (``talaria.session.GapPredictor`` is one):
    expected seconds per gap key, updated by observed durations. ``observe`` mutates."""

    def key_for(self, tool: str, command: str | None = None) -> str: ...

    def predict(self, key: str) -> float: ...

    def observe(self, key: str, observed_s: float) -> float: ...

    def follow(self, estimate_s: float | None, observed_s: float) -> float: ...

    def observations(self, key: str) -> int: ...

    def estimates(self) -> dict[str, float]: ...


@attrs.define
class Session:
    """One session as the cluster core knows it (keyed by ``SessionKey``: tenant and id):
    where it ran last, what it has computed, its gaps. Mutated by the core only."""

    model: str
    last_instance: str | None = None
    known_tokens: int = 0  # history the session has computed somewhere (prompt + answer)
    last_output: int = DEFAULT_EXPECTED_OUTPUT
    calls: int = 0
    ended: bool = False
    started_s: float | None = None  # when its first call arrived
    last_answer_s: float | None = None  # when its last call was answered
    gap_key: str | None = None  # the tool of the gap it is in (from tool_start)
    gap_start_s: float | None = None  # when that tool started (tool_start's time)
    hinted: bool = False  # a client's hint described the current gap
    gap_s: float | None = None  # its own hint-less gaps, by the learner's rule (``follow``)


class ClusterCore:
    """Router + instance cores + session table."""

    def __init__(
        self,
        cluster: ClusterConfig,
        policy: PolicyConfig,
        estimators: Mapping[str, Estimator],
        gaps: GapModel | None = None,
        learner: GapLearner | None = None,
    ) -> None:
        """``learner`` (optional) makes the server learn tool gaps: a ``tool_end``'s measured
        seconds (or the time since its ``tool_start``) per tool kind, and without hints the
        time from an answer to the session's next call (globally and per session); its
        predictions stand in for the hints a client did not send."""
        self.cluster = cluster
        self.policy = policy
        self.learner = learner
        self._estimators = dict(estimators)
        self._gaps = gaps
        self.instances: dict[str, InstanceCore] = {
            spec.name: InstanceCore(
                spec, cluster.models_on(spec), policy, estimators[spec.name], gaps
            )
            for spec in cluster.instances
        }
        self.sessions: dict[SessionKey, Session] = {}
        # calls per ended session, all models: a session's expected calls left, over which
        # the router shares the wake of an instance at zero (``PolicyConfig.wake_shared``)
        self.lengths = SessionLengths()
        self.decisions = 0
        self._hosts = {
            m.name: [self.instances[i.name] for i in cluster.instances_for(m.name)]
            for m in cluster.models
        }
        # the largest call every host of a model can take (prompt + answer tokens)
        self._fits_all = {
            m: min(inst.token_limit(m) for inst in hosts) for m, hosts in self._hosts.items()
        }

    def place(
        self, call: Call, target_output: int, history: TokenSeq | None, now: float
    ) -> tuple[InstanceCore, Request, Decision]:
        """Route ``call`` and queue it on the chosen instance."""
        self.cluster.model(call.model)  # UnknownModel
        info = self.sessions.get(call.session)
        if info is None or info.ended or info.model != call.model:
            info = Session(call.model)  # (a new model under an old id: a new session)
        candidates = self._candidates(call, target_output)
        decision = self._route(call, info, candidates, now)
        chosen = self.instances[decision.instance]
        if info.last_instance is not None and info.last_instance != decision.instance:
            self.instances[info.last_instance].forget_session(call.session, ended=False)
        if info.calls == 0:
            info.started_s = now
        req = Request(
            call,
            history,
            target_output,
            now,
            known_tokens=info.known_tokens,
            session_start_s=info.started_s,
        )
        chosen.submit(req)
        self._learn_untold_gap(info, now)
        info.last_instance = decision.instance
        info.calls += 1
        self.sessions[call.session] = info
        self.decisions += 1
        return chosen, req, decision

    def token_limit(self, model: str) -> int:
        """The largest call (prompt plus answer tokens) some healthy instance serving
        ``model`` can ever hold (0 when none is healthy)."""
        return max((inst.token_limit(model) for inst in self._hosts.get(model, ())), default=0)

    def _candidates(self, call: Call, target_output: int) -> list[InstanceCore]:
        """The instances whose KV pool and context can ever hold the call."""
        hosts = self._hosts[call.model]
        if not hosts:
            raise Overloaded(
                f"no healthy instance serves model {call.model!r} (every one failed); "
                "retry later or restart the server"
            )
        if call.prompt_tokens + target_output <= self._fits_all[call.model]:
            return hosts
        candidates = [inst for inst in hosts if inst.fits(call, target_output)]
        if not candidates:
            errors = []
            for inst in hosts:
                try:
                    inst.check_fits(call, target_output)
                except ContextTooLong as exc:
                    errors.append(str(exc))
            raise ContextTooLong("; ".join(errors))
        return candidates

    def _route(
        self, call: Call, info: Session, candidates: list[InstanceCore], now: float
    ) -> Decision:
        """The router's choice among the candidates (``talaria.policy.router.search``)."""
        return search(
            [inst.estimates for inst in candidates],
            call,
            now,
            self.policy,
            last_instance=info.last_instance,
            known_tokens=info.known_tokens,
            expected_output=info.last_output,
            calls_left=self.lengths.expected_left(info.calls),
        )

    def on_finished(self, req: Request) -> None:
        """A call was answered: remember its history, and give the instance the server's
        own prediction of the gap it starts (a client's hint replaces it)."""
        info = self.sessions.get(req.call.session)
        if info is None:
            return
        info.known_tokens = req.prompt_len + req.generated
        info.last_output = req.generated
        info.last_answer_s = req.finished_s
        info.gap_key, info.gap_start_s, info.hinted = None, None, False
        if self.learner is not None and info.last_instance is not None:
            now = req.finished_s if req.finished_s is not None else req.call.arrival_s
            predicted = info.gap_s if info.gap_s is not None else self.learner.predict(UNTOLD_KEY)
            self.instances[info.last_instance].hint(req.call.session, predicted, now)

    def _learn_untold_gap(self, info: Session, now: float) -> None:
        """A continuation arrived after a gap no client hint described: learn its length,
        under the tool's name if the answer before it called one tool (``tool_calls``),
        else as an untold gap (globally and for the session)."""
        if self.learner is None or info.last_answer_s is None or info.hinted:
            return
        observed = max(0.0, now - info.last_answer_s)
        if info.gap_key is not None:
            self.learner.observe(info.gap_key, observed)
        else:
            self.learner.observe(UNTOLD_KEY, observed)
            info.gap_s = self.learner.follow(info.gap_s, observed)
        info.last_answer_s = None
        info.gap_key = None

    def tool_calls(self, session: SessionKey, tools: Sequence[str], now: float) -> None:
        """The session's last answer ended in calls of ``tools``: the gap it starts is theirs,
        with no hint from the client. The instance it ran on gets the learner's expected gap
        (the sum over the tools of an answer that called several) in place of the untold
        one, and the next call's arrival measures the gap: learned under the tool's name
        when the answer called one tool (by name; several calls of it count as one gap), as
        an untold gap otherwise. A client's own hints (``event``) take over from this.
        Nothing without a learner or tools; ``UnknownSession`` as ``event``."""
        info = self._known(session)
        if self.learner is None or not tools or info.hinted:
            return
        keys = [self.learner.key_for(tool) for tool in tools]
        info.gap_key = keys[0] if len(set(keys)) == 1 else None
        info.gap_start_s = now
        inst = self.instances.get(info.last_instance or "")
        if inst is not None:
            expected = sum(self.learner.predict(k) for k in dict.fromkeys(keys))
            inst.hint(session, expected, now, tool=tools[0])

    def _learn_tool(
        self,
        info: Session,
        kind: EventKind,
        tool: str | None,
        expected_s: float | None,
        measured_s: float | None,
        now: float,
    ) -> float | None:
        """Hint bookkeeping for the learner; returns the expected gap to give the instance
        (the client's, else the learner's prediction for the tool)."""
        info.hinted = True
        if self.learner is None:
            return expected_s
        if kind is EventKind.TOOL_START:
            info.gap_key = self.learner.key_for(tool) if tool else None
            info.gap_start_s = now
            if expected_s is None and info.gap_key is not None:
                return self.learner.predict(info.gap_key)
        elif kind is EventKind.TOOL_END and info.gap_key is not None:
            since = info.gap_start_s if info.gap_start_s is not None else now
            took = measured_s if measured_s is not None else now - since
            self.learner.observe(info.gap_key, max(0.0, took))
            info.gap_key = None
        return expected_s

    def event(
        self,
        session: SessionKey,
        kind: EventKind,
        expected_s: float | None,
        now: float,
        tool: str | None = None,
        measured_s: float | None = None,
    ) -> None:
        """A client hint. ``UnknownSession`` if the session was never seen or has ended.
        ``tool`` (tool_start) and ``measured_s`` (tool_end) feed the gap learner."""
        info = self._known(session)
        if kind is not EventKind.END:
            expected_s = self._learn_tool(info, kind, tool, expected_s, measured_s, now)
        inst = self.instances.get(info.last_instance or "")
        if kind is EventKind.TOOL_START and inst is not None:
            inst.hint(session, expected_s, now, tool=tool)
        elif kind is EventKind.TOOL_END and inst is not None:
            inst.tool_ended(session, now)
        elif kind is EventKind.END:
            info.ended = True
            self.lengths.observe(info.calls)
            if inst is not None:
                inst.end_session(session)

    def _known(self, session: SessionKey) -> Session:
        info = self.sessions.get(session)
        if info is None or info.ended:
            raise UnknownSession(
                f"unknown session {session.id!r}: send a call with this session id first"
            )
        return info

    def forget(self, session: SessionKey) -> None:
        """Drop an ended session's entry (a later call under its id starts a new session)."""
        info = self.sessions.get(session)
        if info is not None and info.ended:
            del self.sessions[session]

    def mark_down(self, instance: str) -> None:
        """Take a failed instance out of routing (its core keeps its state for inspection)."""
        inst = self.instances[instance]
        for model, hosts in self._hosts.items():
            if inst in hosts:
                hosts.remove(inst)
                if hosts:
                    self._fits_all[model] = min(h.token_limit(model) for h in hosts)

    def mark_up(self, instance: str) -> None:
        """Put an instance taken out by ``mark_down`` back into routing (catalog order)."""
        inst = self.instances[instance]
        for model, hosts in self._hosts.items():
            if inst in hosts or model not in inst.models:
                continue
            order = [i.name for i in self.cluster.instances_for(model)]
            hosts.append(inst)
            hosts.sort(key=lambda h: order.index(h.spec.name))
            self._fits_all[model] = min(h.token_limit(model) for h in hosts)

    def fresh_instance(self, instance: str) -> InstanceCore:
        """A new core for ``instance`` (same spec, models, policy and estimator; no weights
        resident, no KV, no calls): what an instance whose process was lost and came back
        holds. Changes nothing until ``replace_instance``."""
        spec = self.instances[instance].spec
        return InstanceCore(
            spec,
            self.cluster.models_on(spec),
            self.policy,
            self._estimators[instance],
            self._gaps,
        )

    def replace_instance(self, core: InstanceCore) -> None:
        """Put ``core`` (from ``fresh_instance``) in its instance's place, outside routing
        (``mark_up`` brings it in). The sessions that ran there find no KV: their next call
        recomputes it (``Request.recomputed_tokens``)."""
        name = core.spec.name
        self.mark_down(name)
        self.instances[name] = core

    def check_integrity(self) -> None:
        for inst in self.instances.values():
            inst.check_integrity()
