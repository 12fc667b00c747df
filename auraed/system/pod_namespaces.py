"""A pod sandbox's namespaces, pinned by bind mounts as CRI-O's pinns pins them: network, IPC and
UTS (and PID for pods that share one), each a file in the pod's directory that runc and CNI
plugins join by path.

Network, IPC and UTS namespaces are made in a short-lived thread of the daemon (``unshare``
changes only the calling thread; see ``namespaces.create_network_namespace``): no fork, so
nothing of grpc's runs in a child (pyroute2's netns helpers fork, and their child crashes in a
grpc process). The thread sets the UTS hostname, writes the namespaced sysctls (``net.*`` land
in its network namespace, the IPC ones in its IPC namespace, as /proc/sys resolves them for the
writing thread), brings up ``lo`` and pins each namespace; then it ends, and no process is kept.

A PID namespace is the exception: the kernel names one (``pid_for_children``) only once it has a
PID 1, and refuses every new process in it (ENOMEM) once its PID 1 has ended, pin or no pin. So
a shared PID namespace gets a minimal init, ``aurae-pod-init``: spawned from the same thread
(posix_spawn, no fork of the daemon), it is PID 1 there, sits in the pod's other namespaces, reaps
the orphans of the pod's containers and exits on SIGTERM or SIGINT. The pod's containers reach it
through /proc/1, so it is confined as containerd's pause container is (auraed.system.confine):
its own mount namespace over an empty read-only root holding only its static program, no open
descriptors, no capabilities, no_new_privs, the pause image's unprivileged id. Its pid and start
time are written beside the pins, so removal finds it after a restart of auraed too.

Removal is idempotent and works from the directory alone: the init is killed (the kernel then
kills everything in the PID namespace), every pin unmounted and deleted, the directory removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from auraed.errors import RESOURCE_ERRNOS, AuraeError, ErrorKind
from auraed.system import confine, namespaces, processes, userns
from auraed.system.threads import in_new_thread
from auraed.system.userns import IdMap

NET, IPC, UTS, PID, USER = "net", "ipc", "uts", "pid", "user"
PIN_NAMES = (NET, IPC, UTS, PID, USER)
"""The pins' file names in a pod's directory (the kinds of /proc/<pid>/ns/ they hold)."""
INIT_RECORD = "pid-init"
"""File beside the pins: "<pid> <start ticks> <parent pid> <parent start ticks>" of the PID
namespace's init (its parent: only the auraed that started it may reap it)."""
POD_INIT_NAME = "aurae-pod-init"
"""What ps shows for a shared PID namespace's init (its argv[0], and its file's name in its root)."""
DEFAULT_POD_INIT = Path("/usr/bin/catatonit")
"""The init's program: catatonit (Debian's package, statically linked, as it must be in a root
holding nothing else), podman's pod infra process; ``-P``, its pause mode, reaps every orphan and
ends on SIGTERM or SIGINT."""
POD_INIT_ARGS = ("-P",)
USERNS_INIT_MOUNTPOINT = Path("/tmp")
"""Any directory every user may reach, on the host and in guests: where a user namespace's init
mounts its empty root in its own mount namespace (nothing of it shows there)."""
HELPER_TIMEOUT = 30.0
"""Seconds the user namespace helper may take to end once told to (it only forks and exits)."""
INIT_EXIT_TIMEOUT = 5.0
"""Seconds a killed init may take to be gone (SIGKILL: milliseconds)."""
_INIT_EXIT_POLL = 0.01
HOST_NAME_MAX = 64
SYSCTL_ROOT = Path("/proc/sys")

# IPC namespace sysctls (ipc/ipc_sysctl.c, ipc/mq_sysctl.c), the UTS one that is not the
# hostname, and the network namespace's whole tree: all a pod may set without touching the host.
_IPC_SYSCTLS = frozenset(
    {"kernel.msgmax", "kernel.msgmnb", "kernel.msgmni", "kernel.sem", "kernel.shmall", "kernel.shmmax"}
    | {"kernel.shmmni", "kernel.shm_rmid_forced"}
)
_IPC_PREFIXES = ("fs.mqueue.",)
_UTS_SYSCTLS = frozenset({"kernel.domainname"})
_NET_PREFIXES = ("net.",)
_SYSCTL_NAME = re.compile(r"^[A-Za-z0-9_-]+([./][A-Za-z0-9_-]+)*$")


class NamespaceError(AuraeError):
    """Pod namespaces that cannot be made as asked; ``kind`` says why."""


