"""Managed tables (``embedding.managed``): the id-to-slot mapping against a plain Python
reference of the same policy, step by step, and a sharded step with managed tables
against a numpy reference of the rows and the optimizer state."""

import collections
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_main

from sparsecomm_jax import make_train_step, runtime
from sparsecomm_jax.embedding import managed
from sparsecomm_jax.embedding.managed import Policy, Vocabulary

M64 = (1 << 64) - 1


def splitmix(z: int) -> int:
    """splitmix64's finalizer in Python integers (the owner hash, written apart)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def owner(i: int, workers: int) -> int:
    return splitmix(i & M64) % workers


class Reference:
    """The policy of ``embedding.managed`` in dicts and loops: slot -> id, id -> slot,
    scores, waiting counts."""

    def __init__(self, slots: int, workers: int, policy: Policy):
        self.n, self.g, self.policy = slots, workers, policy
        self.b = -(-slots // workers)
        self.slot_id, self.id_slot, self.score, self.pending = {}, {}, {}, {}
        self.steps = self.evictions = 0

    def block(self, w: int) -> list[int]:
        return list(range(w * self.b + 1, min((w + 1) * self.b, self.n)))

    def map(self, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        self.steps += 1
        lru = self.policy.eviction == "lru"
        reads = collections.Counter(ids)
        read = set()
        for i, c in reads.items():
            if i in self.id_slot:
                s = self.id_slot[i]
                read.add(s)
                self.score[s] = self.steps if lru else self.score[s] + c
        new = {i: c + self.pending.get(i, 0) for i, c in reads.items() if i not in self.id_slot}
        fresh, fresh_ids = [], []
        for w in range(self.g):
            ready = sorted(
                (i for i, t in new.items() if t >= self.policy.threshold and owner(i, self.g) == w),
                key=lambda i: (-new[i], i),
            )
            order = sorted(
                (s for s in self.block(w) if s not in read),
                key=lambda s: (self.score[s] + 1 if s in self.slot_id else 0, s),
            )
            for i, s in zip(ready, order, strict=False):
                if self.policy.compete and s in self.slot_id and new[i] <= self.score[s]:
                    break  # this id and every later one (fewer reads, higher scores) waits
                if s in self.slot_id:
                    del self.id_slot[self.slot_id[s]]
                    self.evictions += 1
                self.slot_id[s], self.id_slot[i] = i, s
                self.score[s] = self.steps if lru else new[i]
                fresh.append(s)
                fresh_ids.append(i)
        for i, t in new.items():
            if i in self.id_slot:
                self.pending.pop(i, None)
            else:
                self.pending[i] = t
        kept = sorted(self.pending.items(), key=lambda kv: (-kv[1], kv[0]))[: self.n]
        self.pending = dict(kept)
        out = [self.id_slot.get(i, owner(i, self.g) * self.b) for i in ids]
        return out, fresh, fresh_ids


def stream(rng, steps: int, batch: int, distinct: int, exponent: float) -> list[np.ndarray]:
    """Zipf-skewed batches over ``distinct`` ids of extreme values (0, 2^63 - 1, -2^63,
    negatives): many ties in reads and scores."""
    values = rng.integers(-(2**63), 2**63 - 1, size=distinct, dtype=np.int64)
    values[:4] = [0, 2**63 - 1, -(2**63), -1]
    weights = 1.0 / np.arange(1, distinct + 1) ** exponent
    weights /= weights.sum()
    return [rng.choice(values, size=batch, p=weights) for _ in range(steps)]


COMPILER = shutil.which("c++") or shutil.which("g++")
#: Both ways a ``Vocabulary`` maps: numpy, and the compiled kernel where it can be built.
BACKENDS = [
    pytest.param(False, id="numpy"),
    pytest.param(
        True,
        id="kernel",
        marks=pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine"),
    ),
]


@pytest.mark.parametrize("kernel", BACKENDS)
@pytest.mark.parametrize(
    "eviction,threshold,workers,slots",
    [
        ("lru", 1, 4, 24),
        ("lfu", 1, 2, 21),
        ("lru", 3, 2, 16),
        ("lfu", 2, 4, 40),
        ("lru", 1, 1, 9),
        ("lfu+compete", 1, 2, 22),
        ("lfu+compete", 2, 4, 32),
    ],
)
def test_mapping_matches_the_reference_every_step(eviction, threshold, workers, slots, kernel):
    rng = np.random.default_rng(slots)
    kind, _, compete = eviction.partition("+")
    policy = Policy(kind, threshold, compete=bool(compete))
    vocab = Vocabulary(slots, 3, workers, policy, kernel=kernel)
    ref = Reference(slots, workers, policy)
    evicted = 0
    for ids in stream(rng, steps=40, batch=30, distinct=120, exponent=1.1):
        got, fresh = vocab.map(ids)
        want, want_fresh, want_ids = ref.map([int(i) for i in ids])
        assert got.tolist() == want
        zero = [w * ref.b for w in range(workers)]
        assert fresh.slots.tolist() == zero + want_fresh
        np.testing.assert_array_equal(
            fresh.rows[workers:], managed.initial_rows(np.array(want_ids, np.int64), 3, vocab.scale)
        )
        assert not fresh.rows[:workers].any()
        evicted += fresh.evicted
        state = vocab.state
        held = {int(s): int(state.ids[s]) for s in np.flatnonzero(state.used)}
        assert held == ref.slot_id
        assert {s: int(state.score[s]) for s in held} == ref.score
        waiting = int(state.waiting)
        assert (
            dict(zip(state.pending[:waiting].tolist(), state.seen[:waiting].tolist(), strict=True))
            == ref.pending
        )
    assert evicted == int(vocab.state.evictions) == ref.evictions > 0  # the slots filled


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize(
    "policy",
    [Policy("lru"), Policy("lfu"), Policy("lfu", 2), Policy("lfu", compete=True), Policy("lru", 3)],
    ids=["lru", "lfu", "lfu-K2", "lfu-compete", "lru-K3"],
)
def test_the_kernel_maps_a_long_stream_as_numpy_does(policy):
    """Thousands of evictions (the kernel's index deletes and re-inserts ids all along),
    more waiting ids than slots, and the mappings read back batches ago."""
    rng = np.random.default_rng(7)
    numpy_, kernel = (Vocabulary(400, 2, 4, policy, kernel=k) for k in (False, True))
    for ids in stream(rng, steps=60, batch=256, distinct=5000, exponent=0.9):
        (a, fa), (b, fb) = numpy_.map(ids), kernel.map(ids)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(fa.slots, fb.slots)
        np.testing.assert_array_equal(fa.rows, fb.rows)
        assert fa.evicted == fb.evicted
    for at in range(57, 61):
        for x, y in zip(numpy_.state_at(at), kernel.state_at(at), strict=True):
            np.testing.assert_array_equal(x, y)
    assert int(kernel.state.evictions) > 300 or policy.threshold > 1
    assert int(kernel.state.waiting) == 400 or policy.threshold == 1  # the cap reached
    absent = np.setdiff1d(rng.integers(-(2**63), 2**63 - 1, 1000), kernel.state.ids)
    assert (kernel.slot_of(absent) == -1).all()


@pytest.mark.processes
@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")
def test_the_kernel_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """Skewed streams with evictions, waiting ids past the cap, one worker and eight,
    extreme ids and empty batches under the sanitizers: no report, and the index agrees
    with the slots after every batch."""
    from sparsecomm_jax.embedding import mapkernel

    driver = tmp_path / "driver"
    flags = ["-O1", "-g", "-std=c++17", "-fsanitize=address,undefined"]
    flags += ["-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    sources = [str(Path(__file__).with_name("managed_kernel_driver.cc")), str(mapkernel.SOURCE)]
    subprocess.run([COMPILER, *flags, *sources, "-o", str(driver)], check=True)
    done = subprocess.run([str(driver)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("reads", [10, 10**15], ids=["counted", "selected"])
def test_the_kernel_keeps_the_most_read_waiting_ids_as_numpy_does(reads):
    """Over the cap of N waiting ids, with read counts small enough to count and large
    enough that the kernel selects instead: the same ids wait, ties to the lower id."""
    rng = np.random.default_rng(reads % 97)
    policy = Policy("lfu", threshold=2**62)  # nobody is admitted
    for _ in range(30):  # read counts drawn from a few values: the cut falls on ties
        slots = int(rng.integers(8, 40))
        waiting = np.sort(rng.choice(10**6, slots, replace=False)).astype(np.int64)
        seen = np.where(rng.random(slots) < 0.5, 1, reads + rng.integers(0, 3, slots))
        state = managed.VocabState.empty(slots)
        state = state._replace(pending=waiting, seen=seen, waiting=np.int64(slots))
        both = [Vocabulary(slots, 2, 2, policy, state, kernel=k) for k in (False, True)]
        fresh = rng.choice(np.arange(-(10**6), 10**6), 2 * slots)
        ids = np.concatenate([rng.choice(waiting, slots // 4), fresh, fresh[: slots // 2]])
        for vocab in both:
            vocab.map(ids)
        for x, y in zip(*(v.state for v in both), strict=True):
            np.testing.assert_array_equal(x, y)
        assert int(both[1].state.waiting) == slots


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on this machine")
def test_the_kernel_starts_rows_as_initial_rows_does_to_the_bit():
    from sparsecomm_jax.embedding import mapkernel

    rng = np.random.default_rng(5)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 500), [0, -1, 2**63 - 1, -(2**63)]])
    for dim, scale in [(1, 0.5), (3, 1 / np.sqrt(50_000)), (16, 0.0), (64, 3.7)]:
        want = managed.initial_rows(ids, dim, scale)
        got = mapkernel.initial_rows(ids, scale, np.empty((ids.size, dim), np.float32))
        assert got.tobytes() == want.tobytes()


def _saved(slots=16, workers=2):
    vocab = Vocabulary(slots, 2, workers, Policy("lfu", 2))
    for ids in stream(np.random.default_rng(3), steps=6, batch=20, distinct=40, exponent=1.0):
        vocab.map(ids)
    return vocab.state


def _held(state, k):
    return int(np.flatnonzero(state.used)[k])


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda s: s._replace(score=s.score[:4]), "score is int64.4."),
        (lambda s: s._replace(seen=s.seen[:3]), "seen is int64.3."),
        (lambda s: s._replace(used=s.used.astype(np.float32)), "used is float32"),
        (lambda s: s.score.__setitem__(_held(s, 0), -5) or s, "negative"),
        (lambda s: s.used.__setitem__(0, True) or s, "out of order"),
        (lambda s: s.used.__setitem__(_held(s, 0), False) or s, "out of order"),
        (lambda s: s.ids.__setitem__(_held(s, 1), s.ids[_held(s, 0)]) or s, "held in two"),
        (lambda s: s._replace(pending=s.pending[::-1].copy()), "ascending"),
        (lambda s: s._replace(waiting=np.int64(17)), "at most 16"),
    ],
)
def test_a_saved_mapping_the_table_cannot_have_written_is_refused(damage, message):
    """A damaged or hand-written checkpoint never reaches the mapping (the kernel would
    read and write past its arrays): one error naming what is wrong."""
    state = _saved()
    assert int(state.waiting) > 1 and int(state.used.sum()) > 1  # the damage lands
    Vocabulary(16, 2, 2, Policy("lfu", 2), state)  # intact: accepted
    with pytest.raises(ValueError, match=message):
        Vocabulary(16, 2, 2, Policy("lfu", 2), damage(state))


def test_without_a_compiler_the_mapping_runs_in_numpy_and_says_so(monkeypatch):
    from sparsecomm_jax.embedding import mapkernel
    from sparsecomm_jax.topk import hostkernel

    build = hostkernel.build  # with a compiler that fails
    monkeypatch.setattr(hostkernel, "build", lambda **kw: build(compiler="false", **kw))
    with pytest.warns(UserWarning, match="host kernel is not used.*mapped to slots by numpy"):
        assert mapkernel._library.__wrapped__() is None
    monkeypatch.setattr(mapkernel, "_library", lambda: None)
    vocab = Vocabulary(16, 2, 2)
    assert not vocab.kernel and vocab.map(np.array([3, -3]))[0].tolist() == [1, 9]
    with pytest.raises(RuntimeError, match="cannot be built here"):
        Vocabulary(16, 2, 2, kernel=True)


def test_distinct_ids_never_share_a_slot_while_they_fit():
    rng = np.random.default_rng(0)
    vocab = Vocabulary(64, 2, 4, Policy("lfu"))
    for ids in stream(rng, steps=20, batch=50, distinct=200, exponent=0.8):
        slots, _ = vocab.map(ids)
        owned = collections.defaultdict(set)
        for i, s in zip(ids.tolist(), slots.tolist(), strict=True):
            owned[s].add(i)
        zero = set(range(0, 64, 16))
        assert all(len(v) == 1 for s, v in owned.items() if s not in zero)


def test_a_batch_of_more_new_ids_than_slots_admits_the_most_read():
    vocab = Vocabulary(4, 2, 1, Policy("lru"))  # 3 slots for ids, slot 0 the zero row
    ids = np.array([5, 5, 5, 9, 9, 7, 7, 1, 2])
    slots, fresh = vocab.map(ids)
    assert dict(zip(ids.tolist(), slots.tolist(), strict=True)) == {
        5: 1,
        7: 2,
        9: 3,
        1: 0,
        2: 0,
    }  # ties: lower id first
    assert vocab.state.pending[: vocab.state.waiting].tolist() == [1, 2]  # one read each


def test_a_mapping_reads_back_as_it_stood_batches_ago():
    rng = np.random.default_rng(2)
    batches = stream(rng, steps=10, batch=20, distinct=60, exponent=1.0)
    a, b = Vocabulary(20, 2, 2, Policy("lru", 2)), Vocabulary(20, 2, 2, Policy("lru", 2))
    for ids in batches:
        a.map(ids)
    for ids in batches[:7]:
        b.map(ids)
    for x, y in zip(a.state_at(7), b.state, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="read back to batch 6 at most"):
        a.state_at(5)


def test_a_saved_state_maps_as_the_vocabulary_it_came_from():
    rng = np.random.default_rng(1)
    batches = stream(rng, steps=12, batch=20, distinct=60, exponent=1.0)
    a = Vocabulary(20, 2, 2, Policy("lfu", 2))
    for ids in batches[:6]:
        a.map(ids)
    b = Vocabulary(20, 2, 2, Policy("lfu", 2), state=a.state)
    for ids in batches[6:]:
        assert a.map(ids)[0].tolist() == b.map(ids)[0].tolist()


def test_owners_are_balanced_under_skewed_values():
    ids = np.arange(100_000, dtype=np.int64) * 1024  # values sharing their low bits
    counts = np.bincount(managed.owner_of(ids, 8), minlength=8)
    assert counts.max() / counts.mean() < 1.05


@pytest.mark.parametrize(
    "policy,message",
    [
        (Policy("mru"), "eviction must be one of"),
        (Policy("lru", 0), "threshold must be an integer >= 1"),
        (Policy("lru", 1.5), "threshold must be an integer >= 1"),
        (Policy("lru", 1, -1.0), "init_scale must be a number >= 0"),
        (Policy("lru", compete=True), "compete compares read counts: it needs eviction lfu"),
        (Policy("lfu", compete=1), "compete must be true or false"),
    ],
)
def test_a_bad_policy_names_its_field(policy, message):
    with pytest.raises(ValueError, match=message):
        policy.checked()


def test_bad_slots_and_ids_are_refused():
    with pytest.raises(ValueError, match="has 6 slots: each of the 4 workers"):
        Vocabulary(6, 2, 4)
    with pytest.raises(ValueError, match="must be integers"):
        Vocabulary(8, 2, 2).map(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="has no field"):
        Policy.from_json({"eviction": "lru", "size": 3})


# ------------------------------------------------------------------ a sharded step


def _loss(p, b, emb):
    pooled = emb.lookup(p["emb"], b["ids"]).sum(1)  # [B, D]
    return jnp.mean((pooled @ p["w"] - b["y"]) ** 2)


class NumpyModel:
    """``_loss`` trained in float64 numpy on the reference mapping: rows started afresh
    as the policy says, then SGD, Adagrad or (on the rows a step reads) Adam."""

    def __init__(self, params, optimizer: str, lr: float, slots: int, workers: int, policy):
        self.table = np.array(params["emb"], np.float64)
        self.w = np.array(params["w"], np.float64)
        self.kind, self.lr, self.t = optimizer, lr, 0
        self.vocab = Reference(slots, workers, policy)
        self.scale = 1 / np.sqrt(slots) if policy.init_scale is None else policy.init_scale
        zeros = lambda x: np.zeros_like(x)  # noqa: E731
        self.state = {
            "sgd": {},
            "adagrad": {"emb": np.full_like(self.table, 0.1), "w": np.full_like(self.w, 0.1)},
            "adam": {
                "mu": [zeros(self.table), zeros(self.w)],
                "nu": [zeros(self.table), zeros(self.w)],
            },
        }[optimizer]

    def step(self, ids: np.ndarray, y: np.ndarray) -> float:
        out, fresh, fresh_ids = self.vocab.map([int(i) for i in ids.ravel()])
        zero = [w * self.vocab.b for w in range(self.vocab.g)]
        self.table[zero] = 0
        if fresh:
            self.table[fresh] = managed.initial_rows(
                np.array(fresh_ids, np.int64), self.table.shape[1], self.scale
            )
        self._restart(zero + fresh)
        slots = np.array(out).reshape(ids.shape)
        pooled = self.table[slots].sum(1)
        r = pooled @ self.w - y
        d = 2 * r / len(y)
        g_w = pooled.T @ d
        g_t = np.zeros_like(self.table)
        np.add.at(g_t, slots.ravel(), np.repeat(d, ids.shape[1])[:, None] * self.w)
        self._update(g_t, g_w, np.unique(slots))
        return float(np.mean(r**2))

    def _restart(self, slots):
        if self.kind == "adagrad":
            self.state["emb"][slots] = 0.1
        if self.kind == "adam":
            self.state["mu"][0][slots] = 0
            self.state["nu"][0][slots] = 0

    def _update(self, g_t, g_w, read):
        if self.kind == "sgd":
            self.table -= self.lr * g_t
            self.w -= self.lr * g_w
        elif self.kind == "adagrad":
            for key, x, g in (("emb", self.table, g_t), ("w", self.w, g_w)):
                self.state[key] += g**2
                x -= self.lr * g / np.sqrt(self.state[key] + 1e-7)
        else:
            self.t += 1
            mu, nu = self.state["mu"], self.state["nu"]
            for k, (x, g) in enumerate(((self.table, g_t), (self.w, g_w))):
                rows = read if k == 0 else slice(None)
                mu[k][rows] = 0.9 * mu[k][rows] + 0.1 * g[rows]
                nu[k][rows] = 0.999 * nu[k][rows] + 0.001 * g[rows] ** 2
                m_hat = mu[k][rows] / (1 - 0.9**self.t)
                v_hat = nu[k][rows] / (1 - 0.999**self.t)
                x[rows] -= self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


OPTIMIZERS = {"sgd": optax.sgd, "adagrad": optax.adagrad, "adam": optax.adam}


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy,optimizer,policy,replicas",
    [
        ("embrace_rowwise", "adam", Policy("lru", 2), 1),
        ("embrace", "sgd", Policy("lfu", 1), 1),
        ("embrace_rowwise", "adagrad", Policy("lfu", 2, 0.3), 2),
    ],
)
def test_a_sharded_step_matches_numpy(strategy, optimizer, policy, replicas):
    n = len(jax.devices())
    slots, dim, lr = 6 * n // replicas, 4, 0.05
    rng = np.random.default_rng(7)
    params = {
        "emb": rng.normal(size=(slots, dim)).astype(np.float32),
        "w": rng.normal(size=dim).astype(np.float32),
    }
    ts = make_train_step(
        _loss,
        OPTIMIZERS[optimizer](lr),
        runtime.data_mesh(),
        params,
        strategy,
        embedding_paths=["emb"],
        table_layouts={"emb": managed.layout({"emb": policy})},
        table_update="rows",
        replicas=replicas,
    )
    ref = NumpyModel(params, optimizer, lr, slots, n // replicas, policy)
    state = ts.state
    for ids in stream(rng, steps=10, batch=2 * n * 3, distinct=12 * slots, exponent=1.05):
        ids = ids.reshape(2 * n, 3)
        y = rng.normal(size=2 * n).astype(np.float32)
        state, loss = ts.step(state, ts.place_batch({"ids": ids, "y": y}))
        assert float(loss) == pytest.approx(ref.step(ids, y), rel=1e-4, abs=1e-6)
    got = ts.host_params(state)
    np.testing.assert_allclose(got["emb"], ref.table, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["w"], ref.w, rtol=1e-4, atol=1e-5)
    if optimizer == "adam":
        mu = np.asarray(jax.device_get(state.opt_state[0].mu["emb"]))
        np.testing.assert_allclose(mu[:slots], ref.state["mu"][0], rtol=1e-4, atol=1e-6)
    if optimizer == "adagrad":
        sums = np.asarray(jax.device_get(state.opt_state[0].sum_of_squares["emb"]))
        np.testing.assert_allclose(sums[:slots], ref.state["emb"], rtol=1e-4, atol=1e-6)
    assert sum(ts.vocabulary.evictions().values()) == ref.vocab.evictions > 0


def _managed_step(policy=None, optimizer=None, devices=None, rows=None, wire="float32"):
    """``embrace_rowwise`` of ``_loss`` on a table of ``rows`` (4 per device), managed
    by ``policy`` (LFU, K = 2; ``False``: the plain row layout), ``optimizer`` (Adam),
    its rows on ``wire``."""
    n = devices or len(jax.devices())
    rng = np.random.default_rng(3)
    params = {
        "emb": rng.normal(size=(rows or 4 * n, 3)).astype(np.float32),
        "w": np.ones(3, np.float32),
    }
    layouts = None
    if policy is not False:
        layouts = {"emb": managed.layout({"emb": policy or Policy("lfu", 2)})}
    return make_train_step(
        _loss,
        optimizer or optax.adam(0.05),
        runtime.data_mesh(devices),
        params,
        "embrace_rowwise",
        embedding_paths=["emb"],
        table_layouts=layouts,
        table_update="rows",
        comm_dtype=wire,
    )


def _batches(steps: int) -> list[dict]:
    n = len(jax.devices())
    rng = np.random.default_rng(4)
    ids = stream(rng, steps=steps, batch=2 * n * 2, distinct=20 * n, exponent=1.0)
    return [
        {"ids": i.reshape(2 * n, 2), "y": rng.normal(size=2 * n).astype(np.float32)} for i in ids
    ]


def test_a_resume_equals_the_uninterrupted_run(tmp_path):
    from sparsecomm_jax.checkpoint import Checkpointer

    batches = _batches(8)
    whole = _managed_step()
    done = whole.state
    for b in batches:
        done, _ = whole.step(done, whole.place_batch(b))
    first = _managed_step()
    state = first.state
    for b in batches[:4]:
        state, _ = first.step(state, first.place_batch(b))
    first.place_batch(batches[4])  # placed ahead of the step saved: undone in the save
    first.place_batch(batches[5])
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save_state(4, first, state, force=True)
    second = _managed_step()
    with Checkpointer(str(tmp_path)) as ckpt:
        resumed, step = ckpt.restore_state(second)
    assert step == 4
    for b in batches[4:]:
        resumed, _ = second.step(resumed, second.place_batch(b))
    for key in ("emb", "w"):
        np.testing.assert_array_equal(
            second.host_params(resumed)[key], whole.host_params(done)[key]
        )
    np.testing.assert_array_equal(resumed.opt_state[0].nu["emb"], done.opt_state[0].nu["emb"])
    a, b = whole.vocabulary.states()["emb"], second.vocabulary.states()["emb"]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ the command line

PLAN = (
    '{"params/sparse_0/embedding": "managed", "params/sparse_1/embedding": {"layout": '
    '"managed", "config": {"eviction": "lfu", "threshold": 2, "init_scale": null}}}'
)
RAW = ["--model", "dlrm", "--raw-ids", "--tables", "400,400", "--batch", "64", "--devices", "4"]


@pytest.mark.cli
def test_raw_ids_resume_through_the_command_line_as_one_run(tmp_path, capsys):
    """DLRM on raw 64-bit ids with managed tables, saved at step 10 while the loop has
    placed the batches after it, resumed: the losses and held-out metrics of the
    uninterrupted run."""
    import json

    common = [*RAW, "--strategy", "embrace_rowwise", "--plan", PLAN]
    whole, a, b = (tmp_path / n for n in ("whole.json", "a.json", "b.json"))
    ckpt = str(tmp_path / "ckpt")
    assert run_main([*common, "--steps", "20", "--out", str(whole)], capsys)[0] == 0
    first = ["--steps", "10", "--checkpoint-dir", ckpt, "--out", str(a)]
    assert run_main([*common, *first], capsys)[0] == 0
    args = ["--steps", "20", "--checkpoint-dir", ckpt, "--resume", "--out", str(b)]
    assert run_main([*common, *args], capsys)[0] == 0
    w, r = json.loads(whole.read_text()), json.loads(b.read_text())
    assert r["start_step"] == 10 and r["losses"] == w["losses"][10:]
    assert r["heldout"] == w["heldout"] and w["heldout"]["valid"]["loss"] < 0.75
    tables = w["managed_tables"]  # the mappings after 20 steps, as the resumed run has them
    assert r["managed_tables"] == tables and len(tables) == 2
    for t in tables.values():
        assert t["batches"] == 20 and 0 < t["held"] < t["slots"] == 400 and t["waiting"] >= 0


BAD_MANAGED = [
    (["--strategy", "embrace_2d", "--plan", PLAN], "--strategy embrace_2d cannot carry"),
    (
        ["--strategy", "embrace_rowwise", "--tables", "6,400", "--plan", PLAN],
        "the managed layout with 6 slots (its rows): each of the 4 workers",
    ),
    (
        ["--plan", PLAN.replace('"lfu"', '"mru"')],
        "argument --plan: the managed layout's configuration: eviction must be one of",
    ),
    (
        ["--plan", PLAN.replace('"threshold": 2', '"threshold": 0')],
        "threshold must be an integer >= 1",
    ),
    (["--plan", PLAN.replace("null", "-1")], "init_scale must be a number >= 0"),
    (["--plan", PLAN.replace('"eviction"', '"evict"')], "has no field ['evict']"),
    (
        ["--strategy", "embrace_rowwise", "--plan", PLAN, "--steps-per-call", "2"],
        "map each batch's ids as it is placed, one step a call",
    ),
]


@pytest.mark.parametrize(
    "args, message",
    BAD_MANAGED,
    ids=[
        "embrace_2d",
        "few slots",
        "eviction",
        "threshold",
        "init_scale",
        "stray field",
        "steps per call",
    ],
)
def test_bad_managed_input_is_one_line(args, message, capsys):
    code, lines = run_main([*RAW, "--steps", "2", *args], capsys)
    assert code == 2
    assert len(lines) == 1 and message in lines[0], lines


def test_raw_ids_without_a_managed_table_name_the_managed_layout(capsys):
    """Forgetting --plan: the first batch's raw ids are refused (after the progress bar
    has started: the ids are seen as the batch is placed), the error naming the layout."""
    code, lines = run_main([*RAW, "--steps", "2"], capsys)
    assert code == 2 and not any("Traceback" in line for line in lines)
    assert "a table of ids of any value takes the managed layout" in lines[-1], lines


def test_float_ids_of_a_managed_table_are_refused():
    ts = _managed_step()
    n = len(jax.devices())
    batch = {"ids": np.ones((2 * n, 2), np.float32), "y": np.zeros(2 * n, np.float32)}
    with pytest.raises(ValueError, match=r"batch\['ids'\] holds float32 values but feeds managed"):
        ts.place_batch(batch)


@pytest.mark.cli
def test_an_nnx_dlrm_trains_on_raw_ids(tmp_path, capsys):
    """The NNX DLRM's tables (named without Linen's ``params/``) take the managed
    layout as the Linen model's do, and its held-out metrics go through the mapping."""
    import json

    plan = '{"sparse_0/embedding": "managed", "sparse_1/embedding": "managed"}'
    out = tmp_path / "nnx.json"
    args = [*RAW[2:], "--model", "dlrm_nnx", "--strategy", "embrace_rowwise", "--plan", plan]
    assert run_main([*args, "--steps", "12", "--out", str(out)], capsys)[0] == 0
    result = json.loads(out.read_text())
    assert np.isfinite(result["losses"]).all() and result["heldout"]["valid"]["loss"] < 0.75


