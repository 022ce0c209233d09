"""Wire codec: msgpack frames that carry torch tensors and numpy arrays.

Frame layout (integers little-endian; tensor bytes little-endian, as on the hosts we run on):
  prefix  16 bytes: b"P2PW", u32 CRC32C of everything after it, u64 sizes: header length H in
          the top 24 bits (H < 16 MiB), data length D in the low 40 (D < 1 TiB); the CRC is 0
          when the network runs without checksums
  header  H bytes of msgpack; each tensor is an ExtType (1 torch, 2 numpy, 3 compressed) whose
          payload is the msgpack list [dtype, shape, offset, nbytes] (3 adds codec, scale, as_numpy)
  data    D bytes from the first multiple of 16 after the header; each tensor's bytes lie at
          data[offset:offset+nbytes], in header order, 16-aligned, zero padding between them

encode copies each tensor's bytes once, into one bytearray. decode of a bytearray (or writable
memoryview) returns tensors that are zero-copy, writable views of it, so they share memory with
that buffer and with anything else decoded from it; bytes are copied once into a bytearray first.
"""
from __future__ import annotations

import functools
import math
import struct
import sys
import threading
from typing import TYPE_CHECKING

import crc32c
import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that handle tensors: frames of numbers and
# numpy arrays (a gossip run, a listing of protocols) never load it.

COMPRESSIONS = ("none", "fp16", "bf16", "q8", "q4")


class WireError(Exception):
    """A frame that cannot be decoded (malformed, truncated or garbage); the message says why."""


_MAGIC = b"P2PW"
_PREFIX = struct.Struct("<4sIQ")
_CHECKED = 8  # the checksum covers the frame from here: the sizes, the header and the data
_DATA_BITS = 40
MAX_HEADER = 1 << (64 - _DATA_BITS)
MAX_DATA = 1 << _DATA_BITS
MAX_DIMS = 32  # numpy's own limit is 64
MAX_DIM = 1 << 48
MAX_DESCRIPTOR = 1024  # bytes of a tensor's [dtype, shape, offset, nbytes, ...]: 32 dims fit in ~330
_ALIGN = 16  # >= every itemsize, so tensors start element-aligned in a malloc'd buffer
_ZEROS = bytes(_ALIGN)
_TORCH, _NUMPY, _LOSSY = 1, 2, 3  # msgpack ext type codes
_FIELDS = {_TORCH: 4, _NUMPY: 4, _LOSSY: 7}  # payload length per ext type
_NUMPY_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}
_DTYPE_NAMES = {np.dtype(name): name for name in _NUMPY_DTYPES}  # native byte order equals "<" here
_BOOL = _NUMPY_DTYPES["bool"]
_LEVELS = {"q8": 127, "q4": 7}
QUANTISERS = tuple(_LEVELS)  # the compressions that draw random numbers


class _TorchDtypes:
    """torch's dtypes by wire name, and how each travels; built on first use, as it imports torch."""

    def __init__(self):
        import torch

        self.names = {d: str(d).removeprefix("torch.") for d in (
            torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
            torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
            torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}
        self.by_name = {name: d for d, name in self.names.items()}
        # numpy has no bfloat16 or float8: their bytes travel through numpy as same-size unsigned ints
        self.stand_ins = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8,
                          torch.float8_e5m2: torch.uint8}
        self.carriers = {name: _NUMPY_DTYPES[self.names[self.stand_ins.get(d, d)]]
                         for name, d in self.by_name.items()}
        self.casts = {"fp16": torch.float16, "bf16": torch.bfloat16}


@functools.cache
def _torch_dtypes() -> _TorchDtypes:
    return _TorchDtypes()


def _is_tensor(obj) -> bool:
    # Until torch is imported for real, nothing can be a tensor: no need to import it to ask.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def encode(obj, *, compress: str = "none", rng: np.random.Generator | None = None,
           checksum: bool = True) -> bytearray:
    """Serialise obj into one frame; floating tensors are compressed as `compress` says.

    Dict keys must stay hashable when decoded: str, int, float, bool, None or bytes, not tuples.
    With `checksum`, the prefix carries the CRC32C a receiver checks (decode's `checksum`).
    """
    if compress != "none":
        if compress not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compress!r}; use one of {', '.join(COMPRESSIONS)}")
        if compress in _LEVELS and rng is None:
            raise ValueError(f"compression {compress!r} needs rng, a numpy Generator")
    enc = _encoder()
    enc.compress, enc.rng, enc.parts, enc.size = compress, rng, [], 0
    header = enc.header_packer.pack(obj)
    size = enc.size
    if len(header) >= MAX_HEADER or size >= MAX_DATA:
        raise ValueError(f"wire cannot encode a header of {len(header)} bytes (limit {MAX_HEADER}) or data of "
                         f"{size} bytes (limit {MAX_DATA}): send large values as tensors or arrays")
    prefix = _PREFIX.pack(_MAGIC, 0, len(header) << _DATA_BITS | size)
    # bytearray.join allocates without zero-filling: the tensor bytes are copied exactly once
    frame = bytearray().join([prefix, header, _ZEROS[:-(_PREFIX.size + len(header)) % _ALIGN], *enc.parts])
    enc.parts = None  # the tensors' bytes are in the frame: do not keep them alive
    if checksum:
        struct.pack_into("<I", frame, 4, _crc(frame))
    return frame


