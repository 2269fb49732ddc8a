"""Which failures are the user's to fix, and the one line that tells them how.

Only vizq's own error types (subclasses of :class:`VizqError`) and the environment's refusals
(an unwritable or full disk, a path that is a file, a missing file: :class:`OSError` with an
errno) are shown as a one-line message: CLI exit 2, a message box in the dashboard. A plain
``ValueError``/``KeyError``/``IndexError`` is a bug in vizq and must surface as one, with its
traceback, instead of telling the user that their input was wrong.

This module imports nothing from vizq, so every module can raise these types without cycles.
"""
from __future__ import annotations

import errno
import os


class VizqError(Exception):
    """A problem the user can fix; the message says what was wrong and what to do."""


class InputError(VizqError, ValueError):
    """A bad argument or option (count, device, site pattern, bit width)."""


class Cancelled(VizqError, RuntimeError):
    """The user cancelled a long run; nothing was written."""


class DestinationError(VizqError):
    """An output path that vizq may not write to (not its own export, a file, unwritable)."""


#: errno -> what it means for the user, phrased to follow "cannot write PATH: ".
_OS_REASONS = {
    errno.ENOSPC: "the disk is full; free some space or write elsewhere",
    errno.EDQUOT: "the disk quota is exhausted; free some space or write elsewhere",
    errno.EACCES: "permission denied; choose a folder you can write to",
    errno.EPERM: "operation not permitted; choose a folder you can write to",
    errno.EROFS: "the file system is read-only; choose a writable folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ENOENT: "no such file or folder",
    errno.ENAMETOOLONG: "the name is too long",
    errno.EEXIST: "it already exists",
    errno.ENOTEMPTY: "the folder is not empty",
    errno.EIO: "an input/output error occurred on the device",
    errno.EFBIG: "the file would exceed the size this system allows; free space or write elsewhere",
}

def is_user_error(e: BaseException) -> bool:
    """True for failures the user can act on; False for bugs (shown with a traceback)."""
    if isinstance(e, VizqError):
        return True
    return isinstance(e, OSError) and e.errno is not None


def message(e: BaseException) -> str:
    """The one-line, user-facing text of an error."""
    if isinstance(e, OSError) and not isinstance(e, VizqError) and e.errno is not None:
        reason = _OS_REASONS.get(e.errno) or os.strerror(e.errno)
        where = e.filename if e.filename is not None else ""
        text = f"cannot use {where}: {reason}" if where else reason
        return text.replace("\n", " ")
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return (str(e) or type(e).__name__).replace("\n", " ")
