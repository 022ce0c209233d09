"""The arithmetic and cryptography of secure aggregation (protocols/secagg.py); not a protocol.

- keys: X25519 key pairs, agreement, and HKDF(SHA-256) to turn a shared secret into a key;
- Shamir's t-of-n sharing of a 32-byte secret over the prime field GF(2^521 - 1);
- AES-GCM for the shares a client sends another through the server;
- masks: AES-256-CTR as the PRG that expands a 32-byte seed into a vector of Z_{2^64};
- fixed point: the weighted update n_k (x_k - x), and n_k, as elements of Z_{2^64}, refused (Unrepresentable)
  where not finite or so large that a sum of them could wrap.

Every primitive is the `cryptography` package's; only Shamir's polynomial arithmetic is written here.
The jobs at the bottom are what nodes run through node.compute; each takes and returns plain bytes,
arrays and dicts, so that it can run on a Ray worker too.
"""
from __future__ import annotations

import functools

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from emulator.work import Work
from p2p_emulator.workloads.lazy import LazyModule
from p2p_emulator.workloads.training import float_state

torch = LazyModule("torch")

KEY_BYTES = 32
PRIME = 2**521 - 1  # a Mersenne prime: every 32-byte secret is a field element
SHARE_BYTES = 66  # a field element, big-endian
TAG_BYTES = 16
CIPHERTEXT_BYTES = 2 * SHARE_BYTES + TAG_BYTES  # a share of the mask key and one of the self-mask seed, sealed
FRACTION_BITS = 24  # fixed point: 2^-24 steps; |sum| below 2^39 fits Z_{2^64} as a signed value
RING = np.uint64

# Emulated cost, in units of 1 ms measured on a 2-core x86 VM (work no kernel count sees: priced at the
# device profile's `uncounted` factor, or at --compute-cost per unit under --compute-time per-sample):
# X25519 and HKDF 35 us, AES-CTR 7.4 ns per 8 bytes, AES-GCM 1 us per share, a 521-bit multiplication 1 us,
# an inversion 0.5 ms.
UNIT_SECONDS = 1e-3
AGREEMENT_WORK = 0.035
PRG_ENTRY_WORK = 1e-5  # expand and add one entry
SEAL_WORK = 0.001
FIELD_WORK = 0.001
INVERSE_WORK = 0.5


def work(units: float) -> Work:
    """The Work of `units` of cryptography."""
    return Work(reference_seconds=units * UNIT_SECONDS, units=units)


# -- keys

def key_pair(private: bytes) -> tuple[bytes, bytes]:
    """(private, public) raw bytes of the X25519 key whose private bytes are given."""
    public = X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()
    return private, public


def derive(private: bytes, public: bytes, purpose: str) -> bytes:
    """A 32-byte key for `purpose` from the X25519 agreement of two parties (either side gets the same)."""
    secret = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    return expand(secret, purpose)


_PROBE = X25519PrivateKey.from_private_bytes(bytes(KEY_BYTES))  # any key: X25519 makes it a multiple of 8


@functools.lru_cache(maxsize=1 << 14)  # every client checks the same key list: one agreement per key, not per client
def agreeable(public: bytes) -> bool:
    """Whether X25519 agreement with `public` gives a key: `cryptography` refuses a low-order point (such as 32
    zero bytes), whose shared secret is all zeros whatever the private key."""
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def expand(secret: bytes, purpose: str) -> bytes:
    """HKDF-SHA256 of `secret`, bound to `purpose` (no salt: every secret is fresh each round)."""
    return HKDF(hashes.SHA256(), KEY_BYTES, None, purpose.encode()).derive(secret)


# -- Shamir's secret sharing over GF(PRIME); holder h's share is the polynomial at h + 1

def split(secret: bytes, holders: list[int], threshold: int, rng: np.random.Generator) -> dict[int, bytes]:
    """Shares of `secret` such that any `threshold` of them give it back and fewer say nothing of it."""
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [int.from_bytes(rng.bytes(SHARE_BYTES), "big") % PRIME for _ in range(threshold - 1)]
    return {h: _evaluate(coefficients, h + 1).to_bytes(SHARE_BYTES, "big") for h in holders}


def _evaluate(coefficients: list[int], x: int) -> int:
    value = 0
    for c in reversed(coefficients):  # Horner
        value = (value * x + c) % PRIME
    return value


def join(shares: dict[int, bytes]) -> bytes:
    """The secret from shares {holder: share}: Lagrange interpolation at 0, with one inversion."""
    points = [(h + 1, int.from_bytes(s, "big")) for h, s in shares.items()]
    numerator, denominator = 0, 1
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if j != i:
                num, den = num * xj % PRIME, den * (xj - xi) % PRIME
        numerator = (numerator * den + yi * num * denominator) % PRIME  # a/b + c/d = (ad + cb) / bd
        denominator = denominator * den % PRIME
    secret = numerator * pow(denominator, PRIME - 2, PRIME) % PRIME
    return secret.to_bytes(KEY_BYTES, "big") if secret < 2 ** (8 * KEY_BYTES) else b""  # b"": shares disagree


