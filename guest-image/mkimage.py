"""Build the auraed guest image from Debian packages and this repository, cached by a hash of its inputs.

Run through ``guest-image/build [--out DIR]``: prints the output directory (and nothing else on stdout).
The default output is ``<repo>/.work/guest-image/<inputs-hash>/`` with a ``latest`` symlink beside it;
a directory whose hash matches is reused. It holds:

- ``vmlinuz``: the kernel of Debian's linux-image-*-cloud-amd64 (the version apt offers).
- ``initramfs.img``: busybox-static, the virtio/filesystem modules and ``/init`` (``files/init``),
  which mounts ``rootfs.img`` read-only under a tmpfs overlay and switch_roots to ``auraed.init=``.
- ``rootfs.img``: the read-only root: Debian's python3 with a trimmed stdlib, auraed and its runtime
  dependencies from the venv, crun, catatonit, busybox, precompiled bytecode, ``/sbin/aurae-init``.
- ``bare-initramfs.img``: prints ``AURAE-BARE-BOOT-OK`` and powers off (boot benchmark, backend tests).
- ``manifest.json``: kernel version, inputs hash, package versions, file sizes, build time.

The inputs hash covers the Debian package versions (apt's candidates), auraed's sources and
pyproject.toml, the versions of the Python distributions installed from the venv, and every file
under guest-image/. Debian packages are fetched with ``apt-get download`` into ``.work/guest-image/cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import importlib.metadata
import json
import lzma
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FILES = HERE / "files"
DEFAULT_BASE = REPO / ".work" / "guest-image"
FORMAT = 1  # bump to rebuild every image when the layout changes in a way the hash cannot see
KEEP_BUILDS = 3
PRUNE_AFTER = 6 * 3600  # seconds; a build is cheap (~10 s), a test session may hold one for a while

PYTHON = "3.11"
KERNEL_META = "linux-image-cloud-amd64"
PYTHON_PACKAGES = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib")
# Shared libraries for python3, its lib-dynload modules, the native wheels and crun. The build
# resolves every DT_NEEDED of every ELF file in the image against these and fails on a miss.
LIBRARY_PACKAGES = (
    "libc6", "zlib1g", "libexpat1", "libssl3", "libffi8", "libbz2-1.0", "liblzma5", "libsqlite3-0",
    "libuuid1", "libstdc++6", "libgcc-s1",
    "libcap2", "libseccomp2", "libsystemd0", "libyajl2", "libgcrypt20", "libgpg-error0", "libzstd1",
    "liblz4-1",
)  # fmt: skip
# catatonit: the init of a pod's shared PID namespace (auraed.system.pod_namespaces), static.
PACKAGES = ("busybox-static", "crun", "catatonit", *PYTHON_PACKAGES, *LIBRARY_PACKAGES)

# Loaded by the initramfs, in this order after their dependencies (from modules.dep).
INITRAMFS_MODULES = (
    "virtio_ring", "virtio", "virtio_mmio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
    "virtio_pci", "virtio_blk", "failover", "net_failover", "virtio_net", "squashfs", "crc32c-intel",
    "libcrc32c", "erofs", "overlay", "virtio-rng", "fuse", "virtiofs",
)  # fmt: skip
# Also in the root image's /lib/modules/<release> (at their modules.dep paths, with a modules.dep)
# for PID 1 to load when it needs them: the ACPI power button and evdev (auraed/init/powerbutton.py),
# and what container networking may want.
ROOTFS_EXTRA_MODULES = (
    "button", "evdev", "veth", "bridge", "tun", "br_netfilter", "nf_tables", "vsock",
    "vmw_vsock_virtio_transport", "virtio_console",
)  # fmt: skip

STDLIB_DROP = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "distutils",
    "curses", "__phello__", "__hello__.py", "turtle.py", "antigravity.py", "this.py",
    "sitecustomize.py",  # Debian's tries to import apport at every start
}  # fmt: skip
DYNLOAD_DROP = re.compile(
    r"^(_test\w*|_ctypes_test|xxlimited\w*|_xxtestfuzz|_xxsubinterpreters|readline|_curses\w*|_dbm|_gdbm"
    r"|nis|ossaudiodev|_crypt)\."
)
# Never imported in a guest: zstandard's cffi backend (12 MB; the C backend is the default).
SITE_DROP = re.compile(r"^zstandard/(_cffi\..*\.so|backend_cffi\.py)$")
SITE_PACKAGES = "usr/lib/python3/dist-packages"
# Dependencies that read their own version from their installed metadata when imported: that
# pulls importlib.metadata (with email, zipfile, csv, ...: 32 modules, ~1.7 MiB RssAnon and ~14 ms
# on a host, ten times that under TCG) into every guest auraed. In the image the version is a
# literal, taken from the same metadata at build time (the file as shipped, then the line it
# becomes); the chroot check fails the build if the daemon imports importlib.metadata again.
VERSION_LOOKUPS = {
    "betterproto2": (
        "betterproto2/_version.py",
        'from importlib import metadata\n\n__version__ = metadata.version("betterproto2")\n',
    ),
}
MULTIARCH = "x86_64-linux-gnu"

PASSWD = """root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
GROUP = """root:x:0:
nogroup:x:65534:
"""
# Run by the image's own python3 (chrooted) at build time: what the guest's daemon imports must
# not bring importlib.metadata back (VERSION_LOOKUPS), nor reflection, which its first call imports
# (server/rpc.py LazyService).
LEAN_CHECK_SCRIPT = """
import sys
import auraed.__main__, auraed.init.pid1, auraed.server.daemon
late = ("importlib.metadata", "email", "zipfile", "grpc_reflection.v1alpha")
print(" ".join(sorted(m for m in late if m in sys.modules)))
"""
# Run by the image's own python3 (chrooted) at build time: every auraed module and the native pieces.
CHECK_SCRIPT = """
import importlib, pkgutil, sys
import auraed
names = [m.name for m in pkgutil.walk_packages(auraed.__path__, "auraed.")]
names += ["auraed.__main__", "grpc.aio", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection",
          "cryptography.x509", "zstandard", "requests", "sqlite3", "ssl", "ctypes", "uuid", "decimal",
          "lzma", "bz2", "zlib", "asyncio", "hashlib"]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed.append(f"{name}: {exc!r}")
print("\\n".join(failed) if failed else f"ok: {len(names)} modules")
sys.exit(1 if failed else 0)
"""
HOSTS = """127.0.0.1 localhost
::1 localhost ip6-localhost ip6-loopback
"""


