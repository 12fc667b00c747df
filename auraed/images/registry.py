"""A registry client (OCI distribution API) for pulls: resolve a reference, stream verified blobs.

Synchronous (the daemon calls it from worker threads); thread-safe.

What it does, and why it is not built on ``oras`` (tried first, as the design said: every
request goes through ``requests`` directly because each oras request path has a flaw that
matters for a runtime: its request decorator retries for ~131 s before failing, it reuses a stale
bearer token forever, it re-serializes manifests (changing their digest), it ignores image indexes
and it never verifies what it downloads):

- Manifests are fetched raw with an Accept header for OCI index/manifest and Docker manifest
  list/schema 2; the exact bytes are kept and their digest is checked against the reference's
  digest, the index descriptor, or the registry's Docker-Content-Digest header.
- An image index (or Docker manifest list) is resolved to the client's platform, linux/amd64 by
  default, matching os and architecture (a variant-less entry, or "v1", is preferred over other
  variants). If the index offers none, the error (kind "not_found") lists the platforms offered.
- Blobs stream as an iterator of chunks; the byte count and the digest are checked as they arrive.
  A blob longer than its descriptor fails at once; a short or corrupt one fails at the end, and the
  last chunk is held back until the check passed, so a mismatch never hands out the whole blob.
- Auth: anonymous, HTTP basic, and bearer tokens (docker token spec: WWW-Authenticate Bearer
  realm/service/scope; token fetched with basic credentials when given, an OAuth2 refresh-token
  POST for an identity token, or a registry token used as is). Tokens are cached per endpoint,
  repository and credentials until they expire; a token the registry refuses (401) is dropped and
  fetched again ONCE per request, then the request fails as "unauthorized". 403 is final.
- Credentials come from the call (``Credentials``, mirroring the API's RegistryAuth) or else from
  a docker config.json ("auths" entries: "auth" base64 user:pass, "username"/"password",
  "identitytoken", "registrytoken"); credHelpers/credsStore are not run (a log line says so).
  Explicit credentials go only to the reference's own registry, never to its mirrors; a mirror
  gets the config.json entry for its own host, if any.
- Hosts (in the spirit of containerd's hosts.toml): ``RegistryHostConfig`` per registry as it is
  spelled in references ("docker.io", "registry.k8s.io", "127.0.0.1:5000"). Its ``mirrors`` are
  tried in order before the upstream. ``insecure`` means plain HTTP to the upstream and to mirrors
  given without a scheme; ``skip_verify`` means HTTPS without certificate verification; ``ca_file``
  adds a CA bundle. A loopback registry (localhost, 127.x, ::1) without a host config is spoken to
  over plain HTTP, as docker does by default.
- Credentials go only to the registry itself (and the token service its challenge names): a 401
  from a host the registry redirected to is final, since its challenge could name any service;
  an HTTPS registry's token service must be HTTPS too (or on loopback) to be sent credentials.
- Bounded failure: connect timeout 5 s, read timeout ``timeout`` (30 s), and ``timeout`` for a
  whole manifest or token answer; at most MAX_REDIRECTS redirects; only the first ERROR_BODY_MAX
  bytes of an error answer are read. A refused or reset
  connection is retried once per endpoint, timeouts are not retried; then the next mirror, then a
  ``RegistryError`` naming the registry, repository, what was fetched and what each endpoint said.
  No HTTP status is retried. Kinds: "not_found" (404, or no manifest for the platform),
  "unauthorized" (401/403 after authenticating), "unavailable" (connection failure, timeout, 5xx,
  429, TLS failure), "invalid" (the registry answered garbage: junk JSON, a malformed
  descriptor, a digest or size mismatch, an unexpected status), "unsupported" (a well-formed
  answer that is not a container image this client runs: schema 1, an artifact, a media type).
  With mirrors, the kind is the upstream's (the last endpoint's).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import requests
import urllib3.exceptions

from auraed.images.model import DOCKER_MANIFEST, DOCKER_MANIFEST_LIST, OCI_INDEX, OCI_MANIFEST
from auraed.references import (
    DEFAULT_REGISTRY,
    DEFAULT_REGISTRY_HOST,
    LEGACY_DEFAULT_REGISTRY,
    ImageReference,
    ReferenceError,
    check_digest,
)

log = logging.getLogger(__name__)

DOCKER_SCHEMA1 = (
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
)
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
ACCEPT = ", ".join([OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST])
CONFIG_TYPES = frozenset(
    {"application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"}
)
LAYER_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }
)
ATTESTATION_ANNOTATION = "vnd.docker.reference.type"

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 8 << 20
MAX_TOKEN_BYTES = 1 << 20  # a token answer: JWTs are a few KiB
ERROR_BODY_MAX = 64 << 10  # what is read of an error answer, for its message
MAX_REDIRECTS = 5  # requests' default, 30, would let a slow redirect loop run for minutes
MAX_INDEX_DEPTH = 2
CONNECT_TIMEOUT = 5.0
CONNECTION_RETRY_DELAY = 0.2
CHUNK_SIZE = 1 << 20
TOKEN_DEFAULT_LIFETIME = 60  # seconds; the token spec's minimum and default
TOKEN_EXPIRY_MARGIN = 5.0
CLIENT_ID = "auraed"

Kind = Literal["not_found", "unauthorized", "unavailable", "invalid", "unsupported"]
T = TypeVar("T")


class RegistryError(Exception):
    """A pull step that failed; ``kind`` is one of not_found, unauthorized, unavailable, invalid,
    unsupported (see the module docstring)."""

    def __init__(self, kind: Kind, message: str, registry: str = "", repository: str = "") -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message
        self.registry = registry
        self.repository = repository


class _EndpointError(Exception):
    """One endpoint's failure; the caller moves on to the next endpoint or reports them all."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message


