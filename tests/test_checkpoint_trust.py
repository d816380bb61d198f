"""No checkpoint is trusted by its name, nothing is deleted before the run goes ahead:
each case as a user or an attacker would cause it, on the command line, against the
losses of an uninterrupted run."""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import CACHE_SETTINGS, REPO
from helpers import stderr_lines

from experiments.train import main
from sparsecomm_jax import checkpoint

pytestmark = pytest.mark.cli

TINY = ["--model", "lstm_lm", "--vocab", "64", "--dim", "8", "--hidden", "8", "--batch", "8"]
TINY += ["--seq-len", "4", "--devices", "2", "--warmup", "0"]


def run(*args: str, out: Path | None = None) -> int:
    return main([*TINY, *args, *(["--out", str(out)] if out else [])])


def losses(out: Path) -> list[float]:
    return json.loads(out.read_text())["losses"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs' folders with checkpoints of steps 3 and 4 (of different seeds), and the
    losses of an uninterrupted 6-step run of the first."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("a", "0"), ("b", "1")):
        ck = ["--checkpoint-dir", str(root / name), "--checkpoint-every", "1", "--seed", seed]
        assert run("--steps", "4", *ck) == 0
    assert run("--steps", "6", out=root / "full.json") == 0
    return root, losses(root / "full.json")


@pytest.fixture
def folder(runs, tmp_path):
    """A copy of run a's folder (steps 3 and 4) to tamper with."""
    shutil.copytree(runs[0] / "a", tmp_path / "a", symlinks=True)
    return tmp_path / "a"


def resume(folder: Path, *args: str, out: Path | None = None) -> int:
    return run("--steps", "6", "--checkpoint-dir", str(folder), "--resume", *args, out=out)


def one_line(capsys) -> str:
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("how", ["copied", "linked", "renamed"])
def test_another_runs_or_another_steps_checkpoint_is_refused(runs, folder, how, capsys):
    """``cp -a b/4 a/4``, ``ln -s b/4 a/5``, ``mv a/4 a/5``: refused in one line, nothing
    removed."""
    other = runs[0] / "b" / "4"
    if how == "copied":
        shutil.rmtree(folder / "4")
        shutil.copytree(other, folder / "4")
    elif how == "linked":
        (folder / "5").symlink_to(other, target_is_directory=True)
    else:
        (folder / "4").rename(folder / "5")
    before = sorted(p.name for p in folder.iterdir())
    assert resume(folder) == 2
    message = one_line(capsys)
    expected = "is a link to" if how == "linked" else "copied, linked or renamed"
    assert expected in message and "move it away" in message or "remove the link" in message
    assert sorted(p.name for p in folder.iterdir()) == before
    assert other.is_dir()


def test_resume_keeps_newer_checkpoints_until_it_saves(runs, folder, tmp_path, capsys):
    """``--resume-step 3`` with nothing to run, or a log folder that fails, deletes
    nothing; the run that goes ahead replaces step 4 with its own, equal to the
    uninterrupted run's."""
    assert resume(folder, "--resume-step", "3", "--steps", "3") == 2
    assert "nothing to run" in one_line(capsys)
    (tmp_path / "file").write_text("a file where the logs would go")
    assert resume(folder, "--resume-step", "3", "--log-dir", str(tmp_path / "file")) == 2
    assert "is a file" in one_line(capsys)
    assert checkpoint.saved_steps(folder) == [3, 4]
    out = tmp_path / "r.json"
    assert resume(folder, "--resume-step", "3", out=out) == 0
    assert losses(out) == runs[1][3:]
    assert checkpoint.saved_steps(folder) == [3, 6]  # its own final step replaced step 4


def test_a_damaged_newest_is_renamed_aside_not_deleted(runs, folder, tmp_path, capsys):
    """A FIFO in place of a file of step 4 (which would block a reader forever), then a
    deleted array index: each skipped with a note, the run resumes from step 3 exactly
    and keeps the damaged step as ``4.damaged``."""
    data = next(p for p in (folder / "4").rglob("*") if p.is_file() and p.parent.name == "d")
    data.unlink()
    os.mkfifo(data)
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=resume(folder, out=tmp_path / "r")))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the resume blocked on the FIFO"
    err = capsys.readouterr().err
    assert result["code"] == 0 and "checkpoint step 4 skipped" in err and "not a regular" in err
    assert losses(tmp_path / "r") == runs[1][3:]
    assert (folder / "4.damaged").is_dir() and (
        folder / "4.damaged" / data.relative_to(folder / "4")
    ).is_fifo()


