"""An mTLS gRPC client for every aurae service, driven by the same proto descriptors as the server.

    async with AuraeClient.connect() as client:
        await client.call("aurae.cells.v0.CellService", "Allocate", request)
        async for item in client.stream("aurae.observe.v0.ObserveService", "GetSubProcessStream", request):
            ...

``client.service("aurae.cells.v0.CellService").allocate(request)`` is the same with method names in
snake_case.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import ssl
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import betterproto2
import grpc

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.errors import AuraeError, ErrorKind
from auraed.wire import codec, tls
from auraed.wire.channel import (
    DEFAULT_KEEPALIVE_TIME,
    DEFAULT_KEEPALIVE_TIMEOUT,
    MAX_KEEPALIVE_SECONDS,
    channel_options,
)
from auraed.wire.descriptors import message_class, service_descriptor, snake_case
from auraed.wire.metadata import VM_METADATA_KEY

CONFIG_PATHS = (Path("~/.aurae/config"), Path("/etc/aurae/config"))
DEFAULT_SERVER_NAME = "server.unsafe.aurae.io"
DEFAULT_SOCKET = "/var/run/aurae/aurae.sock"
# TCP ports are 16 bits; grpc takes a bigger one modulo 65536 (99999 is 34463), an empty one as 443.
MAX_PORT = 65535
# An address grpc reads as host:port, [IPv6]:port or IPv4:port, unless its "host" is one of
# grpc's URI schemes (unix:path, unix-abstract:name, dns:, ipv4:, ipv6:, vsock:).
HOST_PORT = re.compile(r"(?:\[[^\]]*\]|(?P<host>[^:/\[\]]*)):(?P<port>[^:/]*)")
GRPC_SCHEMES = frozenset({"unix", "unix-abstract", "dns", "ipv4", "ipv6", "vsock"})


class ClientError(AuraeError):
    """A call failed; ``code`` is the gRPC status code name and ``message`` the server's detail."""

    def __init__(self, code: str, message: str) -> None:
        kind = ErrorKind[code] if code in ErrorKind.__members__ else ErrorKind.UNAVAILABLE
        super().__init__(kind, message)
        self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    ca_crt: Path
    client_crt: Path
    client_key: Path
    # "unix:/path" or "host:port"
    address: str
    server_name: str = DEFAULT_SERVER_NAME
    keepalive_time: float = DEFAULT_KEEPALIVE_TIME  # 0: never ping
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT


