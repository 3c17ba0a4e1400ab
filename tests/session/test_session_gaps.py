"""Tool kinds, priors, the gap predictor, and the gap-prediction benchmark."""

from __future__ import annotations

import json
import math
import threading
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import gap_prediction
from talaria.errors import BadRequest, ConfigError
from talaria.session import (
    MAX_EXPECTED_S,
    GapModelConfig,
    GapPredictor,
    KindPrior,
    ToolKind,
    ToolPriors,
    classify_tool,
    gap_key,
    load_tool_priors,
)
from talaria.swebench_replay.traces import TraceCall, TraceSession, session_to_json
from tests.helpers import examples

# --------------------------------------------------------------------------- kinds


@pytest.mark.parametrize(
    ("tool", "command", "kind"),
    [
        ("bash", "pytest -x tests/test_a.py", ToolKind.TESTS),
        ("bash", "cd /repo && python -m pytest", ToolKind.TESTS),
        ("bash", "pip install -e .", ToolKind.INSTALL),
        ("bash", "python reproduce.py", ToolKind.PYTHON_SCRIPT),
        ("bash", "cat a.py | grep foo", ToolKind.SHELL_READ_EDIT),
        ("bash", "frobnicate --all", ToolKind.OTHER),
        ("bash", None, ToolKind.OTHER),
        ("bash", "   ", ToolKind.OTHER),
        ("tests", None, ToolKind.TESTS),
        ("install", None, ToolKind.INSTALL),
        ("pytest", None, ToolKind.TESTS),
        ("str_replace_editor", None, ToolKind.SHELL_READ_EDIT),
        ("read_file", None, ToolKind.SHELL_READ_EDIT),
        ("grep_search", None, ToolKind.SHELL_READ_EDIT),
        ("run_tests", None, ToolKind.TESTS),
        ("pip_install", None, ToolKind.INSTALL),
        ("python_exec", None, ToolKind.PYTHON_SCRIPT),
        ("web_search", None, ToolKind.OTHER),
        ("fetch_url", None, ToolKind.OTHER),
    ],
)
def test_classify_tool(tool: str, command: str | None, kind: ToolKind) -> None:
    assert classify_tool(tool, command) is kind


def test_gap_key() -> None:
    assert gap_key("bash", "pytest") == "tests"
    assert gap_key("bash", "ls") == "shell_read_edit"
    assert gap_key("web_search") == "other:web_search"
    assert gap_key("bash", "frobnicate") == "other:bash"
    assert gap_key("other") == "other"


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=40), st.none() | st.text(max_size=80))
def test_classify_never_raises(tool: str, command: str | None) -> None:
    assert isinstance(classify_tool(tool, command), ToolKind)
    assert gap_key(tool, command)


# --------------------------------------------------------------------------- priors


def test_packaged_priors() -> None:
    priors = load_tool_priors()
    assert priors.median_s(ToolKind.SHELL_READ_EDIT) == 0.241
    assert priors.median_s(ToolKind.PYTHON_SCRIPT) == 0.344
    assert priors.median_s(ToolKind.TESTS) == 0.406
    assert priors.median_s(ToolKind.INSTALL) == 2.555
    assert priors.median_s(ToolKind.OTHER) == 0.261
    assert priors.overall == KindPrior(n=3365, mean_s=0.625, p50_s=0.257)


def test_packaged_priors_are_the_tune_part_measured_again() -> None:
    """The shipped priors are exactly what benchmarks/tool_priors.py measures on the tune
    part of the bundled traces (never the test part)."""
    from talaria.swebench_replay.split import Part, select_part
    from talaria.swebench_replay.traces import BUNDLED_TRACES, load_trace, tool_time_document

    packaged = json.loads((resources.files("talaria.session") / "tool_priors.json").read_text())
    tune = select_part(load_trace(BUNDLED_TRACES), Part.TUNE)
    assert tool_time_document(tune, packaged["source"]) == packaged


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "kinds: missing"),
        ({"kinds": {}}, "kinds.shell_read_edit"),
        (
            {
                "kinds": {
                    k: {"n": 1, "mean": 1, "p50": 1} for k in ("ALL", *(k.value for k in ToolKind))
                }
                | {"tests": {"n": 1, "mean": 1, "p50": -1}}
            },
            "kinds.tests: p50_s",
        ),
    ],
)
def test_priors_from_bad_json(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ToolPriors.from_json(data)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0},
        {"alpha": 1.5},
        {"clip_ratio": 1.0},
        {"clip_ratio": math.inf},
        {"floor_s": 0},
        {"space": "cubic"},
        {"max_tool_names": -1},
    ],
)
def test_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        GapModelConfig(**kwargs)  # type: ignore[arg-type]


def test_plain_ewma_arithmetic() -> None:
    cfg = GapModelConfig.plain_ewma(alpha=0.5)
    assert cfg.update(1.0, 3.0) == 2.0
    assert cfg.update(2.0, 0.0) == pytest.approx(1.0005)  # 0 counts as floor_s = 1 ms


def test_log_space_clipped_arithmetic() -> None:
    cfg = GapModelConfig()  # alpha 0.2, log, clip 2
    assert cfg.update(1.0, 2.0) == pytest.approx(2**0.2)
    assert cfg.update(1.0, 1000.0) == pytest.approx(2**0.2)  # clipped to 2x
    assert cfg.update(1.0, 0.0) == pytest.approx(0.5**0.2)  # clipped to 1/2x
    unclipped = GapModelConfig(clip_ratio=None)
    assert unclipped.update(1.0, 32.0) == pytest.approx(2.0)  # 32 ** 0.2


