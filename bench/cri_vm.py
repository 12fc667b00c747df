"""CRI ``vm`` pods: RunPodSandbox until the guest serves, against a bare boot of the same kernel;
the lifecycle of a pod with one container, ``vm`` pods against ``cell`` pods, busybox against a
~330 MB Debian image in ``vm`` pods; all in one run.

    .venv/bin/python bench/cri_vm.py [--iterations 5] [--warmup 1] [--gap-ms 500]
        [--memory-mib 768] [--guest-image DIR] [--boot default|cold] [--density N]
        [--concurrent [N]] [--json-only]

A sibling of bench/cri.py, not a mode of it: it shares cri.py's pieces (the Auraed runtime, the
pods' and the container's requests, the busybox image and its registry mirror, the CNI network,
PodSandboxStatus's check, the teardown RPCs, the host-side leak checks, the clean-up) and
bench/guest.py's (the bare VM, the console markers, the guest image), but its series, its peer
(a bare boot through the VmService, not containerd) and its report are its own; folded into
cri.py they would double that file's paths through run() and report().

One real auraed (cri.py's Auraed: common.py's Daemon, a dev PKI, the CNI network of
tests.support.cni: Debian's bridge + host-local + portmap + loopback on a private /24) started
with ``--guest-image`` (guest-image/build's output), ``--ca-key`` (the host CA issues every guest
its certificate), ``--vm-address-pool`` (a free /28 of 10.213.128.0/18; pods' guests take their
pod's CNI address, the pool serves the VmService's own VMs) and ``--cri-vm-memory-mib`` /
``--cri-vm-vcpus`` (the size of a pod's guest when the pod gives no limits: ``--memory-mib``
and 1 vCPU, as the bare VM). QEMU runs under TCG on machines without a usable KVM. The container
image is cri.py's: busybox (``registry.k8s.io/e2e-test-images/busybox:1.29-2``, built from
Debian's busybox-static, tests.support.images) pushed to a local docker-registry
(tests.support.registry.LocalRegistry), the daemon's mirror of registry.k8s.io, and pulled onto
the host once through ImageService.PullImage before anything is measured, as is the Debian image
(tests.support.images.build_debian_layout: libc, dash and coreutils, Python, the C toolchain,
QEMU and the CNI plugins, as installed here, in four layers; kept in .work/bench/debian-layout).
Four series, one of each per round, the order rotating from round to round, each after
``--gap-ms`` idle:

* ``vm``: a pod of the ``vm`` handler with one container, its lifecycle as a kubelet drives it,
  each step timed by the client: RunPodSandbox (its reply comes once the guest's auraed serves
  health over mTLS at the pod IP: cell-style pod namespaces and cgroup, CNI ADD, the tap,
  Allocate, the config disk, QEMU, the boot) -> PodSandboxStatus (READY, an IP of the CNI
  subnet) -> CreateContainer (busybox ``sh -c 'echo ready; sleep 3600'``, its log at
  ``<pod log directory>/main/0.log``, oom_score_adj 1000; the host binds the image's snapshots
  read-only in the pod's virtio-fs share and the guest mounts the container's overlay over them
  and creates it with crun) -> StartContainer -> the
  container's first line, ``ready``, in its log file on the host (the file the kubelet reads,
  which the host writes from the guest's Logs stream; read every 5 ms from StartContainer's
  reply) -> StopContainer (timeout 0: SIGKILL at once) -> RemoveContainer -> StopPodSandbox (the
  guest stopped, CNI DEL) -> RemovePodSandbox (the VM freed, tap, namespaces, cgroup and files
  removed). Every pod has a fresh guest: with ``--boot default`` (the daemon's default
  configuration: ``cri_vm_boot = "template"``, ``cri_vm_machine = "q35"``) cloned from the host's
  guest template, which the daemon makes in the background as it starts (the warm-up pods'
  RunPodSandbox is reported apart: the first may wait for the template's end), grown by hotplug
  from the template's base size (1 vCPU, 256 MiB) to the pod's; each clone gets a copy of the
  template's RAM and its virtio-fs plugged after the restore, whose steps are read off the
  daemon's log. With ``--boot cold`` (the default before issue 35: ``cri_vm_boot = "cold"``,
  microvm) booted cold. Once the first line is there, untimed, an ExecSync in the container
  reads the guest's MemAvailable.
* ``vm_debian``: the same, the container from the Debian image (Debian's ``sh`` and ``sleep``).
* ``bare`` (RunPodSandbox's peer): the same kernel with the same QEMU command line (auraed's own:
  machine, accelerator, 1 vCPU, the same memory; the machine the pods' own, q35 with
  ``--boot default`` (``vm_machine``, which only the VmService's VMs follow), microvm cold) and
  the bare initramfs, whose /init prints
  AURAE-BARE-BOOT-OK and powers off (bench/guest.py's bare_vm); no network, no disks. VmService
  Allocate + Start with wait_for_console, timed from sending Allocate until Start's reply; freed
  once it has powered off (untimed).
* ``cell``: a pod of the ``cell`` handler, the same lifecycle with the same requests (its
  container runs on the host with runc, the image already unpacked there): the vm pod's peer.

The container is cri.py's, with the cpu_shares a kubelet sends every BestEffort container (2),
in both series: the vm pod's guest turns it into cpu.weight on its cgroup v2.

A lifecycle's total is the sum of its nine steps; the sum of the pod's four RPCs alone
(RunPodSandbox, PodSandboxStatus, StopPodSandbox, RemovePodSandbox) is reported beside it, the
figure of this script's pod-only runs before containers of vm pods were served. Where a boot's
time goes is read off its serial console, followed on the host every 10 ms as bench/guest.py
does: when the console file appears (QEMU has started: everything before is the host's side),
when the kernel's clock starts (its printk uptime at ``Run /init``), then the guest's markers
(initramfs, PID 1, the daemon, serving) or the bare marker; the host seeing SERVING is the rest
of the reply.

``--warmup`` rounds first, untimed, which also check the pods while their container runs: RUNNING
by ContainerStatus, and for the vm pod its guest (its size as the VmService lists it, QEMU's
accelerator off its command line) and no container monitor of the daemon's on the host (the
container runs in the guest). After the rounds nothing may be left, checked on the host as
cri.py checks (no pod or container listed, no CNI lease, NAT rule, bridge port or libcni cache
entry, no mount below the daemon's directories (the pods' netns pins, the containers' rootfs), no
cgroup below the pods' cgroup parents or the daemon's base, no container monitor or pod init)
and for the guests: no VM listed by the VmService, no process naming the VMs' run directory
(QEMU), no VM run directory or pod directory, no tap owned by one of the daemon's VMs. On exit,
whatever happens: containers and pods removed through the CRI, VMs freed through the VmService,
the daemon stopped, any QEMU still naming a VM's run directory killed, mounts detached, cgroups,
the registry, the CNI bridge, rules and leases and the temp directory removed.

With ``--density N``, after the rounds: N vm pods of the Debian image made one after another,
each running its container, all left idle 30 s, then per pod the PSS of its processes on the host
(QEMU and virtiofsd) and its guest's MemAvailable, with the load average; removed after.

With ``--concurrent [N]`` (N 20 when not given), then: N vm pods (busybox) at once, as a kubelet
given that many pods drives them, with the default configuration's clones: every RunPodSandbox
sent at once; then, in every pod that came up, its container (COMMAND) created and started, all
at once; ListPodSandbox must list all N READY and ListContainers their containers RUNNING, and an
ExecSync (``echo hello``) in each must answer; then every container and pod stopped and removed
at once. Reported: succeeded/total at each step, the wall time of each step (up: RunPodSandbox,
then the containers; down), each pod's RunPodSandbox (and other steps) p50/p90/max, every failure
with its pod, its RPC and how long it took to fail; at the peak the host's MemAvailable (before,
then, after), the PSS of the pods' QEMU and virtiofsd (as the density part reads it), where the
CPU went (the host's busy share during the RunPodSandbox calls, the CPU seconds of the pods'
VMMs and of the daemon), and the clones' steps off the daemon's log. The peer: N bare boots
(the ``bare`` series' VM) started at once through the VmService; the ratio of the wall times
until all were up (every RunPodSandbox's reply; every bare boot's marker). The target is that
all N are READY and nothing leaks (the leak check below runs after this part).

Targets (issues #20, #35): RunPodSandbox of a vm pod at most 1.0x the bare boot (p50) *with the
default configuration* (``--boot default``: the bare VM boots on q35 too, the clones' machine); a
cold run's ratio is reported against that target as what it is; the vm pod's lifecycle (with its
container) is reported against the cell pod's (no target); nothing leaks. Issue #35 also: a vm
pod's CreateContainer at most 2x its StartContainer (p50); the Debian image's CreateContainer at
most 1.2x busybox's; its guest's MemAvailable at most 32 MiB lower than busybox's guest's;
20 concurrent vm pods on 2 cores all READY, nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from common import (
    exit_on_sigterm,
    machine_info,
    make_pki,
    percentile,
    print_json,
    print_lines,
    print_table,
    ratio,
    remove_cgroup_base,
    summarize,
    temp_dir,
    verdict,
)
from container_start import source_state, tests_support
from cri import (
    EXEC,
    EXEC_OUTPUT,
    STOP_TIMEOUT_S,
    Auraed,
    Pod,
    Process,
    Setup,
    baseline,
    call,
    check_pod_network,
    leaks,
    plugin_chain,
    processes,
    publish_images,
    remove_everything,
    teardown,
    unmount_under,
)
from guest import (
    BARE_MARKER,
    BARE_MARKERS,
    GUEST_MARKERS,
    VMS,
    Booted,
    ConsoleWatch,
    Made,
    allocate,
    bare_phases,
    bare_vm,
    free_pool,
    free_vm,
    guest_image_dir,
    guest_phases,
    image_facts,
    last_resort,
    read_console,
    wait_ended,
)

from auraed.api.aurae.vms import v0 as vms_pb
from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient
from auraed.cri.runtime import SERVICE_NAME as RUNTIME_SERVICE
from auraed.images.content import tree_size
from auraed.system.cri_log import parse_cri_log_line
from auraed.system.monitor_launcher import MONITOR_NAME
from auraed.system.node import USER_HZ, load_percent, read_cpu_times, read_memory
from auraed.vms import network
from auraed.vms.backend import CONSOLE_LOG, processes_referencing

if TYPE_CHECKING:
    from tests.support.cni import CniNetwork
    from tests.support.images import BuiltImage
    from tests.support.registry import LocalRegistry

T = TypeVar("T")

SERIES = ("vm", "vm_debian", "bare", "cell")
HANDLERS = ("vm", "cell")
HANDLER_OF = {"vm": "vm", "vm_debian": "vm", "cell": "cell"}  # the pod series' handlers
DEBIAN_IMAGE = "registry.k8s.io/e2e-test-images/aurae-debian:bench"
"""The ~330 MB image of Debian packages (tests.support.images.build_debian_layout), mirrored."""
DEBIAN_LAYOUT = Path(__file__).resolve().parent.parent / ".work" / "bench" / "debian-layout"
"""Where its layout is kept between runs (built again when the packages' versions change)."""
POD_PHASES = ("run_pod", "status", "stop_pod", "remove_pod")  # the pod's own RPCs
# The whole lifecycle, in order: the pod's RPCs and its one container's (``first_line``: from
# StartContainer's reply until the container's first line is in its log file on the host).
PHASES = ("run_pod", "status", "create", "start", "first_line", "stop", "remove", "stop_pod", "remove_pod")
READY_LINE = "ready"
COMMAND = ["sh", "-c", f"echo {READY_LINE}; sleep 3600"]
CREATE_TIMEOUT = 300.0  # a vm pod's Create places the image in its guest: unpacked there, under TCG
FIRST_LINE_TIMEOUT_S = 120.0
LOG_POLL_S = 0.005  # how often the container's log file is read for its first line
STEP_NAMES = {
    "run_pod": "RunPodSandbox",
    "status": "PodSandboxStatus",
    "create": "CreateContainer",
    "start": "StartContainer",
    "first_line": "first line in the log file",
    "stop": "StopContainer",
    "remove": "RemoveContainer",
    "stop_pod": "StopPodSandbox",
    "remove_pod": "RemovePodSandbox",
}
VCPUS = 1
TARGET_RATIO = 1.0  # vm pod RunPodSandbox over the bare boot, p50, with the default configuration
TARGET_CREATE_OVER_START = 2.0  # a vm pod's CreateContainer over its StartContainer, p50 (issue 35)
TARGET_DEBIAN_OVER_BUSYBOX = 1.2  # the Debian image's CreateContainer over busybox's, p50 (issue 35)
TARGET_EXTRA_MEMORY_MIB = 32.0  # the guest's MemAvailable: the Debian image's drop beyond busybox's
MIB = 1024 * 1024
RUN_POD_TIMEOUT = 300.0  # a cold guest boot under TCG on a loaded machine
START_TIMEOUT_S = 300
BARE_TAIL_S = 0.2  # the bare guest powers off right after its marker: let the console catch up
DENSITY_SETTLE_S = 30.0  # idle time of the density pods before their memory is read
CONCURRENT_PODS = 20  # --concurrent without a number: issue 35's "20 concurrent vm pods on 2 cores"
CONCURRENT_EXEC_TIMEOUT_S = 60  # cri.py's ExecSync's own timeout here: N guests share the cores, TCG
# Each concurrent pod's steps, and two sums: ``containers`` (create + start), ``down`` (the last four).
CONCURRENT_PHASES = (
    *("run_pod", "create", "start", "containers", "exec_sync"),
    *("stop", "remove", "stop_pod", "remove_pod", "down"),
)
QEMU = "qemu-system-x86_64"


# ------------------------------------------------------------------------------ the runtime


class VmAuraed(Auraed):
    """cri.py's Auraed serving ``vm`` pods too: the guest image, the host CA's key, a pool; the
    registry mirror of registry.k8s.io, as cri.py's."""

    def __init__(
        self,
        root: Path,
        network: CniNetwork,
        registry: LocalRegistry,
        *,
        image: Path,
        memory_mib: int,
        made: Made,
        boot: str = "default",
    ) -> None:
        pki = make_pki(root)
        # The default's pods are q35 clones (cri_vm_machine): the bare VM boots q35 too (vm_machine,
        # the VmService's machine, which pods do not follow). Cold: microvm for both, as before.
        how = (
            ("--vm-machine", "q35")
            if boot == "default"
            else ("--cri-vm-boot", "cold", "--cri-vm-machine", "microvm")
        )
        super().__init__(
            root,
            network,
            registry,
            "--guest-image", str(image),
            "--ca-key", str(pki.ca_key),
            "--vm-address-pool", str(free_pool()),
            "--cri-vm-memory-mib", str(memory_mib),
            "--cri-vm-vcpus", str(VCPUS),
            *how,
            pki=pki,
        )  # fmt: skip
        self.made = made  # the bare VMs, for the clean-up of last resort

    @property
    def vms_dir(self) -> Path:
        return self.root / "run" / "vms"

    def leftover_processes(self) -> list[Process]:
        """Monitors and pod inits (cri.py's), and any process naming a VM's run directory (QEMU)."""
        vmms = set(processes_referencing(self.vms_dir))
        return [*super().leftover_processes(), *(p for p in processes() if p.pid in vmms)]

    def leftovers_on_host(self) -> dict[str, list[str]]:
        """VM run directories, pod directories, and taps one of this daemon's VMs owns."""
        pods_dir = self.root / "run" / "pods"
        return {
            "vm_run_dirs": entries(self.vms_dir),
            "pod_dirs": entries(pods_dir),
            "vm_taps": taps_owned_under(self.root),
        }

    def cleanup(self) -> None:
        """The daemon stopped (it leaves its VMs running: that is how they outlive a restart),
        then any QEMU still naming a VM's run directory killed, then the mounts detached."""
        try:
            self.daemon.cleanup()
        finally:
            try:
                last_resort(self.daemon, self.made)
            finally:
                unmount_under(self.root)


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def taps_owned_under(root: Path) -> list[str]:
    """Host taps whose owner alias (``auraed-vm <run dir>``) names a run directory below ``root``."""
    found = []
    for name in sorted(network.link_names()):
        if network.TAP_NAME.match(name):
            owner = network.tap_owner(name) or ""
            if owner.startswith(f"auraed-vm {root}/"):
                found.append(f"{name} ({owner})")
    return found


# ------------------------------------------------------------------------------ consoles


class Console(ConsoleWatch):
    """guest.py's ConsoleWatch on a file found once it exists; notes when it first appears."""

    def __init__(self, find: Callable[[], Path | None], markers: dict[str, str]) -> None:
        super().__init__(Path(), markers)
        self._find = find
        self.appeared: float | None = None

    def _scan(self, now: float) -> None:
        if self.appeared is None:
            found = self._find()
            if found is None or not found.exists():
                return
            self.path, self.appeared = found, now
        super()._scan(now)


def new_pod_console(vms_dir: Path) -> Callable[[], Path | None]:
    """The console of the first pod VM (``pod-<id>``) that was not there yet."""
    before = set(entries(vms_dir))

    def find() -> Path | None:
        for run_dir in vms_dir.glob("pod-*"):
            if run_dir.name not in before:
                return run_dir / CONSOLE_LOG
        return None

    return find


def booted(name: str, total: float, console: Console, t0: float) -> Booted:
    """What guest.py's phase splitters read, with times since ``t0`` (our first RPC's send)."""
    text = read_console(console.path) if console.appeared is not None else ""
    return Booted(
        name=name,
        address="",
        allocate_s=0.0,
        start_wall_s=total,
        reported_ready_ms=0,
        arrivals={key: when - t0 for key, (when, _) in console.seen.items()},
        lines={key: line for key, (_, line) in console.seen.items()},
        console=text,
    )


def host_side_split(phases: dict[str, float], console: Console, t0: float) -> dict[str, float]:
    """guest.py's phases renamed for a whole boot: ``total``, and its VMM-and-firmware phase split
    where the console file appears (QEMU started: before it, the host's own work)."""
    out = {"total": phases.pop("total_start_rpc")}
    until_kernel = phases.pop("vmm_and_firmware_until_kernel_clock_starts")
    if console.appeared is not None:
        out["host_until_qemu_console"] = console.appeared - t0
        out["qemu_and_firmware_until_kernel_clock"] = until_kernel - out["host_until_qemu_console"]
    return out | phases


# ------------------------------------------------------------------------------ the series


async def pod_lifecycle(
    runtime: VmAuraed,
    setup: Setup,
    handler: str,
    name: str,
    while_running: Callable[[Pod], Awaitable[None]] | None = None,
    *,
    cold: bool = True,
    memory: list[float] | None = None,
) -> tuple[dict[str, float], dict[str, float] | None]:
    """One pod with one container, as a kubelet drives it: RunPodSandbox, PodSandboxStatus (READY
    with an IP), CreateContainer, StartContainer, the container's first line in its log file on
    the host, StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox: seconds per step,
    their sum (``total``) and the sum of the pod's four RPCs (``pod_total``); for a vm pod, its
    boot's phases too. ``while_running`` runs (untimed) once the line is seen; with ``memory``,
    the guest's MemAvailable then (MiB, read by an ExecSync in the container) is appended to it."""
    pod = setup.pod(name)
    await asyncio.to_thread(pod.prepare)
    client = runtime.client
    # A clone prints no boot: its phases come from the daemon's log instead (clone_phases).
    console = Console(new_pod_console(runtime.vms_dir), GUEST_MARKERS) if handler == "vm" and cold else None
    durations: dict[str, float] = {}
    try:
        if console is not None:
            console.start()
        try:
            config = pod.config()
            request = cri.RunPodSandboxRequest(config=config, runtime_handler=handler)
            t0 = time.monotonic()
            reply = await client.call(RUNTIME_SERVICE, "RunPodSandbox", request, RUN_POD_TIMEOUT)
            durations["run_pod"] = time.monotonic() - t0
        finally:
            if console is not None:
                await console.stop()
        pod.pod_id = reply.pod_sandbox_id
        await timed(durations, "status", check_pod_network(client, pod, setup.network))
        container = one_container(pod)
        create = cri.CreateContainerRequest(
            pod_sandbox_id=pod.pod_id, config=container, sandbox_config=config
        )
        created = await timed(
            durations, "create", client.call(RUNTIME_SERVICE, "CreateContainer", create, CREATE_TIMEOUT)
        )
        pod.container_id = created.container_id
        start_request = cri.StartContainerRequest(container_id=pod.container_id)
        await timed(durations, "start", call(client, "StartContainer", start_request))
        log = pod.log_directory / container.log_path
        await timed(durations, "first_line", first_line(log, f"{name}: {COMMAND}"))
        if while_running is not None:
            await while_running(pod)
        if memory is not None:
            memory.append(await mem_available_mib(client, pod.container_id))
        for phase, method, teardown_request in teardown(pod.container_id, pod.pod_id):
            await timed(durations, phase, call(client, method, teardown_request))
    finally:
        await asyncio.to_thread(pod.clean)
    durations["total"] = sum(durations[p] for p in PHASES)
    durations["pod_total"] = sum(durations[p] for p in POD_PHASES)
    if handler == "vm" and console is None:
        return durations, {"total": durations["run_pod"]}
    if console is None:
        return durations, None
    boot = booted(name, durations["run_pod"], console, t0)
    try:
        return durations, host_side_split(guest_phases(boot), console, t0)
    except RuntimeError as error:  # markers missing: the boot's total stands, its split does not
        print(f"cri_vm: {name}: {error}", file=sys.stderr)
        return durations, {"total": durations["run_pod"]}


def one_container(pod: Pod) -> cri.ContainerConfig:
    """cri.py's container (busybox, a log path below the pod's log directory, cpu_shares 2 and
    oom_score_adj 1000 as for a BestEffort pod) running COMMAND, for both handlers."""
    container = pod.container()
    container.command = COMMAND
    return container


async def mem_available_mib(client: AuraeClient, container_id: str) -> float:
    """The MemAvailable of the machine the container runs on (a vm pod's: its guest's), in MiB."""
    request = cri.ExecSyncRequest(container_id=container_id, cmd=["cat", "/proc/meminfo"], timeout=60)
    reply = await client.call(RUNTIME_SERVICE, "ExecSync", request, 90)
    for line in reply.stdout.decode().splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) / 1024
    raise RuntimeError(f"no MemAvailable in the container's /proc/meminfo: {reply.stdout[:200]!r}")


