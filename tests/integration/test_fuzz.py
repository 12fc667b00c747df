"""Generated and malformed requests to every RPC: the daemon never dies, never blames itself
(UNKNOWN/INTERNAL) for a client's mistake, and leaks nothing."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auraed.api.aurae.cells import v0 as cells_pb
from auraed.api.aurae.vms import v0 as vms_pb
from auraed.system.monitor_launcher import SPARE_NAME
from auraed.wire.descriptors import message_class, service_descriptor
from tests.conftest import DaemonProcess

MONITOR_EXIT_GRACE = 5.0

SERVICES = [
    "aurae.cells.v0.CellService",
    "aurae.containers.v0.ContainerService",
    "aurae.observe.v0.ObserveService",
    "aurae.discovery.v0.DiscoveryService",
    "aurae.vms.v0.VmService",
    "aurae.network.v0.NetworkService",
]
METHODS = [(service, method) for service in SERVICES for method in service_descriptor(service).methods]
CLIENT_MISTAKE_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # our own deadline on endless streams
    grpc.StatusCode.UNAVAILABLE,  # a registry the request names is not reachable (no network here)
    grpc.StatusCode.PERMISSION_DENIED,  # a registry refused
}
NAMES = st.sampled_from(["fz", "fz/a", "fz/a/b", "fz2", "aurae", "", "-x", "A", "a" * 64, "x/../y", "a//b"])
# Executables are real processes: only harmless programs, or ones that do not exist.
PROGRAMS = st.sampled_from(["true", "/bin/true", "false", "echo", "/nonexistent/program", ""])
# VM files: missing, relative, or present but not what they claim to be (Allocate checks they exist).
FILES = st.sampled_from(["", "/nonexistent/vmlinuz", "relative/vmlinuz", "/bin/true", "/etc/hostname"])
SHELL = st.sampled_from(["", "true", "echo fuzz", "exit 3", "echo err >&2"])
INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.name in ("name", "cell_name", "executable_name", "workload"):
        return NAMES | st.text(max_size=80)
    if field.name in ("kernel", "initramfs", "root_disk", "path"):
        return FILES | st.text(max_size=80)
    if field.name == "role":
        return st.sampled_from(["", "guest", "host", "nested", "bogus"])
    if field.name == "backend":
        return st.sampled_from(["", "qemu", "cloud-hypervisor", "firecracker"])
    if field.name == "shell_command":
        return SHELL
    if field.name == "args":
        return PROGRAMS
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=120)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=256)
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=False)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(0, 4)
    low, high = INT_RANGES[field.type]
    interesting = st.sampled_from([low, 0, 1, 1000, 4096, 10_000, 100_000, 1 << 20, 64 << 20, high])
    return interesting | st.integers(low, high)


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    cls = message_class(descriptor.full_name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        attribute = _attribute_name(cls, field)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            assert field.message_type is not None
            if field.message_type.GetOptions().map_entry:
                fields[attribute] = st.dictionaries(st.text(max_size=40), st.text(max_size=40), max_size=4)
                continue
            if depth >= 3:
                continue
            value = message_strategy(field.message_type, depth + 1)
        else:
            value = _scalar(field)
        if field.is_repeated:
            value = st.lists(value, max_size=4)
        elif field.has_presence:
            value = st.none() | value
        fields[attribute] = value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kwargs: cls(**kwargs))


def _attribute_name(cls: Any, field: FieldDescriptor) -> str:
    return field.name if field.name in cls.__dataclass_fields__ else field.name + "_"


def request_bytes(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    return message_strategy(descriptor).map(bytes) | st.binary(max_size=64)


@pytest.fixture
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    config = daemon.client_config()
    credentials = grpc.ssl_channel_credentials(
        config.ca_crt.read_bytes(), config.client_key.read_bytes(), config.client_crt.read_bytes()
    )
    options = [("grpc.ssl_target_name_override", config.server_name)]
    with grpc.secure_channel(config.address, credentials, options=options) as channel:
        yield channel


def _call(channel: grpc.Channel, service: str, method: Any, payload: bytes) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(payload, timeout=0.5):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("service", "method"), METHODS, ids=[f"{s.rsplit('.', 1)[1]}.{m.name}" for s, m in METHODS]
)
def test_generated_requests_never_hurt_the_daemon(
    daemon: DaemonProcess, channel: grpc.Channel, service: str, method: Any
) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=request_bytes(method.input_type))
    def check(payload: bytes) -> None:
        code = _call(channel, service, method, payload)
        assert code in CLIENT_MISTAKE_OK, (
            f"{method.name} answered {code} to {payload!r}\n{daemon.log()[-3000:]}"
        )

    check()
    assert daemon.process is not None and daemon.process.poll() is None, daemon.log()[-3000:]
    _free_everything(channel)
    _assert_nothing_left(daemon)


def _free_everything(channel: grpc.Channel) -> None:
    vms = vms_pb.VmServiceListResponse.parse(
        channel.unary_unary("/aurae.vms.v0.VmService/List")(bytes(vms_pb.VmServiceListRequest()))
    )
    for status in vms.vms:
        assert status.vm is not None
        free_vm = vms_pb.VmServiceFreeRequest(name=status.vm.name, timeout_ms=1000)
        channel.unary_unary("/aurae.vms.v0.VmService/Free")(bytes(free_vm), timeout=60)
    listing = cells_pb.CellServiceListResponse.parse(
        channel.unary_unary("/aurae.cells.v0.CellService/List")(bytes(cells_pb.CellServiceListRequest()))
    )
    for node in listing.cells:
        assert node.cell is not None
        request = cells_pb.CellServiceFreeRequest(cell_name=node.cell.name, grace_period_ms=1000)
        channel.unary_unary("/aurae.cells.v0.CellService/Free")(bytes(request), timeout=60)


def _assert_nothing_left(daemon: DaemonProcess) -> None:
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        base = hierarchy / daemon.cgroup_base
        if base.is_dir():
            assert [p.name for p in base.iterdir() if p.is_dir()] == [], f"cgroups left in {base}"
    # A freed cell's monitor writes its exit record after its process ended, then exits itself:
    # give it a moment rather than catch it on its way out.
    deadline = time.monotonic() + MONITOR_EXIT_GRACE
    while _monitors_left(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _monitors_left(daemon) == [], "monitors are left"
    links = subprocess.run(["ip", "-o", "-d", "link", "show"], capture_output=True, text=True, check=True)
    assert f"alias auraed-vm {daemon.root}" not in links.stdout, "a VM's tap is left"


def _monitors_left(daemon: DaemonProcess) -> list[int]:
    """Monitors are forked by the daemon's monitor launcher and carry its command line (which
    names the daemon's runtime dir); the launcher itself is the daemon's child, a monitor is not,
    and the launcher's spare (not yet a monitor) has a name of its own."""
    assert daemon.process is not None
    runtime_dir = str(daemon.root / "run").encode()
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                stat = (proc / "stat").read_text()
                spare = (proc / "comm").read_text().strip() == SPARE_NAME
            except OSError:
                continue
            ours = runtime_dir in cmdline and b"auraed.system.monitor" in cmdline and not spare
            if ours and int(stat[stat.rindex(")") + 2 :].split()[1]) != daemon.process.pid:
                left.append(int(proc.name))
    return left
