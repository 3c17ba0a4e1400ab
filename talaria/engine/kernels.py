"""Native CPU kernels for bf16 decode, compiled on first use.

PyTorch has no paged attention on CPU, so decode attention over the KV pool otherwise
gathers every sequence's blocks into scratch and runs SDPA on the copy
(:mod:`talaria.engine.attention`): each step writes and reads the whole decoding KV twice.
``csrc/decode_kernels.c`` has

* **paged decode attention** reading the KV once, where it lies: one work item per
  (sequence, KV head), scores of 16 tokens at a time, float32 softmax and accumulation,
  bf16 dot products with AVX512-BF16 where the CPU has them (portable C otherwise);
* **a small matrix product** for decode of one or two sequences (AVX512-BF16 only), which
  reads every weight once per step near memory bandwidth (SmolLM2's 269 MB in 16 ms, 17
  GB/s, against 20-23 ms for PyTorch's bf16 ``mv`` here).

Threads come from the process's OpenMP runtime (PyTorch's), ``torch.get_num_threads()`` of
them. Figures measured on this 2-core CPU are in docs/backends/embedded.md
(``benchmarks/engine.py``).

:func:`build_decode_kernel` compiles the source with the system C compiler (``$CC``, else
``cc`` or ``gcc``) for this CPU (``-march=native``) into a cache folder keyed by the source,
the flags, the compiler and the CPU, and loads it with :mod:`ctypes` (which releases the GIL
during the call). Without a compiler, or with ``TALARIA_NATIVE_KERNELS=0``, it raises
:class:`KernelUnavailable` and the engine keeps PyTorch's operators: the kernels are an
optimisation, never a requirement. Only bf16 on CPU uses them; float32 (the exactness tests
against transformers) and CUDA keep PyTorch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Final

import torch

from talaria.config import cache_dir
from talaria.errors import TalariaError

SOURCE: Final = "decode_kernels.c"
MAX_GROUP: Final = 16
MAX_HEAD_DIM: Final = 256
MAX_SMALL_M: Final = 2
"""Most rows :meth:`DecodeKernel.gemm_small` takes: decode batches of 1 and 2 (at 4 and 8
rows PyTorch's oneDNN product was faster here)."""
_BUILDS: Final = (
    # (compile flags, link flags): this CPU's instructions and vectorized expf (libmvec)
    (("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-Wall"), ("-lmvec", "-lm")),
    # any x86-64 / other CPU, no fast math
    (("-O3", "-fopenmp", "-fPIC", "-Wall"), ("-lm",)),
)
"""Tried in order. Compiling and linking are two commands on purpose: linking a shared
library with ``-ffast-math`` adds ``crtfastmath.o``, whose constructor turns on
flush-to-zero for the whole process when the library loads (subnormal floats become 0 in
every later computation, PyTorch's and Python's included)."""
_COMPILE_TIMEOUT_S: Final = 180.0
_log = logging.getLogger(__name__)


class KernelUnavailable(TalariaError):
    """The native kernel cannot be built or loaded here (the message says why)."""


def default_cache_dir() -> Path:
    """``kernels`` in Talaria's cache directory (:func:`talaria.cache.cache_dir`)."""
    return cache_dir() / "kernels"


def _compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    return found


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"running {cmd[0]} failed: {exc}") from None


def build_decode_kernel(cache_dir: Path | None = None) -> DecodeKernel:
    """Compile (or reuse from ``cache_dir``) and load the paged decode kernel.

    Raises :class:`KernelUnavailable` when ``TALARIA_NATIVE_KERNELS`` is ``0``, no compiler
    is found, compiling fails (with the compiler's message) or the library does not load.
    Writes only into ``cache_dir`` (atomically: a finished library or nothing).
    """
    if os.environ.get("TALARIA_NATIVE_KERNELS", "1").strip().lower() in {"0", "off", "false"}:
        raise KernelUnavailable("disabled by TALARIA_NATIVE_KERNELS=0")
    source = resources.files("talaria.engine").joinpath("csrc", SOURCE).read_bytes()
    cc = _compiler()
    version = _run([cc, "--version"]).stdout
    folder = cache_dir or default_cache_dir()
    errors: list[str] = []
    for flags, libs in _BUILDS:
        stamp = " ".join((*flags, *libs)).encode()
        key = hashlib.sha256(
            b"\0".join([source, stamp, version.encode(), _cpu_id().encode()])
        ).hexdigest()[:20]
        lib = folder / f"decode-kernels-{key}.so"
        if not lib.exists():
            try:
                _compile(cc, flags, libs, source, lib)
            except KernelUnavailable as exc:
                errors.append(str(exc))
                continue
        return DecodeKernel(_load(lib), lib)
    raise KernelUnavailable("; ".join(errors))


