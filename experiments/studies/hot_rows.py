"""Hot rows replicated against the column and row layouts: the bytes of the compiled
programs, all of a step's and those before the forward pass (the lookups' exchange),
for one table of V = 1M rows read by Zipf ids, at P = 4 to 32 simulated devices.

    python -m experiments.studies.hot_rows
    python -m experiments.studies.hot_rows --exponents 1.0 --workers 4,8 --hot 1024

Each worker reads ``--lookups`` ids a step. The hot ids are the H most read over
``--histogram-batches`` batches (``hot.from_counts``), counted as the command line
counts them; the step measured is the batch after those. Bytes are read from the
compiled programs (``comm.hlo``): the whole step's, and those of a program of the
layout's fetch alone (what must arrive before the forward pass can start). Also
reported: the share of the step's reads that the hot rows serve.

The planner's side (``--what planner``, no compile): the same histogram and batch given
to ``planner.table_stats``; for each H the hot layout's modelled bytes, split into the
cold rows' exchange and the hot rows' all-reduce, the H its pricing picks, and the
layout the whole planner gives the table (every priced layout, at ``--link-gbit``).

In ``embrace_2d`` (``--what pipelined``): its pipelined program's bytes in a middle
step, the table column-wise, row-wise and hot at each H (each pipelined: its rows, a hot
table's cold rows, carried from the step before), and the bytes of the collectives the
program issues before its forward pass (``scopes.SCOPE_ROWS``), both read from the
compiled program.

Writes ``hot_rows.json`` and ``.csv`` (compiled bytes), ``hot_rows_planner.json``
and ``.csv``, and ``hot_rows_pipelined.json`` and ``.csv`` into ``--out-dir``.
"""

from __future__ import annotations

import sys

import numpy as np

from experiments.studies import harness


def zipf_ids(rng, exponent: float, vocab: int, size) -> np.ndarray:
    """Ids in [0, V) with P(v) proportional to (v + 1)^-s (a bounded Zipf)."""
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    return rng.choice(vocab, size=size, p=p / p.sum())


def loss(p, batch, emb):
    """The study's model: each id's row through a readout, against ``y``."""
    import jax.numpy as jnp

    return jnp.mean((emb.lookup(p["t"], batch["ids"]) @ p["w"] - batch["y"]) ** 2)


def model(ids: np.ndarray, vocab: int, dim: int) -> tuple[dict, dict]:
    """``(params, batch)``: a V x D table ``t`` of zeros and its readout; the ``ids``
    (every worker's, in order) as one batch."""
    params = {"t": np.zeros((vocab, dim), np.float32), "w": np.zeros((dim, 1), np.float32)}
    return params, {"ids": ids.reshape(-1), "y": np.zeros((ids.size, 1), np.float32)}


def step_bytes(layout, ids: np.ndarray, vocab: int, dim: int, workers: int) -> float:
    """Bytes a worker sends in one step of the whole program (SGD, rows update)."""
    import optax

    import sparsecomm_jax as sc
    from sparsecomm_jax import runtime
    from sparsecomm_jax.comm import hlo

    params, batch = model(ids, vocab, dim)
    ts = sc.make_train_step(
        loss,
        optax.sgd(0.1),
        runtime.data_mesh(workers),
        params,
        "embrace",
        embedding_paths=["t"],
        table_layouts={"t": layout},
        table_update="rows",
    )
    return hlo.total_bytes(hlo.collectives(ts.step, ts.state, ts.place_batch(batch)))


def fetch_bytes(layout, ids: np.ndarray, vocab: int, dim: int, workers: int) -> float:
    """Bytes a worker sends before the forward pass: a program of the layout's fetch
    alone, its capacity planned as the step plans it."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparsecomm_jax import runtime
    from sparsecomm_jax.comm import hlo
    from sparsecomm_jax.embedding import layout_registry
    from sparsecomm_jax.embedding.access import LOOKUP, Read
    from sparsecomm_jax.embedding.layout import padded_shape
    from sparsecomm_jax.embedding.tables import Table, bind_tables

    mesh = runtime.data_mesh(workers)
    [table] = bind_tables((Table(0, "t", vocab, dim, layout_registry.get(layout)),), workers)
    per_worker = ids.reshape(workers, -1)
    reads = {0: (per_worker, np.zeros(0, per_worker.dtype))}
    need = table.layout.capacity.need([reads], (table,), workers) if table.layout.capacity else {}
    capacity = {0: table.layout.capacity.grow(need[0])} if need else {}

    def body(shard, mine):  # shard: the worker's rows; mine: int[1, n] its ids
        fetched = table.layout.fetch({0: shard}, [Read(LOOKUP, 0, mine[0])], capacity, "data")
        return fetched.rows[0][None]

    spec = table.layout.spec("data")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P("data")), out_specs=P("data")))
    shard = jax.ShapeDtypeStruct(
        padded_shape(table, workers), np.float32, sharding=NamedSharding(mesh, spec)
    )
    mine = jax.ShapeDtypeStruct(
        per_worker.shape, per_worker.dtype, sharding=NamedSharding(mesh, P("data"))
    )
    return hlo.total_bytes(hlo.collectives(fn, shard, mine))


def measure(args, exponent: float, workers: int) -> list[dict]:
    """Every layout's bytes at one exponent and P."""
    from sparsecomm_jax.embedding import hot

    counts, step = study_ids(args, exponent, workers)
    rows = []
    hot_ones = [("hot", h, hot.layout({"t": hot.from_counts(counts, h)})) for h in args.hot]
    for name, h, layout in [("column", 0, "column"), ("row", 0, "row"), *hot_ones]:
        hot_ids = hot.from_counts(counts, h)
        rows.append(
            {
                "exponent": exponent,
                "workers": workers,
                "layout": name,
                "hot_rows": h,
                "hot_share": float(np.isin(step, hot_ids).mean()),
                "bytes": step_bytes(layout, step, args.vocab, args.dim, workers),
                "bytes_before_forward": fetch_bytes(layout, step, args.vocab, args.dim, workers),
            }
        )
    return rows


