"""The package import graph (docs/design.md: imports point down the picture, never back up).

Read from the source with ``ast`` (module-level and function-level imports alike), so the
test sees every dependency, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "talaria"
# Imports under ``if TYPE_CHECKING:`` are annotations only and are not dependencies.
TORCH_FREE = (
    "executor",
    "core",
    "policy",
    "memory",
    "cost",
    "runtime",
    "sim",
    "schedule",
    "generation",
    "grammar",
    "config",
    "types",
    "clock",
    "errors",
)


def _subpackage(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        pkg = _subpackage(path)
        for mod in _imports(path):
            top, _, rest = mod.partition(".")
            if top == "talaria" and rest:
                dep = rest.split(".")[0]
                if dep != pkg:
                    edges.setdefault(pkg, set()).add(dep)
            else:
                external.setdefault(pkg, set()).add(top)
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """Pairs of subpackages that reach each other (the strongly connected pairs)."""

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in edges.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    closure = {a: reach(a) for a in edges}
    return {
        frozenset({a, b})
        for a in closure
        for b in closure[a]
        if a != b and a in closure.get(b, set())
    }


def test_no_import_cycle_between_subpackages() -> None:
    edges, _ = _graph()
    assert _cycles(edges) == set()


def test_pure_layers_import_no_torch() -> None:
    _, external = _graph()
    for pkg in TORCH_FREE:
        assert "torch" not in external.get(pkg, set()), f"talaria.{pkg} imports torch"


def test_the_cost_model_stands_alone() -> None:
    """``talaria.cost`` is imported by the simulator and the runtime alike; it imports
    neither (nor the engine): only plain data (the plan types it prices)."""
    edges, _ = _graph()
    assert edges["cost"] <= {"config", "errors", "types", "memory", "schedule"}
    assert "sim" not in edges["runtime"]


def test_the_runtime_reaches_executors_only_through_the_protocol() -> None:
    """``talaria.runtime`` imports no engine and no backend: an executor plugs in at
    ``talaria.executor.Executor``; the engine knows nothing of the runtime (no core, no
    loop), and the protocol itself sits below both."""
    edges, _ = _graph()
    assert not edges["runtime"] & {"engine", "backends", "sim", "server", "api"}
    assert not edges["core"] & {"runtime", "engine", "backends", "sim", "server", "api"}
    assert not edges["engine"] & {"core", "runtime", "policy", "sim", "backends", "server", "api"}
    assert edges["executor"] <= {"generation", "memory", "schedule"}


def test_integrations_and_the_replay_are_imported_under_the_talaria_namespace() -> None:
    """``integrations/`` and ``swebench_replay/`` install as ``talaria.integrations`` and
    ``talaria.swebench_replay`` (pyproject.toml); no code imports their bare top-level
    names, which would load a second copy of each module from a source checkout."""
    repo = ROOT.parent
    offenders = []
    for folder in ("talaria", "integrations", "swebench_replay", "tests", "examples", "benchmarks"):
        for path in (repo / folder).rglob("*.py"):
            for mod in _imports(path):
                if mod.partition(".")[0] in ("integrations", "swebench_replay"):
                    offenders.append(f"{path.relative_to(repo)}: {mod}")
    assert offenders == []
    assert (ROOT / "integrations").resolve() == (repo / "integrations").resolve()
    assert (ROOT / "swebench_replay").resolve() == (repo / "swebench_replay").resolve()
