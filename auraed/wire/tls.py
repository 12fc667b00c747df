"""TLS as grpc does it, for checks made before grpc is given the files.

grpc only logs why it cannot use a certificate or key and then fails every handshake, so the
daemon (its server credentials) and the client (its client credentials) first try the files with
OpenSSL, under the rules grpc's TLS would apply, and refuse them naming the file.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

# OpenSSL's security level 0: grpc's TLS (BoringSSL) has no such levels, and the checks are of
# what grpc would do with the files, not a policy of their own (Debian's default level 2 refuses,
# say, a 1024-bit RSA key that grpc serves with).
AS_GRPC_CIPHERS = "DEFAULT:@SECLEVEL=0"


def read_credential(path: Path, what: str, refuse: Callable[[str], Exception]) -> bytes:
    """The bytes of the ``what`` ("CA certificate", "client key") at ``path``; ``refuse(message)``
    is raised, naming the file, when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise refuse(f"cannot read the {what} {path}: {exc.strerror}") from exc


def _no_password() -> bytes:
    # An encrypted key must fail to load, not make OpenSSL prompt on a terminal for a password.
    return b""


def context_as_grpc(server_side: bool) -> ssl.SSLContext:
    """An OpenSSL context taking the keys and certificates grpc would take (AS_GRPC_CIPHERS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers(AS_GRPC_CIPHERS)
    return context


def load_key_pair(context: ssl.SSLContext, crt: Path, key: Path) -> None:
    """Load the certificate ``crt`` and its unencrypted ``key``; ssl.SSLError when they are not
    (see :func:`is_key_mismatch`), OSError when a file cannot be read."""
    context.load_cert_chain(str(crt), str(key), password=_no_password)


def holds_certificate(pem: bytes) -> bool:
    """Whether ``pem`` holds PEM certificates, and only valid ones, as trust anchors are read."""
    try:  # as text: bytes would be read as DER, and ssl takes only ASCII text
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError):  # ValueError: bytes that are not ASCII
        return False
    return True


def ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason for ``exc`` in words ("key values mismatch")."""
    return str(exc.reason or exc.strerror or exc).lower().replace("_", " ")


def is_key_mismatch(exc: ssl.SSLError) -> bool:
    """Whether :func:`load_key_pair` failed because the key is not the certificate's."""
    return "mismatch" in ssl_reason(exc)
