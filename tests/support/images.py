"""OCI images for tests, built locally (no network): layouts on disk, pushed to test registries.

Layers are described as mappings from a path inside the image to an entry::

    {
        "etc/app.conf": b"mode=test\\n",                  # a regular file, 0644
        "opt/app/run": File(b"#!/bin/sh\\n...", 0o755),   # a file with a mode (and owner)
        "opt/app/current": Symlink("run"),
        "var/cache": Dir(0o700),
        "etc/old.conf": WHITEOUT,                        # deleted from the layers below (.wh.old.conf)
        "opt/app/lib": OPAQUE,                           # lower contents hidden (.wh..wh..opq)
    }

or as a directory to archive whole (``busybox_rootfs(...)``). Parent directories are added
(0755) when a layer does not list them. Tars and gzip streams are deterministic (sorted entries,
fixed mtimes, uid/gid 0 unless given, gzip mtime 0), so building twice gives the same digests.

``build_layout(dest, layers, config)`` writes an OCI image layout (blobs/sha256, oci-layout,
index.json with an ``org.opencontainers.image.ref.name`` annotation) and returns a ``BuiltImage``
with every digest and the exact manifest/config bytes. Ready-made images:

- ``build_busybox_layout``: one layer, busybox with every applet, users root/app/nobody;
- ``build_multilayer_layout``: busybox + a layer of files + a layer that deletes (whiteouts) and
  hides a directory (opaque) and rewrites a file; ``MULTILAYER_PRESENT``/``MULTILAYER_ABSENT``
  say what the unpacked rootfs must (not) contain;
- ``build_large_layout``: busybox + ~50 MB in two more layers (half incompressible, half text),
  seeded, reproducible; reused when ``dest`` already holds it;
- ``build_debian_layout``: ~330 MB of Debian packages installed here (``DEBIAN_LAYERS``: libc,
  dash and coreutils; Python; the C toolchain; QEMU and the CNI plugins, each package's files as
  dpkg lists them), a real distribution's image for benchmarks; reused when ``dest`` holds it
  built from the same package versions.

Pushing: ``push_layout(image, "127.0.0.1:5000/team/app:1")`` runs ``skopeo copy`` (``format="v2s2"``
converts to a Docker schema 2 manifest). ``push_index`` builds one small image per platform and
PUTs blobs, manifests and an OCI index over plain HTTP (the registry does not check architectures).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import requests

from tests.support.busybox import make_busybox_rootfs

OCI_LAYOUT_VERSION = "1.0.0"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
MTIME = 1_700_000_000  # fixed timestamp for every tar entry
CREATED = "2023-11-14T22:13:20Z"
DEFAULT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
SKOPEO_TIMEOUT = 120


@dataclass(frozen=True)
class File:
    data: bytes
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Symlink:
    target: str


@dataclass(frozen=True)
class Hardlink:
    target: str  # a path inside the image, archived earlier in the same layer


@dataclass(frozen=True)
class Whiteout:
    """Deletes the path from the layers below: archived as ``<dir>/.wh.<name>``."""


@dataclass(frozen=True)
class Opaque:
    """Hides everything the layers below have in this directory: ``<dir>/.wh..wh..opq``."""


WHITEOUT = Whiteout()
OPAQUE = Opaque()

Entry = bytes | File | Dir | Symlink | Hardlink | Whiteout | Opaque
LayerSpec = Mapping[str, Entry] | Path


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an image config (what ``docker inspect`` shows under Config)."""

    entrypoint: Sequence[str] | None = None
    cmd: Sequence[str] | None = ("/bin/sh",)
    env: Sequence[str] = DEFAULT_ENV
    working_dir: str = ""
    user: str = ""
    stop_signal: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    exposed_ports: Sequence[str] = ()
    volumes: Sequence[str] = ()
    os: str = "linux"
    architecture: str = "amd64"
    variant: str | None = None

    def platform(self) -> dict[str, str]:
        platform = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            platform["variant"] = self.variant
        return platform

    def to_config_object(self) -> dict[str, object]:
        config: dict[str, object] = {"Env": list(self.env)}
        if self.entrypoint is not None:
            config["Entrypoint"] = list(self.entrypoint)
        if self.cmd is not None:
            config["Cmd"] = list(self.cmd)
        if self.working_dir:
            config["WorkingDir"] = self.working_dir
        if self.user:
            config["User"] = self.user
        if self.stop_signal:
            config["StopSignal"] = self.stop_signal
        if self.labels:
            config["Labels"] = dict(self.labels)
        if self.exposed_ports:
            config["ExposedPorts"] = {port: {} for port in self.exposed_ports}
        if self.volumes:
            config["Volumes"] = {volume: {} for volume in self.volumes}
        return config


