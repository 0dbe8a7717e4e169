"""Strict safetensors reading over the `safetensors` package, and an atomic writer.

Tensor data is read one tensor at a time with `pread` (after the `safetensors` package has checked the
whole file once, `safe_open`); opening a file reads only its header. In front of it sits a thin strict layer that turns every defect into one
`CheckpointError` naming the file and, where there is one, the tensor:

* the file is opened only if it is a regular file, without blocking (a FIFO would hang the library);
* the header is checked here first (`parse_header`) because the library accepts what we must refuse
  (a tensor name given twice with the same entry, `"__metadata__": null`; `tests/core/test_safetensors.py`
  shows each) and names no tensor in some of its own errors (a size that does not match dtype x shape);
* anything else the library refuses (gaps between tensors, trailing bytes) is reported with its message
  and the file name.

Nothing here ever unpickles.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError
from .files import open_regular

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


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads_strict(raw: bytes | str, where: str, what: str, error: type = CheckpointError) -> object:
    """JSON with every key once per object, no NaN / Infinity, UTF-8, bounded nesting: one `error` otherwise."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what} is not UTF-8", where=where, found=f"byte 0x{raw[e.start]:02x} at offset {e.start}") \
                from None
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise error(f"{what} gives the key '{e.args[0]}' twice", where=where) from None
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})", where=where) from None
    except ValueError as e:  # NaN / Infinity
        raise error(f"{what} is not valid JSON ({e})", where=where) from None
    except RecursionError:
        raise error(f"{what} is nested too deeply", where=where) from None


def parse_header(raw: bytes, data_len: int, where: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a header (the JSON bytes) against a data section of `data_len` bytes."""
    obj = loads_strict(raw, where, "header")
    if not isinstance(obj, dict):
        raise CheckpointError("header must be a JSON object", where=where, found=type(obj).__name__)
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("`__metadata__` must be an object mapping strings to strings", where=where,
                              found=type(meta).__name__ if not isinstance(meta, dict) else "non-string values")
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


def read_header(fd: int, where: str) -> tuple[int, dict[str, TensorInfo], dict[str, str]]:
    """(data start, tensors, metadata) of the open safetensors file `fd`, its header checked (`parse_header`)."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CheckpointError("file is truncated (shorter than the 8-byte header length)", where=where,
                              found=f"{size} bytes")
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if hlen > MAX_HEADER_BYTES:
        raise CheckpointError("header length is implausibly large", where=where,
                              expected=f"<= {MAX_HEADER_BYTES}", found=hlen)
    if 8 + hlen > size:
        raise CheckpointError("file is truncated inside its header", where=where,
                              expected=f"{8 + hlen} bytes at least", found=f"{size} bytes")
    tensors, metadata = parse_header(os.pread(fd, hlen, 8), size - 8 - hlen, where)
    return 8 + hlen, tensors, metadata


class SafetensorsFile:
    """One `.safetensors` file: header checked at open, tensors read lazily by the `safetensors` package."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        fd = open_regular(self.path, CheckpointError, "safetensors file")
        try:
            self.data_start, self.tensors, self.metadata = read_header(fd, str(self.path))
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._validated, self._fd = False, None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _validate(self) -> None:
        """Once, before the first read: the `safetensors` package's own checks of the whole file. Its
        handle (a mapping of the whole file) is dropped again: tensors are read with `pread`, so a
        process reading a checkpoint holds only the tensor it reads, in address space too."""
        with self._lock:
            if self._validated:
                return
            from safetensors import SafetensorError, safe_open

            # Re-check: the path must still be a regular file (safe_open itself would block on a FIFO).
            os.close(open_regular(self.path, CheckpointError, "safetensors file"))
            try:
                with safe_open(str(self.path), framework="pt"):
                    pass
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"the safetensors library refuses the file: {e}", where=str(self.path)) from None
            self._fd = open_regular(self.path, CheckpointError, "safetensors file")
            self._validated = True

    def read(self, name: str) -> torch.Tensor:
        """One tensor (its own memory, independent of the file), read with one `pread`."""
        info = self.tensors.get(name)
        where = f"{self.path}: tensor '{name}'"
        if info is None:
            raise CheckpointError("no such tensor in the file", where=where)
        self._validate()
        n = info.end - info.begin
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        try:
            while got < n:
                k = os.preadv(self._fd, [view[got:]], self.data_start + info.begin + got)
                if k <= 0:
                    raise CheckpointError("file changed since it was opened (it is shorter now)", where=where,
                                          expected=f"{self.data_start + info.end} bytes at least")
                got += k
        except OSError as e:
            raise CheckpointError(f"cannot read tensor: {e.strerror}", where=where) from None
        if n == 0:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=torch.uint8).view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._validated = False

    def __del__(self) -> None:  # a file never closed does not keep its descriptor
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def header_bytes(entries, metadata: dict[str, str] | None = None, sort_keys: bool = False) -> bytes:
    """A safetensors header (length prefix, JSON padded to 8 bytes) for tensors stored back to back in the
    order of `entries`: (name, safetensors dtype name, shape, byte count)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, n in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=sort_keys).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list]:
    """Header bytes (padded to 8) and the list of tensors to write after it, in order."""
    order = []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError("dtype cannot be stored in safetensors", where=name, found=str(t.dtype))
        order.append(t.detach().contiguous().cpu())
    entries = [(name, DTYPE_NAMES[t.dtype], t.shape, t.numel() * t.element_size()) for name, t in zip(tensors, order)]
    return header_bytes(entries, metadata), order


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
