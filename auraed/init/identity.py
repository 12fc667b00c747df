"""A template guest's side of cloning: do the imports, say so, wait for an identity, apply it.

A guest booted with ``auraed.template=1`` (auraed/vms/templates.py on the host) has no config
disk and no network on its command line. PID 1 boots as usual, says ``{"template": "booted"}`` on
the host-only virtio-serial port named ``org.aurae.identity``, and the host answers with the
guests' config (``{"template_config": {"auraed.toml": ...}}``: no address, no certificate). With it
the Daemon is built and started up to its listeners (the imports, the store, cgroups, recovery,
the capabilities, every handler: the seconds a cold boot spends there under TCG); there it writes
``{"template": "ready"}`` and blocks reading the port (``Daemon.before_listening``). The host
then saves the guest (its RAM is a file; QEMU's migration keeps the device state) and ends it.

Each clone resumes inside that read. The host sends one JSON line, its identity::

    {"identity": 1, "name": ..., "hostname": ..., "entropy": <base64, 32..4096 bytes>,
     "time_ns": <host CLOCK_REALTIME>, "net": {"iface", "ip" (addr/prefix), "gateway", "mac"},
     "share": <a virtio-fs tag, optional>,
     "grow": {"cpus": N, "memory_mib": M} (optional),
     "files": {"auraed.toml": ..., "pki/ca.crt": ..., "pki/server.crt": ..., "pki/server.key": ...}}

and the guest applies it in this order, before anything serves or makes a key: the entropy
(written to /dev/random, credited, the CRNG reseeded: auraed.system.reseed), the wall clock, the
hostname, the NIC's own MAC, its address and default route, the config files on a tmpfs at
/etc/aurae (where a cold boot mounts its config disk: the template never holds a serving key),
and, with ``"share": TAG``, the virtio-fs the host plugged into the clone as it resumed (a pod's
volumes: a template has none, QEMU 7.2 cannot migrate it) mounted where a cold boot mounts
``auraed.share=``. With ``"grow"``, the clone was grown from its template's size as it was
restored (vCPUs and memory hotplugged by the host): it onlines them (auraed.system.hotplug) and
waits until N CPUs are online and its MemTotal is M MiB above the template's (noted as the
template became ready), so the clone serves at its size; its answer then says what it has, and
PID 1 sizes its tmpfs mounts to half the new memory (auraed.init.pid1.resize_tmpfs).
It answers ``{"identity": "applied", "boot_id": ...}`` (the boot id is made at its first read,
which comes after the reseed), or ``{"identity": "failed", "error": ...}`` and then serves
nothing: the Daemon's start fails and PID 1 ends the machine. The Daemon then loads the clone's
config and adds its listeners. Stdlib only.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import time
from typing import Any

from auraed.bootargs import IDENTITY_PORT, SHARE_MOUNT

log = logging.getLogger("auraed.pid1")

PORT_WAIT = 20.0  # seconds for the identity port to appear (its name comes over the control queue)
RETRY = 0.02  # seconds between reads while the host's end is closed
MAX_LINE = 1024 * 1024
SHARE_WAIT = 10.0  # seconds for a hotplugged virtio-fs to be probed (the host plugs it as the clone resumes)
GROW_WAIT = 20.0  # seconds for hotplugged vCPUs and memory to be added by the kernel (ACPI events)
MAX_GROW_CPUS = 1024
CONFIG_DIR = "etc/aurae"
SECRET_FILES = ("pki/server.key",)


class IdentityError(Exception):
    """The identity could not be received or applied: this guest must not serve."""


def find_port(name: str = IDENTITY_PORT, sys_dir: str = "/sys", dev_dir: str = "/dev") -> str:
    """The device node of the virtio-serial port called ``name``; "" while there is none."""
    base = f"{sys_dir}/class/virtio-ports"
    try:
        ports = sorted(os.listdir(base))
    except OSError:
        return ""
    for port in ports:
        try:
            with open(f"{base}/{port}/name") as handle:
                if handle.read().strip() == name:
                    return f"{dev_dir}/{port}"
        except OSError:
            continue
    return ""


def wait_for_port(timeout: float = PORT_WAIT, sys_dir: str = "/sys", dev_dir: str = "/dev") -> str:
    deadline = time.monotonic() + timeout
    while not (path := find_port(IDENTITY_PORT, sys_dir, dev_dir)) or not os.path.exists(path):
        if time.monotonic() > deadline:
            raise IdentityError(f"no virtio-serial port {IDENTITY_PORT!r} within {timeout:g} s")
        time.sleep(RETRY)
    return path


def send(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def read_line(fd: int) -> bytes:
    """One line from the port; while the host's end is closed (a read gives EOF), wait for it."""
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(fd, 65536)
        if not chunk:
            time.sleep(RETRY)
            continue
        buffer += chunk
        if len(buffer) > MAX_LINE:
            raise IdentityError(f"identity longer than {MAX_LINE} bytes")
    return buffer.split(b"\n", 1)[0]


