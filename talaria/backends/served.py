"""The shape every backend builds: a cluster core over its instances' executors, and per
served model what the in-process API reads (its architecture, tokenizer, source and end
ids). ``talaria.api.backends`` names the builders; each backend adds its own state."""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from talaria.core.cluster import ClusterCore
from talaria.engine.arch import ModelArch
from talaria.engine.tokenizer import Tokenizer

R = TypeVar("R")  # the backend's executor, one per instance


@attrs.define
class ServedCluster(Generic[R]):
    """A built backend. ``tokenizers`` holds None for a model without its own (random
    weights); ``loaded_from`` says where each model came from. ``mechanisms`` says, a line
    each, which of Talaria's mechanisms run on it; ``close`` releases what lives outside
    this process (engines, actors; nothing by default)."""

    core: ClusterCore
    runners: dict[str, R]
    archs: dict[str, ModelArch]
    tokenizers: dict[str, Tokenizer | None]
    loaded_from: dict[str, str]
    eos_token_ids: dict[str, tuple[int, ...]]

    def mechanisms(self) -> list[str]:
        return []

    def close(self) -> None:
        return None
