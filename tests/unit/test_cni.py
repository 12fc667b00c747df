"""auraed.cni without plugins: conf dirs as libcni reads them, what each plugin is given, results,
the pod's values and plugin errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from auraed.cni.config import find_plugin, load_conf_dir, parse_config_list, read_config_file
from auraed.cni.errors import CniError
from auraed.cni.invoke import PluginOutput, RuntimeConf, plugin_config, plugin_env, plugin_failure
from auraed.cni.model import Bandwidth, IpRange, PodNetwork, PortMapping, parse_bin_dirs
from auraed.cni.result import parse_result
from auraed.errors import ErrorKind

BRIDGE = {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local"}}
PORTMAP = {"type": "portmap", "capabilities": {"portMappings": True}}


def conflist(name: str = "net", version: str = "1.0.0", plugins: list[Any] | None = None) -> dict[str, Any]:
    return {"cniVersion": version, "name": name, "plugins": plugins or [BRIDGE, PORTMAP]}


def write(directory: Path, name: str, doc: Any) -> Path:
    path = directory / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# ------------------------------------------------------------------------------------ conf dirs


def test_files_are_read_in_lexical_order_and_the_first_valid_is_the_default(tmp_path: Path) -> None:
    write(tmp_path, "20-b.conflist", conflist("b"))
    write(tmp_path, "10-a.conflist", conflist("a"))
    write(tmp_path, "05-broken.conflist", "{not json")
    write(tmp_path, "30-c.json", {"cniVersion": "0.4.0", "name": "c", "type": "bridge"})
    write(tmp_path, "README", "not a config")
    (tmp_path / "40-dir.conf").mkdir()
    conf = load_conf_dir(tmp_path)
    assert [n.name for n in conf.networks] == ["a", "b", "c"]
    assert conf.default is not None and conf.default.name == "a"
    assert [Path(s.path).name for s in conf.skipped] == ["05-broken.conflist", "40-dir.conf"]
    assert "not JSON" in conf.skipped[0].reason
    assert "not a regular file" in conf.skipped[1].reason


def test_a_conf_file_is_wrapped_into_a_list_of_one(tmp_path: Path) -> None:
    single = {"cniVersion": "0.3.1", "name": "single", "type": "bridge", "bridge": "cni0"}
    network = read_config_file(write(tmp_path, "10.conf", single))
    assert (network.name, network.cni_version) == ("single", "0.3.1")
    assert [p.type for p in network.plugins] == ["bridge"]
    assert network.raw == {"cniVersion": "0.3.1", "name": "single", "plugins": [single]}
    assert not network.supports_check and not network.deletes_with_result


def test_a_list_in_a_conf_file_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has 'plugins' but no 'type'.*\.conflist"):
        read_config_file(write(tmp_path, "10.conf", conflist()))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"cniVersion": "0.2.0"}, "cniVersion '0.2.0' is not supported"),
        ({"cniVersion": ""}, "'cniVersion' must be a non-empty string"),
        ({"name": "bad name"}, "name 'bad name' must be letters"),
        ({"name": None}, "'name' must be a non-empty string"),
        ({"plugins": []}, "'plugins' must be a non-empty list"),
        ({"plugins": [{"bridge": "x"}]}, r"plugins\[0\]: 'type' must be a non-empty string"),
        ({"plugins": [{"type": "../bin/sh"}]}, "must be a plugin's file name"),
        ({"plugins": ["bridge"]}, r"plugins\[0\] must be an object"),
        ({"plugins": [{"type": "portmap", "capabilities": {"portMappings": "yes"}}]}, "capabilities must"),
        ({"disableCheck": "maybe"}, "disableCheck must be a boolean"),
    ],
)
def test_invalid_lists_name_the_problem(change: dict[str, Any], problem: str) -> None:
    doc = {**conflist(), **change}
    with pytest.raises(ValueError, match=problem):
        parse_config_list(doc, "/etc/cni/net.d/10.conflist")


def test_capabilities_and_disable_check() -> None:
    doc = {**conflist(), "disableCheck": "true"}
    doc["plugins"] = [BRIDGE, {"type": "portmap", "capabilities": {"portMappings": True, "bandwidth": False}}]
    network = parse_config_list(doc, "x")
    assert network.disable_check and network.supports_check
    assert network.plugins[1].capabilities == frozenset({"portMappings"})
    assert network.plugins[0].capabilities == frozenset()


def test_a_missing_conf_dir_holds_no_network(tmp_path: Path) -> None:
    conf = load_conf_dir(tmp_path / "absent")
    assert conf.networks == () and conf.skipped == () and conf.default is None


def test_plugins_are_found_in_bin_dir_order(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "bridge").write_text("not executable")
    (second / "bridge").write_text("#!/bin/sh\n")
    (second / "bridge").chmod(0o755)
    (first / "loopback").mkdir()
    assert find_plugin("bridge", [first, second]) == second / "bridge"
    assert find_plugin("loopback", [first, second]) is None
    assert parse_bin_dirs("/usr/lib/cni:/opt/cni/bin") == (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
    with pytest.raises(CniError, match="cni_bin_dirs"):
        parse_bin_dirs("relative:/opt/cni/bin")


# ----------------------------------------------------------------------------- plugin invocation


def test_each_plugin_gets_name_version_prev_result_and_only_its_capabilities() -> None:
    network = parse_config_list(conflist("pods"), "x")
    caps = {"portMappings": [{"hostPort": 80, "containerPort": 8080, "protocol": "tcp"}], "bandwidth": {}}
    prev = {"cniVersion": "1.0.0", "ips": []}
    bridge = plugin_config(network, network.plugins[0], None, caps)
    assert bridge == {**BRIDGE, "name": "pods", "cniVersion": "1.0.0"}
    portmap = plugin_config(network, network.plugins[1], prev, caps)
    assert portmap["prevResult"] == prev
    assert portmap["runtimeConfig"] == {"portMappings": caps["portMappings"]}


def test_the_environment_carries_the_cni_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CNI_COMMAND", "stale")
    monkeypatch.setenv("CNI_STALE", "1")
    pod = PodNetwork("sb1", "/run/netns/x", pod_name="web", pod_namespace="default", pod_uid="u-1")
    runtime = RuntimeConf(pod.sandbox_id, pod.netns, pod.ifname, pod.cni_args())
    env = plugin_env("ADD", runtime, (Path("/usr/lib/cni"), Path("/opt/cni/bin")))
    assert env["CNI_COMMAND"] == "ADD" and "CNI_STALE" not in env
    assert (env["CNI_CONTAINERID"], env["CNI_NETNS"], env["CNI_IFNAME"]) == ("sb1", "/run/netns/x", "eth0")
    assert env["CNI_ARGS"] == (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=sb1;K8S_POD_UID=u-1"
    )
    assert env["CNI_PATH"] == "/usr/lib/cni:/opt/cni/bin"
    assert env["PATH"]


def test_a_plugin_error_is_mapped_by_its_code() -> None:
    config = PluginOutput(1, b'{"code": 7, "msg": "bad config", "details": "no bridge"}', b"")
    error = plugin_failure("plugin bridge ADD", config)
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    assert error.message == "plugin bridge ADD failed: bad config: no bridge (CNI error code 7)"
    later = plugin_failure("x", PluginOutput(1, b'{"code": 11, "msg": "busy"}', b""))
    assert later.kind is ErrorKind.UNAVAILABLE
    own = plugin_failure("x", PluginOutput(1, b'{"code": 999, "msg": "invalid CIDR"}', b""))
    assert own.kind is ErrorKind.INTERNAL and "invalid CIDR" in own.message
    crashed = plugin_failure("x", PluginOutput(2, b"", b"panic: boom\n"))
    assert crashed.kind is ErrorKind.INTERNAL
    assert crashed.message == "x failed with exit status 2: panic: boom"


# ------------------------------------------------------------------------------------- results


RESULT_1_0 = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "cni0", "mac": "aa:bb:cc:dd:ee:01"},
        {"name": "veth1", "mac": "aa:bb:cc:dd:ee:02"},
        {"name": "eth0", "mac": "aa:bb:cc:dd:ee:03", "sandbox": "/run/netns/x"},
    ],
    "ips": [
        {"address": "fd00::5/64", "interface": 2},
        {"address": "10.22.0.5/24", "gateway": "10.22.0.1", "interface": 2},
        {"address": "10.99.0.1/24", "interface": 0},
    ],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.22.0.1"}],
    "dns": {"nameservers": ["10.22.0.1"], "search": ["svc.local"]},
}


def test_a_result_is_typed_and_its_pod_ips_come_ipv4_first() -> None:
    result = parse_result(RESULT_1_0, "1.0.0")
    assert [i.name for i in result.interfaces] == ["cni0", "veth1", "eth0"]
    assert str(result.ips[1].gateway) == "10.22.0.1"
    assert str(result.routes[0].dst) == "0.0.0.0/0"
    assert result.dns.nameservers == ("10.22.0.1",)
    assert result.pod_ips("eth0") == ["10.22.0.5", "fd00::5"]
    assert result.raw is RESULT_1_0


def test_a_0_4_0_result_and_one_without_a_version() -> None:
    old = {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.1.0.2/16", "gateway": "10.1.0.1"}]}
    assert parse_result(old, "0.4.0").pod_ips("eth0") == ["10.1.0.2"]  # no interface: counted
    assert parse_result({"ips": []}, "0.3.1").cni_version == "0.3.1"


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ({"cniVersion": "0.2.0", "ip4": {}}, "result version '0.2.0'"),
        ({"ips": [{"address": "10.0.0.1"}], "interfaces": "eth0"}, "'interfaces' must be a list"),
        ({"ips": [{"address": "nonsense"}]}, r"ips\[0\].address 'nonsense'"),
        ({"ips": [{"address": "10.0.0.2/24", "interface": "0"}]}, "must be an index"),
        ({"routes": [{"dst": "10.0.0.0/8", "gw": "x"}]}, r"routes\[0\].gw"),
        ({"dns": {"nameservers": "8.8.8.8"}}, "nameservers must be a list"),
    ],
)
def test_a_bad_result_names_the_problem(doc: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_result(doc, "1.0.0")


# --------------------------------------------------------------------------------- pod values


def test_capability_args() -> None:
    pod = PodNetwork(
        "sb",
        "/run/netns/sb",
        port_mappings=(PortMapping(8080, 80), PortMapping(5353, 53, "udp", "127.0.0.1")),
        bandwidth=Bandwidth(ingress_rate=1000, ingress_burst=2000),
        ip_ranges=((IpRange("10.5.0.0/24", gateway="10.5.0.1"),),),
    )
    assert pod.capability_args() == {
        "portMappings": [
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
            {"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "127.0.0.1"},
        ],
        "bandwidth": {"ingressRate": 1000, "ingressBurst": 2000, "egressRate": 0, "egressBurst": 0},
        "ipRanges": [[{"subnet": "10.5.0.0/24", "gateway": "10.5.0.1"}]],
    }
    assert PodNetwork("sb", "/run/netns/sb").capability_args() == {}


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PodNetwork("-sb", "/n"), "sandbox_id"),
        (lambda: PodNetwork("sb/1", "/n"), "sandbox_id"),
        (lambda: PodNetwork("sb", "relative"), "netns"),
        (lambda: PodNetwork("sb", "/n", ifname="eth0:1"), "ifname"),
        (lambda: PodNetwork("sb", "/n", ifname="a-very-long-name0"), "ifname"),
        (lambda: PodNetwork("sb", "/n", pod_name="a;K8S_POD_UID=x"), "pod_name"),
        (lambda: PortMapping(0, 80), "port_mappings.host_port"),
        (lambda: PortMapping(80, 70000), "port_mappings.container_port"),
        (lambda: PortMapping(80, 80, "icmp"), "port_mappings.protocol"),
        (lambda: PortMapping(80, 80, "tcp", "localhost"), "port_mappings.host_ip"),
        (lambda: Bandwidth(egress_rate=-1), "bandwidth.egress_rate"),
        (lambda: IpRange("10.0.0.0/33"), "ip_ranges.subnet"),
    ],
)
def test_bad_pod_values_name_their_field(make: Any, field: str) -> None:
    with pytest.raises(CniError) as caught:
        make()
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert caught.value.message.startswith(f"{field}: ")
