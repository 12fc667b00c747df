"""sd_notify(3)'s protocol: one datagram to the unix socket ``NOTIFY_SOCKET`` names.

auraed sends ``READY=1`` once it serves and ``STOPPING=1`` as it stops: systemd units can use
``Type=notify``, and PID 1 of the host image (auraed/init/host.py) learns when its daemon serves.
"""

from __future__ import annotations

import os
import socket

ENV = "NOTIFY_SOCKET"


def notify(message: str, path: str | None = None) -> bool:
    """Send ``message``; False when there is no socket to send to or it cannot be reached."""
    target = path if path is not None else os.environ.get(ENV, "")
    if not target:
        return False
    if target.startswith("@"):  # an abstract socket
        target = "\0" + target[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), target)
    except OSError:
        return False
    return True
