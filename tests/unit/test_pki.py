"""Tests for auraed.pki: certificate chain, file permissions, idempotence and real mTLS over gRPC."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from auraed.pki import (
    CertificateAuthority,
    PkiError,
    PkiPaths,
    certificate_pem,
    create_ca,
    ensure_dev_pki,
    identity_of,
    issue_client_cert,
    issue_server_cert,
    load_ca,
    load_certificate,
    load_private_key,
    private_key_pem,
    write_pem_files,
)
from auraed.server.listeners import check_server_credentials


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def pki_dir(tmp_path: Path) -> Path:
    return tmp_path / "pki"


@pytest.fixture
def dev_pki(pki_dir: Path) -> PkiPaths:
    return ensure_dev_pki(pki_dir)


# --------------------------------------------------------------------------- chain


def test_chain_verifies_for_server_names_and_client(dev_pki: PkiPaths) -> None:
    ca_cert = load_certificate(dev_pki.ca_crt)
    server = load_certificate(dev_pki.server_crt)
    client = load_certificate(dev_pki.clients["aurae-client"][0])
    builder = PolicyBuilder().store(Store([ca_cert]))

    for name in ("localhost", "server.unsafe.aurae.io"):
        chain = builder.build_server_verifier(x509.DNSName(name)).verify(server, [])
        assert chain[-1] == ca_cert
    builder.build_server_verifier(x509.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(server, [])

    verified = builder.build_client_verifier().verify(client, [])
    assert verified.subjects == [x509.DNSName("aurae-client")]

    with pytest.raises(VerificationError):
        builder.build_server_verifier(x509.DNSName("evil.example.com")).verify(server, [])
    with pytest.raises(VerificationError):  # wrong EKU: a client cert cannot serve
        builder.build_server_verifier(x509.DNSName("aurae-client")).verify(client, [])


def test_certificate_extensions() -> None:
    ca = create_ca()
    server, server_key = issue_server_cert(ca, "srv", ["localhost"], ["127.0.0.1", "::1"])
    client, _ = issue_client_cert(ca, "alice")

    assert server.issuer == ca.cert.subject
    server.verify_directly_issued_by(ca.cert)
    client.verify_directly_issued_by(ca.cert)

    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["srv", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    server_eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    client_eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(server_eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert list(client_eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    usage = server.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert usage.value.digital_signature
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    assert server_key.curve.name == "secp256r1"
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert dt.timedelta(days=825) <= lifetime <= dt.timedelta(days=826)


def test_expired_client_cert_has_not_after_in_the_past() -> None:
    ca = create_ca()
    now = dt.datetime.now(dt.UTC)
    cert, _ = issue_client_cert(
        ca, "late", not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(days=1)
    )
    assert cert.not_valid_after_utc < now
    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([ca.cert])).build_client_verifier().verify(cert, [])


def test_invalid_validity_is_rejected() -> None:
    ca = create_ca()
    now = dt.datetime.now(dt.UTC)
    with pytest.raises(ValueError, match="later than"):
        issue_client_cert(ca, "x", not_before=now, not_after=now - dt.timedelta(seconds=1))
    with pytest.raises(ValueError, match="timezone-aware"):
        issue_client_cert(ca, "x", not_after=dt.datetime(2000, 1, 1))
    with pytest.raises(ValueError, match="positive"):
        create_ca(valid_days=0)


def test_identity_of() -> None:
    ca = create_ca()
    server, _ = issue_server_cert(ca, "server.unsafe.aurae.io", ["localhost"], ["127.0.0.1"])
    client, _ = issue_client_cert(ca, "aurae-client")
    assert identity_of(certificate_pem(client)) == ("aurae-client", ["aurae-client"])
    assert identity_of(certificate_pem(server)) == (
        "server.unsafe.aurae.io",
        ["server.unsafe.aurae.io", "localhost"],
    )
    with pytest.raises(PkiError):
        identity_of(b"not a certificate")


# --------------------------------------------------------------------------- files


def test_file_permissions(dev_pki: PkiPaths, pki_dir: Path) -> None:
    assert _mode(pki_dir) == 0o700
    client_crt, client_key = dev_pki.clients["aurae-client"]
    for crt in (dev_pki.ca_crt, dev_pki.server_crt, client_crt):
        assert _mode(crt) == 0o644, crt
    for key in (dev_pki.ca_key, dev_pki.server_key, client_key):
        assert _mode(key) == 0o600, key
    assert sorted(p.name for p in pki_dir.iterdir()) == [
        "aurae-client.crt",
        "aurae-client.key",
        "ca.crt",
        "ca.key",
        "server.crt",
        "server.key",
    ]


def test_write_pem_files_modes_ignore_umask(tmp_path: Path) -> None:
    ca = create_ca()
    old = os.umask(0o277)  # would make a plain create 0400 for both files
    try:
        crt, key = write_pem_files(tmp_path / "a" / "b", "thing", ca.cert, ca.key)
    finally:
        os.umask(old)
    assert (_mode(crt), _mode(key), _mode(crt.parent)) == (0o644, 0o600, 0o700)
    assert crt.read_bytes() == certificate_pem(ca.cert)
    assert key.read_bytes() == private_key_pem(ca.key)
    assert [p.name for p in crt.parent.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_write_pem_files_rejects_path_like_stems(tmp_path: Path) -> None:
    ca = create_ca()
    for stem in ("../escape", "a/b", "", ".hidden", "x.key"):
        with pytest.raises(ValueError, match="stem"):
            write_pem_files(tmp_path, stem, ca.cert, ca.key)


def test_ensure_dev_pki_is_idempotent(pki_dir: Path) -> None:
    first = ensure_dev_pki(pki_dir)
    files = sorted(pki_dir.iterdir())
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in files}
    serials = {p: load_certificate(p).serial_number for p in files if p.suffix == ".crt"}

    second = ensure_dev_pki(pki_dir)

    assert second == first
    assert sorted(pki_dir.iterdir()) == files
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in files} == before
    assert {p: load_certificate(p).serial_number for p in serials} == serials


def test_ensure_dev_pki_repairs_only_what_is_broken(pki_dir: Path) -> None:
    paths = ensure_dev_pki(pki_dir)
    ca_serial = load_certificate(paths.ca_crt).serial_number
    client_crt, _ = paths.clients["aurae-client"]
    client_serial = load_certificate(client_crt).serial_number
    server_serial = load_certificate(paths.server_crt).serial_number

    paths.server_key.unlink()
    ensure_dev_pki(pki_dir)
    assert load_certificate(paths.ca_crt).serial_number == ca_serial
    assert load_certificate(client_crt).serial_number == client_serial
    assert load_certificate(paths.server_crt).serial_number != server_serial
    assert paths.server_key.exists()

    # Asking for an extra server name reissues the server certificate with it.
    ensure_dev_pki(pki_dir, server_names=("localhost", "server.unsafe.aurae.io", "node1"))
    assert "node1" in identity_of(paths.server_crt.read_bytes())[1]

    # A new CA invalidates every leaf.
    paths.ca_key.write_bytes(b"garbage")
    ensure_dev_pki(pki_dir)
    new_ca = load_ca(pki_dir)
    assert new_ca.cert.serial_number != ca_serial
    load_certificate(paths.server_crt).verify_directly_issued_by(new_ca.cert)
    load_certificate(client_crt).verify_directly_issued_by(new_ca.cert)


def test_a_client_certificate_is_reissued_when_its_ca_changes(tmp_path: Path) -> None:
    """The host keeps its certificate for guests (aurae-host) across restarts; after a change of
    its CA, one kept for being there is refused by every guest trusting the new CA."""
    from auraed import pki  # here, not at the top: the other tests stand without this function

    old_ca, new_ca = create_ca("old"), create_ca("new")
    crt, key = pki.ensure_client_cert(old_ca, tmp_path, "aurae-host")
    kept = crt.read_bytes()
    assert pki.ensure_client_cert(old_ca, tmp_path, "aurae-host") == (crt, key)
    assert crt.read_bytes() == kept  # still good: kept as it is

    pki.ensure_client_cert(new_ca, tmp_path, "aurae-host")
    renewed = load_certificate(crt)
    renewed.verify_directly_issued_by(new_ca.cert)
    assert identity_of(crt.read_bytes()) == ("aurae-host", ["aurae-host"])
    assert renewed.public_key() == load_private_key(key).public_key()

    now = dt.datetime.now(dt.UTC)
    expired = issue_client_cert(new_ca, "aurae-host", not_before=now - dt.timedelta(days=3), not_after=now)
    write_pem_files(tmp_path, "aurae-host", *expired)
    pki.ensure_client_cert(new_ca, tmp_path, "aurae-host")
    assert load_certificate(crt).not_valid_after_utc > now + dt.timedelta(days=1)


def test_ensure_dev_pki_multiple_clients(pki_dir: Path) -> None:
    paths = ensure_dev_pki(pki_dir, client_names=("alice", "bob"))
    assert set(paths.clients) == {"alice", "bob"}
    for name, (crt, key) in paths.clients.items():
        assert identity_of(crt.read_bytes()) == (name, [name])
        assert key.name == f"{name}.key"
    with pytest.raises(ValueError, match="collide"):
        ensure_dev_pki(pki_dir, client_names=("server",))


def test_load_ca_roundtrip(dev_pki: PkiPaths, pki_dir: Path) -> None:
    ca = load_ca(pki_dir)
    assert isinstance(ca, CertificateAuthority)
    assert certificate_pem(ca.cert) == dev_pki.ca_crt.read_bytes()


def test_load_ca_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match=str(tmp_path / "ca.crt")):
        load_ca(tmp_path)
    write_pem_files(tmp_path, "ca", create_ca().cert, create_ca().key)
    (tmp_path / "ca.key").unlink()
    with pytest.raises(PkiError, match=str(tmp_path / "ca.key")) as excinfo:
        load_ca(tmp_path)
    assert "does not exist" in str(excinfo.value)


def test_load_ca_corrupt_files(dev_pki: PkiPaths, pki_dir: Path) -> None:
    good_crt = dev_pki.ca_crt.read_bytes()
    dev_pki.ca_crt.write_bytes(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    with pytest.raises(PkiError, match=str(dev_pki.ca_crt)):
        load_ca(pki_dir)

    dev_pki.ca_crt.write_bytes(good_crt)
    dev_pki.ca_key.write_bytes(b"garbage")
    with pytest.raises(PkiError, match=str(dev_pki.ca_key)) as excinfo:
        load_ca(pki_dir)
    assert "garbage" not in str(excinfo.value)


def test_load_ca_mismatched_or_non_ca(dev_pki: PkiPaths, pki_dir: Path) -> None:
    other = create_ca()
    dev_pki.ca_key.write_bytes(private_key_pem(other.key))
    with pytest.raises(PkiError, match="does not match"):
        load_ca(pki_dir)

    ca = create_ca()
    leaf, leaf_key = issue_client_cert(ca, "leaf")
    write_pem_files(pki_dir, "ca", leaf, leaf_key)
    with pytest.raises(PkiError, match="not a CA certificate"):
        load_ca(pki_dir)


# --------------------------------------------------------------------------- real mTLS with grpc.aio

_METHOD = "/aurae.test.Echo/Call"


@dataclass
class _MtlsServer:
    target: str
    ca_pem: bytes
    seen_common_names: list[list[bytes]]


@pytest.fixture
async def mtls_server(dev_pki: PkiPaths) -> AsyncIterator[_MtlsServer]:
    seen: list[list[bytes]] = []

    async def call(request: bytes, context: Any) -> bytes:
        seen.append(list(context.auth_context().get("x509_common_name", [])))
        return b"pong:" + request

    handler = grpc.method_handlers_generic_handler(
        "aurae.test.Echo",
        {"Call": grpc.unary_unary_rpc_method_handler(call, request_deserializer=None)},
    )
    credentials = grpc.ssl_server_credentials(
        [(dev_pki.server_key.read_bytes(), dev_pki.server_crt.read_bytes())],
        root_certificates=dev_pki.ca_crt.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield _MtlsServer(f"127.0.0.1:{port}", dev_pki.ca_crt.read_bytes(), seen)
    finally:
        await server.stop(None)


async def _call(server: _MtlsServer, cert_key: tuple[bytes, bytes] | None, authority: str = "") -> bytes:
    if cert_key is None:
        credentials = grpc.ssl_channel_credentials(root_certificates=server.ca_pem)
    else:
        cert_pem, key_pem = cert_key
        credentials = grpc.ssl_channel_credentials(
            root_certificates=server.ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )
    options = [("grpc.ssl_target_name_override", authority)] if authority else []
    async with grpc.aio.secure_channel(server.target, credentials, options=options) as channel:
        response = await channel.unary_unary(_METHOD)(b"ping", timeout=10)
    assert isinstance(response, bytes)
    return response


def _pem_pair(cert: x509.Certificate, key: Any) -> tuple[bytes, bytes]:
    return certificate_pem(cert), private_key_pem(key)


async def test_mtls_dev_client_succeeds(mtls_server: _MtlsServer, dev_pki: PkiPaths) -> None:
    crt, key = dev_pki.clients["aurae-client"]
    pair = (crt.read_bytes(), key.read_bytes())
    assert await _call(mtls_server, pair) == b"pong:ping"  # server checked by IP SAN 127.0.0.1
    assert await _call(mtls_server, pair, authority="server.unsafe.aurae.io") == b"pong:ping"
    assert mtls_server.seen_common_names == [[b"aurae-client"], [b"aurae-client"]]


async def test_mtls_client_without_cert_fails(mtls_server: _MtlsServer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await _call(mtls_server, None)
    assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.seen_common_names == []


async def test_mtls_client_from_other_ca_fails(mtls_server: _MtlsServer) -> None:
    other = create_ca("other-ca")
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await _call(mtls_server, _pem_pair(*issue_client_cert(other, "aurae-client")))
    assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.seen_common_names == []


async def test_mtls_expired_client_cert_fails(mtls_server: _MtlsServer, pki_dir: Path) -> None:
    ca = load_ca(pki_dir)
    now = dt.datetime.now(dt.UTC)
    expired = issue_client_cert(
        ca, "aurae-client", not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1)
    )
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await _call(mtls_server, _pem_pair(*expired))
    assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.seen_common_names == []


async def test_mtls_client_rejects_wrong_server_name(mtls_server: _MtlsServer, dev_pki: PkiPaths) -> None:
    crt, key = dev_pki.clients["aurae-client"]
    with pytest.raises(grpc.aio.AioRpcError):
        await _call(mtls_server, (crt.read_bytes(), key.read_bytes()), authority="evil.example.com")
    assert mtls_server.seen_common_names == []


def test_the_server_credentials_check_takes_what_grpc_takes(tmp_path: Path) -> None:
    """An intermediate CA configured as ca_crt is a trust anchor to grpc: the start-time check
    must not refuse it ("unable to get issuer certificate")."""
    issuing = create_ca("issuing CA", issuer=create_ca())
    ca_crt = tmp_path / "issuing.crt"
    ca_crt.write_bytes(certificate_pem(issuing.cert))
    server_crt, server_key = write_pem_files(
        tmp_path, "server", *issue_server_cert(issuing, "server.unsafe.aurae.io", [], [])
    )
    check_server_credentials(ca_crt, server_crt, server_key)