def test_a_checkpoint_restored_on_other_devices_keeps_every_ids_row(tmp_path):
    """Saved on 8 workers, restored on 4 and on 2: every held id's row, and its
    optimizer state, at the slot its new owner gives it; training goes on."""
    from sparsecomm_jax.checkpoint import Checkpointer

    def build(devices: int):
        return _managed_step(Policy("lru"), devices=devices, rows=48)

    rng = np.random.default_rng(5)
    saved = build(8)
    state = saved.state
    for ids in stream(rng, steps=4, batch=32, distinct=30, exponent=1.0):  # 30 ids fit
        batch = {"ids": ids.reshape(16, 2), "y": rng.normal(size=16).astype(np.float32)}
        state, _ = saved.step(state, saved.place_batch(batch))
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save_state(4, saved, state, force=True)
    before = saved.vocabulary.vocabularies[0]
    held = before.state.ids[before.state.used]
    rows = saved.host_params(state)["emb"][before.lookup(held)]
    nu = np.asarray(jax.device_get(state.opt_state[0].nu["emb"]))[before.lookup(held)]
    for devices in (4, 2):
        ts = build(devices)
        with Checkpointer(str(tmp_path)) as ckpt:
            got, step = ckpt.restore_state(ts)
        after = ts.vocabulary.vocabularies[0]
        assert step == 4 and (after.slot_of(held) >= 0).all()  # every id kept
        np.testing.assert_array_equal(ts.host_params(got)["emb"][after.lookup(held)], rows)
        got_nu = np.asarray(jax.device_get(got.opt_state[0].nu["emb"]))[after.lookup(held)]
        np.testing.assert_array_equal(got_nu, nu)
        batch = {"ids": held[:16].reshape(8, 2), "y": np.zeros(8, np.float32)}
        got, loss = ts.step(got, ts.place_batch(batch))
        assert np.isfinite(float(loss))


