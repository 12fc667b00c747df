"""runtime.v1 RuntimeService's own RPCs on the kubelet's socket: Version, Status, RuntimeConfig;
and CheckpointContainer, which auraed refuses."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from auraed.api.runtime import v1 as cri
from auraed.client import ClientError
from tests.conftest import DaemonFactory
from tests.support.cni import cni_network
from tests.support.cri import RUNTIME_SERVICE, cri_client


async def status(daemon_factory: DaemonFactory, *args: str) -> cri.StatusResponse:
    daemon = daemon_factory(*args)
    async with cri_client(daemon) as client:
        reply: cri.StatusResponse = await client.call(RUNTIME_SERVICE, "Status", cri.StatusRequest())
        return reply


def conditions(reply: cri.StatusResponse) -> dict[str, cri.RuntimeCondition]:
    assert reply.status is not None
    return {c.type: c for c in reply.status.conditions}


async def test_version_names_the_runtime_and_the_api(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    async with cri_client(daemon) as client:
        reply = await client.call(RUNTIME_SERVICE, "Version", cri.VersionRequest(version="0.1.0"))
    assert (reply.runtime_name, reply.runtime_api_version) == ("auraed", "v1")
    assert reply.runtime_version and reply.version


async def test_the_socket_is_owner_only(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    mode = daemon.cri_socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


async def test_network_not_ready_without_a_cni_config_says_why(daemon_factory: DaemonFactory) -> None:
    found = conditions(await status(daemon_factory))
    assert found["RuntimeReady"].status is True
    network = found["NetworkReady"]
    assert network.status is False and network.reason == "NetworkPluginNotReady"
    assert "net.d" in network.message


async def test_network_not_ready_when_a_plugin_is_missing(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    with cni_network(tmp_path) as network:
        network.write(network.conflist(extra=({"type": "no-such-plugin"},)))
        found = conditions(await status(daemon_factory, "--cni-conf-dir", str(network.conf_dir)))
    assert found["NetworkReady"].status is False and "no-such-plugin" in found["NetworkReady"].message


async def test_ready_with_a_cni_network_and_the_handlers_listed(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    with cni_network(tmp_path) as network:
        network.write(network.conflist())
        reply = await status(daemon_factory, "--cni-conf-dir", str(network.conf_dir))
    found = conditions(reply)
    assert found["RuntimeReady"].status and found["NetworkReady"].status
    # critest and kubelets look features up by the handler a pod names: "" when it names none
    # (the default, cell); vm pods' recursive read-only mounts are made so by their share, and
    # their user namespaces idmapped by it.
    assert [h.name for h in reply.runtime_handlers] == ["", "cell", "vm"]
    vm = reply.runtime_handlers[2].features
    assert vm is not None and vm.recursive_read_only_mounts and vm.user_namespaces


async def test_runtime_config_is_cgroupfs(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    async with cri_client(daemon) as client:
        reply = await client.call(RUNTIME_SERVICE, "RuntimeConfig", cri.RuntimeConfigRequest())
    assert reply.linux.cgroup_driver == cri.CgroupDriver.CGROUPFS


async def test_update_runtime_config_takes_a_pod_cidr_and_refuses_garbage(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()

    def request(cidr: str) -> cri.UpdateRuntimeConfigRequest:
        return cri.UpdateRuntimeConfigRequest(
            runtime_config=cri.RuntimeConfig(network_config=cri.NetworkConfig(pod_cidr=cidr))
        )

    async with cri_client(daemon) as client:
        await client.call(RUNTIME_SERVICE, "UpdateRuntimeConfig", request("10.88.0.0/16,fd00::/64"))
        with pytest.raises(ClientError) as error:
            await client.call(RUNTIME_SERVICE, "UpdateRuntimeConfig", request("not-a-cidr"))
    assert error.value.code == "INVALID_ARGUMENT" and "pod_cidr" in error.value.message
    assert "the kubelet set the pod CIDR to 10.88.0.0/16,fd00::/64" in daemon.log()


async def test_checkpoint_container_is_refused_saying_why(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    request = cri.CheckpointContainerRequest(container_id="any", location="/tmp/checkpoint.tar")
    async with cri_client(daemon) as client:
        with pytest.raises(ClientError) as error:
            await client.call(RUNTIME_SERVICE, "CheckpointContainer", request)
    assert error.value.code == "UNIMPLEMENTED"
    assert error.value.message == "checkpointing containers is not supported by auraed"
