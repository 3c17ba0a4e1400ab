"""Suite-wide settings: hypothesis profiles, and no silent skips under CI.

Hypothesis profiles (``HYPOTHESIS_PROFILE``; default ``ci``):

- ``ci``: deterministic. Every run draws the same examples (``derandomize``: the seed comes
  from each test's own code), so a red run is red again on any machine, and a green ``main``
  cannot turn red at random. Example counts are the tests' own.
- ``search``: new random examples on every run, ten times as many of them (see
  :func:`tests.helpers.examples`), the failing ones kept in ``.hypothesis/`` and replayed
  first next time. It is the nightly-style run that looks for new bugs:
  ``HYPOTHESIS_PROFILE=search pytest -m hypothesis`` (``.ci/nightly`` runs it).

Under ``CI`` (the variable set, as CI services do) a test that would be skipped for want of
data, a package or an extra fails instead: a green run then means the tests ran. Skips for
hardware this machine lacks (a CUDA device, a CPU instruction set) stay skips.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "search",
    max_examples=1_000,
    derandomize=False,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Skip reasons that name hardware, not a missing package or data: these stay skips in CI.
HARDWARE_SKIP = re.compile(r"CUDA|AVX512|GPU", re.IGNORECASE)


def _in_ci() -> bool:
    return bool(os.environ.get("CI"))


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn a skip that is not about hardware into a failure (CI only)."""
    if not (_in_ci() and report.skipped) or getattr(report, "wasxfail", None) is not None:
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    if HARDWARE_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI: {reason or 'no reason given'}. CI must run every test; install "
        "what it needs (the README's commands) or mark it for hardware this machine lacks."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())