def test_rehash_onto_smaller_blocks_keeps_the_highest_scores():
    vocab = Vocabulary(16, 2, 2, Policy("lfu"))
    ids = np.arange(14, dtype=np.int64) * 7919
    vocab.map(np.repeat(ids, np.arange(1, 15)))  # id k read k + 1 times: its LFU score
    moved, old, new = managed.rehash(vocab.state, 8)  # blocks of 2: one id each
    owner = managed.owner_of(ids, 8)
    kept = moved.ids[moved.used]
    for w in range(8):
        mine = ids[owner == w]
        if mine.size:  # the most read id of each owner stays
            assert kept[managed.owner_of(kept, 8) == w].tolist() == [mine.max()]
    assert int(moved.evictions) == 14 - kept.size
    assert sorted(new.tolist()) == sorted(np.flatnonzero(moved.used).tolist())


def test_a_checkpoint_without_the_mappings_is_refused(tmp_path):
    from sparsecomm_jax.checkpoint import Checkpointer, MismatchError

    plain = _managed_step(policy=False)
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save_state(1, plain, plain.state, force=True)
        with pytest.raises(MismatchError, match="a table's ids and its rows go together"):
            ckpt.restore_state(_managed_step(), step=1)


def test_evaluation_and_saves_read_the_mapping_of_the_steps_run(tmp_path):
    """With batches placed ahead of the steps, held-out ids are looked up (and a save
    records the mapping) as they stood after the batches stepped; a save under
    another step number is refused."""
    from sparsecomm_jax.checkpoint import Checkpointer

    batches = _batches(6)
    ts, replay = _managed_step(), _managed_step()
    state = ts.state
    for b in batches[:3]:
        state, _ = ts.step(state, ts.place_batch(b))
        replay.vocabulary.map_batch(b)
    for b in batches[3:5]:
        ts.place_batch(b)  # placed ahead, not stepped
    held_out = batches[5]
    assert ts.vocabulary.stepped == 3
    got = ts.vocabulary.lookup_batch(held_out)["ids"]
    np.testing.assert_array_equal(got, replay.vocabulary.lookup_batch(held_out, at=3)["ids"])
    with Checkpointer(str(tmp_path)) as ckpt, pytest.raises(ValueError, match="has run 3 batches"):
        ckpt.save_state(2, ts, state, force=True)


