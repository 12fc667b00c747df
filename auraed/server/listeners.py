"""mTLS credentials and the listeners auraed serves on."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import ssl
import stat
from pathlib import Path

import grpc

from auraed.config import DaemonConfig
from auraed.errors import ConfigError
from auraed.wire import tls
from auraed.wire.channel import keepalive_options, milliseconds

log = logging.getLogger(__name__)

_X509_V_ERR_CERT_NOT_YET_VALID = 9  # OpenSSL's verify code for a notBefore in the future
# Round trips a TLS 1.3 handshake takes in memory are two; more means it is stuck.
_HANDSHAKE_MAX_ROUNDS = 10


def _trusting(ca_crt: Path) -> ssl.SSLContext:
    """A client's TLS context trusting only ``ca_crt``, as auraed's clients do: an intermediate CA
    there is a trust anchor of its own, as it is to grpc."""
    context = tls.context_as_grpc(server_side=False)
    context.check_hostname = False  # names are the clients' business (server_name), not ours
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    try:
        context.load_verify_locations(cafile=str(ca_crt))
    except ssl.SSLError as exc:
        raise ConfigError(
            f"the CA certificate {ca_crt} holds no valid certificate ({tls.ssl_reason(exc)})"
        ) from None
    return context


def _serving(server_crt: Path, server_key: Path) -> ssl.SSLContext:
    context = tls.context_as_grpc(server_side=True)
    # The certificate alone first, so that its problems are not blamed on the key.
    if not tls.holds_certificate(server_crt.read_bytes()):
        raise ConfigError(f"the server certificate {server_crt} holds no valid PEM certificate")
    try:
        tls.load_key_pair(context, server_crt, server_key)
    except ssl.SSLError as exc:
        if tls.is_key_mismatch(exc):
            raise ConfigError(
                f"the server key {server_key} does not belong to the server certificate {server_crt}"
            ) from None
        # OpenSSL's reason says nothing more ("PEM lib"), and the key's content is never echoed.
        raise ConfigError(f"the server key {server_key} is not an unencrypted PEM private key") from None
    return context


def check_server_credentials(ca_crt: Path, server_crt: Path, server_key: Path) -> None:
    """Refuse, naming the file, what grpc would take and then fail every client with.

    grpc accepts an expired server certificate, or one another CA signed, and every handshake
    fails later; a key it cannot read shows only as a failure to bind. So the daemon shakes hands
    with itself once, in memory, through OpenSSL: a client trusting only ``ca_crt`` must accept
    the server certificate (signature, validity dates, purpose) and the key must be its own.
    """
    for path, what in (
        (ca_crt, "CA certificate"),
        (server_crt, "server certificate"),
        (server_key, "server key"),
    ):
        tls.read_credential(path, what, ConfigError)
    client = _Tls(_trusting(ca_crt), server_side=False)
    server = _Tls(_serving(server_crt, server_key), server_side=True)
    try:
        _handshake(client, server)
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code == _X509_V_ERR_CERT_NOT_YET_VALID:
            # Everything else held (OpenSSL checks the dates last). Clients judge the dates by
            # their own clocks, and a guest's may lag the host's that issued it at boot.
            log.warning("the server certificate %s is not valid yet by this machine's clock", server_crt)
            return
        raise ConfigError(
            f"the server certificate {server_crt} is not accepted by a client trusting the CA "
            f"certificate {ca_crt}: {exc.verify_message}"
        ) from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"the server certificate {server_crt} and key {server_key} cannot serve TLS: "
            f"{tls.ssl_reason(exc)}"
        ) from None


class _Tls:
    """One end of an in-memory TLS connection: its state and the two directions of its bytes."""

    def __init__(self, context: ssl.SSLContext, server_side: bool) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.end = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side)
        self.done = False

    def step(self) -> None:
        if not self.done:
            try:
                self.end.do_handshake()
                self.done = True
            except ssl.SSLWantReadError:
                pass


def _handshake(client: _Tls, server: _Tls) -> None:
    """Carry each end's bytes to the other until both finished their handshake."""
    for _ in range(_HANDSHAKE_MAX_ROUNDS):
        for end, peer in ((client, server), (server, client)):
            end.step()
            peer.incoming.write(end.outgoing.read())
        if client.done and server.done:
            return
    raise ssl.SSLError("the TLS handshake did not finish")


def server_credentials(
    ca_crt: Path, server_crt: Path, server_key: Path, checked: bool = True
) -> grpc.ServerCredentials:
    """mTLS: a client must present a certificate signed by ``ca_crt``; nothing else is accepted.
    ``checked``: refuse what would fail every client first (``check_server_credentials``)."""
    if checked:
        check_server_credentials(ca_crt, server_crt, server_key)
    key = tls.read_credential(server_key, "server key", ConfigError)
    crt = tls.read_credential(server_crt, "server certificate", ConfigError)
    ca = tls.read_credential(ca_crt, "CA certificate", ConfigError)
    return grpc.ssl_server_credentials([(key, crt)], root_certificates=ca, require_client_auth=True)


def config_credentials(config: DaemonConfig) -> grpc.ServerCredentials:
    """``server_credentials`` of the daemon's configuration, checked unless it says not to."""
    return server_credentials(
        config.ca_crt, config.server_crt, config.server_key, config.check_server_credentials
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


# Directories auraed keeps its state, logs and socket in: for their owner alone.
PRIVATE_DIR_MODE = 0o700
# Any access by group or others to the state and runtime directories: their logs, records and
# keys are no one else's business. (The socket's file is owner-only itself, so its directory may
# be a shared one such as /run; there only writing is refused, which could swap the socket.)
OTHERS_ACCESS = 0o077
OTHERS_WRITE = 0o022


def _make_private(path: Path) -> None:
    """Make ``path`` and whichever of its parents are missing, each owner-only.

    Not ``mkdir(parents=True)``, whose parents get the umask's mode: a guest's /run/aurae, made
    for its state directory, would then be refused as the socket's directory.
    """
    missing = [path, *(p for p in path.parents if not p.exists())]
    for directory in sorted(missing, key=lambda p: len(p.parts)):
        with contextlib.suppress(FileExistsError):  # a race with another maker is fine: checked below
            directory.mkdir(mode=PRIVATE_DIR_MODE)
            directory.chmod(PRIVATE_DIR_MODE)  # mkdir's mode went through the umask


def private_directory(path: Path, what: str, forbidden: int = OTHERS_ACCESS) -> None:
    """Make ``path`` (owner-only) if missing; refuse one that is not ours or whose mode allows
    group or others any of ``forbidden``."""
    try:
        if not path.exists():
            _make_private(path)
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot create the {what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"the {what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"the {what} {path} belongs to uid {info.st_uid}, not to auraed's (uid {os.geteuid()})"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & forbidden == 0:
        return
    if forbidden == OTHERS_WRITE:
        raise ConfigError(f"the {what} {path} is writable by others (mode {mode:04o}): chmod go-w {path}")
    raise ConfigError(
        f"the {what} {path} is open to others (mode {mode:04o}); it must be owner-only: "
        f"chmod {PRIVATE_DIR_MODE:o} {path}"
    )


def prepare_unix_socket(path: Path) -> None:
    """Make ``path`` free to bind: a stale socket is removed, a live one or any other file is refused."""
    private_directory(path.parent, "socket's directory", OTHERS_WRITE)
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


def add_plain_unix_listener(server: grpc.aio.Server, path: Path) -> None:
    """A unix socket without TLS (the CRI's: kubelets speak none to their runtime), owner-only."""
    prepare_unix_socket(path)
    previous = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{path}")
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
