"""Bytes per worker of every top-k exchange (dense, topk_allgather, topk_a2a, gtopk,
topk_balanced, oktopk), read from compiled programs on simulated meshes, beside the
lower bound of a sparse all-reduce (2k(P-1)/P pairs); the density where topk_a2a starts
to beat topk_allgather against the formula 1 / (2 (P - 1)); and each owner's load of
the hashed exchanges on a skewed gradient (every top entry inside one contiguous tenth
of the vector).

    python -m experiments.studies.topk_bytes --size 25000000 --workers 4,8,16,32

Nothing is allocated for the bytes: the programs are lowered from shapes only. Writes
``topk_bytes.json`` and ``topk_bytes.png`` into ``--out-dir``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.studies import harness

DENSITIES = (0.001, 0.01, 0.05, 0.1)
KINDS = ("dense", "topk_allgather", "topk_a2a", "gtopk", "topk_balanced", "oktopk")


def program_bytes(kind: str, density: float, size: int, workers: int) -> float:
    """Bytes each worker sends in one aggregation of a float32[size] gradient."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparsecomm_jax import aggregators, runtime
    from sparsecomm_jax.comm import hlo

    mesh = runtime.data_mesh(workers)
    agg = aggregators.AGGREGATORS[kind](density, "data", bucket_bytes=None)

    def body(g, r):
        state = agg.init({"g": g[0]})
        if aggregators.AGGREGATORS[kind].sparse:
            state = state._replace(residual={"g": r[0]})
        mean, _ = agg.update({"g": g[0]}, state)
        return mean["g"][None]

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=True
        )
    )
    shape = jax.ShapeDtypeStruct(
        (workers, size), np.float32, sharding=NamedSharding(mesh, P("data"))
    )
    return hlo.total_bytes(hlo.collectives(fn, shape, shape))


def formula_bytes(kind: str, density: float, size: int, workers: int) -> float:
    """Bytes per worker by the cost formulas (``exchanges.messages_and_bytes``, written
    out in ``comm.costmodel``)."""
    from sparsecomm_jax.topk import exchanges

    return exchanges.messages_and_bytes(kind, size, density, workers)[1]


def lower_bound(density: float, size: int, workers: int) -> float:
    """Bytes of 2k(P-1)/P (index, value) pairs: the least a worker sends in a sparse
    all-reduce of k-sparse vectors (Li and Hoefler, Ok-Topk)."""
    k = max(1, round(density * size))
    return 2 * k * (workers - 1) / workers * 8


def owner_load(size: int, density: float, workers: int, seed: int = 0) -> dict[str, float]:
    """The most loaded owner's pairs over the mean, for one worker's top-k of a skewed
    gradient (its k largest entries all inside one contiguous tenth): hashed owners
    (``topk.balanced.OwnerHash``) against contiguous shards (TopKA2A's)."""
    import numpy as np

    from sparsecomm_jax.topk.balanced import OwnerHash

    rng = np.random.default_rng(seed)
    k = max(1, round(density * size))
    start = int(rng.integers(0, size - size // 10))
    indices = start + rng.choice(size // 10, size=k, replace=False)
    hashed = np.asarray(OwnerHash(size, workers).owners(indices)[0])
    contiguous = indices // -(-size // workers)
    mean = k / workers
    return {
        "hashed": float(np.bincount(hashed, minlength=workers).max() / mean),
        "contiguous": float(np.bincount(contiguous, minlength=workers).max() / mean),
    }


def crossover(size: int, workers: int, lo: float = 1e-4, hi: float = 0.5) -> float:
    """Smallest density where topk_a2a sends fewer bytes than topk_allgather (bisection
    on compiled-program bytes)."""
    for _ in range(12):
        mid = (lo * hi) ** 0.5
        a2a = program_bytes("topk_a2a", mid, size, workers)
        ag = program_bytes("topk_allgather", mid, size, workers)
        lo, hi = (lo, mid) if a2a < ag else (mid, hi)
    return hi


def plot(rows, path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, len(DENSITIES), figsize=(4 * len(DENSITIES), 3.5), sharey=True)
    for ax, density in zip(axes, DENSITIES, strict=True):
        for kind in KINDS:
            pts = [(r["workers"], r["bytes"][kind]) for r in rows if r["density"] == density]
            ax.plot(*zip(*pts, strict=True), marker="o", label=kind)
        bound = [(r["workers"], r["lower_bound"]) for r in rows if r["density"] == density]
        ax.plot(*zip(*bound, strict=True), "k--", label="2k(P-1)/P pairs")
        ax.set(title=f"density {density}", xlabel="workers P", xscale="log", yscale="log")
    axes[0].set_ylabel("bytes per worker per step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--size", type=int, default=25_000_000, help="gradient length d")
    parser.add_argument("--workers", default="4,8,16,32", help="comma list of P")
    parser.add_argument(
        "--crossover-size",
        type=int,
        default=1_000_000,
        help="d for the crossover bisection (many compiles)",
    )
    args = parser.parse_args(argv)
    workers = [int(p) for p in args.workers.split(",")]
    from sparsecomm_jax import runtime

    runtime.simulate_cpu_devices(max(workers))
    from tqdm import tqdm

    rows = []
    for p in tqdm(workers, desc="workers"):
        for density in DENSITIES:
            measured = {k: program_bytes(k, density, args.size, p) for k in KINDS}
            formula = {k: formula_bytes(k, density, args.size, p) for k in KINDS}
            rows.append(
                {
                    "workers": p,
                    "density": density,
                    "bytes": measured,
                    "formula": formula,
                    "lower_bound": lower_bound(density, args.size, p),
                    "owner_load": owner_load(args.size, density, p),
                }
            )
    cross = [
        {"workers": p, "measured": crossover(args.crossover_size, p), "formula": 1 / (2 * (p - 1))}
        for p in workers
    ]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk_bytes.json").write_text(
        json.dumps({"size": args.size, "rows": rows, "crossover": cross}, indent=1)
    )
    plot(rows, out / "topk_bytes.png")
    print(f"d = {args.size:,}: MB per worker per step (compiled program; formula in brackets)")
    for r in rows:
        cells = "  ".join(
            f"{k} {r['bytes'][k] / 1e6:9.4g} ({r['formula'][k] / 1e6:.4g})" for k in KINDS
        )
        print(f"P={r['workers']:>2} density={r['density']:<6} {cells}")
    print("ratios (compiled): oktopk / lower bound, topk_balanced / topk_a2a and / topk_allgather;")
    print("owner load (most loaded / mean) on a skewed gradient: hashed, contiguous")
    for r in rows:
        b = r["bytes"]
        print(
            f"P={r['workers']:>2} density={r['density']:<6} "
            f"{b['oktopk'] / r['lower_bound']:.3f}  {b['topk_balanced'] / b['topk_a2a']:.3f}  "
            f"{b['topk_balanced'] / b['topk_allgather']:.3f}   load "
            f"{r['owner_load']['hashed']:.3f} {r['owner_load']['contiguous']:.2f}"
        )
    for c in cross:
        print(
            f"P={c['workers']:>2} topk_a2a beats topk_allgather above density "
            f"{c['measured']:.5f} (formula 1/(2(P-1)) = {c['formula']:.5f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
