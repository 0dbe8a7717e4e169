"""The artifact format: what `v4compile compile -o DIR` writes (through the compile driver, `cli/driver.py`)
and `v4compile.load(DIR)` reads. The runtime needs this module and the program, never the compiler.

    DIR/manifest.json          format and compiler versions, the config and its hash, numerics, dtype,
                               buckets, pool geometry, targets (+ their functions' files and interfaces),
                               kernels (target, path, sha256 of every GPU binary and sidecar), the weights
                               layout, and the hash of every file (sha256; a weights shard's is
                               made of its header's and tensors' tree digests: `shard_digest`)
    DIR/weights/*.safetensors  the IR weights exactly as the functions take them (after merges), in shards
                               (none in a shape-only artifact, `--weights none`: kernels and program only);
                               the manifest gives each tensor's shard, dtype, shape and digest
                               (`sha256`: a tree of 8 MiB pieces' sha256, `weights.hash`)
    DIR/weights/rank-<r>/      instead, a partitioned module's (`--tp` / `--ep`): rank r's weights, each rank
                               its own directory; the manifest's `parallel` gives the layout and every
                               rank's `weights` entry (the top-level `weights` is rank 0's)
    DIR/onnx/<function>.onnx   the `cpu` target: one ONNX model per function (weights are graph inputs,
                               never copied into these files); a partitioned module's function is its
                               segments cut at the collectives instead, `<function>.s<k>.onnx`, listed
                               with the collective after each under the function's `segments`
    DIR/module.ir              the final IR (text form) of the cpu pipeline
    DIR/gpu/module.ir          the final IR of the gpu pipeline (GPU targets)
    DIR/gpu/program.txt        its program: buffers and ordered launches (codegen/gpu_target.py)
    DIR/kernels/<target>/      gfx950 / sm_90a: one binary + JSON sidecar per kernel specialisation
    DIR/tokenizer/             the checkpoint's tokenizer.json and tokenizer_config.json, when it has them
                               (manifest `tokenizer`: their paths; `v4compile/tokenizer.py`)
    DIR/report.json            what was compiled: functions, op counts, pass hits, sizes; for GPU targets
                               the static kernel report (`kernels`) and the modeled decode step per bucket

Writing (`write_artifact_dir`) is atomic (everything goes to a temporary sibling directory renamed at the
end; on any error, a refusal of its `fill` included, it is removed and a directory it was to replace is left
as it was) and byte-reproducible (no timestamps, sorted keys, deterministic names).
Loading treats the artifact as untrusted input: the manifest is checked against its schema and every path
confined to the directory (`manifest.py`), then every file's hash is checked, naming the file that changed;
the runtime checks the pieces against each other as it opens them (`runtime/artifact_checks.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactError, InputError
from .files import sha256_file as files_sha256
from .manifest import FORMAT_VERSION, MANIFEST, canonical, check_manifest, confined, manifest_digest, read_manifest
from .targets import TARGET_FORMATS

log = logging.getLogger(__name__)

TARGETS = tuple(TARGET_FORMATS)  # cpu, gfx950, sm_90a


@dataclass(frozen=True)
class Buckets:
    """The static shapes compiled: decode per batch bucket, prefill per chunk bucket (prefill batch 1), and
    with `draft_tokens` = K > 0 a speculative verify function per decode bucket (`verify_b<B>`, 1 + K lanes
    per sequence: it serves any k <= K, the unused lanes as padding) and, when the weights carry the MTP
    block, its draft functions (`draft_b<B>` per decode bucket, `draft_c<T>` per chunk bucket).

    `verify_drafts`: the draft counts k <= K whose verify (and MTP draft) functions the cpu target carries
    with their own 1 + k lanes (`verify_b<B>_d<k>`, `draft_b<B>_d<k>`; K's are `verify_b<B>`, `draft_b<B>`);
    None: every k in 1..K. On the cpu device a step costs its nodes and its lanes' arithmetic, so a step
    verifying k < K drafts on K + 1 lanes cost ~10 % more than on its own (tiny-doc, batch 1, k = 1 at K = 3)
    and `draft_tokens="auto"` could not choose a small k at its own cost. The GPU targets carry K's only (a
    verify there is bound by reading the weights, whatever its lanes: one program step per bucket)."""

    decode: tuple[int, ...] = (1, 2, 4, 8)
    prefill: tuple[int, ...] = (16, 64)
    draft_tokens: int = 0
    verify_drafts: tuple[int, ...] | None = None

    def verify_ks(self) -> tuple[int, ...]:
        """The draft counts with their own verify lanes on the cpu target (K last; none without drafts)."""
        K = self.draft_tokens
        if not K:
            return ()
        return tuple(range(1, K + 1)) if self.verify_drafts is None else tuple(self.verify_drafts)

    def validate(self) -> None:
        from .manifest import MAX_BATCH, MAX_BUCKETS, MAX_CHUNK
        from .speculation import MAX_DRAFT_TOKENS

        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise InputError("draft_tokens out of range", expected=f"an integer in 0..{MAX_DRAFT_TOKENS}",
                             found=repr(k)[:40])
        v = self.verify_drafts
        if v is not None and (not isinstance(v, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in v)
                              or list(v) != sorted(set(v)) or (k and (not v or v[0] < 1 or v[-1] != k))
                              or (not k and v)):
            raise InputError("verify_drafts must be increasing draft counts in 1..draft_tokens, ending at it",
                             expected=f"1..{k}, the last {k}" if k else "none without draft_tokens",
                             found=repr(v)[:60])

        for what, v, hi in (("decode batch buckets", self.decode, MAX_BATCH),
                            ("prefill chunk buckets", self.prefill, MAX_CHUNK)):
            if not v or any(b < 1 for b in v) or list(v) != sorted(set(v)):
                raise InputError(f"{what} must be increasing positive integers", found=list(v)[:8])
            if len(v) > MAX_BUCKETS or max(v) > hi:
                raise InputError(f"{what} out of range", expected=f"<= {MAX_BUCKETS} buckets, each <= {hi}",
                                 found=list(v)[:8])


def decode_name(b: int) -> str:
    return f"decode_b{b}"


def prefill_name(t: int) -> str:
    return f"prefill_c{t}"


def verify_name(b: int, drafts: int | None = None) -> str:
    """The verify function of decode bucket `b`: 1 + K lanes a sequence (`verify_b<b>`), or the cpu target's
    1 + k lanes for a k < K (`verify_b<b>_d<k>`, `Buckets.verify_drafts`)."""
    return f"verify_b{b}" + (f"_d{drafts}" if drafts else "")


def draft_name(b: int, drafts: int | None = None) -> str:
    """The MTP draft function of decode bucket `b`, on the lanes of `verify_name(b, drafts)`."""
    return f"draft_b{b}" + (f"_d{drafts}" if drafts else "")


_VERIFY = re.compile(r"verify_b(\d+)")
_LANES = re.compile(r"(verify|draft)_b\d+_d\d+")


def lane_variant(name: str) -> bool:
    """Whether `name` is a verify or MTP draft function of fewer lanes than K's (`verify_name(b, k)`): the cpu
    target's ONNX graphs only, in no program."""
    return _LANES.fullmatch(name) is not None


