"""The stack stays straight: files -> formats/kernels -> models -> engine -> the swarm,
planner and simulator on top (ARCHITECTURE.md, "The floors"). Every import in the package,
including those inside functions, is read from the source; planning a preset is run and its
loaded modules listed."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cellswarm"

TOP = ("cellswarm.swarm", "cellswarm.planner", "cellswarm.sim", "cellswarm.lab", "cellswarm.cli",
       "cellswarm.demo", "cellswarm.verify")  # fmt: skip
ENGINE = ("cellswarm.engine", "cellswarm.loader")
MODEL_CODE = ("cellswarm.models.llama", "cellswarm.models.deepseek2", "cellswarm.models.ops",
              "cellswarm.models.deepseek2_fused")  # fmt: skip
PACKED = ("cellswarm.kernels", "cellswarm.quant.packed", "cellswarm.io.weights")

# (the modules under this prefix, what none of them may import)
RULES = [
    ("cellswarm.io", (*TOP, *ENGINE, "cellswarm.models")),
    ("cellswarm.quant", (*TOP, *ENGINE, "cellswarm.models", "cellswarm.io")),
    ("cellswarm.kernels", (*TOP, *ENGINE, "cellswarm.models", "cellswarm.io", "cellswarm.quant")),
    ("cellswarm.models", (*TOP, *ENGINE)),
    ("cellswarm.engine", TOP),
    ("cellswarm.planner", (*ENGINE, *MODEL_CODE, *PACKED, "cellswarm.swarm", "cellswarm.sim",
                           "cellswarm.lab", "cellswarm.cli")),
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every cellswarm module the file imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("cellswarm")}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path)
        for prefix, banned in RULES:
            if not under(mod, prefix):
                continue
            for imp in sorted(imports(path)):
                if any(under(imp, b) for b in banned):
                    found.append(f"{mod} imports {imp}")
    return found


def test_no_lower_layer_imports_a_higher_one() -> None:
    assert violations() == []


def test_the_guard_sees_a_violation() -> None:
    assert any(under(i, "cellswarm.engine") for i in imports(PACKAGE / "loader.py"))
    assert imports(PACKAGE / "models" / "llama.py") >= {"cellswarm.kernels"}


@pytest.mark.parametrize("call", ['cellswarm.plan("kimi-k3", node="ps3", count=100000)'])
def test_planning_a_preset_loads_neither_the_engine_nor_the_kernels(call: str) -> None:
    code = f"import json, sys, cellswarm\n{call}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    loaded = [m for m in json.loads(out.stdout) if m.startswith("cellswarm")]
    assert "cellswarm.planner.plan" in loaded
    banned = (*ENGINE, *MODEL_CODE, *PACKED, "cellswarm.swarm", "cellswarm.sim")
    assert [m for m in loaded if any(under(m, b) for b in banned)] == []


# The swarm's rooms, lowest first (ARCHITECTURE.md, "The swarm's rooms"): a module imports
# swarm modules of its own room or of lower ones only; rooms on one floor (node, control)
# not each other, except on the top floor, the commands, where the cycle test is the guard.
SWARM_FLOORS: list[tuple[str, ...]] = [
    ("protocol",),
    ("policy",),
    ("auth", "tls", "logs", "settings"),
    ("transport",),
    ("ring",),
    ("node", "control"),
    ("api",),
    ("local", "commands", "batch_cli", "certs_cli", "nats_cli"),
]
TOP_FLOOR = len(SWARM_FLOORS) - 1


def room(name: str) -> str:
    """A module's unit in the import graph: `cellswarm.X` for the packages and top-level
    modules, `cellswarm.swarm.X` inside the swarm (its sub-packages and modules)."""
    if name.startswith("cellswarm.swarm."):
        return ".".join(name.split(".")[:3])
    return ".".join(name.split(".")[:2])


def edges() -> dict[str, set[str]]:
    """Room -> the rooms it imports (a `from a import b` is a's module b when b is one)."""
    out: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = room(module_name(path))
        for target in modules_imported(path):
            theirs = room(target)
            if theirs != mine and not (theirs == "cellswarm.swarm" and under(mine, theirs)):
                out.setdefault(mine, set()).add(theirs)
    return out


def modules_imported(path: Path) -> set[str]:
    """The cellswarm modules a file imports: `from a import b` imports a.b when that is a
    module, else a (a name defined in a) — so `from cellswarm import kernels` is no import
    of the package's front door."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {_module_or_package(node.module, a.name) for a in node.names}
    return {m for m in out if m.startswith("cellswarm")}


def _module_or_package(package: str, name: str) -> str:
    full = f"{package}.{name}"
    path = PACKAGE.parent / full.replace(".", "/")
    return full if path.with_suffix(".py").is_file() or path.is_dir() else package


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                found.append(sorted([*part, v]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages_or_swarm_rooms() -> None:
    assert cycles(edges()) == []


def test_the_cycle_guard_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_swarm_rooms_import_only_downward() -> None:
    floor = {r: i for i, rooms in enumerate(SWARM_FLOORS) for r in rooms}
    wrong = []
    for mine, theirs in edges().items():
        if not mine.startswith("cellswarm.swarm."):
            continue
        for t in theirs:
            if not t.startswith("cellswarm.swarm."):
                continue
            a, b = floor[mine.split(".")[2]], floor[t.split(".")[2]]
            if b > a or (b == a and a != TOP_FLOOR):
                wrong.append(f"{mine} imports {t}")
    assert sorted(wrong) == []


def test_every_swarm_room_is_on_a_floor() -> None:
    have = {p.stem if p.is_file() else p.name for p in (PACKAGE / "swarm").iterdir()
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert have == {r for rooms in SWARM_FLOORS for r in rooms}


def test_importing_the_coordinator_loads_no_kernels_engine_or_model_code() -> None:
    code = ("import json, sys\nimport cellswarm.swarm.control.coordinator\n"
            "print(json.dumps(sorted(sys.modules)))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    loaded = [m for m in json.loads(out.stdout) if m.startswith("cellswarm")]
    banned = ("cellswarm.kernels", "cellswarm.engine.model", "cellswarm.loader", "cellswarm.models",
              "cellswarm.quant.packed", "cellswarm.swarm.ring.stage", "cellswarm.swarm.api",
              "cellswarm.swarm.local", "cellswarm.doctor")  # fmt: skip
    assert [m for m in loaded if any(under(m, b) for b in banned)] == []


def test_the_swarm_says_what_its_values_are() -> None:
    """`Any` under swarm/ stays rare (issue 35: it was 557 names; messages between
    processes are Structs, client bodies JSON values): each one left is a decision, and a
    new one needs a reason."""
    names = sum(isinstance(node, ast.Name) and node.id == "Any"
                for path in (PACKAGE / "swarm").rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text())))  # fmt: skip
    assert names <= 20, f"{names} uses of Any under cellswarm/swarm (at most 20)"
