"""The planner: the layouts it picks on the cost model (tiny tables data parallel, big
ones sharded, memory respected, divisibility respected), the statistics it measures
from sample batches, the candidates a measurement decides among, and ``--plan`` on the
command line."""

import json
import time
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from experiments.studies import plan_check
from experiments.train import build, histogram, main, startup
from experiments.train.checkpoints import resumed_config
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import checkpoint, planner
from sparsecomm_jax.comm import costmodel, wire
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import access, layout_registry, row, tablewise
from sparsecomm_jax.embedding.layout import next_power_of_two
from sparsecomm_jax.embedding.tables import find_tables, table_mask

SLOW = Link.from_bandwidth(1.0)
SHARDED = {x.name for x in layout_registry.LAYOUTS.values() if x.sharded}  # column, row, table
# every layout the planner prices from the common statistics for tables of ids in range
# (the hot layout needs a histogram of the ids: its own tests below; the managed one
# serves tables of raw ids alone: test_managed)
PRICED = [x.name for x in planner.priced() if x.pricing.measure is None and not x.maps_ids]


def names(plan) -> dict[str, str]:
    """A planner ``Plan``'s layouts by name."""
    return plan.layouts().names()


def stats(name, vocab, dim=16, reads=256, distinct=None, bucket=None):
    distinct = min(vocab, reads) if distinct is None else distinct
    bucket = -(-distinct // 4) if bucket is None else bucket
    return planner.TableStats(name, vocab, dim, reads, distinct, bucket)


def test_a_table_takes_only_the_layouts_it_may():
    """``may`` (here ``unpadded``, for a step that stores its column tables unpadded):
    no candidate places a table whose D does not divide by P column-wise; a candidate
    that would have gives that table its best other layout, and the other table stays
    column-wise (it is re-planned, not dropped). Without it both go column-wise."""
    two = [stats("a", 100_000, 64, 512, 400, 60), stats("b", 100_000, 62, 512, 400, 60)]
    link, column = Link.from_bandwidth(1.0), layout_registry.get("column")

    def columns(plans) -> list[set[str]]:
        return [{c.table for c in p.choices if c.layout == "column"} for p in plans]

    assert {"a", "b"} in columns(planner.candidate_plans(two, 4, link))
    may = planner.unpadded(4)
    kept = planner.candidate_plans(two, 4, link, may=may)
    assert {"a"} in columns(kept) and all("b" not in c for c in columns(kept))
    assert planner.unpadded(2)(two[1], column)  # 62 divides by 2
    only = planner.plan_tables(two, 4, link, layouts=["column", "dense"], may=may)
    assert {t: x.name for t, x in only.layouts().items()} == {"a": "column", "b": "dense"}
    with pytest.raises(ValueError, match=r"serves table b where it may go"):
        planner.candidate_plans(two, 4, link, layouts=["column"], may=may)


def test_tiny_tables_stay_data_parallel_and_big_ones_are_sharded():
    plan = planner.plan_tables([stats("big", 1_000_000), stats("tiny", 8)], 4, SLOW)
    assert names(plan)["big"] in SHARDED and names(plan)["tiny"] == "dense"
    costs = {x: planner.layout_cost(stats("big", 1_000_000), x, 4, SLOW).seconds for x in PRICED}
    assert costs["dense"] > 100 * costs[names(plan)["big"]]  # a dense 1M-row table


def test_the_plans_table_shows_the_messages_that_make_up_its_total():
    """The per-message latency, most of a small plan's total, has its own line: the
    lines' milliseconds add up to the total."""
    plan = planner.plan_tables([stats("a", 20_000), stats("b", 30_000)], 4, SLOW)
    lines = plan.table().splitlines()
    assert lines[-2].startswith("(messages: latency per exchange)")
    ms = [float(line.split()[-2]) for line in lines[1:-2]] + [float(lines[-2].split()[-1])]
    assert float(lines[-2].split()[-1]) > 0
    assert sum(ms) == pytest.approx(float(lines[-1].split()[-2]), abs=2e-3)


def test_memory_moves_tables_to_a_sharded_layout():
    mid = [stats(f"t{i}", 4096, reads=4096, distinct=4000, bucket=1000) for i in range(3)]
    free = planner.plan_tables(mid, 4, Link.from_bandwidth(100.0))
    assert set(names(free).values()) <= {"dense", "replicated"}  # fast: whole tables
    tight = planner.plan_tables(mid, 4, Link.from_bandwidth(100.0), memory_bytes=free.memory / 2)
    assert tight.memory <= free.memory / 2 and tight.seconds >= free.seconds
    assert any(x in SHARDED for x in names(tight).values())
    with pytest.raises(ValueError, match="no layout of the tables fits"):
        planner.plan_tables(mid, 4, SLOW, memory_bytes=1000)


def test_a_split_dimension_not_divisible_is_priced_padded():
    odd = stats("odd", 1_000_002, dim=6)  # neither V nor D divides by 4
    even = stats("even", 1_000_002, dim=8)  # D as odd's padded to 8
    slots = 1  # parameters and one optimizer slot, 4 bytes each
    row = planner.layout_cost(odd, "row", 4, SLOW, slots)
    assert row.memory == 1_000_004 * 6 * 4 * (1 + slots) / 4  # V padded to 1_000_004
    column = planner.layout_cost(odd, "column", 4, SLOW, slots)
    assert column.memory == 1_000_002 * 8 * 4 * (1 + slots) / 4  # D padded to 8
    assert column.bytes == planner.layout_cost(even, "column", 4, SLOW, slots).bytes
    tight = planner.plan_tables([odd], 4, SLOW, memory_bytes=20e6)  # the whole needs 48 MB
    assert names(tight)["odd"] in SHARDED


def test_statistics_from_sample_batches():
    w = get_workload("dlrm", tables="64,8", dim=8, batch=32, multi_hot=3)
    params = w.init(jax.random.key(0))
    batches = [w.batch_at(s) for s in range(2)]
    found = planner.table_stats(w.loss, params, w.embedding_paths, batches, 4)
    assert [s.name for s in found] == [f"params/sparse_{f}/embedding" for f in range(2)]
    for s, vocab in zip(found, (64, 8), strict=True):
        assert (s.vocab, s.dim, s.reads, s.lookups) == (vocab, 8, 32 // 4 * 3, 1)
        assert 1 <= s.bucket <= s.distinct <= min(vocab, s.reads)
    assert found[1].distinct <= 8  # a tiny table: every row at most


def test_candidates_are_the_best_plan_of_each_set_of_exchanges():
    mix = [stats("big", 1_000_000), stats("mid", 20_000), stats("tiny", 8)]
    found = planner.candidate_plans(mix, 4, SLOW)
    assert found[0] == planner.plan_tables(mix, 4, SLOW)
    assert [p.seconds for p in found] == sorted(p.seconds for p in found)
    plans = [json.dumps(names(p), sort_keys=True) for p in found]
    assert len(set(plans)) == len(plans) >= 3  # none, column, row at least
    exchanges = [set(names(p).values()) & SHARDED for p in found]
    for allowed in (set(), {"column"}, {"row"}):  # each set's best is among them
        alone = [x for x in PRICED if x not in SHARDED or x in allowed]
        best = planner.plan_tables(mix, 4, SLOW, layouts=alone)
        assert names(best) in [names(p) for p in found]
    assert set() in exchanges and {"column"} in exchanges and {"row"} in exchanges
    for x in PRICED:  # one layout everywhere, unless modelled far slower
        alone = planner.plan_tables(mix, 4, SLOW, layouts=[x])
        kept = names(alone) in [names(p) for p in found]
        assert kept == (alone.seconds <= 10 * found[0].seconds), x
    assert "dense" not in [names(p)["big"] for p in found]  # a 1M-row table: pruned


def test_the_measured_step_decides_among_the_candidates():
    mix = [stats("big", 1_000_000), stats("tiny", 8)]
    found = planner.candidate_plans(mix, 4, SLOW)
    slowest_modelled = found[-1]  # a stand-in timing that ranks the model's last first
    timed = []

    def one(plan):
        return 1.0 if plan is slowest_modelled else 2.0 + plan.seconds

    def stand_in(plans):
        timed.extend(plans)
        return [one(p) for p in plans]

    chosen, seconds = planner.choose_measured(found, stand_in)
    assert chosen is slowest_modelled and timed == found
    assert seconds == [one(p) for p in found]
    assert planner.choose_measured(found[:1], lambda p: pytest.fail("timed")) == (found[0], [])
    with pytest.raises(ValueError, match="gave 1 times for"):
        planner.choose_measured(found, lambda plans: [1.0])


def test_candidates_are_timed_in_turns():
    """Every candidate is built first, then timed a few steps at a time in turns (a change
    of load falls on all); the first step of each (its compile) is not counted."""
    calls = []

    class Fake(NamedTuple):
        name: str
        state: int = 0
        lookahead: int = 0

        def place_batch(self, batch):
            return batch

        def step(self, state, batch):
            calls.append((self.name, batch))
            time.sleep(0.3 if state == 0 else 0.0)  # the first step: a compile
            return state + 1, jnp.float32(0.0)

    def fake_build(config):
        calls.append(("build", config.plan))
        return SimpleNamespace(batch_at=lambda s: s), Fake(config.plan)

    configs = [RunConfig(steps=5, plan=n) for n in ("", "auto")]  # stand-ins
    times = startup.interleaved_step_seconds(configs, fake_build, ["a", "b"], rounds=2, steps=3)
    assert len(times) == 2 and all(0 <= t < 0.1 for t in times)  # no 0.3 s first step
    a, b = "", "auto"
    assert calls[:2] == [("build", a), ("build", b)]
    turns = [(a, 0), (a, 1), (a, 2), (b, 0), (b, 1), (b, 2)]
    assert calls[2:] == turns + [(a, 3), (a, 4), (a, 0), (b, 3), (b, 4), (b, 0)]
    calls.clear()  # one turn of two steps: a median of one step, or of two with the first
    once = startup.interleaved_step_seconds(configs[:1], fake_build, ["a"], rounds=1, steps=2)
    assert once[0] < 0.1


DLRM_FLAGS = ["--model", "dlrm", "--strategy", "embrace", "--devices", "4", "--steps", "2"]
DLRM_FLAGS += ["--tables", "4096,16", "--dim", "8", "--batch", "32", "--optimizer", "adagrad"]


@pytest.mark.cli
def test_plan_auto_times_the_candidates_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main([*DLRM_FLAGS, "--plan", "auto", "--link-gbit", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "params/sparse_0/embedding" in err and "candidate (" in err  # printed
    assert "timing: building 1/" in err  # progress while it times
    result = json.loads(out.read_text())
    chosen = result["config"]["plan"]  # a JSON object, not a string of one
    assert chosen == {t["table"]: t["layout"] for t in result["plan"]["tables"]}
    candidates = result["plan"]["candidates"]
    assert len(candidates) >= 2 and all(c["measured_s"] > 0 for c in candidates)
    fastest = min(candidates, key=lambda c: c["measured_s"])
    assert fastest["layouts"] == chosen
    assert main([*DLRM_FLAGS, "--plan", json.dumps(chosen), "--out", str(out)]) == 0  # replayed
    assert json.loads(out.read_text())["losses"] == result["losses"]


TINY_DLRM = dict(model="dlrm", tables="4096,16", dim=8, batch=32, devices=4, link_gbit=1.0)


def test_plan_model_takes_the_modelled_best_without_timing(monkeypatch):
    monkeypatch.setattr(startup, "interleaved_step_seconds", lambda *a: pytest.fail("timed"))
    config = RunConfig(**TINY_DLRM, optimizer="adagrad", plan="model")
    chosen, record = startup.choose_plan(config, build)
    assert "candidates" not in record
    w = get_workload("dlrm", tables="4096,16", dim=8, batch=32)
    after = histogram.HISTOGRAM_BATCHES  # the sample: the 16 batches after those counted
    sample = [w.batch_at(s) for s in range(after, after + 16)]
    params = w.init(jax.random.key(0))
    counts = histogram.planner_counts(config, w, params)  # the first 16 batches' ids
    found = planner.table_stats(w.loss, params, w.embedding_paths, sample, 4, counts=counts)
    assert all(s.of("hot") is not None for s in found)  # the hot rows are priced too
    expected = planner.plan_tables(found, 4, SLOW, optimizer_slots=1)  # adagrad: one slot
    assert chosen.plan == expected.layouts()
    assert names(expected)["params/sparse_1/embedding"] == "dense"  # 16 rows: whole


def test_candidates_are_timed_at_a_concrete_fusion_threshold(monkeypatch):
    """``--bucket-mb auto`` is searched after the plan: the candidates are built with the
    default threshold (a top-k aggregator reads it as a number)."""
    seen = []

    def stand_in(configs, build_fn, names):
        seen.extend(c.bucket_mb for c in configs)
        return [float(k) for k in range(len(configs))]

    monkeypatch.setattr(startup, "interleaved_step_seconds", stand_in)
    config = RunConfig(**TINY_DLRM, strategy="embrace+topk_a2a", bucket_mb="auto", plan="auto")
    chosen, _ = startup.choose_plan(config, build)
    assert seen and all(b == RunConfig().bucket_mb for b in seen)
    assert chosen.bucket_mb == "auto"  # still searched afterwards


@pytest.mark.cli
def test_a_measured_plan_is_taken_from_the_checkpoint_on_resume(monkeypatch, tmp_path):
    """``--resume`` with ``--plan auto`` keeps the plan the first run chose: timing anew
    could choose another."""
    flags = [*DLRM_FLAGS, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]
    out = tmp_path / "r.json"

    def stand_in(configs, build_fn, names):  # a plan with a row-wise table is fastest
        return [2.0 - ("row" in c.plan.names().values()) for c in configs]

    monkeypatch.setattr(startup, "interleaved_step_seconds", stand_in)
    assert main([*flags, "--plan", "auto", "--link-gbit", "1", "--out", str(out)]) == 0
    chosen = json.loads(out.read_text())["config"]["plan"]
    assert "row" in chosen.values()
    monkeypatch.setattr(startup, "interleaved_step_seconds", lambda *a: pytest.fail("timed"))
    more = [*flags[: flags.index("--steps") + 1], "3", *flags[flags.index("--steps") + 2 :]]
    assert main([*more, "--plan", "auto", "--resume", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["start_step"] == 2 and result["config"]["plan"] == chosen


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--plan", "auto", "--strategy", "dense"], "--plan places each table by its own"),
        (["--plan", "{nope"], "argument --plan: must be auto, model or a JSON object"),
        (["--plan", '{"x": "diagonal"}'], "has layouts ['diagonal']"),
        (["--plan", '{"x": "row", "x": "table"}'], "names ['x'] more than once"),
    ],
)
def test_bad_plans_are_one_line_errors(flags, message, capsys):
    assert main(["--model", "dlrm", "--devices", "2", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.cli
def test_the_hand_plans_medians_and_plot_of_the_plan_check(tmp_path):
    small = dict(tables="30,10", dim=4, multi_hot=1, batch=8)
    names = [f"params/sparse_{f}/embedding" for f in range(2)]
    assert plan_check.table_names(small) == list(zip(names, (30, 10), strict=True))
    tables = [("a", 1000), ("b", 10), ("c", 100)]
    plans = plan_check.hand_plans(tables)
    sharded = ("column", "row", "table")
    mixed = {f"{big}+{small}" for big in sharded for small in ("replicated", "dense")}
    assert set(plans) == {*PRICED, *mixed}
    assert plans["row+dense"] == {"a": "row", "c": "row", "b": "dense"}  # the larger half
    assert all(set(p) == {"a", "b", "c"} for p in plans.values())
    rows = [{"plan": "x", "throughput": t} for t in (3.0, 1.0, 2.0)] + [
        {"plan": "y", "throughput": 5.0}
    ]
    got = {r["plan"]: (r["throughput"], r["rounds"]) for r in plan_check.median_rows(rows)}
    assert got == {"x": (2.0, [1.0, 2.0, 3.0]), "y": (5.0, [5.0])}
    medians = [{**r, "unit": "samples_per_s"} for r in plan_check.median_rows(rows)]
    plan_check.plot(medians, "x", tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.cli
def test_the_plan_check_runs_a_named_subset_and_refuses_unknown_names(capsys):
    with pytest.raises(SystemExit) as stop:
        plan_check.main(["--mix", "dlrm", "--plans", "planner,diagonal"])
    assert stop.value.code == 2 and "--plans ['diagonal'] unknown" in capsys.readouterr().err


@pytest.mark.parametrize("first", ["", '{"params/sparse_0/embedding": "row"}'])
def test_resume_with_plan_auto_keeps_the_layout_the_checkpoints_hold(tmp_path, first):
    """Whatever the first run's ``--plan`` resolved to (a chosen or given plan, or ""
    for the strategy's layout), ``--resume --plan auto`` takes it: a plan timed anew
    could store the tables another way. Folders of versions before 0.3 recorded a plan
    as the JSON text of one: read the same."""
    recorded = json.loads(first) if first else first  # a JSON object since 0.3
    for plan in {recorded if isinstance(recorded, str) else json.dumps(recorded), first}:
        record = {"run_id": "r", "config": {"plan": plan}, "trajectory": {}}
        (tmp_path / checkpoint.RUN_FILE).write_text(json.dumps(record))
        config = RunConfig(resume=True, checkpoint_dir=str(tmp_path), plan="auto")
        assert resumed_config(config).plan == RunConfig(plan=first).plan
    fresh = RunConfig(checkpoint_dir=str(tmp_path), plan="auto")  # not resuming: plans
    assert resumed_config(fresh).plan == "auto"


def test_table_wise_tables_are_priced_by_their_packs():
    """Eight equal tables over four owners, one exchange: each owner's bucket holds two
    tables' ids (2 x 200, padded to 512 as table-wise buckets are, a power of two), where
    row-wise asks each owner for 50 of each table's ids (with its margin); one table
    alone sends its 200 ids to its owner (256); the memory is an owner's rows."""
    eight = [stats(f"t{i}", 1000, reads=256, distinct=200, bucket=50) for i in range(8)]
    one_way = 4 + 2 * 16 * 4  # an id and a row each way, float32
    packed = tablewise.price_together(eight, 4, SLOW, 1)
    assert sum(c.bytes for c in packed) == pytest.approx((4 - 1) * 512 * one_way)  # one exchange
    rows = [planner.layout_cost(s, "row", 4, SLOW) for s in eight]
    assert rows[0].bytes == (4 - 1) * row.CAPACITY.grow(50) * one_way
    assert sum(c.memory for c in packed) == 2 * 1000 * 16 * 4 * 2  # R = two tables' rows
    (alone,) = tablewise.price_together(eight[:1], 4, SLOW, 1)
    assert alone.bytes == pytest.approx((4 - 1) * 256 * one_way)
    plan = planner.plan_tables(eight, 4, SLOW, layouts=["table"])
    assert plan.seconds == pytest.approx(
        sum(c.seconds for c in packed) + planner.group_seconds({"table"}, 4, SLOW)
    )


def test_the_modelled_buckets_of_a_pack_hold_what_its_batches_need():
    """The model's C of a pack (each owner's tables' most distinct ids, summed, padded
    to a power of two as the buckets are) is at least the capacity the layout's plan
    grows to for the same sample batches."""
    w = get_workload("dlrm", tables="500,300,200,100,50", dim=8, batch=64, multi_hot=2)
    params = w.init(jax.random.key(0))
    batches = [w.batch_at(s) for s in range(3)]
    found = planner.table_stats(w.loss, params, w.embedding_paths, batches, 4)
    packed = tablewise.price_together(found, 4, SLOW, 1)
    modelled_c = sum(c.bytes for c in packed) / (3 * (4 + 2 * 8 * 4))
    mask = table_mask(params, w.embedding_paths)
    tables = tablewise.bind(find_tables(params, mask, tablewise.TABLE), 4)
    reads_of = access.host_reads(w.loss, params, mask, (), 4)
    plan_ids = tables[0].layout.capacity.need
    needs = [n for b in batches for n in plan_ids([reads_of(b)], tables, 4).values()]  # one pack
    grown = next_power_of_two(max(needs))
    assert grown <= modelled_c <= next_power_of_two(int(1.5 * max(needs))), (needs, modelled_c)


def test_a_table_read_by_a_full_softmax_is_never_table_wise():
    """An LM's output table (a full softmax) gets no table-wise candidate, not even the
    one-layout-everywhere plan; its statistics say it is attended."""
    w = get_workload("lstm_lm", vocab=64, dim=8, hidden=8, seq_len=4, batch=8, sampled_softmax=0)
    params = w.init(jax.random.key(0))
    found = planner.table_stats(w.loss, params, w.embedding_paths, [w.batch_at(0)], 4)
    assert any(s.attended for s in found)
    plans = planner.candidate_plans(found, 4, SLOW, layouts=PRICED, within=1e9)
    for plan in plans:
        for s in found:
            assert not (s.attended and names(plan)[s.name] == "table"), names(plan)
    mid = [stats(f"t{i}", 4096, reads=4096, distinct=4000, bucket=1000) for i in range(3)]
    mid = [mid[0]._replace(attended=True), *mid[1:]]
    with pytest.raises(ValueError, match="no layout of the tables fits"):  # t0 fits no layout
        planner.plan_tables(mid, 4, SLOW, memory_bytes=4.5e5, layouts=["dense", "table"])
    tight = planner.plan_tables(mid, 4, SLOW, memory_bytes=4.5e5, layouts=["dense", "table", "row"])
    assert names(tight)["t0"] == "row" and tight.memory <= 4.5e5


def test_the_planner_prices_the_chosen_wire():
    """Each layout's bytes with FP8 rows (a float32 scale a row) and a bfloat16 dense
    mean, from the float32 formula's terms: ids 4 bytes, rows out and back in their
    codecs; each exchange's slots padded as its buffers are (row: 90 -> 119, column:
    300 -> 352, 3 sqrt(need) more: ``layout.grow_with_margin``)."""
    s = planner.TableStats("t", 10_000, 64, 512, 300, 90)
    link, p = Link(0.0, 1.0), 4
    spec = wire.parse("forward=float8_e4m3fn,backward=float8_e5m2,dense=bfloat16")

    def nbytes(layout, chosen=spec):
        return planner.layout_cost(s, layout, p, link, 0, wire=chosen).bytes

    assert nbytes("row") == (p - 1) * 119 * (4 + 2 * (64 + 4))
    assert nbytes("column") == (p - 1) * 352 * (4 + 2 * (64 // p + 4))
    assert nbytes("replicated") == (p - 1) * 512 * (64 + 4 + 4)
    assert nbytes("dense") == nbytes("dense", wire.DEFAULT) / 2
    small = planner.TableStats("s", 300, 1, 64, 30, 9)  # 300 entries: slices under a block
    fp8 = wire.parse("float8_e4m3fn")
    priced = planner.layout_cost(small, "dense", p, link, 0, wire=fp8).bytes
    assert priced == costmodel.flat_mean_cost(300, p, wire.E4M3)[1] > 300 * 2 * (p - 1) / p
    assert nbytes("row", wire.DEFAULT) == (p - 1) * 119 * (4 + 2 * 64 * 4)
    plan = planner.plan_tables([s], p, Link.from_bandwidth(0.1), wire=spec)
    assert plan.choices[0].bytes == nbytes(plan.choices[0].layout)
