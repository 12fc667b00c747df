"""How a monitor (auraed.system.monitor) starts the executable it supervises: forked
(set_up_and_exec: it sets itself up, then execs; in a new pid namespace under a minimal init of
its own, _be_init), or spawned with posix_spawn (spawn) from a thread that joined the cell first
(join_cell_steps), where nothing is left to set up in the child (spawnable).
"""

# contextlib.suppress would pull contextlib (+collections, functools) into the lean monitor path.
# ruff: noqa: SIM105

from __future__ import annotations

import os

from auraed.system.monitor_io import describe, errno_of, write_all
from auraed.system.monitor_protocol import START_FAILED_EXIT_CODE

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any, NoReturn
else:
    import _signal  # the C half of `signal`, without its enum wrappers


def join_cell_steps(
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


def spawnable(spec: dict[str, Any]) -> bool:
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


def set_up_and_exec(  # noqa: PLR0915 - one straight line of setup steps
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
        for step, join, target in join_cell_steps(spec, ns):  # noqa: B007 - step names a failure
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
            os.write(err_pipe, f"{errno_of(exc)} {step}: {describe(exc)}".encode(errors="replace"))
        finally:
            os._exit(START_FAILED_EXIT_CODE)
    os._exit(START_FAILED_EXIT_CODE)  # pragma: no cover - execvpe does not return


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
            os._exit(START_FAILED_EXIT_CODE)
        if ended != pid:
            continue  # an orphan
        if status_w >= 0:
            try:
                write_all(status_w, str(status).encode())
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


def spawn(spec: dict[str, Any], out_w: int, err_w: int, new_session: bool = False, stdin: int = -1) -> int:
    """Start argv with posix_spawn, i.e. vfork: no copy of this process to make and tear down
    again, ~1.5 ms less on a host than fork + exec (more under TCG).

    A runtime command (pid_file mode) stays in our session and process group, so killing the
    group (auraed does when we never report) ends it with us; an executable gets its own session
    (``new_session``). Both start in our working directory (for a runtime, auraed's: the paths
    it gave may be relative to it). Signals are reset to their defaults and unblocked; our
    descriptors are all close-on-exec (Python's default) but the ones given as its stdio;
    its stdin is ``stdin`` when given, else /dev/null.
    """
    argv = [str(a) for a in spec["argv"]]
    env = _environment(spec)
    actions: list[tuple[Any, ...]] = []
    if out_w >= 0:
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        actions = [
            (os.POSIX_SPAWN_DUP2, stdin if stdin >= 0 else null, 0),
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