def pipelined_rows(args, exponent: float, workers: int) -> list[dict]:
    """``embrace_2d``'s pipelined program (as built where collectives overlap compute)
    with the study's one table column-wise, row-wise and hot at each H (each pipelined:
    its rows carried from the step before): the bytes of a middle step (the second of
    five), and those of its collectives before the forward pass (the step's fetch of
    rows it does not carry, ``scopes.SCOPE_ROWS``), from the compiled program."""
    import optax

    import sparsecomm_jax as sc
    from sparsecomm_jax import runtime
    from sparsecomm_jax.comm import hlo
    from sparsecomm_jax.embedding import hot
    from sparsecomm_jax.schedule import scopes

    counts, stream = study_ids(args, exponent, workers, after=5)
    params, _ = model(stream[0], args.vocab, args.dim)
    rows = []
    options = [("column", 0, "column"), ("row", 0, "row")]
    options += [("hot", h, hot.layout({"t": hot.from_counts(counts, h)})) for h in args.hot]
    for name, h, layout in options:
        ts = sc.make_train_step(
            loss,
            optax.sgd(0.1),
            runtime.data_mesh(workers),
            params,
            "embrace_2d",
            embedding_paths=["t"],
            table_layouts={"t": layout},
            table_update="rows",
            collectives_overlap=True,
        )

        def batch_at(k: int) -> dict:
            return model(stream[k], args.vocab, args.dim)[1]

        # one step first: the middle step's state carries the rows it fetched
        state, _ = ts.step(ts.state, sc.place_for_step(ts, batch_at, 0, 5))
        text = hlo.compiled_text(ts.step, state, sc.place_for_step(ts, batch_at, 1, 5))
        colls = hlo.scheduled_collectives(text)
        before = [c.name for c in colls if scopes.SCOPE_ROWS in c.op_name]
        sent = {c.name: c for c in hlo.parse_collectives(text)}
        rows.append(
            {
                "exponent": exponent,
                "workers": workers,
                "layout": name,
                "hot_rows": h,
                "bytes": hlo.total_bytes(list(sent.values())),
                "bytes_before_forward": hlo.total_bytes([sent[n] for n in before]),
            }
        )
    return rows


