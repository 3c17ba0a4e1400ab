"""Calibrate where you run: the cache of ``cpu`` profiles measured on this machine.

The shipped ``cpu`` profile (``cpu_profile.json``, :mod:`talaria.cost.hardware`) was measured
on one machine; another, even of the same kind, runs the embedded engine at other rates. A
*calibration* is the same document measured where Talaria runs (the raw machine rates and the
engine microbenchmarks of :mod:`talaria.calibration.calibrate`; never replay results), kept in
a user cache directory under a :class:`CalibrationKey` made of

- the machine (:class:`Machine`): CPU model, CPUs visible to the process, torch threads,
  RAM and torch version;
- the code: a hash (:func:`source_hash`) of the source files that decide step time and of
  the measurement's sizes, the models measured, and their dtype.

A change to any field is a different key, so it misses the cache and is measured again.
The cache directory is ``$TALARIA_CACHE_DIR``, else ``$XDG_CACHE_HOME/talaria``, else
``~/.cache/talaria`` (:func:`cache_dir`); each key has one JSON file named by its digest,
with the key fields inside it. A file that does not parse, has another schema or another
key (a foreign file), or does not make a valid profile is ignored with a
:class:`CalibrationWarning`, never trusted. A calibration records how much of the CPUs other
processes took while it was measured; over :data:`BUSY_SHARE` it is *busy* (it priced a
shared machine), and the embedded replay measures it again.

:class:`Calibration` is what priced a prediction: the profile, whether it was "measured
here" or is the "shipped profile", when it was measured, and the key. This module is file
I/O and plain data, with no torch: the caller supplies the machine's torch fields.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from talaria.config import cache_dir
from talaria.cost.hardware import (
    SHIPPED_CPU_PROFILE,
    HardwareProfile,
    cpu_profile_from_dict,
    profile,
    read_cpu_document,
)
from talaria.errors import ConfigError

SCHEMA: Final = "talaria-calibration/1"
MEASURED_HERE: Final = "measured here"
SHIPPED: Final = "shipped profile"
BUSY_SHARE: Final = 0.25
"""A calibration measured while other processes took more than this share of the machine's
CPU time is *busy*: its rates are those of a shared machine, so it is measured again."""

# The profile numbers a calibration report shows (field names of HardwareProfile).
_REPORTED: Final = (
    "peak_flops_bf16",
    "hbm_bandwidth_Bps",
    "step_overhead_s",
    "kv_read_Bps",
    "attention_flops_per_s",
    "decode_seq_overhead_s",
    "host_link_Bps",
)


class CalibrationWarning(UserWarning):
    """A cached calibration was ignored (unreadable, foreign or invalid)."""


class CalibrationMode(enum.Enum):
    """Which ``cpu`` profile prices the embedded replay's prediction."""

    AUTO = "auto"  # this machine's cached calibration; measured first when none matches
    SHIPPED = "shipped"  # the shipped profile, as measured on another machine
    FRESH = "fresh"  # measure again now (and replace the cached one)