@dataclasses.dataclass(frozen=True)
class PodNamespaceSpec:
    """Which namespaces a pod gets of its own (the others it shares with the host), its hostname
    (empty: the host's name, copied) and its sysctls, by name as sysctl(8) spells them; with
    ``userns``, a user namespace of its own with these mappings, owning all the others."""

    network: bool = True
    ipc: bool = True
    uts: bool = True
    pid: bool = False
    hostname: str = ""
    sysctls: Mapping[str, str] = dataclasses.field(default_factory=dict)
    userns: IdMap | None = None


@dataclasses.dataclass(frozen=True)
class PodNamespaces:
    """A pod's pinned namespaces: the path of each pin (None where the pod shares the host's),
    and the PID namespace's init."""

    directory: str
    net: str | None = None
    ipc: str | None = None
    uts: str | None = None
    pid: str | None = None
    user: str | None = None
    init_pid: int | None = None
    init_ticks: int | None = None

    def to_doc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> PodNamespaces:
        return cls(
            directory=str(doc["directory"]),
            net=doc.get("net"),
            ipc=doc.get("ipc"),
            uts=doc.get("uts"),
            pid=doc.get("pid"),
            user=doc.get("user"),
            init_pid=doc.get("init_pid"),
            init_ticks=doc.get("init_ticks"),
        )


def sysctl_path(name: str) -> Path:
    """The /proc/sys file of ``name``: dots separate its parts unless a slash comes first, and
    then dots are literal (``net.ipv4.conf.eth0/100.rp_filter`` is interface eth0.100's), as
    sysctl(8) and Kubernetes read it."""
    if not _SYSCTL_NAME.match(name) or ".." in name or "//" in name:
        raise NamespaceError.invalid("sysctls", f"{name!r} is not a sysctl name")
    separator = name[min((i for i in (name.find("."), name.find("/")) if i >= 0), default=0)]
    if separator == "/":
        return SYSCTL_ROOT / name
    return SYSCTL_ROOT / name.translate(str.maketrans("./", "/."))


def _canonical(name: str) -> str:
    """``name`` with dots as its separators, as the classification below spells them."""
    return ".".join(sysctl_path(name).relative_to(SYSCTL_ROOT).parts)


def sysctl_namespace(name: str) -> str:
    """Which namespace the sysctl ``name`` belongs to (NET, IPC or UTS); INVALID_ARGUMENT for one
    that is not namespaced (writing it would change the host)."""
    canonical = _canonical(name)
    if canonical.startswith(_NET_PREFIXES):
        return NET
    if canonical in _IPC_SYSCTLS or canonical.startswith(_IPC_PREFIXES):
        return IPC
    if canonical in _UTS_SYSCTLS:
        return UTS
    raise NamespaceError.invalid(
        f"sysctls.{name}", "is not namespaced (only net.*, the IPC ones and kernel.domainname are)"
    )


def _check(spec: PodNamespaceSpec) -> None:
    # Its IPC namespace at least is the user namespace's; its network and UTS may be the
    # machine's where the machine is the pod's (a vm pod's guest). A pod on a host with the
    # host's namespaces and a user namespace is refused before (auraed.cri.model).
    if spec.userns is not None and not spec.ipc:
        raise NamespaceError.invalid(
            "userns", "a pod with a user namespace of its own has its own IPC namespace"
        )
    if not (spec.network or spec.ipc or spec.uts or spec.pid):
        raise NamespaceError.invalid("namespaces", "a pod sandbox needs at least one namespace of its own")
    if spec.hostname and not spec.uts:
        raise NamespaceError.invalid("hostname", "needs the pod's own UTS namespace")
    if len(spec.hostname.encode()) > HOST_NAME_MAX or not spec.hostname.isprintable():
        raise NamespaceError.invalid("hostname", f"must be at most {HOST_NAME_MAX} printable bytes")
    owned = {NET: spec.network, IPC: spec.ipc, UTS: spec.uts}
    names = {NET: "network", IPC: "IPC", UTS: "UTS"}
    for name, value in spec.sysctls.items():
        kind = sysctl_namespace(name)
        if not owned[kind]:
            raise NamespaceError.invalid(f"sysctls.{name}", f"needs the pod's own {names[kind]} namespace")
        if not value.isprintable():
            raise NamespaceError.invalid(f"sysctls.{name}", f"{value!r} is not a printable value")


