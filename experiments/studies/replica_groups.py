"""A model of what replica groups (2-D sparse parallelism) save at scale: bytes,
messages and modelled time per device per step of one large table's exchanges, on P =
64 to 4,096 devices, against the 1-D all-to-all over every device.

    python -m experiments.studies.replica_groups
    python -m experiments.studies.replica_groups --vocab 10000000 --dim 128 --lookups 16384

The exchanges are the row-wise layout's (``embedding.row``: a worker's distinct ids to
their owners, the rows back, their gradients out) and, with R groups of G devices, the
sum across the groups that ``embedding.replica_groups`` makes, per table the fewer bytes of:

- an all-gather of the touched rows: (R - 1) U_G / G rows of 4 D + 4 bytes, R - 1
  messages (a ring), where U_G is the distinct ids of a whole group's lookups;
- an all-reduce of the dense shard: 2 (R - 1) / R x V / G rows, 2 (R - 1) messages.

Distinct ids are expected values under Zipf(s) over V (``distinct``). Time is the
alpha-beta model on two links: peers on the same node of ``--node`` devices over
NVLink, the others over InfiniBand (figures and sources in ``LINKS``). The per-message
latencies are assumptions: the study reports the crossover at three of them.

Writes ``replica_groups.json``, ``.csv`` and ``.png`` into ``--out-dir``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from experiments.studies import harness


class Link(NamedTuple):
    """One kind of link of a device: ``alpha`` seconds a message, ``beta`` bytes a
    second one way."""

    alpha: float
    beta: float


# Per direction, per GPU. NVLink 4 on H100 SXM: 900 GB/s both ways (NVIDIA H100 Tensor
# Core GPU datasheet, 2023). InfiniBand NDR: one 400 Gb/s ConnectX-7 per GPU (NVIDIA DGX
# H100 datasheet, 2023). The alphas are assumptions of the order nccl-tests reports for
# small messages inside a node and across nodes; the study varies the inter-node one.
LINKS = {
    "nvlink": Link(alpha=3e-6, beta=450e9),
    "infiniband": Link(alpha=8e-6, beta=50e9),
}
ALPHAS_INTER = (4e-6, 8e-6, 16e-6)


def distinct(draws: float, vocab: int, exponent: float) -> float:
    """Expected distinct ids among ``draws`` Zipf(``exponent``) draws over ``vocab`` ids:
    the sum over ids of 1 - (1 - p)^draws.

    Example:
        >>> round(distinct(1, 1000, 1.0), 6), distinct(10**9, 1000, 1.0) > 999
        (1.0, True)
    """
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    p /= p.sum()
    return float(-np.expm1(draws * np.log1p(-p)).sum())


class Traffic(NamedTuple):
    """A device's traffic in one step: bytes and messages on each kind of link."""

    bytes_intra: float = 0.0
    bytes_inter: float = 0.0
    msgs_intra: float = 0.0
    msgs_inter: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:  # type: ignore[override]
        return Traffic(*(a + b for a, b in zip(self, other, strict=True)))

    @property
    def bytes(self) -> float:
        return self.bytes_intra + self.bytes_inter

    @property
    def messages(self) -> float:
        return self.msgs_intra + self.msgs_inter

    def seconds(self, intra: Link, inter: Link) -> float:
        return (
            self.msgs_intra * intra.alpha
            + self.msgs_inter * inter.alpha
            + self.bytes_intra / intra.beta
            + self.bytes_inter / inter.beta
        )


def spread(total_bytes: float, messages: int, peers: int, node: int) -> Traffic:
    """``total_bytes`` and ``messages`` over ``peers`` devices (this one among them),
    the share on this device's node (``node`` devices, the group's first) over NVLink."""
    if peers <= 1:
        return Traffic()
    inter = max(0, peers - node) / (peers - 1)  # peers on other nodes
    return Traffic(
        total_bytes * (1 - inter), total_bytes * inter, messages * (1 - inter), messages * inter
    )


