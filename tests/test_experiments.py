"""The sweep experiments: their helpers on small inputs, and two end-to-end runs on
simulated devices (no network, no root) that check files, plots and exactness."""

import contextlib
import csv
import io
import json
import sys
from pathlib import Path

import jax
import pytest
from conftest import REPO

from experiments import train as train_cli
from experiments.studies import bandwidth, convergence, density, harness, paper_scale, scaling
from experiments.studies import wire as wire_study


def test_rates_and_arguments():
    assert harness.gbit("100mbit") == pytest.approx(0.1)
    assert harness.gbit("25gbit") == 25.0
    with pytest.raises(ValueError, match="bandwidth"):
        harness.gbit("fast")
    assert harness.split_argv(["--nproc", "2", "--", "--steps", "3"]) == (
        ["--nproc", "2"],
        ["--steps", "3"],
    )
    assert harness.split_argv(["--nproc", "2"]) == (["--nproc", "2"], [])
    cmd = harness.command(["--steps", "3"], "r.json", 4, "1gbit")
    assert cmd[cmd.index("--nproc") + 1] == "4" and "--per-worker" in cmd
    assert cmd[cmd.index("--devices") + 1] == "4"
    assert "experiments.train" in harness.command([], "r.json", 2, "")


def test_speedups_within_groups_and_failed_rows():
    rows = [
        {"strategy": "dense_pmap", "bandwidth": "1gbit", "step_s": 2.0},
        {"strategy": "embrace", "bandwidth": "1gbit", "step_s": 0.5},
        {"strategy": "dense_pmap", "bandwidth": "10gbit", "step_s": 1.0},
        {"strategy": "embrace", "bandwidth": "10gbit", "step_s": 0.8},
        {"strategy": "embrace", "bandwidth": "25gbit", "step_s": 0.7},
        {"job": ["25gbit", "dense_pmap"], "error": "boom"},
    ]
    harness.add_speedups(rows, ("bandwidth",))
    assert [r.get("speedup") for r in rows] == [1.0, 4.0, 1.0, 1.25, None, None]


def test_grid_keeps_going_after_a_failure(capsys):
    def measure(x):
        if x == 2:
            raise RuntimeError("config 2 broke")
        return {"x": x}

    rows = harness.grid([(1,), (2,), (3,)], measure, "t")
    assert rows[0] == {"x": 1} and rows[2] == {"x": 3}
    assert rows[1]["job"] == [2] and "config 2 broke" in rows[1]["error"]
    assert "config 2 broke" in capsys.readouterr().err


