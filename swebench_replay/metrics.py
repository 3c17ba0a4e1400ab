"""Session completion time and per-call metrics, in the results format of docs/design.md.

Percentiles are linear-interpolated (numpy's default). SCT is first call sent to last call
answered; TTFT is call sent to first token; latency is call sent to last token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from talaria.config import InstanceSpec
from talaria.sim.simulator import CallRecord, SessionRecord, SimResult
from talaria.swebench_replay.workload import ReplaySet


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), q))


def policy_summary(result: SimResult) -> dict[str, Any]:
    """One policy's entry of ``results.json``."""
    scts = [s.sct_s for s in result.sessions]
    ttfts = [c.ttft_s for c in result.calls]
    lats = [c.latency_s for c in result.calls]
    counters = result.counters
    return {
        "sessions": len(result.sessions),
        "calls": len(result.calls),
        "sct_p50_s": percentile(scts, 50),
        "sct_p95_s": percentile(scts, 95),
        "sct_mean_s": float(np.mean(scts)) if scts else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "latency_p50_s": percentile(lats, 50),
        "latency_p95_s": percentile(lats, 95),
        "prefix_reused_tokens": sum(c.reused_tokens for c in result.calls),
        "restored_tokens": sum(c.restored_tokens for c in result.calls),
        "recomputed_tokens": sum(c.recomputed_tokens for c in result.calls),
        "prompt_tokens": sum(c.prompt_tokens for c in result.calls),
        "bytes_moved": int(counters.get("kv_bytes_moved", 0))
        + int(counters.get("weight_bytes_moved", 0)),
        "kv_bytes_moved": int(counters.get("kv_bytes_moved", 0)),
        "weight_bytes_moved": int(counters.get("weight_bytes_moved", 0)),
        "model_switches": int(counters.get("model_switches", 0)),
        "staged_switches": int(counters.get("staged_switches", 0)),
        "sp_admissions": int(counters.get("sp_admissions", 0)),
        "reservations_made": int(counters.get("reservations_made", 0)),
        "reclaims": int(counters.get("reclaims", 0)),
        "kv_dropped_blocks": int(counters.get("kv_dropped_blocks", 0)),
        "makespan_s": result.end_s,
        "session_sct_s": sorted(scts),
    }


def add_ratios(policies: Mapping[str, dict[str, Any]], reference: str = "round") -> None:
    """Add ``speedup_p50_vs_<reference>`` (and ``_p95``, ``_mean``: the reference's SCT over
    this policy's) to every entry, when the reference policy is present."""
    ref = policies.get(reference)
    if ref is None:
        return
    for entry in policies.values():
        for key in ("p50", "p95", "mean"):
            mine = entry[f"sct_{key}_s"]
            entry[f"speedup_{key}_vs_{reference}"] = ref[f"sct_{key}_s"] / mine if mine else 0.0


def check_conservation(result: SimResult, expected_calls: int, tool_s: Mapping[str, float]) -> None:
    """Raise ``ValueError`` unless every call was answered once and no session finished
    faster than its own tool time."""
    keys = [(c.session_id, c.index) for c in result.calls]
    if len(keys) != expected_calls or len(set(keys)) != expected_calls:
        raise ValueError(f"{len(set(keys))} distinct calls answered of {expected_calls}")
    for s in result.sessions:
        if s.sct_s + 1e-9 < tool_s.get(s.session_id, 0.0):
            raise ValueError(f"session {s.session_id}: SCT {s.sct_s} below its tool time")


def results_document(
    substrate: str,
    hardware: str,
    instances: Sequence[InstanceSpec],
    replay: ReplaySet,
    gap_scale: float,
    hints: bool,
    policies: Mapping[str, Any],
) -> dict[str, Any]:
    """A replay's ``results.json`` (docs/design.md "Results format"), shared by the simulated and
    the real-engine replays; callers add their own sections (``engine``, ``fidelity``)."""
    return {
        "substrate": substrate,
        "hardware": hardware,
        "instances": [
            {"name": i.name, "devices": i.n_devices, "device_memory_bytes": i.device_memory_bytes}
            for i in instances
        ],
        "workload": {
            "trace": replay.trace,
            "sessions": len(replay.sessions),
            "calls": replay.n_calls,
            "models": list(replay.models),
            "seed": replay.seed,
            "arrival": replay.arrival.describe(),
            "token_scale": replay.token_scale,
            "tool_times_filled": replay.tool_times_filled,
            "gap_scale": gap_scale,
            "hints": hints,
        },
        "policies": dict(policies),
    }


__all__ = [
    "CallRecord",
    "SessionRecord",
    "add_ratios",
    "check_conservation",
    "percentile",
    "policy_summary",
    "results_document",
]
