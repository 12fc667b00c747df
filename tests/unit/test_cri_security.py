"""auraed.cri.security and auraed.cri.seccomp: a CRI container's security context, namespaces and
mounts as the typed request, checked, and the OCI spec built from it; no runtime."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from auraed.api.runtime import v1 as cri
from auraed.containers.oci_spec import (
    ALL_CAPABILITIES,
    DEFAULT_CAPABILITIES,
    DEFAULT_MASKED_PATHS,
    DEFAULT_READONLY_PATHS,
    HostFacts,
    build_spec,
    compute_capabilities,
    default_seccomp_profile,
)
from auraed.containers.request import ContainerRequest, Mount, SpecError
from auraed.cri import model
from auraed.cri.errors import CriError
from auraed.cri.seccomp import Target, oci_section
from auraed.cri.security import ContainerNamespaces, LinuxSecurity, NamespaceScope, linux_security
from auraed.errors import ErrorKind
from auraed.system.mounts import MountEntry, mount_of, read_mounts
from tests.unit.test_spec import HOST, IMAGE, make_rootfs

CONTEXT = "config.linux.security_context"
PROFILE_MAX = 1 << 20  # cri_profile_max_kib's default
AVAILABLE = HostFacts.probe().capabilities
X86 = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]


def pod(
    privileged: bool = False, options: cri.NamespaceOption | None = None, **security: Any
) -> model.PodSpec:
    context = cri.LinuxSandboxSecurityContext(privileged=privileged, namespace_options=options, **security)
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="p", uid="u", namespace="n"),
        linux=cri.LinuxPodSandboxConfig(security_context=context),
    )
    return model.pod_spec(config, "")


POD = pod()


def translate(
    context: cri.LinuxContainerSecurityContext | None = None,
    mounts: list[cri.Mount] | None = None,
    in_pod: model.PodSpec = POD,
    recursive_read_only: bool = False,
) -> LinuxSecurity:
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="c"),
        command=["top"],
        linux=cri.LinuxContainerConfig(security_context=context),
        mounts=mounts or [],
    )
    return linux_security(
        config, in_pod, profile_max_bytes=PROFILE_MAX, recursive_read_only=recursive_read_only
    )


def refused(kind: ErrorKind = ErrorKind.INVALID_ARGUMENT, **kwargs: Any) -> str:
    with pytest.raises(CriError) as error:
        translate(**kwargs)
    assert error.value.kind is kind, error.value.message
    return error.value.message


def spec_of(part: LinuxSecurity, rootfs: Path) -> dict[str, Any]:
    request = ContainerRequest(name="c", command=("top",), security=part.security, mounts=part.mounts)
    return build_spec(IMAGE, request, rootfs, "/aurae/c", host=HOST)


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return make_rootfs(tmp_path / "rootfs")


def context(**fields: Any) -> cri.LinuxContainerSecurityContext:
    return cri.LinuxContainerSecurityContext(**fields)


# --------------------------------------------------------------------------------------- users


@pytest.mark.parametrize(
    ("fields", "user"),
    [
        ({}, ""),
        ({"run_as_user": cri.Int64Value(1001)}, "1001"),
        ({"run_as_user": cri.Int64Value(0)}, "0"),
        ({"run_as_username": "nobody"}, "nobody"),
        ({"run_as_username": "nobody", "run_as_user": cri.Int64Value(5)}, "nobody"),
        ({"run_as_user": cri.Int64Value(1001), "run_as_group": cri.Int64Value(1002)}, "1001:1002"),
        ({"run_as_username": "app", "run_as_group": cri.Int64Value(0)}, "app:0"),
    ],
)
def test_the_user_is_containerds_user_string(fields: dict[str, Any], user: str) -> None:
    assert translate(context(**fields)).security.user == user


def test_users_and_groups_are_checked() -> None:
    message = refused(context=context(run_as_group=cri.Int64Value(1002)))
    assert message == f"{CONTEXT}.run_as_group: needs run_as_user or run_as_username"
    message = refused(context=context(run_as_user=cri.Int64Value(-1)))
    assert message.startswith(f"{CONTEXT}.run_as_user: -1 is outside 0..")
    assert refused(context=context(run_as_username="a:b")).startswith(f"{CONTEXT}.run_as_username: ")
    message = refused(context=context(supplemental_groups=[5, 2**32]))
    assert message.startswith(f"{CONTEXT}.supplemental_groups[1]: ")
    newer = context(supplemental_groups_policy=2)
    message = refused(context=newer)
    assert message == f"{CONTEXT}.supplemental_groups_policy: 2 is neither Merge nor Strict"


def test_supplemental_groups_join_the_users_groups(rootfs: Path) -> None:
    """Merge (the default): the primary group, the image's groups of the user, then the pod's."""
    part = translate(context(run_as_username="app", supplemental_groups=[1234, 5678]))
    assert part.security.additional_gids == (1234, 5678) and not part.security.strict_groups
    assert spec_of(part, rootfs)["process"]["user"] == {
        "uid": 1000,
        "gid": 1000,
        "additionalGids": [1000, 29, 50, 1234, 5678],
    }


def test_strict_supplemental_groups_leave_the_images_groups_out(rootfs: Path) -> None:
    strict = cri.SupplementalGroupsPolicy.Strict
    part = translate(
        context(run_as_username="app", supplemental_groups=[1234], supplemental_groups_policy=strict)
    )
    assert part.security.strict_groups
    assert spec_of(part, rootfs)["process"]["user"] == {
        "uid": 1000,
        "gid": 1000,
        "additionalGids": [1000, 1234],
    }


# -------------------------------------------------------------------------------- capabilities


def capabilities(add: list[str], drop: list[str]) -> list[str]:
    part = translate(context(capabilities=cri.Capability(add_capabilities=add, drop_capabilities=drop)))
    return compute_capabilities(part.security, AVAILABLE)


def with_order(names: set[str]) -> list[str]:
    return [name for name in ALL_CAPABILITIES if name in names]


def test_capabilities_follow_containerds_order() -> None:
    defaults = set(DEFAULT_CAPABILITIES)
    assert capabilities([], []) == with_order(defaults)
    assert capabilities(["NET_ADMIN"], []) == with_order(defaults | {"CAP_NET_ADMIN"})
    assert capabilities(["net_admin", "CAP_SYS_TIME"], []) == with_order(
        defaults | {"CAP_NET_ADMIN", "CAP_SYS_TIME"}
    )
    assert capabilities([], ["NET_RAW"]) == with_order(defaults - {"CAP_NET_RAW"})
    # Named drops come after named adds, ALL dropped after ALL added.
    assert capabilities(["NET_ADMIN"], ["NET_ADMIN"]) == with_order(defaults)
    assert capabilities(["ALL"], []) == with_order(set(AVAILABLE))
    assert capabilities(["ALL"], ["CHOWN"]) == with_order(set(AVAILABLE) - {"CAP_CHOWN"})
    assert capabilities(["ALL"], ["ALL"]) == []
    assert capabilities([], ["ALL"]) == []
    assert capabilities(["NET_ADMIN", "KILL"], ["ALL", "KILL"]) == ["CAP_NET_ADMIN"]


def test_capabilities_are_checked() -> None:
    caps = cri.Capability(add_capabilities=["NET_ADMIN", "FLY"])
    message = refused(context=context(capabilities=caps))
    assert message == f"{CONTEXT}.capabilities.add_capabilities[1]: 'FLY' is not a capability"
    caps = cri.Capability(drop_capabilities=["bogus"])
    assert refused(context=context(capabilities=caps)).startswith(
        f"{CONTEXT}.capabilities.drop_capabilities[0]: "
    )
    caps = cri.Capability(add_ambient_capabilities=["NET_ADMIN"])
    assert refused(context=context(capabilities=caps)).startswith(
        f"{CONTEXT}.capabilities.add_ambient_capabilities: "
    )
    # This machine's root lacks CAP_SYS_RESOURCE (docs: ENVIRONMENT.md): it cannot hand it on.
    missing = sorted(set(ALL_CAPABILITIES) - AVAILABLE)
    assert missing
    caps = cri.Capability(add_capabilities=[missing[0]])
    assert refused(context=context(capabilities=caps)) == (
        f"{CONTEXT}.capabilities.add_capabilities[0]: {missing[0]} is not available to auraed on this machine"
    )


# ---------------------------------------------------------------------------------- privileged


def test_a_privileged_container_needs_a_privileged_pod() -> None:
    message = refused(context=context(privileged=True))
    assert message == f"{CONTEXT}.privileged: a privileged container needs a privileged pod"
    assert translate(context(privileged=True), in_pod=pod(privileged=True)).security.privileged


def test_a_privileged_spec_has_everything(rootfs: Path) -> None:
    profile = cri.SecurityProfile(profile_type=cri.SecurityProfileProfileType.RuntimeDefault)
    part = translate(
        context(
            privileged=True,
            seccomp=profile,
            masked_paths=["/proc/kcore"],
            readonly_paths=["/proc/sys"],
            capabilities=cri.Capability(drop_capabilities=["ALL"]),
        ),
        in_pod=pod(privileged=True),
    )
    spec = spec_of(part, rootfs)
    assert spec["process"]["capabilities"]["bounding"] == sorted(
        HOST.capabilities, key=ALL_CAPABILITIES.index
    )
    linux = spec["linux"]
    assert "seccomp" not in linux
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == ([], [])
    assert linux["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
    assert {"path": "/dev/null", "type": "c", "major": 1, "minor": 3} in [
        {k: d[k] for k in ("path", "type", "major", "minor")} for d in linux["devices"]
    ]
    assert not any(d["path"].startswith(("/dev/pts/", "/dev/shm/")) for d in linux["devices"])
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert "ro" not in mounts["/sys"]["options"]
    assert "ro" not in mounts["/sys/fs/cgroup"]["options"]


def test_masked_and_readonly_paths_are_taken_as_given(rootfs: Path) -> None:
    part = translate(context(masked_paths=["/bin/ls"], readonly_paths=["/tmp/"]))
    linux = spec_of(part, rootfs)["linux"]
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == (["/bin/ls"], ["/tmp"])
    # Empty is the defaults: it would mean procMount Unmasked, which needs a user namespace.
    linux = spec_of(translate(), rootfs)["linux"]
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == (
        list(DEFAULT_MASKED_PATHS),
        list(DEFAULT_READONLY_PATHS),
    )
    assert refused(context=context(masked_paths=["/ok", "rel"])).startswith(f"{CONTEXT}.masked_paths[1]: ")
    assert refused(context=context(readonly_paths=["/"])).startswith(f"{CONTEXT}.readonly_paths[0]: ")
    # In a pod with a user namespace of its own, empty is procMount Unmasked: none, as containerd.
    mapping = [cri.IdMapping(container_id=0, host_id=100000, length=65536)]
    userns = cri.UserNamespace(mode=cri.NamespaceMode.POD, uids=mapping, gids=mapping)
    own_users = pod(options=cri.NamespaceOption(userns_options=userns))
    linux = spec_of(translate(in_pod=own_users), rootfs)["linux"]
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == ([], [])
    assert spec_of(translate(context(masked_paths=["/bin/ls"]), in_pod=own_users), rootfs)["linux"][
        "maskedPaths"
    ] == ["/bin/ls"]


def test_no_new_privs_and_readonly_rootfs(rootfs: Path) -> None:
    spec = spec_of(translate(context(no_new_privs=True, readonly_rootfs=True)), rootfs)
    assert spec["process"]["noNewPrivileges"] is True
    assert spec["root"]["readonly"] is True
    spec = spec_of(translate(), rootfs)
    assert (spec["process"]["noNewPrivileges"], spec["root"]["readonly"]) == (False, False)


# ------------------------------------------------------------------------------------- seccomp

KINDS = cri.SecurityProfileProfileType
BLOCK_CHMOD = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [{"names": ["chmod", "fchmodat"], "action": "SCMP_ACT_ERRNO"}],
}


def seccomp_of(rootfs: Path, **fields: Any) -> dict[str, Any] | None:
    section: dict[str, Any] | None = spec_of(translate(context(**fields)), rootfs)["linux"].get("seccomp")
    return section


def test_no_profile_is_unconfined_and_runtime_default_is_auraeds(rootfs: Path) -> None:
    assert seccomp_of(rootfs) is None
    assert seccomp_of(rootfs, seccomp=cri.SecurityProfile(profile_type=KINDS.Unconfined)) is None
    default = seccomp_of(rootfs, seccomp=cri.SecurityProfile())  # RuntimeDefault is the zero value
    assert default == default_seccomp_profile(DEFAULT_CAPABILITIES, "x86_64")
    # The aurae API keeps its own default: auraed's profile when none is named.
    spec = build_spec(IMAGE, ContainerRequest(name="c"), rootfs, "/aurae/c", host=HOST)
    assert spec["linux"]["seccomp"] == default


@pytest.mark.filterwarnings("ignore:.*seccomp_profile_path is deprecated")
def test_a_localhost_profile_is_read_and_translated(tmp_path: Path, rootfs: Path) -> None:
    path = tmp_path / "block-chmod.json"
    path.write_text(json.dumps(BLOCK_CHMOD))
    expected = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": X86,
        "syscalls": [{"names": ["chmod", "fchmodat"], "action": "SCMP_ACT_ERRNO"}],
    }
    localhost = cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref=str(path))
    assert seccomp_of(rootfs, seccomp=localhost) == expected
    # The deprecated field, as containerd reads it.
    assert seccomp_of(rootfs, seccomp_profile_path=f"localhost/{path}") == expected
    assert seccomp_of(rootfs, seccomp_profile_path="unconfined") is None
    for word in ("runtime/default", "docker/default"):
        assert seccomp_of(rootfs, seccomp_profile_path=word) == default_seccomp_profile(
            DEFAULT_CAPABILITIES, "x86_64"
        )


@pytest.mark.filterwarnings("ignore:.*seccomp_profile_path is deprecated")
def test_seccomp_profiles_are_checked(tmp_path: Path) -> None:
    where = f"{CONTEXT}.seccomp.localhost_ref"
    ref = cri.SecurityProfile(profile_type=KINDS.RuntimeDefault, localhost_ref="/x.json")
    assert refused(context=context(seccomp=ref)).startswith(f"{where}: ")
    assert refused(context=context(seccomp=cri.SecurityProfile(profile_type=KINDS.Localhost))).startswith(
        f"{where}: "
    )
    relative = cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref="block.json")
    assert refused(context=context(seccomp=relative)) == f"{where}: 'block.json' is not an absolute path"
    missing = cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref=str(tmp_path / "none.json"))
    message = refused(ErrorKind.NOT_FOUND, context=context(seccomp=missing))
    assert message == f"{where}: seccomp profile {tmp_path / 'none.json'} not found"
    bad = tmp_path / "bad.json"
    bad.write_text('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["chmod"], "action": "NO"}]}')
    localhost = cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref=str(bad))
    assert refused(context=context(seccomp=localhost)) == (
        f"{where}: {bad}: syscalls[0].action: 'NO' is not a seccomp action"
    )
    bad.write_text("{not json")
    assert refused(context=context(seccomp=localhost)).startswith(f"{where}: {bad} is not JSON: ")
    path_field = f"{CONTEXT}.seccomp_profile_path"
    for wrong in (str(bad), "localhost/", "default"):
        assert refused(context=context(seccomp_profile_path=wrong)).startswith(f"{path_field}: ")


def test_a_privileged_container_reads_no_profile(tmp_path: Path) -> None:
    missing = cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref=str(tmp_path / "none.json"))
    part = translate(context(privileged=True, seccomp=missing), in_pod=pod(privileged=True))
    assert part.security.seccomp is None


TARGET = Target(frozenset(DEFAULT_CAPABILITIES), "x86_64", (6, 1))


def test_moby_profiles_become_oci_sections() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "archMap": [
            {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
            {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
        ],
        "flags": ["SECCOMP_FILTER_FLAG_LOG"],
        "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW", "comment": "ignored"},
            {
                "name": "personality",
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}],
            },
            {"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["chown"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CHOWN"]}},
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 97,
                "excludes": {"caps": ["NET_RAW"]},
            },
            {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64"]}},
            {"names": ["sync_file_range2"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["arm64"]}},
            {"names": ["clone3"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "5.3"}},
            {"names": ["futex_waitv"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "6.7"}},
            {"names": ["ptrace"], "action": "SCMP_ACT_ALLOW", "excludes": {"minKernel": "4.8"}},
        ],
    }
    assert oci_section(profile, "p", TARGET) == {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": X86,
        "flags": ["SECCOMP_FILTER_FLAG_LOG"],
        "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["personality"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "op": "SCMP_CMP_EQ", "value": 8, "valueTwo": 0}],
            },
            {"names": ["chown"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["clone3"], "action": "SCMP_ACT_ALLOW"},
        ],
    }
    listed = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"]}
    assert oci_section(listed, "p", TARGET)["architectures"] == ["SCMP_ARCH_X86_64"]
    assert oci_section({"defaultAction": "SCMP_ACT_LOG"}, "p", TARGET) == {
        "defaultAction": "SCMP_ACT_LOG",
        "architectures": X86,
        "syscalls": [],
    }


def one_rule(**rule: Any) -> dict[str, Any]:
    """A profile of one syscall rule: ``rule`` over a valid one."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["a"], "action": "SCMP_ACT_LOG", **rule}],
    }


