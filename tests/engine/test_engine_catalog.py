from __future__ import annotations

import pytest

from talaria.cli import main
from talaria.engine.catalog import ENTRIES, Source, arch_of, entry, listings
from talaria.errors import UnknownModel
from talaria.sim.catalog import PAPER_MODELS


def test_dummy_entries_have_their_published_parameter_counts() -> None:
    # Qwen2.5-0.5B: 494,032,768 parameters (tied); Llama-3.2-1B: 1,235,814,400 (tied)
    assert arch_of(entry("qwen2.5-0.5b-dummy")).n_params == 494_032_768
    assert arch_of(entry("llama-3.2-1b-dummy")).n_params == 1_235_814_400


def test_listing_finds_the_smollm2_gguf_and_reads_its_shape() -> None:
    rows = {r.name: r for r in listings(PAPER_MODELS)}
    smol = rows["smollm2-135m"]
    assert smol.available and smol.where.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (smol.architecture, smol.params) == ("llama", 134_515_008)
    assert smol.kv_bytes_per_token_bf16 == 2 * 30 * 3 * 64 * 2  # K+V, 30 layers, 3 KV heads
    assert sum(r.source == Source.SIMULATOR.value for r in rows.values()) == 3
    assert set(ENTRIES) <= set(rows)


def test_unknown_entry_names_the_catalog() -> None:
    with pytest.raises(UnknownModel, match="smollm2-135m"):
        entry("gpt-5")


def test_models_command_prints_every_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-0.5b-dummy", "llama-3.2-1b-dummy"):
        assert name in out
