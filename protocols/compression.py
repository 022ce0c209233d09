"""What the communication-efficient methods share; not a protocol (nothing here is registered).

Compression operators Q (--compress-op, --sparsify), each per tensor of a state (name -> tensor):
  topk:F   the ceil(F n) entries of largest magnitude, as values and their indices
  randk:F  ceil(F n) entries drawn without replacement by the sender's generator, as values and indices
  sign     one bit an entry (0 counts as +), packed 8 a byte, times the mean magnitude ||x||_1 / n
           (the scale epfml/ChocoSGD uses)
  q8, q4   unbiased stochastic rounding to 8 or 4 bits with the max-abs scale (the wire's --compress)
  qsgd:s=S QSGD (Alistarh et al. 2017): sign(x_i) ||x||_2 xi_i / S with xi_i = floor(S |x_i| / ||x||_2 + u),
           u ~ U[0, 1) from the sender's generator, so unbiased; 1 <= S <= 32767 levels, qsgd alone S=127,
           the most int8 holds. qsgd:s=S,biased scales it by 1 / (1 + omega), omega = min(n/S^2, sqrt(n)/S),
           so E||Q(x) - x||^2 < ||x||^2 (a contraction, as CHOCO's theory asks; epfml/ChocoSGD's is_biased).
           Codes travel as int8 (S <= 127) or int16, with ||x||_2 (or its scaled value) as a float.
           Unlike q8/q4 the scale is the L2 norm, not max |x_i|, and S is free: entries small against
           ||x||_2 mostly round to 0 (a sparse, unbiased code), and E||Q(x) - x||^2 <= min(n/S^2, sqrt(n)/S) ||x||^2
  none     the tensor itself
Indices travel in the narrowest unsigned type that holds the tensor's size, so the ledger counts
k values and k indices, not the dense size.

PublicCopies: x̂, the copy of a node's model that its neighbours rebuild from the compressed
increments it sends (CHOCO-SGD's x̂_i, and DCD-PSGD's replica of the node's model), and the node's
copies of its neighbours' x̂_j. Lost increments are detected by a sequence number and repaired by one
dense copy on request (see docs/compression.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from emulator import wire
from emulator.errors import UsageError
from topologies import neighbour_weight
from p2p_emulator.workloads.lazy import LazyModule

from .common import DEGREE, Check, expects, like, node_ids

torch = LazyModule("torch")

OPERATORS = ("topk", "randk", "sign", "q8", "q4", "qsgd", "none")
QSGD_LEVELS = 127  # a plain `qsgd`'s s, the most int8 holds: at 16 CHOCO and DeepSqueeze diverge (docs/compression.md)
CODE_TYPES = (np.int8, np.int16)  # qsgd's codes, in [-s, s]: the narrowest of these that holds s
INDEX_TYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


def index_type(size: int) -> type:
    """The narrowest unsigned integer type that indexes `size` entries."""
    return next(t for t in INDEX_TYPES if size - 1 <= np.iinfo(t).max)


def code_type(levels: int):
    """The narrowest signed integer torch dtype that holds qsgd's codes in [-levels, levels]."""
    kind = next(t for t in CODE_TYPES if levels <= np.iinfo(t).max)
    return torch.int8 if kind is np.int8 else torch.int16