def intact(frame) -> bool:
    """Whether a checksummed frame's CRC32C still matches (what a receiving transport checks)."""
    return len(frame) >= _PREFIX.size and _PREFIX.unpack_from(frame)[1] == _crc(frame)


def _crc(frame) -> int:
    return crc32c.crc32c(memoryview(frame)[_CHECKED:])  # the view goes with the call: frame stays resizable


# Building an encoder and its Packers costs more than packing a small message: each thread reuses one.
_local = threading.local()


def _encoder() -> _Encoder:
    try:
        return _local.encoder
    except AttributeError:
        encoder = _local.encoder = _Encoder()
        return encoder


class _Encoder:
    """One frame's encoding at a time: encode sets compress, rng, parts and size for each frame."""

    def __init__(self):
        self.compress, self.rng = "none", None
        self.header_packer = msgpack.Packer(default=self.default)
        self.packer = msgpack.Packer()  # for ext payloads
        self.parts: list = []  # the data region, as buffers in order
        self.size = 0

    def default(self, obj):
        if isinstance(obj, np.ndarray):
            return self._numpy(obj)
        if _is_tensor(obj):
            return self._torch(obj)
        raise TypeError(f"wire cannot encode {type(obj).__qualname__}; send dict/list/tuple/str/"
                        "int/float/bool/None/bytes, torch.Tensor or numpy.ndarray")

    def _torch(self, t: torch.Tensor) -> msgpack.ExtType:
        import torch

        name = _torch_dtypes().names.get(t.dtype)
        if name is None or t.layout != torch.strided:
            raise TypeError(f"wire cannot encode {t.layout} tensors of {t.dtype}")
        if t.requires_grad or not t.is_cpu or t.is_neg() or t.is_conj():
            t = t.detach().cpu().resolve_conj().resolve_neg()  # the plain values, on the host
        if self._compresses(name):
            return self._lossy(t, name, False)
        return self._ext(_TORCH, _bytes_of(t), name, list(t.shape))

    def _numpy(self, a: np.ndarray) -> msgpack.ExtType:
        name = _DTYPE_NAMES.get(a.dtype) or a.dtype.name  # dtype.name is slow: a few microseconds a message
        if name not in _NUMPY_DTYPES:
            raise TypeError(f"wire cannot encode numpy arrays of {a.dtype}")
        if self._compresses(name):
            import torch

            # torch does the lossy maths; it needs native byte order and (to stay quiet) writable
            return self._lossy(torch.from_numpy(np.require(a, a.dtype.newbyteorder("="), "W")),
                               name, True)
        return self._ext(_NUMPY, np.ascontiguousarray(a, _NUMPY_DTYPES[name]), name, list(a.shape))

    def _compresses(self, name: str) -> bool:
        if self.compress == "none":
            return False
        dtypes = _torch_dtypes()
        dtype = dtypes.by_name[name]
        return dtype.is_floating_point and dtype != dtypes.casts.get(self.compress)

    def _lossy(self, t: torch.Tensor, name: str, as_numpy: bool) -> msgpack.ExtType:
        import torch

        casts = _torch_dtypes().casts
        if self.compress in casts:
            data, scale = t.to(casts[self.compress]), None
            if not torch.isfinite(data).all():  # a receiver refuses it: say so at the source
                raise ValueError(f"wire cannot send as {self.compress} a tensor holding inf, nan or values beyond "
                                 f"{torch.finfo(data.dtype).max:g}")
        else:
            data, scale = quantise(t, self.compress, self.rng)
        return self._ext(_LOSSY, _bytes_of(data), name, list(t.shape), self.compress, scale,
                         as_numpy)

    def _ext(self, code: int, raw: np.ndarray, name: str, shape: list, *extra) -> msgpack.ExtType:
        """Append raw (C-contiguous) to the data region; the ext type that points at it."""
        pad = -self.size % _ALIGN
        if pad:
            self.parts.append(_ZEROS[:pad])
        self.parts.append(raw)
        offset = self.size + pad
        self.size = offset + raw.nbytes
        return msgpack.ExtType(code, self.packer.pack([name, shape, offset, raw.nbytes, *extra]))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array over the tensor's memory (a copy only if t is strided)."""
    t = t.contiguous()
    stand_ins = _torch_dtypes().stand_ins
    return (t.view(stand_ins[t.dtype]) if t.dtype in stand_ins else t).numpy()


