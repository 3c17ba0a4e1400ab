"""Reading a model's architecture from a Hugging Face config (talaria.engine.arch).

Parameter names and shapes are checked against transformers' own tiny models; config errors
must name the offending field.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from talaria.engine.arch import Arch, ModelArch, RopeKind
from talaria.errors import ConfigError
from tests.helpers import hf_model, llama_config, qwen2_config

transformers = pytest.importorskip("transformers")

F32 = torch.float32


@pytest.mark.parametrize("make", [llama_config, qwen2_config])
@pytest.mark.parametrize("tied", [False, True])
def test_param_shapes_match_transformers(make: Any, tied: bool) -> None:
    hf = hf_model(make(tie_word_embeddings=tied), seed=0)
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    state = hf.state_dict()
    shapes = arch.param_shapes()
    expected = {k: tuple(v.shape) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert shapes == expected
    n_unique = sum(p.numel() for p in hf.parameters())
    assert arch.n_params == n_unique
    assert arch.weight_bytes(F32) == 4 * n_unique
    spec = arch.to_spec("tiny", dtype=torch.bfloat16)
    assert spec.total_params == n_unique
    assert spec.weight_bytes == 2 * n_unique
    assert spec.kv_bytes_per_token == arch.kv_bytes_per_token(torch.bfloat16)
    assert arch.architecture is (Arch.QWEN2 if make is qwen2_config else Arch.LLAMA)
    assert arch.attention_bias is (make is qwen2_config)


def test_from_hf_config_reads_old_and_new_rope_fields() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    }
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    old = {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    older = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    new = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    archs = [ModelArch.from_hf_config(c) for c in (old, older, new)]
    assert archs[0] == archs[1] == archs[2]
    a = archs[0]
    assert a.n_kv_heads == 4 and a.head_dim == 16 and a.rope_theta == 5e5
    assert a.rope_scaling is not None and a.rope_scaling.kind is RopeKind.LLAMA3
    assert a.rope_scaling.original_max_position_embeddings == 256


def test_config_errors_name_the_field() -> None:
    good = llama_config().to_dict()
    with pytest.raises(ConfigError, match=r"architectures.*MistralForCausalLM"):
        ModelArch.from_hf_config({**good, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ConfigError, match="model_type"):
        ModelArch.from_hf_config({**good, "architectures": None, "model_type": "gpt2"})
    missing = {k: v for k, v in good.items() if k != "hidden_size"}
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        ModelArch.from_hf_config(missing)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelArch.from_hf_config({**good, "num_attention_heads": 0})
    with pytest.raises(ConfigError, match="rope_type"):
        ModelArch.from_hf_config({**good, "rope_parameters": {"rope_type": "longrope"}})
    with pytest.raises(ConfigError, match="low_freq_factor"):
        ModelArch.from_hf_config(
            {**good, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
        )
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelArch.from_hf_config({**good, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelArch.from_hf_config({**qwen2_config().to_dict(), "use_sliding_window": True})
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelArch.from_hf_config({**good, "num_key_value_heads": 3})
