"""Steps compiled for GPUs that are not there (``sparsecomm_jax.compile_only``): every
strategy compiles for 8 H100s and for 2 hosts x 8, nothing placed; the bytes each GPU
sends equal the CPU program's; ``embrace_2d``'s schedule on a GPU target: its first chunk
before the forward pass, its late all-to-all asynchronous with work between start and
done, and across the steps of one call, what runs in that window.

Needs the ``gpu-compile`` extra (the CUDA plugin and ptxas, no driver); where it is not
installed these tests are skipped, saying so (CI installs it)."""

import importlib.util

import jax
import optax
import pytest

import sparsecomm_jax as sc
from experiments import gpu_schedule
from models import get_workload
from sparsecomm_jax import compile_only, runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import priority
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.schedule import scopes


def cuda_plugin_installed() -> bool:
    """Whether the gpu-compile extra's CUDA plugin is there (without the extra there is
    no ``jax_plugins`` package at all, and ``find_spec`` of its module raises)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason="the gpu-compile extra (the CUDA plugin) is not installed",
)

README = dict(vocab=512, dim=16, hidden=16, seq_len=8, batch=16, sampled_softmax=16)
DLRM = dict(tables="512,256,64", dim=16, bottom="32", top="32", batch=32)


def built(model, strategy, mesh, **kwargs):
    w = get_workload(model, seed=0, **(README if model == "lstm_lm" else DLRM))
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        mesh,
        w.init(jax.random.key(0)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
        **kwargs,
    )
    return w, ts


def compiled(ts, w, call=(0, 1), state=None):
    batch = sc.place_for_call(ts, w.batch_at, call, 10)
    return compile_only.compile_step(
        ts.steps if call[1] > 1 else ts.step, ts.state if state is None else state, batch
    )


def test_a_mesh_of_h100s_that_are_not_there():
    mesh = compile_only.gpu_mesh("h100", hosts=2, per_host=8)
    devices = list(mesh.devices.flat)
    assert len(devices) == 16 and runtime.compile_only(mesh)
    assert devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
    assert not runtime.compile_only(runtime.data_mesh(8))
    with pytest.raises(ArgumentError, match="gpu='b200' must be one of"):
        compile_only.gpu_mesh("b200")
    with pytest.raises(ArgumentError, match="hosts=0 must be a positive integer"):
        compile_only.gpu_mesh("h100", hosts=0)


@pytest.mark.matrix
@pytest.mark.parametrize("hosts", [1, 2])
@pytest.mark.parametrize("model", ["lstm_lm", "dlrm"])
@pytest.mark.parametrize("strategy", sc.strategy_names())
def test_every_strategy_compiles_for_h100s(strategy, model, hosts):
    """Every strategy of ``strategy_names()`` builds and compiles for 8 H100s on one host
    and on two, on the README's model and on DLRM, nothing placed (the state abstract),
    and its program's bytes and memory are read (``dense_pmap``'s state stays on the
    host, stacked per device, as ``jax.pmap`` takes it)."""
    mesh = compile_only.gpu_mesh("h100", hosts=hosts, per_host=8)
    w, ts = built(model, strategy, mesh)
    assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(ts.state))  # unplaced
    program, _ = compiled(ts, w)
    report = compile_only.report(program)
    assert report.memory["peak_memory_in_bytes"] > 0
    assert report.collectives and report.bytes_per_device > 0
    assert all(8 * hosts % c.group_size == 0 for c in report.collectives)


TABLES = [f"params/sparse_{i}/embedding" for i in range(3)]
VARIANTS = {  # DLRM's three tables: strategy, make_train_step's options
    "bf16 wire": ("embrace", dict(comm_dtype="bfloat16", table_update="rows")),
    "fp8 wire": ("embrace_rowwise", dict(comm_dtype="float8_e4m3fn", table_update="rows")),
    "replica groups": ("embrace", dict(replicas=2)),
    "column, row, hot pipelined": (
        "embrace_2d",
        dict(table_layouts=dict(zip(TABLES, ("column", "row", "hot"), strict=True))),
    ),
    "table, replicated, dense": (
        "embrace",
        dict(table_layouts=dict(zip(TABLES, ("table", "replicated", "dense"), strict=True))),
    ),
}


@pytest.mark.matrix
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_wires_replica_groups_and_every_layout_compile_for_h100s(variant):
    """bf16 and FP8 wires, 2 replica groups of 4, and every built-in layout (column, row
    and hot pipelined by ``embrace_2d``; table, replicated, dense under ``embrace``)
    compile for 8 H100s on DLRM; the replica groups' collectives span a group (4) or
    one device of each group (2)."""
    strategy, options = VARIANTS[variant]
    mesh = compile_only.gpu_mesh("h100")
    w, ts = built("dlrm", strategy, mesh, **options)
    assert ts.runs_as == strategy
    report = compile_only.report(compiled(ts, w)[0])
    assert report.collectives and report.bytes_per_device > 0
    groups = {c.group_size for c in report.collectives}
    # replica groups: 4 within a group, 2 across the groups (a row's sum), 8 the dense mean
    assert groups == ({2, 4, 8} if "replicas" in options else {8}), groups


@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "embrace+topk_a2a", "dense"])
def test_gpu_bytes_equal_the_cpu_programs(strategy):
    """A step's collectives send the same bytes a device on 8 H100s as on 8 CPU devices
    (the same partitioned program; XLA's GPU passes change the schedule, not what
    travels)."""
    w, gpu = built("lstm_lm", strategy, compile_only.gpu_mesh("h100"))
    _, cpu = built("lstm_lm", strategy, runtime.data_mesh(8))
    on_gpu = compile_only.report(compiled(gpu, w)[0]).bytes_per_device
    on_cpu = hlo.total_bytes(hlo.collectives(cpu.step, cpu.state, cpu.place_batch(w.batch_at(0))))
    assert on_gpu == on_cpu > 0


def test_embrace_2d_on_h100s_pipelines_its_chunks_and_overlaps_the_late_one(monkeypatch):
    """On 8 H100s ``embrace_2d`` builds its pipelined program (XLA's GPU scheduler can
    overlap): in the steady state (rows carried from the step before) nothing is fetched
    before the forward pass, every first chunk's all-to-all is issued before any late
    one, and the late chunks' all-to-alls are asynchronous with work between start and
    done. (A first chunk of one position a table, so that late chunks exist at this
    size: most of a small batch's positions are read again by the next.)"""
    monkeypatch.setattr(
        priority, "first_chunk_need", lambda reads, tables, workers: {t.index: 1 for t in tables}
    )
    w, ts = built("lstm_lm", "embrace_2d", compile_only.gpu_mesh("h100"))
    assert ts.runs_as == "embrace_2d"
    _, state = compiled(ts, w)
    program, _ = compiled(ts, w, (1, 1), state)
    text = program.as_text()
    colls = hlo.scheduled_collectives(text)
    assert not [c for c in colls if scopes.SCOPE_ROWS in c.op_name]
    order = [c.op_name for c in colls if c.opcode.startswith("all-to-all")]
    high = [k for k, n in enumerate(order) if scopes.SCOPE_HIGH in n]
    low = [k for k, n in enumerate(order) if scopes.SCOPE_LOW in n]
    assert high and low and max(high) < min(low), order
    late = [
        window
        for window in hlo.async_windows(text)
        if window.kind == "all-to-all" and scopes.SCOPE_LOW in window.op_name
    ]
    assert late and any(not w.sync and w.between for w in late), late


@pytest.mark.cli
def test_the_command_reports_a_call_of_several_steps(tmp_path, capsys):
    """``experiments.gpu_schedule``: embrace_2d, three steps a call on 8 H100s; the
    report names each asynchronous collective's window and the steps whose operations
    run in it; the scheduled HLO is written beside the JSON."""
    out = tmp_path / "sched.json"
    flags = ["--model", "lstm_lm", "--vocab", "512", "--dim", "16", "--hidden", "16"]
    flags += ["--seq-len", "8", "--batch", "16", "--sampled-softmax", "16"]
    result = gpu_schedule.run(
        [*flags, "--strategy", "embrace_2d", "--steps-per-call", "3", "--out", str(out)]
    )
    assert result["runs_as"] == "embrace_2d"
    steady = result["programs"]["steady state"]
    assert steady["windows"] and steady["bytes_per_gpu"] > 0
    assert {w["kind"] for w in steady["windows"]} >= {"all-to-all"}
    assert out.exists() and out.with_suffix(".hlo.txt").read_text().startswith("HloModule")
    assert "steady state" in capsys.readouterr().out


def late_windows(text: str) -> dict[int, int]:
    """Per unrolled step, the forward and backward operations of the steps after it in
    the windows of its late all-to-alls (the ``embrace2d_low`` chunks)."""
    out: dict[int, int] = {}
    for window in hlo.async_windows(text):
        if window.kind == "all-to-all" and scopes.SCOPE_LOW in window.op_name:
            summary = gpu_schedule.window_summary(window)
            mine = summary["step"]
            out[mine] = out.get(mine, 0) + summary["other_steps_forward_backward"]
    return out


@pytest.mark.matrix
@pytest.mark.parametrize("nonfinite", ["off", "skip"])
def test_the_next_steps_pass_in_a_late_exchange_where_nothing_skips(monkeypatch, nonfinite):
    """Two ``embrace_2d`` steps in one call on 8 H100s, the steady state (an LM of
    D = H = 128: enough compute for XLA's latency-hiding scheduler to move): with
    ``nonfinite="off"`` step 1's forward and backward pass does not wait for step 0's
    late chunks (it reads the carried rows; stale ones are redone behind a
    conditional), and the scheduler places some of it between a late all-to-all's
    start and its done: EmbRace's overlap across steps. With ``"skip"`` (the default)
    none of it: whether step 0 is skipped depends on every gradient, its late chunks'
    too, and step 1's parameters on that. (A first chunk of one position a table, so
    that late chunks exist at this size.)"""
    monkeypatch.setattr(
        priority, "first_chunk_need", lambda reads, tables, workers: {t.index: 1 for t in tables}
    )
    lm = dict(vocab=512, dim=128, hidden=128, seq_len=8, batch=64, sampled_softmax=16)
    monkeypatch.setitem(globals(), "README", lm)
    w, ts = built("lstm_lm", "embrace_2d", compile_only.gpu_mesh("h100"), nonfinite=nonfinite)
    _, state = compiled(ts, w, (0, 2))
    program, _ = compiled(ts, w, (2, 2), state)
    across = late_windows(program.as_text())
    if nonfinite == "off":
        assert across[0] > 0, across
    else:
        assert sum(across.values()) == 0, across


@pytest.mark.processes
def test_gpu_check_compares_a_card_with_its_compile_only_program():
    """``experiments.gpu_check``'s comparison, on this host: the first model's dense
    step compiled in the child process (``gpu_schedule --gpus 1``) is the program this
    process compiles for one compile-only H100, operation for operation; where the
    backend is no GPU the comparison is skipped, saying why."""
    from experiments import gpu_check
    from experiments.train.config import RunConfig
    from experiments.train.run import build

    size = dict(README, batch=4)
    config = RunConfig(model="lstm_lm", devices=1, strategy="dense", **size)
    workload, ts = build(config, mesh=compile_only.gpu_mesh("h100", per_host=1))
    program, _ = compiled(ts, workload)
    here = gpu_check.program_summary(
        program.as_text(), program.memory_analysis().peak_memory_in_bytes
    )
    there = gpu_check.compile_only_summary("h100", "lstm_lm", size)
    assert here["opcodes"] and here == there
    same = gpu_check.compare_programs(here, there)
    assert same["same_opcodes"] and not same["opcodes_that_differ"]
    other = dict(here, opcodes={**here["opcodes"], "fusion": here["opcodes"]["fusion"] + 1})
    assert gpu_check.compare_programs(other, there)["opcodes_that_differ"] == {
        "fusion": [here["opcodes"]["fusion"] + 1, here["opcodes"]["fusion"]]
    }
    assert gpu_check.card_of("NVIDIA H100 80GB HBM3") == "h100"
    skipped = gpu_check.schedule_comparison({"model": "lstm_lm", "program": here}, size, "cpu")
    assert "no compile-only description" in skipped["skipped"]


def test_the_papers_scale_study_on_a_small_lm():
    """``experiments.studies.gpu_scale`` on a small LM for 8 H100s: ``embrace`` sends
    fewer bytes a GPU than ``dense`` and needs less memory, and the modelled time is the
    link model applied to the compiled collectives (NVLink on one host)."""
    from experiments.studies import gpu_scale

    small = dict(README, per_gpu=2)
    dense, embrace = (gpu_scale.measure("lstm_lm", small, s, hosts=1) for s in ("dense", "embrace"))
    assert embrace["runs_as"] == "embrace" and embrace["link"] == "NVLink"
    assert 0 < embrace["mb_a_gpu"] < dense["mb_a_gpu"]
    assert 0 < embrace["peak_gb"] <= dense["peak_gb"] and embrace["fits"]
    assert embrace["collectives"] > 0 and embrace["comm_ms"] > 0
    # the modelled time is at least the bytes sent over NVLink's bandwidth, plus latency
    beta = gpu_scale.LINKS["nvlink"].beta
    assert embrace["comm_ms"] > 1e3 * embrace["mb_a_gpu"] * 1e6 * beta
    table = gpu_scale.table([{"workload": "LM", **dense}, {"workload": "LM", **embrace}])
    assert table.count("| LM | 8 |") == 2 and "`embrace`" in table