def is_share(value) -> bool:
    """A share as it travels: SHARE_BYTES bytes holding a field element."""
    return isinstance(value, bytes) and len(value) == SHARE_BYTES and int.from_bytes(value, "big") < PRIME


# -- the share exchange: AES-GCM under a key agreed between sender and recipient

def _binding(rnd: int, sender: int, recipient: int) -> str:
    """What a sealed share is bound to: a share replayed from another round, or redirected, fails to open."""
    return f"secagg.shares|{rnd}|{sender}|{recipient}"


def _nonce(sender: int, recipient: int) -> bytes:
    """The pair's agreed key is the same both ways and new each round: the direction makes each nonce unique
    under it (AES-GCM must never seal two messages under one key and nonce)."""
    return sender.to_bytes(6, "big") + recipient.to_bytes(6, "big")


def seal(key: bytes, rnd: int, sender: int, recipient: int, plaintext: bytes) -> bytes:
    aad = _binding(rnd, sender, recipient).encode()
    return AESGCM(key).encrypt(_nonce(sender, recipient), plaintext, aad)


def unseal(key: bytes, rnd: int, sender: int, recipient: int, ciphertext: bytes) -> bytes | None:
    """The plaintext, or None if the ciphertext fails authentication."""
    try:
        return AESGCM(key).decrypt(_nonce(sender, recipient), ciphertext, _binding(rnd, sender, recipient).encode())
    except InvalidTag:
        return None


# -- masks and fixed point

def prg(seed: bytes, length: int) -> np.ndarray:
    """`length` pseudorandom elements of Z_{2^64}: AES-256-CTR keystream under `seed`."""
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(RING, copy=False)


class Unrepresentable(ValueError):
    """An input that must not enter a sum in Z_{2^64}: why, in words."""


def to_ring(values: np.ndarray, summands: int = 1) -> np.ndarray:
    """Reals as fixed-point elements of Z_{2^64} (two's complement) such that a sum of `summands` of them stays in
    the signed range [-2^63, 2^63): each at most (2^63 - 1) // summands steps of 2^-24 in absolute value, else
    Unrepresentable. A bare cast would turn NaN, inf and |x| >= 2^39 into -2^39, and a sum past the range wraps:
    a diverged client would add a large finite value, unseen."""
    bad = np.count_nonzero(~np.isfinite(values))
    if bad:
        raise Unrepresentable(f"{bad} of {values.size} entries are not finite")
    with np.errstate(over="ignore"):
        scaled = np.round(values * 2.0**FRACTION_BITS)
    fits = np.abs(scaled) < 2.0**63  # then int64 holds it exactly (the float below 2^63 is 2^63 - 1024)
    ring = np.where(fits, scaled, 0.0).astype(np.int64)
    bound = (2**63 - 1) // summands
    beyond = np.count_nonzero(~fits | (np.abs(ring) > bound))
    if beyond:
        raise Unrepresentable(f"{beyond} of {values.size} entries are beyond ±{bound / 2.0**FRACTION_BITS:.6g}, "
                              f"past which a sum of {summands} inputs could wrap")
    return ring.view(RING)


def from_ring(values: np.ndarray) -> np.ndarray:
    return values.view(np.int64).astype(np.float64) / 2.0**FRACTION_BITS


def pair_sign(me: int, other: int) -> int:
    """The lower id adds the pair's mask, the higher subtracts it: the two cancel in the sum."""
    return 1 if me < other else -1


def pair_mask(private: bytes, public: bytes, rnd: int, length: int) -> np.ndarray:
    return prg(derive(private, public, f"secagg.mask|{rnd}"), length)


def self_mask(seed: bytes, rnd: int, length: int) -> np.ndarray:
    return prg(expand(seed, f"secagg.self|{rnd}"), length)


def update_vector(state: dict, start: dict, samples: int) -> np.ndarray:
    """n_k (x_k - x) flattened over the float tensors, then n_k: the sum of these gives FedAvg's average."""
    deltas = [(state[name].double() - start[name].double()).reshape(-1) * samples for name in start]
    return np.concatenate([torch.cat(deltas).numpy(), [float(samples)]])


# -- the jobs

def client_keys(material: bytes) -> dict[str, bytes]:
    """A client's round secrets from 96 bytes: the key pair for the share exchange (c), the one for the
    pairwise masks (s), and the self-mask seed b."""
    c_private, c_public = key_pair(material[:32])
    s_private, s_public = key_pair(material[32:64])
    return {"c_private": c_private, "c": c_public, "s_private": s_private, "s": s_public, "b": material[64:]}


def share_secrets(keys: dict, me: int, rnd: int, peers: dict[int, list[bytes]], threshold: int,
                  coefficient_seed: int) -> tuple[dict[int, bytes], bytes]:
    """({peer: sealed shares}, own shares): s_private and b split among the peers and the client itself,
    each peer's pair sealed under the key agreed with its c key."""
    holders = sorted([*peers, me])
    rng = np.random.default_rng(coefficient_seed)
    s_shares, b_shares = split(keys["s_private"], holders, threshold, rng), split(keys["b"], holders, threshold, rng)
    sealed = {v: seal(derive(keys["c_private"], peers[v][0], "secagg.shares"), rnd, me, v, s_shares[v] + b_shares[v])
              for v in peers}
    return sealed, s_shares[me] + b_shares[me]


