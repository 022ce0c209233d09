"""--executor batched: the thread executor's traffic byte for byte, its models up to float rounding."""
from __future__ import annotations

import asyncio
import copy
import json
import types

import pytest
import torch

from p2p_emulator.runs import run
from emulator.clock import VirtualClock
from emulator.compute import BatchedExecutor, Compute, ComputeModel, ThreadExecutor
from tests.conftest import assert_refused
from p2p_emulator.workloads import batched
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import HeavyBall, accuracy, flat, float_state, mean_loss, mix, sgd

TRAFFIC = ("links.csv", "messages.jsonl")  # per-link bytes and every message's send and arrival times
QUIET = dict(trace=True, quiet=True, no_plots=True, model="mlp:hidden=32")
# Traffic that does not depend on model values; other seeds, sizes and horizons than the defaults.
RUNS = {
    "dfedavgm": dict(protocol="dfedavgm", topology="regular:d=4", nodes=10, rounds=3, seed=1),
    "dfedavgm-steps": dict(protocol="dfedavgm", topology="ring", nodes=7, rounds=4, seed=5, local_steps=3,
                           partition="dirichlet:alpha=0.3"),
    "dpsgd": dict(protocol="dpsgd", topology="regular:d=3", nodes=8, rounds=3, seed=2),
    "fedavg": dict(protocol="fedavg", topology="star", nodes=9, rounds=3, seed=3, lr=0.5),
    "gossip-learning": dict(protocol="gossip-learning", topology="regular:d=4", nodes=12, rounds=5, seed=4),
}


@pytest.fixture
def final_models(monkeypatch):
    """Each run's final models (flattened, by (node, key)), caught as its executor closes."""
    caught = []
    close = ThreadExecutor.close

    def keep_models(self):
        caught.append({key: flat(float_state(value)) for key, value in self.store.items()
                       if isinstance(value, torch.nn.Module)})
        close(self)
    monkeypatch.setattr(ThreadExecutor, "close", keep_models)
    return caught


def _read(out, name):
    return (out / name).read_bytes()


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_batched_runs_send_the_thread_runs_bytes_and_train_the_same_models(name, tmp_path, final_models):
    settings = {**QUIET, **RUNS[name]}
    run(**settings, out=str(tmp_path / "thread"))
    batch = run(**settings, executor="batched", out=str(tmp_path / "batched"))
    assert batch.summary["executor"]["batched_jobs"] > 0
    for name_ in TRAFFIC:
        assert _read(tmp_path / "thread", name_) == _read(tmp_path / "batched", name_), name_
    before, after = final_models
    assert before.keys() == after.keys() and before
    for key in before:
        assert torch.linalg.vector_norm(before[key] - after[key]) <= 1e-5 * torch.linalg.vector_norm(before[key]), key
    for a, b in zip(_metrics(tmp_path / "thread"), _metrics(tmp_path / "batched"), strict=True):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a), (a, b)


@pytest.mark.parametrize("compress_op", ["sign", "topk:0.1"])
def test_choco_trains_batched_with_its_carried_momentum_and_the_thread_runs_bytes(compress_op, tmp_path):
    """CHOCO's momentum carries from round to round (sgd's carried=): its steps batch all the same, and as on
    full batches of this model the gradients and the reported losses are sgd's to the bit, the run is the thread run."""
    settings = dict(QUIET, protocol="choco", topology="regular:d=4", nodes=6, rounds=3, seed=5, compress_op=compress_op)
    run(**settings, out=str(tmp_path / "thread"))
    batch = run(**settings, executor="batched", out=str(tmp_path / "batched"))
    jobs = batch.summary["executor"]["job_seconds"]
    assert "sgd (batched)" in jobs and "sgd" not in jobs
    assert batch.summary["executor"]["batched_jobs"] == 2 * 6 * 3  # each node's sgd and accuracy, every round
    for name in (*TRAFFIC, "metrics.jsonl"):
        assert _read(tmp_path / "thread", name) == _read(tmp_path / "batched", name), name