EQ = "SCMP_CMP_EQ"


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ([], "p: the profile must be a JSON object"),
        ({}, "p: defaultAction: 'None' is not a seccomp action"),
        ({"defaultAction": ["x"]}, "p: defaultAction: \"['x']\" is not a seccomp action"),
        (
            {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86"], "archMap": [{}]},
            "p: architectures and archMap are both given; use one of them",
        ),
        (
            {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["x86"]},
            "p: architectures[0]: 'x86' is not a SCMP_ARCH_ name",
        ),
        ({"defaultAction": "SCMP_ACT_ALLOW", "flags": ["X"]}, "p: flags: 'X' is not a seccomp filter flag"),
        ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": {}}, "p: syscalls: must be a list"),
        (one_rule(name="b"), "p: syscalls[0]: name and names are both given; use one of them"),
        (one_rule(names=[]), "p: syscalls[0].names: must name at least one syscall"),
        (one_rule(names=["Chmod!"]), "p: syscalls[0].names[0]: 'Chmod!' is not a syscall name"),
        (one_rule(errnoRet=-1), "p: syscalls[0].errnoRet: must be an errno number 0..4095"),
        (one_rule(args=[{"index": 6, "op": EQ}]), "p: syscalls[0].args[0].index: must be an integer 0..5"),
        (
            one_rule(args=[{"index": 0, "op": "EQ"}]),
            "p: syscalls[0].args[0].op: 'EQ' is not a seccomp comparison",
        ),
        (
            one_rule(args=[{"index": 0, "op": EQ, "value": 2**64}]),
            "p: syscalls[0].args[0].value: must be an unsigned 64-bit integer",
        ),
        (
            one_rule(includes={"minKernel": "five"}),
            "p: syscalls[0].includes.minKernel: 'five' is not MAJOR.MINOR",
        ),
    ],
)
def test_bad_moby_profiles_are_refused_naming_the_value(profile: object, message: str) -> None:
    with pytest.raises(CriError) as error:
        oci_section(profile, "p", TARGET)
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT
    assert error.value.message == message


