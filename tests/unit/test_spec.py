"""auraed.containers.oci_spec: OCI runtime specs from images and requests, without a runtime."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auraed.containers.oci_spec import (
    ALL_CAPABILITIES,
    DEFAULT_CAPABILITIES,
    DEFAULT_MASKED_PATHS,
    DEFAULT_PATH,
    DEFAULT_READONLY_PATHS,
    ONLINE_CPUS,
    HostFacts,
    ImageRuntimeConfig,
    build_spec,
    default_seccomp_profile,
    ensure_working_dir,
    exec_process,
    image_runtime_config,
    resolve_user,
    resource_limits,
    stop_signal,
)
from auraed.containers.request import (
    MAX_CFS_QUOTA_US,
    MAX_HOOK_TIMEOUT_SECONDS,
    PID_MAX_LIMIT,
    UNLIMITED,
    ContainerRequest,
    Hook,
    Hooks,
    Mount,
    Resources,
    Rlimit,
    Security,
    SpecError,
)
from auraed.containers.sandbox import HOST_LOCAL, SandboxContext, SharedNamespaces
from auraed.system.cgroupfs import cpu_weight_to_shares, parse_cpu_list

HOST = HostFacts(
    oom_score_adj=0,
    capabilities=frozenset(ALL_CAPABILITIES),
    rlimit_hard={},
    can_raise_rlimits=True,
    machine="x86_64",
    online_cpus=frozenset({0, 1}),
    online_memory_nodes=frozenset({0}),
)
IMAGE = ImageRuntimeConfig(cmd=("sh",))
PASSWD = """root:x:0:0:root:/root:/bin/sh
# a comment
broken line
app:x:1000:1000:app:/home/app:/bin/sh
web:x:1001:1001::/:/bin/false
"""
GROUP = """root:x:0:
app:x:1000:
web:x:1001:
audio:x:29:app,web
video:x:44:web
staff:x:50:app
"""


def make_rootfs(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    (root / "tmp").mkdir()
    return root


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return make_rootfs(tmp_path / "rootfs")


def build(
    rootfs: Path, request: ContainerRequest | None = None, image: ImageRuntimeConfig = IMAGE, **kwargs: Any
) -> dict[str, Any]:
    kwargs.setdefault("host", HOST)
    spec = build_spec(image, request or ContainerRequest(name="web"), rootfs, "/aurae/web", **kwargs)
    json.dumps(spec)  # always serialisable
    return spec


def joining_netns(path: str) -> SandboxContext:
    return SandboxContext(namespaces=SharedNamespaces(network=Path(path)))


def error(func: Any, *args: Any, **kwargs: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        func(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------- image config


def test_image_config_from_the_whole_document() -> None:
    image = image_runtime_config(
        {
            "architecture": "amd64",
            "config": {
                "Entrypoint": ["/entry"],
                "Cmd": ["serve", "--port", "80"],
                "Env": ["A=1", "PATH=/bin"],
                "WorkingDir": "/srv",
                "User": "app",
                "StopSignal": "SIGINT",
                "Volumes": {"/data": {}, "/cache": {}},
                "ExposedPorts": {"80/tcp": {}},
                "Labels": {"k": "v"},
            },
        }
    )
    assert image.entrypoint == ("/entry",)
    assert image.cmd == ("serve", "--port", "80")
    assert image.env == ("A=1", "PATH=/bin")
    assert image.working_dir == "/srv"
    assert image.user == "app"
    assert image.stop_signal == "SIGINT"
    assert image.volumes == ("/data", "/cache")
    assert image.exposed_ports == ("80/tcp",)
    assert image.labels == {"k": "v"}


def test_image_config_nulls_and_inner_object() -> None:
    assert image_runtime_config({"config": None}) == ImageRuntimeConfig()
    assert image_runtime_config({"Entrypoint": None, "Cmd": ["x"]}).cmd == ("x",)
    assert image_runtime_config({"os": "linux"}) == ImageRuntimeConfig()


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"config": {"Cmd": "sh"}}, "image config.Cmd"),
        ({"config": {"Entrypoint": [1]}}, "image config.Entrypoint"),
        ({"config": {"Env": ["NOEQUALS"]}}, "image config.Env[0]"),
        ({"config": {"User": 0}}, "image config.User"),
        ({"config": {"Volumes": "/data"}}, "image config.Volumes"),
        ({"config": {"Labels": {"a": 1}}}, "image config.Labels"),
        ({"config": []}, "image config.config"),
    ],
)
def test_image_config_errors_name_the_field(document: dict[str, Any], field: str) -> None:
    exc = error(image_runtime_config, document)
    assert exc.kind == "invalid"
    assert exc.message.startswith(field)


@pytest.mark.parametrize(
    "document",
    [
        {"config": {"Cmd": "sh"}},
        {"config": {"Entrypoint": [1]}},
        {"config": {"User": 0}},
        {"config": {"Volumes": "/data"}},
        {"config": {"Labels": {"a": 1}}},
        {"config": []},
        [],
    ],
)
def test_a_lenient_image_config_never_raises(document: Any) -> None:
    assert image_runtime_config(document, lenient=True) == ImageRuntimeConfig()


def test_a_lenient_image_config_keeps_what_it_can_describe() -> None:
    # Describing an image (ListImages) must not fail on a config Create would refuse.
    config = {
        "Env": ["PATH=/bin", "FOO", 3],
        "Cmd": ["sh", None],
        "Labels": {"good": "yes", "bad": 1},
        "User": "app\ud800",
        "Volumes": {"/data": {}},
    }
    described = image_runtime_config({"config": config}, lenient=True)
    assert described.env == ("PATH=/bin", "FOO")
    assert described.cmd == ("sh",)
    assert described.labels == {"good": "yes"}
    assert described.user == "app?"  # a lone surrogate cannot go out as a protobuf string
    assert described.volumes == ("/data",)
    assert error(image_runtime_config, {"config": config}).kind == "invalid"  # Create still refuses it


# ----------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("entrypoint", "cmd", "command", "args", "expected"),
    [
        ((), ("sh",), (), (), ["sh"]),
        (("/entry",), ("a", "b"), (), (), ["/entry", "a", "b"]),
        (("/entry",), ("a",), (), ("x",), ["/entry", "x"]),
        (("/entry",), ("a",), ("/other",), (), ["/other"]),  # command drops the image's Cmd
        (("/entry",), ("a",), ("/other",), ("y",), ["/other", "y"]),
        ((), ("a",), (), ("ls", "-l"), ["ls", "-l"]),
    ],
)
def test_docker_argument_semantics(
    rootfs: Path,
    *,
    entrypoint: tuple[str, ...],
    cmd: tuple[str, ...],
    command: tuple[str, ...],
    args: tuple[str, ...],
    expected: list[str],
) -> None:
    image = ImageRuntimeConfig(entrypoint=entrypoint, cmd=cmd)
    spec = build(rootfs, ContainerRequest(name="web", command=command, args=args), image)
    assert spec["process"]["args"] == expected


def test_no_command_is_invalid(rootfs: Path) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web"), ImageRuntimeConfig())
    assert exc.kind == "invalid"
    assert "no command" in exc.message


def test_nul_in_an_argument_names_it(rootfs: Path) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web", args=("ok", "b\0d")))
    assert exc.message.startswith("args[1]")


# ---------------------------------------------------------------------------------------- env


def test_env_merges_by_key_and_adds_path(rootfs: Path) -> None:
    image = ImageRuntimeConfig(cmd=("sh",), env=("A=1", "B=2"))
    spec = build(rootfs, ContainerRequest(name="web", env=("B=3", "C=x=y")), image)
    assert spec["process"]["env"] == ["A=1", "B=3", "C=x=y", f"PATH={DEFAULT_PATH}"]


def test_env_keeps_the_image_path_and_adds_term_for_a_tty(rootfs: Path) -> None:
    image = ImageRuntimeConfig(cmd=("sh",), env=("PATH=/opt/bin",))
    spec = build(rootfs, ContainerRequest(name="web", tty=True), image)
    assert spec["process"]["env"] == ["PATH=/opt/bin", "TERM=xterm"]
    assert spec["process"]["terminal"] is True


@pytest.mark.parametrize("entry", ["NOVALUE", "=x", "A\0=b"])
def test_bad_env_entries_name_the_field(rootfs: Path, entry: str) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web", env=("OK=1", entry)))
    assert exc.kind == "invalid"
    assert exc.message.startswith("env[1]")


def test_exec_process_overrides_the_containers_own() -> None:
    defaults = {"args": ["sleep", "1"], "env": ["PATH=/bin", "A=1"], "cwd": "/", "terminal": False}
    process = exec_process(defaults, ["sh", "-c", "env"], ["A=2", "B=3"], "/srv/./x/")
    assert process == {
        "args": ["sh", "-c", "env"],
        "env": ["PATH=/bin", "A=2", "B=3"],
        "cwd": "/srv/x",
        "terminal": False,
    }
    assert exec_process(defaults, ["true"], [], "") == {**defaults, "args": ["true"]}
    assert defaults["args"] == ["sleep", "1"]  # not changed in place


@pytest.mark.parametrize(
    ("command", "env", "working_dir", "text"),
    [
        ([], [], "", "start.command: is required"),
        ([""], [], "", "start.command[0]: the program to run is an empty string"),
        (["sh\0x"], [], "", "start.command[0]: contains a NUL character"),
        (["sh", "a\0"], [], "", "start.command[1]: contains a NUL character"),
        (["sh"], ["FOO"], "", "start.env[0]: 'FOO' is not KEY=VALUE"),
        (["sh"], ["A=1", "B=\0"], "", "start.env[1]: contains a NUL character"),
        (["sh"], [], "rel", "start.working_dir: 'rel' is not an absolute path"),
        (["sh"], [], "/a/../b", "start.working_dir: '/a/../b' must not contain '..'"),
    ],
)
def test_exec_process_errors_name_the_field(
    command: list[str], env: list[str], working_dir: str, text: str
) -> None:
    exc = error(exec_process, {"env": ["PATH=/bin"]}, command, env, working_dir)
    assert (exc.kind, exc.message) == ("invalid", text)


# -------------------------------------------------------------------------------------- users


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ("", (0, 0, [])),
        ("root", (0, 0, [])),
        ("app", (1000, 1000, [29, 50])),
        ("web", (1001, 1001, [29, 44])),
        ("1000", (1000, 1000, [29, 50])),
        ("1000:1000", (1000, 1000, [29, 50])),
        ("app:audio", (1000, 29, [50])),
        ("app:7", (1000, 7, [29, 50])),
        ("4242", (4242, 0, [])),
        ("4242:4343", (4242, 4343, [])),
    ],
)
def test_resolve_user(rootfs: Path, user: str, expected: tuple[int, int, list[int]]) -> None:
    assert resolve_user(rootfs, user) == expected


@pytest.mark.parametrize(
    ("user", "kind", "text"),
    [
        ("nobody", "not_found", "user 'nobody' not found"),
        ("app:nogroup", "not_found", "group 'nogroup' not found"),
        ("4242:nogroup", "not_found", "group 'nogroup' not found"),
        ("app:", "invalid", "empty group"),
        (":1", "invalid", "empty user"),
        ("99999999999", "invalid", "out of range"),
    ],
)
def test_resolve_user_errors(rootfs: Path, user: str, kind: str, text: str) -> None:
    exc = error(resolve_user, rootfs, user, where="security.user")
    assert exc.kind == kind
    assert exc.message.startswith("security.user: ")
    assert text in exc.message


def test_resolve_user_without_passwd(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    assert resolve_user(tmp_path / "r", "123:456") == (123, 456, [])
    assert error(resolve_user, tmp_path / "r", "app").kind == "not_found"


def test_passwd_symlinks_never_leave_the_rootfs(tmp_path: Path) -> None:
    host_file = tmp_path / "host-passwd"
    host_file.write_text("evil:x:0:0::/:/bin/sh\n")
    root = tmp_path / "r"
    (root / "etc").mkdir(parents=True)
    (root / "inside").mkdir()
    # Absolute and ".."-laden targets both resolve as if the rootfs were "/".
    (root / "etc" / "passwd").symlink_to(f"/../../../../..{host_file}")
    assert error(resolve_user, root, "evil").kind == "not_found"
    (root / "etc" / "passwd").unlink()
    (root / "etc" / "passwd").symlink_to("../../../../../../../../inside/pw")
    (root / "inside" / "pw").write_text("good:x:7:8::/:/bin/sh\n")
    assert resolve_user(root, "good") == (7, 8, [])


def test_symlink_loops_and_fifos_are_errors_not_hangs(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").symlink_to("passwd")
    assert error(resolve_user, root, "app").kind == "invalid"
    (root / "etc" / "passwd").unlink()
    os.mkfifo(root / "etc" / "passwd")
    exc = error(resolve_user, root, "app")
    assert "not a regular file" in exc.message


def test_user_in_the_spec(rootfs: Path) -> None:
    image = ImageRuntimeConfig(cmd=("sh",), user="web")
    spec = build(rootfs, ContainerRequest(name="web"), image)
    assert spec["process"]["user"] == {"uid": 1001, "gid": 1001, "additionalGids": [1001, 29, 44]}
    request = ContainerRequest(name="web", security=Security(user="app:staff", additional_gids=(5, 50, 29)))
    spec = build(rootfs, request, image)
    assert spec["process"]["user"] == {"uid": 1000, "gid": 50, "additionalGids": [50, 29, 5]}
    strict = ContainerRequest(name="web", security=Security(additional_gids=(7,), strict_groups=True))
    assert build(rootfs, strict, image)["process"]["user"] == {
        "uid": 1001,
        "gid": 1001,
        "additionalGids": [1001, 7],
    }
    spec = build(rootfs, ContainerRequest(name="web"))
    assert spec["process"]["user"] == {"uid": 0, "gid": 0, "additionalGids": [0]}


def test_user_errors_name_the_source(rootfs: Path) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web", security=Security(user="ghost")))
    assert exc.message.startswith("security.user: ")
    exc = error(build, rootfs, ContainerRequest(name="web"), ImageRuntimeConfig(cmd=("sh",), user="ghost"))
    assert exc.message.startswith("image config.User: ")
    exc = error(build, rootfs, ContainerRequest(name="web", security=Security(additional_gids=(2**32,))))
    assert exc.message.startswith("security.additional_gids[0]")


# -------------------------------------------------------------------------------- working dir


def test_working_dir_is_created_owned_by_the_user(rootfs: Path) -> None:
    spec = build(
        rootfs, ContainerRequest(name="web", working_dir="/work/sub/", security=Security(user="app"))
    )
    assert spec["process"]["cwd"] == "/work/sub"
    assert (rootfs / "work" / "sub").is_dir()
    if os.geteuid() == 0:
        assert (rootfs / "work").stat().st_uid == 1000
        assert (rootfs / "work" / "sub").stat().st_gid == 1000
    # Existing directories keep their owner.
    assert (rootfs / "etc").stat().st_uid == os.geteuid()


def test_image_working_dir_and_default(rootfs: Path) -> None:
    assert build(rootfs)["process"]["cwd"] == "/"
    image = ImageRuntimeConfig(cmd=("sh",), working_dir="srv")
    assert build(rootfs, image=image)["process"]["cwd"] == "/srv"
    assert (rootfs / "srv").is_dir()


def test_working_dir_symlinks_stay_inside(tmp_path: Path, rootfs: Path) -> None:
    outside = tmp_path / "outside"
    (rootfs / "abs").symlink_to(outside)
    (rootfs / "rel").symlink_to("../../../../../../" + str(outside))
    ensure_working_dir(rootfs, "/abs/a", 0, 0)
    ensure_working_dir(rootfs, "/rel/b", 0, 0)
    assert not outside.exists()
    assert (rootfs / str(outside).lstrip("/") / "a").is_dir()
    assert (rootfs / str(outside).lstrip("/") / "b").is_dir()


def test_a_refused_request_leaves_the_rootfs_untouched(rootfs: Path) -> None:
    request = ContainerRequest(
        name="web", working_dir="/new", security=Security(capabilities_add=("CAP_FOO",))
    )
    error(build, rootfs, request)
    assert not (rootfs / "new").exists()


def test_host_facts_probe() -> None:
    facts = HostFacts.probe()
    assert facts.oom_score_adj == int(Path("/proc/self/oom_score_adj").read_text())
    assert facts.capabilities <= frozenset(ALL_CAPABILITIES)
    assert facts.can_raise_rlimits == ("CAP_SYS_RESOURCE" in facts.capabilities)
    # Read only when a cpuset asks (off Create's path otherwise), from the machine.
    assert (facts.online_cpus, facts.online_memory_nodes) == (None, None)
    assert facts.cpus_online() == frozenset(parse_cpu_list(ONLINE_CPUS.read_text()))
    assert facts.memory_nodes_online()  # node 0 at least, with or without NUMA


def test_working_dir_errors(rootfs: Path) -> None:
    (rootfs / "file").write_text("x")
    exc = error(build, rootfs, ContainerRequest(name="web", working_dir="/file/sub"))
    assert exc.message.startswith("working_dir: ")
    assert "not a directory" in exc.message
    assert error(ensure_working_dir, rootfs, "/file", 0, 0).kind == "invalid"
    assert error(build, rootfs, ContainerRequest(name="web", working_dir="rel")).message.startswith(
        "working_dir: 'rel' is not an absolute path"
    )
    assert error(build, rootfs, ContainerRequest(name="web", working_dir="/a/../b")).kind == "invalid"
    assert error(ensure_working_dir, rootfs / "missing", "/x", 0, 0).kind == "not_found"


# ------------------------------------------------------------------------------- capabilities


def caps(spec: dict[str, Any]) -> list[str]:
    capabilities = spec["process"]["capabilities"]
    assert capabilities["bounding"] == capabilities["effective"] == capabilities["permitted"]
    assert capabilities["ambient"] == capabilities["inheritable"] == []
    return list(capabilities["bounding"])


def test_default_capabilities(rootfs: Path) -> None:
    assert len(DEFAULT_CAPABILITIES) == 14
    assert sorted(caps(build(rootfs))) == sorted(DEFAULT_CAPABILITIES)


@pytest.mark.parametrize(
    ("add", "drop", "expected"),
    [
        (("NET_BIND_SERVICE",), ("ALL",), ["CAP_NET_BIND_SERVICE"]),
        (("cap_net_admin", "Sys_Ptrace"), ("chown", "CAP_KILL"), None),
        ((), ("all",), []),
        (("ALL",), ("CAP_SYS_ADMIN",), "all-but-sys-admin"),
        (("CAP_KILL",), ("CAP_KILL",), "defaults"),
    ],
)
def test_capability_add_and_drop(
    rootfs: Path, add: tuple[str, ...], drop: tuple[str, ...], expected: list[str] | str | None
) -> None:
    request = ContainerRequest(name="web", security=Security(capabilities_add=add, capabilities_drop=drop))
    result = caps(build(rootfs, request))
    if expected is None:
        wanted = (set(DEFAULT_CAPABILITIES) - {"CAP_CHOWN", "CAP_KILL"}) | {"CAP_NET_ADMIN", "CAP_SYS_PTRACE"}
        assert set(result) == wanted
    elif expected == "all-but-sys-admin":
        assert set(result) == set(ALL_CAPABILITIES) - {"CAP_SYS_ADMIN"}
    elif expected == "defaults":
        assert set(result) == set(DEFAULT_CAPABILITIES)
    else:
        assert result == expected


def test_unknown_capability_names_the_field(rootfs: Path) -> None:
    request = ContainerRequest(name="web", security=Security(capabilities_add=("CAP_FOO",)))
    exc = error(build, rootfs, request)
    assert exc.kind == "invalid"
    assert exc.message == "security.capabilities_add[0]: 'CAP_FOO' is not a capability"
    request = ContainerRequest(name="web", security=Security(capabilities_drop=("KILL", "bogus")))
    assert error(build, rootfs, request).message.startswith("security.capabilities_drop[1]: ")


def test_capabilities_auraed_lacks(rootfs: Path) -> None:
    host = HostFacts(capabilities=frozenset(ALL_CAPABILITIES) - {"CAP_SYS_RESOURCE"})
    request = ContainerRequest(name="web", security=Security(capabilities_add=("SYS_RESOURCE",)))
    exc = error(build, rootfs, request, host=host)
    assert exc.kind == "unsupported"
    assert exc.message.startswith("security.capabilities_add[0]: CAP_SYS_RESOURCE")
    request = ContainerRequest(name="web", security=Security(capabilities_add=("ALL",)))
    assert "CAP_SYS_RESOURCE" not in caps(build(rootfs, request, host=host))


def test_no_new_privileges(rootfs: Path) -> None:
    assert build(rootfs)["process"]["noNewPrivileges"] is False
    request = ContainerRequest(name="web", security=Security(no_new_privileges=True))
    assert build(rootfs, request)["process"]["noNewPrivileges"] is True


# ------------------------------------------------------------------------------------ rlimits


def test_default_rlimit_matches_runc(rootfs: Path) -> None:
    assert build(rootfs)["process"]["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]


def test_rlimits_override_and_normalise(rootfs: Path) -> None:
    request = ContainerRequest(
        name="web", rlimits=(Rlimit("nofile", 100, 200), Rlimit("RLIMIT_CORE", 0, 0), Rlimit("Nproc", 5, 5))
    )
    assert build(rootfs, request)["process"]["rlimits"] == [
        {"type": "RLIMIT_NOFILE", "hard": 200, "soft": 100},
        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
        {"type": "RLIMIT_NPROC", "hard": 5, "soft": 5},
    ]


@pytest.mark.parametrize(
    ("limit", "kind", "text"),
    [
        (Rlimit("RLIMIT_BOGUS", 1, 1), "invalid", "rlimits[0].type: 'RLIMIT_BOGUS' is not an rlimit"),
        (Rlimit("", 1, 1), "invalid", "rlimits[0].type: must not be empty"),
        (Rlimit("NOFILE", 10, 5), "invalid", "rlimits[0]: soft limit 10 is above the hard limit 5"),
        (Rlimit("NOFILE", -1, 5), "invalid", "rlimits[0].soft"),
        (Rlimit("NOFILE", 1, 2**64), "invalid", "rlimits[0].hard"),
    ],
)
def test_rlimit_errors(rootfs: Path, limit: Rlimit, kind: str, text: str) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web", rlimits=(limit,)))
    assert exc.kind == kind
    assert exc.message.startswith(text)


def test_rlimits_above_auraed_own_need_cap_sys_resource(rootfs: Path) -> None:
    host = HostFacts(rlimit_hard={"RLIMIT_NOFILE": 512}, can_raise_rlimits=False)
    # The default is lowered to what auraed can hand on.
    assert build(rootfs, host=host)["process"]["rlimits"] == [
        {"type": "RLIMIT_NOFILE", "hard": 512, "soft": 512}
    ]
    exc = error(build, rootfs, ContainerRequest(name="web", rlimits=(Rlimit("NOFILE", 1, 513),)), host=host)
    assert exc.kind == "unsupported"
    assert exc.message.startswith("rlimits[0]: hard limit 513")
    able = HostFacts(rlimit_hard={"RLIMIT_NOFILE": 512}, can_raise_rlimits=True)
    spec = build(rootfs, ContainerRequest(name="web", rlimits=(Rlimit("NOFILE", 1, 4096),)), host=able)
    assert spec["process"]["rlimits"][0]["hard"] == 4096


# ------------------------------------------------------------------------------------ sysctls


def test_namespaced_sysctls(rootfs: Path) -> None:
    sysctls = {
        "net.ipv4.ip_unprivileged_port_start": "0",
        "kernel.shmmax": "1000000",
        "fs.mqueue.msg_max": "20",
        "kernel.domainname": "example",
        "net.ipv4.conf.eth0.forwarding": "1",
    }
    assert build(rootfs, ContainerRequest(name="web", sysctls=sysctls))["linux"]["sysctl"] == sysctls
    assert "sysctl" not in build(rootfs)["linux"]


@pytest.mark.parametrize(
    ("key", "value", "host_network", "kind", "text"),
    [
        ("net.ipv4.ip_forward", "1", True, "invalid", "own network namespace"),
        ("vm.swappiness", "1", False, "unsupported", "not a namespaced sysctl"),
        ("kernel.hostname", "x", False, "invalid", "hostname field"),
        ("kernel.panic", "1", False, "unsupported", "not a namespaced sysctl"),
        ("net", "1", False, "invalid", "not a sysctl name"),
        ("net.ipv4/../x", "1", False, "invalid", "not a sysctl name"),
        ("net.ipv4.ip_forward", "1\n2", False, "invalid", "newline"),
    ],
)
def test_sysctl_errors(
    rootfs: Path, *, key: str, value: str, host_network: bool, kind: str, text: str
) -> None:
    request = ContainerRequest(name="web", sysctls={key: value}, host_network=host_network)
    exc = error(build, rootfs, request)
    assert exc.kind == kind
    assert exc.message.startswith(f"sysctls[{key!r}]: ")
    assert text in exc.message


def test_net_sysctls_with_a_joined_netns(rootfs: Path) -> None:
    request = ContainerRequest(name="web", sysctls={"net.ipv4.ip_forward": "1"})
    spec = build(rootfs, request, sandbox=joining_netns("/run/netns/x"))
    assert spec["linux"]["sysctl"] == {"net.ipv4.ip_forward": "1"}


# -------------------------------------------------------------------------------------- oom


@pytest.mark.parametrize(
    ("requested", "own", "expected"),
    [(None, 0, 0), (500, 0, 500), (-500, 0, 0), (None, 300, 300), (100, 300, 300), (None, -500, 0)],
)
def test_oom_score_adj_never_below_auraed(
    rootfs: Path, requested: int | None, own: int, expected: int
) -> None:
    request = ContainerRequest(name="web", security=Security(oom_score_adj=requested))
    assert build(rootfs, request, auraed_oom_score_adj=own)["process"]["oomScoreAdj"] == expected


def test_oom_score_adj_from_host_facts_and_range(rootfs: Path) -> None:
    assert build(rootfs, host=HostFacts(oom_score_adj=42))["process"]["oomScoreAdj"] == 42
    request = ContainerRequest(name="web", security=Security(oom_score_adj=1001))
    assert error(build, rootfs, request).message.startswith("security.oom_score_adj: 1001")


def test_oom_score_adj_read_from_proc(rootfs: Path) -> None:
    own = int(Path("/proc/self/oom_score_adj").read_text())
    request = ContainerRequest(name="web", security=Security(oom_score_adj=-1000))
    assert build(rootfs, request, host=None)["process"]["oomScoreAdj"] == max(own, -1000)


# ------------------------------------------------------------------------------------- mounts


DEFAULT_MOUNTS = ["/proc", "/dev", "/sys", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys/fs/cgroup"]


def destinations(spec: dict[str, Any]) -> list[str]:
    return [m["destination"] for m in spec["mounts"]]


def added_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The spec's mounts other than the defaults, in order."""
    return [m for m in spec["mounts"] if m["destination"] not in DEFAULT_MOUNTS]


