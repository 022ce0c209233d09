"""QSGD (Alistarh et al. 2017) as a compression operator: unbiased, within the paper's variance bound, exact bytes."""
import json

import numpy as np
import pytest
import torch

from emulator import wire
from emulator.errors import UsageError
from p2p_emulator.cli import main
from p2p_emulator.workloads.models import build_model
from p2p_emulator.workloads.training import float_state
from protocols.compression import QSGD_LEVELS, Operator
from tests.conftest import assert_refused

RING = ["--dataset", "digits", "--topology", "ring", "--quiet", "--no-plots"]


def _qsgd(s: int) -> Operator:
    return Operator.parse("compress-op", f"qsgd:s={s}")


def _draws(op: Operator, x: torch.Tensor, count: int, rng) -> torch.Tensor:
    """`count` draws of Q(x), stacked."""
    return torch.stack([op.decompress(op.compress({"w": x}, rng), {"w": x})["w"] for _ in range(count)])


def _mean_square_z(op: Operator, x: torch.Tensor, rng, count: int = 2000) -> float:
    """The mean over entries of z_i^2, z_i = (mean of Q(x)_i - x_i) / its standard error: about 1 if unbiased."""
    q = _draws(op, x, count, rng)
    error = q.mean(0) - x
    se = q.std(0) / count ** 0.5
    return float((error / se).square().mean())


class _Skewed:
    """A generator whose u is drawn as U^1.1 (mean 0.476, not 0.5): rounds up a little too seldom."""

    def __init__(self, rng):
        self.rng = rng

    def random(self, size, dtype):
        return self.rng.random(size, dtype=dtype) ** dtype(1.1)


def test_qsgd_is_unbiased_and_the_test_can_tell_a_biased_one():
    x = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    op = _qsgd(8)
    assert _mean_square_z(op, x, np.random.default_rng(0)) < 2.0
    assert _mean_square_z(op, x, _Skewed(np.random.default_rng(0))) > 4.0


@pytest.mark.parametrize("n, s", [(10, 1), (64, 4), (1000, 4), (1000, 127)])
@pytest.mark.parametrize("kind", ["gaussian", "flat"])
def test_the_variance_is_within_the_papers_bound(n, s, kind):
    """E||Q(x) - x||^2 <= min(n/s^2, sqrt(n)/s) ||x||^2 (Lemma 3.1); flat x (all |x_i| equal) is near the bound."""
    g = torch.Generator().manual_seed(n + s)
    x = torch.randn(n, dtype=torch.float64, generator=g)
    if kind == "flat":
        x = x.sign()
    q = _draws(_qsgd(s), x, 300, np.random.default_rng(1))
    measured = float((q - x).square().sum(1).mean())
    norm2 = float(x.square().sum())
    assert measured <= min(n / s ** 2, n ** 0.5 / s) * norm2
    # stochastic rounding between the two nearest levels: Var = (||x||/s)^2 frac(y)(1 - frac(y)), y = s|x|/||x||
    y = s * x.abs() / norm2 ** 0.5
    frac = y - y.floor()
    assert measured == pytest.approx(norm2 / s ** 2 * float((frac * (1 - frac)).sum()), rel=0.1)


def test_codes_are_one_level_apart_at_most_and_come_from_the_senders_generator():
    x = torch.randn(3, 50)
    op = _qsgd(4)
    first, again, other = (op.compress({"w": x}, np.random.default_rng(seed))["w"] for seed in (1, 1, 2))
    assert torch.equal(first["c"], again["c"]) and not torch.equal(first["c"], other["c"])
    assert first["c"].dtype == torch.int8 and first["c"].shape == (150,)
    assert first["s"] == pytest.approx(float(x.norm()))
    dense = op.decompress({"w": first}, {"w": x})["w"]
    assert dense.shape == x.shape and dense.dtype == x.dtype
    assert float((dense - x).abs().max()) <= first["s"] / 4 * (1 + 1e-6)
    assert torch.equal(dense.sign() * x.sign() >= 0, torch.ones_like(x, dtype=torch.bool))  # never the wrong sign