@pytest.mark.parametrize("settings", [
    dict(protocol="local", topology="ring", nodes=6, rounds=3, seed=6),
    dict(protocol="mapl+", topology="mesh", nodes=6, rounds=2, local_epochs=1, partition="mapl:scenario=1"),
])
def test_local_and_mapl_plus_run_batched(settings, tmp_path, final_models):
    """Local trains batched; MAPL+ evaluates batched (its training, PML, runs node by node)."""
    thread = run(**QUIET, **settings, out=str(tmp_path / "thread"))
    batch = run(**QUIET, **settings, executor="batched", out=str(tmp_path / "batched"))
    assert batch.summary["executor"]["batched_jobs"] > 0
    before, after = final_models
    assert all(torch.linalg.vector_norm(before[k] - after[k]) <= 1e-5 * torch.linalg.vector_norm(before[k])
               for k in before)
    assert thread.summary["final"]["test_acc"] == pytest.approx(batch.summary["final"]["test_acc"], abs=1e-6)


def test_batched_runs_are_byte_identical_to_each_other(tmp_path):
    settings = {**QUIET, **RUNS["gossip-learning"], "executor": "batched"}
    run(**settings, out=str(tmp_path / "a"))
    run(**settings, out=str(tmp_path / "b"))
    for name in (*TRAFFIC, "metrics.jsonl"):
        assert _read(tmp_path / "a", name) == _read(tmp_path / "b", name), name


def test_unbatchable_jobs_run_unchanged(tmp_path):
    """MAPL's training (PML) has no batched form, and hetero-small gives nodes different models: the run
    keeps the thread run's traffic, and its scores agree."""
    settings = dict(QUIET, protocol="mapl", topology="mesh", nodes=6, rounds=2, model="hetero-small",
                    partition="mapl:scenario=1", local_epochs=1)
    thread = run(**settings, out=str(tmp_path / "thread"))
    batch = run(**settings, executor="batched", out=str(tmp_path / "batched"))
    for name in TRAFFIC:
        assert _read(tmp_path / "thread", name) == _read(tmp_path / "batched", name), name
    assert thread.summary["final"]["test_acc"] == pytest.approx(batch.summary["final"]["test_acc"], abs=1e-6)


def test_measured_compute_time_charges_each_job_an_equal_share_of_its_batch(monkeypatch):
    """docs/batched.md, Emulated time: with --compute-time measured each job of a batch is charged the batch's
    wall time over the number of jobs in it, times --compute-factor and its node's slowdown; a job alone in
    its batch is charged its own wall time. The executor's wall clock is a fake one that only the jobs move:
    batch "a" (4 jobs) takes 8 s, batch "b" (2 jobs) 3 s, and "c" (1 job, run as fn itself) 0.75 s."""
    wall = [100.0]
    monkeypatch.setattr("emulator.compute.time", types.SimpleNamespace(perf_counter=lambda: wall[0]))
    took = {"a": 8.0, "b": 3.0, "c": 0.75}

    def job(x, group):
        wall[0] += took[group]
        return 10 * x

    def together(calls):
        wall[0] += took[calls[0][0][1]]
        return [10 * x for (x, _), _ in calls]

    groups = ["a", "a", "b", "a", "c", "b", "a"]  # node i's job joins batch groups[i]
    slowdowns = (1.0, 2.0, 0.5, 4.0, 1.0, 3.0, 0.25)
    executor = BatchedExecutor(1, {job: types.SimpleNamespace(key=lambda x, group: group, run=together)}, {})
    clock = VirtualClock()
    compute = Compute(ComputeModel("measured", 0.0, 1.5, slowdowns), clock, executor=executor)

    async def node(i):
        return await compute.run(i, job, (i, groups[i]), {}, work=1.0), clock.now

    async def every_node():
        return await asyncio.gather(*(node(i) for i in range(len(groups))))

    with executor:
        finished = clock.run(every_node())
        # a: 8 / 4 = 2 s each, b: 3 / 2 = 1.5 s each, c: 0.75 s; times 1.5 and the node's slowdown
        charged = [3.0, 6.0, 1.125, 12.0, 1.125, 6.75, 0.75]
        assert finished == [(10 * i, t) for i, t in enumerate(charged)]
        assert compute.busy_seconds == charged
        assert executor.stats() == {"kind": "batched", "job_seconds": {"job": 0.75, "job (batched)": 11.0},
                                    "batches": 2, "batched_jobs": 6}


# -- the batched jobs against the plain ones, outside any run

def _nodes(spec: str, sizes: list[int], shape=(1, 8, 8), seed=0):
    gen = torch.Generator().manual_seed(seed)
    models = [build_model(spec, shape, 10, init_seed=i) for i in range(len(sizes))]
    data = [(torch.randn(n, *shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)) for n in sizes]
    return models, data