def hidden_mounts(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(earlier, later) pairs where the later mount is at or above the earlier one, hiding it."""
    found = destinations(spec)
    return [
        (earlier, later)
        for index, later in enumerate(found)
        for earlier in found[:index]
        if earlier == later or earlier.startswith(later.rstrip("/") + "/")
    ]


def test_default_mounts(rootfs: Path) -> None:
    spec = build(rootfs)
    assert destinations(spec) == DEFAULT_MOUNTS
    assert hidden_mounts(spec) == []
    by_destination = {m["destination"]: m for m in spec["mounts"]}
    assert "ro" in by_destination["/sys"]["options"]
    assert by_destination["/sys/fs/cgroup"]["type"] == "cgroup"
    assert "ro" in by_destination["/sys/fs/cgroup"]["options"]


def test_bind_mounts(tmp_path: Path, rootfs: Path) -> None:
    request = ContainerRequest(
        name="web",
        mounts=(
            Mount(destination="/data/sub", source=str(tmp_path)),
            Mount(destination="/data", source=str(tmp_path), type="bind", read_only=True),
            Mount(destination="/scratch", type="tmpfs", options=("size=1m",)),
            Mount(destination="/one", source=str(tmp_path), options=("bind", "rshared")),
        ),
    )
    mounts = added_mounts(build(rootfs, request))
    assert mounts == [
        {
            "destination": "/data",
            "type": "bind",
            "source": str(tmp_path),
            "options": ["rbind", "rprivate", "ro"],
        },
        {"destination": "/scratch", "type": "tmpfs", "source": "tmpfs", "options": ["size=1m"]},
        {"destination": "/one", "type": "bind", "source": str(tmp_path), "options": ["bind", "rshared"]},
        {
            "destination": "/data/sub",
            "type": "bind",
            "source": str(tmp_path),
            "options": ["rbind", "rprivate"],
        },
    ]


def test_missing_bind_source_is_not_found(tmp_path: Path, rootfs: Path) -> None:
    request = ContainerRequest(
        name="web", mounts=(Mount("/a", str(tmp_path)), Mount("/b", str(tmp_path / "missing")))
    )
    exc = error(build, rootfs, request)
    assert exc.kind == "not_found"
    assert exc.message == f"mounts[1].source: {tmp_path / 'missing'} does not exist"


@pytest.mark.parametrize(
    ("mount", "kind", "text"),
    [
        (Mount("relative", "/tmp"), "invalid", "mounts[0].destination: 'relative' is not an absolute path"),
        (Mount("/", "/tmp"), "invalid", "mounts[0].destination: must not be /"),
        (Mount("/a/../b", "/tmp"), "invalid", "mounts[0].destination"),
        (Mount("/proc", "/tmp"), "invalid", "mounts[0].destination: cannot mount over /proc"),
        (Mount("/proc/sys/kernel", "/tmp"), "invalid", "mounts[0].destination: cannot mount over"),
        (Mount("/x", "relative"), "invalid", "mounts[0].source"),
        (Mount("/x", "", type="nfs"), "unsupported", "mounts[0].type"),
        (Mount("/x", "/tmp", options=("ro,exec",)), "invalid", "mounts[0].options[0]"),
        (Mount("/x", "/tmp", options=("",)), "invalid", "mounts[0].options[0]"),
    ],
)
def test_mount_errors(rootfs: Path, mount: Mount, kind: str, text: str) -> None:
    exc = error(build, rootfs, ContainerRequest(name="web", mounts=(mount,)))
    assert exc.kind == kind
    assert exc.message.startswith(text)


def test_duplicate_mount_destination(rootfs: Path) -> None:
    request = ContainerRequest(name="web", mounts=(Mount("/x", "/tmp"), Mount("/x/", "/tmp")))
    assert error(build, rootfs, request).message == "mounts[1].destination: /x is mounted twice"


def test_request_mounts_replace_defaults_and_proc_files_are_allowed(rootfs: Path) -> None:
    request = ContainerRequest(
        name="web",
        mounts=(Mount("/dev/shm", type="tmpfs", options=("size=1g",)), Mount("/proc/uptime", "/proc/uptime")),
    )
    spec = build(rootfs, request)
    shm = [m for m in spec["mounts"] if m["destination"] == "/dev/shm"]
    assert shm == [{"destination": "/dev/shm", "type": "tmpfs", "source": "tmpfs", "options": ["size=1g"]}]
    assert destinations(spec).index("/dev") < destinations(spec).index("/dev/shm")


@pytest.mark.parametrize(
    "mount",
    [
        Mount("/dev", type="tmpfs", options=("mode=755",)),
        Mount("/sys", type="sysfs", options=("ro",)),
        Mount("/sys/fs", type="tmpfs"),
        Mount("/dev/shm/sub", type="tmpfs"),
    ],
)
def test_a_request_mount_never_hides_a_default_beneath_it(rootfs: Path, mount: Mount) -> None:
    # A tmpfs at /dev was mounted after /dev/pts, /dev/shm and /dev/mqueue and hid them (a
    # container with a terminal could not even start); it replaces the default /dev only.
    spec = build(rootfs, ContainerRequest(name="web", mounts=(mount,)))
    assert hidden_mounts(spec) == []
    assert sorted(destinations(spec)) == sorted({*DEFAULT_MOUNTS, mount.destination})
    assert next(m for m in spec["mounts"] if m["destination"] == mount.destination)["type"] == mount.type


def test_volumes_and_read_only_rootfs(rootfs: Path) -> None:
    image = ImageRuntimeConfig(cmd=("sh",), volumes=("/data", "/cache/", "/logs"))
    writable = build(rootfs, ContainerRequest(name="web"), image)
    assert writable["root"] == {"path": str(rootfs), "readonly": False}
    assert "/data" not in destinations(writable)  # part of the writable layer
    request = ContainerRequest(
        name="web", security=Security(read_only_rootfs=True), mounts=(Mount("/logs", "/tmp"),)
    )
    spec = build(rootfs, request, image)
    assert spec["root"]["readonly"] is True
    extra = {m["destination"]: m for m in added_mounts(spec)}
    assert set(extra) == {"/data", "/cache", "/logs", "/tmp"}
    assert extra["/data"]["type"] == "tmpfs"
    assert extra["/logs"]["type"] == "bind"
    assert "mode=1777" in extra["/tmp"]["options"]
    request = ContainerRequest(
        name="web", security=Security(read_only_rootfs=True), mounts=(Mount("/tmp", type="tmpfs"),)
    )
    assert [m["options"] for m in build(rootfs, request)["mounts"] if m["destination"] == "/tmp"] == [[]]


def test_masked_and_readonly_paths(rootfs: Path) -> None:
    spec = build(rootfs)
    assert spec["linux"]["maskedPaths"] == list(DEFAULT_MASKED_PATHS)
    assert spec["linux"]["readonlyPaths"] == list(DEFAULT_READONLY_PATHS)
    request = ContainerRequest(
        name="web", security=Security(masked_paths=("/proc/keys",), readonly_paths=("/x",))
    )
    spec = build(rootfs, request)
    assert spec["linux"]["maskedPaths"] == ["/proc/keys"]
    assert spec["linux"]["readonlyPaths"] == ["/x"]
    request = ContainerRequest(name="web", security=Security(masked_paths=("/ok", "rel")))
    assert error(build, rootfs, request).message.startswith("security.masked_paths[1]")


# -------------------------------------------------------------------------------- namespaces


def namespaces(spec: dict[str, Any]) -> dict[str, str | None]:
    return {ns["type"]: ns.get("path") for ns in spec["linux"]["namespaces"]}


def test_namespaces(rootfs: Path) -> None:
    assert namespaces(build(rootfs)) == {
        "pid": None,
        "ipc": None,
        "uts": None,
        "mount": None,
        "cgroup": None,
        "network": None,
    }
    assert "network" not in namespaces(build(rootfs, ContainerRequest(name="web", host_network=True)))
    assert namespaces(build(rootfs, sandbox=joining_netns("/run/netns/c1")))["network"] == "/run/netns/c1"
    request = ContainerRequest(name="web", host_network=True)
    exc = error(build, rootfs, request, sandbox=joining_netns("/run/netns/c1"))
    assert exc.message.startswith("host_network: ")


def test_hostname(rootfs: Path) -> None:
    assert build(rootfs)["hostname"] == "web"
    assert build(rootfs, ContainerRequest(name="web", hostname="db.local"))["hostname"] == "db.local"
    assert error(build, rootfs, ContainerRequest(name="web", hostname="-bad")).message.startswith(
        "hostname: "
    )
    assert error(build, rootfs, ContainerRequest(name="")).message.startswith("hostname: ")
    assert error(build, rootfs, ContainerRequest(name="a_b")).message.startswith("name: ")


# ----------------------------------------------------------------------------------- sandbox


def test_a_container_on_its_own_gets_what_it_got_before_sandboxes(rootfs: Path) -> None:
    request = ContainerRequest(name="web", sysctls={"kernel.shmmax": "1"})
    assert build(rootfs, request, sandbox=HOST_LOCAL) == build(rootfs, request)


def test_the_sandboxs_namespaces_are_joined_by_path(rootfs: Path) -> None:
    shared = SharedNamespaces(
        network=Path("/run/netns/pod"),
        ipc=Path("/run/ipc/pod"),
        uts=Path("/run/uts/pod"),
        pid=Path("/proc/7/ns/pid"),
    )
    spec = build(rootfs, sandbox=SandboxContext(namespaces=shared))
    assert spec["linux"]["namespaces"] == [
        {"type": "pid", "path": "/proc/7/ns/pid"},
        {"type": "ipc", "path": "/run/ipc/pod"},
        {"type": "uts", "path": "/run/uts/pod"},
        {"type": "mount"},
        {"type": "cgroup"},
        {"type": "network", "path": "/run/netns/pod"},
    ]
    relative = SandboxContext(namespaces=SharedNamespaces(ipc=Path("run/ipc")))
    assert error(build, rootfs, sandbox=relative).message.startswith("sandbox.namespaces.ipc: ")


def test_the_hosts_namespaces_are_left_out(rootfs: Path) -> None:
    """A namespace the sandbox shares with the host has no entry: the container stays in the
    runtime's, as containerd leaves it (no /proc/1/ns path to open); no hostname is set in the
    host's UTS namespace, none may be asked."""
    host = SharedNamespaces(network=Path("/run/netns/pod"), host=frozenset({"pid", "ipc", "uts"}))
    spec = build(rootfs, sandbox=SandboxContext(namespaces=host))
    assert spec["linux"]["namespaces"] == [
        {"type": "mount"},
        {"type": "cgroup"},
        {"type": "network", "path": "/run/netns/pod"},
    ]
    assert "hostname" not in spec
    asked = error(
        build, rootfs, ContainerRequest(name="web", hostname="db"), sandbox=SandboxContext(namespaces=host)
    )
    assert asked.message.startswith("hostname: ")
    both = SharedNamespaces(pid=Path("/proc/7/ns/pid"), host=frozenset({"pid"}))
    assert error(build, rootfs, sandbox=SandboxContext(namespaces=both)).message.startswith(
        "sandbox.namespaces.pid: "
    )
    network = SharedNamespaces(host=frozenset({"network"}))
    assert error(build, rootfs, sandbox=SandboxContext(namespaces=network)).message.startswith(
        "sandbox.namespaces.host: "
    )


def test_the_sandbox_names_the_host(rootfs: Path) -> None:
    named = SandboxContext(hostname="web-0")
    assert build(rootfs, sandbox=named)["hostname"] == "web-0"
    own = error(build, rootfs, ContainerRequest(name="web", hostname="db"), sandbox=named)
    assert own.message.startswith("hostname: ")
    assert error(build, rootfs, sandbox=SandboxContext(hostname="-bad")).message.startswith(
        "sandbox.hostname: "
    )
    # A joined UTS namespace keeps the hostname its owner gave it: none is set, none may be asked.
    joined = SharedNamespaces(uts=Path("/run/uts/pod"))
    assert "hostname" not in build(rootfs, sandbox=SandboxContext(namespaces=joined))
    both = SandboxContext(namespaces=joined, hostname="web-0")
    assert error(build, rootfs, sandbox=both).message.startswith("sandbox.hostname: ")


def test_the_sandboxs_files_and_shm_are_bind_mounted(tmp_path: Path, rootfs: Path) -> None:
    files = {name: tmp_path / name for name in ("resolv.conf", "hosts", "hostname")}
    for path in files.values():
        path.write_text("x\n")
    (tmp_path / "shm").mkdir()
    sandbox = SandboxContext(
        resolv_conf=files["resolv.conf"],
        hosts=files["hosts"],
        hostname_file=files["hostname"],
        shm=tmp_path / "shm",
    )
    spec = build(rootfs, sandbox=sandbox)
    assert hidden_mounts(spec) == []
    by_destination = {m["destination"]: m for m in spec["mounts"]}
    for destination, source in (
        ("/etc/resolv.conf", files["resolv.conf"]),
        ("/etc/hosts", files["hosts"]),
        ("/etc/hostname", files["hostname"]),
    ):
        assert by_destination[destination] == {
            "destination": destination,
            "type": "bind",
            "source": str(source),
            "options": ["rbind", "rprivate"],
        }
    assert by_destination["/dev/shm"] == {
        "destination": "/dev/shm",
        "type": "bind",
        "source": str(tmp_path / "shm"),
        "options": ["rbind", "rprivate", "nosuid", "noexec", "nodev"],
    }
    assert destinations(spec).count("/dev/shm") == 1  # the container's own tmpfs is gone
    read_only = ContainerRequest(name="web", security=Security(read_only_rootfs=True))
    mounts = {m["destination"]: m for m in build(rootfs, read_only, sandbox=sandbox)["mounts"]}
    assert "ro" in mounts["/etc/hosts"]["options"] and "ro" not in mounts["/dev/shm"]["options"]
    # A mount of the request's own at one of those places wins.
    own_hosts = ContainerRequest(
        name="web", mounts=(Mount("/etc/hosts", str(tmp_path / "hosts"), read_only=True),)
    )
    mounts = {m["destination"]: m for m in build(rootfs, own_hosts, sandbox=sandbox)["mounts"]}
    assert mounts["/etc/hosts"]["options"] == ["rbind", "rprivate", "ro"]
    missing = error(build, rootfs, sandbox=SandboxContext(hosts=tmp_path / "nope"))
    assert missing.kind == "not_found" and missing.message.startswith("sandbox.hosts: ")


def test_the_sandboxs_sysctls_go_with_the_requests(rootfs: Path) -> None:
    sandbox = SandboxContext(sysctls={"kernel.shmmax": "1", "net.ipv4.ip_forward": "1"})
    request = ContainerRequest(name="web", sysctls={"kernel.shmmax": "2"})
    assert build(rootfs, request, sandbox=sandbox)["linux"]["sysctl"] == {
        "kernel.shmmax": "2",
        "net.ipv4.ip_forward": "1",
    }
    bad = error(build, rootfs, sandbox=SandboxContext(sysctls={"vm.swappiness": "1"}))
    assert bad.kind == "unsupported" and bad.message.startswith("sandbox.sysctls['vm.swappiness']: ")


def test_cgroups_path(rootfs: Path) -> None:
    assert build(rootfs)["linux"]["cgroupsPath"] == "/aurae/web"
    with pytest.raises(SpecError, match="cgroups_path"):
        build_spec(IMAGE, ContainerRequest(name="web"), rootfs, "", host=HOST)


# --------------------------------------------------------------------------------- resources


def test_resources(rootfs: Path) -> None:
    resources = Resources(
        cpu_weight=100, cpu_max=50_000, cpuset_cpus="0-1", cpuset_mems="0", memory_max=64 << 20, pids_max=32
    )
    linux = build(rootfs, ContainerRequest(name="web", resources=resources))["linux"]["resources"]
    assert linux["cpu"] == {
        "shares": cpu_weight_to_shares(100),
        "quota": 50_000,
        "period": 100_000,
        "cpus": "0-1",
        "mems": "0",
    }
    assert linux["memory"] == {"limit": 64 << 20}
    assert linux["pids"] == {"limit": 32}
    assert linux["devices"][0] == {"allow": False, "access": "rwm"}
    allowed = {(d["type"], d.get("major"), d.get("minor")) for d in linux["devices"][1:]}
    assert {("c", 1, 3), ("c", 1, 9), ("c", 5, 2), ("c", 136, None)} <= allowed
    assert build(rootfs)["linux"]["resources"].keys() == {"devices"}


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        (Resources(cpu_weight=0), "resources.cpu_weight"),
        (Resources(cpu_weight=10_001), "resources.cpu_weight"),
        (Resources(cpu_max=999), "resources.cpu_max"),
        (Resources(cpu_period=999), "resources.cpu_period"),
        (Resources(cpuset_cpus="0-"), "resources.cpuset_cpus"),
        (Resources(cpuset_mems=""), "resources.cpuset_mems"),
        (Resources(memory_max=1 << 20), "resources.memory_max"),
        (Resources(memory_max=1 << 63), "resources.memory_max"),
        (Resources(pids_max=0), "resources.pids_max"),
        (Resources(pids_max=PID_MAX_LIMIT + 1), "resources.pids_max"),
        (Resources(cpu_max=MAX_CFS_QUOTA_US + 1), "resources.cpu_max"),
        (Resources(cpuset_cpus="0-2"), "resources.cpuset_cpus"),
        (Resources(cpuset_cpus="0-1000"), "resources.cpuset_cpus"),
        (Resources(cpuset_mems="5"), "resources.cpuset_mems"),
    ],
)
def test_resource_errors(rootfs: Path, resources: Resources, field: str) -> None:
    host = HostFacts(online_cpus=frozenset({0, 1}), online_memory_nodes=frozenset({0}))
    exc = error(build, rootfs, ContainerRequest(name="web", resources=resources), host=host)
    assert exc.kind == "invalid"
    assert exc.message.startswith(field + ": ")