def _config_file(explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    env = os.environ.get("AURAE_CONFIG")
    if env:
        return Path(env)
    for candidate in CONFIG_PATHS:
        path = candidate.expanduser()
        if path.exists():
            return path
    return None


def load_client_config(path: Path | None = None, address: str | None = None) -> ClientConfig:
    """Read an Aurae-style client config: [auth] ca_crt, client_crt, client_key; [system] socket or
    address, server_name, keepalive_time and keepalive_timeout (seconds; 0 time: never ping)."""
    config_path = _config_file(path)
    if config_path is None:
        raise ClientError(
            "FAILED_PRECONDITION",
            "no client config: pass --config, set AURAE_CONFIG, or "
            "create ~/.aurae/config (see `aer pki init`)",
        )
    try:
        table = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise _config_error(config_path, f"not UTF-8 text (byte {exc.start})") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise _config_error(config_path, str(exc)) from exc
    auth, system = _table(table, "auth", config_path), _table(table, "system", config_path)
    base = config_path.parent

    def resolve(key: str) -> Path:
        if key not in auth:
            raise _config_error(config_path, f"missing [auth] {key}")
        return (base / Path(_text(auth, "auth", key, "", config_path)).expanduser()).resolve()

    socket = _text(system, "system", "socket", DEFAULT_SOCKET, config_path)
    target = address or _text(system, "system", "address", "", config_path) or f"unix:{socket}"
    if not _is_text(target):
        raise _config_error(config_path, f"the address {target!r} is not valid UTF-8 text")
    if problem := _address_problem(target):
        where = "" if address else f"{config_path}: "  # the caller's own, or the file's
        raise ClientError("FAILED_PRECONDITION", f"{where}the address {target!r}: {problem}")
    return ClientConfig(
        ca_crt=resolve("ca_crt"),
        client_crt=resolve("client_crt"),
        client_key=resolve("client_key"),
        address=target if ":" in target else f"unix:{target}",
        server_name=_text(system, "system", "server_name", DEFAULT_SERVER_NAME, config_path),
        keepalive_time=_seconds(system, "keepalive_time", DEFAULT_KEEPALIVE_TIME, config_path),
        keepalive_timeout=_seconds(
            system, "keepalive_timeout", DEFAULT_KEEPALIVE_TIMEOUT, config_path, zero=False
        ),
    )


def _address_problem(target: str) -> str:
    """Why grpc would not connect to ``target`` as it reads ("" when it would): a host:port's port
    must be 1 to MAX_PORT, where grpc would quietly connect elsewhere."""
    match = HOST_PORT.fullmatch(target)
    if match is None or match["host"] in GRPC_SCHEMES:
        return ""
    port = match["port"]
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= MAX_PORT:
        return f"the port must be a number from 1 to {MAX_PORT}"
    return ""


def client_config_text(ca_crt: Path, client_crt: Path, client_key: Path, socket: str | Path) -> str:
    """A client config that :func:`load_client_config` reads: these credentials, a unix socket."""

    def quoted(value: object) -> str:  # a JSON string is a valid TOML basic string
        return json.dumps(str(value))

    return (
        f"[auth]\nca_crt = {quoted(ca_crt)}\n"
        f"client_crt = {quoted(client_crt)}\nclient_key = {quoted(client_key)}\n\n"
        f"[system]\nsocket = {quoted(socket)}\n"
    )


def _config_error(config_path: Path, problem: str) -> ClientError:
    return ClientError("FAILED_PRECONDITION", f"{config_path}: {problem}")


def _table(table: dict[str, Any], key: str, config_path: Path) -> dict[str, Any]:
    value = table.get(key, {})
    if not isinstance(value, dict):
        raise _config_error(config_path, f"[{key}] must be a table")
    return value


def _is_text(value: str) -> bool:
    """Printable UTF-8: an --address with bytes that are not UTF-8 arrives as surrogates."""
    return value.isprintable()


def _text(table: dict[str, Any], section: str, key: str, default: str, config_path: Path) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not _is_text(value) or (key in table and not value):
        raise _config_error(config_path, f"[{section}] {key} must be a non-empty string, not {value!r}")
    return value


def _seconds(system: dict[str, Any], key: str, default: float, config_path: Path, zero: bool = True) -> float:
    value = system.get(key, default)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 <= value <= MAX_KEEPALIVE_SECONDS or (value == 0 and not zero):
        least = ">= 0" if zero else "> 0"
        raise _config_error(
            config_path, f"[system] {key} must be seconds ({least}, at most {MAX_KEEPALIVE_SECONDS:.0f})"
        )
    return float(value)


def _precondition(message: str) -> ClientError:
    return ClientError("FAILED_PRECONDITION", message)


def _check_credentials(config: ClientConfig, ca_crt: bytes, client_crt: bytes) -> None:
    """Refuse files grpc cannot use, naming them: grpc only logs its reasons (several lines in
    its developers' words) and fails every call with "Failed to create security handshaker"."""
    for path, data, what in ((config.ca_crt, ca_crt, "CA"), (config.client_crt, client_crt, "client")):
        if not tls.holds_certificate(data):
            raise _precondition(f"the {what} certificate {path} holds no PEM certificate")
    context = tls.context_as_grpc(server_side=False)  # a key grpc would use must not be refused here
    try:
        tls.load_key_pair(context, config.client_crt, config.client_key)
    except ssl.SSLError as exc:
        problem = (
            f"is not the key of the client certificate {config.client_crt}"
            if tls.is_key_mismatch(exc)
            else "holds no unencrypted PEM private key"
        )
        raise _precondition(f"the client key {config.client_key} {problem}") from None
    except OSError as exc:  # changed since it was read
        raise _precondition(f"cannot read {exc.filename}: {exc.strerror}") from None


def channel_for(config: ClientConfig) -> grpc.aio.Channel:
    ca_crt = tls.read_credential(config.ca_crt, "CA certificate", _precondition)
    client_key = tls.read_credential(config.client_key, "client key", _precondition)
    client_crt = tls.read_credential(config.client_crt, "client certificate", _precondition)
    _check_credentials(config, ca_crt, client_crt)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca_crt, private_key=client_key, certificate_chain=client_crt
    )
    options = [
        *channel_options(config.keepalive_time, config.keepalive_timeout),
        ("grpc.ssl_target_name_override", config.server_name),
        ("grpc.default_authority", config.server_name),
    ]
    return grpc.aio.secure_channel(config.address, credentials, options=options)


