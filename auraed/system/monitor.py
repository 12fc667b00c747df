"""Per-executable monitor: supervises one executable so that it survives the death of auraed.

Run as ``python -m auraed.system.monitor SPEC_JSON_PATH SYNC_FD``, cheaper (no runpy, no site) as
``monitor_command(...)`` builds it, or cheapest forked by ``auraed.system.monitor_launcher``, which
calls ``main`` in a child of a process that has imported this module already (what the
Supervisor does).

The monitor makes itself a session leader, starts the executable inside the cell's cgroups
(optionally in a new pid namespace, as PID 2 under a minimal init, inside a network namespace,
with new mount/uts/ipc namespaces; _Monitor.spawn_child and fork_child say which way when, and
auraed.system.monitor_child does it), reports the process on SYNC_FD, copies the child's
stdout/stderr into a Kubernetes CRI format log file (auraed.system.cri_log), and finally writes
``exit.json``. What it reads and writes for auraed (the spec, the report, exit.json, SIGUSR1 to
reopen the log file) is auraed.system.monitor_protocol.

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
- ``stdin``: the process's stdin is a pipe whose write end the monitor holds (and reports as
  ``input_fd``, with a console socket the terminal master instead), so that it reads no EOF
  while auraed is away; auraed takes a copy of that descriptor (pidfd_getfd) to attach to it.
  SIGUSR2 makes the monitor let go of the pipe: once auraed's copy is closed too, the process
  reads EOF (the CRI's stdin_once).
- ``runtime_starts``: argv also starts the process (``runc run --detach``), so what the shared
  pipes carry while argv runs may already be the process's output. runc and crun never write to
  stdout, so stdout is logged as it comes: a follower sees the first line without waiting for
  the runtime to exit. stderr also carries the runtime's errors: it is kept (up to
  EARLY_OUTPUT_MAX, then the pipe is left unread until argv ends), logged once argv succeeded and
  used as the error message when it failed.

With an empty ``log_path`` the monitor copies nothing: argv inherits the monitor's own stdin,
stdout and stderr, which the monitor then drops (pass-through, used for exec sessions).

The monitor path, this module and the four above, imports only builtins and tiny C modules (os,
sys, time, select, _signal, _json); the ``signal`` and ``json`` packages cost ~10 ms (enum, re,
collections) natively and ~10x that in emulated guests. ctypes comes in (through
auraed.system.namespaces) only when namespaces or a subreaper are asked for; auraed.system.pty
(``_socket``) only with a console socket.
"""
# contextlib.suppress would pull contextlib (+collections, functools) into the lean monitor path.
# ruff: noqa: SIM105

from __future__ import annotations

import os
import select
import sys
import time

