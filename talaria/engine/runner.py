"""The embedded engine's executor for one instance: real tensors sized by its memory layout.

:class:`EngineRunner` implements :class:`~talaria.executor.Executor`. It holds no policy: the
driver owns the instance's core and hands each decision over as a :class:`~talaria.executor.
Work` (the schedule, where it sits, the records of its calls). It owns the tensors the
core's accounting describes (sized by the core's :class:`~talaria.executor.Layout`):

* **weight arena**: one device tensor of ``layout.arena_bytes`` bytes, allocated once.
  Every model's parameters are bound
  (:func:`~talaria.engine.weight_layout.bind_weights`) as views at its region's offset; only
  the model whose weights were last copied into a region is valid there. A switch copies
  into the region; the data pointer never changes.
* **host tier of weights**: one flat byte tensor per model (pinned on CUDA), the source of
  every switch and stage. Without ``weight_files`` the arena's host budget is accounting:
  this runner keeps every model's host copy, and the arena's ``DISK_TO_HOST`` steps copy
  nothing. With :class:`~talaria.engine.weight_files.WeightFiles` the tier is real: the
  runner holds the copies of the models the arena starts with on host
  (``Layout.host_models``), a plan's ``DISK_TO_HOST`` step reads the model's file into a new
  host buffer, and its ``host_drops`` release theirs, so host memory follows the arena's
  budget and a cold start reads from the disk. A switch reads on the step's thread (the
  step waits for its weights); a stage's read runs on a reader thread of its own
  (:class:`~talaria.engine.weight_files.WeightReads`) and its copies wait for it on the
  stage thread. The arena counts the host copy from the stage's start, so a read goes on
  to its end when its stage is abandoned; the runner holds the copy once it is whole. A
  switch that needs a model still being read waits for the read (``waited_reads``); it
  reads the file itself only when the read was dropped or failed (``sync_reads``).
* **KV**: a :class:`~talaria.engine.kv_pool.KVPool` of ``layout.device_blocks`` /
  ``layout.host_blocks`` blocks of ``layout.block_bytes``, and one
  :class:`~talaria.engine.kv_pool.PagedKV` device view per model.
* **staging**: the first ``Placement.staged_bytes`` of the next model's flat weights are
  copied into the device KV blocks the core lent for it (``Placement.stage_blocks``, in
  order); a switch to the staged model copies them device -> device into its region and only
  the rest from host. On CPU the stage copy runs on a low-priority background thread
  (:class:`~talaria.engine.staging.BackgroundCopy`), on CUDA on a side stream
  (:class:`~talaria.engine.staging.StreamCopy`), while later steps run; the step that
  finds it landed reports it (``Executed.stage_landed``), and a stage the core abandoned
  (the work's placement stages another model, or into other blocks) is cancelled before
  its blocks are reused.

:meth:`EngineRunner.execute` runs one work: KV moves (in plan order, so demotions run before
the restores that may reuse their blocks), a weight switch, a stage, then one forward over
the step's prefill chunks and decodes, sampling one token per sequence whose prompt is
complete. Everything but a stage copy runs on the caller's thread (CPU) or stream (CUDA); on
CUDA the switch's device -> device copy is ordered after the side stream's event, not after
a host wait.

Not thread-safe: one driver executes on a runner at a time.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from typing import Final

import attrs
import llguidance
import torch

from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.grammar import GrammarMask, ll_tokenizer
from talaria.engine.kernels import DecodeKernel
from talaria.engine.kv_pool import KVPool, PagedKV
from talaria.engine.logits import LogitsProcessor, token_logprob
from talaria.engine.model import LlamaModel
from talaria.engine.sampling import make_generator, sample_row, skip_draws
from talaria.engine.staging import BackgroundCopy, Fill, StreamCopy
from talaria.engine.tokenizer import Tokenizer
from talaria.engine.weight_files import WeightFiles, WeightReads, whole
from talaria.engine.weight_layout import bind_weights
from talaria.errors import BadRequest, ConfigError
from talaria.executor import CallRecord, Layout, Work
from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.memory.weights import SwitchPlan
from talaria.schedule import Executed, Placement, Request, StepPlan
from talaria.types import KVTier, Link

log = logging.getLogger(__name__)

READ_POLL_S: Final = 0.002
"""How often a stage waiting for its model's read checks whether it ended or was cancelled."""


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
    """How one call draws its tokens here, built from its record at its first draw."""

    params: SamplingParams
    generator: torch.Generator | None
    processor: LogitsProcessor | None = None  # built at the first draw, if params need one
    grammar: GrammarMask | None = None  # built at the first draw, if params carry one
    # the prompt's last ``resumed`` ids were generated by this call on another instance
    # (it moved here when that one was lost): its generator and logits state catch up with
    # them at the first draw, so the answer goes on as if it had never moved
    resumed: int = 0


