"""Folders a process writes into: created with a one-line error, and locked so only one process at a time works in one.

A lock is ``fcntl.flock`` on the file ``.lock`` inside the folder, which then holds the PID of the
process that took it last. The operating system releases the lock when that process ends, however
it ends (SIGKILL, power loss), so a lock is never stale: the file may stay, the lock does not. The
token cache uses it (data/prepare.py) and so does the run folder (training/run_folder.py); data/ is
the lowest layer both may import.
"""
import errno
import fcntl
import os
from pathlib import Path
from typing import Optional

from errors import UserError

LOCK_FILE = ".lock"


def make_folder(path: Path, option: str, value) -> None:
    """Create ``path`` and its parents; UserError naming ``option=value`` when that cannot be done."""
    check_folder_path(path, option, value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{option}={value}: cannot create {path} ({err.strerror}); point {option} at a folder you "
                        "can write") from err


def check_folder_path(path: Path, option: str, value) -> None:
    """UserError when ``path`` or one of its parents is a file, so that it can be no folder."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            raise UserError(f"{option}={value}: {part} is a file, not a folder; remove it or point {option} "
                            "at a folder")


def check_file_paths(folder: Path, names, option: str, value) -> None:
    """UserError when one of ``names`` (files a process writes in ``folder``) is a folder: writing it
    would fail with IsADirectoryError halfway through."""
    for name in names:
        path = Path(folder) / name
        if path.is_dir():
            raise UserError(f"{path} is a folder, but it is where a file goes; remove it or point {option} at another "
                            f"folder than {value}")


def out_of_space(err: BaseException) -> bool:
    """Whether a disk or quota that is full caused ``err`` (anywhere in its chain)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def remove_temporaries(folder: Path) -> None:
    """Remove the temporary files (``.*.tmp``) a killed process left in ``folder``, which the caller holds
    the lock of (so no other process is writing them)."""
    for path in Path(folder).glob(".*.tmp"):
        if path.is_file():
            path.unlink(missing_ok=True)


class FolderLock:
    """The exclusive lock of one folder (which must exist)."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK_FILE
        self.fd: Optional[int] = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False when another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._own(fd)
        return True

    def acquire(self) -> None:
        """Take the lock, waiting for the process that holds it to finish."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._own(fd)

    def _own(self, fd: int) -> None:
        self.fd = fd
        os.pwrite(fd, f"{os.getpid():<10}\n".encode(), 0)  # one write over the last holder's PID: never empty
        os.ftruncate(fd, 11)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def lock_holder(folder) -> Optional[int]:
    """The PID of the process that holds ``folder``'s lock (-1 when it has not written it yet); None
    when nobody does. Creates nothing."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None


def holder_text(pid: int) -> str:
    return f"PID {pid}" if pid > 0 else "PID not written yet"