def spec_name(b: int, sampled: bool = False, drafts: int = 1) -> str:
    """The one-call speculative step of decode bucket `b` (verify, acceptance, MTP draft: the C runtime's program
    only; `passes/spec_steps.py`): greedy (`spec_b<b>`), or `sampled` (`spec_s<b>`: greedy or sampled per
    sequence), drafting one token; greedy drafting `drafts` = k > 1 (the k - 1 recursive drafts in the call too):
    `spec_b<b>_d<k>`, one per k in 2..K (the cpu device's load-time graphs are named by `cpu_spec_name`)."""
    if drafts > 1 and sampled:
        raise ValueError(f"spec_name: the sampled one-call step drafts one token, not {drafts}")
    return f"spec_{'s' if sampled else 'b'}{b}" + (f"_d{drafts}" if drafts > 1 else "")


def cpu_spec_name(b: int, drafts: int, verifies: int | None = None) -> str:
    """The cpu device's fused verify + acceptance + `drafts` MTP drafts graph of decode bucket `b`, made by the
    runtime after load (`codegen/onnx_spec.py`, `runtime/speculative.py`): `spec_b<b>_d<k>` for every k, 1
    included, so no name of it is a program function's (`spec_name`'s k = 1 step is `spec_b<b>`); on the lanes of
    `verify_name(b, v)` for `verifies` = v < K: `spec_b<b>_v<v>_d<k>`."""
    return f"spec_b{b}" + (f"_v{verifies}" if verifies else "") + f"_d{drafts}"


