"""A pod's user namespace (Kubernetes' ``hostUsers: false``): its id mappings, and how the
daemon starts the helper process that makes it (auraed.system.userns_helper), with the pod's
other namespaces owned by it.

A user namespace can only be made (unshare) or entered (setns) by a single-threaded process,
which the daemon is not; and every other namespace of the pod must be owned by it, or root in
the pod's containers would have no power over its own network, IPC, UTS or PID namespace (runc
joins the user namespace first, then the others). So a short-lived child, ``python -m
auraed.system.userns``, unshares them all at once and waits while the daemon writes its id maps
and pins its namespaces (auraed.system.pod_namespaces). Then it becomes the namespace's root (host
``uid``) and configures them: only that root may write a user namespace's IPC sysctls (the
daemon would need CAP_SYS_RESOURCE, which these hosts withhold). For a pod that shares a PID
namespace, it then clones that namespace's PID 1 as the daemon's child (CLONE_PARENT), which
confines itself (auraed.system.confine) and becomes the pod's init; the helper ends.

The conversation on the helper's stdin and stdout, one line each way per step:

- helper: ``ready`` once unshared; the daemon writes /proc/<helper>/uid_map and gid_map and pins
  /proc/<helper>/ns/*, then says ``go``;
- helper: ``configured``, or ``refused <JSON: field, message>`` for a sysctl the kernel refused
  (then it exits 1);
- for a pod sharing a PID namespace, helper: ``init <pid>`` once the init is cloned; the daemon
  pins its PID namespace, then says ``done``; the helper exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from auraed.system import confine

CLONE_NEWUSER = 0x10000000
DEFAULT_USERNS_ROOTFS_DIR = Path("/run/aurae-userns")
"""Where a container in its pod's user namespace has its rootfs bound and its idmapped binds
staged (``<id>/rootfs``, ``<id>/mounts/<n>``: the container domain's ``_reachable_rootfs`` and
``_idmapped_binds``): every directory above it must let others pass (x)."""
HELPER_MODULE = "auraed.system.userns_helper"


@dataclasses.dataclass(frozen=True)
class IdMap:
    """The one uid and one gid mapping of a pod's user namespace: ids 0 to length-1 inside are
    ``uid``... (``gid``...) on the host, as the kubelet gives them (one range of each)."""

    uid: int
    uid_length: int
    gid: int
    gid_length: int

    def lines(self) -> tuple[str, str]:
        """/proc/<pid>/uid_map's and gid_map's content."""
        return f"0 {self.uid} {self.uid_length}\n", f"0 {self.gid} {self.gid_length}\n"

    def oci_mappings(self) -> dict[str, list[dict[str, int]]]:
        """The OCI spec's ``linux.uidMappings`` and ``gidMappings``."""
        return {
            "uidMappings": [{"containerID": 0, "hostID": self.uid, "size": self.uid_length}],
            "gidMappings": [{"containerID": 0, "hostID": self.gid, "size": self.gid_length}],
        }

    def unprivileged_id(self) -> int:
        """The id a confined init takes inside: the pause image's, where the mappings reach it."""
        return min(confine.UNPRIVILEGED_ID, self.uid_length - 1, self.gid_length - 1)


def write_id_maps(pid: int, idmap: IdMap) -> None:
    """The mappings of the user namespace ``pid`` made (the daemon, root on the host, may map any
    range for its child)."""
    uid_map, gid_map = idmap.lines()
    Path(f"/proc/{pid}/uid_map").write_text(uid_map)
    Path(f"/proc/{pid}/gid_map").write_text(gid_map)


def helper_argv(
    kinds: tuple[str, ...],
    configuration: Mapping[str, object],
    *,
    init: tuple[str, ...],
    name: str,
    init_id: int,
    mountpoint: Path,
) -> list[str]:
    """How the daemon starts the helper (auraed.system.userns_helper) for a pod owning ``kinds``
    (net, ipc, uts), configured as ``configuration`` says (hostname, sysctls, network: JSON);
    ``init``, the init's program and arguments, when the pod shares a PID namespace, confined
    over ``mountpoint`` (any directory: see confine.confine_thread)."""
    argv = [sys.executable, "-m", HELPER_MODULE, "--kinds", ",".join(kinds)]
    argv += ["--configuration", json.dumps(configuration)]
    if init:
        argv += ["--name", name, "--init-id", str(init_id), "--mountpoint", str(mountpoint), "--", *init]
    return argv
