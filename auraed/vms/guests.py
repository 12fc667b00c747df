"""The host's side of trust with its guests: who it is to them, and its channels to them.

The host CA (``ca_crt`` + ``ca_key``) issues each guest a server certificate on its config disk
(guest_config.py) and the host a client certificate with the identity ``aurae-host``, the only
identity a guest lets in. Channels to guests use the client's options (auraed.wire.channel): a
short reconnect backoff, so a booting guest is reached the moment it listens, grpc's full
connect timeout, so a guest slow to finish a handshake is still reached, and keepalive pings, so
calls to a guest that stopped answering end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from auraed.bootargs import GUEST_CONFIG_SERIAL, SHARE_TAG
from auraed.config import VM_TEMPLATE_MEMORY_MIB
from auraed.errors import AuraeError, ErrorKind
from auraed.metrics.sink import NO_METRICS, MetricsSink
from auraed.pki import (
    CertificateAuthority,
    PkiError,
    certificate_pem,
    ensure_client_cert,
    load_ca_files,
)
from auraed.system.tasks import run_to_end
from auraed.vms.errors import VmError
from auraed.vms.guest_config import GuestIdentity, build_config_disk, config_files, template_config
from auraed.vms.model import (
    GUEST_ROLE,
    DiskSpec,
    NetInfo,
    State,
    VmRecord,
    VmSpec,
    check_file,
    parse_kernel_args,
    parse_path,
)
from auraed.vms.placement import GuestEndpoint
from auraed.vms.templates import (
    TemplateRecord,
    Templates,
    TemplateShape,
    identity_message,
    send_identity,
)
from auraed.vms.vms import DEFAULT_START_TIMEOUT, Vms, choose_backend
from auraed.wire.channel import DEFAULT_KEEPALIVE_TIME, DEFAULT_KEEPALIVE_TIMEOUT, channel_options

log = logging.getLogger(__name__)

HOST_IDENTITY = "aurae-host"
SYSTEM = "aurae.system.v0.SystemService"


@dataclasses.dataclass
class _Link:
    """The host's channel to one guest, and why the host closed it ("" while open)."""

    channel: grpc.aio.Channel
    closed: str = ""

    def why_closed(self) -> str:
        return self.closed