def test_a_restore_that_changes_the_eviction_is_refused(tmp_path):
    from sparsecomm_jax.checkpoint import Checkpointer, MismatchError

    def build(eviction):
        return _managed_step(Policy(eviction), optax.sgd(0.1))

    with Checkpointer(str(tmp_path)) as ckpt:
        lru = build("lru")
        ckpt.save_state(0, lru, lru.state, force=True)
        with pytest.raises(MismatchError, match="by lru, this step by lfu"):
            ckpt.restore_state(build("lfu"))


def test_lfu_scores_beyond_the_limit_rank_without_overflow():
    vocab = Vocabulary(3, 2, 1, Policy("lfu"))  # the zero row and two slots
    vocab.map(np.array([10, 11]))
    state = vocab.state
    state.score[1] = 2**62  # id 10 read beyond count
    again = Vocabulary(3, 2, 1, Policy("lfu"), state=state)
    again.map(np.array([12]))  # evicts the less read id 11
    assert again.slot_of(np.array([10, 11, 12])).tolist() == [1, -1, 2]


@pytest.mark.matrix
@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3fn"])
def test_a_narrow_wire_carries_managed_rows(wire):
    """The managed table's rows and gradients travel in a narrow codec as a row table's
    do: the same mapping, losses within the codec's rounding of float32's."""
    batches = _batches(5)
    runs = {}
    for dtype in ("float32", wire):
        n = len(jax.devices())
        rng = np.random.default_rng(3)
        params = {
            "emb": rng.normal(size=(4 * n, 3)).astype(np.float32),
            "w": np.ones(3, np.float32),
        }
        ts = make_train_step(
            _loss,
            optax.sgd(0.05),
            runtime.data_mesh(),
            params,
            "embrace_rowwise",
            embedding_paths=["emb"],
            table_layouts={"emb": managed.layout({"emb": Policy("lru", 2)})},
            comm_dtype=dtype,
        )
        state, losses = ts.state, []
        for b in batches:
            state, loss = ts.step(state, ts.place_batch(b))
            losses.append(float(loss))
        runs[dtype] = (losses, ts.vocabulary.states()["emb"].ids)
    np.testing.assert_allclose(runs[wire][0], runs["float32"][0], rtol=0.05)
    np.testing.assert_array_equal(runs[wire][1], runs["float32"][1])


