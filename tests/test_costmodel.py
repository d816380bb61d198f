"""The cost model against compiled-program bytes; choose() at the crossovers; adaptive."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import aggregators, runtime
from sparsecomm_jax.comm import costmodel, hlo
from sparsecomm_jax.topk import costs, exchanges, local_cost

N = 8


def _compiled(name, density, size, workers=N):
    mesh = runtime.data_mesh(workers)
    agg = aggregators.AGGREGATORS[name](density, "data", bucket_bytes=None)

    def body(g, r):
        state = agg.init({"g": g[0]})
        if name != "dense":
            state = state._replace(residual={"g": r[0]})
        return agg.update({"g": g[0]}, state)[0]["g"][None]

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=True
        )
    )
    x = jax.ShapeDtypeStruct((workers, size), np.float32, sharding=NamedSharding(mesh, P("data")))
    return hlo.collectives(fn, x, x)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "name", ["dense", "topk_allgather", "topk_a2a", "gtopk", "topk_balanced", "oktopk"]
)
@pytest.mark.parametrize("density", [0.01, 0.1])
def test_formulas_match_compiled_bytes_and_messages(name, density):
    size = 64_000
    colls = _compiled(name, density, size)
    messages, nbytes = exchanges.messages_and_bytes(name, size, density, N)
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
    cross = costs.crossover_density(workers)
    pair = ("topk_allgather", "topk_a2a")
    assert exchanges.choose(size, cross * 0.9, workers, link, pair) == "topk_allgather"
    assert exchanges.choose(size, cross * 1.1, workers, link, pair) == "topk_a2a"
    classic = ("dense", "topk_allgather", "topk_a2a")
    assert exchanges.choose(size, 0.6, workers, link, classic) == "dense"  # a2a loses above ~0.5
    assert exchanges.choose(size, 0.001, workers, link, classic) == "topk_allgather"


@pytest.mark.parametrize("workers", [4, 8, 16, 32])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.1])
def test_oktopk_sends_the_fewest_bytes_of_the_menu_on_large_buckets(workers, density):
    """Within 1.5x of the 2k(P-1)/P pairs every sparse all-reduce must send, so on a
    bytes-only link it is adaptive's choice; topk_balanced sends the whole sum of the
    selections and is never below it."""
    size, k = 25_000_000, round(density * 25_000_000)  # the histograms' bytes are fixed
    link = costmodel.Link(alpha=0.0, beta=1e-9)
    assert exchanges.choose(size, density, workers, link) == "oktopk"
    nbytes = exchanges.messages_and_bytes("oktopk", size, density, workers)[1]
    assert nbytes <= 1.5 * 2 * k * (workers - 1) / workers * 8
    assert exchanges.messages_and_bytes("topk_balanced", size, density, workers)[1] >= nbytes


@pytest.mark.parametrize("workers, size", [(8, 64_000), (8, 1001), (4, 10), (32, 250_000)])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
def test_the_result_form_is_the_smallest(workers, size, density):
    """Each form's words by hand: pairs 2 a slot, a bitmap a bit an entry and a value a
    slot, the whole shard a word an entry; the chosen one is the fewest."""
    width = -(-size // workers)
    for slots in (1, max(1, round(density * width)), width):
        words = {"pairs": 2 * slots, "bitmap": -(-width // 32) + slots, "shard": width}
        form = costs.result_form(width, slots)
        assert words[form] == min(words.values())


def test_latency_bound_buckets_go_dense():
    link = costmodel.Link(alpha=1e-3, beta=1e-12)  # messages dominate
    assert exchanges.choose(1000, 0.01, 8, link) in ("dense", "topk_allgather")
    assert exchanges.choose(1000, 0.01, 8, link) != "topk_a2a"  # 3(P-1) messages


def test_fit_recovers_alpha_and_beta():
    truth = costmodel.Link(alpha=2e-5, beta=3e-9)
    points = [
        (m, b, m * truth.alpha + b * truth.beta)
        for m, b in [(14, 1e3), (14, 1e6), (28, 1e5), (6, 5e6)]
    ]
    got = costmodel.fit(points)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert got.beta == pytest.approx(truth.beta, rel=1e-6)
    with pytest.raises(ValueError, match="two"):
        costmodel.fit(points[:1])


def test_calibrate_runs_on_simulated_devices():
    link, points = costmodel.calibrate(runtime.data_mesh(N), sizes=(256, 4096), repeats=2)
    assert len(points) == 2 and link.alpha >= 0 and link.beta >= 0


@pytest.mark.parametrize("density", [0.001, 0.3, 0.9])
def test_adaptive_runs_the_chosen_exchange_and_conserves(density):
    link = costmodel.Link(alpha=0.0, beta=1e-9)
    mesh = runtime.data_mesh(N)
    agg = aggregators.adaptive(density, "data", link=link, bucket_bytes=None)
    rng = np.random.default_rng(0)
    g = rng.normal(size=(N, 4000)).astype(np.float32)
    r = (0.1 * rng.normal(size=(N, 4000))).astype(np.float32)

    def body(gp, rp):
        state = agg.init({"w": gp[0]})._replace(residual={"w": rp[0]})
        mean, st = agg.update({"w": gp[0]}, state)
        return mean["w"][None], st.residual["w"][None]

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=(P("data"), P("data")),
            check_vma=False,
        )
    )
    args = [runtime.put_global(x, mesh, P("data")) for x in (g, r)]
    mean, new_r = (np.asarray(x) for x in fn(*args))
    np.testing.assert_allclose(N * mean[0] + new_r.sum(0), (g + r).sum(0), atol=1e-4)
    chosen = exchanges.choose(4000, density, N, link)
    got = [(c.kind, c.bytes_sent) for c in hlo.collectives(fn, *args)]
    assert got == [(c.kind, c.bytes_sent) for c in _compiled(chosen, density, 4000)]


def test_adaptive_accepts_a_state_without_a_count():
    """An ``ErrorFeedbackState`` built by hand (no ``deferred``, as before 0.3) still
    works: nothing is counted."""
    agg = aggregators.adaptive(0.1, "data", bucket_bytes=None)
    mesh = runtime.data_mesh(N)

    def body(g):
        mean, st = agg.update({"w": g[0]}, aggregators.ErrorFeedbackState({"w": g[0] * 0}))
        assert st.deferred == ()
        return mean["w"][None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    x = np.random.default_rng(2).normal(size=(N, 800)).astype(np.float32)
    assert np.isfinite(np.asarray(jax.jit(fn)(runtime.put_global(x, mesh, P("data"))))).all()


def test_fit_line_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 100, 6)
    y = 0.5 + 0.25 * x + rng.normal(0, 0.01, 6)
    slope, fixed = np.polyfit(x, y, 1)
    assert costmodel.fit_line(list(zip(x, y, strict=True))) == pytest.approx((fixed, slope))
    assert costmodel.fit_line([(10.0, 2.0)]) == (0.0, 0.2)  # one point: through the origin


def test_local_work_turns_the_choice_to_the_shorter_step():
    # P=4, density 0.2: topk_a2a sends fewer bytes than topk_allgather (crossover 1/6),
    # but here its local work is 50 ms a bucket against 5 ms.
    size, density, workers = 1 << 20, 0.2, 4
    stand_in = {"topk_allgather": 0.005, "topk_a2a": 0.05, "topk_balanced": 1, "oktopk": 1}
    timer = lambda fn, x: stand_in[calls.pop(0)]  # noqa: E731
    calls = [s for s in exchanges.menu() if s in stand_in for _ in range(2)]
    local = local_cost.measure_local_work([size, size // 2], density, workers, timer)
    assert not calls  # every timed exchange of the menu, at both sizes
    assert local.seconds("topk_a2a", size) == pytest.approx(0.05)
    assert local.seconds("dense", size) == 0.0
    link = costmodel.Link(alpha=50e-6, beta=8 / 1e9)  # 1 Gbit/s
    pair = ("topk_allgather", "topk_a2a")
    assert exchanges.choose(size, density, workers, link, pair) == "topk_a2a"  # fewer bytes
    with_local = costmodel.Link(link.alpha, link.beta, local)
    assert exchanges.choose(size, density, workers, with_local) == "topk_allgather"
    ag, a2a = (exchanges.exchange_time(s, size, density, workers, with_local) for s in pair)
    assert ag < a2a


@pytest.mark.parametrize("strategy", ["topk_allgather", "topk_a2a"])
def test_local_work_fn_is_the_exchange_without_collectives(strategy):
    size, workers, density = 400, 4, 0.05
    x = np.random.default_rng(1).normal(size=size).astype(np.float32)
    total, kept = local_cost.local_work_fn(strategy, size, density, workers)(x)
    k = 20
    if strategy == "topk_allgather":
        top = np.argsort(-np.abs(x), kind="stable")[:k]
        sent = np.zeros_like(x)
        sent[top] = x[top]
        np.testing.assert_allclose(np.asarray(total), workers * sent, rtol=1e-6)
    else:
        shards = x.reshape(workers, -1)
        sent = np.zeros_like(shards)
        for s, shard in enumerate(shards):
            top = np.argsort(-np.abs(shard), kind="stable")[: k // workers]
            sent[s, top] = shard[top]
        np.testing.assert_allclose(np.asarray(total), sent.sum(0), rtol=1e-6)
        sent = sent.reshape(-1)
    np.testing.assert_array_equal(np.asarray(kept), x - sent)
    assert local_cost.local_work_fn("dense", size, density, workers) is None


def test_adaptive_prices_local_work():
    # density 0.3 goes by all-to-all on bytes alone (above); slow local work of every
    # exchange by all-to-all turns it.
    slow = (1.0, 0.0)
    local = costmodel.LocalWork(dict.fromkeys(("topk_a2a", "topk_balanced", "oktopk"), slow))
    agg = aggregators.adaptive(
        0.3, "data", link=costmodel.Link(0.0, 1e-9, local), bucket_bytes=None
    )
    body = lambda g: agg.update({"w": g[0]}, agg.init({"w": g[0]}))[0]["w"][None]  # noqa: E731
    mesh = runtime.data_mesh(N)
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    x = runtime.put_global(np.ones((N, 4000), np.float32), mesh, P("data"))
    kinds = {c.kind for c in hlo.collectives(fn, x)}
    assert "all-to-all" not in kinds and "all-reduce" in kinds  # dense is next cheapest


@pytest.mark.parametrize("size", [13, 1001, 4099])
@pytest.mark.parametrize("name", ["dense", "topk_allgather"])
def test_formulas_match_compiled_bytes_for_any_size(name, size):
    nbytes = exchanges.messages_and_bytes(name, size, 0.1, N)[1]
    assert hlo.total_bytes(_compiled(name, 0.1, size)) == pytest.approx(nbytes, rel=1e-6)


@pytest.mark.parametrize(
    "size, workers, density",
    [
        (13, 4, 0.1),
        (13, 4, 0.3),
        (37, 8, 0.05),
        (37, 4, 0.5),
        (1001, 8, 0.1),
        (1001, 4, 0.01),
        (1001, 8, 0.3),
    ],
)
def test_topk_a2a_formula_matches_compiled_bytes_for_any_size(size, workers, density):
    # k < P, k not a multiple of P, d not a multiple of P: ceil(k/P) slots per shard
    colls = _compiled("topk_a2a", density, size, workers)
    nbytes = exchanges.messages_and_bytes("topk_a2a", size, density, workers)[1]
    assert hlo.total_bytes(colls) == pytest.approx(nbytes, rel=1e-6)
    slots = -(-round(density * size) // workers)
    a2a_shapes = {shape for c in colls if c.kind == "all-to-all" for _, shape in c.shapes}
    assert a2a_shapes == {(1, slots)}  # one [1, ceil(k/P)] chunk per destination


BALANCED_CASES = [  # (size, workers, density): every result form, odd sizes, d < P
    (100_000, 4, 0.001),  # pairs
    (64_000, 8, 0.05),  # bitmap
    (999, 4, 0.6),  # the whole shard
    (5, 8, 0.4),
    (37, 3, 0.1),
]


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["topk_balanced", "oktopk"])
@pytest.mark.parametrize("size, workers, density", BALANCED_CASES)
def test_balanced_formulas_match_compiled_bytes_for_any_size(name, size, workers, density):
    colls = _compiled(name, density, size, workers)
    messages, nbytes = exchanges.messages_and_bytes(name, size, density, workers)
    assert hlo.total_bytes(colls) == nbytes
    link = costmodel.Link(alpha=1e-5, beta=1e-9)
    assert costmodel.program_time(colls, link) == pytest.approx(
        messages * link.alpha + nbytes * link.beta, rel=1e-9
    )


def test_the_balanced_cases_cover_every_result_form():
    forms = set()
    for size, workers, density in BALANCED_CASES:
        k = max(1, round(density * size))
        width = -(-size // workers)
        forms.add(costs.result_form(width, costs.union_slots(k, size, workers)))
        forms.add(costs.result_form(width, min(width, costs.owner_slots(k, workers))))
    assert forms == set(costs.RESULT_FORMS)
