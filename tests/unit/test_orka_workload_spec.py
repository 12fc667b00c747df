"""orka's Workload checked into a WorkloadSpec: the units auraed reads (cpu in millicores, memory
in MiB), and refusals naming the field."""

from __future__ import annotations

import pytest

from auraed.api import node_agent as na
from auraed.containers.request import Resources
from auraed.errors import AuraeError
from auraed.orka.guest import GuestSizing, check_guest_size, guest_size
from auraed.orka.model import Phase, Status, Usage, WorkloadSpec, container_name
from auraed.orka.servicer import status_message, workload_spec
from auraed.vms.guests import GUEST_BASE_MIB
from auraed.vms.model import host_memory_mib
from auraed.wire import codec


def test_limits_are_millicores_and_mebibytes() -> None:
    spec = workload_spec(
        na.Workload(
            instance_id="i-1",
            image="nginx:1",
            environment=["A=1", "B="],
            resource_limits=na.WorkloadResources(cpu=250, memory=64),
        )
    )
    assert spec.env == ("A=1", "B=")
    assert spec.resources() == Resources(cpu_max=25_000, cpu_period=100_000, memory_max=64 * 1024 * 1024)
    assert workload_spec(na.Workload(instance_id="i", image="nginx")).resources() == Resources()


def test_an_unknown_type_is_refused() -> None:
    workload = codec.decode(na.Workload, b"\x0a\x01i\x10\x05\x1a\x05nginx")  # type = 5
    with pytest.raises(AuraeError, match="type: 5 is not a type this node runs"):
        workload_spec(workload)


def test_any_instance_id_gets_a_container_name() -> None:
    names = {container_name(i) for i in ("a", "A", "a/b c", "x" * 253)}
    assert len(names) == 4 and all(len(n) <= 63 and n.startswith("orka-") for n in names)


def test_a_status_carries_its_code_message_and_usage() -> None:
    message = status_message("i", Status(Phase.TERMINATED, "exited with code 3", Usage(5, 6, 7)))
    decoded = codec.decode(na.WorkloadStatus, codec.encode(message))
    assert decoded.status is not None and decoded.resource_usage is not None
    assert (decoded.status.code, decoded.status.message) == (2, "exited with code 3")
    assert (decoded.resource_usage.cpu, decoded.resource_usage.memory, decoded.resource_usage.disk) == (
        5,
        6,
        7,
    )


def test_a_workloads_guest_is_sized_from_its_limits_or_the_default() -> None:
    default = GuestSizing(vcpus=3, memory_mib=500)
    sizes = [
        guest_size(WorkloadSpec("i", "nginx", cpu_millicores=cpu, memory_mib=memory), default)
        for cpu, memory in ((1500, 64), (1000, 6), (10, None), (None, 100))
    ]
    assert sizes == [(2, GUEST_BASE_MIB + 64), (1, GUEST_BASE_MIB + 6), (1, 500), (3, GUEST_BASE_MIB + 100)]
    with pytest.raises(
        AuraeError, match=r"resource_limits.cpu: 256 vCPUs for its guest VM are more than 255"
    ):
        check_guest_size(WorkloadSpec("i", "nginx", cpu_millicores=255_001), default)
    with pytest.raises(AuraeError, match=r"resource_limits\.memory: its guest VM would need"):
        check_guest_size(WorkloadSpec("i", "nginx", memory_mib=host_memory_mib()), default)
    check_guest_size(WorkloadSpec("i", "nginx", cpu_millicores=255_000, memory_mib=64), default)
