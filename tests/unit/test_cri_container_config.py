"""A CRI ContainerConfig checked into the CRI's values and a host container request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from auraed.api.runtime import v1 as cri
from auraed.containers.request import Resources
from auraed.cri.container_config import ContainerSpec, CriMount, container_spec, resources
from auraed.cri.errors import CriError
from auraed.cri.model import pod_spec
from auraed.errors import ErrorKind

IMAGE = cri.ImageSpec(image="sha256:" + "ab" * 32, user_specified_image="busybox:1.29-2")
PROFILE_MAX = 1 << 20  # cri_profile_max_kib's default


def pod(**fields: Any) -> Any:
    metadata = cri.PodSandboxMetadata(name="web", uid="web-uid", namespace="default", attempt=1)
    return pod_spec(cri.PodSandboxConfig(metadata=metadata, **fields), "cell")


def config(**fields: Any) -> cri.ContainerConfig:
    fields.setdefault("metadata", cri.ContainerMetadata(name="app", attempt=2))
    fields.setdefault("image", IMAGE)
    return cri.ContainerConfig(**fields)


def spec(**fields: Any) -> ContainerSpec:
    return container_spec(config(**fields), pod(), profile_max_bytes=PROFILE_MAX)


def refusal(field: str, **fields: Any) -> CriError:
    with pytest.raises(CriError) as error:
        spec(**fields)
    assert error.value.message.startswith(field + ": "), error.value.message
    return error.value


def test_what_the_cri_keeps_and_the_host_request() -> None:
    made = container_spec(
        config(
            command=["sh", "-c"],
            args=["echo $A"],
            envs=[cri.KeyValue(key="A", value="b=c")],
            working_dir="/tmp",
            labels={"foo": "bar"},
            annotations={"abc": "def"},
            tty=True,
            stop_signal=cri.Signal.SIGINT,
            log_path="app/2.log",
        ),
        pod(
            log_directory="/var/log/pods/web",
            linux=cri.LinuxPodSandboxConfig(sysctls={"kernel.shm_rmid_forced": "1"}),
        ),
        profile_max_bytes=PROFILE_MAX,
    )
    assert (made.name, made.attempt, made.image.shown, made.image.image) == (
        "app",
        2,
        "busybox:1.29-2",
        IMAGE.image,
    )
    assert (made.labels, made.annotations) == ({"foo": "bar"}, {"abc": "def"})
    assert made.log_path == Path("/var/log/pods/web/app/2.log")
    request = made.request
    assert request.name == "app_web_default_web-uid_2"  # unique per pod and attempt
    assert (request.command, request.args, request.env) == (("sh", "-c"), ("echo $A",), ("A=b=c",))
    assert (request.working_dir, request.tty, request.stop_signal) == ("/tmp", True, "SIGINT")
    assert request.sysctls == {"kernel.shm_rmid_forced": "1"}  # the pod's, in each container
    assert request.security.oom_score_adj is None and request.resources == Resources()


def test_no_log_directory_or_no_log_path_is_the_containers_own_log() -> None:
    assert spec(log_path="app.log").log_path is None
    assert (
        container_spec(config(), pod(log_directory="/logs"), profile_max_bytes=PROFILE_MAX).log_path is None
    )
    with pytest.raises(CriError) as error:
        container_spec(
            config(log_path="../../etc/passwd"), pod(log_directory="/logs/web"), profile_max_bytes=PROFILE_MAX
        )
    assert error.value.message.startswith("config.log_path: ")


def test_mounts_as_asked_and_as_binds(tmp_path: Path) -> None:
    """The CRI keeps the mount as asked; the host request gets auraed.cri.security's bind of the
    resolved host path (a symlink followed), read-only."""
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    asked = cri.Mount(
        container_path="/data", host_path=str(tmp_path / "link"), readonly=True, selinux_relabel=True
    )
    made = spec(mounts=[asked])
    assert made.mounts == (CriMount("/data", str(tmp_path / "link"), readonly=True, selinux_relabel=True),)
    (bind,) = made.request.mounts
    assert (bind.destination, bind.source, bind.read_only) == ("/data", str(tmp_path / "data"), True)
    refusal("config.mounts[0].host_path", mounts=[cri.Mount(container_path="/data", host_path="relative")])
    # An image volume has no host path; the image is the container domain's to find.
    image_volume = cri.Mount(
        container_path="/data", image=cri.ImageSpec(image="busybox"), image_sub_path="bin"
    )
    made = spec(mounts=[image_volume])
    assert [(m.host_path, m.image, m.image_sub_path) for m in made.mounts] == [("", "busybox", "bin")]


def test_resources_zero_is_unset() -> None:
    limits = cri.LinuxContainerResources(
        cpu_period=100_000,
        cpu_quota=20_000,
        cpu_shares=1024,
        memory_limit_in_bytes=64 << 20,
        memory_swap_limit_in_bytes=64 << 20,
        oom_score_adj=-998,
        cpuset_cpus="0",
    )
    made = spec(linux=cri.LinuxContainerConfig(resources=limits))
    assert made.request.resources == Resources(
        cpu_period=100_000,
        cpu_max=20_000,
        cpu_shares=1024,
        cpuset_cpus="0",
        memory_max=64 << 20,
        memory_swap=64 << 20,
    )
    assert made.request.security.oom_score_adj == -998  # the spec raises it to auraed's own
    assert resources(cri.LinuxContainerResources(), "linux") == Resources()
    # memory + swap without a memory limit adds to nothing: dropped, as the kubelet never sends it.
    assert resources(cri.LinuxContainerResources(memory_swap_limit_in_bytes=1 << 30), "linux") == Resources()
    with pytest.raises(CriError) as error:
        resources(cri.LinuxContainerResources(cpu_quota=-1), "linux")
    assert error.value.message == "linux.cpu_quota: is negative"


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("config.metadata", {"metadata": None}),
        ("config.metadata.name", {"metadata": cri.ContainerMetadata(name="")}),
        ("config.metadata.name", {"metadata": cri.ContainerMetadata(name="a_b")}),
        ("config.image.image", {"image": None}),
        ("config.image.image", {"image": cri.ImageSpec(image="")}),
        ("config.envs[0].key", {"envs": [cri.KeyValue(key="", value="x")]}),
        ("config.envs[0].key", {"envs": [cri.KeyValue(key="A=B", value="x")]}),
        ("config.command[1]", {"command": ["sh", "a\0b"]}),
        ("config.labels", {"labels": {"": "x"}}),
        ("config.mounts[0].container_path", {"mounts": [cri.Mount(host_path="/srv")]}),
    ],
)
def test_refusals_name_the_field(field: str, fields: dict[str, Any]) -> None:
    assert refusal(field, **fields).kind is ErrorKind.INVALID_ARGUMENT