@pytest.mark.processes
def test_two_processes_map_and_train_as_one(tmp_path):
    """A job of 2 processes x 2 devices maps the global batch's raw ids on every
    process alike: the losses and held-out metrics of one process of 4 devices."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    train = [sys.executable, "-m", "experiments.train", *RAW[:-2], "--steps", "8"]
    train += ["--strategy", "embrace_rowwise", "--plan", PLAN]
    job, one = tmp_path / "job.json", tmp_path / "one.json"
    launch = [sys.executable, "-m", "sparsecomm_jax.launch", "--nproc", "2"]
    runs = [
        [*launch, "--devices-per-proc", "2", "--", *train, "--out", str(job)],
        [*train, "--devices", "4", "--out", str(one)],
    ]
    for cmd in runs:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    a, b = json.loads(job.read_text()), json.loads(one.read_text())
    assert a["losses"] == b["losses"] and a["heldout"] == b["heldout"]


# ------------------------------------------------------------------ the planner


def _two_tables(rng, batches: int, batch: int = 32):
    """A model reading ``raw`` (64 slots, raw int64 ids) and ``fixed`` (48 rows, ids in
    range), and sample batches of fresh random ids."""
    params = {
        "raw": jnp.zeros((64, 4)),
        "fixed": jnp.zeros((48, 4)),
        "w": jnp.zeros((4,)),
    }

    def loss(p, b, emb):
        x = emb.lookup(p["raw"], b["user"]).sum(1) + emb.lookup(p["fixed"], b["item"]).sum(1)
        return jnp.mean((x @ p["w"] - b["y"]) ** 2)

    out = [
        {
            "user": rng.integers(-(2**63), 2**63 - 1, size=(batch, 3), dtype=np.int64),
            "item": rng.integers(0, 48, size=(batch, 2)),
            "y": rng.normal(size=batch).astype(np.float32),
        }
        for _ in range(batches)
    ]
    return loss, params, out


def test_the_planner_measures_raw_ids_as_mapped_and_gives_them_the_managed_layout():
    """A table whose sample ids exceed its rows is measured on the slots a fresh
    mapping gives them (numpy reference: ``Vocabulary.map`` batch after batch, the
    distinct slots per worker and per (worker, owner) bucket) and takes the managed
    layout, the only one that serves it, at every bandwidth; the table of ids in range
    never takes it and is measured on its own ids as before."""
    from sparsecomm_jax import planner
    from sparsecomm_jax.comm.costmodel import Link

    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh ids each run
    loss, params, batches = _two_tables(np.random.default_rng(seed), 3)
    workers = 4
    stats = {s.name: s for s in planner.table_stats(loss, params, ["raw", "fixed"], batches, 4)}
    raw, fixed = stats["raw"], stats["fixed"]
    assert raw.raw and not fixed.raw, seed

    vocab, distinct, bucket = Vocabulary(64, 4, workers), 0, 0
    for b in batches:
        slots, _ = vocab.map(b["user"])
        for mine in np.split(slots, workers):  # each worker's slice of the batch
            uniq = np.unique(mine)
            distinct = max(distinct, uniq.size)
            bucket = max(bucket, int(np.bincount(uniq // 16, minlength=workers).max()))
    assert (raw.reads, raw.distinct, raw.bucket) == (8 * 3, distinct, bucket), seed
    items = [np.split(b["item"], workers) for b in batches]  # the fixed table's own ids
    assert fixed.distinct == max(np.unique(m).size for parts in items for m in parts), seed
    assert fixed.bucket == max(
        int(np.bincount(np.unique(m) // 12, minlength=workers).max()) for ps in items for m in ps
    )
    assert (fixed.reads, fixed.vocab) == (8 * 2, 48)

    for gbits in (0.1, 1.0, 100.0):
        link = Link.from_bandwidth(gbits)
        for plan in planner.candidate_plans(list(stats.values()), workers, link):
            layouts = plan.layouts()
            assert maps_ids(layouts["raw"]) and not maps_ids(layouts["fixed"])
    assert not planner.serves(raw, "row") and not planner.serves(fixed, "managed")


def maps_ids(layout) -> bool:
    """Whether a plan's layout (a name or a value) maps ids to rows (the managed one)."""
    from sparsecomm_jax.embedding import layout_registry

    return layout_registry.get(layout).maps_ids


