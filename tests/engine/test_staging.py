"""``talaria.engine.staging``: ``BackgroundCopy`` (exact copies, cancel between chunks, errors)
and, on CUDA, ``StreamCopy`` (the same on a side stream)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from talaria.engine.staging import CHUNK_BYTES, BackgroundCopy, StreamCopy


def _runs(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.zeros(n, dtype=torch.uint8),
            torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
        )
        for n in sizes
    ]


def test_copies_every_run_exactly_and_can_be_reused() -> None:
    copier = BackgroundCopy()
    assert copier.done and not copier.active
    runs = _runs([3 * CHUNK_BYTES + 5, 17, CHUNK_BYTES], seed=1)
    copier.start("m", (4, 5, 9), runs)
    assert copier.active and copier.model == "m" and copier.blocks == (4, 5, 9)
    copier.wait()
    assert not copier.active and copier.done
    assert copier.copied_bytes == sum(src.numel() for _, src in runs)
    for dst, src in runs:
        assert torch.equal(dst, src)
    again = _runs([100], seed=2)
    copier.start("n", (1,), again)
    copier.wait()
    assert torch.equal(again[0][0], again[0][1])


def test_typed_views_of_other_dtypes_copy_by_bytes() -> None:
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(4000, dtype=torch.uint8)
    copier = BackgroundCopy()
    copier.start("m", (0,), [(dst, src.view(torch.uint8))])
    copier.wait()
    assert torch.equal(dst.view(torch.float32), src)


def test_cancel_stops_between_chunks_and_leaves_it_idle() -> None:
    copier = BackgroundCopy()
    runs = _runs([64 * CHUNK_BYTES], seed=3)
    copier.start("m", (0,), runs)
    copier.cancel()
    assert not copier.active and copier.done and copier.model is None and copier.blocks == ()
    assert copier.copied_bytes % CHUNK_BYTES == 0  # whole chunks only
    assert copier.copied_bytes <= 64 * CHUNK_BYTES
    copier.cancel()  # idempotent


def test_a_fill_writes_the_sources_on_the_copy_thread_first() -> None:
    """A fill (a weight file read) runs on the copy thread before the copies; the copies
    then carry what it wrote."""
    copier = BackgroundCopy()
    src = torch.zeros(CHUNK_BYTES + 7, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    where: list[str] = []

    def fill(cancelled: Callable[[], bool]) -> bool:
        where.append(threading.current_thread().name)
        src.fill_(7)
        return not cancelled()

    copier.start("m", (0,), [(dst, src)], fill)
    copier.wait()
    assert where == ["stage-m"]
    assert bool((dst == 7).all()) and copier.copied_bytes == src.numel()


def test_a_cancel_during_the_fill_stops_it_and_copies_nothing() -> None:
    copier = BackgroundCopy()
    runs = _runs([CHUNK_BYTES], seed=4)
    started = threading.Event()

    def fill(cancelled: Callable[[], bool]) -> bool:
        started.set()
        while not cancelled():
            time.sleep(0.001)
        return False

    copier.start("m", (0,), runs, fill)
    assert started.wait(10)
    copier.cancel()
    assert copier.copied_bytes == 0
    assert not bool(runs[0][0].any())


def test_refuses_runs_it_cannot_copy_and_a_second_start() -> None:
    copier = BackgroundCopy()
    with pytest.raises(ValueError, match="equal-sized"):
        copier.start(
            "m", (0,), [(torch.zeros(8, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8))]
        )
    strided = torch.zeros(16, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        copier.start("m", (0,), [(strided, torch.zeros(8, dtype=torch.uint8))])
    assert not copier.active
    copier.start("m", (0,), _runs([32 * CHUNK_BYTES], seed=4))
    with pytest.raises(RuntimeError, match="still active"):
        copier.start("n", (1,), _runs([8], seed=5))
    copier.wait()


def test_a_stream_copy_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StreamCopy(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stream_copy_lands_exactly_and_orders_the_runners_stream_after_it() -> None:
    device = torch.device("cuda")
    copier = StreamCopy(device)
    assert copier.done and not copier.active
    sizes = [3 * CHUNK_BYTES + 5, 17, CHUNK_BYTES]
    runs = [(dst.to(device), src.pin_memory()) for dst, src in _runs(sizes, seed=5)]
    copier.start("m", (2, 3, 7), runs)
    assert copier.active and copier.model == "m" and copier.blocks == (2, 3, 7)
    assert copier.copied_bytes == sum(sizes)
    copier.wait()  # no host wait: the current stream runs after the copy
    for dst, src in runs:
        assert torch.equal(dst.cpu(), src)  # .cpu() on the current stream sees the bytes
    assert not copier.active and copier.done
    with pytest.raises(ValueError, match="pinned host bytes"):
        copier.start("m", (0,), [(runs[0][0], runs[0][1].clone())])  # pageable source
    big = [
        (
            torch.zeros(64 * CHUNK_BYTES, dtype=torch.uint8, device=device),
            torch.full((64 * CHUNK_BYTES,), 7, dtype=torch.uint8).pin_memory(),
        )
    ]
    copier.start("n", (0,), big)
    with pytest.raises(RuntimeError, match="still active"):
        copier.start("n", (0,), big)
    copier.cancel()  # queued copies cannot stop; what follows on the stream waits for them
    big[0][0].add_(1)
    assert not copier.active and copier.model is None and copier.blocks == ()
    assert int(big[0][0].min()) == int(big[0][0].max()) == 8
