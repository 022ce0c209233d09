"""Model zoo: backbones split into (backbone, projection head, classifier) as MAPL needs.

Every model is a `SplitModel`: backbone x -> z (width d_z), MAPL projection head
z -> p (width d_p) and classifier ReLU(z) -> logits (Linear without bias, so the
K x d_z weight is all MAPL exchanges; shaped mlp and the LEAF models have a bias,
char-lstm no ReLU). Protocols that do not use the projection head simply never
call `project`.

What a model reads (`model_specs.READS`): images (C, H, W), except mlp (images or
feature vectors (D,)) and char-lstm (token ids (L,), of any integer dtype); any
other pairing is refused in one line.

Architectures (`MODELS`):
- "cnn-small": the CPU default, two conv layers (32/64) with BatchNorm and
  pooling, then Linear to d_z (~150k parameters with d_z = 512).
- "mlp": Flatten -> Linear(C*H*W, 256) -> ReLU -> Linear(256, d_z).
- "mlp:hidden=64,64": the literature's MLP, C*H*W -> 64 -> 64 -> K with biases; the
  last hidden width is the latent (d_z is ignored).
- "cnn-small:channels=16,32": cnn-small with those conv widths (one conv-pool each).
- "resnet18", "shufflenet" (shufflenet_v2_x1_0), "googlenet": torchvision
  definitions (weights=None, never downloaded) with the stem replaced for small
  images (3x3 stride-1 first conv taking C channels, the stem max-pool removed)
  and the final fc mapping to d_z. With these stems all three run on 8x8 inputs,
  so no input upsampling is needed. GoogLeNet has aux_logits=False and its
  Dropout removed.
- "alexnet": an AlexNet-style small CNN (torchvision's AlexNet cannot take 32x32).
- "hetero": the four paper backbones, per node (`assigned_arch`).
- "hetero-small": four cheap CPU backbones of different kinds, per node:
  "cnn-small" (plain CNN), "small-resnet" (3x3 stem + two residual stages),
  "small-dwsep" (MobileNetV2 inverted residuals, depthwise-separable) and
  "small-mixer" (MLP-Mixer on a 4x4 grid of patches). Each has <= 151k
  parameters at d_z = 512 and takes ~3.5-4.5 ms forward+backward for a batch of
  64 8x8 images on one thread.
- "leaf-cnn": LEAF's FEMNIST CNN (Caldas et al. 2018, models/femnist/cnn.py): 5x5
  'same' conv 32 + ReLU, 2x2 max-pool, 5x5 'same' conv 64 + ReLU, 2x2 max-pool,
  Linear to 2048 = z (d_z is ignored), then the classifier ReLU + Linear(2048, K)
  with bias: LEAF's dense 2048 with ReLU and its output layer. Any image of at least
  4x4 (the flatten width follows the size: 64 * (H // 4) * (W // 4)); no BatchNorm,
  as LEAF. Its parameters equal LEAF's (6,603,710 at 28x28, 62 classes). Departure: PyTorch's
  initialisation, where LEAF's TF layers start from Glorot-uniform kernels and zero biases.
- "char-lstm", "char-lstm:hidden=H": LEAF's Shakespeare model
  (models/shakespeare/stacked_lstm.py): Embedding(vocabulary, 8), two stacked LSTM
  layers of H = 256 units, the last time step's output is z (d_z = H; --d-z is
  ignored), and the classifier is Linear(H, K) with bias and no activation before it
  (LEAF's dense output layer on outputs[:, -1]). Departures from LEAF: PyTorch's LSTM
  has two bias vectors per gate (b_ih and b_hh) where TF's BasicLSTMCell has one, so
  2 * 4H more parameters per layer; TF's cell adds a forget-gate bias of 1.0 and
  initialises with Glorot-uniform kernels and zero biases, here PyTorch's init
  (every tensor U(-1/sqrt(H), 1/sqrt(H)), embedding N(0, 1)); the vocabulary is the
  dataset's (text.py: LEAF's 80 characters and one unknown id, 81), where LEAF looks
  an unknown character up as -1.
"hetero" and "hetero-small" assign round-robin by node id, or with
assign="random" independently per node from the node's own seed (`assign_seed`).

norm="group" replaces every BatchNorm (backbone and projection head) by a
GroupNorm with the most groups <= 32 that divide the channels and leave >= 4
channels per group (see `_num_groups`).

No model contains Dropout: it would draw from the global RNG while training.
The MAPL projection head exists only when d_p is given (MAPL builds it; the others
never carry it).

Construction seeds a private fork of the CPU generator with `init_seed` (nodes given
the same one start from one x0), so a node's initial parameters depend on
(spec, shapes, init_seed) only and the global RNG state is left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .lazy import LazyModule
from .model_specs import NORMS, ModelError, assigned_arch, check_reads, parse_model

# torchvision's import pulls in torch._dynamo (over a second): only the architectures built from its
# blocks load it.
tvm = LazyModule("torchvision.models")
TORCHVISION_ARCHS = frozenset({"resnet18", "shufflenet", "googlenet", "small-resnet", "small-dwsep"})


def import_for_jobs(archs: list[str], trains: bool) -> None:
    """Import now what the nodes' jobs would import on first use, as each takes about a second: inside
    the first jobs it would be measured and charged to those nodes. torchvision for the architectures
    built from its blocks; torch._dynamo, which torch.optim imports with the first optimizer, if they train."""
    if TORCHVISION_ARCHS.intersection(archs):
        importlib.import_module("torchvision.models")
    if trains:
        importlib.import_module("torch._dynamo")


# fork_rng swaps the process-wide CPU generator; serialise builds so two threads
# building nodes at once never see each other's seed.
RNG_LOCK = threading.Lock()


class SplitModel(nn.Module):
    """Backbone + MAPL projection head (only when d_p is given) + classifier."""

    def __init__(self, arch: str, backbone: nn.Module, d_z: int, d_p: int | None, hidden: int, num_classes: int,
                 bias: bool = False, activation: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.arch, self.d_z, self.d_p = arch, d_z, d_p
        self.backbone = backbone
        if d_p is not None:
            self.projection = nn.Sequential(
                nn.Linear(d_z, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, d_p)
            )
        # Authors' code: ReLU on the latent, then a linear layer; MAPL sends only its weight. The activation is
        # per architecture (char-lstm: none) but keeps index 0, so the linear layer is always classifier[1].
        self.classifier = nn.Sequential(activation(), nn.Linear(d_z, num_classes, bias=bias))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def project(self, z: torch.Tensor) -> torch.Tensor:
        return self.projection(z)


# --- backbones: each takes (in_shape, d_z) and maps a batch of samples (B, *in_shape) -> (B, d_z) ---


def _conv_bn(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


def _cnn_small(in_shape: tuple[int, int, int], d_z: int, channels: tuple[int, ...] = (32, 64)) -> nn.Module:
    # Adaptive pooling to 2x2 keeps the linear layer the same for 8x8, 28x28 and 32x32.
    layers: list[nn.Module] = []
    for c_in, c_out in zip((in_shape[0], *channels), channels):
        layers += [*_conv_bn(c_in, c_out), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(channels[-1] * 4, d_z))


def _mlp(in_shape: tuple[int, ...], d_z: int, hidden: tuple[int, ...] = (256,)) -> nn.Module:
    """Flatten (images; feature vectors pass as they are), then Linear layers through `hidden` to d_z with ReLU
    between them."""
    widths = [int(np.prod(in_shape)), *hidden, d_z]
    layers: list[nn.Module] = [nn.Flatten()]
    for n_in, n_out in zip(widths, widths[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers[:-1])


def _resnet18(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    net = tvm.resnet18(weights=None, num_classes=d_z)
    net.conv1 = nn.Conv2d(in_shape[0], 64, 3, padding=1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's ResNet init
    net.maxpool = nn.Identity()
    return net


def _shufflenet(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    net = tvm.shufflenet_v2_x1_0(weights=None, num_classes=d_z)
    net.conv1 = nn.Sequential(*_conv_bn(in_shape[0], 24))
    net.maxpool = nn.Identity()
    return net


def _googlenet(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    from torchvision.models.googlenet import BasicConv2d

    net = tvm.googlenet(weights=None, num_classes=d_z, aux_logits=False, init_weights=True, transform_input=False)
    net.conv1 = BasicConv2d(in_shape[0], 64, kernel_size=3, padding=1)
    nn.init.trunc_normal_(net.conv1.conv.weight, std=0.01, a=-2, b=2)  # torchvision's GoogLeNet init
    net.maxpool1 = nn.Identity()  # keep maxpool2: inception 3 then runs at 16x16 for 32x32 inputs
    net.dropout = nn.Identity()
    return net


def _alexnet(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    # AlexNet's five convs with its per-GPU channel counts (48-128-192-192-128),
    # 3x3 kernels and max-pools sized for 8..32 pixel inputs.
    relu = lambda: nn.ReLU(inplace=True)  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 48, 3, padding=1), relu(), nn.MaxPool2d(2),
        nn.Conv2d(48, 128, 3, padding=1), relu(), nn.MaxPool2d(2),
        nn.Conv2d(128, 192, 3, padding=1), relu(),
        nn.Conv2d(192, 192, 3, padding=1), relu(),
        nn.Conv2d(192, 128, 3, padding=1), relu(),
        nn.AdaptiveMaxPool2d(2), nn.Flatten(), nn.Linear(128 * 4, d_z),
    )  # fmt: skip


def _small_resnet(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    from torchvision.models.resnet import BasicBlock

    def down(c_in: int, c_out: int) -> nn.Module:
        shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), nn.BatchNorm2d(c_out))
        return BasicBlock(c_in, c_out, stride=2, downsample=shortcut)

    return nn.Sequential(
        *_conv_bn(in_shape[0], 16), down(16, 32), down(32, 64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, d_z),
    )  # fmt: skip


def _small_dwsep(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    from torchvision.models.mobilenetv2 import InvertedResidual

    return nn.Sequential(
        *_conv_bn(in_shape[0], 16),
        InvertedResidual(16, 32, stride=2, expand_ratio=2), InvertedResidual(32, 64, stride=2, expand_ratio=2),
        nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU6(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, d_z),
    )  # fmt: skip


class _MixerBlock(nn.Module):
    """MLP-Mixer block: an MLP across tokens, then an MLP across channels (pre-norm, residual)."""

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 64), nn.GELU(), nn.Linear(64, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, tokens, dim)
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class _Mixer(nn.Module):
    def __init__(self, in_shape: tuple[int, int, int], d_z: int, dim: int = 32):
        super().__init__()
        c, h, w = in_shape
        patch = max(1, min(h, w) // 4)  # a 4x4 grid of tokens keeps the token MLP cheap at any size
        self.embed = nn.Conv2d(c, dim, patch, stride=patch)
        tokens = (h // patch) * (w // patch)
        self.blocks = nn.Sequential(_MixerBlock(tokens, dim), _MixerBlock(tokens, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, d_z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(tokens)).mean(1))


LEAF_CNN_DENSE = 2048  # LEAF's FEMNIST CNN: the dense layer before the output, its latent


def _leaf_cnn(in_shape: tuple[int, int, int], d_z: int) -> nn.Module:
    """LEAF's FEMNIST CNN up to its 2048-wide dense layer; 'same' 5x5 convs keep the size, each pool halves it."""
    c, h, w = in_shape
    return nn.Sequential(
        nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), d_z),
    )  # fmt: skip


