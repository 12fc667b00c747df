"""The duties of auraed as PID 1: in a guest VM, on bare metal, and (reduced) in a pid namespace.

``auraed/__main__.py`` hands over to :func:`main` when ``os.getpid() == 1``. What runs when:

1. :meth:`Pid1.boot`, before anything else (before the configuration is read, stdlib only):
   console logging; the mounts (proc, sysfs, devtmpfs, devpts, /dev/shm, /run, /tmp, cgroup2 with
   every controller enabled for the children of the root) -- each skipped when already mounted;
   the subprocess hook that registers auraed's own children (see :mod:`auraed.init.reaper`);
   handlers for the stop signals (SIGTERM, SIGINT, SIGPWR), so that one sent while auraed starts
   is not dropped (PID 1 gets no signal it has no handler for) and auraed is then not started.
   Then, only for the machine's init (PID 1 of the initial pid namespace): Ctrl-Alt-Del to SIGINT
   (when power-off is allowed), the hostname (``auraed.hostname=``), the config disk read-only at
   /etc/aurae (guests: the disk with serial ``config``; hosts only with
   ``auraed.config_disk=<device>``), the network
   (``auraed.ip=<addr>/<prefix>``, ``auraed.gateway=<addr>``, ``auraed.iface=`` default eth0: lo up,
   address, up, default route, by ioctls), and the evdev/ACPI button modules when no power button
   is visible yet. Last, the power buttons are opened (evdev queues only the presses after its
   open: one while auraed starts is then not lost).
2. :func:`main` loads the configuration (from the config disk) and has the Daemon built by the
   factory ``auraed/__main__.py`` handed over (PID 1 does not import the server).
3. :meth:`Pid1.serve` runs the Daemon in an event loop of ours, with: SIGCHLD-driven orphan
   reaping, SIGTERM/SIGINT/SIGPWR as a graceful stop (the Daemon installs its own for SIGTERM and
   SIGINT, same effect), the power button watched through the loop, and the boot log lines
   replayed into Observe's daemon log once the Daemon has set up its logging.
4. :meth:`Pid1.finish` once the Daemon has stopped, returned or raised (PID 1 never just exits: the
   kernel panics): SIGTERM to every process, a grace period, SIGKILL, reaping, sync, unmount
   (reverse order), sync, then the final action -- power off (``reboot(RB_POWER_OFF)``) for a
   guest or with ``auraed.poweroff=1``; exit for PID 1 of a child pid namespace (a container, the
   tests: the namespace simply ends); otherwise halt (sleep forever, reaping).

Safety: ``reboot()`` is only ever called when this process is PID 1 of the INITIAL pid namespace
(``/proc/self/ns/pid`` is inode 0xEFFFFFFC) and the kernel command line makes it a guest or enables
power-off; PID 1 of any other pid namespace (every test) can only exit. Mounting at ``/``,
hostname and network changes also need the initial pid namespace; in a child pid namespace, mounts
happen only under an explicit test root (``AURAED_PID1_ROOT``).

Test hooks (environment, read by :meth:`Pid1Layout.from_env`): ``AURAED_PID1_ROOT`` puts every
mount target under that directory (and never enables cgroup controllers there: the hierarchy is
the host's); ``AURAED_PID1_POWER_BUTTON`` is a ':'-separated list of input devices (or FIFOs) to
watch instead of discovering "Power Button" devices.

Power off from an RPC: the Daemon that ``auraed/__main__.py`` builds for PID 1 is given the
:class:`Pid1`, and its Shutdown call goes through :meth:`Pid1.power_off`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from auraed.bootargs import GUEST_CONFIG_DISK, BootArgs

if TYPE_CHECKING:
    import asyncio
    from typing import Protocol

    from auraed.config import DaemonConfig
    from auraed.init.host import HostBoot
    from auraed.init.identity import TemplateGuest
    from auraed.init.powerbutton import PowerButtonWatcher
    from auraed.init.reaper import ChildRegistry, Reaper

    class Stoppable(Protocol):
        """What PID 1 needs of what it runs: the Daemon, or the supervisor of its child."""

        async def run(self) -> int: ...

        def request_stop(self) -> None: ...

    class Serving(Stoppable, Protocol):
        """The Daemon in PID 1's own process: a template's is handed its clone's config before
        it listens."""

        before_listening: Callable[[], Awaitable[DaemonConfig]] | None

    # What auraed/__main__.py hands over: the Daemon to serve, built once the configuration is
    # read and given this Pid1 (its Shutdown call powers the machine off through it).
    DaemonFactory = Callable[[DaemonConfig, "Pid1"], Serving]


log = logging.getLogger("auraed.pid1")

INITIAL_PID_NS_INODE = 0xEFFFFFFC  # PROC_PID_INIT_INO: the initial pid namespace's nsfs inode
RB_POWER_OFF = 0x4321FEDC  # LINUX_REBOOT_CMD_POWER_OFF (glibc's reboot() adds the magic numbers)
RB_AUTOBOOT = 0x01234567  # LINUX_REBOOT_CMD_RESTART
RB_DISABLE_CAD = 0  # LINUX_REBOOT_CMD_CAD_OFF: Ctrl-Alt-Del sends SIGINT to PID 1

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20

# (source, target relative to the root, fstype, flags, data), mounted in this order.
MOUNTS: tuple[tuple[str, str, str, int, str | None], ...] = (
    ("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
    ("sysfs", "sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
    ("devtmpfs", "dev", "devtmpfs", MS_NOSUID, "mode=0755"),
    ("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5"),
    ("tmpfs", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("tmpfs", "run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
    ("tmpfs", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("cgroup2", "sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
)
CONFIG_DIR = "etc/aurae"
TEMPLATE_CONFIG_DIR = "run/aurae-template"  # a template's config, until a clone has its own
VIRTIO_CONSOLE_MODULE = "kernel/drivers/char/virtio_console.ko"  # virtio-serial (a template's identity port)
CONFIG_DISK_FSTYPES = ("squashfs", "erofs")
DEVICE_WAIT = 5.0  # seconds for the config disk's node to appear
INTERFACE_WAIT = 10.0  # seconds for eth0 to appear (virtio_net may still be probing)
TERMINATE_GRACE = 5.0  # seconds between SIGTERM and SIGKILL to every process at the end
KILL_WAIT = 5.0  # seconds for SIGKILLed processes to disappear
BOOT_LOG_LIMIT = 1000
# What stops PID 1 gracefully: SIGTERM, SIGINT (also Ctrl-Alt-Del once reboot(CAD_OFF) is set) and
# SIGPWR (what container managers such as LXC send an init to shut it down). Names, not numbers:
# this module imports no signal at load time.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGPWR")
_ACTIONS = {"poweroff": "powering off", "reboot": "rebooting", "exit": "exiting", "halt": "halting"}
CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the daemon's console format


class Pid1Layout(NamedTuple):
    """Where PID 1 mounts things; tests point ``root`` at a temporary directory."""

    root: str = "/"
    config_device: str = GUEST_CONFIG_DISK
    power_buttons: tuple[str, ...] = ()  # explicit devices; discovered from sysfs when empty
    enable_controllers: bool = True
    cmdline: str = "/proc/cmdline"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Pid1Layout:
        env = os.environ if environ is None else environ
        root = env.get("AURAED_PID1_ROOT", "") or "/"
        buttons = tuple(p for p in env.get("AURAED_PID1_POWER_BUTTON", "").split(":") if p)
        return cls(root=root, power_buttons=buttons, enable_controllers=root == "/")

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    @property
    def is_real_root(self) -> bool:
        return os.path.realpath(self.root) == "/"


def in_initial_pid_namespace() -> bool:
    """True only for the machine's own pid namespace; False when unsure."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INITIAL_PID_NS_INODE
    except OSError:
        return False


