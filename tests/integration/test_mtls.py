"""mTLS on every listener and authorization by client identity, against a real daemon."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import ipaddress
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from auraed.api.aurae.cells import v0 as cells
from auraed.api.aurae.containers import v0 as containers
from auraed.api.aurae.discovery import v0 as discovery
from auraed.api.aurae.observe import v0 as observe
from auraed.client import AuraeClient, ClientConfig, ClientError
from auraed.errors import ConfigError
from auraed.pki import (
    CertificateAuthority,
    PkiPaths,
    PrivateKey,
    create_ca,
    issue_client_cert,
    issue_server_cert,
    write_pem_files,
)
from auraed.pki.certs import load_ca
from auraed.server.listeners import check_server_credentials
from auraed.wire.channel import DEFAULT_KEEPALIVE_TIME, DEFAULT_KEEPALIVE_TIMEOUT
from tests.conftest import DaemonFactory, DaemonProcess, remove_daemon_leftovers, start_refused
from tests.support import workers

CONTAINERS = "aurae.containers.v0.ContainerService"
OBSERVE = "aurae.observe.v0.ObserveService"
SERVER_NAME = "server.unsafe.aurae.io"  # the name clients expect (ClientConfig.server_name)

DISCOVER = ("aurae.discovery.v0.DiscoveryService", "Discover", discovery.DiscoveryServiceDiscoverRequest())


def _free_port() -> int:
    return workers.free_port()  # this test worker's own ports: no other worker takes it meanwhile


def _with_client_cert(daemon: DaemonProcess, crt: Path, key: Path, address: str) -> ClientConfig:
    return ClientConfig(ca_crt=daemon.pki.ca_crt, client_crt=crt, client_key=key, address=address)


def _start_tcp_daemon(daemon_factory: DaemonFactory, *flags: str) -> tuple[DaemonProcess, str]:
    """A daemon also serving on a free loopback port, and that host:port."""
    tcp = f"127.0.0.1:{_free_port()}"
    return daemon_factory("--tcp-listen", tcp, *flags), tcp


def _ours_at(
    daemon: DaemonProcess,
    address: str,
    keepalive_time: float = DEFAULT_KEEPALIVE_TIME,
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
) -> ClientConfig:
    """The daemon's own client config, pointed at ``address``."""
    return dataclasses.replace(
        daemon.client_config(),
        address=address,
        keepalive_time=keepalive_time,
        keepalive_timeout=keepalive_timeout,
    )


@pytest.fixture
def tcp_daemon(daemon_factory: DaemonFactory) -> tuple[DaemonProcess, str]:
    return _start_tcp_daemon(daemon_factory)


def _addresses(tcp_daemon: tuple[DaemonProcess, str]) -> list[str]:
    daemon, tcp = tcp_daemon
    return [f"unix:{daemon.socket}", tcp]


async def _discover(config: ClientConfig) -> str:
    async with AuraeClient.connect(config) as client:
        reply = await client.call(*DISCOVER, timeout=5)
        return str(reply.role)


async def _refused(config: ClientConfig) -> ClientError:
    with pytest.raises(ClientError) as error:
        await _discover(config)
    return error.value


