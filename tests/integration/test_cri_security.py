"""critest's security-context, volume and mount-propagation specs, against real runc containers
made in-process by the Containers domain from requests that auraed.cri.security translated out of
real CRI ContainerConfig messages. Outputs are critest's own (exec output, exit codes, the
container's CRI log).

The image is busybox as critest's is built: /bin/ls a hard link of the one binary, so that
masking /bin/ls (a bind of /dev/null over that path, which would follow a symlink to busybox
itself) leaves /bin/sh working.

Needs root and runc. Host mounts made here (binds, tmpfs, their propagation) are unmounted and
checked gone; containers and cgroups go as tests/integration/test_sandbox.py's Lab removes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest

from auraed.api.runtime import v1 as cri
from auraed.containers.containers import Containers
from auraed.containers.model import ContainerRecord, State
from auraed.containers.oci_spec import exec_process, host_devices
from auraed.containers.request import ContainerRequest
from auraed.cri import model
from auraed.cri.errors import CriError
from auraed.cri.security import linux_security
from auraed.errors import ErrorKind
from auraed.system.mounts import read_mounts
from tests.integration.test_sandbox import Lab, open_lab
from tests.support.busybox import BUSYBOX
from tests.support.images import BuiltImage, Entry, File, Hardlink, build_layout, busybox_rootfs

IMAGE = "localhost/critest-busybox:latest"
BASE = f"aurae-crisec-{os.getpid()}"
PAUSE = ("sleep", "600")
PROFILE_MAX = 1 << 20  # cri_profile_max_kib's default
KINDS = cri.SecurityProfileProfileType
PROPAGATION = cri.MountPropagation
BLOCK_HOST_NAME = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [{"names": ["sethostname"], "action": "SCMP_ACT_ERRNO"}],
}
BLOCK_CHMOD = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [{"names": ["chmod", "fchmodat"], "action": "SCMP_ACT_ERRNO"}],
}


@pytest.fixture(scope="module")
def critest_busybox(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    """busybox with /bin/ls a hard link of /bin/busybox, as in critest's image."""
    dest = tmp_path_factory.mktemp("critest-busybox")
    hardlinked: dict[str, Entry] = {
        "bin/busybox": File(BUSYBOX.read_bytes(), 0o755),
        "bin/ls": Hardlink("bin/busybox"),
    }
    with tempfile.TemporaryDirectory(prefix="busybox-") as work:
        return build_layout(dest, [busybox_rootfs(Path(work)), hardlinked])


@pytest.fixture
async def lab(tmp_path: Path, critest_busybox: BuiltImage) -> AsyncIterator[Lab]:
    async with open_lab(tmp_path, critest_busybox, IMAGE, BASE) as made:
        yield made


def pod(privileged: bool = False) -> model.PodSpec:
    context = cri.LinuxSandboxSecurityContext(privileged=privileged)
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="p", uid="u", namespace="n"),
        linux=cri.LinuxPodSandboxConfig(security_context=context),
    )
    return model.pod_spec(config, "")


POD = pod()
PRIVILEGED_POD = pod(privileged=True)


async def run(
    containers: Containers,
    name: str,
    command: Sequence[str] = PAUSE,
    *,
    security: cri.LinuxContainerSecurityContext | None = None,
    mounts: Sequence[cri.Mount] = (),
    in_pod: model.PodSpec = POD,
    recursive_read_only: bool = False,
) -> ContainerRecord:
    """A started container made as the CRI's CreateContainer makes it, from a ContainerConfig."""
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name),
        command=list(command),
        linux=cri.LinuxContainerConfig(security_context=security),
        mounts=list(mounts),
    )
    part = await asyncio.to_thread(
        linux_security,
        config,
        in_pod,
        profile_max_bytes=PROFILE_MAX,
        recursive_read_only=recursive_read_only,
    )
    request = ContainerRequest(name=name, command=tuple(command), security=part.security, mounts=part.mounts)
    return await containers.create(request, IMAGE, {}, start=True)


