"""A strict reader and an atomic writer for the safetensors format.

The reader parses the header itself so that every defect of a file (truncation, a corrupt or oversized
JSON header, overlapping or out-of-file tensor bytes, an unknown dtype) becomes one `CheckpointError`
naming the file and the tensor. Tensors are read one at a time from a memory map; opening a file reads
only its header. Nothing here ever unpickles.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same limit as the reference implementation

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def parse_header(raw: bytes, data_len: int, where: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a header (the JSON bytes) against a data section of `data_len` bytes."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("header is not UTF-8", where=where) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"header is not valid JSON ({e.msg} at char {e.pos})", where=where) from None
    if not isinstance(obj, dict):
        raise CheckpointError("header must be a JSON object", where=where, found=type(obj).__name__)
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("`__metadata__` must map strings to strings", where=where)
    infos: dict[str, TensorInfo] = {}
    for name, ent in obj.items():
        at = f"{where}: tensor '{name}'"
        if not isinstance(ent, dict):
            raise CheckpointError("header entry must be an object", where=at, found=type(ent).__name__)
        dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise CheckpointError("unknown dtype", where=at, expected=" / ".join(DTYPES), found=dt)
        if (not isinstance(shape, list) or
                not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise CheckpointError("shape must be a list of non-negative integers", where=at, found=shape)
        if (not isinstance(offs, list) or len(offs) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise CheckpointError("data_offsets must be [begin, end]", where=at, found=offs)
        begin, end = offs
        want = math.prod(shape) * ITEMSIZE[dt]
        if not 0 <= begin <= end:
            raise CheckpointError("data_offsets are not ordered", where=at, found=offs)
        if end - begin != want:
            raise CheckpointError("byte size does not match dtype x shape", where=at, expected=want,
                                  found=end - begin)
        if end > data_len:
            raise CheckpointError("tensor bytes run past the end of the file", where=at,
                                  expected=f"end <= {data_len}", found=end)
        infos[name] = TensorInfo(name, dt, tuple(shape), begin, end)
    spans = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"tensors '{n0}' and '{n1}' overlap", where=where)
    return infos, meta


class SafetensorsFile:
    """One `.safetensors` file: header parsed at open, tensors read lazily through mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = str(self.path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror}", where=where) from None
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            self._fh.close()
            raise CheckpointError("file is truncated (shorter than the 8-byte header length)", where=where,
                                  found=f"{size} bytes")
        (hlen,) = struct.unpack("<Q", self._fh.read(8))
        if hlen > MAX_HEADER_BYTES:
            self._fh.close()
            raise CheckpointError("header length is implausibly large", where=where,
                                  expected=f"<= {MAX_HEADER_BYTES}", found=hlen)
        if 8 + hlen > size:
            self._fh.close()
            raise CheckpointError("file is truncated inside its header", where=where,
                                  expected=f"{8 + hlen} bytes at least", found=f"{size} bytes")
        raw = self._fh.read(hlen)
        self.data_start = 8 + hlen
        try:
            self.tensors, self.metadata = parse_header(raw, size - self.data_start, where)
        except CheckpointError:
            self._fh.close()
            raise
        self._mm: mmap.mmap | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def read(self, name: str) -> torch.Tensor:
        """A copy of one tensor (the map is not kept alive by the result)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        raw = np.frombuffer(self._map(), dtype=np.uint8, count=info.nbytes, offset=self.data_start + info.begin)
        t = torch.from_numpy(raw.copy())
        return t.view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._fh.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list]:
    """Header bytes (padded to 8) and the list of tensors to write after it, in order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    order = []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError("dtype cannot be stored in safetensors", where=name, found=str(t.dtype))
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        order.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write atomically (temp file in the same directory, then rename). Returns the file size."""
    path = Path(path)
    head, order = serialize(tensors, metadata)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            for t in order:
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path.stat().st_size
