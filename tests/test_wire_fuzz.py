"""Property-based tests of the wire codec (hypothesis): what encodes decodes to itself, and no input
whatever makes decode raise anything but WireError. `./dev bench fuzz_wire` runs the same properties longer."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from emulator.wire import WireError, decode, encode

SCALARS = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text() \
    | st.binary()
ARRAYS = hnp.arrays(st.sampled_from(["int8", "int64", "uint16", "float32", "float64", "bool", "complex64"]),
                    hnp.array_shapes(min_dims=0, max_dims=4, max_side=5))
VALUES = st.recursive(SCALARS | ARRAYS, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def decodes_or_refuses(frame: bytes, checksum: bool) -> None:
    try:
        decode(frame, checksum=checksum)
    except WireError:
        pass


@FUZZ
@given(VALUES)
def test_what_encodes_decodes_to_itself(value):
    assert same(decode(encode(value)), value)


@FUZZ
@given(st.binary(max_size=4096), st.booleans())
def test_arbitrary_bytes_only_ever_raise_wire_error(frame, checksum):
    decodes_or_refuses(frame, checksum)
    decodes_or_refuses(b"P2PW" + frame, checksum)


@FUZZ
@given(VALUES, st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_frames_only_ever_raise_wire_error(value, edits):
    """Past the checksum (off here), the structural checks must hold on their own."""
    frame = bytearray(encode(value, checksum=False))
    for position, byte in edits:
        frame[position % len(frame)] = byte
    decodes_or_refuses(bytes(frame), checksum=False)
