"""The cost model against compiled-program bytes; choose() at the crossovers; adaptive."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import aggregators, costmodel, hlo, runtime

N = 8


def _compiled(name, density, size):
    mesh = runtime.data_mesh(N)
    agg = aggregators.AGGREGATORS[name](density, "data", bucket_bytes=None)

    def body(g, r):
        state = agg.init({"g": g[0]}) if name == "dense" else aggregators.ErrorFeedbackState(
            {"g": r[0]})  # fmt: skip
        return agg.update({"g": g[0]}, state)[0]["g"][None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=P("data"), check_vma=False))  # fmt: skip
    x = jax.ShapeDtypeStruct((N, size), np.float32, sharding=NamedSharding(mesh, P("data")))
    return hlo.collectives(fn, x, x)


@pytest.mark.parametrize("name", ["dense", "topk_allgather", "topk_a2a", "gtopk"])
@pytest.mark.parametrize("density", [0.01, 0.1])
def test_formulas_match_compiled_bytes_and_messages(name, density):
    size = 64_000
    colls = _compiled(name, density, size)
    messages, nbytes = costmodel.messages_and_bytes(name, size, density, N)
    assert hlo.total_bytes(colls) == pytest.approx(nbytes, rel=1e-6)
    link = costmodel.Link(alpha=1e-5, beta=1e-9)
    # the program's modelled time equals the formula's (per-collective message counts:
    # top-k sends values and indices as two collectives of the same pattern)
    assert costmodel.program_time(colls, link) == pytest.approx(
        messages * link.alpha + nbytes * link.beta, rel=1e-6
    )


@pytest.mark.parametrize("workers", [4, 8, 16, 32])
def test_choose_at_the_crossover(workers):
    size = 10_000_000
    link = costmodel.Link(alpha=0.0, beta=1e-9)  # bytes only: the crossover is exact
    cross = costmodel.crossover_density(workers)
    pair = ("topk_allgather", "topk_a2a")
    assert costmodel.choose(size, cross * 0.9, workers, link, pair) == "topk_allgather"
    assert costmodel.choose(size, cross * 1.1, workers, link, pair) == "topk_a2a"
    assert costmodel.choose(size, 0.6, workers, link) == "dense"  # a2a loses above ~0.5
    assert costmodel.choose(size, 0.001, workers, link) == "topk_allgather"


def test_latency_bound_buckets_go_dense():
    link = costmodel.Link(alpha=1e-3, beta=1e-12)  # messages dominate
    assert costmodel.choose(1000, 0.01, 8, link) in ("dense", "topk_allgather")
    assert costmodel.choose(1000, 0.01, 8, link) != "topk_a2a"  # 3(P-1) messages


def test_fit_recovers_alpha_and_beta():
    truth = costmodel.Link(alpha=2e-5, beta=3e-9)
    points = [(m, b, m * truth.alpha + b * truth.beta)
              for m, b in [(14, 1e3), (14, 1e6), (28, 1e5), (6, 5e6)]]  # fmt: skip
    got = costmodel.fit(points)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert got.beta == pytest.approx(truth.beta, rel=1e-6)
    with pytest.raises(ValueError, match="two"):
        costmodel.fit(points[:1])


def test_calibrate_runs_on_simulated_devices():
    link, points = costmodel.calibrate(runtime.data_mesh(N), sizes=(256, 4096), repeats=2)
    assert len(points) == 2 and link.alpha >= 0 and link.beta >= 0


@pytest.mark.parametrize("density, expected", [(0.001, "all-gather"), (0.3, "all-to-all"),
                                               (0.9, "all-reduce")])  # fmt: skip
def test_adaptive_picks_per_bucket_and_conserves(density, expected):
    link = costmodel.Link(alpha=0.0, beta=1e-9)
    mesh = runtime.data_mesh(N)
    agg = aggregators.adaptive(density, "data", link=link, bucket_bytes=None)
    rng = np.random.default_rng(0)
    g = rng.normal(size=(N, 4000)).astype(np.float32)
    r = (0.1 * rng.normal(size=(N, 4000))).astype(np.float32)

    def body(gp, rp):
        mean, st = agg.update({"w": gp[0]}, aggregators.ErrorFeedbackState({"w": rp[0]}))
        return mean["w"][None], st.residual["w"][None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P("data"), P("data")), check_vma=False))  # fmt: skip
    args = [runtime.put_global(x, mesh, P("data")) for x in (g, r)]
    mean, new_r = (np.asarray(x) for x in fn(*args))
    np.testing.assert_allclose(N * mean[0] + new_r.sum(0), (g + r).sum(0), atol=1e-4)
    kinds = {c.kind for c in hlo.collectives(fn, *args)}
    assert expected in kinds
