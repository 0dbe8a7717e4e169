"""Reading the user's files safely and writing ours atomically.

Reading: only regular files are opened, without blocking (a FIFO or a device named as a config, shard
or IR file would otherwise hang the tool), with a size limit, and, for a checkpoint, only inside the
checkpoint directory (`inside`: no `..`, no absolute path, no symlink leading out).

Writing: every output path is checked before any work starts (`check_output_file`, `check_output_dir`),
and every output is written under a temporary sibling name and renamed into place when complete, so an
interrupted or failed run leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import V4Error

MAX_TEXT_BYTES = 64 * 1024 * 1024  # configs, indexes and IR files are far smaller


def open_regular(path: str | Path, error: type[V4Error], what: str = "file") -> int:
    """A read-only descriptor of a regular file (never blocks: FIFOs and devices are refused)."""
    p = str(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"cannot open {what}: {e.strerror}", where=p) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} is not a regular file", where=p, found=_kind(st.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path: str | Path, error: type[V4Error], what: str = "file", limit: int = MAX_TEXT_BYTES) -> bytes:
    fd = open_regular(path, error, what)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{what} is too large", where=str(path), expected=f"<= {limit} bytes", found=f"{size} bytes")
        try:
            data = read_sized(f, size, limit)
        except OSError as e:
            raise error(f"cannot read {what}: {e.strerror}", where=str(path)) from None
    if len(data) > limit:
        raise error(f"{what} is too large", where=str(path), expected=f"<= {limit} bytes")
    return data


GROWTH_PIECE = 1 << 20


def read_sized(f, size: int, limit: int) -> bytes:
    """The rest of the open file `f`, whose size `size` (fstat's, already checked against `limit`) sizes the
    read: `f.read(limit + 1)` would allocate the whole limit up front (4 GiB for an artifact's file), which
    fails under an address-space cap (`ulimit -v`, containers, batch schedulers) however small the file is.
    A file that grew since its fstat is read on in small pieces, at most `limit + 1` bytes in all, so the
    caller still sees that it is too large."""
    data = f.read(min(size, limit) + 1)
    if len(data) <= size:
        return data
    parts = [data]
    total = len(data)
    while total <= limit:
        piece = f.read(min(GROWTH_PIECE, limit + 1 - total))
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
    return b"".join(parts)


def read_text(path: str | Path, error: type[V4Error], what: str = "file", limit: int = MAX_TEXT_BYTES) -> str:
    """A regular file's contents as UTF-8 text."""
    data = read_bytes(path, error, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text", where=str(path), found=f"byte 0x{data[e.start]:02x} at offset {e.start}") \
            from None


def inside(root: str | Path, rel: str, error: type[V4Error], where: str) -> Path:
    """`root / rel`, refused unless it names a path inside `root` (after following every symlink)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise error("file name must be a non-empty string", where=where, found=repr(rel))
    if os.path.isabs(rel) or Path(rel).drive:
        raise error("file name must be relative to the checkpoint directory", where=where, found=rel)
    if any(part == ".." for part in Path(rel).parts):
        raise error("file name leaves the checkpoint directory", where=where, found=rel)
    base = Path(root).resolve()
    p = Path(root) / rel
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python 3.11)
        raise error(f"file name cannot be resolved ({e})", where=where, found=rel) from None
    if real != base and base not in real.parents:
        raise error("file resolves outside the checkpoint directory (symlink?)", where=where,
                    expected=f"a file under {base}", found=str(real))
    return p


# ---- outputs -----------------------------------------------------------------------------------

def check_output_file(path: str | Path, error: type[V4Error], what: str = "output file") -> Path:
    """An output file path that can be written: not a directory, its parent a writable directory
    (created if missing: every missing ancestor must be creatable). An existing regular file is replaced."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{what} names a directory", where=str(p), expected="a file path")
    if p.exists() and not p.is_file():
        raise error(f"{what} exists and is not a regular file", where=str(p))
    _check_parent(p, error, what)
    return p


def check_output_dir(path: str | Path, error: type[V4Error], force: bool = False,
                     what: str = "output directory") -> Path:
    """An output directory path: absent, empty, or (with `force`) a directory to replace."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise error(f"{what} exists and is not a directory", where=str(p))
        if any(p.iterdir()) and not force:
            raise error(f"{what} exists and is not empty", where=str(p), expected="a new or empty directory, "
                        "or --force to replace it")
    _check_parent(p, error, what)
    return p


def _check_parent(p: Path, error: type[V4Error], what: str) -> None:
    parent = p.absolute().parent
    probe = parent
    while not probe.exists():
        if probe.is_symlink():
            raise error(f"{what}: a parent is a dangling symlink", where=str(probe))
        probe = probe.parent
    if not probe.is_dir():
        raise error(f"{what}: a parent is not a directory", where=str(p), found=f"{probe} is a file")
    # A real probe (not os.access): root passes access checks on read-only file systems.
    try:
        fd, name = tempfile.mkstemp(prefix=".v4compile-probe-", dir=probe)
    except OSError as e:
        raise error(f"{what}: directory is not writable ({e.strerror})", where=str(probe)) from None
    os.close(fd)
    os.unlink(name)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write under a temporary sibling name, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary sibling name; on success it replaces `path` (an empty one,
    or any directory with `force`); on any failure or interruption the temporary directory is removed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The name is chosen before the directory exists, so that a signal arriving just after it is created still
    # finds it in the clean-up below (mkdtemp's return would leave a window).
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        old = None
        if out.exists():
            if any(out.iterdir()):
                if not force:
                    raise FileExistsError(f"{out} is not empty")
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old)
            else:
                out.rmdir()
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | Path, error: type[V4Error]) -> str:
    """sha256 of a regular file, read in 1 MiB pieces (opened without blocking: a FIFO is refused, never
    waited on)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, error), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
