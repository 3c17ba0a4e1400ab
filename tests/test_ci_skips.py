"""Under ``CI`` a skip for want of a package or data fails the run (``tests/conftest.py``);
a skip for hardware this machine lacks stays a skip; without ``CI`` every skip is a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).parent / "conftest.py"
MODULE_SKIP = 'import pytest\n\npytest.importorskip("no_such_extra")\n\n\ndef test_x():\n    pass\n'
TEST_SKIPS = """import pytest


def test_needs_data():
    pytest.skip("the traces are not here")


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_needs_a_gpu():
    pass
"""


def _run(tmp_path: Path, source: str, ci: bool) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("source", [MODULE_SKIP, TEST_SKIPS], ids=["module", "test"])
def test_a_missing_package_or_data_fails_under_ci(tmp_path: Path, source: str) -> None:
    run = _run(tmp_path, source, ci=True)
    assert run.returncode != 0, run.stdout
    assert "skipped under CI" in run.stdout


def test_hardware_skips_stay_skips_and_nothing_fails_outside_ci(tmp_path: Path) -> None:
    ci = _run(tmp_path, TEST_SKIPS, ci=True)
    assert "1 failed" in ci.stdout and "1 skipped" in ci.stdout, ci.stdout
    local = _run(tmp_path, TEST_SKIPS, ci=False)
    assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout
