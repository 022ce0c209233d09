"""MAPL's two-view training augmentation, on batches of tensors.

The pipeline of the MAPL authors' code (SupCon's CIFAR recipe):
RandomResizedCrop(scale 0.2-1, ratio 3/4-4/3) back to the input size,
RandomHorizontalFlip(0.5) and, for RGB only,
RandomApply(ColorJitter(0.4, 0.4, 0.4, 0.1), p=0.8) and RandomGrayscale(0.2).
The paper's Table 8 also lists a Gaussian blur (p = 0.5); like SupCon's CIFAR
recipe this pipeline leaves it out (on 8-32 px images it wipes out most detail).

Every sample gets its own random parameters. The crop is batched: one
`affine_grid`-style grid + bilinear `grid_sample` over per-sample boxes: the geometry of
v2 `resized_crop` with bilinear interpolation (a crop is never larger than the
output, so resizing only upsamples and its antialiasing has nothing to do).
Flip and grayscale apply torchvision.transforms.v2.functional ops to the chosen
samples. v2's colour-jitter kernels take one scalar factor per call, so the
jitter re-states them with a per-sample factor tensor, batched (a per-sample
loop of v2 calls cost ~30 ms per 64 RGB 32x32 images, this ~5 ms; the tests
check both agree). Only RGB data is jittered.

All randomness comes from the caller's torch.Generator, so views are reproducible
and independent of other threads; the global RNG is never used.

Input: a float batch (B, C, H, W) with values in [0, 1]; standardise (mean/std)
after augmenting, because the colour ops clamp to [0, 1] and work in HSV.
(Single-channel input only gets crop and flip, which work on any range.)

Training only: evaluation code does not call TwoViews and sees the plain images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf
from torchvision.transforms.v2 import functional as F

_CROP_TRIES = 10  # as torchvision's RandomResizedCrop
_RATIO = (3 / 4, 4 / 3)
_JITTER = 0.4  # brightness, contrast and saturation factors in [0.6, 1.4]
_HUE = 0.1  # hue shift in [-0.1, 0.1]
_P_JITTER, _P_GRAY, _P_FLIP = 0.8, 0.2, 0.5


class TwoViews:
    """Two independently augmented views of a batch; see the module docstring."""

    def __init__(self, in_shape: tuple[int, int, int], generator: torch.Generator, *, scale=(0.2, 1.0)):
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"crop scale must satisfy 0 < low <= high <= 1, got {scale}")
        self.in_shape = tuple(in_shape)
        self.generator = generator
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.in_shape or not x.is_floating_point():
            shape = ", ".join(map(str, self.in_shape))
            raise ValueError(f"expected a float batch of shape (B, {shape}), got {x.dtype} {tuple(x.shape)}")
        return self.view(x), self.view(x)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        x = self._resized_crop(x)
        x = self._flip(x)
        if self.in_shape[0] == 3:
            x = self.colour_jitter(x)
            x = self._grayscale(x)
        return x

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator)

    def _crop_boxes(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample box sizes (w, h) as fractions of the image, torchvision's rule:
        area ~ U(scale), log-aspect ~ U(log ratio); the first of 10 tries that fits
        wins, else the whole image (torchvision's fallback for square inputs)."""
        _, height, width = self.in_shape
        area = self.scale[0] + (self.scale[1] - self.scale[0]) * self._rand(b, _CROP_TRIES)
        lo, hi = math.log(_RATIO[0]), math.log(_RATIO[1])
        ratio = torch.exp(lo + (hi - lo) * self._rand(b, _CROP_TRIES))  # width/height in pixels
        w = torch.sqrt(area * ratio * height / width)
        h = torch.sqrt(area / ratio * width / height)
        fits = (w <= 1) & (h <= 1)
        first = fits.to(torch.uint8).argmax(1, keepdim=True)  # argmax returns the first maximum
        w, h = w.gather(1, first).squeeze(1), h.gather(1, first).squeeze(1)
        none = ~fits.any(1)
        return w.masked_fill(none, 1.0), h.masked_fill(none, 1.0)

    def _resized_crop(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        w, h = self._crop_boxes(b)
        # Box centre uniform over the positions where the box fits, in [-1, 1] grid units.
        cx = (1 - w) * (2 * self._rand(b) - 1)
        cy = (1 - h) * (2 * self._rand(b) - 1)
        # The sampling grid of affine_grid for a scale-and-shift map, built by
        # broadcasting (affine_grid's general matmul costs more than the sampling).
        _, _, height, width = x.shape
        u = (torch.arange(width, dtype=x.dtype) * 2 + 1) / width - 1  # pixel centres in [-1, 1]
        v = (torch.arange(height, dtype=x.dtype) * 2 + 1) / height - 1
        gx = (cx[:, None] + w[:, None] * u).to(x.dtype)[:, None, :].expand(b, height, width)
        gy = (cy[:, None] + h[:, None] * v).to(x.dtype)[:, :, None].expand(b, height, width)
        grid = torch.stack((gx, gy), -1)
        return nnf.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def _flip(self, x: torch.Tensor) -> torch.Tensor:
        flip = self._rand(x.shape[0]) < _P_FLIP
        x[flip] = F.horizontal_flip(x[flip])
        return x

    def _grayscale(self, x: torch.Tensor) -> torch.Tensor:
        gray = self._rand(x.shape[0]) < _P_GRAY
        x[gray] = F.rgb_to_grayscale(x[gray], num_output_channels=3)
        return x

    def colour_jitter(self, x: torch.Tensor) -> torch.Tensor:
        """ColorJitter(0.4, 0.4, 0.4, 0.1) with probability 0.8, per sample: own
        factors and own random order of the four ops, applied batched per op.
        A blend with factor 1 returns its input bit for bit, so the cheap ops run
        on the whole batch with factor 1 for the samples not due for them; hue,
        the costly one, runs only on the samples due for it."""
        b = x.shape[0]
        apply = self._rand(b) < _P_JITTER
        factors = (1 - _JITTER + 2 * _JITTER * self._rand(b, 3)).to(x.dtype)
        hue = (_HUE * (2 * self._rand(b) - 1)).to(x.dtype)
        order = self._rand(b, 4).argsort(1)  # 0-2: brightness, contrast, saturation; 3: hue
        for step in range(4):
            due = torch.where(apply, order[:, step], -1)
            for k, blend in enumerate((brightness, contrast, saturation)):
                x = blend(x, torch.where(due == k, factors[:, k], 1.0).view(-1, 1, 1, 1))
            chosen = due == 3
            if chosen.any():
                x[chosen] = hue_shift(x[chosen], hue[chosen].view(-1, 1, 1, 1))
        return x


# v2's colour kernels with a per-sample factor (shape (B, 1, 1, 1)) instead of a
# scalar; same results, checked against v2 per sample in tests/test_augment.py.


def _blend(image: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    return (image * ratio + other * (1 - ratio)).clamp_(0, 1)


def brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (x * f).clamp_(0, 1)


def contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, F.rgb_to_grayscale(x).mean((-3, -2, -1), keepdim=True), f)


def saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return _blend(x, F.rgb_to_grayscale(x), f)


def hue_shift(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """v2's adjust_hue (RGB -> HSV, shift H, back) with a per-sample shift. The
    inverse uses the closed form channel = V - C * clamp(min(k, 4 - k), 0, 1),
    k = (n + 6H) mod 6, n = 5, 3, 1 for R, G, B: no gather, and v2's batched
    HSV helpers are private."""
    r, g, b = x.unbind(-3)
    low, high = torch.minimum(torch.minimum(r, g), b), torch.maximum(torch.maximum(r, g), b)  # aminmax over C is slow
    chroma = high - low
    safe = torch.where(chroma == 0, 1.0, chroma)  # grey pixels: any hue, chroma 0 cancels it
    sixths = torch.where(high == r, (g - b) / safe, torch.where(high == g, (b - r) / safe + 2, (r - g) / safe + 4))
    sixths = sixths + 6 * shift.view(-1, 1, 1)
    k = (sixths.unsqueeze(-3) + _HSV_OFFSETS.to(x.dtype)).remainder_(6)
    return high.unsqueeze(-3) - chroma.unsqueeze(-3) * torch.minimum(k, 4 - k).clamp_(0, 1)


_HSV_OFFSETS = torch.tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1)
