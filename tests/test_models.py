import threading

import pytest
import torch

from emulator.seeds import Seeds
from torch import nn
from torchvision.models.mobilenetv2 import InvertedResidual
from torchvision.models.resnet import BasicBlock

from p2p_emulator.workloads.model_specs import HETERO_ARCHS, HETERO_SMALL_ARCHS, MODELS, ModelError, assigned_arch
from p2p_emulator.workloads.models import _num_groups, build_model, parameter_count

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
SMALL = dict(d_z=64, d_p=32, hidden=128)
K = 10
# torchvision-size backbones take most of the file's time; deselect with -m "not slow".
slow = pytest.mark.slow

# (model name, node) covering every concrete architecture once.
CASES = [
    ("cnn-small", 0),
    ("mlp", 0),
    pytest.param("resnet18", 0, marks=slow),
    pytest.param("shufflenet", 0, marks=slow),
    pytest.param("googlenet", 0, marks=slow),
    ("alexnet", 0),
    ("hetero", 3),  # alexnet: the cheap member; the others are covered above
    *[("hetero-small", n) for n in range(4)],
]


def _build(name, shape, node=0, **kw):
    return build_model(name, shape, K, node=node, num_nodes=4, **{**SMALL, **kw})


def _state(model):
    return [t.clone() for t in model.state_dict().values()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,node", CASES)
def test_forward_backward_shapes(name, node, shape):
    model = _build(name, shape, node).train()
    x = torch.randn(4, *shape)
    z = model.features(x)
    logits, p = model.classifier(z), model.project(z)
    assert z.shape == (4, 64) and logits.shape == (4, K) and p.shape == (4, 32)
    (logits.square().mean() + p.square().mean()).backward()
    first = next(model.backbone.parameters())
    assert first.grad is not None and first.grad.abs().sum() > 0
    linear = model.classifier[-1]
    assert linear.weight.shape == (K, 64) and linear.bias is None
    assert isinstance(model.classifier[0], nn.ReLU)


def test_forward_is_classifier_of_features():
    model = _build("cnn-small", (1, 8, 8)).eval()
    x = torch.randn(4, 1, 8, 8)
    assert torch.allclose(model(x), model.classifier(model.features(x)))


def test_projection_head_layout():
    head = _build("mlp", (1, 8, 8)).projection
    assert [type(m) for m in head] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert (head[0].in_features, head[0].out_features, head[3].out_features) == (64, 128, 32)


def test_homogeneous_models_ignore_assignment():
    for name in set(MODELS) - {"hetero", "hetero-small"}:
        assert assigned_arch(name, 5, "random", 1) == assigned_arch(name, 2, "round-robin", 0) == name
    assert _build("mlp", (1, 8, 8), node=3, assign="random").arch == "mlp"


def test_hetero_round_robin():
    assert [assigned_arch("hetero", n, "round-robin", 0) for n in range(8)] == list(HETERO_ARCHS) * 2
    assert list(HETERO_ARCHS) == ["resnet18", "shufflenet", "googlenet", "alexnet"]
    assert _build("hetero", (1, 8, 8), node=3).arch == "alexnet"


def test_hetero_small_is_four_different_architectures():
    models = [_build("hetero-small", (1, 28, 28), node=n) for n in range(4)]
    assert [m.arch for m in models] == list(HETERO_SMALL_ARCHS)
    assert len({parameter_count(m.backbone) for m in models}) == 4
    # Each has a signature building block of its own kind.
    kinds = [{type(m) for m in model.backbone.modules()} for model in models]
    assert BasicBlock in kinds[1] and InvertedResidual in kinds[2] and nn.LayerNorm in kinds[3]
    assert not kinds[0] & {BasicBlock, InvertedResidual, nn.LayerNorm}


def test_small_models_stay_small():
    for name, node in [("cnn-small", 0)] + [("hetero-small", n) for n in range(4)]:
        count = parameter_count(build_model(name, (1, 28, 28), K, node=node, num_nodes=4).backbone)
        assert count <= 250_000, (name, node, count)
    assert 100_000 <= parameter_count(build_model("cnn-small", (1, 28, 28), K).backbone) <= 250_000


def test_random_assignment_is_deterministic():
    def assign(seed, how="random", spec="hetero"):
        return [assigned_arch(spec, n, how, Seeds(seed).stream("model.assign", n)) for n in range(40)]

    first = assign(7)
    assert first == assign(7)
    assert set(first) == set(HETERO_ARCHS)
    assert first != assign(8)
    assert first != assign(7, "round-robin")
    small = [_build("hetero-small", (1, 8, 8), node=n, assign="random", assign_seed=3 + n).arch for n in range(4)]
    assert small == [assigned_arch("hetero-small", n, "random", 3 + n) for n in range(4)]


@pytest.mark.parametrize("name,node", [("cnn-small", 0), ("hetero-small", 2), ("hetero-small", 3)])
def test_parameters_depend_on_seed_and_node_only(name, node):
    torch.manual_seed(1)
    a = _state(_build(name, (1, 8, 8), node, init_seed=5))
    torch.manual_seed(2)  # a different global state must not matter
    assert _same(a, _state(_build(name, (1, 8, 8), node, init_seed=5)))
    assert not _same(a, _state(_build(name, (1, 8, 8), node, init_seed=6)))


def test_one_init_seed_gives_every_node_the_same_start():
    a = _state(_build("cnn-small", (1, 8, 8), node=0, init_seed=9))
    assert _same(a, _state(_build("cnn-small", (1, 8, 8), node=1, init_seed=9)))


def test_build_leaves_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    _build("hetero-small", (1, 8, 8), node=1)
    _build("alexnet", (3, 32, 32))
    assert torch.equal(before, torch.get_rng_state())


def test_concurrent_builds_match_sequential():
    expected = [_state(_build("cnn-small", (1, 8, 8), node=n)) for n in range(4)]
    results = [None] * 4

    def work(n):
        results[n] = _state(_build("cnn-small", (1, 8, 8), node=n))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(_same(e, r) for e, r in zip(expected, results))


@pytest.mark.parametrize("name,node", CASES)
def test_group_norm_replaces_every_batch_norm(name, node):
    batch = _build(name, (1, 8, 8), node)
    group = _build(name, (1, 8, 8), node, norm="group").train()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in group.modules())
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in batch.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in group.modules()) == n_bn >= 1  # the head has one
    z = group.features(torch.randn(4, 1, 8, 8))  # deep layers see 1x1 maps here
    (group.classifier(z).sum() + group.project(z).sum()).backward()
    assert z.std() > 0


