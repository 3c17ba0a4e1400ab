"""The in-process API: ``talaria.Talaria`` serves the embedded engine to code in this process.

::

    async with Talaria(TalariaConfig.default()) as tal:
        answer = await tal.chat([{"role": "user", "content": "hi"}], "smollm2-135m",
                                session_id="agent-1", max_tokens=64)
        async for chunk in tal.chat_stream(messages, "smollm2-135m", session_id="agent-1"):
            print(chunk.text, end="")
        await tal.event("agent-1", "tool_start", tool="bash", expected_s=0.4)
        summary = await tal.event("agent-1", "end")

``Talaria`` owns a :class:`~talaria.runtime.live.LiveCluster` over the models of its
:class:`TalariaConfig`; ``SyncTalaria`` wraps it for scripts. Every error is a
:class:`~talaria.errors.TalariaError` with an HTTP status and a message a user can act on.
Calls without a session id are one-call sessions: they end when they return.
"""

from __future__ import annotations

import time
import tomllib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, aclosing
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import attrs
import torch

from talaria.backends.embedded import EmbeddedCluster, build_embedded_cluster
from talaria.config import InstanceSpec, PolicyConfig
from talaria.engine.catalog import DEFAULT_MODELS, ENTRIES
from talaria.engine.sampling import SamplingParams, StopChecker
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import BadRequest, ConfigError, ShuttingDown, TalariaError, UnknownModel
from talaria.policy.baselines import policy as named_policy
from talaria.runtime.live import (
    DEFAULT_MAX_CALLS,
    Delta,
    Failed,
    Finished,
    LiveCluster,
    SessionSummary,
)
from talaria.types import EventKind, TokenSeq

GB = 10**9
DEFAULT_MAX_TOKENS = 1024
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

__all__ = [
    "ChatChunk",
    "ChatResult",
    "ModelInfo",
    "SessionSummary",
    "SyncTalaria",
    "Talaria",
    "TalariaConfig",
    "Usage",
]


