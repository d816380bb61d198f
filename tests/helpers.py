"""Shared test helpers: single-device reference training, tree comparison, the numpy
reference of TopKA2A's selection, and a small model of three tables."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sparsecomm_jax as sc
from experiments.train import main
from sparsecomm_jax import runtime

#: Lines the gpu-compile extra's CUDA plugin prints when JAX starts in any process (from
#: its C++ extension's import, outside this project; harmless without a GPU).
PLUGIN_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


def run_main(args, capsys) -> tuple[int, list[str]]:
    """``experiments.train.main(args)`` in this process: exit status and stderr lines."""
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def stderr_lines(stderr: str) -> list[str]:
    """What a process wrote to stderr, line by line, less progress bars (``it/s``), blank
    lines and the CUDA plugin's start-up lines (``PLUGIN_NOISE``)."""
    lines = stderr.replace("\r", "\n").splitlines()
    return [
        x for x in lines if x.strip() and "it/s" not in x and not any(n in x for n in PLUGIN_NOISE)
    ]


def reference_run(workload, optimizer, params, steps):
    """Plain single-device training on the whole global batch: the ground truth."""
    opt_state, losses = optimizer.init(params), []

    @jax.jit  # one program (op-by-op dispatch would compile every optimizer op)
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(workload.loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, workload.batch_at(step))
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def strategy_run(workload, optimizer, params, steps, strategy, devices=8, **kwargs):
    """``steps`` steps of ``strategy``; returns (losses, host params, TrainStep)."""
    mesh = runtime.data_mesh(devices)
    ts = sc.make_train_step(
        workload.loss,
        optimizer,
        mesh,
        params,
        strategy,
        replicated_keys=workload.replicated_keys,
        embedding_paths=workload.embedding_paths,
        id_keys=workload.id_keys,
        **kwargs,
    )
    state, losses = ts.state, []
    for step in range(steps):
        state, loss = ts.step(state, place(ts, workload, step, steps))
        losses.append(sc.loss_value(loss))
    return losses, ts.host_params(state), ts


def place(ts, workload, step, steps):
    """The placed batch of ``step`` (see ``place_for_step``)."""
    return sc.place_for_step(ts, workload.batch_at, step, steps)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def a2a_sent(x, k, workers):
    """What TopKA2A sends of a float[d] ``x`` at k entries, as float[d] (numpy): P shards
    cut as ``np.array_split`` cuts them, the k slots dealt one by one from the first
    shard on, in each shard its largest magnitudes (ties to the lower index)."""
    slots = np.bincount(np.arange(k) % workers, minlength=workers)
    parts = np.array_split(np.arange(x.size), workers)
    by_size = [p[np.argsort(-np.abs(x[p]), kind="stable")] for p in parts]
    taken = np.concatenate([p[:n] for p, n in zip(by_size, slots, strict=True)])
    sent = np.zeros_like(x)
    sent[taken] = x[taken]
    return sent


def record_loop_events(monkeypatch, loop) -> list:
    """A list that ``experiments.train.loop`` (passed as ``loop``) fills as it runs: ``"run"``
    when a program call is handed to the devices, ``"read"`` when its losses are read."""
    events = []
    real_runner, real_read = loop._runner, loop.loss_values

    def runner(ts, compiled):
        program = real_runner(ts, compiled)
        return lambda state, batch: events.append("run") or program(state, batch)

    monkeypatch.setattr(loop, "_runner", runner)
    monkeypatch.setattr(loop, "loss_values", lambda loss: events.append("read") or real_read(loss))
    return events


# ------------------------------------------------------- a small model of three tables

THREE = {"a": 37, "b": 21, "c": 9}  # V of each table: none divides by 2, 3, 4 or 8
THREE_DIM = 6
THREE_BATCH = 24  # divides by 1, 2, 3, 4 and 8 devices


def three_tables_loss(p, batch, emb):
    """Each example reads a row of each table; their sum through ``w`` against ``y``."""
    rows = sum(emb.lookup(p[k], batch[k]) for k in THREE)
    return jnp.mean((rows @ p["w"] - batch["y"]) ** 2)


def three_tables_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=(v, THREE_DIM)).astype(np.float32) for k, v in THREE.items()}
    return {**params, "w": rng.normal(size=(THREE_DIM, 1)).astype(np.float32)}


def three_tables_batch(seed: int, step: int) -> dict:
    rng = np.random.default_rng((seed, step))
    ids = {k: rng.integers(0, v, (THREE_BATCH,)) for k, v in THREE.items()}
    return {**ids, "y": rng.normal(size=(THREE_BATCH, 1)).astype(np.float32)}


def run_three_tables(ts, seed: int, steps: int = 3, state=None, start: int = 0):
    """``steps`` steps of ``ts`` on ``three_tables_batch(seed, start...)``, from
    ``state`` (default ``ts.state``); returns ``(state, losses)``."""
    state, losses = ts.state if state is None else state, []
    for s in range(start, start + steps):
        state, value = ts.step(state, ts.place_batch(three_tables_batch(seed, s)))
        losses.append(float(value))
    return state, losses


def workload_step(w, params, devices: int, optimizer, strategy: str, **kw):
    """``make_train_step`` of a ``models`` workload ``w`` on ``devices`` devices."""
    return sc.make_train_step(
        w.loss,
        optimizer,
        runtime.data_mesh(devices),
        params,
        strategy,
        embedding_paths=w.embedding_paths,
        replicated_keys=w.replicated_keys,
        **kw,
    )


def run_placed(ts, batch_at, steps: int):
    """``steps`` steps of ``ts`` from ``ts.state``, each batch placed as a user places it
    for any step, pipelined ones too (``place_for_step``: the batch and those it looks
    ahead to); returns ``(state, losses)``."""
    state, losses = ts.state, []
    for step in range(steps):
        state, loss = ts.step(state, sc.place_for_step(ts, batch_at, step, steps))
        losses.append(sc.loss_value(loss))
    return state, losses