def test_cpu_shares_and_memory_swap(rootfs: Path) -> None:
    resources = Resources(cpu_shares=512, memory_max=15 << 20, memory_swap=15 << 20)
    linux = build(rootfs, ContainerRequest(name="web", resources=resources))["linux"]["resources"]
    assert linux["cpu"] == {"shares": 512}
    assert linux["memory"] == {"limit": 15 << 20, "swap": 15 << 20}
    unlimited = Resources(memory_max=15 << 20, memory_swap=UNLIMITED)
    assert resource_limits(unlimited, HOST) == {"memory": {"limit": 15 << 20, "swap": -1}}
    assert "devices" not in resource_limits(resources, HOST)  # what a runtime's update takes


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        (Resources(cpu_shares=1), "resources.cpu_shares: 1 is outside 2..262144"),
        (Resources(cpu_shares=262_145), "resources.cpu_shares: 262145 is outside 2..262144"),
        (
            Resources(cpu_shares=2, cpu_weight=1),
            "resources.cpu_shares: give cpu_weight or cpu_shares, not both",
        ),
        (Resources(memory_swap=64 << 20), "resources.memory_swap: needs resources.memory_max"),
        (
            Resources(memory_max=64 << 20, memory_swap=32 << 20),
            f"resources.memory_swap: {32 << 20} is outside {64 << 20}..{(1 << 63) - 1}",
        ),
    ],
)
def test_cpu_shares_and_memory_swap_errors(rootfs: Path, resources: Resources, message: str) -> None:
    assert error(build, rootfs, ContainerRequest(name="web", resources=resources)).message == message


