"""The stack stays straight: files -> formats/kernels -> models -> engine -> the swarm,
planner and simulator on top (ARCHITECTURE.md, "Import rules"). Every import in the package,
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