async def timed(durations: dict[str, float], phase: str, step: Awaitable[T]) -> T:
    """``step`` awaited, its seconds in ``durations[phase]``."""
    start = time.monotonic()
    outcome = await step
    durations[phase] = time.monotonic() - start
    return outcome


async def first_line(path: Path, what: str) -> None:
    """Until the log file the kubelet reads holds the container's first line (READY_LINE on
    stdout, in the CRI format), read every LOG_POLL_S (in the loop: a thread's hop would cost
    more than reading a file of one line)."""
    deadline = time.monotonic() + FIRST_LINE_TIMEOUT_S
    while (line := first_stdout_line(path)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: no line in {path} {FIRST_LINE_TIMEOUT_S:.0f} s after the start")
        await asyncio.sleep(LOG_POLL_S)
    if line != READY_LINE:
        raise RuntimeError(f"{what}: first line {line!r} in {path}, not {READY_LINE!r}")


def first_stdout_line(path: Path) -> str | None:
    """The first whole stdout line of a CRI log file, if it has one yet."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    for line in text.split("\n")[:-1]:  # whole lines only: the last may be half written
        _, stream, partial, content = parse_cri_log_line(line)
        if stream == "stdout" and not partial:
            return content
    return None


async def bare_boot(
    aurae: AuraeClient, runtime: VmAuraed, image: Path, memory_mib: int, name: str
) -> dict[str, float]:
    """Allocate + Start (until the bare marker) of the bare VM, its phases; freed once off."""
    console = Console(lambda: runtime.vms_dir / name / CONSOLE_LOG, BARE_MARKERS)
    console.start()
    try:
        t0 = time.monotonic()
        await allocate(aurae, bare_vm(name, image, memory_mib), runtime.made)
        allocated = time.monotonic() - t0
        request = vms_pb.VmServiceStartRequest(
            name=name, wait_for_console=BARE_MARKER, timeout_ms=START_TIMEOUT_S * 1000
        )
        await aurae.call(VMS, "Start", request, timeout=START_TIMEOUT_S + 30)
        total = time.monotonic() - t0
        await asyncio.sleep(BARE_TAIL_S)
    finally:
        await console.stop()
    try:
        reason = await wait_ended(aurae, name)
    except RuntimeError as error:  # seen 1 bare boot in ~25 (q35, idle or not): say what it printed
        tail = read_console(console.path).splitlines()[-5:] if console.appeared is not None else []
        raise RuntimeError(f"{error}; its console's last lines: {tail}") from None
    finally:  # freed (stopped first, if it never powered off) whatever happened: nothing is left
        await free_vm(aurae, name, runtime.made)
    if "powered off" not in reason:
        raise RuntimeError(f"bare VM {name} ended with {reason!r}")
    phases = host_side_split(bare_phases(booted(name, total, console, t0)), console, t0)
    return {"total": phases.pop("total"), "allocate_rpc": allocated, **phases}


async def idle_density(runtime: VmAuraed, setup: Setup, count: int) -> dict[str, Any]:
    """``count`` vm pods of ``setup.image``, one after another, each with its container running
    COMMAND, then all left idle DENSITY_SETTLE_S: per pod, the PSS of its processes on the host
    (QEMU and virtiofsd, every process naming its VM's run directory: PSS splits the guest RAM they
    both map) and its guest's MemAvailable; the load average then. Removed after, untimed."""
    client = runtime.client
    pods: list[Pod] = []
    try:
        for i in range(count):
            pod = setup.pod(f"idle-{i}")
            await asyncio.to_thread(pod.prepare)
            pods.append(pod)
            config = pod.config()
            run_pod = cri.RunPodSandboxRequest(config=config, runtime_handler="vm")
            pod.pod_id = (
                await client.call(RUNTIME_SERVICE, "RunPodSandbox", run_pod, RUN_POD_TIMEOUT)
            ).pod_sandbox_id
            container = one_container(pod)
            create = cri.CreateContainerRequest(
                pod_sandbox_id=pod.pod_id, config=container, sandbox_config=config
            )
            pod.container_id = (
                await client.call(RUNTIME_SERVICE, "CreateContainer", create, CREATE_TIMEOUT)
            ).container_id
            await call(client, "StartContainer", cri.StartContainerRequest(container_id=pod.container_id))
            await first_line(pod.log_directory / container.log_path, pod.name)
        await asyncio.sleep(DENSITY_SETTLE_S)
        loadavg = [round(x, 2) for x in os.getloadavg()]
        pss = [round(pod_pss_mib(runtime.vms_dir / f"pod-{pod.pod_id[:16]}"), 1) for pod in pods]
        available = [round(await mem_available_mib(client, pod.container_id), 1) for pod in pods]
    finally:
        for pod in pods:
            with contextlib.suppress(Exception):
                for _, method, request in teardown(pod.container_id, pod.pod_id):
                    await call(client, method, request)
            await asyncio.to_thread(pod.clean)
    return {
        "pods": count,
        "image": setup.image,
        "settle_s": DENSITY_SETTLE_S,
        "host_pss_mib_per_pod": pss,
        "host_pss_mib_mean": round(sum(pss) / len(pss), 1),
        "host_pss_mib_total": round(sum(pss), 1),
        "guest_mem_available_mib": available,
        "loadavg_at_measure": loadavg,
    }


def pod_pss_mib(run_dir: Path) -> float:
    """The PSS of every process naming the VM's run directory (its QEMU and virtiofsd), in MiB."""
    total_kib = 0
    for pid in processes_referencing(run_dir):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024


def pod_vm_name(pod: Pod) -> str:
    """The name of a vm pod's guest (auraed.cri.vm's ``pod-<the pod id's first 16>``)."""
    return f"pod-{pod.pod_id[:16]}"


async def attempt(durations: dict[str, float], phase: str, pod: Pod, step: Awaitable[T]) -> T:
    """``timed``, and a failure said with its pod, its RPC and how long it took to fail."""
    start = time.monotonic()
    try:
        return await timed(durations, phase, step)
    except Exception as error:
        took = time.monotonic() - start
        raise RuntimeError(
            f"{pod.name}: {STEP_NAMES.get(phase, phase)} failed after {took:.1f} s: {error}"
        ) from error


def host_mem_available_mib() -> float:
    return round(read_memory().available / MIB, 1)


def cpu_seconds(pid: int, children: bool = False) -> float:
    """The CPU time (user + system) process ``pid`` has used, with its waited-for children's when
    ``children`` (the daemon's CNI plugins, runtimes); 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0], utime [11]
    ticks = sum(int(f) for f in fields[11 : 15 if children else 13])
    return ticks / USER_HZ


def pod_cpu_seconds(run_dir: Path) -> float:
    """The CPU time every process naming the VM's run directory (QEMU, virtiofsd) has used."""
    return sum(cpu_seconds(pid) for pid in processes_referencing(run_dir))


async def all_at_once(
    pods: list[Pod], step: Callable[[Pod], Awaitable[None]], failures: list[str]
) -> tuple[list[Pod], float]:
    """``step`` of every pod at once: the pods it succeeded for (each failure's text appended to
    ``failures``) and the wall seconds until the last ended."""
    start = time.monotonic()
    outcomes = await asyncio.gather(*(step(pod) for pod in pods), return_exceptions=True)
    wall = time.monotonic() - start
    failures += [str(o) for o in outcomes if isinstance(o, BaseException)]
    return [pod for pod, o in zip(pods, outcomes, strict=True) if not isinstance(o, BaseException)], wall


def daemon_cpu_seconds(runtime: VmAuraed) -> float:
    """The daemon's CPU time, its children's (CNI plugins, runtimes) included."""
    process = runtime.daemon.process
    return cpu_seconds(process.pid, children=True) if process is not None else 0.0


def peak_figures(
    runtime: VmAuraed, up: list[Pod], host_cpu_busy: float, daemon_cpu_before: float
) -> dict[str, Any]:
    """The concurrent pods' peak: the host's memory, the PSS of the pods' VMMs, and where the CPU
    went from the first RunPodSandbox to here (the pods' VMMs all started after it): the host's
    busy share during the RunPodSandbox calls (every process's, other sessions' too), the pods'
    QEMU and virtiofsd, the daemon and its children; the load average."""
    pss = [round(pod_pss_mib(runtime.vms_dir / pod_vm_name(pod)), 1) for pod in up]
    vmm_cpu = [pod_cpu_seconds(runtime.vms_dir / pod_vm_name(pod)) for pod in up]
    return {
        "host_mem_available_mib": host_mem_available_mib(),
        "host_pss_mib_total": round(sum(pss), 1),
        "host_pss_mib_mean": round(sum(pss) / len(pss), 1) if pss else 0.0,
        "host_pss_mib_per_pod": pss,
        "host_cpu_busy_percent_during_run_pod": round(host_cpu_busy, 1),
        "pods_vmm_cpu_s_total": round(sum(vmm_cpu), 1),
        "pods_vmm_cpu_s_mean": round(sum(vmm_cpu) / len(vmm_cpu), 1) if vmm_cpu else 0.0,
        "daemon_cpu_s": round(daemon_cpu_seconds(runtime) - daemon_cpu_before, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


async def concurrent_pods(runtime: VmAuraed, setup: Setup, count: int) -> dict[str, Any]:
    """``count`` vm pods at once, as a kubelet given that many pods: every RunPodSandbox sent at
    once, then in every pod that came up its container (COMMAND) created and started, all at once;
    at the peak, ListPodSandbox must list them all READY and ListContainers their containers
    RUNNING, an ExecSync in each must answer, and the host's memory is read (MemAvailable, and
    the PSS of every process naming a pod's VM run directory, as the density part reads it); then
    every container and pod stopped and removed at once. Failures are collected, not raised:
    what is left is removed afterwards (and the leak check after it sees what could not be)."""
    client = runtime.client
    pods = [setup.pod(f"many-{i}") for i in range(count)]
    steps: dict[str, dict[str, float]] = {pod.name: {} for pod in pods}
    failures: list[str] = []
    peak: dict[str, Any] = {}
    available_before = host_mem_available_mib()
    daemon_cpu_before, host_cpu_before = daemon_cpu_seconds(runtime), read_cpu_times()
    for pod in pods:
        await asyncio.to_thread(pod.prepare)

    async def run_pod(pod: Pod) -> None:
        request = cri.RunPodSandboxRequest(config=pod.config(), runtime_handler="vm")
        reply = await attempt(
            steps[pod.name],
            "run_pod",
            pod,
            client.call(RUNTIME_SERVICE, "RunPodSandbox", request, RUN_POD_TIMEOUT),
        )
        pod.pod_id = reply.pod_sandbox_id

    async def start_container(pod: Pod) -> None:
        create = cri.CreateContainerRequest(
            pod_sandbox_id=pod.pod_id, config=one_container(pod), sandbox_config=pod.config()
        )
        created = await attempt(
            steps[pod.name],
            "create",
            pod,
            client.call(RUNTIME_SERVICE, "CreateContainer", create, CREATE_TIMEOUT),
        )
        pod.container_id = created.container_id
        start = cri.StartContainerRequest(container_id=pod.container_id)
        await attempt(steps[pod.name], "start", pod, call(client, "StartContainer", start))
        steps[pod.name]["containers"] = steps[pod.name]["create"] + steps[pod.name]["start"]

    async def exec_answers(pod: Pod) -> None:
        request = cri.ExecSyncRequest(
            container_id=pod.container_id, cmd=EXEC, timeout=CONCURRENT_EXEC_TIMEOUT_S
        )
        reply = await attempt(
            steps[pod.name], "exec_sync", pod,
            client.call(RUNTIME_SERVICE, "ExecSync", request, CONCURRENT_EXEC_TIMEOUT_S + 30),
        )  # fmt: skip
        if reply.exit_code != 0 or reply.stdout != EXEC_OUTPUT:
            raise RuntimeError(f"{pod.name}: ExecSync {EXEC}: exit {reply.exit_code}, {reply.stdout[:100]!r}")

    async def down(pod: Pod) -> None:
        calls = teardown(pod.container_id, pod.pod_id)
        for phase, method, request in calls:
            await attempt(steps[pod.name], phase, pod, call(client, method, request))
        steps[pod.name]["down"] = sum(steps[pod.name][phase] for phase, _, _ in calls)

    try:
        up, run_wall = await all_at_once(pods, run_pod, failures)
        host_cpu_busy_run_pod = load_percent(host_cpu_before, read_cpu_times())
        running, containers_wall = await all_at_once(up, start_container, failures)
        ours = {pod.pod_id for pod in up}
        listed = (await call(client, "ListPodSandbox", cri.ListPodSandboxRequest())).items
        listed_containers = (await call(client, "ListContainers", cri.ListContainersRequest())).containers
        ready = [p.id for p in listed if p.id in ours and p.state == cri.PodSandboxState.SANDBOX_READY]
        running_listed = [
            c.id for c in listed_containers
            if c.pod_sandbox_id in ours and c.state == cri.ContainerState.CONTAINER_RUNNING
        ]  # fmt: skip
        answered, exec_wall = await all_at_once(running, exec_answers, failures)
        peak = peak_figures(runtime, up, host_cpu_busy_run_pod, daemon_cpu_before)
    finally:
        made = [pod for pod in pods if pod.pod_id]
        done, down_wall = await all_at_once(made, down, failures)
        if len(done) < len(made):
            await remove_everything(client)
        for pod in pods:
            await asyncio.to_thread(pod.clean)
    counts = {
        "succeeded": len(done),
        "run_pod_succeeded": len(up),
        "containers_started": len(running),
        "ready_listed": len(ready),
        "running_listed": len(running_listed),
        "exec_answered": len(answered),
    }
    return {
        "pods": count,
        **counts,
        "all_succeeded": not failures and all(n == count for n in counts.values()),
        "failures": failures,
        "run_pod_wall_ms": round(run_wall * 1000, 1),
        "containers_wall_ms": round(containers_wall * 1000, 1),
        "up_wall_ms": round((run_wall + containers_wall) * 1000, 1),
        "exec_wall_ms": round(exec_wall * 1000, 1),
        "down_wall_ms": round(down_wall * 1000, 1),
        "per_pod": {
            phase: summarize(found)
            for phase in CONCURRENT_PHASES
            if (found := [steps[pod.name][phase] for pod in pods if phase in steps[pod.name]])
        },
        "vms": [pod_vm_name(pod) for pod in up],
        "host_mem_available_mib_before": available_before,
        "peak": peak,
        "host_mem_available_mib_after": host_mem_available_mib(),
    }


async def concurrent_bare_boots(
    aurae: AuraeClient, runtime: VmAuraed, image: Path, memory_mib: int, count: int
) -> dict[str, Any]:
    """The concurrent pods' peer: ``count`` bare boots (the ``bare`` series' VM) started at once,
    the wall time until the last one's marker (Start's reply), and each boot's own total."""
    start = time.monotonic()

    async def boot(i: int) -> tuple[float, float]:
        sent = time.monotonic()
        total = (await bare_boot(aurae, runtime, image, memory_mib, f"bare-many-{i}"))["total"]
        return sent - start + total, total  # (when its Start replied, from the first send; its own)

    outcomes = await asyncio.gather(*(boot(i) for i in range(count)), return_exceptions=True)
    booted = [o for o in outcomes if not isinstance(o, BaseException)]
    return {
        "vms": count,
        "succeeded": len(booted),
        "failures": [f"bare-many-{i}: {o}" for i, o in enumerate(outcomes) if isinstance(o, BaseException)],
        "wall_ms": round(max((end for end, _ in booted), default=0.0) * 1000, 1),
        "per_boot": summarize([total for _, total in booted]) if booted else {},
    }


async def container_running(client: AuraeClient, pod: Pod) -> None:
    """ContainerStatus: the pod's container RUNNING."""
    request = cri.ContainerStatusRequest(container_id=pod.container_id)
    status = (await call(client, "ContainerStatus", request)).status
    if status.state != cri.ContainerState.CONTAINER_RUNNING:
        raise RuntimeError(f"{pod.name}: its container is {status.state!r} after its first line, not RUNNING")


class GuestCheck:
    """While a warm-up vm pod's container runs: RUNNING; the pod's guest as the VmService lists it,
    QEMU's accelerator; no container monitor of the daemon's on the host (it runs in the guest)."""

    def __init__(self, aurae: AuraeClient, runtime: VmAuraed) -> None:
        self.aurae = aurae
        self.runtime = runtime
        self.seen: dict[str, Any] = {}

    async def __call__(self, pod: Pod) -> None:
        await container_running(self.runtime.client, pod)
        listing = await self.aurae.call(VMS, "List", vms_pb.VmServiceListRequest(), timeout=30)
        pods = [s for s in listing.vms if s.vm.name.startswith("pod-")]
        if len(pods) != 1:
            raise RuntimeError(f"{pod.name}: {len(pods)} pod VMs listed while it runs, not 1")
        vm = pods[0].vm
        argv = qemu_argv(self.runtime.vms_dir / vm.name)
        run_dir = str(self.runtime.root / "run")
        monitors = [p for p in processes() if p.comm == MONITOR_NAME and run_dir in p.cmdline]
        if monitors:
            raise RuntimeError(f"{pod.name}: container monitors on the host: {[str(m) for m in monitors]}")
        self.seen = {
            "vcpus": vm.vcpus,
            "memory_mib": vm.memory_mib,
            "accelerator": argv[argv.index("-accel") + 1] if "-accel" in argv[:-1] else "",
            "container_running": True,
            "host_container_monitors": len(monitors),
        }


def qemu_argv(run_dir: Path) -> list[str]:
    """The command line of the QEMU naming ``run_dir`` (empty when none)."""
    for pid in processes_referencing(run_dir):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if Path(argv[0]).name == QEMU:
                return argv
    return []


async def optional_parts(
    args: argparse.Namespace, aurae: AuraeClient, runtime: VmAuraed, setup: Setup, image: Path
) -> dict[str, dict[str, Any]]:
    """After the rounds, what was asked of ``--density`` and ``--concurrent`` (empty if not)."""
    density, concurrent = {}, {}
    if args.density:
        density = await idle_density(runtime, dataclasses.replace(setup, image=DEBIAN_IMAGE), args.density)
    if args.concurrent:
        concurrent = await concurrent_with_peer(args, aurae, runtime, setup, image)
    return {"density": density, "concurrent": concurrent}


def logged_clones(
    args: argparse.Namespace, log: str, concurrent: dict[str, Any]
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The steps of the rounds' clones and of the concurrent pods' clones, as the daemon logged
    them (none when cold). The warm-up rounds' come first and are left out (two vm pods a round,
    vm and vm_debian), and so are the density pods', which come after the rounds'."""
    if args.boot != "default":
        return [], []
    clones = clone_phases(log)
    rounds = list(clones.values())[2 * args.warmup : 2 * (args.warmup + args.iterations)]
    return rounds, [clones[vm] for vm in concurrent.get("vms", []) if vm in clones]


async def concurrent_with_peer(
    args: argparse.Namespace, aurae: AuraeClient, runtime: VmAuraed, setup: Setup, image: Path
) -> dict[str, Any]:
    """The concurrent pods, then their peer, each after ``--gap-ms`` idle."""
    await asyncio.sleep(args.gap_ms / 1000)
    concurrent = await concurrent_pods(runtime, setup, args.concurrent)
    await asyncio.sleep(args.gap_ms / 1000)
    peer = await concurrent_bare_boots(aurae, runtime, image, args.memory_mib, args.concurrent)
    return {**concurrent, "bare_peer": peer}


async def run(
    args: argparse.Namespace, runtime: VmAuraed, setup: Setup, image: Path, debian: BuiltImage
) -> dict[str, Any]:
    """Warm-up, the rotating rounds, the density pods when asked, the leak check; whatever
    happens, pods and VMs removed."""
    series: dict[str, list[dict[str, float]]] = {s: [] for s in SERIES}
    boots: dict[str, list[dict[str, float]]] = {"vm": [], "vm_debian": [], "bare": []}
    memory: dict[str, list[float]] = {"vm": [], "vm_debian": []}  # the guests' MemAvailable, MiB
    runs: list[dict[str, Any]] = []
    warmup_run_pod: list[float] = []  # by default, the first may wait for the template's end
    async with runtime.daemon.client() as aurae:
        check = GuestCheck(aurae, runtime)

        async def one(
            kind: str, name: str, ready: Callable[[Pod], Awaitable[None]] | None, measured: bool = True
        ) -> tuple[dict[str, float], dict[str, float] | None]:
            if kind == "bare":
                phases = await bare_boot(aurae, runtime, image, args.memory_mib, name)
                return phases, phases
            of = dataclasses.replace(setup, image=DEBIAN_IMAGE) if kind == "vm_debian" else setup
            return await pod_lifecycle(
                runtime, of, HANDLER_OF[kind], name, ready, cold=args.boot == "cold",
                memory=memory[kind] if measured and kind in memory else None,
            )  # fmt: skip

        async def cell_running(pod: Pod) -> None:
            await container_running(runtime.client, pod)

        try:
            # busybox and the Debian image pulled once, untimed, onto the host
            await runtime.connect(setup.image, DEBIAN_IMAGE)
            snapshots = runtime.root / "state" / "images" / "snapshots"
            debian_facts = {
                "layers": len(debian.layers),
                "compressed_mib": round(debian.total_layer_size / MIB, 1),
                "unpacked_mib": round(
                    sum(
                        tree_size(snapshots / layer.diff_id.removeprefix("sha256:"))
                        for layer in debian.layers
                    )
                    / MIB,
                    1,
                ),
            }
            before = baseline(runtime, setup.pods_base)
            for i in range(args.warmup):
                for kind in SERIES:
                    ready = check if HANDLER_OF.get(kind) == "vm" else cell_running
                    measured, _ = await one(kind, f"{kind}-w{i}".replace("_", "-"), ready, measured=False)
                    if kind == "vm":
                        warmup_run_pod.append(measured["run_pod"])
            for i in range(args.iterations):
                for kind in SERIES[i % len(SERIES) :] + SERIES[: i % len(SERIES)]:
                    await asyncio.sleep(args.gap_ms / 1000)
                    measured, phases = await one(kind, f"{kind}-{i}".replace("_", "-"), None)
                    series[kind].append(measured)
                    if phases is not None and kind in boots:
                        boots[kind].append(phases)
                    entry = {"kind": kind, "round": i, "total_ms": round(measured["total"] * 1000, 1)}
                    if "pod_total" in measured:
                        entry["pod_rpcs_ms"] = round(measured["pod_total"] * 1000, 1)
                    runs.append(entry)
                    if not args.json_only:
                        print(f"  round {i}: {kind} {measured['total']:.2f} s", file=sys.stderr)
            loadavg_after_rounds = [round(x, 2) for x in os.getloadavg()]
            after_rounds = await optional_parts(args, aurae, runtime, setup, image)
            left = await leaks(runtime, setup, before)
            listed = await aurae.call(VMS, "List", vms_pb.VmServiceListRequest(), timeout=30)
            if listed.vms:
                left["left"]["vms_listed"] = [s.vm.name for s in listed.vms]
                left["clean"] = False
        finally:
            if runtime.connected:
                await remove_everything(runtime.client)
            for name in list(runtime.made.vms):
                with contextlib.suppress(Exception):
                    await free_vm(aurae, name, runtime.made)
            await runtime.close()
    rounds_clones, concurrent_clones = logged_clones(args, runtime.log(), after_rounds["concurrent"])
    return {
        "version": runtime.version,
        "series": series,
        "boots": boots,
        "memory": memory,
        **after_rounds,
        "debian_image": debian_facts,
        "loadavg_after_rounds": loadavg_after_rounds,
        "runs": runs,
        "vm_pod_guest": check.seen,
        "leaks_after_rounds": left,
        "warmup_run_pod_s": warmup_run_pod,
        "clones": rounds_clones,
        "concurrent_clones": concurrent_clones,
        "template": template_made(runtime.log()) if args.boot == "default" else {},
    }


MIB_KEY = "ram_copied_mib"
CLONE_LOG = {
    "ram_copy": re.compile(r"VM (pod-\w+): RAM copied for its shared directory in (\d+) ms \((\d+) MiB"),
    "plugged": re.compile(r"VM (pod-\w+): RAM copied .* virtio-fs plugged in (\d+) ms"),
    "cloned": re.compile(
        r"VM (pod-\w+) cloned from template \S+: restored in (\d+) ms, identity applied in ([\d.]+) ms"
    ),
    "ready": re.compile(r"guest (pod-\w+) cloned from template \S+, ready in ([\d.]+) s"),
    "grown": re.compile(r"VM (pod-\w+) grown as it was restored from .* in (\d+) ms"),
    "onlined": re.compile(r"VM (pod-\w+) cloned from template .* KiB ([\d.]+) ms into its identity"),
}
TEMPLATE_LOG = re.compile(
    r"VM template (\S+) made in ([\d.]+) s \(imports ([\d.]+) s, saved in (\d+) ms, (\d+) MiB resident\)"
)


def template_made(log: str) -> dict[str, float | str]:
    """The pods' template as the daemon made it at its start: seconds to make it (boot to saved),
    its guest's imports, the save, its resident MiB (auraed.vms.templates' line)."""
    found = TEMPLATE_LOG.search(log)
    if found is None:
        return {}
    return {
        "name": found[1],
        "made_s": float(found[2]),
        "imports_s": float(found[3]),
        "save_s": float(found[4]) / 1000,
        "resident_mib": float(found[5]),
    }


def clone_phases(log: str) -> dict[str, dict[str, float]]:
    """Per clone of a vm pod (by its VM's name, in order), in seconds (as every series here): its
    RAM copy, the virtio-fs plug, the restore, the hotplug growing it to the pod's size and its guest's wait
    for it to be online (part of the identity), the identity, its ready time as the handler
    logged it; and the MiB of data copied. From the daemon's log lines (auraed.vms.qemu, auraed.vms.guests,
    auraed.cri.vm)."""
    clones: dict[str, dict[str, float]] = {}
    for line in log.splitlines():
        if m := CLONE_LOG["ram_copy"].search(line):
            clones.setdefault(m[1], {}).update({"ram_copy": float(m[2]) / 1000, MIB_KEY: float(m[3])})
        if m := CLONE_LOG["plugged"].search(line):
            clones.setdefault(m[1], {})["virtio_fs_plug"] = float(m[2]) / 1000
        if m := CLONE_LOG["cloned"].search(line):
            clones.setdefault(m[1], {}).update(restore=float(m[2]) / 1000, identity=float(m[3]) / 1000)
        if m := CLONE_LOG["ready"].search(line):
            clones.setdefault(m[1], {})["guest_ready"] = float(m[2])
        if m := CLONE_LOG["grown"].search(line):
            clones.setdefault(m[1], {})["hotplug"] = float(m[2]) / 1000
        if m := CLONE_LOG["onlined"].search(line):
            clones.setdefault(m[1], {})["guest_onlined"] = float(m[2]) / 1000
    return clones


# ------------------------------------------------------------------------------ report


def stats_of(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per key, the summary of every sample holding it (a boot whose markers were missed has
    only its total)."""
    keys = list(dict.fromkeys(k for s in samples for k in s))
    return {k: summarize([s[k] for s in samples if k in s]) for k in keys}


def report(
    args: argparse.Namespace,
    results: dict[str, Any],
    *,
    machine: dict[str, Any],
    source: dict[str, Any],
    image: Path,
    network: CniNetwork,
) -> dict[str, Any]:
    steps = {h: stats_of(results["series"][h]) for h in HANDLERS}
    lifecycle = {h: {k: steps[h][k] for k in (*PHASES, "total")} for h in HANDLERS}
    pod_rpcs = {h: {**{k: steps[h][k] for k in POD_PHASES}, "total": steps[h]["pod_total"]} for h in HANDLERS}
    boots = {k: stats_of(v) for k, v in results["boots"].items()}
    run_pod = {"vm": lifecycle["vm"]["run_pod"], "bare": boots["bare"]["total"]}
    boot_ratio = ratio(run_pod["vm"]["p50_ms"], run_pod["bare"]["p50_ms"])

    def vm_over_cell(of: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
        return {phase: ratio(of["vm"][phase]["p50_ms"], of["cell"][phase]["p50_ms"]) for phase in of["vm"]}

    clean = bool(results["leaks_after_rounds"]["clean"])
    debian = {k: steps_of for k, steps_of in stats_of(results["series"]["vm_debian"]).items() if k in PHASES}
    create_over_start = ratio(lifecycle["vm"]["create"]["p50_ms"], lifecycle["vm"]["start"]["p50_ms"])
    debian_over_busybox = ratio(debian["create"]["p50_ms"], lifecycle["vm"]["create"]["p50_ms"])
    available = {kind: round(percentile(sorted(values), 50), 1) for kind, values in results["memory"].items()}
    extra_mib = round(available["vm"] - available["vm_debian"], 1)
    concurrent = concurrent_report(results)
    result: dict[str, Any] = {
        "benchmark": "cri_vm",
        "machine": machine,
        "source": source,
        "guest_image": image_facts(image),
        "iterations": args.iterations,
        "warmup": args.warmup,
        "gap_ms": args.gap_ms,
        "memory_mib": args.memory_mib,
        "vcpus": VCPUS,
        "boot": args.boot,
        "machine_type": "q35" if args.boot == "default" else "microvm",
        "version": results["version"],
        "vm_pod_guest": results["vm_pod_guest"],
        "cni": {"subnet": str(network.subnet), "plugins": plugin_chain(network)},
        "run_pod": run_pod,
        "ratio_p50_run_pod_vm_over_bare": boot_ratio,
        "ratio_min_run_pod_vm_over_bare": ratio(run_pod["vm"]["min_ms"], run_pod["bare"]["min_ms"]),
        "boot_phases": boots,
        "container_command": COMMAND,
        "stop_timeout_s": STOP_TIMEOUT_S,
        "lifecycle": lifecycle,
        "ratio_p50_lifecycle_vm_over_cell": vm_over_cell(lifecycle),
        "ratio_min_lifecycle_total_vm_over_cell": ratio(
            lifecycle["vm"]["total"]["min_ms"], lifecycle["cell"]["total"]["min_ms"]
        ),
        "pod_lifecycle": pod_rpcs,
        "ratio_p50_pod_lifecycle_vm_over_cell": vm_over_cell(pod_rpcs),
        "debian_image": {"reference": DEBIAN_IMAGE, **results["debian_image"]},
        "lifecycle_vm_debian": debian,
        "ratio_p50_create_over_start_vm": create_over_start,
        "ratio_p50_create_debian_over_busybox_vm": debian_over_busybox,
        "guest_mem_available_mib": {k: results["memory"][k] for k in results["memory"]},
        "guest_mem_available_p50_mib": available,
        "guest_mem_available_debian_drop_beyond_busybox_mib": extra_mib,
        "density": results["density"],
        "concurrent": concurrent,
        "loadavg_after_rounds": results["loadavg_after_rounds"],
        "runs": results["runs"],
        "leaks_after_rounds": results["leaks_after_rounds"],
        "warmup_run_pod_ms": [round(s * 1000, 1) for s in results["warmup_run_pod_s"]],
        "clone_phases": stats_of(
            [{k: v for k, v in c.items() if k != "ram_copied_mib"} for c in results["clones"]]
        ),
        "clone_ram_copied_mib": [c.get(MIB_KEY) for c in results["clones"]],
        "template_made_at_start": results["template"],
        "target": {
            "ratio_p50_run_pod_over_bare_at_most": TARGET_RATIO,
            "applies_to": "the default configuration (--boot default: template clones)",
            f"{args.boot}_result": verdict(boot_ratio <= TARGET_RATIO),
            "create_over_start_at_most": TARGET_CREATE_OVER_START,
            "create_over_start": verdict(create_over_start <= TARGET_CREATE_OVER_START),
            "debian_create_over_busybox_at_most": TARGET_DEBIAN_OVER_BUSYBOX,
            "debian_create_over_busybox": verdict(debian_over_busybox <= TARGET_DEBIAN_OVER_BUSYBOX),
            "debian_extra_memory_mib_at_most": TARGET_EXTRA_MEMORY_MIB,
            "debian_extra_memory": verdict(extra_mib <= TARGET_EXTRA_MEMORY_MIB),
            "nothing_leaked": verdict(clean),
            **({"concurrent_all_ready": verdict(concurrent["all_succeeded"])} if concurrent else {}),
        },
    }
    if not args.json_only:
        print_report(args, result)
    return result


def concurrent_report(results: dict[str, Any]) -> dict[str, Any]:
    """The concurrent pods' figures with their peer's, the ratio of the wall times until all were
    up (every RunPodSandbox's reply; every bare boot's marker), and their clones' steps."""
    concurrent = results["concurrent"]
    if not concurrent:
        return {}
    peer = concurrent["bare_peer"]
    return {
        **{k: v for k, v in concurrent.items() if k != "vms"},
        "ratio_run_pod_wall_over_bare_wall": ratio(concurrent["run_pod_wall_ms"], peer["wall_ms"]),
        "clone_phases": stats_of(
            [{k: v for k, v in c.items() if k != MIB_KEY} for c in results["concurrent_clones"]]
        ),
    }


def stat_row(label: str, stats: dict[str, float]) -> list[object]:
    return [label, stats["p50_ms"], stats["min_ms"], stats["max_ms"]]


def print_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    run_pod, boots, lifecycle = result["run_pod"], result["boot_phases"], result["lifecycle"]
    how = "Cold" if args.boot == "cold" else "Default (from-template)"
    print_table(
        f"{how} vm pod RunPodSandbox vs a bare boot of the same kernel (ms), {args.iterations} each, "
        f"{args.memory_mib} MiB, {VCPUS} vCPU, {result['machine_type']}",
        ["series", "p50", "min", "max"],
        [
            stat_row("vm pod: RunPodSandbox until the guest serves", run_pod["vm"]),
            stat_row("bare: Allocate + Start until its marker", run_pod["bare"]),
        ],
    )
    rows = [stat_row(f"{kind}: {phase}", stats) for kind in boots for phase, stats in boots[kind].items()]
    rows += [stat_row(f"vm clone: {phase}", stats) for phase, stats in result["clone_phases"].items()]
    print_table(
        "Where the boots go (ms; p50s do not add up to the total's)",
        ["series: phase", "p50", "min", "max"],
        rows,
    )
    ratios = result["ratio_p50_lifecycle_vm_over_cell"]
    pod_rpcs, pod_ratios = result["pod_lifecycle"], result["ratio_p50_pod_lifecycle_vm_over_cell"]

    def row(label: str, of: dict[str, dict[str, dict[str, float]]], phase: str, by: float) -> list[object]:
        return [label, *(of[h][phase][f"{stat}_ms"] for h in HANDLERS for stat in ("p50", "min", "max")), by]

    print_table(
        f"Pod lifecycle with one container (ms per step), {args.iterations} pods per handler",
        ["step", "vm p50", "vm min", "vm max", "cell p50", "cell min", "cell max", "ratio p50"],
        [
            *(row(STEP_NAMES[phase], lifecycle, phase, ratios[phase]) for phase in PHASES),
            row("total", lifecycle, "total", ratios["total"]),
            row("of which the pod's 4 RPCs", pod_rpcs, "total", pod_ratios["total"]),
        ],
    )
    debian = result["lifecycle_vm_debian"]
    print_table(
        "vm pods: busybox (1 MB) against a Debian image (~330 MB) (ms per step, p50 min max)",
        ["step", "busybox p50", "min", "max", "debian p50", "min", "max", "ratio p50"],
        [
            [
                STEP_NAMES[phase],
                *(lifecycle["vm"][phase][f"{stat}_ms"] for stat in ("p50", "min", "max")),
                *(debian[phase][f"{stat}_ms"] for stat in ("p50", "min", "max")),
                ratio(debian[phase]["p50_ms"], lifecycle["vm"][phase]["p50_ms"]),
            ]
            for phase in ("create", "start", "first_line")
        ],
    )
    memory, target = result["guest_mem_available_mib"], result["target"]
    extra = result["guest_mem_available_debian_drop_beyond_busybox_mib"]
    lines = [
        f"guest MemAvailable after the start (MiB): busybox {memory['vm']}, debian {memory['vm_debian']}; "
        f"the Debian image's drop beyond busybox's: {extra} MiB "
        f"(target <= {TARGET_EXTRA_MEMORY_MIB:g}: {target['debian_extra_memory']})",
        f"vm pod CreateContainer / StartContainer, p50: {result['ratio_p50_create_over_start_vm']}x "
        f"(target <= {TARGET_CREATE_OVER_START:g}: {target['create_over_start']})",
        f"debian / busybox CreateContainer, p50: {result['ratio_p50_create_debian_over_busybox_vm']}x "
        f"(target <= {TARGET_DEBIAN_OVER_BUSYBOX:g}: {target['debian_create_over_busybox']})",
        f"load average after the rounds: {result['loadavg_after_rounds']}",
    ]
    if density := result["density"]:
        lines.append(
            f"density: {density['pods']} idle vm pods of the Debian image, host PSS per pod (QEMU + "
            f"virtiofsd) mean {density['host_pss_mib_mean']} MiB, total {density['host_pss_mib_total']} "
            f"MiB: {density['host_pss_mib_per_pod']}; guests' MemAvailable "
            f"{density['guest_mem_available_mib']}; load average {density['loadavg_at_measure']}"
        )
    print_lines(lines)
    if concurrent := result["concurrent"]:
        print_concurrent(concurrent)
    found = result["leaks_after_rounds"]
    target = result["target"]
    cold = result["ratio_p50_run_pod_vm_over_bare"]
    met = "met" if target[f"{args.boot}_result"] == "PASS" else "NOT met"
    if args.boot == "default":
        verdict_line = (
            f"target <= {TARGET_RATIO}x (default configuration): {met}; the warm-up pods' "
            f"RunPodSandbox: {result['warmup_run_pod_ms']} ms; the template made at start: "
            f"{result['template_made_at_start']}"
        )
    else:
        verdict_line = f"target <= {TARGET_RATIO}x is for the default configuration: cold, it is {met}"
    print_lines(
        [
            f"vm pod guest: {result['vm_pod_guest']}",
            f"after the rounds: {'nothing left' if found['clean'] else 'LEFT ' + str(found['left'])} "
            f"({found['settled_ms']} ms)",
            f"ratio vm pod RunPodSandbox / bare boot, p50: {cold}x ({args.boot}; min/min "
            f"{result['ratio_min_run_pod_vm_over_bare']}x)",
            verdict_line,
            f"ratio vm / cell full lifecycle, p50: {ratios['total']}x (min/min "
            f"{result['ratio_min_lifecycle_total_vm_over_cell']}x); the pod's 4 RPCs alone: "
            f"{pod_ratios['total']}x",
            f"nothing leaked: {target['nothing_leaked']}",
        ]
    )


def print_concurrent(concurrent: dict[str, Any]) -> None:
    per_pod, peer, peak = concurrent["per_pod"], concurrent["bare_peer"], concurrent["peak"]

    def row(label: str, wall: object, stats: dict[str, float]) -> list[object]:
        return [label, wall, *(stats.get(f"{stat}_ms", "-") for stat in ("p50", "p90", "max"))]

    count = concurrent["pods"]
    print_table(
        f"{count} vm pods at once (ms): wall times, and each pod's step",
        ["what (succeeded)", "wall", "p50", "p90", "max"],
        [
            row(
                f"RunPodSandbox ({concurrent['run_pod_succeeded']}/{count})",
                concurrent["run_pod_wall_ms"],
                per_pod.get("run_pod", {}),
            ),
            row(
                f"CreateContainer, then StartContainer ({concurrent['containers_started']})",
                concurrent["containers_wall_ms"],
                per_pod.get("containers", {}),
            ),
            row(
                f"ExecSync ({concurrent['exec_answered']})",
                concurrent["exec_wall_ms"],
                per_pod.get("exec_sync", {}),
            ),
            row(
                f"Stop and Remove, containers and pods ({concurrent['succeeded']})",
                concurrent["down_wall_ms"],
                per_pod.get("down", {}),
            ),
            row(
                f"peer: bare boots at once ({peer['succeeded']}/{peer['vms']})",
                peer["wall_ms"],
                peer["per_boot"],
            ),
        ],
    )
    memory = (
        f"host MemAvailable (MiB): {concurrent['host_mem_available_mib_before']} before, "
        f"{peak.get('host_mem_available_mib', '-')} at the peak, "
        f"{concurrent['host_mem_available_mib_after']} after"
    )
    pss = (
        f"PSS of the pods' QEMU and virtiofsd at the peak: {peak.get('host_pss_mib_total', '-')} MiB "
        f"({peak.get('host_pss_mib_mean', '-')} per pod); load average {peak.get('loadavg', '-')}"
    )
    print_lines(
        [
            f"{count} at once: {concurrent['succeeded']}/{count} went through, {concurrent['ready_listed']} "
            f"listed READY, {concurrent['running_listed']} containers RUNNING, "
            f"{concurrent['exec_answered']} ExecSync answered: {verdict(concurrent['all_succeeded'])}",
            f"RunPodSandbox wall / the bare boots' wall: {concurrent['ratio_run_pod_wall_over_bare_wall']}x",
            f"{memory}; {pss}",
            f"CPU: the host {peak.get('host_cpu_busy_percent_during_run_pod', '-')}% busy during the "
            f"RunPodSandbox calls; the pods' QEMU and virtiofsd {peak.get('pods_vmm_cpu_s_total', '-')} s "
            f"({peak.get('pods_vmm_cpu_s_mean', '-')} s per pod), the daemon "
            f"{peak.get('daemon_cpu_s', '-')} s until the peak",
            "their clones' steps, p50 (max) ms: "
            + ", ".join(
                f"{step} {stats['p50_ms']:.0f} ({stats['max_ms']:.0f})"
                for step, stats in concurrent["clone_phases"].items()
            ),
            *(f"failure: {failure}" for failure in concurrent["failures"]),
        ]
    )


# ------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    parser.add_argument("--gap-ms", type=int, default=500, help="idle time before each (default 500)")
    parser.add_argument(
        "--memory-mib", type=int, default=768, help="MiB of the pods' guests and the bare VM (default 768)"
    )
    parser.add_argument("--guest-image", help="guest image directory (default: guest-image/build)")
    parser.add_argument(
        "--boot",
        choices=("default", "cold"),
        default="default",
        help="the daemon's default configuration: vm pods cloned from the host's template, made as "
        "the daemon starts (q35; the bare VM boots q35 too), or booted cold (microvm)",
    )
    parser.add_argument(
        "--density",
        type=int,
        default=0,
        help="after the rounds, this many idle vm pods of the Debian image at once: the host memory "
        "(PSS of QEMU and virtiofsd) per pod (default 0: none)",
    )
    parser.add_argument(
        "--concurrent",
        type=int,
        nargs="?",
        const=CONCURRENT_PODS,
        default=0,
        metavar="N",
        help=f"after the rounds, N vm pods (busybox) at once (without N: {CONCURRENT_PODS}): every "
        "RunPodSandbox at once, then their containers, all listed READY and RUNNING, an ExecSync in "
        "each, all removed at once; the host memory at the peak; peer: N bare boots at once "
        "(default 0: none)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if (
        args.iterations < 1
        or min(args.warmup, args.gap_ms, args.density, args.concurrent) < 0
        or args.memory_mib < 64
    ):
        parser.error(
            "--iterations must be positive, --warmup, --gap-ms, --density and --concurrent not "
            "negative, --memory-mib >= 64"
        )
    if os.geteuid() != 0:
        parser.exit(2, "cri_vm: needs root (pods: namespaces, cgroups, mounts, CNI; taps, QEMU)\n")
    if shutil.which(QEMU) is None:
        parser.exit(2, f"cri_vm: {QEMU} is not installed (qemu-system-x86)\n")
    tests_support()
    from tests.support.cni import missing_plugins

    if missing_plugins():
        parser.exit(
            2, f"cri_vm: CNI plugins missing: {', '.join(missing_plugins())} (containernetworking-plugins)\n"
        )
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run, set up and, whatever happens, cleaned up; the result."""
    tests_support()
    from tests.support.cni import cni_network
    from tests.support.cri import BUSYBOX_IMAGE
    from tests.support.registry import LocalRegistry

    machine = machine_info()  # now: the load before this run's own guests
    source = source_state()
    image = guest_image_dir(args.guest_image)
    pods_base = f"aurae-bench-cri-vm-{os.getpid()}"
    with temp_dir("auraed-bench-cri-vm-") as root, LocalRegistry() as registry, cni_network(root) as network:
        network.write(network.conflist())
        publish_images(root / "images", registry, pause=False)
        from tests.support.cri import publish
        from tests.support.images import build_debian_layout

        debian = build_debian_layout(DEBIAN_LAYOUT)
        publish(debian, registry, DEBIAN_IMAGE)
        runtime = VmAuraed(
            root / "auraed",
            network,
            registry,
            image=image,
            memory_mib=args.memory_mib,
            made=Made(),
            boot=args.boot,
        )
        try:
            runtime.start()
            setup = Setup(BUSYBOX_IMAGE, network, root / "pods", pods_base)
            results = asyncio.run(run(args, runtime, setup, image, debian))
        except BaseException:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"--- auraed log (tail)\n{runtime.log()[-4000:]}\n")
            raise
        finally:
            with contextlib.suppress(Exception):
                runtime.cleanup()
            remove_cgroup_base(pods_base)
        return report(args, results, machine=machine, source=source, image=image, network=network)


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    print_json(measure(args))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