def test_resources_at_the_kernel_limits(rootfs: Path) -> None:
    host = HostFacts(online_cpus=frozenset({0, 1, 3}), online_memory_nodes=frozenset({0}))
    resources = Resources(
        cpu_max=MAX_CFS_QUOTA_US, pids_max=PID_MAX_LIMIT, cpuset_cpus="0-1,3", cpuset_mems="0"
    )
    linux = build(rootfs, ContainerRequest(name="web", resources=resources), host=host)["linux"]
    assert linux["resources"]["cpu"]["quota"] == MAX_CFS_QUOTA_US
    assert linux["resources"]["pids"] == {"limit": PID_MAX_LIMIT}
    offline = ContainerRequest(name="web", resources=Resources(cpuset_cpus="1-2"))
    assert error(build, rootfs, offline, host=host).message == (
        "resources.cpuset_cpus: 2 not online on this machine (online: 0-1,3)"
    )


# ----------------------------------------------------------------------------------- seccomp


def denied(profile: dict[str, Any]) -> set[str]:
    return {name for rule in profile["syscalls"] if "args" not in rule for name in rule["names"]}


def test_default_seccomp_profile(rootfs: Path) -> None:
    profile = build(rootfs)["linux"]["seccomp"]
    assert profile == default_seccomp_profile(DEFAULT_CAPABILITIES, "x86_64")
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert profile["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert {"unshare", "setns", "mount", "kexec_load", "bpf", "keyctl", "clone3"} <= denied(profile)
    assert "ptrace" not in denied(profile)
    clone3 = [rule for rule in profile["syscalls"] if rule["names"] == ["clone3"]]
    assert clone3 == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    clone_flags = [rule["args"][0]["value"] for rule in profile["syscalls"] if rule["names"] == ["clone"]]
    assert 0x10000000 in clone_flags  # CLONE_NEWUSER
    assert default_seccomp_profile(machine="aarch64")["architectures"] == [
        "SCMP_ARCH_AARCH64",
        "SCMP_ARCH_ARM",
    ]


def test_seccomp_rules_follow_granted_capabilities(rootfs: Path) -> None:
    request = ContainerRequest(name="web", security=Security(capabilities_add=("SYS_ADMIN",)))
    profile = build(rootfs, request)["linux"]["seccomp"]
    assert "mount" not in denied(profile)
    assert "clone" not in {n for rule in profile["syscalls"] for n in rule["names"]}
    assert "kexec_load" in denied(profile)


def test_seccomp_unconfined_and_from_a_file(tmp_path: Path, rootfs: Path) -> None:
    request = ContainerRequest(name="web", security=Security(seccomp_profile="unconfined"))
    assert "seccomp" not in build(rootfs, request)["linux"]
    custom = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}
    (tmp_path / "p.json").write_text(json.dumps(custom))
    request = ContainerRequest(name="web", security=Security(seccomp_profile=str(tmp_path / "p.json")))
    assert build(rootfs, request)["linux"]["seccomp"] == custom


