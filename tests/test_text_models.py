"""LEAF's two reference models (char-lstm, leaf-cnn), what each model reads, and char-lstm under the protocols,
executors and DP-SGD."""
import json
import warnings

import pytest
import torch
from torch import nn

from conftest import assert_refused
from p2p_emulator.cli import main
from p2p_emulator.workloads import batched, privacy, prototypes, text
from p2p_emulator.workloads.model_specs import ModelError
from p2p_emulator.workloads.models import build_model, parameter_count
from tests.conftest import library_epsilon

V = text.VOCABULARY  # 81: LEAF's 80 characters and one unknown id; the classes are the same ids
SMALL = "char-lstm:hidden=16"


def lstm_layer(n_in: int, h: int) -> int:
    """TF's BasicLSTMCell: one kernel (n_in + h) x 4h and one bias 4h (forget bias 1.0 is a constant)."""
    return (n_in + h) * 4 * h + 4 * h


def leaf_char_lstm(vocabulary: int, h: int) -> int:
    """LEAF's Shakespeare model: embedding V x 8, two LSTM layers, dense h -> V with bias."""
    return vocabulary * 8 + lstm_layer(8, h) + lstm_layer(h, h) + h * vocabulary + vocabulary


def test_char_lstm_has_leafs_parameters_plus_pytorchs_second_lstm_bias():
    model = build_model("char-lstm", (80,), V, vocabulary=V)
    # PyTorch keeps b_ih and b_hh per gate where TF has one bias: 4h more per layer, two layers.
    assert parameter_count(model) == leaf_char_lstm(V, 256) + 2 * 4 * 256 == 820185
    assert model.d_z == 256


def test_leaf_cnn_has_leafs_parameters():
    # conv 5x5x1x32 + 32, conv 5x5x32x64 + 64, dense 7*7*64 -> 2048 with bias, dense 2048 -> 62 with bias
    leaf = (25 * 32 + 32) + (25 * 32 * 64 + 64) + (7 * 7 * 64 * 2048 + 2048) + (2048 * 62 + 62)
    assert parameter_count(build_model("leaf-cnn", (1, 28, 28), 62)) == leaf == 6603710


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_char_lstm_reads_ids_of_any_dtype_and_its_latent_is_the_last_lstm_output(dtype):
    model = build_model(SMALL, (80,), V, vocabulary=V, d_z=64, d_p=8, hidden=12)  # --d-z is ignored
    x = torch.randint(0, V, (3, 80)).to(dtype)
    z = model.features(x)
    expected = model.backbone.lstm(model.backbone.embed(x.long()))[0][:, -1]
    assert z.shape == (3, 16) and torch.equal(z, expected)
    assert model(x).shape == (3, V) and model.project(z).shape == (3, 8)
    assert isinstance(model.classifier[0], nn.Identity) and model.classifier[1].bias is not None
    model(x).sum().backward()
    assert model.backbone.embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_leaf_cnn_takes_any_image_size_and_has_a_2048_latent(shape):
    model = build_model("leaf-cnn", shape, 10, d_z=64)
    z = model.features(torch.randn(2, *shape))
    assert z.shape == (2, 2048) and model(torch.randn(2, *shape)).shape == (2, 10)
    assert isinstance(model.classifier[0], nn.ReLU) and model.classifier[1].bias is not None
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_mlp_reads_feature_vectors():
    model = build_model("mlp:hidden=8", (20,), 3)
    assert model(torch.randn(5, 20)).shape == (5, 3)


@pytest.mark.parametrize("spec,shape,vocabulary,words", [
    ("char-lstm", (1, 8, 8), 0, ["--model char-lstm reads token sequences", "gives images (1, 8, 8)"]),
    ("char-lstm", (20,), 0, ["reads token sequences", "feature vectors of 20 values", "use --model mlp"]),
    ("cnn-small", (80,), V, ["--model cnn-small reads images", "token sequences of length 80", "char-lstm"]),
    ("leaf-cnn", (20,), 0, ["--model leaf-cnn reads images", "feature vectors"]),
    ("hetero-small", (80,), V, ["--model hetero-small reads images", "token sequences"]),
    ("resnet18", (80,), V, ["--model resnet18 reads images"]),
    ("mlp", (80,), V, ["--model mlp reads images or feature vectors", "token sequences"]),
    ("leaf-cnn", (1, 3, 3), 0, ["leaf-cnn", "at least 4x4", "3x3"]),
    ("char-lstm:hidden=32,32", (80,), V, ["hidden is one width"]),
    ("char-lstm:channels=32", (80,), V, ["char-lstm:hidden=W"]),
])
def test_a_model_refuses_data_it_cannot_read_in_one_line(spec, shape, vocabulary, words):
    with pytest.raises(ModelError) as info:
        build_model(spec, shape, 10, num_nodes=4, vocabulary=vocabulary)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


def fortunes(root, *args, nodes=4, samples=60, test=20):
    return ["--dataset", "fortunes", "--data-root", str(root), "--partition",
            f"natural:nodes={nodes},samples={samples},test={test}", "--rounds", "2", "--quiet", "--no-plots", *args]


