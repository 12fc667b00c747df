"""The guest image for real: guest-image/build from Debian packages and our code, booted under QEMU TCG.

The build runs once per session (cached by the hash of its inputs, so usually it only checks). Every
boot is a microvm with no network device; each QEMU process is killed and reaped when its test
ends, whatever happened. Boots that must end by themselves (the guest powers off) are checked to.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from auraed.pki import PkiPaths
from tests.support.configdisk import config_disk as squashfs_config_disk

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

    def __init__(
        self, image: Path, initramfs: str, append: str, root_serial: str = "", extra: tuple[str, ...] = ()
    ) -> None:
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
            *extra,
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
def booted(
    image: Path, initramfs: str, append: str = "", root_serial: str = "", extra: tuple[str, ...] = ()
) -> Iterator[Guest]:
    guest = Guest(image, initramfs, append, root_serial, extra)
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
        # switch_root could not execute a directory: a kernel panic, not a message.
        ("auraed.init=/usr/bin", "auraed.init=/usr/bin is not a file in the root image"),
        ("auraed.root=/dev/vdz auraed.rootwait=1", "root device /dev/vdz did not appear"),
        # $((rootwait * 20)) took "0.5" as an expression and "08" as bad octal: a shell error ended
        # /init, a kernel panic.
        ("auraed.rootwait=0.5", "auraed.rootwait=0.5 is not a whole number of seconds"),
        ("auraed.root=/dev/vdz auraed.rootwait=08", "root device /dev/vdz did not appear within 8s"),
    ],
)
def test_initramfs_failure_is_reported_and_powers_off(guest_image: Path, append: str, message: str) -> None:
    with booted(guest_image, "initramfs.img", append) as guest:
        guest.wait_for(message, timeout=60)
        assert guest.wait_exit(timeout=30) == 0
        assert "aurae-initramfs: FATAL" in guest.console
        assert "Kernel panic" not in guest.console


def test_the_daemon_and_pid1_read_one_role(guest_image: Path) -> None:
    """A VM's own kernel_args come after the host's "auraed.role=guest", and the last word counts.
    The Daemon used to look for the guest word anywhere: it served as a guest while PID 1, reading
    "host", skipped the config disk and, without auraed.poweroff=1, halted the VM for ever."""
    append = "auraed.role=guest auraed.role=host auraed.poweroff=1"
    with booted(guest_image, "initramfs.img", append) as guest:
        guest.wait_for("auraed starting as ", timeout=90)
        assert guest.wait_exit(timeout=60) == 0  # no config here: it stops, and powers off
        console = guest.console
    assert "auraed starting as host (PID 1 without a guest marker" in console, console
    assert "powering off" in console, console


# A guest daemon with no network: its unix socket only (the config disk's auraed.toml).
UNIX_ONLY_GUEST_CONFIG = """role = "guest"
socket = "/run/aurae/aurae.sock"
state_dir = "/run/aurae/state"
runtime_dir = "/run/aurae/run"
"""


def config_disk(pki: PkiPaths, work: Path, config_text: str = UNIX_ONLY_GUEST_CONFIG) -> Path:
    """A squashfs config disk as PID 1 mounts it at /etc/aurae (serial "config"): the server's
    credentials and ``config_text`` as auraed.toml."""
    credentials = {
        "pki/ca.crt": pki.ca_crt,
        "pki/server.crt": pki.server_crt,
        "pki/server.key": pki.server_key,
    }
    return squashfs_config_disk(work, config_text, credentials)


def qmp(path: Path, command: str) -> dict[str, object]:
    """One QMP command on QEMU's control socket (greeting, capabilities, the command)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        replies = sock.makefile("r")
        replies.readline()  # the greeting
        for execute in ("qmp_capabilities", command):
            sock.sendall(json.dumps({"execute": execute}).encode() + b"\n")
            while "return" not in (reply := json.loads(replies.readline())) and "error" not in reply:
                pass  # events
        return reply


def test_a_power_button_press_while_auraed_starts_powers_off(
    guest_image: Path, pki: PkiPaths, tmp_path: Path
) -> None:
    """The host stops a VM with system_powerdown (the ACPI power button). evdev gives a reader only
    the presses after its open, and PID 1 used to open the button only once the daemon ran: a
    guest stopped while auraed started (seconds under TCG) lost the press and served on."""
    control = tmp_path / "qmp.sock"
    extra = (
        "-drive", f"id=config,file={config_disk(pki, tmp_path)},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-device,drive=config,serial=config",
        "-qmp", f"unix:{control},server=on,wait=off",
    )  # fmt: skip
    with booted(guest_image, "initramfs.img", "auraed.role=guest", extra=extra) as guest:
        guest.wait_for("PID 1 boot done", timeout=90)
        assert "error" not in qmp(control, "system_powerdown")
        assert guest.wait_exit(timeout=90) == 0
        console = guest.console
    assert "config disk /dev/vdb (squashfs) mounted read-only" in console, console
    assert "power button: stopping auraed, then powering off" in console, console
    assert "auraed ended (status 0, power button): powering off" in console, console


def session_processes(session: int) -> list[str]:
    """The processes still in ``session`` (a build started with start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session:  # field 6, the session id
                    found.append(f"{entry.name}: {(entry / 'comm').read_text().strip()}")
    return found


def test_a_build_stopped_by_sigterm_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM (a cancelled CI job, ``timeout``) used to end the build on the spot: its half-made
    tree (~100 MB) stayed behind, with whatever step it was running."""
    out = tmp_path / "out"
    work = tmp_path / ".out.tmp"
    process = subprocess.Popen(
        [str(BUILD), "--out", str(out), "--force"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (work / "rootfs" / "usr").is_dir():  # well into the build
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        process.terminate()
        _, err = process.communicate(timeout=120)
        # Checked before the cleanup below kills the session: a step the build left running is
        # found, not killed; one that is ending as the build returns gets a few seconds.
        deadline = time.monotonic() + 5
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = session_processes(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "guest-image/build: interrupted (SIGTERM): nothing built" in err
    assert "Traceback" not in err, err
    assert not work.exists() and not out.exists()
    assert left == []


def test_a_killed_build_is_cleaned_up_by_the_next(guest_image: Path) -> None:
    """SIGKILL leaves the tree (``.<hash>.tmp``) behind; the next build removes it."""
    stale = guest_image.parent / ".0000000000000000.tmp"
    (stale / "rootfs").mkdir(parents=True)
    try:
        _, log, _ = build()
        assert not stale.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
    assert "removing .0000000000000000.tmp, left by a build that was killed" in log


def test_a_missing_tool_fails_the_build_clearly(tmp_path: Path) -> None:
    """A tool hack/setup installs (here mkfs.erofs) missing from PATH: a one-line error naming it,
    not a traceback, and nothing left behind."""
    path = tmp_path / "bin"
    path.mkdir()
    for directory in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for tool in Path(directory).iterdir() if Path(directory).is_dir() else ():
            if tool.name != "mkfs.erofs" and not (path / tool.name).exists():
                (path / tool.name).symlink_to(tool)
    out = tmp_path / "out"
    done = subprocess.run(
        [str(BUILD), "--out", str(out), "--force"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PATH": str(path)},
    )
    assert done.returncode == 1, done.stderr
    assert (
        "guest-image/build: cannot run mkfs.erofs: No such file or directory (run hack/setup)" in done.stderr
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert not out.exists() and not (tmp_path / ".out.tmp").exists()