# --------------------------------------------------------------------------- predictor


def test_predictor_seeds_from_priors_and_learns() -> None:
    p = GapPredictor.default()
    assert p.predict("tests") == 0.406
    assert p.predict("other:web_search") == 0.261  # unknown tools start from "other"
    after = p.observe("tests", 0.812)
    assert after == pytest.approx(0.406 * 2**0.2)
    assert p.predict("tests") == after
    assert p.observations("tests") == 1
    assert p.predict("python_script") == 0.344  # other keys untouched
    assert p.estimates() == {"tests": after}


def test_predictor_learns_unknown_tool_by_name() -> None:
    p = GapPredictor(load_tool_priors(), GapModelConfig.plain_ewma(alpha=0.5))
    p.observe("other:web_search", 2.261)
    assert p.predict("other:web_search") == pytest.approx(1.261)  # (0.261 + 2.261) / 2
    assert p.predict("other") == 0.261


def test_predictor_caps_keys() -> None:
    cfg = GapModelConfig(alpha=1.0, space="linear", clip_ratio=None, max_tool_names=1)
    p = GapPredictor(load_tool_priors(), cfg)
    p.observe("other:a", 5.0)  # the one name allowed
    p.observe("other:b", 7.0)  # no room: learned as "other"
    assert p.predict("other:a") == 5.0
    assert p.predict("other") == 7.0
    assert p.predict("other:b") == 7.0
    assert p.predict("other:c") == 7.0
    for kind in ToolKind:  # kinds always have room
        p.observe(kind.value, 1.0)
    assert p.predict("tests") == 1.0


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf, "1", True, None])
def test_observe_rejects_bad_durations_and_changes_nothing(bad: object) -> None:
    p = GapPredictor.default()
    with pytest.raises(BadRequest):
        p.observe("tests", bad)  # type: ignore[arg-type]
    assert p.estimates() == {}
    assert p.observations("tests") == 0


def test_prediction_capped_for_the_wire() -> None:
    p = GapPredictor(load_tool_priors(), GapModelConfig(alpha=1.0, clip_ratio=None))
    p.observe("install", 1e9)
    assert p.predict("install") == MAX_EXPECTED_S


@settings(max_examples=examples(60), deadline=None)
@given(
    st.sampled_from(
        [
            GapModelConfig(),
            GapModelConfig(clip_ratio=None),
            GapModelConfig.plain_ewma(0.3),
            GapModelConfig(alpha=1.0),
        ]
    ),
    st.lists(st.floats(min_value=0, max_value=1e4), min_size=1, max_size=30),
)
def test_estimate_stays_within_observed_range(cfg: GapModelConfig, xs: list[float]) -> None:
    p = GapPredictor(load_tool_priors(), cfg)
    prior = p.predict("tests")
    for x in xs:
        before = p.predict("tests")
        after = p.observe("tests", x)
        if cfg.clip_ratio is not None:
            ratio = cfg.clip_ratio**cfg.alpha
            assert before / ratio * (1 - 1e-9) <= after <= before * ratio * (1 + 1e-9)
    lo = min(prior, *(max(x, cfg.floor_s) for x in xs))
    hi = max(prior, *xs)
    assert lo * (1 - 1e-9) <= p.predict("tests") <= hi * (1 + 1e-9)


def test_predictor_thread_safe_counts() -> None:
    p = GapPredictor.default()

    def work() -> None:
        for _ in range(500):
            p.observe("tests", 0.5)
            p.predict("tests")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.observations("tests") == 2000


# --------------------------------------------------------------------------- benchmark


def _session(sid: str, kinds_times: list[tuple[ToolKind, float | None]]) -> TraceSession:
    calls = [
        TraceCall(prompt_tokens=100 + i, output_tokens=10, tool_kind=k, tool_seconds=t)
        for i, (k, t) in enumerate(kinds_times)
    ]
    return TraceSession(sid, "test", "agent", "model", None, calls)


def test_benchmark_on_a_tiny_trace(tmp_path: Path) -> None:
    sessions = [
        _session("a", [(ToolKind.TESTS, 0.406), (ToolKind.TESTS, 1.406), (ToolKind.OTHER, None)]),
        _session("b", [(ToolKind.INSTALL, 2.555), (ToolKind.TESTS, None)]),
    ]
    traces = tmp_path / "t.jsonl"
    traces.write_text("".join(json.dumps(session_to_json(s)) + "\n" for s in sessions))
    out = tmp_path / "r" / "gap.json"
    assert gap_prediction.main(["--traces", str(traces), "--part", "all", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sessions"] == 2
    assert result["calls_measured"] == 3
    # const predicts 0.257: errors 0.149, 1.149, 2.298
    assert result["mae_s_const"] == pytest.approx((0.149 + 1.149 + 2.298) / 3)
    # prior: errors 0, 1.0, 0
    assert result["mae_s_prior"] == pytest.approx(1 / 3)
    # plain EWMA: the second tests call predicts 0.406 (learned 0.406 exactly)
    assert result["mae_s_ewma_shared"] == pytest.approx(1 / 3)
    assert len(result["grid_mae_s_shared"]) == len(gap_prediction.ALPHAS) * len(
        gap_prediction.CLIPS
    )


def test_benchmark_missing_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gap_prediction.main(["--traces", str(tmp_path / "nope")]) == 2
    assert "no traces at" in capsys.readouterr().err
