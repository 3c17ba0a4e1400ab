"""``benchmarks/gpu_steps.py``: a replay's steps rebuilt from the step log (exact shapes) and
timed alone on the CPU with the tiny models, so the GPU script is known to work before a GPU
is lent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_steps import batch_of, decode_contexts, kind_of, prefill_chunks, sample
from tests.helpers import run_benchmark


def _step(
    model: str | None,
    prefill: int,
    decodes: int,
    ctx: int,
    chunks: int,
    attn: float,
    seconds: float = 0.01,
) -> dict[str, Any]:
    return {
        "instance": "i0",
        "start_s": 0.0,
        "seconds": seconds,
        "model": model,
        "prefill_tokens": prefill,
        "decodes": decodes,
        "context_tokens": ctx,
        "prefill_chunks": chunks,
        "prefill_attn_tokens": attn,
        "switch_bytes": 0,
        "stage_bytes": 0,
        "kv_bytes": 0,
        "predicted_s": 0.005,
        "loop_cpu_s": 0.0,
    }


def test_decode_contexts_spread_around_the_mean_and_keep_the_sum() -> None:
    assert decode_contexts(4, 400) == [50, 83, 117, 150]
    assert decode_contexts(1, 37) == [37]
    assert sum(decode_contexts(7, 1000)) == 1000


def test_prefill_chunks_give_back_the_logged_attention_sum() -> None:
    # two 5-token chunks after 100 cached tokens each: 2 x (5 x 100 + 15) keys attended
    assert prefill_chunks(_step("m", 10, 0, 0, 2, 1030.0)) == [(5, 100), (5, 100)]
    assert prefill_chunks(_step("m", 7, 0, 0, 1, 28.0)) == [(7, 0)]


def test_batch_of_lays_block_tables_end_to_end() -> None:
    batch, blocks = batch_of(_step("m", 20, 2, 60, 1, 20 * 16 + 210.0), vocab=50)
    starts = [s.start for s in batch.seqs]
    # a 20-token chunk after 16 cached tokens; two decodes of contexts 15 and 45 (mean 30)
    assert starts == [16, 15, 45] and [len(s.token_ids) for s in batch.seqs] == [20, 1, 1]
    assert [s.block_table for s in batch.seqs] == [(0, 1, 2), (3,), (4, 5, 6)]
    assert blocks == 7


def test_kind_and_sample() -> None:
    steps = [_step("a", 0, 2, 100, 0, 0.0) for _ in range(10)]
    steps += [_step("a", 8, 0, 0, 1, 36.0), _step("a", 8, 1, 9, 1, 36.0)]
    steps += [_step(None, 0, 0, 0, 0, 0)]
    assert [kind_of(s) for s in steps[-3:]] == ["prefill", "mixed", None]
    picked = sample(steps, 3)
    assert len(picked) == 5  # three of ten decode steps, the prefill, the mixed one
    assert picked[0] is steps[0] and picked[2] is steps[9]


def test_tiny_steps_alone_write_results(tmp_path: Path) -> None:
    steps = [_step("tiny-llama", 0, b, b * 40, 0, 0.0) for b in range(1, 11)]
    chunks = (8, 12, 16, 24, 32, 40)
    steps += [_step("tiny-qwen", n, 0, 0, 1, n * 32 + n * (n + 1) / 2) for n in chunks]
    steps += [_step("tiny-qwen", 16, 2, 80, 1, 16 * 17 / 2)]
    log = tmp_path / "steps.json"
    log.write_text(json.dumps({"talaria": steps}))
    out = tmp_path / "new" / "alone.json"
    done = run_benchmark(
        "gpu_steps.py", "--tiny", "--steps", str(log), "--out", str(out), "--reps", "1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["policies"]["talaria"]["rows"]
    assert len(rows) == len(steps) and all(r["alone_s"] > 0 for r in rows)
    assert set(doc["policies"]["talaria"]["summary"]) >= {"decode", "prefill", "mixed"}
    by_kind = doc["fit_alone"]["held_out_error_p50_by_model_kind"]
    assert set(by_kind) == {"tiny-llama/decode", "tiny-qwen/prefill", "tiny-qwen/mixed"}
    assert out.with_suffix(".profile.txt").read_text().count("aten::") >= 10
