"""One job per run directory: ``RUN_DIR/.owner`` names the job that owns it.

The owner file is a small JSON record (host, pid, start time, job id, attempt, a random token)
created atomically: written under a unique temporary name and hard-linked to ``.owner``
(``link`` fails when the name exists, on local disks and NFS alike; where links are not supported,
``open(O_CREAT | O_EXCL)``). While the job runs, a daemon thread touches the file every
``MEGAFORMER_RUN_LOCK_HEARTBEAT`` seconds (default 30): its modification time is the last heartbeat.
A clean exit, or one on a user error, removes the file.

Another job that finds the file is refused at once, with one line naming the owner, unless the
owner is stale, in which case it is taken over with a warning:

- its heartbeat is older than ``MEGAFORMER_RUN_LOCK_STALE`` seconds (default 3 heartbeats): the
  owner died (SIGKILL, a lost node) or hangs without its process; this is the rule for an owner on
  another host, whose process cannot be seen from here (hosts' clocks are assumed in sync to well
  under that timeout);
- it is on this host and its pid is gone (``os.kill(pid, 0)``): no need to wait for the timeout;
- it is the same job (``SLURM_JOB_ID``, else ``TORCHELASTIC_RUN_ID``) restarted (a higher
  ``SLURM_RESTART_COUNT`` / ``TORCHELASTIC_RESTART_COUNT``), or run again from another host: a
  requeue takes its own run directory back. The same job on this host with its process alive
  is still refused.

Taking over renames the stale file away under a unique name (one job wins the rename), checks that
the moved file is the one judged stale (else puts it back and looks again), and then creates a new
owner file as above. Nothing relies on ``flock``, which network filesystems do not all honour.

Commands that write files (``convert``, ``prepare-data``) call :func:`check_not_owned` on their
output: writing into a run directory, or below one, that a live job owns is refused.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from megaformer.errors import UserError

log = logging.getLogger("megaformer")

OWNER_FILE = ".owner"
HEARTBEAT_ENV = "MEGAFORMER_RUN_LOCK_HEARTBEAT"
STALE_ENV = "MEGAFORMER_RUN_LOCK_STALE"
DEFAULT_HEARTBEAT_S = 30.0


class RunDirInUse(UserError):
    """A run directory that another live job owns."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise UserError(f"{name}={raw!r}: must be > 0 seconds")
    return value


def heartbeat_seconds() -> float:
    return _env_seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)


def stale_seconds() -> float:
    return _env_seconds(STALE_ENV, 3 * heartbeat_seconds())


@dataclass
class Owner:
    """Who owns a run directory; ``heartbeat`` is the owner file's modification time."""

    host: str
    pid: int
    started: float
    job: Optional[str] = None
    attempt: list = field(default_factory=lambda: [0, 0])
    token: str = ""
    heartbeat: float = 0.0

    @classmethod
    def me(cls) -> "Owner":
        job = os.environ.get("SLURM_JOB_ID") or None
        if job is None and os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
            job = "torchelastic:" + os.environ["TORCHELASTIC_RUN_ID"]
        attempt = [
            int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        ]
        return cls(socket.gethostname(), os.getpid(), time.time(), job, attempt, uuid.uuid4().hex)

    def record(self) -> str:
        data = asdict(self)
        data.pop("heartbeat")
        return json.dumps(data) + "\n"

    def describe(self, now: Optional[float] = None) -> str:
        now = time.time() if now is None else now
        started = datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc)
        job = f", job {self.job}" if self.job else ""
        return (
            f"host {self.host}, pid {self.pid}{job}, started {started:%Y-%m-%d %H:%M:%S} UTC, "
            f"last heartbeat {max(0.0, now - self.heartbeat):.0f}s ago"
        )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except OSError:
        return False
    return True


def plausible_lock(path: Path, st: os.stat_result) -> bool:
    """Whether ``st`` (the lstat of ``path``) can be an owner file megaformer wrote: a regular
    file (not a link, FIFO or device), owned by this user or by the owner of its folder (a
    colleague's run directory). Anything else, such as a FIFO or another user's file planted in a
    shared folder, is not a lock."""
    if not stat.S_ISREG(st.st_mode):
        return False
    if st.st_uid == os.getuid():
        return True
    try:
        return st.st_uid == os.stat(Path(path).parent).st_uid
    except OSError:
        return False


