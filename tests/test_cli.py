"""experiments.train: the result record, and one-line errors on bad input."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from helpers import record_loop_events, run_main, stderr_lines

import sparsecomm_jax as sc
from experiments.train import command, loop, main, run, train_and_evaluate
from experiments.train.config import RunConfig
from experiments.train.startup import adaptive_link
from experiments.train.validate import validate
from models import MODELS
from sparsecomm_jax.step import capacities
from sparsecomm_jax.strategies.rules import NONFINITE
from sparsecomm_jax.topk.selectors import SELECTORS

SMALL = dict(vocab=300, dim=16, hidden=16, seq_len=8, batch=16, steps=3, warmup=1)


@pytest.mark.cli
def test_result_record_fields():
    result = train_and_evaluate(RunConfig(strategy="dense", **SMALL), progress=False)
    for key in (
        "model",
        "strategy",
        "devices",
        "steps",
        "losses",
        "step_time_s",
        "tokens_per_s",
        "comm_bytes_per_step",
        "collectives",
        "config",
    ):
        assert key in result
    assert len(result["losses"]) == 3 and np.all(np.isfinite(result["losses"]))
    assert len(result["step_times_s"]) == 3 and min(result["step_times_s"]) > 0
    # throughput per wall time: from one step's loss to the next, the program within it
    assert result["wall_time_s"] >= result["step_time_s"] > 0
    assert result["tokens_per_s"] == pytest.approx(16 * 8 / result["wall_time_s"])
    assert len(result["place_times_s"]) == 3 and result["place_time_s"] >= 0
    assert result["comm_bytes_per_step"] > 0 and result["collectives"][0]["kind"] == "all-reduce"
    assert result["config"]["model_config"]["vocab"] == 300
    json.dumps(result)  # JSON-ready


@pytest.mark.cli
def test_pmap_and_shard_map_agree_through_cli():
    a = train_and_evaluate(RunConfig(strategy="dense", **SMALL), progress=False)
    b = train_and_evaluate(RunConfig(strategy="dense_pmap", **SMALL), progress=False)
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-6)
    assert a["comm_bytes_per_step"] == pytest.approx(b["comm_bytes_per_step"], rel=1e-6)


@pytest.mark.cli
def test_overlapped_step_from_the_command_line():
    """``--overlap``: embrace_2d across steps (two programs), the same losses as the
    pipelined step, the bytes of its ``high`` and ``low`` programs together."""
    small = dict(SMALL, sampled_softmax=8, optimizer="sgd", lr=0.5)
    piped = RunConfig(strategy="embrace_2d", collectives_overlap="yes", **small)
    one = train_and_evaluate(piped, progress=False)
    two = train_and_evaluate(RunConfig(strategy="embrace_2d", overlap=True, **small), False)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["overlap"] and two["comm_bytes_per_step"] > 0
    assert len(two["step_times_s"]) == small["steps"] - 1


@pytest.mark.cli
def test_embrace_2d_on_cpu_runs_as_embrace_unless_told(tmp_path, capsys):
    """On this CPU mesh ``embrace_2d`` runs as ``embrace`` (the record says so, and so
    do the command's line and the comparison's table); ``--collectives-overlap yes``
    builds its pipelined program: the same losses, more collectives."""
    from experiments import compare

    small = dict(SMALL, sampled_softmax=8, optimizer="sgd", lr=0.5)
    flags = ["--vocab", "300", "--dim", "16", "--hidden", "16", "--seq-len", "8"]
    flags += ["--batch", "16", "--warmup", "1", "--sampled-softmax", "8"]
    out = tmp_path / "auto.json"
    run_flags = ["--steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--out", str(out)]
    assert main([*flags, *run_flags, "--strategy", "embrace_2d"]) == 0
    assert "embrace_2d (ran as embrace): final loss" in capsys.readouterr().out
    auto = json.loads(out.read_text())
    ref = train_and_evaluate(RunConfig(strategy="embrace", **small), progress=False)
    yes = RunConfig(strategy="embrace_2d", collectives_overlap="yes", **small)
    piped = train_and_evaluate(yes, progress=False)
    assert (auto["runs_as"], ref["runs_as"], piped["runs_as"]) == (
        "embrace",
        "embrace",
        "embrace_2d",
    )
    assert auto["losses"] == ref["losses"] and auto["collectives"] == ref["collectives"]
    np.testing.assert_allclose(piped["losses"], ref["losses"], rtol=1e-5)
    assert len(piped["collectives"]) > len(ref["collectives"])
    capsys.readouterr()
    both = ["--steps", "2", "--strategies", "embrace,embrace_2d", "--out-dir", str(tmp_path)]
    assert compare.main([*flags, *both]) == 0
    said = capsys.readouterr().out
    assert "embrace_2d ran as embrace" in said and said.count("ran as") == 1


@pytest.mark.cli
def test_compare_gives_each_strategy_its_own_folders(tmp_path, capsys):
    """--checkpoint-dir and --log-dir hold one subfolder per strategy (one folder for
    all would refuse the second run as another run's); --out is not --out-dir."""
    from experiments import compare

    flags = ["--vocab", "300", "--dim", "16", "--hidden", "16", "--seq-len", "8"]
    flags += ["--batch", "16", "--steps", "2", "--warmup", "1", "--sampled-softmax", "8"]
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    flags += ["--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--log-dir", str(logs)]
    out = ["--out-dir", str(tmp_path / "out")]
    assert compare.main([*flags, "--strategies", "dense,embrace", *out]) == 0
    said = capsys.readouterr().out
    assert "recommended here: " in said and "on a 1Gbit/s link (modelled): " in said
    for strategy in ("dense", "embrace"):
        assert (logs / strategy / "steps.jsonl").is_file()
        assert (ck / strategy / "2").is_dir()  # the last step's checkpoint
    with pytest.raises(SystemExit):
        compare.main([*flags, "--out", str(tmp_path / "x.json")])
    assert "unrecognized arguments: --out" in capsys.readouterr().err


@pytest.mark.cli
def test_compare_runs_a_pmap_step_one_step_a_call():
    """--steps-per-call applies to the strategies that can run several steps a call
    (a pipelined embrace_2d too, its steps unrolled); the pmap baseline runs one (it
    would refuse the flag on its own)."""
    from experiments import compare

    config = RunConfig(steps_per_call=4, **SMALL)
    assert compare.run_of(config, "dense_pmap").steps_per_call == 1
    assert compare.run_of(config, "embrace").steps_per_call == 4
    assert compare.run_of(config, "embrace_2d").steps_per_call == 4  # runs as embrace here
    pipelined = dataclasses.replace(config, collectives_overlap="yes")
    assert compare.run_of(pipelined, "embrace_2d").steps_per_call == 4
    for strategy in ("dense_pmap", "embrace_2d"):  # what compare runs passes the checks
        validate(compare.run_of(pipelined, strategy))


@pytest.mark.cli
def test_calibrated_link_for_adaptive_and_in_the_result():
    config = RunConfig(strategy="adaptive", density=0.1, link_gbit=0, calibrate=True, **SMALL)
    link = adaptive_link(config)  # fitted on the 8 simulated devices
    assert link.beta > 0 and link.alpha >= 0
    result = train_and_evaluate(config, progress=False)
    assert result["link"]["beta"] > 0 and len(result["link"]["points"]) == 3
    assert np.all(np.isfinite(result["losses"]))


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match="only 8"):
        train_and_evaluate(RunConfig(devices=16, **{**SMALL, "batch": 16}), progress=False)


