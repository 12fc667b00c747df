"""orka's protos as we serve and call them: every package, service, message, field name, number
and type as orka's files (dev-sys-do/orka, branch staging) have them, read back from the
descriptors our generated code registers."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from auraed.api import node_agent as na
from auraed.api.scheduler import agent as sa
from auraed.wire import codec
from auraed.wire.descriptors import service_descriptor

F = FieldDescriptor
# message -> [(field, number, type, repeated, proto3 optional)], transcribed from orka's files:
# proto/src/node-agent/agent.proto and proto/src/scheduler/agent.proto.
ORKA_MESSAGES = {
    "node_agent.Workload": [
        ("instance_id", 1, F.TYPE_STRING, False, False),
        ("type", 2, F.TYPE_ENUM, False, False),
        ("image", 3, F.TYPE_STRING, False, False),
        ("environment", 4, F.TYPE_STRING, True, False),
        ("resource_limits", 5, F.TYPE_MESSAGE, False, True),
    ],
    "node_agent.Workload.Resources": [
        ("cpu", 1, F.TYPE_INT32, False, True),
        ("memory", 2, F.TYPE_INT32, False, True),
        ("disk", 3, F.TYPE_INT32, False, True),
    ],
    "node_agent.WorkloadStatus": [
        ("instance_id", 1, F.TYPE_STRING, False, False),
        ("status", 2, F.TYPE_MESSAGE, False, False),
        ("resource_usage", 3, F.TYPE_MESSAGE, False, False),
    ],
    "node_agent.WorkloadStatus.Status": [
        ("code", 1, F.TYPE_UINT32, False, False),
        ("message", 2, F.TYPE_STRING, False, True),
    ],
    "node_agent.WorkloadStatus.Resources": [
        ("cpu", 1, F.TYPE_INT32, False, False),
        ("memory", 2, F.TYPE_INT32, False, False),
        ("disk", 3, F.TYPE_INT32, False, False),
    ],
    "node_agent.WorkloadSignal": [
        ("instance_id", 1, F.TYPE_STRING, False, False),
        ("signal", 2, F.TYPE_ENUM, False, False),
    ],
    "node_agent.Empty": [],
    "scheduler.agent.Empty": [],
    "scheduler.agent.ConnectionRequest": [
        ("id", 1, F.TYPE_STRING, False, False),
        ("port", 2, F.TYPE_UINT32, False, False),
    ],
    "scheduler.agent.DisconnectionNotice": [("id", 1, F.TYPE_STRING, False, False)],
    "scheduler.agent.NodeStatus": [
        ("id", 1, F.TYPE_STRING, False, False),
        ("memory", 2, F.TYPE_MESSAGE, False, False),
        ("cpu_load", 3, F.TYPE_MESSAGE, False, False),
    ],
    "scheduler.agent.NodeStatus.Memory": [
        ("total", 1, F.TYPE_UINT64, False, False),
        ("free", 2, F.TYPE_UINT64, False, False),
    ],
    "scheduler.agent.NodeStatus.CpuLoad": [("load", 1, F.TYPE_DOUBLE, False, False)],
}
ORKA_ENUMS = {
    "node_agent.Workload.Type": {"CONTAINER": 0},
    "node_agent.WorkloadStatus.Status.StatusCode": {"WAITING": 0, "RUNNING": 1, "TERMINATED": 2},
    "node_agent.WorkloadSignal.Signal": {"STOP": 0, "KILL": 1},
}
# service -> {method: (request, reply, client streaming, server streaming)}
ORKA_SERVICES = {
    "node_agent.WorkloadService": {
        "Create": ("node_agent.Workload", "node_agent.WorkloadStatus", False, True),
        "Signal": ("node_agent.WorkloadSignal", "node_agent.Empty", False, False),
    },
    "scheduler.agent.LifecycleService": {
        "JoinCluster": ("scheduler.agent.ConnectionRequest", "scheduler.agent.Empty", False, False),
        "LeaveCluster": ("scheduler.agent.DisconnectionNotice", "scheduler.agent.Empty", False, False),
    },
    "scheduler.agent.StatusUpdateService": {
        "UpdateNodeStatus": ("scheduler.agent.NodeStatus", "scheduler.agent.Empty", True, False),
    },
}


def test_messages_are_orkas_field_for_field() -> None:
    for name, fields in ORKA_MESSAGES.items():
        descriptor = na.Workload.DESCRIPTOR.file.pool.FindMessageTypeByName(name)
        assert descriptor.full_name == name
        ours = [
            (f.name, f.number, f.type, f.is_repeated, f.has_presence and f.containing_oneof is not None)
            for f in descriptor.fields
        ]
        assert ours == fields, name


def test_enums_are_orkas() -> None:
    pool = na.Workload.DESCRIPTOR.file.pool
    for name, values in ORKA_ENUMS.items():
        enum = pool.FindEnumTypeByName(name)
        assert {v.name: v.number for v in enum.values} == values, name


def test_services_are_orkas() -> None:
    for service, methods in ORKA_SERVICES.items():
        descriptor = service_descriptor(service)
        ours = {
            m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
            for m in descriptor.methods
        }
        assert ours == methods, service


def test_a_status_code_is_the_same_varint_as_orkas_enum_typed_copy() -> None:
    """orka's scheduler/controller.proto types Status.code as the enum: field 1, varint, either way."""
    status = na.WorkloadStatusStatus(code=na.WorkloadStatusStatusStatusCode.TERMINATED.value, message="x")
    assert codec.encode(status)[:2] == b"\x08\x02"
    assert sa.ConnectionRequest(id="n", port=50052).port == 50052