def parse(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise IdentityError(f"identity is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("identity") != 1:
        raise IdentityError("not an identity message")
    for key, kind in (("name", str), ("hostname", str), ("entropy", str), ("time_ns", int), ("files", dict)):
        if not isinstance(message.get(key), kind):
            raise IdentityError(f"identity: {key} missing or not a {kind.__name__}")
    return message


def apply(message: dict[str, Any], root: str = "/", template_mem_total_kib: int = 0) -> dict[str, Any]:
    """Apply an identity (the order matters: randomness first); what the host is told.
    ``template_mem_total_kib``: the MemTotal the template had, which a grown clone's is above."""
    from auraed.system import reseed

    steps: dict[str, float] = {}
    started = time.monotonic()
    reseed.reseed_random(base64.b64decode(message["entropy"]))
    steps["entropy"] = time.monotonic() - started
    reseed.set_wall_clock(int(message["time_ns"]))
    from auraed.system.namespaces import sethostname

    sethostname(message["hostname"])
    net = message.get("net")
    if isinstance(net, dict) and net.get("ip"):
        step = time.monotonic()
        configure_network(net)
        steps["network"] = time.monotonic() - step
    write_config(message["files"], os.path.join(root, CONFIG_DIR))
    share = message.get("share")
    if isinstance(share, str) and share:
        step = time.monotonic()
        mount_share(share, os.path.join(root, SHARE_MOUNT.lstrip("/")))
        steps["share"] = time.monotonic() - step
    grown: dict[str, Any] = {}
    if "grow" in message:
        # Last: the kernel adds what was plugged while the rest was applied.
        step = time.monotonic()
        grown = online_grown(message["grow"], template_mem_total_kib)
        steps["grow"] = time.monotonic() - step
        grown["grow_ms"] = round(steps["grow"] * 1000, 1)
    steps["all"] = time.monotonic() - started
    log.info(
        "identity of %s applied in %.0f ms (hostname %s; %s)",
        message["name"],
        steps["all"] * 1000,
        message["hostname"],
        ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in steps.items() if k != "all"),
    )
    return {
        "identity": "applied",
        "boot_id": reseed.boot_id(),
        "applied_ms": round(steps["all"] * 1000, 1),
        **grown,
    }


def online_grown(grow: Any, template_mem_total_kib: int, timeout: float = GROW_WAIT) -> dict[str, Any]:
    """The vCPUs and memory the host plugged into the clone online: ``grow["cpus"]`` CPUs, and
    MemTotal ``grow["memory_mib"]`` above the template's; what the clone has then."""
    from auraed.system import hotplug

    cpus = grow.get("cpus") if isinstance(grow, dict) else None
    memory_mib = grow.get("memory_mib") if isinstance(grow, dict) else None
    if not isinstance(cpus, int) or not isinstance(memory_mib, int):
        raise IdentityError("identity: grow needs cpus and memory_mib, integers")
    if not 1 <= cpus <= MAX_GROW_CPUS or memory_mib < 0:
        raise IdentityError(f"identity: grow to {cpus} CPUs and {memory_mib} MiB more is out of range")
    try:
        done = hotplug.online_until(cpus, template_mem_total_kib + memory_mib * 1024, timeout)
    except (TimeoutError, OSError, ValueError) as exc:
        raise IdentityError(f"the vCPUs and memory plugged into the clone: {exc}") from None
    # PID 1 then sizes its tmpfs mounts to the new memory (auraed.init.pid1.resize_tmpfs).
    return {"online_cpus": done.online_cpus, "mem_total_kib": done.mem_total_kib}


def configure_network(net: dict[str, Any]) -> None:
    from auraed.init import netconf

    iface = str(net.get("iface") or "eth0")
    address, prefix = netconf.parse_cidr(str(net["ip"]))
    if not netconf.wait_for_interface(iface, 10.0):
        raise IdentityError(f"{iface} is missing")
    if net.get("mac"):
        netconf.set_mac(iface, str(net["mac"]))
    netconf.configure_interface(iface, address, prefix)
    if net.get("gateway"):
        netconf.add_default_route(netconf.check_address(str(net["gateway"])), iface)


def mount_share(tag: str, target: str, timeout: float = SHARE_WAIT) -> None:
    """The clone's virtio-fs (plugged by the host after the restore: its driver may still be
    probing it) mounted at ``target``, where a cold boot mounts ``auraed.share=``."""
    from auraed.system.namespaces import mount

    os.makedirs(target, mode=0o755, exist_ok=True)
    if os.path.ismount(target):
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            mount(tag, target, "virtiofs", 0, None)
            return
        except OSError as exc:
            # EINVAL: no virtio-fs device of that tag (yet); ENODEV: no virtiofs driver (yet).
            if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENODEV) or time.monotonic() > deadline:
                raise IdentityError(f"virtio-fs {tag!r} on {target}: {exc}") from None
        time.sleep(RETRY)


