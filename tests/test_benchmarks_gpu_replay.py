"""``benchmarks/gpu_replay.py --tiny``: the GPU replay's script runs end to end on the CPU with
three tiny random-weight models, so it is known to work before a GPU is lent."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.gpu_replay import TINY, random_loader
from tests.helpers import run_benchmark


def test_random_loader_describes_the_model_without_a_tokenizer() -> None:
    load = random_loader(TINY, torch.device("cpu"))
    m = load("tiny-llama", torch.bfloat16)
    assert m.tokenizer is None and m.eos_token_ids == () and m.load_format == "dummy"
    assert set(m.tensors) == set(m.arch.param_shapes())
    assert m.arch.hidden_size == TINY["tiny-llama"]["hidden_size"]


def test_tiny_replay_writes_results(tmp_path: Path) -> None:
    done = run_benchmark(
        "gpu_replay.py",
        *("--tiny", "--sessions", "3", "--calls", "15", "--token-scale", "0.05"),
        *("--gap-scale", "0.1", "--out", str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["engine"]["device"] == "cpu"
    assert doc["engine"]["models"] == list(TINY)
    policies = doc["policies"]
    assert {"talaria", "round"} <= set(policies)
    assert policies["model-serial"]["reference"] is True
    for name in ("talaria", "round"):
        assert policies[name]["sessions"] == 3 and policies[name]["calls"] == 15
    partial = json.loads((tmp_path / "policies.json").read_text())
    assert set(partial) == {"talaria", "round"}
    assert "talaria" in done.stdout