def study_ids(args, exponent: float, workers: int, after: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, step ids)``: the histogram of ``--histogram-batches`` batches of Zipf
    ids and the batch after them (``int[P * lookups]``; ``after`` > 1: the ``after``
    batches after them, ``int[after, P * lookups]``)."""
    rng = np.random.default_rng(args.seed)
    shape = (args.histogram_batches + after, workers * args.lookups)
    ids = zipf_ids(rng, exponent, args.vocab, shape)
    counts = np.bincount(ids[: args.histogram_batches].ravel(), minlength=args.vocab)
    return counts, ids[-1] if after == 1 else ids[args.histogram_batches :]


def plan_rows(args, exponent: float, workers: int) -> list[dict]:
    """The planner's view of the hot layout at one exponent and P: a row per H tried."""
    from sparsecomm_jax import planner
    from sparsecomm_jax.comm.costmodel import Link
    from sparsecomm_jax.embedding import hot

    counts, step = study_ids(args, exponent, workers)
    params, batch = model(step, args.vocab, args.dim)
    [stats] = planner.table_stats(loss, params, ["t"], [batch], workers, counts={"t": counts})
    link = Link.from_bandwidth(args.link_gbit)
    picked = planner.layout_cost(stats, "hot", workers, link, 0)
    plan = planner.plan_tables([stats], workers, link, optimizer_slots=0)
    [chosen] = plan.choices
    rows = []
    for option in stats.of("hot").options:
        price = hot.option_price(stats, option, workers, link, 0)
        cold = hot.option_price(stats, option._replace(rows=0), workers, link, 0).bytes
        rows.append(
            {
                "exponent": exponent,
                "workers": workers,
                "hot_rows": option.rows,
                "cold_bucket": option.bucket,  # as measured; priced padded
                "cold_bytes": cold,
                "hot_allreduce_bytes": price.bytes - cold,
                "bytes": price.bytes,
                "hot_picks": picked.setting,
                "planner_layout": f"{chosen.layout} {chosen.setting}".strip(),
                "column_bytes": planner.layout_cost(stats, "column", workers, link, 0).bytes,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--vocab", type=int, default=1_000_000, help="V")
    parser.add_argument("--dim", type=int, default=32, help="D (float32)")
    parser.add_argument("--lookups", type=int, default=2048, help="ids a worker reads a step")
    parser.add_argument("--workers", default="4,8,16,32", help="comma list of P")
    parser.add_argument("--exponents", default="0.8,1.0,1.2", help="Zipf exponents")
    parser.add_argument("--hot", default="1024,16384", help="comma list of H to measure")
    parser.add_argument("--histogram-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--what",
        default="bytes,planner",
        help="comma list: bytes (compiled), planner, pipelined (embrace_2d, compiled)",
    )
    parser.add_argument("--link-gbit", type=float, default=1.0, help="the planner's link")
    args = parser.parse_args(argv)
    args.hot = [int(h) for h in args.hot.split(",")]
    workers = [int(p) for p in args.workers.split(",")]
    what = set(args.what.split(","))
    from sparsecomm_jax import runtime

    runtime.simulate_cpu_devices(max(workers))
    jobs = [(s, p) for s in map(float, args.exponents.split(",")) for p in workers]
    if "bytes" in what:
        show_bytes(args, jobs)
    if "planner" in what:
        show_planner(args, jobs)
    if "pipelined" in what:
        show_pipelined(args, jobs)
    return 0


def grid_rows(args, jobs: list[tuple[float, int]], rows_of, desc: str, name: str) -> list[dict]:
    """``rows_of(args, exponent, P)`` at every point of ``jobs``, their rows in one list,
    saved as ``name`` (json and csv) in ``--out-dir``."""
    rows = []
    for got in harness.grid(jobs, lambda s, p: {"rows": rows_of(args, s, p)}, desc):
        rows.extend(got.get("rows", []))
    harness.save_rows(rows, args.out_dir, name, {"setup": vars(args)})
    return rows


def show_bytes(args, jobs: list[tuple[float, int]]) -> None:
    """The compiled bytes of every layout, saved and printed."""
    rows = grid_rows(args, jobs, measure, "hot rows", "hot_rows")
    print(f"V={args.vocab:,} D={args.dim} lookups/worker={args.lookups}: KB a worker sends")
    print("   s   P  layout      H  hot share  step KB  before forward KB")
    for r in rows:
        print(
            f"{r['exponent']:4} {r['workers']:3}  {r['layout']:6} {r['hot_rows']:6} "
            f"{r['hot_share']:10.3f} {r['bytes'] / 1e3:8.1f} "
            f"{r['bytes_before_forward'] / 1e3:17.1f}"
        )


def show_pipelined(args, jobs: list[tuple[float, int]]) -> None:
    """The compiled bytes of ``embrace_2d`` with the table column-wise, row-wise and
    hot, saved and printed."""
    rows = grid_rows(args, jobs, pipelined_rows, "2d", "hot_rows_pipelined")
    print(f"embrace_2d, V={args.vocab:,} D={args.dim}: KB a worker sends in a middle step")
    print("   s   P  layout      H  step KB  before forward KB")
    for r in rows:
        print(
            f"{r['exponent']:4} {r['workers']:3}  {r['layout']:6} {r['hot_rows']:6} "
            f"{r['bytes'] / 1e3:8.1f} {r['bytes_before_forward'] / 1e3:17.1f}"
        )


def show_planner(args, jobs: list[tuple[float, int]]) -> None:
    """The planner's modelled bytes of each H, saved and printed."""
    rows = grid_rows(args, jobs, plan_rows, "planner", "hot_rows_planner")
    print(f"the planner's model, {args.link_gbit} Gbit/s: KB a worker sends a step")
    print(
        "   s   P       H  cold C  cold KB  hot all-reduce KB  total KB  column KB  hot picks  plan"
    )
    for r in rows:
        print(
            f"{r['exponent']:4} {r['workers']:3}  {r['hot_rows']:6} {r['cold_bucket']:7} "
            f"{r['cold_bytes'] / 1e3:8.1f} {r['hot_allreduce_bytes'] / 1e3:18.1f} "
            f"{r['bytes'] / 1e3:9.1f} {r['column_bytes'] / 1e3:10.1f}  {r['hot_picks']:9}  "
            f"{r['planner_layout']}"
        )


if __name__ == "__main__":
    sys.exit(main())