@pytest.mark.parametrize(
    ("content", "kind"), [(None, "not_found"), ("{not json", "invalid"), ("[]", "invalid"), ("{}", "invalid")]
)
def test_seccomp_file_errors(tmp_path: Path, rootfs: Path, content: str | None, kind: str) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    request = ContainerRequest(name="web", security=Security(seccomp_profile=str(path)))
    exc = error(build, rootfs, request)
    assert exc.kind == kind
    assert exc.message.startswith("security.seccomp_profile: ")
    request = ContainerRequest(name="web", security=Security(seccomp_profile="strict"))
    assert error(build, rootfs, request).message.startswith("security.seccomp_profile: ")


def test_a_seccomp_file_that_never_ends_is_refused_unread(tmp_path: Path, rootfs: Path) -> None:
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    for path, problem in ((fifo, "is a FIFO"), ("/dev/zero", "is a character device")):
        request = ContainerRequest(name="web", security=Security(seccomp_profile=str(path)))
        exc = error(build, rootfs, request)
        assert (
            exc.kind == "invalid"
            and exc.message == f"security.seccomp_profile: {path} {problem}, not a regular file"
        )


# ------------------------------------------------------------------------------------- hooks


def test_hooks(rootfs: Path) -> None:
    hooks = Hooks(
        create_runtime=(Hook("/bin/setup-net", args=("--id", "web"), env=("A=1",), timeout_seconds=5),),
        poststop=(Hook("/bin/cleanup"),),
    )
    spec = build(rootfs, ContainerRequest(name="web", hooks=hooks))
    assert spec["hooks"] == {
        "createRuntime": [
            {
                "path": "/bin/setup-net",
                "args": ["/bin/setup-net", "--id", "web"],
                "env": ["A=1"],
                "timeout": 5,
            }
        ],
        "poststop": [{"path": "/bin/cleanup", "args": ["/bin/cleanup"]}],
    }
    assert "hooks" not in build(rootfs)


