"""CRI pod lifecycle: a pod with a busybox container through the kubelet's API, auraed vs containerd.

    .venv/bin/python bench/cri.py [--iterations 20] [--warmup 2] [--gap-ms 100] [--pods 50]
        [--runtimes auraed,containerd] [--json-only]

One CRI client (auraed.client.AuraeClient on a plain gRPC channel, as a kubelet speaks it) sends
the same runtime.v1 requests to two runtimes running side by side in the same run:

* ``auraed`` - a real auraed (bench/common.py's Daemon) serving the CRI on its own socket, pods of
  its ``cell`` handler (pinned namespaces and a pod cgroup on the host, containers with runc);
* ``containerd`` (the peer) - Debian's containerd 1.6 started by this script as a child process
  with a config of its own (temp root, state and socket; netns pins under its state dir), its CRI
  plugin with ``restrict_oom_score_adj = true`` (this machine's bounding set lacks
  CAP_SYS_RESOURCE), runc through ``io.containerd.runc.v2`` with the cgroupfs driver
  (``SystemdCgroup = false``), registered under the handler name ``cell`` so that the very same
  RunPodSandboxRequest (runtime_handler "cell") selects it. containerd needs a pause image: a
  static C ``pause`` compiled here with gcc (sleeps until SIGINT/SIGTERM, reaps children),
  published as ``registry.k8s.io/pause:3.6``, its default sandbox image. If containerd is not
  installed the script installs Debian's package with apt-get first.

Both pull busybox (``registry.k8s.io/e2e-test-images/busybox:1.29-2``, built from Debian's
busybox-static, tests.support.images) through ImageService.PullImage from one local
docker-registry (tests.support.registry.LocalRegistry) configured as their mirror of
registry.k8s.io, before anything is measured. Both use one CNI config: Debian's bridge +
host-local + portmap + loopback on a private /24 checked against every host address and route
(tests.support.cni), and the same plugin binaries (/usr/lib/cni).

Each iteration, in an order that alternates, after ``--gap-ms`` of idle time, each runtime runs
one pod's whole lifecycle, every RPC timed by the client:

    RunPodSandbox (handler cell; cgroup_parent /aurae-bench-cri-<pid>/pod<uid>, as a kubelet with
    the cgroupfs driver sends it; pod and container namespaces as a kubelet's defaults) ->
    CreateContainer (busybox ``sh -c 'sleep 3600'``, a log path under the pod's log directory,
    cpu_shares 2 and oom_score_adj 1000 as a kubelet sends for a BestEffort pod) ->
    StartContainer -> ExecSync ``echo hello`` (stdout must be exactly "hello\\n", exit 0) ->
    StopContainer (timeout 0: SIGKILL at once) -> RemoveContainer -> StopPodSandbox ->
    RemovePodSandbox

The pod's log directory and cgroup parent are made and removed by the script, as a kubelet does,
outside the timed calls. Warm-up pods (``--warmup``) also check PodSandboxStatus: the pod is
READY with an IP of the CNI subnet.

Then ``--pods`` (50) pods at once on each runtime: Run + Create + Start + ExecSync of all of them
concurrently, a check that every pod is listed READY with its own IP of the subnet and every
container RUNNING, then Stop + Remove of all of them concurrently; wall times of both halves.

After the iterations and after the concurrent pods, nothing may be left of them, checked on the
host, not only through the CRI: no pod or container listed, no host-local lease, no NAT rule of
the network, no device on its bridge, no CNI result cached under /var/lib/cni, no mount under the
runtime's directories beyond those there before the first pod, no cgroup below the pods' cgroup
parents (nor below auraed's cgroup base beyond what it had), no containerd shim or auraed
container monitor left. On exit everything is removed: pods through the CRI, then both runtimes
stopped, containerd's shims, mounts (rootfs, shm, netns pins), cgroups and directories, the
registry, the CNI bridge, rules and leases.

``--runtimes containerd`` measures one side alone (no ratios; the target is then not judged).
A runtime that answers UNIMPLEMENTED to a call of the lifecycle stops the run at its first
warm-up pod, with exit status 3 and a message saying so (everything is cleaned up first).

Target (issue): auraed's lifecycle at most 0.8x containerd's (median of the total); the
concurrent pods all succeed on both, and nothing leaks.

Pods of the ``vm`` handler (a guest VM each) are measured by bench/cri_vm.py, with these pieces.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from cell_lifecycle import Phases
from common import (
    CGROUP_ROOT,
    STOP_TIMEOUT,
    Daemon,
    exit_on_sigterm,
    machine_info,
    make_pki,
    print_json,
    print_lines,
    print_table,
    ratio,
    remove_cgroup_base,
    stop_process,
    summarize,
    temp_dir,
    verdict,
)
from container_start import source_state, tests_support

from auraed.api.runtime import v1 as cri
from auraed.client import AuraeClient, ClientError
from auraed.cni.model import DEFAULT_BIN_DIRS
from auraed.cri.images import SERVICE_NAME as IMAGE_SERVICE
from auraed.cri.runtime import SERVICE_NAME as RUNTIME_SERVICE
from auraed.system import namespaces
from auraed.system.monitor_launcher import MONITOR_NAME
from auraed.system.mounts import read_mounts
from auraed.system.pod_namespaces import POD_INIT_NAME

if TYPE_CHECKING:
    from auraed.pki import PkiPaths
    from tests.support.cni import CniNetwork
    from tests.support.registry import LocalRegistry

RUNTIMES = ("auraed", "containerd")
HANDLER = "cell"
NAMESPACE = "bench"
PAUSE_IMAGE = "registry.k8s.io/pause:3.6"  # containerd 1.6's default sandbox_image
MIRRORED = ("registry.k8s.io",)
COMMAND = ["sh", "-c", "sleep 3600"]
EXEC = ["echo", "hello"]
EXEC_OUTPUT = b"hello\n"
EXEC_TIMEOUT_S = 10
STOP_TIMEOUT_S = 0
# A kubelet's BestEffort container: the least CPU weight, the first to be OOM-killed.
CPU_SHARES = 2
OOM_SCORE_ADJ = 1000
CALL_TIMEOUT = 120.0
READY_TIMEOUT = 30.0
LEAK_SETTLE_S = 5.0  # how long what a removed pod held may take to go, after the last reply
TARGET_RATIO = 0.8
NOT_SERVED_STATUS = 3  # the exit status when a runtime does not serve the lifecycle's RPCs
UP = ("run_pod", "create", "start", "exec_sync")
DOWN = ("stop", "remove", "stop_pod", "remove_pod")
PHASES = (*UP, *DOWN)
# A kubelet's defaults: the pod's network and IPC namespaces, a PID namespace per container.
NAMESPACE_OPTIONS = cri.NamespaceOption(
    network=cri.NamespaceMode.POD, pid=cri.NamespaceMode.CONTAINER, ipc=cri.NamespaceMode.POD
)
CNI_CACHE = Path("/var/lib/cni")  # libcni's result cache (containerd's; auraed keeps its own)
CONTAINERD_RUN = Path("/run/containerd")  # where containerd 1.6 shims put their sockets (s/)
CONTAINERD_LOOPBACK = "cni-loopback"  # the network containerd's CRI adds for every pod's lo
PAUSE_C = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
static void leave(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, leave);
    signal(SIGTERM, leave);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""


async def call(client: AuraeClient, method: str, request: Any) -> Any:
    """One RuntimeService RPC."""
    return await client.call(RUNTIME_SERVICE, method, request, CALL_TIMEOUT)


# ------------------------------------------------------------------------------ the pods


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every pod of the run shares: the container image, the CNI network, where the pods'
    log directories go and the base of their cgroup parents."""

    image: str
    network: CniNetwork
    logs: Path
    pods_base: str

    def pod(self, name: str) -> Pod:
        uid = str(uuid.uuid4())
        return Pod(
            name, uid, self.image, self.logs / f"{NAMESPACE}_{name}_{uid}", f"/{self.pods_base}/pod{uid}"
        )


