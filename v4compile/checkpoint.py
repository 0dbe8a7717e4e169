"""Reading and writing DeepSeek-V4 checkpoints.

`Checkpoint.open(path)` accepts a single `.safetensors` file or a directory (sharded with
`model.safetensors.index.json`, or one or more shards without an index), in the official, HF or
HF-`save_pretrained` naming. Opening reads only headers. `validate()` checks every tensor against the
config's `weight_specs` (missing, unexpected, mis-shaped, mis-typed, scale grids) and reports the first
problem as one `CheckpointError` naming the file and tensor. `dense(name)` loads one tensor,
dequantised to float (FP8 128x128 or FP4 1x32 with their scales), never the whole checkpoint.

`write_checkpoint` saves any tensor source in the official layout, in the released dtypes (BF16, FP8 +
E8M0 scales, FP4 packed + scales) or plain fp32 / bf16, sharded with an index, atomically.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import V4Config
from .errors import CheckpointError
from .files import atomic_dir, inside, read_text
from .formats import fp4_dequant, fp4_quant, fp8_block_dequant, fp8_block_quant, nonfinite_error
from .names import Slice, canonical_sources
from .safetensors_io import ITEMSIZE, SafetensorsFile, TensorInfo, loads_strict, write_file
from .weights import TensorSpec, spec_table

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")


_QUANT_OF_DTYPE = {"F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4"}


@dataclass(frozen=True)
class Entry:
    """Where a canonical tensor lives."""

    file: Path
    key: str
    info: TensorInfo
    slice: Slice

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.info.shape
        if self.slice.index is not None:
            shape = shape[1:]
        if self.slice.rows is not None:
            shape = (self.slice.rows[1] - self.slice.rows[0], *shape[1:])
        return shape

    @property
    def dtype(self) -> str:
        return self.info.dtype


def _read_index(path: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name)."""
    index = path / INDEX_FILE
    inside(path, INDEX_FILE, CheckpointError, str(index))
    obj = loads_strict(read_text(index, CheckpointError, "index"), str(index), "index")
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError("index has no `weight_map` object of name -> shard file", where=str(index))
    return wm


