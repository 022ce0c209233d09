import math
import struct
import time
import warnings

import crc32c
import msgpack
import numpy as np
import pytest
import torch

from emulator.wire import COMPRESSIONS, WireError, decode, encode

TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16,
                torch.uint32, torch.uint64, torch.complex64, torch.complex128,
                torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
                "bool", "uint16", "uint32", "uint64", "complex64", "complex128"]
SHAPES = [(5,), (2, 3, 4), (0,), (3, 0, 2), ()]


def make_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal lacks kernels for uint32/float8; comparing bytes works for every dtype
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def assert_same(got, want):
    """Deep equality where tuples come back as lists and tensors compare by dtype, shape, bytes."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor
        assert got.dtype == want.dtype and got.shape == want.shape
        assert same_bytes(got, want.detach())
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is list and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert type(got) is type(want) and got == want


def state_dict_like(seed=0):
    g = torch.Generator().manual_seed(seed)
    state, c_in = {}, 3
    for i, c_out in enumerate((16, 32, 32, 64)):
        state[f"conv{i}.weight"] = torch.randn(c_out, c_in, 3, 3, generator=g)
        state[f"bn{i}.weight"] = torch.randn(c_out, generator=g)
        state[f"bn{i}.running_var"] = torch.rand(c_out, generator=g)
        state[f"bn{i}.num_batches_tracked"] = torch.tensor(7)
        c_in = c_out
    state["fc.weight"] = torch.randn(10, c_in, generator=g)
    return state


# --- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip(dtype, shape):
    t = make_tensor(dtype, shape)
    assert_same(decode(encode(t)), t)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip(dtype, shape):
    a = make_tensor(torch.float64 if dtype.startswith("float") else torch.int64, shape).numpy()
    a = np.asarray((a > 0) if dtype == "bool" else np.abs(a).astype(dtype))  # 0-d stays an array
    assert_same(decode(encode(a)), a)


def test_big_endian_numpy_comes_back_with_the_same_values():
    a = np.arange(6, dtype=">f8").reshape(2, 3)
    got = decode(encode(a))
    assert got.dtype == np.float64 and got.dtype.isnative
    np.testing.assert_array_equal(got, a)


@pytest.mark.parametrize("view", [
    lambda t: t.t(),
    lambda t: t[::2, 1:],
    lambda t: t[:, 3],
    lambda t: t[:1].expand(5, 6),
    lambda t: t.to(torch.bfloat16).t(),
], ids=["transposed", "strided-slice", "column", "expanded", "bf16-transposed"])
def test_non_contiguous_torch(view):
    t = view(torch.arange(30, dtype=torch.float32).reshape(5, 6))
    assert not t.is_contiguous()
    assert_same(decode(encode(t)), t)


def test_non_contiguous_numpy():
    a = np.arange(30, dtype=np.int32).reshape(5, 6)
    for v in (a.T, a[::2, 1:], a[:, 3]):
        assert_same(decode(encode(v)), v.copy())


def test_nested_structure_with_int_keys():
    msg = {
        0: {"params": {3: torch.randn(2, 2), 7: np.arange(3)}, "round": 12},
        1: [torch.tensor(1.5), (1, -2, 2**40), "text", b"\x00raw", None, True, False, 0.25],
        "empty": {}, "nested": [[[]], ()],
        -5: float("inf"),
    }
    assert_same(decode(encode(msg)), msg)


def test_plain_values_without_tensors():
    for value in (None, 0, "x", b"", [], {}, 3.25, {1: 2}):
        assert_same(decode(encode(value)), value)


def test_requires_grad_is_sent_as_data():
    p = torch.nn.Parameter(torch.randn(3, 4))
    got = decode(encode({"w": p, "y": p * 2}))
    assert type(got["w"]) is torch.Tensor and not got["w"].requires_grad
    assert torch.equal(got["w"], p.detach()) and torch.equal(got["y"], (p * 2).detach())


def test_conjugate_and_negative_views_are_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    assert torch.equal(decode(encode(z.conj())), z.conj().resolve_conj())
    assert torch.equal(decode(encode(z.conj().imag)), -z.imag)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_comes_back_on_cpu():
    t = torch.randn(3, 3, device="cuda")
    got = decode(encode(t))
    assert got.device.type == "cpu" and torch.equal(got, t.cpu())


# --- memory: no aliasing of the sender, writable, zero-copy on the receiver --------------------

@pytest.mark.parametrize("as_bytes", [False, True], ids=["bytearray", "bytes"])
def test_decoded_does_not_follow_sender_mutations_and_is_writable(as_bytes):
    t, a = torch.arange(8, dtype=torch.float32), np.arange(8.0)
    frame = encode({"t": t, "a": a})
    if as_bytes:
        frame = bytes(frame)
    t.add_(100)
    a += 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable buffers
        got = decode(frame)
        got["t"].mul_(2)
    got["a"] *= 2
    assert torch.equal(got["t"], torch.arange(8, dtype=torch.float32) * 2)
    np.testing.assert_array_equal(got["a"], np.arange(8.0) * 2)
    assert torch.equal(t, torch.arange(8, dtype=torch.float32) + 100)  # sender untouched


def test_decode_of_a_bytearray_is_zero_copy_and_aligned():
    frame = encode({"a": torch.ones(3, dtype=torch.int8), "b": torch.arange(5.0),
                    "c": torch.arange(3, dtype=torch.float64), "d": np.arange(4)})
    base = np.frombuffer(frame, np.uint8).ctypes.data
    got = decode(frame)
    for address in (got["a"].data_ptr(), got["b"].data_ptr(), got["c"].data_ptr(), got["d"].ctypes.data):
        assert base <= address < base + len(frame)
        assert (address - base) % 16 == 0


def test_memoryview_frames():
    t = torch.arange(6.0).reshape(2, 3)
    frame = encode(t)
    assert torch.equal(decode(memoryview(frame)), t)
    assert torch.equal(decode(memoryview(bytes(frame))), t)


# --- malformed input ---------------------------------------------------------------------------

def sample_message():
    return {"w": torch.linspace(-2, 2, 15).reshape(3, 5),
            2: [np.arange(4, dtype=np.int16), "s"],
            "b": torch.tensor([True, False]),
            "h": torch.ones(3, dtype=torch.bfloat16)}


def sample_frame():
    return bytes(encode(sample_message()))


def split(frame):
    """(header object with raw ExtTypes, data region) following the documented layout."""
    _, _, sizes = struct.unpack_from("<4sIQ", frame)
    header_len, data_len = sizes >> 40, sizes & (2**40 - 1)
    header = msgpack.unpackb(frame[16:16 + header_len], strict_map_key=False,
                             ext_hook=lambda code, data: msgpack.ExtType(code, data))
    return header, frame[len(frame) - data_len:]


def join(header, data):
    return join_raw(msgpack.packb(header), data)


def join_raw(packed: bytes, data: bytes) -> bytes:
    """A frame with a valid checksum: the tampering tests reach the checks behind it."""
    rest = struct.pack("<Q", len(packed) << 40 | len(data)) + packed + bytes(-(16 + len(packed)) % 16) + data
    return b"P2PW" + struct.pack("<I", crc32c.crc32c(rest)) + rest


def edit_ext(header, edit):
    """Apply edit(code, fields) -> (code, fields) to the first ext type of the sample header."""
    code, fields = edit(header["w"].code, msgpack.unpackb(header["w"].data))
    header["w"] = msgpack.ExtType(code, msgpack.packb(fields))
    return header


def refused_behind_the_checksum(frame) -> str:
    """decode's WireError for a tampered frame built with a valid checksum: the reason must be the
    tampering, not the magic or the CRC (which would make the test pass without reaching it)."""
    with pytest.raises(WireError) as caught:
        decode(frame)
    reason = str(caught.value)
    assert "checksum" not in reason and "magic" not in reason
    return reason


def test_layout_helpers_rebuild_a_valid_frame():
    frame = sample_frame()
    assert join(*split(frame)) == frame  # so the tampering tests below change only what they say


@pytest.mark.parametrize("frame", [b"", b"P2PW", bytes(16), b"\x00" * 100, b"garbage" * 9,
                                   b"P2PW" + bytes(12), b"P2PW" + b"\xff" * 40])
def test_junk_frames(frame):
    with pytest.raises(WireError):
        decode(frame)


def test_random_garbage():
    rng = np.random.default_rng(0)
    for n in list(range(0, 64)) + [100, 1000, 5000]:
        for _ in range(5):
            junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            for frame in (junk, b"P2PW" + junk):
                with pytest.raises(WireError):
                    decode(frame)


def test_every_truncation():
    frame = sample_frame()
    for cut in range(len(frame)):
        with pytest.raises(WireError):
            decode(frame[:cut])
        # without the checksum (which refuses most cuts first) the sizes in the prefix must refuse each
        with pytest.raises(WireError, match="shorter than its prefix" if cut < 16 else "but its prefix says"):
            decode(frame[:cut], checksum=False)


@pytest.mark.parametrize("junk", [b"\x00", b"x", bytes(16), b"P2PW" * 10])
def test_trailing_junk(junk):
    frame = bytearray(sample_frame() + junk)
    struct.pack_into("<I", frame, 4, crc32c.crc32c(bytes(frame[8:])))  # the junk checksummed: the sizes must refuse it
    with pytest.raises(WireError, match=f"frame is {len(frame)} bytes but its prefix says {len(frame) - len(junk)}"):
        decode(frame)


def tensor_spans(header, start):
    """{frame index: the tensor's dtype} for every byte of every tensor, from the header's descriptors."""
    spans = {}
    for ext in (header["w"], header[2][0], header["b"], header["h"]):
        name, _, offset, nbytes = msgpack.unpackb(ext.data)
        spans.update(dict.fromkeys(range(start + offset, start + offset + nbytes), name))
    return spans


def flips_decode_accepts(frame):
    """The (index, mask) flips of sample_frame that decode(checksum=False) must accept; all others are refused.

    Derived from the layout, not observed: what a flip leaves decodable is
      - the CRC field: no checksum is checked;
      - the zero padding after the header and between tensors: decode never reads it;
      - every byte of every tensor (any bits are a float or an int), except that a bool byte must
        stay 0 or 1: flipping its low bit swaps them, flipping all its bits makes 0xFE or 0xFF;
      - the header's plain values outside the descriptors: each one-letter str ("w", "s", "b",
        "h") flipped in its low bit is another letter, flipped in all bits is not UTF-8; the int
        key 2 (a positive fixint) becomes 3 or, flipped in all bits, the negative fixint -3.
    Everything else is structure: the magic, the sizes, msgpack's type bytes and lengths, the
    dtype names, the shapes, offsets and sizes of the descriptors.
    """
    header, data = split(frame)
    packed = msgpack.packb(header)  # the header's bytes (test_layout_helpers_rebuild_a_valid_frame)
    start = len(frame) - len(data)
    plain = [msgpack.packb(letter) for letter in "wsbh"] + [msgpack.packb(2) + b"\x92"]  # 2, then its list
    assert all(packed.count(value) == 1 for value in plain)
    text = [16 + packed.index(value) + 1 for value in plain[:-1]]  # the letter after its fixstr byte
    int_key = 16 + packed.index(plain[-1])
    spans = tensor_spans(header, start)
    ignored = [*range(4, 8), *(i for i in range(16 + len(packed), len(frame)) if i not in spans)]
    accepted = {(i, mask) for i in ignored for mask in (0xFF, 0x01)}
    accepted |= {(i, mask) for i, name in spans.items() for mask in (0xFF, 0x01)
                 if name != "bool" or mask == 0x01}
    accepted |= {(i, 0x01) for i in text} | {(int_key, 0xFF), (int_key, 0x01)}
    return accepted, set(ignored)


def test_every_byte_flipped_is_either_decoded_or_a_wire_error_without_checksums():
    frame = sample_frame()
    want, ignored = flips_decode_accepts(frame)
    assert len(ignored) == 4 + 8 + 4 + 8 + 14  # the CRC, then padding after the header and after three tensors
    accepted = set()
    for i in range(len(frame)):
        for mask in (0xFF, 0x01):
            bad = bytearray(frame)
            bad[i] ^= mask
            try:
                got = decode(bad, checksum=False)
            except WireError:
                continue
            accepted.add((i, mask))
            if i in ignored:  # bytes decode never reads: the message comes back as it was sent
                assert_same(got, sample_message())
    assert accepted == want
    assert 2 * len(frame) - len(accepted) == 164  # of 396 flips: what a checksum-less receiver refuses


def test_the_checksum_catches_every_flipped_bit():
    frame = sample_frame()
    assert_same(decode(frame), sample_message())
    for bit in range(8 * len(frame)):
        bad = bytearray(frame)
        bad[bit >> 3] ^= 1 << (bit & 7)
        # the magic is checked first; from the CRC field on, every bit is the checksum's to catch
        with pytest.raises(WireError, match="magic" if bit < 32 else "fails its checksum"):
            decode(bad)


def test_frames_without_checksums_decode_only_without_checking():
    frame = encode({"x": np.arange(3)}, checksum=False)
    assert struct.unpack_from("<I", frame, 4) == (0,)
    assert decode(frame, checksum=False)["x"].tolist() == [0, 1, 2]
    with pytest.raises(WireError, match="checksum"):
        decode(frame)
    assert len(frame) == len(encode({"x": np.arange(3)}))  # the checksum costs no byte: it has its field


@pytest.mark.parametrize("delta", [1 << 40, -(1 << 40), (1 << 23) << 40, 16, -16, 1],
                         ids=["header+1", "header-1", "header-huge", "data+16", "data-16", "data+1"])
def test_wrong_prefix_lengths_with_a_valid_checksum(delta):
    frame = bytearray(sample_frame())
    sizes, = struct.unpack_from("<Q", frame, 8)
    struct.pack_into("<Q", frame, 8, (sizes + delta) % 2**64)
    struct.pack_into("<I", frame, 4, crc32c.crc32c(bytes(frame[8:])))
    refused_behind_the_checksum(frame)


@pytest.mark.parametrize("edit", [
    lambda c, f: (c, [f[0], f[1], f[2] + 16, f[3]]),
    lambda c, f: (c, [f[0], f[1], f[2] + 1, f[3]]),
    lambda c, f: (c, [f[0], f[1], -16, f[3]]),
    lambda c, f: (c, [f[0], f[1], f[2], f[3] + 4]),
    lambda c, f: (c, [f[0], f[1], f[2], f[3] - 4]),
    lambda c, f: (c, [f[0], f[1], f[2], 2**64 - 1]),
    lambda c, f: (c, [f[0], f[1], "0", f[3]]),
    lambda c, f: (c, ["float99", f[1], f[2], f[3]]),
    lambda c, f: (c, [b"float32", f[1], f[2], f[3]]),
    lambda c, f: (c, ["float64", f[1], f[2], f[3]]),
    lambda c, f: (c, [f[0], [-1], f[2], f[3]]),
    lambda c, f: (c, [f[0], [-3, -5], f[2], f[3]]),
    lambda c, f: (c, [f[0], [2**40, 2**40], f[2], f[3]]),
    lambda c, f: (c, [f[0], [1] * 70, f[2], f[3]]),
    lambda c, f: (c, [f[0], [15.0], f[2], f[3]]),
    lambda c, f: (c, [f[0], "abc", f[2], f[3]]),
    lambda c, f: (c, [f[0], [5, 4], f[2], f[3]]),
    lambda c, f: (c, f[:3]),
    lambda c, f: (c, {"dtype": f[0]}),
    lambda c, f: (9, f),
    lambda c, f: (3, f + ["q8", 1.0, False]),
    lambda c, f: (3, [f[0], f[1], f[2], 15, "q8", 1.0, False]),
], ids=lambda e: None)
def test_tampered_tensor_descriptor(edit):
    header, data = split(sample_frame())
    refused_behind_the_checksum(join(edit_ext(header, edit), data))


@pytest.mark.parametrize("name", ["float99", b"float32", None])
def test_an_unknown_dtype_is_named(name):
    header, data = split(sample_frame())
    edited = edit_ext(header, lambda c, f: (c, [name, *f[1:]]))
    assert refused_behind_the_checksum(join(edited, data)) == f"unknown dtype {name!r}"


@pytest.mark.parametrize("codec, scale, as_numpy, name", [
    ("q9", 1.0, False, "float32"), ("q8", float("nan"), False, "float32"),
    ("q8", -1.0, False, "float32"), ("q8", 1, False, "float32"), ("q8", None, False, "float32"),
    ("fp16", 1.0, False, "float32"), ("q8", 1.0, "yes", "float32"), ("q8", 1.0, False, "int64"),
    ("q8", 1.0, True, "bfloat16"), (None, 1.0, False, "float32"),
    ("q8", 1e308, False, "float32"), ("q8", float("inf"), False, "float32"), ("q4", 7e4, False, "float16"),
])
def test_tampered_compressed_descriptor(codec, scale, as_numpy, name):
    frame = bytes(encode({"w": torch.randn(3, 5)}, compress="q8", rng=np.random.default_rng(0)))
    header, data = split(frame)
    code, payload = header["w"]
    fields = msgpack.unpackb(payload)
    assert code == 3 and fields[4:] == ["q8", fields[5], False]
    header["w"] = msgpack.ExtType(3, msgpack.packb([name, *fields[1:4], codec, scale, as_numpy]))
    assert refused_behind_the_checksum(join(header, data)).startswith(
        ("unknown codec", "bad quantisation scale", "fp16 tensor with a scale", "compressed tensor of dtype"))


def fastest_decodes(frames, repeats=5):
    """The least wall time of `repeats` decodes of each frame, taken in turns: the minimum sheds
    the noise of a busy machine, and the turns meet the same load. A WireError counts as a decode."""
    best = [math.inf] * len(frames)
    for _ in range(repeats):
        for k, frame in enumerate(frames):
            start = time.perf_counter()
            try:
                decode(frame)
            except WireError:
                pass
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def test_a_long_shape_list_fails_before_any_arithmetic_on_it():
    """A compressed tensor's header with a 180 kB shape list: refused on its length, before it is even unpacked."""
    frame = bytes(encode({"w": torch.randn(3, 5)}, compress="q8", rng=np.random.default_rng(0)))
    header, data = split(frame)
    fields = msgpack.unpackb(header["w"].data)
    header["w"] = msgpack.ExtType(3, msgpack.packb([fields[0], [2**47 - 1] * 20_000, *fields[2:]]))
    tampered = join(header, data)
    # An honest frame of the same length, its header as long: the same tensor and a bytes value
    # the size of the shape list. Both decodes copy the frame, check its CRC and copy the big
    # header item once, so they take about as long (measured: 20 us and 35 us, a ratio of 0.43 to
    # 0.57 in 200 tries, two busy processes beside it on 2 cores). Unpacking the shape list and
    # multiplying it out, as before the bound (math.prod of 20,000 factors of 2**47 is quadratic in
    # their count: 0.65 s, 28 s at 112,000), made it 0.47 s against 0.33 ms: a ratio of 1,400.
    def honest_frame(n):
        return bytes(encode({"w": torch.randn(3, 5), "pad": bytes(n)}, compress="q8", rng=np.random.default_rng(0)))

    honest = honest_frame(len(tampered))  # too long by the rest of the frame: shorten its bytes by that
    honest = honest_frame(2 * len(tampered) - len(honest))
    assert len(honest) == len(tampered) > 180_000
    tampered_s, honest_s = fastest_decodes([tampered, honest])
    assert tampered_s < 20 * honest_s, (tampered_s, honest_s)
    with pytest.raises(WireError, match=r"tensor descriptor of \d+ bytes \(at most 1024\)"):
        decode(tampered)


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_a_cast_tensor_holding_inf_is_refused_at_both_ends(compress):
    with pytest.raises(ValueError, match="inf"):
        encode({"w": torch.tensor([1.0, 1e39 if compress == "bf16" else 1e5])}, compress=compress)
    header, data = split(bytes(encode({"w": torch.ones(4)}, compress=compress)))
    inf = torch.full((4,), float("inf"), dtype=torch.float16 if compress == "fp16" else torch.bfloat16)
    raw = inf.view(torch.int16).numpy().tobytes()
    with pytest.raises(WireError, match="inf or nan"):
        decode(join(header, raw + data[len(raw):]))