class GuestTrust:
    """``keepalive_time`` and ``keepalive_timeout``: the pings of the host's channels to guests
    (``guest_keepalive_time``, ``guest_keepalive_timeout``): a call to a guest that stops
    answering ends UNAVAILABLE within their sum."""

    def __init__(
        self,
        ca_crt: Path,
        ca_key: Path,
        pki_dir: Path,
        keepalive_time: float = DEFAULT_KEEPALIVE_TIME,
        keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    ) -> None:
        self._ca_crt, self._ca_key, self._pki_dir = ca_crt, ca_key, pki_dir
        self._keepalive = (keepalive_time, keepalive_timeout)
        self._ca: CertificateAuthority | None = None
        self._credentials: grpc.ChannelCredentials | None = None
        self._links: dict[str, _Link] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def ca(self) -> CertificateAuthority:
        if self._ca is None:
            try:
                self._ca = load_ca_files(self._ca_crt, self._ca_key)
            except PkiError as exc:
                raise AuraeError(
                    ErrorKind.FAILED_PRECONDITION,
                    f"guests need the host CA to issue their certificates: {exc}",
                ) from None
        return self._ca

    def credentials(self) -> grpc.ChannelCredentials:
        """mTLS as ``aurae-host``, trusting only the host CA; the client cert is made once."""
        if self._credentials is None:
            # Reissued unless issued by the current CA and not about to expire: one kept after a
            # change of CA would be refused by every guest.
            crt, key = ensure_client_cert(self.ca(), self._pki_dir, HOST_IDENTITY)
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=certificate_pem(self.ca().cert),
                private_key=key.read_bytes(),
                certificate_chain=crt.read_bytes(),
            )
        return self._credentials

    def config_disk(self, output: Path, identity: GuestIdentity) -> Path:
        return build_config_disk(output, identity, self.ca(), HOST_IDENTITY)

    def config_files(self, identity: GuestIdentity) -> dict[str, str]:
        """What a clone is given in place of a config disk (its own certificate and key, issued now)."""
        return config_files(identity, self.ca(), HOST_IDENTITY)

    def endpoint(self, name: str, identity: GuestIdentity, booted_at: float) -> GuestEndpoint:
        link = self._links.get(name)
        if link is None:
            options = [
                *channel_options(*self._keepalive),
                ("grpc.ssl_target_name_override", identity.server_name),
            ]
            channel = grpc.aio.secure_channel(identity.endpoint, self.credentials(), options=options)
            link = self._links[name] = _Link(channel)
        return GuestEndpoint(
            name, identity.endpoint, identity.server_name, link.channel, booted_at, link.why_closed
        )

    def _unlink(self, name: str, why: str) -> grpc.aio.Channel | None:
        link = self._links.pop(name, None)
        if link is None:
            return None
        link.closed = why
        return link.channel

    async def forget(self, name: str, why: str) -> None:
        """Close the channel to ``name``; calls on it end, their relays answering ``why``."""
        channel = self._unlink(name, why)
        if channel is not None:
            await channel.close()

    def forget_soon(self, name: str, why: str) -> None:
        """``forget`` for code that cannot wait: the channel is closed by a task."""
        channel = self._unlink(name, why)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(), name=f"close-guest-{name}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def wait_serving(self, endpoint: GuestEndpoint, timeout: float) -> float:
        """Seconds until the guest's health is SERVING; DEADLINE_EXCEEDED after ``timeout``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        started = time.monotonic()
        stub = health_pb2_grpc.HealthStub(endpoint.channel)
        last_error = ""
        while (remaining := timeout - (time.monotonic() - started)) > 0:
            if why := endpoint.why_closed():
                raise AuraeError(ErrorKind.UNAVAILABLE, f"guest {endpoint.name} never served: {why}")
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=min(remaining, 5.0), wait_for_ready=True
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - started
                last_error = f"health {reply.status}"
            except grpc.aio.AioRpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                if not endpoint.why_closed():
                    raise  # not the channel closing: this wait itself was cancelled
                continue
            await asyncio.sleep(0.05)
        raise AuraeError(
            ErrorKind.DEADLINE_EXCEEDED,
            f"guest {endpoint.name} at {endpoint.address} was not serving within {timeout:g} s, the "
            f"guest_ready_timeout (its last health check: {last_error or 'none answered'})",
        )

    async def close(self) -> None:
        for name in list(self._links):
            await self.forget(name, "the host is shutting down")
        await asyncio.gather(*self._closing)


def identity_for(name: str, guest_address: str, host_address: str, port: int) -> GuestIdentity:
    """``guest_address`` with its prefix ("10.213.0.2/30"); ``host_address`` the tap's end."""
    return GuestIdentity(
        hostname=name,
        address=ipaddress.IPv4Interface(guest_address),
        gateway=ipaddress.IPv4Interface(host_address).ip,
        port=port,
    )


def hostname_of(spec: VmSpec) -> str:
    """The guest's hostname: the last ``auraed.hostname=`` of its kernel arguments, else its name."""
    names = [a.removeprefix("auraed.hostname=") for a in spec.kernel_args if a.startswith("auraed.hostname=")]
    return names[-1] if names else spec.name


GUEST_BASE_MIB = 256
"""Memory a guest's own kernel and auraed take before any container (added to what it runs)."""
CONFIG_DISK = "config.img"
GUEST_IMAGE_FILES = {"kernel": "vmlinuz", "initramfs": "initramfs.img", "root_disk": "rootfs.img"}
# Transparent huge pages cost a small guest 2-4 MiB of RSS for nothing.
THP_ARG = "transparent_hugepage=madvise"


