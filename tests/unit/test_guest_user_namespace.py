"""What a guest takes as a pod's user namespace (``config.user_namespace``: a vm pod with
hostUsers: false): one uid and one gid range, never of its root, within 32-bit ids; and never
with the machine's IPC namespace, which the pod's user namespace does not own."""

from __future__ import annotations

from pathlib import Path

import pytest

from auraed.api.aurae.containers import v0 as pb
from auraed.containers.errors import ContainerError
from auraed.containers.pid_groups import PidGroups
from auraed.containers.servicer import container_sandbox, id_mapping
from auraed.errors import ErrorKind
from auraed.system.userns import IdMap


def message(**fields: int) -> pb.IdMapping:
    values = {"uid": 1_000_000, "uid_length": 65536, "gid": 2_000_000, "gid_length": 1000}
    return pb.IdMapping(**(values | fields))


def test_a_mapping_becomes_the_pods_idmap() -> None:
    assert id_mapping(message()) == IdMap(1_000_000, 65536, 2_000_000, 1000)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"uid_length": 0}, "config.user_namespace.uid_length"),
        ({"gid_length": 0}, "config.user_namespace.gid_length"),
        ({"uid": 2**32 - 10, "uid_length": 11}, "config.user_namespace.uid_length"),
        ({"uid": 0}, "config.user_namespace.uid"),
        ({"gid": 0}, "config.user_namespace.gid"),
    ],
)
def test_anything_else_is_refused_naming_the_field(fields: dict[str, int], field: str) -> None:
    with pytest.raises(ContainerError) as error:
        id_mapping(message(**fields))
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT
    assert error.value.message.startswith(f"{field}:"), error.value.message


def test_the_machines_ipc_namespace_is_refused_with_a_user_namespace(tmp_path: Path) -> None:
    config = pb.ContainerConfig(name="c", image="i", host_ipc=True, user_namespace=message())
    with pytest.raises(ContainerError) as error:
        container_sandbox(config, PidGroups(tmp_path), None)
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT
    assert error.value.message.startswith("config.host_ipc:"), error.value.message
    assert list(tmp_path.iterdir()) == []  # nothing made
