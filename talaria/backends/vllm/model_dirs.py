"""Hugging Face directories of the embedded catalog's models, for vLLM to load.

vLLM loads models from a directory; the embedded catalog ships SmolLM2-135M as a GGUF and
describes the others as published configurations with random weights. ``write_model_dir``
turns a catalog entry into a directory vLLM serves, nothing downloaded:

* ``smollm2-135m``: the GGUF dequantized (``load_gguf``) and written with safetensors, its
  configuration as transformers would write it, and its tokenizer and chat template;
* a random-weight entry: its ``config.json`` and SmolLM2's tokenizer (the one the embedded
  API lends it), to be served with ``load_format = "dummy"``; vLLM draws its own random
  weights. Its vocabulary may be wider than the tokenizer's; the API then limits sampling
  to the tokenizer's ids, as on the embedded engine.

``catalog_for`` returns the matching :class:`VllmModel` entries, so the vLLM backend serves
the same three models as the embedded replay. Writes only under the directory it is given;
an existing, complete directory is reused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from talaria.backends.vllm.catalog import VllmModel
from talaria.engine.catalog import Source, entry
from talaria.engine.loader import gguf_tokenizer, load_gguf, smollm2_gguf
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError

_DONE = ".talaria-complete"
# the tiny test model as vLLM can run it: vLLM's CPU attention has no kernel for the
# embedded tiny model's head_dim of 16, so this one has one head of 64 (same width)
TINY = "smollm2-tiny-vllm"
_TINY_SHAPE = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64}


def _tokenizer_files(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    tok.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        if value is not None:
            config[name] = value
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_model_dir(name: str, out: Path, dtype: torch.dtype = torch.bfloat16) -> VllmModel:
    """Write catalog entry ``name`` (or :data:`TINY`, the tiny test model with a head size
    vLLM's CPU attention supports) as a directory under ``out`` (reused when complete)."""
    tiny = name == TINY
    e = entry("smollm2-tiny-dummy" if tiny else name)
    if e.source is Source.SIMULATOR:
        raise ConfigError(f"{name} is a simulator-only model; vLLM cannot serve it")
    if e.source is not Source.GGUF_PACKAGE:
        if e.config is None:
            raise ConfigError(f"catalog entry {name} has no configuration")
        return write_config_dir(name, {**e.config, **(_TINY_SHAPE if tiny else {})}, out, dtype)
    target = Path(out) / name
    dtype_name = str(dtype).removeprefix("torch.")
    model = VllmModel(name, target, dtype=dtype_name)
    if (target / _DONE).is_file():
        return model
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    loaded = load_gguf(smollm2_gguf(), dtype)
    config = {**loaded.config, "torch_dtype": dtype_name}
    config.pop("quantization_config", None)
    tensors = {k: v.contiguous() for k, v in loaded.tensors.items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(target / "model.safetensors"))
    if loaded.tokenizer is None:
        raise ConfigError(f"{name}: its GGUF carries no tokenizer")
    _finish_dir(target, config, loaded.tokenizer)
    return model


def write_config_dir(
    name: str, config: Mapping[str, Any], out: Path, dtype: torch.dtype = torch.bfloat16
) -> VllmModel:
    """A directory of a published configuration (``config``: its ``config.json`` fields)
    with SmolLM2's tokenizer, served with random weights (``load_format = "dummy"``): how
    ``benchmarks/gpu_vllm.py`` gets 7-14B shapes without downloading anything."""
    target = Path(out) / name
    dtype_name = str(dtype).removeprefix("torch.")
    model = VllmModel(name, target, load_format="dummy", dtype=dtype_name)
    if (target / _DONE).is_file():
        return model
    target.mkdir(parents=True, exist_ok=True)
    _finish_dir(target, {**config, "torch_dtype": dtype_name}, gguf_tokenizer(smollm2_gguf()))
    return model


def _finish_dir(target: Path, config: Mapping[str, Any], tok: Tokenizer) -> None:
    """``config.json``, ``generation_config.json``, the tokenizer files, then the marker
    that says the directory is complete."""
    (target / "config.json").write_text(json.dumps(dict(config), indent=1))
    eos = config.get("eos_token_id")
    generation = {"eos_token_id": eos} if eos is not None else {}
    (target / "generation_config.json").write_text(json.dumps(generation))
    _tokenizer_files(tok, target, int(config.get("max_position_embeddings", 8192)))
    (target / _DONE).write_text("")


def catalog_for(
    names: Sequence[str], out: Path, dtype: torch.dtype = torch.bfloat16
) -> tuple[VllmModel, ...]:
    """``write_model_dir`` for each name."""
    return tuple(write_model_dir(n, out, dtype) for n in names)
