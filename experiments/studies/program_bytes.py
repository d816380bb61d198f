"""Bytes each worker sends per step, by program: ``embrace``'s one program against the
overlapped step's ``high`` (on the step's path) and ``low`` (beside the next step's
compute, the only part the overlap can hide), and how many positions the neighbouring
batch reads (what must go first). Read from the compiled programs of a
middle step on simulated CPU devices (``hlo.parse_collectives``); nothing is timed.

    python -m experiments.studies.program_bytes --vocab 100000 --dim 256 --hidden 64 \\
        --seq-len 16 --batch 64 --sampled-softmax 1024
"""

from __future__ import annotations

import collections
import sys


def _summary(text: str) -> dict:
    from sparsecomm_jax.comm import hlo

    sent, count, branches = collections.Counter(), collections.Counter(), 0
    for c in hlo.parse_collectives(text):
        if c.conditional:  # runs only when its branch is taken (a refetch)
            branches += 1
            continue
        sent[c.kind] += c.bytes_sent
        count[c.kind] += 1
    return {
        "MB": sum(sent.values()) / 1e6,
        "collectives": sum(count.values()),
        "by_kind": {k: (count[k], round(v / 1e6, 3)) for k, v in sent.items()},
        "in_branches": branches,
    }


def measure(args) -> dict:
    """``{program: summary}`` for ``embrace`` and the overlapped step (row-sparse tables)."""
    from sparsecomm_jax import runtime

    runtime.simulate_cpu_devices(args.devices)
    import jax
    import optax

    import sparsecomm_jax as sc
    from experiments.studies.timeline import _workload
    from sparsecomm_jax.comm.hlo import compiled_text as hlo_text

    w, mesh = _workload(args), runtime.data_mesh(args.devices)
    params, kw = w.init(jax.random.key(0)), dict(table_update="rows")
    common = dict(replicated_keys=w.replicated_keys, embedding_paths=w.embedding_paths, **kw)
    ts = sc.make_train_step(w.loss, optax.sgd(0.5), mesh, params, "embrace", **common)
    out = {
        "embrace": _summary(hlo_text(ts.step, ts.state, sc.place_for_step(ts, w.batch_at, 1, 5)))
    }
    ov = sc.make_overlapped(w.loss, optax.sgd(0.5), mesh, params, **common)
    p, st = ov.programs, ov.state
    batch = ov.place(*(w.batch_at(s) for s in range(1, 5)))
    grads = p.compute(st.params, p.fetch(st.params, batch.data), batch.data)
    out["overlap high"] = _summary(hlo_text(p.high, st, *grads, batch))
    new, _, pend, _, _ = p.high(st, *grads, batch)
    out["overlap low"] = _summary(
        hlo_text(p.low, new.params, new.opt_state, pend, batch.capacity, False)
    )
    out["first-chunk capacity"] = batch.capacity
    return out


def reuse(args, steps=range(2, 8)) -> dict:
    """Mean share of positions, LSTM LM: ``bwd_*`` of batch t whose id batch t+1 reads
    (they must go in the first chunk), ``fwd_*`` of batch t+1 whose id batch t reads
    (their fetch must wait for step t's update); ``in``: input table, ``out``: targets,
    ``neg``: the shared negatives (output table)."""
    import numpy as np

    from experiments.studies.timeline import _workload

    w, out = _workload(args), collections.defaultdict(list)

    def reads(s):
        b = w.batch_at(s)
        tok, neg = b["tokens"], b["negatives"]
        return tok[:, :-1].ravel(), tok[:, 1:].ravel(), neg

    for t in steps:
        (i0, o0, n0), (i1, o1, n1) = reads(t), reads(t + 1)
        out0, out1 = np.concatenate([o0, n0]), np.concatenate([o1, n1])
        pairs = {
            "bwd_in": (i0, i1),
            "bwd_out": (o0, out1),
            "bwd_neg": (n0, out1),
            "fwd_in": (i1, i0),
            "fwd_out": (o1, out0),
            "fwd_neg": (n1, out0),
        }
        for name, (ids, other) in pairs.items():
            out[name].append(np.isin(ids, other).mean())
    return {k: round(float(np.mean(v)), 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    from experiments.studies.timeline import parse

    args = parse([*(argv if argv is not None else sys.argv[1:]), "--out", "-"])
    for name, value in measure(args).items():
        print(f"{name}: {value}")
    if args.model == "lstm_lm" and args.sampled_softmax:
        print(f"shares of positions read by the neighbouring batch: {reuse(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