@dataclasses.dataclass
class Pod:
    """One pod's requests (the same for every runtime) and the ids a runtime gave it."""

    name: str
    uid: str
    image: str
    log_directory: Path
    cgroup_parent: str
    pod_id: str = ""
    container_id: str = ""

    def config(self) -> cri.PodSandboxConfig:
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=self.name, uid=self.uid, namespace=NAMESPACE),
            hostname=self.name,
            log_directory=str(self.log_directory),
            labels={"io.kubernetes.pod.name": self.name, "io.kubernetes.pod.namespace": NAMESPACE},
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=self.cgroup_parent,
                security_context=cri.LinuxSandboxSecurityContext(namespace_options=NAMESPACE_OPTIONS),
            ),
        )

    def container(self) -> cri.ContainerConfig:
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name="main"),
            image=cri.ImageSpec(image=self.image),
            command=COMMAND,
            log_path="main/0.log",
            linux=cri.LinuxContainerConfig(
                resources=cri.LinuxContainerResources(cpu_shares=CPU_SHARES, oom_score_adj=OOM_SCORE_ADJ),
                security_context=cri.LinuxContainerSecurityContext(namespace_options=NAMESPACE_OPTIONS),
            ),
        )

    def prepare(self) -> None:
        """What a kubelet makes before RunPodSandbox: the pod's log directory."""
        self.log_directory.mkdir(parents=True)

    def clean(self) -> None:
        """What a kubelet removes after RemovePodSandbox: the log directory (and the pod's cgroup
        parent: ``remove_pod_cgroups``, at the leak checks)."""
        shutil.rmtree(self.log_directory, ignore_errors=True)


async def pod_up(client: AuraeClient, pod: Pod, phases: Phases) -> None:
    """RunPodSandbox, CreateContainer, StartContainer, ExecSync: each a phase of ``phases``."""
    config = pod.config()
    run = await call(
        client, "RunPodSandbox", cri.RunPodSandboxRequest(config=config, runtime_handler=HANDLER)
    )
    pod.pod_id = run.pod_sandbox_id
    phases.mark("run_pod")
    request = cri.CreateContainerRequest(
        pod_sandbox_id=pod.pod_id, config=pod.container(), sandbox_config=config
    )
    pod.container_id = (await call(client, "CreateContainer", request)).container_id
    phases.mark("create")
    await call(client, "StartContainer", cri.StartContainerRequest(container_id=pod.container_id))
    phases.mark("start")
    execute = cri.ExecSyncRequest(container_id=pod.container_id, cmd=EXEC, timeout=EXEC_TIMEOUT_S)
    executed = await call(client, "ExecSync", execute)
    phases.mark("exec_sync")
    if executed.exit_code != 0 or executed.stdout != EXEC_OUTPUT:
        raise RuntimeError(
            f"{pod.name}: ExecSync {EXEC} gave exit {executed.exit_code}, "
            f"stdout {executed.stdout[:200]!r}, stderr {executed.stderr[:200]!r}"
        )


