"""Which namespace a pod's sysctl belongs to, and its /proc/sys file (sysctl(8)'s spelling)."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.errors import ErrorKind
from auraed.system.pod_namespaces import IPC, NET, UTS, NamespaceError, sysctl_namespace, sysctl_path


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("net.ipv4.ip_forward", "net/ipv4/ip_forward"),
        ("net/ipv4/ip_forward", "net/ipv4/ip_forward"),
        ("net.ipv4.conf.eth0/100.rp_filter", "net/ipv4/conf/eth0.100/rp_filter"),
        ("net/ipv4/conf/eth0.100/rp_filter", "net/ipv4/conf/eth0.100/rp_filter"),
        ("fs.mqueue.msg_max", "fs/mqueue/msg_max"),
    ],
)
def test_sysctl_paths(name: str, path: str) -> None:
    assert sysctl_path(name) == Path("/proc/sys") / path


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("net.core.somaxconn", NET),
        ("net/ipv4/conf/eth0.100/rp_filter", NET),
        ("kernel.shm_rmid_forced", IPC),
        ("kernel.shmmax", IPC),
        ("kernel.msgmnb", IPC),
        ("kernel.sem", IPC),
        ("fs.mqueue.msg_max", IPC),
        ("kernel.domainname", UTS),
    ],
)
def test_namespaced_sysctls(name: str, kind: str) -> None:
    assert sysctl_namespace(name) == kind


@pytest.mark.parametrize(
    "name", ["kernel.hostname", "kernel.pid_max", "vm.overcommit_memory", "fs.file-max", "kernel.shmxyz"]
)
def test_sysctls_of_the_host_are_refused(name: str) -> None:
    with pytest.raises(NamespaceError) as caught:
        sysctl_namespace(name)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert caught.value.message.startswith(f"sysctls.{name}: is not namespaced")


@pytest.mark.parametrize(
    "name", ["", "net..ipv4", "net.ipv4.conf.../x", "net/../../etc", "net.ipv4 .x", "net.*"]
)
def test_malformed_names(name: str) -> None:
    with pytest.raises(NamespaceError, match="is not a sysctl name"):
        sysctl_path(name)
