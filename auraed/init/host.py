"""auraed as PID 1 of a machine booted from the host image (host-image/): bare metal, host role.

The host image writes ``/usr/lib/aurae/host.json`` (:class:`HostProfile`); PID 1 of the initial pid
namespace that finds it, and no ``auraed.role=guest``, runs the machine this way
(auraed/init/pid1.py calls in here):

- boot: the data disk found, formatted when blank, mounted on the state directory
  (auraed/init/datadisk.py); the network from ``ip=`` (auraed/init/ipconfig.py), else DHCP on the
  first link with carrier through busybox's ``udhcpc`` (already in the image for its applets, a
  client that renews its lease on its own; our lease script applies it with iproute2); the hostname.
- serving: the daemon runs as a CHILD of PID 1 (:class:`DaemonSupervisor`), not inside it as in a
  guest. PID 1 stays a small stdlib process that mounts, reaps and powers off; a daemon that dies --
  an exception, a crash of grpc's C core, the OOM killer -- is restarted (backing off), the machine
  stays up and says so on the console. A guest keeps the daemon in PID 1: a guest's boot is its
  startup time, and its host restarts a guest that died.
- the child reports to PID 1 over a datagram socket (``NOTIFY_SOCKET``, sd_notify's protocol):
  ``READY=1`` once it serves (PID 1 then prints the status screen) and ``AURAE_ACTION=reboot`` or
  ``poweroff`` from SystemService Shutdown (:class:`InitMachine`), after which PID 1 stops it
  (SIGTERM: containers and cells stopped), syncs, unmounts and reboots or powers off.
- first boot (in the child, which imports the PKI anyway; auraed/init/hostpki.py): the host's CA
  and server certificate on the data disk, and a client configuration shown once on the console
  with the CA's fingerprint.

SIGTERM, SIGPWR and the power button power the machine off; SIGINT (Ctrl-Alt-Del) reboots it.

The console has no login and no shell: the status screen only, unless the daemon's config turns
``console_shell`` on (:class:`ConsoleShell`: a root shell there each time Enter is pressed).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from auraed.init import ipconfig

if TYPE_CHECKING:
    from auraed.init.datadisk import DataDisk

log = logging.getLogger("auraed.pid1")

PROFILE_PATH = "usr/lib/aurae/host.json"
INIT_SOCKET = "/run/aurae/init.sock"
NOTIFY_ENV = "NOTIFY_SOCKET"
INIT_SOCKET_ENV = "AURAED_INIT_SOCKET"  # set for the daemon PID 1 runs: it is the host's
ACTIONS = ("poweroff", "reboot")
DATA_DISK_WAIT = 10.0
CARRIER_WAIT = 5.0
DHCP_TIMEOUT = 30.0
RESTART_BACKOFF: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_RUN = 60.0  # a daemon that served this long before dying starts again at the first backoff
STOP_WAIT_EXTRA = 30.0  # seconds beyond stop_grace_period the daemon has to stop before SIGKILL
# console_shell: busybox's cttyhack gives the shell the console's real tty (ttyS0, tty1: what
# /sys/class/tty/console/active names) as its controlling terminal, so ^C and job control work.
CONSOLE_SHELL = ("cttyhack", "sh", "-l")
CONSOLE_SHELL_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "TERM": "linux",
    "PS1": "aurae# ",
}
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B


class HostProfile(NamedTuple):
    """The host image's ``host.json`` (host-image/mkhost.py writes it)."""

    data_label: str
    data_serial: str
    state_dir: str
    api_port: int
    tls_dir: str
    client_dir: str
    dhcp_script: str
    data_partname: str = ""  # the GPT name of a data partition (host-image's disk.img: aurae-data)
    # Kernel modules loaded at boot, in order (paths under /lib/modules/<release>): tun for the VMs'
    # taps (no udev here to load it on first open of /dev/net/tun), KVM for their accelerator.
    modules: tuple[str, ...] = ()
    # Directories made under the state dir once it is mounted (relative paths): what the root links
    # to it so that it outlives a reboot, e.g. cni/net.d for /etc/cni/net.d (pods' CNI networks).
    state_dirs: tuple[str, ...] = ()

    @classmethod
    def load(cls, root: str = "/") -> HostProfile | None:
        try:
            with open(os.path.join(root, PROFILE_PATH)) as handle:
                data = json.load(handle)
        except FileNotFoundError:
            return None
        disk = data["data_disk"]
        return cls(
            data_label=str(disk["label"]),
            data_serial=str(disk["serial"]),
            state_dir=str(disk["mount"]),
            api_port=int(data["api_port"]),
            tls_dir=str(data["tls_dir"]),
            client_dir=str(data["client_dir"]),
            dhcp_script=str(data["dhcp_script"]),
            data_partname=str(disk.get("partname", "")),
            modules=tuple(str(m) for m in data.get("modules", ())),
            state_dirs=tuple(str(d) for d in data.get("state_dirs", ())),
        )


