"""``Talaria``: the async in-process API over a live cluster of the embedded engine.

Built from a ``talaria.api.config.TalariaConfig``; ``async with`` builds the
``talaria.backends.embedded`` cluster and runs it as a ``talaria.runtime.live.LiveCluster``.
Calls return the types of ``talaria.api.results``; session ids are scoped per tenant
(``talaria.api.tenants``); ``stats()`` is ``talaria.api.stats.snapshot``. The sync wrapper is
``talaria.api.sync``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio
import attrs

from talaria.api.config import TalariaConfig
from talaria.api.results import ChatChunk, ChatResult, ModelInfo, Usage
from talaria.api.stats import snapshot
from talaria.api.tenants import DEFAULT_TENANT, scoped_session_id
from talaria.backends.embedded import EmbeddedCluster, build_embedded_cluster
from talaria.engine.sampling import SamplingParams, StopChecker
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import BadRequest, ShuttingDown, TalariaError, UnknownModel
from talaria.runtime.live import Delta, Failed, Finished, LiveCluster, SessionSummary
from talaria.types import EventKind, TokenSeq


@attrs.frozen
class _Prepared:
    session_id: str  # the client's id
    one_shot: bool
    model: str
    prompt: TokenSeq
    params: SamplingParams
    tokenizer: Tokenizer
    tenant: str
    id_prefix: str = "chatcmpl"  # OpenAI's: "chatcmpl" for chats, "cmpl" for completions

    @property
    def scoped_id(self) -> str:
        """The session as the runtime knows it: the client's id within its tenant."""
        return scoped_session_id(self.tenant, self.session_id)


