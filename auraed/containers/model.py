"""Container records, as persisted and as reported."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from auraed.containers.sandbox import CGROUP_PARENT
from auraed.state.store import flat_doc
from auraed.system.supervisor import Supervised


class State:
    CREATING = "creating"  # kernel objects being made; a record left so is torn down at start
    CREATED = "created"
    RUNNING = "running"
    EXITED = "exited"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class ProcessUser:
    """The ids a container's process runs with: its spec's ``process.user``."""

    uid: int
    gid: int
    additional_gids: tuple[int, ...]  # its supplementary groups, the primary group among them

    @classmethod
    def of(cls, process: dict[str, Any]) -> ProcessUser | None:
        """From an OCI process; None when it names no user (a record made before they were kept)."""
        user = process.get("user")
        if not isinstance(user, dict) or "uid" not in user:
            return None
        return cls(int(user["uid"]), int(user.get("gid", 0)), tuple(map(int, user.get("additionalGids", ()))))


@dataclasses.dataclass
class ContainerRecord:
    id: str
    name: str
    image: str  # as the client named it
    image_id: str
    directory: str  # state_dir/containers/<id>: bundle, rootfs, upper, work, log
    labels: dict[str, str]
    tty: bool
    stop_signal: int
    process: dict[str, Any]  # the OCI process of the spec: defaults for Exec
    # Its cgroup is <cgroup_parent>/<id> below the cgroup base; records from before sandboxes
    # have neither field and were host-local.
    cgroup_parent: str = CGROUP_PARENT
    sandbox_id: str = ""  # the sandbox it belongs to, "" for none
    # Where its CRI-format log goes when its sandbox names a place (a kubelet's log directory);
    # "": container.log in its own directory, as for every record saved before.
    log_file: str = ""
    # Its stdin is a pipe its monitor holds (attach writes to it); with stdin_once the pipe is
    # closed after the first attach. input_fd: the monitor's descriptor for the input (that
    # pipe, or the terminal master with a tty), -1 for none.
    stdin: bool = False
    stdin_once: bool = False
    input_fd: int = -1
    state: str = State.CREATING
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    monitor_pid: int = 0
    monitor_ticks: int | None = None
    pid: int = 0
    ticks: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    reason: str = ""
    # The images it mounts as volumes (IMAGE_MOUNT), by id, in its mounts' order: kept while it is.
    volume_images: tuple[str, ...] = ()
    # The layers' directories (bottom first) of an image this machine does not store but reads
    # where another machine shares it (auraed.containers.rootfs.SharedImage); none: the store's.
    shared_layers: list[str] = dataclasses.field(default_factory=list)
    # For each of volume_images, its shared layers' directories as shared_layers are (the
    # request's Mount.image_layers); an empty list: the store's image.
    shared_volume_layers: list[list[str]] = dataclasses.field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.directory)

    @property
    def bundle(self) -> Path:
        return self.path / "bundle"

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"

    @property
    def log_path(self) -> Path:
        return Path(self.log_file) if self.log_file else self.path / "container.log"

    @property
    def exit_path(self) -> Path:
        return self.path / "exit.json"

    @property
    def supervised(self) -> Supervised:
        return Supervised(self.monitor_pid, self.monitor_ticks, self.pid, self.ticks, self.input_fd)

    @property
    def user(self) -> ProcessUser | None:
        return ProcessUser.of(self.process)

    @property
    def alive(self) -> bool:
        return self.state in (State.CREATED, State.RUNNING)

    def to_doc(self) -> dict[str, Any]:
        return flat_doc(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ContainerRecord:
        return cls(**{**doc, "volume_images": tuple(doc.get("volume_images", ()))})