def test_zeros_float64_and_non_finite_tensors():
    op = _qsgd(16)
    zeros = op.compress({"w": torch.zeros(5)}, np.random.default_rng(0))["w"]
    assert zeros["s"] == 0.0 and not zeros["c"].any() and op.check({"w": torch.zeros(5)})({"w": zeros})
    x = torch.randn(7, dtype=torch.float64)
    assert op.decompress(op.compress({"w": x}, np.random.default_rng(0)), {"w": x})["w"].dtype == torch.float64
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 0.0]),
                torch.full((2,), 3e38)):  # finite, but its norm is beyond float32
        # a diverged model: a body every receiver refuses, after a trip over the wire, as it refuses sign's
        body = wire.decode(wire.encode(op.compress({"w": bad}, np.random.default_rng(0))))
        assert not op.check({"w": bad})(body)
    for codec in ("q8", "q4"):
        q = Operator.parse("compress-op", codec)
        bad = torch.tensor([1.0, float("inf"), 2.0])
        assert not q.check({"w": bad})(wire.decode(wire.encode(q.compress({"w": bad}, np.random.default_rng(0)))))


def test_a_plain_qsgd_and_the_narrowest_code_types():
    assert Operator.parse("sparsify", "qsgd") == Operator("qsgd", 1.0, QSGD_LEVELS) == _qsgd(127)
    x = torch.randn(10)
    for s, kind in ((1, torch.int8), (127, torch.int8), (128, torch.int16), (32767, torch.int16)):
        assert _qsgd(s).compress({"w": x}, np.random.default_rng(0))["w"]["c"].dtype == kind


@pytest.mark.parametrize("n, s", [(4096, 16), (1000, 127), (64, 1)])
def test_biased_qsgd_is_the_unbiased_one_scaled_to_a_contraction(n, s):
    """qsgd:s=S,biased = Q(x) / (1 + omega): its mean is x / (1 + omega) and E||Q'(x) - x||^2 <= omega / (1 + omega)
    ||x||^2 < ||x||^2, where the unbiased one's error may pass ||x||^2 (omega > 1)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    omega = min(n / s ** 2, n ** 0.5 / s)
    biased = Operator.parse("compress-op", f"qsgd:s={s},biased")
    assert biased == Operator("qsgd", 1.0, s, True) and Operator.parse("compress-op", "qsgd:biased").levels == 127
    first, again = (biased.compress({"w": x}, np.random.default_rng(3))["w"] for _ in range(2))
    plain = _qsgd(s).compress({"w": x}, np.random.default_rng(3))["w"]
    assert torch.equal(first["c"], plain["c"]) and first["s"] == pytest.approx(plain["s"] / (1 + omega), rel=1e-12)
    q = _draws(biased, x, 400, np.random.default_rng(4))
    error = float((q - x).square().sum(1).mean() / x.square().sum())
    assert error <= omega / (1 + omega) * 1.05 and error < 1
    assert torch.allclose(q.mean(0) * (1 + omega), x, atol=5 * float(q.std(0).max()) * (1 + omega) / 20)


@pytest.mark.parametrize("spec", ["qsgd:s=0", "qsgd:x", "qsgd:s=1.5", "qsgd:4", "qsgd:s=", "qsgd:s=-3",
                                  "qsgd:s=32768", "qsgd:s=4:5", "qsgd:biased,s=4", "qsgd:s=4,biased,biased",
                                  "qsgd:s=4,", "qsgd:,biased", "qsgd:"])
def test_a_bad_qsgd_is_named(spec):
    with pytest.raises(UsageError, match="--compress-op") as e:
        Operator.parse("compress-op", spec)
    assert "\n" not in str(e.value) and "qsgd:s=S" in str(e.value)


@pytest.mark.parametrize("flags, named", [
    (["--protocol", "choco", "--compress-op", "qsgd:s=0"], "--compress-op"),
    (["--protocol", "choco", "--compress-op", "qsgd:x"], "--compress-op"),
    (["--protocol", "choco", "--compress-op", "qsgd:s=1.5"], "--compress-op"),
    (["--protocol", "choco", "--compress-op", "qsgd:s=40000"], "--compress-op"),
    (["--protocol", "dpsgd", "--sparsify", "qsgd:s=0"], "--sparsify"),
    (["--protocol", "dfedavgm", "--sparsify", "qsgd:s=1.5"], "--sparsify"),
])
def test_bad_qsgd_flags_give_one_line_and_no_run_directory(flags, named, tmp_path, capsys):
    assert_refused(capsys, [*RING, *flags], named, tmp_path / "run")


# -- bytes


@pytest.mark.parametrize("s, frame", [(4, 1048), (127, 1048), (128, 2048), (32767, 2048)])
def test_a_tensors_bytes_are_its_codes_and_one_float(s, frame):
    """1000 entries: 16 prefix + 31 or 32 header bytes ({"c": descriptor, "s": float64}), padded to 48, + 1000 int8
    or 2000 int16 codes; q8's {"c", "s"} costs the same as qsgd with s <= 127."""
    x = torch.randn(1000)
    body = _qsgd(s).compress({"w": x}, np.random.default_rng(0))["w"]
    assert len(wire.encode(body)) == frame == 48 + 1000 * body["c"].element_size()
    if s <= 127:
        q8 = Operator.parse("compress-op", "q8").compress({"w": x}, np.random.default_rng(0))["w"]
        assert len(wire.encode(q8)) == frame