@pytest.mark.parametrize(
    ("hooks", "text"),
    [
        (Hooks(start_container=(Hook("relative"),)), "hooks.start_container[0].path"),
        (Hooks(poststart=(Hook("/ok"), Hook(""))), "hooks.poststart[1].path"),
        (Hooks(create_container=(Hook("/x", env=("BAD",)),)), "hooks.create_container[0].env[0]"),
        (Hooks(create_runtime=(Hook("/x", timeout_seconds=0),)), "hooks.create_runtime[0].timeout_seconds"),
        (
            Hooks(poststop=(Hook("/x", timeout_seconds=MAX_HOOK_TIMEOUT_SECONDS + 1),)),
            f"hooks.poststop[0].timeout_seconds: {MAX_HOOK_TIMEOUT_SECONDS + 1} is outside",
        ),
    ],
)
def test_hook_errors(rootfs: Path, hooks: Hooks, text: str) -> None:
    assert error(build, rootfs, ContainerRequest(name="web", hooks=hooks)).message.startswith(text)


# ------------------------------------------------------------------------------- stop signal


@pytest.mark.parametrize(
    ("request_signal", "image_signal", "expected"),
    [
        ("", "", signal.SIGTERM),
        ("", "SIGINT", signal.SIGINT),
        ("", "quit", signal.SIGQUIT),
        ("9", "SIGINT", signal.SIGKILL),
        ("HUP", "SIGINT", signal.SIGHUP),
        ("SIGRTMIN+3", "", signal.SIGRTMIN + 3),
    ],
)
def test_stop_signal(request_signal: str, image_signal: str, expected: int) -> None:
    image = ImageRuntimeConfig(stop_signal=image_signal)
    assert stop_signal(image, ContainerRequest(name="web", stop_signal=request_signal)) == expected


