"""``benchmarks/gpu_replay.py --tiny``: the GPU replay's script runs end to end on the CPU with
three tiny random-weight models, so it is known to work before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.gpu_replay import TINY, random_loader

ROOT = Path(__file__).resolve().parents[1]


def test_random_loader_describes_the_model_without_a_tokenizer() -> None:
    load = random_loader(TINY, torch.device("cpu"))
    m = load("tiny-llama", torch.bfloat16)
    assert m.tokenizer is None and m.eos_token_ids == () and m.load_format == "dummy"
    assert set(m.tensors) == set(m.arch.param_shapes())
    assert m.arch.hidden_size == TINY["tiny-llama"]["hidden_size"]


def test_tiny_replay_writes_results(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_replay.py"), "--tiny"]
    cmd += ["--sessions", "3", "--calls", "15", "--token-scale", "0.05", "--gap-scale", "0.1"]
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
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