_machine_init: list[bool] = []  # cached once known: a process never changes its pid namespace


def machine_init_status() -> bool | None:
    """Whether this is PID 1 of the initial pid namespace (the process the kernel started); None
    when it cannot be known (PID 1 without a readable /proc).

    Cached at the first answer read from /proc, so that it still holds at the very end, after
    /proc has been unmounted; a forked child (pid != 1) is never the machine's init.
    """
    if os.getpid() != 1:
        return False
    if not _machine_init:
        try:
            inode = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            return None
        _machine_init.append(inode == INITIAL_PID_NS_INODE)
    return _machine_init[0]


def is_machine_init() -> bool:
    """PID 1 of the initial pid namespace, for sure."""
    return machine_init_status() is True


class _BootBuffer(logging.Handler):
    """Keeps the records logged before the Daemon's logging exists, to replay them into Observe."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < BOOT_LOG_LIMIT:
            self.records.append(record)


class Pid1:
    def __init__(self, layout: Pid1Layout | None = None, args: BootArgs | None = None) -> None:
        from auraed.init.reaper import ChildRegistry, Reaper

        self.layout = layout or Pid1Layout()
        self.args = args or BootArgs()
        self.registry: ChildRegistry = ChildRegistry()
        self.reaper: Reaper = Reaper(self.registry)
        self.reason = ""
        self.grace = TERMINATE_GRACE
        self.timings: dict[str, float] = {}
        self._daemon: Stoppable | None = None
        self._boot_log = _BootBuffer()
        # Power buttons opened at boot: evdev hands a reader only the events after its open, so a
        # press while auraed is still starting (seconds under TCG) would otherwise be lost.
        self._buttons: list[tuple[str, int]] | None = None
        # A machine booted from the host image (auraed/init/host.py): its boot, and what ends it.
        self.host: HostBoot | None = None
        self.action = "poweroff"

    # ----- 1. boot ---------------------------------------------------------------------------

    def boot(self) -> None:
        """Everything before the configuration is read. Every step logs its failure and goes on."""
        started = time.monotonic()
        self.setup_console_logging()
        from auraed.init.reaper import install_popen_hook

        install_popen_hook(self.registry)  # before anything can spawn a child
        self._step("signal handlers", self.handle_stop_signals)
        step = time.monotonic()
        if os.getpid() == 1 and self.layout.is_real_root and not os.path.ismount("/proc"):
            # A kernel that started us directly: /proc first, to learn which PID 1 we are.
            self._step("mount /proc", lambda: self._mount(*MOUNTS[0]))
        machine = is_machine_init()
        if machine or not self.layout.is_real_root:
            self._step("mounts", self.mount_all)
            self.timings["mounts"] = time.monotonic() - step
        else:
            log.info("PID 1 of a child pid namespace: the mounts are left to whoever made it")
        self._step("console", self.ensure_console)
        self._step("kernel command line", self.read_cmdline)
        if machine and not self.args.guest:
            self._step("host image", self.load_host)
        if machine and self.final_action() == "poweroff":
            self._step("Ctrl-Alt-Del", lambda: _reboot(RB_DISABLE_CAD))
        if machine and self.args.template:
            # Hostname, config and network come with each clone's identity (auraed/init/identity.py).
            self._step("identity port", self.prepare_template)
        elif machine:
            self._step("hostname", self.set_hostname)
            step = time.monotonic()
            self._step("config disk", self.mount_config_disk)
            self.timings["config disk"] = time.monotonic() - step
            host = self.host
            if host is not None:
                step = time.monotonic()
                self._step("data disk", host.data_disk)
                self.timings["data disk"] = time.monotonic() - step
                self._step("kernel modules", host.load_modules)
            step = time.monotonic()
            self._step("network", self.configure_network)
            if host is not None and not self.args.ip:
                self._step("network (ip=)", lambda: host.configure_network(bool(self.args.hostname)))
            self.timings["network"] = time.monotonic() - step
            self._step("shared directory", self.mount_share)
        if machine and self.args.debug_console:
            self._step("debug console", self.start_debug_console)
        if machine and not self.layout.power_buttons:
            self._step("power button modules", self.load_power_button_modules)
        self._step("power button", self.open_power_buttons)
        self.timings["boot"] = time.monotonic() - started
        log.info(
            "PID 1 boot done in %.0f ms (%s)",
            self.timings["boot"] * 1000,
            ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in self.timings.items() if k != "boot"),
        )

    def handle_stop_signals(self) -> None:
        """Stop signals count from the very start. PID 1 gets no signal it has no handler for: one
        that arrived before the loop's handlers (boot, the configuration, the imports: seconds under
        TCG) was dropped, and auraed went on to serve as if nobody had asked it to stop."""
        import signal

        for name in STOP_SIGNALS:
            signal.signal(signal.Signals[name], self._on_early_signal)

    def _on_early_signal(self, sig: int, _frame: object) -> None:
        self._on_signal(sig)

    def _step(self, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception as exc:
            log.error("PID 1: %s failed: %s", what, exc)

    def setup_console_logging(self) -> None:
        """Console (stderr, the serial console of a guest) until the Daemon sets up its own."""
        root = logging.getLogger()
        root.setLevel(logging.INFO)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        if sys.stderr is not None:
            console = logging.StreamHandler(sys.stderr)
            console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
            root.addHandler(console)
        root.addHandler(self._boot_log)

    def ensure_console(self) -> None:
        """fds 0-2 on /dev/console if the kernel or initramfs left them closed."""
        broken = []
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
            except OSError:
                broken.append(fd)
        if not broken:
            return
        console = os.open(self.layout.path("dev/console"), os.O_RDWR | os.O_NOCTTY)
        for fd in broken:
            os.dup2(console, fd)
        if console not in (0, 1, 2):
            os.close(console)
        if sys.stderr is None or 2 in broken:
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives forever)
            self.setup_console_logging()

    def read_cmdline(self) -> None:
        with open(self.layout.cmdline) as handle:
            self.args = BootArgs.parse(handle.read())
        if self.args.role:
            log.info("kernel command line: role %s", self.args.role)

    def mount_all(self) -> None:
        """The MOUNTS, each skipped when something is mounted there already."""
        mounted = []
        for entry in MOUNTS:
            try:
                if self._mount(*entry):
                    mounted.append(self.layout.path(entry[1]))
            except OSError as exc:
                log.error("PID 1: cannot mount %s on %s: %s", entry[2], self.layout.path(entry[1]), exc)
        if mounted:
            log.info("mounted %s", " ".join(mounted))

    def _mount(self, source: str, relative: str, fstype: str, flags: int, data: str | None) -> bool:
        from auraed.system.namespaces import mount

        target = self.layout.path(relative)
        if os.path.ismount(target):
            return False
        os.makedirs(target, mode=0o755, exist_ok=True)
        mount(source, target, fstype, flags, data)
        if fstype == "cgroup2" and self.layout.enable_controllers:
            try:
                enable_controllers(target)
            except OSError as exc:
                log.error("PID 1: cgroup2 controllers: %s", exc)
        return True

    def mount_share(self) -> None:
        """The host's shared directory (virtio-fs, ``auraed.share=TAG``) at SHARE_MOUNT: a pod's
        volumes, which containers bind-mount from there."""
        if self.args.share:
            from auraed.bootargs import SHARE_MOUNT

            if self._mount(self.args.share, SHARE_MOUNT.lstrip("/"), "virtiofs", 0, None):
                log.info("shared directory %s at %s", self.args.share, SHARE_MOUNT)

    def load_host(self) -> None:
        """The host image's profile: this machine runs as a bare-metal host (auraed/init/host.py)."""
        from auraed.init.host import HostBoot, HostProfile

        profile = HostProfile.load(self.layout.root)
        if profile is not None:
            with open(self.layout.cmdline) as handle:
                self.host = HostBoot(profile, handle.read())
            log.info("host image: auraed serves as this machine's host")

    def set_hostname(self) -> None:
        if self.args.hostname:
            from auraed.system.namespaces import sethostname

            sethostname(self.args.hostname)
            log.info("hostname %s", self.args.hostname)

    def mount_config_disk(self) -> None:
        """The config disk read-only at <root>/etc/aurae (before the configuration is loaded).

        ``auraed.config_disk=`` names the device, or ``serial=NAME`` for the virtio disk with that
        serial (QEMU ``-device virtio-blk-*,serial=NAME``); a guest's default is the disk whose serial
        is GUEST_CONFIG_SERIAL (auraed/bootargs.py).
        """
        wanted = self.args.config_disk or (self.layout.config_device if self.args.guest else "")
        if not wanted:
            return
        target = self.layout.path(CONFIG_DIR)
        if os.path.ismount(target):
            log.info("config disk: %s is already mounted", target)
            return
        deadline = time.monotonic() + DEVICE_WAIT
        while not (device := find_block_device(wanted, self.layout.path("sys"), self.layout.path("dev"))):
            if time.monotonic() >= deadline:
                raise OSError(f"{wanted} did not appear in {DEVICE_WAIT:g} s")
            time.sleep(0.02)
        from auraed.system.namespaces import mount

        os.makedirs(target, mode=0o755, exist_ok=True)
        errors = []
        for fstype in CONFIG_DISK_FSTYPES:
            try:
                mount(device, target, fstype, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError as exc:
                errors.append(f"{fstype}: {exc.strerror}")
                continue
            log.info("config disk %s (%s) mounted read-only on %s", device, fstype, target)
            return
        raise OSError(f"cannot mount {device} on {target}: {'; '.join(errors)}")

    def configure_network(self) -> None:
        """lo up; then, when ``auraed.ip`` says so, the address, link up and the default route."""
        from auraed.system.namespaces import bring_loopback_up

        # Whatever auraed.ip says: a guest booted without it had no 127.0.0.1 at all.
        bring_loopback_up()
        if not self.args.ip:
            return
        from auraed.init import netconf

        address, prefix = netconf.parse_cidr(self.args.ip)
        gateway = netconf.check_address(self.args.gateway) if self.args.gateway else ""
        iface = self.args.iface
        if not netconf.wait_for_interface(iface, INTERFACE_WAIT):
            raise OSError(f"{iface} did not appear in {INTERFACE_WAIT:g} s")
        netconf.configure_interface(iface, address, prefix)
        if gateway:
            netconf.add_default_route(gateway, iface)
        log.info("network: %s %s/%d up, default via %s", iface, address, prefix, gateway or "(none)")

    def prepare_template(self) -> None:
        """A template: lo up, and the virtio-serial driver its identity port needs."""
        from auraed.init import powerbutton
        from auraed.system.namespaces import bring_loopback_up

        bring_loopback_up()
        powerbutton.load_modules(modules=(VIRTIO_CONSOLE_MODULE,))

    def start_debug_console(self) -> None:
        """The host's vm_debug_console: a shell on the debug port, served by a thread of its own."""
        from auraed.init import debugshell, powerbutton

        powerbutton.load_modules(modules=(VIRTIO_CONSOLE_MODULE,))
        debugshell.start(self.layout.path("sys"), self.layout.path("dev"))

    def open_power_buttons(self) -> None:
        """Open the power buttons now, to be watched once the loop runs (see ``self._buttons``)."""
        from auraed.init import powerbutton

        self._buttons = []
        paths = list(self.layout.power_buttons) or powerbutton.find_power_buttons(
            self.layout.path("sys"), self.layout.path("dev")
        )
        for path in paths:
            try:
                self._buttons.append((path, powerbutton.open_device(path)))
            except OSError as exc:
                log.error("power button %s: %s", path, exc)

    def load_power_button_modules(self) -> None:
        from auraed.init import powerbutton

        if powerbutton.find_power_buttons(self.layout.path("sys"), self.layout.path("dev")):
            return
        loaded = powerbutton.load_modules()
        if loaded:
            log.info("loaded %s", " ".join(os.path.basename(p) for p in loaded))

    # ----- 2./3. serve -----------------------------------------------------------------------

    def run(self, daemon: Stoppable) -> int:
        """Run ``daemon`` in a loop of ours; unlike asyncio.run, cleanup is bounded (a worker
        thread stuck in a read must not keep PID 1 from powering off)."""
        import asyncio

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(self.serve(daemon))
        finally:
            try:
                _cancel_remaining(loop)
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def serve(self, daemon: Stoppable) -> int:
        import asyncio
        import signal

        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_log_loop_exception)
        self._daemon = daemon
        for name in STOP_SIGNALS:
            sig = signal.Signals[name]
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.reason:  # asked to stop while booting (handle_stop_signals): nothing to start
            log.info("%s before auraed started: not starting it", self.reason)
            self._close_buttons()
            return 0
        self.reaper.start(loop)
        task = loop.create_task(daemon.run())
        await asyncio.sleep(0)  # the Daemon's run() sets up its logging before its first await
        self._replay_boot_log()
        watcher = self._watch_power_buttons(loop)
        try:
            return await task
        finally:
            if watcher is not None:
                watcher.close()
            self.reaper.stop()

    def power_off(self, reason: str, reboot: bool = False) -> str:
        """Stop auraed gracefully, then end the machine as :meth:`final_action` says, which it
        returns (for a Shutdown/PowerOff RPC).

        Returns at once: the caller's RPC still gets its answer, because the Daemon gives in-flight
        calls a grace period when it stops; the power-off follows once everything has stopped (see
        :meth:`finish`). Raises AuraeError(FAILED_PRECONDITION) while this PID 1 serves no Daemon,
        or where it is the machine's init but not allowed to power off (a host without
        ``auraed.poweroff=1``), where stopping would leave a halted machine.
        """
        from auraed.errors import AuraeError

        if self._daemon is None:
            raise AuraeError.precondition("power off: this PID 1 is not serving auraed")
        if reboot and self.host is None:
            raise AuraeError.precondition("reboot: only a machine booted from the host image reboots")
        if self.host is not None:
            return self.request_action("reboot" if reboot else "poweroff", reason)
        action = self.final_action()
        if action == "halt":
            raise AuraeError.precondition(
                "power off: not enabled on this machine (auraed.poweroff=1 on the kernel command line)"
            )
        self.request_power_off(reason)
        return action

    def request_action(self, action: str, reason: str) -> str:
        """Stop auraed, then ``action`` ("poweroff" or "reboot"): a host image's machine."""
        if not self.reason:
            self.action = action
        self.request_power_off(reason)
        return self.action

    def request_power_off(self, reason: str) -> None:
        if self.reason:
            log.info("%s: already stopping (%s)", reason, self.reason)
            return
        self.reason = reason
        log.info("%s: stopping auraed, then %s", reason, _ACTIONS[self.final_action()])
        if self._daemon is not None:
            self._daemon.request_stop()

    def _on_signal(self, sig: int) -> None:
        import signal

        name = signal.Signals(sig).name
        if self.host is not None:  # Ctrl-Alt-Del reboots, as on any init; the others power off
            self.request_action("reboot" if name == "SIGINT" else "poweroff", f"received {name}")
            return
        self.request_power_off(f"received {name}")

    def _replay_boot_log(self) -> None:
        from auraed.observe.events import DaemonLogHandler

        root = logging.getLogger()
        handlers = [h for h in root.handlers if isinstance(h, DaemonLogHandler)]
        for record in self._boot_log.records:
            if record.levelno >= root.level:
                for handler in handlers:
                    handler.handle(record)
        self._boot_log.records.clear()

    def _watch_power_buttons(self, loop: asyncio.AbstractEventLoop) -> PowerButtonWatcher | None:
        from auraed.init import powerbutton

        if not self._buttons:  # boot() did not run, or found none: the modules may just have come
            self.open_power_buttons()
        buttons, self._buttons = self._buttons or [], []
        if not buttons:
            if self.args.guest:
                log.warning("no power button found: system_powerdown will not stop this guest")
            return None
        watcher = powerbutton.PowerButtonWatcher(loop, lambda path: self.request_power_off("power button"))
        for path, fd in buttons:
            watcher.adopt(path, fd)
        log.info("watching the power button (%s)", " ".join(watcher.devices))
        return watcher

    def _close_buttons(self) -> None:
        for _, fd in self._buttons or []:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._buttons = []

    # ----- 4. finish -------------------------------------------------------------------------

    def final_action(self) -> str:
        """One of "poweroff", "exit" (PID 1 of a child pid namespace, or not PID 1) or "halt"
        (also when unsure: exiting would panic a machine, powering off might hit a host)."""
        machine = machine_init_status()
        if machine is None:
            return "halt"
        if not machine:
            return "exit"
        if self.host is not None:
            return self.action
        if self.args.guest or self.args.poweroff:
            return "poweroff"
        return "halt"

    def finish(self, status: int, reason: str = "") -> NoReturn:
        """Stop everything and end the machine (or the namespace); never returns."""
        import signal

        self._daemon = None
        action = self.final_action()
        try:
            for name in (*STOP_SIGNALS, "SIGHUP"):
                signal.signal(signal.Signals[name], signal.SIG_IGN)
            self._console_only_logging()
            log.info(
                "auraed ended (status %d, %s): %s",
                status,
                self.reason or reason or "the daemon stopped",
                _ACTIONS[action],
            )
            if os.getpid() == 1:  # kill(-1) from anyone else would hit far too much
                self.terminate_all(self.grace)
                os.sync()
                self.unmount_all()
            os.sync()
        except BaseException as exc:  # nothing may keep PID 1 from the end
            _console(f"auraed: PID 1 shutdown: {exc!r}")
        if action == "poweroff":
            _power_off_machine(self.args, self.host is not None)
        if action == "reboot" and self.host is not None:
            _reboot_machine()
        if action == "exit":
            os._exit(status & 0xFF)
        _halt_forever()

    def _console_only_logging(self) -> None:
        """The loop is gone: keep only the console handler (Observe's would publish to nothing)."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            if type(handler) is not logging.StreamHandler:
                root.removeHandler(handler)

    def terminate_all(self, grace: float) -> None:
        """SIGTERM to every process of the pid namespace, ``grace`` seconds, SIGKILL, reap."""
        import signal

        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT)):
            if not _other_processes():
                break
            try:
                os.kill(-1, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while _reap_any() or (_other_processes() and time.monotonic() < deadline):
                time.sleep(0.02)
        while _reap_any():
            pass

    def unmount_all(self) -> None:
        """Unmount everything under the root in reverse order (the root itself: remount
        read-only); only the machine's init may do that at "/", others only under a test root."""
        from auraed.system.namespaces import mount, umount

        real_root = self.layout.is_real_root
        if real_root and not is_machine_init():
            return
        root = os.path.realpath(self.layout.root)
        prefix = root.rstrip("/") + "/"
        targets = [t for t in _mount_points() if t.startswith(prefix) and t != root]
        failed = []
        for target in reversed(targets):
            try:
                umount(target)
            except OSError:
                failed.append(target)
        if real_root:
            try:
                mount(None, "/", None, MS_REMOUNT | MS_RDONLY)
            except OSError:
                failed.append("(remount / read-only)")
        log.info("unmounted %d file systems%s", len(targets) - len(failed), _busy(failed))


