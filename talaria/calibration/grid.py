"""A step-time grid: the engine's forward over batch x context and chunk x cached prefix.

The calibration's microbenchmarks (:mod:`talaria.calibration.engine`) measure a handful of
shapes through the serving path and fit one rate from each pair. This module measures the
same forward (``LlamaModel.forward`` on a paged KV pool, the native decode kernel where it
builds, as the runner calls it) over a grid of shapes, so that a cost model can be checked
where the replays really run it:

- decode: ``batch`` sequences of ``context`` tokens each, one token each;
- prefill: one ``chunk``-token chunk after a cached ``prefix``.

The KV the steps read is the pool's zeros: a step's time does not depend on what the cache
holds, only on how much of it is read. :func:`measure_grid` returns :class:`StepPoint` rows
(plain data, JSON-ready with :meth:`StepPoint.to_json`); :mod:`talaria.calibration.linear`
fits and checks a cost model on them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import torch

from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kernels import optional_decode_kernel
from talaria.engine.kv_pool import KVPool
from talaria.engine.model import LlamaModel
from talaria.engine.threads import in_own_thread
from talaria.engine.weight_layout import bind_weights
from talaria.errors import ConfigError

T = TypeVar("T")

BLOCK_TOKENS = 16
"""Tokens per KV block (the runtime's default ``block_size``)."""


def _check_sizes(values: object, what: str, zero: bool) -> None:
    low = 0 if zero else 1
    if (
        not isinstance(values, tuple)
        or not values
        or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values)
    ):
        raise ConfigError(f"StepGrid.{what} must be a non-empty tuple of integers >= {low}")