CHAR_LSTM_HIDDEN = 256  # LEAF's Shakespeare model: n_hidden
CHAR_EMBEDDING = 8


class _CharLSTM(nn.Module):
    """LEAF's Shakespeare model up to its output layer: embed each id in 8 dimensions, two stacked LSTM layers
    of `hidden` units, and the last time step's output as the latent (d_z = hidden)."""

    def __init__(self, in_shape: tuple[int], hidden: int, vocabulary: int):
        super().__init__()  # in_shape (L,): the LSTM reads sequences of any length
        self.embed = nn.Embedding(vocabulary, CHAR_EMBEDDING)
        self.lstm = nn.LSTM(CHAR_EMBEDDING, hidden, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(x.long())  # ids come as uint8 or int32, as the dataset stores them
        # cuDNN's LSTM cannot backpropagate in eval mode (L2C's loss_gradient does); PyTorch's own kernel can.
        native = x.is_cuda and not self.training and torch.is_grad_enabled()
        with torch.backends.cudnn.flags(enabled=False) if native else contextlib.nullcontext():
            return self.lstm(embedded)[0][:, -1]


_BUILDERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "cnn-small": _cnn_small,
    "mlp": _mlp,
    "resnet18": _resnet18,
    "shufflenet": _shufflenet,
    "googlenet": _googlenet,
    "alexnet": _alexnet,
    "small-resnet": _small_resnet,
    "small-dwsep": _small_dwsep,
    "small-mixer": _Mixer,
}


