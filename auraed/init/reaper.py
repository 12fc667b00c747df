"""Reaping orphans as PID 1 without stealing the exit status of auraed's own children.

PID 1 inherits every orphan of the machine: when they end, someone must wait() for them or
they stay zombies forever. The classic init answer, ``waitpid(-1)`` in a loop, is wrong inside
auraed: auraed also waits for its OWN children, each through its owner -- subprocess.Popen.wait
/poll (the Supervisor's monitors, capability probes), asyncio's child watcher (3.11's default
ThreadedChildWatcher blocks in ``waitpid(pid)`` in a thread per child: runc/crun commands, exec
monitors), and ``os.waitpid(pid)`` in auraed.system.processes.reap. A blind ``waitpid(-1)`` would
collect some of their statuses first: Popen then reports 0 (it treats ECHILD as success) and
asyncio 255, so a failing ``runc create`` would look like a success.

The design here:

* Ownership is registered where children are made. :func:`install_popen_hook` wraps
  ``subprocess.Popen._execute_child`` -- the single place where Popen, subprocess.run and asyncio's
  subprocess transports fork -- so every child started that way is recorded in a
  :class:`ChildRegistry` (by pid, holding a weak reference to its Popen) without any change to the
  code that spawns. A child forked by other means (os.fork, os.posix_spawn) must be registered by
  hand with :meth:`ChildRegistry.own` / :meth:`ChildRegistry.disown`; auraed has none today.
* A child stays owned while its Popen object is alive and has no returncode: that is exactly the
  window in which its owner may still wait for it. Once the owner has collected the status (or
  dropped the Popen without ever waiting, so nobody can ask), it is no longer owned.
* On SIGCHLD (coalesced, plus a slow periodic sweep for anything missed), :class:`Reaper` scans
  /proc for zombies whose parent is this process, opens a pidfd on each, and only then asks the
  registry which of them are unowned; it reaps exactly those, through ``waitid(P_PIDFD)``. The
  pidfd pins the process identity: if an owner reaps its zombie and the pid is reused between
  the scan and our wait, we wait on the process the pidfd names, never on the newcomer.
* A fork in flight is the one window in which a brand-new child exists but is not yet
  registered. Spawns count themselves in and out under the registry lock; a scan that finds one
  in flight reaps nothing and runs again as soon as the last spawn has registered its child.
* Owners are never disturbed: their waitpid(pid)/Popen.wait still finds their zombie, because
  we never touch an owned pid, and waiting by pid (not -1) in the owners is what auraed does.

Scanning /proc costs one small read per process; a guest runs few processes, and SIGCHLDs that
arrive while a scan is pending coalesce into that scan.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

SWEEP_INTERVAL = 30.0  # seconds between safety sweeps, whatever SIGCHLD said


class ChildRegistry:
    """The children auraed itself started and whose status their owner may still collect."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spawning = 0
        self._deferred = False
        self._popens: dict[int, weakref.ref[Any]] = {}
        self._pids: set[int] = set()
        # Called (from the spawning thread) when a scan was deferred by a spawn that just ended.
        self.on_spawned: Callable[[], None] | None = None

    def spawn_started(self) -> None:
        with self._lock:
            self._spawning += 1

    def spawn_finished(self, popen: Any) -> None:
        pid = getattr(popen, "pid", None)
        with self._lock:
            self._spawning -= 1
            if isinstance(pid, int) and pid > 0:
                self._popens[pid] = weakref.ref(popen)
            rescan = self._deferred and self._spawning == 0
            if rescan:
                self._deferred = False
        callback = self.on_spawned
        if rescan and callback is not None:
            callback()

    def own(self, pid: int) -> None:
        """Register a child started without subprocess (os.fork, posix_spawn): never reaped here."""
        with self._lock:
            self._pids.add(pid)

    def disown(self, pid: int) -> None:
        """The owner has waited for ``pid`` (or will not): forget it."""
        with self._lock:
            self._pids.discard(pid)

    def owned(self, pid: int) -> bool:
        with self._lock:
            return pid in self._pids or self._popen_owns(pid)

    def unowned(self, pids: Iterable[int]) -> list[int] | None:
        """The subset of ``pids`` nobody in auraed will wait for; None while a spawn is in flight
        (a scan then runs again once it has registered its child)."""
        with self._lock:
            if self._spawning:
                self._deferred = True
                return None
            for pid in [p for p in self._popens if not self._popen_owns(p)]:
                del self._popens[pid]
            return [pid for pid in pids if pid not in self._pids and pid not in self._popens]

    def _popen_owns(self, pid: int) -> bool:
        ref = self._popens.get(pid)
        popen = ref() if ref is not None else None
        return popen is not None and getattr(popen, "returncode", None) is None