def test_the_section_wins_over_the_profile_name_in_the_spec(rootfs: Path) -> None:
    part = translate(context(seccomp=cri.SecurityProfile()))
    section = {"defaultAction": "SCMP_ACT_LOG"}
    security = replace(part.security, seccomp=section)
    request = ContainerRequest(name="c", security=security)
    assert build_spec(IMAGE, request, rootfs, "/aurae/c", host=HOST)["linux"]["seccomp"] == section
    request = ContainerRequest(name="c", security=replace(security, seccomp={"syscalls": []}))
    with pytest.raises(SpecError, match=r"security.seccomp: the section is not an OCI seccomp profile"):
        build_spec(IMAGE, request, rootfs, "/aurae/c", host=HOST)


# ---------------------------------------------------------------------------------- namespaces

NODE, POD_MODE, CONTAINER, TARGET_MODE = (
    cri.NamespaceMode.NODE,
    cri.NamespaceMode.POD,
    cri.NamespaceMode.CONTAINER,
    cri.NamespaceMode.TARGET,
)
S = NamespaceScope


def namespaces(container: cri.NamespaceOption | None, in_pod: model.PodSpec) -> ContainerNamespaces:
    return translate(context(namespace_options=container), in_pod=in_pod).namespaces


def test_network_and_ipc_are_the_pods_pid_the_containers_choice() -> None:
    assert namespaces(None, POD) == ContainerNamespaces(S.POD, S.POD, S.POD)
    host = pod(options=cri.NamespaceOption(network=NODE, ipc=NODE, pid=NODE))
    both = cri.NamespaceOption(network=NODE, ipc=NODE, pid=NODE)
    assert namespaces(both, host) == ContainerNamespaces(S.NODE, S.NODE, S.NODE)
    # The zero value, POD, is the pod's, whatever it is.
    assert namespaces(None, host) == ContainerNamespaces(S.NODE, S.NODE, S.NODE)
    own_pid = pod(options=cri.NamespaceOption(pid=CONTAINER))
    assert namespaces(cri.NamespaceOption(pid=CONTAINER), own_pid).pid is S.CONTAINER
    assert namespaces(None, own_pid).pid is S.CONTAINER  # the pod shares none
    assert namespaces(cri.NamespaceOption(pid=CONTAINER), POD).pid is S.CONTAINER
    target = cri.NamespaceOption(pid=TARGET_MODE, target_id="abc")
    assert namespaces(target, POD) == ContainerNamespaces(S.POD, S.POD, S.TARGET, "abc")