class BuildError(Exception):
    pass


class Interrupted(BaseException):
    """SIGTERM or SIGHUP (a CI job cancelled, a closed terminal). Their default action ended the
    build on the spot, leaving its half-made tree (~100 MB) behind; as an exception, every
    ``finally`` runs (the tree is removed, subprocess.run kills the step's child) like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def log(message: str) -> None:
    print(f"guest-image: {message}", file=sys.stderr, flush=True)


def run(args: list[str], **kwargs: object) -> str:
    try:
        result = subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    except FileNotFoundError as exc:  # a tool hack/setup installs, or a cwd that is gone
        raise BuildError(f"cannot run {args[0]}: {exc.strerror} (run hack/setup)") from exc
    if result.returncode != 0:
        raise BuildError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    out: str = result.stdout
    return out


# --- inputs -------------------------------------------------------------------------------------


@dataclass
class Inputs:
    kernel_package: str
    packages: dict[str, str]  # Debian package -> version
    dists: dict[str, str]  # Python distribution (normalized name) -> version
    sources: str  # digest of our files
    rootfs_type: str
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        blob = json.dumps(
            {
                "format": FORMAT,
                "kernel": self.kernel_package,
                "packages": self.packages,
                "dists": self.dists,
                "sources": self.sources,
                "rootfs_type": self.rootfs_type,
            },
            sort_keys=True,
        )
        self.digest = hashlib.sha256(blob.encode()).hexdigest()[:16]


def apt_candidates(packages: Iterable[str]) -> dict[str, str]:
    names = list(packages)
    out = run(["apt-cache", "policy", *names], env={**os.environ, "LC_ALL": "C"})
    found: dict[str, str] = {}
    current = ""
    for line in out.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1].split(":")[0]
        elif line.strip().startswith("Candidate:") and current:
            found[current] = line.split(":", 1)[1].strip()
    missing = [n for n in names if found.get(n, "(none)") == "(none)"]
    if missing:
        raise BuildError(f"apt offers no candidate for {', '.join(missing)} (apt-get update?)")
    return {n: found[n] for n in names}


def kernel_package(meta: str = KERNEL_META) -> str:
    out = run(["apt-cache", "show", "--no-all-versions", meta], env={**os.environ, "LC_ALL": "C"})
    for line in out.splitlines():
        if line.startswith("Depends:"):
            for dep in line.split(":", 1)[1].split(","):
                name = dep.strip().split()[0]
                if name.startswith("linux-image-"):
                    return name
    raise BuildError(f"cannot find the kernel package {meta} depends on")


def _requirement_parser() -> type:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    return Requirement


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def python_dists() -> dict[str, importlib.metadata.Distribution]:
    """auraed's runtime dependencies, transitively, as installed in the running (venv) interpreter."""
    requirement_type = _requirement_parser()
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = runtime_requirements()
    while pending:
        text = pending.pop()
        requirement = requirement_type(text)
        name = normalize(requirement.name)
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError as exc:
            raise BuildError(f"{requirement.name} is not installed in {sys.prefix} (run hack/setup)") from exc
        found[name] = dist
        extras = set(requirement.extras) | {""}
        for sub in dist.requires or []:
            sub_requirement = requirement_type(sub)
            marker = sub_requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras):
                pending.append(sub)
    return found


def walk_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc" or path.is_dir():
            continue
        yield path


