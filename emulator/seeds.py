"""Every random stream of a run comes from one function of (seed, purpose, key).

`stream(seed, "churn", node)` is a numpy SeedSequence whose spawn key holds a hash
of the purpose's name and the key (a node id, or src and dst for a link), so no two
purposes or keys share a stream, whatever the seed, and a stream never depends on
how many other streams were drawn before it.
"""
from __future__ import annotations

import random
import zlib

import numpy as np


def stream(seed: int, purpose: str, *key: int) -> np.random.SeedSequence:
    # The key's length is part of the spawn key, so (a,) and (a, 0) differ.
    return np.random.SeedSequence(seed, spawn_key=(zlib.crc32(purpose.encode()), len(key), *key))


class Seeds:
    """The run's seed, and the generators every purpose draws from."""

    def __init__(self, seed: int):
        self.seed = seed

    def stream(self, purpose: str, *key: int) -> np.random.SeedSequence:
        return stream(self.seed, purpose, *key)

    def numpy(self, purpose: str, *key: int) -> np.random.Generator:
        return np.random.default_rng(self.stream(purpose, *key))

    def python(self, purpose: str, *key: int) -> random.Random:
        return random.Random(int.from_bytes(self.stream(purpose, *key).generate_state(4).tobytes(), "little"))

    def integer(self, purpose: str, *key: int) -> int:
        """A 63-bit seed, for libraries that take an int (torch.manual_seed, networkx)."""
        return int(self.stream(purpose, *key).generate_state(1, np.uint64)[0] >> np.uint64(1))
