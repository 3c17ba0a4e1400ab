"""The calibration cache: keys, digests, round trips, and files that must not be trusted."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest

from talaria.calibration.cache import (
    MEASURED_HERE,
    SCHEMA,
    SHIPPED,
    CalibrationKey,
    CalibrationWarning,
    Machine,
    cache_path,
    describe_line,
    read_cached,
    shipped_calibration,
    source_hash,
    write_cached,
)
from talaria.config import CACHE_ENV, InstanceSpec, cache_dir
from talaria.cost import estimator_for, profile
from talaria.cost.hardware import read_cpu_document
from talaria.errors import ConfigError
from talaria.sim.catalog import PAPER_MODELS

MACHINE = Machine(cpu="Test CPU 9000", cores=2, threads=2, ram_bytes=24 * 10**9, torch="2.13.0")
KEY = CalibrationKey(MACHINE, "ab" * 32, ("m-small", "m-big"), "bfloat16")


def _doc(prefill_flop_s: float = 1.25e11) -> dict[str, Any]:
    """A calibration document: the shipped one with a fit of its own."""
    doc = read_cpu_document()
    doc["engine"] = {
        **doc["engine"],
        "measured_at": "2030-01-02T03:04:05+00:00",
        "fit": {**doc["engine"]["fit"], "prefill_flop_s": prefill_flop_s},
    }
    return doc


def test_key_digest_is_stable_and_round_trips() -> None:
    same = CalibrationKey(attrs.evolve(MACHINE), "ab" * 32, ["m-small", "m-big"], "bfloat16")
    assert same == KEY and same.digest() == KEY.digest()
    assert len(KEY.digest()) == 16 and int(KEY.digest(), 16) >= 0
    assert CalibrationKey.from_dict(json.loads(json.dumps(KEY.to_dict()))) == KEY


@pytest.mark.parametrize(
    "changed",
    [
        attrs.evolve(KEY, machine=attrs.evolve(MACHINE, cpu="Other CPU")),
        attrs.evolve(KEY, machine=attrs.evolve(MACHINE, cores=4)),
        attrs.evolve(KEY, machine=attrs.evolve(MACHINE, threads=1)),
        attrs.evolve(KEY, machine=attrs.evolve(MACHINE, ram_bytes=16 * 10**9)),
        attrs.evolve(KEY, machine=attrs.evolve(MACHINE, torch="2.14.0")),
        attrs.evolve(KEY, code="cd" * 32),
        attrs.evolve(KEY, models=("m-small",)),
        attrs.evolve(KEY, dtype="float32"),
    ],
)
def test_any_changed_field_misses_the_cache(tmp_path: Path, changed: CalibrationKey) -> None:
    write_cached(KEY, _doc(), tmp_path)
    assert changed.digest() != KEY.digest()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a miss is silent: nothing cached under that key
        assert read_cached(changed, tmp_path) is None
    assert read_cached(KEY, tmp_path) is not None


def test_source_hash_follows_file_bytes_names_and_settings(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("x = 1\n")
    (tmp_path / "cost.py").write_text("y = 2\n")
    patterns = ("engine/*.py", "cost.py")
    first = source_hash(tmp_path, patterns, {"reps": 3})
    assert source_hash(tmp_path, patterns, {"reps": 3}) == first
    assert source_hash(tmp_path, patterns, {"reps": 2}) != first
    (tmp_path / "engine" / "a.py").write_text("x = 2\n")
    edited = source_hash(tmp_path, patterns, {"reps": 3})
    assert edited != first
    (tmp_path / "engine" / "b.py").write_text("")
    assert source_hash(tmp_path, patterns, {"reps": 3}) != edited
    with pytest.raises(ConfigError, match="no source file matches"):
        source_hash(tmp_path, ("gone/*.py",), {})


def test_cache_dir_prefers_talaria_then_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cache_dir({CACHE_ENV: "/x/t", "XDG_CACHE_HOME": "/x/xdg"}) == Path("/x/t")
    assert cache_dir({"XDG_CACHE_HOME": "/x/xdg"}) == Path("/x/xdg/talaria")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir({}) == tmp_path / ".cache" / "talaria"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_path(KEY) == tmp_path / "env" / f"cpu-calibration-{KEY.digest()}.json"


def test_cache_round_trip_keeps_the_profile_and_states_the_key(tmp_path: Path) -> None:
    written = write_cached(KEY, _doc(), tmp_path / "new", seconds=12.5)
    assert written.measured_now and written.seconds == 12.5 and written.origin == MEASURED_HERE
    stored = json.loads(Path(written.path).read_text())
    assert stored["schema"] == SCHEMA and stored["key"] == KEY.to_dict()
    assert stored["digest"] == KEY.digest()
    read = read_cached(KEY, tmp_path / "new")
    assert read is not None
    assert read.profile == written.profile and read.key == KEY
    assert read.profile.peak_flops_bf16 == 1.25e11
    assert not read.measured_now and read.measured_at == "2030-01-02T03:04:05+00:00"
    entry = read.describe()
    assert entry["origin"] == MEASURED_HERE and entry["digest"] == KEY.digest()
    assert entry["key"]["machine"]["cpu"] == "Test CPU 9000"
    assert "cached" in describe_line(entry) and KEY.digest() in describe_line(entry)
    assert "just now in 12 s" in describe_line(written.describe())
    json.dumps(entry)  # plain JSON


def test_a_calibration_states_how_busy_the_machine_was(tmp_path: Path) -> None:
    quiet = write_cached(KEY, {**_doc(), "contention": {"others_cpu_share": 0.1}}, tmp_path)
    assert quiet.others_cpu_share == 0.1 and not quiet.busy
    assert "busy" not in describe_line(quiet.describe())
    write_cached(KEY, {**_doc(), "contention": {"others_cpu_share": 0.5}}, tmp_path)
    busy = read_cached(KEY, tmp_path)
    assert busy is not None and busy.busy and busy.describe()["others_cpu_share"] == 0.5
    assert "other processes took 50% of the CPUs" in describe_line(busy.describe())
    unknown = write_cached(KEY, _doc(), tmp_path)
    assert unknown.others_cpu_share is None and not unknown.busy


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "unreadable"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({**_doc(), "schema": "talaria-calibration/0"}), "schema"),
        (json.dumps({**_doc(), "schema": SCHEMA, "key": {"machine": 3}}), "no valid key"),
        (
            json.dumps(
                {
                    **_doc(),
                    "schema": SCHEMA,
                    "key": attrs.evolve(KEY, machine=attrs.evolve(MACHINE, cores=64)).to_dict(),
                }
            ),
            "foreign",
        ),
        (json.dumps({**_doc(-1.0), "schema": SCHEMA, "key": KEY.to_dict()}), "prefill_flop_s"),
    ],
)
def test_corrupt_or_foreign_cache_files_are_ignored_with_a_warning(
    tmp_path: Path, content: str, why: str
) -> None:
    path = cache_path(KEY, tmp_path)
    path.write_text(content)
    with pytest.warns(CalibrationWarning, match=why):
        assert read_cached(KEY, tmp_path) is None
    assert path.read_text() == content  # left alone: ignored, not deleted or rewritten


def test_a_document_without_an_engine_fit_is_not_cached(tmp_path: Path) -> None:
    doc = {k: v for k, v in _doc().items() if k != "engine"}
    with pytest.raises(ConfigError, match="no engine fit"):
        write_cached(KEY, doc, tmp_path)
    assert not list(tmp_path.iterdir())


def test_shipped_calibration_is_the_shipped_profile() -> None:
    shipped = shipped_calibration()
    assert shipped.origin == SHIPPED and shipped.key is None and not shipped.measured_now
    assert shipped.profile == profile("cpu")
    assert shipped.measured_at == read_cpu_document()["engine"]["measured_at"]
    line = describe_line(shipped.describe())
    assert line.startswith(SHIPPED) and "cpu_profile.json" in line


def test_estimators_take_a_calibration_in_place_of_the_shipped_profile(tmp_path: Path) -> None:
    calibrated = write_cached(KEY, _doc(), tmp_path).profile
    spec = InstanceSpec("cpu-0", "cpu", 10**9, 10**9)
    model = PAPER_MODELS[0]
    assert estimator_for(spec, [model]).cost.hw == profile("cpu")
    assert estimator_for(spec, [model], {"cpu": calibrated}).cost.hw == calibrated
    assert estimator_for(spec, [model], {"h200-tp8": profile("h200-tp8")}).cost.hw == profile("cpu")