def _relative_gap(a, b) -> float:
    a, b = flat(float_state(a)), flat(float_state(b))
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a))


@pytest.mark.parametrize("spec, sizes, kw", [
    ("mlp:hidden=32", [40, 40, 37, 70, 3, 1, 0], dict(epochs=2, steps=0, momentum=0.9, weight_decay=5e-4)),
    ("mlp:hidden=64,32", [20, 33, 33], dict(epochs=1, steps=5, momentum=0.0, weight_decay=0.0)),
    ("cnn-small", [24, 24, 17, 5], dict(epochs=1, steps=0, momentum=0.9, weight_decay=5e-4)),  # BatchNorm
])
def test_sgd_together_is_sgd_node_by_node(spec, sizes, kw):
    models, data = _nodes(spec, sizes)
    alone = [copy.deepcopy(m) for m in models]
    kw = dict(kw, lr=0.05, batch_size=16)
    for r in range(3):
        expected = [sgd(m, x, y, generator=torch.Generator().manual_seed(10 * r + i), **kw)
                    for i, (m, (x, y)) in enumerate(zip(alone, data))]
        got = batched.sgd_together([((m, x, y), dict(kw, generator=torch.Generator().manual_seed(10 * r + i)))
                                    for i, (m, (x, y)) in enumerate(zip(models, data))])
        assert [n for _, n in got] == [n for _, n in expected]  # the same batches, one-sample ones skipped
        assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in expected], rel=1e-5)
    for a, b in zip(alone, models):
        assert _relative_gap(a, b) < 1e-5
        for (name, u), v in zip(a.state_dict().items(), b.state_dict().values()):
            if not u.is_floating_point():
                assert torch.equal(u, v), name  # BatchNorm's batch counts


def test_sgd_together_steps_each_nodes_carried_momentum_as_sgd_does():
    models, data = _nodes("mlp:hidden=32", [40, 37, 3])
    alone = [copy.deepcopy(m) for m in models]
    kw = dict(epochs=1, steps=0, lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=16)
    carried = [HeavyBall(m, kw["lr"], kw["momentum"], kw["weight_decay"]) for m in models]
    carried_alone = [HeavyBall(m, kw["lr"], kw["momentum"], kw["weight_decay"]) for m in alone]
    for r in range(3):
        expected = [sgd(m, x, y, generator=torch.Generator().manual_seed(10 * r + i), carried=c, **kw)
                    for i, (m, (x, y), c) in enumerate(zip(alone, data, carried_alone))]
        got = batched.sgd_together([((m, x, y), dict(kw, generator=torch.Generator().manual_seed(10 * r + i),
                                                     carried=c))
                                    for i, (m, (x, y), c) in enumerate(zip(models, data, carried))])
        assert [n for _, n in got] == [n for _, n in expected]
        assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in expected], rel=1e-5)
    for a, b, ca, cb in zip(alone, models, carried_alone, carried):
        assert _relative_gap(a, b) < 1e-5
        for p, q in zip(a.parameters(), b.parameters()):  # the buffers a fourth call would step with
            u, v = ca.optimizer.state[p]["momentum_buffer"], cb.optimizer.state[q]["momentum_buffer"]
            assert torch.linalg.vector_norm(u - v) <= 1e-5 * torch.linalg.vector_norm(u)


def test_a_stack_is_the_models_storage_not_a_second_copy():
    models, data = _nodes("mlp:hidden=32", [10, 10, 10])
    kw = dict(epochs=1, steps=0, lr=0.1, momentum=0.9, weight_decay=0.0, batch_size=4)
    batched.sgd_together([((m, x, y), dict(kw, generator=torch.Generator())) for m, (x, y) in zip(models, data)])
    storages = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    assert len(storages) == len(list(models[0].parameters()))  # one storage per tensor name, shared by the nodes
    before = [flat(float_state(m)) for m in models]
    # a later job over the same models in another order works in place and hands each node its own result
    results = batched.accuracy_together([((m, x, y), {}) for m, (x, y) in reversed(list(zip(models, data)))])
    assert results == [accuracy(m, x, y) for m, (x, y) in reversed(list(zip(models, data)))]
    assert all(torch.equal(b, flat(float_state(m))) for b, m in zip(before, models))


