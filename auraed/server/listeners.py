"""mTLS credentials and the listeners auraed serves on."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

import grpc

from auraed.config import DaemonConfig
from auraed.errors import ConfigError
from auraed.keepalive import keepalive_options, milliseconds

log = logging.getLogger(__name__)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from exc


def server_credentials(ca_crt: Path, server_crt: Path, server_key: Path) -> grpc.ServerCredentials:
    """mTLS: a client must present a certificate signed by ``ca_crt``; nothing else is accepted."""
    return grpc.ssl_server_credentials(
        [(_read(server_key, "server key"), _read(server_crt, "server certificate"))],
        root_certificates=_read(ca_crt, "CA certificate"),
        require_client_auth=True,
    )


def server_options(config: DaemonConfig) -> list[tuple[str, int]]:
    """grpc server arguments: one daemon per port, and keepalive both ways (see DaemonConfig)."""
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", milliseconds(config.keepalive_client_min_interval)),
    ]
    return options + keepalive_options(config.keepalive_time, config.keepalive_timeout)


def _serving_already(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def prepare_unix_socket(path: Path) -> None:
    """Make ``path`` free to bind: a stale socket is removed, a live one or any other file is refused."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    if _serving_already(path):
        raise ConfigError(f"another process is already serving on {path}")
    log.info("removing stale socket %s", path)
    path.unlink()


def add_unix_listener(server: grpc.aio.Server, path: Path, credentials: grpc.ServerCredentials) -> None:
    prepare_unix_socket(path)
    # The socket must never be reachable by others, not even between bind and chmod.
    previous = os.umask(0o177)
    try:
        server.add_secure_port(f"unix:{path}", credentials)
    finally:
        os.umask(previous)
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o600)


def add_tcp_listener(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials) -> int:
    try:
        port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {address}")
    return int(port)


def remove_unix_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock on the state directory for the life of the process."""
    fd = os.open(state_dir / "auraed.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"another auraed is already running with the state directory {state_dir}") from None
    return fd
