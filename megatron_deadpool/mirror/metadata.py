"""The snapshot's metadata blob (RNG states, counters, scheduler, param-group fields): a
format that carries values only. A slot's metadata was once a pickle, and a pickle runs code
when it is read: a crafted copy served to a restoring spare was code execution. Decoding
this format builds data and nothing else.

    [u32 JSON length][JSON document][raw bytes]

The JSON document holds plain values (None, bool, int, float, str, lists, dicts with str
keys); everything else is one tagged object, with its bytes in the raw section (RNG states
are kilobytes of bytes: no base64, no text)::

    {"__bytes": [offset, length]}                       bytes
    {"__tuple": [...]}                                  tuple (numpy's and Python's RNG
                                                        states are set from tuples)
    {"__ndarray": [dtype, shape, offset, length]}       numpy array, numeric dtypes only
    {"__npscalar": [dtype, offset, length]}             numpy scalar
    {"__tensor": [dtype, shape, offset, length]}        torch tensor, read back on the CPU
    {"__dict": [[key, value], ...]}                     a dict with a key that is not a
                                                        plain str (or that starts "__")

Values come back bitwise: floats through ``repr`` (exact in JSON), arrays and tensors as
their bytes. A value of any other type is an error when it is written, not a surprise when
it is read. A blob that is not this format raises MirrorCorruptError.
"""

from __future__ import annotations

import json
import struct
from typing import Any, List

import numpy as np
import torch

from ..base.errors import MirrorCorruptError

HEAD = struct.Struct("<I")
TAGS = ("__bytes", "__tuple", "__ndarray", "__npscalar", "__tensor", "__dict")
NUMERIC_KINDS = "biufc"  # numpy dtype kinds that are plain numbers (never objects)
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                if isinstance(d, torch.dtype)}


def encode(meta: Any) -> bytes:
    raw: List[bytes] = []
    size = [0]

    def put(data: bytes) -> List[int]:
        raw.append(data)
        size[0] += len(data)
        return [size[0] - len(data), len(data)]

    def enc(v):
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None:
            return v  # the common cases first, by exact type: this runs every step
        if t is dict or isinstance(v, dict):
            for k in v:
                if type(k) is not str or k.startswith("__"):
                    return {"__dict": [[enc(k), enc(x)] for k, x in v.items()]}
            return {k: enc(x) for k, x in v.items()}
        if t is bytes or isinstance(v, (bytes, bytearray)):
            return {"__bytes": put(bytes(v))}
        if t is list or isinstance(v, list):
            return [enc(x) for x in v]
        if t is tuple or isinstance(v, tuple):
            return {"__tuple": [enc(x) for x in v]}
        if isinstance(v, np.generic):  # before float: np.float64 is one
            return {"__npscalar": [_np_dtype(v.dtype), *put(v.tobytes())]}
        if isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            return {"__ndarray": [_np_dtype(a.dtype), list(a.shape), *put(a.tobytes())]}
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            return {"__tensor": [str(t.dtype).removeprefix("torch."), list(t.shape),
                                 *put(data)]}
        raise MirrorCorruptError(f"snapshot metadata holds a {type(v).__name__}, which the "
                                 f"metadata format does not carry")

    doc = json.dumps(enc(meta), separators=(",", ":")).encode()
    return HEAD.pack(len(doc)) + doc + b"".join(raw)


def _np_dtype(dt: np.dtype) -> str:
    if dt.kind not in NUMERIC_KINDS:
        raise MirrorCorruptError(f"snapshot metadata holds a numpy {dt} array; only numbers "
                                 f"are carried")
    return dt.str


def decode(blob: bytes) -> Any:
    """The metadata ``encode`` wrote. Raises MirrorCorruptError on anything else."""
    try:
        (n,) = HEAD.unpack_from(blob)
        doc = blob[HEAD.size:HEAD.size + n]
        if len(doc) != n:
            raise ValueError("the JSON document is cut short")
        raw = memoryview(blob)[HEAD.size + n:]
        return json.loads(doc, object_hook=lambda d: _tagged(d, raw))
    except MirrorCorruptError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, struct.error) as exc:
        raise MirrorCorruptError(f"snapshot metadata is not in the metadata format: "
                                 f"{type(exc).__name__}: {exc}") from None


def _tagged(d: dict, raw: memoryview):
    if len(d) != 1 or next(iter(d)) not in TAGS:
        return d
    (tag, v), = d.items()
    if tag == "__tuple":
        return tuple(_list(v))
    if tag == "__dict":
        return {_key(k): x for k, x in _list(v)}
    if tag == "__bytes":
        return bytes(_span(raw, *v))
    if tag == "__npscalar":
        dtype, off, length = v
        return np.frombuffer(_span(raw, off, length), dtype=_numeric(dtype), count=1)[0]
    dtype, shape, off, length = v
    data = _span(raw, off, length)
    if tag == "__ndarray":
        return np.frombuffer(data, dtype=_numeric(dtype)).reshape(_shape(shape)).copy()
    dt = TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None
    if dt is None:
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(_shape(shape))


def _list(v) -> list:
    if not isinstance(v, list):
        raise TypeError(f"expected a list, got {type(v).__name__}")
    return v


def _key(k):
    if isinstance(k, (list, dict)):
        raise TypeError(f"a dict key cannot be a {type(k).__name__}")
    return k


def _span(raw: memoryview, off, length) -> memoryview:
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, length)):
        raise TypeError("byte offsets must be integers")
    if not (0 <= off and 0 <= length and off + length <= len(raw)):
        raise ValueError(f"bytes [{off}, {off + length}) outside the {len(raw)}-byte section")
    return raw[off:off + length]


def _numeric(dtype) -> np.dtype:
    dt = np.dtype(str(dtype))
    if dt.kind not in NUMERIC_KINDS:
        raise ValueError(f"numpy dtype {dt} is not a number type")
    return dt


def _shape(shape) -> tuple:
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
               for x in _list(shape)):
        raise TypeError(f"bad shape {shape!r}")
    return tuple(shape)