@pytest.mark.parametrize("on_fortunes,model,named", [
    (False, "char-lstm", "--model char-lstm reads token sequences"),
    (True, "cnn-small", "--model cnn-small reads images"),
    (True, "mlp", "--model mlp reads images or feature vectors"),
])
def test_the_cli_refuses_a_model_for_the_wrong_data_in_one_line(capsys, tmp_path, fortunes_root, on_fortunes, model,
                                                                named):
    data = fortunes(fortunes_root) if on_fortunes else ["--dataset", "digits"]
    assert_refused(capsys, ["--protocol", "local", "--nodes", "4", "--model", model, *data], named, tmp_path / "r")


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fedavg_trains_char_lstm_on_a_star(tmp_path, fortunes_root):
    out = tmp_path / "fedavg"
    assert main(["--protocol", "fedavg", "--topology", "star", "--nodes", "5", "--model", "char-lstm:hidden=32",
                 "--lr", "1", *fortunes(fortunes_root, samples=150, test=40), "--rounds", "3", "--out", str(out)]) == 0
    clients = [r for r in _rows(out) if r["node"] != 0]
    # every client sends the whole model: the LEAF count at hidden 32 plus PyTorch's second bias (2 x 4h)
    assert {r["params_sent"] for r in clients} == {leaf_char_lstm(V, 32) + 2 * 4 * 32}
    first, last = ({r["node"]: r["train_loss"] for r in clients if r["round"] == k} for k in (0, 2))
    assert len(first) == 4 and all(last[n] < first[n] - 0.3 for n in first), (first, last)


@pytest.mark.parametrize("protocol", [["mapl", "--nodes", "4", "--d-p", "8"],
                                      ["fedclassavg", "--topology", "star", "--nodes", "5"]])
def test_two_view_protocols_run_char_lstm_on_the_samples_themselves(tmp_path, fortunes_root, protocol):
    out = tmp_path / "run"
    # --normalize max: token ids are never normalised, so the views' --normalize standard is not needed
    assert main(["--protocol", *protocol, "--model", SMALL, "--normalize", "max", *fortunes(fortunes_root),
                 "--out", str(out)]) == 0
    rows = [r for r in _rows(out) if "train_loss" in r]
    assert len(rows) == 8 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)


def test_without_augmentation_both_views_are_the_samples():
    x = torch.randint(0, V, (5, 80), dtype=torch.uint8)
    assert torch.equal(prototypes.two_views(x, None, None), torch.cat([x, x]))
    assert prototypes.view_stats(type("Tokens", (), {"kind": "tokens"})()) is None


def test_the_batched_executor_runs_char_lstm_node_by_node_with_the_thread_runs_results(tmp_path, fortunes_root):
    args = ["--protocol", "dfedavgm", "--topology", "ring", "--nodes", "4", "--model", SMALL, "--trace",
            *fortunes(fortunes_root)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for executor in ("thread", "batched"):
            assert main([*args, "--executor", executor, "--out", str(tmp_path / executor)]) == 0
    assert not [w for w in caught if "batching rule" in str(w.message)]
    for name in ("links.csv", "messages.jsonl", "metrics.jsonl"):  # not batched: the very same jobs
        assert (tmp_path / "thread" / name).read_bytes() == (tmp_path / "batched" / name).read_bytes(), name
    summary = json.loads((tmp_path / "batched" / "summary.json").read_text())
    assert summary["executor"]["batched_jobs"] == 0


def test_recurrent_models_are_never_batched_and_others_still_are():
    lstm = build_model(SMALL, (80,), V, vocabulary=V)
    tokens = torch.zeros(2, 80, dtype=torch.uint8)
    assert not batched._batchable(lstm, tokens)
    assert batched._batchable(build_model("mlp:hidden=8", (20,), 3), torch.zeros(2, 20))


def test_per_sample_gradients_of_an_lstm_loop_and_match_vmaps():
    model = build_model("char-lstm:hidden=4", (80,), V, vocabulary=V).train()
    x, y = torch.randint(0, V, (3, 80), dtype=torch.uint8), torch.randint(0, V, (3,))
    names = [name for name, _ in model.named_parameters()][1:]  # the embedding frozen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's fallback over the LSTM kernel warns
        expected, expected_losses = privacy._vmapped_gradients(model, x, y, names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipped, losses = privacy.clipped_gradients(model, x, y, 1e6, names)  # no clipping at this bound
    assert not caught and list(clipped) == names
    assert torch.allclose(losses, expected_losses)
    assert all(torch.allclose(clipped[n], expected[n], atol=1e-6) for n in names)
    empty, none = privacy._looped_gradients(model, x[:0], y[:0], names)
    assert none.shape == (0,) and empty[names[0]].shape == (0, *dict(model.named_parameters())[names[0]].shape)


def test_dp_sgd_runs_char_lstm_and_accounts_each_node(tmp_path, fortunes_root):
    out = tmp_path / "dp"
    assert main(["--protocol", "dfedavgm", "--topology", "ring", "--nodes", "4", "--model", SMALL,
                 "--dp", "clip=1,noise=1", *fortunes(fortunes_root), "--out", str(out)]) == 0
    samples = [sum(node["train"].values()) for node in json.loads((out / "partition.json").read_text())["nodes"]]
    assert samples == [60] * 4
    rows = [json.loads(line) for line in (out / "privacy.jsonl").read_text().splitlines()]
    assert sorted((r["round"], r["node"]) for r in rows) == [(r, i) for r in range(2) for i in range(4)]
    for row in rows:  # one epoch a round: round(60 / 32) = 2 steps of batch 32, sampled at rate 32 / 60
        assert (row["steps"], row["delta"], row["noise"]) == (2 * (row["round"] + 1), 1 / 60, 1.0)
        assert row["epsilon"] == pytest.approx(library_epsilon(1.0, 32 / 60, row["steps"], 1 / 60), rel=1e-12)
    epsilons = json.loads((out / "summary.json").read_text())["privacy"]["epsilon"]
    assert epsilons == {str(r["node"]): r["epsilon"] for r in rows if r["round"] == 1}
