"""What an instance core needs to know about time: the ``Estimator`` protocol.

The simulator prices steps and copies with it; the router ranks placements with its rates.
``CostModelEstimator`` implements it with the roofline cost model of ``talaria.cost`` for
one instance (a hardware profile and a tensor-parallel degree); a live runtime uses the same
class with a profile measured on its own hardware (``talaria.cost.estimator_for`` with this
machine's cached calibration, :mod:`talaria.calibration.cache`, when the embedded executor
finds one; the shipped profile otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from talaria.config import ModelSpec
from talaria.cost.cost_model import CostModel
from talaria.cost.step_shape import StepShape
from talaria.errors import UnknownModel
from talaria.types import Link

# Typical shape used to turn step costs into per-token rates for routing estimates.
_RATE_CHUNK_TOKENS = 2048
_RATE_CONTEXT_TOKENS = 16384
_DECODE_BUCKET = 1024
_MEMO_LIMIT = 1 << 16


class Estimator(Protocol):
    """Seconds for engine steps and copies on one instance. Pure and deterministic."""

    def step_s(self, model: str, step: StepShape) -> float: ...

    def copy_s(self, nbytes: int, link: Link) -> float: ...

    def prefill_tok_s(self, model: str) -> float: ...

    def restore_tok_s(self, model: str) -> float: ...

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float: ...

    def stage_contention(self) -> StageContention | None:
        """How a weight stage contends with the steps beside it; None: it does not."""
        ...

    def provision_s(self) -> float:
        """Seconds to get the instance's devices back after it scaled to zero, before a
        switch can copy (0: at once)."""
        ...

    def co_run_slowdown(self) -> float | None:
        """How many times longer this instance's work takes while another instance of the
        same hardware on its server works; None: instances do not slow each other."""
        ...


@attrs.frozen
class StageContention:
    """A weight stage beside steps (measured, see the hardware profile): each step takes
    ``step_slowdown`` times longer while the stage copies, the stage copies at ``share`` of
    its idle rate while steps run, and it shares the host link half and half with
    host-to-device KV moves."""

    step_slowdown: float
    share: float


class CostModelEstimator:
    """``Estimator`` backed by ``talaria.cost.cost_model.CostModel``."""

    def __init__(self, cost: CostModel, models: Sequence[ModelSpec]) -> None:
        self.cost = cost
        self._models: Mapping[str, ModelSpec] = {m.name: m for m in models}
        self._prefill_rate = {m.name: self._rate(m) for m in models}
        self._restore_rate = {m.name: self._restore(m) for m in models}
        self._decode_memo: dict[tuple[str, int, int], float] = {}

    def spec(self, model: str) -> ModelSpec:
        try:
            return self._models[model]
        except KeyError:
            raise UnknownModel(f"model {model!r} has no cost entry on this instance") from None

    def _rate(self, m: ModelSpec) -> float:
        n = _RATE_CHUNK_TOKENS
        attn = n * (_RATE_CONTEXT_TOKENS + n / 2)
        return n / self.cost.step_s(m, StepShape(n, attn))

    def step_s(self, model: str, step: StepShape) -> float:
        return self.cost.step_s(self.spec(model), step)

    def copy_s(self, nbytes: int, link: Link) -> float:
        return self.cost.copy_s(nbytes, link) if nbytes > 0 else 0.0

    def prefill_tok_s(self, model: str) -> float:
        return self._prefill_rate[self.spec(model).name]

    def _restore(self, m: ModelSpec) -> float:
        n = 1 << 20
        return n / self.cost.copy_s(int(self.cost.kv_bytes_per_token(m) * n), Link.HOST_TO_DEVICE)

    def restore_tok_s(self, model: str) -> float:
        return self._restore_rate[self.spec(model).name]

    def stage_contention(self) -> StageContention | None:
        hw = self.cost.hw
        if hw.stage_step_slowdown is None or hw.stage_share_beside_steps is None:
            return None
        return StageContention(hw.stage_step_slowdown, hw.stage_share_beside_steps)

    def co_run_slowdown(self) -> float | None:
        return self.cost.hw.co_run_slowdown

    def provision_s(self) -> float:
        return self.cost.hw.provision_s or 0.0

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        """One decode step (memoized with the context rounded up to 1,024 tokens: this is a
        routing estimate; the simulator prices real steps with ``step_s``)."""
        bucket = -(-context_tokens // _DECODE_BUCKET) * _DECODE_BUCKET
        key = (model, max(1, batch), bucket)
        cached = self._decode_memo.get(key)
        if cached is None:
            cached = self.cost.step_s(self.spec(model), StepShape.decode(key[1], bucket))
            if len(self._decode_memo) < _MEMO_LIMIT:
                self._decode_memo[key] = cached
        return cached