def optional_decode_kernel(device: torch.device | str) -> DecodeKernel | None:
    """The kernel for an engine on ``device``: built (or reused) on CPU, None on other
    devices or when it cannot be built here (the reason is logged; the engine then uses
    gather + SDPA)."""
    if torch.device(device).type != "cpu":
        return None
    try:
        return build_decode_kernel()
    except KernelUnavailable as exc:
        _log.warning("native paged decode kernel unavailable, using gather + SDPA: %s", exc)
        return None


def _compile(
    cc: str, flags: tuple[str, ...], libs: tuple[str, ...], source: bytes, lib: Path
) -> None:
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create the kernel cache {lib.parent}: {exc}") from None
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, obj, out = Path(tmp) / SOURCE, Path(tmp) / "k.o", Path(tmp) / lib.name
        src.write_bytes(source)
        for cmd in (
            [cc, *flags, "-c", str(src), "-o", str(obj)],
            [cc, "-shared", "-fopenmp", str(obj), "-o", str(out), *libs],
        ):
            done = _run(cmd)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise KernelUnavailable(f"{' '.join(cmd[:3])} ... failed: {' | '.join(tail)}")
        os.replace(out, lib)


def _load(lib: Path) -> ctypes.CDLL:
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {lib}: {exc}") from None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = dll.talaria_paged_decode_bf16
    fn.argtypes = [p, i64, p, p, i64, p, i64, p, i64, i32, i32, i32, i32, ctypes.c_float, i32, p]
    fn.restype = i32
    dll.talaria_paged_decode_avx512bf16.argtypes = []
    dll.talaria_paged_decode_avx512bf16.restype = i32
    gemm = dll.talaria_gemm_small_bf16
    gemm.argtypes = [p, i64, p, i64, i32, p, i64, i64, i32, p]
    gemm.restype = i32
    return dll