BAD_INPUT = [
    (["--model", "nope"], "argument --model: invalid choice: 'nope'"),
    (["--strategy", "nope"], "argument --strategy: invalid choice: 'nope'"),
    (["--optimizer", "rmsprop"], "argument --optimizer: invalid choice"),
    (["--comm-dtype", "float16"], "--comm-dtype 'float16' is unknown; choose one of"),
    (["--selector", "fast"], "argument --selector: invalid choice"),
    (["--nonfinite", "ignore"], "argument --nonfinite: invalid choice"),
    (["--lr", "abc"], "argument --lr: invalid float value"),
    (["--devices", "4", "--batch", "6"], "not divisible"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "-3"], "--steps must be >= 1"),
    (["--link-gbit", "-1"], "--link-gbit must be >= 0"),
    (["--link-gbit", "nan"], "--link-gbit must be >= 0 (finite), got nan"),
    (["--link-alpha-us", "-5"], "--link-alpha-us must be >= 0"),
    (["--lr", "nan"], "--lr must be > 0 (finite), got nan"),
    (["--lr", "inf"], "--lr must be > 0 (finite), got inf"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--lr", "-0.1"], "--lr must be > 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
    (["--model", "resnet", "--image-size", "0"], "--image-size must be >= 1"),
    (["--dim", "0"], "--dim must be >= 1"),
    (["--hidden", "0"], "--hidden must be >= 1"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--model", "vgg", "--width", "0"], "--width must be >= 1"),
    (["--vocab", "1"], "--vocab must be >= 2"),
    (["--model", "transformer", "--heads", "3"], "--heads 3 does not divide --dim 32"),
    (["--model", "bert", "--masked", "20"], "--masked 20 is more than --seq-len 16"),
    (["--model", "resnet", "--noise", "nan"], "--noise must be >= 0 (finite), got nan"),
    (["--zipf-exponent", "nan"], "--zipf-exponent must be > 0 (finite), got nan"),
    (["--zipf-exponent", "inf"], "--zipf-exponent must be > 0 (finite), got inf"),
    (["--bucket-mb", "inf"], "--bucket-mb must be > 0 (finite), got inf"),
    (["--bucket-mb", "nan"], "--bucket-mb must be > 0 (finite), got nan"),
    (["--density", "2"], "--density must be in (0, 1]"),
    (["--strategy", "oktopk", "--capacity-factor", "0.5"], "--capacity-factor must be 0 or >= 1"),
    (["--strategy", "topk_balanced", "--capacity-factor", "nan"], "--capacity-factor must be 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32 - 1], got -1"),
    (["--seed", str(2**32)], "--seed must be in [0, 2**32 - 1]"),
    (["--sampled-softmax", "-3"], "--sampled-softmax must be >= 0, got -3"),
    (["--max-skipped", "-1"], "--max-skipped must be >= 0"),
    (["--text-file", "/nonexistent/corpus.txt"], "--text-file /nonexistent/corpus.txt does not"),
    (["--text-file", "/"], "--text-file / is a directory"),
    (["--model", "resnet", "--text-file", __file__], "--model resnet would ignore it"),
    (["--devices", "1000", "--batch", "1000"], "--devices 1000: one process runs at most 256"),
    (["--devices", "1", "--batch", str(10**9)], "--batch 1000000000: one global batch alone"),
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
    (["--resume-step", "2"], "--resume-step needs --resume"),
    (["--overlap"], "--overlap runs embrace_2d across steps: give --strategy embrace_2d"),
    (
        ["--strategy", "embrace_2d", "--overlap", "--checkpoint-dir", "/tmp/x"],
        "--overlap keeps no --checkpoint-dir",
    ),
    (["--steps-per-call", "0"], "--steps-per-call must be >= 1, got 0"),
    (
        ["--strategy", "dense_pmap", "--steps-per-call", "2"],
        "--strategy dense_pmap runs one step a call",
    ),
    (
        ["--strategy", "embrace_2d", "--overlap", "--steps-per-call", "2"],
        "--overlap runs one step a call",
    ),
    (
        ["--strategy", "embrace_2d", "--overlap", "--plan", "model"],
        "--overlap carries column-wise tables only: leave out --plan",
    ),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_error(args, message, capsys, monkeypatch):
    """Every bad flag stops before JAX builds anything, with one line naming it."""
    monkeypatch.setattr(run, "build", lambda config: pytest.fail("built despite bad input"))
    code, lines = run_main(args, capsys)
    assert code == 2
    assert len(lines) == 1 and message in lines[0], lines


BAD_MODEL_INPUT = [
    (
        ["--model", "resnet", "--strategy", "embrace"],
        "--model resnet has no embedding tables for --strategy embrace to shard",
    ),
    (["--model", "dlrm", "--tables", "5,0"], "--tables needs one or more tables, each of >= 2"),
    (["--text-file", "EMPTY", "--seq-len", "16"], "has 0 tokens; an example takes 17"),
]


@pytest.mark.parametrize(
    "args, message", BAD_MODEL_INPUT, ids=[" ".join(a) for a, _ in BAD_MODEL_INPUT]
)
def test_bad_model_input_is_one_line_error(args, message, capsys, tmp_path):
    """What only the model knows (its tables, its data) is found when it is built,
    before any program: one line naming the flags."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, lines = run_main([str(empty) if a == "EMPTY" else a for a in args], capsys)
    assert code == 2
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.processes
def test_bad_input_as_a_process_is_one_line_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--lr", "nan"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = stderr_lines(proc.stderr)
    assert len(lines) == 1 and "--lr must be > 0" in lines[0]


def test_every_flag_has_help_and_fixed_sets_have_choices():
    parser = command.make_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    choices = {a.dest: a.choices for a in parser._actions if a.choices is not None}
    assert list(choices["strategy"]) == sc.strategy_names()
    assert sorted(choices["model"]) == sorted(MODELS)
    assert set(choices["selector"]) == set(SELECTORS)
    assert set(choices["nonfinite"]) == set(NONFINITE)
    assert set(choices["optimizer"]) == {"sgd", "momentum", "adam", "adagrad", "lazy_adam"}
    assert set(choices["table_update"]) == {"auto", "rows", "dense"}
    assert "comm_dtype" not in choices  # a codec, or one per exchange (comm.wire.parse)
    text = parser.format_help()
    assert "--max-skipped" in text and "--resume-step" in text and "--overwrite" in text


@pytest.mark.processes
def test_writes_json(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--devices",
            "2",
            "--steps",
            "2",
            "--batch",
            "4",
            "--vocab",
            "100",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and len(result["losses"]) == 2


@pytest.mark.cli
def test_rowwise_run_survives_capacity_growth(monkeypatch):
    """Bucket capacity grows mid-run (a new program); the runner recompiles, not fails,
    and reads the step in flight before compiling (no step's time holds a compile).
    Slots sized to each batch's exact need, no margin, so a later batch outgrows them."""
    events = record_loop_events(monkeypatch, loop)
    real_grow = capacities.grow_capacities

    def exact(current, needs, fixed, policy):
        return real_grow(current, needs, fixed, policy._replace(grow=lambda need: need))

    monkeypatch.setattr(capacities, "grow_capacities", exact)
    real_compiled = loop._compiled

    def compiled(ts, log, state, batch, key):
        events.append("compile" if key not in log.programs else "cached")
        return real_compiled(ts, log, state, batch, key)

    monkeypatch.setattr(loop, "_compiled", compiled)
    config = RunConfig(
        model="transformer",
        strategy="embrace_rowwise",
        devices=4,
        batch=8,
        steps=3,
        vocab=2000,
        dim=16,
        warmup=0,
    )
    result = train_and_evaluate(config, progress=False)
    assert result["programs"] >= 2 and len(result["losses"]) == 3
    compiles = [k for k, e in enumerate(events) if e == "compile"]
    assert len(compiles) == result["programs"]
    for k in compiles:  # nothing in flight when a program is compiled
        assert events[:k].count("run") == events[:k].count("read")
    dense = train_and_evaluate(
        RunConfig(**{**config.__dict__, "strategy": "dense"}), progress=False
    )
    np.testing.assert_allclose(result["losses"], dense["losses"], rtol=1e-5)


@pytest.mark.cli
def test_compare_models_each_step_on_a_stated_link():
    """The modelled columns: the measured step plus the compiled collectives through the
    cost model at 1 and 10 Gbit/s (6 messages of a 4-worker all-reduce), labelled."""
    from experiments import compare

    ring = {"kind": "all-reduce", "name": "ar", "group_size": 4, "result_bytes": 4e6}
    dense = {"strategy": "dense_pmap", "losses": [1.0], "step_time_s": 0.01}
    dense |= {"comm_bytes_per_step": 6e6, "peak_memory_bytes": None}
    dense["collectives"] = [{**ring, "bytes_sent": 6e6}]
    sparse = {**dense, "strategy": "oktopk", "comm_bytes_per_step": 6e4}
    sparse["collectives"] = [{**ring, "bytes_sent": 6e4}]
    rows = compare.summarize([dense, sparse])
    for label, link in compare.MODEL_LINKS.items():
        base, fewer = (0.01 + 6 * link.alpha + b * link.beta for b in (6e6, 6e4))
        assert rows[0][f"modelled_step_ms_{label}"] == pytest.approx(base * 1e3)
        assert rows[1][f"modelled_speedup_{label}"] == pytest.approx(base / fewer)
    assert rows[1]["modelled_speedup_1G"] > rows[1]["modelled_speedup_10G"] > 1
    assert "MODELLED" in compare.format_table(rows)
