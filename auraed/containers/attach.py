"""A running container's own input, held for one attach: its stdin pipe or its terminal.

The container's monitor holds the input (see auraed.system.monitor); an attach borrows a copy
of that descriptor (pidfd_getfd) for its session. Its end is the client's end of input: with
``stdin_once`` (not on a terminal, as containerd) that closes the container's stdin, the monitor
letting go of the pipe; otherwise the client only detaches.
"""

from __future__ import annotations

import contextlib
import os

from auraed.containers.containers import Containers
from auraed.containers.exec import write_fd
from auraed.containers.model import ContainerRecord
from auraed.system.pty import set_window_size


class ContainerInput:
    """The input of one attach to a running container (from :func:`attach_input`)."""

    def __init__(self, containers: Containers, record: ContainerRecord, fd: int) -> None:
        self._containers = containers
        self._record = record
        self._fd = fd

    @property
    def closes_stdin(self) -> bool:
        """Whether the end of this attach's input closes the container's stdin (stdin_once)."""
        return self._record.stdin_once and not self._record.tty

    async def write(self, data: bytes) -> None:
        if self._fd >= 0:
            await write_fd(self._fd, data)

    def resize(self, rows: int, cols: int) -> None:
        """The terminal's size (its foreground process gets SIGWINCH); nothing without one."""
        if self._record.tty and self._fd >= 0 and rows > 0 and cols > 0:
            with contextlib.suppress(OSError):
                set_window_size(self._fd, rows, cols)

    async def end(self) -> None:
        """The client's input ended: with stdin_once the container's stdin is closed now (the
        process reads EOF); otherwise the container's input stays open for a later attach."""
        if self.closes_stdin:
            self.close()
            self._containers.release_stdin(self._record)

    def close(self) -> None:
        """Let go of the borrowed descriptor (the monitor keeps its own)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def attach_input(containers: Containers, record: ContainerRecord) -> ContainerInput | None:
    """The input of a running container for an attach; None when it has none open (created
    without stdin or a terminal, or its stdin closed by an earlier stdin_once attach): what the
    client sends is then dropped, as containerd does."""
    if record.input_fd < 0:
        return None
    return ContainerInput(containers, record, containers.borrow_input(record))