@dataclass(frozen=True)
class Operator:
    """A compression operator Q: compress (state -> wire body) and decompress (body -> dense state)."""
    name: str
    fraction: float = 1.0  # topk and randk: the share of each tensor's entries sent
    levels: int = 0  # qsgd: s, the number of levels of |x_i| / ||x||_2 above 0
    biased: bool = False  # qsgd: scaled by 1 / (1 + omega), a contraction, as the reference's CHOCO runs use

    @classmethod
    def parse(cls, flag: str, spec: str) -> Operator:
        """`topk:0.01`, `qsgd:s=4` and the like; a bad spec is a one-line UsageError naming `flag`."""
        name, _, text = spec.partition(":")
        fraction, levels = 1.0, 0
        if name in ("topk", "randk"):
            try:
                fraction = float(text)
            except ValueError:
                fraction = math.nan
            good = 0 < fraction <= 1
        elif name == "qsgd":
            parts = text.split(",") if text else []
            biased = parts[-1:] == ["biased"]
            rest = parts[:-1] if biased else parts
            digits = rest[0].removeprefix("s=") if rest[:1] and rest[0].startswith("s=") else "" if rest else str(
                QSGD_LEVELS)
            levels = int(digits) if len(rest) <= 1 and digits.isascii() and digits.isdigit() else 0
            good = 1 <= levels <= np.iinfo(CODE_TYPES[-1]).max and (bool(text) or ":" not in spec)
        else:
            good = name in OPERATORS and not text
        if not good:
            raise UsageError(f"--{flag} {spec!r}: choose topk:F or randk:F (0 < F <= 1), sign, q8, q4, "
                             f"qsgd:s=S[,biased] (1 <= S <= {np.iinfo(CODE_TYPES[-1]).max}; qsgd: S={QSGD_LEVELS}) "
                             "or none")
        return cls(name, fraction, levels, name == "qsgd" and biased)

    def kept(self, size: int) -> int:
        """How many entries of a tensor of `size` a sparse operator sends."""
        return min(size, max(1, math.ceil(self.fraction * size)))

    def compress(self, state: dict, rng: np.random.Generator) -> dict:
        return {name: self._compress(t.reshape(-1), rng) for name, t in state.items()}

    def decompress(self, body: dict, like_state: dict) -> dict:
        """The dense tensors `body` stands for, shaped and typed as like_state's."""
        return {name: self._decompress(body[name], t.numel(), t.dtype).view(t.shape) for name, t in like_state.items()}

    def check(self, like_state: dict) -> Check:
        """A check of received compressed bodies of a state like `like_state`."""
        return expects(**{name: self._check(t.numel(), t.dtype) for name, t in like_state.items()})

    def _compress(self, flat, rng: np.random.Generator):
        n = flat.numel()
        if self.name in ("topk", "randk"):
            k = self.kept(n)
            if self.name == "topk":
                index = flat.abs().topk(k, sorted=False).indices.sort().values
            else:
                index = torch.from_numpy(np.sort(rng.choice(n, k, replace=False)))
            return {"i": index.numpy().astype(index_type(n)), "v": flat[index].clone()}
        if self.name == "sign":
            scale = float(flat.abs().mean()) if n else 0.0
            return {"b": np.packbits((flat >= 0).numpy()), "s": scale}
        if self.name in wire.QUANTISERS:
            if not torch.isfinite(flat).all():  # a diverged model: a body every receiver refuses, as for sign
                return {"c": self._codes(n), "s": math.nan}
            codes, scale = wire.quantise(flat, self.name, rng)
            return {"c": codes, "s": scale}
        if self.name == "qsgd":
            return _qsgd(flat, self.levels, rng, self.biased)
        return flat.clone()

    def _codes(self, n: int):
        """Zero codes of a quantiser for n entries, shaped as on the wire."""
        if self.name == "qsgd":
            return torch.zeros(n, dtype=code_type(self.levels))
        return torch.zeros(n, dtype=torch.int8) if self.name == "q8" else torch.zeros((n + 1) // 2, dtype=torch.uint8)

    def _decompress(self, part, n: int, dtype):
        if self.name in ("topk", "randk"):
            dense = torch.zeros(n, dtype=dtype)
            dense[torch.from_numpy(part["i"].astype(np.int64))] = part["v"]
            return dense
        if self.name == "sign":  # -s or s in float32 by bit, looked up: as (2 bit - 1) s, in one step, not four
            levels = np.array([-part["s"], part["s"]], dtype=np.float32)
            return torch.from_numpy(levels.take(np.unpackbits(part["b"], count=n))).to(dtype)
        if self.name in wire.QUANTISERS:
            return wire.dequantise(part["c"], self.name, part["s"], n, dtype)
        if self.name == "qsgd":
            work = torch.float64 if dtype == torch.float64 else torch.float32
            return part["c"].to(work).mul_(part["s"] / self.levels).to(dtype)
        return part

    def _check(self, n: int, dtype) -> Check:
        if self.name in ("topk", "randk"):
            k, kind = self.kept(n), index_type(n)
            values = like(torch.zeros(k, dtype=dtype))
            return lambda p: (isinstance(p, dict) and p.keys() == {"i", "v"} and isinstance(p["i"], np.ndarray)
                              and p["i"].dtype == kind and p["i"].shape == (k,) and (k == 0 or int(p["i"].max()) < n)
                              and values(p["v"]))
        scale = _scale(dtype)
        if self.name == "sign":
            return expects(b=np.zeros((n + 7) // 8, np.uint8), s=scale)
        if self.name in wire.QUANTISERS:
            return expects(c=self._codes(n), s=scale)
        if self.name == "qsgd":
            levels, kind = self.levels, code_type(self.levels)
            # |code| <= s and scale <= the dtype's max: every decompressed entry is finite
            codes = lambda c: (torch.is_tensor(c) and c.dtype == kind and c.shape == (n,)  # noqa: E731
                               and (n == 0 or -levels <= int(c.min()) and int(c.max()) <= levels))
            return expects(c=codes, s=scale)
        return like(torch.zeros(n, dtype=dtype))


def _qsgd(flat, levels: int, rng: np.random.Generator, biased: bool = False) -> dict:
    """QSGD's codes of a flat tensor, sign(x_i) xi_i with xi_i = floor(s |x_i| / ||x||_2 + u), and its scale:
    ||x||_2, or, biased, ||x||_2 / (1 + omega) with omega = min(n / s^2, sqrt(n) / s), the variance bound."""
    work = torch.float64 if flat.dtype == torch.float64 else torch.float32
    x = flat.to(work)
    norm = float(torch.linalg.vector_norm(x, dtype=torch.float64)) if x.numel() else 0.0
    if not norm <= torch.finfo(flat.dtype).max:  # a diverged model: a body every receiver refuses (its scale)
        return {"c": torch.zeros(x.numel(), dtype=code_type(levels)), "s": math.nan}
    y = x.abs().div_(norm or 1.0).mul_(levels)
    u = rng.random(y.numel(), dtype=np.float32 if work == torch.float32 else np.float64)
    # floor(y + u) is floor(y) + 1 with probability frac(y): E[xi] = y. y <= s but for rounding in the norm.
    xi = y.add_(torch.from_numpy(u)).floor_().clamp_(max=levels)
    n = x.numel()
    omega = min(n / levels ** 2, math.sqrt(n) / levels) if biased else 0.0
    return {"c": xi.copysign_(x).to(code_type(levels)), "s": norm / (1 + omega)}


def _scale(dtype) -> Check:
    top = torch.finfo(dtype).max
    return lambda s: type(s) is float and 0 <= s <= top


def difference(a: dict, b: dict) -> dict:
    return {name: a[name] - b[name] for name in a}


def copied(state: dict) -> dict:
    return {name: value.clone() for name, value in state.items()}


def on_host(state: dict) -> dict:
    """The state in host memory (no copy there), where the copies x̂ live and the operators work."""
    return {name: value.cpu() for name, value in state.items()}


# -- x̂: the public copies


@dataclass
class PublicCopies:
    """x̂_i (what the neighbours rebuild of this node's model) and this node's x̂_j of each neighbour j.

    Every copy starts at `start` (CHOCO: zeros; DCD-PSGD: the common x0), or, with start None
    (--init independent), is unknown until x̂_j comes whole, as it does in j's first message. A sender
    numbers its increments; a receiver that finds one missing keeps its last x̂_j, marks j stale and says
    so in each message it sends; j then sends it its whole x̂_j once, and the ledger counts those bytes.
    """
    public: dict  # x̂_i
    start: dict | None
    seq: int = 0  # increments added to x̂_i
    copies: dict = field(default_factory=dict)  # j -> x̂_j
    seqs: dict = field(default_factory=dict)  # j -> the number of j's increments in this node's x̂_j
    degrees: dict = field(default_factory=dict)  # j -> j's (in-)degree, from its last message
    stale: list = field(default_factory=list)  # neighbours whose increments were missed
    asked: list = field(default_factory=list)  # neighbours that asked this node for its whole x̂_i
    refreshed: dict = field(default_factory=dict)  # j -> the round x̂_i was last sent whole to j

    def advance(self, increment: dict) -> None:
        """x̂_i += Q(...), as every neighbour will add it."""
        for name, value in increment.items():
            self.public[name].add_(value)
        self.seq += 1

    def send(self, node, kind: str, compressed: dict, **extra) -> None:
        """The increment to every (out-)neighbour; x̂_i whole to those that asked for it and, when copies
        have no common start, to those never sent it."""
        head = {"seq": self.seq, "stale": self.stale, **extra}
        whole = [j for j in node.neighbours if j in self.asked or (self.start is None and j not in self.refreshed)]
        node.broadcast(kind, {**head, "delta": compressed}, to=[j for j in node.neighbours if j not in whole])
        for j in whole:
            node.send(j, kind, {**head, "whole": self.public})
            self.refreshed[j] = node.round
        self.asked = []

    def check(self, operator: Operator, num_nodes: int) -> Check:
        """A check of the bodies `send` writes: an increment or a whole x̂_j, never both."""
        body = expects(optional=("delta", "whole"), seq=int, stale=node_ids(num_nodes), degree=int,
                       delta=operator.check(self.public), whole=like(self.public))
        return lambda b: body(b) and len(b.keys() & {"delta", "whole"}) == 1

    def receive(self, node, heard: dict, operator: Operator) -> None:
        """Add each heard increment to its x̂_j, or take a whole x̂_j; note what was missed and who asks."""
        for j, message in heard.items():
            body = message.body
            self.degrees[j] = body[DEGREE]
            if node.id in body["stale"] and self.refreshed.get(j) != node.round:  # not answered this round
                self.asked.append(j)
            if "whole" in body:
                self.copies[j], self.seqs[j] = body["whole"], body["seq"]
                self._mark(j, stale=False)
            elif self.copy_of(j) is not None and body["seq"] == self.seqs.get(j, 0) + 1:
                for name, value in operator.decompress(body["delta"], self.public).items():
                    self.copies[j][name].add_(value)
                self.seqs[j] = body["seq"]
            else:
                self._mark(j, stale=True)

    def copy_of(self, j: int) -> dict | None:
        """x̂_j as this node holds it (the start, if nothing came yet); None while unknown."""
        if j not in self.copies and self.start is not None:
            self.copies[j] = copied(self.start)
        return self.copies.get(j)

    def in_step(self, j: int) -> bool:
        """Whether this node holds x̂_j and has found none of j's increments missing since it was last whole."""
        return j in self.copies and j not in self.stale

    def _mark(self, j: int, stale: bool) -> None:
        if stale and j not in self.stale:
            self.stale = sorted([*self.stale, j])
        elif not stale and j in self.stale:
            self.stale = [k for k in self.stale if k != j]

    def rows(self, node, mixing: str, among=None) -> list:
        """[w_ij, j] of the in-neighbours (those in `among`, if given) whose x̂_j this node holds whole and whose
        degree it knows, from the graph of this exchange; a stale x̂_j, off by the increments it missed, waits."""
        degree = len(node.in_neighbours)
        return [[neighbour_weight(mixing, degree, self.degrees[j]), j] for j in node.in_neighbours
                if j in self.degrees and self.in_step(j) and (among is None or j in among)]

    def consensus(self, rows: list, step: float) -> dict:
        """gamma * sum_j w_ij (x̂_j - x̂_i) over `rows` [w_ij, j] (taken at an exchange, kept for a later round)."""
        return weighted_differences(self.public, [(w, self.copies[j]) for w, j in rows if self.in_step(j)], step)


def weighted_differences(own: dict, rows, step: float) -> dict:
    """step * sum_j w_j (x_j - own) over rows of (w_j, x_j): a consensus step on states."""
    shift = {name: torch.zeros_like(value) for name, value in own.items()}
    for weight, other in rows:
        for name, value in shift.items():
            value.add_(other[name] - own[name], alpha=step * weight)
    return shift


# The consensus step a method takes when --consensus-step is not given, by operator: the best final accuracy
# of experiments/compression_gamma.yaml (digits, seed 9, held out from the tables; docs/compression.md), with
# top-k and random-k at F = 0.01 and qsgd at s = 127. CHOCO's none is exact gossip of the copies.
CONSENSUS_STEPS = {
    "choco": {"topk": 0.05, "randk": 0.01, "sign": 1.0, "q8": 1.0, "q4": 1.0, "qsgd": 1.0, "none": 1.0},
    "deepsqueeze": {"topk": 0.01, "randk": 0.01, "sign": 0.2, "q8": 1.0, "q4": 0.5, "qsgd": 0.5},
}
