"""Per-step JSON lines, TensorBoard scalars, held-out perplexity in the result and the
--profile-steps trace of a run on generated WikiText-format files."""

import dataclasses
import io
import json
import math
import struct

import jax
import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from test_data import write_corpus
from tqdm import tqdm

from experiments.train import loop, main, runlog, train_and_evaluate
from experiments.train.config import RunConfig
from sparsecomm_jax import checkpoint

jax.devices()  # start JAX on conftest's 8 devices: runs with --devices < 8 must not shrink it

RUN = dict(model="gpt2", devices=2, steps=4, warmup=1, batch=4, vocab=40, seq_len=6, dim=8)


def read_scalars(folder):
    """tag -> {step: value} from the TFRecord event files in ``folder``."""
    out = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.fixture(scope="module")
def wikitext_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wiki")
    write_corpus(folder)
    out = folder / "run" / "result.json"
    config = RunConfig(**RUN, data_dir=str(folder), eval_every=2, profile_steps="1:3", out=str(out))
    return train_and_evaluate(config, progress=False), out.with_name("result.logs"), config


@pytest.mark.cli
def test_result_reports_heldout_perplexity(wikitext_run):
    result, *_ = wikitext_run
    for split in ("valid", "test"):
        m = result["heldout"][split]
        assert m["perplexity"] == pytest.approx(math.exp(m["loss"])) and m["batches"] > 0
    assert [(e["step"], e["split"]) for e in result["eval"]] == [(1, "valid"), (3, "valid")]
    # the evaluation after the last step is the final one
    assert result["eval"][-1]["loss"] == pytest.approx(result["heldout"]["valid"]["loss"])
    # an untrained model is near uniform over 40 words; 4 steps move it only a little
    assert 5 < result["heldout"]["valid"]["perplexity"] < 200
    json.dumps(result)


@pytest.mark.cli
def test_sharded_tables_are_scored_like_dense(wikitext_run):
    dense, _, config = wikitext_run
    embrace = dataclasses.replace(config, strategy="embrace", profile_steps="", out="")
    got = train_and_evaluate(embrace, progress=False)
    np.testing.assert_allclose(got["losses"], dense["losses"], rtol=1e-5)
    for split in ("valid", "test"):
        want = dense["heldout"][split]["loss"]
        assert got["heldout"][split]["loss"] == pytest.approx(want, rel=1e-5)
    assert "log_dir" not in got and "trace_dir" not in got  # no --out, no --log-dir


@pytest.mark.cli
def test_one_json_line_per_step(wikitext_run):
    result, logs, _ = wikitext_run
    lines = [json.loads(x) for x in (logs / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    np.testing.assert_allclose([x["loss"] for x in lines], result["losses"], rtol=1e-6)
    np.testing.assert_allclose([x["step_time_s"] for x in lines], result["step_times_s"])
    assert all(x["comm_bytes_per_worker"] == result["comm_bytes_per_step"] for x in lines)
    assert [x.get("valid_perplexity") for x in lines][::2] == [None, None]
    assert lines[3]["valid_perplexity"] == pytest.approx(result["heldout"]["valid"]["perplexity"])


@pytest.mark.cli
def test_tensorboard_scalars_match_the_lines(wikitext_run):
    result, logs, _ = wikitext_run
    scalars = read_scalars(logs)
    assert sorted(scalars["train/loss"]) == [0, 1, 2, 3]
    np.testing.assert_allclose(list(scalars["train/loss"].values()), result["losses"], rtol=1e-6)
    assert scalars["valid/perplexity"][3] == pytest.approx(
        result["heldout"]["valid"]["perplexity"], rel=1e-6
    )


@pytest.mark.cli
def test_profile_steps_leave_a_trace(wikitext_run):
    result, logs, _ = wikitext_run
    assert result["trace_dir"] == str(logs / "trace")
    files = [p.name for p in (logs / "trace").rglob("*") if p.is_file()]
    assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in files), files


def test_lines_are_on_disk_before_the_log_closes(tmp_path):
    log = runlog.StepLog(tmp_path)
    log.write({"step": 0, "loss": 1.5})
    assert json.loads((tmp_path / "steps.jsonl").read_text()) == {"step": 0, "loss": 1.5}
    log.write({"step": 1, "loss": 1.25})
    log.close()
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # the line a killed run leaves half-written
    resumed = runlog.StepLog(tmp_path, start=1)  # --resume from step 1: keeps step 0 only
    resumed.write({"step": 1, "loss": float("nan")})  # a skipped step: strict JSON null
    resumed.close()
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    assert json.loads(lines[1])["loss"] is None and "NaN" not in lines[1]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert read_scalars(tmp_path)["train/loss"] == {0: 1.5}


@pytest.mark.cli
def test_the_progress_bar_is_drawn_on_its_own_clock_not_at_every_step(monkeypatch):
    """The loss goes into the bar without a redraw per step (a long run's log would hold
    one line per step, written while the step runs); the bar still ends with it."""
    draws, shown = [], io.StringIO()

    class Bar(tqdm):  # redraws only when told to: its clock never comes round
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 1e9, "file": shown})

        def refresh(self, *args, **kwargs):
            draws.append(self.n)
            return super().refresh(*args, **kwargs)

    monkeypatch.setattr(loop, "tqdm", Bar)
    steps = 6
    result = train_and_evaluate(RunConfig(**{**RUN, "steps": steps}), progress=True)
    assert len(result["losses"]) == steps
    assert len(draws) < 3  # opened (and at most once more), not once per step
    assert f"loss={result['losses'][-1]:.4f}" in shown.getvalue()  # the last draw, at close


