import pytest
import torch
from torchvision.transforms.v2 import functional as F

from p2p_emulator.workloads import augment
from p2p_emulator.workloads.augment import TwoViews

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]


def _views(shape, seed=0, batch=16, **kw):
    x = torch.rand(batch, *shape, generator=torch.Generator().manual_seed(99))
    return x, TwoViews(shape, torch.Generator().manual_seed(seed), **kw)(x)


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_and_dtype(shape):
    x, (a, b) = _views(shape)
    assert a.shape == b.shape == x.shape and a.dtype == b.dtype == x.dtype


@pytest.mark.parametrize("shape", SHAPES)
def test_views_differ_from_each_other_and_from_input(shape):
    x, (a, b) = _views(shape)
    for left, right in [(a, b), (a, x), (b, x)]:
        per_sample = (left - right).flatten(1).abs().amax(1)
        assert (per_sample > 1e-3).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_input_is_not_modified(shape):
    x = torch.rand(8, *shape)
    copy = x.clone()
    TwoViews(shape, torch.Generator().manual_seed(0))(x)
    assert torch.equal(x, copy)


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_views(shape):
    _, (a1, b1) = _views(shape, seed=5)
    _, (a2, b2) = _views(shape, seed=5)
    _, (a3, _) = _views(shape, seed=6)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.equal(a1, a3)


def test_global_rng_untouched():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for shape in SHAPES:
        _views(shape)
    assert torch.equal(before, torch.get_rng_state())


def test_full_scale_crop_is_identity_and_grayscale_is_only_flipped():
    # scale (1, 1) can only fit the whole image, so a 1-channel view is the input
    # or its mirror image: no colour op touched it.
    x, (a, b) = _views((1, 28, 28), batch=64, scale=(1.0, 1.0))
    for view in (a, b):
        same = (view - x).flatten(1).abs().amax(1) < 1e-5
        mirrored = (view - x.flip(-1)).flatten(1).abs().amax(1) < 1e-5
        assert (same | mirrored).all()
        assert 16 < mirrored.sum() < 48  # p = 0.5


def test_rgb_gets_jitter_and_grayscale():
    x, (a, b) = _views((3, 32, 32), batch=200, scale=(1.0, 1.0))
    for view in (a, b):
        geometric_only = torch.minimum(
            (view - x).flatten(1).abs().amax(1), (view - x.flip(-1)).flatten(1).abs().amax(1)
        ) < 1e-5
        assert geometric_only.sum() < 0.2 * 200 + 20  # jitter or grayscale hit ~84% of samples
        gray = (view[:, 0] == view[:, 1]).flatten(1).all(1) & (view[:, 1] == view[:, 2]).flatten(1).all(1)
        assert 15 < gray.sum() < 70  # p = 0.2


def test_crop_zooms_in():
    # A checkerboard of 1px squares: zooming in (upsampling) creates intermediate values.
    board = ((torch.arange(28)[:, None] + torch.arange(28)) % 2).float().expand(32, 1, 28, 28)
    a, _ = TwoViews((1, 28, 28), torch.Generator().manual_seed(0), scale=(0.2, 0.3))(board)
    assert ((a > 0.05) & (a < 0.95)).float().mean() > 0.5


def test_crops_are_scattered_sub_ramps():
    # On a left-to-right ramp a crop is again a ramp (reversed when flipped), and
    # its mean is the box's horizontal centre, which must vary over the image.
    ramp = ((torch.arange(28) + 0.5) / 28).expand(256, 1, 28, 28).contiguous()
    a, _ = TwoViews((1, 28, 28), torch.Generator().manual_seed(0), scale=(0.2, 0.3))(ramp)
    steps = a[:, 0, 14].diff(dim=-1)
    assert ((steps > 0).all(1) | (steps < 0).all(1)).all()
    centres = a.mean((1, 2, 3))
    assert centres.min() < 0.35 and centres.max() > 0.65 and 0.4 < centres.mean() < 0.6


@pytest.mark.parametrize(
    "ours,theirs,lo,hi",
    [
        (augment.brightness, F.adjust_brightness, 0.6, 1.4),
        (augment.contrast, F.adjust_contrast, 0.6, 1.4),
        (augment.saturation, F.adjust_saturation, 0.6, 1.4),
        (augment.hue_shift, F.adjust_hue, -0.1, 0.1),
    ],
)
def test_batched_jitter_ops_match_v2_per_sample(ours, theirs, lo, hi):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 3, 16, 16, generator=g)
    x[0] = x[0].round()  # ties between channels, pure colours
    x[1] = x[1, :1]  # grey: no hue
    factors = lo + (hi - lo) * torch.rand(6, generator=g)
    batched = ours(x.clone(), factors.view(-1, 1, 1, 1))
    expected = torch.stack([theirs(img, float(f)) for img, f in zip(x, factors)])
    assert torch.allclose(batched, expected, atol=1e-5)
    assert not torch.allclose(batched, x, atol=1e-3)


def test_colour_jitter_matches_v2_color_jitter_per_sample():
    # Replays colour_jitter's draws (same generator seed, same order of draws)
    # through v2's scalar kernels, one sample at a time, ColorJitter-style.
    x = torch.rand(32, 3, 12, 12, generator=torch.Generator().manual_seed(3))
    ours = TwoViews((3, 12, 12), torch.Generator().manual_seed(4)).colour_jitter(x.clone())
    g = torch.Generator().manual_seed(4)
    apply = torch.rand(32, generator=g) < 0.8
    factors = 0.6 + 0.8 * torch.rand(32, 3, generator=g)
    hue = 0.1 * (2 * torch.rand(32, generator=g) - 1)
    order = torch.rand(32, 4, generator=g).argsort(1)
    ops = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue]
    for i in range(32):
        image = x[i]
        params = [*factors[i].tolist(), float(hue[i])]
        for k in order[i].tolist() if apply[i] else []:
            image = ops[k](image, params[k])
        assert torch.allclose(ours[i], image, atol=1e-5), i
    assert 20 <= apply.sum() < 32


def test_bad_input_is_rejected():
    aug = TwoViews((1, 8, 8), torch.Generator())
    for bad in [torch.rand(4, 1, 9, 9), torch.rand(1, 8, 8), torch.zeros(4, 1, 8, 8, dtype=torch.uint8)]:
        with pytest.raises(ValueError):
            aug(bad)
    with pytest.raises(ValueError):
        TwoViews((1, 8, 8), torch.Generator(), scale=(0.0, 1.0))