def read_owner(path: Path) -> Optional[Owner]:
    """The owner recorded in ``path`` (an owner file); None when there is none. An unreadable or
    half-written record is an unknown owner (host "?", pid 0) judged by its heartbeat alone; a
    file that cannot be a lock (:func:`plausible_lock`) is an unknown owner with no heartbeat
    (stale). The file is opened non-blocking without following a link, so a FIFO never hangs."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return Owner("?", 0, 0.0, token="")
    if not plausible_lock(path, st):
        return Owner("?", 0, 0.0, token="")  # heartbeat 0: stale, taken over / ignored
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(1 << 16) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:  # vanished or unreadable meanwhile: judged by the heartbeat seen
        raw = b""
    try:
        data = json.loads(raw.decode())
        owner = Owner(
            str(data["host"]),
            int(data["pid"]),
            float(data["started"]),
            data.get("job") or None,
            [int(x) for x in data.get("attempt") or [0, 0]],
            str(data.get("token", "")),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        owner = Owner("?", 0, st.st_mtime, token="")
    owner.heartbeat = st.st_mtime
    return owner


def stale_reason(
    owner: Owner, me: Owner, stale_after: float, now: Optional[float] = None
) -> Optional[str]:
    """Why ``owner`` no longer owns its run directory (as seen by ``me``); None when it does."""
    now = time.time() if now is None else now
    if owner.heartbeat - now > stale_after:  # no job writes heartbeats ahead of the clocks
        return f"its heartbeat is {owner.heartbeat - now:.0f}s in the future"
    same_host = owner.host == me.host
    if owner.job and owner.job == me.job and not (same_host and _pid_alive(owner.pid)):
        if list(me.attempt) > list(owner.attempt):
            return f"job {owner.job} was restarted"
        return (
            f"job {owner.job} runs again on {me.host}"
            if not same_host
            else f"job {owner.job}'s process {owner.pid} is gone"
        )
    if now - owner.heartbeat > stale_after:
        return f"no heartbeat for {now - owner.heartbeat:.0f}s (more than {stale_after:.0f}s)"
    if same_host and owner.pid > 0 and not _pid_alive(owner.pid):
        return f"its process {owner.pid} on this host is gone"
    return None


def _in_use(run_dir: Path, owner: Owner, stale_after: float) -> str:
    return (
        f"{run_dir} is in use by another job ({owner.describe()}); wait for it to end, or use "
        f"another --run-dir (an owner without a heartbeat for {stale_after:.0f}s is taken "
        f"over; {run_dir / OWNER_FILE} names it)"
    )


class RunLock:
    """Ownership of one run directory by this process (see the module docstring)."""

    def __init__(
        self, run_dir: Path, heartbeat_s: Optional[float] = None, stale_s: Optional[float] = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / OWNER_FILE
        self.heartbeat_s = heartbeat_seconds() if heartbeat_s is None else heartbeat_s
        self.stale_s = (
            (3 * self.heartbeat_s if heartbeat_s is not None else stale_seconds())
            if stale_s is None
            else stale_s
        )
        self.me = Owner.me()
        self.held = False
        self.lost = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------- acquire

    def _create(self) -> bool:
        """Create the owner file with our record; False when one exists."""
        tmp = self.run_dir / f"{OWNER_FILE}.tmp-{self.me.token}"
        with open(tmp, "x") as fh:
            fh.write(self.me.record())
            fh.flush()
            os.fsync(fh.fileno())
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:
                if os.stat(tmp).st_nlink == 2:  # NFS: the link was made, its reply lost
                    return True
                return self._create_exclusive()
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(self.me.record())
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def _take_over(self, stale: Owner) -> bool:
        """Move the stale owner file away; False when it changed in the meantime."""
        moved = self.run_dir / f"{OWNER_FILE}.stale-{self.me.token}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        now_there = read_owner(moved)
        if now_there is None or (now_there.token, now_there.pid, now_there.host) != (
            stale.token,
            stale.pid,
            stale.host,
        ):
            try:  # another job's fresh owner file: put it back
                os.link(moved, self.path)
            except OSError:
                pass
            moved.unlink(missing_ok=True)
            return False
        moved.unlink(missing_ok=True)
        return True

    def acquire(self) -> None:
        """Own the run directory, or raise :class:`RunDirInUse` naming its owner."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            if self._create():
                self.held = True
                return
            owner = read_owner(self.path)
            if owner is None:
                continue  # released meanwhile
            reason = stale_reason(owner, self.me, self.stale_s)
            if reason is None:
                raise RunDirInUse(_in_use(self.run_dir, owner, self.stale_s))
            if self._take_over(owner):
                log.warning(
                    "%s: taking over from a stale owner (%s): %s",
                    self.run_dir,
                    owner.describe(),
                    reason,
                )
        owner = read_owner(self.path)
        raise RunDirInUse(
            _in_use(self.run_dir, owner, self.stale_s)
            if owner is not None
            else f"{self.run_dir}: could not take ownership (other jobs keep claiming it)"
        )

    # ------------------------------------------------------------------------- heartbeat

    def _owned(self) -> bool:
        owner = read_owner(self.path)
        return owner is not None and owner.token == self.me.token

    def beat(self) -> bool:
        """Refresh the heartbeat; False (and a warning, once) when another job took over."""
        if not self._owned():
            if not self.lost:
                self.lost = True
                log.warning(
                    "%s: this job no longer owns the run directory (%s); another job took it "
                    "over after a missed heartbeat",
                    self.run_dir,
                    (lambda o: o.describe() if o else "no owner")(read_owner(self.path)),
                )
            return False
        try:
            os.utime(self.path)
        except OSError:
            return False
        return True

    def start_heartbeat(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.heartbeat_s):
                if not self.beat():
                    return

        self._thread = threading.Thread(target=loop, name="megaformer-run-lock", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- release

    def release(self) -> None:
        """Stop the heartbeat and remove the owner file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.held and self._owned():
            moved = self.run_dir / f"{OWNER_FILE}.done-{self.me.token}"
            try:
                os.rename(self.path, moved)
                owner = read_owner(moved)
                if owner is not None and owner.token != self.me.token:
                    os.link(moved, self.path)  # raced with a takeover: not ours to remove
                moved.unlink(missing_ok=True)
            except OSError:
                pass
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_on_rank0(run_dir: Path, rank: int) -> Optional[RunLock]:
    """Rank 0 takes the run directory (with a heartbeat); a refusal is raised on every rank.

    Call it on every rank after the process group exists: the outcome travels by one broadcast,
    so all ranks end alike (one line, exit code 2) instead of some waiting on rank 0."""
    import torch.distributed as tdist

    lock: Optional[RunLock] = None
    error: Optional[str] = None
    if rank == 0:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
            lock.start_heartbeat()
        except UserError as e:
            error = str(e)
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        box = [error]
        tdist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RunDirInUse(error)
    return lock


def shared_folder(folder: Path) -> bool:
    """A folder others may write to (``/tmp``, a ``/scratch`` root): sticky or world-writable.
    Run directories are never such folders, so an owner file found there is not a lock."""
    try:
        mode = os.stat(folder).st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_ISVTX | stat.S_IWOTH))


def check_not_owned(path: Path, what: str) -> None:
    """Raise :class:`RunDirInUse` when ``path`` is in (or is) a run directory that a live job owns
    (this process's own run directory excepted)."""
    path = Path(path).absolute()
    me = Owner.me()
    stale_after = stale_seconds()
    for folder in (path, *path.parents):
        if shared_folder(folder):
            continue  # /tmp, /scratch: megaformer never locks such a folder, anyone can plant there
        owner = read_owner(folder / OWNER_FILE)
        if owner is None:
            continue
        if (owner.host, owner.pid) == (me.host, me.pid) or stale_reason(owner, me, stale_after):
            return
        raise RunDirInUse(
            f"{what}: {path} is inside {folder}, a run directory in use by a "
            f"training job ({owner.describe()}); write elsewhere or wait for it to end"
        )
