"""The rooms of the code import one way (README.md's layout table): flows → tasks → vime_engine, and inside the
engine from the entry points and the runtime down to the math. Read from the source's import statements, lazy
ones inside functions included, so a late import cannot hide an arrow; imports under `if TYPE_CHECKING:` only
name types for annotations and never run, so they are left out. And the driver's side stays light: what the workers
compute with is imported where they run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("vime_engine", "tasks", "flows")

# A room may import only rooms of a lower rank; rooms of one rank do not import each other.
RANKS: dict[str, int] = {
    "vime_engine.sample": 0, "vime_engine.algorithms": 0, "vime_engine.devices": 0,
    "vime_engine.config": 1,
    "vime_engine.plugins": 2, "vime_engine.data": 2, "vime_engine.models": 2, "vime_engine.tracking": 2,
    "vime_engine.checkpoint": 2, "vime_engine.weight_sync": 2,
    "vime_engine.assets": 3, "vime_engine.rewards": 3,
    "vime_engine.rollout": 4, "vime_engine.train": 4,
    "vime_engine.agents": 5, "vime_engine.preflight": 5, "vime_engine.convert": 5,
    "vime_engine.runtime": 6,
    "vime_engine.chunk": 7,
    "tasks": 8,
    "flows": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in TOPS for p in (ROOT / top).rglob("*.py")}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            nodes = node.orelse
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            nodes = []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
            nodes = []
        else:
            nodes = list(ast.iter_child_nodes(node))
        for child in nodes:
            visit(child)

    visit(ast.parse(path.read_text()))
    return {n for n in names if n in known}


def room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "vime_engine" else parts[0]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imported(p, known) - {m} for m, p in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same node, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_every_room_has_a_rank():
    assert {room(m) for m in modules()} - {"vime_engine"} <= set(RANKS), "give the new room a rank in RANKS"


def test_no_module_imports_upward_or_sideways():
    wrong = sorted(
        f"{m} → {t}"
        for m, targets in import_graph().items() for t in targets
        if room(m) != room(t) and room(m) in RANKS and RANKS[room(t)] >= RANKS[room(m)]
    )
    assert not wrong, "imports against the layout:\n" + "\n".join(wrong)


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# Imported only where the workers compute (trainer ranks, engines, reward grading). The driver would import them
# before Ray starts, on every run's critical path (torch ~1 s, math-verify with sympy ~0.3 s; bench/startup.py), and
# the CLI would pay them before refusing a bad flag.
HEAVY_FOR_THE_DRIVER = ("torch", "vllm", "transformers", "math_verify", "sympy")


def test_the_driver_imports_nothing_the_workers_compute_with():
    code = ("import sys, flows.cli, vime_engine.runtime.driver, vime_engine.preflight; "
            f"print(' '.join(m for m in {HEAVY_FOR_THE_DRIVER!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert loaded.stdout.split() == []
