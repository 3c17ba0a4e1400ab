"""What a call's caller receives, and the record of a call in flight that owns its stream.

A call's tokens reach its caller through an unbounded memory stream of :class:`Delta`, then
one :class:`Finished` or :class:`Failed`; :func:`deliver` hands one event over (a caller
that stopped listening gets nothing). :class:`LiveCall` is the live loop's record of a call:
its request, how it samples, its stop checker and how much of its answer the caller has.
:func:`log_call` writes a finished call's line of the call log. Mutated on the event loop
thread only (:mod:`talaria.runtime.live`).
"""

from __future__ import annotations

import logging

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from talaria.errors import TalariaError
from talaria.executor import CallRecord
from talaria.generation import SamplingParams, StopChecker, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.schedule import Request
from talaria.types import Call

log = logging.getLogger("talaria.runtime.live")
# one INFO line per finished call: the server's call log (``talaria serve`` shows it at
# --log-level info)
calls_log = logging.getLogger("talaria.calls")


@attrs.frozen
class Delta:
    """New text of a call (may be empty when only token ids advanced); ``logprobs`` has one
    entry per id of ``token_ids`` when the call asked for them (``SamplingParams.logprobs``),
    else none."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Finished:
    """A call ended. ``cached_tokens`` counts prompt tokens whose KV was reused or restored;
    ``stop_sequence`` is the stop string that ended it (None: another reason)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    instance: str
    ttft_s: float
    latency_s: float
    stop_sequence: str | None = None


@attrs.frozen
class Failed:
    error: TalariaError


Event = Delta | Finished | Failed


@attrs.define(eq=False)
class LiveCall:
    """One call in flight: its request, its record (how to sample it, what it generated on
    its current instance), its stop checker and the stream to its caller."""

    call: Call
    req: Request
    instance: str
    record: CallRecord
    checker: StopChecker
    send: MemoryObjectSendStream[Event]
    sent_tokens: int = 0  # of the ids its current instance generated
    sent_logprobs: int = 0
    text: list[str] = attrs.field(factory=list)

    @property
    def key(self) -> CallKey:
        return self.call.key

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def resumed(self) -> int:
        """Ids of its answer generated on instances that were lost: they end
        ``call.prompt`` now."""
        return self.record.resumed


def deliver(lc: LiveCall, event: Event) -> None:
    """Hand ``event`` to the call's caller; a caller that closed its end (it went away)
    gets nothing, and its call is cancelled by whoever closed it."""
    try:
        lc.send.send_nowait(event)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        log.debug("call %s: its caller stopped listening", lc.key)


def log_call(key: CallKey, model: str, done: Finished) -> None:
    """The call log's line for a finished call: its session (tenant and id), index, model,
    instance, prompt tokens and how many of them were cached, answer tokens, why it ended
    and its timings."""
    session, index = key
    calls_log.info(
        "tenant=%s session=%s call=%d model=%s instance=%s prompt=%d cached=%d output=%d "
        "finish=%s ttft_s=%.3f latency_s=%.3f",
        session.tenant,
        session.id,
        index,
        model,
        done.instance,
        done.prompt_tokens,
        done.cached_tokens,
        done.completion_tokens,
        done.finish_reason,
        done.ttft_s,
        done.latency_s,
    )
