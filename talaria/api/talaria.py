"""``Talaria``: the async in-process API over a live cluster of the embedded engine.

Built from a ``talaria.api.config.TalariaConfig``; ``async with`` builds the
``talaria.backends.embedded`` cluster and runs it as a ``talaria.runtime.live.LiveCluster``.
Calls return the types of ``talaria.api.results``; a session is its tenant's
(``talaria.types.SessionKey``: tenant and id); ``stats()`` is ``talaria.api.stats.snapshot``.
The sync wrapper is ``talaria.api.sync``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any, TypedDict, Unpack

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from talaria.api import backends
from talaria.api.config import TalariaConfig
from talaria.api.results import (
    ChatChunk,
    ChatResult,
    Choice,
    Logprob,
    ModelInfo,
    Tokenized,
    ToolCall,
    Usage,
)
from talaria.api.stats import snapshot
from talaria.api.tool_choice import (
    AnswerReader,
    ToolPlan,
    constrained,
    plan_tools,
    render_messages,
)
from talaria.api.tool_parsers import ToolFormat, format_for_template
from talaria.backends.served import ServedCluster
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import BadRequest, ShuttingDown, TalariaError, UnknownModel
from talaria.generation import SamplingParams, StopChecker
from talaria.grammar import Grammar
from talaria.runtime.live import LiveCluster
from talaria.runtime.sessions import SessionSummary
from talaria.runtime.streams import Delta, Failed, Finished
from talaria.types import DEFAULT_TENANT, EventKind, SessionKey, TokenSeq

MAX_CHOICES = 16  # ``n``: samples of one prompt per request
SEED_SPAN = 2**64  # torch seeds: a choice's seed (seed + index) wraps within this span
_Item = tuple[int, str, Delta | Finished] | tuple[int, BaseException]


class CallArgs(TypedDict, total=False):
    """What every call takes beside its prompt and model (the HTTP server passes the same,
    ``talaria.server.backend``): ``params``, its sampling (``SamplingParams``; None, or
    ``max_tokens`` None, leaves the output cap to the server: ``default_max_tokens`` or
    what the context leaves beside the prompt); ``session_id`` (None: a one-call session),
    within its ``tenant`` (default: ``DEFAULT_TENANT``); ``n`` choices of the same prompt
    (default 1; see :meth:`Talaria._choices`)."""

    params: SamplingParams | None
    session_id: str | None
    tenant: str
    n: int


class ChatArgs(CallArgs, total=False):
    """A chat call's :class:`CallArgs` and its tools: ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` as OpenAI's (``talaria.api.tool_choice``); the answer's calls
    come back in ``tool_calls``."""

    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None


def _check_args(call: Mapping[str, object], kind: type[CallArgs]) -> None:
    """``BadRequest`` naming an argument ``kind`` does not take (unchecked at run time)."""
    unknown = sorted(set(call) - set(kind.__annotations__))
    if unknown:
        raise BadRequest(
            f"unknown argument(s) {', '.join(unknown)}: a call takes "
            f"{', '.join(kind.__annotations__)} (sampling goes in params=SamplingParams(...))"
        )


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
    tools: ToolPlan | None = None  # how the answer's tool calls are read (None: no tools)
    clamped: int | None = None  # the output cap granted, when less than max_tokens asked

    @property
    def key(self) -> SessionKey:
        """The session as the runtime knows it: the client's id within its tenant."""
        return SessionKey(self.tenant, self.session_id)