def spec_names(b: int, draft_tokens: int) -> list[str]:
    """Every one-call speculative step of decode bucket `b` in an artifact of K = `draft_tokens` (`spec_name`)."""
    return [spec_name(b), spec_name(b, sampled=True)] + [spec_name(b, drafts=k) for k in range(2, draft_tokens + 1)]


def spec_buckets(functions) -> list[int]:
    """The decode buckets among `functions` (names) with both a verify and an MTP draft function: those whose
    one-call speculative step the C runtime's program carries."""
    return sorted(int(m.group(1)) for m in map(_VERIFY.fullmatch, functions)
                  if m is not None and draft_name(int(m.group(1))) in functions)


def draft_prefill_name(t: int) -> str:
    """The MTP draft function over a prefill chunk of `t` tokens (batch 1)."""
    return f"draft_c{t}"


def sha256_file(path: Path, error: type = ArtifactError) -> str:
    return files_sha256(path, error)


# ---- write --------------------------------------------------------------------------------------

def write_artifact_dir(out: str | Path, fill: Callable[[Path], tuple[dict[str, Any], dict[str, str]]],
                       force: bool = False) -> Path:
    """Write an artifact directory at `out` atomically (replacing an existing artifact there, or with `force`
    any directory). `fill(tmp)` writes the artifact's files into a temporary sibling directory and returns
    the manifest's fields and the hashes of the files it hashed as it wrote them; this adds the format and
    compiler versions and the sha256 of every file (hashing the rest), then the manifest's own digest."""
    from .version import __version__

    out = Path(out)
    if out.is_symlink():  # replacing it would replace the link, not the directory it names
        raise InputError("output directory is a symlink", where=str(out), expected="the directory it points to")
    if out.exists() and not force and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise InputError("output directory exists and is not an artifact; refusing to replace it", where=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    old = None
    try:
        tmp.mkdir()
        fields, hashed = fill(tmp)
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(tmp))
                files[rel] = hashed[rel] if rel in hashed else sha256_file(p)
        manifest = {"format_version": FORMAT_VERSION, "compiler_version": __version__, **fields, "files": files}
        manifest["manifest_sha256"] = manifest_digest(manifest)  # the manifest's own bytes are checked too
        (tmp / MANIFEST).write_text(canonical(manifest))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():  # moved aside, the new one not in place: the old one back
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old)
    log.info("wrote artifact %s (%d files)", out, len(files) + 1)
    return out


# ---- load ---------------------------------------------------------------------------------------