def _shard_files(path: Path, wm: dict[str, str] | None) -> list[Path]:
    """The shard files, each checked to lie inside the checkpoint directory before it is opened."""
    if wm is not None:
        index = path / INDEX_FILE
        files = []
        for shard in sorted(set(wm.values())):
            names = [k for k, v in wm.items() if v == shard]
            holding = f"holding {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}"
            f = inside(path, shard, CheckpointError, f"{index}: shard of '{names[0]}'")
            if not f.exists():
                raise CheckpointError("index points at a missing shard", where=str(index),
                                      expected=f"file {shard} ({holding})", found="no such file")
            files.append(f)
        return files
    files = [inside(path, f.name, CheckpointError, str(f)) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError("no .safetensors files in checkpoint directory", where=str(path))
    return files


def _check_stacked(f: Path, key: str, info: TensorInfo, sl: Slice, cfg: V4Config) -> None:
    """A stacked HF expert tensor holds exactly one slice per expert (and gate_up 2 x moe_inter_dim rows)."""
    where = f"{f}: '{key}'"
    if sl.index is not None and (len(info.shape) < 2 or info.shape[0] != cfg.n_experts):
        raise CheckpointError("stacked expert tensor does not hold one slice per expert", where=where,
                              expected=f"[{cfg.n_experts}, ...] (n_routed_experts)", found=list(info.shape))
    if sl.rows is not None and (len(info.shape) < 3 or info.shape[1] != 2 * cfg.moe_inter_dim):
        raise CheckpointError("stacked gate_up tensor does not hold gate and up rows", where=where,
                              expected=f"[{cfg.n_experts}, {2 * cfg.moe_inter_dim}, ...] (2 x moe_intermediate_size)",
                              found=list(info.shape))


class Checkpoint:
    """A lazily read checkpoint, indexed by canonical tensor name (a `weights_convert.WeightSource`)."""

    def __init__(self, path: Path, cfg: V4Config, entries: dict[str, Entry], files: dict[Path, SafetensorsFile],
                 index_map: dict[str, str] | None, allow_nonfinite: bool = False):
        self.path, self.cfg, self.entries, self._files = path, cfg, entries, files
        self._index_map = index_map
        self.allow_nonfinite = allow_nonfinite

    @classmethod
    def open(cls, path: str | Path, cfg: V4Config | None = None, allow_nonfinite: bool = False) -> "Checkpoint":
        """Open a checkpoint (headers only). Every file read lies inside the directory; with the default
        `allow_nonfinite=False` a tensor holding NaN / Inf (or an E8M0 scale byte 0xFF) is refused when read."""
        path = Path(path)
        if not path.exists():
            raise CheckpointError("checkpoint not found", where=str(path))
        if cfg is None:
            cfg = V4Config.from_dir(path.parent if path.is_file() else path)
        wm = _read_index(path) if path.is_dir() and (path / INDEX_FILE).exists() else None
        files = [path] if not path.is_dir() else _shard_files(path, wm)
        opened: dict[Path, SafetensorsFile] = {}
        try:
            for f in files:
                opened[f] = SafetensorsFile(f)
            if wm is not None:
                for name, shard in wm.items():
                    if name not in opened[path / shard].tensors:
                        raise CheckpointError("index names a tensor its shard does not hold",
                                              where=str(path / shard), expected=name, found="absent")
            entries: dict[str, Entry] = {}
            for f, sf in opened.items():
                for key, info in sf.tensors.items():
                    for cname, sl in canonical_sources(key, cfg.n_experts, cfg.moe_inter_dim):
                        _check_stacked(f, key, info, sl, cfg)
                        if cname in entries:
                            raise CheckpointError("tensor appears twice", where=f"{f}: '{key}'",
                                                  found=f"also in {entries[cname].file.name} as "
                                                        f"'{entries[cname].key}'")
                        entries[cname] = Entry(f, key, info, sl)
        except BaseException:
            for sf in opened.values():
                sf.close()
            raise
        log.debug("opened %s: %d files, %d canonical tensors", path, len(files), len(entries))
        return cls(path, cfg, entries, opened, wm, allow_nonfinite)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, include_mtp: bool = True) -> "Checkpoint":
        specs = spec_table(self.cfg, include_mtp=include_mtp)
        expected: set[str] = set()
        for s in specs.values():
            expected.add(s.name)
            e = self.entries.get(s.name)
            if e is None:
                raise CheckpointError("missing tensor", where=f"{self.path}: '{s.name}'",
                                      expected=f"{s.fmt} {list(s.shape)}", found="absent")
            self._check(s, e)
            if e.dtype in ("F8_E4M3", "I8", "U8") and s.fmt != "i64":
                expected.add(s.scale_key)
        for name, e in self.entries.items():
            if name not in expected and not (name.startswith("mtp.") and not include_mtp):
                raise CheckpointError("unexpected tensor", where=f"{e.file}: '{e.key}'",
                                      expected=f"only the tensors of config '{self.cfg.name}'", found=name)
        for s in specs.values():
            if s.fmt == "i64":
                self._check_ids(s.name)
        return self

    def _check_ids(self, name: str) -> None:
        """Hash-routing tables name experts: every id in [0, n_experts). The one data check of `validate`
        (a table is vocab x top-k integers, small next to the weights)."""
        e = self.entries[name]
        t = self.raw(name)
        bad = (t < 0) | (t >= self.cfg.n_experts)
        if bool(bad.any()):
            idx = [int(i) for i in bad.nonzero()[0]]
            raise CheckpointError("hash-routing table names an expert that does not exist",
                                  where=f"{e.file}: '{e.key}'", expected=f"ids in [0, {self.cfg.n_experts})",
                                  found=f"{int(t[tuple(idx)])} at {idx}")

    def _check(self, s: TensorSpec, e: Entry) -> None:
        where = f"{e.file}: '{e.key}'"
        if s.fmt == "i64":
            if e.dtype not in ("I64", "I32"):
                raise CheckpointError("wrong dtype", where=where, expected="I64 or I32", found=e.dtype)
            if e.shape != s.shape:
                raise CheckpointError("wrong shape", where=where, expected=list(s.shape), found=list(e.shape))
            return
        if e.dtype in FLOAT_DTYPES:
            if e.shape != s.shape:
                raise CheckpointError("wrong shape", where=where, expected=list(s.shape), found=list(e.shape))
            return
        if not s.quantizable:
            raise CheckpointError("wrong dtype", where=where, expected="F32 / BF16 / F16", found=e.dtype)
        if e.dtype == "F8_E4M3":
            if e.shape != s.shape:
                raise CheckpointError("wrong shape", where=where, expected=list(s.shape), found=list(e.shape))
            grid = s.with_format("fp8").scale_shape(self.cfg.quant_block)
        elif e.dtype in ("I8", "U8"):
            packed = (*s.shape[:-1], s.shape[-1] // 2)
            if e.shape != packed:
                raise CheckpointError("wrong shape for packed FP4", where=where, expected=list(packed),
                                      found=list(e.shape))
            grid = s.with_format("fp4").scale_shape(fp4_block=self.cfg.expert_scale_block)
        else:
            raise CheckpointError("wrong dtype", where=where, expected="F8_E4M3 / I8 (fp4) / BF16 / F32",
                                  found=e.dtype)
        sname = s.scale_key
        se = self.entries.get(sname)
        if se is None:
            raise CheckpointError("quantized weight has no scale tensor", where=where, expected=sname, found="absent")
        if se.shape != grid:
            raise CheckpointError("scale grid does not match its weight", where=f"{se.file}: '{se.key}'",
                                  expected=list(grid), found=list(se.shape))
        if se.dtype not in ("F8_E8M0", "U8", "F32"):
            raise CheckpointError("wrong scale dtype", where=f"{se.file}: '{se.key}'",
                                  expected="F8_E8M0 / U8 / F32", found=se.dtype)

    # ---- reading -------------------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor for a canonical name (sliced out of a stacked one), as stored."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError("missing tensor", where=f"{self.path}: '{name}'")
        t = self._files[e.file].read(e.key)
        if e.slice.index is not None:
            t = t[e.slice.index]
        if e.slice.rows is not None:
            t = t[e.slice.rows[0]: e.slice.rows[1]]
        if not self.allow_nonfinite:
            err = nonfinite_error(t, scale=name.endswith(".scale"), where=f"{e.file}: '{e.key}'")
            if err is not None:
                raise err
        return t.contiguous()

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One tensor with quantisation undone (int tensors as int64)."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError("missing tensor", where=f"{self.path}: '{name}'")
        t = self.raw(name)
        where = f"{e.file}: '{e.key}'"
        if e.dtype in ("I64", "I32"):
            return t.to(torch.int64)
        if e.dtype == "F8_E4M3":
            scale = self.raw(name[: -len(".weight")] + ".scale")
            return fp8_block_dequant(t, scale, self.cfg.quant_block, where).to(dtype)
        if e.dtype in ("I8", "U8"):
            scale = self.raw(name[: -len(".weight")] + ".scale")
            return fp4_dequant(t, scale, self.cfg.expert_scale_block, where).to(dtype)
        return t.to(dtype)

    def rows(self, name: str) -> int:
        """Its first axis, from the header (0 where no file holds it: `raw` names the problem)."""
        e = self.entries.get(name)
        return e.shape[0] if e is not None else 0

    def stored_range(self, name: str) -> tuple[Path, int, int]:
        """(file, absolute byte offset, byte count) of a canonical tensor's stored bytes, read by nothing
        here (a copier's `pread`). A slice of a stacked HF tensor (one expert, gate or up rows) is a
        contiguous range of the row-major stored tensor."""
        e = self.entries[name]
        shape, start = e.info.shape, 0
        if e.slice.index is not None:
            start += e.slice.index * math.prod(shape[1:])
            shape = shape[1:]
        if e.slice.rows is not None:
            start += e.slice.rows[0] * math.prod(shape[1:])
        isz = ITEMSIZE[e.dtype]
        return e.file, self._files[e.file].data_start + e.info.begin + start * isz, math.prod(e.shape) * isz

    def names(self) -> list[str]:
        return sorted(self.entries)

    def stored_formats(self) -> dict[str, str]:
        """Canonical name -> "fp8" / "fp4" (quantised GEMM weights) or "dense" (anything else), from the
        file headers."""
        return {n: _QUANT_OF_DTYPE.get(e.dtype, "dense") for n, e in self.entries.items()}

    def missing(self) -> list[str]:
        """The config's tensors that no file holds (from the headers: no data read)."""
        return [n for n in spec_table(self.cfg) if n not in self.entries]

    def header_specs(self) -> list[TensorSpec]:
        """The config's specs with the formats actually found in the files (for `inspect`)."""
        fmt_of = {"F32": "fp32", "BF16": "bf16", "F16": "bf16", "F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4",
                  "I64": "i64", "I32": "i64"}
        out = []
        for s in spec_table(self.cfg).values():
            e = self.entries.get(s.name)
            out.append(s if e is None else s.with_format(fmt_of.get(e.dtype, s.fmt)))
        return out


# ---- writing -----------------------------------------------------------------------------------

def encode(spec: TensorSpec, value: torch.Tensor, fmt: str, cfg: V4Config) -> dict[str, torch.Tensor]:
    """Stored tensor(s) for one canonical tensor in format `fmt` (fp8 / fp4 add a `.scale`)."""
    if spec.fmt == "i64":
        return {spec.name: value.to(torch.int64)}
    if fmt == "fp8":
        q, s = fp8_block_quant(value, cfg.quant_block)
        return {spec.name: q, spec.scale_key: s.view(torch.float8_e8m0fnu)}
    if fmt == "fp4":
        q, s = fp4_quant(value, cfg.expert_scale_block)
        return {spec.name: q, spec.scale_key: s.view(torch.float8_e8m0fnu)}
    return {spec.name: value.to({"fp32": torch.float32, "bf16": torch.bfloat16}[fmt])}


def stored_format(spec: TensorSpec, dtype: str) -> str:
    """The format a tensor is written in: `released` keeps the spec's format; fp32 / bf16 write every
    float tensor plainly (fp32 tensors of the release stay fp32 under bf16, as they are in the release)."""
    if spec.fmt == "i64":
        return "i64"
    if dtype == "released":
        return spec.fmt
    if dtype == "bf16" and spec.fmt == "fp32":
        return "fp32"
    return dtype


def write_checkpoint(out: str | Path, cfg: V4Config, get: Callable[[TensorSpec], torch.Tensor],
                     dtype: str = "released", max_shard_bytes: int = 4 << 30, include_mtp: bool = True,
                     progress: Callable[[int, int], None] | None = None, force: bool = False) -> Path:
    """Write a sharded official-layout checkpoint to directory `out`, atomically.

    `get(spec)` returns the tensor's float (or int) value in its logical shape; a non-finite value is
    refused. The directory is built under a temporary name next to `out` and renamed into place only when
    complete; an existing non-empty `out` is replaced only with `force`.
    """
    if dtype not in ("released", "fp32", "bf16"):
        raise ValueError(f"unknown checkpoint dtype {dtype!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError("output directory exists and is not empty", where=str(out),
                              expected="a new or empty directory (or force)")
    with atomic_dir(out, force=force) as tmp:
        specs = list(spec_table(cfg, include_mtp=include_mtp).values())
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        for i, s in enumerate(specs):
            value = get(s)
            err = nonfinite_error(value, where=f"tensor '{s.name}' to write")
            if err is not None:
                raise err
            stored = encode(s, value, stored_format(s, dtype), cfg)
            nbytes = sum(t.numel() * t.element_size() for t in stored.values())
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1].update(stored)
            sizes[-1] += nbytes
            if progress:
                progress(i + 1, len(specs))
        weight_map, total = {}, 0
        n = len(shards)
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            total += write_file(tmp / fname, shard, {"format": "pt"})
            weight_map.update({name: fname for name in shard})
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=1) + "\n")
        (tmp / "config.json").write_text(cfg.to_json())
    return out

