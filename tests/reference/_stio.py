"""Minimal safetensors I/O for the reference oracles.

Uses the `safetensors` package when it is importable and falls back to a small pure-Python
reader/writer of the same format otherwise (8-byte little-endian header length, JSON header with
`dtype`/`shape`/`data_offsets` per tensor and an optional `__metadata__` map of strings, then the
raw little-endian data), so the oracles only really need torch.
"""

import ctypes
import json
import struct

import torch

try:  # pragma: no cover - depends on the machine
    import safetensors.torch as _st_torch
    from safetensors import safe_open as _safe_open

    HAVE_SAFETENSORS = True
except Exception:  # noqa: BLE001
    HAVE_SAFETENSORS = False

_DT = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DT_INV = {v: k for k, v in _DT.items()}


def _load_fallback(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        dt = _DT[info["dtype"]]
        a, b = info["data_offsets"]
        shape = list(info["shape"])
        if b == a:
            out[name] = torch.zeros(shape, dtype=dt)
            continue
        buf = bytearray(raw[base + a : base + b])
        out[name] = torch.frombuffer(buf, dtype=dt).reshape(shape).clone()
    return out, dict(meta)


def load(path):
    """Returns (dict name -> CPU tensor, metadata dict of str -> str)."""
    if HAVE_SAFETENSORS:
        tensors = _st_torch.load_file(path, device="cpu")
        with _safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        return tensors, dict(meta)
    return _load_fallback(path)


def _save_fallback(tensors, path, metadata):
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    off = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[name] = {
            "dtype": _DT_INV[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + len(data)],
        }
        blobs.append(data)
        off += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def save(tensors, path, metadata=None):
    """Writes CPU-contiguous copies of `tensors` (dict name -> tensor)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if HAVE_SAFETENSORS:
        md = {str(k): str(v) for k, v in metadata.items()} if metadata else None
        _st_torch.save_file(tensors, path, metadata=md)
    else:
        _save_fallback(tensors, path, metadata)