class EngineRunner:
    """Executes one instance's work on real tensors (see the module docstring).

    ``layout``: the instance core's memory layout (``InstanceCore.layout``); ``models`` maps
    every model of it to its architecture and its weights (Hugging Face parameter names; any
    dtype, converted to ``dtype``). The layout must describe the models in ``dtype``
    (``ModelArch.to_spec(name, dtype)``): weight bytes, KV bytes per token and tokens per
    block are checked. ``eos_token_ids`` per model are the ends a ``min_tokens`` holds back;
    ``decode_kernel`` (:func:`~talaria.engine.kernels.optional_decode_kernel`) lets bf16
    models on CPU attend in place during decode. ``background_staging``: a stage copies on
    a low-priority thread (CPU, :class:`~talaria.engine.staging.BackgroundCopy`) or a side
    stream (CUDA, :class:`~talaria.engine.staging.StreamCopy`) while later steps run, and a
    later step reports it landed; otherwise it copies inside the step that carries it.
    ``tokenizers`` per model let calls with a grammar be constrained (llguidance reads the
    vocabulary; a model without one refuses such calls). ``threads``: the torch threads
    every step uses, set on the executing thread at each step (a thread's OpenMP team
    starts at the process default, whatever ``torch.set_num_threads`` said on another
    thread, and the live runtime executes steps on worker threads); None leaves the thread
    as it is.
    """

    def __init__(
        self,
        layout: Layout,
        models: Mapping[str, tuple[ModelArch, Mapping[str, torch.Tensor]]],
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        eos_token_ids: Mapping[str, Collection[int]] | None = None,
        host_weights: Mapping[str, torch.Tensor] | None = None,
        decode_kernel: DecodeKernel | None = None,
        background_staging: bool = True,
        threads: int | None = None,
        tokenizers: Mapping[str, Tokenizer | None] | None = None,
        weight_files: WeightFiles | None = None,
    ) -> None:
        if set(models) != set(layout.models):
            raise ConfigError(
                f"runner models {sorted(models)} differ from the instance's {sorted(layout.models)}"
            )
        if threads is not None and threads < 1:
            raise ConfigError(f"a runner needs at least one thread, got {threads}")
        self.layout = layout
        self.threads = threads
        self.dtype = dtype
        self.device = torch.device(device)
        self._sampling: dict[CallKey, _CallSampling] = {}
        self.decode_kernel = decode_kernel
        self.eos = {m: frozenset(ids) for m, ids in (eos_token_ids or {}).items()}
        self.archs = {name: arch for name, (arch, _) in models.items()}
        self.tokenizers = dict(tokenizers or {})
        self._ll: dict[str, llguidance.LLTokenizer] = {}  # per model, built at first use
        bb = layout.block_bytes
        self.pool = KVPool(layout.device_blocks, layout.host_blocks, bb, self.device)
        self._block_rows = self.pool.device_pool.view(layout.device_blocks, layout.block_bytes)
        self.region = torch.zeros(layout.arena_bytes, dtype=torch.uint8, device=self.device)
        self._pin = pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.weight_files = weight_files
        self.host_weights: dict[str, torch.Tensor] = {}
        self.paged: dict[str, PagedKV] = {}
        for name, (arch, weights) in models.items():
            self._check_spec(name, arch)
            adopted = (host_weights or {}).get(name)
            if weight_files is None or name in layout.host_models:  # else on disk only
                self.host_weights[name] = (
                    self._adopt(name, arch, adopted)
                    if adopted is not None
                    else self._flatten(name, arch, weights, pin)
                )
            self.paged[name] = self.pool.paged(arch, dtype, KVTier.DEVICE)
            if self.paged[name].tokens_per_block != layout.tpb(name):
                raise ConfigError(
                    f"model {name}: a KV block holds {self.paged[name].tokens_per_block} tokens "
                    f"in {dtype} but the instance counts {layout.tpb(name)}"
                )
        self._models: dict[tuple[str, int], LlamaModel] = {}
        self._staged: str | None = None  # model whose first bytes sit in the lent blocks
        # a stage's read of a model on disk: on a reader thread, kept even if the stage is not
        self._reads = WeightReads(weight_files) if weight_files is not None else None
        self.sync_reads = 0  # weight files read on the step thread for want of a stage's read
        self.waited_reads = 0  # switches that waited on the end of a stage's read
        # stages copy on a background thread (CPU) or a side stream (CUDA)
        self._stager: BackgroundCopy | StreamCopy | None = None
        if background_staging and self.device.type == "cpu":
            self._stager = BackgroundCopy()
        elif background_staging and self.device.type == "cuda":
            self._stager = StreamCopy(self.device)

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
        layout = self.layout
        if layout.weights_of(name) != arch.weight_bytes(self.dtype):
            raise ConfigError(
                f"model {name}: the instance counts {layout.weights_of(name)} weight bytes, "
                f"the architecture needs {arch.weight_bytes(self.dtype)} in {self.dtype}"
            )
        if layout.kv_per_token(name) != arch.kv_bytes_per_token(self.dtype):
            raise ConfigError(f"model {name}: KV bytes per token differ from the instance's")

    # ------------------------------------------------------------------ the protocol
    @property
    def executes_kv_moves(self) -> bool:
        """The KV moves the core plans are copied here, block by block."""
        return True

    def vocab_size(self, model: str) -> int | None:
        """Token ids ``model`` accepts here (None: not served by this runner)."""
        arch = self.archs.get(model)
        return arch.vocab_size if arch is not None else None

    def execute(self, work: Work) -> Executed:
        """Do the tensor work of ``work``: drop the state of its dropped calls, stop a stage
        the core abandoned, then KV moves (in plan order, so demotions run before the
        restores that may reuse their blocks), the weight switch, the stage, the forward and
        sampling; report a background stage that landed. Reads the work's records, mutates
        tensors and this runner's sampling state only."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # per thread, and cheap: every step
        for key in work.dropped:
            self._sampling.pop(key, None)
        sched, where = work.schedule, work.where
        stager = self._stager
        if stager is not None and stager.active and self._abandoned(where):
            stager.cancel()  # its blocks may be reused by this step's moves
            self._staged = None
        self._take_reads()
        for plan in sched.kv_moves:
            self.pool.execute(plan)
        if sched.step is not None:
            for plan in sched.step.kv_moves:
                self.pool.execute(plan)
        if sched.switch is not None:
            self._switch(sched.switch, where.stage_blocks)
        if sched.stage is not None:  # after the KV moves: a demotion may free a lent block
            self._stage(sched.stage, where.stage_blocks, where.staged_bytes)
        done = Executed()
        if sched.step is not None:
            if where.region is None:
                raise RuntimeError(f"a step of {sched.step.model}, whose weights are in no region")
            done = self._run(sched.step, sched.requests, work.calls, where.region)
        return attrs.evolve(
            done,
            stage_pending=sched.stage is not None and stager is not None,
            stage_landed=self._landed(),
        )

    def _abandoned(self, where: Placement) -> bool:
        """The core stages another model, or into other blocks, than the copy under way."""
        stager = self._stager
        if stager is None:
            return False
        return stager.model != where.staging or stager.blocks != where.stage_blocks

    def _landed(self) -> tuple[str, tuple[int, ...]] | None:
        """The background stage that finished copying (once), with its lent blocks."""
        stager = self._stager
        if stager is None or not stager.active or not stager.done or stager.model is None:
            return None
        stager.wait()
        self._take_reads()
        return stager.model, stager.blocks

    def _take_reads(self) -> None:
        """Hold the host copies whose stage reads have ended whole."""
        if self._reads is not None:
            self.host_weights.update(self._reads.take_done())

    @property
    def host_models(self) -> frozenset[str]:
        """Models with a host copy here: held, or being read for a stage."""
        reading = self._reads.pending if self._reads is not None else ()
        return frozenset(self.host_weights).union(reading)

    def restart(self, layout: Layout) -> None:
        """Serve a fresh core of the same ``layout`` from now on: every call's state is
        dropped and a stage in flight cancelled; the tensors stay (the fresh core holds no
        weights, so its first step of a model switches it in)."""
        if layout != self.layout:
            raise ConfigError(f"a restart with layout {layout}, the buffers are {self.layout}")
        if self._stager is not None:
            self._stager.cancel()
        if self._reads is not None:
            self._reads.drop_all()
        self._staged = None
        self._sampling.clear()
        if self.weight_files is not None:  # the fresh arena's host tier: its starting models
            for name in set(self.host_weights) - set(layout.host_models):
                del self.host_weights[name]
            for name in layout.host_models:
                if name not in self.host_weights:
                    self._read(name)

    def _draw(self, logits: torch.Tensor, rec: CallRecord) -> tuple[int, TokenLogprob | None]:
        """The next token of the call ``rec`` from its last row of logits, and its logprob
        if the call's params ask for them."""
        if rec.forced is not None:
            return rec.forced[len(rec.outputs)], None
        how = self._sampling.get(rec.key)
        if how is None:
            generator = None if rec.params.greedy else make_generator(rec.params, self.device)
            how = self._sampling[rec.key] = _CallSampling(
                rec.params, generator, resumed=max(0, rec.resumed)
            )
        if rec.params.grammar is not None and how.grammar is None:
            how.grammar = self._grammar(rec)
        if rec.vocab_limit is not None:
            logits = logits[: rec.vocab_limit]
        raw = logits
        if how.grammar is not None:
            logits = how.grammar.apply(logits)
        if how.resumed and how.generator is not None:
            skip_draws(how.generator, how.resumed, logits.shape[-1], logits.device)
        if how.params.processes_logits:
            if how.processor is None:
                how.processor = self._processor(rec, how, logits)
            logits = how.processor(logits)
        how.resumed = 0
        if how.generator is None:  # greedy: the first maximum, as argmax
            token = int(torch.argmax(logits))
        else:
            token = int(sample_row(logits.float(), how.params, how.generator))
        if how.processor is not None:
            how.processor.observe(token)
        if how.grammar is not None:
            how.grammar.accept((token,))
        if how.params.logprobs is None:
            return token, None
        return token, token_logprob(raw, token, how.params.logprobs)

    def _grammar(self, rec: CallRecord) -> GrammarMask:
        """The call's grammar state, moved past its own answer so far if it resumed."""
        grammar, tok = rec.params.grammar, self.tokenizers.get(rec.model)
        if grammar is None or tok is None:
            raise BadRequest(f"model {rec.model} has no tokenizer here: it cannot follow a grammar")
        vocab = self.archs[rec.model].vocab_size
        ll = self._ll.get(rec.model)
        if ll is None:
            ll = self._ll[rec.model] = ll_tokenizer(tok, vocab)
        mask = GrammarMask(grammar, ll, vocab)
        if rec.resumed:
            mask.accept(rec.prompt[len(rec.prompt) - rec.resumed :])
        return mask

    def _processor(
        self, rec: CallRecord, how: _CallSampling, logits: torch.Tensor
    ) -> LogitsProcessor:
        """The call's logits state, caught up with its own answer so far if it resumed."""
        ends = set(how.params.stop_token_ids)
        if not how.params.ignore_eos:
            ends.update(self.eos.get(rec.model, ()))
        prompt = rec.prompt
        own = prompt[len(prompt) - how.resumed :] if how.resumed else ()
        processor = LogitsProcessor(
            how.params, prompt[: len(prompt) - len(own)], ends, logits.shape[-1], logits.device
        )
        for token in own:
            processor.observe(token)
        return processor

    # ------------------------------------------------------------------ weights
    def model(self, name: str, region: int) -> LlamaModel:
        """``name``'s forward bound to execution region ``region`` (views, made once)."""
        cached = self._models.get((name, region))
        if cached is None:
            layout = self.layout
            off = layout.region_offsets[region]
            views = bind_weights(
                self.archs[name], self.region[off : off + layout.region_bytes], self.dtype
            )
            cached = self._models[(name, region)] = LlamaModel(
                self.archs[name], views, self.decode_kernel
            )
        return cached

    def _switch(self, plan: SwitchPlan, lent: Sequence[int]) -> None:
        """Copy ``plan.model``'s weights into its region: the staged part device -> device
        from the lent blocks, the rest host -> device (after reading the model's file, where
        the plan loads it from disk)."""
        self._host_tier(plan)
        host = self.host_weights[plan.model]
        off = self.layout.region_offsets[plan.region]
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
            # DISK_TO_HOST: done before the copies (_host_tier), or kept (no weight files)
        if plan.steps and pos != host.numel():
            raise RuntimeError(f"switch to {plan.model} copied {pos} of {host.numel()} bytes")
        self._staged = None

    def _stage(self, plan: SwitchPlan, ids: Sequence[int], n: int) -> None:
        """Copy the first ``n`` bytes (the arena's ``staged_bytes``) of the model's host
        weights into the lent blocks ``ids``, in order: started on the background copy
        thread (CPU; once the model's file is read on the reader, where the plan loads it
        from disk) or the side stream (CUDA; the file read inline), else inline."""
        bb = self.layout.block_bytes
        if len(ids) * bb < n:
            raise RuntimeError(f"staging {n} bytes into {len(ids)} blocks of {bb}")
        stager = self._stager
        if stager is not None:
            stager.cancel()  # a stage the core abandoned for this one
        fill: Fill | None = None
        reads = self._reads
        reading = reads is not None and (_from_disk(plan) or plan.model in reads.pending)
        if reads is not None and reading and isinstance(stager, BackgroundCopy):
            # the file is read on the reader (or an abandoned stage's read of it goes on),
            # the copies wait for it on the stage thread
            self._drop_host(plan)
            src, read = reads.start_or_join(plan.model, self.layout.weights_of(plan.model))
            fill = functools.partial(_after_read, read)
        else:
            self._host_tier(plan)
            src = self.host_weights[plan.model]
        runs = [(rows.flatten()[: hi - lo], src[lo:hi]) for rows, lo, hi in self._lent_runs(n, ids)]
        if stager is not None:
            stager.start(plan.model, tuple(ids), runs, fill)
        else:
            for dst, part in runs:
                dst.copy_(part, non_blocking=True)
        self._staged = plan.model

    def _host_tier(self, plan: SwitchPlan) -> None:
        """With weight files: release the plan's ``host_drops``, then read ``plan.model``'s
        file if the plan loads it from disk, or if the host copy the arena counts was being
        read by a stage that was cancelled before the read ended. Without: nothing (every
        host copy is kept)."""
        if self.weight_files is None:
            return
        self._drop_host(plan)
        if _from_disk(plan):
            self._read(plan.model)
        elif plan.model not in self.host_weights:
            read = self._reads.wait(plan.model) if self._reads is not None else None
            if read is not None:  # an abandoned stage's read, not ended yet
                self.host_weights[plan.model] = read
                self.waited_reads += 1
            else:
                self._read(plan.model)
                self.sync_reads += 1

    def _drop_host(self, plan: SwitchPlan) -> None:
        for name in plan.host_drops:
            self.host_weights.pop(name, None)
            if self._reads is not None:
                self._reads.drop(name)

    def _read(self, name: str) -> None:
        files = self.weight_files
        if files is None:
            raise RuntimeError(f"no weight files to read {name} from")
        self.host_weights[name] = files.read(name, self.layout.weights_of(name), self._pin)

    def _lent_runs(self, n: int, lent: Sequence[int]) -> list[tuple[torch.Tensor, int, int]]:
        """The first ``n`` staged bytes as runs of consecutive ``lent`` blocks: ``(rows view,
        first byte, end byte)`` of the model's flat weights. Slice copies of whole runs run
        at memcpy speed, unlike index_select / index_copy_ on CPU."""
        bb = self.layout.block_bytes
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
    def _run(
        self,
        plan: StepPlan,
        running: Mapping[CallKey, Request],
        records: Mapping[CallKey, CallRecord],
        region: int,
    ) -> Executed:
        seqs: list[SeqInput] = []
        sampled: list[Request | None] = []
        for key, n, start in plan.prefill:
            req = running[key]
            ids = records[key].prompt
            seqs.append(SeqInput(ids[start : start + n], start, req.blocks))
            sampled.append(req if start + n == req.prompt_len else None)
        for key in plan.decode:
            req = running[key]
            out = records[key].outputs
            seqs.append(SeqInput((out[-1],), req.prompt_len + len(out) - 1, req.blocks))
            sampled.append(req)
        batch = BatchInput(seqs)  # type: ignore[arg-type]  # attrs plugin: converter=tuple
        logits = self.model(plan.model, region).forward(batch, self.paged[plan.model])
        tokens: list[tuple[Request, int]] = []
        logprobs: list[tuple[CallKey, TokenLogprob]] = []
        failed: list[tuple[Request, str]] = []
        for last, rows in zip(sampled, batch.split(logits), strict=True):
            if last is None:
                continue
            try:  # one call's sampling failing fails that call alone, not the step
                token, logprob = self._draw(rows[-1], records[last.key])
            except Exception as exc:
                log.exception("sampling call %s failed", last.key)
                failed.append((last, f"{type(exc).__name__}: {exc}"))
                continue
            tokens.append((last, token))
            if logprob is not None:
                logprobs.append((last.key, logprob))
        return Executed(tuple(tokens), tuple(failed), tuple(logprobs))


def _from_disk(plan: SwitchPlan) -> bool:
    """Whether ``plan`` reads its model's weights from disk first."""
    return any(step.link is Link.DISK_TO_HOST for step in plan.steps)


def _after_read(read: Future[bool], cancelled: Callable[[], bool]) -> bool:
    """A stage's fill: wait on the stage thread for its model's read to end (True: whole),
    or for the stage to be cancelled (False; the read goes on)."""
    while not read.done():
        if cancelled():
            return False
        time.sleep(READ_POLL_S)
    return whole(read)
