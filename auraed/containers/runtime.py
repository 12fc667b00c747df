"""The OCI runtime as containers use it: the :class:`OciRuntime` interface and its errors.

Implementations (auraed.containers.oci_cli: runc, crun, and any runtime speaking their command
line) run the runtime's binary. Containers and exec sessions (auraed.containers.exec) depend on
this interface only; ``create`` and ``exec`` run under our monitor, which is why the interface
hands out their argv rather than running them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TIMEOUT = 10.0
"""Seconds for one runtime command (state, start, kill, ps)."""

DELETE_TIMEOUT = 30.0
"""``delete --force`` kills and waits for every process of the container."""

UNIX_PATH_MAX = 107
"""Longest unix socket path (sun_path is 108 bytes with its NUL)."""

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LOGRUS_MSG_RE = re.compile(r'msg="((?:[^"\\]|\\.)*)"')


class OciRuntimeError(Exception):
    """A runtime command failed. ``kind``: "not_found" (no such container), "invalid" (not in a state
    that allows it, or a bad argument) or "failed" (anything else); the message carries the
    runtime's own words."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class OciRuntime(Protocol):
    """An OCI runtime: what Containers and exec sessions ask of one."""

    @property
    def name(self) -> str:
        """The runtime's name in messages ("runc", "crun")."""
        ...

    @property
    def binary(self) -> str:
        """The program run (a path, or a bare name when it was not found at start)."""
        ...

    @property
    def env(self) -> tuple[str, ...]:
        """The environment its commands run with (KEY=VALUE), also those run by a monitor."""
        ...

    @property
    def scratch_dir(self) -> Path | None:
        """Where exec sessions keep their process file, pid file and console socket (the system
        temp dir when None); short, as socket paths are limited to 107 bytes."""
        ...

    @property
    def releases_by_fifo(self) -> bool:
        """Whether :meth:`start_created` starts a created container without a runtime process:
        then Containers creates ahead of Start."""
        ...

    def create_argv(
        self,
        container_id: str,
        bundle: Path,
        pid_file: Path,
        console_socket: Path | None,
        start: bool = False,
    ) -> list[str]:
        """``create`` (with ``start``, created and started by one command) for the monitor
        (MonitorSpec argv with pid_file, subreaper, console_socket)."""
        ...

    def exec_argv(
        self, container_id: str, process_file: Path, pid_file: Path, console_socket: Path | None
    ) -> list[str]:
        """A detached ``exec`` for the monitor; the process file's ``terminal`` must match."""
        ...

    async def start(self, container_id: str) -> None:
        """Start a created container (the runtime's ``start``)."""
        ...

    async def start_created(self, container_id: str, alive: Callable[[], bool]) -> None:
        """What ``start`` does for a container ``create`` made, without a runtime process where
        :attr:`releases_by_fifo`. ``alive``: whether the init still runs, asked while waiting."""
        ...

    def knows(self, container_id: str) -> bool:
        """Whether the runtime keeps state for the container (whatever its status)."""
        ...

    async def state(self, container_id: str) -> dict[str, Any] | None:
        """The runtime's state document (``status``: created/running/paused/stopped), or None when
        the runtime does not know the container."""
        ...

    async def kill(self, container_id: str, signal: int, all_processes: bool = False) -> None:
        """Send ``signal`` to the container's init, or with ``all_processes`` to every process of
        it. A container that is not running is "invalid"."""
        ...

    async def delete(self, container_id: str, force: bool = False) -> None:
        """Remove the runtime's state (and with ``force`` kill what still runs). Idempotent."""
        ...

    async def ps(self, container_id: str) -> list[int]:
        """Host pids of the container's processes."""
        ...

    async def update(self, container_id: str, resources_file: Path) -> None:
        """Apply the limits of ``resources_file`` (the spec's ``linux.resources`` as JSON) to a
        created or running container's cgroup."""
        ...

    async def mount_options(self) -> frozenset[str]:
        """The mount options the runtime says it knows (empty when it does not say)."""
        ...

    def error(
        self, what: str, container_id: str, stderr: bytes | str, code: int | None = None
    ) -> OciRuntimeError:
        """An OciRuntimeError for a failed ``what`` from the runtime's stderr (a monitor's report)."""
        ...


def runtime_message(stderr: bytes | str) -> str:
    """The error a runtime printed: runc's logrus ``msg="..."`` values, else its last lines."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    messages = [_unescape(m) for m in _LOGRUS_MSG_RE.findall(text)]
    if messages:
        return "; ".join(messages[-3:])
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines[-3:])[-2000:]


def _unescape(value: str) -> str:
    try:
        decoded: str = json.loads(f'"{value}"')
    except ValueError:
        return value
    return decoded


def check_container_id(container_id: str) -> str:
    """Container ids go on the runtime's command line: letters, digits, ``_.-``, no leading dash."""
    if not _ID_RE.match(container_id):
        raise OciRuntimeError("invalid", f"bad container id {container_id!r}")
    return container_id


def check_socket_path(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    if len(os.fsencode(text)) > UNIX_PATH_MAX:
        raise OciRuntimeError(
            "invalid", f"console socket path is longer than {UNIX_PATH_MAX} bytes (unix socket limit): {text}"
        )
    return text
