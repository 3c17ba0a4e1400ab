"""The process side of a Ray instance: an embedded engine executing schedules it did not make.

:class:`InstanceWorker` is the class a Ray actor runs (``cluster.py`` wraps it with
``ray.remote``; nothing here imports Ray, so it is tested in process too). It holds an
:class:`~talaria.engine.runner.EngineRunner` sized by the serving core's
:class:`~talaria.executor.Layout` (sent with ``attach``: the actor builds no core) and a
mirror of the records of the calls it runs (the prompt and the ids sampled so far, what the
engine reads). The decisions come over the wire (:class:`~talaria.backends.ray.wire.
WireSchedule`) with the :class:`~talaria.schedule.Placement` the serving core planned them
at.

The constructor stores its arguments only; ``attach`` loads the models (from this node's
catalog: nothing is shipped) if this process has not yet, checks them against the layout,
and drops every call's state. Ray runs the constructor again when it restarts the actor, so
the serving process calls ``attach`` after every loss. Stages copy inline (no background
thread): the serving core hears ``stage_done`` at the commit of the step that carried the
stage. ``execute`` and ``attach`` are called by one caller at a time (the instance's
driver); ``ping`` may run beside them.
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
from talaria.executor import CallRecord, Layout, Work
from talaria.generation import SamplingParams
from talaria.memory.kv import CallKey
from talaria.schedule import Request, Schedule
from talaria.types import Call, TokenSeq

__all__ = ["InstanceWorker", "WorkerInfo"]


@attrs.frozen
class WorkerInfo:
    """Where the actor runs and what it loaded."""

    node_id: str
    hostname: str
    pid: int
    layout: Layout
    vocab_sizes: dict[str, int]
    eos_token_ids: dict[str, tuple[int, ...]]
    torch_threads: int


class InstanceWorker:
    """Executes one instance's schedules on the embedded engine (see the module docstring).

    ``name``: the instance's; ``models`` in the order the serving core's instance lists
    them; ``threads``: torch intra-op threads (the CPUs Ray reserved for the actor);
    ``node_id`` names the node in ``WorkerInfo`` (Ray's runtime context in an actor,
    anything in process)."""

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
        self.name = name
        self.model_names = tuple(models)
        self.dtype = getattr(torch, dtype)
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}")
        self.device = device
        self.threads = threads
        self.native_kernels = native_kernels
        self.node_id = node_id
        self._runner: EngineRunner | None = None
        self._requests: dict[CallKey, Request] = {}
        self._records: dict[CallKey, CallRecord] = {}

    def attach(self, layout: Layout) -> WorkerInfo:
        """Load the models if this process has not yet (into buffers of ``layout``), drop
        every call's state; what the serving process checks before it routes here. Raises
        ``ConfigError`` when this node's models do not fit ``layout`` (other dtype, other
        shapes)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self._runner is None or self._runner.layout != layout:
            self._runner = self._load(layout)
        else:
            self._runner.restart(layout)
        self._requests.clear()
        self._records.clear()
        runner = self._runner
        return WorkerInfo(
            self.node_id,
            socket.gethostname(),
            os.getpid(),
            runner.layout,
            {m: a.vocab_size for m, a in runner.archs.items()},
            {m: tuple(sorted(ids)) for m, ids in runner.eos.items()},
            torch.get_num_threads(),
        )

    def ping(self) -> str:
        return self.node_id

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

    def execute(self, wire: WireSchedule) -> WireResult:
        """Run one schedule: forget the dropped calls, take in the new ones, then the KV
        moves, switch, stage, forward and sampling as ``EngineRunner.execute`` does; the
        sampled ids grow the calls' records here too."""
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
        )

    def _take(self, runner: EngineRunner, new: NewCall) -> None:
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
