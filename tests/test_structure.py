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


# ------------------------------------------------- names belong to their registries

REPO = PACKAGE.parent
# Strings that are such a name only by spelling here: (file, string): why.
NOT_NAMES = {
    ("sparsecomm_jax/embedding/row_optimizers.py", "row"): "lazy_adam's count='row'",
    ("sparsecomm_jax/embedding/row_optimizers.py", "table"): "lazy_adam's count='table'",
}

# Dicts keyed by names that are a result's columns (data, not facts of the names).
RESULT_ROWS = {
    ("experiments/studies/paper_scale.py", frozenset({"dense", "embrace"})): "seconds each",
    ("experiments/peers/gspmd_lm.py", frozenset({"row", "replicated"})): "the peer's own "
    "NamedSharding choices (--layout), not the library's layouts",
}


def registry_names() -> dict[str, tuple[str, set[str]]]:
    """Kind -> (the module that registers its names, the names)."""
    from sparsecomm_jax import AGGREGATORS, STRATEGIES, optimizers
    from sparsecomm_jax.embedding import layout_registry

    return {
        "layout": ("sparsecomm_jax/embedding/layout_registry.py", set(layout_registry.LAYOUTS)),
        "strategy": ("sparsecomm_jax/strategies/registry.py", set(STRATEGIES)),
        "aggregator": ("sparsecomm_jax/aggregators.py", set(AGGREGATORS)),
        "optimizer": ("sparsecomm_jax/optimizers.py", set(optimizers.OPTIMIZERS)),
    }


def named_outside_registries(path: Path, text: str) -> list[str]:
    """Where the code at ``path`` tests a registered name by its spelling: a comparison
    with one (``== "row"``, ``in ("sgd", "adagrad")``), or a table of facts keyed by two
    or more names of one kind (a dict literal). Each as ``file:line what``; a registry's
    own module may name its own. Names as data (a list of strategies to run) are no
    test of a name and pass."""
    where = str(path.relative_to(REPO))
    registries = registry_names()
    homes = {n for home, names in registries.values() if home == where for n in names}
    found = []
    for kind, (_, names) in registries.items():
        mine = {n for n in names if (where, n) not in NOT_NAMES and n not in homes}

        def strings(node, mine=mine) -> list[str]:
            constants = (n for n in ast.walk(node) if isinstance(n, ast.Constant))
            return [n.value for n in constants if n.value in mine]

        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare) and any(
                isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
            ):
                literal = ast.Constant | ast.Tuple | ast.List | ast.Set
                sides = [x for x in (node.left, *node.comparators) if isinstance(x, literal)]
                found += [
                    f"{where}:{node.lineno} compares {kind} {h!r}"
                    for x in sides
                    for h in strings(x)
                ]
            elif isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)} & mine
                if len(keys) >= 2 and (where, frozenset(keys)) not in RESULT_ROWS:
                    found.append(f"{where}:{node.lineno} keys a table by {kind}s {sorted(keys)}")
    return found


REGISTRY_WORDS = ("layout", "strategy", "aggregator", "optimizer", "exchange", "carrier")


def _dotted(node) -> str:
    """``a.b.c`` of an attribute chain (``""`` where it is no plain chain)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _registry_value(node) -> bool:
    """Whether ``node`` reads the ``.name`` of what looks like a registry value: an
    attribute ``.name`` of a layout, strategy, aggregator, optimizer or exchange (its
    dotted path names one), or of a module constant (``COLUMN.name``, ``hot.HOT.name``)."""
    if not (isinstance(node, ast.Attribute) and node.attr == "name"):
        return False
    base = _dotted(node.value)
    last = base.rsplit(".", 1)[-1]
    return any(w in base.lower() for w in REGISTRY_WORDS) or (last.isupper() and len(last) > 1)


def names_compared(path: Path, text: str) -> list[str]:
    """Where the code at ``path`` compares a registry value's ``.name`` (``layout.name
    == "row"``, ``t.layout.name in NAMES``, ``x.name == HOT.name``): asking a value its
    name instead of its facts (``Layout.pipelined``, ``Strategy.scannable``, ...). A
    registry's own module may; each found as ``file:line``."""
    where = str(path.relative_to(REPO))
    if where in {home for home, _ in registry_names().values()}:
        return []
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
        ):
            if any(_registry_value(x) for x in (node.left, *node.comparators)):
                found.append(f"{where}:{node.lineno} compares a registry value's name")
    return found


def test_the_check_of_compared_names_sees_them_and_passes_the_rest():
    code = (
        "if t.layout.name in CARRIED: pass\n"
        "if x.name == hot.HOT.name: pass\n"
        "if strategy.name != 'embrace': pass\n"
        "if t.name in names or f.name == 'x': pass\n"
    )
    found = names_compared(REPO / "sparsecomm_jax" / "x.py", code)
    assert found == [
        "sparsecomm_jax/x.py:1 compares a registry value's name",
        "sparsecomm_jax/x.py:2 compares a registry value's name",
        "sparsecomm_jax/x.py:3 compares a registry value's name",
    ], found


def test_no_registry_value_is_asked_its_name_to_decide():
    """A layout, strategy, aggregator, optimizer or exchange is asked its facts, never
    its name compared, outside its registry: ``schedule/`` pipelines any layout with a
    ``Pipelined``, the planner prices any with ``Pricing``."""
    found = []
    for folder in ("sparsecomm_jax", "experiments", "models"):
        for path in sorted((REPO / folder).rglob("*.py")):
            found += names_compared(path, path.read_text())
    assert not found, "\n".join(found)


def test_the_schedule_imports_no_layout():
    """``schedule/`` pipelines a table through its layout's hook (``Layout.pipelined``),
    so it imports no layout's module: a new pipelined layout edits nothing there."""
    layouts = {m for m in MODULES if m.startswith("embedding.")} & {
        f"embedding.{name}"
        for name in ("column", "row", "hot", "tablewise", "replicated", "dense", "layout_registry")
    }
    assert len(layouts) == 7, layouts
    for m in MODULES:
        if m.startswith("schedule."):
            assert not library_imports(m) & layouts, (m, library_imports(m) & layouts)


def test_the_check_of_names_sees_a_comparison_and_a_table():
    code = 'if opt == "adam": pass\nif x in ("sgd",): pass\nFACTS = {"column": 1, "row": 2}\n'
    found = named_outside_registries(REPO / "experiments" / "x.py", code)
    assert found == [
        "experiments/x.py:3 keys a table by layouts ['column', 'row']",
        "experiments/x.py:1 compares optimizer 'adam'",
        "experiments/x.py:2 compares optimizer 'sgd'",
    ], found
    assert not named_outside_registries(REPO / "experiments" / "x.py", 'RUN = ("sgd", "adam")')


def test_no_layout_strategy_or_optimizer_name_is_compared_outside_its_registry():
    """Callers ask a registry's values for their facts (``Layout.sharded``,
    ``Strategy.scannable``, ``AggregatorKind.sparse``, ``Optimizer.rows``, ...) instead
    of testing names: a new layout, strategy, aggregator or optimizer is one entry, with
    nothing else to edit."""
    found = []
    for folder in ("sparsecomm_jax", "experiments", "models"):
        for path in sorted((REPO / folder).rglob("*.py")):
            found += named_outside_registries(path, path.read_text())
    assert not found, "\n".join(found)


def test_one_version_from_one_place():
    """The version is written once, ``sparsecomm_jax.__version__``; the package's
    metadata reads it from there."""
    import tomllib

    import sparsecomm_jax

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "sparsecomm_jax.__version__" and sparsecomm_jax.__version__