@dataclass(frozen=True)
class BuiltLayer:
    digest: str  # of the gzip blob
    diff_id: str  # of the uncompressed tar
    size: int
    media_type: str = OCI_LAYER_GZIP

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class BuiltImage:
    """An image in an OCI layout, with its exact manifest and config bytes."""

    layout: Path
    ref_name: str
    manifest_digest: str
    manifest: bytes
    config_digest: str
    config: bytes
    layers: tuple[BuiltLayer, ...]
    platform: dict[str, str]

    @property
    def manifest_size(self) -> int:
        return len(self.manifest)

    @property
    def total_layer_size(self) -> int:
        return sum(layer.size for layer in self.layers)

    def blob_path(self, digest: str) -> Path:
        algorithm, hex_digest = digest.split(":", 1)
        return self.layout / "blobs" / algorithm / hex_digest

    def blob(self, digest: str) -> bytes:
        return self.blob_path(digest).read_bytes()

    def manifest_descriptor(self) -> dict[str, object]:
        return {
            "mediaType": OCI_MANIFEST,
            "digest": self.manifest_digest,
            "size": len(self.manifest),
            "platform": self.platform,
        }


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


# -- layers -------------------------------------------------------------------------------------


def _tarinfo(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.uname = info.gname = ""
    info.mtime = MTIME
    return info


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def tar_from_spec(spec: Mapping[str, Entry]) -> bytes:
    """An uncompressed layer tar from a path -> entry mapping (see the module docstring)."""
    entries: dict[str, Entry] = {}
    for raw_path, entry in spec.items():
        path = raw_path.strip("/")
        if not path or ".." in path.split("/"):
            raise ValueError(f"bad layer path {raw_path!r}")
        for parent in _parents(path):
            entries.setdefault(parent, Dir())
        entries[path] = entry
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(entries, key=lambda p: p.split("/")):
            entry = entries[path]
            directory, _, name = path.rpartition("/")
            prefix = f"{directory}/" if directory else ""
            if isinstance(entry, bytes):
                entry = File(entry)
            if isinstance(entry, File):
                info = _tarinfo(path, tarfile.REGTYPE, entry.mode, entry.uid, entry.gid)
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            elif isinstance(entry, Dir):
                tar.addfile(_tarinfo(path, tarfile.DIRTYPE, entry.mode, entry.uid, entry.gid))
            elif isinstance(entry, Symlink):
                info = _tarinfo(path, tarfile.SYMTYPE, 0o777)
                info.linkname = entry.target
                tar.addfile(info)
            elif isinstance(entry, Hardlink):
                info = _tarinfo(path, tarfile.LNKTYPE, 0o644)
                info.linkname = entry.target.strip("/")
                tar.addfile(info)
            elif isinstance(entry, Whiteout):
                info = _tarinfo(f"{prefix}.wh.{name}", tarfile.REGTYPE, 0o644)
                tar.addfile(info, io.BytesIO(b""))
            else:
                tar.addfile(_tarinfo(path, tarfile.DIRTYPE, 0o755))
                tar.addfile(_tarinfo(f"{path}/.wh..wh..opq", tarfile.REGTYPE, 0o644), io.BytesIO(b""))
    return buffer.getvalue()


def tar_from_dir(root: Path) -> bytes:
    """An uncompressed layer tar of everything under ``root`` (owners normalized to 0:0)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted([*dirnames, *filenames]):
                full = Path(dirpath) / name
                info = tar.gettarinfo(str(full), arcname=str(full.relative_to(root)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = MTIME
                if info.isreg():
                    with full.open("rb") as handle:
                        tar.addfile(info, handle)
                else:
                    tar.addfile(info)
    return buffer.getvalue()


def gzip_layer(tar: bytes, compresslevel: int = 6) -> bytes:
    return gzip.compress(tar, compresslevel=compresslevel, mtime=0)


def busybox_rootfs(workdir: Path) -> Path:
    """A busybox root filesystem directory under ``workdir`` (a layer spec for ``build_layout``)."""
    return make_busybox_rootfs(workdir / "busybox-rootfs")


# -- layouts ------------------------------------------------------------------------------------


def _write_blob(layout: Path, data: bytes) -> str:
    digest = sha256_digest(data)
    path = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
    return digest


def _add_to_index(layout: Path, descriptor: Mapping[str, object], ref_name: str) -> None:
    index_path = layout / "index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
    index["manifests"] = [
        entry
        for entry in index["manifests"]
        if entry.get("annotations", {}).get(REF_NAME_ANNOTATION) != ref_name
    ]
    index["manifests"].append({**descriptor, "annotations": {REF_NAME_ANNOTATION: ref_name}})
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": OCI_LAYOUT_VERSION}))
    index_path.write_text(json.dumps(index, indent=2))


def build_layout(
    dest: Path,
    layers: Sequence[LayerSpec],
    config: ImageConfig | None = None,
    ref_name: str = "latest",
    compresslevel: int = 6,
) -> BuiltImage:
    """Write (or add to) the OCI layout at ``dest``: gzip layers, config, manifest, index entry."""
    config = config or ImageConfig()
    dest.mkdir(parents=True, exist_ok=True)
    built: list[BuiltLayer] = []
    for spec in layers:
        tar = tar_from_dir(spec) if isinstance(spec, Path) else tar_from_spec(spec)
        blob = gzip_layer(tar, compresslevel)
        built.append(BuiltLayer(_write_blob(dest, blob), sha256_digest(tar), len(blob)))
    config_doc = {
        "created": CREATED,
        **config.platform(),
        "config": config.to_config_object(),
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in built]},
        "history": [
            {"created": CREATED, "created_by": f"tests.support.images layer {i}"} for i in range(len(built))
        ],
    }
    config_raw = canonical_json(config_doc)
    config_digest = _write_blob(dest, config_raw)
    manifest_doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_raw)},
        "layers": [layer.descriptor() for layer in built],
    }
    manifest_raw = canonical_json(manifest_doc)
    manifest_digest = _write_blob(dest, manifest_raw)
    image = BuiltImage(
        dest,
        ref_name,
        manifest_digest,
        manifest_raw,
        config_digest,
        config_raw,
        tuple(built),
        config.platform(),
    )
    _add_to_index(dest, image.manifest_descriptor(), ref_name)
    return image


def load_layout(layout: Path, ref_name: str = "latest") -> BuiltImage:
    """The image ``ref_name`` of a layout written by ``build_layout``."""
    index = json.loads((layout / "index.json").read_text())
    for entry in index["manifests"]:
        if entry.get("annotations", {}).get(REF_NAME_ANNOTATION) == ref_name:
            break
    else:
        raise KeyError(f"{layout} has no image named {ref_name!r}")
    blobs = layout / "blobs" / "sha256"
    manifest_raw = (blobs / entry["digest"].split(":", 1)[1]).read_bytes()
    manifest = json.loads(manifest_raw)
    config_raw = (blobs / manifest["config"]["digest"].split(":", 1)[1]).read_bytes()
    diff_ids = json.loads(config_raw)["rootfs"]["diff_ids"]
    layers = tuple(
        BuiltLayer(layer["digest"], diff_id, layer["size"], layer["mediaType"])
        for layer, diff_id in zip(manifest["layers"], diff_ids, strict=True)
    )
    platform = entry.get("platform") or {"architecture": "amd64", "os": "linux"}
    return BuiltImage(
        layout,
        ref_name,
        entry["digest"],
        manifest_raw,
        manifest["config"]["digest"],
        config_raw,
        layers,
        platform,
    )


def build_busybox_layout(
    dest: Path, config: ImageConfig | None = None, ref_name: str = "latest"
) -> BuiltImage:
    """A one-layer busybox image."""
    with tempfile.TemporaryDirectory(prefix="busybox-") as work:
        return build_layout(dest, [busybox_rootfs(Path(work))], config, ref_name)


APP_SCRIPT = b'#!/bin/sh\necho app running as $(id -u) in $(pwd): $(cat /etc/app.conf)\nexec "$@"\n'

MULTILAYER_FILES: dict[str, Entry] = {
    "etc/app.conf": b"mode=test\n",
    "etc/remove-me": b"this file is deleted by the next layer\n",
    "opt/app/bin/run": File(APP_SCRIPT, 0o755),
    "opt/app/current": Symlink("bin/run"),
    "opt/app/data/keep.txt": b"kept\n",
    "opt/app/data/old.txt": b"deleted by a whiteout\n",
    "opt/app/lib/a.txt": b"hidden by the opaque directory\n",
    "opt/app/lib/b.txt": b"hidden by the opaque directory\n",
    "home/app/owned.txt": File(b"owned by app\n", 0o600, 1000, 1000),
}
MULTILAYER_CHANGES: dict[str, Entry] = {
    "etc/remove-me": WHITEOUT,
    "opt/app/data/old.txt": WHITEOUT,
    "opt/app/lib": OPAQUE,
    "opt/app/lib/c.txt": b"the only file left in lib\n",
    "etc/app.conf": b"mode=final\n",
}
# After unpacking all three layers: path -> exact content (symlinks: "-> target").
MULTILAYER_PRESENT: dict[str, bytes | str] = {
    "etc/app.conf": b"mode=final\n",
    "opt/app/bin/run": APP_SCRIPT,
    "opt/app/current": "-> bin/run",
    "opt/app/data/keep.txt": b"kept\n",
    "opt/app/lib/c.txt": b"the only file left in lib\n",
    "home/app/owned.txt": b"owned by app\n",
    "bin/busybox": "",  # present (content not compared)
}
MULTILAYER_ABSENT = ("etc/remove-me", "opt/app/data/old.txt", "opt/app/lib/a.txt", "opt/app/lib/b.txt")
MULTILAYER_CONFIG = ImageConfig(
    entrypoint=["/opt/app/bin/run"],
    cmd=["echo", "hello"],
    env=[*DEFAULT_ENV, "APP_MODE=test"],
    working_dir="/opt/app",
    user="app",
    stop_signal="SIGUSR1",
    labels={"org.example.test": "multilayer"},
    exposed_ports=["8080/tcp"],
    volumes=["/data"],
)


def build_multilayer_layout(
    dest: Path, config: ImageConfig | None = None, ref_name: str = "latest"
) -> BuiltImage:
    """busybox + files + deletions (whiteouts, an opaque dir); see MULTILAYER_PRESENT/ABSENT."""
    with tempfile.TemporaryDirectory(prefix="busybox-") as work:
        layers: list[LayerSpec] = [busybox_rootfs(Path(work)), MULTILAYER_FILES, MULTILAYER_CHANGES]
        return build_layout(dest, layers, config or MULTILAYER_CONFIG, ref_name)


def _large_layers(total_bytes: int, seed: int, file_size: int) -> tuple[dict[str, Entry], dict[str, Entry]]:
    rng = random.Random(seed)
    half = total_bytes // 2
    alphabet = b"abcdefghijklmnopqrstuvwxyz \n"
    table = bytes(alphabet[i % len(alphabet)] for i in range(256))
    noise: dict[str, Entry] = {}
    text: dict[str, Entry] = {}
    for i in range(max(1, half // file_size)):
        noise[f"data/random/{i:04d}.bin"] = rng.randbytes(file_size)
    for i in range(max(1, half // file_size)):
        text[f"data/text/{i:04d}.txt"] = rng.randbytes(file_size).translate(table)
    return noise, text


def build_large_layout(
    dest: Path,
    total_bytes: int = 50 << 20,
    seed: int = 20240601,
    ref_name: str = "latest",
    file_size: int = 1 << 20,
) -> BuiltImage:
    """busybox + two seeded data layers of ``total_bytes`` together, for benchmarks.

    Reuses the image when ``dest`` already holds ``ref_name`` built with the same parameters.
    """
    stamp = f"large-{total_bytes}-{seed}-{file_size}"
    name_marker = dest / f".{ref_name}.params"
    if name_marker.exists() and name_marker.read_text() == stamp:
        return load_layout(dest, ref_name)
    with tempfile.TemporaryDirectory(prefix="busybox-") as work:
        noise, text = _large_layers(total_bytes, seed, file_size)
        layers: list[LayerSpec] = [busybox_rootfs(Path(work)), noise, text]
        image = build_layout(dest, layers, ImageConfig(cmd=["/bin/sh"]), ref_name, compresslevel=1)
    name_marker.write_text(stamp)
    return image


DEBIAN_LAYERS: tuple[tuple[str, ...], ...] = (
    ("libc6", "libgcc-s1", "dash", "coreutils", "libacl1", "libattr1", "libselinux1", "libpcre2-8-0",
     "libgmp10", "libssl3"),
    ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-dev"),
    ("gcc-12", "cpp-12", "g++-12", "libstdc++-12-dev", "libgcc-12-dev", "binutils-x86-64-linux-gnu"),
    ("qemu-system-x86", "containernetworking-plugins"),
)  # fmt: skip
"""Installed by hack/setup (build-essential, python3-dev, qemu-system-x86, the CNI plugins) or
essential: every machine that runs the tests has them."""


def package_versions(packages: Sequence[str]) -> str:
    """``package=version`` of each installed package, one a line (dpkg's status)."""
    result = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}=${Version}\\n", *packages],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return result.stdout


def debian_rootfs(root: Path, packages: Sequence[str]) -> Path:
    """``root`` holding the files of the installed ``packages`` as dpkg lists them (regular files
    and symlinks; directories made as needed), each where it really is on this merged-/usr system
    (``/bin/sh`` in ``usr/bin``)."""
    listed = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True, check=True).stdout
    for line in sorted(set(listed.splitlines())):
        if not line.startswith("/"):
            continue  # "diverted by ..." and the like
        source = Path(os.path.realpath(Path(line).parent)) / Path(line).name
        if not source.exists() and not source.is_symlink():
            continue
        if source.is_dir() and not source.is_symlink():
            continue
        target = root / source.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            continue
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return root