def test_namespace_options_are_checked() -> None:
    where = f"{CONTEXT}.namespace_options"
    for options, field in (
        (cri.NamespaceOption(network=NODE), "network"),
        (cri.NamespaceOption(ipc=NODE), "ipc"),
        (cri.NamespaceOption(network=CONTAINER), "network"),
        (cri.NamespaceOption(pid=NODE), "pid"),
        (cri.NamespaceOption(pid=TARGET_MODE), "target_id"),
        (cri.NamespaceOption(target_id="abc"), "target_id"),
        (cri.NamespaceOption(userns_options=cri.UserNamespace(mode=POD_MODE)), "userns_options.mode"),
    ):
        assert refused(context=context(namespace_options=options)).startswith(f"{where}.{field}: ")
    node_userns = cri.NamespaceOption(userns_options=cri.UserNamespace(mode=NODE))
    assert translate(context(namespace_options=node_userns)).namespaces.pid is S.POD


# -------------------------------------------------------------------------------------- mounts

PROPAGATION = cri.MountPropagation


def bind(host: Path | str, container: str = "/data", **fields: Any) -> cri.Mount:
    return cri.Mount(host_path=str(host), container_path=container, **fields)


def test_mounts_are_recursive_binds_of_the_resolved_host_path(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("dir")
    part = translate(
        mounts=[
            bind(tmp_path / "link", "/link/", readonly=True, selinux_relabel=True),
            bind(tmp_path / "new" / "deep", "/new"),
        ]
    )
    assert part.mounts == (
        Mount("/link", str(tmp_path / "dir"), "bind", ("rprivate",), read_only=True),
        Mount("/new", str(tmp_path / "new" / "deep"), "bind", ("rprivate",)),
    )
    assert (tmp_path / "new" / "deep").is_dir()  # created, as containerd does
    assert oct((tmp_path / "new" / "deep").stat().st_mode & 0o777) == oct(0o755 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_mounts_are_checked_before_anything_is_made(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to("nowhere")
    made = tmp_path / "made"
    for mounts, kind, start in (
        (
            [bind(made), bind(tmp_path, "rel")],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].container_path: ",
        ),
        ([bind(made), bind(tmp_path, "/")], ErrorKind.INVALID_ARGUMENT, "config.mounts[1].container_path: "),
        ([bind(made), bind("")], ErrorKind.INVALID_ARGUMENT, "config.mounts[1].host_path: "),
        (
            [bind(made), bind(tmp_path, "/data/")],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].container_path: /data is mounted twice",
        ),
        (
            [
                bind(made),
                cri.Mount(container_path="/img", image=cri.ImageSpec(image="busybox"), host_path="/x"),
            ],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].host_path: an image volume has none",
        ),
        (
            [
                bind(made),
                cri.Mount(container_path="/img", image=cri.ImageSpec(image="b"), image_sub_path="../x"),
            ],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].image_sub_path: ",
        ),
        (
            [bind(made), bind(tmp_path, "/x", image_sub_path="etc")],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].image_sub_path: ",
        ),
        (
            [bind(made), bind(tmp_path, "/x", uid_mappings=[cri.IdMapping(host_id=1000, length=1)])],
            ErrorKind.UNIMPLEMENTED,
            "config.mounts[1]: id-mapped mounts are not supported",
        ),
        (
            [bind(made), bind(tmp_path, "/x", readonly=True, recursive_read_only=True)],
            ErrorKind.INVALID_ARGUMENT,
            "config.mounts[1].recursive_read_only: recursive read-only mounts are not supported by this",
        ),
    ):
        assert refused(kind, mounts=mounts).startswith(start), mounts
        assert not made.exists()
    assert refused(mounts=[bind(tmp_path / "dangling")]) == (
        f"config.mounts[0].host_path: {tmp_path / 'dangling'} is a symlink to nothing"
    )


