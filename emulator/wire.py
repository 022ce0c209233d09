"""Wire codec: msgpack frames that carry torch tensors and numpy arrays.

Frame layout (integers little-endian; tensor bytes little-endian, as on the hosts we run on):
  prefix  16 bytes: b"P2PW", u32 header length H, u64 data length D
  header  H bytes of msgpack; each tensor is an ExtType whose payload is the msgpack list
          [dtype, shape, offset, nbytes] (compressed ones add [codec, scale, as_numpy])
  data    D bytes starting at the first multiple of 16 after the header; each tensor's bytes
          lie at data[offset:offset+nbytes], 16-aligned and in header order, with zero padding

encode copies each tensor once into a single bytearray. decode of a bytearray (or writable
memoryview) returns tensors that are zero-copy, writable views of it, so they share memory with
the frame and with any other decode of that same buffer; bytes are copied once first.
"""
from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import torch

COMPRESSIONS = ("none", "fp16", "bf16", "q8", "q4")


class WireError(Exception):
    """A frame that cannot be decoded (malformed, truncated or garbage); the message says why."""


_MAGIC = b"P2PW"
_PREFIX = struct.Struct("<4sIQ")
_ALIGN = 16  # >= every itemsize, so tensors start element-aligned in a malloc'd buffer
_TORCH, _NUMPY, _LOSSY = 1, 2, 3  # msgpack ext type codes
_NUMPY_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}
_TORCH_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}
_TORCH_DTYPES = {name: d for d, name in _TORCH_NAMES.items()}
# numpy has no bfloat16 or float8: their bytes travel through numpy as same-size unsigned ints
_STAND_INS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8,
              torch.float8_e5m2: torch.uint8}
_CARRIERS = {name: _NUMPY_DTYPES[_TORCH_NAMES[_STAND_INS.get(d, d)]] for name, d in _TORCH_DTYPES.items()}
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_LEVELS = {"q8": 127, "q4": 7}


def _pad(n: int) -> int:
    return -n % _ALIGN


def encode(obj, *, compress: str = "none", rng: np.random.Generator | None = None) -> bytearray:
    """Serialise obj into one frame; floating tensors are compressed as `compress` says."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compress!r}; use one of {', '.join(COMPRESSIONS)}")
    if compress in _LEVELS and rng is None:
        raise ValueError(f"compression {compress!r} needs rng, a numpy Generator")
    enc = _Encoder(compress, rng)
    header = msgpack.packb(obj, default=enc.default, use_bin_type=True)
    prefix = _PREFIX.pack(_MAGIC, len(header), enc.size)
    # bytearray.join allocates without zero-filling: the tensor bytes are copied exactly once
    return bytearray().join([prefix, header, bytes(_pad(len(prefix) + len(header))), *enc.parts])


class _Encoder:
    def __init__(self, compress: str, rng: np.random.Generator | None):
        self.compress, self.rng = compress, rng
        self.parts: list = []  # the data region, as buffers in order
        self.size = 0

    def default(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._torch(obj)
        if isinstance(obj, np.ndarray):
            return self._numpy(obj)
        raise TypeError(f"wire cannot encode {type(obj).__qualname__}; send dict/list/tuple/str/"
                        "int/float/bool/None/bytes, torch.Tensor or numpy.ndarray")

    def _torch(self, t: torch.Tensor) -> msgpack.ExtType:
        name = _TORCH_NAMES.get(t.dtype)
        if name is None or t.layout != torch.strided:
            raise TypeError(f"wire cannot encode {t.layout} tensors of {t.dtype}")
        if t.requires_grad or not t.is_cpu or t.is_neg() or t.is_conj():
            t = t.detach().cpu().resolve_conj().resolve_neg()  # the plain values, on the host
        shape = list(t.shape)
        if self._compresses(t.dtype):
            return self._lossy(t, name, shape, False)
        offset, nbytes = self._place(_bytes_of(t))
        return msgpack.ExtType(_TORCH, msgpack.packb([name, shape, offset, nbytes]))

    def _numpy(self, a: np.ndarray) -> msgpack.ExtType:
        name = a.dtype.name
        if name not in _NUMPY_DTYPES:
            raise TypeError(f"wire cannot encode numpy arrays of {a.dtype}")
        shape = list(a.shape)
        if self._compresses(_TORCH_DTYPES[name]):
            # torch does the lossy maths; it needs native byte order and (to stay quiet) writable
            return self._lossy(torch.from_numpy(np.require(a, a.dtype.newbyteorder("="), "W")),
                               name, shape, True)
        offset, nbytes = self._place(np.ascontiguousarray(a, _NUMPY_DTYPES[name]))
        return msgpack.ExtType(_NUMPY, msgpack.packb([name, shape, offset, nbytes]))

    def _compresses(self, dtype: torch.dtype) -> bool:
        return (self.compress != "none" and dtype.is_floating_point
                and dtype != _CASTS.get(self.compress))

    def _lossy(self, t: torch.Tensor, name: str, shape: list, as_numpy: bool) -> msgpack.ExtType:
        if self.compress in _CASTS:
            data, scale = t.to(_CASTS[self.compress]), None
        else:
            data, scale = _quantise(t, _LEVELS[self.compress], self.rng)
        offset, nbytes = self._place(_bytes_of(data))
        return msgpack.ExtType(_LOSSY, msgpack.packb(
            [name, shape, offset, nbytes, self.compress, scale, as_numpy]))

    def _place(self, raw: np.ndarray) -> tuple[int, int]:
        """Append raw (C-contiguous) to the data region; returns its (offset, nbytes)."""
        pad = _pad(self.size)
        if pad:
            self.parts.append(bytes(pad))
        self.parts.append(raw)
        offset = self.size + pad
        self.size = offset + raw.nbytes
        return offset, raw.nbytes


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array over the tensor's memory (a copy only if t is strided)."""
    t = t.contiguous()
    return (t.view(_STAND_INS[t.dtype]) if t.dtype in _STAND_INS else t).numpy()


