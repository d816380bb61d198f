"""The library's shape: imports only go down (between modules and between the concept
packages) and no function-local imports; modules are sized by their concept and the
formatter decides their layout."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sparsecomm_jax"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.name != "__init__.py"
)


def _path(name: str) -> Path:
    return PACKAGE / f"{name.replace('.', '/')}.py"


def _tree(name: str) -> ast.Module:
    return ast.parse(_path(name).read_text())


def _resolve(module: str, names: list[str]) -> set[str]:
    """The library modules an import of ``names`` from ``module`` reaches."""
    base = module.removeprefix("sparsecomm_jax").removeprefix(".")
    found = {base} if base in MODULES else set()
    for name in names:
        full = f"{base}.{name}" if base else name
        if full in MODULES:
            found.add(full)
    return found


def library_imports(name: str) -> set[str]:
    """The ``sparsecomm_jax`` modules that module ``name`` imports at top level."""
    out = set()
    for node in _tree(name).body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("sparsecomm_jax")
        ):
            out |= _resolve(node.module, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("sparsecomm_jax."):
                    out |= _resolve(a.name, [])
    return out - {name}


def package_of(name: str) -> str:
    """``embedding.column`` -> ``embedding``; a top-level module is its own package."""
    return name.split(".")[0]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
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


def test_every_module_is_seen():
    assert {"embedding.column", "topk.selectors", "strategies.build", "runtime"} <= set(MODULES)
    assert "embedding.access" in library_imports("embedding.column")


def test_library_imports_form_no_cycle():
    graph = {m: library_imports(m) for m in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {find_cycle(graph)}"


def test_concept_packages_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        graph.setdefault(package_of(m), set()).update(
            package_of(i) for i in library_imports(m) if package_of(i) != package_of(m)
        )
    assert find_cycle(graph) is None, f"packages import each other: {find_cycle(graph)}"


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


def test_the_launcher_starts_without_jax():
    """``python -m sparsecomm_jax.launch`` imports neither JAX nor the library's steps
    (the front door loads its names on first use)."""
    code = "import sys, sparsecomm_jax.launch; print('jax' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.stdout.strip() == "False", done.stderr