SIZED_TMPFS = "size=50%"
"""A tmpfs of MOUNTS given no size has the kernel's default, half the machine's memory when it was
mounted: resized to it again after the host grew the machine."""


def resize_tmpfs(root: str = "/") -> list[str]:
    """PID 1's tmpfs mounts (MOUNTS: /run, where a guest's containers and images live, /tmp,
    /dev/shm) sized again to half the machine's memory, as a cold boot of its new size has them:
    after the host grew the machine (a template's clone grown as it was restored, a Resize), they
    were still half of what it had at boot. Their flags are MOUNTS' (a remount sets them again).
    What failed, in words (nothing is undone)."""
    from auraed.system.namespaces import mount

    failures = []
    for source, relative, fstype, flags, _ in MOUNTS:
        target = os.path.join(root, relative)
        if fstype != "tmpfs" or not os.path.ismount(target):
            continue
        try:
            mount(source, target, fstype, flags | MS_REMOUNT, SIZED_TMPFS)
        except OSError as exc:
            failures.append(f"{target}: {exc.strerror or exc}")
    return failures


def find_block_device(wanted: str, sys_dir: str = "/sys", dev_dir: str = "/dev") -> str:
    """``wanted`` if that device exists; for ``serial=NAME`` the disk whose serial is NAME; "" if
    none (yet)."""
    if not wanted.startswith("serial="):
        return wanted if os.path.exists(wanted) else ""
    serial = wanted.removeprefix("serial=")
    try:
        disks = sorted(os.listdir(f"{sys_dir}/block"))
    except OSError:
        return ""
    for disk in disks:
        try:
            with open(f"{sys_dir}/block/{disk}/serial") as handle:
                if handle.read().strip().strip("\0") == serial:
                    return f"{dev_dir}/{disk}"
        except OSError:
            continue
    return ""