def _models(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names:
        raise ConfigError("serve at least one model (models = [...])")
    for n in names:
        if n not in ENTRIES:
            raise ConfigError(f"unknown model {n!r}; the catalog has {sorted(ENTRIES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"models are listed twice: {list(names)}")
    return names


def _positive(_: Any, attribute: Any, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen
class TalariaConfig:
    """What ``Talaria`` serves and how. Units: bytes, seconds.

    The default serves SmolLM2-135M (real weights) and two published configurations with
    random weights (Qwen2.5-0.5B, Llama-3.2-1B) on one CPU instance whose device budget
    (3 GB x 0.9) cannot hold their 3.73 GB of bfloat16 weights at once, so model switches,
    KV demotion to the host tier (6 GB with the weights) and weight staging are real (the
    embedded replay's instance). About 9 GB of RAM in all. ``policy`` names one of
    DESIGN.md's policies; ``policy_overrides`` sets any of its knobs (for example
    ``{"slot_max_s": 4.0}``).
    """

    models: tuple[str, ...] = attrs.field(default=DEFAULT_MODELS, converter=_models)
    instances: int = attrs.field(default=1, validator=_positive)
    device_memory_bytes: int = attrs.field(default=3 * GB, validator=_positive)
    host_memory_bytes: int = attrs.field(default=6 * GB, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    memory_utilization: float = 0.9
    hardware: str = "cpu"
    device: str = "cpu"
    dtype: str = "bfloat16"
    policy: str = "talaria"
    policy_overrides: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # API key -> tenant name (a TOML [tenants] table); a key listed here is accepted too.
    # Any other configured key is a tenant of its own (named by a digest of the key).
    tenants: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    # calls in flight (queued or running) the server takes at most; past it a call gets
    # 429 with Retry-After instead of waiting without bound
    max_calls: int = DEFAULT_MAX_CALLS
    # the most of them one tenant may hold (None: max_calls), so that one tenant's overload
    # leaves the others room
    max_calls_per_tenant: int | None = None
    session_idle_s: float = attrs.field(default=600.0, validator=_positive)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=_positive)
    default_max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for knob in ("max_calls", "max_calls_per_tenant"):  # the latter may be None
            v = getattr(self, knob)
            if v is None and knob == "max_calls_per_tenant":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{knob} must be a positive integer, got {v!r}")
        for key, name in self.tenants.items():
            ok = isinstance(name, str) and 0 < len(name) <= 64 and name.isprintable()
            if not isinstance(key, str) or not key.strip() or not ok or name == DEFAULT_TENANT:
                raise ConfigError(
                    f"tenants maps API keys to tenant names of 1 to 64 printable characters "
                    f"(not {DEFAULT_TENANT!r}); got {name!r}"
                )
        self.policy_config()  # unknown policy or knob

    @classmethod
    def default(cls) -> TalariaConfig:
        return cls()

    @classmethod
    def from_toml(cls, path: str | Path) -> TalariaConfig:
        """Read a TOML file: top-level keys are this class's fields; a ``[policy]`` table
        holds ``name`` and any knob of the policy."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {p} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        policy = data.pop("policy", None)
        if isinstance(policy, dict):
            data["policy"] = policy.pop("name", "talaria")
            data["policy_overrides"] = policy
        elif policy is not None:
            data["policy"] = policy
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config file {p}: unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"config file {p}: {exc}") from exc

    def policy_config(self) -> PolicyConfig:
        base = named_policy(self.policy)
        known = {f.name for f in attrs.fields(PolicyConfig)} - {"name"}
        unknown = sorted(set(self.policy_overrides) - known)
        if unknown:
            raise ConfigError(f"unknown policy knobs {unknown}; known: {sorted(known)}")
        return attrs.evolve(base, **self.policy_overrides)

    def instance_specs(self) -> tuple[InstanceSpec, ...]:
        return tuple(
            InstanceSpec(
                name=f"{self.hardware}-{i}",
                hardware=self.hardware,
                device_memory_bytes=self.device_memory_bytes,
                host_memory_bytes=self.host_memory_bytes,
                block_size=self.block_size,
                memory_utilization=self.memory_utilization,
            )
            for i in range(self.instances)
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class ChatResult:
    """A whole answer. ``finish_reason`` is "stop" (end token or stop string) or "length"."""

    id: str
    model: str
    text: str
    finish_reason: str
    usage: Usage
    instance: str
    session_id: str
    created: int
    token_ids: tuple[int, ...] = ()
    ttft_s: float = 0.0


@attrs.frozen
class ChatChunk:
    """A piece of a streamed answer; ``finish_reason`` and ``usage`` only on the last."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    instance: str
    session_id: str
    created: int
    token_ids: tuple[int, ...] = ()


@attrs.frozen
class ModelInfo:
    name: str
    context_length: int
    source: str
    created: int


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


DEFAULT_TENANT = "default"
_TENANT_SEPARATOR = "\x1f"  # never in a wire session id (printable ASCII only)


def scoped_session_id(tenant: str, session_id: str) -> str:
    """A tenant's session id as the runtime keys it: tenants never share a session (their
    hints reach only their sessions; their calls never reuse each other's). The default
    tenant's ids are unchanged; no wire id can collide with a scoped one."""
    if tenant == DEFAULT_TENANT:
        return session_id
    return f"{tenant}{_TENANT_SEPARATOR}{session_id}"


class Talaria:
    """Serve the configured models in this process (see the module docstring).

    ``__init__`` does no I/O; ``async with`` loads the models and starts the loop. Not for
    use from two event loops at once; from threads use :class:`SyncTalaria`.
    """

    def __init__(self, config: TalariaConfig | None = None) -> None:
        self._config = config or TalariaConfig.default()
        self._cluster: EmbeddedCluster | None = None
        self._live: LiveCluster | None = None
        self._created = int(time.time())
        self._sct: list[float] = []

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
        )
        await live.__aenter__()
        self._live = live
        return self

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
            self._sct.append(summary.sct_s)
        return summary

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: per instance KV blocks per tier, queue, reservations,
        active model and counters; sessions; totals."""
        live = self.live
        instances: dict[str, Any] = {}
        switches = moved = 0
        for name, inst in live.core.instances.items():
            kv = inst.kv
            counters = attrs.asdict(inst.counters) | {
                f"kv_{k}": v for k, v in attrs.asdict(kv.counters).items()
            }
            switches += inst.counters.model_switches
            moved += inst.counters.weight_bytes_moved + inst.counters.kv_bytes_moved
            instances[name] = {
                "active_model": inst.arena.active_model,
                "queue_depth": sum(len(q) for q in inst.waiting.values()),
                "running": len(inst.running),
                "reservations_held": len(inst.admission.held),
                "healthy": not live.drivers[name].down,
                "kv_blocks": {
                    "device_total": kv.device_blocks,
                    "device_free": kv.device_free,
                    "device_used": kv.device_blocks - kv.device_free,
                    "host_total": kv.host_blocks,
                    "host_free": kv.host_free,
                    "host_used": kv.host_blocks - kv.host_free,
                },
                "counters": counters,
            }
        return {
            "instances": instances,
            "sessions": {
                "active": len(live.sessions),
                "ended": live.ended_sessions,
                "expired": live.expired_sessions,
                "total": len(live.sessions) + live.ended_sessions,
            },
            "calls": {
                "in_flight": len(live.calls),
                "finished": sum(i.counters.calls_finished for i in live.core.instances.values()),
                "failed": live.calls_failed,
                "refused": live.calls_refused,  # over max_calls (429)
                "max": live.max_calls,
                "max_per_tenant": live.max_calls_per_tenant,
            },
            "events": dict(live.events),
            "model_switches": switches,
            "bytes_moved": moved,
        }

    def check_integrity(self) -> None:
        self.live.check_integrity()


class SyncTalaria(AbstractContextManager["SyncTalaria"]):
    """``Talaria`` for synchronous scripts: its loop runs on a background thread (an anyio
    blocking portal) in one long-lived task that holds the ``async with``."""

    def __init__(self, config: TalariaConfig | None = None) -> None:
        self.talaria = Talaria(config)
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._held: Any = None
        self._stop: anyio.Event | None = None

    async def _hold(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with self.talaria:
            self._stop = anyio.Event()
            task_status.started()
            await self._stop.wait()

    def __enter__(self) -> SyncTalaria:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        portal = self._portal_cm.__enter__()
        try:
            self._held, _ = portal.start_task(self._hold)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._portal = portal
        return self

    def __exit__(self, *exc_info: Any) -> None:
        portal = self._require()
        try:
            if self._stop is not None:
                portal.call(self._stop.set)
            self._held.result()
        finally:
            self._portal = None
            self._portal_cm.__exit__(*exc_info)

    def _require(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            raise RuntimeError("use `with SyncTalaria(config) as t:`")
        return self._portal

    def chat(self, messages: Sequence[Mapping[str, Any]], model: str, **kwargs: Any) -> ChatResult:
        portal = self._require()
        return portal.call(lambda: self.talaria.chat(messages, model, **kwargs))

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], model: str, **kwargs: Any
    ) -> Iterator[ChatChunk]:
        portal = self._require()
        stream = portal.call(
            lambda: _aiter_ready(self.talaria.chat_stream(messages, model, **kwargs))
        )
        while True:
            try:
                yield portal.call(stream.__anext__)
            except StopAsyncIteration:
                return

    def complete(self, prompt: str, model: str, **kwargs: Any) -> ChatResult:
        portal = self._require()
        return portal.call(lambda: self.talaria.complete(prompt, model, **kwargs))

    def event(self, session_id: str, event: str, **kwargs: Any) -> SessionSummary | None:
        portal = self._require()
        return portal.call(lambda: self.talaria.event(session_id, event, **kwargs))

    def stats(self) -> dict[str, Any]:
        return self.talaria.stats()

    def models(self) -> list[ModelInfo]:
        return self.talaria.models()


async def _aiter_ready(it: AsyncIterator[ChatChunk]) -> AsyncIterator[ChatChunk]:
    return it
