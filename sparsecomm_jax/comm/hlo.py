"""Reading the compiled program: which collectives it runs and what each worker sends.

Bytes per worker under the standard algorithms, with S the collective's result size
and P its replica-group size:

=================== ==========================
all-reduce (ring)   2 (P-1)/P * S
all-gather          (P-1)/P * S            (S = gathered output)
reduce-scatter      (P-1) * S              (S = scattered output)
all-to-all          (P-1)/P * S
collective-permute  S
=================== ==========================

Example:
    >>> import jax, jax.numpy as jnp
    >>> from sparsecomm_jax import runtime
    >>> from sparsecomm_jax.comm import hlo
    >>> mesh = runtime.data_mesh()
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...             in_specs=jax.P("data"), out_specs=jax.P()))
    >>> [c.kind for c in hlo.collectives(f, jnp.ones(len(jax.devices())))]
    ['all-reduce']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")

_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_OPCODE = re.compile(r"(?:^|[\s)])([a-z][a-z0-9\-]*)\(")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_BRANCH_PAIR = re.compile(r"\b(?:true_computation|false_computation)=%?([\w.\-]+)")


class Collective(NamedTuple):
    """One collective of the compiled program.

    Attributes:
      kind: one of ``KINDS``.
      name: the instruction name in the HLO text.
      shapes: result arrays as ``(dtype, shape)`` (several for tuple-shaped results).
      group_size: workers taking part (P).
      result_bytes: total bytes of the result (S).
      bytes_sent: bytes each worker sends under the standard algorithm (table above).
      conditional: it lies in a branch of a ``conditional`` (``lax.cond``, ``lax.switch``)
        or in a computation one calls: it runs only on the calls that take that branch.
    """

    kind: str
    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group_size: int
    result_bytes: int
    bytes_sent: float
    conditional: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "shapes": [f"{d}[{','.join(map(str, s))}]" for d, s in self.shapes],
            "group_size": self.group_size,
            "result_bytes": self.result_bytes,
            "bytes_sent": self.bytes_sent,
            "conditional": self.conditional,
        }


def bytes_per_worker(kind: str, result_bytes: int, group_size: int) -> float:
    """Bytes one worker sends for a collective of ``kind`` (see the module table)."""
    p, s = group_size, result_bytes
    if p <= 1:
        return 0.0
    return {
        "all-reduce": 2 * (p - 1) / p * s,
        "all-gather": (p - 1) / p * s,
        "all-to-all": (p - 1) / p * s,
        "reduce-scatter": (p - 1) * s,
        "collective-permute": float(s),
    }[kind]


def parse_shapes(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """All arrays in an HLO shape string: ``"(f32[2,3]{1,0}, s32[])"`` -> two arrays."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _ITEMSIZE:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(out)


def nbytes(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    return int(sum(_ITEMSIZE[d] * int(np.prod(s, dtype=np.int64)) for d, s in shapes))


def _group_size(attrs: str, default: int) -> int:
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})", attrs)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x])
    m = re.search(r"replica_groups=\[([0-9]+),([0-9]+)\]<=", attrs)
    if m:
        return int(m.group(2))
    return default


def _module_size(text: str) -> int:
    header = text.split("\n", 1)[0]
    parts = re.search(r"num_partitions=([0-9]+)", header)
    reps = re.search(r"replica_count=([0-9]+)", header)
    return (int(parts.group(1)) if parts else 1) * (int(reps.group(1)) if reps else 1)


def _branch_computations(text: str) -> set[str]:
    """The computations that run only when a ``conditional`` takes their branch: each
    branch and every computation it calls, transitively (a loop's body in a branch)."""
    calls: dict[str, set[str]] = {}
    roots: set[str] = set()
    current = ""
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            continue
        if not _INSTR.match(line):
            continue
        calls.setdefault(current, set()).update(_CALLED.findall(line))
        if " conditional(" in line:
            for group in _BRANCHES.findall(line):
                roots.update(n.strip().lstrip("%") for n in group.split(",") if n.strip())
            roots.update(_BRANCH_PAIR.findall(line))
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(calls.get(name, ()))
    return seen