def _quantise(t: torch.Tensor, levels: int, rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    """Unbiased stochastic rounding of t/scale*levels to integers in [-levels, levels]."""
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
    if levels == _LEVELS["q8"]:
        return q.to(torch.int8), scale
    codes = q.add_(8).to(torch.uint8).reshape(-1)  # 1..15, two per byte, first in the low nibble
    if codes.numel() % 2:
        codes = torch.cat((codes, codes.new_zeros(1)))
    return codes[0::2] | (codes[1::2] << 4), scale


def decode(frame: bytes | bytearray | memoryview) -> object:
    """Inverse of encode. Raises WireError, and nothing else, for any bad input."""
    try:
        return _decode(frame)
    except WireError:
        raise
    except Exception as e:  # a safety net: whatever slipped past the checks is still a bad frame
        raise WireError(f"malformed frame: {type(e).__name__}: {e}".splitlines()[0]) from e


def _decode(frame) -> object:
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
    magic, header_len, data_len = _PREFIX.unpack_from(buf)
    if magic != _MAGIC:
        raise WireError("frame does not start with the wire magic")
    start = _PREFIX.size + header_len
    start += _pad(start)
    if start + data_len != len(buf):
        raise WireError(f"frame is {len(buf)} bytes but its prefix says {start + data_len}")
    dec = _Decoder(buf, start)
    with memoryview(buf) as view:
        try:
            obj = msgpack.unpackb(view[_PREFIX.size:_PREFIX.size + header_len],
                                  ext_hook=dec.ext_hook, strict_map_key=False, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise WireError(f"bad msgpack header: {type(e).__name__}: {e}".splitlines()[0]) from e
    if dec.end != data_len:
        raise WireError(f"tensors cover {dec.end} of {data_len} data bytes")
    return obj


class _Decoder:
    def __init__(self, buf, start: int):
        self.buf, self.start = buf, start
        self.end = 0  # where the previous tensor ended in the data region

    def ext_hook(self, code: int, payload: bytes):
        if code not in (_TORCH, _NUMPY, _LOSSY):
            raise WireError(f"unknown ext type {code}")
        fields = msgpack.unpackb(payload)
        if type(fields) is not list or len(fields) != (7 if code == _LOSSY else 4):
            raise WireError(f"bad tensor descriptor {fields!r:.80}")
        name, shape, offset, nbytes = fields[:4]
        # tensors must tile the data region exactly as encode lays them out
        if offset != self.end + _pad(self.end):
            raise WireError(f"tensor at offset {offset!r:.20} is out of place")
        if type(shape) is not list or min(shape, default=0) < 0:  # numpy reads -1 as "infer"
            raise WireError(f"bad shape {shape!r:.80}")
        if code == _LOSSY:
            t = self._lossy(name, shape, offset, nbytes, *fields[4:])
            return t.numpy() if fields[6] else t
        dtypes = _NUMPY_DTYPES if code == _NUMPY else _CARRIERS
        if type(name) is not str or name not in dtypes:
            raise WireError(f"unknown dtype {name!r:.40}")
        array = self._array(dtypes[name], shape, offset, nbytes)
        if code == _NUMPY:
            return array
        t = torch.from_numpy(array)
        return t.view(_TORCH_DTYPES[name]) if t.dtype != _TORCH_DTYPES[name] else t

    def _array(self, dtype: np.dtype, shape: list, offset: int, nbytes) -> np.ndarray:
        """The nbytes at data[offset:] as an array of shape, sharing the frame's memory."""
        array = np.ndarray(shape, dtype, self.buf, self.start + offset)  # raises if past the end
        if array.nbytes != nbytes:
            raise WireError(f"{dtype.name} array of shape {shape} cannot be {nbytes!r:.20} bytes")
        if dtype == bool and array.view(np.uint8).max(initial=0) > 1:
            raise WireError("bool array holds bytes other than 0 and 1")
        self.end = offset + array.nbytes
        return array

    def _lossy(self, name, shape: list, offset: int, nbytes, codec, scale, as_numpy) -> torch.Tensor:
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None or not dtype.is_floating_point or type(as_numpy) is not bool or (
                as_numpy and name not in _NUMPY_DTYPES):
            raise WireError(f"compressed tensor claims dtype {name!r:.40} (as_numpy={as_numpy!r:.10})")
        if not all(type(d) is int for d in shape):
            raise WireError(f"bad shape {shape!r:.80}")
        count = math.prod(shape)
        if codec in _CASTS:
            if scale is not None:
                raise WireError(f"{codec} tensor with a scale")
            wire = self._array(_CARRIERS[_TORCH_NAMES[_CASTS[codec]]], [count], offset, nbytes)
            return torch.from_numpy(wire).view(_CASTS[codec]).to(dtype).view(shape)
        if codec not in _LEVELS:
            raise WireError(f"unknown codec {codec!r:.20}")
        if type(scale) is not float or not math.isfinite(scale) or scale < 0:
            raise WireError(f"bad quantisation scale {scale!r:.20}")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if codec == "q8":
            q = torch.from_numpy(self._array(_NUMPY_DTYPES["int8"], [count], offset, nbytes)).to(work)
        else:
            packed = torch.from_numpy(self._array(_NUMPY_DTYPES["uint8"], [(count + 1) // 2], offset, nbytes))
            q = torch.stack((packed & 15, packed >> 4), 1).reshape(-1)[:count].to(work).sub_(8)
        return q.mul_(scale / _LEVELS[codec]).to(dtype).view(shape)