def _busy(failed: Sequence[str]) -> str:
    return f"; busy: {' '.join(failed)}" if failed else ""


def enable_controllers(cgroup_root: str) -> list[str]:
    """Enable every available controller in the root's cgroup.subtree_control; what is enabled."""
    with open(os.path.join(cgroup_root, "cgroup.controllers")) as handle:
        available = handle.read().split()
    control = os.path.join(cgroup_root, "cgroup.subtree_control")
    with open(control) as handle:
        enabled = set(handle.read().split())
    missing = [c for c in available if c not in enabled]
    if missing:
        try:
            with open(control, "w") as handle:
                handle.write(" ".join(f"+{c}" for c in missing))
        except OSError:
            for controller in missing:  # one refused must not keep the others off
                try:
                    with open(control, "w") as handle:
                        handle.write(f"+{controller}")
                except OSError as exc:
                    log.error("cgroup2: cannot enable %s: %s", controller, exc.strerror)
        with open(control) as handle:
            enabled = set(handle.read().split())
    result = [c for c in available if c in enabled]
    log.info("cgroup2 controllers: %s", " ".join(result) or "none")
    return result


def _mount_points() -> list[str]:
    """Mount points of this mount namespace, in mount order (octal escapes decoded)."""
    points = []
    with open("/proc/self/mountinfo", "rb") as handle:
        for line in handle:
            fields = line.split(b" ", 5)
            if len(fields) > 4:
                points.append(fields[4].decode("unicode_escape").encode("latin-1").decode())
    return points