@pytest.mark.parametrize("bad", ["SIGFOO", "0", "65", "RTMIN+99", "-1", "1.5"])
def test_bad_stop_signals(rootfs: Path, bad: str) -> None:
    exc = error(stop_signal, ImageRuntimeConfig(), ContainerRequest(name="web", stop_signal=bad))
    assert exc.message.startswith("stop_signal: ")
    exc = error(stop_signal, ImageRuntimeConfig(stop_signal=bad), ContainerRequest(name="web"))
    assert exc.message.startswith("image config.StopSignal: ")
    # build_spec refuses it too, before anything reaches a runtime.
    assert error(build, rootfs, ContainerRequest(name="web", stop_signal=bad)).kind == "invalid"


# -------------------------------------------------------------------------------- hypothesis

T = Any


def mostly(valid: st.SearchStrategy[T], wild: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """Usually a plausible value, sometimes an arbitrary one: every field is wrong now and then,
    and enough requests get past the first check to exercise the rest."""
    return st.integers(0, 14).flatmap(lambda i: wild if i == 0 else valid)


text = st.text(max_size=12)
paths = st.lists(st.sampled_from(["a", "..", ".", "", "etc", "passwd", "tmp", "b"]), max_size=4).map("/".join)
abs_paths = st.lists(st.sampled_from(["a", "b", "tmp", "data"]), min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)
)
maybe_int = st.one_of(st.none(), st.integers(min_value=-(2**65), max_value=2**65))
small_tuple = st.lists(text, max_size=3).map(tuple)
words = st.lists(st.sampled_from(["sh", "-c", "true", "x y"]), max_size=3).map(tuple)
env_entries = st.lists(
    mostly(st.builds("{}={}".format, st.sampled_from(["A", "B", "PATH"]), text), text), max_size=3
).map(tuple)
caps_names = st.sampled_from(["ALL", "net_admin", "CAP_KILL", "SYS_RESOURCE", "chown", "Sys_Admin"])
mounts = st.builds(
    Mount,
    destination=mostly(abs_paths, st.one_of(paths, text)),
    source=mostly(st.sampled_from(["/tmp", "/", "", "tmpfs"]), st.one_of(paths, text)),
    type=mostly(st.sampled_from(["", "bind", "tmpfs"]), text),
    options=mostly(
        st.lists(st.sampled_from(["ro", "size=1m", "rshared"]), max_size=2).map(tuple), small_tuple
    ),
    read_only=st.booleans(),
)
rlimits = st.builds(
    Rlimit,
    type=mostly(st.sampled_from(["nofile", "RLIMIT_CORE", "nproc"]), text),
    soft=mostly(st.integers(0, 1000), st.integers(-(2**65), 2**65)),
    hard=mostly(st.integers(1000, 2000), st.integers(-(2**65), 2**65)),
)
sysctl_names = mostly(
    st.sampled_from(["net.ipv4.ip_forward", "kernel.sem", "fs.mqueue.msg_max", "kernel.domainname"]), text
)
hooks = st.builds(
    Hook,
    path=mostly(abs_paths, st.one_of(paths, text)),
    args=small_tuple,
    env=mostly(st.just(()), small_tuple),
    timeout_seconds=mostly(st.one_of(st.none(), st.integers(1, 60)), maybe_int),
)


