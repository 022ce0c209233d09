"""Every random stream of a run comes from one function of (seed, purpose, key).

`stream(seed, "churn", node)` is a numpy SeedSequence whose spawn key holds a hash
of the purpose's name and the key (a node id, or src and dst for a link), so no two
purposes or keys share a stream, whatever the seed, and a stream never depends on
how many other streams were drawn before it.
"""
from __future__ import annotations

import json
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


# -- a generator's state as plain data (msgpack-able), for checkpoints

def random_state(rng: random.Random | None) -> list | None:
    if rng is None:
        return None
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(rng: random.Random, state: list) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


def numpy_state(generator: np.random.Generator | None) -> str | None:
    """A numpy Generator's bit generator state, as JSON (its integers outgrow msgpack's 64 bits)."""
    return None if generator is None else json.dumps(generator.bit_generator.state)


def set_numpy_state(generator: np.random.Generator, state: str) -> None:
    generator.bit_generator.state = json.loads(state)


def numpy_generator(state: str) -> np.random.Generator:
    """A numpy Generator in a saved state (the state is all of it: which stream it came from no longer matters)."""
    generator = np.random.default_rng()
    set_numpy_state(generator, state)
    return generator