def build_debian_layout(
    dest: Path, layers: Sequence[Sequence[str]] = DEBIAN_LAYERS, ref_name: str = "latest"
) -> BuiltImage:
    """One layer per group of installed Debian packages (``DEBIAN_LAYERS``), Cmd ``sh``; reused
    when ``dest`` already holds ``ref_name`` built from the same package versions."""
    stamp = package_versions([package for group in layers for package in group])
    name_marker = dest / f".{ref_name}.packages"
    if name_marker.exists() and name_marker.read_text() == stamp:
        return load_layout(dest, ref_name)
    with tempfile.TemporaryDirectory(prefix="debian-") as work:
        roots: list[LayerSpec] = [
            debian_rootfs(Path(work) / str(index), group) for index, group in enumerate(layers)
        ]
        image = build_layout(dest, roots, ImageConfig(cmd=["sh"]), ref_name, compresslevel=1)
    name_marker.write_text(stamp)
    return image


# -- pushing ------------------------------------------------------------------------------------


def push_layout(
    image: BuiltImage | Path,
    destination: str,
    creds: str | None = None,
    format: Literal["oci", "v2s2"] | None = None,
    ref_name: str | None = None,
) -> None:
    """``skopeo copy oci:<layout>:<ref> docker://<destination>`` to a plain-HTTP registry.

    ``destination`` is "127.0.0.1:<port>/<repository>:<tag>"; ``creds`` "user:password";
    ``format="v2s2"`` converts to a Docker schema 2 manifest (the digest changes then).
    """
    layout = image.layout if isinstance(image, BuiltImage) else image
    name = ref_name or (image.ref_name if isinstance(image, BuiltImage) else "latest")
    command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if creds:
        command += ["--dest-creds", creds]
    if format:
        command += ["--format", format]
    command += [f"oci:{layout}:{name}", f"docker://{destination}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=SKOPEO_TIMEOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr}")