@attrs.frozen
class StepGrid:
    """The shapes measured per model and how often (the median of ``reps`` after a warm-up).
    The defaults cover what the embedded replay runs (up to 12 sessions, contexts up to
    8,192 tokens at its token scale) on two cores in about a minute per model."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_contexts: tuple[int, ...] = (256, 1024, 4096)
    chunks: tuple[int, ...] = (16, 64, 256, 1024)
    prefixes: tuple[int, ...] = (0, 1024, 4096)
    multi: tuple[int, ...] = (4,)
    reps: int = 3

    def __attrs_post_init__(self) -> None:
        for name in ("decode_batches", "decode_contexts", "chunks", "prefixes"):
            _check_sizes(getattr(self, name), name, zero=name == "prefixes")
        multi = self.multi
        if not isinstance(multi, tuple) or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 2 for k in multi
        ):
            raise ConfigError("StepGrid.multi must be a tuple of integers >= 2 (may be empty)")
        if isinstance(self.reps, bool) or not isinstance(self.reps, int) or self.reps < 1:
            raise ConfigError("StepGrid.reps must be an integer >= 1")

    def describe(self) -> str:
        return (
            f"step grid: decode batches {list(self.decode_batches)} x contexts "
            f"{list(self.decode_contexts)}, chunks {list(self.chunks)} x cached prefixes "
            f"{list(self.prefixes)}, {list(self.multi)} sequences prefilling "
            f"{self.multi_chunk}-token chunks at once, {self.reps} reps"
        )

    @property
    def multi_chunk(self) -> int:
        """The chunk of each sequence of a step that prefills several at once (the second
        smallest chunk, or the only one)."""
        return self.chunks[min(1, len(self.chunks) - 1)]

    @property
    def kv_blocks(self) -> int:
        """KV blocks the largest shape holds at once (the pool is sized for it)."""
        slack = 4 + self.reps  # prefills run at fresh lengths around their chunk
        decode = max(self.decode_batches) * _blocks(max(self.decode_contexts) + 1)
        prefill = _blocks(max(self.prefixes) + max(self.chunks) + slack)
        multi = max(self.multi, default=0) * _blocks(max(self.prefixes) + self.multi_chunk + slack)
        return max(decode, prefill, multi)

    def shapes(self) -> list[tuple[int, int, int, int, int]]:
        """``(batch, context, chunk, prefix, prefilling)`` of every point: decode points
        have chunk 0 and no sequence prefilling; prefill points batch 0 and ``prefilling``
        sequences each prefilling ``chunk`` tokens after ``prefix`` cached ones."""
        decode = [(b, c, 0, 0, 0) for c in self.decode_contexts for b in self.decode_batches]
        prefill = [(0, 0, n, p, 1) for p in self.prefixes for n in self.chunks]
        n = self.multi_chunk
        multi = [(0, 0, n, p, k) for k in self.multi for p in self.prefixes]
        return decode + prefill + multi


@attrs.frozen
class StepPoint:
    """One measured step: ``batch`` decoding sequences of ``context`` tokens each, or
    ``prefilling`` sequences each prefilling a ``chunk``-token chunk after ``prefix`` cached
    tokens; and its median seconds."""

    model: str
    batch: int
    context: int
    chunk: int
    prefix: int
    seconds: float
    prefilling: int = 1

    @property
    def is_decode(self) -> bool:
        return self.chunk == 0

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StepPoint:
        return cls(**doc)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _table(first: int, tokens: int) -> tuple[int, ...]:
    return tuple(range(first, first + _blocks(tokens)))


class BareForward:
    """One model's forward alone, as the runner runs it: a weight region of its own (a copy of
    ``flat`` on ``device``), the decode kernel where it builds, and a zeroed KV pool of
    ``kv_blocks`` on ``device``. The grid and the step benchmarks time steps on it."""

    def __init__(
        self,
        arch: ModelArch,
        flat: torch.Tensor,
        dtype: torch.dtype,
        kv_blocks: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.region = flat.to(self.device, copy=True)
        weights = bind_weights(arch, self.region, dtype)
        self.model = LlamaModel(arch, weights, optional_decode_kernel(self.device))
        block_bytes = KVPool.block_bytes_for([arch], dtype, BLOCK_TOKENS)
        self.pool = KVPool(kv_blocks, 1, block_bytes, self.device)
        self.pool.device_pool.zero_()
        self.kv = self.pool.paged(arch, dtype)
        self.vocab = arch.vocab_size

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, batch: BatchInput, reps: int) -> float:
        """The median seconds of ``reps`` forwards of ``batch`` after a warm-up, the device
        synchronised around each."""
        times = []
        with torch.inference_mode():
            for r in range(reps + 1):
                self.sync()
                t0 = time.perf_counter()
                self.model.forward(batch, self.kv)
                self.sync()
                if r:
                    times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def decode(self, batch: int, context: int) -> Callable[[], object]:
        per = _blocks(context + 1)
        seqs = [
            SeqInput((1 + i % (self.vocab - 1),), context, _table(i * per, context + 1))
            for i in range(batch)
        ]
        step = BatchInput(seqs)  # type: ignore[arg-type]  # attrs plugin: converter=tuple
        return lambda: self.model.forward(step, self.kv)

    def prefill(self, chunk: int, prefix: int, seqs: int = 1) -> Callable[[], object]:
        ids = tuple(1 + i % (self.vocab - 1) for i in range(chunk))
        per = _blocks(prefix + chunk)
        step = BatchInput(
            [SeqInput(ids, prefix, _table(i * per, prefix + chunk)) for i in range(seqs)]  # type: ignore[misc]
        )
        return lambda: self.model.forward(step, self.kv)

    def fresh_prefill(self, chunk: int, prefix: int, seqs: int, calls: int) -> Callable[[], object]:
        """The prefill of ``chunk`` tokens after ``prefix``, each of ``calls`` calls at a
        token count the process has not run before (``chunk`` + 4, + 1, - 1, + 2, - 2, ...;
        at least 1): serving rarely sees a prefill's length twice, and a new length costs
        more than a repeated one (the matmul library builds and caches kernels per shape),
        so a grid that repeated one length would price the warm case."""
        offsets = [4] + [sign * k for k in range(1, calls) for sign in (1, -1)]
        steps = [self.prefill(max(1, chunk + off), prefix, seqs) for off in offsets[:calls]]
        calls_made = iter(steps)
        return lambda: next(calls_made)()


def _interleaved_medians(steps: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """The median time of each step over ``reps`` rounds after a warm-up round, every
    round running each step once in turn: a disturbance on a shared machine (another
    process for a second) then hits one repetition of several points, which the median
    drops, rather than every repetition of one point."""
    times: list[list[float]] = [[] for _ in steps]
    for r in range(reps + 1):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            if r:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def on_worker_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in inference mode on a thread of its own that exits when done
    (:func:`~talaria.engine.threads.in_own_thread`): the grid builds its engine and times
    its steps there, the only thread whose OpenMP team is alive, as the live runtime's
    steps run."""

    def run() -> T:
        with torch.inference_mode():
            return fn()

    return in_own_thread(run, "talaria-step-grid")