def teardown(container_id: str, pod_id: str) -> list[tuple[str, str, Any]]:
    """(phase, method, request) of StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox;
    either id may be empty (that half is left out)."""
    calls: list[tuple[str, str, Any]] = []
    if container_id:
        calls += [
            (
                "stop",
                "StopContainer",
                cri.StopContainerRequest(container_id=container_id, timeout=STOP_TIMEOUT_S),
            ),
            ("remove", "RemoveContainer", cri.RemoveContainerRequest(container_id=container_id)),
        ]
    if pod_id:
        calls += [
            ("stop_pod", "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=pod_id)),
            ("remove_pod", "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id)),
        ]
    return calls


async def pod_down(client: AuraeClient, pod: Pod, phases: Phases) -> None:
    """StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox: each a phase."""
    for phase, method, request in teardown(pod.container_id, pod.pod_id):
        await call(client, method, request)
        phases.mark(phase)


async def lifecycle(client: AuraeClient, pod: Pod) -> dict[str, float]:
    """One pod from RunPodSandbox to RemovePodSandbox: seconds per RPC and the total."""
    await asyncio.to_thread(pod.prepare)
    phases = Phases()
    await pod_up(client, pod, phases)
    await pod_down(client, pod, phases)
    durations = phases.finish()
    await asyncio.to_thread(pod.clean)
    return durations


async def check_pod_network(client: AuraeClient, pod: Pod, network: CniNetwork) -> str:
    """PodSandboxStatus: READY, with an IP of the CNI network's subnet; the IP."""
    status = (
        await call(client, "PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=pod.pod_id))
    ).status
    ip = status.network.ip if status.network is not None else ""
    ready = status.state == cri.PodSandboxState.SANDBOX_READY
    if not ready or not ip or ipaddress.ip_address(ip) not in network.subnet:
        raise RuntimeError(f"{pod.name}: state {status.state!r}, ip {ip!r}, not READY in {network.subnet}")
    return str(ip)


async def remove_everything(client: AuraeClient) -> None:
    """Every container, then every pod the runtime lists, stopped and removed (after a failure;
    a runtime may list pods and not containers)."""
    with contextlib.suppress(ClientError):
        containers = (await call(client, "ListContainers", cri.ListContainersRequest())).containers
        await calls_ignoring_errors(client, [c for ctr in containers for c in teardown(ctr.id, "")])
    with contextlib.suppress(ClientError):
        pods = (await call(client, "ListPodSandbox", cri.ListPodSandboxRequest())).items
        await calls_ignoring_errors(client, [c for pod in pods for c in teardown("", pod.id)])


async def calls_ignoring_errors(client: AuraeClient, calls: list[tuple[str, str, Any]]) -> None:
    for _, method, request in calls:
        with contextlib.suppress(ClientError):
            await call(client, method, request)


# ------------------------------------------------------------------------------ the runtimes


class Runtime(abc.ABC):
    """One CRI runtime under measurement: its socket, its directory, what of it may leak."""

    name = ""
    images: tuple[str, ...] = ()  # pulled before anything is measured

    def __init__(self, root: Path, socket: Path) -> None:
        self.root = root
        self.socket = socket
        self._client: AuraeClient | None = None
        self.version: dict[str, str] = {}

    @property
    def client(self) -> AuraeClient:
        assert self._client is not None, "connect() first"
        return self._client

    @abc.abstractmethod
    def start(self) -> None: ...

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def connect(self, *pull: str) -> None:
        """A CRI client on the socket, once the runtime reports RuntimeReady and NetworkReady
        (containerd loads the CNI config a moment after it serves); then its own images and
        ``pull`` pulled."""
        self._client = AuraeClient(grpc.aio.insecure_channel(f"unix:{self.socket}"))
        deadline = time.monotonic() + READY_TIMEOUT
        while not await self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} was not ready in {READY_TIMEOUT:.0f} s:\n{self.log()[-3000:]}"
                )
            await asyncio.sleep(0.1)
        reply = await call(self.client, "Version", cri.VersionRequest())
        self.version = {"runtime_name": reply.runtime_name, "runtime_version": reply.runtime_version}
        for image in (*self.images, *pull):
            request = cri.PullImageRequest(image=cri.ImageSpec(image=image))
            await self.client.call(IMAGE_SERVICE, "PullImage", request, CALL_TIMEOUT)

    async def _ready(self) -> bool:
        try:
            reply = await self.client.call(RUNTIME_SERVICE, "Status", cri.StatusRequest(), 5)
        except ClientError:
            return False
        ready = {c.type for c in reply.status.conditions if c.status}
        return {"RuntimeReady", "NetworkReady"} <= ready

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def own_cgroup_bases(self) -> tuple[str, ...]:
        """cgroup bases of the runtime's own (beside the pods' cgroup parents)."""
        return ()

    @abc.abstractmethod
    def leftover_processes(self) -> list[Process]:
        """Processes a removed pod must not leave behind (shims, monitors)."""

    def leftovers_on_host(self) -> dict[str, list[str]]:
        """What else of a removed pod the runtime may leave on the host, by kind (none here)."""
        return {}

    @abc.abstractmethod
    def log(self) -> str: ...

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Stop the runtime and remove everything it made, whatever state it is in."""


class Auraed(Runtime):
    """A real auraed (bench/common.py's Daemon) with the CNI config and the registry mirror (none
    without a registry), ``extra_args`` on its command line, a dev PKI of its own unless given."""

    name = "auraed"

    def __init__(
        self,
        root: Path,
        network: CniNetwork,
        registry: LocalRegistry | None,
        *extra_args: str,
        pki: PkiPaths | None = None,
    ) -> None:
        tests_support()
        from tests.support.cri import mirrors_config

        self.daemon = Daemon(
            root,
            pki or make_pki(root),
            "--cni-conf-dir",
            str(network.conf_dir),
            *extra_args,
            config_text=mirrors_config(registry, MIRRORED) if registry is not None else "",
        )
        super().__init__(root, self.daemon.cri_socket)

    def start(self) -> None:
        self.daemon.start()

    def own_cgroup_bases(self) -> tuple[str, ...]:
        return (self.daemon.cgroup_base,)

    def leftover_processes(self) -> list[Process]:
        """Container monitors and pod inits of this daemon: below it, or naming its runtime dir
        (every monitor's command line does)."""
        table, runtime_dir = processes(), str(self.root / "run")
        below = descendants(self.daemon.process.pid, table) if self.daemon.process is not None else set()
        return [
            p
            for p in table
            if p.comm in (MONITOR_NAME, POD_INIT_NAME) and (p.pid in below or runtime_dir in p.cmdline)
        ]

    def log(self) -> str:
        return self.daemon.log()

    def cleanup(self) -> None:
        try:
            self.daemon.cleanup()
        finally:
            unmount_under(self.root)


class Containerd(Runtime):
    """Debian's containerd 1.6, a child process with a config, root, state and socket of its own."""

    name = "containerd"
    images = (PAUSE_IMAGE,)

    def __init__(self, root: Path, network: CniNetwork, registry: LocalRegistry, binary: str) -> None:
        super().__init__(root, root / "containerd.sock")
        root.mkdir(parents=True)
        self.binary = binary
        self.network = network
        self.registry = registry
        self.config_path = root / "config.toml"
        self.log_path = root / "containerd.log"
        self.runc_root = root / "runc"
        self.process: subprocess.Popen[bytes] | None = None
        self.cni_cache_made = not CNI_CACHE.exists()
        self.run_dir_made = not CONTAINERD_RUN.exists()

    def config(self) -> str:
        """containerd's config (version 2): everything under ``root`` but the netns pins (under
        its state dir too) and what libcni caches; the CRI plugin as the module docstring says."""
        q = json.dumps  # a JSON string of plain ASCII is a TOML basic string
        cri_plugin = 'plugins."io.containerd.grpc.v1.cri"'
        bin_dir = next(d for d in DEFAULT_BIN_DIRS if (d / "bridge").is_file())
        runc = shutil.which("runc") or "runc"
        return f"""version = 2
root = {q(str(self.root / "root"))}
state = {q(str(self.root / "state"))}
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = {q(str(self.socket))}

[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(self.root / "opt"))}

[{cri_plugin}]
  sandbox_image = {q(PAUSE_IMAGE)}
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [{cri_plugin}.containerd]
    default_runtime_name = {q(HANDLER)}
    snapshotter = "overlayfs"

    [{cri_plugin}.containerd.runtimes.{HANDLER}]
      runtime_type = "io.containerd.runc.v2"

      [{cri_plugin}.containerd.runtimes.{HANDLER}.options]
        BinaryName = {q(runc)}
        Root = {q(str(self.runc_root))}
        SystemdCgroup = false

  [{cri_plugin}.cni]
    bin_dir = {q(str(bin_dir))}
    conf_dir = {q(str(self.network.conf_dir))}
    max_conf_num = 1

  [{cri_plugin}.registry.mirrors."{MIRRORED[0]}"]
    endpoint = [{q(self.registry.url)}]
"""

    def start(self) -> None:
        self.config_path.write_text(self.config())
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while not self.socket.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"containerd made no socket in {READY_TIMEOUT:.0f} s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)

    def leftover_processes(self) -> list[Process]:
        """Shims: each is started with ``-address <our socket>``."""
        return naming(str(self.socket))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cleanup(self) -> None:
        """containerd stopped; its shims (which outlive it), runc state, mounts, and libcni's
        cache of our network removed, and what it created outside ``root``."""
        stop_process(self.process)
        for shim in naming(str(self.socket)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(shim.pid, signal.SIGKILL)
        wait_until(lambda: not naming(str(self.socket)), STOP_TIMEOUT)
        for state in self.runc_root.glob("*/*"):
            subprocess.run(
                ["runc", "--root", str(state.parent), "delete", "--force", state.name],
                capture_output=True,
                check=False,
            )
        unmount_under(self.root)
        for cached in cni_cache_of(self.network):
            cached.unlink(missing_ok=True)
        if self.cni_cache_made:  # libcni made it for this containerd: its empty directories go
            remove_empty_dirs(CNI_CACHE)
        if self.run_dir_made:  # only containerd and its shims write there
            shutil.rmtree(CONTAINERD_RUN, ignore_errors=True)


def ensure_containerd() -> str:
    """containerd's path; Debian's package installed first (apt-get) if it is missing."""
    found = shutil.which("containerd")
    if found is not None:
        return found
    print(
        "cri: containerd is not installed; installing Debian's containerd package (apt-get)", file=sys.stderr
    )
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "containerd"],
    ):
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    found = shutil.which("containerd")
    if found is None:
        raise RuntimeError("apt-get installed containerd, but no containerd is on PATH")
    return found


# ------------------------------------------------------------------------------ the host, for leaks


@dataclasses.dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    comm: str
    cmdline: str

    def __str__(self) -> str:
        return f"{self.pid} {self.comm}: {self.cmdline[:200]}"


def processes() -> list[Process]:
    """Every process but this one, from /proc (those that exit meanwhile are skipped)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        comm, _, rest = stat.partition(" (")[2].rpartition(") ")
        found.append(Process(int(proc.name), int(rest.split()[1]), comm, cmdline))
    return found


def descendants(ancestor: int, table: Sequence[Process]) -> set[int]:
    children: dict[int, list[int]] = {}
    for process in table:
        children.setdefault(process.ppid, []).append(process.pid)
    found: set[int] = set()
    todo = [ancestor]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def naming(text: str) -> list[Process]:
    """Processes whose command line holds ``text``."""
    return [p for p in processes() if text in p.cmdline]


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``."""
    return [m.mount_point for m in read_mounts() if Path(m.mount_point).is_relative_to(root)]


def unmount_under(root: Path) -> None:
    """Detach every mount below ``root``, deepest first (rootfs, shm, netns pins)."""
    for point in sorted(set(mounts_under(root)), key=lambda p: len(Path(p).parts), reverse=True):
        with contextlib.suppress(OSError):
            namespaces.umount(point, namespaces.MNT_DETACH)


def remove_empty_dirs(top: Path) -> None:
    """rmdir every directory under ``top`` (and ``top``) that is empty, bottom up."""
    if not top.is_dir():
        return
    for directory, _, _ in sorted(os.walk(top), key=lambda entry: len(entry[0]), reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def cni_cache_of(network: CniNetwork) -> list[Path]:
    """libcni's cached results (``results/<network>-<container id>-<ifname>``) for the network
    and for the loopback network containerd adds to every pod (``cni-loopback``)."""
    results = CNI_CACHE / "results"
    names = (f"{network.name}-*", f"{CONTAINERD_LOOPBACK}-*")
    return sorted(p for name in names for p in results.glob(name)) if results.is_dir() else []


def cgroups_under(bases: Sequence[str]) -> set[str]:
    """Every cgroup directory below each base, in every hierarchy ("<hierarchy>/<base>/...")."""
    found: set[str] = set()
    for hierarchy in CGROUP_ROOT.iterdir():
        for base in bases:
            top = hierarchy / base
            if top.is_dir():
                found |= {str(p.relative_to(CGROUP_ROOT)) for p in top.rglob("*") if p.is_dir()}
    return found


def remove_pod_cgroups(pods_base: str) -> None:
    """rmdir each pod's cgroup parent (a kubelet removes it once the pod is gone); one still
    holding a cgroup or a process stays."""
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / pods_base
        for pod in top.iterdir() if top.is_dir() else ():
            with contextlib.suppress(OSError):
                pod.rmdir()


def bridge_ports(network: CniNetwork) -> list[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", "master", network.bridge], capture_output=True, text=True, check=False
    )
    return [line.split(": ")[1].split("@")[0] for line in out.stdout.splitlines() if ": " in line]


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What of a runtime's is on the host before its first pod: what is there after is a leak."""

    mounts: frozenset[str]
    cgroups: frozenset[str]


def baseline(runtime: Runtime, pods_base: str) -> Baseline:
    bases = (pods_base, *runtime.own_cgroup_bases())
    return Baseline(frozenset(mounts_under(runtime.root)), frozenset(cgroups_under(bases)))


async def leaks(runtime: Runtime, setup: Setup, before: Baseline) -> dict[str, Any]:
    """What is left of the runtime's pods (see the module docstring), by kind. A shim or monitor
    may take a moment to exit after the last reply: the host is looked at until it is clean or
    LEAK_SETTLE_S have passed, and the time it took is reported."""
    network, bases = setup.network, (setup.pods_base, *runtime.own_cgroup_bases())
    pods = (await call(runtime.client, "ListPodSandbox", cri.ListPodSandboxRequest())).items
    containers = (await call(runtime.client, "ListContainers", cri.ListContainersRequest())).containers
    listed = {"pods_listed": [p.id for p in pods], "containers_listed": [c.id for c in containers]}

    def on_host() -> dict[str, list[str]]:
        remove_pod_cgroups(setup.pods_base)  # the kubelet's part, retried: what stays is not empty
        return {
            "cni_leases": sorted(network.allocations()),
            "nat_rules": network.rules(),
            "bridge_ports": bridge_ports(network),
            "cni_cache": [str(p) for p in cni_cache_of(network)],
            "mounts": sorted(set(mounts_under(runtime.root)) - before.mounts),
            "cgroups": sorted(cgroups_under(bases) - before.cgroups),
            "processes": [str(p) for p in runtime.leftover_processes()],
            **runtime.leftovers_on_host(),
        }

    start = time.monotonic()
    found = await asyncio.to_thread(on_host)
    while any(found.values()) and time.monotonic() - start < LEAK_SETTLE_S:
        await asyncio.sleep(0.05)
        found = await asyncio.to_thread(on_host)
    left = {kind: items for kind, items in {**listed, **found}.items() if items}
    return {"clean": not left, "settled_ms": round((time.monotonic() - start) * 1000, 1), "left": left}


# ------------------------------------------------------------------------------ the run


class NotServed(Exception):
    """A runtime answers UNIMPLEMENTED to a call of the lifecycle."""


async def warm_up(runtime: Runtime, setup: Setup, name: str) -> None:
    """One lifecycle, untimed, with the pod's status and network checked while it runs."""
    pod = setup.pod(name)
    await asyncio.to_thread(pod.prepare)
    try:
        await pod_up(runtime.client, pod, Phases())
        await check_pod_network(runtime.client, pod, setup.network)
        await pod_down(runtime.client, pod, Phases())
    except ClientError as error:
        if error.code != "UNIMPLEMENTED":
            raise
        raise NotServed(
            f"{runtime.name} does not serve the pod lifecycle yet ({error.message}); "
            "measure the peer alone with --runtimes containerd"
        ) from None
    finally:
        await asyncio.to_thread(pod.clean)


async def concurrent_pods(runtime: Runtime, setup: Setup, count: int) -> dict[str, Any]:
    """``count`` pods up at once, all checked listed and running with their own IPs, then all
    down at once. Failures are counted, not raised: what failed is removed afterwards."""
    client = runtime.client
    pods = [setup.pod(f"{runtime.name}-c{n}") for n in range(count)]
    for pod in pods:
        pod.prepare()
    up = {pod.name: Phases() for pod in pods}
    start = time.perf_counter()
    raised = await asyncio.gather(*(pod_up(client, p, up[p.name]) for p in pods), return_exceptions=True)
    up_wall = time.perf_counter() - start
    failures = [f"{p.name} up: {r!r}" for p, r in zip(pods, raised, strict=True) if r is not None]
    running = [p for p, r in zip(pods, raised, strict=True) if r is None]
    listed = (await call(client, "ListPodSandbox", cri.ListPodSandboxRequest())).items
    containers = (await call(client, "ListContainers", cri.ListContainersRequest())).containers
    ips = await asyncio.gather(
        *(check_pod_network(client, p, setup.network) for p in running), return_exceptions=True
    )
    failures += [
        f"{p.name} status: {ip!r}" for p, ip in zip(running, ips, strict=True) if not isinstance(ip, str)
    ]
    down = {pod.name: Phases() for pod in running}
    start = time.perf_counter()
    raised = await asyncio.gather(
        *(pod_down(client, p, down[p.name]) for p in running), return_exceptions=True
    )
    down_wall = time.perf_counter() - start
    failures += [f"{p.name} down: {r!r}" for p, r in zip(running, raised, strict=True) if r is not None]
    if failures:
        await remove_everything(client)
    for pod in pods:
        pod.clean()
    done = [p for p, r in zip(running, raised, strict=True) if r is None]
    counts = {
        "succeeded": len(done),
        "ready_listed": sum(1 for p in listed if p.state == cri.PodSandboxState.SANDBOX_READY),
        "running_listed": sum(1 for c in containers if c.state == cri.ContainerState.CONTAINER_RUNNING),
        "distinct_ips": len({ip for ip in ips if isinstance(ip, str)}),
    }
    return {
        "pods": count,
        **counts,
        "all_succeeded": all(n == count for n in counts.values()),
        "failures": failures[:20],
        "up_wall_ms": round(up_wall * 1000, 1),
        "down_wall_ms": round(down_wall * 1000, 1),
        "wall_ms": round((up_wall + down_wall) * 1000, 1),
        "per_pod": {
            phase: summarize([(up if phase in UP else down)[p.name].durations[phase] for p in done])
            for phase in PHASES
        }
        if done
        else {},
    }


async def run(args: argparse.Namespace, runtimes: list[Runtime], setup: Setup) -> dict[str, dict[str, Any]]:
    """Warm-up, the interleaved lifecycles, the concurrent pods and the leak checks."""
    results: dict[str, dict[str, Any]] = {r.name: {"iterations": []} for r in runtimes}
    try:
        for runtime in runtimes:
            await runtime.connect(setup.image)
            results[runtime.name]["version"] = runtime.version
        before = {r.name: baseline(r, setup.pods_base) for r in runtimes}
        for i in range(args.warmup):
            for runtime in runtimes:
                await warm_up(runtime, setup, f"{runtime.name}-w{i}")
        for i in range(args.iterations):
            for runtime in runtimes[i % len(runtimes) :] + runtimes[: i % len(runtimes)]:
                await asyncio.sleep(args.gap_ms / 1000)
                pod = setup.pod(f"{runtime.name}-{i}")
                results[runtime.name]["iterations"].append(await lifecycle(runtime.client, pod))
        for runtime in runtimes:
            results[runtime.name]["leaks_after_iterations"] = await leaks(
                runtime, setup, before[runtime.name]
            )
        for runtime in runtimes if args.pods else ():
            await asyncio.sleep(args.gap_ms / 1000)
            results[runtime.name]["concurrent"] = await concurrent_pods(runtime, setup, args.pods)
            results[runtime.name]["leaks_after_concurrent"] = await leaks(
                runtime, setup, before[runtime.name]
            )
    finally:
        for runtime in runtimes:
            if runtime.connected:
                await remove_everything(runtime.client)
            await runtime.close()
    return results


# ------------------------------------------------------------------------------ images


def publish_images(workdir: Path, registry: LocalRegistry, pause: bool) -> None:
    """busybox, and for containerd the pause image, pushed as the mirror of their upstream names."""
    tests_support()
    from tests.support.cri import BUSYBOX_IMAGE, publish
    from tests.support.images import File, ImageConfig, build_busybox_layout, build_layout

    publish(build_busybox_layout(workdir / "busybox"), registry, BUSYBOX_IMAGE)
    if pause:
        binary = compile_pause(workdir / "pause-build")
        layer = {"pause": File(binary.read_bytes(), 0o755)}
        config = ImageConfig(entrypoint=["/pause"], cmd=None)
        publish(build_layout(workdir / "pause", [layer], config, ref_name="pause"), registry, PAUSE_IMAGE)


def compile_pause(workdir: Path) -> Path:
    """A static ``pause`` (the sandbox's only process under containerd), from PAUSE_C, with gcc."""
    workdir.mkdir(parents=True, exist_ok=True)
    source, binary = workdir / "pause.c", workdir / "pause"
    source.write_text(PAUSE_C)
    command = ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return binary


# ------------------------------------------------------------------------------ report


def report(
    args: argparse.Namespace,
    machine: dict[str, Any],
    results: dict[str, dict[str, Any]],
    network: CniNetwork,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "cri",
        "machine": machine,
        "source": source_state(),
        "iterations": args.iterations,
        "warmup": args.warmup,
        "gap_ms": args.gap_ms,
        "pods": args.pods,
        "handler": HANDLER,
        "container_command": COMMAND,
        "exec": EXEC,
        "stop_timeout_s": STOP_TIMEOUT_S,
        "cni": {"subnet": str(network.subnet), "plugins": plugin_chain(network)},
    }
    for name, data in results.items():
        result[name] = {
            "version": data["version"],
            "lifecycle": {
                phase: summarize([it[phase] for it in data["iterations"]]) for phase in (*PHASES, "total")
            },
            **{
                key: data[key]
                for key in ("leaks_after_iterations", "concurrent", "leaks_after_concurrent")
                if key in data
            },
        }
    both = all(name in results for name in RUNTIMES)
    clean = all(
        result[n][k]["clean"]
        for n in results
        for k in ("leaks_after_iterations", "leaks_after_concurrent")
        if k in result[n]
    )
    concurrent_ok = all(
        result[n]["concurrent"]["all_succeeded"] for n in results if "concurrent" in result[n]
    )
    target: dict[str, Any] = {
        "ratio_p50_total_at_most": TARGET_RATIO,
        "concurrent_all_succeed": concurrent_ok,
        "nothing_leaked": clean,
    }
    if both:
        auraed, containerd = result["auraed"]["lifecycle"], result["containerd"]["lifecycle"]
        ratios = {
            phase: ratio(auraed[phase]["p50_ms"], containerd[phase]["p50_ms"]) for phase in (*PHASES, "total")
        }
        result["ratio_p50_auraed_over_containerd"] = ratios
        result["ratio_mean_total_auraed_over_containerd"] = ratio(
            auraed["total"]["mean_ms"], containerd["total"]["mean_ms"]
        )
        target["result"] = verdict(ratios["total"] <= TARGET_RATIO and concurrent_ok and clean)
    else:
        target["result"] = "NOT JUDGED (one runtime measured)"
    result["target"] = target
    if not args.json_only:
        print_report(args, result, list(results))
    return result


def plugin_chain(network: CniNetwork) -> list[str]:
    """The conflist's plugins, each with its IPAM plugin ("bridge+host-local")."""
    plugins = network.conflist()["plugins"]
    return [p["type"] + (f"+{p['ipam']['type']}" if "ipam" in p else "") for p in plugins]


def print_report(args: argparse.Namespace, result: dict[str, Any], names: list[str]) -> None:
    ratios = result.get("ratio_p50_auraed_over_containerd", {})
    headers = ["phase", *(f"{n} {stat}" for n in names for stat in ("p50", "min", "max"))]
    rows = [
        [
            phase,
            *(result[n]["lifecycle"][phase][f"{stat}_ms"] for n in names for stat in ("p50", "min", "max")),
        ]
        + ([ratios[phase]] if ratios else [])
        for phase in (*PHASES, "total")
    ]
    print_table(
        f"CRI pod lifecycle (ms per RPC), {args.iterations} iterations per runtime, "
        f"{args.gap_ms} ms idle first",
        headers + (["ratio p50"] if ratios else []),
        rows,
    )
    if args.pods:
        print_table(
            f"{args.pods} pods at once (wall ms)",
            ["runtime", "succeeded", "up", "down", "total", "RunPodSandbox p50", "ExecSync p50"],
            [
                [
                    n,
                    f"{c['succeeded']}/{c['pods']}",
                    c["up_wall_ms"],
                    c["down_wall_ms"],
                    c["wall_ms"],
                    c["per_pod"].get("run_pod", {}).get("p50_ms", "-"),
                    c["per_pod"].get("exec_sync", {}).get("p50_ms", "-"),
                ]
                for n in names
                for c in [result[n]["concurrent"]]
            ],
        )
    lines = []
    for n in names:
        for key in ("leaks_after_iterations", "leaks_after_concurrent"):
            if key in result[n]:
                found = result[n][key]
                what = "nothing left" if found["clean"] else f"LEFT {found['left']}"
                lines.append(
                    f"{n} {key.removeprefix('leaks_').replace('_', ' ')}: {what} ({found['settled_ms']} ms)"
                )
    target = result["target"]
    if ratios:
        lines.append(f"ratio auraed/containerd, lifecycle p50: {ratios['total']}x")
    concurrent, clean = verdict(target["concurrent_all_succeed"]), verdict(target["nothing_leaked"])
    lines.append(
        f"target auraed <= {TARGET_RATIO}x containerd, concurrent pods all succeed ({concurrent}), "
        f"nothing leaked ({clean}): {target['result']}"
    )
    print_lines(lines)


# ------------------------------------------------------------------------------ main


def make_runtime(name: str, root: Path, network: CniNetwork, registry: LocalRegistry) -> Runtime:
    if name == "auraed":
        return Auraed(root / "auraed", network, registry)
    return Containerd(root / "containerd", network, registry, ensure_containerd())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--iterations", type=int, default=20, help="measured lifecycles per runtime (default 20)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="warm-up lifecycles per runtime (default 2)")
    parser.add_argument(
        "--gap-ms", type=int, default=100, help="idle time before each lifecycle (default 100)"
    )
    parser.add_argument(
        "--pods", type=int, default=50, help="pods at once per runtime, 0 for none (default 50)"
    )
    parser.add_argument(
        "--runtimes",
        default=",".join(RUNTIMES),
        help=f"comma-separated, of {', '.join(RUNTIMES)} (default: both)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    args.names = [n for n in RUNTIMES if n in args.runtimes.split(",")]
    if not args.names or set(args.runtimes.split(",")) - set(RUNTIMES):
        parser.error(f"--runtimes takes {', '.join(RUNTIMES)} (comma-separated)")
    if args.iterations < 1 or args.warmup < 0 or args.gap_ms < 0 or args.pods < 0:
        parser.error("--iterations must be positive; --warmup, --gap-ms and --pods not negative")
    if os.geteuid() != 0:
        parser.exit(2, "cri: needs root (pods: namespaces, cgroups, mounts, CNI)\n")
    tests_support()
    from tests.support.cni import missing_plugins

    if missing_plugins():
        parser.exit(
            2, f"cri: CNI plugins missing: {', '.join(missing_plugins())} (containernetworking-plugins)\n"
        )
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run, every runtime set up and, whatever happens, cleaned up; the result."""
    tests_support()
    from tests.support.cni import cni_network
    from tests.support.cri import BUSYBOX_IMAGE
    from tests.support.registry import LocalRegistry

    machine = machine_info()  # now: the load before this run's own pods
    pods_base = f"aurae-bench-cri-{os.getpid()}"
    with temp_dir("auraed-bench-cri-") as root, LocalRegistry() as registry, cni_network(root) as network:
        network.write(network.conflist())
        publish_images(root / "images", registry, pause="containerd" in args.names)
        runtimes: list[Runtime] = []
        try:
            for name in args.names:
                runtimes.append(make_runtime(name, root, network, registry))
                runtimes[-1].start()
            setup = Setup(BUSYBOX_IMAGE, network, root / "pods", pods_base)
            results = asyncio.run(run(args, runtimes, setup))
        except NotServed:
            raise
        except Exception:
            for runtime in runtimes:
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"--- {runtime.name} log (tail)\n{runtime.log()[-4000:]}\n")
            raise
        finally:
            for runtime in runtimes:
                with contextlib.suppress(Exception):
                    runtime.cleanup()
            remove_cgroup_base(pods_base)
        return report(args, machine, results, network)


def main() -> None:
    args = parse_args()
    exit_on_sigterm()
    try:
        result = measure(args)
    except NotServed as error:
        print(f"cri: {error}", file=sys.stderr)
        sys.exit(NOT_SERVED_STATUS)
    print_json(result)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
