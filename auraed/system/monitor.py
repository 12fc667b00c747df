"""Per-executable monitor: supervises one executable so that it survives the death of auraed.

Run as ``python -m auraed.system.monitor SPEC_JSON_PATH SYNC_FD``, cheaper (no runpy, no site) as
``monitor_command(...)`` builds it, or cheapest forked by ``auraed.system.monitor_launcher``, which
calls ``main`` in a child of a process that has imported this module already (what the
Supervisor does).

The monitor makes itself a session leader, starts the executable inside the cell's cgroups
(optionally in a new pid namespace, as PID 2 under a minimal init (_be_init), inside a network
namespace, with new mount/uts/ipc namespaces; _Monitor.spawn_child and fork_child say which way
when), reports ``{"pid": N,
"start_ticks": T}`` (or ``{"error": ..., "errno": N}``) as one JSON line on SYNC_FD, copies the
child's stdout/stderr into a Kubernetes CRI format log file, and finally writes ``exit.json``
atomically. SIGUSR1 makes it reopen the log file (log rotation, CRI ReopenContainerLog).

Containers (OCI runtimes) use three more spec options:

- ``subreaper``: the monitor becomes a child subreaper (prctl), so the processes a runtime forks
  and abandons are reparented to it; it then reaps every child, not only the supervised one.
- ``pid_file``: argv is a runtime command that starts the real process and exits (``runc create
  --pid-file P``, ``runc exec --detach --pid-file P``). The monitor spawns it with posix_spawn
  (no fork of itself; it stays in the monitor's process group, so killing that group ends both),
  waits for it (its output is kept apart, not logged: it is the runtime's), reports
  ``{"error": ...}`` with the runtime's last stderr lines when it fails, else reads the pid from
  pid_file, reports it, and supervises that process, which inherited argv's stdout/stderr pipes.
  Implies ``subreaper``; cwd, uid/gid, cgroups and namespaces are the runtime's business.
- ``console_socket``: the monitor listens there before running argv (which carries
  ``--console-socket``), receives the terminal master the runtime sends, and logs its output as
  stdout.
- ``runtime_starts``: argv also starts the process (``runc run --detach``), so what the shared
  pipes carry while argv runs may already be the process's output. runc and crun never write to
  stdout, so stdout is logged as it comes: a follower sees the first line without waiting for
  the runtime to exit. stderr also carries the runtime's errors: it is kept (up to
  EARLY_OUTPUT_MAX, then the pipe is left unread until argv ends), logged once argv succeeded and
  used as the error message when it failed.

With an empty ``log_path`` the monitor copies nothing: argv inherits the monitor's own stdin,
stdout and stderr, which the monitor then drops (pass-through, used for exec sessions).

The monitor path imports only builtins and tiny C modules (os, sys, time, select, _signal, _json);
the ``signal`` and ``json`` packages cost ~10 ms (enum, re, collections) natively and ~10x that in
emulated guests. ctypes comes in (through auraed.system.namespaces) only when namespaces or a
subreaper are asked for; auraed.system.pty (``_socket``) only with a console socket. The classes
and parsers at the bottom are for auraed, not for the monitor path.
"""

# contextlib.suppress would pull contextlib (+collections, functools) into the lean monitor path.
# ruff: noqa: SIM105

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any, NoReturn
else:
    import _signal  # the C half of `signal`, without its enum wrappers

LOG_LINE_MAX = 16 * 1024
"""Longest CRI log record; longer lines are split into P records followed by an F record."""

EXIT_GRACE_SECONDS = 2.0
"""How long output is still collected after the executable died while a descendant holds its pipes."""

RUNTIME_OUTPUT_MAX = 16 * 1024
"""How much of a runtime command's own output is kept for its error message."""

ADOPTION_WAIT = 2.0
"""Seconds a process a runtime started may take to be reparented to us (see await_adoption)."""

EARLY_OUTPUT_MAX = 1024 * 1024
"""With runtime_starts: how much of stderr is read while the runtime runs (the rest waits)."""

_READ_SIZE = 64 * 1024
_EIO = 5  # errno.EIO: a terminal master once the last slave descriptor is closed
_START_FAILED_EXIT_CODE = 127
_INF = float("inf")


# --------------------------------------------------------------------------------------- tiny JSON


def _encode_str(value: str) -> str:
    try:
        from _json import encode_basestring_ascii
    except ImportError:  # pragma: no cover - CPython always has _json
        from json.encoder import py_encode_basestring_ascii as encode_basestring_ascii
    return encode_basestring_ascii(value)


def _dumps(obj: object) -> str:
    """json.dumps for None/bool/int/float/str/list/tuple/dict without importing json (and re)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        if not -_INF < obj < _INF:  # NaN and infinities are not JSON
            return "null"
        return float.__repr__(obj)
    if isinstance(obj, str):
        return _encode_str(obj)
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{_encode_str(str(k))}: {_dumps(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list | tuple):
        return "[" + ", ".join(_dumps(v) for v in obj) + "]"
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


class _ScanContext:
    """The attributes _json.make_scanner reads from a json.JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity


def _loads(text: str) -> Any:
    """json.loads through the C scanner, falling back to the json package (errors, other Pythons)."""
    try:
        from _json import make_scanner

        scan = make_scanner(_ScanContext())  # type: ignore[arg-type]
        start = len(text) - len(text.lstrip())
        value, end = scan(text, start)
        if text[end:].strip():
            raise ValueError("extra data")
        return value
    except Exception:
        import json

        return json.loads(text)


# ------------------------------------------------------------------------------------------ helpers


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return f"{type(exc).__name__}: {exc}"


def _errno_of(exc: BaseException) -> int:
    return exc.errno if isinstance(exc, OSError) and exc.errno else 0


def log_error(message: str) -> None:
    try:
        os.write(2, f"auraed-monitor[{os.getpid()}]: {message}\n".encode(errors="replace"))
    except OSError:
        pass


def _read_counter(path: str | None, key: str = "oom_kill") -> int | None:
    """The value of the ``key N`` line of a cgroup file (memory.oom_control v1, memory.events v2)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            for line in f.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _proc_start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _ensure_std_fds() -> None:
    """Make sure fds 0-2 are open so that the pipes made later never land on them."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open("/dev/null", os.O_RDWR)  # takes the lowest free number: this one


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _system_module(name: str) -> ModuleType:
    """auraed.system.<name>, imported on first use, also when this file runs as a script under
    ``python -I -S`` (the source root is then added to sys.path)."""
    full_name = f"auraed.system.{name}"
    try:
        __import__(full_name)
    except ImportError:
        _add_source_root()
        __import__(full_name)
    return sys.modules[full_name]