def put_blob(
    registry_url: str, repository: str, data: bytes, headers: Mapping[str, str] | None = None
) -> str:
    """Monolithic blob upload (POST then PUT ?digest=); skipped if the registry has it."""
    digest = sha256_digest(data)
    headers = dict(headers or {})
    head = requests.head(f"{registry_url}/v2/{repository}/blobs/{digest}", headers=headers, timeout=10)
    if head.status_code == 200:
        return digest
    start = requests.post(f"{registry_url}/v2/{repository}/blobs/uploads/", headers=headers, timeout=10)
    if start.status_code != 202:
        raise RuntimeError(f"blob upload to {repository} refused: {start.status_code} {start.text}")
    location = start.headers["Location"]
    if location.startswith("/"):
        location = registry_url + location
    separator = "&" if "?" in location else "?"
    put = requests.put(
        f"{location}{separator}digest={digest}",
        data=data,
        headers={**headers, "Content-Type": "application/octet-stream"},
        timeout=60,
    )
    if put.status_code != 201:
        raise RuntimeError(f"blob {digest} upload failed: {put.status_code} {put.text}")
    return digest


def put_manifest(
    registry_url: str,
    repository: str,
    reference: str,
    raw: bytes,
    *,
    media_type: str,
    headers: Mapping[str, str] | None = None,
) -> str:
    """PUT the exact manifest bytes (tag or digest reference); returns their digest."""
    response = requests.put(
        f"{registry_url}/v2/{repository}/manifests/{reference}",
        data=raw,
        headers={**(headers or {}), "Content-Type": media_type},
        timeout=30,
    )
    if response.status_code != 201:
        raise RuntimeError(
            f"manifest PUT {repository}:{reference} failed: {response.status_code} {response.text}"
        )
    return sha256_digest(raw)


