"""``talaria.engine.staging.BackgroundCopy``: exact copies, cancel between chunks, errors."""

from __future__ import annotations

import pytest
import torch

from talaria.engine.staging import CHUNK_BYTES, BackgroundCopy


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