def write_config(files: dict[str, Any], target: str) -> None:
    """The config files on a tmpfs at ``target`` (owner-only), as the config disk would hold them."""
    from auraed.system.namespaces import mount

    os.makedirs(target, mode=0o755, exist_ok=True)
    if not os.path.ismount(target):
        mount("tmpfs", target, "tmpfs", 0x2 | 0x4 | 0x8, "mode=0700,size=1m")  # nosuid,nodev,noexec
    write_files(files, target)


def write_files(files: dict[str, Any], target: str) -> None:
    os.makedirs(target, mode=0o700, exist_ok=True)
    for relative, content in files.items():
        if not isinstance(content, str) or relative.startswith("/") or ".." in relative.split("/"):
            raise IdentityError(f"identity: bad file {relative!r}")
        path = os.path.join(target, relative)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        mode = 0o600 if relative in SECRET_FILES else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with open(fd, "w") as handle:
            handle.write(content)


class TemplateGuest:
    """The guest's end of the identity port, from the template's boot to the clone's identity."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.mem_total_kib = 0  # the template's, once ready: a grown clone's is above it

    @classmethod
    def open(cls) -> TemplateGuest:
        # Kept open for the machine's life: a close could drop the last answer before the host read it.
        return cls(os.open(wait_for_port(), os.O_RDWR | os.O_CLOEXEC))

    def template_config(self, directory: str) -> str:
        """Say the template booted; write the config the host answers with (the guests' own, no
        address or key of anyone's) in ``directory``; its auraed.toml's path."""
        send(self.fd, {"template": "booted"})
        try:
            message = json.loads(read_line(self.fd))
            files = message["template_config"]
        except (ValueError, KeyError, TypeError) as exc:
            raise IdentityError(f"no template config from the host: {exc!r}") from None
        if not isinstance(files, dict) or "auraed.toml" not in files:
            raise IdentityError("the host's template config has no auraed.toml")
        write_files(files, directory)
        return os.path.join(directory, "auraed.toml")

    def ready(self, started: float) -> None:
        """The Daemon has done all it can without an identity: the host saves the template now."""
        import gc

        # What the template made stays as it is: the collector no longer walks (and so writes to)
        # those objects in each clone, which then keeps sharing their pages with the template.
        from auraed.system import hotplug

        self.mem_total_kib = hotplug.mem_total_kib()
        gc.collect()
        gc.freeze()
        took = time.monotonic() - started
        send(self.fd, {"template": "ready", "imports_s": round(took, 3), "mem_total_kib": self.mem_total_kib})
        log.info("template ready in %.1f s: waiting for an identity", took)

    def take_identity(self, root: str = "/") -> dict[str, Any]:
        """Block until the host sends this clone its identity, apply it, answer; IdentityError
        (the host told why) when it cannot be applied."""
        line = read_line(self.fd)
        try:
            reply = apply(parse(line), root, self.mem_total_kib)
        except Exception as exc:
            send(self.fd, {"identity": "failed", "error": str(exc)[:2000]})
            raise IdentityError(str(exc)) from exc
        send(self.fd, reply)
        return reply
