from __future__ import annotations

import pytest
import torch

from talaria.backends.base import Substrate
from talaria.backends.embedded import build_embedded
from talaria.config import InstanceSpec
from talaria.errors import BadRequest, ConfigError, UnknownModel
from talaria.policy.baselines import POLICIES
from talaria.types import Call, TokenSeq

GB = 10**9


def cpu_instance() -> InstanceSpec:
    return InstanceSpec(
        name="cpu-0",
        hardware="cpu",
        device_memory_bytes=2 * GB,
        host_memory_bytes=2 * GB,
        block_size=16,
        memory_utilization=0.9,
    )


@pytest.fixture(scope="module")
def smol() -> object:
    return build_embedded(cpu_instance(), ["smollm2-135m"], POLICIES["talaria"], torch.bfloat16)


def test_smollm2_answers_a_chat_and_keeps_serving_after_a_bad_request(smol: object) -> None:
    inst = smol
    substrate: Substrate = inst.runner  # type: ignore[attr-defined]
    tok = inst.tokenizers["smollm2-135m"]  # type: ignore[attr-defined]
    assert tok is not None
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    prompt = TokenSeq(tok.encode(text, add_special_tokens=False))
    with pytest.raises(BadRequest, match="vocabulary"):
        inst.runner.submit(  # type: ignore[attr-defined]
            Call("bad", 0, "smollm2-135m", TokenSeq([10**6]), 8), now=0.0
        )
    call = Call("s", 0, "smollm2-135m", prompt, 16)
    out = inst.runner.generate([call])  # type: ignore[attr-defined]
    answer = tok.decode(list(out[call.key]), skip_special_tokens=True)
    assert answer.strip()
    assert substrate.idle
    substrate.core.check_integrity()


def test_unknown_model_and_empty_list_are_refused() -> None:
    with pytest.raises(UnknownModel, match="catalog"):
        build_embedded(cpu_instance(), ["gpt-5"], POLICIES["talaria"])
    with pytest.raises(ConfigError):
        build_embedded(cpu_instance(), [], POLICIES["talaria"])