class _Design(NamedTuple):
    """How one architecture is built: its backbone builder, latent width and classifier."""
    builder: Callable[[tuple[int, ...], int], nn.Module]
    d_z: int
    bias: bool = False  # the classifier's
    activation: type[nn.Module] = nn.ReLU  # between the latent and the classifier's linear layer


def build_model(
    spec: str,
    in_shape: tuple[int, ...],
    num_classes: int,
    *,
    node: int = 0,
    num_nodes: int = 1,
    d_z: int = 512,
    d_p: int | None = None,
    hidden: int = 4096,
    norm: str = "batch",
    assign: str = "round-robin",
    assign_seed=0,
    init_seed: int = 0,
    vocabulary: int = 0,
) -> SplitModel:
    """Build node `node`'s model; parameters depend only on (spec, shapes, init_seed).

    Nodes of one architecture built with the same init_seed start from the same point;
    assign_seed is the node's draw for assign="random". d_p adds MAPL's projection head.
    in_shape is a sample's: (C, H, W) images, (L,) token ids (when `vocabulary` > 0) or (D,) features.
    """
    arch = assigned_arch(spec, node, assign, assign_seed)
    _, widths = parse_model(spec)
    if norm not in NORMS:
        raise ModelError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")
    if not 0 <= node < num_nodes:
        raise ModelError(f"node {node} is outside 0..{num_nodes - 1}")
    in_shape = tuple(in_shape)
    check_reads(spec, arch, in_shape, vocabulary)
    design = _design(spec, arch, widths, in_shape, d_z, vocabulary)
    # Seed a private copy of the CPU generator: the global RNG state is restored on exit.
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(init_seed)
        model = SplitModel(arch, design.builder(in_shape, design.d_z), design.d_z, d_p, hidden, num_classes,
                           design.bias, design.activation)
    if norm == "group":
        _to_group_norm(model)
    return model