class DecodeKernel:
    """The loaded paged decode kernel (from :func:`build_decode_kernel`; no I/O here).

    Stateless and safe to call from any thread; each call uses ``torch.get_num_threads()``
    OpenMP threads.
    """

    def __init__(self, dll: ctypes.CDLL, path: Path) -> None:
        self._fn = dll.talaria_paged_decode_bf16
        self._gemm = dll.talaria_gemm_small_bf16
        self.path = path
        self.avx512bf16 = bool(dll.talaria_paged_decode_avx512bf16())

    def __repr__(self) -> str:
        isa = "avx512-bf16" if self.avx512bf16 else "portable"
        return f"DecodeKernel({isa}, {self.path.name})"

    @staticmethod
    def supports(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether a model of these shapes with KV in ``dtype`` (on CPU) can use the kernel."""
        group, rem = divmod(n_heads, n_kv_heads)
        return (
            dtype == torch.bfloat16
            and rem == 0
            and 1 <= group <= MAX_GROUP
            and 1 <= head_dim <= MAX_HEAD_DIM
        )

    def attend(
        self,
        q: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
        tables: torch.Tensor,
        ctxs: torch.Tensor,
        tokens_per_block: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[n, n_heads, hd]`` (one token per sequence) over the first
        ``ctxs[i]`` cached tokens of sequence ``i``, whose blocks are ``tables[i]``; returns
        ``[n, n_heads, hd]`` bf16.

        ``k_rows`` / ``v_rows`` are one layer's block rows ``[num_blocks, tpb * kvh * hd]``
        (:meth:`~talaria.engine.kv_pool.PagedKV.rows`). Shapes, dtypes and strides are checked
        here (``ValueError``); block ids and lengths are not: the caller has validated them
        against the pool (:meth:`LlamaModel._plan` does), since the kernel reads where they
        point.
        """
        n, n_heads, hd = q.shape
        kvh = _rows_kv_heads(q, k_rows, v_rows, tokens_per_block)
        if (
            kvh == 0
            or not _block_tables_fit(tables, ctxs, n)
            or not self.supports(n_heads, kvh, hd, q.dtype)
        ):
            raise ValueError(_unsupported(q, k_rows, tables, ctxs))
        out = torch.empty((n, n_heads, hd), dtype=torch.bfloat16)
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_rows.data_ptr(),
            v_rows.data_ptr(),
            k_rows.stride(0),
            tables.data_ptr(),
            tables.shape[1],
            ctxs.data_ptr(),
            n,
            tokens_per_block,
            kvh,
            hd,
            n_heads // kvh,
            scale,
            torch.get_num_threads(),
            out.data_ptr(),
        )
        if rc != 0:
            raise MemoryError(f"paged decode kernel failed (code {rc}): out of memory")
        return out

    def gemm_supports(self, w: torch.Tensor) -> bool:
        """Whether :meth:`gemm_small` takes weight ``w``: this build has the AVX512-BF16
        product, ``w`` is a bf16 CPU matrix with contiguous rows, 32 | its columns."""
        return (
            self.avx512bf16
            and w.dtype == torch.bfloat16
            and w.device.type == "cpu"
            and w.dim() == 2
            and w.stride(1) == 1
            and w.shape[1] % 32 == 0
        )

    def gemm_small(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ w.T + b`` for ``x`` ``[M, in]``, ``1 <= M <= MAX_SMALL_M``: ``[M, out]``
        bf16, float32 accumulation, ``w`` read once. Batch-1 decode is bound by reading the
        weights; this runs near the memory bandwidth. Raises ``ValueError`` for operands it
        cannot take."""
        rows, k = w.shape
        m = x.shape[0]
        if (
            not self.gemm_supports(w)
            or x.dtype != torch.bfloat16
            or x.dim() != 2
            or x.shape[1] != k
            or not 1 <= m <= MAX_SMALL_M
            or x.stride(1) != 1
            or (b is not None and (b.dtype != torch.bfloat16 or b.shape != (rows,)))
            or (b is not None and not b.is_contiguous())
        ):
            raise ValueError(
                f"small gemm kernel: unsupported operands x {tuple(x.shape)} {x.dtype}, w "
                f"{tuple(w.shape)} {w.dtype} strides {w.stride()}"
            )
        y = torch.empty((m, rows), dtype=torch.bfloat16)
        rc = self._gemm(
            w.data_ptr(),
            w.stride(0),
            x.data_ptr(),
            x.stride(0),
            m,
            None if b is None else b.data_ptr(),
            rows,
            k,
            torch.get_num_threads(),
            y.data_ptr(),
        )
        if rc != 0:
            raise ValueError(f"small gemm kernel refused {tuple(w.shape)} (code {rc})")
        return y


def _rows_kv_heads(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, tpb: int) -> int:
    """The KV heads of :meth:`DecodeKernel.attend`'s block rows ``[num_blocks, tpb * kvh *
    hd]``, or 0 when the queries and rows are not bf16 CPU tensors of matching widths with
    unit-stride heads and rows."""
    hd = q.shape[2]
    kvh, rem = divmod(k_rows.shape[1], tpb * hd)
    if (
        q.dtype != torch.bfloat16
        or k_rows.dtype != torch.bfloat16
        or v_rows.shape != k_rows.shape
        or v_rows.dtype != torch.bfloat16
        or rem
        or q.stride(2) != 1
        or q.stride(1) != hd
        or k_rows.stride(1) != 1
        or v_rows.stride() != k_rows.stride()
        or q.device.type != "cpu"
    ):
        return 0
    return kvh


def _block_tables_fit(tables: torch.Tensor, ctxs: torch.Tensor, n: int) -> bool:
    """Whether ``tables`` ``[n, max_blocks]`` and ``ctxs`` ``[n]`` are contiguous int64, as
    :meth:`DecodeKernel.attend` reads them."""
    return (
        tables.dtype == torch.int64
        and ctxs.dtype == torch.int64
        and tables.dim() == 2
        and tables.shape[0] == n
        and ctxs.shape == (n,)
        and tables.is_contiguous()
        and ctxs.is_contiguous()
    )


def _unsupported(
    q: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, ctxs: torch.Tensor
) -> str:
    """The ``ValueError`` message of operands :meth:`DecodeKernel.attend` does not take."""
    return (
        f"paged decode kernel: unsupported operands q {tuple(q.shape)} {q.dtype} "
        f"strides {q.stride()}, rows {tuple(rows.shape)} {rows.dtype}, tables "
        f"{tuple(tables.shape)} {tables.dtype}, ctxs {tuple(ctxs.shape)} {ctxs.dtype}"
    )