TINY = ["--model", "lstm_lm", "--vocab", "64", "--dim", "8", "--hidden", "8", "--batch", "8"]
TINY += ["--seq-len", "4", "--devices", "2", "--warmup", "0"]


@pytest.mark.cli
def test_a_resumed_run_logs_each_step_once(tmp_path, capsys):
    """Interrupted after 3 steps (checkpoints at 2 and 3), resumed from step 2: every step
    has one line and one scalar, and they are the uninterrupted run's."""
    full = tmp_path / "full"
    assert main([*TINY, "--steps", "4", "--log-dir", str(full)]) == 0
    logs, ck = tmp_path / "logs", ["--checkpoint-dir", str(tmp_path / "ck")]
    assert (
        main([*TINY, "--steps", "3", "--checkpoint-every", "1", "--log-dir", str(logs), *ck]) == 0
    )
    args = [*TINY, "--steps", "4", "--log-dir", str(logs), *ck, "--resume", "--resume-step", "2"]
    assert main([*args, "--profile-steps", "0:2"]) == 0
    assert "ends before step 2, where this resumed run starts: no trace" in capsys.readouterr().err
    lines = [json.loads(x) for x in (logs / "steps.jsonl").read_text().splitlines()]
    expected = [json.loads(x) for x in (full / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert [x["loss"] for x in lines] == [x["loss"] for x in expected]
    assert len(list(logs.glob("events.out.tfevents.*"))) == 1
    assert read_scalars(logs)["train/loss"] == read_scalars(full)["train/loss"]
    assert not (logs / "trace").exists()


@pytest.mark.cli
def test_a_fresh_run_replaces_the_folders_logs(tmp_path):
    for steps in ("3", "2"):
        assert main([*TINY, "--steps", steps, "--log-dir", str(tmp_path)]) == 0
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.cli
def test_a_log_folder_in_use_is_refused(tmp_path, capsys):
    with checkpoint.DirectoryLock(tmp_path):  # another run writing there
        assert main([*TINY, "--steps", "1", "--log-dir", str(tmp_path)]) == 2
    assert f"--log-dir {tmp_path} is in use by another run" in _one_line(capsys)
    assert not (tmp_path / "steps.jsonl").exists()


@pytest.mark.parametrize("inside", [".", "logs"])
def test_logs_inside_the_checkpoint_folder_are_refused(tmp_path, inside, capsys):
    ck = ["--checkpoint-dir", str(tmp_path)]
    assert main([*TINY, "--steps", "1", *ck, "--log-dir", str(tmp_path / inside)]) == 2
    assert "is inside --checkpoint-dir" in _one_line(capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile-steps", "3"], "--profile-steps must be A:B"),
        (["--profile-steps", "4:2", "--out", "x.json"], "--profile-steps must be A:B"),
        (["--profile-steps", "0:2"], "--profile-steps needs --log-dir or --out"),
        (["--profile-steps", "1:2", "--log-dir", "x"], "starts after the last step"),
        (["--eval-every", "-1"], "--eval-every must be >= 0"),
        (["--eval-every", "2"], "--eval-every needs held-out data"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message, capsys):
    assert main(["--devices", "1", "--batch", "4", "--steps", "1", "--vocab", "50", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_each_process_of_a_job_traces_into_its_own_folder(tmp_path, monkeypatch):
    assert runlog.trace_folder(tmp_path, 0) == tmp_path / "trace"
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert runlog.trace_folder(tmp_path, 1) == tmp_path / "trace" / "rank1"


def test_profile_window_parsing():
    assert runlog.parse_profile_steps("") is None
    assert runlog.parse_profile_steps("0:1") == (0, 1)
    assert runlog.scalar_tag("valid_loss") == "valid/loss"
    assert runlog.scalar_tag("step_time_s") == "train/step_time_s"