class Talaria:
    """Serve the configured models in this process (see the ``talaria.api`` docstring).

    ``__init__`` does no I/O; ``async with`` loads the models and starts the loop. Not for
    use from two event loops at once; from threads use :class:`SyncTalaria`.
    """

    def __init__(self, config: TalariaConfig | None = None) -> None:
        self._config = config or TalariaConfig.default()
        self._cluster: ServedCluster[Any] | None = None
        self._live: LiveCluster | None = None
        self._tg: anyio.abc.TaskGroup | None = None  # runs the choices of n > 1 requests
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
        self._cluster = await anyio.to_thread.run_sync(self._build)
        try:
            await self._start_live()
        except BaseException:
            self._close_cluster()
            raise
        return self

    def _build(self) -> ServedCluster[Any]:
        return backends.build(self._config)

    def mechanisms(self) -> list[str]:
        """What the backend runs of Talaria's mechanisms (the vLLM backend says which are
        active on its platform; the embedded engine runs them all)."""
        return self._require_cluster().mechanisms()

    def _close_cluster(self) -> None:
        """Stop the vLLM engines or the Ray actors (the embedded engine holds nothing outside
        this process)."""
        if self._cluster is not None:
            self._cluster.close()

    async def _start_live(self) -> None:
        cfg = self._config
        if self._cluster is None:
            raise ShuttingDown("Talaria is not running")
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
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

    async def drain(self) -> None:
        """Begin shutting down: refuse new calls (503 ``ShuttingDown``), let calls in flight
        finish for up to ``shutdown_grace_s``, then fail the rest with ``ShuttingDown`` (a
        stream ends with that error, not a cut connection). Leaving the ``async with`` block
        afterwards finds nothing left to wait for."""
        if self._live is not None:
            await self._live.shutdown()

    async def __aexit__(self, *exc_info: Any) -> None:
        live, self._live = self._live, None
        tg, self._tg = self._tg, None
        try:
            if live is not None:  # calls end (the choices' tasks with them) ...
                with anyio.CancelScope(shield=True):
                    await live.shutdown()
        finally:
            try:
                if tg is not None:  # ... then the task group entered last exits first
                    tg.cancel_scope.cancel()
                    await tg.__aexit__(None, None, None)
            finally:
                try:
                    if live is not None:
                        await live.__aexit__(*exc_info)
                finally:
                    await anyio.to_thread.run_sync(self._close_cluster)

    # ------------------------------------------------------------------ models
    def models(self) -> list[ModelInfo]:
        cluster = self._require_cluster()
        return [
            ModelInfo(name, arch.max_context, cluster.loaded_from[name], self._created)
            for name, arch in cluster.archs.items()
        ]

    def _require_cluster(self) -> ServedCluster[Any]:
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
        text: str | Sequence[int],
        params: SamplingParams | None,
        tenant: str,
        tools: ToolPlan | None = None,
        scripted: Grammar | None = None,
    ) -> _Prepared:
        """``text`` is the prompt's text, or its token ids (checked against the model's
        vocabulary when the call is submitted). ``params`` None: the defaults, with the
        output cap left to the server; the cap is resolved here (:meth:`_output_cap`).
        ``scripted`` (an answer script's grammar) overrides any other grammar."""
        tok = self._tokenizer(model)
        if isinstance(text, str):
            ids = tok.encode(text, add_special_tokens=False)
        elif isinstance(text, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in text
        ):
            ids = [int(t) for t in text]
        else:
            raise BadRequest("prompt must be a string or a list of non-negative token ids")
        if not ids:
            raise BadRequest("the prompt is empty; send at least one token of text")
        if params is None:
            params = SamplingParams(max_tokens=None)
        elif not isinstance(params, SamplingParams):
            raise BadRequest(f"params must be a SamplingParams, got {type(params).__name__}")
        max_tokens, clamped = self._output_cap(model, len(ids), params.max_tokens)
        params = constrained(attrs.evolve(params, max_tokens=max_tokens), tools, scripted)
        one_shot = session_id is None
        sid = session_id if session_id is not None else f"call-{uuid.uuid4().hex}"
        if not sid or len(sid) > 256:
            raise BadRequest("session_id must be a non-empty string of at most 256 characters")
        return _Prepared(
            sid, one_shot, model, TokenSeq(ids), params, tok, tenant, tools=tools, clamped=clamped
        )

    def _output_cap(
        self, model: str, prompt_tokens: int, asked: int | None
    ) -> tuple[int, int | None]:
        """(the output cap a call runs with, that cap when it is less than ``asked``).

        The room is what the model's context and the largest KV pool serving it leave beside
        the prompt. Without ``asked`` a call gets ``default_max_tokens`` or the room if less.
        An ``asked`` over the room is clamped to it (agents send ``max_tokens: 32000``
        whatever the model), unless ``strict_max_tokens``: then it stands and the call is
        refused (``ContextTooLong``) when submitted, as OpenAI does. A prompt that leaves
        no room is refused when submitted either way."""
        cluster = self._require_cluster()
        limit = cluster.core.token_limit(model) or cluster.archs[model].max_context
        room = limit - prompt_tokens
        if asked is None:
            return max(1, min(self._config.default_max_tokens, room)), None
        if asked <= room or room < 1 or self._config.strict_max_tokens:
            return asked, None
        return room, room

    async def _events(self, p: _Prepared) -> AsyncGenerator[tuple[str, Delta | Finished]]:
        """Run one prepared call; yields (instance, event): deltas then one ``Finished``;
        raises the call's error on failure."""
        live = self.live
        cluster = self._require_cluster()
        checker = StopChecker(
            p.params,
            cluster.eos_token_ids.get(p.model, ()),
            # a template's call markers may be special tokens (as vLLM's parsers do, keep them)
            p.tokenizer.stream(skip_special_tokens=p.tools is None),
        )
        own = cluster.tokenizers.get(p.model) is not None
        limit = None if own else p.tokenizer.vocab_size
        async with live.session(p.key).lock:
            lc, receive = await live.submit(
                p.key, p.model, p.prompt, p.params, checker, vocab_limit=limit
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
                if p.one_shot and p.key in live.sessions:
                    live.event(p.key, EventKind.END)

    def _tool_format(self, model: str, tok: Tokenizer) -> ToolFormat:
        """How ``model`` writes tool calls: the config's ``tool_parsers`` entry, else what its
        chat template (``tok``'s) teaches."""
        named = self._config.tool_parsers.get(model)
        if named is not None:
            return ToolFormat(named)
        return format_for_template(tok.chat_template)

    def _chat_text(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        tools: object,
        add_generation_prompt: bool = True,
        tool_choice: object = None,
        parallel_tool_calls: object = None,
    ) -> tuple[str, ToolPlan | None]:
        """The prompt of a conversation (``talaria.api.tool_choice`` prepares its messages
        and plans how the answer's tool calls are read) and that plan. BadRequest for bad
        messages or tool fields."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        tok = self._tokenizer(model)
        fmt = self._tool_format(model, tok)
        plan = plan_tools(tools, tool_choice, parallel_tool_calls, fmt)
        shown = list(plan.tools) if plan is not None else None
        rendered = render_messages(messages, tok.chat_template, fmt, shown)
        return tok.apply_chat_template(rendered, add_generation_prompt, tools=shown), plan

    def tokenize(
        self,
        model: str,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> Tokenized:
        """``prompt`` (a text) or ``messages`` (rendered by the chat template, with the
        generation prompt unless ``add_generation_prompt`` is false) as ``model``'s tokens,
        as vLLM's ``/tokenize`` does. ``add_special_tokens`` defaults as vLLM's: true for a
        prompt, false for messages (the template writes them). Note that calls encode their
        text without special tokens. BadRequest unless exactly one of the two is given."""
        if (prompt is None) == (messages is None):
            raise BadRequest("send exactly one of prompt (a text) and messages (a conversation)")
        tok = self._tokenizer(model)
        if messages is not None:
            text, _ = self._chat_text(
                model, messages, tools, add_generation_prompt, tool_choice, parallel_tool_calls
            )
            special = bool(add_special_tokens)
        else:
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string")
            text = prompt
            special = True if add_special_tokens is None else add_special_tokens
        ids = tok.encode(text, add_special_tokens=special)
        strs = tuple(tok.token_str(i) for i in ids)
        limit = self._require_cluster().archs[model].max_context
        return Tokenized(tuple(ids), strs, limit)

    def detokenize(self, model: str, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` under ``model``'s tokenizer (special tokens kept, as
        vLLM's ``/detokenize``). BadRequest for an id outside the vocabulary."""
        ids = list(token_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("tokens must be a list of integer token ids")
        return self._tokenizer(model).decode(ids, skip_special_tokens=False)

    async def chat(
        self, messages: Sequence[Mapping[str, Any]], model: str, **call: Unpack[ChatArgs]
    ) -> ChatResult:
        """Answer a conversation (OpenAI message dicts); ``call`` as :class:`ChatArgs`
        (sampling, session, tenant, choices, tools). Choice 0 is the answer."""
        return await self._whole(self._chat_calls(messages, model, call))

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], model: str, **call: Unpack[ChatArgs]
    ) -> AsyncIterator[ChatChunk]:
        """Like ``chat``, as chunks of text (and of whole tool calls). Input errors raise
        here, before iteration. A consumer that stops early should close the iterator
        (``contextlib.aclosing``): that cancels the call and frees its KV at once."""
        return self._chunks(self._chat_calls(messages, model, call))

    async def complete(
        self, prompt: str | Sequence[int], model: str, **call: Unpack[CallArgs]
    ) -> ChatResult:
        """Continue a raw prompt (no chat template): a text, or the model's token ids."""
        _check_args(call, CallArgs)
        return await self._whole(self._calls(model, prompt, call, "cmpl"))

    def complete_stream(
        self, prompt: str | Sequence[int], model: str, **call: Unpack[CallArgs]
    ) -> AsyncIterator[ChatChunk]:
        """Like ``complete``, as chunks of text."""
        _check_args(call, CallArgs)
        return self._chunks(self._calls(model, prompt, call, "cmpl"))

    def _chat_calls(
        self, messages: Sequence[Mapping[str, Any]], model: str, call: ChatArgs
    ) -> list[_Prepared]:
        _check_args(call, ChatArgs)
        text, plan = self._chat_text(
            model,
            messages,
            call.get("tools"),
            tool_choice=call.get("tool_choice"),
            parallel_tool_calls=call.get("parallel_tool_calls"),
        )
        return self._calls(model, text, call, "chatcmpl", plan, messages)

    def _calls(
        self,
        model: str,
        text: str | Sequence[int],
        call: CallArgs,
        id_prefix: str,
        plan: ToolPlan | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
    ) -> list[_Prepared]:
        """The prepared calls of one request (one per choice; arguments checked); a chat
        call's ``messages`` are read by the deployment's answer script, if any."""
        tenant = call.get("tenant", DEFAULT_TENANT)
        script = self._config.answer_script
        scripted = script.grammar(messages, plan) if script is not None else None
        params = call.get("params")
        p = self._prepare(model, call.get("session_id"), text, params, tenant, plan, scripted)
        return self._choices(attrs.evolve(p, id_prefix=id_prefix), call.get("n", 1))

    def _choices(self, p: _Prepared, n: int) -> list[_Prepared]:
        """The calls that answer a request for ``n`` choices (``1 <= n <= MAX_CHOICES``).

        Choice 0 is ``p``: it runs in the caller's session, so the session's history
        continues from it. Choices 1..n-1 are one-call sessions of the same tenant, started
        once choice 0's prompt is computed (its first token), so the prefix cache serves
        their prompt's full blocks; with a ``seed``, choice i samples with ``seed + i`` (as
        vLLM does), else each from fresh entropy. Raises BadRequest for a bad ``n``."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n (choices) must be an integer in 1..{MAX_CHOICES}, got {n!r}")
        out = [p]
        for i in range(1, n):
            seed = p.params.seed
            if seed is not None:
                seed = seed + i if seed + i < SEED_SPAN else seed + i - SEED_SPAN
            params = attrs.evolve(p.params, seed=seed)
            sid = f"call-{uuid.uuid4().hex}"
            out.append(attrs.evolve(p, session_id=sid, one_shot=True, params=params))
        return out

    async def _merged(
        self, ps: list[_Prepared]
    ) -> AsyncGenerator[tuple[int, str, Delta | Finished]]:
        """The events of every choice as (index, instance, event), interleaved; raises the
        first choice's error that occurs (the others are then cancelled). One choice runs in
        this task; several run as tasks of this API's task group (choice 0 first, the rest
        once its first token came), cancelled when this generator is closed."""
        if len(ps) == 1:
            async with aclosing(self._events(ps[0])) as events:
                async for inst, ev in events:
                    yield 0, inst, ev
            return
        tg = self._tg
        if tg is None:
            raise ShuttingDown("Talaria is not running: use `async with Talaria(config) as t:`")
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        prompt_done = anyio.Event()
        scopes = [anyio.CancelScope() for _ in ps]
        for i, p in enumerate(ps):
            tg.start_soon(self._forward, i, p, scopes[i], send.clone(), prompt_done)
        send.close()
        try:
            async with receive:
                async for item in receive:
                    if len(item) == 2:
                        raise item[1]
                    yield item
        finally:
            for scope in scopes:
                scope.cancel()

    async def _forward(
        self,
        index: int,
        p: _Prepared,
        scope: anyio.CancelScope,
        send: MemoryObjectSendStream[_Item],
        prompt_done: anyio.Event,
    ) -> None:
        """Run choice ``index`` and hand its events (or its error) to ``send``; choice 0
        sets ``prompt_done`` at its first event (or its end), the others wait for it."""
        with scope, send:
            try:
                if index > 0:
                    await prompt_done.wait()
                async with aclosing(self._events(p)) as events:
                    async for inst, ev in events:
                        if index == 0:
                            prompt_done.set()
                        send.send_nowait((index, inst, ev))
            except Exception as exc:  # the caller raises it (and cancels the others)
                send.send_nowait((index, exc))
            finally:
                if index == 0:
                    prompt_done.set()

    async def _whole(self, ps: list[_Prepared]) -> ChatResult:
        p = ps[0]
        cid = f"{p.id_prefix}-{uuid.uuid4().hex}"
        text: list[list[str]] = [[] for _ in ps]
        ids: list[list[int]] = [[] for _ in ps]
        logprobs: list[list[Logprob]] = [[] for _ in ps]
        choices: dict[int, Choice] = {}
        first: Finished | None = None
        async with aclosing(self._merged(ps)) as events:
            async for i, inst, ev in events:
                if isinstance(ev, Delta):
                    text[i].append(ev.text)
                    ids[i].extend(ev.token_ids)
                    logprobs[i].extend(Logprob.of(p.tokenizer, ev.logprobs))
                    continue
                usage = Usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                asked = ps[i].params.logprobs is not None
                reader = AnswerReader(p.tools)
                head = reader.feed("".join(text[i]))
                tail, reason = reader.finish(ev.finish_reason)
                choices[i] = Choice(
                    i,
                    head.content + tail.content,
                    reason,
                    tuple(ids[i]),
                    usage,
                    tuple(logprobs[i]) if asked else None,
                    head.calls + tail.calls,
                    ev.stop_sequence,
                )
                if i == 0:
                    first, instance = ev, inst
                    self._note_tool_calls(p, choices[0].tool_calls)
        if first is None or len(choices) != len(ps):
            raise TalariaError("the call ended without an answer")  # a stream ends with one
        ordered = tuple(choices[i] for i in range(len(ps)))
        c0 = ordered[0]
        return ChatResult(
            cid,
            p.model,
            c0.text,
            c0.finish_reason,
            Usage.of_choices(tuple(c.usage for c in ordered)),
            instance,
            p.session_id,
            int(time.time()),
            c0.token_ids,
            first.ttft_s,
            ordered,
            c0.logprobs,
            c0.tool_calls,
            c0.stop_sequence,
            p.clamped,
        )

    async def _chunks(self, ps: list[_Prepared]) -> AsyncIterator[ChatChunk]:
        p = ps[0]
        asked = p.params.logprobs is not None
        base = ChatChunk(
            f"{p.id_prefix}-{uuid.uuid4().hex}",
            p.model,
            "",
            None,
            None,
            "",
            p.session_id,
            int(time.time()),
            prompt_tokens=len(p.prompt),
            max_tokens_clamped=p.clamped,
        )
        readers = [AnswerReader(p.tools) for _ in ps]
        called: list[ToolCall] = []  # choice 0's
        async with aclosing(self._merged(ps)) as events:
            async for i, inst, ev in events:
                reader, first_call = readers[i], readers[i].calls_made
                if isinstance(ev, Delta):
                    piece = reader.feed(ev.text)
                    called += piece.calls if i == 0 else ()
                    lps = Logprob.of(p.tokenizer, ev.logprobs) if asked else None
                    yield attrs.evolve(
                        base,
                        text=piece.content,
                        instance=inst,
                        token_ids=ev.token_ids,
                        logprobs=lps,
                        index=i,
                        tool_calls=piece.calls,
                        first_call=first_call,
                    )
                    continue
                piece, reason = reader.finish(ev.finish_reason)
                if i == 0:
                    self._note_tool_calls(p, [*called, *piece.calls])
                lps = () if asked else None
                if piece:
                    yield attrs.evolve(
                        base,
                        text=piece.content,
                        instance=inst,
                        logprobs=lps,
                        index=i,
                        tool_calls=piece.calls,
                        first_call=first_call,
                    )
                usage = Usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                yield attrs.evolve(
                    base,
                    finish_reason=reason,
                    usage=usage,
                    instance=inst,
                    logprobs=lps,
                    index=i,
                    stop_sequence=ev.stop_sequence,
                )

    def _note_tool_calls(self, p: _Prepared, calls: Sequence[ToolCall]) -> None:
        """An answer that ends in tool calls opens a gap named for its tools (no client hint
        needed; ``LiveCluster.tool_calls``). Nothing for a one-call session."""
        if calls and not p.one_shot:
            self.live.tool_calls(p.key, [c.name for c in calls])

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
        """A session hint (docs/design.md wire format): "tool_start" (with the tool and the
        seconds the client expects it to take), "tool_end" or "end". Returns the session's
        summary on "end". A tenant's hints reach only its own sessions (another tenant's
        session id is an unknown session here)."""
        try:
            kind = EventKind(event)
        except ValueError:
            raise BadRequest(
                f"unknown event {event!r}; send one of {[k.value for k in EventKind]}"
            ) from None
        key = SessionKey(tenant, session_id)
        return self.live.event(key, kind, tool=tool, expected_s=expected_s, measured_s=measured_s)

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
