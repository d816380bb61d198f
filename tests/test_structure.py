"""The library's shape: imports only go down and no function-local imports (modules are
sized by their concept; the formatter decides layout)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sparsecomm_jax"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _tree(name: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{name}.py").read_text())


def library_imports(name: str) -> set[str]:
    """The ``sparsecomm_jax`` modules that module ``name`` imports at top level."""
    out = set()
    for node in _tree(name).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "sparsecomm_jax":
                out |= {a.name for a in node.names}
            elif node.module.startswith("sparsecomm_jax."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {
                a.name.split(".")[1] for a in node.names if a.name.startswith("sparsecomm_jax.")
            }
    return out & set(MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_library_imports_form_no_cycle():
    graph = {m: library_imports(m) for m in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {find_cycle(graph)}"


@pytest.mark.parametrize("name", MODULES)
def test_no_function_local_imports(name):
    tree = _tree(name)
    top = set(map(id, tree.body))
    local = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top
    ]
    assert not local, f"{name}.py imports inside functions at lines {local}"


def test_every_module_imports_alone_in_reverse_order():
    code = "; ".join(f"import sparsecomm_jax.{m}" for m in reversed(MODULES))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent, timeout=120)
