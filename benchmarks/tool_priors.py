"""Write the packaged tool-time priors from the tune part of the bundled traces.

``talaria/session/tool_priors.json`` is what every Talaria server's gap predictor starts
from and what a replay's clients hint (each kind's median): it is measured on the tune part
of the sessions only (``talaria.swebench_replay.split``), so that no figure of a comparison
on the test part, or on traces someone else holds out, leans on numbers taken from the
sessions it is judged on. ``tests/session/test_session_gaps.py`` checks the file against a
fresh measurement.

    python benchmarks/tool_priors.py            # print what it would write
    python benchmarks/tool_priors.py --write    # write talaria/session/tool_priors.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from talaria.swebench_replay.split import Part, select_part
from talaria.swebench_replay.traces import BUNDLED_TRACES, load_trace, tool_time_document

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "talaria" / "session" / "tool_priors.json"
SOURCE = (
    "the tune part of mini-swe-agent v2.2.7 deepseek runs of SWE-bench Lite "
    "(swebench_replay/data; SWE-agent/mini-swe-agent refs/pull/816, commit ec0e8e849fea)"
)


def measured() -> dict[str, Any]:
    """The priors document of the bundled traces' tune part."""
    return tool_time_document(select_part(load_trace(BUNDLED_TRACES), Part.TUNE), SOURCE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {TARGET}")
    args = parser.parse_args(argv)
    text = json.dumps(measured(), indent=1) + "\n"
    if args.write:
        TARGET.write_text(text)
        print(f"wrote {TARGET}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