def test_negative_shape_that_numpy_would_infer():
    header, data = split(bytes(encode({"w": torch.arange(4.0)})))
    with pytest.raises(WireError, match=r"bad shape \[-1\]"):
        decode(join(edit_ext(header, lambda c, f: (c, [f[0], [-1], f[2], f[3]])), data))


def test_data_region_longer_than_its_tensors():
    header, data = split(sample_frame())
    with pytest.raises(WireError, match=f"tensors cover {len(data)} of {len(data) + 16} data bytes"):
        decode(join(header, data + bytes(16)))


def test_bool_bytes_other_than_zero_and_one():
    header, data = split(bytes(encode({"w": torch.tensor([True, False])})))
    with pytest.raises(WireError, match="bool array holds bytes other than 0 and 1"):
        decode(join(header, b"\x01\x02"))
    assert decode(join(header, b"\x01\x00"))["w"].tolist() == [True, False]


@pytest.mark.parametrize("packed", [
    b"\xa1\xff",  # a one-byte str that is not utf-8
    b"\x91" * 100_000 + b"\xc0",  # lists nested far past msgpack's stack
    b"\xc1",  # a byte msgpack never uses
    b"\x92\x01",  # a list missing an item
    b"\x01\x02",  # two objects where one belongs
    b"\xd4\x01\x00",  # a tensor ext type too short to be one
], ids=["bad-utf8", "deep", "never-used", "short-list", "extra-data", "short-ext"])
def test_bad_msgpack_header(packed):
    refused_behind_the_checksum(join_raw(packed, b""))