@pytest.mark.parametrize("flags", [["--protocol", "choco", "--compress-op", "qsgd:s=4"],
                                   ["--protocol", "dpsgd", "--sparsify", "qsgd:s=200", "--error-feedback"]])
def test_every_qsgd_message_is_exactly_its_frame(flags, tmp_path):
    out = tmp_path / "run"
    assert main([*RING, "--nodes", "4", "--rounds", "2", "--model", "mlp:hidden=16", *flags, "--trace",
                 "--out", str(out)]) == 0
    messages = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
    state = float_state(build_model("mlp:hidden=16", (1, 8, 8), 10))
    op, kind = Operator.parse("compress-op", flags[3]), "choco" if flags[1] == "choco" else "model"
    for m in messages:
        q = op.compress(state, np.random.default_rng(0))  # the codes' values do not change their size
        body = {"degree": 2, "c": q} if "--error-feedback" in flags else {
            "seq": m["round"] + 1, "stale": [], "degree": 2, "delta": q}
        assert m["kind"] == kind and m["bytes"] == len(wire.encode([kind, m["round"], body]))
    assert len(messages) == 4 * 2 * 2


# -- received bodies


def test_a_hostile_qsgd_body_is_refused():
    like = {"w": torch.zeros(300), "b": torch.zeros(3)}
    op = _qsgd(4)
    check = op.check(like)
    good = wire.decode(wire.encode(op.compress({k: torch.randn(v.shape) for k, v in like.items()},
                                               np.random.default_rng(0))))
    assert check(good)
    w = good["w"]
    for bad in ({**w, "c": torch.full((300,), 5, dtype=torch.int8)},  # beyond +s
                {**w, "c": torch.full((300,), -5, dtype=torch.int8)},  # beyond -s
                {**w, "c": w["c"].to(torch.int16)},  # not the narrowest type
                {**w, "c": w["c"].to(torch.float32)},  # not codes
                {**w, "c": w["c"].numpy()},  # not a tensor
                {**w, "c": w["c"][:-1]},  # one code short
                {**w, "s": -1.0}, {**w, "s": float("nan")}, {**w, "s": float("inf")},
                {**w, "s": 1e39},  # beyond float32: its entries would decompress to inf
                {**w, "s": 1},  # not a float
                {"c": w["c"]},  # no scale
                {**w, "x": 0}):  # a key too many
        assert not check({**good, "w": bad}), bad
    assert not check({"w": w})  # a tensor missing
    # int8's -128 has no positive twin: the check must not take abs() of it
    wide = _qsgd(127)
    codes = torch.zeros(300, dtype=torch.int8)
    codes[7] = -128
    assert not wide.check(like)({**good, "w": {"c": codes, "s": 1.0}})
    codes[7] = -127
    assert wide.check(like)({**good, "w": {"c": codes, "s": 1.0}})