def open_shares(keys: dict, me: int, rnd: int, peers: dict[int, list[bytes]],
                sealed: dict[int, bytes]) -> tuple[dict[int, bytes], list[int]]:
    """({sender: its s share + b share}, [senders whose ciphertext failed authentication])."""
    opened, refused = {}, []
    for u, ciphertext in sealed.items():
        plaintext = unseal(derive(keys["c_private"], peers[u][0], "secagg.shares"), rnd, u, me, ciphertext)
        if plaintext is None or not (is_share(plaintext[:SHARE_BYTES]) and is_share(plaintext[SHARE_BYTES:])):
            refused.append(u)
        else:
            opened[u] = plaintext
    return opened, refused


def masked_input(model, start: dict, samples: int, keys: dict, me: int, rnd: int, peers: dict[int, bytes],
                 summands: int) -> tuple[np.ndarray | None, str]:
    """The masked fixed-point update of the trained model from the global `start` (see masked)."""
    return masked(update_vector(float_state(model), start, samples), summands, keys, me, rnd, peers)


def masked_model(model, weight: float, keys: dict, me: int, rnd: int, peers: dict[int, bytes],
                 summands: int) -> tuple[np.ndarray | None, str]:
    """The masked fixed-point w x of the model's float tensors (a neighbour's term of a mixing step; see masked)."""
    values = weight * torch.cat([t.double().reshape(-1) for t in float_state(model).values()]).numpy()
    return masked(values, summands, keys, me, rnd, peers)


def masked(values: np.ndarray, summands: int, keys: dict, me: int, rnd: int,
           peers: dict[int, bytes]) -> tuple[np.ndarray | None, str]:
    """(the masked input, ""), or (None, why `values` cannot be one of `summands` inputs: see to_ring)."""
    try:
        x = to_ring(values, summands)
    except Unrepresentable as why:
        return None, str(why)
    return mask(x, keys, me, rnd, peers), ""


def mask(x: np.ndarray, keys: dict, me: int, rnd: int, peers: dict[int, bytes]) -> np.ndarray:
    """y = x + PRG(b) + sum_v sign(me, v) PRG(s_{me,v}) in Z_{2^64}, over the peers {v: s public key} that
    completed the share exchange."""
    y = x.copy()
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64
        y += self_mask(keys["b"], rnd, len(y))
        for v, public in peers.items():
            pad = pair_mask(keys["s_private"], public, rnd, len(y))
            y = y + pad if pair_sign(me, v) > 0 else y - pad
    return y


def recover(b_shares: dict[int, dict[int, bytes]], s_shares: dict[int, dict[int, bytes]],
            s_public: dict[int, bytes]) -> tuple[dict[int, bytes], dict[int, bytes], list[int]]:
    """(self-mask seeds of the survivors, s private keys of the dropped, [dropped ids whose key failed to
    rebuild]): each secret joined from its shares; a rebuilt key must match the public key it advertised."""
    seeds = {u: join(shares) for u, shares in b_shares.items()}
    keys, wrong = {}, []
    for v, shares in s_shares.items():
        private = join(shares)
        if len(private) == KEY_BYTES and key_pair(private)[1] == s_public[v]:
            keys[v] = private
        else:
            wrong.append(v)
    return seeds, keys, wrong


def unmask(total: np.ndarray, rnd: int, seeds: dict[int, bytes], dropped: dict[int, bytes],
           survivors_of: dict[int, dict[int, bytes]]) -> np.ndarray:
    """sum_u y_u - sum_u PRG(b_u) - (the masks survivors u shared with each dropped v): the sum of the inputs.
    `survivors_of[v]` holds the s public keys of the survivors that masked with dropped client v."""
    total = total.copy()
    with np.errstate(over="ignore"):
        for seed in seeds.values():
            total -= self_mask(seed, rnd, len(total))
        for v, private in dropped.items():
            for u, public in survivors_of[v].items():
                mask = pair_mask(private, public, rnd, len(total))
                total = total - mask if pair_sign(u, v) > 0 else total + mask
    return total


def mix_sum(model, self_weight: float, total: np.ndarray) -> None:
    """x <- w_ii x + sum_j w_ij x_j, the sum from the unmasked fixed-point total."""
    values, offset = torch.from_numpy(from_ring(total)), 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                n = tensor.numel()
                tensor.mul_(self_weight).add_(values[offset:offset + n].reshape(tensor.shape).to(tensor.dtype))
                offset += n


def add_average(model, total: np.ndarray) -> None:
    """x <- x + sum_k n_k (x_k - x) / sum_k n_k, from the unmasked fixed-point sum."""
    values = from_ring(total)
    if values[-1] <= 0:
        return
    step = torch.from_numpy(values[:-1] / values[-1])
    offset = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                n = tensor.numel()
                tensor += step[offset:offset + n].reshape(tensor.shape).to(tensor.dtype)
                offset += n
