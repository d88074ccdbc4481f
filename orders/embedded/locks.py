"""Files, locks and processes on this host: what the embedded stores need of the OS.

Nothing here knows about Redis or SQL: cross-process file locks, pidfiles, whether a pid
still runs (a zombie counts as gone) and where, and reading the tail of a log file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from orders.errors import StoreUnavailable

POLL_S = 0.02
LOG_TAIL_LINES = 12
LOG_TAIL_LINE_CHARS = 300


@contextlib.contextmanager
def file_lock(path: Path, *, store: str, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` across processes, waited for at most ``timeout_s``.

    Failures raise StoreUnavailable for ``store`` (the store the lock protects).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreUnavailable(
            store, f"cannot open the lock file {path}: {exc.strerror or exc}"
        ) from exc
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise StoreUnavailable(
                        store, f"cannot lock {path}: {exc.strerror or exc}"
                    ) from exc
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    store, f"another process held {path} for over {timeout_s:g} s; try again"
                )
            time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs. A zombie (dead, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True  # no /proc (not Linux), or it just went away: trust kill(0)
    fields = stat.rpartition(")")[2].split()
    return not (fields and fields[0] in {"Z", "X"})


def wait_gone(pid: int, deadline: float) -> bool:
    """Poll until ``pid`` is gone (True) or ``deadline`` passes (False)."""
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def works_in(pid: int, directory: Path) -> bool:
    """Whether ``pid`` runs with ``directory`` as its cwd, as a redis-server for it does.

    Tells a server of ours (alive, not answering yet) from an unrelated process that got
    the pid of a stale pidfile. Without /proc it cannot tell, and says yes.
    """
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except PermissionError:
        return False  # another user's process: not a server in our home
    except OSError:
        return True
    return Path(cwd) == directory


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_from(path: Path, offset: int) -> str:
    """What was written to ``path`` past ``offset`` (the log of this start attempt only)."""
    try:
        with path.open("rb") as log:
            log.seek(offset)
            return log.read(1 << 20).decode("utf-8", errors="replace")
    except OSError:
        return ""


def as_text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


def tail(text: str) -> str:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join("  " + line[:LOG_TAIL_LINE_CHARS] for line in lines[-LOG_TAIL_LINES:])
