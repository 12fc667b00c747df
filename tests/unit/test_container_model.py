"""auraed.containers.model: container records as the state store keeps them."""

from __future__ import annotations

from auraed.containers.model import ContainerRecord, State
from auraed.containers.sandbox import CGROUP_PARENT

# A record as auraed saved it before containers had sandboxes: no cgroup_parent, no sandbox_id,
# no log_file (a log path of the sandbox's choosing), and no stdin (nor the monitor's input_fd).
BEFORE_SANDBOXES = {
    "id": "0" * 32,
    "name": "web",
    "image": "localhost/busybox:latest",
    "image_id": "sha256:" + "1" * 64,
    "directory": "/var/lib/aurae/containers/" + "0" * 32,
    "labels": {"app": "web"},
    "tty": False,
    "stop_signal": 15,
    "process": {"args": ["sleep", "300"]},
    "state": State.RUNNING,
    "created_at": 1.0,
    "started_at": 2.0,
    "finished_at": None,
    "monitor_pid": 100,
    "monitor_ticks": 5,
    "pid": 101,
    "ticks": 6,
    "exit_code": None,
    "signal": None,
    "oom_killed": False,
    "reason": "",
}


def test_a_record_from_before_sandboxes_is_a_container_on_its_own() -> None:
    record = ContainerRecord.from_doc(dict(BEFORE_SANDBOXES))
    assert (record.cgroup_parent, record.sandbox_id, record.log_file) == (CGROUP_PARENT, "", "")
    assert (record.stdin, record.input_fd, record.supervised.input_fd) == (False, -1, -1)
    assert record.to_doc() == {
        **BEFORE_SANDBOXES,
        "cgroup_parent": CGROUP_PARENT,
        "sandbox_id": "",
        "log_file": "",
        "stdin": False,
        "stdin_once": False,
        "input_fd": -1,
        "volume_images": (),
        "shared_layers": [],  # the store's image, as for every record saved before shared ones
        "shared_volume_layers": [],  # likewise for its image volumes
    }


def test_a_sandboxed_record_keeps_its_cgroup_parent_and_sandbox() -> None:
    doc = {**BEFORE_SANDBOXES, "cgroup_parent": "_pods/p1", "sandbox_id": "p1"}
    record = ContainerRecord.from_doc(dict(doc))
    assert (record.cgroup_parent, record.sandbox_id) == ("_pods/p1", "p1")
    assert ContainerRecord.from_doc(record.to_doc()) == record