def sources_digest(builders: Iterable[Path] = (HERE,)) -> str:
    digest = hashlib.sha256()
    ours = [p for d in builders for p in walk_files(d) if p.suffix != ".md"]
    paths = [REPO / "pyproject.toml", *walk_files(REPO / "auraed"), *ours]
    for path in paths:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link:" + os.readlink(path).encode())
        else:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
            digest.update(b"x" if os.access(path, os.X_OK) else b"-")
    return digest.hexdigest()


def apt_state(packages: Iterable[str] = PACKAGES, kernel_meta: str = KERNEL_META) -> str:
    """What apt's candidates depend on: its package lists, its configuration, dpkg's status."""
    digest = hashlib.sha256(json.dumps([kernel_meta, *packages]).encode())
    for directory in (Path("/var/lib/apt/lists"), Path("/etc/apt")):
        for path in sorted(directory.rglob("*")):
            if path.is_file() and "partial" not in path.parts and path.name != "lock":
                info = path.stat()
                digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    info = Path("/var/lib/dpkg/status").stat()
    digest.update(f"status\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()


def debian_packages(
    cache: Path, wanted: tuple[str, ...] = PACKAGES, kernel_meta: str = KERNEL_META
) -> tuple[str, dict[str, str]]:
    """The kernel package and every package's candidate version; remembered until apt's state changes
    (each apt-cache call here parses the package lists: ~0.7 s)."""
    state = apt_state(wanted, kernel_meta)
    remembered = cache / (
        "apt-candidates.json" if wanted == PACKAGES else f"apt-candidates-{state[:12]}.json"
    )
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(remembered.read_text())
        if saved["state"] == state:
            return saved["kernel"], saved["packages"]
    kernel = kernel_package(kernel_meta)
    packages = apt_candidates([kernel, *wanted])
    cache.mkdir(parents=True, exist_ok=True)
    partial = remembered.with_name(f".{remembered.name}.{os.getpid()}")
    partial.write_text(json.dumps({"state": state, "kernel": kernel, "packages": packages}))
    partial.rename(remembered)
    return kernel, packages


def resolve_inputs(rootfs_type: str, cache: Path, flavour: Flavour | None = None) -> Inputs:
    flavour = flavour or GUEST
    kernel, packages = debian_packages(cache, flavour.packages, flavour.kernel_meta)
    dists = {name: dist.version for name, dist in sorted(python_dists().items())}
    sources = sources_digest(flavour.builders)
    return Inputs(
        kernel, packages, dists, sources if flavour is GUEST else f"{flavour.name}:{sources}", rootfs_type
    )


# --- Debian packages -------------------------------------------------------------------------


def deb_filename(package: str, version: str) -> str:
    return f"{package}_{version.replace(':', '%3a')}_"


def fetch_packages(cache: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Each package extracted (dpkg-deb -x) into its own cached directory. The cache is shared by
    every flavour's build (guest and host images, each under its own lock, may run at once, as
    parallel test workers do): downloading and extracting hold the cache's own lock."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_packages(cache, packages)


def _fetch_packages(cache: Path, packages: dict[str, str]) -> dict[str, Path]:
    debs = cache / "debs"
    extracted = cache / "pkgs"
    debs.mkdir(parents=True, exist_ok=True)
    extracted.mkdir(parents=True, exist_ok=True)

    def deb_of(package: str, version: str) -> Path | None:
        matches = sorted(debs.glob(deb_filename(package, version) + "*.deb"))
        return matches[0] if matches else None

    wanted = [f"{p}={v}" for p, v in packages.items() if deb_of(p, v) is None]
    if wanted:
        log(f"apt-get download {' '.join(wanted)}")
        run(["apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", *wanted], cwd=debs)
    trees: dict[str, Path] = {}
    for package, version in packages.items():
        deb = deb_of(package, version)
        if deb is None:
            raise BuildError(f"apt-get download did not produce {package} {version}")
        tree = extracted / deb.name.removesuffix(".deb")
        if not tree.is_dir():
            partial = tree.with_name(tree.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            run(["dpkg-deb", "-x", str(deb), str(partial)])
            if package.startswith("linux-image-"):
                for release in (partial / "lib" / "modules").iterdir():
                    run(["depmod", "-b", str(partial), release.name])
            partial.rename(tree)
        trees[package] = tree
    return trees


# --- ELF -------------------------------------------------------------------------------------


def is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def elf_dynamic(path: Path) -> tuple[list[str], list[str]]:
    """(DT_NEEDED, DT_RUNPATH + DT_RPATH) of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    if data[4] != 2 or data[5] != 1:
        raise BuildError(f"{path}: not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    paths: list[str] = []
    for section in sections:
        if section[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[section[6]]
        base = strtab[4]

        def string(offset: int, base: int = base) -> str:
            end = data.index(b"\0", base + offset)
            return data[base + offset : end].decode()

        for offset in range(section[4], section[4] + section[5], 16):
            tag, value = struct.unpack_from("<qQ", data, offset)
            if tag == 0:
                break
            if tag == 1:
                needed.append(string(value))
            elif tag in (15, 29):
                paths.extend(string(value).split(":"))
    return needed, paths


# --- kernel modules ----------------------------------------------------------------------------


@dataclass
class Modules:
    root: Path  # .../lib/modules/<release>
    deps: dict[str, list[str]]  # module name -> dependency names, load-last first (modules.dep order)
    paths: dict[str, str]  # module name -> path relative to root

    @classmethod
    def load(cls, root: Path) -> Modules:
        deps: dict[str, list[str]] = {}
        paths: dict[str, str] = {}
        for line in (root / "modules.dep").read_text().splitlines():
            target, _, rest = line.partition(":")
            name = module_name(target)
            paths[name] = target
            deps[name] = [module_name(d) for d in rest.split()]
        return cls(root, deps, paths)

    def load_order(self, names: Iterable[str]) -> list[str]:
        order: list[str] = []

        def visit(name: str) -> None:
            if name in order:
                return
            for dep in reversed(self.deps[name]):
                visit(dep)
            order.append(name)

        for name in names:
            key = module_name(name)
            if key not in self.paths:
                raise BuildError(f"kernel module {name} is not in {self.root}/modules.dep (built in?)")
            visit(key)
        return order

    def content(self, name: str) -> bytes:
        path = self.root / self.paths[name]
        data = path.read_bytes()
        if path.suffix == ".xz":
            return lzma.decompress(data)
        if path.suffix == ".zst":
            import zstandard

            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return data

    def filename(self, name: str) -> str:
        return re.sub(r"\.ko(\.\w+)?$", ".ko", self.paths[name])


def module_name(path: str) -> str:
    return re.sub(r"\.ko(\.\w+)?$", "", path.rsplit("/", 1)[-1]).replace("-", "_")


# --- cpio (newc) -----------------------------------------------------------------------------


class Cpio:
    """A newc archive built in memory: root-owned, mtime 0, in insertion order: reproducible."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.inode = 0

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        self.inode += 1
        encoded = name.encode() + b"\0"
        fields = (self.inode, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self.out += b"070701" + b"".join(b"%08X" % f for f in fields) + encoded
        self.out += b"\0" * (-len(self.out) % 4)
        self.out += data
        self.out += b"\0" * (-len(self.out) % 4)

    def directory(self, name: str, mode: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | mode)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self.out += b"\0" * (-len(self.out) % 512)
        return bytes(self.out)


def busybox_cpio(busybox: Path, applets: Iterable[str], init: bytes) -> Cpio:
    archive = Cpio()
    for directory in ("bin", "dev", "proc", "sys", "etc", "lib", "lower", "overlay", "newroot"):
        archive.directory(directory)
    archive.chardev("dev/console", 5, 1)
    archive.chardev("dev/null", 1, 3, 0o666)
    archive.file("bin/busybox", busybox.read_bytes(), 0o755)
    for applet in applets:
        archive.symlink(f"bin/{applet}", "busybox")
    archive.file("init", init, 0o755)
    return archive


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, compresslevel=9, mtime=0)
    return data


# --- the build ----------------------------------------------------------------------------------


@dataclass
class Build:
    inputs: Inputs
    trees: dict[str, Path]
    work: Path
    out: Path
    stage: Path = field(init=False)
    used_packages: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)

    # What a flavour changes (host-image/mkhost.py's HostBuild): its libraries, modules, name.
    library_packages: ClassVar[tuple[str, ...]] = LIBRARY_PACKAGES
    initramfs_modules: ClassVar[tuple[str, ...]] = INITRAMFS_MODULES
    rootfs_extra_modules: ClassVar[tuple[str, ...]] = ROOTFS_EXTRA_MODULES
    identity: ClassVar[tuple[str, str]] = ("guest", "aurae-guest")  # (flavour, hostname and ID)

    def __post_init__(self) -> None:
        self.stage = self.work / "rootfs"

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - start, 2)
        log(f"{name}: {self.timings[name]:.2f}s")

    @property
    def kernel_tree(self) -> Path:
        return self.trees[self.inputs.kernel_package]

    @property
    def kernel_release(self) -> str:
        releases = [p.name for p in (self.kernel_tree / "lib" / "modules").iterdir()]
        if len(releases) != 1:
            raise BuildError(f"expected one kernel release in {self.kernel_tree}, found {releases}")
        return releases[0]

    def busybox(self) -> Path:
        return self.trees["busybox-static"] / "bin" / "busybox"

    def applets(self) -> list[str]:
        return [a for a in run([str(self.busybox()), "--list"]).split() if a and a != "busybox"]

    # rootfs ---------------------------------------------------------------------------------------

    def make_layout(self) -> None:
        s = self.stage
        for directory in (
            "usr/bin",
            "usr/sbin",
            f"usr/lib/{MULTIARCH}",
            "usr/lib64",
            "usr/lib/aurae",
            "proc",
            "sys",
            "dev",
            "run",
            "tmp",
            "etc/aurae",
            "root",
            "mnt",
            "var/lib",
            "var/log",
            "var/tmp",
            SITE_PACKAGES,
        ):
            (s / directory).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "sbin", "lib", "lib64"):
            (s / link).symlink_to(f"usr/{link}")
        (s / "tmp").chmod(0o1777)
        (s / "var/tmp").chmod(0o1777)
        (s / "root").chmod(0o700)
        etc = s / "etc"
        (etc / "passwd").write_text(PASSWD)
        (etc / "group").write_text(GROUP)
        (etc / "hosts").write_text(HOSTS)
        flavour, name = self.identity
        (etc / "hostname").write_text(f"{name}\n")
        (etc / "ld.so.conf").write_text(f"/usr/lib/{MULTIARCH}\n")
        (s / "usr/lib/os-release").write_text(
            f'NAME="auraed {flavour}"\nID={name}\n'
            f'VERSION_ID={self.inputs.digest}\nPRETTY_NAME="auraed {flavour} {self.inputs.digest}"\n'
        )
        (etc / "os-release").symlink_to("../usr/lib/os-release")
        (s / "usr/lib/aurae/image.json").write_text(
            json.dumps({"inputs_hash": self.inputs.digest, "kernel_release": self.kernel_release}) + "\n"
        )
        for script in ("aurae-init", "aurae-selftest"):
            shutil.copy(FILES / script, s / "usr/sbin" / script)
            (s / "usr/sbin" / script).chmod(0o755)

    def install_busybox_and_crun(self) -> None:
        s = self.stage
        shutil.copy(self.busybox(), s / "usr/bin/busybox")
        shutil.copy(self.trees["crun"] / "usr/bin/crun", s / "usr/bin/crun")
        shutil.copy(self.trees["catatonit"] / "usr/bin/catatonit", s / "usr/bin/catatonit")
        self.used_packages |= {"busybox-static", "crun", "catatonit"}
        for line in run([str(self.busybox()), "--list-full"]).split():
            directory, _, applet = line.rpartition("/")
            target_dir = {"bin": "usr/bin", "sbin": "usr/sbin"}.get(directory, directory)
            link = s / target_dir / applet
            if applet in ("busybox", "linuxrc") or link.exists() or link.is_symlink():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(s / "usr/bin/busybox", link.parent))

    def install_python(self) -> None:
        s = self.stage
        stdlib = s / f"usr/lib/python{PYTHON}"
        for package in PYTHON_PACKAGES:
            tree = self.trees[package]
            source = tree / f"usr/lib/python{PYTHON}"
            if source.is_dir():
                shutil.copytree(
                    source, stdlib, symlinks=True, dirs_exist_ok=True, ignore=self._stdlib_ignore(source)
                )
            self.used_packages.add(package)
        shutil.copy(
            self.trees["python3.11-minimal"] / f"usr/bin/python{PYTHON}", s / f"usr/bin/python{PYTHON}"
        )
        (s / "usr/bin/python3").symlink_to(f"python{PYTHON}")

    @staticmethod
    def _stdlib_ignore(source: Path) -> Callable[[str, list[str]], set[str]]:
        def ignore(directory: str, names: list[str]) -> set[str]:
            here = Path(directory)
            dropped = {n for n in names if n == "__pycache__"}
            if here == source:
                dropped |= STDLIB_DROP & set(names)
            if here.name == "lib-dynload":
                dropped |= {n for n in names if DYNLOAD_DROP.match(n)}
            return dropped

        return ignore

    def install_site_packages(self) -> None:
        target = self.stage / SITE_PACKAGES
        for name, dist in sorted(python_dists().items()):
            if name == "auraed":
                continue
            for entry in dist.files or []:
                relative = str(entry)
                if (
                    relative.startswith("..")
                    or "__pycache__" in relative
                    or relative.endswith((".pyc", ".pyi"))
                    or SITE_DROP.match(relative)
                ):
                    continue
                source = Path(str(dist.locate_file(entry)))
                if not source.is_file():
                    continue
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
        self.pin_versions(target)
        shutil.copytree(
            REPO / "auraed", target / "auraed", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        for path in sorted(target.rglob("*.so*")):
            if is_elf(path):
                run(["strip", "--strip-unneeded", str(path)])

    def pin_versions(self, target: Path) -> None:
        """Write the version of each VERSION_LOOKUPS dependency into its module as a literal."""
        versions = {name: dist.version for name, dist in python_dists().items()}
        for name, (relative, lookup) in VERSION_LOOKUPS.items():
            module = target / relative
            text = module.read_text()
            if lookup not in text:
                raise BuildError(
                    f"{relative} no longer reads its version the way VERSION_LOOKUPS in "
                    "guest-image/mkimage.py expects: update or drop that entry"
                )
            literal = (
                f'__version__ = "{versions[name]}"  # the metadata\'s, written by guest-image/mkimage.py\n'
            )
            module.write_text(text.replace(lookup, literal))

    def install_libraries(self) -> list[str]:
        """Copy the shared library closure of every ELF file in the stage; returns the library names."""
        s = self.stage
        index: dict[str, tuple[str, Path]] = {}
        for package in self.library_packages:
            tree = self.trees[package]
            for directory in (f"lib/{MULTIARCH}", f"usr/lib/{MULTIARCH}"):
                if (tree / directory).is_dir():
                    for path in (tree / directory).iterdir():
                        if path.is_file() or path.is_symlink():
                            index.setdefault(path.name, (package, path))
        libdir = s / f"usr/lib/{MULTIARCH}"
        copied: list[str] = []

        def copy(name: str) -> None:
            while not (libdir / name).exists() and not (libdir / name).is_symlink():
                package, source = index[name]
                self.used_packages.add(package)
                if source.is_symlink():
                    target = os.readlink(source)
                    (libdir / name).symlink_to(Path(target).name)
                    copied.append(name)
                    name = Path(target).name
                else:
                    shutil.copy2(source, libdir / name)
                    copied.append(name)
                    pending.append(libdir / name)

        pending = [p for p in sorted(s.rglob("*")) if is_elf(p)]
        copy("ld-linux-x86-64.so.2")
        (s / "usr/lib64/ld-linux-x86-64.so.2").symlink_to(f"../lib/{MULTIARCH}/ld-linux-x86-64.so.2")
        missing: dict[str, set[str]] = {}
        while pending:
            path = pending.pop()
            needed, runpaths = elf_dynamic(path)
            for name in needed:
                local = [Path(p.replace("$ORIGIN", str(path.parent))) / name for p in runpaths]
                if any(p.exists() and s in p.parents for p in local):
                    continue
                if name in index:
                    copy(name)
                else:
                    missing.setdefault(name, set()).add(str(path.relative_to(s)))
        if missing:
            lines = []
            for name, users in sorted(missing.items()):
                owner = subprocess.run(
                    ["dpkg", "-S", f"*/{name}"], capture_output=True, text=True, check=False
                )
                hint = owner.stdout.split(":")[0] if owner.returncode == 0 else "unknown package"
                lines.append(f"  {name} (needed by {', '.join(sorted(users))}; on this host from {hint})")
            raise BuildError("shared libraries not in LIBRARY_PACKAGES:\n" + "\n".join(lines))
        run(["ldconfig", "-r", str(s)])
        return sorted(copied)

    def customize(self) -> None:
        """What a flavour adds to the root tree before the libraries are resolved (none here)."""

    def install_modules(self, modules: Modules, names: list[str]) -> None:
        release = self.kernel_release
        destination = self.stage / "usr/lib/modules" / release
        for name in names:
            path = destination / modules.filename(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(modules.content(name))
        for extra in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
            shutil.copy(modules.root / extra, destination / extra)
        run(["depmod", "-b", str(self.stage), release])

    def compile_bytecode(self) -> None:
        # unchecked-hash: the image is read-only and never changes under the bytecode, so Python
        # must not stat sources or recompile at boot. The venv's interpreter is Debian's python3.11.
        # A fixed hash seed keeps the marshalled constants (frozensets) in one order: reproducible.
        run(
            [
                sys.executable,
                "-m",
                "compileall",
                "-q",
                "-j0",
                "--invalidation-mode",
                "unchecked-hash",
                "-s",
                str(self.stage),
                "-p",
                "/",
                str(self.stage / f"usr/lib/python{PYTHON}"),
                str(self.stage / SITE_PACKAGES),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )

    def check_rootfs(self) -> None:
        """Import every auraed module with the image's own python3, chrooted: missing pieces fail here."""
        env = {"PATH": "/usr/sbin:/usr/bin", "LANG": "C.UTF-8", "HOME": "/root"}
        result = subprocess.run(
            ["chroot", str(self.stage), "/usr/bin/python3", "-B", "-c", CHECK_SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if result.returncode != 0:
            raise BuildError(
                f"the root image's python3 cannot import auraed:\n{result.stdout}{result.stderr}"
            )
        heavy = run(["chroot", str(self.stage), "/usr/bin/python3", "-B", "-c", LEAN_CHECK_SCRIPT], env=env)
        if heavy.strip():
            raise BuildError(
                f"the guest's daemon imports {heavy.strip()} at start again: see LEAN_CHECK_SCRIPT"
            )
        # crun re-executes itself through /proc (not mounted here): ask the loader instead.
        crun = run(
            ["chroot", str(self.stage), "/usr/lib64/ld-linux-x86-64.so.2", "--list", "/usr/bin/crun"], env=env
        )
        if "not found" in crun:
            raise BuildError(f"crun's libraries do not resolve in the root image:\n{crun}")
        log(f"chroot check: {result.stdout.strip()}; crun's {len(crun.splitlines())} libraries resolve")

    def make_rootfs_image(self) -> None:
        image = self.work / "rootfs.img"
        if self.inputs.rootfs_type == "squashfs":
            run(
                [
                    "mksquashfs",
                    str(self.stage),
                    str(image),
                    "-noappend",
                    "-comp",
                    "zstd",
                    "-Xcompression-level",
                    "15",
                    "-all-root",
                    "-no-xattrs",
                    "-mkfs-time",
                    "0",
                    "-all-time",
                    "0",
                    "-no-progress",
                    "-quiet",
                ]
            )
        else:
            uuid = "-".join(
                (
                    self.inputs.digest[:8],
                    self.inputs.digest[8:12],
                    self.inputs.digest[12:16],
                    "0000",
                    "000000000000",
                )
            )
            run(
                [
                    "mkfs.erofs",
                    "-zlz4hc,6",
                    "-T0",
                    f"-U{uuid}",
                    "--all-root",
                    "-x-1",
                    "--quiet",
                    str(image),
                    str(self.stage),
                ]
            )

    # initramfs ------------------------------------------------------------------------------------

    def make_initramfs(self, modules: Modules, order: list[str]) -> None:
        conf = (
            "# Written by guest-image/mkimage.py\n"
            f'AURAE_MODULES="{" ".join(order)}"\n'
            f"AURAE_ROOTFSTYPE={self.inputs.rootfs_type}\n"
            f"AURAE_KERNEL_RELEASE={self.kernel_release}\n"
        )
        archive = busybox_cpio(self.busybox(), self.applets(), (FILES / "init").read_bytes())
        archive.file("etc/initramfs.conf", conf.encode())
        archive.directory("lib/modules")
        for name in order:
            archive.file(f"lib/modules/{name}.ko", modules.content(name))
        (self.work / "initramfs.img").write_bytes(compress(archive.finish(), INITRAMFS_COMPRESSION))
        bare = busybox_cpio(self.busybox(), ["sh", "echo", "poweroff"], (FILES / "bare-init").read_bytes())
        (self.work / "bare-initramfs.img").write_bytes(compress(bare.finish(), INITRAMFS_COMPRESSION))

    def run(self, started: float) -> None:
        release = self.kernel_release
        modules = Modules.load(self.kernel_tree / "lib" / "modules" / release)
        order = modules.load_order(self.initramfs_modules)
        with self.step("kernel and initramfs"):
            shutil.copy(self.kernel_tree / "boot" / f"vmlinuz-{release}", self.work / "vmlinuz")
            self.make_initramfs(modules, order)
        with self.step("rootfs tree"):
            self.make_layout()
            self.install_busybox_and_crun()
            self.install_python()
            self.install_site_packages()
            self.customize()
            libraries = self.install_libraries()
            self.install_modules(
                modules, modules.load_order([*self.initramfs_modules, *self.rootfs_extra_modules])
            )
        with self.step("bytecode"):
            self.compile_bytecode()
        with self.step("chroot check"):
            self.check_rootfs()
        with self.step(f"rootfs image ({self.inputs.rootfs_type})"):
            self.make_rootfs_image()
        unused = sorted(set(self.library_packages) - self.used_packages)
        if unused:
            log(f"note: library packages nothing needs: {', '.join(unused)}")
        tree_bytes = sum(
            p.stat().st_size for p in self.stage.rglob("*") if p.is_file() and not p.is_symlink()
        )
        shutil.rmtree(self.stage)
        files = {}
        for name in ("vmlinuz", "initramfs.img", "rootfs.img", "bare-initramfs.img"):
            data = (self.work / name).read_bytes()
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {
            "inputs_hash": self.inputs.digest,
            "flavour": self.identity[0],
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "step_seconds": self.timings,
            "kernel": {
                "package": self.inputs.kernel_package,
                "version": self.inputs.packages[self.inputs.kernel_package],
                "release": release,
            },
            "rootfs": {
                "type": self.inputs.rootfs_type,
                "tree_bytes": tree_bytes,
                "default_init": "/sbin/aurae-init",
                "selftest_init": "/sbin/aurae-selftest",
                "python": f"/usr/bin/python{PYTHON}",
                "site_packages": f"/{SITE_PACKAGES}",
                "modules": modules.load_order([*self.initramfs_modules, *self.rootfs_extra_modules]),
            },
            "initramfs": {"compression": INITRAMFS_COMPRESSION, "modules": order},
            "files": files,
            "packages": self.inputs.packages,
            "python_dists": self.inputs.dists,
            "libraries": libraries,
            "kernel_args": KERNEL_ARGS,
        }
        (self.work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


INITRAMFS_COMPRESSION = "gzip"
KERNEL_ARGS = {
    "auraed.init": "program run as PID 1 from the root image (default /sbin/aurae-init)",
    "auraed.root": (
        "root image device (default /dev/vda), serial=NAME (virtio-blk serial) or PARTLABEL=NAME (GPT name)"
    ),
    "auraed.rootfstype": "squashfs or erofs (default: the type built)",
    "auraed.rootwait": "seconds to wait for the root device (default 10)",
    "auraed.overlay_size": "tmpfs size= of the writable upper layer (default: tmpfs default, half of RAM)",
    "auraed.rescue": "1: a console shell instead of powering off on an initramfs failure",
    "auraed.debug": "1: trace the initramfs /init on the console",
    "auraed.role": "guest: read by auraed (PID 1) itself, not by the initramfs",
}


# --- flavours -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flavour:
    """One kind of image this builder makes: the guest's (GUEST) or the host's (host-image/mkhost.py)."""

    name: str
    base: Path  # where builds go: <base>/<inputs-hash>, <base>/latest
    packages: tuple[str, ...]  # Debian packages besides the kernel
    builders: tuple[Path, ...]  # the builder directories whose files the inputs hash covers
    build: type[Build] = Build
    kernel_meta: str = KERNEL_META  # the Debian metapackage whose linux-image-* is the kernel


GUEST = Flavour("guest", DEFAULT_BASE, PACKAGES, (HERE,))


# --- entry point --------------------------------------------------------------------------------


def manifest_hash(directory: Path) -> str | None:
    try:
        value = json.loads((directory / "manifest.json").read_text()).get("inputs_hash")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def is_image_dir(directory: Path) -> bool:
    return directory.is_dir() and (manifest_hash(directory) is not None or not any(directory.iterdir()))


def point_latest(base: Path, directory: Path) -> None:
    latest = base / "latest"
    temporary = base / ".latest.tmp"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(directory.name)
    temporary.rename(latest)


def prune(base: Path, keep: Path) -> None:
    """Remove builds nobody built or reused for PRUNE_AFTER seconds, beyond the KEEP_BUILDS newest.

    A build's directory mtime is touched whenever it is reused, and VMs may still be booting from
    builds of a source tree that changed minutes ago, so recency alone never removes anything.
    """
    builds = [
        p
        for p in base.iterdir()
        if p.is_dir() and not p.is_symlink() and re.fullmatch(r"[0-9a-f]{16}", p.name)
    ]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    now = time.time()
    for old in [p for p in builds if p != keep][KEEP_BUILDS - 1 :]:
        if now - old.stat().st_mtime > PRUNE_AFTER:
            log(f"removing build {old.name}, unused for {(now - old.stat().st_mtime) / 3600:.0f} h")
            shutil.rmtree(old, ignore_errors=True)


def remove_killed_builds(base: Path) -> None:
    """The trees (``.<hash>.tmp``) of builds killed outright (SIGKILL, a crash); called under the
    lock every build holds, so none of them is in progress."""
    for stale in base.glob(".*.tmp"):
        if stale.is_dir() and not stale.is_symlink():
            log(f"removing {stale.name}, left by a build that was killed")
            shutil.rmtree(stale, ignore_errors=True)


def build(out: Path | None, rootfs_type: str, force: bool, cache: Path, flavour: Flavour = GUEST) -> Path:
    started = time.monotonic()
    base = flavour.base
    base.mkdir(parents=True, exist_ok=True)
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remove_killed_builds(base)
        inputs = resolve_inputs(rootfs_type, cache, flavour)
        destination = out if out is not None else base / inputs.digest
        if not force and manifest_hash(destination) == inputs.digest:
            log(f"up to date: {destination} ({time.monotonic() - started:.2f}s)")
            os.utime(destination)
            if out is None:
                point_latest(base, destination)
            return destination
        if destination.exists() and not is_image_dir(destination):
            raise BuildError(f"{destination} exists and is not a {flavour.name} image directory")
        log(f"building {inputs.digest} into {destination}")
        try:
            trees = fetch_packages(cache, inputs.packages)
        except BuildError:
            log("fetching failed; apt-get update and resolving again")
            run(["apt-get", "update", "-qq"])
            inputs = resolve_inputs(rootfs_type, cache, flavour)
            destination = out if out is not None else base / inputs.digest
            trees = fetch_packages(cache, inputs.packages)
        work = destination.parent / f".{destination.name}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            flavour.build(inputs, trees, work, destination).run(started)
            if destination.exists():
                shutil.rmtree(destination)
            work.rename(destination)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if out is None:
            point_latest(base, destination)
            prune(base, destination)
        log(f"built {destination} in {time.monotonic() - started:.1f}s")
        return destination


def main(argv: list[str] | None = None, flavour: Flavour = GUEST, description: str = "") -> int:
    prog = f"{flavour.name}-image/build"
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help=f"output directory (default: .work/{flavour.name}-image/<inputs-hash>)"
    )
    parser.add_argument(
        "--rootfs-type",
        choices=("erofs", "squashfs"),
        default="erofs",
        help="erofs (lz4hc, default: boots faster under TCG) or squashfs (zstd, half the size)",
    )
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_BASE / "cache", help="downloaded and extracted .debs"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    parser.add_argument("--print-hash", action="store_true", help="print the inputs hash and exit")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print(f"{prog}: run as root (chroot, depmod and ldconfig -r need it)", file=sys.stderr)
        return 2
    if f"{sys.version_info.major}.{sys.version_info.minor}" != PYTHON:
        print(f"{prog}: needs Python {PYTHON} (the image's); this is {sys.version}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupted)
    try:
        if args.print_hash:
            print(resolve_inputs(args.rootfs_type, args.cache.resolve(), flavour).digest)
            return 0
        out = args.out.resolve() if args.out else None
        print(build(out, args.rootfs_type, args.force, args.cache.resolve(), flavour))
    except BuildError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = signal.Signals(exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
        print(f"{prog}: interrupted ({signum.name}): nothing built", file=sys.stderr)
        return 128 + signum.value
    return 0


if __name__ == "__main__":
    sys.exit(main())
