"""The ``vm`` runtime handler: a pod is a guest VM, booted for it, on the pod's CNI network.

What the pod owns on the host is made as for a ``cell`` pod (auraed.cri.cell does it: the pinned
network namespace where the CNI plugins put the pod's interface, the pod cgroup, the files,
ADD/DEL); this handler adds the guest. In the pod's namespace a tap is joined to the CNI
interface by traffic-control mirroring (auraed.vms.pod_tap); the guest's NIC takes the
interface's MAC and its eth0 the pod's address and gateway, so the pod's IP is the guest's: the
host reaches the guest's auraed (mTLS, its per-guest certificate) at the pod IP, the kubelet's
hostPorts and other pods reach it through the CNI network as any pod.

The guest is sized from the pod's resources where it gives them (its containers' limits and
overhead, which the kubelet sums), plus what the guest itself needs, else from the configured
default. Pods that ask for a host namespace cannot be a guest: refused before anything is made.

Containers of a ``vm`` pod run in its guest (auraed.cri.guest_containers): they share the
guest's network and IPC namespaces (the pod's) and, when the pod shares its PID namespace, one
the guest makes for the pod (never the guest auraed's own). A pod with a user namespace of its
own (``hostUsers: false``) has it on the host, as a cell pod (its share's binds are idmapped by
it), and one of the same mappings in its guest, which owns the pod's IPC namespace there instead
of the guest's, and its PID namespace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from auraed.cni.cni import Cni
from auraed.cni.model import DEFAULT_IFNAME
from auraed.cni.result import CniResult
from auraed.containers.sandbox import SandboxContext, SharedNamespaces, UserNamespace
from auraed.cri.cell import CellSandbox
from auraed.cri.errors import CriError
from auraed.cri.model import PodRecord, PodResources, PodSpec, PodState
from auraed.cri.pod_share import PodShares
from auraed.cri.sandbox import HandlerFeatures
from auraed.errors import AuraeError, ErrorKind
from auraed.system.netns_dial import open_connection_in
from auraed.system.tasks import run_to_end
from auraed.vms.guests import GUEST_BASE_MIB, Guests
from auraed.vms.model import NetInfo, State, VmSpec
from auraed.vms.pod_tap import join_tap, unjoin_tap
from auraed.vms.templates import AUTO

log = logging.getLogger(__name__)

HANDLER = "vm"
"""The runtime handler's name (a RuntimeClass's handler)."""
VM_KEY = "vm"
"""The pod's sandbox entry of this handler: its VM's name and its tap."""
TAP = "tap0"
"""The guest's tap, beside the CNI interface in the pod's namespace."""
VMM_CGROUP = "vmm"
"""The cgroup below the pod's where its guest's QEMU and virtiofsd run: the pod cgroup counts
the whole VM (its containers and the guest's own overhead), and the kubelet's pod limits bound it."""
MIB = 1024 * 1024
POD_PID = Path("/proc/self/ns/pid")
"""What a vm pod's container sandbox names as its PID namespace when the pod shares one: no path
is joined by it, the guest makes the pod's PID namespace (auraed.cri.guest_containers)."""


TEMPLATE_VM = "pod-template"
"""The name of the spec a vm pod's template is made from (auraed.cri.vm_template): no VM has it."""


@dataclasses.dataclass(frozen=True)
class VmSizing:
    """A pod guest's size when the pod gives none, what its VMM takes beyond the guest's RAM, and
    its machine type (the ``cri_vm_*`` settings)."""

    vcpus: int = 1
    memory_mib: int = 768
    vmm_overhead_mib: int = 160
    machine: str = "q35"

    @property
    def vm_overhead_mib(self) -> int:
        """What a pod's VM takes beyond its containers' memory: the guest's own kernel and
        auraed, and its VMM."""
        return GUEST_BASE_MIB + self.vmm_overhead_mib


def guest_size(resources: PodResources, overhead: PodResources, default: VmSizing) -> tuple[int, int]:
    """(vCPUs, MiB) for a pod: its CPU quota over period (containers' and overhead), rounded
    up, and its containers' memory limit with the guest's own memory added; the default where
    the pod says nothing. The memory overhead is the VM's cost (the guest's own memory is in it,
    and the VMM's), not memory the guest's containers get."""
    cores = sum(
        part.cpu_quota / part.cpu_period
        for part in (resources, overhead)
        if part.cpu_quota > 0 and part.cpu_period > 0
    )
    vcpus = max(1, math.ceil(cores)) if cores else default.vcpus
    memory = resources.memory_limit
    memory_mib = GUEST_BASE_MIB + math.ceil(memory / MIB) if memory else default.memory_mib
    return vcpus, memory_mib


def cgroup_overhead(overhead: PodResources, sizing: VmSizing) -> PodResources:
    """The overhead a vm pod's cgroup is given above its containers' limits: the pod's, or
    what its VM takes beyond them when that is more (below it, the host would OOM-kill the
    VM's QEMU for the guest's own memory)."""
    return dataclasses.replace(
        overhead, memory_limit=max(overhead.memory_limit, sizing.vm_overhead_mib * MIB)
    )


def host_namespaces_asked(spec: PodSpec) -> list[str]:
    """The options of ``spec`` that put the pod in a host namespace (none for a guest)."""
    asked = {
        "config.linux.security_context.namespace_options.network": spec.host_network,
        "config.linux.security_context.namespace_options.pid": spec.host_pid,
        "config.linux.security_context.namespace_options.ipc": spec.host_ipc,
    }
    return [option for option, on in asked.items() if on]


def vm_name(pod: PodRecord) -> str:
    return pod_vm_name(pod.id)


def pod_vm_name(pod_id: str) -> str:
    """The VM of the pod ``pod_id``."""
    return f"pod-{pod_id[:16]}"


def _pod_address(result: CniResult, ifname: str) -> tuple[ipaddress.IPv4Interface, ipaddress.IPv4Address]:
    """The pod's IPv4 address (with its prefix) on ``ifname`` and its gateway: the guest's."""
    inside = {index for index, nic in enumerate(result.interfaces) if nic.name == ifname and nic.sandbox}
    for ip in result.ips:
        address = ip.address
        if not isinstance(address, ipaddress.IPv4Interface):
            continue
        if ip.interface is not None and inside and ip.interface not in inside:
            continue
        gateway = ip.gateway or next(
            (r.gw for r in result.routes if r.gw is not None and r.dst.prefixlen == 0 and r.dst.version == 4),
            None,
        )
        if not isinstance(gateway, ipaddress.IPv4Address):
            raise CriError(ErrorKind.FAILED_PRECONDITION, f"the pod network gave {address} no IPv4 gateway")
        return address, gateway
    raise CriError(ErrorKind.FAILED_PRECONDITION, "the pod network gave no IPv4 address: a guest needs one")


class VmSandbox:
    """The SandboxController of ``vm`` pods."""

    name = HANDLER
    # Recursive read-only mounts: the pod's share makes every mount of such a volume read-only
    # where virtiofsd serves it (auraed.cri.pod_share). User namespaces: the share's binds are
    # idmapped on the host, the guest runs the containers in one of the same mappings.
    features = HandlerFeatures(recursive_read_only_mounts=True, user_namespaces=True)
    stop_ends_containers = True

    def __init__(
        self,
        cell: CellSandbox,
        cni: Cni,
        guests: Guests,
        sizing: VmSizing,
        shares: PodShares,
        *,
        from_template: bool = False,
    ) -> None:
        self._from_template = from_template  # cri_vm_boot = "template"
        self._cell = cell
        self._cni = cni
        self._guests = guests
        self._sizing = sizing
        self._shares = shares

    def check(self, spec: PodSpec) -> None:
        asked = host_namespaces_asked(spec)
        if asked:
            raise CriError.invalid(
                asked[0],
                "a pod of the vm handler has its own network, PID and IPC namespaces (its guest's); "
                "run a pod that shares the host's with the cell handler",
            )

    def _warn_of_overhead(self, pod: PodRecord, overhead: PodResources, resources: PodResources) -> None:
        """A pod with a memory limit whose declared overhead is below what its VM takes: its
        cgroup here gets enough, but a kubelet bounds its own pod cgroup (above ours) by the
        declared overhead, and would OOM-kill the VM there."""
        needed = self._sizing.vm_overhead_mib
        declared = math.ceil(overhead.memory_limit / MIB)
        if resources.memory_limit and declared < needed:
            log.warning(
                "pod %s declares a memory overhead of %d MiB, below the %d MiB its VM takes beyond its "
                "containers (the guest's kernel and auraed, QEMU); its cgroup here is given %d MiB of "
                "overhead; set its RuntimeClass's overhead.podFixed.memory to at least %dMi so that "
                "the kubelet's pod limit agrees",
                pod.id[:13], declared, needed, needed, needed,
            )  # fmt: skip

    def _entry(self, pod: PodRecord) -> dict[str, Any] | None:
        entry = pod.sandbox.get(VM_KEY)
        return entry if isinstance(entry, dict) else None

    def _netns(self, pod: PodRecord) -> str:
        network = self._cell.network_namespace(pod)
        if network is None:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} has no network namespace of its own")
        return str(network)

    # -- run -------------------------------------------------------------------------------

    async def run(self, pod: PodRecord, save: Callable[[PodRecord], None]) -> None:
        """The host side as a cell pod's, then the tap, then the guest. A failure is undone by
        the caller (stop, then remove), which handles whatever part was made."""
        self.check(pod.spec)
        self._warn_of_overhead(pod, pod.spec.overhead, pod.spec.resources)
        await self._cell.run(pod, save, overhead=cgroup_overhead(pod.spec.overhead, self._sizing))
        netns = self._netns(pod)
        attachment = self._cni.attachment(pod.id)
        if attachment is None or attachment.result is None:
            raise CriError(ErrorKind.FAILED_PRECONDITION, "the pod has no network result for its guest")
        address, gateway = _pod_address(attachment.result, DEFAULT_IFNAME)
        name = vm_name(pod)
        pod.sandbox[VM_KEY] = {"name": name, "tap": TAP, "netns": netns}
        save(pod)  # before the tap, the share and the VM: a crash from here on is undone at start
        nic = await run_to_end(asyncio.to_thread(join_tap, netns, DEFAULT_IFNAME, TAP))
        shared = await run_to_end(asyncio.to_thread(self._shares.make, pod.id))
        cgroup_procs = await self._cell.make_child_cgroup(pod, VMM_CGROUP)
        net = NetInfo(
            index=-1,
            tap=TAP,
            host_ip=str(gateway),
            guest_ip=str(address.ip),
            prefixlen=address.network.prefixlen,
            mac=nic.mac,
            netns=netns,
        )
        vcpus, memory_mib = guest_size(pod.spec.resources, pod.spec.overhead, self._sizing)
        spec = self._guest_spec(
            name,
            vcpus=vcpus,
            memory_mib=memory_mib,
            hostname=pod.spec.hostname,
            shared_dir=str(shared),
            shared_namespace=str(self._shares.namespace(pod.id)),
            cgroup_procs=cgroup_procs,
        )
        await self._guests.allocate(spec, net)
        try:
            booted = await self._guests.boot(name, cold_if_no_template=True)
        except AuraeError as exc:
            # Its kind is the boot's (DEADLINE_EXCEEDED: not serving in time, the console's tail
            # in the message); the caller undoes the pod.
            raise CriError(
                exc.kind, f"pod sandbox {pod.id[:13]}: its guest did not boot: {exc.message}"
            ) from None
        how = f"cloned from template {booted.record.template}" if booted.record.template else "booted cold"
        log.info("pod %s: guest %s %s, ready in %.1f s", pod.id[:13], name, how, booted.ready or 0.0)

    def _guest_spec(
        self,
        name: str,
        *,
        vcpus: int,
        memory_mib: int,
        hostname: str,
        shared_dir: str,
        cgroup_procs: tuple[str, ...],
        shared_namespace: str = "",
    ) -> VmSpec:
        return VmSpec.guest(
            name,
            vcpus,
            memory_mib,
            # The pod's hostname for the guest (the last auraed.hostname wins over the VM's name,
            # which stays its identity: its certificate and the host's channel name it).
            kernel_args=(f"auraed.hostname={hostname}",) if hostname else (),
            backend="qemu",
            shared_dir=shared_dir,
            shared_namespace=shared_namespace,
            cgroup_procs=cgroup_procs,
            # The host's template (made at daemon start, auraed.cri.vm_template): a clone grown to
            # the pod's size, its virtio-fs plugged as it resumes; cold when it cannot be
            # (Guests.boot says why).
            template=AUTO if self._from_template else "",
            machine=self._sizing.machine,
        )

    def template_spec(self) -> VmSpec | None:
        """A pod's guest as its template is made for (its size is the default's: a template's
        clones are grown from its own base size); None when pods boot cold (cri_vm_boot)."""
        if not self._from_template:
            return None
        # As a pod's, it has a share (never made: a template has none, each clone's is plugged).
        share = str(self._shares.served(TEMPLATE_VM))
        sizing = self._sizing
        return self._guest_spec(
            TEMPLATE_VM,
            vcpus=sizing.vcpus,
            memory_mib=sizing.memory_mib,
            hostname="",
            shared_dir=share,
            cgroup_procs=(),
        )

    # -- stop, remove ----------------------------------------------------------------------

    def _vm(self, pod: PodRecord) -> str | None:
        """The pod's VM, when it still exists."""
        entry = self._entry(pod)
        if entry is None:
            return None
        try:
            self._guests.vms.get(entry["name"])
        except AuraeError:
            return None
        return str(entry["name"])

    async def stop(self, pod: PodRecord) -> None:
        """The guest stops (its containers with it), then the pod's network is released."""
        name = self._vm(pod)
        if name is not None and self._guests.vms.get(name).state in (State.RUNNING, State.STARTING):
            await self._guests.vms.stop(name, 0.0)
        await self._cell.stop(pod)

    async def remove(self, pod: PodRecord) -> None:
        name = self._vm(pod)
        if name is not None:
            await self._guests.free(name, 0.0)
        entry = self._entry(pod)
        if entry is not None:
            await run_to_end(asyncio.to_thread(unjoin_tap, entry["netns"], DEFAULT_IFNAME, entry["tap"]))
        await run_to_end(asyncio.to_thread(self._shares.remove, pod.id))
        await self._cell.remove(pod)

    async def recover(self, pod: PodRecord) -> None:
        """As a cell pod's; a READY pod whose guest is not running is NOT_READY from now on."""
        await self._cell.recover(pod)
        if pod.state is not PodState.READY:
            return
        name = self._vm(pod)
        if name is None or self._guests.vms.get(name).state != State.RUNNING:
            log.warning("pod %s lost its guest: it is not ready any more", pod.id[:13])
            pod.state = PodState.NOT_READY

    async def update_resources(self, pod: PodRecord, overhead: PodResources, resources: PodResources) -> None:
        """A resize (UpdatePodSandboxResources): the guest grown to what the new total needs (its
        vCPUs and memory hotplugged on q35 and onlined in the guest; never shrunk: a guest gives
        nothing back here, the pod cgroup's limits bound what it uses), then the pod cgroup on
        the host, which holds the VM, given the new limits as a cell pod's. A guest that cannot
        grow (microvm) refuses before anything changed."""
        name = self._vm(pod)
        if name is None:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} has no guest VM")
        vcpus, memory_mib = guest_size(resources, overhead, self._sizing)
        spec = self._guests.vms.get(name).spec
        if vcpus > spec.vcpus or memory_mib > spec.memory_mib:
            await self._guests.resize(name, max(vcpus, spec.vcpus), max(memory_mib, spec.memory_mib))
        self._warn_of_overhead(pod, overhead, resources)
        await self._cell.update_resources(pod, cgroup_overhead(overhead, self._sizing), resources)

    def container_sandbox(self, pod: PodRecord) -> SandboxContext:
        """What a container in the pod's guest shares there: the pod's PID namespace when the
        pod shares one (its network and IPC are the guest's always), the pod's /etc/hosts,
        /etc/resolv.conf and /etc/hostname (host files the guest is given through the pod's
        share). ``cgroup_parent`` is the pod cgroup on the host, where the VM runs: what the
        pod's stats read."""
        if self._vm(pod) is None:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} has no guest VM")
        join = self._cell.container_join(pod)
        pid = POD_PID if pod.spec.shared_pid else None
        # The pod's user namespace on the host (the cell's pin) with its mappings: the share's
        # binds are idmapped by it, the guest makes one of the same mappings.
        user = None if join.userns is None else UserNamespace(Path(join.namespaces["user"]), join.userns)
        return SandboxContext(
            sandbox_id=pod.id,
            cgroup_parent=join.cgroup_parent,
            namespaces=SharedNamespaces(pid=pid, user=user),
            hostname=pod.spec.hostname or None,
            resolv_conf=join.resolv_conf,
            hosts=join.hosts,
            hostname_file=join.hostname_file,
        )

    async def dial(self, pod: PodRecord, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """``port`` at the pod's IP, from the host: the guest's address (its localhost is its own)."""
        if not pod.ip:
            raise CriError.precondition(f"pod sandbox {pod.id[:13]} has no IP")
        return await open_connection_in(None, pod.ip, port)