def test_group_counts():
    """The most groups, at most 32, that split the channels evenly with at least 4 channels each, else 1
    (fewer than 8 channels, or a prime count); 116 = 4 * 29 and 464 = 16 * 29: no count from 30 to 32 divides."""
    channels = [1, 2, 3, 4, 7, 8, 11, 16, 24, 48, 64, 116, 192, 464, 1024, 4096]
    assert {c: _num_groups(c) for c in channels} == {
        1: 1, 2: 1, 3: 1, 4: 1, 7: 1, 8: 2, 11: 1, 16: 4, 24: 6, 48: 12, 64: 16, 116: 29, 192: 32, 464: 29,
        1024: 32, 4096: 32}


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(name="vgg"), ["vgg", *MODELS]),
        (dict(name="cnn-small", norm="layer"), ["layer", "batch", "group"]),
        (dict(name="hetero", assign="greedy"), ["greedy", "round-robin", "random"]),
        (dict(name="cnn-small", node=4), ["node 4"]),
    ],
)
def test_bad_configuration_errors(kwargs, words):
    name = kwargs.pop("name")
    with pytest.raises(ModelError) as info:
        build_model(name, (1, 8, 8), K, num_nodes=4, **kwargs)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words)
    assert isinstance(info.value, ValueError)


def test_parameter_count():
    model = _build("mlp", (1, 8, 8))
    assert parameter_count(model) == sum(p.numel() for p in model.parameters()) > 0
    # mlp backbone: 64*256 + 256 + 256*64 + 64
    assert parameter_count(model.backbone) == 64 * 256 + 256 + 256 * 64 + 64
