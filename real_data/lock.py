"""An exclusive lock on a run directory, so that two processes never write one run.

The lock is ``RUN_DIR/.lock``, held with ``fcntl.flock`` on an open descriptor: the kernel
drops it when the holder exits in any way (SIGKILL and power loss included), so a lock file
left by a crashed process is stale by construction and the next process simply takes it. The
file names its holder (pid, host, start time) for the message a second process gets. Release
removes the file while still holding the lock; :meth:`RunLock.acquire` re-checks that the file
it locked is still the one at the path, so a process that opened the old file just before it
was removed cannot hold a lock on a file nobody else sees.

``flock`` locks are local to a host: run directories on a network file system shared by
several hosts need one host per run directory (which the study's ``--shard`` gives).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from linattn.errors import UserError

LOCK_FILE = ".lock"


class RunLocked(UserError):
    """Another live process holds the run directory's lock."""


def _describe(text: str) -> str:
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    if not fields:
        return "another process"
    since = fields.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(since))) if since else "?"
    return f"pid {fields.get('pid', '?')} on {fields.get('host', '?')} (since {when})"


class RunLock:
    """The held lock of one run directory (:meth:`acquire`); :meth:`release` is idempotent.

    Attributes
    ----------
    path : Path
        The lock file.
    stale : str or None
        The holder a crashed process left in the file (``None`` if the file was new).
    """

    def __init__(self, path: Path, fd: int, stale: str | None) -> None:
        self.path, self._fd, self.stale = path, fd, stale

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> RunLock:
        """Lock ``run_dir`` (which must exist) or raise :class:`RunLocked` naming the holder."""
        path = Path(run_dir) / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _flock_retrying(fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunLocked(
                    f"{run_dir} is in use by {_describe(_read(path))}; wait for that process "
                    "to finish or stop it (a crashed holder releases the lock by itself)"
                ) from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file its holder removed on release: lock the new one
        try:
            previous = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or None
            holder = f"pid={os.getpid()} host={socket.gethostname()} since={time.time():.0f}\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            os.fchmod(fd, 0o644)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, previous)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (nothing to do when already released)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):  # a read-only or vanished folder: the lock still goes
            os.unlink(self.path)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a lock nobody released (the kernel drops it at exit anyway)
        with contextlib.suppress(Exception):
            self.release()


def _flock_retrying(fd: int, tries: int = 4, pause_s: float = 0.05) -> None:
    """An exclusive non-blocking flock, tried a few times: :func:`holder` takes a shared lock
    for an instant, which must not make an acquirer give up."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if i == tries - 1:
                raise
            time.sleep(pause_s)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def holder(run_dir: str | os.PathLike) -> str | None:
    """Who holds ``run_dir``'s lock (``pid P on HOST (since T)``), or ``None`` if nobody does
    (no lock file, or a stale one). For callers that must not touch a run in use, e.g. before
    removing a run directory."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _describe(_read(path))
    finally:
        os.close(fd)
    return None
