"""Certificate authority, certificate issuing and PEM file handling for auraed's mTLS.

Key type: every key generated here is ECDSA on NIST P-256 (secp256r1).  P-256 is
supported by every TLS stack auraed talks to (BoringSSL inside grpcio, OpenSSL,
rustls, Go), gives roughly 128-bit security with small keys and signatures, and key
generation takes microseconds, so tests can mint throw-away PKIs freely (RSA-4096,
what many hand-written setups use, takes around a second per key).  Existing CAs with
RSA keys can still be loaded and used for issuing.

Key usage of leaf certificates: ``digitalSignature`` always, plus ``keyEncipherment``
only for RSA keys.  RFC 5480 (section 3) does not allow ``keyEncipherment`` on EC keys
and an EC key can never be used for RSA key transport, so it is left off for P-256.

Private key material is never logged or printed; log messages only name file paths.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
"""Private key types this module can sign with (generated keys are always EC P-256)."""

CERT_SUFFIX = ".crt"
KEY_SUFFIX = ".key"
CA_STEM = "ca"
SERVER_STEM = "server"
CA_CERT_FILE = CA_STEM + CERT_SUFFIX
CA_KEY_FILE = CA_STEM + KEY_SUFFIX

DEFAULT_CA_COMMON_NAME = "aurae-ca"
DEFAULT_SERVER_COMMON_NAME = "server.unsafe.aurae.io"
DEFAULT_SERVER_NAMES: tuple[str, ...] = ("localhost", DEFAULT_SERVER_COMMON_NAME)
DEFAULT_SERVER_IPS: tuple[str, ...] = ("127.0.0.1",)
DEFAULT_CLIENT_NAMES: tuple[str, ...] = ("aurae-client",)

CA_VALID_DAYS = 3650
LEAF_VALID_DAYS = 825  # the historical CA/Browser-forum maximum for leaf certificates

CERT_FILE_MODE = 0o644
KEY_FILE_MODE = 0o600
PKI_DIR_MODE = 0o700

# Certificates are backdated a little so that peers with a slightly lagging clock
# do not reject a freshly issued certificate as "not yet valid".
_CLOCK_SKEW_ALLOWANCE = dt.timedelta(minutes=5)
# ensure_dev_pki() reissues certificates that expire within this window.
_RENEW_BEFORE_EXPIRY = dt.timedelta(days=1)

_STEM_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PkiError(Exception):
    """A certificate or key file is missing, unreadable, malformed or inconsistent."""


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA certificate together with the private key that signs certificates for it."""

    cert: x509.Certificate
    key: PrivateKey


@dataclass(frozen=True)
class PkiPaths:
    """Locations of the files produced by :func:`ensure_dev_pki`."""

    ca_crt: Path
    ca_key: Path
    server_crt: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    """Client name -> (certificate path, key path)."""


