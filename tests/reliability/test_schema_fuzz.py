"""A third-party, schema-driven fuzzer against the live server: schemathesis reads the
server's own ``/openapi.json`` (every operation, its request body and its documented
answers, :mod:`talaria.server.openapi`) and generates requests, valid and not, for each
operation. Every answer must be a status the document lists for that operation; a 5xx
other than a documented 503 fails the run (the document lists no 500), and the server must
be intact afterwards (``tests.reliability.inprocess.assert_intact``).

Generated ``max_tokens`` (and ``n``) past :data:`MAX_NEW` are mapped down before the call,
as the hand-written fuzzer does, so that a case takes milliseconds on the tiny model; values
outside the schema's range are sent as they are. The default suite runs
:data:`EXAMPLES` cases per operation; the ``slow`` variant :data:`SLOW_EXAMPLES` (a few
thousand in all). The run's counts per operation and status print at the end.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.reliability.inprocess import (
    AUTH,
    MODEL,
    assert_intact,
    probe,
    requires_tiny_model,
    serve_tiny,
)

schemathesis = pytest.importorskip("schemathesis")

pytestmark = requires_tiny_model

EXAMPLES = 8  # per operation, default suite (96 cases; the slow one has depth)
SLOW_EXAMPLES = 400  # per operation, slow suite: 4,800 cases over the twelve operations
MAX_NEW = 16


def _small(body: Any) -> Any:
    """``body`` with an in-range ``max_tokens`` / ``max_completion_tokens`` past
    :data:`MAX_NEW` and an ``n`` past 2 mapped down (out-of-range values stay: they are
    refused at once), and a string ``model`` set to the served one (a random name only
    reaches the 404; any other type is left to be refused)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    if isinstance(out.get("model"), str):
        out["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        v = out.get(key)
        # past the context too: such a max_tokens is clamped to the context, not refused
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_NEW:
            out[key] = MAX_NEW
    n = out.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 16:
        out["n"] = 2
    return out


def fuzz_operation(
    url: str, operation: Any, documented: set[int], per_operation: int, seen: Counter[str]
) -> None:
    """Schemathesis's cases for one operation; fails on an answer the document does not
    list for it, or a 5xx other than 503."""

    @settings(
        max_examples=per_operation,
        deadline=None,
        derandomize=True,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def one(case: Any) -> None:
        case.body = _small(case.body)
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        status = response.status_code
        seen[f"{case.method} {operation.path} {status}"] += 1
        assert status in documented, f"{case.method} {operation.path}: {status} {response.text}"
        assert status < 500 or status == 503, response.text

    one()


def fuzz(url: str, per_operation: int) -> Counter[str]:
    """Every operation of the server's OpenAPI document (:func:`fuzz_operation`); returns
    ``"METHOD path status"`` counts."""
    with httpx.Client(base_url=url, timeout=60) as http:
        doc = http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    seen: Counter[str] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        responses = doc["paths"][operation.path][operation.method]["responses"]
        fuzz_operation(url, operation, {int(s) for s in responses}, per_operation, seen)
    return seen


def _run(per_operation: int) -> None:
    with serve_tiny() as url, httpx.Client(base_url=url, timeout=60) as client:
        baseline = probe(client)
        seen = fuzz(url, per_operation)
        assert_intact(client, baseline)
    operations = {key.rsplit(" ", 1)[0] for key in seen}
    assert len(operations) == 12, sorted(operations)
    print(f"\n{sum(seen.values())} cases over {len(operations)} operations:")
    for key, count in sorted(seen.items()):
        print(f"  {key}: {count}")


def test_schemathesis_finds_no_undocumented_answer() -> None:
    _run(EXAMPLES)


@pytest.mark.slow
def test_schemathesis_a_few_thousand_cases() -> None:
    _run(SLOW_EXAMPLES)
