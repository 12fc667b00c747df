"""Terminals of OCI containers: the console socket protocol and window sizes.

An OCI runtime given ``--console-socket PATH`` connects to PATH once it has made the container's
pseudo-terminal and sends the master end as one SCM_RIGHTS file descriptor (runc and crun attach a
short message, e.g. the name ``/dev/ptmx``; it carries nothing we need).

Lean on purpose: the per-executable monitor imports this module, so only ``os`` at import time;
``_socket`` (the C half of ``socket``, without its enum wrappers), ``fcntl`` and ``struct`` are
imported inside the functions.
"""

# ruff: noqa: SIM105

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import _socket

CONSOLE_RECEIVE_TIMEOUT = 10.0
"""How long a connected runtime may take to send the terminal."""

_MAX_FDS = 4


def listen_console_socket(path: str | os.PathLike[str]) -> _socket.socket:
    """A listening unix stream socket at ``path`` (a stale file there is replaced), close-on-exec.

    unix socket paths are limited to 107 bytes: keep the directories short.
    """
    import _socket

    target = os.fsencode(path)
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.bind(target)
        os.chmod(target, 0o600)
        sock.listen(1)
    except BaseException:
        sock.close()
        raise
    return sock


def receive_pty_master(conn: _socket.socket) -> int:
    """The terminal master a runtime sends on a connected console socket (close-on-exec).

    Blocks until the message arrives (or the socket's timeout passes); every further descriptor in
    the message is closed. OSError when the peer hangs up without sending a descriptor.
    """
    import _socket

    fds: list[int] = []
    while True:
        data, ancdata, _flags, _addr = conn.recvmsg(
            4096, _socket.CMSG_SPACE(_MAX_FDS * 4), _socket.MSG_CMSG_CLOEXEC
        )
        for level, kind, payload in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(
                    int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True)
                    for i in range(0, usable, 4)
                )
        if fds:
            break
        if not data:
            raise OSError(0, "the runtime closed the console socket without sending a terminal")
    for extra in fds[1:]:
        try:
            os.close(extra)
        except OSError:
            pass
    return fds[0]


def accept_pty_master(listener: _socket.socket, timeout: float = CONSOLE_RECEIVE_TIMEOUT) -> int:
    """Accept one connection on a console socket listener and receive the terminal master from it."""
    import _socket

    fd, _addr = listener._accept()  # type: ignore[attr-defined]  # the C accept: no `socket` import
    conn = _socket.socket(fileno=fd)
    try:
        conn.settimeout(timeout)
        return receive_pty_master(conn)
    finally:
        conn.close()


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """TIOCSWINSZ on a terminal (the master end works): the foreground process group gets SIGWINCH."""
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def get_window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of a terminal."""
    import fcntl
    import struct
    import termios

    rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    return rows, cols