def measure_grid(
    name: str,
    arch: ModelArch,
    flat: torch.Tensor,
    dtype: torch.dtype,
    grid: StepGrid,
) -> list[StepPoint]:
    """Every shape of ``grid`` on ``name`` (``arch`` with its flat weights ``flat``, as
    :func:`~talaria.engine.runner.flatten_weights` lays them out), in ``dtype``,
    on a worker thread with torch's current thread count (:func:`on_worker_thread`, which
    also builds it). Allocates the model's weights once more and a KV pool for the largest
    shape, both freed as it returns."""
    shapes = grid.shapes()

    def timed() -> list[float]:
        fwd = BareForward(arch, flat, dtype, grid.kv_blocks)
        calls = grid.reps + 1  # the warm-up and the timed repetitions
        steps = [
            fwd.decode(b, c) if n == 0 else fwd.fresh_prefill(n, p, max(k, 1), calls)
            for b, c, n, p, k in shapes
        ]
        return _interleaved_medians(steps, grid.reps)

    seconds = on_worker_thread(timed)
    return [
        StepPoint(name, b, c, n, p, s, prefilling=max(k, 1))
        for (b, c, n, p, k), s in zip(shapes, seconds, strict=True)
    ]


def measure_co_run(
    arch: ModelArch, flat: torch.Tensor, dtype: torch.dtype, grid: StepGrid
) -> dict[str, float]:
    """How much slower a step runs while a second engine (its own copy of the weights and
    its own KV pool) steps on another thread, as a second instance in the same process does:
    the median time of the grid's middle decode shape and middle fresh prefill chunk alone
    and beside the other engine's decode steps of the middle shape, alternating
    ``grid.reps`` rounds so that drift hits both alike; both run on worker threads
    (:func:`on_worker_thread`) with torch's current thread count. Returns
    ``co_run_s_alone`` and ``co_run_s_beside`` (sums over the two shapes of the medians,
    seconds)."""
    batch, context = grid.decode_batches, grid.decode_contexts
    b, c = batch[len(batch) // 2], context[len(context) // 2]
    n = grid.chunks[len(grid.chunks) // 2]
    blocks = max(b * _blocks(c + 1), _blocks(n))
    threads = torch.get_num_threads()
    stop = threading.Event()
    steps: list[Callable[[], object]] = []
    noise: list[Callable[[], object]] = []

    def busy() -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            while not stop.is_set():
                noise[0]()

    alone: list[list[float]] = [[], []]
    beside: list[list[float]] = [[], []]

    def rounds() -> None:
        mine, other = (BareForward(arch, flat, dtype, blocks) for _ in range(2))
        steps.extend([mine.decode(b, c), mine.prefill(n, 0)])
        noise.append(other.decode(b, c))
        for step in steps:
            step()  # warm-up
        for _ in range(grid.reps):
            for i, t in enumerate(_interleaved_medians(steps, 1)):
                alone[i].append(t)
            worker = threading.Thread(target=busy, daemon=True)
            worker.start()
            try:
                for i, t in enumerate(_interleaved_medians(steps, 1)):
                    beside[i].append(t)
            finally:
                stop.set()
                worker.join()
                stop.clear()

    on_worker_thread(rounds)
    return {
        "co_run_s_alone": sum(statistics.median(ts) for ts in alone),
        "co_run_s_beside": sum(statistics.median(ts) for ts in beside),
    }


def points_json(points: Sequence[StepPoint]) -> list[dict[str, Any]]:
    return [p.to_json() for p in points]
