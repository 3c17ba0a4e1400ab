"""The embedded engine's executor for one instance: real tensors under an ``InstanceCore``.

:class:`EngineRunner` owns the instance's policy and accounting (an
:class:`~talaria.runtime.instance.InstanceCore`) and the tensors that accounting describes:

* **weight arena**: one device tensor of ``core.arena.arena_bytes`` bytes, allocated once.
  Every model's parameters are bound
  (:func:`~talaria.engine.weight_layout.bind_weights`) as views at its region's offset; only
  the model whose weights were last copied into a region is valid there. A switch copies
  into the region; the data pointer never changes.
* **host tier of weights**: one flat byte tensor per model (pinned on CUDA), the source of
  every switch and stage. The arena's host budget is accounting; this runner keeps every
  model's host copy, so the arena's ``DISK_TO_HOST`` steps copy nothing here (a loader
  that reads from disk would do them).
* **KV**: a :class:`~talaria.engine.kv_pool.KVPool` of ``core.kv.device_blocks`` /
  ``core.kv.host_blocks`` blocks of ``core.kv.block_bytes``, and one
  :class:`~talaria.engine.kv_pool.PagedKV` device view per model.
* **staging**: the first ``core.arena.staged_bytes`` of the next model's flat weights are
  copied into the device KV blocks the core lent for it (``core.stage_blocks``, in order);
  a switch to the staged model copies them device -> device into its region and only the
  rest from host. On CPU the stage copy runs on a low-priority background thread
  (:class:`~talaria.engine.staging.BackgroundCopy`), on CUDA on a side stream
  (:class:`~talaria.engine.staging.StreamCopy`), while later steps run; the core hears
  ``stage_done`` from the first :meth:`EngineRunner.plan` after it finished, and a stage the
  core abandons is cancelled before its blocks are reused.

:meth:`EngineRunner.step` runs one ``schedule`` of the core: KV moves (in plan order, so
demotions run before the restores that may reuse their blocks), a weight switch, a stage,
then one forward over the step's prefill chunks and decodes, sampling one token per
sequence whose prompt is complete. Everything but a stage copy runs on the caller's thread
(CPU) or stream (CUDA); on CUDA the switch's device -> device copy is ordered after the side
stream's event, not after a host wait.

Not thread-safe: one task drives a runner.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import torch

from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kernels import DecodeKernel
from talaria.engine.kv_pool import KVPool, PagedKV
from talaria.engine.logits import LogitsProcessor, token_logprob
from talaria.engine.model import LlamaModel
from talaria.engine.sampling import make_generator, sample_row
from talaria.engine.staging import BackgroundCopy, StreamCopy
from talaria.engine.weight_layout import bind_weights
from talaria.errors import BadRequest, ConfigError
from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.memory.weights import SwitchPlan
from talaria.runtime.substrate import commit_schedule
from talaria.schedule import Executed, Placement, Request, Schedule, StepPlan
from talaria.types import Call, KVTier, Link

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the core drives this runner; the runner needs only its interface
    from talaria.runtime.instance import InstanceCore

_MAX_IDLE_STEPS: Final = 100_000
STAGE_POLL_S: Final = 0.001  # how often ``generate`` looks whether a stage it waits on landed


def flatten_weights(
    name: str,
    arch: ModelArch,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    pin: bool = False,
) -> torch.Tensor:
    """One flat host byte buffer holding ``weights`` in ``dtype`` in the arena's layout (what
    a runner keeps per model and copies into its weight region on a switch)."""
    flat = torch.empty(arch.weight_bytes(dtype), dtype=torch.uint8, pin_memory=pin)
    for pname, view in bind_weights(arch, flat, dtype).items():
        if pname not in weights:
            raise ConfigError(f"model {name}: weights lack parameter {pname!r}")
        view.copy_(weights[pname])
    return flat


@attrs.define
class _CallSampling:
    """How one prepared call draws its tokens (see ``EngineRunner.prepare``)."""

    params: SamplingParams
    generator: torch.Generator | None
    vocab_limit: int | None
    forced: tuple[int, ...] | None
    processor: LogitsProcessor | None = None  # built at the first draw, if params need one


class EngineRunner:
    """Executes one instance core's schedules on real tensors (see the module docstring).

    ``models`` maps every model of ``core`` to its architecture and its weights (Hugging Face
    parameter names; any dtype, converted to ``dtype``). The core's specs must describe the
    models in ``dtype`` (``ModelArch.to_spec(name, dtype)``): weight bytes and KV bytes per
    token are checked. ``eos_token_ids`` per model end a call early (each call samples
    as ``prepare`` said, else greedily); ``decode_kernel``
    (:func:`~talaria.engine.kernels.optional_decode_kernel`) lets bf16 models on CPU attend in
    place during decode. ``background_staging``: a stage copies on a low-priority thread
    (CPU, :class:`~talaria.engine.staging.BackgroundCopy`) or a side stream (CUDA,
    :class:`~talaria.engine.staging.StreamCopy`) while later steps run, and the core hears
    ``stage_done`` at the first ``plan`` after it finished; otherwise it copies inside the
    step that carries it. ``threads``: the torch threads every step uses, set on the
    executing thread at each step (a thread's OpenMP team starts at the process default,
    whatever ``torch.set_num_threads`` said on another thread, and the live runtime executes
    steps on worker threads); None leaves the thread as it is.
    """

    def __init__(
        self,
        core: InstanceCore,
        models: Mapping[str, tuple[ModelArch, Mapping[str, torch.Tensor]]],
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        eos_token_ids: Mapping[str, Collection[int]] | None = None,
        host_weights: Mapping[str, torch.Tensor] | None = None,
        decode_kernel: DecodeKernel | None = None,
        background_staging: bool = True,
        threads: int | None = None,
    ) -> None:
        if set(models) != set(core.models):
            raise ConfigError(
                f"runner models {sorted(models)} differ from the instance's {sorted(core.models)}"
            )
        if threads is not None and threads < 1:
            raise ConfigError(f"a runner needs at least one thread, got {threads}")
        self.core = core
        self.threads = threads
        self.dtype = dtype
        self.device = torch.device(device)
        self._sampling: dict[CallKey, _CallSampling] = {}
        self.decode_kernel = decode_kernel
        self.eos = {m: frozenset(ids) for m, ids in (eos_token_ids or {}).items()}
        self.archs = {name: arch for name, (arch, _) in models.items()}
        kv = core.kv
        self.pool = KVPool(kv.device_blocks, kv.host_blocks, kv.block_bytes, self.device)
        self._block_rows = self.pool.device_pool.view(kv.device_blocks, kv.block_bytes)
        self.region = torch.zeros(core.arena.arena_bytes, dtype=torch.uint8, device=self.device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.host_weights: dict[str, torch.Tensor] = {}
        self.paged: dict[str, PagedKV] = {}
        for name, (arch, weights) in models.items():
            self._check_spec(name, arch)
            adopted = (host_weights or {}).get(name)
            if adopted is not None:
                self.host_weights[name] = self._adopt(name, arch, adopted)
            else:
                self.host_weights[name] = self._flatten(name, arch, weights, pin)
            self.paged[name] = self.pool.paged(arch, dtype, KVTier.DEVICE)
            if self.paged[name].tokens_per_block != kv.tpb(name):
                raise ConfigError(
                    f"model {name}: a KV block holds {self.paged[name].tokens_per_block} tokens "
                    f"in {dtype} but the instance counts {kv.tpb(name)}"
                )
        self._models: dict[tuple[str, int], LlamaModel] = {}
        self._staged: str | None = None  # model whose first bytes sit in core.stage_blocks
        # stages copy on a background thread (CPU) or a side stream (CUDA)
        self._stager: BackgroundCopy | StreamCopy | None = None
        if background_staging and self.device.type == "cpu":
            self._stager = BackgroundCopy()
        elif background_staging and self.device.type == "cuda":
            self._stager = StreamCopy(self.device)
        self._abort_stage = False  # the core took the lent blocks back: stop the copy first
        self._prompts: dict[CallKey, tuple[int, ...]] = {}
        self.outputs: dict[CallKey, list[int]] = {}  # generated ids; kept until take_output
        # per generated id of the calls that ask for logprobs; dropped with their outputs
        self.logprobs: dict[CallKey, list[TokenLogprob]] = {}

    def _flatten(
        self, name: str, arch: ModelArch, weights: Mapping[str, torch.Tensor], pin: bool
    ) -> torch.Tensor:
        return flatten_weights(name, arch, weights, self.dtype, pin)

    def _adopt(self, name: str, arch: ModelArch, flat: torch.Tensor) -> torch.Tensor:
        """Share another runner's flat host weights (read-only here: switches and stages
        copy from them): runners of one process need one host copy of each model."""
        if flat.dtype != torch.uint8 or flat.numel() != arch.weight_bytes(self.dtype):
            raise ConfigError(
                f"model {name}: adopted host weights are {flat.numel()} {flat.dtype} elements, "
                f"the arena layout needs {arch.weight_bytes(self.dtype)} bytes"
            )
        return flat

    def _check_spec(self, name: str, arch: ModelArch) -> None:
        spec = self.core.models[name]
        if spec.weight_bytes != arch.weight_bytes(self.dtype):
            raise ConfigError(
                f"model {name}: the instance counts {spec.weight_bytes} weight bytes, the "
                f"architecture needs {arch.weight_bytes(self.dtype)} in {self.dtype}"
            )
        if spec.kv_bytes_per_token_on(self.core.spec.n_devices) != arch.kv_bytes_per_token(
            self.dtype
        ):
            raise ConfigError(f"model {name}: KV bytes per token differ from the instance's")

    # ------------------------------------------------------------------ intake
    def submit(self, call: Call, now: float, known_tokens: int = 0) -> Request:
        """Queue ``call`` (up to ``call.max_new_tokens`` tokens). Raises ``BadRequest`` for a
        token id outside the model's vocabulary and the core's errors (``ContextTooLong``,
        ``UnknownModel``) before anything is queued."""
        arch = self.archs.get(call.model)
        if arch is not None:
            ids = call.prompt.tokens()
            bad = next((t for t in ids if t >= arch.vocab_size), None)
            if bad is not None:
                raise BadRequest(
                    f"call {call.key}: token id {bad} is outside {call.model}'s vocabulary "
                    f"of {arch.vocab_size}"
                )
            self._prompts[call.key] = ids
        req = Request(call, None, call.max_new_tokens, now, known_tokens=known_tokens)
        try:
            self.core.submit(req)
        except Exception:
            self._prompts.pop(call.key, None)
            raise
        self.outputs[call.key] = []
        return req

    def take_output(self, key: CallKey) -> tuple[int, ...]:
        """The ids a finished call generated (forgotten afterwards)."""
        self._prompts.pop(key, None)
        self._sampling.pop(key, None)
        self.logprobs.pop(key, None)
        return tuple(self.outputs.pop(key))

    def forget(self, key: CallKey) -> None:
        """Drop what this runner keeps for a call that was aborted."""
        self._prompts.pop(key, None)
        self._sampling.pop(key, None)
        self.outputs.pop(key, None)
        self.logprobs.pop(key, None)

    def vocab_size(self, model: str) -> int | None:
        """Token ids ``model`` accepts here (None: not served by this runner)."""
        arch = self.archs.get(model)
        return arch.vocab_size if arch is not None else None

    def prepare(
        self,
        key: CallKey,
        params: SamplingParams,
        vocab_limit: int | None = None,
        forced: Sequence[int] | None = None,
    ) -> None:
        """Announce a call the core was given (the substrate protocol): its tokens are drawn
        with ``params`` (its own seeded generator; ids below ``vocab_limit`` only; logits
        processed by a ``LogitsProcessor`` when ``params.processes_logits``; each drawn id's
        logprob recorded in ``logprobs`` when ``params.logprobs`` is set), or are exactly
        ``forced`` (a replay), one per step. A call not prepared is greedy."""
        generator = None if params.greedy else make_generator(params, self.device)
        pinned = tuple(forced) if forced is not None else None
        self._sampling[key] = _CallSampling(params, generator, vocab_limit, pinned)
        self.outputs.setdefault(key, [])

    def _draw(self, logits: torch.Tensor, req: Request) -> int:
        """The next token of ``req`` from its last row of logits."""
        how = self._sampling.get(req.key)
        if how is None:  # greedy: the first maximum, as argmax
            return int(torch.argmax(logits))
        if how.forced is not None:
            return how.forced[len(self.outputs[req.key])]
        if how.vocab_limit is not None:
            logits = logits[: how.vocab_limit]
        raw = logits
        if how.params.processes_logits:
            if how.processor is None:
                ends = set(how.params.stop_token_ids)
                if not how.params.ignore_eos:
                    ends.update(self.eos.get(req.call.model, ()))
                how.processor = LogitsProcessor(
                    how.params, self._prompt(req), ends, logits.shape[-1], logits.device
                )
            logits = how.processor(logits)
        if how.generator is None:  # greedy: the first maximum, as argmax
            token = int(torch.argmax(logits))
        else:
            token = int(sample_row(logits.float(), how.params, how.generator))
        if how.processor is not None:
            how.processor.observe(token)
        if how.params.logprobs is not None:
            entry = token_logprob(raw, token, how.params.logprobs)
            self.logprobs.setdefault(req.key, []).append(entry)
        return token

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        return self.core.idle

    @property
    def executes_kv_moves(self) -> bool:
        """The KV moves the core plans are copied here, block by block."""
        return True

    # ------------------------------------------------------------------ one step
    def step(self, now: float) -> list[Request]:
        """Run one ``core.schedule(now)``; returns the calls that finished in it."""
        sched = self.plan(now)
        return self.commit(sched, self.execute(sched), now)

    def plan(self, now: float) -> Schedule:
        """The core's next decision (mutates the core; call from the task that owns it).

        First reports a background stage that has finished (``core.stage_done``); after
        deciding, notes whether the decision took the lent blocks of a stage still copying
        (then :meth:`execute` stops that copy before anything else)."""
        core, stager = self.core, self._stager
        if stager is not None and stager.active and stager.done:
            model = stager.model
            stager.wait()
            if model is not None and core.stage_blocks == stager.blocks:
                core.stage_done(model)
        sched = core.schedule(now)
        if stager is not None and stager.active:
            same = core.stage_blocks == stager.blocks
            if not same or core.arena.staging_in_progress != stager.model:
                self._abort_stage = True
        return sched

    def execute(self, sched: Schedule) -> Executed:
        """Do the tensor work of ``sched``: KV moves (in plan order, so demotions run before
        the restores that may reuse their blocks), the weight switch, the stage, the forward
        and sampling. Mutates tensors and this runner's outputs only, never the core, so it
        may run on a worker thread while the owning task routes new calls into the core (the
        calls of the step are read from ``sched`` and their ``Request`` objects)."""
        return self.execute_at(sched, Placement.of(self.core, sched))

    def execute_at(self, sched: Schedule, where: Placement) -> Executed:
        """``execute`` with the arena region of the step's model and the lent stage blocks
        given (``where``, captured when ``sched`` was planned) instead of read from the core:
        a runner in another process (``talaria.backends.ray``) executes schedules its own
        core never made, and reads only the core's fixed layout."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # per thread, and cheap: every step
        if self._abort_stage and self._stager is not None:
            self._stager.cancel()  # its blocks may be reused by this step's moves
            self._staged = None
            self._abort_stage = False
        for plan in sched.kv_moves:
            self.pool.execute(plan)
        if sched.step is not None:
            for plan in sched.step.kv_moves:
                self.pool.execute(plan)
        if sched.switch is not None:
            self._switch(sched.switch, where.stage_blocks)
        if sched.stage is not None:  # after the KV moves: a demotion may free a lent block
            self._stage(sched.stage, where.stage_blocks, where.staged_bytes)
        if sched.step is None:
            return Executed(())
        if where.region is None:
            raise RuntimeError(f"a step of {sched.step.model}, whose weights are in no region")
        return self._run(sched.step, sched.requests, where.region)

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        ends: Callable[[Request, int], bool] | None = None,
    ) -> list[Request]:
        """Report ``sched``'s execution to the core at ``now``; returns the calls that
        finished. A sampled token ends its call when ``ends(request, token)`` says so
        (default: the token is one of the model's end-of-sequence ids)."""
        eos = self.eos.get(sched.step.model, frozenset()) if sched.step is not None else ()
        return commit_schedule(
            self.core,
            sched,
            done,
            now,
            self.outputs,
            ends or (lambda _req, token: token in eos),
            stage_copied=self._stager is None,
        )

    def generate(
        self,
        calls: Iterable[Call],
        now: float = 0.0,
        tick_s: float = 0.01,
        max_steps: int = _MAX_IDLE_STEPS,
    ) -> dict[CallKey, tuple[int, ...]]:
        """Submit ``calls`` and step (the clock moving ``tick_s`` a step) until each has
        finished; returns each call's generated ids. For tests and scripts. While the core
        waits for a background stage to land, this sleeps until the copy is done instead of
        spinning (``max_steps`` counts decisions, not wall time)."""
        keys = [self.submit(call, now).key for call in calls]
        pending = set(keys)
        for _ in range(max_steps):
            if not pending:
                break
            sched = self.plan(now)
            for req in self.commit(sched, self.execute(sched), now):
                pending.discard(req.key)
            stager = self._stager
            while sched.waiting_for_stage and stager is not None and not stager.done:
                time.sleep(STAGE_POLL_S)  # ``plan`` reports the stage once it has landed
            now += tick_s
        else:
            raise RuntimeError(f"calls {sorted(pending)} did not finish in {max_steps} steps")
        return {key: self.take_output(key) for key in keys}

    # ------------------------------------------------------------------ weights
    def model(self, name: str, region: int) -> LlamaModel:
        """``name``'s forward bound to execution region ``region`` (views, made once)."""
        cached = self._models.get((name, region))
        if cached is None:
            arena = self.core.arena
            off = arena.region_offset(region)
            views = bind_weights(
                self.archs[name], self.region[off : off + arena.region_bytes], self.dtype
            )
            cached = self._models[(name, region)] = LlamaModel(
                self.archs[name], views, self.decode_kernel
            )
        return cached

    def restart(self, core: InstanceCore) -> None:
        """Serve ``core`` (a fresh core of the same instance) from now on: every call's state
        is dropped and a stage in flight cancelled; the tensors stay (the fresh core holds no
        weights, so its first step of a model switches it in)."""
        if self._stager is not None:
            self._stager.cancel()
        self._staged, self._abort_stage = None, False
        for state in (self._prompts, self._sampling, self.outputs, self.logprobs):
            state.clear()
        self.core = core

    def _switch(self, plan: SwitchPlan, lent: Sequence[int]) -> None:
        """Copy ``plan.model``'s weights into its region: the staged part device -> device
        from the lent blocks, the rest host -> device."""
        host = self.host_weights[plan.model]
        off = self.core.arena.region_offset(plan.region)
        dst = self.region[off : off + host.numel()]
        pos = 0
        for step in plan.steps:
            n = step.nbytes
            if step.link is Link.DEVICE_TO_DEVICE:
                if self._stager is not None:
                    self._stager.wait()  # the core switches only after stage_done: a no-op
                if self._staged != plan.model:
                    raise RuntimeError(f"switch to {plan.model} from staging it does not hold")
                for rows, lo, hi in self._lent_runs(n, lent):
                    dst[lo:hi].copy_(rows.flatten()[: hi - lo])
                pos = n
            elif step.link is Link.HOST_TO_DEVICE:
                dst[pos : pos + n].copy_(host[pos : pos + n], non_blocking=True)
                pos += n
            # DISK_TO_HOST: every model's host copy is kept here (see the module docstring)
        if plan.steps and pos != host.numel():
            raise RuntimeError(f"switch to {plan.model} copied {pos} of {host.numel()} bytes")
        self._staged = None

    def _stage(self, plan: SwitchPlan, ids: Sequence[int], n: int) -> None:
        """Copy the first ``n`` bytes (the arena's ``staged_bytes``) of the model's host
        weights into the lent blocks ``ids``, in order: started on the background copy
        thread (CPU) or the side stream (CUDA), else inline."""
        bb = self.core.kv.block_bytes
        if len(ids) * bb < n:
            raise RuntimeError(f"staging {n} bytes into {len(ids)} blocks of {bb}")
        src = self.host_weights[plan.model]
        runs = [(rows.flatten()[: hi - lo], src[lo:hi]) for rows, lo, hi in self._lent_runs(n, ids)]
        if self._stager is not None:
            self._stager.cancel()  # a stage the core abandoned for this one
            self._stager.start(plan.model, tuple(ids), runs)
        else:
            for dst, part in runs:
                dst.copy_(part, non_blocking=True)
        self._staged = plan.model

    def _lent_runs(self, n: int, lent: Sequence[int]) -> list[tuple[torch.Tensor, int, int]]:
        """The first ``n`` staged bytes as runs of consecutive ``lent`` blocks: ``(rows view,
        first byte, end byte)`` of the model's flat weights. Slice copies of whole runs run
        at memcpy speed, unlike index_select / index_copy_ on CPU."""
        bb = self.core.kv.block_bytes
        ids = lent[: math.ceil(n / bb)]
        runs: list[tuple[torch.Tensor, int, int]] = []
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[i - 1] + 1:
                lo, hi = start * bb, min(i * bb, n)
                runs.append((self._block_rows[ids[start] : ids[i - 1] + 1], lo, hi))
                start = i
        return runs

    # ------------------------------------------------------------------ forward
    def _run(self, plan: StepPlan, running: Mapping[CallKey, Request], region: int) -> Executed:
        seqs: list[SeqInput] = []
        sampled: list[Request | None] = []
        for key, n, start in plan.prefill:
            req = running[key]
            ids = self._prompt(req)
            seqs.append(SeqInput(ids[start : start + n], start, req.blocks))
            sampled.append(req if start + n == req.prompt_len else None)
        for key in plan.decode:
            req = running[key]
            out = self.outputs[key]
            seqs.append(SeqInput((out[-1],), req.prompt_len + len(out) - 1, req.blocks))
            sampled.append(req)
        batch = BatchInput(seqs)  # type: ignore[arg-type]  # attrs plugin: converter=tuple
        logits = self.model(plan.model, region).forward(batch, self.paged[plan.model])
        tokens: list[tuple[Request, int]] = []
        failed: list[tuple[Request, str]] = []
        for last, rows in zip(sampled, batch.split(logits), strict=True):
            if last is None:
                continue
            try:  # one call's sampling failing fails that call alone, not the step
                token = self._draw(rows[-1], last)
            except Exception as exc:
                log.exception("sampling call %s failed", last.key)
                failed.append((last, f"{type(exc).__name__}: {exc}"))
                continue
            self.outputs[last.key].append(token)
            tokens.append((last, token))
        return Executed(tuple(tokens), tuple(failed))

    def _prompt(self, req: Request) -> tuple[int, ...]:
        ids = self._prompts.get(req.key)
        if ids is None:
            ids = self._prompts[req.key] = req.call.prompt.tokens()
        return ids
