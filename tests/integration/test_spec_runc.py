"""Specs from auraed.containers.oci_spec run by the real runc over a busybox root filesystem (root only).

Every container lives below the cgroup ``/aurae-spectest-<pid>``; fixtures delete containers with
``runc delete --force`` and remove that cgroup parent (runc leaves parents behind) in every
hierarchy, even when a test fails, then assert that nothing named like it is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from auraed.containers.oci_spec import (
    ALL_CAPABILITIES,
    DEFAULT_CAPABILITIES,
    ImageRuntimeConfig,
    build_spec,
    read_oom_score_adj,
)
from auraed.containers.request import (
    ContainerRequest,
    Hook,
    Hooks,
    Mount,
    Resources,
    Rlimit,
    Security,
    SpecError,
)
from auraed.system.cgroupfs import cpu_weight_to_shares
from tests.support.busybox import make_busybox_rootfs

RUNC = shutil.which("runc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
BASE = f"aurae-spectest-{os.getpid()}"
RUN_TIMEOUT = 30


PROBE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void *thread_main(void *arg) { return arg; }
static int child(void *arg) { (void)arg; return 0; }
static char stack[65536];

static void report(const char *what, long rc) { printf("%s=%d\n", what, rc == -1 ? errno : 0); }

int main(void) {
    pthread_t thread;
    int rc = pthread_create(&thread, NULL, thread_main, NULL); /* glibc tries clone3 first */
    if (rc == 0) pthread_join(thread, NULL);
    printf("pthread=%d\n", rc);
    report("clone3", syscall(SYS_clone3, NULL, 0)); /* EINVAL when allowed, ENOSYS when filtered */
    int pid = clone(child, stack + sizeof stack, SIGCHLD, NULL);
    if (pid > 0) waitpid(pid, NULL, 0);
    report("clone", pid);
    pid = clone(child, stack + sizeof stack, CLONE_NEWUSER | SIGCHLD, NULL);
    if (pid > 0) waitpid(pid, NULL, 0);
    report("clone_newuser", pid);
    /* Last: afterwards this process is in a user namespace without an id mapping. */
    report("unshare_user", unshare(CLONE_NEWUSER));
    return 0;
}
"""


def leftovers() -> list[Path]:
    return [p for hierarchy in CGROUP_ROOT.iterdir() for p in hierarchy.glob(f"{BASE}*")]


def remove_cgroup_base() -> None:
    for hierarchy in CGROUP_ROOT.iterdir():
        base = hierarchy / BASE
        if not base.is_dir():
            continue
        for directory in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if directory.is_dir():
                with contextlib.suppress(OSError):
                    directory.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    spec: dict[str, Any]
    rootfs: Path