def _text(_inst: Any, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{attr.name} must be a non-empty string, got {value!r}")


def _count(_inst: Any, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attr.name} must be a positive integer, got {value!r}")


@attrs.frozen
class Machine:
    """What the engine's speed depends on outside the code: the CPU model, the CPUs the
    process may run on, the torch intra-op threads, total RAM (bytes, cgroup-capped) and the
    torch version."""

    cpu: str = attrs.field(validator=_text)
    cores: int = attrs.field(validator=_count)
    threads: int = attrs.field(validator=_count)
    ram_bytes: int = attrs.field(validator=_count)
    torch: str = attrs.field(validator=_text)


def _names(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class CalibrationKey:
    """The machine, the code hash (:func:`source_hash`), the models measured and their
    dtype (``"bfloat16"``). Equal keys share one cache file."""

    machine: Machine
    code: str = attrs.field(validator=_text)
    models: tuple[str, ...] = attrs.field(converter=_names)
    dtype: str = attrs.field(validator=_text)

    def __attrs_post_init__(self) -> None:
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ConfigError("a calibration key names at least one model")

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": attrs.asdict(self.machine),
            "code": self.code,
            "models": list(self.models),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, doc: object) -> CalibrationKey:
        """The key a cache file states; ConfigError when it is not a well-formed key."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("machine"), Mapping):
            raise ConfigError("the key is not an object with a 'machine' object")
        models = doc.get("models")
        if not isinstance(models, list):
            raise ConfigError("the key's 'models' is not a list")
        try:
            machine = Machine(**doc["machine"])
        except TypeError as exc:
            raise ConfigError(f"the key's machine has other fields ({exc})") from None
        return cls(machine, doc.get("code"), models, doc.get("dtype"))  # type: ignore[arg-type]

    def digest(self) -> str:
        """16 hex digits of the SHA-256 of the key's canonical JSON (the cache file name)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_hash(root: Path, patterns: Sequence[str], settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of every file under ``root`` that a glob of ``patterns`` matches (its
    path relative to ``root`` and its bytes, in path order) and of ``settings`` (the
    measurement's sizes, as canonical JSON). ConfigError when a pattern matches nothing: a
    moved file must not silently drop out of the key."""
    h = hashlib.sha256()
    files: set[Path] = set()
    for pattern in patterns:
        found = [p for p in root.glob(pattern) if p.is_file()]
        if not found:
            raise ConfigError(f"calibration key: no source file matches {root / pattern}")
        files.update(found)
    for path in sorted(files):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_path(key: CalibrationKey, directory: Path | None = None) -> Path:
    """The cache file of ``key`` in ``directory`` (default :func:`cache_dir`)."""
    return (
        cache_dir() if directory is None else directory
    ) / f"cpu-calibration-{key.digest()}.json"


@attrs.frozen
class Calibration:
    """The ``cpu`` profile that prices a prediction, and where it comes from.

    ``origin`` is :data:`MEASURED_HERE` (a calibration of this machine; ``key`` is its key)
    or :data:`SHIPPED` (``key`` is None: it was measured on ``measured_on``, elsewhere).
    ``measured_now``: measured by this process (``seconds`` it took), not read from the
    cache. ``others_cpu_share``: the share of the machine's CPU time other processes took
    while it was measured (None: unknown, or the shipped profile)."""

    profile: HardwareProfile
    origin: str
    measured_at: str
    path: str
    measured_on: Mapping[str, Any]
    key: CalibrationKey | None = None
    measured_now: bool = False
    seconds: float = 0.0
    others_cpu_share: float | None = None

    @property
    def busy(self) -> bool:
        """Measured while other processes took over :data:`BUSY_SHARE` of the CPUs."""
        return self.others_cpu_share is not None and self.others_cpu_share > BUSY_SHARE

    def describe(self) -> dict[str, Any]:
        """The ``calibration`` entry of a results document (plain JSON)."""
        prices = self.profile.step_prices
        return {
            "origin": self.origin,
            "measured_at": self.measured_at,
            "measured_now": self.measured_now,
            "seconds": self.seconds,
            "path": self.path,
            "digest": None if self.key is None else self.key.digest(),
            "key": None if self.key is None else self.key.to_dict(),
            "measured_on": dict(self.measured_on),
            "others_cpu_share": self.others_cpu_share,
            "busy": self.busy,
            "profile": {f: getattr(self.profile, f) for f in _REPORTED},
            "step_prices": None if prices is None else prices.to_json(),
        }


def describe_line(entry: Mapping[str, Any]) -> str:
    """One line for a report from a results document's ``calibration`` entry."""
    on = entry.get("measured_on") or {}
    where = f"{on.get('cpu', '?')}, {on.get('threads', '?')} threads"
    if entry.get("origin") != MEASURED_HERE:
        return f"{SHIPPED} ({entry.get('path')}, measured {entry.get('measured_at')} on {where})"
    how = (
        f"just now in {float(entry.get('seconds', 0.0)):.0f} s"
        if entry.get("measured_now")
        else "cached"
    )
    share = entry.get("others_cpu_share")
    busy = (
        f"; busy: other processes took {100 * float(share):.0f}% of the CPUs meanwhile"
        if entry.get("busy") and share is not None
        else ""
    )
    return (
        f"{MEASURED_HERE} ({how}; measured {entry.get('measured_at')} on {where}{busy}; key "
        f"{entry.get('digest')}, {entry.get('path')})"
    )


def shipped_calibration() -> Calibration:
    """The shipped ``cpu`` profile as a :class:`Calibration` (``origin`` :data:`SHIPPED`)."""
    doc = read_cpu_document()
    engine = doc.get("engine")
    when = engine.get("measured_at") if isinstance(engine, Mapping) else None
    machine = doc.get("machine")
    return Calibration(
        profile("cpu"),
        SHIPPED,
        str(when or doc.get("measured_at", "?")),
        SHIPPED_CPU_PROFILE,
        dict(machine) if isinstance(machine, Mapping) else {},
    )


def _ignore(path: Path, why: str) -> None:
    warnings.warn(
        f"ignoring the cached calibration {path}: {why}", CalibrationWarning, stacklevel=3
    )


def _problem(doc: object, key: CalibrationKey) -> str | None:
    """Why ``doc`` is not a calibration of ``key`` (None: it is one)."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("schema") != SCHEMA:
        return f"schema {doc.get('schema')!r}, expected {SCHEMA!r}"
    try:
        stated = CalibrationKey.from_dict(doc.get("key"))
    except ConfigError as exc:
        return f"no valid key ({exc})"
    if stated != key:
        return "its key is another machine's or another code's (a foreign file)"
    engine = doc.get("engine")
    if not isinstance(engine, Mapping) or not isinstance(engine.get("fit"), Mapping):
        return "no engine fit"
    return None


def read_cached(key: CalibrationKey, directory: Path | None = None) -> Calibration | None:
    """This key's cached calibration, or None when there is none or it cannot be trusted
    (then a :class:`CalibrationWarning` says why). Reads one file; writes nothing."""
    path = cache_path(key, directory)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _ignore(path, f"unreadable ({exc})")
        return None
    problem = _problem(doc, key)
    if problem is not None:
        _ignore(path, problem)
        return None
    try:
        prof = cpu_profile_from_dict(doc, str(path))
    except ConfigError as exc:
        _ignore(path, str(exc))
        return None
    return _calibration(doc, prof, path, key)


def _calibration(
    doc: Mapping[str, Any],
    prof: HardwareProfile,
    path: Path,
    key: CalibrationKey,
    seconds: float | None = None,
) -> Calibration:
    """The :class:`Calibration` of a checked document (``seconds``: measured now)."""
    machine = doc.get("machine")
    contention = doc.get("contention")
    share = contention.get("others_cpu_share") if isinstance(contention, Mapping) else None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0:
        share = None
    return Calibration(
        prof,
        MEASURED_HERE,
        str(doc["engine"].get("measured_at", doc.get("measured_at", "?"))),
        str(path),
        dict(machine) if isinstance(machine, Mapping) else {},
        key,
        measured_now=seconds is not None,
        seconds=seconds or 0.0,
        others_cpu_share=None if share is None else float(share),
    )


def write_cached(
    key: CalibrationKey,
    doc: Mapping[str, Any],
    directory: Path | None = None,
    seconds: float = 0.0,
) -> Calibration:
    """Store ``doc`` (a ``cpu_profile.json`` document with its ``engine`` section, and a
    ``contention`` section with ``others_cpu_share`` when known) as ``key``'s calibration,
    replacing any earlier one atomically, and return it (``measured_now``, ``seconds`` it
    took). ConfigError when ``doc`` is not a valid profile; nothing is written then."""
    path = cache_path(key, directory)
    stored = {**doc, "schema": SCHEMA, "key": key.to_dict(), "digest": key.digest()}
    problem = _problem(stored, key)
    if problem is not None:
        raise ConfigError(f"not a calibration: {problem}")
    prof = cpu_profile_from_dict(stored, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return _calibration(stored, prof, path, key, seconds)