def test_a_planned_step_trains_raw_ids_as_the_managed_layout_given_by_hand():
    """A user's path: the planner's layouts into ``make_train_step``, raw ids placed
    and stepped; the losses equal those of the same step with the managed layout given
    by hand for the raw table (and the plan's layout for the other)."""
    from sparsecomm_jax import planner
    from sparsecomm_jax.comm.costmodel import Link

    loss, params, batches = _two_tables(np.random.default_rng(), 4)
    params["w"] = jnp.ones(4)
    stats = planner.table_stats(loss, params, ["raw", "fixed"], batches[:2], 4)
    layouts = planner.plan_tables(stats, 4, Link.from_bandwidth(1.0)).layouts()
    by_hand = {"raw": managed.MANAGED, "fixed": layouts["fixed"]}

    def losses(table_layouts) -> list[float]:
        ts = make_train_step(
            loss,
            optax.adagrad(0.1),
            runtime.data_mesh(4),
            params,
            "embrace_rowwise",
            embedding_paths=["raw", "fixed"],
            table_layouts=table_layouts,
            table_update="rows",
        )
        state, out = ts.state, []
        for b in batches:
            state, value = ts.step(state, ts.place_batch(b))
            out.append(float(value))
        return out

    planned = losses(layouts)
    assert planned == losses(by_hand) and all(np.isfinite(planned)), planned