def optional(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return mostly(st.one_of(st.none(), valid), maybe_int)


requests = st.builds(
    ContainerRequest,
    name=mostly(st.just("web"), text),
    command=mostly(words, small_tuple),
    args=mostly(words, small_tuple),
    env=env_entries,
    working_dir=mostly(st.one_of(st.just(""), abs_paths), st.one_of(paths, text)),
    hostname=mostly(st.sampled_from(["", "h1", "a.b"]), text),
    mounts=st.lists(mounts, max_size=3).map(tuple),
    resources=st.builds(
        Resources,
        cpu_weight=optional(st.integers(1, 10_000)),
        cpu_max=optional(st.integers(1_000, 10**6)),
        cpu_period=optional(st.integers(1_000, 10**6)),
        cpuset_cpus=mostly(st.sampled_from([None, "0", "0-1"]), st.one_of(st.none(), text)),
        cpuset_mems=mostly(st.sampled_from([None, "0"]), st.one_of(st.none(), text)),
        memory_max=optional(st.integers(6 << 20, 1 << 40)),
        pids_max=optional(st.integers(1, 10**6)),
    ),
    security=st.builds(
        Security,
        capabilities_add=mostly(st.lists(caps_names, max_size=2).map(tuple), small_tuple),
        capabilities_drop=mostly(st.lists(caps_names, max_size=2).map(tuple), small_tuple),
        no_new_privileges=st.booleans(),
        read_only_rootfs=st.booleans(),
        masked_paths=mostly(
            st.lists(abs_paths, max_size=2).map(tuple), st.lists(paths, max_size=2).map(tuple)
        ),
        readonly_paths=mostly(
            st.lists(abs_paths, max_size=2).map(tuple), st.lists(paths, max_size=2).map(tuple)
        ),
        user=mostly(st.sampled_from(["", "app", "1000:50", "web:audio", "42"]), text),
        additional_gids=mostly(
            st.lists(st.integers(0, 100), max_size=2).map(tuple),
            st.lists(st.integers(min_value=-1, max_value=2**33), max_size=2).map(tuple),
        ),
        seccomp_profile=mostly(st.sampled_from(["", "default", "unconfined"]), text),
        oom_score_adj=optional(st.integers(-1000, 1000)),
    ),
    rlimits=st.lists(rlimits, max_size=2).map(tuple),
    sysctls=st.dictionaries(sysctl_names, mostly(st.just("1"), text), max_size=2),
    hooks=st.builds(Hooks, poststart=st.lists(hooks, max_size=2).map(tuple)),
    tty=st.booleans(),
    stop_signal=mostly(st.sampled_from(["", "SIGINT", "9"]), text),
    host_network=st.booleans(),
)
images = st.builds(
    ImageRuntimeConfig,
    entrypoint=mostly(words, small_tuple),
    cmd=mostly(words, small_tuple),
    env=env_entries,
    working_dir=mostly(st.one_of(st.just(""), abs_paths), st.one_of(paths, text)),
    user=mostly(st.sampled_from(["", "app", "root"]), text),
    stop_signal=mostly(st.sampled_from(["", "SIGQUIT"]), text),
    volumes=mostly(st.lists(abs_paths, max_size=2).map(tuple), st.lists(paths, max_size=2).map(tuple)),
)


@pytest.fixture(scope="module")
def shared_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("fuzz") / "rootfs")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(image=images, request=requests)
def test_random_requests_raise_only_spec_errors(
    shared_rootfs: Path, image: ImageRuntimeConfig, request: ContainerRequest
) -> None:
    try:
        spec = build_spec(image, request, shared_rootfs, "/aurae/fuzz", host=HOST)
    except SpecError as exc:
        assert exc.kind in ("invalid", "not_found", "unsupported")
        assert exc.message
        return
    json.dumps(spec)
    assert spec["process"]["args"]
    assert spec["process"]["oomScoreAdj"] >= HOST.oom_score_adj