def _namespaces() -> ModuleType:
    """auraed.system.namespaces (ctypes): only for namespaces or a subreaper."""
    return _system_module("namespaces")


def _threads() -> ModuleType:
    return _system_module("threads")


def _pty() -> ModuleType:
    """auraed.system.pty (console socket helpers): only with a console socket."""
    return _system_module("pty")


def _add_source_root() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    if root not in sys.path:
        sys.path.append(root)  # appended: the stdlib keeps priority


def _tail_lines(data: bytes, lines: int = 5, limit: int = 2000) -> str:
    """The last lines of a runtime's output for an error message; of runc's logrus lines
    (``time=... level=error msg="..."``) only the message."""
    kept = []
    for raw in data.decode(errors="replace").strip().splitlines()[-lines:]:
        start = raw.find(' msg="')
        end = raw.rfind('"')
        line = raw[start + 6 : end].replace('\\"', '"') if start >= 0 and end > start + 5 else raw
        if line.strip():
            kept.append(line.strip())
    return "; ".join(kept)[-limit:]


# -------------------------------------------------------------------------------------- CRI writer


class _Stream:
    __slots__ = ("buf", "crlf", "fd", "name")

    def __init__(self, fd: int, name: bytes, crlf: bool = False) -> None:
        self.fd = fd
        self.name = name
        self.buf = b""
        self.crlf = crlf  # a terminal: lines end in \r\n (ONLCR); the \r is not logged


class _CriLog:
    """Appends CRI records (``<RFC3339Nano> <stream> <F|P> <content>``), one write(2) per read chunk."""

    __slots__ = ("failed", "fd", "path", "prefix", "second")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.failed = False
        self.second = -1
        self.prefix = b""

    def open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)

    def reopen(self) -> None:
        old = self.fd
        try:
            self.open()
            self.failed = False
        except OSError as exc:
            log_error(f"reopen {self.path}: {_describe(exc)}")
            return
        if old >= 0:
            os.close(old)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def timestamp(self) -> bytes:
        now = time.time_ns()
        second, nanos = divmod(now, 1_000_000_000)
        if second != self.second:
            self.second = second
            self.prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)).encode()
        return b"%s.%09dZ" % (self.prefix, nanos)

    def write(self, records: list[bytes]) -> None:
        if not records or self.fd < 0:
            return
        try:
            _write_all(self.fd, b"".join(records))
        except OSError as exc:
            if not self.failed:  # say it once; keep draining the pipes so the executable never blocks
                log_error(f"write {self.path}: {_describe(exc)}")
            self.failed = True

    def feed(self, stream: _Stream, data: bytes) -> None:
        ts = self.timestamp()
        head = b"%s %s " % (ts, stream.name)
        buf = stream.buf + data if stream.buf else data
        records: list[bytes] = []
        start = 0
        while True:
            newline = buf.find(b"\n", start)
            if newline < 0:
                break
            end = newline - 1 if stream.crlf and newline > start and buf[newline - 1] == 13 else newline
            self._line(head, buf, start, end, records)
            start = newline + 1
        # An unterminated tail longer than one record: emit full-size partial records now.
        while len(buf) - start > LOG_LINE_MAX:
            records.append(head + b"P " + buf[start : start + LOG_LINE_MAX] + b"\n")
            start += LOG_LINE_MAX
        stream.buf = buf[start:]
        self.write(records)

    def finish(self, stream: _Stream) -> None:
        """At EOF the last unterminated data becomes an F record."""
        if stream.buf:
            head = b"%s %s " % (self.timestamp(), stream.name)
            records: list[bytes] = []
            self._line(head, stream.buf, 0, len(stream.buf), records)
            stream.buf = b""
            self.write(records)

    @staticmethod
    def _line(head: bytes, buf: bytes, start: int, end: int, records: list[bytes]) -> None:
        while end - start > LOG_LINE_MAX:
            records.append(head + b"P " + buf[start : start + LOG_LINE_MAX] + b"\n")
            start += LOG_LINE_MAX
        records.append(head + b"F " + buf[start:end] + b"\n")


# ----------------------------------------------------------------------------------------- monitor


def _join_cell_steps(
    spec: dict[str, Any], ns: ModuleType | None
) -> list[tuple[str, Callable[[str], None], str]]:
    """Joining the cell, step by step (name, action, its argument): its cgroups, then its
    network namespace.

    Both are the caller's thread's own when taken from a thread: writing 0 (the writer) to a v1
    "tasks" file moves that thread alone (and lets the kernel skip a grace period, see
    cgroupfs.join_files), and setns(CLONE_NEWNET) changes only the calling thread. 0 also
    names us in a new pid namespace, where our pid may be 1.
    """
    steps: list[tuple[str, Callable[[str], None], str]] = [
        (f"join cgroup {join_file}", _write_zero, str(join_file))
        for join_file in spec.get("cgroup_join_files") or ()
    ]
    netns = spec.get("netns_path")
    if netns and ns is not None:

        def enter(path: str) -> None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                ns.setns(fd, ns.CLONE_NEWNET)
            finally:
                os.close(fd)

        steps.append((f"setns {netns}", enter, str(netns)))
    return steps


