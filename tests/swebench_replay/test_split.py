"""The tune / test split: fixed by each session's id, a third tune, a task's sessions together."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.swebench_replay.split import Part, part_of, select_part
from talaria.swebench_replay.traces import BUNDLED_TRACES, load_trace
from tests.helpers import examples


def test_the_rule_is_the_sha256_of_the_id_modulo_three() -> None:
    for sid in ("django__django-11099", "astropy__astropy-12907", "x"):
        value = int.from_bytes(hashlib.sha256(sid.encode()).digest()[:8], "big")
        assert part_of(sid) is (Part.TUNE if value % 3 == 0 else Part.TEST)


def test_the_bundled_traces_split_as_documented() -> None:
    sessions = load_trace(BUNDLED_TRACES)
    tune, test = select_part(sessions, Part.TUNE), select_part(sessions, Part.TEST)
    assert (len(tune), len(test)) == (43, 89)
    assert sum(s.n_calls for s in tune) == 3409 and sum(s.n_calls for s in test) == 7013
    assert {s.session_id for s in tune}.isdisjoint({s.session_id for s in test})
    assert select_part(sessions, Part.ALL) == sessions


@settings(max_examples=examples(200), deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_a_session_has_one_part_whatever_else_runs(sid: str) -> None:
    assert part_of(sid) in (Part.TUNE, Part.TEST)
    assert part_of(sid) is part_of(str(sid))
