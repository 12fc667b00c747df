"""OCI runtimes by their command line (runc, crun), asynchronously and with bounded waits.

Only the subcommands and flags both runc (1.1) and crun (1.x) accept are used, always with
``--root`` before the subcommand: ``create --bundle B --pid-file P [--console-socket S] ID``,
``start ID``, ``state ID``, ``kill [--all] ID SIGNUM``, ``delete [--force] ID``,
``ps --format json ID``, ``update --resources F ID`` and
``exec --detach --pid-file P --process F [--tty --console-socket S] ID``.
Both keep a container's state in ``<root>/<id>/``, which is how an unknown id is recognised
whatever the runtime's wording. :class:`OciCli` is that shared command line, and serves any
runtime that speaks it; :class:`Runc` and :class:`Crun` add how each one's created init waits at
``<root>/<id>/exec.fifo`` until ``start``, which is how they start it without a ``start`` process.

``create`` and ``exec`` are not run here: they run under our monitor (auraed.system.monitor), a
child subreaper that adopts the process the runtime forks and abandons. runc 1.1 refuses
``--console-socket`` unless it detaches, so every exec is detached (as containerd's shim does)
and supervised the same way (auraed.containers.exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal as signals
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auraed.containers.runtime import (
    DEFAULT_TIMEOUT,
    DELETE_TIMEOUT,
    OciRuntimeError,
    check_container_id,
    check_socket_path,
    runtime_message,
)
from auraed.system import processes

# runc 1.1's words for a container it keeps no state for (libcontainer.ErrNotExist), alone or
# after what failed ("exec failed: container does not exist"). Only these exact words: a process
# that is missing ("executable file not found in $PATH") is not a missing container. Runtimes
# that copy runc's command line copy its words too; crun's are told by its state (_gone).
_MISSING_CONTAINER_RE = re.compile(r"(?:^|: )container does not exist$")
_INVALID_WORDS = (
    "not running",
    "stopped",
    "already running",
    "not in created state",
    "is running",
    "not created",
    "paused",
    "cannot start",
    "cannot exec",
    "cannot delete",
    "cannot kill",
)

_FIFO_CHECK_INTERVAL = 0.1
"""Seconds between checks that an init not yet at its fifo still lives (runc checks as often)."""


@dataclass(frozen=True)
class OciCli:
    """One OCI runtime binary speaking runc's command line, and its state directory.

    ``scratch_dir``: where exec sessions keep their process file, pid file and console socket
    (the system temp dir when None); keep it short, socket paths are limited to 107 bytes.
    """

    binary: str
    root: Path
    timeout: float = DEFAULT_TIMEOUT
    scratch_dir: Path | None = None
    env: tuple[str, ...] = field(default_factory=lambda: (f"PATH={os.environ.get('PATH', os.defpath)}",))

    @property
    def name(self) -> str:
        return os.path.basename(self.binary)

    def base_argv(self) -> list[str]:
        return [self.binary, "--root", str(self.root)]

    # -- commands run by the monitor ---------------------------------------------------------

    def create_argv(
        self,
        container_id: str,
        bundle: Path,
        pid_file: Path,
        console_socket: Path | None,
        start: bool = False,
    ) -> list[str]:
        """``create`` (or with ``start``, ``run --detach``: created and started by one command) for
        the monitor (MonitorSpec argv with pid_file, subreaper, console_socket)."""
        command = ["run", "--detach"] if start else ["create"]
        argv = [*self.base_argv(), *command, "--bundle", str(bundle), "--pid-file", str(pid_file)]
        if console_socket is not None:
            argv += ["--console-socket", check_socket_path(console_socket)]
        argv.append(check_container_id(container_id))
        return argv

    def exec_argv(
        self, container_id: str, process_file: Path, pid_file: Path, console_socket: Path | None
    ) -> list[str]:
        """``exec --detach`` for the monitor; the process file's ``terminal`` must match."""
        argv = [*self.base_argv(), "exec", "--detach", "--pid-file", str(pid_file)]
        argv += ["--process", str(process_file)]
        if console_socket is not None:
            argv += ["--tty", "--console-socket", check_socket_path(console_socket)]
        argv.append(check_container_id(container_id))
        return argv

    # -- commands run here -------------------------------------------------------------------

    async def start(self, container_id: str) -> None:
        await self._check("start", container_id)

    def knows(self, container_id: str) -> bool:
        """Whether the runtime keeps state for the container (whatever its status)."""
        return (self.root / container_id).exists()

    @property
    def releases_by_fifo(self) -> bool:
        """A runtime not known to us is started by its own ``start``."""
        return False

    async def start_created(self, container_id: str, alive: Callable[[], bool]) -> None:
        """The runtime's own ``start``: how its init waits for it is not known here."""
        await self.start(container_id)

    async def state(self, container_id: str) -> dict[str, Any] | None:
        """The runtime's state document (``status``: created/running/paused/stopped), or None when
        the runtime does not know the container."""
        try:
            out = await self._check("state", container_id)
        except OciRuntimeError as exc:
            if exc.kind == "not_found":
                return None
            raise
        try:
            state = json.loads(out)
        except ValueError:
            raise OciRuntimeError(
                "failed", f"{self.name} state {container_id}: not JSON: {out[:200]!r}"
            ) from None
        if not isinstance(state, dict):
            raise OciRuntimeError("failed", f"{self.name} state {container_id}: not an object")
        return state

    async def kill(self, container_id: str, signal: int, all_processes: bool = False) -> None:
        """Send ``signal`` (a number) to the container's init, or with ``all_processes`` to every
        process of it. A container that is not running is "invalid" (runc: "container not
        running")."""
        if not 0 < int(signal) < signals.NSIG:
            raise OciRuntimeError("invalid", f"bad signal number {signal}")
        await self._check(
            "kill", container_id, options=["--all"] if all_processes else [], extra=[str(int(signal))]
        )

    async def delete(self, container_id: str, force: bool = False) -> None:
        """Remove the runtime's state (and with ``force`` kill what still runs); its cgroup goes too.
        Idempotent: an unknown id is fine."""
        try:
            await self._check(
                "delete",
                container_id,
                options=["--force"] if force else [],
                timeout=max(self.timeout, DELETE_TIMEOUT),
            )
        except OciRuntimeError as exc:
            if exc.kind != "not_found":
                raise

    async def ps(self, container_id: str) -> list[int]:
        """Host pids of the container's processes."""
        out = await self._check("ps", container_id, options=["--format", "json"])
        try:
            pids = json.loads(out or b"[]")
        except ValueError:
            raise OciRuntimeError(
                "failed", f"{self.name} ps {container_id}: not JSON: {out[:200]!r}"
            ) from None
        return [int(pid) for pid in pids or []]

    async def update(self, container_id: str, resources_file: Path) -> None:
        """``update --resources FILE``: the limits of a created or running container."""
        await self._check("update", container_id, options=["--resources", str(resources_file)])

    async def mount_options(self) -> frozenset[str]:
        """The mount options ``features`` lists (runc 1.1: ``rro`` among them); empty when the
        runtime has no ``features`` (crun before 1.9) or it fails: then none is claimed."""
        try:
            code, out, _ = await self.run([self.binary, "features"], self.timeout)
            features = json.loads(out) if code == 0 else {}
        except (OciRuntimeError, ValueError):
            return frozenset()
        options = features.get("mountOptions") if isinstance(features, dict) else None
        if not isinstance(options, list):
            return frozenset()
        return frozenset(option for option in options if isinstance(option, str))

    # -- plumbing ----------------------------------------------------------------------------

    def _exec_fifo(self, container_id: str) -> Path:
        """Where a created container's init waits for ``start`` (runc and crun alike)."""
        return self.root / check_container_id(container_id) / "exec.fifo"

    async def _check(
        self,
        command: str,
        container_id: str,
        *,
        options: list[str] | None = None,
        extra: list[str] | None = None,
        timeout: float | None = None,
    ) -> bytes:
        argv = [
            *self.base_argv(),
            command,
            *(options or []),
            check_container_id(container_id),
            *(extra or []),
        ]
        code, out, err = await self.run(argv, timeout or self.timeout)
        if code != 0:
            raise self.error(f"{command} {container_id}", container_id, err, code)
        return out

    def error(
        self, what: str, container_id: str, stderr: bytes | str, code: int | None = None
    ) -> OciRuntimeError:
        """An OciRuntimeError for a failed ``what`` from the runtime's stderr."""
        message = runtime_message(stderr) or (f"exit status {code}" if code is not None else "failed")
        lowered = message.lower()
        if self._gone(container_id, message):
            kind = "not_found"
        elif any(word in lowered for word in _INVALID_WORDS):
            kind = "invalid"
        else:
            kind = "failed"
        return OciRuntimeError(kind, f"{self.name} {what}: {message}")

    def _gone(self, container_id: str, message: str) -> bool:
        """Whether a command failed because the runtime does not know the container: decided by
        its own state (both keep ``<root>/<id>/``; crun 1.8 words it as a missing status file),
        or by runc's exact words for it, never by "not found" anywhere in the message."""
        if not self.knows(container_id):
            return True
        return any(_MISSING_CONTAINER_RE.search(part) for part in message.split("; "))

    async def run(self, argv: list[str], timeout: float) -> tuple[int, bytes, bytes]:
        """Run a runtime command in its own process group; on timeout or cancellation the whole group
        is killed and reaped before returning/raising."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=dict(item.split("=", 1) for item in self.env if "=" in item),
            )
        except OSError as exc:
            raise OciRuntimeError("failed", f"cannot run {argv[0]}: {exc}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            await _kill_group(proc)
            raise OciRuntimeError(
                "failed", f"{' '.join(argv[3:5])}: {self.name} did not answer in {timeout:g}s"
            ) from None
        except BaseException:
            await _kill_group(proc)
            raise
        assert proc.returncode is not None
        return proc.returncode, out, err


class Runc(OciCli):
    """runc (1.1): its created init writes one byte into exec.fifo and execs once it is read
    (libcontainer). Reading it here is what ``runc start`` does, without its process: ~8 ms on
    a host (docs/benchmarks.md)."""

    @property
    def releases_by_fifo(self) -> bool:
        return True

    async def start_created(self, container_id: str, alive: Callable[[], bool]) -> None:
        """Read the init's byte, then the end of the fifo, which its exec closes. Poststart hooks
        are not run: containers with some are not created ahead (Containers.create)."""
        fifo = self._exec_fifo(container_id)
        try:
            await _read_exec_fifo(fifo, alive, self.timeout)
        except OSError as exc:
            raise OciRuntimeError("failed", f"cannot start {container_id} at {fifo}: {exc}") from None


class Crun(OciCli):
    """crun (1.x): its created init reads one byte from exec.fifo and execs (status.c). Writing
    it here is what ``crun start`` does, without its process: 150-320 ms in a TCG guest."""

    @property
    def releases_by_fifo(self) -> bool:
        return True

    async def start_created(self, container_id: str, alive: Callable[[], bool]) -> None:
        """One byte for the init; no reader means the init is gone. Poststart hooks are not run:
        containers with some are not created ahead (Containers.create)."""
        fifo = self._exec_fifo(container_id)
        try:
            _write_exec_fifo(fifo)
        except OSError as exc:
            raise OciRuntimeError("failed", f"cannot start {container_id} at {fifo}: {exc}") from None


def runtime_for(binary: str, root: Path, *, scratch_dir: Path | None = None) -> OciCli:
    """The implementation for ``binary`` by its name: runc, crun, else the shared command line."""
    kinds: dict[str, type[OciCli]] = {"runc": Runc, "crun": Crun}
    return kinds.get(os.path.basename(binary), OciCli)(binary=binary, root=root, scratch_dir=scratch_dir)


def _write_exec_fifo(fifo: Path) -> None:
    """crun: one byte for the init, which reads it and execs. No reader: the init is gone."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # ENXIO without a reader
    try:
        os.unlink(fifo)
        os.write(fd, b"\0")
    finally:
        os.close(fd)


async def _read_exec_fifo(fifo: Path, alive: Callable[[], bool], timeout: float) -> None:
    """runc: read the init's byte, then the end of the fifo, which its exec closes.

    Opened without blocking: a blocking open would wait forever for an init that died before
    it opened its end. Until it has, reads return nothing and the init is checked now and then.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        received = b""
        while True:
            try:
                data: bytes | None = os.read(fd, 16)
            except BlockingIOError:
                data = None  # the init has it open and has not written yet
            if data:
                received += data
                continue
            if data == b"" and received:
                break  # its exec closed the fifo: the process runs
            if data == b"" and not alive():
                raise OciRuntimeError("failed", "the container's process ended before it was started")
            if loop.time() > deadline:
                raise OciRuntimeError("failed", f"its process did not reach {fifo} in {timeout:g}s")
            await processes.until_readable(fd, timeout=_FIFO_CHECK_INTERVAL)
    finally:
        os.close(fd)
    os.unlink(fifo)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the command and what it forked into its group (only while its pid, hence the
    group id, cannot have been reused), then reap it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signals.SIGKILL)
    await asyncio.shield(proc.wait())