def write_sysctls(sysctls: Mapping[str, str]) -> None:
    """Each sysctl written where /proc/sys resolves it for the calling thread (its namespaces');
    INVALID_ARGUMENT naming the one the kernel refuses."""
    for name, value in sysctls.items():
        path = sysctl_path(name)
        try:
            with open(path, "w") as file:
                file.write(value)
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                raise
            problem = "no such sysctl" if exc.errno == errno.ENOENT else (exc.strerror or str(exc))
            raise NamespaceError.invalid(f"sysctls.{name}", f"cannot set {value!r}: {problem}") from None


def _spawn_confined_init(program: Path, directory: Path) -> int:
    """Start the PID namespace's init from the calling thread (after its unshare(CLONE_NEWPID)),
    confined (auraed.system.confine): the thread cannot reach the host's files afterwards."""
    path = confine.confine_thread(program, POD_INIT_NAME, directory)
    return os.posix_spawn(path, [POD_INIT_NAME, *POD_INIT_ARGS], {}, setsid=True)


def _record_init(directory: Path, pid: int) -> None:
    """The init's record: it and this process, its parent (the user namespace helper clones it
    as this process's child too), which alone may reap it."""
    parent = os.getpid()
    fields = (pid, processes.start_ticks(pid), parent, processes.start_ticks(parent))
    (directory / INIT_RECORD).write_text(" ".join(map(str, fields)) + "\n")


def create_pod_namespaces(
    directory: Path, spec: PodNamespaceSpec, init_program: Path = DEFAULT_POD_INIT
) -> PodNamespaces:
    """Make and pin the namespaces ``spec`` asks for under ``directory`` (created; it must not
    hold pins already), with ``init_program`` as the PID namespace's init where ``spec`` asks for
    one. On any failure, whatever was made is removed again before raising."""
    _check(spec)
    if spec.pid and not init_program.is_file():
        raise NamespaceError(
            ErrorKind.FAILED_PRECONDITION,
            f"a shared PID namespace needs its init, {init_program}, which is missing "
            "(the pod_init setting; Debian's catatonit package)",
        )
    kinds = tuple(kind for kind, wanted in ((NET, spec.network), (IPC, spec.ipc), (UTS, spec.uts)) if wanted)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    taken = [name for name in (*PIN_NAMES, INIT_RECORD) if os.path.lexists(directory / name)]
    if taken:  # another pod's: never touched, not even by the clean-up of a failure
        raise NamespaceError.already_exists(f"pod namespaces in {directory} ({', '.join(taken)})")
    try:
        if spec.userns is None:
            init = in_new_thread(lambda: _unshare_and_pin(directory, spec, kinds, init_program))
        else:
            init = _made_in_user_namespace(directory, spec, kinds, init_program)
        if init is not None:
            _record_init(directory, init)
            namespaces.pin_namespace(f"/proc/{init}/ns/pid", directory / PID)
    except BaseException:
        remove_pod_namespaces(directory)
        raise
    return PodNamespaces(
        str(directory),
        net=str(directory / NET) if NET in kinds else None,
        ipc=str(directory / IPC) if IPC in kinds else None,
        uts=str(directory / UTS) if UTS in kinds else None,
        pid=str(directory / PID) if spec.pid else None,
        user=str(directory / USER) if spec.userns is not None else None,
        init_pid=init,
        init_ticks=None if init is None else processes.start_ticks(init),
    )


def configure_namespaces(hostname: str, sysctls: Mapping[str, str], network: bool) -> None:
    """In the calling thread's namespaces: the hostname, the sysctls, ``lo`` up."""
    if hostname:
        namespaces.sethostname(hostname)
    write_sysctls(sysctls)
    if network:
        namespaces.bring_loopback_up()


def _unshare_and_pin(
    directory: Path, spec: PodNamespaceSpec, kinds: tuple[str, ...], init_program: Path
) -> int | None:
    """On a thread of its own: the namespaces made, configured and pinned; the init spawned (the
    thread's last act: see _spawn_confined_init) where the pod shares a PID namespace."""
    flags = {NET: namespaces.CLONE_NEWNET, IPC: namespaces.CLONE_NEWIPC, UTS: namespaces.CLONE_NEWUTS}
    namespaces.unshare(sum(flags[kind] for kind in kinds) | (namespaces.CLONE_NEWPID if spec.pid else 0))
    configure_namespaces(spec.hostname, spec.sysctls, spec.network)
    for kind in kinds:
        namespaces.pin_namespace(namespaces.thread_namespace(kind), directory / kind)
    return _spawn_confined_init(init_program, directory) if spec.pid else None