def test_moving_average_and_time_to_target():
    assert convergence.moving_average([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    result = {"strategy": "s", "losses": [3.0, 2.0, 1.0], "step_times_s": [0.5, 0.5, 1.0]}
    rows = convergence.curve(result, window=1)
    assert [r["wall_s"] for r in rows] == [0.5, 1.0, 2.0]
    assert convergence.time_to_target(rows, 2.0) == 1.0
    assert convergence.time_to_target(rows, 0.5) is None
    curves = {"dense_pmap": rows, "s": convergence.curve({**result, "strategy": "s"}, 1)}
    summary = convergence.summarize(curves, "dense_pmap")  # target: dense's final loss 1.0
    assert [r["time_to_target_s"] for r in summary] == [2.0, 2.0]
    assert convergence.summarize(curves, "dense_pmap", target=2.5)[1]["time_to_target_s"] == 1.0
    assert convergence.reach_text(1.0, 2.5) == "reaches 2.5 at 1.00 s"
    assert convergence.reach_text(None, 0.5) == "never reaches 0.5"
    # without dense_pmap and without --target-loss there is nothing to reach
    assert convergence.summarize({"s": rows}, "dense_pmap")[0]["time_to_target_s"] is None
    assert convergence.reach_text(None, None).startswith("no target: give --target-loss")


@pytest.mark.cli
def test_convergence_without_a_baseline_or_target_says_so(tmp_path, monkeypatch, capsys):
    def fake_run(train_args, out, nproc=1, bandwidth=""):
        strategy = train_args[train_args.index("--strategy") + 1]
        return {"strategy": strategy, "losses": [3.0, 2.0], "step_times_s": [0.1, 0.1]}

    monkeypatch.setattr(harness, "run_config", fake_run)
    argv = ["--local", "--strategies", "embrace", "--out-dir", str(tmp_path)]
    assert convergence.main(argv) == 0
    printed = capsys.readouterr().out
    assert "no target: give --target-loss" in printed and "never" not in printed
    assert convergence.main([*argv, "--target-loss", "2.5"]) == 0
    assert "reaches 2.5 at 0.20 s" in capsys.readouterr().out


def test_measured_crossover():
    rows = [
        {"strategy": "topk_allgather", "density": 0.05, "step_s": 1.0, "comm_s": 0.2},
        {"strategy": "topk_a2a", "density": 0.05, "step_s": 1.5, "comm_s": 0.5},
        {"strategy": "topk_allgather", "density": 0.2, "step_s": 1.5, "comm_s": 0.6},
        {"strategy": "topk_a2a", "density": 0.2, "step_s": 1.55, "comm_s": 0.55},
        {"strategy": "topk_allgather", "density": 0.3, "step_s": 2.0, "comm_s": 1.0},
        {"strategy": "topk_a2a", "density": 0.3, "step_s": 1.6, "comm_s": 0.6},
        {"job": ["topk_a2a", 0.5], "error": "failed"},
    ]
    assert density.measured_crossover(rows) == 0.3
    assert density.measured_crossover(rows, "comm_s") == 0.2
    assert density.measured_crossover(rows[:2]) is None


def _run_in_repo(monkeypatch, main, argv):
    monkeypatch.chdir(REPO)
    return main(argv)


TINY = ["--", "--steps", "4", "--warmup", "1", "--vocab", "500", "--dim", "16", "--hidden", "16"]


def _run_config_in_process(train_args, out, nproc=1, bandwidth=""):
    """``harness.run_config`` without a process per run: the same command line, given to
    ``experiments.train.main`` here (``test_convergence_runs_and_saves`` runs processes)."""
    assert len(jax.devices()) >= nproc  # the suite's devices, started before main runs
    cmd = harness.command(train_args, out, nproc, bandwidth)
    assert cmd[1:3] == ["-m", "experiments.train"]
    assert train_cli.main(cmd[3:]) == 0
    return json.loads(Path(out).read_text())


@pytest.mark.cli
def test_scaling_runs_and_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "run_config", _run_config_in_process)
    argv = [
        "--local",
        "--nproc",
        "1,2",
        "--strategies",
        "dense_pmap,embrace",
        "--batch-per-worker",
        "4",
        "--out-dir",
        str(tmp_path),
        *TINY,
    ]
    assert _run_in_repo(monkeypatch, scaling.main, argv) == 0
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert sorted((r["workers"], r["strategy"]) for r in rows) == [
        (1, "dense_pmap"),
        (1, "embrace"),
        (2, "dense_pmap"),
        (2, "embrace"),
    ]
    by = {(r["workers"], r["strategy"]): r for r in rows}
    for n in (1, 2):  # embrace is exact: the same loss as dense on the same global batch
        assert by[n, "embrace"]["final_loss"] == pytest.approx(by[n, "dense_pmap"]["final_loss"])
        assert by[n, "dense_pmap"]["speedup"] == 1.0
    assert by[2, "embrace"]["bytes"] < by[2, "dense_pmap"]["bytes"]
    assert (tmp_path / "scaling.png").stat().st_size > 0
    with open(tmp_path / "scaling.csv") as f:
        assert len(list(csv.DictReader(f))) == 4


@pytest.mark.cli
def test_convergence_runs_and_saves(tmp_path, monkeypatch):
    argv = [
        "--local",
        "--nproc",
        "2",
        "--strategies",
        "dense_pmap,sparse_allgather",
        "--window",
        "2",
        "--out-dir",
        str(tmp_path),
        *TINY,
    ]
    assert _run_in_repo(monkeypatch, convergence.main, argv) == 0
    saved = json.loads((tmp_path / "convergence.json").read_text())
    curves = {}
    for r in saved["rows"]:
        curves.setdefault(r["strategy"], []).append(r["loss"])
    assert curves["sparse_allgather"] == pytest.approx(curves["dense_pmap"], rel=1e-5)
    summary = {s["strategy"]: s for s in saved["summary"]}
    # the baseline reaches its own final moving average at its last step at the latest
    assert summary["dense_pmap"]["time_to_target_s"] <= summary["dense_pmap"]["wall_s"]
    assert summary["sparse_allgather"]["time_to_target_s"] is not None
    assert (tmp_path / "convergence.png").stat().st_size > 0


@pytest.mark.cli
def test_bandwidth_sweep_labels_speedups_and_predictions(tmp_path, monkeypatch):
    """The sweep's wiring, with each run replaced by a result whose step time is
    10 ms of compute plus bytes / rate (no processes started)."""

    def fake_run(train_args, out, nproc, rate):
        strategy = train_args[train_args.index("--strategy") + 1]
        nbytes = {"dense_pmap": 8e6, "embrace": 1e6}[strategy]
        step = 0.01 + nbytes * 8 / (harness.gbit(rate) * 1e9)
        coll = {
            "kind": "all-gather",
            "name": "ag",
            "group_size": nproc,
            "result_bytes": 2 * nbytes,
            "bytes_sent": nbytes,
        }
        return {
            "strategy": strategy,
            "step_time_s": step,
            "tokens_per_s": 100 / step,
            "comm_bytes_per_step": nbytes,
            "losses": [1.0],
            "collectives": [coll],
        }

    monkeypatch.setattr(harness, "run_config", fake_run)
    argv = [
        "--nproc",
        "2",
        "--bandwidths",
        "1gbit,10gbit",
        "--free-bandwidth",
        "1000gbit",
        "--strategies",
        "dense_pmap,embrace",
        "--alpha-us",
        "0",
        "--out-dir",
        str(tmp_path),
    ]
    assert bandwidth.main(argv) == 0
    rows = json.loads((tmp_path / "bandwidth.json").read_text())["rows"]
    assert [(r["bandwidth"], r["gbit"], r["strategy"]) for r in rows[:4]] == [
        ("1gbit", 1.0, "dense_pmap"),
        ("1gbit", 1.0, "embrace"),
        ("10gbit", 10.0, "dense_pmap"),
        ("10gbit", 10.0, "embrace"),
    ]
    assert rows[1]["speedup"] == pytest.approx(0.074 / 0.018)
    for r in rows[:4]:  # measured = step - step at 1000gbit; the model prices bytes / rate
        assert r["comm_s"] == pytest.approx(
            r["bytes"] * 8 / (r["gbit"] * 1e9) * (1 - r["gbit"] / 1000)
        )
        assert r["predicted_comm_s"] == pytest.approx(r["bytes"] * 8 / (r["gbit"] * 1e9))
        # modelled: the step at the free rate + the prediction (here 10 ms + bytes / rate,
        # the fake's step, to within what 1000 Gbit/s still costs)
        free = 0.01 + r["bytes"] * 8 / 1e12
        assert r["modelled_step_s"] == pytest.approx(free + r["predicted_comm_s"])
    assert "modelled_step_s" not in rows[-1]  # the free rate's own rows
    assert (tmp_path / "bandwidth_modelled.png").stat().st_size > 0
    assert (tmp_path / "bandwidth.png").stat().st_size > 0


@pytest.mark.cli
def test_density_sweep_predictions_with_stand_in_runs(tmp_path, monkeypatch):
    """The density sweep's wiring: the dense run's calibrated link prices every row's
    collectives; step times are made up so that topk_a2a wins from density 0.3."""
    link = {"alpha": 1e-3, "beta": 1e-8}

    def fake_run(train_args, out, nproc, rate):
        strategy = train_args[train_args.index("--strategy") + 1]
        density_ = float(train_args[train_args.index("--density") + 1])
        nbytes = {"dense": 1e6, "topk_allgather": 2e6 * density_, "topk_a2a": 5e5}
        sent = nbytes.get(strategy, nbytes["topk_allgather"])
        free = "100gbit" in rate
        step = 0.1 + (0 if free else sent * 1e-7)
        coll = {
            "kind": "all-gather",
            "name": "ag",
            "group_size": nproc,
            "result_bytes": sent * nproc / (nproc - 1),
            "bytes_sent": sent,
        }
        result = {
            "strategy": strategy,
            "step_time_s": step,
            "comm_bytes_per_step": sent,
            "losses": [1.0],
            "collectives": [coll],
        }
        return {**result, "link": link} if "--calibrate" in train_args else result

    monkeypatch.setattr(harness, "run_config", fake_run)
    argv = ["--nproc", "4", "--densities", "0.1,0.3", "--out-dir", str(tmp_path)]
    assert density.main(argv) == 0
    saved = json.loads((tmp_path / "density.json").read_text())
    assert saved["link"] == link
    assert saved["crossover"]["measured_step"] == 0.3  # 5e5 < 2e6 * 0.3 bytes
    assert saved["crossover"]["measured_comm"] == 0.3
    for r in [saved["dense"], *saved["rows"]]:  # 3 messages of an all-gather among 4
        assert r["calibrated_comm_s"] == pytest.approx(3 * 1e-3 + r["bytes"] * 1e-8)
        assert r["comm_s"] == pytest.approx(r["bytes"] * 1e-7)
    assert (tmp_path / "density.png").stat().st_size > 0


@pytest.mark.cli
def test_density_sweep_stops_clearly_without_calibration(tmp_path, monkeypatch, capsys):
    def failing_run(*args):
        raise RuntimeError("no root")

    monkeypatch.setattr(harness, "run_config", failing_run)
    assert density.main(["--densities", "0.1", "--out-dir", str(tmp_path)]) == 2
    assert "calibration" in capsys.readouterr().err


def test_a_failed_run_reports_its_ranks_error(tmp_path, monkeypatch):
    # The launcher streams each rank's output, its error included, to standard output;
    # standard error holds only the launcher's own line.
    script = (
        "import sys; print('[rank 1] error: --flag is wrong'); "
        "print('launch: rank 1 exited with code 2', file=sys.stderr); sys.exit(2)"
    )
    monkeypatch.setattr(harness, "command", lambda *a: [sys.executable, "-c", script])
    with pytest.raises(RuntimeError) as failed:
        harness.run_config(["--steps", "1"], tmp_path / "r.json")
    assert "--flag is wrong" in str(failed.value)
    assert "exited with code 2" in str(failed.value)


def test_a_failed_run_keeps_the_first_error_under_the_other_ranks_tracebacks():
    out = ["[rank 0] step 0", "[rank 1] ValueError: --tables is wrong"]
    out += [f"[rank 0] gloo: connection closed, frame {i}" for i in range(40)]
    text = harness.failure_tail("\n".join(out), "launch: rank 1 exited with code 2")
    assert "--tables is wrong" in text and "frame 39" in text and "frame 5\n" not in text
    assert text.endswith("exited with code 2")
    assert len(harness.failure_tail("x" * 10_000, "", limit=100)) < 110


def test_the_modelled_plot_says_so_when_nothing_was_modelled(tmp_path):
    # --free-bandwidth '' leaves no step to add the modelled communication to
    rows = [{"strategy": "dense_pmap", "bandwidth": "1gbit", "step_s": 0.2}]
    bandwidth.plot_modelled(rows, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0


def test_paper_scale_projects_the_balanced_exchanges_beside_the_others():
    rows = paper_scale.project()["topka2a_32gpu"]
    assert len(rows) == 3 * 4 * 3  # rates x models x densities
    for r in rows:
        assert {"topk_balanced", "oktopk"} <= set(r)
        assert r["oktopk_vs_allgather"] == pytest.approx(r["topk_allgather"] / r["oktopk"])
    # at 1% on 32 workers Ok-Topk's volume (< 6k(P-1)/P) is far under an all-gather's,
    # which shows where bytes dominate (10 Gbit/s); at 100 Gbit/s its ~280 messages'
    # latency can outweigh them on the smallest model
    slow_1pc = [r for r in rows if r["density"] == 0.01 and r["gbit"] == 10]
    assert all(r["oktopk"] < r["topk_allgather"] / 2 for r in slow_1pc)


@pytest.mark.cli
def test_the_wire_study_judges_each_spec_against_float32(tmp_path, monkeypatch):
    """Each strategy and spec trained in process on tiny DLRM tables: FP8 sends about a
    quarter of float32's bytes at a held-out loss close to float32's; a spec the strategy
    refuses is a row with its error, and the others still run."""

    def run_config(train_args, out, nproc=1, bandwidth=""):  # in process, its error kept
        cmd, err = harness.command(train_args, out, nproc, bandwidth), io.StringIO()
        with contextlib.redirect_stderr(err):
            failed = train_cli.main(cmd[3:])
        if failed:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.getvalue()}")
        return json.loads(Path(out).read_text())

    monkeypatch.setattr(harness, "run_config", run_config)
    tiny = ["--tables", "64,48", "--dim", "8", "--bottom", "16", "--top", "16", "--batch", "16"]
    argv = ["--steps", "6", "--models", "dlrm", "--devices", "2", "--out-dir", str(tmp_path)]
    argv += ["--strategies", "embrace,embrace+topk_a2a"]
    argv += ["--specs", "float32;float8_e4m3fn", "--", *tiny, "--eval-batches", "2"]
    assert _run_in_repo(monkeypatch, wire_study.main, argv) == 0
    rows = {
        (r["strategy"], r["spec"]): r
        for r in json.loads((tmp_path / "wire.json").read_text())["rows"]
    }
    assert "narrows the dense mean" in rows["embrace+topk_a2a", "float8_e4m3fn"]["error"]
    f32, fp8 = rows["embrace", "float32"], rows["embrace", "float8_e4m3fn"]
    assert 0.2 < fp8["bytes"] / f32["bytes"] < 0.45  # rows of 4 values pay a 4-byte scale
    assert fp8["loss"] == pytest.approx(f32["loss"], rel=0.02) and fp8["loss"] != f32["loss"]
    assert rows["embrace+topk_a2a", "float32"]["loss"] > 0
    table = wire_study.table(list(rows.values()), 0.01, "embrace")
    assert "| float8_e4m3fn |" in table and "failed" in table


def _row(strategy, loss, step_ms, mean_ms, mb, modelled):
    base_mb, base_ms = 4.0, 10.0
    return {
        "strategy": strategy,
        "final_loss": loss,
        "step_time_ms": step_ms,
        "mean_step_ms": mean_ms,
        "comm_mb_per_step": mb,
        "speedup_vs_dense_pmap": base_ms / step_ms,
        "bytes_reduction_vs_dense_pmap": base_mb / mb,
        **{f"modelled_speedup_{label}": modelled for label in ("10G", "1G")},
    }


def test_the_comparison_recommends_from_its_own_table():
    """The lossless strategy of least mean step (not median) is recommended, the one a
    modelled link favours with its byte reduction, the slowest with why (fewer bytes,
    more work), and the lossy ones are said to need more steps to show their cost."""
    from experiments import compare

    rows = [
        _row("dense_pmap", 2.0, 10.0, 10.0, 4.0, 1.0),
        _row("embrace", 2.0, 6.0, 9.0, 0.5, 3.0),  # fastest median, a slow mean
        _row("embrace_rowwise", 2.0, 7.0, 7.5, 0.4, 3.5),
        _row("adaptive", 2.1, 32.0, 32.0, 0.2, 2.0),
        _row("topk_a2a", 2.05, 5.0, 5.0, 0.1, 8.0),  # lossy: never recommended
    ]
    lines = compare.recommend(rows, steps=10)
    assert lines[0].startswith("recommended here: embrace_rowwise (lossless; mean step 7.5")
    assert lines[1].startswith("on a 10Gbit/s link (modelled): embrace_rowwise, 3.50x")
    assert "10.0x fewer bytes" in lines[1]
    assert lines[3].startswith("slowest here: adaptive, 3.2x dense_pmap's step: it sends fewer")
    assert "after 10 steps their loss is within 0.1000" in lines[4] and "--steps 300" in lines[4]
