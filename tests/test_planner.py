"""The planner: the layouts it picks on the cost model (tiny tables data parallel, big
ones sharded, memory respected, divisibility respected), the statistics it measures
from sample batches, and ``--plan`` on the command line."""

import json

import jax
import pytest

from experiments import plan_check
from experiments.train import main
from models import get_workload
from sparsecomm_jax import planner
from sparsecomm_jax.comm.costmodel import Link

SLOW = Link.from_bandwidth(1.0)


def stats(name, vocab, dim=16, reads=256, distinct=None, bucket=None):
    distinct = min(vocab, reads) if distinct is None else distinct
    bucket = -(-distinct // 4) if bucket is None else bucket
    return planner.TableStats(name, vocab, dim, reads, distinct, bucket)


def test_tiny_tables_stay_data_parallel_and_big_ones_are_sharded():
    plan = planner.plan_tables([stats("big", 1_000_000), stats("tiny", 8)], 4, SLOW)
    assert plan.layouts()["big"] in planner.SHARDED and plan.layouts()["tiny"] == "dense"
    costs = {
        x: planner.layout_cost(stats("big", 1_000_000), x, 4, SLOW).seconds
        for x in planner.LAYOUT_NAMES
    }
    assert costs["dense"] > 100 * costs[plan.layouts()["big"]]  # a dense 1M-row table


def test_memory_moves_tables_to_a_sharded_layout():
    mid = [stats(f"t{i}", 4096, reads=4096, distinct=4000, bucket=1000) for i in range(3)]
    free = planner.plan_tables(mid, 4, Link.from_bandwidth(100.0))
    assert set(free.layouts().values()) <= {"dense", "replicated"}  # fast: whole tables
    tight = planner.plan_tables(mid, 4, Link.from_bandwidth(100.0), memory_bytes=free.memory / 2)
    assert tight.memory <= free.memory / 2 and tight.seconds >= free.seconds
    assert any(x in planner.SHARDED for x in tight.layouts().values())
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
    assert tight.layouts()["odd"] in planner.SHARDED


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


def test_plan_auto_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--model", "dlrm", "--strategy", "embrace", "--devices", "4", "--steps", "2"]
    args += ["--tables", "4096,16", "--dim", "8", "--batch", "32", "--optimizer", "adagrad"]
    assert main([*args, "--plan", "auto", "--link-gbit", "1", "--out", str(out)]) == 0
    assert "params/sparse_0/embedding" in capsys.readouterr().err  # the plan, printed
    result = json.loads(out.read_text())
    layouts = json.loads(result["config"]["plan"])
    assert layouts == {t["table"]: t["layout"] for t in result["plan"]["tables"]}
    assert layouts["params/sparse_1/embedding"] == "dense"
    assert main([*args, "--plan", json.dumps(layouts), "--out", str(out)]) == 0  # replayed
    assert json.loads(out.read_text())["losses"] == result["losses"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--plan", "auto", "--strategy", "dense"], "--plan places each table by its own"),
        (["--plan", "{nope"], "--plan must be auto or a JSON object"),
        (["--plan", '{"x": "diagonal"}'], "has layouts ['diagonal']"),
    ],
)
def test_bad_plans_are_one_line_errors(flags, message, capsys):
    assert main(["--model", "dlrm", "--devices", "2", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_hand_plans_medians_and_plot_of_the_plan_check(tmp_path):
    small = dict(tables="30,10", dim=4, multi_hot=1, batch=8)
    names = [f"params/sparse_{f}/embedding" for f in range(2)]
    assert plan_check.table_names(small) == list(zip(names, (30, 10), strict=True))
    tables = [("a", 1000), ("b", 10), ("c", 100)]
    plans = plan_check.hand_plans(tables)
    mixed = {f"{big}+{small}" for big in ("column", "row") for small in ("replicated", "dense")}
    assert set(plans) == {*planner.LAYOUT_NAMES, *mixed}
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