def test_negative_raw_ids_alone_make_a_table_raw():
    """Raw ids that happen to be all negative in the sample lie outside [0, V) too (a
    fixed vocabulary's step refuses them): the table is raw and planned managed."""
    from sparsecomm_jax import planner
    from sparsecomm_jax.comm.costmodel import Link

    loss, params, batches = _two_tables(np.random.default_rng(), 2)
    for b in batches:
        b["user"] = -np.abs(b["user"]) - 1  # every raw id negative
    stats = planner.table_stats(loss, params, ["raw", "fixed"], batches, 4)
    assert [s.raw for s in stats] == [False, True]  # leaf order: fixed, raw, w
    plan = planner.plan_tables(stats, 4, Link.from_bandwidth(1.0))
    assert maps_ids(plan.layouts()["raw"]) and not maps_ids(plan.layouts()["fixed"])


def test_raw_ids_on_too_few_slots_for_the_planner_name_the_table():
    from sparsecomm_jax import planner

    loss, params, batches = _two_tables(np.random.default_rng(0), 1)
    params["raw"] = jnp.zeros((6, 4))  # 6 slots cannot give 4 workers a block each
    with pytest.raises(ValueError, match="a table of raw ids takes the managed layout.*raw"):
        planner.table_stats(loss, params, ["raw", "fixed"], batches, 4)