def test_a_deleted_array_index_falls_back(runs, folder, tmp_path, capsys):
    (folder / "4" / checkpoint.STATE_ITEM / "_METADATA").unlink()
    assert resume(folder, out=tmp_path / "r") == 0
    assert "checkpoint step 4 skipped" in capsys.readouterr().err
    assert losses(tmp_path / "r") == runs[1][3:]


def _flip_middle_bytes(step: Path) -> int:
    """Flips one bit in the middle of each array data file of a checkpoint; returns how
    many."""
    data = [p for p in (step / checkpoint.STATE_ITEM).rglob("*") if p.parent.name == "d"]
    for path in data:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    return len(data)


def test_a_flipped_byte_is_caught_before_a_step_trains_on_it(tmp_path):
    """One bit flipped in the middle of the data file of a 64 x 64 table: orbax reads it
    without complaint (the value changes), the digest saved beside the run id does not
    match, and the checkpoint before it is restored exactly."""
    rng = np.random.default_rng(0)
    tree = {"w": jnp.asarray(rng.normal(size=(64, 64)).astype(np.float32)), "b": jnp.ones(5)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, tree, force=True)
        ckpt.save(2, jax.tree.map(lambda x: x + 1, tree), force=True)
    files = [p for p in (tmp_path / "2").rglob("*") if p.parent.name == "d"]
    path = max(files, key=lambda p: p.stat().st_size)  # the table's data, compressed
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    skipped = []
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, step = ckpt.restore(tree, on_skip=lambda s, why: skipped.append((s, why)))
    assert step == 1 and len(skipped) == 1 and skipped[0][0] == 2
    assert "differs from the digest saved with it in array w" in skipped[0][1]
    np.testing.assert_array_equal(restored["w"], tree["w"])


def test_flipped_bytes_in_a_runs_checkpoint_never_train(runs, folder, tmp_path, capsys):
    """A bit flipped in every data file of step 4: the resume skips it in one line (the
    digest or orbax catches it) and continues from step 3 to the uninterrupted losses."""
    assert _flip_middle_bytes(folder / "4") > 0
    assert resume(folder, out=tmp_path / "r") == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if "skipped" in x]
    assert len(notes) == 1 and "checkpoint step 4 skipped" in notes[0]
    assert losses(tmp_path / "r") == runs[1][3:]


def test_another_runs_state_beside_this_runs_identity_is_skipped(runs, folder, tmp_path, capsys):
    """Run b's saved state copied into run a's step 4, a's own identity (run id, step)
    left beside it: the digest binds the two, so step 4 is skipped, not trained on."""
    shutil.rmtree(folder / "4" / checkpoint.STATE_ITEM)
    shutil.copytree(
        runs[0] / "b" / "4" / checkpoint.STATE_ITEM, folder / "4" / checkpoint.STATE_ITEM
    )
    assert resume(folder, out=tmp_path / "r") == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if "skipped" in x]
    assert len(notes) == 1 and "another run's state copied in" in notes[0]
    assert losses(tmp_path / "r") == runs[1][3:]


def test_a_failing_disk_is_raised_and_the_checkpoint_kept(runs, folder, monkeypatch, capsys):
    """One EIO while reading an intact step 4 is the file system's failure, not damage:
    one line, step 4 kept; the next try resumes from it."""
    real, calls = ocp.CheckpointManager.item_metadata, []

    def flaky(self, step):
        calls.append(step)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, step)

    monkeypatch.setattr(ocp.CheckpointManager, "item_metadata", flaky)
    assert resume(folder) == 2
    message = one_line(capsys)
    assert "cannot read checkpoint step 4" in message and "it is kept" in message
    assert checkpoint.saved_steps(folder) == [3, 4]
    assert resume(folder, "--steps", "5") == 0
    assert checkpoint.saved_steps(folder) == [4, 5]


