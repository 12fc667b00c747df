"""Image references, parsed and normalized the way docker does.

A value clients give (like the names in auraed.names), below both the images subsystem, which
pulls by them, and the configuration, which names registries the way references do.

The grammar is the distribution project's (github.com/distribution/reference)::

    reference        := name [ ":" tag ] [ "@" digest ]
    name             := [domain "/"] path-component ["/" path-component]*
    domain           := host [":" port]          host: DNS name, IPv4, or [IPv6]
    path-component   := [a-z0-9]+ (separator [a-z0-9]+)*      separator: "." "_" "__" "-"+
    tag              := [\\w][\\w.-]{0,127}
    digest           := algorithm ":" hex

Normalization follows docker's ``ParseNormalizedNamed``: the first path component is a registry
only if it contains "." or ":" or is "localhost"; otherwise the registry is ``docker.io`` and a
single-component repository gets ``library/`` in front ("busybox" -> docker.io/library/busybox).
``index.docker.io`` is spelled ``docker.io``. A reference without tag or digest gets tag "latest";
one with a digest keeps the tag it was given (informational; the digest is what is pulled).

Only sha256 (64 hex) and sha512 (128 hex) digests are accepted, in lowercase: other algorithms
are valid grammar but cannot be verified, so they are refused here rather than at download time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_REGISTRY = "docker.io"
DEFAULT_REGISTRY_HOST = "registry-1.docker.io"  # where docker.io's API is served
LEGACY_DEFAULT_REGISTRY = "index.docker.io"
OFFICIAL_NAMESPACE = "library"
DEFAULT_TAG = "latest"
NAME_MAX = 255
DNS_LABEL_MAX = 63  # RFC 1035
MAX_PORT = 65535

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN_RE = re.compile(rf"(?:{_DOMAIN_NAME}|{_IPV6})(?::[0-9]+)?")
_PATH_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_DIGEST_RE = re.compile(r"([A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*):([0-9a-fA-F]+)")
_HEX64_RE = re.compile(r"[a-f0-9]{64}")
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha512": 128}


class ReferenceError(ValueError):
    """An image reference that is not valid; the message says what is wrong with it."""


@dataclass(frozen=True)
class ImageReference:
    """A normalized image reference: registry "docker.io", repository "library/busybox"."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        return parse_reference(text)

    @property
    def repository_name(self) -> str:
        """The full repository name without tag or digest: "docker.io/library/busybox"."""
        return f"{self.registry}/{self.repository}"

    @property
    def name(self) -> str:
        """Canonical: "docker.io/library/busybox:latest", "reg/app@sha256:..." or "reg/app:1@sha256:..."."""
        text = self.repository_name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    @property
    def registry_host(self) -> str:
        """The host[:port] whose /v2/ API serves this registry ("registry-1.docker.io" for docker.io)."""
        return DEFAULT_REGISTRY_HOST if self.registry == DEFAULT_REGISTRY else self.registry

    @property
    def manifest_reference(self) -> str:
        """What goes after /manifests/ in the API: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> ImageReference:
        """The same repository pinned to ``digest`` (the tag is kept for display)."""
        check_digest(digest)
        return ImageReference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        return self.name


def check_digest(digest: str) -> str:
    """``digest`` if it is a well-formed sha256/sha512 digest, else a ReferenceError saying why."""
    match = _DIGEST_RE.fullmatch(digest)
    if match is None:
        raise ReferenceError(
            f"invalid digest {digest!r}: expected algorithm:hex, e.g. sha256:<64 hex digits>"
        )
    algorithm, hex_part = match.groups()
    if algorithm not in DIGEST_HEX_LENGTHS:
        raise ReferenceError(
            f"unsupported digest algorithm {algorithm!r} in {digest!r} (use sha256 or sha512)"
        )
    expected = DIGEST_HEX_LENGTHS[algorithm]
    if len(hex_part) != expected:
        raise ReferenceError(
            f"invalid digest {digest!r}: {algorithm} needs {expected} hex digits, got {len(hex_part)}"
        )
    if hex_part != hex_part.lower():
        raise ReferenceError(f"invalid digest {digest!r}: hex digits must be lowercase")
    return digest


def parse_reference(text: str) -> ImageReference:
    """Parse and normalize ``text``; raises ReferenceError with what is wrong."""
    if not isinstance(text, str):
        raise ReferenceError(f"reference must be a string, not {type(text).__name__}")
    if not text:
        raise ReferenceError("reference is empty")
    if text != text.strip() or any(c.isspace() for c in text):
        raise ReferenceError(f"invalid reference {text!r}: contains whitespace")

    remainder, at, digest = text.partition("@")
    if at:
        if not digest:
            raise ReferenceError(f"invalid reference {text!r}: empty digest after '@'")
        check_digest(digest)
    tag: str | None = None
    # A ":" after the last "/" starts the tag ("host:5000/app" has its ":" before the "/").
    colon = remainder.rfind(":")
    if colon > remainder.rfind("/"):
        remainder, tag = remainder[:colon], remainder[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise ReferenceError(
                f"invalid tag {tag!r} in {text!r}: "
                "a tag is 1-128 of [A-Za-z0-9_.-], not starting with '.' or '-'"
            )
    if not remainder:
        raise ReferenceError(f"invalid reference {text!r}: no repository name")
    if len(remainder) > NAME_MAX:
        raise ReferenceError(
            f"invalid reference {text[:40]!r}...: repository name longer than {NAME_MAX} characters"
        )

    registry, path = _split_domain(remainder)
    if _HEX64_RE.fullmatch(remainder):
        raise ReferenceError(
            f"invalid reference {text!r}: a 64-hex name looks like an image id, not a repository"
        )
    for component in path.split("/"):
        if not component:
            raise ReferenceError(f"invalid reference {text!r}: empty path component in {path!r}")
        if not _PATH_COMPONENT_RE.fullmatch(component):
            if _PATH_COMPONENT_RE.fullmatch(component.lower()):
                raise ReferenceError(f"invalid reference {text!r}: repository name must be lowercase")
            raise ReferenceError(
                f"invalid reference {text!r}: path component {component!r} must be "
                "lowercase letters and digits separated by '.', '_', '__' or '-'"
            )
    if tag is None and not digest:
        tag = DEFAULT_TAG
    return ImageReference(registry, path, tag, digest or None)


def registry_name(text: str) -> str:
    """A registry as configuration names it ("registry.k8s.io", "127.0.0.1:5000"), spelled as
    lookups spell it: lowercase (host names are case-insensitive), docker.io for index.docker.io.
    A ReferenceError when it is not a host[:port]."""
    if not _DOMAIN_RE.fullmatch(text):
        if "://" in text or "/" in text:
            raise ReferenceError(f"{text!r}: name the registry as references do (host[:port]), not a URL")
        raise ReferenceError(f"{text!r} is not a valid registry host[:port]")
    problem = _host_problem(text)
    if problem:
        raise ReferenceError(f"{text!r}: {problem}")
    name = text.lower()
    return DEFAULT_REGISTRY if name == LEGACY_DEFAULT_REGISTRY else name


def _host_problem(domain: str) -> str:
    """What DNS or TCP forbids in a host[:port] the grammar allows (it bounds neither), or ""."""
    host, port = domain, ""
    if domain.startswith("["):
        host, _, rest = domain.partition("]")
        port = rest.removeprefix(":")
    elif ":" in domain:
        host, port = domain.rsplit(":", 1)
    if port and int(port) > MAX_PORT:
        return f"port {port} is over {MAX_PORT}"
    # (A whole name is at most NAME_MAX, within DNS's 253 for a host name.)
    if not host.startswith("[") and any(len(label) > DNS_LABEL_MAX for label in host.split(".")):
        return f"each dot-separated part of a host name is at most {DNS_LABEL_MAX} characters"
    return ""


def _split_domain(name: str) -> tuple[str, str]:
    first, slash, rest = name.partition("/")
    if not slash or ("." not in first and ":" not in first and first != "localhost"):
        # No registry: docker.io, with "library/" for official images.
        path = name if "/" in name else f"{OFFICIAL_NAMESPACE}/{name}"
        return DEFAULT_REGISTRY, path
    if not _DOMAIN_RE.fullmatch(first):
        raise ReferenceError(f"invalid reference {name!r}: {first!r} is not a valid registry host[:port]")
    problem = _host_problem(first)
    if problem:
        raise ReferenceError(f"invalid reference {name!r}: registry {first!r}: {problem}")
    if first == LEGACY_DEFAULT_REGISTRY:
        first = DEFAULT_REGISTRY
    if first == DEFAULT_REGISTRY and "/" not in rest:
        rest = f"{OFFICIAL_NAMESPACE}/{rest}"
    return first, rest
