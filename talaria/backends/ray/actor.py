"""The process side of a Ray instance: an engine executing schedules it did not make.

:class:`Worker` is what a Ray actor runs (``cluster.py`` wraps a subclass with
``ray.remote``; nothing here imports Ray, so it is tested in process too). It holds an
executor for the serving core's :class:`~talaria.executor.Layout` (sent with ``attach``: the
actor builds no core), :class:`InstanceWorker` the embedded engine's
:class:`~talaria.engine.runner.EngineRunner`, :class:`~talaria.backends.ray.vllm_worker.
VllmWorker` vLLM engines, and a mirror of the records of the calls it runs (the prompt and
the ids sampled so far, what the engine reads). The decisions come over the wire
(:class:`~talaria.backends.ray.wire.WireSchedule`) with the
:class:`~talaria.schedule.Placement` the serving core planned them at.

The constructor stores its arguments only; ``attach`` loads the models (from this node's
catalog or model directories: nothing is shipped) if this process has not yet, checks them
against the layout, and drops every call's state. Ray runs the constructor again when it
restarts the actor, so the serving process calls ``attach`` after every loss. Stages copy
inline (no background thread): the serving core hears ``stage_done`` at the commit of the
step that carried the stage. ``execute`` and ``attach`` are called by one caller at a time
(the instance's driver); ``ping`` may run beside them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import attrs
import torch

from talaria.backends.embedded import load_catalog_model
from talaria.backends.ray.wire import NewCall, WireResult, WireSchedule
from talaria.engine.kernels import optional_decode_kernel
from talaria.engine.runner import EngineRunner
from talaria.errors import ConfigError
from talaria.executor import CallRecord, Executor, Layout, Work
from talaria.generation import SamplingParams
from talaria.memory.kv import CallKey
from talaria.schedule import Request, Schedule
from talaria.types import Call, TokenSeq

__all__ = ["InstanceWorker", "Worker", "WorkerInfo"]


@attrs.frozen
class WorkerInfo:
    """Where the actor runs and what it loaded (``executes_kv_moves``: whether its engine
    copies the core's planned KV moves, as the embedded engine does; vLLM does not)."""

    node_id: str
    hostname: str
    pid: int
    layout: Layout
    vocab_sizes: dict[str, int]
    eos_token_ids: dict[str, tuple[int, ...]]
    torch_threads: int
    executes_kv_moves: bool = True


class Worker:
    """Executes one instance's schedules on an executor it builds in its own process (see
    the module docstring); :class:`InstanceWorker` builds the embedded engine,
    :class:`~talaria.backends.ray.vllm_worker.VllmWorker` vLLM engines.

    ``name``: the instance's; ``models`` in the order the serving core's instance lists
    them; ``node_id`` names the node in ``WorkerInfo`` (Ray's runtime context in an actor,
    anything in process). Subclasses say how to get an executor ready for a layout
    (:meth:`_ready`) and the end ids of its models (:meth:`_eos`)."""

    def __init__(self, name: str, models: Sequence[str], node_id: str = "") -> None:
        self.name = name
        self.model_names = tuple(models)
        self.node_id = node_id
        self._runner: Executor | None = None
        self._requests: dict[CallKey, Request] = {}
        self._records: dict[CallKey, CallRecord] = {}

    def _ready(self, layout: Layout) -> Executor:
        """An executor for a fresh core of ``layout``: built, or the one there restarted.
        Raises ``ConfigError`` when this node's models do not fit ``layout``."""
        raise NotImplementedError

    def _eos(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def attach(self, layout: Layout) -> WorkerInfo:
        """Get the executor ready for ``layout`` (loading the models if this process has
        not yet), drop every call's state; what the serving process checks before it
        routes here. Raises ``ConfigError`` when this node's models do not fit ``layout``
        (other dtype, other shapes)."""
        runner = self._runner = self._ready(layout)
        self._requests.clear()
        self._records.clear()
        vocab = {m: runner.vocab_size(m) for m in self.model_names}
        return WorkerInfo(
            self.node_id,
            socket.gethostname(),
            os.getpid(),
            layout,
            {m: v for m, v in vocab.items() if v is not None},
            self._eos(),
            torch.get_num_threads(),
            runner.executes_kv_moves,
        )

    def ping(self) -> str:
        return self.node_id

    def execute(self, wire: WireSchedule) -> WireResult:
        """Run one schedule: forget the dropped calls, take in the new ones, then what the
        executor does with it (the embedded engine: KV moves, switch, stage, forward and
        sampling; vLLM: submit, switch, collect tokens); the sampled ids grow the calls'
        records here too."""
        runner = self._runner
        if runner is None:
            raise RuntimeError("the worker executes nothing before attach()")
        for key in wire.drop:
            self._requests.pop(key, None)
            self._records.pop(key, None)
        for new in wire.new:
            self._take(runner, new)
        running: dict[CallKey, Request] = {}
        for key, blocks in wire.blocks:
            req = self._requests.get(key)
            if req is None:
                raise RuntimeError(f"call {key} runs here but its prompt never came")
            req.blocks = blocks
            running[key] = req
        sched = Schedule(
            step=wire.step,
            switch=wire.switch,
            stage=wire.stage,
            kv_moves=wire.kv_moves,
            requests=running,
        )
        calls = {key: self._records[key] for key in running}
        done = runner.execute(Work(sched, wire.placement, calls, wire.drop))
        logprobs = dict(done.logprobs)
        for req, token in done.sampled:
            self._records[req.key].add(token, logprobs.get(req.key))
        return WireResult(
            tuple((req.key, token) for req, token in done.sampled),
            done.logprobs,
            tuple((req.key, why) for req, why in done.failed),
            done.silent,
            done.cached,
        )

    def _take(self, runner: Executor, new: NewCall) -> None:
        vocab = runner.vocab_size(new.model)
        if vocab is None:
            raise ConfigError(f"model {new.model} is not served by instance {self.name}")
        session, index = new.key
        call = Call(
            session.id, index, new.model, TokenSeq(new.prompt), new.target_output, None,
            session.tenant,
        )  # fmt: skip
        self._requests[new.key] = Request(call, None, new.target_output, 0.0)
        params = new.params or SamplingParams(max_tokens=new.target_output, temperature=0.0)
        self._records[new.key] = CallRecord(
            new.key, new.model, new.prompt, params, new.vocab_limit, new.forced, new.resumed
        )

    def held(self) -> tuple[CallKey, ...]:
        """The calls whose state this worker keeps (the serving process checks it holds
        them too)."""
        return tuple(self._requests)


class InstanceWorker(Worker):
    """The embedded engine as a worker: an :class:`~talaria.engine.runner.EngineRunner`
    sized by the layout ``attach`` sends, its models loaded from this node's catalog.

    ``threads``: torch intra-op threads (the CPUs Ray reserved for the actor)."""

    def __init__(
        self,
        name: str,
        models: Sequence[str],
        dtype: str = "bfloat16",
        device: str = "cpu",
        threads: int | None = None,
        native_kernels: bool = True,
        node_id: str = "",
    ) -> None:
        super().__init__(name, models, node_id)
        self.dtype = getattr(torch, dtype)
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}")
        self.device = device
        self.threads = threads
        self.native_kernels = native_kernels
        self._engine: EngineRunner | None = None

    def _ready(self, layout: Layout) -> EngineRunner:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self._engine is None or self._engine.layout != layout:
            self._engine = self._load(layout)
        else:
            self._engine.restart(layout)
        return self._engine

    def _eos(self) -> dict[str, tuple[int, ...]]:
        engine = self._engine
        return {} if engine is None else {m: tuple(sorted(ids)) for m, ids in engine.eos.items()}

    def _load(self, layout: Layout) -> EngineRunner:
        loaded = {m: load_catalog_model(m, self.dtype) for m in self.model_names}
        return EngineRunner(
            layout,
            {m: (lm.arch, lm.tensors) for m, lm in loaded.items()},
            dtype=self.dtype,
            device=self.device,
            eos_token_ids={m: lm.eos_token_ids for m, lm in loaded.items()},
            decode_kernel=optional_decode_kernel(self.device) if self.native_kernels else None,
            background_staging=False,
            threads=self.threads,  # on whichever thread Ray runs execute
            tokenizers={m: lm.tokenizer for m, lm in loaded.items()},
        )
