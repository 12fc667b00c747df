"""Real and fake container registries on 127.0.0.1 for tests.

``LocalRegistry`` runs Debian's ``docker-registry`` (distribution 2.8) with filesystem storage in a
temporary directory, in one of three modes:

- ``"anonymous"``: no authentication at all;
- ``"basic"``: HTTP basic auth from an htpasswd file (bcrypt hashes) with ``users``;
- ``"token"``: bearer tokens. A ``TokenServer`` (a thread in this process) issues ES256 JWTs for the
  ``users`` (or anonymously for pulls when ``anonymous_pull``); the registry trusts them through
  ``rootcertbundle`` (the token carries its certificate in the ``x5c`` header).

Use it as a context manager; on exit the registry process is stopped (SIGTERM, then SIGKILL) and
its storage, config and credentials are deleted::

    with LocalRegistry(mode="basic", users={"alice": "secret"}) as registry:
        registry.url        # "http://127.0.0.1:<port>"
        registry.host       # "127.0.0.1:<port>", for image references
        registry.creds      # "alice:secret", for skopeo --dest-creds

``FakeRegistry`` is a tiny programmable HTTP server for failure cases a real registry never
produces (junk manifests, blobs whose bytes do not match their digest): map (method, path) to a
``FakeResponse`` or give a handler function.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import bcrypt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from auraed.pki import PkiPaths
from tests.support import workers

REGISTRY_BINARY = "/usr/bin/docker-registry"
READY_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
TOKEN_SERVICE = "auraed-test-registry"
TOKEN_ISSUER = "auraed-test-token-issuer"
POLL_INTERVAL = 0.02  # how fast the in-process HTTP servers notice shutdown()

Mode = Literal["anonymous", "basic", "token"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller binds it soon after), of
    this test worker's own ports (``tests.support.workers``)."""
    return workers.free_port()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenKey:
    """An EC P-256 key and a self-signed certificate for it: signs registry JWTs (ES256)."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TOKEN_ISSUER)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def sign(self, claims: Mapping[str, object]) -> str:
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(der).decode()]}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


@dataclass
class TokenRequest:
    """What the token server saw: for asserting how often (and how) clients fetched tokens."""

    method: str
    user: str | None
    scopes: list[str]
    grant_type: str
    status: int


class TokenServer:
    """A registry token service (docker token auth spec) in a thread on 127.0.0.1.

    GET /token?service=..&scope=.. with optional basic credentials, and the OAuth2 form
    POST /token (grant_type=password or refresh_token). Authenticated users get every action they
    ask for; anonymous callers get "pull" when ``anonymous_pull``. Knobs for tests:

    - ``token_lifetime``: seconds until the JWT's ``exp`` (negative: already expired; the registry
      allows 60 s of clock leeway, so use < -60 for a token it refuses);
    - ``advertised_expires_in``: the ``expires_in`` told to clients (may lie, to make a client hold
      a token the registry no longer accepts);
    - ``refresh_tokens``: refresh token -> user, for identity-token (OAuth2 refresh) logins.
    """

    def __init__(self, users: Mapping[str, str], anonymous_pull: bool = False) -> None:
        self.users = dict(users)
        self.anonymous_pull = anonymous_pull
        self.key = TokenKey()
        self.token_lifetime = 300
        self.advertised_expires_in = 300
        self.refresh_tokens: dict[str, str] = {}
        self.requests: list[TokenRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(POLL_INTERVAL,), name="token-server", daemon=True
        )

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def issue(self, user: str | None, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            parts = scope.split(":")
            if len(parts) < 3:
                continue
            kind, name, actions = parts[0], ":".join(parts[1:-1]), parts[-1].split(",")
            granted = actions if user is not None else [a for a in actions if a == "pull"]
            if user is None and not self.anonymous_pull:
                granted = []
            if granted:
                access.append({"type": kind, "name": name, "actions": granted})
        now = int(time.time())
        claims = {
            "iss": TOKEN_ISSUER,
            "sub": user or "",
            "aud": TOKEN_SERVICE,
            "exp": now + self.token_lifetime,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        return self.key.sign(claims)

    def _record(self, request: TokenRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, status: int, body: Mapping[str, object]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _basic_user(self) -> tuple[bool, str | None]:
                header = self.headers.get("Authorization", "")
                if not header.startswith("Basic "):
                    return True, None
                try:
                    user, _, password = base64.b64decode(header[6:]).decode().partition(":")
                except ValueError:
                    return False, None
                return server.users.get(user) == password, user

            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                scopes = query.get("scope", [])
                ok, user = self._basic_user()
                if not ok:
                    server._record(TokenRequest("GET", user, scopes, "basic", 401))
                    self._reply(401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]})
                    return
                server._record(TokenRequest("GET", user, scopes, "basic" if user else "anonymous", 200))
                token = server.issue(user, scopes)
                issued = datetime.datetime.now(datetime.UTC).isoformat()
                self._reply(
                    200,
                    {
                        "token": token,
                        "access_token": token,
                        "expires_in": server.advertised_expires_in,
                        "issued_at": issued,
                    },
                )

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                grant = form.get("grant_type", [""])[0]
                scopes = " ".join(form.get("scope", [])).split()
                user: str | None = None
                if grant == "refresh_token":
                    user = server.refresh_tokens.get(form.get("refresh_token", [""])[0])
                elif grant == "password":
                    name = form.get("username", [""])[0]
                    user = name if server.users.get(name) == form.get("password", [""])[0] else None
                if user is None:
                    server._record(TokenRequest("POST", None, scopes, grant, 401))
                    self._reply(401, {"error": "invalid_grant"})
                    return
                server._record(TokenRequest("POST", user, scopes, grant, 200))
                token = server.issue(user, scopes)
                self._reply(200, {"access_token": token, "expires_in": server.advertised_expires_in})

        return Handler


class LocalRegistry:
    """A real ``docker-registry serve`` on 127.0.0.1:<free port>; see the module docstring."""

    def __init__(
        self,
        mode: Mode = "anonymous",
        users: Mapping[str, str] | None = None,
        anonymous_pull: bool = False,
    ) -> None:
        if mode != "anonymous" and not users:
            users = {"alice": "secret"}
        self.mode: Mode = mode
        self.users: dict[str, str] = dict(users or {})
        self.anonymous_pull = anonymous_pull
        self.port = 0
        self.workdir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.token_server: TokenServer | None = None

    # -- addresses and credentials ------------------------------------------------------------
    @property
    def host(self) -> str:
        """The registry part of image references: "127.0.0.1:<port>"."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def user(self) -> str:
        return next(iter(self.users))

    @property
    def password(self) -> str:
        return self.users[self.user]

    @property
    def creds(self) -> str | None:
        """The first user as "user:password" (skopeo --creds); None for an anonymous registry."""
        return None if self.mode == "anonymous" else f"{self.user}:{self.password}"

    @property
    def storage(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "storage"

    def log(self) -> str:
        if self.workdir is None or not (self.workdir / "registry.log").exists():
            return ""
        return (self.workdir / "registry.log").read_text(errors="replace")

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="auraed-registry-"))
        try:
            self.storage.mkdir()
            auth = self._auth_config()
            for attempt in range(3):  # the free port may be taken between probing and binding
                self.port = free_port()
                config = self.workdir / "config.yml"
                config.write_text(self._config(auth))
                if self._spawn(config, last=attempt == 2):
                    return
        except BaseException:
            self.stop()
            raise

    def _auth_config(self) -> str:
        assert self.workdir is not None
        if self.mode == "basic":
            htpasswd = self.workdir / "htpasswd"
            lines = [
                f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds=4)).decode()}\n"
                for user, pw in self.users.items()
            ]
            htpasswd.write_text("".join(lines))
            return f"auth:\n  htpasswd:\n    realm: auraed-test\n    path: {htpasswd}\n"
        if self.mode == "token":
            self.token_server = TokenServer(self.users, anonymous_pull=self.anonymous_pull)
            self.token_server.start()
            bundle = self.workdir / "token-ca.pem"
            bundle.write_bytes(self.token_server.key.cert_pem())
            return (
                "auth:\n  token:\n"
                f"    realm: {self.token_server.realm}\n"
                f"    service: {TOKEN_SERVICE}\n"
                f"    issuer: {TOKEN_ISSUER}\n"
                f"    rootcertbundle: {bundle}\n"
            )
        return ""

    def _config(self, auth: str) -> str:
        return (
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: {secrets.token_hex(16)}\n"
            f"{auth}"
        )

    def _spawn(self, config: Path, last: bool) -> bool:
        assert self.workdir is not None
        with (self.workdir / "registry.log").open("ab") as log:
            self.process = subprocess.Popen(
                [REGISTRY_BINARY, "serve", str(config)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                if "address already in use" in self.log() and not last:
                    return False
                raise RuntimeError(f"docker-registry exited early:\n{self.log()}")
            if self._answers():
                return True
            time.sleep(0.05)
        raise RuntimeError(f"docker-registry did not answer /v2/ within {READY_TIMEOUT}s:\n{self.log()}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/", timeout=1) as response:
                return int(response.status) == 200
        except urllib.error.HTTPError as error:
            return error.code == 401
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the registry and the token server, delete all their files. Idempotent."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        if self.token_server is not None:
            self.token_server.stop()
            self.token_server = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- helpers for tests ----------------------------------------------------------------------
    def auth_headers(self, repository: str) -> dict[str, str]:
        """Authorization for raw HTTP pushes to ``repository``: basic, or a pull+push token."""
        if self.mode == "basic":
            return {
                "Authorization": "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            }
        if self.mode == "token":
            assert self.token_server is not None
            token = self.token_server.issue(self.user, [f"repository:{repository}:pull,push"])
            return {"Authorization": f"Bearer {token}"}
        return {}

    def docker_config(self, path: Path, user: str | None = None, password: str | None = None) -> Path:
        """Write a docker config.json at ``path`` with an "auths" entry for this registry."""
        user = user or self.user
        password = password if password is not None else self.users[user]
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        path.write_text(json.dumps({"auths": {self.host: {"auth": auth}}}))
        return path


@dataclass
class FakeResponse:
    """``send_length=False`` omits Content-Length: the body ends when the connection closes.
    ``pace_s``: a slow link, the body sent PACE_CHUNK bytes at a time, pace_s apart.
    ``endless``: the body sent again and again (no Content-Length) until the client hangs up,
    or ENDLESS_MAX bytes, so that a client that never stops reading fails its test, not the machine."""

    status: int = 200
    body: bytes = b""
    headers: Mapping[str, str | list[str]] = field(default_factory=dict)  # a list: one header each
    send_length: bool = True
    pace_s: float = 0.0
    endless: bool = False


ENDLESS_MAX = 256 << 20


PACE_CHUNK = 64 << 10


FakeHandler = Callable[[str, str, Mapping[str, str]], FakeResponse | None]


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]


class FakeRegistry:
    """A programmable HTTP server on 127.0.0.1 that plays a broken registry.

    ``routes`` maps (method, path) to a response; ``handler(method, path, headers)`` is asked
    first when given and may return None to fall through. Unknown paths answer 404 with a registry
    style error body. GET /v2/ answers 200 unless routed otherwise. Requests are recorded in
    ``requests``. HEAD gets the GET route without body.
    """

    def __init__(
        self,
        routes: Mapping[tuple[str, str], FakeResponse] | None = None,
        handler: FakeHandler | None = None,
        tls: PkiPaths | None = None,
    ) -> None:
        self.routes: dict[tuple[str, str], FakeResponse] = dict(routes or {})
        self.handler = handler
        self.requests: list[SeenRequest] = []
        self.sent: dict[str, int] = {}  # path -> body bytes written so far
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.scheme = "http"
        if tls is not None:  # HTTPS with the PKI's server certificate (its SAN has 127.0.0.1)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.server_crt, tls.server_key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(POLL_INTERVAL,), name="fake-registry", daemon=True
        )

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def respond(self, method: str, path: str, headers: Mapping[str, str]) -> FakeResponse:
        if self.handler is not None:
            answer = self.handler(method, path, headers)
            if answer is not None:
                return answer
        lookup = "GET" if method == "HEAD" else method
        if (lookup, path) in self.routes:
            return self.routes[(lookup, path)]
        if path == "/v2/" and lookup == "GET":
            return FakeResponse(200, b"{}", {"Content-Type": "application/json"})
        body = json.dumps({"errors": [{"code": "NAME_UNKNOWN", "message": "not here"}]}).encode()
        return FakeResponse(404, body, {"Content-Type": "application/json"})

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _serve(self) -> None:
                path = urllib.parse.urlsplit(self.path).path
                headers = dict(self.headers.items())
                fake.requests.append(SeenRequest(self.command, path, headers))
                answer = fake.respond(self.command, path, headers)
                self.send_response(answer.status)
                sent = {k.lower() for k in answer.headers}
                for key, value in answer.headers.items():
                    for one in [value] if isinstance(value, str) else value:
                        self.send_header(key, one)
                if "content-length" not in sent and answer.send_length and not answer.endless:
                    self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if answer.endless:
                    self._send_endless(path, answer.body)
                    return
                step = PACE_CHUNK if answer.pace_s else max(len(answer.body), 1)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    for offset in range(0, len(answer.body), step):
                        self.wfile.write(answer.body[offset : offset + step])
                        self.wfile.flush()
                        fake.sent[path] = offset + len(answer.body[offset : offset + step])
                        time.sleep(answer.pace_s)

            def _send_endless(self, path: str, body: bytes) -> None:
                fake.sent[path] = 0
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    while fake.sent[path] < ENDLESS_MAX:
                        self.wfile.write(body)
                        fake.sent[path] += len(body)

            do_GET = _serve
            do_HEAD = _serve
            do_PUT = _serve
            do_POST = _serve

        return Handler


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (kernel backlog) but never answers: a hung registry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def processes_running(binary: str = REGISTRY_BINARY) -> list[int]:
    """PIDs of processes whose executable is ``binary`` and whose parent is this process."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "exe") != binary:
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            pids.append(int(entry.name))
    return pids