async def exec_in(containers: Containers, record: ContainerRecord, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``argv`` run in the container, as ExecSync reports them."""
    process = exec_process(containers.process_defaults(record), list(argv), [], "")
    session = await containers.exec(record, process, False, stdin=False, size=None)
    out: list[bytes] = []
    err: list[bytes] = []
    try:
        async for stream, data in session.output():
            (out if stream == "stdout" else err).append(data)
        code = await asyncio.wait_for(session.wait(), 30)
    finally:
        await session.close()
    return code, b"".join(out).decode(), b"".join(err).decode()


async def logged(containers: Containers, record: ContainerRecord) -> list[tuple[str, str]]:
    """(stream, line) of everything the container wrote, once it has ended."""
    ended = await asyncio.wait_for(containers.wait(record), 30)
    assert ended.state is State.EXITED
    fields = [line.split(" ", 3) for line in record.log_path.read_text().splitlines()]
    return [(stream, content) for _, stream, _, content in fields]


def context(**fields: object) -> cri.LinuxContainerSecurityContext:
    return cri.LinuxContainerSecurityContext(**fields)  # type: ignore[arg-type]


def caps(add: Sequence[str] = (), drop: Sequence[str] = ()) -> cri.Capability:
    return cri.Capability(add_capabilities=list(add), drop_capabilities=list(drop))


# --------------------------------------------------------------------------- users and rootfs


async def test_run_as_user_username_group_and_supplemental_groups(lab: Lab) -> None:
    containers = lab.containers()
    uid = await run(containers, "uid", security=context(run_as_user=cri.Int64Value(1001)))
    assert await exec_in(containers, uid, "id", "-u") == (0, "1001\n", "")
    name = await run(containers, "name", security=context(run_as_username="nobody"))
    assert await exec_in(containers, name, "id", "-nu") == (0, "nobody\n", "")
    groups = await run(containers, "groups", security=context(supplemental_groups=[1234, 5678]))
    code, out, _ = await exec_in(containers, groups, "id", "-G")
    assert code == 0 and {"1234", "5678"} <= set(out.split())
    both = context(run_as_user=cri.Int64Value(1001), run_as_group=cri.Int64Value(1002))
    group = await run(containers, "group", ("sh", "-c", "echo $(id -u):$(id -g)"), security=both)
    assert await logged(containers, group) == [("stdout", "1001:1002")]
    with pytest.raises(CriError) as refused:
        await run(containers, "group-only", security=context(run_as_group=cri.Int64Value(1002)))
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT
    assert [r.name for r in containers.all()] == ["uid", "name", "groups", "group"]


async def test_read_only_rootfs(lab: Lab) -> None:
    containers = lab.containers()
    touch = ("sh", "-c", "touch test.go && [ -f test.go ] && echo 'Found'")
    writable = await run(containers, "writable", touch, security=context(readonly_rootfs=False))
    assert await logged(containers, writable) == [("stdout", "Found")]
    read_only = await run(containers, "read-only", touch, security=context(readonly_rootfs=True))
    assert await logged(containers, read_only) == [("stderr", "touch: test.go: Read-only file system")]


async def test_masked_and_readonly_paths_and_no_new_privs(lab: Lab) -> None:
    containers = lab.containers()
    paths = context(masked_paths=["/bin/ls"], readonly_paths=["/tmp"], no_new_privs=True)
    record = await run(containers, "paths", security=paths)
    # critest runs `sh -c ls`; this busybox's sh runs its applets without a PATH lookup, so the
    # masked file is named: the same failed exec of /dev/null bound over /bin/ls.
    code, out, err = await exec_in(containers, record, "/bin/sh", "-c", "/bin/ls")
    assert code != 0 and (out, err) == ("", "/bin/sh: /bin/ls: Permission denied\n")
    code, _, err = await exec_in(containers, record, "touch", "/tmp/test")
    assert code != 0 and err == "touch: /tmp/test: Read-only file system\n"
    no_new_privs = await exec_in(containers, record, "grep", "NoNewPrivs:", "/proc/self/status")
    assert no_new_privs == (0, "NoNewPrivs:\t1\n", "")
    plain = await run(containers, "plain")
    assert await exec_in(containers, plain, "sh", "-c", "ls /bin/ls && touch /tmp/test") == (
        0,
        "/bin/ls\n",
        "",
    )
    no_new_privs = await exec_in(containers, plain, "grep", "NoNewPrivs:", "/proc/self/status")
    assert no_new_privs == (0, "NoNewPrivs:\t0\n", "")


# ------------------------------------------------------------------ privileges, capabilities


async def test_privileged_and_capabilities(lab: Lab) -> None:
    containers = lab.containers()
    privileged = context(privileged=True)
    everything = await run(containers, "privileged", security=privileged, in_pod=PRIVILEGED_POD)
    assert (await exec_in(containers, everything, "brctl", "addbr", "foobar"))[0] == 0
    device = next(d for d in host_devices() if d["type"] == "b")  # a disk of the host's
    assert (await exec_in(containers, everything, "test", "-b", device["path"]))[0] == 0
    _, mounts, _ = await exec_in(containers, everything, "cat", "/proc/self/mounts")
    assert "sysfs /sys sysfs rw," in mounts
    with pytest.raises(CriError, match="a privileged container needs a privileged pod"):
        await run(containers, "refused", security=privileged)

    unprivileged = await run(containers, "unprivileged", security=context(privileged=False))
    code, _, err = await exec_in(containers, unprivileged, "brctl", "addbr", "foobar")
    assert code != 0 and "Operation not permitted" in err
    assert (await exec_in(containers, unprivileged, "test", "-e", device["path"]))[0] != 0
    net_admin = await run(containers, "net-admin", security=context(capabilities=caps(add=["NET_ADMIN"])))
    assert (await exec_in(containers, net_admin, "brctl", "addbr", "foobar"))[0] == 0

    no_raw = await run(containers, "no-raw", security=context(capabilities=caps(drop=["NET_RAW"])))
    code, _, err = await exec_in(containers, no_raw, "ping", "-c", "1", "127.0.0.1")
    assert code != 0 and "permission denied" in err

    async def bounding(record: ContainerRecord) -> str:
        return (await exec_in(containers, record, "grep", "CapBnd:", "/proc/self/status"))[1]

    zero = "CapBnd:\t0000000000000000\n"
    all_caps = await run(containers, "all", security=context(capabilities=caps(add=["ALL"])))
    assert await bounding(all_caps) != zero
    none = await run(containers, "none", security=context(capabilities=caps(drop=["ALL"])))
    assert await bounding(none) == zero


# ------------------------------------------------------------------------------------ seccomp


@pytest.fixture
def profiles(tmp_path: Path) -> dict[str, str]:
    """critest's two profiles, written as it writes them."""
    directory = tmp_path / "seccomp-tests"
    directory.mkdir()
    paths = {}
    for name, profile in (("block-host-name", BLOCK_HOST_NAME), ("block-chmod", BLOCK_CHMOD)):
        path = directory / f"{name}.json"
        path.write_text(json.dumps(profile, indent=4))
        paths[name] = str(path)
    return paths


def localhost(path: str) -> cri.SecurityProfile:
    return cri.SecurityProfile(profile_type=KINDS.Localhost, localhost_ref=path)


async def test_seccomp_profiles(lab: Lab, profiles: dict[str, str]) -> None:
    containers = lab.containers()

    async def seccomp_mode(name: str, profile: cri.SecurityProfile | None) -> str:
        record = await run(containers, name, security=context(seccomp=profile))
        return (await exec_in(containers, record, "grep", "Seccomp:", "/proc/self/status"))[1]

    assert (
        await seccomp_mode("unconfined", cri.SecurityProfile(profile_type=KINDS.Unconfined))
        == "Seccomp:\t0\n"
    )
    assert await seccomp_mode("default", cri.SecurityProfile()) == "Seccomp:\t2\n"  # RuntimeDefault
    assert await seccomp_mode("nil", None) == "Seccomp:\t0\n"

    chmod = await run(containers, "chmod", security=context(seccomp=localhost(profiles["block-chmod"])))
    code, _, err = await exec_in(containers, chmod, "chmod", "400", "/")
    assert code != 0 and "Operation not permitted" in err
    assert (await exec_in(containers, chmod, "grep", "Seccomp:", "/proc/self/status"))[1] == "Seccomp:\t2\n"


async def test_sethostname_under_seccomp_and_privileges(lab: Lab, profiles: dict[str, str]) -> None:
    containers = lab.containers()
    sys_admin = caps(add=["SYS_ADMIN"])
    blocked = localhost(profiles["block-host-name"])
    unconfined = cri.SecurityProfile(profile_type=KINDS.Unconfined)
    free = await run(
        containers, "free", ("sleep", "60"), security=context(capabilities=sys_admin, seccomp=unconfined)
    )
    assert await exec_in(containers, free, "hostname", "ANewHostName") == (0, "", "")
    denied = await run(
        containers, "denied", ("sleep", "60"), security=context(capabilities=sys_admin, seccomp=blocked)
    )
    code, _, err = await exec_in(containers, denied, "hostname", "ANewHostName")
    assert code != 0 and "Operation not permitted" in err
    privileged = context(privileged=True, seccomp=blocked)
    ignored = await run(containers, "ignored", ("sleep", "60"), security=privileged, in_pod=PRIVILEGED_POD)
    assert await exec_in(containers, ignored, "hostname", "ANewHostName") == (0, "", "")


# ------------------------------------------------------------------------------------- mounts


class HostMounts:
    """Mounts a test makes on the host, unmounted (lazily, with what is below them) at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.points: list[Path] = []

    def mount(self, *args: str | Path, at: Path) -> None:
        subprocess.run(["mount", *map(str, args), str(at)], check=True)
        self.points.append(at)

    def make(self, propagation: str, at: Path) -> None:
        subprocess.run(["mount", f"--make-{propagation}", str(at)], check=True)

    def under_root(self) -> list[str]:
        prefix = str(self.root) + "/"
        return [m.mount_point for m in read_mounts() if m.mount_point.startswith(prefix)]

    def clean(self) -> None:
        for made in reversed(self.points):
            subprocess.run(["umount", "--recursive", "--lazy", str(made)], check=False, capture_output=True)
        for point in reversed(self.under_root()):  # what propagated to the host from a container
            subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
        assert self.under_root() == []


@pytest.fixture
def host_mounts(lab: Lab, tmp_path: Path) -> Iterator[HostMounts]:
    """Depends on the lab so that its mounts go before the lab's containers do."""
    mounts = HostMounts(tmp_path)
    try:
        yield mounts
    finally:
        mounts.clean()


async def test_host_path_volumes_also_through_symlinks_and_created_when_missing(
    lab: Lab, tmp_path: Path
) -> None:
    containers = lab.containers()
    volume = tmp_path / f"test{os.getpid()}"
    volume.mkdir()
    (volume / "testVolume.file").touch()
    link = Path(f"{volume}-symlink")
    link.symlink_to(volume)
    missing = tmp_path / "created" / "here"
    record = await run(
        containers,
        "volumes",
        mounts=[
            cri.Mount(host_path=str(volume), container_path=str(volume), selinux_relabel=True),
            cri.Mount(host_path=str(link), container_path=str(link)),
            cri.Mount(host_path=str(missing), container_path="/created"),
        ],
    )
    assert await exec_in(containers, record, "ls", "-A", str(volume)) == (0, "testVolume.file\n", "")
    assert await exec_in(containers, record, "ls", "-A", str(link)) == (0, "testVolume.file\n", "")
    assert (await exec_in(containers, record, "test", "-L", str(link)))[0] != 0  # a directory there
    assert missing.is_dir()
    assert (await exec_in(containers, record, "touch", "/created/file"))[0] == 0
    assert (missing / "file").exists()


async def test_read_only_mounts_are_not_recursive_unless_asked(
    lab: Lab, host_mounts: HostMounts, tmp_path: Path
) -> None:
    containers = lab.containers()
    host = tmp_path / "host"
    (host / "tmpfs").mkdir(parents=True)
    host_mounts.mount("-t", "tmpfs", "tmpfs", at=host / "tmpfs")
    top_only = cri.Mount(host_path=str(host), container_path="/mnt", readonly=True, selinux_relabel=True)
    record = await run(containers, "top-only", mounts=[top_only])
    assert await exec_in(containers, record, "touch", "/mnt/tmpfs/file") == (0, "", "")
    assert await exec_in(containers, record, "touch", "/mnt/file") == (
        1,
        "",
        "touch: /mnt/file: Read-only file system\n",
    )
    recursive = cri.Mount(host_path=str(host), container_path="/mnt", readonly=True, recursive_read_only=True)
    with pytest.raises(CriError, match="recursive read-only mounts are not supported"):
        await run(containers, "refused", mounts=[recursive])
    record = await run(containers, "recursive", mounts=[recursive], recursive_read_only=True)
    code, _, err = await exec_in(containers, record, "touch", "/mnt/tmpfs/foo")
    assert code != 0 and err == "touch: /mnt/tmpfs/foo: Read-only file system\n"


@pytest.mark.parametrize(
    ("propagation", "expected"),
    [
        # (the host mount's propagation, the container sees a host mount, the host sees its mount)
        (PROPAGATION.PROPAGATION_PRIVATE, ("rprivate", False, False)),
        (PROPAGATION.PROPAGATION_HOST_TO_CONTAINER, ("rshared", True, False)),
        (PROPAGATION.PROPAGATION_BIDIRECTIONAL, ("rshared", True, True)),
    ],
)
async def test_mount_propagation(
    lab: Lab,
    host_mounts: HostMounts,
    tmp_path: Path,
    propagation: cri.MountPropagation,
    expected: tuple[str, bool, bool],
) -> None:
    """critest's layout: a host directory bind-mounted on itself with the propagation asked."""
    host_mode, sees_host, host_sees = expected
    source = tmp_path / "mnt"
    (source / "propagationMnt").mkdir(parents=True)
    flag_dir = tmp_path / "propagationSrcDir"
    flag_dir.mkdir()
    (flag_dir / "flagFile").touch()
    host_mounts.mount("--bind", source, at=source)
    host_mounts.make(host_mode, source)
    containers = lab.containers()
    mount = cri.Mount(host_path=str(source), container_path=str(source), propagation=propagation)
    record = await run(
        containers, "propagation", security=context(privileged=True), mounts=[mount], in_pod=PRIVILEGED_POD
    )

    host_mounts.mount("--bind", flag_dir, at=source / "propagationMnt")
    _, listed, _ = await exec_in(containers, record, "ls", "-A", str(source / "propagationMnt"))
    assert listed == ("flagFile\n" if sees_host else "")

    inside = source / "containerMntPoint"
    assert (await exec_in(containers, record, "sh", "-c", f"mkdir -p {inside}"))[0] == 0
    assert (await exec_in(containers, record, "sh", "-c", f"mount --bind /etc {inside}"))[0] == 0
    assert bool(os.listdir(inside)) is host_sees


async def test_propagation_needs_a_host_mount_that_carries_it(
    lab: Lab, host_mounts: HostMounts, tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir()
    host_mounts.mount("--bind", private, at=private)
    host_mounts.make("rprivate", private)
    for propagation, needed in (
        (PROPAGATION.PROPAGATION_HOST_TO_CONTAINER, "shared or slave"),
        (PROPAGATION.PROPAGATION_BIDIRECTIONAL, "shared"),
    ):
        mount = cri.Mount(host_path=str(private / "sub"), container_path="/m", propagation=propagation)
        config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"), mounts=[mount])
        with pytest.raises(CriError) as refused:
            linux_security(config, POD, profile_max_bytes=PROFILE_MAX)
        assert refused.value.kind is ErrorKind.FAILED_PRECONDITION
        mode = propagation.name.removeprefix("PROPAGATION_")
        assert refused.value.message == (
            f"config.mounts[0].propagation: {mode} needs {private / 'sub'} on a {needed} mount, "
            f"but it is on {private}, which is private"
        )
    # A slave of a shared mount carries the host's mounts to a container.
    host_mounts.make("rshared", private)
    slave = tmp_path / "slave"
    slave.mkdir()
    host_mounts.mount("--bind", private, at=slave)
    host_mounts.make("rslave", slave)
    mount = cri.Mount(
        host_path=str(slave), container_path="/m", propagation=PROPAGATION.PROPAGATION_HOST_TO_CONTAINER
    )
    config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"), mounts=[mount])
    assert linux_security(config, POD, profile_max_bytes=PROFILE_MAX).mounts[0].options == ("rslave",)
    mount.propagation = PROPAGATION.PROPAGATION_BIDIRECTIONAL
    with pytest.raises(CriError, match=f"but it is on {slave}, which is slave"):
        linux_security(config, POD, profile_max_bytes=PROFILE_MAX)