_hook_target: list[ChildRegistry] = []  # the registry the Popen hook feeds (once installed)


def install_popen_hook(registry: ChildRegistry) -> None:
    """Record every child subprocess.Popen (hence subprocess.run and asyncio subprocesses) starts.

    Idempotent per process: a second call with another registry replaces the target registry.
    """
    import subprocess

    installed = bool(_hook_target)
    _hook_target[:] = [registry]
    if installed:
        return
    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def _execute_child(self: Any, *args: Any, **kwargs: Any) -> None:
        target = _hook_target[0]
        target.spawn_started()
        try:
            original(self, *args, **kwargs)
        finally:
            target.spawn_finished(self)

    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]


def zombie_children(parent: int, proc: str = "/proc") -> list[int]:
    """Pids of the zombies whose parent is ``parent``, from /proc/<pid>/stat."""
    zombies = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as stat:
                data = stat.read()
        except OSError:
            continue
        # comm (field 2) may hold spaces and parentheses: the fields start after the last ")".
        fields = data[data.rfind(b")") + 2 :].split(maxsplit=2)
        if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == parent:
            zombies.append(int(name))
    return zombies


def _wait_pidfd(fd: int) -> bool:
    """Reap the process behind ``fd`` if it has exited and is our child."""
    try:
        return os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return False


class Reaper:
    """Reaps unowned zombie children of this process, on SIGCHLD, in the event loop."""

    def __init__(self, registry: ChildRegistry, proc: str = "/proc") -> None:
        self.registry = registry
        self.proc = proc
        self.reaped = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._sweep: asyncio.TimerHandle | None = None

    def reap_orphans(self) -> int:
        """One scan: reap every zombie child nobody in auraed owns; how many were reaped."""
        pidfds: dict[int, int] = {}
        try:
            for pid in zombie_children(os.getpid(), self.proc):
                try:
                    pidfds[pid] = os.pidfd_open(pid)
                except OSError:  # gone meanwhile (its owner reaped it)
                    continue
            # Ownership is decided AFTER the pidfds pin the processes: see the module docstring.
            unowned = self.registry.unowned(pidfds)
            count = sum(1 for pid in unowned or () if _wait_pidfd(pidfds[pid]))
        finally:
            for fd in pidfds.values():
                os.close(fd)
        self.reaped += count
        return count

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reap on every SIGCHLD (main thread, running loop), once now, and every SWEEP_INTERVAL."""
        self._loop = loop
        self.registry.on_spawned = self._schedule_threadsafe
        loop.add_signal_handler(signal.SIGCHLD, self._schedule)
        self._schedule()
        self._sweep = loop.call_later(SWEEP_INTERVAL, self._periodic)

    def stop(self) -> None:
        self.registry.on_spawned = None
        if self._sweep is not None:
            self._sweep.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGCHLD)
        self._loop = None

    def _schedule_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _periodic(self) -> None:
        self._schedule()
        if self._loop is not None:
            self._sweep = self._loop.call_later(SWEEP_INTERVAL, self._periodic)

    def _run(self) -> None:
        import logging

        self._scheduled = False
        try:
            count = self.reap_orphans()
        except Exception:  # PID 1 keeps serving whatever a scan hits
            logging.getLogger("auraed.pid1").exception("reaping orphans failed")
            return
        if count:
            logging.getLogger("auraed.pid1").debug("reaped %d orphan(s)", count)
