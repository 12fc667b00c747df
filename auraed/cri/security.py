"""A CRI container's Linux security context, namespaces and mounts, as the Containers domain's typed
request parts (auraed.containers.request).

:func:`linux_security` checks every field of a kubelet's LinuxContainerSecurityContext and Mounts
and names it, as the CRI does, when it is wrong (CriError: INVALID_ARGUMENT unless said). The
meanings are containerd's, so that a kubelet gets the containers it gets there:

* User: ``run_as_username``, else ``run_as_user``, then ``:<run_as_group>``; a group without a user
  is refused; none of them: the image's USER. The process's groups are its primary group, the
  user's memberships in the image's /etc/group (``supplemental_groups_policy`` Merge, the
  default; not with Strict) and ``supplemental_groups``; ContainerStatus reports them.
* Capabilities: names with or without ``CAP_``, any case. containerd's order: add ALL, drop ALL,
  then the named adds, then the named drops (drop ALL + add X is X alone, add X + drop X lacks X).
  Ambient capabilities are refused.
* Privileged: only in a privileged pod. Every capability and device, no seccomp, no masked or
  read-only paths, writable /sys (``Security.privileged``); the capability, seccomp and path
  fields are not used.
* ``masked_paths`` and ``readonly_paths``: a list given is taken as it is (the kubelet sends its
  default lists for every container). An empty one is the defaults (auraed's DEFAULT_MASKED_PATHS
  and DEFAULT_READONLY_PATHS: /proc/keys, /proc/timer_list, /sys/firmware... masked, /proc/sys
  and the like read-only), unlike containerd and CRI-O, where an empty list is none. Empty lists
  are how the kubelet says ``procMount: Unmasked``, which Kubernetes allows only in a pod with a
  user namespace of its own (``hostUsers: false``; the API server refuses it otherwise): there an
  empty list is none, as in containerd; anywhere else an empty list never comes from a kubelet,
  and a client that sends one (crictl with a bare config, a test harness) does not get a
  container that reads the host's keyring and timers and writes /proc/sys. A privileged
  container has none (oci_spec), as in containerd.
* Seccomp: no profile is unconfined, as containerd has it, unlike the aurae API whose default is
  auraed's profile; RuntimeDefault is auraed's default profile; Localhost reads the moby-format
  profile at the absolute path ``localhost_ref`` (auraed.cri.seccomp). The deprecated
  ``seccomp_profile_path`` is read when ``seccomp`` is unset: "runtime/default", "docker/default",
  "unconfined", "localhost/<path>".
* AppArmor and SELinux options are ignored (auraed applies neither), with a log line.
* Namespaces (:class:`ContainerNamespaces`): network and IPC are the pod's (the host's for a pod
  of the host's); the PID namespace is the container's choice among the pod's, its own, the
  host's (in a host-PID pod) and another container's (TARGET).
* Mounts: host paths, bind mounted recursively; the host path is created as a directory when
  missing and its symlinks resolved (containerd does both). ``readonly`` makes the bind itself
  read-only, not the mounts below it (``recursive_read_only`` is for those, where the runtime
  can). Propagation: PRIVATE ``rprivate``, HOST_TO_CONTAINER ``rslave`` (the host path must be on a
  shared or slave mount), BIDIRECTIONAL ``rshared`` (on a shared mount); the spec builder sets the
  root's propagation to match. Image volumes are UNIMPLEMENTED (critest then skips its specs), as
  are id-mapped mounts; ``selinux_relabel`` is ignored.

Reading the seccomp profile, creating host directories and reading mountinfo are blocking file
work on paths the request names: call it on a thread of its own with a deadline
(auraed.system.tasks.OwnThreads), not on the loop's shared pool. Everything is checked before
anything is created.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from auraed.api.runtime import v1 as cri
from auraed.containers.oci_spec import (
    DEFAULT_MASKED_PATHS,
    DEFAULT_READONLY_PATHS,
    HostFacts,
    capability_name,
    compute_capabilities,
)
from auraed.containers.request import IMAGE_MOUNT, MAX_ID, Mount, Security, SpecError, check_path
from auraed.cri.errors import CriError
from auraed.cri.model import PodSpec
from auraed.cri.seccomp import Target, load_profile
from auraed.errors import ErrorKind
from auraed.system.mounts import mount_of

log = logging.getLogger(__name__)

CONTEXT = "config.linux.security_context"
# Mode of a host path directory created for a mount (containerd's MkdirAll mode).
HOST_PATH_MODE = 0o755
# The deprecated seccomp_profile_path's words (containerd's), and its prefix of a file's path.
_RUNTIME_DEFAULT_PATHS = frozenset({"runtime/default", "docker/default"})
_UNCONFINED_PATH = "unconfined"
_LOCALHOST_PREFIX = "localhost/"
MAX_IMAGE_FIELD = 4096
"""The longest image reference or sub path an image volume may name."""
_PROPAGATION = {
    cri.MountPropagation.PROPAGATION_PRIVATE: "rprivate",
    cri.MountPropagation.PROPAGATION_HOST_TO_CONTAINER: "rslave",
    cri.MountPropagation.PROPAGATION_BIDIRECTIONAL: "rshared",
}


class NamespaceScope(enum.Enum):
    """Whose namespace a container is in."""

    POD = "pod"  # the pod's, shared by its containers
    CONTAINER = "container"  # a new one of its own
    NODE = "node"  # the host's
    TARGET = "target"  # another container's (PID only): ContainerNamespaces.pid_target


@dataclass(frozen=True)
class ContainerNamespaces:
    """Which namespaces a container joins. ``network`` and ``ipc`` are POD or NODE (the pod's own,
    or the host's for a pod of the host's); ``pid`` any scope, with ``pid_target`` the id of the
    container whose PID namespace TARGET names (one of the same pod)."""

    network: NamespaceScope
    ipc: NamespaceScope
    pid: NamespaceScope
    pid_target: str = ""


class LinuxSecurity(NamedTuple):
    """A container's security, mounts and namespaces, from its CRI config and its pod's."""

    security: Security
    mounts: tuple[Mount, ...]
    namespaces: ContainerNamespaces


def linux_security(
    config: cri.ContainerConfig, pod: PodSpec, *, profile_max_bytes: int, recursive_read_only: bool = False
) -> LinuxSecurity:
    """``config``'s Linux security context and mounts, checked, for a container of ``pod``.

    ``profile_max_bytes``: the largest Localhost seccomp profile read. ``recursive_read_only``:
    whether the runtime makes mounts read-only recursively (runc 1.1+ on Linux 5.12+; what Status
    advertises as the handler's recursive_read_only_mounts); without it a mount asking for it is
    refused. Raises CriError naming the field.
    """
    context = (config.linux or cri.LinuxContainerConfig()).security_context
    context = context or cri.LinuxContainerSecurityContext()
    namespaces = container_namespaces(context.namespace_options, pod)
    planned = [
        _planned_mount(mount, f"config.mounts[{index}]", recursive_read_only)
        for index, mount in enumerate(config.mounts)
    ]
    _check_distinct(planned)
    profile, profile_field = _seccomp_choice(context)
    security = _security(context, pod, profile)
    # Last, the parts that read and create files, once everything else is known to be good.
    localhost = cri.SecurityProfileProfileType.Localhost
    if not security.privileged and profile is not None and profile.profile_type == localhost:
        seccomp = _localhost_seccomp(profile, profile_field, security, profile_max_bytes)
        security = replace(security, seccomp=seccomp)
    mounts = tuple(map(_bound, planned))
    return LinuxSecurity(security, mounts, namespaces)


# ---------------------------------------------------------------------------------- security


def _security(
    context: cri.LinuxContainerSecurityContext, pod: PodSpec, seccomp: cri.SecurityProfile | None
) -> Security:
    if context.privileged and not pod.privileged:
        raise CriError.invalid(f"{CONTEXT}.privileged", "a privileged container needs a privileged pod")
    _ignored_profiles(context)
    add, drop = _capabilities(context.capabilities, f"{CONTEXT}.capabilities")
    return Security(
        capabilities_add=add,
        capabilities_drop=drop,
        no_new_privileges=context.no_new_privs,
        read_only_rootfs=context.readonly_rootfs,
        masked_paths=_paths(context.masked_paths, f"{CONTEXT}.masked_paths")
        or _unless_unmasked(pod, DEFAULT_MASKED_PATHS),
        readonly_paths=_paths(context.readonly_paths, f"{CONTEXT}.readonly_paths")
        or _unless_unmasked(pod, DEFAULT_READONLY_PATHS),
        user=_user(context),
        additional_gids=tuple(
            _id(gid, f"{CONTEXT}.supplemental_groups[{index}]")
            for index, gid in enumerate(context.supplemental_groups)
        ),
        strict_groups=_strict_groups(context.supplemental_groups_policy),
        seccomp_profile=_seccomp_profile(seccomp),
        privileged=context.privileged,
        exact_paths=True,
    )


def _id(value: int, where: str) -> int:
    if not 0 <= value <= MAX_ID:
        raise CriError.invalid(where, f"{value} is outside 0..{MAX_ID}")
    return value


def _strict_groups(policy: cri.SupplementalGroupsPolicy) -> bool:
    """Strict: the image's /etc/group is not read for the user's groups; Merge (the zero value)
    adds them. Another value is one of a newer CRI, refused rather than guessed at."""
    policies = cri.SupplementalGroupsPolicy
    if policy not in (policies.Merge, policies.Strict):
        raise CriError.invalid(
            f"{CONTEXT}.supplemental_groups_policy", f"{int(policy)} is neither Merge nor Strict"
        )
    return policy == policies.Strict


def _user(context: cri.LinuxContainerSecurityContext) -> str:
    """containerd's user string: name or uid, then ":gid"; "" for the image's USER."""
    user = ""
    if context.run_as_user is not None:
        user = str(_id(context.run_as_user.value, f"{CONTEXT}.run_as_user"))
    if context.run_as_username:
        name = context.run_as_username
        if len(name) > 256 or any(c in name for c in ":\0\n") or name != name.strip():
            raise CriError.invalid(f"{CONTEXT}.run_as_username", f"{name[:60]!r} is not a user name")
        user = name
    if context.run_as_group is not None:
        gid = _id(context.run_as_group.value, f"{CONTEXT}.run_as_group")
        if not user:
            raise CriError.invalid(f"{CONTEXT}.run_as_group", "needs run_as_user or run_as_username")
        user = f"{user}:{gid}"
    return user


def _capabilities(capabilities: cri.Capability | None, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(add, drop) for the Containers domain, whose order differs from containerd's: drops there
    come before adds, ALL added minus named drops wins. Rewritten so both give containerd's set."""
    if capabilities is None:
        return (), ()
    if capabilities.add_ambient_capabilities:
        raise CriError.invalid(f"{where}.add_ambient_capabilities", "ambient capabilities are not supported")
    adds = _capability_names(capabilities.add_capabilities, f"{where}.add_capabilities", to_hold=True)
    drops = _capability_names(capabilities.drop_capabilities, f"{where}.drop_capabilities", to_hold=False)
    named_adds = [name for name in adds if name != "ALL"]
    named_drops = tuple(dict.fromkeys(name for name in drops if name != "ALL"))
    kept = tuple(dict.fromkeys(name for name in named_adds if name not in named_drops))
    if "ALL" in drops:  # dropped after ALL was added: only the named adds are left
        return kept, ("ALL",)
    if "ALL" in adds:
        return ("ALL",), named_drops
    return kept, named_drops


def _capability_names(names: Sequence[str], where: str, *, to_hold: bool) -> list[str]:
    """Capability names normalised ("net_admin" is CAP_NET_ADMIN); ``to_hold``: each one must be
    one auraed holds, or the runtime would fail on it."""
    available: frozenset[str] | None = None
    out = []
    for index, raw in enumerate(names):
        try:
            name = capability_name(raw, f"{where}[{index}]")
        except SpecError as exc:
            raise CriError(ErrorKind.INVALID_ARGUMENT, exc.message) from None
        if to_hold and name != "ALL":
            available = available if available is not None else HostFacts.probe().capabilities
            if name not in available:
                raise CriError.invalid(
                    f"{where}[{index}]", f"{name} is not available to auraed on this machine"
                )
        out.append(name)
    return out


def _paths(paths: Sequence[str], where: str) -> tuple[str, ...]:
    return tuple(_path(path, f"{where}[{index}]") for index, path in enumerate(paths))


def _path(path: str, where: str, *, allow_root: bool = False) -> str:
    try:
        return check_path(path, where, allow_root=allow_root)
    except SpecError as exc:
        raise CriError(ErrorKind.INVALID_ARGUMENT, exc.message) from None


def _ignored_profiles(context: cri.LinuxContainerSecurityContext) -> None:
    """AppArmor and SELinux: auraed applies neither; a request for one is logged, not refused,
    as containerd does on a host without them."""
    apparmor = context.apparmor
    if (apparmor is not None and apparmor.profile_type != cri.SecurityProfileProfileType.Unconfined) or (
        context.apparmor_profile not in ("", _UNCONFINED_PATH)
    ):
        log.info("CRI container: AppArmor profile ignored (auraed applies no AppArmor profile)")
    selinux = context.selinux_options
    if selinux is not None and any((selinux.user, selinux.role, selinux.type, selinux.level)):
        log.info("CRI container: SELinux options ignored (auraed applies no SELinux labels)")


# ----------------------------------------------------------------------------------- seccomp


def _seccomp_choice(context: cri.LinuxContainerSecurityContext) -> tuple[cri.SecurityProfile | None, str]:
    """The seccomp profile asked for, and the field naming its file; the deprecated path read as
    containerd reads it when ``seccomp`` is unset."""
    kinds = cri.SecurityProfileProfileType
    if context.seccomp is not None:
        profile = context.seccomp
        where = f"{CONTEXT}.seccomp.localhost_ref"
        if profile.profile_type == kinds.Localhost and not profile.localhost_ref:
            raise CriError.invalid(where, "is required for a Localhost profile")
        if profile.profile_type != kinds.Localhost and profile.localhost_ref:
            raise CriError.invalid(where, "is only for a Localhost profile")
        return profile, where
    where = f"{CONTEXT}.seccomp_profile_path"
    path = context.seccomp_profile_path
    if not path:
        return None, where
    if path in _RUNTIME_DEFAULT_PATHS:
        return cri.SecurityProfile(profile_type=kinds.RuntimeDefault), where
    if path == _UNCONFINED_PATH:
        return cri.SecurityProfile(profile_type=kinds.Unconfined), where
    if not path.startswith(_LOCALHOST_PREFIX) or path == _LOCALHOST_PREFIX:
        raise CriError.invalid(
            where, f"{path[:200]!r} is not runtime/default, docker/default, unconfined or localhost/<path>"
        )
    return cri.SecurityProfile(
        profile_type=kinds.Localhost, localhost_ref=path[len(_LOCALHOST_PREFIX) :]
    ), where


def _seccomp_profile(profile: cri.SecurityProfile | None) -> str:
    """Security.seccomp_profile: "unconfined" when none is asked for (a Localhost profile is
    read later, into Security.seccomp, which wins over this)."""
    if profile is None or profile.profile_type == cri.SecurityProfileProfileType.Unconfined:
        return "unconfined"
    return "default"


def _localhost_seccomp(
    profile: cri.SecurityProfile, where: str, security: Security, max_bytes: int
) -> dict[str, object]:
    """The Localhost profile's file as an OCI section, its rules chosen for the container's
    capabilities."""
    capabilities = frozenset(compute_capabilities(security, HostFacts.probe().capabilities))
    return load_profile(profile.localhost_ref, where, Target.here(capabilities), max_bytes)


def _unless_unmasked(pod: PodSpec, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """What an empty masked or read-only list means: in a pod with a user namespace of its own,
    ``procMount: Unmasked`` (the kubelet's only reason to send one, allowed there alone), so
    none, as containerd and CRI-O take it; elsewhere the defaults (see the module's docstring)."""
    return () if pod.userns is not None else defaults


# -------------------------------------------------------------------------------- namespaces


def container_namespaces(options: cri.NamespaceOption | None, pod: PodSpec) -> ContainerNamespaces:
    """Where the container's network, IPC and PID namespaces come from. A container may not ask
    for the host's network or IPC namespace when its pod has its own (the zero value, POD, means
    the pod's whatever it is); the PID namespace is its own choice."""
    options = options or cri.NamespaceOption()
    where = f"{CONTEXT}.namespace_options"
    modes = cri.NamespaceMode
    scopes: dict[str, NamespaceScope] = {}
    for name, host in (("network", pod.host_network), ("ipc", pod.host_ipc)):
        mode = getattr(options, name)
        if mode not in (modes.POD, modes.NODE):
            raise CriError.invalid(f"{where}.{name}", "must be POD or NODE")
        if mode == modes.NODE and not host:
            raise CriError.invalid(f"{where}.{name}", f"NODE, but the pod has a {name} namespace of its own")
        scopes[name] = NamespaceScope.NODE if host else NamespaceScope.POD
    _check_user_namespace(options.userns_options, pod, f"{where}.userns_options")
    pid, target = _pid_scope(options, pod, where)
    return ContainerNamespaces(scopes["network"], scopes["ipc"], pid, target)


def _check_user_namespace(asked: cri.UserNamespace | None, pod: PodSpec, where: str) -> None:
    """A container is in its pod's user namespace, or the host's where the pod has none: it may
    say so (the kubelet repeats the pod's options), never ask for another."""
    modes = cri.NamespaceMode
    if asked is None:
        return
    if asked.mode not in (modes.POD, modes.NODE):
        raise CriError.invalid(f"{where}.mode", f"must be POD or NODE, not {asked.mode.name}")
    if asked.mode == modes.POD and pod.userns is None:
        raise CriError.invalid(f"{where}.mode", "POD, but the pod has no user namespace of its own")
    if asked.mode == modes.NODE and pod.userns is not None:
        raise CriError.invalid(f"{where}.mode", "NODE, but the pod has a user namespace of its own")
    if asked.mode == modes.POD and (asked.uids or asked.gids):
        mapping = pod.userns
        assert mapping is not None
        given = [(m.container_id, m.host_id, m.length) for m in (*asked.uids, *asked.gids)]
        if given != [(0, mapping.uid, mapping.uid_length), (0, mapping.gid, mapping.gid_length)]:
            raise CriError.invalid(where, "its mappings are not its pod's")


def _pid_scope(options: cri.NamespaceOption, pod: PodSpec, where: str) -> tuple[NamespaceScope, str]:
    modes = cri.NamespaceMode
    if options.pid == modes.TARGET and not options.target_id:
        raise CriError.invalid(f"{where}.target_id", "is required with a pid mode of TARGET")
    if options.pid != modes.TARGET and options.target_id:
        raise CriError.invalid(f"{where}.target_id", "is only for a pid mode of TARGET")
    if options.pid == modes.TARGET:
        return NamespaceScope.TARGET, options.target_id
    if options.pid == modes.NODE:
        if not pod.host_pid:
            raise CriError.invalid(f"{where}.pid", "NODE, but the pod has no host PID namespace")
        return NamespaceScope.NODE, ""
    if options.pid == modes.CONTAINER:
        return NamespaceScope.CONTAINER, ""
    # POD: the pod's, which is the host's for a host-PID pod; a pod that shares none (its own
    # pid mode CONTAINER) leaves each container one of its own.
    if pod.host_pid:
        return NamespaceScope.NODE, ""
    return (NamespaceScope.POD if pod.shared_pid else NamespaceScope.CONTAINER), ""


# ------------------------------------------------------------------------------------ mounts


class _Planned(NamedTuple):
    """A request mount, checked, its host path as given (resolved by :func:`_bound`)."""

    mount: Mount
    where: str  # the CRI's field: "config.mounts[3]"
    propagation: str  # "rprivate", "rslave" or "rshared", also among the mount's options


def _planned_mount(mount: cri.Mount, where: str, recursive_read_only: bool) -> _Planned:
    if mount.image is not None and mount.image.image:
        return _image_volume(mount, where)
    if mount.image_sub_path:
        raise CriError.invalid(f"{where}.image_sub_path", "is only for an image volume")
    if mount.uid_mappings or mount.gid_mappings:
        raise CriError(ErrorKind.UNIMPLEMENTED, f"{where}: id-mapped mounts are not supported")
    destination = _path(mount.container_path, f"{where}.container_path")
    source = _path(mount.host_path, f"{where}.host_path", allow_root=True)
    propagation = _PROPAGATION.get(mount.propagation)
    if propagation is None:
        raise CriError.invalid(f"{where}.propagation", f"{mount.propagation} is not a propagation mode")
    options = [propagation]
    if mount.recursive_read_only:
        options.append(_recursive_read_only(mount, where, recursive_read_only))
    return _Planned(Mount(destination, source, "bind", tuple(options), mount.readonly), where, propagation)


def _image_volume(mount: cri.Mount, where: str) -> _Planned:
    """An image volume (KEP-4639): the image's files (the kubelet has pulled it), read-only,
    nothing executable, as the Kubernetes documentation says it is mounted; a sub path of it
    resolved inside the image when the container is created."""
    assert mount.image is not None
    if mount.host_path:
        raise CriError.invalid(f"{where}.host_path", "an image volume has none")
    if mount.propagation != cri.MountPropagation.PROPAGATION_PRIVATE:
        raise CriError.invalid(f"{where}.propagation", "an image volume's is PROPAGATION_PRIVATE")
    if mount.uid_mappings or mount.gid_mappings:
        raise CriError(ErrorKind.UNIMPLEMENTED, f"{where}: id-mapped mounts are not supported")
    destination = _path(mount.container_path, f"{where}.container_path")
    image = _text_field(mount.image.image, f"{where}.image.image")
    sub_path = _text_field(mount.image_sub_path, f"{where}.image_sub_path")
    if "\0" in sub_path or ".." in sub_path.split("/"):
        raise CriError.invalid(f"{where}.image_sub_path", f"{sub_path[:80]!r} must stay inside the image")
    return _Planned(Mount(destination, image, IMAGE_MOUNT, (), True, sub_path), where, "rprivate")


def _text_field(value: str, field: str) -> str:
    if len(value) > MAX_IMAGE_FIELD or not value.isprintable():
        raise CriError.invalid(
            field, f"{value[:80]!r} is not a printable string of at most {MAX_IMAGE_FIELD}"
        )
    return value


def _recursive_read_only(mount: cri.Mount, where: str, supported: bool) -> str:
    field = f"{where}.recursive_read_only"
    if not supported:
        raise CriError.invalid(field, "recursive read-only mounts are not supported by this runtime")
    if not mount.readonly:
        raise CriError.invalid(field, "needs readonly")
    if mount.propagation != cri.MountPropagation.PROPAGATION_PRIVATE:
        raise CriError.invalid(field, "needs PROPAGATION_PRIVATE")
    return "rro"


def _check_distinct(planned: list[_Planned]) -> None:
    seen: set[str] = set()
    for mount, where, _ in planned:
        if mount.destination in seen:
            raise CriError.invalid(f"{where}.container_path", f"{mount.destination} is mounted twice")
        seen.add(mount.destination)


def _bound(planned: _Planned) -> Mount:
    """The mount from its host path as it is on the host: created (a directory) when missing,
    its symlinks resolved, on a mount that can carry the propagation asked for. An image volume
    has no host path (the container domain mounts the image)."""
    mount, where, propagation = planned
    if mount.type == IMAGE_MOUNT:
        return mount
    field = f"{where}.host_path"
    path = mount.source
    if not os.path.lexists(path):
        try:
            os.makedirs(path, HOST_PATH_MODE, exist_ok=True)
        except OSError as exc:
            raise CriError.invalid(field, f"cannot create {path}: {exc.strerror}") from None
    elif not os.path.exists(path):
        raise CriError.invalid(field, f"{path} is a symlink to nothing")
    real = os.path.realpath(path)
    _check_propagation(real, propagation, f"{where}.propagation")
    return replace(mount, source=real)


def _check_propagation(path: str, propagation: str, where: str) -> None:
    """A bind of a private mount cannot receive the host's mounts nor hand its own back: refuse
    rather than make a container that silently lacks what it asked for (containerd does too)."""
    if propagation == "rprivate":
        return
    try:
        holder = mount_of(path)
    except (OSError, LookupError) as exc:
        raise CriError.precondition(f"{where}: cannot find the mount of {path}: {exc}") from None
    needed = ("shared",) if propagation == "rshared" else ("shared", "slave")
    if holder.propagation not in needed:
        mode = "BIDIRECTIONAL" if propagation == "rshared" else "HOST_TO_CONTAINER"
        raise CriError.precondition(
            f"{where}: {mode} needs {path} on a {' or '.join(needed)} mount, but it is on "
            f"{holder.mount_point}, which is {holder.propagation}"
        )