def _design(spec: str, arch: str, widths: tuple[int, ...] | None, in_shape: tuple[int, ...], d_z: int,
            vocabulary: int) -> _Design:
    if arch == "char-lstm":
        # LEAF's output layer: a dense layer with bias straight on the LSTM's output, no activation.
        hidden = widths[0] if widths else CHAR_LSTM_HIDDEN
        return _Design(functools.partial(_CharLSTM, vocabulary=vocabulary), hidden, bias=True, activation=nn.Identity)
    if arch == "leaf-cnn":
        if min(in_shape[1:]) < 4:
            raise ModelError(f"--model {spec}: its two 2x2 max-pools need images of at least 4x4 pixels, "
                             f"not {in_shape[1]}x{in_shape[2]}")
        return _Design(_leaf_cnn, LEAF_CNN_DENSE, bias=True)  # LEAF: dense 2048 + ReLU, then dense K
    if widths:
        return _shaped(spec, arch, widths, in_shape, d_z)
    return _Design(_BUILDERS[arch], d_z)


def _shaped(spec: str, arch: str, widths: tuple[int, ...], in_shape: tuple[int, ...], d_z: int) -> _Design:
    """A shaped mlp or cnn-small."""
    if arch == "mlp":
        # The plain MLP of the literature: its last hidden layer is the latent, the classifier has a bias.
        return _Design(functools.partial(_mlp, hidden=widths[:-1]), widths[-1], bias=True)
    if 2 ** len(widths) > min(in_shape[1:]):
        raise ModelError(f"model {spec!r}: {len(widths)} conv layers halve a {in_shape[1]}x{in_shape[2]} "
                         f"image to nothing; use at most {int(math.log2(min(in_shape[1:])))}")
    return _Design(functools.partial(_cnn_small, channels=widths), d_z)


def _num_groups(channels: int) -> int:
    # At most 32 groups (GroupNorm paper default) with at least 4 channels each:
    # a one-channel group on a 1x1 feature map (8x8 inputs, deep layers) normalises to 0.
    return max((g for g in range(1, 33) if channels % g == 0 and channels // g >= 4), default=1)


def _to_group_norm(module: nn.Module) -> None:
    """Replace every BatchNorm in place by a GroupNorm over the same channels (L2C)."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, nn.GroupNorm(_num_groups(child.num_features), child.num_features))
        else:
            _to_group_norm(child)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