@pytest.mark.parametrize("frame", ["text", None, 12, [1, 2], np.zeros(4, np.uint8)])
def test_non_bytes_frame(frame):
    with pytest.raises(WireError):
        decode(frame)


# --- encode errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [object(), {1, 2}, 1 + 2j, np.array([object()]),
                                   np.array(["a", "b"]), torch.eye(3).to_sparse()],
                         ids=["object", "set", "complex", "object-array", "str-array", "sparse"])
def test_unsupported_type(value):
    with pytest.raises(TypeError, match="wire cannot encode"):
        encode({"x": [value]})


def test_unknown_compression_names_the_allowed_ones():
    with pytest.raises(ValueError, match="none, fp16, bf16, q8, q4"):
        encode(torch.zeros(2), compress="zip")


@pytest.mark.parametrize("compress", ["q8", "q4"])
def test_quantisation_needs_rng(compress):
    with pytest.raises(ValueError, match="rng"):
        encode(torch.zeros(2), compress=compress)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantising_non_finite_values_is_refused(bad):
    with pytest.raises(ValueError, match="inf or nan"):
        encode(torch.tensor([1.0, bad]), compress="q8", rng=np.random.default_rng(0))


# --- compression ---------------------------------------------------------------------------------

@pytest.mark.parametrize("compress, rtol", [("fp16", 1e-3), ("bf16", 8e-3)])
@pytest.mark.parametrize("kind", ["float32", "float64", "numpy-float32", "float16-or-bf16"])
def test_casts_restore_dtype_within_tolerance(compress, rtol, kind):
    x = torch.randn(4, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    value = {"float32": x.float(), "float64": x, "numpy-float32": x.float().numpy(),
             "float16-or-bf16": x.to(torch.bfloat16 if compress == "fp16" else torch.float16)}[kind]
    got = decode(encode(value, compress=compress))
    assert type(got) is type(value) and got.dtype == value.dtype and got.shape == value.shape
    want = torch.as_tensor(value).double()
    assert torch.allclose(torch.as_tensor(got).double(), want, rtol=rtol, atol=0)
    if kind != "float16-or-bf16":  # bf16 values fit fp16 exactly, the other way round they don't
        assert not torch.equal(torch.as_tensor(got).double(), want)  # it was cast


@pytest.mark.parametrize("compress", ["fp16", "bf16", "q8", "q4"])
def test_compression_leaves_integers_and_bools_alone(compress):
    msg = {"i": torch.arange(-5, 5), "b": torch.tensor([True, False]),
           "n": np.arange(4, dtype=np.uint8), "nbt": torch.tensor(7),
           "c": torch.randn(3, dtype=torch.complex64)}
    assert_same(decode(encode(msg, compress=compress, rng=np.random.default_rng(0))), msg)


@pytest.mark.parametrize("compress", ["fp16", "q8", "q4"])
def test_compression_shrinks_floats(compress):
    x = torch.linspace(-1, 1, 1000)
    none = len(encode(x))
    smaller = len(encode(x, compress=compress, rng=np.random.default_rng(0)))
    assert smaller <= none * {"fp16": 0.52, "q8": 0.27, "q4": 0.14}[compress]


@pytest.mark.parametrize("compress, levels", [("q8", 127), ("q4", 7)])
def test_quantisation_is_unbiased(compress, levels):
    x = torch.randn(257, generator=torch.Generator().manual_seed(1))
    step = float(x.abs().max()) / levels
    rng, n = np.random.default_rng(2), 2000
    mean = sum(decode(encode(x, compress=compress, rng=rng)).double() for _ in range(n)) / n
    # each dequantisation is x +- one step with variance <= step**2/4; 6 sigma of the mean
    assert (mean - x.double()).abs().max() < 6 * step / (2 * math.sqrt(n))


@pytest.mark.parametrize("compress, levels", [("q8", 127), ("q4", 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_quantisation_error_is_within_one_step(compress, levels, dtype):
    x = (torch.randn(3, 101, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 5)
    x = x.to(dtype)
    scale = float(x.abs().max())
    got = decode(encode(x, compress=compress, rng=np.random.default_rng(0)))
    assert got.dtype == dtype and got.shape == x.shape
    err = (got.double() - x.double()).abs()
    # one quantisation step, plus rounding the dequantised value into dtype
    assert err.max() <= scale / levels + scale * torch.finfo(dtype).eps
    assert err.max() > 0


@pytest.mark.parametrize("compress", ["q8", "q4", "fp16", "bf16"])
@pytest.mark.parametrize("value", [torch.zeros(5), torch.zeros(3, 0), torch.tensor(2.5),
                                   torch.linspace(-3, 2, 7),
                                   np.linspace(-1, 1, 9, dtype=np.float32),
                                   np.float64(1.5) * np.ones((2, 1))],
                         ids=["zeros", "empty", "0-d", "odd-length", "numpy32", "numpy64"])
def test_quantisation_edge_shapes(compress, value):
    got = decode(encode(value, compress=compress, rng=np.random.default_rng(0)))
    assert type(got) is type(value) and got.dtype == value.dtype and got.shape == value.shape
    # one quantisation step (scale / levels), or a cast's rounding (half an ulp: 2**-11 fp16, 2**-8 bf16)
    step = {"q8": 1 / 127, "q4": 1 / 7, "fp16": 2**-11, "bf16": 2**-8}[compress]
    tol = float(np.abs(np.asarray(value)).max(initial=0)) * step + 1e-6
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64),
                               np.asarray(value, dtype=np.float64), atol=tol, rtol=0)


def test_quantised_state_dict_sizes():
    state = state_dict_like()
    rng = np.random.default_rng(0)
    none = len(encode(state))
    q8 = len(encode(state, compress="q8", rng=rng))
    q4 = len(encode(state, compress="q4", rng=rng))
    assert q8 <= 0.3 * none
    assert q4 <= 0.6 * q8


@pytest.mark.parametrize("compress", COMPRESSIONS)
def test_same_seed_gives_identical_bytes(compress):
    state = state_dict_like()
    first = encode(state, compress=compress, rng=np.random.default_rng(5))
    assert first == encode(state, compress=compress, rng=np.random.default_rng(5))
    if compress in ("q8", "q4"):
        assert first != encode(state, compress=compress, rng=np.random.default_rng(6))