def quantise(t: torch.Tensor, codec: str, rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    """q8 or q4 codes of t and their scale: unbiased stochastic rounding of t/scale*levels to integers
    in [-levels, levels]; q8 one int8 an entry, q4 two entries a byte (first in the low nibble)."""
    import torch

    levels = _LEVELS[codec]
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.to(work)
    scale = float(x.abs().max()) if x.numel() else 0.0
    if not math.isfinite(scale):
        raise ValueError("wire cannot quantise a tensor holding inf or nan")
    # x/scale <= 1 exactly (division is monotone), so q never leaves [-levels, levels]
    y = x.div(scale or 1.0).mul_(levels)
    u = rng.random(y.numel(), dtype=np.float32 if work == torch.float32 else np.float64)
    # floor(y + u) is floor(y) + 1 with probability frac(y): E[q] = y
    q = y.add_(torch.from_numpy(u).view(y.shape)).floor_()
    if codec == "q8":
        return q.to(torch.int8), scale
    codes = q.add_(8).to(torch.uint8).reshape(-1)  # 1..15
    if codes.numel() % 2:
        codes = torch.cat((codes, codes.new_zeros(1)))
    return codes[0::2] | (codes[1::2] << 4), scale


def dequantise(codes: torch.Tensor, codec: str, scale: float, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The `count` values (flat, of `dtype`) that quantise's codes and scale stand for."""
    import torch

    work = torch.float64 if dtype == torch.float64 else torch.float32
    if codec == "q8":
        q = codes.to(work)
    else:
        q = torch.stack((codes & 15, codes >> 4), 1).reshape(-1)[:count].to(work).sub_(8)
    return q.mul_(scale / _LEVELS[codec]).to(dtype)


def decode(frame: bytes | bytearray | memoryview, *, checksum: bool = True) -> object:
    """Inverse of encode. Raises WireError, and nothing else, for any bad input;
    with `checksum`, also for a frame whose CRC32C does not match (corrupted in transit)."""
    try:
        return _decode(frame, checksum)
    except WireError:
        raise
    except Exception as e:  # a safety net: whatever slipped past the checks is still a bad frame
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise WireError(f"malformed frame: {reason}".splitlines()[0]) from e


def _decode(frame, checksum: bool) -> object:
    if isinstance(frame, bytearray):
        buf = frame
    elif isinstance(frame, memoryview) and not frame.readonly and frame.c_contiguous:
        buf = frame.cast("B")
    elif isinstance(frame, (bytes, memoryview)):
        buf = bytearray(frame)  # decoded tensors must be writable and not alias the sender
    else:
        raise WireError(f"frame must be bytes, bytearray or memoryview, not {type(frame).__name__}")
    if len(buf) < _PREFIX.size:
        raise WireError(f"frame of {len(buf)} bytes is shorter than its prefix")
    magic, crc, sizes = _PREFIX.unpack_from(buf)
    if magic != _MAGIC:
        raise WireError("frame does not start with the wire magic")
    if checksum and crc != _crc(buf):
        raise WireError("frame fails its checksum (corrupted in transit)")
    header_len, data_len = sizes >> _DATA_BITS, sizes & (MAX_DATA - 1)
    header_end = _PREFIX.size + header_len
    start = header_end + -header_end % _ALIGN
    if start + data_len != len(buf):
        raise WireError(f"frame is {len(buf)} bytes but its prefix says {start + data_len}")
    dec = _Decoder(buf, start)
    obj = msgpack.unpackb(memoryview(buf)[_PREFIX.size:header_end], ext_hook=dec.ext_hook,
                          strict_map_key=False)
    if dec.end != data_len:
        raise WireError(f"tensors cover {dec.end} of {data_len} data bytes")
    return obj


def _check_shape(shape) -> None:
    """Before any arithmetic on it: a short list of non-negative ints (numpy reads -1 as "infer")."""
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(
            type(d) is int and 0 <= d < MAX_DIM for d in shape):
        raise WireError(f"bad shape {shape!r:.80}")


# Small numpy arrays are decoded a million times a run with a handful of descriptors: each
# checked descriptor is kept (up to a bound), so only the array's place is checked again.
_KNOWN_DESCRIPTORS = 4096
_NUMPY_DESCRIPTORS: dict[bytes, tuple] = {}


class _Decoder:
    def __init__(self, buf, start: int):
        self.buf, self.start = buf, start
        self.end = 0  # where the previous tensor ended in the data region

    def ext_hook(self, code: int, payload: bytes):
        known = _NUMPY_DESCRIPTORS.get(payload) if code == _NUMPY else None
        if known is not None:  # checked when first seen: only its place in this frame is left to check
            dtype, shape, offset, nbytes = known
            self._check_place(offset)
            return self._array(dtype, shape, offset, nbytes)
        if len(payload) > MAX_DESCRIPTOR:  # before unpacking it: a long shape list costs its length to parse
            raise WireError(f"tensor descriptor of {len(payload)} bytes (at most {MAX_DESCRIPTOR})")
        fields = msgpack.unpackb(payload)
        if type(fields) is not list or len(fields) != _FIELDS.get(code):
            raise WireError(f"bad ext type {code} with payload {fields!r:.80}")
        name, shape, offset, nbytes = fields[:4]
        self._check_place(offset)
        _check_shape(shape)
        if code == _LOSSY:
            t = self._lossy(name, shape, offset, nbytes, *fields[4:])
            return t.numpy() if fields[6] else t
        dtypes = _NUMPY_DTYPES if code == _NUMPY else _torch_dtypes().carriers
        if type(name) is not str or name not in dtypes:
            raise WireError(f"unknown dtype {name!r:.40}")
        array = self._array(dtypes[name], shape, offset, nbytes)
        if code == _NUMPY:
            if len(_NUMPY_DESCRIPTORS) < _KNOWN_DESCRIPTORS:
                _NUMPY_DESCRIPTORS[payload] = (dtypes[name], shape, offset, nbytes)
            return array
        import torch

        t = torch.from_numpy(array)
        dtype = _torch_dtypes().by_name[name]
        return t if t.dtype == dtype else t.view(dtype)

    def _check_place(self, offset) -> None:
        """Tensors must tile the data region exactly as encode lays them out."""
        if offset != self.end + -self.end % _ALIGN:
            raise WireError(f"tensor at offset {offset!r:.20} is out of place")

    def _array(self, dtype: np.dtype, shape: list, offset: int, nbytes) -> np.ndarray:
        """The nbytes at data[offset:] as an array of shape, sharing the frame's memory."""
        array = np.ndarray(shape, dtype, self.buf, self.start + offset)  # raises if past the end
        if array.nbytes != nbytes:
            raise WireError(f"{dtype.name} array of shape {shape} cannot be {nbytes!r:.20} bytes")
        if dtype is _BOOL and array.view(np.uint8).max(initial=0) > 1:
            raise WireError("bool array holds bytes other than 0 and 1")
        self.end = offset + array.nbytes
        return array

    def _lossy(self, name, shape: list, offset: int, nbytes, codec, scale, as_numpy):
        import torch

        dtypes = _torch_dtypes()
        dtype = dtypes.by_name.get(name) if type(name) is str else None
        if dtype is None or not dtype.is_floating_point or type(as_numpy) is not bool or (
                as_numpy and name not in _NUMPY_DTYPES):
            raise WireError(f"compressed tensor of dtype {name!r:.40}, as_numpy={as_numpy!r:.10}")
        count = math.prod(shape)  # at most MAX_DIMS factors below MAX_DIM: checked by ext_hook
        if codec in dtypes.casts:
            if scale is not None:
                raise WireError(f"{codec} tensor with a scale")
            wire = dtypes.casts[codec]
            raw = self._array(dtypes.carriers[dtypes.names[wire]], [count], offset, nbytes)
            t = torch.from_numpy(raw).view(wire)
            if not torch.isfinite(t).all():
                raise WireError(f"{codec} tensor holds inf or nan")
            return t.to(dtype).view(shape)
        if codec not in _LEVELS:
            raise WireError(f"unknown codec {codec!r:.20}")
        # |q| <= levels, so values stay within +-scale: finite in the tensor's own dtype
        if type(scale) is not float or not 0 <= scale <= torch.finfo(dtype).max:
            raise WireError(f"bad quantisation scale {scale!r:.20} for {name}")
        codes = self._array(_NUMPY_DTYPES["int8" if codec == "q8" else "uint8"],
                            [count if codec == "q8" else (count + 1) // 2], offset, nbytes)
        return dequantise(torch.from_numpy(codes), codec, scale, count, dtype).view(shape)


def keep_large_frames_in_the_heap() -> None:
    """Ask glibc to serve big frames from the heap instead of fresh mmaps.

    Above 32 MiB glibc maps every allocation anew, so each large frame pays a page fault
    per 4 KiB (a 37 MB model: ~9,000 faults, 10x the cost of copying it). The emulate
    command calls this once at start; elsewhere (other libc, other OS) it does nothing.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4
    mallopt(m_mmap_max, 0)  # the threshold cannot go above 32 MiB; no mmaps at all can
    mallopt(m_trim_threshold, 2**31 - 1)  # and keep freed memory for the next frame