# ----- boot ----------------------------------------------------------------------------------


class HostBoot:
    """What PID 1 does on a host image before the daemon starts; each step logs and goes on."""

    def __init__(self, profile: HostProfile, cmdline: str) -> None:
        self.profile = profile
        self.cmdline = cmdline
        self.disk: DataDisk | None = None
        self.disk_problem = ""
        self.network = ""  # how the address came, for the status screen

    def load_modules(self) -> None:
        """The profile's modules, each on its own: one that fails (kvm_intel on an AMD machine, or
        under TCG with no VMX) is logged and the rest still load."""
        from auraed.init import powerbutton

        loaded = []
        for module in self.profile.modules:
            try:
                loaded += powerbutton.load_modules(modules=(module,))
            except OSError as exc:
                log.info("kernel module %s not loaded: %s", os.path.basename(module), exc.strerror or exc)
        if loaded:
            log.info("loaded %s", " ".join(os.path.basename(p) for p in loaded))

    def data_disk(self) -> None:
        from auraed.init import datadisk

        p = self.profile
        try:
            self.disk = datadisk.prepare(
                p.data_label, p.data_serial, p.state_dir, DATA_DISK_WAIT, partname=p.data_partname
            )
        except (datadisk.DataDiskError, OSError) as exc:
            self.disk_problem = str(exc)
            log.error("data disk: %s; the state is in memory and lost at power-off", exc)
            os.makedirs(p.state_dir, mode=0o700, exist_ok=True)
        self.make_state_dirs()

    def make_state_dirs(self) -> None:
        """The profile's directories on the state dir (0755, as /etc's would be); one that cannot be
        made, or that names a path outside the state dir, is logged and skipped."""
        base = os.path.realpath(self.profile.state_dir)
        for relative in self.profile.state_dirs:
            path = os.path.realpath(os.path.join(base, relative))
            if os.path.isabs(relative) or not path.startswith(base + os.sep):
                log.error("state dir %r: not a path under %s; skipped", relative, base)
                continue
            try:
                os.makedirs(path, mode=0o755, exist_ok=True)
            except OSError as exc:
                log.error("state dir %s: %s", path, exc.strerror or exc)

    def configure_network(self, hostname_given: bool) -> None:
        from auraed.init import netconf

        try:
            wanted = ipconfig.from_cmdline(self.cmdline)
        except ValueError as exc:
            log.error("%s: trying DHCP instead", exc)
            wanted = ipconfig.IpConfig("dhcp")
        wanted = wanted or ipconfig.IpConfig("dhcp")
        if wanted.hostname and not hostname_given:
            from auraed.system.namespaces import sethostname

            sethostname(wanted.hostname)
        if wanted.mode == "off":
            self.network = "off (ip=off)"
            return
        device = wanted.device or first_link_with_carrier(CARRIER_WAIT)
        if not device:
            self.network = "no link with carrier"
            log.error("network: no link with carrier; the aurae API is only on its unix socket")
            return
        if wanted.mode == "static":
            if not netconf.wait_for_interface(device, CARRIER_WAIT):
                raise OSError(f"ip=: {device} did not appear in {CARRIER_WAIT:g} s")
            netconf.configure_interface(device, wanted.address, wanted.prefix)
            if wanted.gateway:
                netconf.add_default_route(wanted.gateway, device)
            write_resolv_conf(wanted.dns)
            self.network = f"{device} {wanted.address}/{wanted.prefix} (ip= on the kernel command line)"
            log.info("network: %s, default via %s", self.network, wanted.gateway or "(none)")
            return
        self.network = f"{device} by DHCP (udhcpc)"
        start_dhcp(device, self.profile.dhcp_script)


