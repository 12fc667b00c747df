"""The guest image for real: guest-image/build from Debian packages and our code, booted under QEMU TCG.

The build runs once per session (cached by the hash of its inputs, so usually it only checks). Every
boot is a microvm with no network device; each QEMU process is killed and reaped when its test
ends, whatever happened. Boots that must end by themselves (the guest powers off) are checked to.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "guest-image" / "build"
FILES = ("vmlinuz", "initramfs.img", "rootfs.img", "bare-initramfs.img", "manifest.json")
BARE_MARKER = "AURAE-BARE-BOOT-OK"
ROOTFS_MARKER = "AURAE-ROOTFS-OK"


def build(*args: str) -> tuple[Path, str, float]:
    """Run guest-image/build: (output directory, its log, seconds)."""
    started = time.monotonic()
    result = subprocess.run([str(BUILD), *args], capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, f"guest-image/build failed:\n{result.stderr[-4000:]}"
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, f"guest-image/build printed more than its directory: {result.stdout!r}"
    return Path(lines[0]), result.stderr, time.monotonic() - started


@pytest.fixture(scope="session")
def guest_image() -> Path:
    out, _, _ = build()
    return out


def tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    raise AssertionError("no 'cpu MHz' in /proc/cpuinfo")


class Guest:
    """One QEMU microvm (TCG) with its serial console on stdout, collected by a thread."""

    def __init__(self, image: Path, initramfs: str, append: str, root_serial: str = "") -> None:
        serial = f",serial={root_serial}" if root_serial else ""
        self.args = [
            "qemu-system-x86_64",
            "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on",
            "-accel", "tcg", "-cpu", "max", "-m", "512", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-serial", "stdio",
            "-kernel", str(image / "vmlinuz"),
            "-initrd", str(image / initramfs),
            "-append", f"console=ttyS0 panic=-1 tsc_early_khz={tsc_khz()} {append}",
            "-drive", f"id=root,file={image / 'rootfs.img'},format=raw,if=none,readonly=on",
            "-device", f"virtio-blk-device,drive=root{serial}",
        ]  # fmt: skip
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._output: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            with self._lock:
                self._output.append(raw.decode(errors="replace"))

    @property
    def console(self) -> str:
        with self._lock:
            return "".join(self._output)

    def wait_for(self, text: str, timeout: float) -> float:
        """Seconds from QEMU's start until ``text`` is on the console."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if text in self.console:
                return time.monotonic() - self.started
            if self.process.poll() is not None:
                self._reader.join(5)
                if text in self.console:
                    return time.monotonic() - self.started
                code = self.process.returncode
                raise AssertionError(f"QEMU exited ({code}) before {text!r}:\n{self.console}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.console}")

    def wait_exit(self, timeout: float) -> int:
        """The guest powers itself off: QEMU exits."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"QEMU still running {timeout}s later:\n{self.console}") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextlib.contextmanager
def booted(image: Path, initramfs: str, append: str = "", root_serial: str = "") -> Iterator[Guest]:
    guest = Guest(image, initramfs, append, root_serial)
    try:
        yield guest
    finally:
        guest.kill()


def test_manifest_describes_the_files(guest_image: Path) -> None:
    manifest = json.loads((guest_image / "manifest.json").read_text())
    assert guest_image.name == manifest["inputs_hash"]
    for name in FILES:
        assert (guest_image / name).is_file(), f"{guest_image} lacks {name}"
    for name, entry in manifest["files"].items():
        assert (guest_image / name).stat().st_size == entry["size"] > 0
    kernel = manifest["kernel"]
    assert kernel["package"].startswith("linux-image-") and kernel["package"].endswith("-cloud-amd64")
    assert kernel["package"] == f"linux-image-{kernel['release']}"
    assert manifest["packages"][kernel["package"]] == kernel["version"]
    for package in ("busybox-static", "crun", "python3.11-minimal", "libc6"):
        assert package in manifest["packages"]
    assert {"grpcio", "protobuf", "betterproto2", "cryptography"} <= set(manifest["python_dists"])
    assert manifest["rootfs"]["type"] in ("erofs", "squashfs")
    modules = manifest["initramfs"]["modules"]
    # Dependencies load first (from modules.dep): virtio before its transports, failover before net.
    assert modules.index("virtio_ring") < modules.index("virtio") < modules.index("virtio_mmio")
    assert modules.index("failover") < modules.index("net_failover") < modules.index("virtio_net")
    assert {"virtio_blk", "erofs", "squashfs", "overlay", "virtio_pci"} <= set(modules)
    # The initramfs is a gzip'd newc cpio.
    assert (guest_image / "initramfs.img").read_bytes()[:2] == b"\x1f\x8b"
    latest = guest_image.parent / "latest"
    assert latest.is_symlink()


def test_unchanged_inputs_reuse_the_build(guest_image: Path) -> None:
    again, log, seconds = build()
    assert again == guest_image
    assert "up to date" in log
    assert seconds < 15, f"a cached build took {seconds:.1f}s"
    hashed, _, _ = build("--print-hash")
    assert hashed.name == guest_image.name


def test_bare_initramfs_boots_and_powers_off(guest_image: Path) -> None:
    with booted(guest_image, "bare-initramfs.img") as guest:
        seconds = guest.wait_for(BARE_MARKER, timeout=60)
        assert guest.wait_exit(timeout=30) == 0
    print(f"bare boot: {BARE_MARKER} {seconds:.2f}s after QEMU started")


def test_rootfs_selftest(guest_image: Path) -> None:
    """The real root image with a PID 1 of its own: python3, auraed and grpc import; crun runs a
    container on cgroup v2. The root is found by its virtio serial (auraed.root=serial=...)."""
    append = "auraed.init=/sbin/aurae-selftest auraed.root=serial=aurae-root"
    with booted(guest_image, "initramfs.img", append, root_serial="aurae-root") as guest:
        seconds = guest.wait_for(ROOTFS_MARKER, timeout=90)
        guest.wait_for("AURAE-SELFTEST-DONE", timeout=120)
        assert guest.wait_exit(timeout=30) == 0
        console = guest.console
    assert "AURAE-SELFTEST-FAILED" not in console, console
    assert "Python 3.11" in console
    assert "crun version" in console
    assert "modprobe veth ok" in console
    assert "AURAE-CRUN-42" in console, console
    assert "cgroup2 controllers:" in console and "memory" in console
    print(f"rootfs self-test: {ROOTFS_MARKER} {seconds:.2f}s after QEMU started")


@pytest.mark.parametrize(
    ("append", "message"),
    [
        ("auraed.init=/sbin/no-such-init", "auraed.init=/sbin/no-such-init does not exist in the root image"),
        ("auraed.root=/dev/vdz auraed.rootwait=1", "root device /dev/vdz did not appear"),
    ],
)
def test_initramfs_failure_is_reported_and_powers_off(guest_image: Path, append: str, message: str) -> None:
    with booted(guest_image, "initramfs.img", append) as guest:
        guest.wait_for(message, timeout=60)
        assert guest.wait_exit(timeout=30) == 0
        assert "aurae-initramfs: FATAL" in guest.console
        assert "Kernel panic" not in guest.console