def parse_collectives(text: str) -> list[Collective]:
    """Every collective in an HLO module's text, in text order.

    Async pairs (``all-gather-start`` / ``all-gather-done``, GPU) count once, with the
    shape of the ``-done`` result; collectives inside called computations count too,
    those of a ``conditional``'s branches marked ``conditional`` (``total_bytes`` leaves
    them out unless asked).
    """
    default_group = _module_size(text)
    branches = _branch_computations(text)
    found: list[Collective] = []
    starts: dict[str, tuple[str, str]] = {}
    current = ""
    for line in text.splitlines():
        if c := _COMPUTATION.match(line):
            current = c.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OPCODE.search(rest)
        if not op:
            continue
        opcode, shape_text = op.group(1), rest[: op.start(1)]
        attrs = rest[op.end() :]
        base = opcode.removesuffix("-start").removesuffix("-done")
        if base not in KINDS:
            continue
        if opcode.endswith("-start"):
            starts[name] = (base, attrs)
            continue
        if opcode.endswith("-done"):
            src = re.match(r"\s*%?([\w.\-]+)", attrs)
            base, attrs = starts.pop(src.group(1), (base, attrs)) if src else (base, attrs)
        shapes = parse_shapes(shape_text)
        size = nbytes(shapes)
        group = _group_size(attrs, default_group)
        sent = bytes_per_worker(base, size, group)
        found.append(Collective(base, name, shapes, group, size, sent, current in branches))
    return found


def compiled_text(fn: Callable, *args, **kwargs) -> str:
    """The compiled (scheduled, optimised) HLO text of a jitted or pmapped ``fn``."""
    if not hasattr(fn, "lower"):
        raise ValueError("fn must be a jax.jit or jax.pmap function (it has no .lower)")
    return fn.lower(*args, **kwargs).compile().as_text()


def collectives(fn: Callable, *args, **kwargs) -> list[Collective]:
    """The collectives of ``fn`` compiled for ``args``, in scheduled order."""
    return parse_collectives(compiled_text(fn, *args, **kwargs))


def total_bytes(
    colls: Sequence[Collective], kinds: Sequence[str] = KINDS, conditional: bool = False
) -> float:
    """Bytes each worker sends per call of the program, summed over ``colls`` of
    ``kinds``; a ``conditional`` branch's collectives only when ``conditional`` is true
    (they run on the calls that take the branch: a pipelined step's refetch)."""
    return float(
        sum(c.bytes_sent for c in colls if c.kind in kinds and (conditional or not c.conditional))
    )


class Instruction(NamedTuple):
    """One instruction of the entry computation, in scheduled order.

    Attributes:
      name: instruction name.
      opcode: e.g. ``"all-to-all"``, ``"fusion"``.
      operands: names of the instructions it reads.
      op_name: the JAX op path from its metadata (holds ``jax.named_scope`` names).
    """

    name: str
    opcode: str
    operands: tuple[str, ...]
    op_name: str


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_names(text: str) -> dict[str, str]:
    """Instruction name -> the JAX op path of its metadata (``""`` where it has none),
    for every instruction of every computation of a module's text (a profiler's thunk
    is named by its instruction).

    Example:
        >>> op_names('  %fusion.3 = f32[4] fusion(%p), metadata={op_name="jit(step)/mul"}')
        {'fusion.3': 'jit(step)/mul'}
    """
    out = {}
    for line in text.splitlines():
        if m := _INSTR.match(line):
            meta = _OP_NAME.search(m.group(2))
            out[m.group(1)] = meta.group(1) if meta else ""
    return out