@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    verified: bool = True
    deferred: tuple[str, ...] = ()  # files whose hash the weights reader checks as it streams them

    def weights(self, rank: int = 0):
        """The weights (of rank `rank` in a partitioned artifact: its own directory only), mapped
        (`weights_map.MappedWeights`), every shard opened through `file` (listed, confined, a regular file);
        the deferred shards are hashed as streamed."""
        from .weights_map import MappedWeights

        files = self.manifest["files"]
        entry = self.rank_weights(rank)
        deferred = {rel: files[rel] for rel in self.deferred if rel in entry["shards"]}
        return MappedWeights(self.path, entry["tensors"], ArtifactError, deferred or None,
                             path_of=lambda rel: self.file(rel, "weights shard"))

    def rank_weights(self, rank: int) -> dict[str, Any]:
        """The manifest's `weights` entry of rank `rank` (the top-level one for an unpartitioned artifact)."""
        p = self.manifest.get("parallel")
        if p is None:
            if rank != 0:
                raise ArtifactError("the artifact is not partitioned: it has rank 0 only", where=str(self.path),
                                    found=f"rank {rank}")
            return self.manifest["weights"]
        if not 0 <= rank < p["world"]:
            raise ArtifactError("no such rank in the artifact's layout", where=str(self.path),
                                expected=f"0 <= rank < {p['world']}", found=rank)
        return p["rank_weights"][rank]

    def target(self, name: str) -> dict[str, Any]:
        for t in self.manifest["targets"]:
            if t["name"] == name:
                return t
        raise ArtifactError(f"the artifact has no '{name}' target", where=str(self.path),
                            expected=", ".join(t["name"] for t in self.manifest["targets"]) or "a target")

    def file(self, rel: str, what: str = "file") -> Path:
        """The path of a file of the artifact: listed in the manifest, inside the artifact after every
        symlink, a regular file (checked again at every open: see `manifest.confined`)."""
        return confined(self.path, rel, self.manifest["files"], what)

    def read_bytes(self, rel: str, what: str = "file", limit: int = 1 << 32) -> bytes:
        """A (small) file's bytes, checked against its hash in the manifest when the artifact was verified:
        what is used is what was hashed, even if the file changed since `load_artifact`."""
        from .files import read_bytes

        data = read_bytes(self.file(rel, what), ArtifactError, what, limit)
        if self.verified and hashlib.sha256(data).hexdigest() != self.manifest["files"][rel]:
            raise ArtifactError(f"{what} does not match its hash in the manifest (changed or damaged)", where=rel)
        return data


def load_artifact(path: str | Path, verify: bool = True, defer_weights: bool = False) -> Artifact:
    """Read and check an artifact directory: the manifest (not through a symlink; one typed schema, see
    `manifest.py`), then every file it lists (inside the artifact, a regular file, and with `verify` its
    hash; a weights shard's is its `shard_digest`). Nothing outside the directory is opened. With
    `defer_weights` the weight shards' hashes (every rank's) are left to `Artifact.weights(rank)`, which
    hashes its rank's as it reads them (one read of every byte, not two; never another rank's)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ArtifactError("an artifact is named by a directory path", found=repr(path)[:60])
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError("not an artifact directory", where=str(path))
    manifest = read_manifest(path)
    try:
        check_manifest(manifest, verify)
    except ArtifactError as e:
        raise ArtifactError(e.what, where=str(path / MANIFEST) if e.where == MANIFEST else e.where,
                            expected=e.expected, found=e.found) from None
    files = manifest["files"]
    entries = [manifest["weights"], *manifest.get("parallel", {}).get("rank_weights", [])]
    shards = {rel for w in entries for rel in w.get("shards", [])} & set(files)
    deferred = shards if verify and defer_weights else set()
    for rel, digest in sorted(files.items()):
        p = confined(path, rel, files)
        if not verify or rel in deferred:
            continue
        if rel in shards:
            from .weights_map import shard_file_digest

            found = shard_file_digest(p, ArtifactError)
        else:
            found = sha256_file(p)
        if found != digest:
            raise ArtifactError("file does not match its hash in the manifest (changed or damaged)",
                                where=str(path / rel), expected=digest[:16] + "...")
    return Artifact(path, manifest, verify, tuple(sorted(deferred)))