def _other_processes() -> bool:
    """Any process of this pid namespace besides us that is not a kernel thread."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if name.isdigit() and name != me:
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    if handle.read(1):
                        return True
                with open(f"/proc/{name}/stat", "rb") as handle:
                    data = handle.read()
                if data[data.rfind(b")") + 2 :].startswith(b"Z"):
                    return True
            except OSError:
                continue
    return False


def _reap_any() -> bool:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return pid > 0


def _clone_config(
    template: TemplateGuest, argv: list[str], root: str, started: float
) -> Callable[[], Awaitable[DaemonConfig]]:
    """What a template's Daemon awaits before its listeners: ready, then a clone's identity, then
    the clone's own config (written with its identity where a cold boot's config disk is)."""

    async def wait() -> DaemonConfig:
        import asyncio

        from auraed.config import load_config

        template.ready(started)
        identity = await asyncio.to_thread(template.take_identity, root)
        if identity.get("mem_total_kib", 0) > template.mem_total_kib:
            # Grown as it was restored: /run (the containers' layers), /tmp and /dev/shm take half
            # the clone's memory, not the template's.
            for failure in resize_tmpfs(root):
                log.warning("a tmpfs not resized to the clone's memory: %s", failure)
        loading = time.monotonic()
        config = load_config(argv)
        log.info("the clone's configuration loaded in %.0f ms", (time.monotonic() - loading) * 1000)
        return config

    return wait


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    import asyncio

    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=5.0))
    loop.run_until_complete(asyncio.wait([loop.create_task(loop.shutdown_asyncgens())], timeout=5.0))


def _log_loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """An exception nobody handled inside the loop: log it and keep serving."""
    exc = context.get("exception")
    log.error(
        "unhandled in the event loop: %s",
        context.get("message"),
        exc_info=exc if isinstance(exc, BaseException) else None,
    )


def _console(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode(errors="replace"))


def _libc_reboot(command: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot.argtypes = [ctypes.c_int]
    result: int = libc.reboot(ctypes.c_int(command & 0xFFFFFFFF).value)
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"reboot({command:#x}): {os.strerror(err)}")
    return result


def _reboot(command: int) -> None:
    """reboot(2) -- only ever for the machine's init: the guard cannot be bypassed by tests."""
    if not is_machine_init():
        raise PermissionError("reboot() is reserved to PID 1 of the initial pid namespace")
    _libc_reboot(command)


