"""Atomic writes: temp file in the same folder, then rename. A crash or a cancelled run
never leaves half a file, and an existing file stays intact until the new one is complete."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path to write; it replaces ``path`` only if the block succeeds."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file ordinary permissions
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except OSError as e:
        _name_destination(e, p, Path(tmp))
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _name_destination(e: OSError, dest: Path, tmp: Path) -> None:
    """Make an I/O error name what the user asked to write, not our temp path (or nothing)."""
    if e.errno is not None and (e.filename is None or str(e.filename).startswith(str(tmp))):
        e.filename = str(dest)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


PARTIAL_MARKER = ".vizq-partial"  # first file of every temp folder: marks it as ours to clean


def check_writable(path: str | Path, *, kind: str = "file") -> None:
    """Fail now, before minutes of work, if ``path`` cannot be written: an ancestor that is a
    file, an existing folder where a file is meant (or a file where a folder is), or a nearest
    existing folder in which nothing can be created (permissions, read-only file system).
    Probing by creating a file is the only test that also holds for root and read-only mounts."""
    from .errors import DestinationError

    p = Path(path).expanduser().absolute()
    if kind == "file" and p.is_dir():
        raise DestinationError(f"{p} is a folder; give a file name to write")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise DestinationError(f"{p} is a file; vizq writes a folder there and will not replace a file. "
                               "Choose another --out")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DestinationError(f"cannot write {p}: {parent} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".vizq-probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        from .errors import message

        raise DestinationError(f"cannot write {p}: {message(e)}") from None


def lock_file(target: Path) -> Path:
    """The lock file for ``target``: in vizq's cache folder (keyed by the absolute path), not
    beside the target, so nothing of vizq's is left in the user's folders."""
    import hashlib

    from .quant.native import cache_dir

    key = hashlib.sha1(str(Path(target).expanduser().absolute()).encode()).hexdigest()[:20]
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}.lock"


@contextmanager
def locked(target: Path) -> Iterator[None]:
    """An exclusive advisory lock for writing ``target`` (POSIX ``flock``): writers take turns,
    across threads and processes (torchrun ranks included) on this machine."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; the swap itself stays consistent
        yield
        return
    with open(lock_file(target), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    system cannot, and the caller falls back to two renames that :func:`recover_dir` repairs."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False  # EINVAL/ENOSYS (file system without it): use the fallback


def _old_path(p: Path) -> Path:
    return p.with_name(f".{p.name}.old")


def _writer_gone(tmp: Path) -> bool:
    """Whether the process that made temp folder ``tmp`` has ended (its pid is in the marker)."""
    try:
        pid = int((tmp / PARTIAL_MARKER).read_text() or "0")
        os.kill(pid, 0)
    except (OSError, ValueError):
        return True
    return False


def _recover(p: Path, is_ours: Callable[[Path], bool], keep: Path | None = None) -> None:
    """:func:`recover_dir` for a caller that holds the lock."""
    old = _old_path(p)
    if old.is_dir() and is_ours(old):
        if not p.exists():
            os.replace(old, p)
        elif is_ours(p):
            shutil.rmtree(old, ignore_errors=True)
    if p.parent.is_dir():
        for tmp in p.parent.glob(f".{p.name}.tmp-*"):
            if tmp == keep or not tmp.is_dir():
                continue
            marked = (tmp / PARTIAL_MARKER).exists()
            # marked: being written, stale once its writer is gone; unmarked and complete: a
            # writer died between unmarking and the swap (both happen under the lock we hold)
            if (marked and _writer_gone(tmp)) or (not marked and is_ours(tmp)):
                shutil.rmtree(tmp, ignore_errors=True)


def recover_dir(path: str | Path, is_ours: Callable[[Path], bool]) -> None:
    """Finish what a killed commit left: a missing ``path`` whose previous version waits in
    ``.NAME.old`` gets it back; temp folders of writers that are gone are removed. Nothing that
    is not marked or recognised as ours is touched, and live writers' folders are left alone."""
    p = Path(path).expanduser()
    if not p.parent.is_dir() or not (_old_path(p).exists() or any(p.parent.glob(f".{p.name}.tmp-*"))):
        return  # nothing to repair (and no lock file to create)
    with locked(p):
        _recover(p, is_ours)


@contextmanager
def atomic_dir(path: str | Path, is_ours: Callable[[Path], bool] | None = None, force: bool = False) -> Iterator[Path]:
    """Yield a temp folder; it becomes ``path`` only when the block succeeds.

    An existing ``path`` is replaced only if ``is_ours(path)`` says vizq wrote it, or with
    ``force``; a file at ``path`` is never replaced. The swap is one atomic exchange where the
    OS offers it, else two renames whose gap :func:`recover_dir` closes on the next run (or
    read). Concurrent writers take turns under a lock (:func:`locked`): the last one to finish
    wins, and every reader sees one complete folder.
    """
    from .errors import DestinationError

    p = Path(path).expanduser()
    ours = is_ours or (lambda _: False)
    check_writable(p, kind="dir")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.tmp-", dir=p.parent))
    try:
        (tmp / PARTIAL_MARKER).write_text(str(os.getpid()))
        yield tmp
        with locked(p):
            _recover(p, ours, keep=tmp)
            if p.exists() and not p.is_dir():
                raise DestinationError(f"{p} is a file; vizq will not replace it with a folder. Choose another --out")
            if p.exists() and not (force or ours(p) or not any(p.iterdir())):
                raise DestinationError(
                    f"{p} exists and is not a vizq export; vizq never overwrites folders it did not write. "
                    "Choose a new --out, or pass --force to replace it")
            (tmp / PARTIAL_MARKER).unlink()
            if not p.exists():
                os.replace(tmp, p)
            elif _exchange(tmp, p):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous version
            else:
                old = _old_path(p)
                os.replace(p, old)  # a kill here is repaired by recover_dir: old comes back
                os.replace(tmp, p)
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        _name_destination(e, p, tmp)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