def test_a_subset_of_a_stack_trains_and_writes_back():
    models, data = _nodes("mlp:hidden=32", [12, 12, 12, 12])
    alone = [copy.deepcopy(m) for m in models]
    kw = dict(epochs=1, steps=0, lr=0.1, momentum=0.9, weight_decay=0.0, batch_size=4)
    batched.sgd_together([((m, x, y), dict(kw, generator=torch.Generator().manual_seed(i)))
                          for i, (m, (x, y)) in enumerate(zip(models, data))])
    for i, (m, (x, y)) in enumerate(zip(alone, data)):
        sgd(m, x, y, generator=torch.Generator().manual_seed(i), **kw)
    batched.sgd_together([((models[i], *data[i]), dict(kw, generator=torch.Generator().manual_seed(7))) for i in (3, 1)])
    for i in (3, 1):
        sgd(alone[i], *data[i], generator=torch.Generator().manual_seed(7), **kw)
    assert all(_relative_gap(a, b) < 1e-5 for a, b in zip(alone, models))


@pytest.mark.parametrize("job, together", [(accuracy, batched.accuracy_together),
                                           (mean_loss, batched.mean_loss_together)])
def test_evaluation_together_is_evaluation_node_by_node(job, together):
    models, data = _nodes("cnn-small", [9, 30, 1, 0, 30], shape=(1, 12, 12))
    expected = [job(m, x, y, 8) for m, (x, y) in zip(models, data)]
    got = together([((m, x, y, 8), {}) for m, (x, y) in zip(models, data)])
    assert got[3] != got[3] and expected[3] != expected[3]  # no samples: NaN
    assert got[:3] + got[4:] == pytest.approx(expected[:3] + expected[4:], rel=1e-5)


def test_the_shortcuts_give_the_plain_jobs_results():
    models, _ = _nodes("cnn-small", [1, 1, 1], shape=(1, 12, 12))
    plain, quick = copy.deepcopy(models[0]), models[0]
    others = [(0.25, float_state(models[1])), (0.5, float_state(models[2]))]
    mix(plain, 0.25, others)
    batched.mix_by_layout(quick, 0.25, others)
    assert list(batched.float_state_by_layout(quick)) == list(float_state(plain))
    assert all(torch.equal(a, b) for a, b in zip(float_state(plain).values(),
                                                  batched.float_state_by_layout(quick).values()))


def test_models_of_other_architectures_or_options_do_not_share_a_batch():
    mlp, data = _nodes("mlp:hidden=32", [8, 8])
    other, _ = _nodes("mlp:hidden=16", [8])
    kw = dict(epochs=1, steps=0, lr=0.1, momentum=0.9, weight_decay=0.0, batch_size=4, generator=None)
    key = batched.BATCHERS[sgd].key
    assert key(mlp[0], *data[0], **kw) == key(mlp[1], *data[1], **kw)
    assert key(other[0], *data[0], **kw) != key(mlp[0], *data[0], **kw)
    assert key(mlp[0], *data[0], **{**kw, "lr": 0.2}) != key(mlp[1], *data[1], **kw)
    assert key(mlp[0], *data[0], **kw, forward=lambda x, y: x) is None  # a custom forward pass runs alone
    carried = [HeavyBall(m, kw["lr"], kw["momentum"], kw["weight_decay"]) for m in mlp]
    assert key(mlp[0], *data[0], **kw, carried=carried[0]) == key(mlp[1], *data[1], **kw, carried=carried[1])
    assert key(mlp[0], *data[0], **kw, carried=carried[0]) != key(mlp[0], *data[0], **kw)
    assert key(mlp[0], *data[0], **kw, carried=carried[1]) is None  # another model's optimizer
    assert key(mlp[0], *data[0], **{**kw, "lr": 0.2}, carried=carried[0]) is None  # sgd would step with 0.1
    cnn, images = _nodes("cnn-small", [8], shape=(1, 12, 12))
    assert key(cnn[0], *images[0], **kw) is None  # convolutions on a CPU: one node after another is faster


@pytest.mark.parametrize("flags, named", [
    (["--executor", "batched", "--clock", "real"], "--executor batched"),
    (["--executor", "batches"], "--executor"),
])
def test_bad_batched_flags_are_one_line_and_exit_2(capsys, tmp_path, flags, named):
    assert_refused(capsys, [*flags, "--rounds", "1", "--quiet"], named, tmp_path / "r")