async def test_valid_client_is_served_on_unix_and_tcp(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    daemon, _ = tcp_daemon
    for address in _addresses(tcp_daemon):
        assert await _discover(_ours_at(daemon, address)) == "host"


class _Relay:
    """A TCP relay to ``target`` that can hold every chunk ``delay`` seconds each way (a far client)
    and can swallow everything while keeping both connections open (a peer gone without a word)."""

    def __init__(self, target: str, delay: float = 0.0) -> None:
        self.target, self.delay = target, delay
        self.swallowing = False
        self.server_hung_up = asyncio.Event()
        self._listener: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._listener = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._listener.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._listener is not None
        self._listener.close()
        await self._listener.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        host, port = self.target.rsplit(":", 1)
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(
            self._carry(client_reader, server_writer),
            self._carry(server_reader, client_writer, from_server=True),
        )

    async def _carry(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_server: bool = False
    ) -> None:
        try:
            while chunk := await reader.read(65536):
                await asyncio.sleep(self.delay)
                if not self.swallowing:
                    writer.write(chunk)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            if from_server:
                self.server_hung_up.set()
            writer.close()


async def test_client_is_served_over_a_long_link(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    """TCP, TLS and HTTP/2 settings take several round trips: at 300 ms each, well over a second.

    grpc takes min_reconnect_backoff_ms as the time a connection attempt may last; when the client
    set it to 50 ms, such a link failed at once with UNAVAILABLE.
    """
    daemon, tcp = tcp_daemon
    async with _Relay(tcp, delay=0.15) as far:
        started = time.monotonic()
        assert await _discover(_ours_at(daemon, far)) == "host"
    assert time.monotonic() - started > 0.6  # the handshake really crossed the slow link


def _follow_daemon_log(client: AuraeClient) -> asyncio.Task[list[str]]:
    """A followed stream that stays quiet: the daemon's log from now on."""
    request = observe.ObserveServiceGetAuraeDaemonLogStreamRequest(follow=True, tail=0)

    async def read() -> list[str]:
        return [r.item.line async for r in client.stream(OBSERVE, "GetAuraeDaemonLogStream", request)]

    return asyncio.create_task(read())


async def test_a_client_notices_a_connection_gone_silent(daemon_factory: DaemonFactory) -> None:
    """Pings on a quiet followed stream: accepted while answered, the stream's end when not."""
    daemon, tcp = _start_tcp_daemon(daemon_factory, "--keepalive-client-min-interval", "0.2")
    relay = _Relay(tcp)
    async with relay as far:
        # A timeout of a second: a loaded machine may take half of one to relay an answer.
        config = _ours_at(daemon, far, keepalive_time=0.5, keepalive_timeout=1.0)
        async with AuraeClient.connect(config) as client:
            following = _follow_daemon_log(client)
            await asyncio.sleep(2.5)  # five pings answered; none refused as too many
            assert not following.done()
            relay.swallowing = True
            silent = time.monotonic()
            with pytest.raises(ClientError) as error:
                await asyncio.wait_for(following, 15)
            assert error.value.code == "UNAVAILABLE"
            assert time.monotonic() - silent < 5


async def test_the_daemon_drops_a_client_gone_silent(daemon_factory: DaemonFactory) -> None:
    """The daemon's own pings end the calls of a client that vanished (a client that never pings)."""
    daemon, tcp = _start_tcp_daemon(daemon_factory, "--keepalive-time", "0.5", "--keepalive-timeout", "1")
    relay = _Relay(tcp)
    async with relay as far, AuraeClient.connect(_ours_at(daemon, far, keepalive_time=0)) as client:
        following = _follow_daemon_log(client)
        await asyncio.sleep(1.5)  # the daemon's pings answered meanwhile
        assert not following.done() and not relay.server_hung_up.is_set()
        relay.swallowing = True
        await asyncio.wait_for(relay.server_hung_up.wait(), 5)
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError, ClientError):
            await following


async def test_client_without_certificate_is_refused(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    daemon, _ = tcp_daemon
    for address in _addresses(tcp_daemon):
        credentials = grpc.ssl_channel_credentials(root_certificates=daemon.pki.ca_crt.read_bytes())
        options = [("grpc.ssl_target_name_override", "server.unsafe.aurae.io")]
        async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
            call = channel.unary_unary("/aurae.discovery.v0.DiscoveryService/Discover")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call(b"", timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_is_refused(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    for address in _addresses(tcp_daemon):
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary("/aurae.discovery.v0.DiscoveryService/Discover")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call(b"", timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_certificate_from_another_ca_is_refused(
    tcp_daemon: tuple[DaemonProcess, str], tmp_path: Path
) -> None:
    daemon, _ = tcp_daemon
    foreign_ca = create_ca("someone-else")
    crt, key = write_pem_files(tmp_path, "foreign", *issue_client_cert(foreign_ca, "aurae-client"))
    for address in _addresses(tcp_daemon):
        error = await _refused(_with_client_cert(daemon, crt, key, address))
        assert error.code == "UNAVAILABLE"


async def test_expired_certificate_is_refused(tcp_daemon: tuple[DaemonProcess, str], tmp_path: Path) -> None:
    daemon, _ = tcp_daemon
    ca = load_ca(daemon.pki.ca_crt.parent)
    now = dt.datetime.now(dt.UTC)
    cert, key = issue_client_cert(
        ca, "aurae-client", not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(days=1)
    )
    crt, key_path = write_pem_files(tmp_path, "expired", cert, key)
    for address in _addresses(tcp_daemon):
        error = await _refused(_with_client_cert(daemon, crt, key_path, address))
        assert error.code == "UNAVAILABLE"


POLICY = """
[authorization]
default = []
[authorization.identities]
"aurae-client" = ["*"]
"reader" = ["aurae.discovery.v0.DiscoveryService/*", "grpc.health.v1.Health/*"]
"""


REPEATED_REFUSALS = 30


async def test_a_client_refused_in_a_loop_is_logged_once(daemon_factory: DaemonFactory) -> None:
    """Each kind of refusal is logged once a minute, not once a call: a client retrying a denied
    call in a loop must not fill the daemon's log."""
    daemon = daemon_factory(config_text=POLICY)
    async with daemon.client("reader") as reader:
        for _ in range(REPEATED_REFUSALS):
            with pytest.raises(ClientError):
                await reader.call("aurae.cells.v0.CellService", "List", cells.CellServiceListRequest())
        with pytest.raises(ClientError):  # another method: another refusal, logged too
            await reader.call(CONTAINERS, "List", containers.ContainerServiceListRequest())
    log = daemon.log()
    assert log.count("refused /aurae.cells.v0.CellService/List for identity reader") == 1
    assert log.count(f"refused /{CONTAINERS}/List for identity reader") == 1


async def test_authorization_by_identity(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(config_text=POLICY)
    # Allowed everything.
    assert await _discover(daemon.client_config("aurae-client")) == "host"
    # reader: discovery yes, cells no.
    assert await _discover(daemon.client_config("reader")) == "host"
    async with daemon.client("reader") as reader:
        assert await reader.health() == "SERVING"
        with pytest.raises(ClientError) as error:
            await reader.call("aurae.cells.v0.CellService", "List", cells.CellServiceListRequest())
        assert error.value.code == "PERMISSION_DENIED"
        assert "reader" in error.value.message
    # A ContainerService call naming a VM is routed to the guest: checked before that too.
    async with AuraeClient.connect(daemon.client_config("reader"), vm="g1") as routed:
        with pytest.raises(ClientError) as error:
            await routed.call(CONTAINERS, "List", containers.ContainerServiceListRequest())
        assert error.value.code == "PERMISSION_DENIED"
    # intruder: signed by the CA but not listed, and the default allows nothing, health included.
    error_ = await _refused(daemon.client_config("intruder"))
    assert error_.code == "PERMISSION_DENIED"
    async with daemon.client("intruder") as intruder:
        with pytest.raises(ClientError) as error:
            await intruder.health()
        assert error.value.code == "PERMISSION_DENIED"
    log = daemon.log()
    assert "refused /aurae.cells.v0.CellService/List for identity reader" in log
    assert "identity intruder" in log


async def test_default_policy_allows_any_identity_signed_by_the_ca(daemon: DaemonProcess) -> None:
    assert await _discover(daemon.client_config("intruder")) == "host"


def _refused_start(pki: PkiPaths, server_crt: Path, server_key: Path) -> str:
    """Start a daemon with this server certificate and key; it must refuse: what it logged."""
    root = Path(tempfile.mkdtemp(prefix="aurae-cred-", dir="/tmp"))
    return start_refused(
        DaemonProcess(root, dataclasses.replace(pki, server_crt=server_crt, server_key=server_key), [])
    )


def test_bad_server_credentials_are_refused_at_start_naming_the_file(pki: PkiPaths, tmp_path: Path) -> None:
    ca = load_ca(pki.ca_crt.parent)
    now = dt.datetime.now(dt.UTC)
    expired = _issue(
        ca, ExtendedKeyUsageOID.SERVER_AUTH, now - dt.timedelta(days=10), now - dt.timedelta(days=1)
    )
    cases = {
        "expired": (*write_pem_files(tmp_path, "expired", *expired), "certificate has expired"),
        "foreign": (
            *write_pem_files(
                tmp_path, "foreign", *issue_server_cert(create_ca("other"), SERVER_NAME, [], [])
            ),
            "unable to get local issuer certificate",
        ),
        "client-only": (
            *write_pem_files(tmp_path, "client", *issue_client_cert(ca, SERVER_NAME)),
            "unsuitable certificate purpose",
        ),
    }
    for name, (crt, key, problem) in cases.items():
        said = _refused_start(pki, crt, key)
        assert f"server certificate {crt}" in said and problem in said, name
        assert "Traceback" not in said and "cannot listen" not in said, name
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    said = _refused_start(pki, pki.server_crt, junk)
    assert f"server key {junk} is not an unencrypted PEM private key" in said
    foreign_key = cases["foreign"][1]
    said = _refused_start(pki, pki.server_crt, foreign_key)
    assert f"server key {foreign_key} does not belong to the server certificate {pki.server_crt}" in said


async def test_without_the_check_bad_credentials_are_served_and_every_client_fails(
    pki: PkiPaths, tmp_path: Path
) -> None:
    """check_server_credentials = false (what a host writes for its guests, whose credentials it
    has just issued): the start shakes no hands with itself, so an expired certificate is served,
    and every client's handshake fails: that check is what refuses them at start."""
    ca = load_ca(pki.ca_crt.parent)
    now = dt.datetime.now(dt.UTC)
    expired = _issue(
        ca, ExtendedKeyUsageOID.SERVER_AUTH, now - dt.timedelta(days=10), now - dt.timedelta(days=1)
    )
    crt, key = write_pem_files(tmp_path, "expired", *expired)
    root = Path(tempfile.mkdtemp(prefix="aurae-nocheck-", dir="/tmp"))
    daemon = DaemonProcess(
        root, dataclasses.replace(pki, server_crt=crt, server_key=key), ["--no-check-server-credentials"]
    )
    daemon.start()
    try:
        error = await _refused(daemon.client_config())
        assert error.code == "UNAVAILABLE", error
    finally:
        daemon.stop()
        remove_daemon_leftovers(daemon)


def _issue(
    ca: CertificateAuthority, usage: x509.ObjectIdentifier, not_before: dt.datetime, not_after: dt.datetime
) -> tuple[x509.Certificate, PrivateKey]:
    """A certificate for the server's name with any validity window (none of the issue_* offer it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
    )
    return builder.sign(ca.key, hashes.SHA256()), key


SAN_POLICY = """
[authorization]
default = []
[authorization.identities]
"spiffe://aurae/admin" = ["*"]
"admin@aurae.test" = ["*"]
"10.9.8.7" = ["*"]
"dns-reader" = ["aurae.discovery.v0.DiscoveryService/*"]
"""


async def test_only_the_cn_and_dns_sans_are_identities(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """A URI, e-mail or IP SAN spelled like a listed identity is no such identity; a DNS SAN is."""
    daemon = daemon_factory(config_text=SAN_POLICY)
    ca = load_ca(daemon.pki.ca_crt.parent)
    address = f"unix:{daemon.socket}"
    others: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier("spiffe://aurae/admin"),
        x509.RFC822Name("admin@aurae.test"),
        x509.IPAddress(ipaddress.ip_address("10.9.8.7")),
    ]
    for san in others:
        crt, key = write_pem_files(tmp_path, "other", *issue_client_cert(ca, "nobody", extra_san=[san]))
        error = await _refused(_with_client_cert(daemon, crt, key, address))
        assert error.code == "PERMISSION_DENIED", san
    cert = issue_client_cert(ca, "nobody", extra_san=[x509.DNSName("dns-reader")])
    crt, key = write_pem_files(tmp_path, "dns", *cert)
    assert await _discover(_with_client_cert(daemon, crt, key, address)) == "host"


def test_a_server_certificate_valid_only_later_is_taken_with_a_warning(
    pki: PkiPaths, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients judge dates by their own clocks; a guest's may lag behind its host's at boot."""
    ca = load_ca(pki.ca_crt.parent)
    now = dt.datetime.now(dt.UTC)
    later = _issue(
        ca, ExtendedKeyUsageOID.SERVER_AUTH, now + dt.timedelta(hours=1), now + dt.timedelta(days=9)
    )
    crt, key = write_pem_files(tmp_path, "later", *later)
    check_server_credentials(pki.ca_crt, crt, key)
    assert f"server certificate {crt} is not valid yet" in caplog.text
    # Not yet valid, and from another CA: refused for that.
    other = issue_server_cert(create_ca("other"), SERVER_NAME, [], [])
    crt, key = write_pem_files(tmp_path, "other", *other)
    with pytest.raises(ConfigError, match="unable to get local issuer certificate"):
        check_server_credentials(pki.ca_crt, crt, key)
