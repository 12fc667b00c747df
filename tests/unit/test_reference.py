"""Image reference parsing and normalization, as docker does it, plus a fuzz: only ReferenceError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from auraed.references import ImageReference, ReferenceError, check_digest, parse_reference

HEX = "a" * 64
DIGEST = f"sha256:{HEX}"


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("busybox", "docker.io", "library/busybox", "latest", None),
        ("busybox:1.36", "docker.io", "library/busybox", "1.36", None),
        ("library/busybox", "docker.io", "library/busybox", "latest", None),
        ("docker.io/busybox", "docker.io", "library/busybox", "latest", None),
        ("index.docker.io/busybox:1", "docker.io", "library/busybox", "1", None),
        ("docker.io/library/busybox", "docker.io", "library/busybox", "latest", None),
        ("team/app", "docker.io", "team/app", "latest", None),
        ("registry.k8s.io/pause:3.9", "registry.k8s.io", "pause", "3.9", None),
        ("registry.k8s.io/kube-apiserver:v1.30.0", "registry.k8s.io", "kube-apiserver", "v1.30.0", None),
        (f"127.0.0.1:5000/team/app@{DIGEST}", "127.0.0.1:5000", "team/app", None, DIGEST),
        (f"127.0.0.1:5000/team/app:1.0@{DIGEST}", "127.0.0.1:5000", "team/app", "1.0", DIGEST),
        ("localhost/app", "localhost", "app", "latest", None),
        ("localhost:5000/app:dev", "localhost:5000", "app", "dev", None),
        ("[::1]:5000/app", "[::1]:5000", "app", "latest", None),
        ("Example.COM/team/app", "Example.COM", "team/app", "latest", None),
        ("ghcr.io/a/b/c/d:x_Y-z.1", "ghcr.io", "a/b/c/d", "x_Y-z.1", None),
        ("quay.io/some_org/my__app-x.y", "quay.io", "some_org/my__app-x.y", "latest", None),
        ("host:5000", "docker.io", "library/host", "5000", None),
        (f"busybox@{DIGEST}", "docker.io", "library/busybox", None, DIGEST),
        (f"busybox@sha512:{'b' * 128}", "docker.io", "library/busybox", None, f"sha512:{'b' * 128}"),
        ("a" * 128 + ":" + "t" * 128, "docker.io", "library/" + "a" * 128, "t" * 128, None),
    ],
)
def test_parse_and_normalize(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None
) -> None:
    ref = parse_reference(text)
    assert ref == ImageReference(registry, repository, tag, digest)
    assert parse_reference(ref.name) == ref  # the canonical name parses to itself


def test_names() -> None:
    assert parse_reference("busybox").name == "docker.io/library/busybox:latest"
    assert parse_reference(f"reg.example:443/app@{DIGEST}").name == f"reg.example:443/app@{DIGEST}"
    assert parse_reference(f"app:1@{DIGEST}").name == f"docker.io/library/app:1@{DIGEST}"
    ref = parse_reference("busybox")
    assert ref.repository_name == "docker.io/library/busybox"
    assert ref.registry_host == "registry-1.docker.io"
    assert ref.manifest_reference == "latest"
    assert str(ref) == ref.name
    assert parse_reference("registry.k8s.io/pause:3.9").registry_host == "registry.k8s.io"
    pinned = parse_reference(f"app:1@{DIGEST}")
    assert pinned.manifest_reference == DIGEST
    assert ref.with_digest(DIGEST).name == f"docker.io/library/busybox:latest@{DIGEST}"
    assert ImageReference.parse("busybox") == ref


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("Busybox", "must be lowercase"),
        ("docker.io/Library/busybox", "must be lowercase"),
        ("busybox:", "invalid tag"),
        ("busybox:.hidden", "invalid tag"),
        ("busybox:-x", "invalid tag"),
        ("busybox:" + "t" * 129, "invalid tag"),
        ("busybox:a/b", "not a valid registry"),
        ("busybox@", "empty digest"),
        ("busybox@sha256:abc", "needs 64 hex digits"),
        (f"busybox@sha256:{'A' * 64}", "lowercase"),
        (f"busybox@md5:{HEX}", "unsupported digest algorithm"),
        ("busybox@nonsense", "expected algorithm:hex"),
        (f"busybox@{DIGEST}@{DIGEST}", "invalid digest"),
        ("a//b", "empty path component"),
        ("team/app/", "empty path component"),
        ("/app", "empty path component"),
        (":latest", "no repository"),
        (f"@{DIGEST}", "no repository"),
        ("team/-app", "path component"),
        ("team/app_", "path component"),
        ("team/a...b", "path component"),
        ("bad_host.example/app", "not a valid registry"),
        ("-bad.example/app", "not a valid registry"),
        ("busy box", "whitespace"),
        (" busybox", "whitespace"),
        ("a" * 64, "image id"),
        ("x" * 256, "longer than 255"),
        # The grammar bounds neither; urllib3 would refuse them later with an unwrapped error.
        ("a" * 64 + ".example/app", "at most 63 characters"),
        ("registry.example:65536/app", "port 65536 is over 65535"),
    ],
)
def test_invalid(text: str, problem: str) -> None:
    with pytest.raises(ReferenceError, match=problem) as caught:
        parse_reference(text)
    assert isinstance(caught.value, ValueError)


def test_check_digest() -> None:
    assert check_digest(DIGEST) == DIGEST
    with pytest.raises(ReferenceError, match="unsupported digest algorithm"):
        check_digest(f"sha384:{'a' * 96}")
    with pytest.raises(ReferenceError, match="sha512 needs 128"):
        check_digest(f"sha512:{HEX}")


REFERENCE_CHARS = st.sampled_from([*"abcAZ09._-/:@", "sha256:", HEX, "localhost", "docker.io", "[::1]", " "])


@settings(max_examples=600, deadline=None)
@given(st.one_of(st.text(max_size=300), st.lists(REFERENCE_CHARS, max_size=12).map("".join)))
def test_fuzz_only_reference_errors(text: str) -> None:
    try:
        ref = parse_reference(text)
    except ReferenceError as error:
        assert str(error)
        return
    # Whatever parses normalizes to a fixed point and has a sane shape.
    assert parse_reference(ref.name) == ref
    assert ref.tag is not None or ref.digest is not None
    assert ref.repository and not ref.repository.startswith("/")