def push_image_raw(
    image: BuiltImage,
    registry_url: str,
    repository: str,
    reference: str,
    headers: Mapping[str, str] | None = None,
) -> str:
    """Push an image's blobs and exact manifest bytes over HTTP; returns the manifest digest."""
    for digest in (image.config_digest, *(layer.digest for layer in image.layers)):
        put_blob(registry_url, repository, image.blob(digest), headers)
    return put_manifest(
        registry_url, repository, reference, image.manifest, media_type=OCI_MANIFEST, headers=headers
    )


@dataclass(frozen=True)
class PushedIndex:
    digest: str
    raw: bytes
    images: dict[str, BuiltImage]  # "linux/amd64" -> the image for that platform


def push_index(
    workdir: Path,
    registry_url: str,
    repository: str,
    tag: str,
    *,
    platforms: Sequence[str] = ("linux/arm64", "linux/amd64"),
    headers: Mapping[str, str] | None = None,
    base_layers: Sequence[LayerSpec] = (),
    media_type: str = OCI_INDEX,
    config: ImageConfig | None = None,
) -> PushedIndex:
    """An index over one small image per platform ("os/arch[/variant]"), pushed to ``tag``.

    Each image is ``base_layers`` plus a layer holding /etc/platform with the platform's name,
    and its config is ``config`` (default ``ImageConfig()``) for that platform, so a test can
    tell which one it got.
    """
    images: dict[str, BuiltImage] = {}
    entries = []
    for platform in platforms:
        os_name, arch, *rest = platform.split("/")
        for_platform = replace(
            config or ImageConfig(), os=os_name, architecture=arch, variant=rest[0] if rest else None
        )
        layers: list[LayerSpec] = [*base_layers, {"etc/platform": f"{platform}\n".encode()}]
        image = build_layout(workdir / platform.replace("/", "-"), layers, for_platform, ref_name=tag)
        push_image_raw(image, registry_url, repository, image.manifest_digest, headers)
        images[platform] = image
        entries.append(image.manifest_descriptor())
    raw = canonical_json({"schemaVersion": 2, "mediaType": media_type, "manifests": entries})
    digest = put_manifest(registry_url, repository, tag, raw, media_type=media_type, headers=headers)
    return PushedIndex(digest, raw, images)