@dataclass(frozen=True)
class Credentials:
    """Credentials for one pull, as the API's RegistryAuth carries them. Secrets stay out of repr."""

    username: str = ""
    password: str = field(default="", repr=False)
    registry_token: str = field(default="", repr=False)  # a bearer token, used as is
    identity_token: str = field(default="", repr=False)  # an OAuth2 refresh token

    @classmethod
    def from_auth(cls, auth: Any) -> Credentials | None:
        """From anything shaped like RegistryAuth (the proto message); None when it is all empty."""
        if auth is None:
            return None
        if isinstance(auth, Credentials):
            return auth if not auth.empty else None
        creds = cls(
            str(getattr(auth, "username", "") or ""),
            str(getattr(auth, "password", "") or ""),
            str(getattr(auth, "registry_token", "") or ""),
            str(getattr(auth, "identity_token", "") or ""),
        )
        return None if creds.empty else creds

    @property
    def empty(self) -> bool:
        return not (self.username or self.password or self.registry_token or self.identity_token)

    @property
    def has_basic(self) -> bool:
        return bool(self.username) and bool(self.password)

    def basic_header(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()

    def fingerprint(self) -> str:
        """Keys the token cache: a token fetched with some credentials is only reused with them."""
        material = "\0".join((self.username, self.password, self.registry_token, self.identity_token))
        return hashlib.sha256(material.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RegistryHostConfig:
    """How to reach one registry (named as in references: "docker.io", "127.0.0.1:5000").

    ``mirrors``: base URLs ("http://127.0.0.1:5000", "https://mirror.example/v2" is fine too) tried
    in order before the upstream; a mirror without scheme gets http when ``insecure``, else https.
    ``insecure``: plain HTTP to the upstream. ``skip_verify``: HTTPS without certificate checks.
    ``ca_file``: a PEM bundle to verify the registry's (and its mirrors') certificates with.
    """

    host: str
    mirrors: Sequence[str] = ()
    insecure: bool = False
    skip_verify: bool = False
    ca_file: Path | None = None


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict[str, Any] | None = None
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResolvedManifest:
    """The image manifest a reference resolved to, byte for byte, with its parsed descriptors."""

    reference: ImageReference
    digest: str  # sha256 of ``raw`` (also when the reference pinned a sha512 digest)
    media_type: str
    raw: bytes
    config: Descriptor
    layers: tuple[Descriptor, ...]
    index_digest: str | None = None  # the index it was selected from, if any
    platform: dict[str, Any] | None = None  # as the index described it
    endpoint: str = ""  # the base URL that served it (a mirror or the upstream)

    @property
    def total_size(self) -> int:
        return sum(layer.size for layer in self.layers)


@dataclass(frozen=True)
class _Endpoint:
    base: str  # "https://registry-1.docker.io", without /v2
    host: str  # its host[:port], for credential lookup
    verify: bool | str
    mirror: bool


@dataclass(frozen=True)
class _Challenge:
    scheme: str  # lowercase: "basic", "bearer"
    params: dict[str, str]


@dataclass
class _Token:
    value: str
    expires_at: float


_CHALLENGE_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*)\s*,?')


def parse_challenge(header: str) -> _Challenge | None:
    """``Bearer realm="https://x/token",service="x",scope="repository:a:pull"`` -> scheme + params."""
    scheme, _, rest = header.strip().partition(" ")
    if not scheme:
        return None
    params: dict[str, str] = {}
    position = 0
    while position < len(rest):
        match = _CHALLENGE_PARAM.match(rest, position)
        if match is None or match.end() == position:
            break
        name, value = match.group(1).lower(), match.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[name] = value
        position = match.end()
    return _Challenge(scheme.lower(), params)


def _preferred_challenge(response: requests.Response) -> _Challenge | None:
    """The challenge to answer: Bearer when the registry offers it next to others (one
    WWW-Authenticate header each), as docker does: it works anonymously, Basic needs a password."""
    headers = response.raw.headers.getlist("WWW-Authenticate") if response.raw is not None else []
    challenges = [c for c in map(parse_challenge, headers) if c is not None]
    bearer = [c for c in challenges if c.scheme == "bearer"]
    preferred = bearer or challenges
    return preferred[0] if preferred else None


def _is_loopback(host: str) -> bool:
    name = host
    if name.startswith("["):
        name = name[1 : name.find("]")]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _normalize_config_key(key: str) -> str:
    """A config.json "auths" key ("https://index.docker.io/v1/", "host:5000") -> "host:5000"."""
    host = key
    if "://" in host:
        host = urllib.parse.urlsplit(host).netloc
    host = host.split("/", 1)[0]
    if host in (LEGACY_DEFAULT_REGISTRY, DEFAULT_REGISTRY_HOST):
        return DEFAULT_REGISTRY
    return host


def _origin(url: str) -> tuple[str, str]:
    """Scheme and host[:port] of ``url``, lowercase: what decides where credentials may go."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _downgrades(registry: str, realm: str) -> bool:
    """Whether a token service at ``realm`` would carry the registry's HTTPS traffic's secrets
    over plain HTTP to another machine (loopback stays on this one)."""
    scheme, netloc = _origin(realm)
    return _origin(registry)[0] == "https" and scheme == "http" and not _is_loopback(netloc)


def _digest_of(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def _error_detail(response: requests.Response) -> str:
    """The registry's error codes and messages from the body, or the start of the body.

    Reads at most ERROR_BODY_MAX bytes: an error answer may be endless (a hostile registry)."""
    try:
        head = next(response.iter_content(ERROR_BODY_MAX), b"")
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError):
        return f"HTTP {response.status_code}"
    text = head.decode(response.encoding or "utf-8", errors="replace") if head else ""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("errors"), list):
        parts = []
        for error in doc["errors"]:
            if isinstance(error, dict):
                parts.append(f"{error.get('code', '?')}: {error.get('message', '')}".strip())
        if parts:
            return f"HTTP {response.status_code} ({'; '.join(parts)})"
    snippet = " ".join(text.split())[:200]
    return f"HTTP {response.status_code}" + (f" ({snippet})" if snippet else "")


def _status_error(response: requests.Response, what: str) -> _EndpointError:
    status = response.status_code
    detail = _error_detail(response)
    if status == 404:
        return _EndpointError("not_found", f"{what} not found: {detail}")
    if status in (401, 403):
        return _EndpointError("unauthorized", f"{what}: access denied: {detail}")
    if status == 429 or status >= 500:
        return _EndpointError("unavailable", f"{what}: registry failed: {detail}")
    return _EndpointError("invalid", f"{what}: unexpected answer {detail}")


class BlobStream(Iterator[bytes]):
    """The chunks of one blob, checked against its descriptor as they arrive.

    More bytes than the descriptor's size fail at once; at the end of the stream the size and
    digest are checked before the last chunk is handed out, so a consumer never receives a
    complete corrupt blob. Always ``close()`` it (or use ``with``) when abandoning it early.
    """

    def __init__(
        self, response: requests.Response, descriptor: Descriptor, what: str, chunk_size: int
    ) -> None:
        self._response = response
        self._descriptor = descriptor
        self._what = what
        self._source = response.raw.stream(chunk_size, decode_content=False)
        algorithm = descriptor.digest.split(":", 1)[0]
        self._hash = hashlib.new(algorithm)
        self._algorithm = algorithm
        self._held = b""
        self._done = False
        self.bytes_read = 0

    def __iter__(self) -> Self:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._done = True
        self._response.close()

    def _fail(self, kind: Kind, problem: str) -> RegistryError:
        self.close()
        return RegistryError(kind, f"{self._what}: {problem}")

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        while True:
            try:
                chunk = next(self._source)
            except StopIteration:
                return self._finish()
            except (urllib3.exceptions.HTTPError, requests.RequestException, OSError) as exc:
                raise self._fail(
                    "unavailable",
                    f"download broke off after {self.bytes_read} of {self._descriptor.size} bytes: {exc}",
                ) from None
            if not chunk:
                continue
            self.bytes_read += len(chunk)
            if self.bytes_read > self._descriptor.size:
                raise self._fail(
                    "invalid",
                    f"registry sent more than the {self._descriptor.size} bytes the manifest declares",
                )
            self._hash.update(chunk)
            held, self._held = self._held, chunk
            if held:
                return held

    def _finish(self) -> bytes:
        if self.bytes_read != self._descriptor.size:
            raise self._fail(
                "invalid",
                f"size mismatch: got {self.bytes_read} bytes, the manifest declares {self._descriptor.size}",
            )
        actual = f"{self._algorithm}:{self._hash.hexdigest()}"
        if actual != self._descriptor.digest:
            raise self._fail("invalid", f"digest mismatch: the bytes received hash to {actual}")
        self.close()
        last, self._held = self._held, b""
        if not last:
            raise StopIteration
        return last


class RegistryClient:
    """Pulls from OCI registries; see the module docstring for the behaviour."""

    def __init__(
        self,
        hosts: Mapping[str, RegistryHostConfig] | Iterable[RegistryHostConfig] | None = None,
        docker_config: Path | None = None,
        timeout: float = 30.0,
        platform: tuple[str, str] = ("linux", "amd64"),
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        if hosts is None:
            self._hosts: dict[str, RegistryHostConfig] = {}
        elif isinstance(hosts, Mapping):
            self._hosts = dict(hosts)
        else:
            self._hosts = {config.host: config for config in hosts}
        self._docker_config = docker_config
        self._timeout = timeout
        self._connect_timeout = min(connect_timeout, timeout)
        self.platform = platform
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._tokens: dict[tuple[str, str, str], _Token] = {}
        self._basic_endpoints: set[str] = set()
        self._config_cache: tuple[tuple[str, int, int], dict[str, Credentials]] | None = None
        self._warned_helpers: set[str] = set()
        unverified = sorted(host for host, config in self._hosts.items() if config.skip_verify)
        if unverified:
            log.warning(
                "registries %s: TLS certificates are not verified (skip_verify)", ", ".join(unverified)
            )
            # Said once, here: urllib3 would warn again on stderr at every request.
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------------
    def resolve(self, ref: ImageReference, auth: Credentials | None = None) -> ResolvedManifest:
        """The image manifest ``ref`` names, following an index to this client's platform."""
        creds = Credentials.from_auth(auth)
        what = f"manifest {ref.manifest_reference}"
        raw, media_type, endpoint = self._fetch_manifest(
            ref,
            ref.manifest_reference,
            expected_digest=ref.digest,
            expected_size=None,
            creds=creds,
            what=what,
        )
        digest = _digest_of(raw)
        index_digest: str | None = None
        platform: dict[str, Any] | None = None
        depth = 0
        while media_type in INDEX_TYPES:
            depth += 1
            if depth > MAX_INDEX_DEPTH:
                raise self._error(
                    ref, "invalid", f"{what}: image indexes nested deeper than {MAX_INDEX_DEPTH}"
                )
            index_digest = index_digest or digest
            child = self._select_platform(ref, raw, what)
            platform = child.platform
            what = f"manifest {child.digest} (for {'/'.join(self.platform)} in {what})"
            raw, media_type, endpoint = self._fetch_manifest(
                ref,
                child.digest,
                expected_digest=child.digest,
                expected_size=child.size,
                creds=creds,
                what=what,
            )
            digest = _digest_of(raw)
        config, layers = self._parse_image_manifest(ref, raw, what)
        return ResolvedManifest(
            ref, digest, media_type, raw, config, layers, index_digest, platform, endpoint
        )

    def fetch_blob(
        self,
        ref: ImageReference,
        descriptor: Descriptor,
        auth: Credentials | None = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> BlobStream:
        """The blob's bytes as verified chunks. The request is made now (a missing blob raises here)."""
        creds = Credentials.from_auth(auth)
        what = f"blob {descriptor.digest}"
        try:
            check_digest(descriptor.digest)
        except ReferenceError as exc:
            raise self._error(ref, "invalid", f"{what}: {exc}") from None

        def attempt(endpoint: _Endpoint) -> tuple[requests.Response, _Endpoint]:
            headers = {"Accept-Encoding": "identity"}
            response = self._request(
                endpoint, ref, f"/blobs/{descriptor.digest}", headers=headers, creds=creds, what=what
            )
            if response.status_code != 200:
                with contextlib.closing(response):
                    raise _status_error(response, what)
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) != descriptor.size:
                response.close()
                raise _EndpointError(
                    "invalid",
                    f"{what}: Content-Length {length}, the manifest declares {descriptor.size} bytes",
                )
            return response, endpoint

        response, endpoint = self._on_endpoints(ref, what, attempt)
        return BlobStream(
            response, descriptor, self._describe(ref, f"{what} from {endpoint.base}"), chunk_size
        )

    def fetch_blob_bytes(
        self,
        ref: ImageReference,
        descriptor: Descriptor,
        auth: Credentials | None = None,
        limit: int = MAX_CONFIG_BYTES,
    ) -> bytes:
        """A small blob (an image config) in memory, verified; larger than ``limit`` is refused."""
        if descriptor.size > limit:
            raise self._error(
                ref,
                "invalid",
                f"blob {descriptor.digest}: {descriptor.size} bytes is over the {limit} byte limit",
            )
        with self.fetch_blob(ref, descriptor, auth) as stream:
            return b"".join(stream)

    # -- manifests --------------------------------------------------------------------------------
    def _fetch_manifest(
        self,
        ref: ImageReference,
        reference: str,
        *,
        expected_digest: str | None,
        expected_size: int | None,
        creds: Credentials | None,
        what: str,
    ) -> tuple[bytes, str, str]:
        """Raw manifest bytes, media type and serving endpoint; digests checked at each endpoint."""

        def attempt(endpoint: _Endpoint) -> tuple[bytes, str, str]:
            response = self._request(
                endpoint, ref, f"/manifests/{reference}", headers={"Accept": ACCEPT}, creds=creds, what=what
            )
            with contextlib.closing(response):
                if response.status_code != 200:
                    raise _status_error(response, what)
                raw = self._read_limited(response, MAX_MANIFEST_BYTES, what)
                header_digest = response.headers.get("Docker-Content-Digest", "")
                content_type = response.headers.get("Content-Type", "")
            if expected_size is not None and len(raw) != expected_size:
                raise _EndpointError(
                    "invalid", f"{what}: {len(raw)} bytes, the index declares {expected_size}"
                )
            if expected_digest is not None:
                actual = _digest_of(raw, expected_digest.split(":", 1)[0])
                if actual != expected_digest:
                    raise _EndpointError(
                        "invalid", f"{what}: digest mismatch: the bytes received hash to {actual}"
                    )
            algorithm = header_digest.split(":", 1)[0]
            if algorithm in ("sha256", "sha512") and _digest_of(raw, algorithm) != header_digest:
                raise _EndpointError(
                    "invalid",
                    f"{what}: the body hashes to {_digest_of(raw, algorithm)}, "
                    f"the registry says Docker-Content-Digest {header_digest}",
                )
            return raw, self._manifest_media_type(raw, content_type, what), endpoint.base

        return self._on_endpoints(ref, what, attempt)

    def _read_limited(self, response: requests.Response, limit: int, what: str) -> bytes:
        """A small answer (a manifest, a token) whole: at most ``limit`` bytes, within the
        client's timeout overall (the socket's timeout alone lets a byte at a time go on)."""
        parts: list[bytes] = []
        total = 0
        deadline = time.monotonic() + self._timeout
        try:
            for chunk in response.iter_content(65536):
                total += len(chunk)
                if total > limit:
                    raise _EndpointError("invalid", f"{what}: larger than {limit} bytes")
                if time.monotonic() > deadline:
                    raise _EndpointError(
                        "unavailable", f"{what}: not received within {self._timeout:g}s ({total} bytes)"
                    )
                parts.append(chunk)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _EndpointError("unavailable", f"{what}: download broke off: {exc}") from None
        return b"".join(parts)

    @staticmethod
    def _manifest_media_type(raw: bytes, content_type: str, what: str) -> str:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
            raise _EndpointError("invalid", f"{what}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise _EndpointError("invalid", f"{what}: not a JSON object")
        header = content_type.split(";", 1)[0].strip().lower()
        body = doc.get("mediaType")
        media_type = body if isinstance(body, str) and body else header
        if media_type in DOCKER_SCHEMA1 or doc.get("schemaVersion") == 1:
            raise _EndpointError("unsupported", f"{what}: Docker schema 1 manifests are not supported")
        if media_type not in MANIFEST_TYPES | INDEX_TYPES:
            if media_type in ("", "application/json", "application/octet-stream", "text/plain"):
                # OCI allows mediaType to be absent: tell by the shape.
                if isinstance(doc.get("manifests"), list):
                    media_type = OCI_INDEX
                elif "config" in doc and "layers" in doc:
                    media_type = OCI_MANIFEST
                else:
                    raise _EndpointError("invalid", f"{what}: neither an image manifest nor an index")
            else:
                raise _EndpointError("unsupported", f"{what}: unsupported media type {media_type!r}")
        if doc.get("schemaVersion") != 2:
            raise _EndpointError(
                "invalid", f"{what}: schemaVersion must be 2, not {doc.get('schemaVersion')!r}"
            )
        return media_type

    def _select_platform(self, ref: ImageReference, raw: bytes, what: str) -> Descriptor:
        doc = json.loads(raw)
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise self._error(ref, "invalid", f"{what}: an index without a manifests list")
        try:
            descriptors = [
                self._descriptor(entry, f"{what}.manifests[{i}]") for i, entry in enumerate(entries)
            ]
        except _EndpointError as exc:
            raise self._error(ref, exc.kind, exc.message) from None
        wanted_os, wanted_arch = self.platform
        usable = [d for d in descriptors if d.media_type in MANIFEST_TYPES | INDEX_TYPES]
        matching = [
            d
            for d in usable
            if d.platform is not None
            and d.platform.get("os") == wanted_os
            and d.platform.get("architecture") == wanted_arch
        ]
        matching.sort(key=lambda d: 0 if (d.platform or {}).get("variant") in (None, "", "v1") else 1)
        if matching:
            return matching[0]
        unlabelled = [d for d in usable if d.platform is None]
        if unlabelled:
            # OCI makes platform optional; the config's os/architecture is checked after the pull.
            return unlabelled[0]
        offered = sorted(
            {
                _platform_text(d.platform)
                for d in descriptors
                if d.platform and d.annotations.get(ATTESTATION_ANNOTATION) != "attestation-manifest"
            }
        )
        offered_text = ", ".join(offered) if offered else "none"
        raise self._error(
            ref,
            "not_found",
            f"{what}: the image index has no {wanted_os}/{wanted_arch} manifest; "
            f"platforms offered: {offered_text}",
        )

    def _parse_image_manifest(
        self, ref: ImageReference, raw: bytes, what: str
    ) -> tuple[Descriptor, tuple[Descriptor, ...]]:
        doc = json.loads(raw)
        try:
            config = self._descriptor(doc.get("config"), f"{what}.config")
            if config.media_type not in CONFIG_TYPES:
                raise _EndpointError(
                    "unsupported",
                    f"{what}: config media type {config.media_type!r} is not a container image config "
                    "(an OCI artifact?)",
                )
            entries = doc.get("layers")
            if not isinstance(entries, list):
                raise _EndpointError("invalid", f"{what}: no layers list")
            layers = tuple(self._descriptor(entry, f"{what}.layers[{i}]") for i, entry in enumerate(entries))
            for i, layer in enumerate(layers):
                if layer.media_type not in LAYER_TYPES:
                    raise _EndpointError(
                        "unsupported", f"{what}.layers[{i}]: unsupported media type {layer.media_type!r}"
                    )
        except _EndpointError as exc:
            raise self._error(ref, exc.kind, exc.message) from None
        return config, layers

    @staticmethod
    def _descriptor(value: Any, what: str) -> Descriptor:
        if not isinstance(value, dict):
            raise _EndpointError("invalid", f"{what}: not a descriptor object")
        media_type, digest, size = value.get("mediaType"), value.get("digest"), value.get("size")
        if not isinstance(media_type, str) or not media_type:
            raise _EndpointError("invalid", f"{what}: no mediaType")
        if not isinstance(digest, str):
            raise _EndpointError("invalid", f"{what}: no digest")
        try:
            check_digest(digest)
        except ReferenceError as exc:
            raise _EndpointError("invalid", f"{what}: {exc}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _EndpointError("invalid", f"{what}: size must be a non-negative integer, not {size!r}")
        platform = value.get("platform")
        if platform is not None and not isinstance(platform, dict):
            raise _EndpointError("invalid", f"{what}: platform is not an object")
        annotations = value.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise _EndpointError("invalid", f"{what}: annotations is not an object")
        return Descriptor(
            media_type, digest, size, platform, {str(k): str(v) for k, v in annotations.items()}
        )

    # -- endpoints, errors ------------------------------------------------------------------------
    def _endpoints(self, ref: ImageReference) -> list[_Endpoint]:
        # Keys are lowercase (auraed.config checks them); a reference keeps the case it was given.
        config = self._hosts.get(ref.registry.lower()) or self._hosts.get(ref.registry_host.lower())
        if config is None:
            scheme = "http" if _is_loopback(ref.registry_host) else "https"
            return [_Endpoint(f"{scheme}://{ref.registry_host}", ref.registry_host, True, False)]
        verify: bool | str = True
        if config.skip_verify:
            verify = False
        elif config.ca_file is not None:
            verify = str(config.ca_file)
        endpoints = []
        for mirror in config.mirrors:
            url = mirror if "://" in mirror else f"{'http' if config.insecure else 'https'}://{mirror}"
            base = url.rstrip("/")
            base = base.removesuffix("/v2")
            endpoints.append(_Endpoint(base, urllib.parse.urlsplit(base).netloc, verify, True))
        scheme = "http" if config.insecure else "https"
        endpoints.append(_Endpoint(f"{scheme}://{ref.registry_host}", ref.registry_host, verify, False))
        return endpoints

    def _describe(self, ref: ImageReference, what: str) -> str:
        return f"registry {ref.registry}, repository {ref.repository}: {what}"

    def _error(self, ref: ImageReference, kind: Kind, problem: str) -> RegistryError:
        return RegistryError(kind, self._describe(ref, problem), ref.registry, ref.repository)

    def _on_endpoints(self, ref: ImageReference, what: str, attempt: Callable[[_Endpoint], T]) -> T:
        endpoints = self._endpoints(ref)
        failures: list[tuple[_Endpoint, _EndpointError]] = []
        for endpoint in endpoints:
            try:
                return attempt(endpoint)
            except _EndpointError as exc:
                failures.append((endpoint, exc))
                if endpoint is not endpoints[-1]:
                    log.info(
                        "%s: %s failed (%s), trying the next endpoint", ref.name, endpoint.base, exc.message
                    )
        last = failures[-1][1]
        if len(failures) == 1:
            message = f"{last.message} (at {endpoints[0].base})"
        else:
            message = f"{what}: every endpoint failed: " + "; ".join(
                f"{'mirror ' if endpoint.mirror else ''}{endpoint.base}: {exc.message}"
                for endpoint, exc in failures
            )
        raise self._error(ref, last.kind, message)

    # -- HTTP, auth -------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            # Some registries set cookies and then act as if talking to a browser (as oras notes).
            session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
            session.headers["User-Agent"] = "auraed"
            session.max_redirects = MAX_REDIRECTS
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def _send(
        self,
        endpoint: _Endpoint,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        form: Mapping[str, str] | None = None,
        what: str,
    ) -> requests.Response:
        """One streamed GET (or POST of ``form``); the caller reads and closes the response.

        Every failure to get an answer is an _EndpointError "unavailable": requests' own, and what
        urllib3 and the standard library raise unwrapped for a malformed URL or redirect target."""
        session = self._session()
        for attempt in (1, 2):
            try:
                return session.request(
                    "POST" if form is not None else "GET",
                    url,
                    headers=dict(headers or {}),
                    data=dict(form) if form is not None else None,
                    stream=True,
                    timeout=(self._connect_timeout, self._timeout),
                    verify=endpoint.verify,
                    allow_redirects=True,
                )
            except requests.exceptions.SSLError as exc:
                raise _EndpointError(
                    "unavailable", f"{what}: TLS with {endpoint.host} failed: {exc}"
                ) from None
            except requests.exceptions.ConnectTimeout:
                raise _EndpointError(
                    "unavailable",
                    f"{what}: no connection to {endpoint.host} within {self._connect_timeout:g}s",
                ) from None
            except requests.exceptions.ReadTimeout:
                raise _EndpointError(
                    "unavailable", f"{what}: {endpoint.host} did not answer within {self._timeout:g}s"
                ) from None
            except requests.exceptions.ConnectionError as exc:
                if attempt == 1:
                    log.debug("%s: connection to %s failed (%s), retrying once", what, endpoint.host, exc)
                    time.sleep(CONNECTION_RETRY_DELAY)
                    continue
                raise _EndpointError(
                    "unavailable", f"{what}: cannot connect to {endpoint.host}: {_reason(exc)}"
                ) from None
            except (requests.RequestException, urllib3.exceptions.HTTPError, ValueError, OSError) as exc:
                raise _EndpointError(
                    "unavailable", f"{what}: request to {endpoint.host} failed: {exc}"
                ) from None
        raise AssertionError("unreachable")

    def _request(
        self,
        endpoint: _Endpoint,
        ref: ImageReference,
        path: str,
        *,
        headers: Mapping[str, str],
        creds: Credentials | None,
        what: str,
    ) -> requests.Response:
        """One streamed GET with auth: at most two requests and one token fetch."""
        url = f"{endpoint.base}/v2/{ref.repository}{path}"
        creds = self._credentials_for(endpoint, ref, creds)
        key = (endpoint.base, ref.repository, creds.fingerprint() if creds else "")
        sent = self._cached_authorization(endpoint, key, creds)
        response = self._send(endpoint, url, headers={**headers, **sent}, what=what)
        if response.status_code != 401:
            return response
        if response.history and _origin(response.url) != _origin(url):
            # A host we were redirected to (a CDN, say) is not the registry: its challenge could
            # name any token service, which would then be sent the registry's credentials.
            response.close()
            raise _EndpointError(
                "unauthorized",
                f"{what}: {_origin(response.url)[1]}, where {endpoint.host} redirected the request, "
                "refused it (HTTP 401); credentials are only ever sent to the registry itself",
            )
        challenge = _preferred_challenge(response)
        detail = _error_detail(response)
        response.close()
        if challenge is None:
            raise _EndpointError("unauthorized", f"{what}: 401 without an authentication challenge: {detail}")
        if challenge.scheme == "basic":
            if creds is None or not creds.has_basic:
                raise _EndpointError("unauthorized", f"{what}: the registry requires a username and password")
            if sent:
                raise _EndpointError(
                    "unauthorized", f"{what}: the registry refused user {creds.username!r}: {detail}"
                )
            with self._lock:
                self._basic_endpoints.add(endpoint.base)
            authorization = creds.basic_header()
        elif challenge.scheme == "bearer":
            if sent.get("Authorization", "").startswith("Bearer "):
                log.info("%s: %s refused a cached token; fetching a new one", ref.name, endpoint.host)
                with self._lock:
                    self._tokens.pop(key, None)
            authorization = "Bearer " + self._fetch_token(
                endpoint, ref, challenge, creds=creds, key=key, what=what
            )
        else:
            raise _EndpointError(
                "unauthorized", f"{what}: unsupported authentication scheme {challenge.scheme!r}"
            )
        retry_headers = {**headers, "Authorization": authorization}
        response = self._send(endpoint, url, headers=retry_headers, what=what)
        if response.status_code == 401:
            detail = _error_detail(response)
            response.close()
            with self._lock:
                self._tokens.pop(key, None)
            if challenge.scheme == "basic" and creds is not None:
                raise _EndpointError(
                    "unauthorized", f"{what}: the registry refused user {creds.username!r}: {detail}"
                )
            who = f"user {creds.username!r}" if creds and creds.username else "these credentials"
            if creds is None:
                who = "anonymous access (no credentials given)"
            raise _EndpointError("unauthorized", f"{what}: {who} not authorized: {detail}")
        return response

    def _cached_authorization(
        self, endpoint: _Endpoint, key: tuple[str, str, str], creds: Credentials | None
    ) -> dict[str, str]:
        with self._lock:
            token = self._tokens.get(key)
            if token is not None and token.expires_at <= time.monotonic():
                del self._tokens[key]
                token = None
            basic = endpoint.base in self._basic_endpoints
        if token is not None:
            return {"Authorization": f"Bearer {token.value}"}
        if basic and creds is not None and creds.has_basic:
            return {"Authorization": creds.basic_header()}
        return {}

    def _fetch_token(
        self,
        endpoint: _Endpoint,
        ref: ImageReference,
        challenge: _Challenge,
        *,
        creds: Credentials | None,
        key: tuple[str, str, str],
        what: str,
    ) -> str:
        if creds is not None and creds.registry_token:
            with self._lock:
                self._tokens[key] = _Token(creds.registry_token, time.monotonic() + TOKEN_DEFAULT_LIFETIME)
            return creds.registry_token
        realm = challenge.params.get("realm", "")
        if urllib.parse.urlsplit(realm).scheme not in ("http", "https"):
            raise _EndpointError("unauthorized", f"{what}: bearer challenge with an unusable realm {realm!r}")
        if creds is not None and _downgrades(endpoint.base, realm):
            # The registry is spoken to over TLS: its secrets must not then cross the network in
            # the clear because a challenge says so (anonymous tokens may: they carry none).
            raise _EndpointError(
                "unauthorized",
                f"{what}: {endpoint.host} is HTTPS but its token service {realm} is plain HTTP; "
                "credentials are not sent there",
            )
        service = challenge.params.get("service", "")
        scopes = challenge.params.get("scope", "").split() or [f"repository:{ref.repository}:pull"]
        token_endpoint = _Endpoint(
            realm, urllib.parse.urlsplit(realm).netloc, endpoint.verify, endpoint.mirror
        )
        token_what = f"token from {realm}"
        if creds is not None and creds.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": creds.identity_token,
                "service": service,
                "scope": " ".join(scopes),
                "client_id": CLIENT_ID,
            }
            response = self._send(token_endpoint, realm, form=form, what=token_what)
        else:
            params = [("service", service)] if service else []
            params += [("scope", scope) for scope in scopes]
            url = f"{realm}{'&' if '?' in realm else '?'}{urllib.parse.urlencode(params)}"
            headers = {"Accept": "application/json"}
            if creds is not None and creds.has_basic:
                headers["Authorization"] = creds.basic_header()
            response = self._send(token_endpoint, url, headers=headers, what=token_what)
        with contextlib.closing(response):
            if response.status_code in (401, 403):
                who = f"user {creds.username!r}" if creds and creds.username else "anonymous access"
                raise _EndpointError(
                    "unauthorized", f"{what}: the token service refused {who}: {_error_detail(response)}"
                )
            if response.status_code != 200:
                # Not the image's absence (a 404 here would read as NOT_FOUND): the service failed.
                raise _EndpointError("unavailable", f"{token_what}: {_error_detail(response)}")
            body = self._read_limited(response, MAX_TOKEN_BYTES, token_what)
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            raise _EndpointError("invalid", f"{token_what}: the answer is not JSON") from None
        token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token:
            raise _EndpointError("invalid", f"{token_what}: the answer carries no token")
        expires_in = doc.get("expires_in")
        lifetime = float(TOKEN_DEFAULT_LIFETIME)
        if isinstance(expires_in, int | float) and not isinstance(expires_in, bool):
            lifetime = max(float(expires_in), TOKEN_DEFAULT_LIFETIME)
        with self._lock:
            self._tokens[key] = _Token(token, time.monotonic() + lifetime - TOKEN_EXPIRY_MARGIN)
        return token

    # -- credentials --------------------------------------------------------------------------------
    def _credentials_for(
        self, endpoint: _Endpoint, ref: ImageReference, explicit: Credentials | None
    ) -> Credentials | None:
        if not endpoint.mirror:
            if explicit is not None:
                return explicit
            configured = self._config_credentials()
            return configured.get(ref.registry) or configured.get(ref.registry_host)
        return self._config_credentials().get(endpoint.host)

    def _config_path(self) -> Path | None:
        if self._docker_config is not None:
            return self._docker_config
        directory = os.environ.get("DOCKER_CONFIG")
        if directory:
            return Path(directory) / "config.json"
        with contextlib.suppress(RuntimeError):
            return Path.home() / ".docker" / "config.json"
        return None

    def _config_credentials(self) -> dict[str, Credentials]:
        """The docker config.json's credentials by registry host; re-read when the file changes."""
        path = self._config_path()
        if path is None:
            return {}
        try:
            stat = path.stat()
        except OSError:
            return {}
        stamp = (str(path), stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if self._config_cache is not None and self._config_cache[0] == stamp:
                return self._config_cache[1]
        credentials = self._read_docker_config(path)
        with self._lock:
            self._config_cache = (stamp, credentials)
        return credentials

    def _read_docker_config(self, path: Path) -> dict[str, Credentials]:
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("ignoring docker config %s: %s", path, exc)
            return {}
        if not isinstance(doc, dict):
            log.warning("ignoring docker config %s: not a JSON object", path)
            return {}
        helpers = [*(doc.get("credHelpers") or {})] if isinstance(doc.get("credHelpers"), dict) else []
        if doc.get("credsStore"):
            helpers.append(f"credsStore {doc['credsStore']!r}")
        for helper in helpers:
            if helper not in self._warned_helpers:
                self._warned_helpers.add(helper)
                log.info("docker config %s: credential helpers are not run; ignoring %s", path, helper)
        credentials: dict[str, Credentials] = {}
        auths = doc.get("auths")
        if not isinstance(auths, dict):
            return credentials
        for key, entry in auths.items():
            if not isinstance(entry, dict):
                continue
            username = str(entry.get("username") or "")
            password = str(entry.get("password") or "")
            encoded = entry.get("auth")
            if isinstance(encoded, str) and encoded:
                try:
                    decoded = base64.b64decode(encoded, validate=False).decode()
                except (binascii.Error, UnicodeDecodeError):
                    log.warning(
                        "docker config %s: the auth entry for %s is not base64 user:password", path, key
                    )
                    continue
                username, sep, password = decoded.partition(":")
                if not sep:
                    log.warning("docker config %s: the auth entry for %s has no ':'", path, key)
                    continue
            creds = Credentials(
                username,
                password,
                str(entry.get("registrytoken") or ""),
                str(entry.get("identitytoken") or ""),
            )
            if not creds.empty:
                credentials[_normalize_config_key(str(key))] = creds
        return credentials


def _platform_text(platform: Mapping[str, Any]) -> str:
    parts = [str(platform.get("os", "?")), str(platform.get("architecture", "?"))]
    if platform.get("variant"):
        parts.append(str(platform["variant"]))
    return "/".join(parts)


def _reason(exc: BaseException) -> str:
    """The innermost cause of a connection error ("Connection refused"), not urllib3's whole story."""
    text = str(exc)
    match = re.search(r"\[Errno -?\d+\] ([^')\]]+)", text)
    if match:
        return match.group(1).strip()
    if "Name or service not known" in text or "NameResolutionError" in text:
        return "host name does not resolve"
    return text[:300]