def _reboot_machine() -> None:
    try:
        _reboot(RB_AUTOBOOT)
    except OSError as exc:
        _console(f"auraed: reboot failed: {exc}")


def _power_off_machine(args: BootArgs, host: bool = False) -> None:
    if not (is_machine_init() and (args.guest or args.poweroff or host)):
        _console("auraed: power off refused: not the machine's init, or not enabled")
        return
    try:
        _reboot(RB_POWER_OFF)
    except OSError as exc:
        _console(f"auraed: power off failed: {exc}")


def _halt_forever() -> NoReturn:
    _console("auraed: halted")
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(60)
        except BaseException:  # PID 1 must not return
            time.sleep(1)


def main(argv: Sequence[str], make_daemon: DaemonFactory) -> NoReturn:
    """PID 1: boot, load the configuration, serve what ``make_daemon`` builds, finish. Never
    returns. ``make_daemon`` is called only after the boot: the Daemon's imports (seconds under
    emulation) come after the mounts, and a stop signal meanwhile is not lost. A template guest
    (``auraed.template=1``) starts its Daemon with the host's template config and holds it before
    its listeners until a clone's identity comes (auraed/init/identity.py); one that gets none
    serves nothing."""
    started = time.monotonic()
    init = Pid1(Pid1Layout.from_env())
    status = 1
    reason = ""
    try:
        init.boot()
        from auraed.config import load_config
        from auraed.errors import ConfigError

        template = None
        config_argv = list(argv)
        if init.args.template and is_machine_init():
            from auraed.init.identity import IdentityError, TemplateGuest

            try:
                template = TemplateGuest.open()
                config_argv += ["--config", template.template_config(init.layout.path(TEMPLATE_CONFIG_DIR))]
            except IdentityError as exc:
                log.error("auraed: a template without its config: %s", exc)
                init.finish(1, "no template config")
        try:
            config = load_config(config_argv)
        except ConfigError as exc:
            log.error("auraed: %s", exc.message)
            init.finish(2, "configuration error")
        except SystemExit as exc:  # argparse: --help, or a bad flag
            init.finish(exc.code if isinstance(exc.code, int) else 2, "command line")
        init.grace = min(config.stop_grace_period, TERMINATE_GRACE)
        if init.host is not None:  # the daemon as a child of PID 1, restarted should it die
            from auraed.init.host import DaemonSupervisor

            supervisor = DaemonSupervisor(
                argv,
                init.host,
                init.request_action,
                stop_grace=config.stop_grace_period,
                console_shell=config.console_shell,
            )
            status = init.run(supervisor)
        else:
            daemon = make_daemon(config, init)
            if template is not None:
                daemon.before_listening = _clone_config(template, list(argv), init.layout.root, started)
            status = init.run(daemon)
        if not init.reason:
            reason = f"the daemon returned {status}"
    except BaseException as exc:  # PID 1 must reach finish()
        try:
            log.exception("auraed failed")
        except BaseException:
            _console(f"auraed failed: {exc!r}")
        reason = f"auraed failed: {exc!r}"
    init.finish(status, reason)