def entry_instructions(text: str) -> list[Instruction]:
    """The entry computation's instructions in the order the scheduled module lists
    them (the execution order on CPU)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        op = _OPCODE.search(m.group(2)) if m else None
        if not op:
            continue
        rest = m.group(2)[op.end() :]
        meta = _OP_NAME.search(rest)
        refs = tuple(re.findall(r"%([\w.\-]+)", rest.split("), ", 1)[0]))
        out.append(Instruction(m.group(1), op.group(1), refs, meta.group(1) if meta else ""))
    return out


def ancestors(instructions: Sequence[Instruction], name: str) -> set[str]:
    """Every instruction that ``name`` depends on, directly or transitively."""
    by_name = {i.name: i for i in instructions}
    seen: set[str] = set()
    todo = list(by_name[name].operands)
    while todo:
        n = todo.pop()
        if n in by_name and n not in seen:
            seen.add(n)
            todo.extend(by_name[n].operands)
    return seen


def scheduled_collectives(text: str) -> list[Instruction]:
    """The entry computation's collectives (async ``-start`` halves included), in
    scheduled order; their ``op_name`` tells which part of the step issued them."""
    kinds = set(KINDS) | {k + "-start" for k in KINDS}
    return [i for i in entry_instructions(text) if i.opcode in kinds]


#: Instructions that move no data and compute nothing (left out of a window's ops).
BOOKKEEPING = frozenset(
    {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "copy-start", "copy-done"}
)


class Window(NamedTuple):
    """An asynchronous collective (a GPU program's ``-start`` and ``-done`` pair) and
    what the scheduled program runs between them.

    Attributes:
      start: the ``-start`` instruction's name.
      done: its ``-done``'s name.
      kind: one of ``KINDS``.
      op_name: the start's JAX op path (its ``jax.named_scope`` names).
      sync: XLA made it synchronous (``"is_sync":true``: nothing overlaps it).
      between: the instructions between start and done, ``Instruction`` s in order
        (``BOOKKEEPING`` left out): what may run while the collective is in flight.
    """

    start: str
    done: str
    kind: str
    op_name: str
    sync: bool
    between: tuple

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "done": self.done,
            "kind": self.kind,
            "op_name": self.op_name,
            "sync": self.sync,
            "between": [[i.name, i.opcode, i.op_name] for i in self.between],
        }


def async_windows(text: str) -> list[Window]:
    """Every asynchronous collective of the entry computation, in scheduled order, with
    the instructions scheduled between its start and its done (a CPU program has none:
    XLA:CPU's collectives are synchronous).

    Example:
        >>> text = (
        ...     "ENTRY %main (p: f32[4]) -> f32[4] {\\n"
        ...     "  %p = f32[4] parameter(0)\\n"
        ...     '  %s = (f32[4], f32[4]) all-to-all-start(%p), backend_config={"is_sync":false}\\n'
        ...     "  %m = f32[4] multiply(%p, %p)\\n"
        ...     "  %d = f32[4] all-to-all-done(%s)\\n"
        ...     "  ROOT %r = f32[4] add(%d, %m)\\n"
        ...     "}"
        ... )
        >>> [(w.kind, w.sync, [i.name for i in w.between]) for w in async_windows(text)]
        [('all-to-all', False, ['m'])]
    """
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    sync: set[str] = set()
    for line in lines[first + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if m and re.search(r'"is_sync":\s*true', line):
            sync.add(m.group(1))
    instrs = entry_instructions(text)
    position = {ins.name: k for k, ins in enumerate(instrs)}
    out = []
    for k, ins in enumerate(instrs):
        base = ins.opcode.removesuffix("-start")
        if not ins.opcode.endswith("-start") or base not in KINDS:
            continue
        done = next(
            (d for d in instrs[k + 1 :] if d.opcode == f"{base}-done" and ins.name in d.operands),
            None,
        )
        if done is None:
            continue
        between = tuple(
            i for i in instrs[k + 1 : position[done.name]] if i.opcode not in BOOKKEEPING
        )
        out.append(Window(ins.name, done.name, base, ins.op_name, ins.name in sync, between))
    return out