class Runner:
    """Builds a bundle per run, runs it in the foreground, and always deletes the container."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.state = workdir / "runc-state"
        self.count = 0
        self.ids: list[str] = []

    def bundle(self) -> tuple[str, Path]:
        self.count += 1
        container_id = f"spec-{os.getpid()}-{self.count}"
        bundle = self.workdir / container_id
        make_busybox_rootfs(bundle / "rootfs")
        return container_id, bundle

    def run(
        self,
        request: ContainerRequest,
        image: ImageRuntimeConfig | None = None,
        prepare: Callable[[Path], None] | None = None,
        **kwargs: Any,
    ) -> Result:
        container_id, bundle = self.bundle()
        rootfs = bundle / "rootfs"
        if prepare is not None:
            prepare(rootfs)
        spec = build_spec(image or ImageRuntimeConfig(), request, rootfs, f"/{BASE}/{container_id}", **kwargs)
        (bundle / "config.json").write_text(json.dumps(spec))
        self.ids.append(container_id)
        assert RUNC is not None
        try:
            completed = subprocess.run(
                [RUNC, "--root", str(self.state), "run", "--bundle", str(bundle), container_id],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT,
                check=False,
            )
        finally:
            self.delete(container_id)
        return Result(completed.returncode, completed.stdout, completed.stderr, spec, rootfs)

    def sh(self, script: str, request: ContainerRequest | None = None, **kwargs: Any) -> Result:
        base = request or ContainerRequest(name="spectest")
        return self.run(dataclasses.replace(base, command=("/bin/sh", "-c", script), args=()), **kwargs)

    def delete(self, container_id: str) -> None:
        assert RUNC is not None
        subprocess.run(
            [RUNC, "--root", str(self.state), "delete", "--force", container_id],
            capture_output=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def cleanup(self) -> None:
        for container_id in self.ids:
            self.delete(container_id)
        remove_cgroup_base()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def runc(tmp_path: Path) -> Iterator[Runner]:
    runner = Runner(tmp_path / "runc")
    runner.workdir.mkdir()
    try:
        yield runner
    finally:
        runner.cleanup()
        assert leftovers() == []


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None, "no C compiler for the seccomp probe: run hack/setup"
    directory = tmp_path_factory.mktemp("probe")
    (directory / "probe.c").write_text(PROBE_C)
    built = subprocess.run(
        [compiler, "-static", "-pthread", "-O1", "-o", str(directory / "probe"), str(directory / "probe.c")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, f"cannot build a static probe: {built.stderr[-500:]}"
    return directory / "probe"


def status_field(output: str, name: str) -> str:
    for line in output.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise AssertionError(f"{name} not in {output!r}")


def cap_mask(names: list[str] | tuple[str, ...]) -> int:
    return sum(1 << ALL_CAPABILITIES.index(name) for name in names)


def ok(result: Result) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


# ------------------------------------------------------------------------------- capabilities


def test_default_capabilities_and_seccomp(runc: Runner) -> None:
    out = ok(runc.sh("cat /proc/self/status"))
    assert int(status_field(out, "CapEff"), 16) == cap_mask(DEFAULT_CAPABILITIES)
    assert int(status_field(out, "CapBnd"), 16) == cap_mask(DEFAULT_CAPABILITIES)
    assert int(status_field(out, "CapAmb"), 16) == 0
    assert status_field(out, "NoNewPrivs") == "0"
    assert status_field(out, "Seccomp") == "2"


def test_drop_all_add_one(runc: Runner) -> None:
    security = Security(capabilities_drop=("ALL",), capabilities_add=("net_bind_service",))
    out = ok(runc.sh("cat /proc/self/status", ContainerRequest(name="spectest", security=security)))
    assert int(status_field(out, "CapEff"), 16) == 1 << 10
    assert int(status_field(out, "CapBnd"), 16) == 1 << 10


def test_no_new_privileges(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", security=Security(no_new_privileges=True))
    assert status_field(ok(runc.sh("cat /proc/self/status", request)), "NoNewPrivs") == "1"


# --------------------------------------------------------------------------------- filesystem


def test_read_only_rootfs_keeps_tmp_and_volumes_writable(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", security=Security(read_only_rootfs=True))
    image = ImageRuntimeConfig(volumes=("/data",))
    result = runc.sh(
        "touch /x 2>&1; echo root=$?; touch /tmp/x; echo tmp=$?; touch /data/x; echo data=$?",
        request,
        image=image,
    )
    out = ok(result)
    assert "Read-only file system" in out
    assert "root=1" in out
    assert "tmp=0" in out
    assert "data=0" in out
    assert not (result.rootfs / "x").exists()


def test_writable_rootfs(runc: Runner) -> None:
    result = runc.sh("touch /x && echo done")
    assert ok(result).strip() == "done"
    assert (result.rootfs / "x").exists()


def test_masked_and_readonly_paths(runc: Runner) -> None:
    script = (
        "echo interrupts=$(cat /proc/interrupts | wc -c); echo firmware=$(ls -A /sys/firmware | wc -l);"
        " echo kcore=$(head -c 16 /proc/kcore 2>/dev/null | wc -c);"
        " echo 1 > /proc/sys/kernel/ns_last_pid 2>/dev/null; echo sys=$?"
    )
    out = ok(runc.sh(script))
    assert "interrupts=0" in out
    assert "firmware=0" in out
    assert "kcore=0" in out  # masked (and absent on kernels without /proc/kcore)
    assert "sys=1" in out
    # Replacing the defaults unmasks what is no longer listed.
    request = ContainerRequest(name="spectest", security=Security(masked_paths=("/proc/keys",)))
    out = ok(runc.sh("echo interrupts=$(cat /proc/interrupts | wc -c)", request))
    assert "interrupts=0" not in out


def test_bind_mounts_read_write_and_read_only(runc: Runner, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "hello").write_text("from the host\n")
    request = ContainerRequest(
        name="spectest",
        mounts=(
            Mount(destination="/mnt/rw", source=str(shared)),
            Mount(destination="/mnt/ro", source=str(shared), read_only=True),
            Mount(destination="/scratch", type="tmpfs", options=("size=1m",)),
        ),
    )
    script = (
        "cat /mnt/ro/hello; echo inside > /mnt/rw/new; echo rw=$?;"
        " echo x > /mnt/ro/other 2>/dev/null; echo ro=$?; touch /scratch/f; echo tmpfs=$?"
    )
    out = ok(runc.sh(script, request))
    assert "from the host" in out
    assert "rw=0" in out
    assert "ro=1" in out
    assert "tmpfs=0" in out
    assert (shared / "new").read_text() == "inside\n"
    assert not (shared / "other").exists()


def test_missing_bind_source_fails_before_runc(runc: Runner, tmp_path: Path) -> None:
    request = ContainerRequest(name="spectest", mounts=(Mount("/mnt", str(tmp_path / "missing")),))
    with pytest.raises(SpecError) as info:
        runc.sh("true", request)
    assert info.value.kind == "not_found"
    assert "mounts[0].source" in info.value.message
    assert runc.ids == []  # runc never ran


# ------------------------------------------------------------------------------- user and cwd


def add_group_member(rootfs: Path) -> None:
    with (rootfs / "etc" / "group").open("a") as group:
        group.write("audio:x:29:app\n")


def test_user_from_the_image(runc: Runner) -> None:
    out = ok(
        runc.sh(
            "id -u; id -g; id -G",
            image=ImageRuntimeConfig(user="app"),
            prepare=add_group_member,
        )
    )
    assert out.split("\n")[:3] == ["1000", "1000", "1000 29"]


def test_numeric_user_and_group(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", security=Security(user="1000:1000"))
    out = ok(runc.sh("id -u; id -g; cat /proc/self/status", request))
    assert out.split("\n")[:2] == ["1000", "1000"]
    assert int(status_field(out, "CapEff"), 16) == 0  # a non-root user keeps no capabilities


def test_missing_working_dir_is_created_for_the_user(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", working_dir="/work/sub", security=Security(user="app"))
    result = runc.sh("pwd; stat -c %u:%g .; touch mine && echo wrote", request)
    assert ok(result).split("\n")[:3] == ["/work/sub", "1000:1000", "wrote"]
    assert (result.rootfs / "work" / "sub").stat().st_uid == 1000


# ------------------------------------------------------------------------------ process setup


def test_rlimits(runc: Runner) -> None:
    assert ok(runc.sh("ulimit -n; ulimit -Hn")).split() == ["1024", "1024"]
    request = ContainerRequest(name="spectest", rlimits=(Rlimit("nofile", 321, 654),))
    assert ok(runc.sh("ulimit -n; ulimit -Hn", request)).split() == ["321", "654"]


def test_env_hostname_and_args(runc: Runner) -> None:
    image = ImageRuntimeConfig(
        entrypoint=("/bin/sh", "-c"), cmd=("echo never",), env=("A=image", "B=image", "PATH=/bin")
    )
    request = ContainerRequest(
        name="spectest",
        hostname="spec-host",
        env=("B=request", "C=new"),
        args=('echo "$A $B $C $PATH"; hostname',),
    )
    result = runc.run(request, image)
    assert ok(result).split("\n")[:2] == ["image request new /bin", "spec-host"]


def test_namespaced_sysctl(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", sysctls={"net.ipv4.ip_unprivileged_port_start": "0"})
    assert ok(runc.sh("cat /proc/sys/net/ipv4/ip_unprivileged_port_start", request)).strip() == "0"
    assert ok(runc.sh("cat /proc/sys/net/ipv4/ip_unprivileged_port_start")).strip() == "1024"


def test_oom_score_adj_never_below_auraed(runc: Runner) -> None:
    own = read_oom_score_adj()
    request = ContainerRequest(name="spectest", security=Security(oom_score_adj=-999))
    # A value below auraed's own would make runc fail without CAP_SYS_RESOURCE: it is raised.
    assert int(ok(runc.sh("cat /proc/self/oom_score_adj", request))) == max(own, -999)
    request = ContainerRequest(name="spectest", security=Security(oom_score_adj=700))
    assert int(ok(runc.sh("cat /proc/self/oom_score_adj", request))) == max(own, 700)


def test_hooks_run(runc: Runner, tmp_path: Path) -> None:
    created = tmp_path / "created.json"
    stopped = tmp_path / "stopped"
    hooks = Hooks(
        create_runtime=(Hook("/bin/sh", args=("-c", f"cat > {created}")),),
        poststop=(
            Hook("/bin/sh", args=("-c", f"echo $MARK > {stopped}"), env=("MARK=gone",), timeout_seconds=5),
        ),
    )
    result = runc.sh("true", ContainerRequest(name="spectest", hooks=hooks))
    ok(result)
    assert json.loads(created.read_text())["id"] == runc.ids[-1]  # hooks get the state on stdin
    assert stopped.read_text() == "gone\n"


# ---------------------------------------------------------------------------------- cgroups


def test_memory_cpu_and_pids_limits_in_the_cgroup(runc: Runner) -> None:
    resources = Resources(memory_max=64 << 20, pids_max=16, cpu_weight=200)
    request = ContainerRequest(name="spectest", resources=resources)
    script = (
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max;"
        " cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max;"
        " cat /sys/fs/cgroup/cpu/cpu.shares 2>/dev/null || cat /sys/fs/cgroup/cpu.weight"
    )
    memory, pids, cpu = ok(runc.sh(script, request)).split()
    assert int(memory) == 64 << 20
    assert int(pids) == 16
    assert int(cpu) in (cpu_weight_to_shares(200), 200)


def test_pids_limit_stops_forks(runc: Runner) -> None:
    request = ContainerRequest(name="spectest", resources=Resources(pids_max=4))
    result = runc.sh("for i in 1 2 3 4 5 6 7 8; do sleep 1 & done; wait; echo finished", request)
    assert "can't fork" in result.stdout + result.stderr or "Resource temporarily" in result.stderr


# ---------------------------------------------------------------------------------- seccomp


def test_seccomp_default_blocks_unshare_and_unconfined_allows_it(runc: Runner) -> None:
    result = runc.sh("unshare -U true")
    assert result.returncode != 0
    assert "Operation not permitted" in result.stderr
    request = ContainerRequest(name="spectest", security=Security(seccomp_profile="unconfined"))
    ok(runc.sh("unshare -U true && echo unshared", request))
    # Even with a user namespace's full capabilities, mounting needs the unconfined profile.
    out = ok(runc.sh("unshare -r -m sh -c 'mount -t tmpfs none /tmp && echo mounted'", request))
    assert "mounted" in out
    assert status_field(ok(runc.sh("cat /proc/self/status", request)), "Seccomp") == "0"


def test_seccomp_syscalls_with_a_probe(runc: Runner, probe: Path) -> None:
    def install(rootfs: Path) -> None:
        shutil.copy2(probe, rootfs / "bin" / "probe")

    def run(request: ContainerRequest) -> dict[str, int]:
        out = ok(runc.run(request, ImageRuntimeConfig(cmd=("/bin/probe",)), prepare=install))
        return {key: int(value) for key, value in (line.split("=") for line in out.split())}

    confined = run(ContainerRequest(name="spectest"))
    # clone3 fails with ENOSYS so glibc's pthread_create falls back to clone, which works.
    assert confined == {"pthread": 0, "clone3": 38, "unshare_user": 1, "clone_newuser": 1, "clone": 0}
    unconfined = run(ContainerRequest(name="spectest", security=Security(seccomp_profile="unconfined")))
    assert unconfined == {"pthread": 0, "clone3": 22, "unshare_user": 0, "clone_newuser": 0, "clone": 0}