def _write_zero(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def _spawnable(spec: dict[str, Any]) -> bool:
    """Whether the executable can start by posix_spawn from a thread that joined the cell
    (_Monitor.spawn_child): no new namespace, hostname or ids to set up in the child, v1 cgroups
    only (joining a v2 cgroup moves the whole monitor), and no pids limit on the way."""
    if spec.get("uid") is not None or spec.get("gid") is not None or spec.get("hostname"):
        return False
    if any(spec.get(key) for key in ("new_pid_ns", "new_mount_ns", "new_uts_ns", "new_ipc_ns")):
        return False
    join_files = [str(f) for f in spec.get("cgroup_join_files") or ()]
    return all(os.path.basename(f) == "tasks" for f in join_files) and not any(map(_pids_limited, join_files))


def _pids_limited(join_file: str) -> bool:
    """Whether the cgroup of ``join_file``, or one above it, limits its pids.

    The pids controller counts threads: while the joining thread spawns, it holds one of the
    cell's pids itself, so a cell allowing one process could start none. Such cells fork a child
    that joins and execs instead (a move into a cgroup is never refused for its pids).
    """
    directory, above = os.path.dirname(join_file), ""
    while directory != above:
        try:
            with open(os.path.join(directory, "pids.max"), "rb") as limit:
                if limit.read().strip() != b"max":
                    return True
        except OSError:
            return False  # not the pids hierarchy, or its root (which has no limit file)
        directory, above = os.path.dirname(directory), directory
    return False


def _child(  # noqa: PLR0915 - one straight line of setup steps
    spec: dict[str, Any], ns: ModuleType | None, out_w: int, err_w: int, err_pipe: int, *, status_w: int = -1
) -> NoReturn:
    """Runs in the forked child: set up, then exec. Never returns; failures go to err_pipe.

    ``out_w`` < 0: pass-through, the monitor's own stdin/stdout/stderr are kept. In a new pid
    namespace this process stays as its PID 1 (_be_init) and a child of it execs argv, as PID 2;
    ``status_w`` then carries that child's wait status back to the monitor.
    """
    step = "setup"
    try:
        step = "setsid"
        os.setsid()
        if spec.get("new_pid_ns"):
            # First, so the init stays out of the cell's cgroups (it takes none of the cell's
            # pids or memory) and of every namespace but the new pid namespace.
            step = "fork the executable under its init"
            _be_init(err_pipe, status_w)  # returns in the child only
        for step, join, target in _join_cell_steps(spec, ns):  # noqa: B007 - step names a failure
            join(target)
        if ns is not None:
            flags = 0
            if spec.get("new_mount_ns"):
                flags |= ns.CLONE_NEWNS
            if spec.get("new_uts_ns"):
                flags |= ns.CLONE_NEWUTS
            if spec.get("new_ipc_ns"):
                flags |= ns.CLONE_NEWIPC
            if flags:
                step = f"unshare {flags:#x}"
                ns.unshare(flags)
            if spec.get("new_mount_ns"):
                step = "make / rprivate"
                ns.mount(None, "/", None, ns.MS_REC | ns.MS_PRIVATE)
                if spec.get("new_pid_ns"):
                    step = "mount proc on /proc"
                    ns.mount("proc", "/proc", "proc", ns.MS_NOSUID | ns.MS_NODEV | ns.MS_NOEXEC)
            hostname = spec.get("hostname")
            if hostname:
                step = f"sethostname {hostname}"
                ns.sethostname(hostname)
        if out_w >= 0:
            step = "open /dev/null"
            null = os.open("/dev/null", os.O_RDWR)
            step = "redirect stdio"
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
        uid, gid = spec.get("uid"), spec.get("gid")
        if uid is not None or gid is not None:
            step = "setgroups"
            os.setgroups([])
        if gid is not None:
            step = f"setgid {gid}"
            os.setgid(gid)
        if uid is not None:
            step = f"setuid {uid}"
            os.setuid(uid)
        cwd = spec.get("cwd") or "/"
        step = f"chdir {cwd}"
        os.chdir(cwd)
        step = "reset signals"
        for sig in range(1, _signal.NSIG):
            if sig in (_signal.SIGKILL, _signal.SIGSTOP):
                continue
            try:
                _signal.signal(sig, _signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # 32/33: reserved by libc
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        step = "close fds"
        os.closerange(3, err_pipe)
        os.closerange(err_pipe + 1, max(os.sysconf("SC_OPEN_MAX"), err_pipe + 2))
        argv = [str(a) for a in spec["argv"]]
        env = _environment(spec)
        step = f"exec {argv[0]}"
        os.execvpe(argv[0], argv, env)  # resolves argv[0] with env's PATH (os.defpath without one)
    except BaseException as exc:
        try:
            os.write(err_pipe, f"{_errno_of(exc)} {step}: {_describe(exc)}".encode(errors="replace"))
        finally:
            os._exit(_START_FAILED_EXIT_CODE)
    os._exit(_START_FAILED_EXIT_CODE)  # pragma: no cover - execvpe does not return


def _be_init(err_pipe: int, status_w: int) -> None:
    """Stay PID 1 of the new pid namespace; return in a forked child, which execs argv as PID 2.

    The kernel gives a namespace's PID 1 only the signals it has handlers for: an executable
    there would never see Stop's SIGTERM and every Stop would wait out its grace period. This
    PID 1 handles every signal by passing it on to the executable's process group, reaps
    orphans, and when the executable ends writes its wait status to ``status_w`` (a PID 1
    cannot end by a signal of its own) and leaves, which ends the namespace. Signals are
    blocked across the fork, so none comes before a handler is in place.
    """
    catchable = _signal.valid_signals() - {_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD}
    _signal.pthread_sigmask(_signal.SIG_BLOCK, catchable)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its own group: what a relayed signal reaches
        if status_w >= 0:
            os.close(status_w)
        return  # signals are reset and unblocked before exec
    try:
        os.setpgid(pid, pid)  # also here, so no relayed signal can come before it
    except OSError:
        pass  # it did so itself, and may have exec'd already
    os.close(err_pipe)  # the child's copy reports its exec (or failure) alone
    _relay_and_reap(pid, status_w, catchable)


def _relay_and_reap(pid: int, status_w: int, catchable: set[_signal.Signals]) -> NoReturn:
    """PID 1's loop (see _be_init): never returns."""

    def relay(signum: int, frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except OSError:
            pass  # its group is gone: it is being reaped

    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # the monitor's: its monitor.log names the monitor alone (kill_unreported)
        os.dup2(null, fd)
    # Nor anything else the monitor had when it forked us (a fork keeps them all, CLOEXEC or
    # not), above all its sync pipe to auraed, which would never see that pipe's end.
    keep = max(status_w, 2)
    os.closerange(3, keep)
    os.closerange(keep + 1, max(os.sysconf("SC_OPEN_MAX"), keep + 2))
    _signal.set_wakeup_fd(-1)
    for sig in catchable:
        try:
            _signal.signal(sig, relay)
        except (OSError, ValueError):
            pass  # 32/33: reserved by libc
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    while True:
        try:
            ended, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(_START_FAILED_EXIT_CODE)
        if ended != pid:
            continue  # an orphan
        if status_w >= 0:
            try:
                _write_all(status_w, str(status).encode())
            except OSError:
                pass
        if os.WIFSIGNALED(status):
            os._exit(128 + os.WTERMSIG(status))
        os._exit(os.WEXITSTATUS(status))


def _environment(spec: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in spec.get("env") or ():
        key, sep, value = str(item).partition("=")
        if sep:
            env[key] = value
    return env


def _find_program(name: str, env: dict[str, str]) -> str:
    """argv[0] resolved as execvpe would, with env's PATH (os.defpath without one)."""
    if "/" in name:
        return name
    for directory in env.get("PATH", os.defpath).split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return name  # posix_spawn then fails with ENOENT, as exec would


def _spawn(spec: dict[str, Any], out_w: int, err_w: int, new_session: bool = False) -> int:
    """Start argv with posix_spawn, i.e. vfork: no copy of this process to make and tear down
    again, ~1.5 ms less on a host than fork + exec (more under TCG).

    A runtime command (pid_file mode) stays in our session and process group, so killing the
    group (auraed does when we never report) ends it with us; an executable gets its own session
    (``new_session``). Both start in our working directory (for a runtime, auraed's: the paths
    it gave may be relative to it). Signals are reset to their defaults and unblocked; our
    descriptors are all close-on-exec (Python's default) but the ones given as its stdio.
    """
    argv = [str(a) for a in spec["argv"]]
    env = _environment(spec)
    actions: list[tuple[Any, ...]] = []
    if out_w >= 0:
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        actions = [
            (os.POSIX_SPAWN_DUP2, null, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, err_w, 2),
        ]
    try:
        return os.posix_spawn(
            _find_program(argv[0], env),
            argv,
            env,
            file_actions=actions,
            setsid=new_session,
            setsigdef=_signal.valid_signals() - {_signal.SIGKILL, _signal.SIGSTOP},
            setsigmask=(),
        )
    finally:
        if out_w >= 0:
            os.close(null)


def _noop(signum: int, frame: object) -> None:
    """SIGUSR1/SIGCHLD handler: the work happens through the wakeup fd."""


def _proc_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _descends_from(pid: int, ancestor: int, depth: int = 8) -> bool:
    """Whether ``ancestor`` is among the first ``depth`` parents of ``pid`` (or ``pid`` itself)."""
    for _ in range(depth):
        if pid == ancestor:
            return True
        fields = _proc_stat_fields(pid)
        if fields is None or int(fields[1]) <= 1:
            return False
        pid = int(fields[1])
    return False


def _runs(pid: int, ticks: int | None) -> bool:
    """Whether pid is still the same, not yet dead, process."""
    fields = _proc_stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def _describe_status(name: str, status: int) -> str:
    if os.WIFEXITED(status):
        return f"{name} exited with status {os.WEXITSTATUS(status)}"
    if os.WIFSIGNALED(status):
        return f"{name} was killed by signal {os.WTERMSIG(status)}"
    return f"{name} ended with wait status {status}"


class _Monitor:
    def __init__(self, sync_fd: int) -> None:
        self.sync_fd = sync_fd
        self.synced = False
        self.step = "start"
        self.exit_path: str | None = None
        self.exit_written = False
        self.pid = 0
        self.ticks: int | None = None
        self.status: int | None = None
        self.reaped = False
        self.status_fd = -1  # the read end of an init's status pipe (see _be_init)
        self.subreaper = False
        self.foreign = False  # the supervised pid is not our child: no exit status, only its end
        self.runtime_running = False  # self.pid is a runtime command (pid_file mode) still running
        self.runtime_starts = False  # that command also starts the process (run --detach)
        self.early: dict[int, bytes] = {}  # with runtime_starts: stderr -> what it carried meanwhile
        self.live: dict[int, _Stream] = {}  # with runtime_starts: stdout, logged while the runtime runs
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.oom_file: str | None = None
        self.oom_before: int | None = None
        self.log: _CriLog | None = None
        self.pipes: list[int] = []
        self.console_path: str | None = None
        self.listener: Any = None

    # ---- reporting

    def sync(self, message: dict[str, object]) -> None:
        if self.synced:
            return
        self.synced = True
        if self.sync_fd < 0:
            return
        try:
            _write_all(self.sync_fd, (_dumps(message) + "\n").encode())
        except OSError as exc:  # auraed is gone: keep supervising, exit.json will tell
            log_error(f"write sync fd: {_describe(exc)}")
        try:
            os.close(self.sync_fd)
        except OSError:
            pass
        self.sync_fd = -1

    def write_exit(self, error: str | None = None) -> None:
        if self.exit_written or not self.exit_path:
            return
        self.exit_written = True
        exit_code: int | None = None
        signal: int | None = None
        status = self.status
        if error is not None:
            exit_code = _START_FAILED_EXIT_CODE
        elif status is not None:
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                signal = os.WTERMSIG(status)
        oom = False
        if signal == _signal.SIGKILL and self.oom_before is not None:
            after = _read_counter(self.oom_file)
            oom = after is not None and after > self.oom_before
        record: dict[str, object] = {
            "exit_code": exit_code,
            "signal": signal,
            "oom_killed": oom,
            "started_at": self.started_at,
            "finished_at": self.finished_at if self.finished_at is not None else time.time(),
        }
        if error is not None:
            record["error"] = error
        directory = os.path.dirname(self.exit_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        tmp = f"{self.exit_path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, (_dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.exit_path)

    # ---- child state

    def ended(self, status: int | None) -> None:
        self.reaped = True
        self.status = self.relayed_status(status)
        self.finished_at = time.time()

    def relayed_status(self, status: int | None) -> int | None:
        """The executable's own wait status when an init of ours ran it (see _be_init), else
        ``status``. An init killed (SIGKILL, after a grace period) wrote none: its status is the
        executable's, whose namespace ended with it."""
        if self.status_fd < 0:
            return status
        try:
            relayed = os.read(self.status_fd, 64)
        except OSError:
            relayed = b""
        os.close(self.status_fd)
        self.status_fd = -1
        return int(relayed) if relayed.strip().isdigit() else status

    def check_child(self, block: bool = False) -> None:
        if self.foreign:
            while not self.reaped and self.pid > 0:
                if not _runs(self.pid, self.ticks):
                    self.ended(None)  # its parent collects the status; we only see the end
                elif block:
                    time.sleep(0.1)
                    continue
                break
            if self.subreaper:
                self.reap_all(False)
            return
        if self.subreaper:
            self.reap_all(block)
            return
        if self.reaped or self.pid <= 0:
            return
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # someone else reaped it (cannot happen with SIGCHLD at SIG_DFL)
            self.ended(None)
            return
        if pid == self.pid:
            self.ended(status)

    def reap_all(self, block: bool) -> None:
        """As a subreaper: reap every child that ended (orphans too); with block, until ours did."""
        while True:
            ours_pending = not self.reaped and self.pid > 0 and not self.foreign
            try:
                pid, status = os.waitpid(-1, 0 if block and ours_pending else os.WNOHANG)
            except ChildProcessError:  # no children left at all
                if ours_pending:
                    self.ended(None)
                return
            if pid == 0:
                return
            if pid == self.pid and ours_pending:
                self.ended(status)

    # ---- main path

    def run(self, spec_path: str) -> None:  # noqa: PLR0915
        _ensure_std_fds()
        try:
            os.set_inheritable(self.sync_fd, False)
        except OSError:
            self.sync_fd = -1
        _own_session_and_signals()

        self.step = f"read spec {spec_path}"
        with open(spec_path, "rb") as f:
            spec: dict[str, Any] = _loads(f.read().decode())
        self.exit_path = str(spec["exit_path"])
        if not spec.get("argv"):
            raise ValueError("empty argv")
        pid_file = spec.get("pid_file")
        console = spec.get("console_socket")
        log_path = spec.get("log_path")
        self.subreaper = bool(spec.get("subreaper") or pid_file)
        self.runtime_starts = bool(pid_file and spec.get("runtime_starts"))
        need_ns = self.subreaper or any(
            spec.get(key)
            for key in ("new_pid_ns", "new_mount_ns", "new_uts_ns", "new_ipc_ns", "hostname", "netns_path")
        )
        ns = _namespaces() if need_ns else None
        if self.subreaper and ns is not None:
            self.step = "become a child subreaper"
            ns.set_child_subreaper()

        if log_path:
            self.step = f"open log {log_path}"
            self.log = _CriLog(str(log_path))
            self.log.open()
        self.oom_file = spec.get("oom_counter_file")
        self.oom_before = _read_counter(self.oom_file)

        self.step = "pipes"
        out_r = out_w = err_r = err_w = -1
        if log_path:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self.pipes = [out_r, err_r]
        if console:
            self.step = f"listen on console socket {console}"
            self.console_path = str(console)
            self.listener = _pty().listen_console_socket(self.console_path)
        if spec.get("new_pid_ns") and ns is not None:
            self.step = "unshare pid namespace"
            ns.unshare(ns.CLONE_NEWPID)  # only our children go there: the next fork is its PID 1

        self.started_at = time.time()
        try:
            if pid_file:
                failure = self.start_runtime(spec, out_w, err_w)
            elif _spawnable(spec):
                failure = self.spawn_child(spec, ns, out_w, err_w)
            else:
                failure = self.fork_child(spec, ns, out_w, err_w)
        finally:
            for fd in (out_w, err_w):
                if fd >= 0:
                    os.close(fd)
        if failure is not None:
            code, message = failure
            self.check_child(block=True)
            self.close_console()
            self.sync({"error": message, "errno": code})
            self.write_exit(error=message)
            return
        if not log_path:
            self.drop_stdio()

        streams = [_Stream(out_r, b"stdout"), _Stream(err_r, b"stderr")] if log_path else []
        if pid_file:
            name = os.path.basename(str(spec["argv"][0]))
            if self.runtime_starts and self.log is not None:
                self.live = {out_r: streams[0]}
            master = self.start_through_runtime(name, str(pid_file), out_r, err_r)
            if master < -1:
                return
            for stream in streams:  # the process's first output, read while the runtime ran
                data = self.early.pop(stream.fd, b"")
                if data and self.log is not None:
                    self.log.feed(stream, data)
            if master >= 0:
                streams.append(_Stream(master, b"stdout", crlf=True))
        else:
            self.ticks = _proc_start_ticks(self.pid)
        self.sync({"pid": self.pid, "start_ticks": self.ticks})
        self.supervise(*streams)
        self.write_exit()

    def start_runtime(self, spec: dict[str, Any], out_w: int, err_w: int) -> tuple[int, str] | None:
        """Spawn the runtime command; (errno, message) when it could not be started."""
        self.step = f"spawn {spec['argv'][0]}"
        try:
            self.pid = _spawn(spec, out_w, err_w)
        except OSError as exc:
            return _errno_of(exc), f"{self.step}: {_describe(exc)}"
        self.runtime_running = True
        return None

    def spawn_child(
        self, spec: dict[str, Any], ns: ModuleType | None, out_w: int, err_w: int
    ) -> tuple[int, str] | None:
        """posix_spawn the executable from a short-lived thread that joined the cell first (see
        _join_cell_steps): the child starts inside, this process stays out. No copy of the
        monitor and no Python in the child: ~3 ms less than fork_child on a host."""
        step = "spawn"

        def in_cell() -> int:
            nonlocal step
            for step, join, target in _join_cell_steps(spec, ns):  # noqa: B007 - step names a failure
                join(target)
            cwd = str(spec.get("cwd") or "/")
            step = f"chdir {cwd}"
            ours = os.open(".", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.chdir(cwd)  # the process's, for the child to inherit; ours again below
                step = f"exec {spec['argv'][0]}"
                return _spawn(spec, out_w, err_w, new_session=True)
            finally:
                os.fchdir(ours)
                os.close(ours)

        self.step = "spawn"
        try:
            self.pid = _threads().in_new_thread(in_cell)
        except Exception as exc:
            return _errno_of(exc), f"{step}: {_describe(exc)}"
        return None

    def fork_child(
        self, spec: dict[str, Any], ns: ModuleType | None, out_w: int, err_w: int
    ) -> tuple[int, str] | None:
        """Fork the child that sets itself up and execs argv; (errno, message) when it failed."""
        report_r, report_w = os.pipe()
        status_w = -1
        if spec.get("new_pid_ns"):  # the child stays as its namespace's init: see _be_init
            self.status_fd, status_w = os.pipe()
        self.step = "fork"
        try:
            self.pid = os.fork()
            if self.pid == 0:
                _child(spec, ns, out_w, err_w, report_w, status_w=status_w)
        finally:
            os.close(report_w)
            if status_w >= 0:
                os.close(status_w)
        self.step = "wait for exec"
        chunks = []
        with open(report_r, "rb", buffering=0) as report:
            while chunk := report.read(4096):  # EOF: exec happened (CLOEXEC closed the pipe)
                chunks.append(chunk)
        if not chunks:
            return None
        code_s, _, message = b"".join(chunks).decode(errors="replace").partition(" ")
        return int(code_s) if code_s.isdigit() else 0, message

    def drop_stdio(self) -> None:
        """Pass-through: the child has the caller's stdio; the monitor must not hold it open."""
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if null > 2:
            os.close(null)

    def start_through_runtime(self, name: str, pid_file: str, out_r: int, err_r: int) -> int:
        """pid_file mode: wait for the runtime command, then adopt the process it started.

        Returns the terminal master (console socket), -1 without one, or -2 after a failure that
        was reported (sync line and exit.json).
        """
        self.step = f"wait for {name}"
        status, output, master = self.await_runtime([fd for fd in (out_r, err_r) if fd >= 0])
        self.runtime_running = False
        if output:
            log_error(f"{name} said: {output.decode(errors='replace').strip()}")
        error: str | None = None
        pid = 0
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            error = _describe_status(name, status)
            tail = _tail_lines(output)
            if tail:
                error = f"{error}: {tail}"
        else:
            self.step = f"read pid file {pid_file}"
            try:
                with open(pid_file, "rb") as f:
                    pid = int(f.read().strip())
                if pid <= 0:
                    raise ValueError(f"bad pid {pid}")
            except (OSError, ValueError) as exc:
                error = f"{name} wrote no usable pid file {pid_file}: {_describe(exc)}"
            if error is None and self.console_path and master < 0:
                error = f"{name} sent no terminal on the console socket {self.console_path}"
        self.close_console()
        if error is not None:
            if master >= 0:
                os.close(master)
            self.sync({"error": error, "errno": 0})
            self.write_exit(error=error)
            return -2
        self.pid = pid
        self.status = None
        self.reaped = False
        self.finished_at = None
        fields = self.await_adoption(pid)
        self.ticks = int(fields[19]) if fields is not None and len(fields) > 19 else None
        # Adopted: its parent (the runtime) exited and we are the subreaper. Otherwise (another
        # runtime design) only its end can be observed, not its status.
        self.foreign = fields is None or int(fields[1]) != os.getpid()
        if self.oom_before is None:
            self.oom_before = _read_counter(self.oom_file)  # the runtime made the cgroup just now
        if master >= 0:
            self.pipes.append(master)
        return master

    @staticmethod
    def await_adoption(pid: int) -> list[bytes] | None:
        """The process's /proc stat fields, once we are its parent or ADOPTION_WAIT has passed.

        ``crun run --detach`` starts the process from an intermediate crun process that may still
        be exiting when the command we ran has ended; when it ends, the kernel gives the process
        to us, the subreaper. A parent that is not our descendant will not hand it over: no wait.
        Nothing is reaped here: the process may already have ended, and its status must be left
        for supervise().
        """
        me = os.getpid()
        deadline = time.monotonic() + ADOPTION_WAIT
        while True:
            fields = _proc_stat_fields(pid)
            if fields is None or int(fields[1]) == me or not _descends_from(int(fields[1]), me):
                return fields
            if time.monotonic() > deadline:
                return fields
            time.sleep(0.001)

    def await_runtime(self, fds: list[int]) -> tuple[int, bytes, int]:
        """Wait for the runtime command (self.pid), keeping its output and accepting the console.

        Returns (wait status, the runtime's last output, terminal master or -1).
        """
        poller = select.poll()
        for fd in fds:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        readable = set(fds)
        listen_fd = -1
        if self.listener is not None:
            self.listener.setblocking(False)
            listen_fd = self.listener.fileno()
            poller.register(listen_fd, select.POLLIN)
        pidfd = -1
        try:
            pidfd = os.pidfd_open(self.pid)
            poller.register(pidfd, select.POLLIN)
        except (AttributeError, OSError):
            pidfd = -1
        output = b""
        master = -1
        try:
            while True:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    break
                for fd, _event in poller.poll(None if pidfd >= 0 else 100):
                    if fd == pidfd:
                        poller.unregister(pidfd)
                        os.close(pidfd)
                        pidfd = -1
                    elif fd == listen_fd:
                        poller.unregister(listen_fd)
                        master = self.accept_console()
                    elif fd in readable:
                        output, more = self.take_runtime_output(fd, self.read_some(fd), output)
                        if not more:
                            poller.unregister(fd)  # EOF, or enough kept: the rest waits in the pipe
                            readable.discard(fd)
            self.ended(status)
            output = self.drain_runtime_output(readable, status, output)
            if self.listener is not None and master < 0:
                try:
                    master = self.accept_console()
                except BlockingIOError:
                    pass  # it never connected
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return status, output, master

    def drain_runtime_output(self, fds: set[int], status: int, output: bytes) -> bytes:
        """Add what the runtime wrote just before it exited; not when it started a process that
        may write on and on (runtime_starts and success): the pipes are the process's now."""
        if self.runtime_starts and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return output
        for fd in fds:
            while data := self.read_some(fd):
                output, _ = self.take_runtime_output(fd, data, output)
        return output

    def take_runtime_output(self, fd: int, data: bytes, output: bytes) -> tuple[bytes, bool]:
        """What a pipe carried while the runtime ran: stdout with runtime_starts is logged at
        once; the rest is the runtime's output so far (for its error message) and kept.
        Returns that output and whether to go on reading the pipe."""
        if not data:
            return output, False
        stream = self.live.get(fd)
        if stream is not None and self.log is not None:
            self.log.feed(stream, data)
            return output, True
        return (output + data)[-RUNTIME_OUTPUT_MAX:], self.keep_early(fd, data)

    def keep_early(self, fd: int, data: bytes) -> bool:
        """With runtime_starts, keep data read while the runtime runs; False once the pipe's
        share is full (then it is no longer read until the runtime has ended)."""
        if not self.runtime_starts:
            return True
        kept = self.early.get(fd, b"") + data
        self.early[fd] = kept
        return len(kept) < EARLY_OUTPUT_MAX

    @staticmethod
    def read_some(fd: int) -> bytes:
        try:
            return os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return b""

    def accept_console(self) -> int:
        self.step = f"receive the terminal on {self.console_path}"
        master: int = _pty().accept_pty_master(self.listener)
        self.close_console()
        return master

    def close_console(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            if self.console_path:
                try:
                    os.unlink(self.console_path)
                except OSError:
                    pass

    def supervise(self, *streams: _Stream) -> None:  # noqa: PLR0915
        log = self.log
        poller = select.poll()
        active: dict[int, _Stream] = {}
        for stream in streams:
            os.set_blocking(stream.fd, False)
            poller.register(stream.fd, select.POLLIN)
            active[stream.fd] = stream

        pidfd = -1
        try:
            pidfd = os.pidfd_open(self.pid)
            poller.register(pidfd, select.POLLIN)
        except (AttributeError, OSError):
            pidfd = -1  # old kernel: poll waitpid(WNOHANG) every 250 ms instead

        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        _signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        _signal.signal(_signal.SIGUSR1, _noop)
        if self.subreaper:
            _signal.signal(_signal.SIGCHLD, _noop)  # orphans that end wake us up to be reaped
        poller.register(wake_r, select.POLLIN)

        deadline: float | None = None
        self.check_child()
        while active or not self.reaped:
            timeout: float | None
            if self.reaped:
                if deadline is None:
                    deadline = time.monotonic() + EXIT_GRACE_SECONDS
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                timeout = remaining * 1000
            else:
                timeout = None if pidfd >= 0 else 250
            for fd, _event in poller.poll(timeout):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = -1
                elif fd == wake_r:
                    try:
                        signals = os.read(wake_r, 256)
                    except BlockingIOError:
                        signals = b""
                    if _signal.SIGUSR1 in signals and log is not None:
                        log.reopen()
                elif fd in active and not self.pump(active[fd]):
                    poller.unregister(fd)
                    self.close_stream(active.pop(fd))
            self.check_child()

        for stream in active.values():  # deadline passed: a descendant still holds the pipe
            self.pump(stream)
            self.close_stream(stream)
        if pidfd >= 0:
            os.close(pidfd)
        self.check_child(block=True)

    def pump(self, stream: _Stream) -> bool:
        """Read what is available; False at EOF."""
        assert self.log is not None
        try:
            data = os.read(stream.fd, _READ_SIZE)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno == _EIO:  # a terminal whose last slave closed: its EOF
                return False
            raise
        if not data:
            return False
        self.log.feed(stream, data)
        return True

    def close_stream(self, stream: _Stream) -> None:
        assert self.log is not None
        self.log.finish(stream)
        os.close(stream.fd)
        self.pipes.remove(stream.fd)

    def crashed(self, exc: BaseException) -> None:
        """Last resort after an unexpected exception: tell auraed, reap the child, write exit.json."""
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            log_error(f"crashed in {self.step}: {_describe(exc)}")
        message = f"{self.step}: {_describe(exc)}"
        try:
            self.sync({"error": message, "errno": _errno_of(exc)})
        except BaseException:
            pass
        for fd in self.pipes:  # nobody reads them any more: the executable gets EPIPE, not a hang
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipes = []
        try:
            self.close_console()
        except BaseException:
            pass
        if self.runtime_running:  # a runtime command we will not adopt anything from
            try:
                os.kill(self.pid, _signal.SIGKILL)
            except OSError:
                pass
        try:
            self.check_child(block=True)
        except BaseException as reap_exc:
            log_error(f"waitpid {self.pid}: {_describe(reap_exc)}")
        failed_to_start = self.pid <= 0 or self.runtime_running
        try:
            self.write_exit(error=message if failed_to_start else None)
        except BaseException as write_exc:
            log_error(f"write {self.exit_path}: {_describe(write_exc)}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        log_error("usage: monitor SPEC_JSON_PATH SYNC_FD")
        return 2
    monitor = _Monitor(int(args[1]))
    try:
        monitor.run(args[0])
    except BaseException as exc:
        monitor.crashed(exc)
    finally:
        if monitor.log is not None:
            monitor.log.close()
    return 0


# ------------------------------------------------------------------------------ auraed-side helpers

MONITOR_PATH = os.path.abspath(__file__)
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(MONITOR_PATH)))
# Imported as a module (cached bytecode), not run as a script (compiled on every start: ~8 ms);
# os._exit skips interpreter teardown once the exit record is written (~3 ms).
_BOOT = "import sys,os;sys.path.append({root!r});from {module} import main;os._exit(main(sys.argv[1:]))"


def module_command(module: str, args: list[str], python: str | None = None) -> list[str]:
    """Run ``module.main(args)`` the cheapest way: isolated (-I), without site (-S), from bytecode.

    Skips runpy (~7 ms), site/.pth processing (~3-15 ms) and compiling a script (~8 ms), and ends
    with os._exit. The module must import only what ``python -I -S`` finds plus auraed itself.
    """
    return [python or sys.executable, "-I", "-S", "-c", _BOOT.format(root=_SOURCE_ROOT, module=module), *args]


def monitor_command(spec_path: str, sync_fd: int, python: str | None = None) -> list[str]:
    """One monitor as its own interpreter; pass ``sync_fd`` in ``pass_fds``.

    auraed forks its monitors from the launcher (``auraed.system.monitor_launcher``) instead;
    this is for starting one by hand (tests, the benchmarks' references).
    """
    return module_command("auraed.system.monitor", [spec_path, str(sync_fd)], python)


def _own_session_and_signals() -> None:
    """A session of our own (out of auraed's reach of terminal signals), interactive signals
    ignored, SIGCHLD delivered."""
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()
        except OSError as exc:
            log_error(f"setsid: {_describe(exc)}")
    for sig in (_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE):
        _signal.signal(sig, _signal.SIG_IGN)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)  # SIG_IGN (inherited) would auto-reap


def prepare_ahead() -> None:
    """In a process forked to become a monitor later (the launcher's spare), before it knows
    what for: what does not depend on the request, and a first touch of the objects a monitor
    uses, so that their pages are copied from the parent now rather than on the request's path."""
    _own_session_and_signals()
    _ensure_std_fds()
    _loads('{"argv": ["x"], "n": 1, "t": true, "f": null}')
    _Monitor(-1)
    _CriLog(os.devnull).timestamp()
    os.makedirs(os.path.dirname(os.devnull), exist_ok=True)  # the path _CriLog.open takes
    _namespaces().is_child_subreaper()


def preload() -> None:
    """Import what a monitor would otherwise import on demand, for processes that fork monitors."""
    import _json  # noqa: F401 - the spec parser's scanner
    import warnings  # noqa: F401 - os.execvpe imports it in the child, just before exec

    _namespaces()
    _pty()


class MonitorSpec:
    """What the monitor should run; ``to_json()`` is the SPEC_JSON_PATH file's content.

    ``log_path`` "": pass-through, argv inherits the monitor's stdin/stdout/stderr. ``pid_file``:
    argv is an OCI runtime command (``create --pid-file``, ``exec --detach --pid-file``) and the
    process to supervise is the pid it writes there (implies ``subreaper``; ``cwd``, uid/gid,
    cgroups and namespaces do not apply). ``console_socket``:
    the path given to the runtime as ``--console-socket``; the terminal's output is logged as stdout.
    ``runtime_starts``: the pid_file command also starts the process (``run --detach``).
    """

    __slots__ = (
        "argv",
        "cgroup_join_files",
        "console_socket",
        "cwd",
        "env",
        "exit_path",
        "gid",
        "hostname",
        "log_path",
        "netns_path",
        "new_ipc_ns",
        "new_mount_ns",
        "new_pid_ns",
        "new_uts_ns",
        "oom_counter_file",
        "pid_file",
        "runtime_starts",
        "subreaper",
        "uid",
    )

    def __init__(
        self,
        *,
        argv: list[str],
        log_path: str,
        exit_path: str,
        env: list[str] | None = None,
        cwd: str = "/",
        uid: int | None = None,
        gid: int | None = None,
        cgroup_join_files: list[str] | None = None,
        oom_counter_file: str | None = None,
        new_pid_ns: bool = False,
        new_mount_ns: bool = False,
        new_uts_ns: bool = False,
        new_ipc_ns: bool = False,
        hostname: str | None = None,
        netns_path: str | None = None,
        subreaper: bool = False,
        pid_file: str | None = None,
        console_socket: str | None = None,
        runtime_starts: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.env = list(env) if env is not None else []
        self.cwd = cwd
        self.uid = uid
        self.gid = gid
        self.cgroup_join_files = list(cgroup_join_files) if cgroup_join_files else []
        self.oom_counter_file = oom_counter_file
        self.log_path = log_path
        self.exit_path = exit_path
        self.new_pid_ns = new_pid_ns
        self.new_mount_ns = new_mount_ns
        self.new_uts_ns = new_uts_ns
        self.new_ipc_ns = new_ipc_ns
        self.hostname = hostname
        self.netns_path = netns_path
        self.subreaper = subreaper
        self.pid_file = pid_file
        self.console_socket = console_socket
        self.runtime_starts = runtime_starts

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MonitorSpec:
        return cls(**{name: data[name] for name in cls.__slots__ if name in data})

    @classmethod
    def from_json(cls, text: str) -> MonitorSpec:
        return cls.from_dict(_loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MonitorSpec) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MonitorSpec({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


class ExitRecord:
    """exit.json: how the executable ended. ``exit_code`` is None when it died by ``signal``."""

    __slots__ = ("error", "exit_code", "finished_at", "oom_killed", "signal", "started_at")

    def __init__(
        self,
        *,
        exit_code: int | None,
        signal: int | None,
        oom_killed: bool,
        started_at: float,
        finished_at: float,
        error: str | None = None,
    ) -> None:
        self.exit_code = exit_code
        self.signal = signal
        self.oom_killed = oom_killed
        self.started_at = started_at
        self.finished_at = finished_at
        self.error = error

    @property
    def cri_exit_code(self) -> int:
        """The shell/CRI convention: the exit code, or 128 + signal number."""
        if self.exit_code is not None:
            return self.exit_code
        return 128 + self.signal if self.signal is not None else -1

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExitRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ExitRecord({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


def read_exit_record(path: str | os.PathLike[str]) -> ExitRecord | None:
    """The monitor's exit.json, or None while it does not exist (or is unreadable/garbage)."""
    try:
        with open(path, "rb") as f:
            data = _loads(f.read().decode())
        return ExitRecord(
            exit_code=data.get("exit_code"),
            signal=data.get("signal"),
            oom_killed=bool(data.get("oom_killed")),
            started_at=float(data["started_at"]),
            finished_at=float(data["finished_at"]),
            error=data.get("error"),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def format_cri_timestamp(ns: int) -> str:
    """RFC 3339 UTC with nanoseconds, fixed width: ``2026-11-30T01:02:03.123456789Z``."""
    second, nanos = divmod(ns, 1_000_000_000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(second))}.{nanos:09d}Z"


def _days_from_civil(year: int, month: int, day: int) -> int:
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def parse_rfc3339_ns(ts: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 timestamp (any fraction length, Z or +hh:mm)."""
    if len(ts) < 20 or ts[4] != "-" or ts[7] != "-" or ts[10] not in "Tt " or ts[13] != ":" or ts[16] != ":":
        raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
    year, month, day = int(ts[0:4]), int(ts[5:7]), int(ts[8:10])
    hour, minute, second = int(ts[11:13]), int(ts[14:16]), int(ts[17:19])
    pos = 19
    nanos = 0
    if ts[pos] == ".":
        end = pos + 1
        while end < len(ts) and ts[end].isdigit():
            end += 1
        digits = ts[pos + 1 : end]
        if not digits:
            raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
        nanos = int(digits[:9].ljust(9, "0"))
        pos = end
    zone = ts[pos:]
    if zone in ("Z", "z"):
        offset = 0
    elif len(zone) == 6 and zone[0] in "+-" and zone[3] == ":":
        offset = (int(zone[1:3]) * 60 + int(zone[4:6])) * 60 * (1 if zone[0] == "+" else -1)
    else:
        raise ValueError(f"not an RFC 3339 timestamp: {ts!r}")
    seconds = _days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second - offset
    return seconds * 1_000_000_000 + nanos


def parse_cri_log_line(line: str) -> tuple[float, str, bool, str]:
    """``<ts> <stream> <F|P> <content>`` -> (epoch seconds, stream, partial, content without newline)."""
    if line.endswith("\n"):
        line = line[:-1]
    parts = line.split(" ", 3)
    if len(parts) < 3 or parts[2] not in ("F", "P"):
        raise ValueError(f"not a CRI log line: {line[:80]!r}")
    content = parts[3] if len(parts) == 4 else ""
    return parse_rfc3339_ns(parts[0]) / 1e9, parts[1], parts[2] == "P", content


if __name__ == "__main__":
    sys.exit(main())
