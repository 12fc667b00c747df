"""A CRI ContainerConfig, checked at the edge into typed values: the CRI's own record of what was
asked (:class:`ContainerSpec`) and the host container request it becomes (``ContainerRequest``).

Decisions worth knowing:

* Command and args mean what the kubelet means by them: ``command`` is the image's Entrypoint
  replaced, ``args`` its Cmd replaced; an empty one keeps the image's (with a command and no
  args, the image's Cmd is dropped). That is ContainerRequest's rule as well.
* Resources: CPU period and quota (µs), shares (cgroup v1 cpu.shares), the memory limit and the
  memory + swap limit (v1 memory.memsw), cpusets and oom_score_adj; 0 (the proto's zero) is
  "not set" for each but oom_score_adj, which the kubelet always sends. The runtime spec never
  sets an oom_score_adj below auraed's own (auraed.containers.oci_spec).
* The pod's sysctls go into each container's spec too, as containerd puts them there: they are
  namespaced (the pod model checks that), so they land in the pod's own namespaces again.
* Mounts, the security context and the container's namespace choices are auraed.cri.security's
  (host paths resolved, propagation, read-only binds that are not recursive). What the request
  asks is also kept as asked: ContainerStatus reports exactly that.
* The log goes to ``<pod log_directory>/<config.log_path>`` when the pod names a directory and
  the container a path; else into the container's own directory. The kubelet is trusted with
  where: any absolute log directory is taken (``/etc`` too), as containerd takes it (it joins the
  two with filepath.Join and checks neither); a ``log_path`` that climbs out of the directory is
  refused. What is already at the path must be a regular file (auraed.system.request_files).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from auraed.api.runtime import v1 as cri
from auraed.containers.request import ContainerRequest, Resources
from auraed.cri.errors import CriError
from auraed.cri.model import MAX_NAME, PodSpec, labels
from auraed.cri.security import ContainerNamespaces, linux_security
from auraed.system.request_files import NotRegularFile, check_regular

MAX_ARGS = 4096
MAX_ARG = 128 * 1024  # one argument (the kernel's MAX_ARG_STRLEN)
MAX_ENVS = 4096
MAX_MOUNTS = 1024
MAX_PATH = 4096
MAX_REFERENCE = 4096
UNSET = 0  # the proto's zero: a limit the kubelet did not set


@dataclasses.dataclass(frozen=True)
class CriMount:
    """A mount as the CreateContainer request asked for it (ContainerStatus reports these)."""

    container_path: str
    host_path: str
    readonly: bool = False
    selinux_relabel: bool = False
    propagation: int = 0  # cri.MountPropagation's value
    recursive_read_only: bool = False
    image: str = ""  # an image volume's image, as the request named it
    image_sub_path: str = ""

    def to_doc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CriMount:
        return cls(**doc)


@dataclasses.dataclass(frozen=True)
class ImageAsked:
    """The image as the request named it: ``image`` (a reference or an id) and the name the user
    gave, which ContainerStatus reports."""

    image: str
    user_specified_image: str = ""
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def shown(self) -> str:
        return self.user_specified_image or self.image


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
    """A CreateContainer request, checked: what the CRI keeps, and the host request it runs as."""

    name: str
    attempt: int
    image: ImageAsked
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    mounts: tuple[CriMount, ...]
    log_path: Path | None  # absolute; None: in the container's own directory
    request: ContainerRequest
    namespaces: ContainerNamespaces  # whose network, IPC and PID namespaces it is in


def _text(value: str, field: str, limit: int = MAX_NAME, required: bool = False) -> str:
    if required and not value:
        raise CriError.invalid(field, "is required")
    if len(value) > limit:
        raise CriError.invalid(field, f"is longer than {limit} characters")
    if "\0" in value:
        raise CriError.invalid(field, "holds a NUL character")
    return value


def _absolute(value: str, field: str) -> str:
    _text(value, field, MAX_PATH, required=True)
    if not value.startswith("/"):
        raise CriError.invalid(field, f"{value[:100]!r} is not an absolute path")
    return value


def image_asked(spec: cri.ImageSpec | None) -> ImageAsked:
    if spec is None or not spec.image:
        raise CriError.invalid("config.image.image", "is required")
    return ImageAsked(
        image=_text(spec.image, "config.image.image", MAX_REFERENCE),
        user_specified_image=_text(
            spec.user_specified_image, "config.image.user_specified_image", MAX_REFERENCE
        ),
        annotations=labels(spec.annotations, "config.image.annotations"),
    )


def _strings(values: list[str], field: str) -> tuple[str, ...]:
    if len(values) > MAX_ARGS:
        raise CriError.invalid(field, f"more than {MAX_ARGS} entries")
    return tuple(_text(value, f"{field}[{index}]", MAX_ARG) for index, value in enumerate(values))


def _envs(values: list[cri.KeyValue]) -> tuple[str, ...]:
    if len(values) > MAX_ENVS:
        raise CriError.invalid("config.envs", f"more than {MAX_ENVS} entries")
    envs = []
    for index, entry in enumerate(values):
        if not entry.key or "=" in entry.key:
            raise CriError.invalid(f"config.envs[{index}].key", f"{entry.key[:60]!r} is not a variable name")
        _text(entry.key, f"config.envs[{index}].key", MAX_NAME)
        _text(entry.value, f"config.envs[{index}].value", MAX_ARG)
        envs.append(f"{entry.key}={entry.value}")
    return tuple(envs)


def cri_mounts(values: list[cri.Mount]) -> tuple[CriMount, ...]:
    if len(values) > MAX_MOUNTS:
        raise CriError.invalid("config.mounts", f"more than {MAX_MOUNTS} entries")
    mounts = []
    for index, mount in enumerate(values):
        field = f"config.mounts[{index}]"
        image_volume = mount.image is not None and bool(mount.image.image)
        mounts.append(
            CriMount(
                container_path=_absolute(mount.container_path, f"{field}.container_path"),
                host_path="" if image_volume else _absolute(mount.host_path, f"{field}.host_path"),
                readonly=mount.readonly,
                selinux_relabel=mount.selinux_relabel,
                propagation=int(mount.propagation),
                recursive_read_only=mount.recursive_read_only,
                image=mount.image.image if mount.image is not None else "",
                image_sub_path=mount.image_sub_path,
            )
        )
    return tuple(mounts)


def _set(value: int) -> int | None:
    return None if value == UNSET else value


def resources(value: cri.LinuxContainerResources | None, field: str) -> Resources:
    """The cgroup limits of a LinuxContainerResources (what CreateContainer and
    UpdateContainerResources carry); their ranges are checked as the spec is built."""
    if value is None:
        return Resources()
    for name in ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes"):
        if getattr(value, name) < 0:
            raise CriError.invalid(f"{field}.{name}", "is negative")
    swap = value.memory_swap_limit_in_bytes
    if swap < -1:
        raise CriError.invalid(f"{field}.memory_swap_limit_in_bytes", "is below -1 (unlimited)")
    memory = _set(value.memory_limit_in_bytes)
    return Resources(
        cpu_period=_set(value.cpu_period),
        cpu_max=_set(value.cpu_quota),
        cpu_shares=_set(value.cpu_shares),
        cpuset_cpus=_text(value.cpuset_cpus, f"{field}.cpuset_cpus", MAX_NAME) or None,
        cpuset_mems=_text(value.cpuset_mems, f"{field}.cpuset_mems", MAX_NAME) or None,
        memory_max=memory,
        # Without a memory limit, memory + swap has nothing to add to (the kubelet sends none then).
        memory_swap=_set(swap) if memory is not None else None,
    )


def log_path(config_path: str, pod: PodSpec) -> Path | None:
    """``<pod log_directory>/<log_path>`` (absolute, normalised), None unless both are given."""
    _text(config_path, "config.log_path", MAX_PATH)
    if not config_path or not pod.log_directory:
        return None
    joined = posixpath.normpath(posixpath.join(pod.log_directory, config_path))
    directory = posixpath.normpath(pod.log_directory)
    if not joined.startswith(directory.rstrip("/") + "/"):
        raise CriError.invalid("config.log_path", f"{config_path[:100]!r} leaves the pod's log directory")
    return Path(joined)


def _check_log_file(path: Path) -> None:
    """A log already at ``path`` must be a regular file: the host appends to it and reads it back
    (a FIFO would block both, a device would take the container's output)."""
    try:
        check_regular(path)
    except NotRegularFile as exc:
        raise CriError.invalid("config.log_path", str(exc.strerror)) from None
    except OSError as exc:
        raise CriError.invalid("config.log_path", f"cannot look at {path}: {exc.strerror}") from None


def host_name(name: str, attempt: int, pod: PodSpec) -> str:
    """The host container's name, unique per pod and attempt as containerd reserves it."""
    meta = pod.metadata
    return f"{name}_{meta.name}_{meta.namespace}_{meta.uid}_{attempt}"


def _stop_signal(value: cri.Signal) -> str:
    return "" if value == cri.Signal.RUNTIME_DEFAULT else cri.Signal(value).name


def container_spec(
    config: cri.ContainerConfig | None,
    pod: PodSpec,
    *,
    profile_max_bytes: int,
    recursive_read_only: bool = False,
) -> ContainerSpec:
    """A CreateContainer request's config in the pod ``pod``, as typed values;
    INVALID_ARGUMENT naming the field. It reads files the request names (a seccomp profile of at
    most ``profile_max_bytes``, host paths, the log's path) and may make a missing host path:
    call it on a thread of its own with a deadline (auraed.system.tasks.OwnThreads)."""
    if config is None:
        raise CriError.invalid("config", "is required")
    if config.metadata is None:
        raise CriError.invalid("config.metadata", "is required")
    name = _text(config.metadata.name, "config.metadata.name", required=True)
    if "/" in name or "_" in name:  # the host name is made of names joined by "_"
        raise CriError.invalid("config.metadata.name", f"{name[:60]!r} holds a '/' or '_'")
    attempt = config.metadata.attempt
    mounts = cri_mounts(config.mounts)
    linux = config.linux or cri.LinuxContainerConfig()
    limits = linux.resources
    secured = linux_security(
        config, pod, profile_max_bytes=profile_max_bytes, recursive_read_only=recursive_read_only
    )
    logged_to = log_path(config.log_path, pod)
    if logged_to is not None:
        _check_log_file(logged_to)
    request = ContainerRequest(
        name=host_name(name, attempt, pod),
        command=_strings(config.command, "config.command"),
        args=_strings(config.args, "config.args"),
        env=_envs(config.envs),
        working_dir=_text(config.working_dir, "config.working_dir", MAX_PATH),
        mounts=secured.mounts,
        resources=resources(limits, "config.linux.resources"),
        security=replace(
            secured.security, oom_score_adj=limits.oom_score_adj if limits is not None else None
        ),
        sysctls=dict(pod.sysctls),
        tty=config.tty,
        stdin=config.stdin,
        stdin_once=config.stdin and config.stdin_once,
        stop_signal=_stop_signal(config.stop_signal),
        host_network=pod.host_network,
    )
    return ContainerSpec(
        name=name,
        attempt=attempt,
        image=image_asked(config.image),
        labels=labels(config.labels, "config.labels"),
        annotations=labels(config.annotations, "config.annotations"),
        mounts=mounts,
        log_path=logged_to,
        request=request,
        namespaces=secured.namespaces,
    )