def one_d(workers: int, unique: float, dim: int, node: int) -> Traffic:
    """The row-wise exchanges over every device: ids out, rows back, gradients out."""
    share = (workers - 1) / workers
    return spread(unique * share * (8 * dim + 4), 3 * (workers - 1), workers, node)


def across(replicas: int, group: int, group_unique: float, vocab: int, dim: int) -> tuple:
    """The sum across the groups, the fewer bytes of the two (``replica_groups.choose``), all
    between nodes; returns ``(Traffic, "rows" or "shard")``."""
    row = 4 * dim + 4
    rows = (replicas - 1) * group_unique / group
    shard = 2 * (replicas - 1) / replicas * vocab / group
    if rows < shard:
        return Traffic(0, rows * row, 0, replicas - 1), "rows"
    return Traffic(0, shard * row, 0, 2 * (replicas - 1)), "shard"


def two_d(workers, group, unique, group_unique, vocab, dim, node) -> tuple:
    """Replica groups: the row-wise exchanges within a group, the sum across them."""
    inside = spread(unique * (group - 1) / group * (8 * dim + 4), 3 * (group - 1), group, node)
    sync, how = across(workers // group, group, group_unique, vocab, dim)
    return inside + sync, how


def sparse_allreduce_bytes(replicas: int, group: int, every_unique: float, dim: int) -> float:
    """What the sum across the groups would send as a sparse all-reduce (not built): a
    reduce-scatter and an all-gather of the union of the groups' touched rows at an
    owner, each (R - 1) / R of it: the least an exact sum can send."""
    return 2 * (replicas - 1) / replicas * every_unique / group * (4 * dim + 4)


def model(args) -> list[dict]:
    """Every (exponent, P, G) row of the model."""
    rows = []
    for s in args.exponents:
        unique = distinct(args.lookups, args.vocab, s)
        grouped = {g: distinct(g * args.lookups, args.vocab, s) for g in args.groups}
        for p in args.workers:
            every = distinct(p * args.lookups, args.vocab, s)  # the whole step's distinct ids
            flat = one_d(p, unique, args.dim, args.node)
            for g in (g for g in args.groups if g < p and p % g == 0):
                mine, how = two_d(p, g, unique, grouped[g], args.vocab, args.dim, args.node)
                times = {}
                for alpha in ALPHAS_INTER:
                    inter = LINKS["infiniband"]._replace(alpha=alpha)
                    times[alpha] = (
                        flat.seconds(LINKS["nvlink"], inter),
                        mine.seconds(LINKS["nvlink"], inter),
                    )
                rows.append(
                    {
                        "exponent": s,
                        "workers": p,
                        "group": g,
                        "replicas": p // g,
                        "sync": how,
                        "unique_per_worker": unique,
                        "unique_per_group": grouped[g],
                        "bytes_1d": flat.bytes,
                        "bytes_2d": mine.bytes,
                        "bytes_2d_sparse_allreduce": mine.bytes
                        - across(p // g, g, grouped[g], args.vocab, args.dim)[0].bytes
                        + sparse_allreduce_bytes(p // g, g, every, args.dim),
                        "messages_1d": flat.messages,
                        "messages_2d": mine.messages,
                        "seconds_1d": {str(a): t[0] for a, t in times.items()},
                        "seconds_2d": {str(a): t[1] for a, t in times.items()},
                    }
                )
    return rows


def crossovers(rows: list[dict]) -> list[dict]:
    """Per exponent, G and inter-node alpha: the smallest P where 2-D takes less time."""
    out = []
    for s in sorted({r["exponent"] for r in rows}):
        for g in sorted({r["group"] for r in rows}):
            for alpha in ALPHAS_INTER:
                mine = [r for r in rows if r["exponent"] == s and r["group"] == g]
                wins = [
                    r["workers"]
                    for r in mine
                    if r["seconds_2d"][str(alpha)] < r["seconds_1d"][str(alpha)]
                ]
                out.append(
                    {"exponent": s, "group": g, "alpha_inter": alpha, "from_p": min(wins or [0])}
                )
    return out


def plot(rows: list[dict], path: Path, exponent: float) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    alpha = str(LINKS["infiniband"].alpha)
    for g in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == g and r["exponent"] == exponent]
        ps = [r["workers"] for r in mine]
        axes[0].plot(ps, [r["bytes_2d"] / r["bytes_1d"] for r in mine], marker="o", label=f"G={g}")
        axes[1].plot(ps, [r["messages_2d"] for r in mine], marker="o", label=f"G={g}")
        ratio = [r["seconds_2d"][alpha] / r["seconds_1d"][alpha] for r in mine]
        axes[2].plot(ps, ratio, marker="o", label=f"G={g}")
    flat = sorted({(r["workers"], r["messages_1d"]) for r in rows if r["exponent"] == exponent})
    axes[1].plot(*zip(*flat, strict=True), "k--", label="1-D")
    for ax, title in zip(
        axes,
        ("bytes, 2-D / 1-D", "messages per device", f"modelled time, 2-D / 1-D (alpha {alpha})"),
        strict=True,
    ):
        ax.set(title=title, xlabel="devices P", xscale="log")
    axes[1].set_yscale("log")
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--vocab", type=int, default=10_000_000, help="V, the table's rows")
    parser.add_argument("--dim", type=int, default=128, help="D, float32 columns")
    parser.add_argument("--lookups", type=int, default=16_384, help="ids a worker reads a step")
    parser.add_argument("--node", type=int, default=8, help="devices a node (NVLink)")
    parser.add_argument("--workers", default="64,128,256,512,1024,2048,4096")
    parser.add_argument("--groups", default="8,16,32,64", help="G, devices a group")
    parser.add_argument("--exponents", default="0.8,1.0,1.2", help="Zipf exponents")
    args = parser.parse_args(argv)
    args.workers = [int(x) for x in args.workers.split(",")]
    args.groups = [int(x) for x in args.groups.split(",")]
    args.exponents = [float(x) for x in args.exponents.split(",")]
    rows = model(args)
    cross = crossovers(rows)
    out = Path(args.out_dir)
    setup = {k: v for k, v in vars(args).items() if k != "out_dir"}
    links = {k: v._asdict() for k, v in LINKS.items()}
    harness.save_rows(rows, out, "replica_groups", {"setup": setup, "links": links})
    plot(rows, out / "replica_groups.png", 1.0 if 1.0 in args.exponents else args.exponents[0])
    alpha = str(LINKS["infiniband"].alpha)
    print(f"V={args.vocab:,} D={args.dim} lookups/worker={args.lookups:,}; time at alpha {alpha}")
    print(
        "   s     P   G  sync   MB 1-D  MB 2-D  (sparse all-reduce)  msgs 1-D  msgs 2-D"
        "  ms 1-D  ms 2-D"
    )
    for r in rows:
        print(
            f"{r['exponent']:4} {r['workers']:5} {r['group']:3}  {r['sync']:5} "
            f"{r['bytes_1d'] / 1e6:7.2f} {r['bytes_2d'] / 1e6:7.2f} "
            f"{r['bytes_2d_sparse_allreduce'] / 1e6:20.2f} {r['messages_1d']:9.0f} "
            f"{r['messages_2d']:9.0f} {r['seconds_1d'][alpha] * 1e3:7.3f} "
            f"{r['seconds_2d'][alpha] * 1e3:7.3f}"
        )
    print("the smallest P where 2-D takes less time (0: none of those modelled)")
    for c in cross:
        print(
            f"s={c['exponent']} G={c['group']:3} inter-node alpha "
            f"{c['alpha_inter'] * 1e6:g} us: {c['from_p']}"
        )
    print(json.dumps({"written": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