def test_a_linked_lock_file_is_refused_its_target_untouched(folder, tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (folder / checkpoint.LOCK_FILE).unlink(missing_ok=True)
    (folder / checkpoint.LOCK_FILE).symlink_to(precious)
    assert resume(folder) == 2
    assert "is a symbolic link; remove it" in one_line(capsys)
    assert precious.read_text() == "keep me"


DEEP = '{"run_id": "x", "config": {"plan": ' + '{"a": ' * 5000 + "1" + "}" * 5002


@pytest.mark.parametrize("record", ["[1, 2]", '"a run"', '{"lr": 1}', "fifo", "{", DEEP])
def test_a_run_record_that_is_none_is_one_line(folder, record, capsys):
    """Among them a recorded plan nested 5,000 levels deep, resumed with ``--plan
    model`` (which reads the recorded plan)."""
    path = folder / checkpoint.RUN_FILE
    path.unlink()
    os.mkfifo(path) if record == "fifo" else path.write_text(record)
    plan = ["--strategy", "embrace", "--plan", "model"] if record == DEEP else []
    assert resume(folder, *plan) == 2
    assert str(path) in one_line(capsys)


def test_an_equivalent_table_update_resumes(tmp_path, capsys):
    """``--table-update rows`` resumes a run of ``auto`` that chose rows; ``dense`` is
    another trajectory and is refused, naming both."""
    ck = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1", "--optimizer", "sgd"]
    assert run("--steps", "2", "--strategy", "embrace", *ck) == 0
    assert (
        run("--steps", "3", "--strategy", "embrace", *ck, "--resume", "--table-update", "rows") == 0
    )
    assert checkpoint.saved_steps(tmp_path) == [2, 3]
    capsys.readouterr()
    assert (
        run("--steps", "4", *ck, "--strategy", "embrace", "--resume", "--table-update", "dense")
        == 2
    )
    assert "--table-update ('rows' there, 'dense' here)" in one_line(capsys)


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from experiments.train import cli
sys.argv = ["train", *sys.argv[2:]]
cli()
"""


@pytest.mark.processes
@pytest.mark.parametrize("limit", [600, 3000])  # the run record fails; orbax's writers fail
def test_a_full_disk_is_one_line_and_leaves_no_stray_file(tmp_path, limit):
    """Files may grow to ``limit`` bytes only: the save fails in one error line (no writer
    thread's traceback; orbax's closed-loop noise, below, aside), exit status 2, no
    temporary run record left behind. The output goes through a pipe: the limit applies
    to files only."""
    folder = tmp_path / "ck"
    args = [*TINY, "--steps", "2", "--checkpoint-dir", str(folder), "--checkpoint-every", "1"]
    env = {k: v for k, v in os.environ.items() if k not in CACHE_SETTINGS}  # files it writes
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(limit), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = stderr_lines(proc.stderr)
    # A known race outside this project: writes still in flight when orbax's save fails
    # call back into its closed event loop from tensorstore's threads, which print
    # "RuntimeError: Event loop is closed" tracebacks (4 runs of 16 of 8a1bc0a, 1 of 6 of
    # its successor, here). Those lines are told apart; nothing else may be there.
    errors = [x for x in lines if "error: " in x]  # the noise may share its line
    others = [x for x in lines if "error: " not in x and not _closed_loop_noise(x)]
    assert proc.returncode == 2 and len(errors) == 1 and not others, proc.stderr[-3000:]
    assert "error: cannot write checkpoint step 1 into" in errors[0]
    assert not list(folder.glob(".checkpoint_run.json.*"))
    assert not list(folder.glob(f"*{checkpoint.TMP_MARK}*"))  # no half-written save either


def _closed_loop_noise(line: str) -> bool:
    """A line of asyncio's "Event loop is closed" traceback (see the test above)."""
    known = (
        "Traceback (most recent call last):",
        "asyncio/base_events.py",
        "self._check_closed()",
        "raise RuntimeError('Event loop is closed')",
        "RuntimeError: Event loop is closed",
    )
    return any(k in line for k in known)