def first_link_with_carrier(timeout: float, sys_dir: str = "/sys/class/net") -> str:
    """Bring every ethernet link up, then the first (by name) that reports carrier."""
    from auraed.init import netconf

    deadline = time.monotonic() + timeout
    candidates: list[str] = []
    while not candidates and time.monotonic() < deadline:
        candidates = sorted(
            name for name in os.listdir(sys_dir) if _read(f"{sys_dir}/{name}/type") == "1" and name != "lo"
        )
        if not candidates:
            time.sleep(0.05)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in candidates:
            with contextlib.suppress(OSError):
                netconf.set_up(sock, name)
    while True:
        for name in candidates:
            if _read(f"{sys_dir}/{name}/carrier") == "1":
                return name
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.05)


def start_dhcp(device: str, script: str) -> None:
    """busybox udhcpc: at most three discovers (2 s apart) now, then on in the background, where
    it also renews the lease; it forks itself away (its own orphan, reaped by PID 1)."""
    args = [
        "udhcpc",
        "-i",
        device,
        "-s",
        script,
        "-t",
        "3",
        "-T",
        "2",
        "-b",
        "-S",
        "-x",
        "hostname:" + socket.gethostname(),
    ]
    try:
        subprocess.run(args, stdin=subprocess.DEVNULL, timeout=DHCP_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("network: udhcpc on %s: %s", device, exc)


def write_resolv_conf(servers: Sequence[str]) -> None:
    if servers:
        with open("/etc/resolv.conf", "w") as handle:
            handle.writelines(f"nameserver {server}\n" for server in servers)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def interface_addresses(sys_dir: str = "/sys/class/net") -> list[tuple[str, str, int]]:
    """(interface, IPv4 address, prefix) of every interface but lo that has one (its primary)."""
    found: list[tuple[str, str, int]] = []
    try:
        names = sorted(os.listdir(sys_dir))
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            if name == "lo":
                continue
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)[20:24]
                mask = fcntl.ioctl(sock.fileno(), SIOCGIFNETMASK, request)[20:24]
            except OSError:
                continue
            found.append((name, socket.inet_ntoa(address), bin(int.from_bytes(mask, "big")).count("1")))
    return found


def ca_fingerprint(ca_pem: bytes) -> str:
    """SHA-256 of the first certificate's DER, as ``openssl x509 -fingerprint -sha256`` shows it."""
    text = ca_pem.decode("ascii", errors="replace")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start = text.index(begin) + len(begin)
    der = base64.b64decode("".join(text[start : text.index(end, start)].split()))
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


# ----- serving: the daemon as PID 1's child --------------------------------------------------