def test_a_raw_key_that_feeds_two_tables_names_the_managed_layout():
    """Raw ids read by two tables cannot be mapped for either: the planner says why,
    naming the managed layout it would have given them."""
    from sparsecomm_jax import planner

    loss, params, batches = _two_tables(np.random.default_rng(0), 1)

    def both(p, b, emb):
        x = emb.lookup(p["raw"], b["user"]).sum(1) + emb.lookup(p["fixed"], b["user"]).sum(1)
        return jnp.mean((x @ p["w"] - b["y"]) ** 2)

    with pytest.raises(ValueError, match="a table of raw ids takes the managed layout.*own"):
        planner.table_stats(both, params, ["raw", "fixed"], batches, 4)
    with pytest.raises(ValueError, match="sample batches"):
        planner.table_stats(loss, params, ["raw", "fixed"], [], 4)


@pytest.mark.cli
@pytest.mark.matrix
@pytest.mark.parametrize("plan", ["model", "auto"])
def test_the_planner_gives_raw_ids_managed_tables_at_the_command_line(plan, tmp_path, capsys):
    """``--raw-ids --plan model`` (and ``auto``, which times its candidates): every
    table of raw ids planned managed, trained."""
    import json

    out = tmp_path / "run.json"
    args = [*RAW, "--strategy", "embrace_rowwise", "--plan", plan, "--steps", "3"]
    code, lines = run_main([*args, "--out", str(out)], capsys)
    assert code == 0, lines
    chosen = json.loads(out.read_text())["config"]["plan"]
    layouts = [x if isinstance(x, str) else x["layout"] for x in chosen.values()]
    assert layouts and all(maps_ids(x) for x in layouts), chosen
