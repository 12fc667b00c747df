"""Small PKI for auraed's mutual TLS: a CA, server and client certificates, PEM files.

Generated keys are ECDSA P-256; see :mod:`auraed.pki.certs` for the reasoning.
"""

from auraed.pki.certs import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    CertificateAuthority,
    PkiError,
    PkiPaths,
    PrivateKey,
    certificate_pem,
    create_ca,
    ensure_client_cert,
    ensure_dev_pki,
    identity_of,
    issue_client_cert,
    issue_server_cert,
    load_ca,
    load_ca_files,
    load_certificate,
    load_private_key,
    private_key_pem,
    write_pem_files,
)

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "CertificateAuthority",
    "PkiError",
    "PkiPaths",
    "PrivateKey",
    "certificate_pem",
    "create_ca",
    "ensure_client_cert",
    "ensure_dev_pki",
    "identity_of",
    "issue_client_cert",
    "issue_server_cert",
    "load_ca",
    "load_ca_files",
    "load_certificate",
    "load_private_key",
    "private_key_pem",
    "write_pem_files",
]