RESIZE_TIMEOUT = 60.0
"""Seconds a guest has to online what Resize plugged (ACPI events, handled by its kernel)."""
RESIZE_POLL = 0.1


@dataclasses.dataclass(frozen=True)
class Resized:
    """What a guest reported after a resize: its online CPUs, its MemTotal (KiB; 0 for a VM
    that is not a guest), and the seconds from the first hotplug until it reported them."""

    online_cpus: int
    mem_total_kib: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Booted:
    """A VM that Guests.boot started: its record, and the seconds from launching its VMM until it
    was ready (a guest: its auraed serving; another VM: its console marker; None: not waited for)."""

    record: VmRecord
    ready: float | None


class Guests:
    """VMs whose role is "guest": booted from the guest image with a config disk, ready when serving.

    Allocate fills in the guest image and the config disk; Boot writes the config disk (the
    guest's address is known only once allocated), boots, and returns once the guest's auraed
    answers health SERVING over mTLS — or stops the VM and reports its console. VMs of other roles
    go through the same operations, as plain VMs.

    A guest whose spec names a template (``VmSpec.template``: "auto" or a template's name) is
    cloned from it instead (``templates``, vms/templates.py): restored, given its identity over its
    identity port (entropy, clock, hostname, network, its own certificate and key), then waited
    for like any guest. Where it cannot be cloned (a backend that cannot restore, extra disks, a
    console marker to wait for) it boots cold, and the log says why.
    """

    def __init__(
        self,
        vms: Vms,
        trust: GuestTrust,
        image_dir: Path,
        ready_timeout: float,
        metrics: MetricsSink = NO_METRICS,
        *,
        template_memory_mib: int = VM_TEMPLATE_MEMORY_MIB,
    ) -> None:
        self.vms = vms
        self._metrics = metrics
        self.trust = trust
        self._image_dir = image_dir
        self._ready_timeout = ready_timeout
        self.templates = Templates(
            vms.store,
            vms.backends,
            vms.templates_dir,
            ready_timeout,
            lambda: template_config(vms.guest_port, HOST_IDENTITY),
            base_memory_mib=template_memory_mib,
        )
        vms.when_ended(self._vm_ended)

    @staticmethod
    def is_guest(spec: VmSpec) -> bool:
        return spec.role == GUEST_ROLE

    async def allocate(self, spec: VmSpec, net: NetInfo | None = None) -> VmRecord:
        """Allocate the VM of ``spec`` (parse_vm's), a guest completed with its image and config
        disk; ``net``: a network the caller made for it (Vms.allocate's). A guest naming a
        template and no backend runs on QEMU, the backend that restores clones."""
        if spec.template and not spec.backend:
            spec = dataclasses.replace(spec, backend="qemu")
        spec = self.with_config_disk(self.complete(spec))
        if spec.template and spec.template != "auto":
            self.templates.check_shape(spec)  # named: it must exist and be of this VM's shape
        return await self.vms.allocate(spec, net)

    def complete(self, spec: VmSpec) -> VmSpec:
        """Defaults for a guest: the guest image's files where the spec names none, a network.

        What is filled in is held to the rules of a requested VM (parse_vm's).
        """
        if not self.is_guest(spec):
            return spec
        kernel, initramfs, root_disk = (
            getattr(spec, field) or self._image_file(field, filename)
            for field, filename in GUEST_IMAGE_FILES.items()
        )
        kernel_args = spec.kernel_args
        if not any(arg.startswith("transparent_hugepage=") for arg in kernel_args):
            kernel_args = parse_kernel_args([*kernel_args, THP_ARG])
        return dataclasses.replace(
            spec,
            kernel=kernel,
            initramfs=initramfs,
            root_disk=root_disk,
            network=True,
            kernel_args=kernel_args,
        )

    def has_image(self) -> bool:
        """Whether a guest image is there to boot guests from."""
        return all((self._image_dir / name).is_file() for name in GUEST_IMAGE_FILES.values())

    @property
    def image_dir(self) -> Path:
        return self._image_dir

    def _image_file(self, field: str, filename: str) -> str:
        path = self._image_dir / filename
        if not path.is_file():
            raise VmError.precondition(
                f"no guest image at {self._image_dir} ({filename} missing): build one with "
                "hack/guest-image and set guest_image",
            )
        checked = parse_path(str(path), f"vm.{field}", True)
        check_file(f"vm.{field}", checked)
        return checked

    def with_config_disk(self, spec: VmSpec) -> VmSpec:
        if not self.is_guest(spec):
            return spec
        if any(d.serial == GUEST_CONFIG_SERIAL for d in spec.extra_disks):
            # The guest finds its config disk by this serial (init/pid1.py).
            raise AuraeError(
                ErrorKind.INVALID_ARGUMENT,
                f"vm.extra_disks: serial {GUEST_CONFIG_SERIAL!r} is the guest's config disk's; "
                "choose another",
            )
        disk = DiskSpec(str(self.vms.run_dir(spec.name) / CONFIG_DISK), False, GUEST_CONFIG_SERIAL)
        return dataclasses.replace(spec, extra_disks=(*spec.extra_disks, disk))

    def identity(self, record: VmRecord) -> GuestIdentity:
        if record.net is None:
            raise AuraeError(ErrorKind.FAILED_PRECONDITION, f"VM {record.name} has no network")
        return identity_for(
            record.name,
            f"{record.net.guest_ip}/{record.net.prefixlen}",
            f"{record.net.host_ip}/{record.net.prefixlen}",
            self.vms.guest_port,
        )

    async def boot(
        self,
        name: str,
        *,
        wait_for_console: str = "",
        timeout: float = DEFAULT_START_TIMEOUT,
        cold_if_no_template: bool = False,
    ) -> Booted:
        """Start the allocated VM ``name``; a guest is ready once its auraed serves.

        ``wait_for_console`` and ``timeout`` are Vms.start's (the guest's wait for serving is
        ``ready_timeout`` on top). A guest not serving in time is stopped, its console's tail in
        the VmError; a boot cancelled by its caller is undone. ``cold_if_no_template``: a guest
        whose template cannot be made boots cold (logged) rather than failing (a vm pod's).
        """
        record = self.vms.get(name)
        if self.is_guest(record.spec) and record.spec.template:
            why_cold = self.template_problem(record.spec, record.backend, wait_for_console)
            why_cold = why_cold or self.templates.clone_problem(record.spec, record.backend)
            template, level = None, logging.INFO
            if why_cold is None:
                try:
                    template = await self.templates.for_clone(record.spec, record.backend)
                except VmError as exc:
                    if not cold_if_no_template:
                        raise
                    why_cold, level = f"the template could not be made: {exc.message}", logging.WARNING
            if template is not None:
                return await self._clone(name, timeout, template)
            log.log(
                level,
                "VM %s boots cold instead of from template %s: %s",
                name,
                record.spec.template,
                why_cold,
            )
        if self.is_guest(record.spec):
            output = self.vms.run_dir(name) / CONFIG_DISK
            await asyncio.to_thread(self.trust.config_disk, output, self.identity(record))
        record, ready = await self.vms.start(name, wait_for_console=wait_for_console, timeout=timeout)
        if self.is_guest(record.spec):
            serving = await self._wait_serving(name)
            ready = serving if serving is not None else ready
        if ready is not None:
            self._metrics.vm_booted(ready)
        return Booted(record, ready)

    # -- clones ------------------------------------------------------------------------------

    def template_problem(self, spec: VmSpec, backend: str, wait_for_console: str = "") -> str | None:
        """Why guests like ``spec`` on ``backend`` cannot be cloned from a template, whatever
        their size (None: they can; Templates.clone_problem says whether one of its size can)."""
        problem = self.templates.problem(backend)
        if problem:
            return problem
        if any(d.serial != GUEST_CONFIG_SERIAL for d in spec.extra_disks):
            return "it has extra disks (a template has none)"
        if wait_for_console:
            return "a console marker was asked for (a clone prints no boot)"
        if spec.shared_dir:
            chosen = self.vms.backends.get(backend)
            why: str | None = "its backend cannot plug a shared directory into a clone"
            check = getattr(chosen, "shared_clone_problem", None)
            if check is not None:
                why = check(spec.machine)
            if why:
                return f"it has a shared directory: {why}"
        return None

    async def ensure_template(self, spec: VmSpec) -> TemplateRecord:
        """The template guests like ``spec`` (naming one) are cloned from, made or rebuilt now
        when it is missing or out of date (auraed.cri.vm_template makes vm pods' at start).
        VmError when such guests cannot be clones, or the template cannot be made."""
        spec = self.complete(spec)
        backend = choose_backend(spec.backend or "qemu", self.vms.backends)
        problem = self.template_problem(spec, backend)
        if problem:
            raise VmError.precondition(problem)
        return await self.templates.for_clone(spec, backend)

    async def _clone(self, name: str, timeout: float, template: TemplateRecord) -> Booted:
        """Restore the guest from its template, give it its identity, wait until it serves."""
        record = self.vms.get(name)
        identity = self.identity(record)
        files = await asyncio.to_thread(self.trust.config_files, identity)
        net = record.net
        assert net is not None  # identity() has checked
        message = identity_message(
            name,
            hostname_of(record.spec),
            {
                "iface": "eth0",
                "ip": f"{net.guest_ip}/{net.prefixlen}",
                "gateway": net.host_ip,
                "mac": net.mac,
            },
            files,
            # Plugged by the backend as the clone resumes (a copy of the template's RAM mapped
            # shared for virtiofsd, auraed.vms.qemu), mounted by the clone with its identity.
            share=SHARE_TAG if record.spec.shared_dir else "",
        )
        record, _ = await self.vms.start(
            name,
            timeout=timeout,
            image=template.image(),
            without_disks=(GUEST_CONFIG_SERIAL,),
            template=template.name,
        )
        if record.plugged_vcpus or record.plugged_memory_mib:
            # Grown from the template's size as it was restored: the guest onlines what was
            # plugged before it takes the rest of its identity (auraed.init.identity).
            message["grow"] = {"cpus": record.spec.vcpus, "memory_mib": record.plugged_memory_mib}
        handle = self.vms.handle(name)
        try:
            if handle is None:
                raise VmError.precondition(f"VM {name} ended as it was restored")
            # Under load (many clones at once on few cores) taking the identity can take as
            # long as a boot: the clone has the guest_ready_timeout a booting guest has.
            reply = await send_identity(handle, message, self._ready_timeout)
        except VmError as exc:
            tail = self.vms.console_tail(name)
            await self.vms.stop_boot(name, handle, f"no identity: {exc.message}")
            raise VmError(
                exc.kind, f"VM {name}: {exc.message}; stopped it. Console tail:\n" + "\n".join(tail)
            ) from None
        except asyncio.CancelledError:
            await run_to_end(self.vms.stop_boot(name, handle, "the Start was cancelled"))
            raise
        grown = ""
        if "grow" in message:
            grown = (
                f", grown from {template.shape.vcpus} vCPU and {template.shape.memory_mib} MiB to "
                f"{record.spec.vcpus} vCPUs and {record.spec.memory_mib} MiB (the guest has "
                f"{reply.get('online_cpus', '?')} CPUs online and MemTotal {reply.get('mem_total_kib', '?')} "
                f"KiB {reply.get('grow_ms', '?')} ms into its identity)"
            )
        log.info(
            "VM %s cloned from template %s: restored in %.0f ms, identity applied in %s ms (boot id %s)%s",
            name,
            template.name,
            record.restore_ms or 0.0,
            reply.get("applied_ms", "?"),
            reply.get("boot_id", "?"),
            grown,
        )
        ready = await self._wait_serving(name)
        if ready is not None:
            self._metrics.vm_cloned(ready)
        return Booted(record, ready)

    async def create_template(
        self,
        name: str,
        *,
        vcpus: int,
        memory_mib: int,
        kernel: str = "",
        initramfs: str = "",
        root_disk: str = "",
        kernel_args: tuple[str, ...] = (),
    ) -> TemplateRecord:
        """Make (or rebuild, when its files changed) template ``name``; files default to the
        guest image's. Returns once it is ready."""
        spec = self.complete(
            VmSpec.guest(
                name,
                vcpus,
                memory_mib,
                kernel=kernel,
                initramfs=initramfs,
                root_disk=root_disk,
                kernel_args=kernel_args,
                backend="qemu",
            )
        )
        backend = choose_backend("qemu", self.vms.backends)
        machine = self.vms.backends[backend].machine_of(spec.machine)
        return await self.templates.ensure(name, TemplateShape.of(spec, machine), backend, auto=False)

    async def remove_template(self, name: str) -> None:
        await self.templates.remove(name, self.vms.all())

    def template_users(self, name: str) -> list[str]:
        return self.templates.users(name, self.vms.all())

    async def refresh(self, name: str, timeout: float = 30.0) -> tuple[str, int]:
        """Fresh entropy and the host's time for a running guest, through its SystemService
        (ReseedRandom, SetTime): (its boot id, how far its clock was off in ns)."""
        import os

        from auraed.api.aurae.system import v0 as system_pb
        from auraed.wire import codec

        channel = (await self.lookup(name)).channel
        request = codec.encode(system_pb.SystemServiceReseedRandomRequest(entropy=os.urandom(64)))
        reply = await channel.unary_unary(f"/{SYSTEM}/ReseedRandom")(request, timeout=timeout)
        boot_id = codec.decode(system_pb.SystemServiceReseedRandomResponse, reply).boot_id
        request = codec.encode(system_pb.SystemServiceSetTimeRequest(unix_ns=time.time_ns()))
        reply = await channel.unary_unary(f"/{SYSTEM}/SetTime")(request, timeout=timeout)
        return boot_id, codec.decode(system_pb.SystemServiceSetTimeResponse, reply).adjusted_ns

    async def resize(self, name: str, vcpus: int, memory_mib: int) -> VmRecord:
        """Grow the running VM ``name`` to at least ``vcpus`` and ``memory_mib`` (Vms.grow: never
        shrinks, refuses what it cannot), and, for a guest, have its auraed online what was plugged
        (SystemService.OnlineCpuMem) until it reports the new vCPUs and the memory added. The
        record, saved, says the VM's new size."""
        record, _ = await self.resize_reporting(name, vcpus, memory_mib)
        return record

    async def resize_reporting(self, name: str, vcpus: int, memory_mib: int) -> tuple[VmRecord, Resized]:
        """``resize``, and what the guest reported once grown."""
        record = self.vms.get(name)
        if vcpus == record.spec.vcpus and memory_mib == record.spec.memory_mib:
            return record, Resized(0, 0, 0.0)
        before = None
        if self.is_guest(record.spec) and record.state == State.RUNNING:
            before = await self.online_cpu_mem(name)
        started = time.monotonic()
        old_memory = record.spec.memory_mib
        record = await self.vms.grow(name, vcpus, memory_mib)
        if before is None:
            return record, Resized(0, 0, time.monotonic() - started)
        added_kib = (record.spec.memory_mib - old_memory) * 1024
        deadline = started + RESIZE_TIMEOUT
        while True:
            now = await self.online_cpu_mem(name)
            if now.online_cpus >= record.spec.vcpus and now.mem_total_kib >= before.mem_total_kib + added_kib:
                break
            if time.monotonic() > deadline:
                failures = f"; refused: {'; '.join(now.failures)}" if now.failures else ""
                raise VmError(
                    ErrorKind.DEADLINE_EXCEEDED,
                    f"VM {name}: its VMM has {record.spec.vcpus} vCPUs and {record.spec.memory_mib} MiB, but "
                    f"within {RESIZE_TIMEOUT:g} s its guest onlined only {now.online_cpus} CPUs and "
                    f"{(now.mem_total_kib - before.mem_total_kib) // 1024} of the "
                    f"{added_kib // 1024} MiB added{failures}",
                )
            await asyncio.sleep(RESIZE_POLL)
        resized = Resized(now.online_cpus, now.mem_total_kib, time.monotonic() - started)
        log.info(
            "VM %s: its guest has %d CPUs and MemTotal %d KiB, %.2f s after the hotplug began",
            name,
            now.online_cpus,
            now.mem_total_kib,
            resized.seconds,
        )
        return record, resized

    async def online_cpu_mem(self, name: str, timeout: float = 30.0) -> Any:
        """The guest's SystemService.OnlineCpuMem: every offline CPU and memory block onlined."""
        from auraed.api.aurae.system import v0 as system_pb
        from auraed.vms.guest_calls import guest_error
        from auraed.wire import codec

        endpoint = await self.lookup(name)
        request = codec.encode(system_pb.SystemServiceOnlineCpuMemRequest())
        try:
            reply = await endpoint.channel.unary_unary(f"/{SYSTEM}/OnlineCpuMem")(request, timeout=timeout)
            return codec.decode(system_pb.SystemServiceOnlineCpuMemResponse, reply)
        except (grpc.aio.AioRpcError, codec.CodecError) as exc:
            raise guest_error(endpoint, exc) from None

    async def _wait_serving(self, name: str) -> float | None:
        """Seconds from launching the VMM until the guest serves (None without a launch time)."""
        record = self.vms.get(name)
        endpoint = await self.lookup(name)
        handle = self.vms.handle(name)
        try:
            await self.trust.wait_serving(endpoint, self._ready_timeout)
            # Counted from launching the VMM, as console_ready_ms promises (started_at is then).
            return time.time() - record.started_at if record.started_at else None
        except AuraeError as exc:
            tail = self.vms.console_tail(name)
            stopped = "; stopped it" if record.state == State.RUNNING else ""
            await self.vms.stop(name, 0.0)
            raise VmError(exc.kind, f"{exc.message}{stopped}. Console tail:\n" + "\n".join(tail)) from None
        except asyncio.CancelledError:
            # The caller went before its guest served: the boot it asked for is undone.
            await run_to_end(self.vms.stop_boot(name, handle, "the Start was cancelled"))
            raise

    async def lookup(self, name: str) -> GuestEndpoint:
        """The endpoint of a running guest (for placing work in it)."""
        record = self.vms.get(name)
        if not self.is_guest(record.spec):
            raise AuraeError(ErrorKind.FAILED_PRECONDITION, f"VM {name} does not run a guest auraed")
        if record.state != State.RUNNING:
            raise AuraeError(
                ErrorKind.FAILED_PRECONDITION,
                f"VM {name} is {record.state_with_reason()}; its guest cannot be reached until it is "
                "started again",
            )
        return self.trust.endpoint(name, self.identity(record), record.started_at)

    def _vm_ended(self, record: VmRecord) -> None:
        # Calls relayed to a guest whose VM died would wait on a dead connection: end them now.
        if self.is_guest(record.spec):
            self.trust.forget_soon(record.name, f"its VM {record.state_with_reason()}")

    async def free(self, name: str, timeout: float | None) -> None:
        """Free the VM, closing the host's channel to its guest before the tap goes.

        A channel left retrying after its tap is gone would reach for the guest's address through
        the host's default route. It is closed again afterwards, in case a call to the guest
        opened it meanwhile.
        """
        await self.trust.forget(name, "its VM was freed")
        try:
            await self.vms.free(name, timeout)
        finally:
            await self.trust.forget(name, "its VM was freed")