from auraed.system.cri_log import CriLogWriter, LogStream
from auraed.system.monitor_child import join_cell_steps, set_up_and_exec, spawn, spawnable
from auraed.system.monitor_io import describe, errno_of, log_error, write_all
from auraed.system.monitor_protocol import (
    START_FAILED_EXIT_CODE,
    ExitRecord,
    encode_report,
    loads,
    write_exit_record,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from types import ModuleType
    from typing import Any
else:
    import _signal  # the C half of `signal`, without its enum wrappers

EXIT_GRACE_SECONDS = 2.0
"""How long output is still collected after the executable died while a descendant holds its pipes."""

RUNTIME_OUTPUT_MAX = 16 * 1024
"""How much of a runtime command's own output is kept for its error message."""

ADOPTION_WAIT = 2.0
"""Seconds a process a runtime started may take to be reparented to us (see await_adoption)."""

EARLY_OUTPUT_MAX = 1024 * 1024
"""With runtime_starts: how much of stderr is read while the runtime runs (the rest waits)."""

SHELL_KILLED_EXIT_CODE = 128 + 9
"""How a shell reports a command killed by SIGKILL: 128 + the signal's number."""

_READ_SIZE = 64 * 1024
_EIO = 5  # errno.EIO: a terminal master once the last slave descriptor is closed


# ------------------------------------------------------------------------------------------ helpers


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


def _system_module(name: str) -> ModuleType:
    """auraed.system.<name>, imported on first use (importlib would add its own import)."""
    full_name = f"auraed.system.{name}"
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


# ----------------------------------------------------------------------------------------- monitor


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
        self.status_fd = -1  # the read end of an init's status pipe (see monitor_child._be_init)
        self.subreaper = False
        self.foreign = False  # the supervised pid is not our child: no exit status, only its end
        self.runtime_running = False  # self.pid is a runtime command (pid_file mode) still running
        self.runtime_starts = False  # that command also starts the process (run --detach)
        self.early: dict[int, bytes] = {}  # with runtime_starts: stderr -> what it carried meanwhile
        self.live: dict[int, LogStream] = {}  # with runtime_starts: stdout, logged while the runtime runs
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.oom_file: str | None = None
        self.oom_before: int | None = None
        self.log: CriLogWriter | None = None
        self.pipes: list[int] = []
        self.console_path: str | None = None
        self.listener: Any = None
        self.stdin_w = -1  # with ``stdin``: the write end of the process's stdin pipe, held

    # ---- reporting

    def sync(self, message: dict[str, object]) -> None:
        if self.synced:
            return
        self.synced = True
        if self.sync_fd < 0:
            return
        try:
            write_all(self.sync_fd, encode_report(message))
        except OSError as exc:  # auraed is gone: keep supervising, exit.json will tell
            log_error(f"write sync fd: {describe(exc)}")
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
            exit_code = START_FAILED_EXIT_CODE
        elif status is not None:
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                signal = os.WTERMSIG(status)
        oom = False
        # Killed by SIGKILL, or a shell (a container's init, say) telling that its command was:
        # the OOM killer's doing if the cgroup's counter rose meanwhile.
        killed = signal == _signal.SIGKILL or exit_code == SHELL_KILLED_EXIT_CODE
        if killed and self.oom_before is not None:
            after = _read_counter(self.oom_file)
            oom = after is not None and after > self.oom_before
        record = ExitRecord(
            exit_code=exit_code,
            signal=signal,
            oom_killed=oom,
            started_at=self.started_at,
            finished_at=self.finished_at if self.finished_at is not None else time.time(),
            error=error,
        )
        write_exit_record(self.exit_path, record)

    # ---- child state

    def ended(self, status: int | None) -> None:
        self.reaped = True
        self.status = self.relayed_status(status)
        self.finished_at = time.time()

    def relayed_status(self, status: int | None) -> int | None:
        """The executable's own wait status when an init of ours ran it (see
        monitor_child._be_init), else ``status``. An init killed (SIGKILL, after a grace period)
        wrote none: its status is the executable's, whose namespace ended with it."""
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
            spec: dict[str, Any] = loads(f.read().decode())
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
            self.log = CriLogWriter(str(log_path))
            self.log.open()
        self.oom_file = spec.get("oom_counter_file")
        self.oom_before = _read_counter(self.oom_file)

        self.step = "pipes"
        out_r = out_w = err_r = err_w = -1
        in_r = -1
        if log_path:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self.pipes = [out_r, err_r]
            if spec.get("stdin") and pid_file and not console:
                in_r, self.stdin_w = os.pipe()
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
                failure = self.start_runtime(spec, out_w, err_w, in_r)
            elif spawnable(spec):
                failure = self.spawn_child(spec, ns, out_w, err_w)
            else:
                failure = self.fork_child(spec, ns, out_w, err_w)
        finally:
            for fd in (out_w, err_w, in_r):
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

        streams = [LogStream(out_r, b"stdout"), LogStream(err_r, b"stderr")] if log_path else []
        input_fd = self.stdin_w
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
                streams.append(LogStream(master, b"stdout", crlf=True))
                input_fd = master
        else:
            self.ticks = _proc_start_ticks(self.pid)
        report: dict[str, object] = {"pid": self.pid, "start_ticks": self.ticks}
        if input_fd >= 0:
            report["input_fd"] = input_fd
        self.sync(report)
        self.supervise(*streams)
        self.write_exit()

    def start_runtime(
        self, spec: dict[str, Any], out_w: int, err_w: int, in_r: int = -1
    ) -> tuple[int, str] | None:
        """Spawn the runtime command (its stdin ``in_r`` when given, else /dev/null); (errno,
        message) when it could not be started."""
        self.step = f"spawn {spec['argv'][0]}"
        try:
            self.pid = spawn(spec, out_w, err_w, stdin=in_r)
        except OSError as exc:
            return errno_of(exc), f"{self.step}: {describe(exc)}"
        self.runtime_running = True
        return None

    def spawn_child(
        self, spec: dict[str, Any], ns: ModuleType | None, out_w: int, err_w: int
    ) -> tuple[int, str] | None:
        """posix_spawn the executable from a short-lived thread that joined the cell first (see
        join_cell_steps): the child starts inside, this process stays out. No copy of the
        monitor and no Python in the child: ~3 ms less than fork_child on a host."""
        step = "spawn"

        def in_cell() -> int:
            nonlocal step
            for step, join, target in join_cell_steps(spec, ns):  # noqa: B007 - step names a failure
                join(target)
            cwd = str(spec.get("cwd") or "/")
            step = f"chdir {cwd}"
            ours = os.open(".", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.chdir(cwd)  # the process's, for the child to inherit; ours again below
                step = f"exec {spec['argv'][0]}"
                return spawn(spec, out_w, err_w, new_session=True)
            finally:
                os.fchdir(ours)
                os.close(ours)

        self.step = "spawn"
        try:
            self.pid = _threads().in_new_thread(in_cell)
        except Exception as exc:
            return errno_of(exc), f"{step}: {describe(exc)}"
        return None

    def fork_child(
        self, spec: dict[str, Any], ns: ModuleType | None, out_w: int, err_w: int
    ) -> tuple[int, str] | None:
        """Fork the child that sets itself up and execs argv; (errno, message) when it failed."""
        report_r, report_w = os.pipe()
        status_w = -1
        if spec.get("new_pid_ns"):  # the child stays as its namespace's init (monitor_child._be_init)
            self.status_fd, status_w = os.pipe()
        self.step = "fork"
        try:
            self.pid = os.fork()
            if self.pid == 0:
                set_up_and_exec(spec, ns, out_w, err_w, report_w, status_w=status_w)
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
                error = f"{name} wrote no usable pid file {pid_file}: {describe(exc)}"
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

    def supervise(self, *streams: LogStream) -> None:  # noqa: PLR0915
        log = self.log
        poller = select.poll()
        active: dict[int, LogStream] = {}
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
        _signal.signal(_signal.SIGUSR2, _noop)
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
                    if _signal.SIGUSR2 in signals:
                        self.release_stdin()
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

    def release_stdin(self) -> None:
        """Let go of the process's stdin pipe (SIGUSR2): it reads EOF once no copy is left."""
        if self.stdin_w >= 0:
            os.close(self.stdin_w)
            self.stdin_w = -1

    def pump(self, stream: LogStream) -> bool:
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

    def close_stream(self, stream: LogStream) -> None:
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
            log_error(f"crashed in {self.step}: {describe(exc)}")
        message = f"{self.step}: {describe(exc)}"
        try:
            self.sync({"error": message, "errno": errno_of(exc)})
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
            log_error(f"waitpid {self.pid}: {describe(reap_exc)}")
        failed_to_start = self.pid <= 0 or self.runtime_running
        try:
            self.write_exit(error=message if failed_to_start else None)
        except BaseException as write_exc:
            log_error(f"write {self.exit_path}: {describe(write_exc)}")


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
            log_error(f"setsid: {describe(exc)}")
    # SIGUSR1 (reopen the log) and SIGUSR2 (let go of stdin) too, until supervise() handles
    # them: one sent while the process starts would end the monitor otherwise. auraed sends
    # SIGUSR1 again until the log is reopened, SIGUSR2 only to a container reported running.
    for sig in (_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE, _signal.SIGUSR1, _signal.SIGUSR2):
        _signal.signal(sig, _signal.SIG_IGN)
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)  # SIG_IGN (inherited) would auto-reap


def prepare_ahead() -> None:
    """In a process forked to become a monitor later (the launcher's spare), before it knows
    what for: what does not depend on the request, and a first touch of the objects a monitor
    uses, so that their pages are copied from the parent now rather than on the request's path."""
    _own_session_and_signals()
    _ensure_std_fds()
    loads('{"argv": ["x"], "n": 1, "t": true, "f": null}')
    _Monitor(-1)
    CriLogWriter(os.devnull).timestamp()
    os.makedirs(os.path.dirname(os.devnull), exist_ok=True)  # the path CriLogWriter.open takes
    _namespaces().is_child_subreaper()


def preload() -> None:
    """Import what a monitor would otherwise import on demand, for processes that fork monitors."""
    import _json  # noqa: F401 - the spec parser's scanner
    import warnings  # noqa: F401 - os.execvpe imports it in the child, just before exec

    _namespaces()
    _pty()


if __name__ == "__main__":
    sys.exit(main())