def test_recursive_read_only_needs_readonly_and_private_propagation(tmp_path: Path) -> None:
    part = translate(
        mounts=[bind(tmp_path, readonly=True, recursive_read_only=True)], recursive_read_only=True
    )
    assert part.mounts[0].options == ("rprivate", "rro")
    for fields, problem in (
        ({"readonly": False}, "needs readonly"),
        (
            {"readonly": True, "propagation": PROPAGATION.PROPAGATION_HOST_TO_CONTAINER},
            "needs PROPAGATION_PRIVATE",
        ),
        (
            {"readonly": True, "propagation": PROPAGATION.PROPAGATION_BIDIRECTIONAL},
            "needs PROPAGATION_PRIVATE",
        ),
    ):
        message = refused(
            mounts=[bind(tmp_path, recursive_read_only=True, **fields)], recursive_read_only=True
        )
        assert message == f"config.mounts[0].recursive_read_only: {problem}"


def test_the_roots_propagation_follows_the_binds(rootfs: Path, tmp_path: Path) -> None:
    def root_propagation(*options: str) -> str | None:
        request = ContainerRequest(
            name="c",
            mounts=tuple(Mount(f"/m{i}", str(tmp_path), options=(o,)) for i, o in enumerate(options)),
        )
        propagation: str | None = build_spec(IMAGE, request, rootfs, "/aurae/c", host=HOST)["linux"].get(
            "rootfsPropagation"
        )
        return propagation

    assert root_propagation() is None
    assert root_propagation("rprivate") is None
    assert root_propagation("rprivate", "rslave") == "rslave"
    assert root_propagation("rslave", "rshared") == "rshared"
    assert root_propagation("shared") == "rshared"


