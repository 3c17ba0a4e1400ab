"""Binding a model's parameters as views of one flat region (talaria.engine.weight_layout).

The region must be large enough and of bytes or the serving dtype; a model refuses weights
that lack a parameter of its architecture.
"""

from __future__ import annotations

import pytest
import torch

from talaria.engine.arch import ModelArch
from talaria.engine.model import LlamaModel
from talaria.engine.weight_layout import bind_weights
from talaria.errors import ConfigError
from tests.helpers import llama_config

transformers = pytest.importorskip("transformers")

F32 = torch.float32


def test_region_too_small_or_mistyped() -> None:
    arch = ModelArch.from_hf_config(llama_config().to_dict())
    need = arch.weight_bytes(F32)
    with pytest.raises(ConfigError, match=rf"region holds {need - 4} bytes.*need {need}"):
        bind_weights(arch, torch.empty(need - 4, dtype=torch.uint8), F32)
    with pytest.raises(ConfigError, match="region must be uint8"):
        bind_weights(arch, torch.empty(need, dtype=torch.int32), F32)
    views = bind_weights(arch, torch.empty(need // 4, dtype=F32), F32)  # a typed region works
    assert views["model.embed_tokens.weight"].shape == (128, 64)
    with pytest.raises(ConfigError, match=r"lm_head\.weight"):
        LlamaModel(arch, {k: v for k, v in views.items() if k != "lm_head.weight"})