def _made_in_user_namespace(
    directory: Path, spec: PodNamespaceSpec, kinds: tuple[str, ...], init_program: Path
) -> int | None:
    """The pod's user namespace and its other namespaces, owned by it, made and configured by the
    helper (auraed.system.userns: a multi-threaded process can neither make nor enter a user
    namespace), mapped and pinned here."""
    assert spec.userns is not None
    init = (str(init_program), *POD_INIT_ARGS) if spec.pid else ()
    settings = {"hostname": spec.hostname, "sysctls": dict(spec.sysctls), "network": spec.network}
    # The init's root goes over /tmp in its own mount namespace: the pod's directory is root's
    # 0700 (the namespace's root, another host uid, may not reach it).
    mountpoint = USERNS_INIT_MOUNTPOINT
    argv = userns.helper_argv(
        kinds,
        settings,
        init=init,
        name=POD_INIT_NAME,
        init_id=spec.userns.unprivileged_id(),
        mountpoint=mountpoint,
    )
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as helper:
        assert helper.stdin is not None and helper.stdout is not None
        try:
            _hear(helper.stdout, "ready")
            userns.write_id_maps(helper.pid, spec.userns)
            for kind in (USER, *kinds):
                namespaces.pin_namespace(f"/proc/{helper.pid}/ns/{kind}", directory / kind)
            _tell(helper.stdin, "go")
            refused = _hear(helper.stdout, "configured", "refused")
            if refused:
                doc = json.loads(refused)
                raise NamespaceError(ErrorKind(doc["kind"]), doc["message"])
            init_pid = int(_hear(helper.stdout, "init")) if spec.pid else None
            _tell(helper.stdin, "done")
            code = helper.wait(HELPER_TIMEOUT)
        except BaseException:
            helper.kill()
            raise
    if code != 0:
        raise NamespaceError(ErrorKind.INTERNAL, f"the user namespace helper failed (exit status {code})")
    return init_pid


def _hear(stream: IO[str], word: str, refusal: str = "") -> str:
    """The rest of the helper's next line, which must start with ``word``; with ``refusal``, a
    line starting with that is returned whole (after the word) instead, and ``word``'s is ""."""
    said, _, rest = stream.readline().strip().partition(" ")
    if said == word:
        return "" if refusal else rest
    if refusal and said == refusal:
        return rest
    raise NamespaceError(ErrorKind.INTERNAL, f"the user namespace helper said {said!r}, not {word!r}")


def _tell(stream: IO[str], word: str) -> None:
    stream.write(word + "\n")
    stream.flush()


def _read_init(directory: Path) -> tuple[int, int | None, bool] | None:
    """The init's pid and start ticks, and whether this process is its parent."""
    try:
        words = (directory / INIT_RECORD).read_text().split()
        fields = [None if word == "None" else int(word) for word in words]
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # cut short by a crash right at its write: its process cannot be named
    if len(fields) != 4:
        return None
    pid, ticks, parent, parent_ticks = fields
    if pid is None:
        return None
    ours = parent == os.getpid() and parent_ticks == processes.start_ticks(os.getpid())
    return pid, ticks, ours


def _stop_init(directory: Path) -> None:
    """SIGKILL the PID namespace's init if it is still the process recorded, wait until it has
    ended, and reap it where this process is its parent (a zombie keeps its pid from reuse until
    then, so no other child's status can be taken instead)."""
    found = _read_init(directory)
    if found is None:
        return
    pid, ticks, ours = found
    processes.send_signal(pid, signal.SIGKILL, ticks)
    deadline = time.monotonic() + INIT_EXIT_TIMEOUT
    while processes.is_alive(pid, ticks):  # a zombie is not alive
        if time.monotonic() > deadline:
            raise NamespaceError(ErrorKind.INTERNAL, f"{POD_INIT_NAME} {pid} did not end after SIGKILL")
        time.sleep(_INIT_EXIT_POLL)
    if ours:
        with contextlib.suppress(ChildProcessError):  # reaped already
            os.waitpid(pid, 0)


def remove_pod_namespaces(directory: Path) -> None:
    """Stop the init, unpin every namespace of the pod and remove its directory; idempotent (a
    directory already gone, or half made, is fine)."""
    _stop_init(directory)
    for name in PIN_NAMES:
        namespaces.unpin_namespace(directory / name)
    (directory / INIT_RECORD).unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        directory.rmdir()