# --------------------------------------------------------------------------- helpers


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _generate_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _public_key_der(key: PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _cert_public_key_der(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _validity(
    valid_days: int, not_before: dt.datetime | None, not_after: dt.datetime | None
) -> tuple[dt.datetime, dt.datetime]:
    if valid_days <= 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")
    start = not_before if not_before is not None else _utcnow() - _CLOCK_SKEW_ALLOWANCE
    end = not_after if not_after is not None else start + dt.timedelta(days=valid_days)
    for name, value in (("not_before", start), ("not_after", end)):
        if value.tzinfo is None:
            raise ValueError(f"{name} must be timezone-aware, got naive datetime {value!r}")
    if end <= start:
        raise ValueError(f"not_after ({end.isoformat()}) must be later than not_before ({start.isoformat()})")
    return start, end


def _name(common_name: str) -> x509.Name:
    if not common_name:
        raise ValueError("common_name must not be empty")
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(builder: x509.CertificateBuilder, key: PrivateKey) -> x509.Certificate:
    return builder.sign(private_key=key, algorithm=hashes.SHA256())


def _authority_key_identifier(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key())  # type: ignore[arg-type]
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _leaf_key_usage(key: PrivateKey) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=isinstance(key, rsa.RSAPrivateKey),
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _issue_leaf(
    ca: CertificateAuthority,
    *,
    common_name: str,
    san: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    valid_days: int,
    not_before: dt.datetime | None,
    not_after: dt.datetime | None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    start, end = _validity(valid_days, not_before, not_after)
    key = _generate_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(key), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_identifier(ca.cert), critical=False)
    )
    return _sign(builder, ca.key), key


def _check_stem(stem: str) -> None:
    if not _STEM_PATTERN.fullmatch(stem) or stem.endswith((CERT_SUFFIX, KEY_SUFFIX)):
        raise ValueError(
            f"invalid PEM file stem {stem!r}: use letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit, without a {CERT_SUFFIX}/{KEY_SUFFIX} suffix"
        )


# --------------------------------------------------------------------------- issuing


def create_ca(
    common_name: str = DEFAULT_CA_COMMON_NAME,
    valid_days: int = CA_VALID_DAYS,
    issuer: CertificateAuthority | None = None,
) -> CertificateAuthority:
    """Create a CA (EC P-256) that may only sign leaf certificates: a self-signed root or, with
    ``issuer``, an intermediate CA that ``issuer`` signs (an organisation's issuing CA)."""
    start, end = _validity(valid_days, None, None)
    key = _generate_key()
    name = _name(common_name)
    issuer_name, signing_key = (issuer.cert.subject, issuer.key) if issuer else (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return CertificateAuthority(cert=_sign(builder, signing_key), key=key)


def issue_server_cert(
    ca: CertificateAuthority,
    common_name: str,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str],
    valid_days: int = LEAF_VALID_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Issue a TLS server certificate (EKU serverAuth) with the given DNS and IP SANs.

    The common name is always included as a DNS SAN too, since TLS clients match
    host names against the SAN only.
    """
    dns = list(dict.fromkeys([common_name, *dns_names]))
    san: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    return _issue_leaf(
        ca,
        common_name=common_name,
        san=san,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        valid_days=valid_days,
        not_before=None,
        not_after=None,
    )


def issue_client_cert(
    ca: CertificateAuthority,
    common_name: str,
    valid_days: int = LEAF_VALID_DAYS,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    *,
    extra_san: Sequence[x509.GeneralName] = (),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Issue a TLS client certificate (EKU clientAuth) whose DNS SAN is the common name.

    ``not_before``/``not_after`` (timezone-aware) override the validity window computed
    from ``valid_days``, e.g. to mint an already expired certificate for tests.
    ``extra_san`` are further subject alternative names (only DNS names are identities
    to auraed's authorization; see auraed.server.authz).
    """
    san: list[x509.GeneralName] = [x509.DNSName(common_name), *extra_san]
    return _issue_leaf(
        ca,
        common_name=common_name,
        san=san,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        valid_days=valid_days,
        not_before=not_before,
        not_after=not_after,
    )


# --------------------------------------------------------------------------- PEM I/O


def certificate_pem(cert: x509.Certificate) -> bytes:
    """PEM encoding of a certificate."""
    return cert.public_bytes(serialization.Encoding.PEM)


def private_key_pem(key: PrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM encoding of a private key (the daemon must read it unattended)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ensure_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(mode=PKI_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(directory, PKI_DIR_MODE)  # mkdir's mode is filtered through the umask
    except OSError as exc:
        raise PkiError(f"cannot create PKI directory {directory}: {exc.strerror or exc}") from exc


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` via a temporary file created with ``mode`` and a rename.

    The temporary file is created with its final permissions by ``os.open`` (never
    wider, whatever the umask) so a private key is not readable by others at any time.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise PkiError(f"cannot create {tmp}: {exc.strerror or exc}") from exc
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have removed bits we want (e.g. 0644 for certs)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise PkiError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with contextlib.suppress(OSError):
        _fsync_directory(path.parent)


def write_pem_files(directory: Path, stem: str, cert: x509.Certificate, key: PrivateKey) -> tuple[Path, Path]:
    """Atomically write ``<stem>.crt`` (mode 0644) and ``<stem>.key`` (mode 0600).

    ``directory`` is created with mode 0700 if it does not exist.  The key is written
    before the certificate; a crash in between leaves a key that does not match the
    certificate, which :func:`ensure_dev_pki` detects and repairs.
    Returns ``(cert_path, key_path)``.
    """
    _check_stem(stem)
    _ensure_directory(directory)
    cert_path = directory / f"{stem}{CERT_SUFFIX}"
    key_path = directory / f"{stem}{KEY_SUFFIX}"
    _atomic_write(key_path, private_key_pem(key), KEY_FILE_MODE)
    _atomic_write(cert_path, certificate_pem(cert), CERT_FILE_MODE)
    log.debug("wrote certificate %s and private key %s", cert_path, key_path)
    return cert_path, key_path


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise PkiError(f"{what} {path} does not exist") from exc
    except OSError as exc:
        raise PkiError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def load_certificate(path: Path) -> x509.Certificate:
    """Load the first PEM certificate in ``path``; raises :class:`PkiError` naming the file."""
    data = _read_file(path, "certificate")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise PkiError(f"{path} does not contain a valid PEM certificate: {exc}") from exc


def load_private_key(path: Path) -> PrivateKey:
    """Load an unencrypted PEM EC or RSA private key; raises :class:`PkiError` naming the file."""
    data = _read_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:  # raised for password-protected keys
        raise PkiError(f"private key {path} is encrypted; auraed needs an unencrypted key") from exc
    except (ValueError, UnsupportedAlgorithm):
        # The exception text is deliberately not included: never echo key material.
        raise PkiError(f"{path} does not contain a valid PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise PkiError(f"private key {path} has unsupported type {type(key).__name__}; use EC or RSA")
    return key


def load_ca(directory: Path) -> CertificateAuthority:
    """Load ``ca.crt`` and ``ca.key`` from ``directory`` and check that they belong together."""
    return load_ca_files(directory / CA_CERT_FILE, directory / CA_KEY_FILE)


def load_ca_files(cert_path: Path, key_path: Path) -> CertificateAuthority:
    """Load a CA certificate and its key and check that they belong together."""
    cert = load_certificate(cert_path)
    key = load_private_key(key_path)
    if _cert_public_key_der(cert) != _public_key_der(key):
        raise PkiError(f"private key {key_path} does not match CA certificate {cert_path}")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise PkiError(f"{cert_path} is not a CA certificate (basicConstraints CA flag not set)")
    return CertificateAuthority(cert=cert, key=key)


def identity_of(cert_pem: bytes) -> tuple[str, list[str]]:
    """Return ``(common_name, san_dns_names)`` of a PEM certificate.

    The common name is ``""`` if the subject has none; callers doing authorization
    must treat that as "no identity".
    """
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise PkiError(f"not a valid PEM certificate: {exc}") from exc
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = cns[0].value if cns else ""
    common_name = cn if isinstance(cn, str) else cn.decode("utf-8", "replace")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return common_name, []
    return common_name, san.get_values_for_type(x509.DNSName)


# --------------------------------------------------------------------------- dev PKI


def _is_current(cert: x509.Certificate) -> bool:
    now = _utcnow()
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc > now + _RENEW_BEFORE_EXPIRY


def _usable_ca(directory: Path) -> CertificateAuthority | None:
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if not cert_path.exists() and not key_path.exists():
        return None
    try:
        ca = load_ca(directory)
    except PkiError as exc:
        log.warning("replacing unusable dev CA: %s", exc)
        return None
    if not _is_current(ca.cert):
        log.warning("replacing dev CA %s: expired or about to expire", cert_path)
        return None
    return ca


def _usable_leaf(
    ca: CertificateAuthority,
    cert_path: Path,
    key_path: Path,
    *,
    common_name: str,
    usage: x509.ObjectIdentifier,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str],
) -> bool:
    """Whether an existing certificate/key pair can be kept as it is."""
    if not cert_path.exists() and not key_path.exists():
        return False
    try:
        cert = load_certificate(cert_path)
        key = load_private_key(key_path)
    except PkiError as exc:
        log.warning("reissuing: %s", exc)
        return False
    problem = _leaf_problem(
        ca,
        cert,
        key,
        common_name=common_name,
        usage=usage,
        dns_names=dns_names,
        ip_addresses=ip_addresses,
    )
    if problem:
        log.warning("reissuing %s: %s", cert_path, problem)
        return False
    return True


def _leaf_problem(
    ca: CertificateAuthority,
    cert: x509.Certificate,
    key: PrivateKey,
    *,
    common_name: str,
    usage: x509.ObjectIdentifier,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str],
) -> str | None:
    if _cert_public_key_der(cert) != _public_key_der(key):
        return "private key does not match the certificate"
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return "not issued by the current CA"
    if not _is_current(cert):
        return "expired or about to expire"
    cn, san_dns = identity_of(certificate_pem(cert))
    if cn != common_name:
        return f"common name is {cn!r}, expected {common_name!r}"
    try:
        ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        return f"missing extension {exc.oid.dotted_string}"
    if usage not in ekus:
        return f"extended key usage lacks {usage.dotted_string}"
    missing_dns = set(dns_names) - set(san_dns)
    wanted_ips = {ipaddress.ip_address(ip) for ip in ip_addresses}
    missing_ips = wanted_ips - set(san.get_values_for_type(x509.IPAddress))
    if missing_dns or missing_ips:
        missing = sorted(missing_dns) + sorted(str(ip) for ip in missing_ips)
        return f"subject alternative names lack {', '.join(missing)}"
    return None


def ensure_client_cert(ca: CertificateAuthority, directory: Path, name: str) -> tuple[Path, Path]:
    """``<name>.crt``/``<name>.key`` in ``directory``: a client certificate for ``name`` from ``ca``.

    Kept while it parses, matches its key, was issued by ``ca``, is not about to expire and names
    ``name``; (re)issued otherwise. A certificate checked only for being there outlives a change
    of CA and is refused by every peer trusting the new one (the host's certificate for guests).
    Returns ``(cert_path, key_path)``.
    """
    _check_stem(name)
    crt, key = directory / f"{name}{CERT_SUFFIX}", directory / f"{name}{KEY_SUFFIX}"
    if not _usable_leaf(
        ca,
        crt,
        key,
        common_name=name,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        dns_names=[name],
        ip_addresses=[],
    ):
        write_pem_files(directory, name, *issue_client_cert(ca, name))
        log.info("issued client certificate %s", crt)
    return crt, key


def ensure_dev_pki(
    directory: Path,
    server_names: Sequence[str] = DEFAULT_SERVER_NAMES,
    server_ips: Sequence[str] = DEFAULT_SERVER_IPS,
    client_names: Sequence[str] = DEFAULT_CLIENT_NAMES,
    server_common_name: str = DEFAULT_SERVER_COMMON_NAME,
) -> PkiPaths:
    """Create a development PKI in ``directory`` unless a usable one is already there.

    Produces ``ca.crt``/``ca.key``, ``server.crt``/``server.key`` and
    ``<client>.crt``/``<client>.key`` for every client name (the client name is both
    the certificate's common name and its file stem).  Idempotent: files that exist,
    parse, match their key, chain to the CA, are not about to expire and carry the
    requested names are left untouched.  Anything else is (re)issued; a new CA
    implies new server and client certificates.
    """
    for client in client_names:
        _check_stem(client)
        if client in (CA_STEM, SERVER_STEM):
            raise ValueError(f"client name {client!r} would collide with the CA or server files")

    ca = _usable_ca(directory)
    if ca is None:
        ca = create_ca()
        write_pem_files(directory, CA_STEM, ca.cert, ca.key)
        log.info("created dev CA %s", directory / CA_CERT_FILE)

    server_crt = directory / f"{SERVER_STEM}{CERT_SUFFIX}"
    server_key = directory / f"{SERVER_STEM}{KEY_SUFFIX}"
    server_dns = list(dict.fromkeys([server_common_name, *server_names]))
    if not _usable_leaf(
        ca,
        server_crt,
        server_key,
        common_name=server_common_name,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        dns_names=server_dns,
        ip_addresses=server_ips,
    ):
        cert, key = issue_server_cert(ca, server_common_name, server_dns, server_ips)
        write_pem_files(directory, SERVER_STEM, cert, key)
        log.info("issued dev server certificate %s", server_crt)

    clients = {client: ensure_client_cert(ca, directory, client) for client in client_names}

    return PkiPaths(
        ca_crt=directory / CA_CERT_FILE,
        ca_key=directory / CA_KEY_FILE,
        server_crt=server_crt,
        server_key=server_key,
        clients=clients,
    )