class Talaria:
    """Serve the configured models in this process (see the ``talaria.api`` docstring).

    ``__init__`` does no I/O; ``async with`` loads the models and starts the loop. Not for
    use from two event loops at once; from threads use :class:`SyncTalaria`.
    """

    def __init__(self, config: TalariaConfig | None = None) -> None:
        self._config = config or TalariaConfig.default()
        self._cluster: EmbeddedCluster | None = None
        self._live: LiveCluster | None = None
        self._created = int(time.time())

    @property
    def config(self) -> TalariaConfig:
        return self._config

    @property
    def live(self) -> LiveCluster:
        if self._live is None:
            raise ShuttingDown(
                "Talaria is not running (not started, or shut down): use "
                "`async with Talaria(config) as t:`"
            )
        return self._live

    async def __aenter__(self) -> Talaria:
        cfg = self._config
        self._cluster = await anyio.to_thread.run_sync(
            lambda: build_embedded_cluster(
                cfg.instance_specs(), cfg.models, cfg.policy_config(), cfg.torch_dtype, cfg.device
            )
        )
        live = LiveCluster(
            self._cluster.core,
            self._cluster.runners,
            session_idle_s=cfg.session_idle_s,
            shutdown_grace_s=cfg.shutdown_grace_s,
            max_calls=cfg.max_calls,
            max_calls_per_tenant=cfg.max_calls_per_tenant,
            tokens_per_minute_per_tenant=cfg.tokens_per_minute_per_tenant,
            max_sessions_per_tenant=cfg.max_sessions_per_tenant,
        )
        await live.__aenter__()
        self._live = live
        return self

    async def drain(self) -> None:
        """Begin shutting down: refuse new calls (503 ``ShuttingDown``), let calls in flight
        finish for up to ``shutdown_grace_s``, then fail the rest with ``ShuttingDown`` (a
        stream ends with that error, not a cut connection). Leaving the ``async with`` block
        afterwards finds nothing left to wait for."""
        if self._live is not None:
            await self._live.shutdown()

    async def __aexit__(self, *exc_info: Any) -> None:
        live, self._live = self._live, None
        if live is not None:
            await live.__aexit__(*exc_info)

    # ------------------------------------------------------------------ models
    def models(self) -> list[ModelInfo]:
        cluster = self._require_cluster()
        return [
            ModelInfo(name, arch.max_context, cluster.loaded_from[name], self._created)
            for name, arch in cluster.archs.items()
        ]

    def _require_cluster(self) -> EmbeddedCluster:
        if self._cluster is None:
            raise ShuttingDown("Talaria is not running: use `async with Talaria(config) as t:`")
        return self._cluster

    def _tokenizer(self, model: str) -> Tokenizer:
        """The model's tokenizer; a random-weight model borrows the first real one (its
        vocabulary is larger, and sampling is limited to the borrowed one's ids)."""
        cluster = self._require_cluster()
        if model not in cluster.archs:
            raise UnknownModel(f"unknown model {model!r}; served models: {sorted(cluster.archs)}")
        own = cluster.tokenizers.get(model)
        if own is not None:
            return own
        for tok in cluster.tokenizers.values():
            if tok is not None and tok.vocab_size <= cluster.archs[model].vocab_size:
                return tok
        raise BadRequest(f"model {model} has no tokenizer; send token ids instead of text")

    # ------------------------------------------------------------------ calls
    def _prepare(
        self,
        model: str,
        session_id: str | None,
        text: str,
        max_tokens: int | None,
        sampling: Mapping[str, Any],
        tenant: str,
    ) -> _Prepared:
        tok = self._tokenizer(model)
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("the prompt is empty; send at least one token of text")
        limit = self._require_cluster().archs[model].max_context - len(ids)
        if max_tokens is None:
            max_tokens = max(1, min(self._config.default_max_tokens, limit))
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        one_shot = session_id is None
        sid = session_id if session_id is not None else f"call-{uuid.uuid4().hex}"
        if not sid or len(sid) > 256:
            raise BadRequest("session_id must be a non-empty string of at most 256 characters")
        return _Prepared(sid, one_shot, model, TokenSeq(ids), params, tok, tenant)

    async def _events(self, p: _Prepared) -> AsyncGenerator[tuple[str, Delta | Finished]]:
        """Run one prepared call; yields (instance, event): deltas then one ``Finished``;
        raises the call's error on failure."""
        live = self.live
        cluster = self._require_cluster()
        checker = StopChecker(
            p.params, cluster.eos_token_ids.get(p.model, ()), p.tokenizer.stream()
        )
        own = cluster.tokenizers.get(p.model) is not None
        limit = None if own else p.tokenizer.vocab_size
        async with live.session(p.scoped_id).lock:
            lc, receive = await live.submit(
                p.scoped_id,
                p.model,
                p.prompt,
                p.params,
                checker,
                tenant=p.tenant,
                vocab_limit=limit,
            )
            done = False
            try:
                async with receive:
                    async for ev in receive:
                        if isinstance(ev, Failed):
                            raise ev.error
                        done = isinstance(ev, Finished)
                        yield lc.instance, ev
            finally:
                if not done:
                    live.cancel(lc.key)
                if p.one_shot and p.scoped_id in live.sessions:
                    live.event(p.scoped_id, EventKind.END)

    def _chat_text(self, model: str, messages: Sequence[Mapping[str, Any]], tools: Any) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        return self._tokenizer(model).apply_chat_template(messages, True, tools=tools)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        model: str,
        *,
        session_id: str | None = None,
        max_tokens: int | None = None,
        tenant: str = "default",
        tools: Sequence[Mapping[str, Any]] | None = None,
        **sampling: Any,
    ) -> ChatResult:
        """Answer a conversation (OpenAI message dicts). ``sampling``: temperature, top_p,
        top_k, seed, stop, stop_token_ids, ignore_eos (see ``SamplingParams``)."""
        text = self._chat_text(model, messages, tools)
        return await self._whole(
            self._prepare(model, session_id, text, max_tokens, sampling, tenant)
        )

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        model: str,
        *,
        session_id: str | None = None,
        max_tokens: int | None = None,
        tenant: str = "default",
        tools: Sequence[Mapping[str, Any]] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[ChatChunk]:
        """Like ``chat``, as chunks of text. Input errors raise here, before iteration.
        A consumer that stops early should close the iterator (``contextlib.aclosing``):
        that cancels the call and frees its KV at once."""
        text = self._chat_text(model, messages, tools)
        return self._chunks(self._prepare(model, session_id, text, max_tokens, sampling, tenant))

    async def complete(
        self,
        prompt: str,
        model: str,
        *,
        session_id: str | None = None,
        max_tokens: int | None = None,
        tenant: str = "default",
        **sampling: Any,
    ) -> ChatResult:
        """Continue a raw prompt (no chat template)."""
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        return await self._whole(
            attrs.evolve(
                self._prepare(model, session_id, prompt, max_tokens, sampling, tenant),
                id_prefix="cmpl",
            )
        )

    def complete_stream(
        self,
        prompt: str,
        model: str,
        *,
        session_id: str | None = None,
        max_tokens: int | None = None,
        tenant: str = "default",
        **sampling: Any,
    ) -> AsyncIterator[ChatChunk]:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        p = self._prepare(model, session_id, prompt, max_tokens, sampling, tenant)
        return self._chunks(attrs.evolve(p, id_prefix="cmpl"))

    async def _whole(self, p: _Prepared) -> ChatResult:
        cid = f"{p.id_prefix}-{uuid.uuid4().hex}"
        text: list[str] = []
        ids: list[int] = []
        async for _, ev in self._events(p):
            if isinstance(ev, Delta):
                text.append(ev.text)
                ids.extend(ev.token_ids)
            else:
                return ChatResult(
                    cid,
                    p.model,
                    "".join(text),
                    ev.finish_reason,
                    Usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens),
                    ev.instance,
                    p.session_id,
                    int(time.time()),
                    tuple(ids),
                    ev.ttft_s,
                )
        raise TalariaError(
            "the call ended without an answer"
        )  # unreachable: a stream ends with one

    async def _chunks(self, p: _Prepared) -> AsyncIterator[ChatChunk]:
        cid = f"{p.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        sid = p.session_id
        async with aclosing(self._events(p)) as events:
            async for inst, ev in events:
                if isinstance(ev, Delta):
                    yield ChatChunk(
                        cid, p.model, ev.text, None, None, inst, sid, created, ev.token_ids
                    )
                else:
                    usage = Usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                    yield ChatChunk(cid, p.model, "", ev.finish_reason, usage, inst, sid, created)

    # ------------------------------------------------------------------ sessions
    async def event(
        self,
        session_id: str,
        event: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        measured_s: float | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> SessionSummary | None:
        """A session hint (DESIGN.md wire format): "tool_start" (with the tool and the
        seconds the client expects it to take), "tool_end" or "end". Returns the session's
        summary on "end". A tenant's hints reach only its own sessions (another tenant's
        session id is an unknown session here)."""
        try:
            kind = EventKind(event)
        except ValueError:
            raise BadRequest(
                f"unknown event {event!r}; send one of {[k.value for k in EventKind]}"
            ) from None
        scoped = scoped_session_id(tenant, session_id)
        summary = self.live.event(scoped, kind, expected_s, tool=tool, measured_s=measured_s)
        if summary is not None:
            summary = attrs.evolve(summary, session_id=session_id)
        return summary

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: per instance KV blocks per tier, queue, reservations,
        active model and counters; sessions; totals."""
        return snapshot(self.live)

    def check_integrity(self) -> None:
        """Raise if any invariant of the runtime or its memory managers is broken (call it
        between steps, as the tests do once their calls have ended)."""
        self.live.check_integrity()

    async def integrity_problems(self) -> list[str]:
        """What ``check_integrity`` finds, checked between engine steps (safe while serving):
        an empty list when every invariant holds, else the problem."""
        try:
            await self.live.check_integrity_between_steps()
        except Exception as exc:  # any broken invariant is reported, not raised
            return [f"{type(exc).__name__}: {exc}"]
        return []