def _client_error(exc: grpc.aio.AioRpcError, config: ClientConfig | None) -> ClientError:
    details = exc.details() or ""
    if config is not None and (hint := connection_hint(exc.code(), details, config)):
        return ClientError("UNAVAILABLE", f"cannot reach auraed at {config.address}: {hint} [{details}]")
    return ClientError(exc.code().name, details)


# How grpc reports a server that refused the client's certificate: a hang-up, worded by where the
# client was at that moment, or a TLS alert naming the reason.
REFUSED_CLIENT_CERTIFICATE = (
    "Socket closed",
    "Connection reset",
    "Broken pipe",
    "alert unknown ca",
    "alert bad certificate",
    "alert certificate",  # required, expired, unknown, revoked
    "alert unsupported certificate",
)


def connection_hint(code: grpc.StatusCode, details: str, config: ClientConfig) -> str:
    """What a failure to connect most likely means, in the client config's terms ("" when unsure).

    grpc words these for its own developers ("Socket closed" for a client certificate the server
    refused); the original text stays in the message.
    """
    if code != grpc.StatusCode.UNAVAILABLE or not details.startswith("failed to connect to all addresses"):
        return ""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return f"its certificate is not signed by the CA in {config.ca_crt}, or has expired"
    if "Hostname Verification Check failed" in details:
        return (
            f"its certificate does not name {config.server_name!r} (server_name under [system] in the "
            "client config)"
        )
    if any(words in details for words in REFUSED_CLIENT_CERTIFICATE):
        return (
            "it ended the TLS handshake: it may not accept the client certificate "
            f"{config.client_crt} (from another CA, or expired)"
        )
    if "Connection refused" in details or "No such file or directory" in details:
        return "nothing accepts connections there"
    return ""


def log_lines(reply: containers_pb.ContainerServiceLogsResponse) -> list[containers_pb.LogLine]:
    """The lines of a ContainerService.Logs reply, also from an auraed that sent one line a message
    in ``line``, ``stream`` and ``timestamp`` (a guest still running an older image): such a reply
    always names its stream."""
    if reply.lines or not reply.stream:
        return list(reply.lines)
    return [containers_pb.LogLine(line=reply.line, stream=reply.stream, timestamp=reply.timestamp)]


def _decoded(response: type[betterproto2.Message], data: bytes) -> Any:
    try:
        return codec.decode(response, data)
    except codec.CodecError as exc:
        raise ClientError("INTERNAL", f"the server's reply cannot be read: {exc}") from None


class _Requests:
    """A call's request, or stream of requests, encoded before grpc takes it.

    A request that cannot be encoded (a value out of its field's range) is the caller's mistake:
    INVALID_ARGUMENT, raised here for one request. When a stream's request fails, grpc cancels
    the call (the caller sees CancelledError or CANCELLED); the encoding error is raised instead.
    """

    def __init__(self, payload: Any) -> None:
        self._payload = payload
        self._error: codec.CodecError | None = None

    def encoded(self) -> Any:
        if isinstance(self._payload, betterproto2.Message):
            try:
                return codec.encode(self._payload)
            except codec.CodecError as exc:
                raise ClientError("INVALID_ARGUMENT", str(exc)) from None
        return self._stream()

    async def _stream(self) -> AsyncIterator[bytes]:
        async for message in self._payload:
            try:
                data = codec.encode(message)
            except codec.CodecError as exc:
                self._error = exc
                raise
            yield data

    def failure(self, exc: grpc.aio.AioRpcError, config: ClientConfig | None) -> ClientError:
        self.raise_encoding_failure()
        return _client_error(exc, config)

    def raise_encoding_failure(self) -> None:
        if self._error is not None:
            raise ClientError("INVALID_ARGUMENT", str(self._error)) from None


# (client streaming, server streaming) -> the AuraeClient method that makes that kind of call
_CALLS = {(False, False): "call", (False, True): "stream", (True, False): "upload", (True, True): "duplex"}


