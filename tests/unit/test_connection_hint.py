"""What a failure to connect is called, for each wording grpc was seen to use for it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from auraed.client.client import ClientConfig, connection_hint

CONFIG = ClientConfig(
    ca_crt=Path("/c/ca.crt"), client_crt=Path("/c/client.crt"), client_key=Path("/c/client.key"),
    address="unix:/run/aurae.sock",
)  # fmt: skip
PREFIX = "failed to connect to all addresses; last error: UNAVAILABLE: unix:/run/aurae.sock: "


# A server that refuses the client's certificate hangs up during the handshake; where the client
# was at that moment decides grpc's words (the first four seen in one test over 60 tries).
@pytest.mark.parametrize(
    "last_error",
    [
        "Socket closed",
        "Delayed close due to in-progress write (Socket closed) (sendmsg: Broken pipe (32))",
        "Delayed close due to in-progress write (sendmsg: Broken pipe (32))",
        "recvmsg:Connection reset by peer (104)",
        # A server that says why before it hangs up (OpenSSL's alert names).
        "SSL_ERROR_SSL: error:0A000418:SSL routines::tlsv1 alert unknown ca",
        "SSL_ERROR_SSL: error:0A00045C:SSL routines::tlsv13 alert certificate required",
    ],
)
def test_a_hang_up_during_the_handshake_names_the_client_certificate(last_error: str) -> None:
    hint = connection_hint(grpc.StatusCode.UNAVAILABLE, PREFIX + last_error, CONFIG)
    assert hint.startswith("it ended the TLS handshake") and "/c/client.crt" in hint


@pytest.mark.parametrize(
    ("last_error", "words"),
    [
        ("SSL_ERROR_SSL: error:1000007d:SSL routines:CERTIFICATE_VERIFY_FAILED", "not signed by the CA"),
        ("Peer name aurae is not in peer certificate: Hostname Verification Check failed", "does not name"),
        ("connect: Connection refused (111)", "nothing accepts connections there"),
        ("connect: No such file or directory (2)", "nothing accepts connections there"),
        ("something grpc has not said before", ""),
    ],
)
def test_other_failures_to_connect(last_error: str, words: str) -> None:
    hint = connection_hint(grpc.StatusCode.UNAVAILABLE, PREFIX + last_error, CONFIG)
    assert words in hint if words else hint == ""


def test_failures_after_connecting_get_no_hint() -> None:
    assert connection_hint(grpc.StatusCode.UNAVAILABLE, "Socket closed", CONFIG) == ""
    assert connection_hint(grpc.StatusCode.INTERNAL, PREFIX + "Socket closed", CONFIG) == ""
