"""The additive step model: counts worked out by hand, the prices' validation, and the cost
model pricing with them where a profile carries them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from talaria.cost.cost_model import CostModel
from talaria.cost.hardware import cpu_profile_from_dict, read_cpu_document
from talaria.cost.step_prices import TERMS, StepPrices, step_counts
from talaria.cost.step_shape import StepShape
from talaria.errors import BadRequest, ConfigError
from tests.sim.test_cost_model import DENSE, make_hw

# DENSE: weight_bytes 2e6, kv_bytes_per_token 256, flops_per_token 2e6,
# attention_flops(c) = 512 c.
ONE_EACH = StepPrices((1.0,) * len(TERMS), small_rows=2)


def test_decode_counts_by_hand() -> None:
    # 3 sequences, contexts summing to 300: rows 3 > 2, so the matmul path's weights
    counts = step_counts(DENSE, StepShape.decode(3, 300), 2)
    assert counts == (1.0, 3.0, 0.0, 0.0, 2e6, 300 * 256, 3 * 2e6, 0.0, 0.0)
    # one sequence: the small-batch path's weights
    assert step_counts(DENSE, StepShape.decode(1, 100), 2)[3:5] == (2e6, 0.0)


def test_prefill_counts_by_hand() -> None:
    # a 4-token chunk after 10 cached tokens attends 4 * 10 + 4 * 5 / 2 = 50 keys in all;
    # its prefix is 50 / 4 - 5 / 2 = 10 tokens of KV read
    counts = step_counts(DENSE, StepShape(4, 50.0), 2)
    assert counts == (1.0, 0.0, 1.0, 0.0, 2e6, 0.0, 4 * 2e6, 512 * 50, 10 * 256)
    # two chunks of 2 tokens after 10 and 0 cached tokens: 2 * 10 + 3 + 3 = 26 keys; the
    # mean-context formula would say 26 / 4 - 5 / 2 = 4 cached tokens, the step says 10
    counts = step_counts(DENSE, StepShape(4, 26.0, prefill_chunks=2, prefix_tokens=10), 2)
    assert counts[2:] == (2.0, 0.0, 2e6, 0.0, 4 * 2e6, 512 * 26, 10 * 256)


def test_prices_sum_counts() -> None:
    prices = StepPrices((0.01, 0.001, 0.5, 1e-9, 2e-9, 1e-8, 1e-12, 1e-11, 1e-7), small_rows=2)
    # decode of 3 at 300 context tokens: 0.01 + 0.003 + 2e6 * 2e-9 + 76800 * 1e-8
    # + 6e6 * 1e-12 = 0.01 + 0.003 + 0.004 + 0.000768 + 0.000006
    assert prices.step_s(DENSE, StepShape.decode(3, 300)) == pytest.approx(0.017774, rel=1e-12)


def test_a_profile_with_step_prices_prices_steps_with_them() -> None:
    prices = StepPrices((0.01, 0.0, 0.0, 1e-9, 1e-9, 0.0, 0.0, 0.0, 0.0), small_rows=2)
    hw = make_hw(step_prices=prices, sources=(*make_hw().sources, "step_prices: test"))
    cm = CostModel(hw, 1)
    assert cm.decode_step_s(DENSE, 1, 10) == pytest.approx(0.01 + 2e6 * 1e-9)
    with pytest.raises(BadRequest, match="prefill_chunks"):
        StepShape(4, 10.0, prefill_chunks=-1)
    assert cm.prefill_s(DENSE, 0) == 0.0  # no tokens, no step
    with pytest.raises(BadRequest):
        cm.decode_step_s(DENSE, -1, 10)


def test_step_prices_need_a_source_and_valid_numbers() -> None:
    with pytest.raises(ConfigError, match="step_prices"):
        make_hw(step_prices=ONE_EACH)
    for bad in ((1.0,) * (len(TERMS) - 1), (-1.0,) + (1.0,) * (len(TERMS) - 1)):
        with pytest.raises(ConfigError):
            StepPrices(bad, 2)
    with pytest.raises(ConfigError):
        StepPrices((math.nan,) * len(TERMS), 2)
    with pytest.raises(ConfigError, match="small_rows"):
        StepPrices((1.0,) * len(TERMS), -1)


def test_json_round_trip_and_missing_keys() -> None:
    assert StepPrices.from_json(ONE_EACH.to_json()) == ONE_EACH
    doc = ONE_EACH.to_json()
    del doc["overhead_s"]
    with pytest.raises(ConfigError, match="overhead_s"):
        StepPrices.from_json(doc)


@given(
    prefill=st.integers(0, 10_000),
    prefix=st.integers(0, 100_000),
    seqs=st.integers(0, 256),
    context=st.integers(0, 10**6),
)
def test_a_step_costs_more_with_more_work(
    prefill: int, prefix: int, seqs: int, context: int
) -> None:
    """Over the whole domain a step's time is finite, non-negative, and grows with its
    context (every price is >= 0, so no count can lower it)."""
    attn = prefill * prefix + prefill * (prefill + 1) / 2
    prices = StepPrices((0.01, 1e-4, 1e-3, 1e-9, 2e-9, 1e-9, 1e-12, 1e-11, 1e-9), small_rows=2)
    t = prices.step_s(DENSE, StepShape(prefill, attn, seqs, context))
    assert math.isfinite(t) and t >= 0.01
    assert prices.step_s(DENSE, StepShape(prefill, attn, seqs, context + 1)) >= t


def test_a_cpu_document_with_step_prices_makes_a_profile_that_uses_them() -> None:
    doc = read_cpu_document()
    fitted = doc["engine"]["fit"]
    fitted["step_prices"] = ONE_EACH.to_json()
    fitted["step_grid_held_out"] = {"median_abs": 0.08, "p90_abs": 0.2, "max_abs": 0.3}
    fitted["co_run_slowdown"] = 1.5
    prof = cpu_profile_from_dict(doc, "test")
    assert prof.step_prices == ONE_EACH and prof.co_run_slowdown == 1.5
    assert "held-out error median 8.0%" in prof.source_of("step_prices")[0]
    assert prof.source_of("co_run_slowdown")
    fitted["co_run_slowdown"] = 0.5  # a peer cannot speed a step up
    with pytest.raises(ConfigError, match="co_run_slowdown"):
        cpu_profile_from_dict(doc, "test")
    fitted["co_run_slowdown"] = 1.5
    del fitted["step_prices"]["per_seq_s"]
    with pytest.raises(ConfigError, match="per_seq_s"):
        cpu_profile_from_dict(doc, "test")
    del fitted["step_prices"]
    assert cpu_profile_from_dict(doc, "test").step_prices is None  # the roofline prices