class ServiceStub:
    """Methods of one service, as snake_case attributes, from its descriptor."""

    def __init__(self, client: AuraeClient, service: str) -> None:
        descriptor = service_descriptor(service)
        for method in descriptor.methods:
            # Each kind of method has its own call: a stream of requests given to one that takes a
            # single one reached grpc as such, and failed there with a TypeError.
            kind = _CALLS[method.client_streaming, method.server_streaming]

            def call(
                request: Any, timeout: float | None = None, _m: str = method.name, _k: str = kind
            ) -> Any:
                return getattr(client, _k)(service, _m, request, timeout)

            setattr(self, snake_case(method.name), call)

    def __getattr__(self, name: str) -> Any:  # for type checkers: attributes are set in __init__
        raise AttributeError(name)


class AuraeClient:
    """``vm``: send every ContainerService call to that VM's guest, through the host. ``config``,
    when known, words a failure to connect in its terms."""

    def __init__(self, channel: grpc.aio.Channel, vm: str = "", config: ClientConfig | None = None) -> None:
        self.channel = channel
        self.config = config
        self._metadata = ((VM_METADATA_KEY, vm),) if vm else None

    @classmethod
    def connect(cls, config: ClientConfig | None = None, vm: str = "") -> AuraeClient:
        config = config or load_client_config()
        return cls(channel_for(config), vm, config)

    async def __aenter__(self) -> AuraeClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def service(self, name: str) -> ServiceStub:
        return ServiceStub(self, name)

    def _response_class(self, service: str, method: str) -> type[betterproto2.Message]:
        descriptor = service_descriptor(service)
        return message_class(descriptor.methods_by_name[method].output_type.full_name)

    def _callable(self, kind: str, service: str, method: str) -> Any:
        """grpc's multicallable of ``kind`` ("unary_unary", "stream_stream", ...) for one method.

        Bytes in and out: requests are encoded (see _Requests) and replies decoded (_decoded)
        here, not by grpc's hooks, which log a failing hook and carry on with an empty request
        or a reply of None.
        """
        return getattr(self.channel, kind)(f"/{service}/{method}")

    async def _one_reply(
        self, kind: str, service: str, method: str, payload: Any, timeout: float | None
    ) -> Any:
        requests = _Requests(payload)
        try:
            reply = await self._callable(kind, service, method)(
                requests.encoded(), timeout=timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise requests.failure(exc, self.config) from None
        except asyncio.CancelledError:
            requests.raise_encoding_failure()
            raise
        return _decoded(self._response_class(service, method), reply)

    async def _replies(
        self, kind: str, service: str, method: str, payload: Any, timeout: float | None
    ) -> AsyncIterator[Any]:
        response = self._response_class(service, method)
        requests = _Requests(payload)
        call = self._callable(kind, service, method)(
            requests.encoded(), timeout=timeout, metadata=self._metadata
        )
        try:
            async for reply in call:
                yield _decoded(response, reply)
        except grpc.aio.AioRpcError as exc:
            raise requests.failure(exc, self.config) from None
        except asyncio.CancelledError:
            requests.raise_encoding_failure()
            raise
        finally:
            call.cancel()

    async def call(
        self, service: str, method: str, request: betterproto2.Message, timeout: float | None = None
    ) -> Any:
        return await self._one_reply("unary_unary", service, method, request, timeout)

    def stream(
        self, service: str, method: str, request: betterproto2.Message, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        return self._replies("unary_stream", service, method, request, timeout)

    def duplex(
        self,
        service: str,
        method: str,
        requests: AsyncIterator[betterproto2.Message],
        timeout: float | None = None,
    ) -> AsyncIterator[Any]:
        """A bidirectional-streaming call: send ``requests``, yield the replies as they come."""
        return self._replies("stream_stream", service, method, requests, timeout)

    async def upload(
        self,
        service: str,
        method: str,
        requests: AsyncIterator[betterproto2.Message],
        timeout: float | None = None,
    ) -> Any:
        """A client-streaming call: send ``requests``, return the one reply."""
        return await self._one_reply("stream_unary", service, method, requests, timeout)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health status name (SERVING, NOT_SERVING, SERVICE_UNKNOWN) of ``service``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and not exc.details():
                # grpc's health service says nothing more; "aer: NOT_FOUND:" alone named nothing
                raise ClientError("NOT_FOUND", f"no health status for the service {service!r}") from None
            raise _client_error(exc, self.config) from None
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