# ---------------------------------------------------------------------------------- mountinfo

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 27 0:37 / /mnt/with\\040space rw,relatime master:7 - tmpfs tmpfs rw
41 27 0:38 / /mnt rw,relatime shared:9 master:7 - tmpfs tmpfs rw
42 41 0:39 / /mnt/a rw,relatime - tmpfs tmpfs rw
43 41 0:40 / /mnt/a rw,relatime shared:12 - tmpfs tmpfs rw
"""


def test_mountinfo_is_read_with_its_propagation(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    entries = read_mounts(info)
    assert [e.mount_point for e in entries] == ["/proc", "/", "/mnt/with space", "/mnt", "/mnt/a", "/mnt/a"]
    assert entries[2] == MountEntry("/mnt/with space", "tmpfs", ("master:7",))
    assert [e.propagation for e in entries] == ["private", "shared", "slave", "shared", "private", "shared"]
    assert mount_of("/etc/passwd", info).mount_point == "/"
    assert mount_of("/mnt/with space/x", info).propagation == "slave"
    assert mount_of("/mnt/ab", info).mount_point == "/mnt"
    assert mount_of("/mnt/a/b", info).optional_fields == ("shared:12",)  # the top one at /mnt/a
    assert mount_of("/", info).mount_point == "/"