class DaemonSupervisor:
    """The daemon as a child process of PID 1: started, restarted when it dies, stopped on request.

    PID 1 (auraed/init/pid1.py ``Pid1.serve``) runs it as it runs a Daemon in a guest: ``run``
    until ``request_stop``."""

    def __init__(
        self,
        argv: Sequence[str],
        boot: HostBoot,
        on_action: Callable[[str, str], object],
        *,
        stop_grace: float,
        environ: Mapping[str, str] | None = None,
        socket_path: str = INIT_SOCKET,
        console_shell: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.shell = ConsoleShell(self.show_status) if console_shell else None
        self.boot = boot
        self.on_action = on_action
        self.stop_grace = stop_grace
        self.environ = dict(os.environ if environ is None else environ)
        self.socket_path = socket_path
        self.backoff = RESTART_BACKOFF
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._exited = asyncio.Event()
        self._socket: socket.socket | None = None
        self.ready_at: float | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-B", "-m", "auraed", *self.argv]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._open_socket(loop)
        if self.shell is not None:
            self.shell.start(loop)
        status = 0
        try:
            while not self._stopping:
                started = time.monotonic()
                status = await self._run_once()
                if self._stopping:
                    break
                ran = time.monotonic() - started
                if ran >= STABLE_RUN:
                    self.restarts = 0
                delay = self.backoff[min(self.restarts, len(self.backoff) - 1)]
                self.restarts += 1
                console(
                    f"auraed: the daemon ended ({describe_status(status)}) after {ran:.1f} s; the "
                    f"machine stays up: restarting it in {delay:g} s (restart {self.restarts})"
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._exited.wait(), delay)  # set only when stopping
        finally:
            self._close_socket(loop)
            if self.shell is not None:
                self.shell.stop()
        return 0 if status is None else status

    async def _run_once(self) -> int:
        env = {**self.environ, NOTIFY_ENV: self.socket_path, INIT_SOCKET_ENV: self.socket_path}
        self.ready_at = None
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command(), stdin=subprocess.DEVNULL, env=env, start_new_session=False
            )
        except OSError as exc:
            log.error("cannot start the daemon: %s", exc)
            return 127
        log.info("started the daemon (pid %d)", self.process.pid)
        status = await self.process.wait()
        self.process = None
        return status

    def request_stop(self) -> None:
        """Stop the daemon (SIGTERM: its graceful stop) and do not start it again; SIGKILL if it
        has not stopped after its grace period and some."""
        if self._stopping:
            return
        self._stopping = True
        self._exited.set()
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        asyncio.get_running_loop().call_later(self.stop_grace + STOP_WAIT_EXTRA, self._kill, process)

    @staticmethod
    def _kill(process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            log.error("the daemon did not stop in time: killing it")
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    # ----- the notify socket ----------------------------------------------------------------

    def _open_socket(self, loop: asyncio.AbstractEventLoop) -> None:
        path = self.socket_path
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        sock.bind(path)
        os.chmod(path, 0o600)
        self._socket = sock
        loop.add_reader(sock.fileno(), self._on_message)

    def _close_socket(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._socket is not None:
            loop.remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = None
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)

    def _on_message(self) -> None:
        assert self._socket is not None
        while True:
            try:
                data = self._socket.recv(4096)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("init socket: %s", exc)
                return
            self.handle(parse_notify(data))

    def handle(self, fields: dict[str, str]) -> None:
        if fields.get("READY") == "1":
            self.ready_at = time.monotonic()
            self.show_status()
        action = fields.get("AURAE_ACTION", "")
        if action in ACTIONS:
            self.on_action(action, fields.get("AURAE_REASON", "") or f"the daemon asked to {action}")

    def show_status(self) -> None:
        """The status screen, once the daemon serves (again after a console shell ends)."""
        if self.ready_at is None or self.process is None:
            return
        console(status_screen(self.boot, self.process.pid, self.restarts, shell=self.shell is not None))


class ConsoleShell:
    """console_shell: a root shell on the machine's console (PID 1's fd 0) each time Enter is
    pressed there, one at a time; PID 1 reads nothing of the console while it runs, and shows
    ``on_closed`` (the status screen) when it ends. Sessions are logged, never what is typed."""

    def __init__(
        self,
        on_closed: Callable[[], None],
        fd: int = 0,
        argv: Sequence[str] = CONSOLE_SHELL,
        environ: Mapping[str, str] = CONSOLE_SHELL_ENV,
    ) -> None:
        self.on_closed = on_closed
        self.fd = fd
        self.argv = list(argv)
        self.environ = dict(environ)
        self.sessions = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = False
        self._stopped = False
        self._session: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._listen()

    def stop(self) -> None:
        self._stopped = True
        self._unlisten()

    def _listen(self) -> None:
        assert self._loop is not None
        if self._stopped or self._listening:
            return
        try:
            self._loop.add_reader(self.fd, self._on_input)
            self._listening = True
        except (OSError, ValueError) as exc:
            log.error("console shell: cannot read the console: %s", exc)

    def _unlisten(self) -> None:
        if self._listening and self._loop is not None:
            self._loop.remove_reader(self.fd)
        self._listening = False

    def _on_input(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        except OSError as exc:
            log.error("console shell: reading the console: %s", exc)
            data = b""
        if not data:  # no console input at all (/dev/null, a closed line)
            self._unlisten()
            return
        if b"\n" in data or b"\r" in data:
            self._unlisten()
            assert self._loop is not None
            self._session = self._loop.create_task(self._run_session())

    async def _run_session(self) -> None:
        self.sessions += 1
        started = time.monotonic()
        log.warning("console shell %d opened on the console (console_shell is on)", self.sessions)
        status: int | None = None
        try:
            shell = await asyncio.create_subprocess_exec(
                *self.argv, env=self.environ, cwd="/", start_new_session=True
            )
            status = await shell.wait()
        except OSError as exc:
            log.error("console shell: cannot start %s: %s", self.argv[0], exc)
        log.warning(
            "console shell %d closed after %.0f s (%s)",
            self.sessions, time.monotonic() - started, describe_status(status),
        )  # fmt: skip
        if not self._stopped:
            self.on_closed()
            self._listen()


def parse_notify(data: bytes) -> dict[str, str]:
    fields = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


def describe_status(status: int | None) -> str:
    if status is None:
        return "status unknown"
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


def uptime() -> float:
    try:
        return float(_read("/proc/uptime").split()[0])
    except (IndexError, ValueError):
        return 0.0


def status_screen(boot: HostBoot, daemon_pid: int, restarts: int, shell: bool = False) -> str:
    p = boot.profile
    addresses = interface_addresses()
    try:
        fingerprint = ca_fingerprint(Path(p.tls_dir, "ca.crt").read_bytes())
    except (OSError, ValueError) as exc:
        fingerprint = f"(unreadable: {exc})"
    if boot.disk is not None:
        new = ", formatted this boot" if boot.disk.formatted else ""
        disk = f"{boot.disk.device} ({boot.disk.how}{new}) on {p.state_dir}"
    else:
        disk = f"NONE -- state in memory only ({boot.disk_problem})"
    endpoints = [f"{address}:{p.api_port}" for _, address, _ in addresses] or ["(no address yet)"]
    width = 78
    lines = [
        "=" * width,
        f" auraed host {socket.gethostname()} -- PID 1 is auraed (host role)",
        f" health      SERVING (daemon pid {daemon_pid}, {uptime():.1f} s after boot"
        + (f", {restarts} restarts" if restarts else "")
        + ")",
        f" network     {boot.network or '(none)'}",
        *(f" address     {name} {address}/{prefix}" for name, address, prefix in addresses),
        f" aurae API   mTLS on {', '.join(endpoints)}",
        f" CA SHA-256  {fingerprint}",
        f" data disk   {disk}",
        *([" console     press Enter for a root shell (console_shell = true)"] if shell else []),
        f" client      config in {p.client_dir} (shown on the console at first boot)",
        "=" * width,
    ]
    return "\n".join(lines)


def console(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode(errors="replace"))


# ----- the daemon's side ---------------------------------------------------------------------


class InitMachine:
    """The Machine (auraed/server/system_service.py) of a daemon PID 1 runs on a host image: a
    Shutdown asks PID 1, over its socket, to stop the daemon and reboot or power off."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def power_off(self, reason: str, reboot: bool = False) -> str:
        from auraed.errors import AuraeError
        from auraed.system.sdnotify import notify

        action = "reboot" if reboot else "poweroff"
        message = f"AURAE_ACTION={action}\nAURAE_REASON={reason.replace(chr(10), ' ')}"
        if not notify(message, self.socket_path):
            raise AuraeError.precondition(f"{action}: PID 1 does not answer on {self.socket_path}")
        return action
