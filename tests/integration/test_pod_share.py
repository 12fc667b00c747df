"""A vm pod's share on this host's kernel (auraed.cri.pod_share), without a guest:
test_cri_vm_share.py performs the attacks from a real guest; here the share is seen from a mount
namespace made in the pod's own as virtiofsd's sandbox makes its own there (every mount a slave
of the pod namespace's), and the tree is given what only a compromised share could hold
(symlinks where the host makes its mount points), to show that no link in it is followed and
that its removal stops at nothing. The host's own mount table holds nothing of it but the pin.

Every test unmounts what it made, also when it fails (``shares``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from auraed.containers.request import Mount
from auraed.cri.errors import CriError
from auraed.cri.pod_share import POINTS, SERVED, PodShares
from auraed.system import namespaces
from auraed.system.mounts import THREAD_MOUNTINFO, MountEntry, read_mounts

POD = "0123456789abcdef" * 4


def mounts_below(path: Path) -> list[str]:
    """On the host."""
    return [e.mount_point for e in read_mounts() if e.mount_point.startswith(str(path))]


def pod_mounts(shares: PodShares, pod: str = POD) -> dict[str, MountEntry]:
    """The mounts of the pod's namespace, by mount point (the topmost of each)."""
    entries = namespaces.in_mount_namespace(shares.namespace(pod), lambda: read_mounts(THREAD_MOUNTINFO))
    return {entry.mount_point: entry for entry in entries}


def pod_mounts_below(shares: PodShares, path: Path) -> list[str]:
    return sorted(point for point in pod_mounts(shares) if point.startswith(str(path)))


def in_pod_namespace(shares: PodShares, script: str) -> None:
    """``script`` (sh -c) in the pod's mount namespace, where its share is mounted."""
    subprocess.run(["nsenter", f"--mount={shares.namespace(POD)}", "sh", "-c", script], check=True)


@pytest.fixture
def shares(tmp_path: Path) -> Iterator[PodShares]:
    try:
        yield PodShares(tmp_path / "pod-shares")
    finally:
        for point in sorted(mounts_below(tmp_path), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@pytest.fixture
def volumes(tmp_path: Path) -> Path:
    """ro/ (a file in it), rro/ with a tmpfs at rro/below, rw/, and a file."""
    top = tmp_path / "volumes"
    for name in ("ro", "rro/below", "rw"):
        (top / name).mkdir(parents=True)
    (top / "ro" / "keep").write_text("keep\n")
    (top / "file").write_text("the host's\n")
    namespaces.mount("below", top / "rro" / "below", "tmpfs", 0, "size=64k")
    return top


class VirtiofsdView:
    """A process in a mount namespace of its own whose mounts are slaves of the pod namespace's,
    made as virtiofsd started there (auraed.vms.qemu) makes its own with ``sandbox=namespace``: a
    share's later mounts reach it by propagation only."""

    def __init__(self, shares: PodShares) -> None:
        enter = ["nsenter", f"--mount={shares.namespace(POD)}"]
        self.process = subprocess.Popen(
            [*enter, "unshare", "--mount", "--propagation", "slave", "sleep", "600"]
        )
        for _ in range(500):  # ready once sleep runs: unshare made the namespace and its slaves
            if Path(f"/proc/{self.process.pid}/comm").read_text().strip() == "sleep":
                return
            time.sleep(0.01)
        raise AssertionError("unshare did not start")

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.process.pid), "-m", "sh", "-c", script],
            capture_output=True,
            text=True,
            check=False,
        )

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def virtiofsd_view(shares: PodShares) -> Iterator[VirtiofsdView]:
    view = VirtiofsdView(shares)
    try:
        yield view
    finally:
        view.close()


def bind(source: Path, destination: str, *options: str, read_only: bool = False) -> Mount:
    return Mount(destination, str(source), "bind", options, read_only)


def test_the_share_is_read_only_where_virtiofsd_serves_it_but_for_writable_volumes(
    shares: PodShares, volumes: Path
) -> None:
    served = shares.make(POD)
    assert shares.make(POD) == served == shares.directory(POD) / SERVED  # idempotent
    entries = pod_mounts(shares)
    assert entries[str(served)].shared
    assert entries[str(shares.directory(POD) / POINTS)].propagation == "private"
    with virtiofsd_view(shares) as view:  # as virtiofsd starts: after the share is made, before binds
        guest = shares.bind(
            POD,
            "k1",
            (
                bind(volumes / "ro", "/ro", "rprivate", read_only=True),
                bind(volumes / "rro", "/rro", "rprivate", "rro", read_only=True),
                bind(volumes / "rw", "/rw", "rprivate"),
                bind(volumes / "file", "/file", "rprivate", read_only=True),
                Mount("/tmp", "tmpfs", "tmpfs", ("size=1m",)),
            ),
        )
        assert [m.source for m in guest] == [f"/run/aurae/share/k1/{n}" for n in range(4)] + ["tmpfs"]
        assert guest[1].options == ("rprivate",) and guest[1].read_only  # rro is the host's
        attempts = {
            "top": f"touch {served}/planted",
            "symlink": f"ln -s / {served}/k1/escape",
            "ro": f"touch {served}/k1/0/written",
            "rro": f"touch {served}/k1/1/written",
            "below rro": f"touch {served}/k1/1/below/written",
            "file": f"echo pwned > {served}/k1/3",
            "rw": f"echo guest > {served}/k1/2/written",
        }
        outcomes = {what: view.run(script) for what, script in attempts.items()}
        refused = {what for what, done in outcomes.items() if "Read-only file system" in done.stderr}
        assert refused == set(attempts) - {"rw"}, outcomes
        assert outcomes["rw"].returncode == 0 and (volumes / "rw" / "written").read_text() == "guest\n"
        assert (volumes / "file").read_text() == "the host's\n"
        # The host holds none of it: only the pin of the pod's namespace.
        assert mounts_below(shares.directory(POD)) == [str(shares.namespace(POD))]
        shares.release(POD, "k1")
        assert pod_mounts_below(shares, served / "k1") == [] and view.run(f"ls {served}").stdout == ""
    shares.remove(POD)
    assert mounts_below(shares.directory(POD)) == [] and not shares.directory(POD).exists()
    assert sorted(p.name for p in (volumes / "ro").iterdir()) == ["keep"]
    assert mounts_below(volumes) == [str(volumes / "rro" / "below")]  # the host's own, left


def test_no_link_in_the_share_is_followed(shares: PodShares, volumes: Path, tmp_path: Path) -> None:
    """Symlinks where the host makes mount points (only a share the guest could write would hold
    them): a bind there fails rather than mount anywhere else; removal deletes them, not what
    they name."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("precious\n")
    served = shares.make(POD)
    points = shares.directory(POD) / POINTS
    in_pod_namespace(
        shares,
        f"ln -s {outside} {points}/k1 && mkdir -p {points}/k2/junk && ln -s {outside}/precious {points}/k2/0"
        f" && ln -s ../../../../.. {points}/k2/junk/up",
    )
    for key, volume in (("k1", volumes / "ro"), ("k2", volumes / "file")):
        with pytest.raises(CriError) as refused:
            shares.bind(POD, key, (bind(volume, "/v", "rprivate", read_only=True),))
        # ELOOP at a symlink, ENOTDIR at one opened as a directory: never through it.
        message = refused.value.message
        assert message.startswith(f"cannot share {volume} with the pod's guest: "), message
        assert message.endswith(("Not a directory", "Too many levels of symbolic links")), message
    assert pod_mounts_below(shares, served) == [str(served)] and mounts_below(outside) == []
    assert pod_mounts_below(shares, outside) == []
    shares.remove(POD)
    assert not shares.directory(POD).exists() and mounts_below(tmp_path / "pod-shares") == []
    assert (outside / "precious").read_text() == "precious\n"


def test_a_release_takes_its_own_key_only(shares: PodShares, volumes: Path) -> None:
    served = shares.make(POD)
    shares.bind(POD, "k1", (bind(volumes / "ro", "/a", "rprivate"), bind(volumes / "rro", "/b", "rprivate")))
    shares.bind(POD, "k2", (bind(volumes / "rw", "/c", "rprivate"),))
    # The rbind's submount (rro/below) is in the share with it, and goes with it.
    below = [f"{served}/k1/0", f"{served}/k1/1", f"{served}/k1/1/below"]
    assert pod_mounts_below(shares, served / "k1") == below
    shares.release(POD, "k1")
    shares.release(POD, "k1")  # idempotent
    assert pod_mounts_below(shares, served / "k1") == []
    assert pod_mounts_below(shares, served / "k2") == [f"{served}/k2/0"]
    listed = namespaces.in_mount_namespace(shares.namespace(POD), lambda: sorted(os.listdir(served)))
    assert listed == ["k2"]
    shares.remove(POD)
    shares.remove(POD)  # idempotent
    assert not shares.directory(POD).exists()


def test_a_share_made_as_before_is_removed_whatever_it_holds(
    shares: PodShares, volumes: Path, tmp_path: Path
) -> None:
    """A pod's directory that was itself the share (a bind on itself, as auraed made it before):
    a guest could write there, and its symlinks made the removal fail (ENOTEMPTY)."""
    directory = shares.directory(POD)
    (directory / "k1" / "0").mkdir(parents=True)
    namespaces.mount(directory, directory, None, namespaces.MS_BIND)
    namespaces.mount(None, directory, None, namespaces.MS_SHARED)
    namespaces.mount(volumes / "ro", directory / "k1" / "0", None, namespaces.MS_BIND | namespaces.MS_REC)
    (directory / "escape").symlink_to("/")
    (directory / "k1" / "escape").symlink_to(tmp_path)
    (directory / "planted").write_text("planted\n")
    shares.remove(POD)
    assert not directory.exists() and mounts_below(directory) == []
    assert sorted(p.name for p in (volumes / "ro").iterdir()) == ["keep"]


def test_the_hosts_mount_below_a_volume_goes_while_the_volume_is_shared(
    shares: PodShares, volumes: Path
) -> None:
    """critest's readonly specs: the host unmounts a tmpfs below a volume the share holds, then
    removes its mount point. The share's copy is in the pod's namespace, which Linux detaches on
    rmdir; a second mount of it in the host's namespace (as the share was made before) kept the
    mount point busy (EBUSY)."""
    below = volumes / "rro" / "below"
    served = shares.make(POD)
    shares.bind(POD, "k1", (bind(volumes / "rro", "/v", "rprivate", read_only=True),))
    assert pod_mounts_below(shares, served / "k1") == [f"{served}/k1/0", f"{served}/k1/0/below"]
    assert mounts_below(volumes) == [str(below)]  # the host's own, and nothing of the share's
    namespaces.umount(below)
    below.rmdir()
    assert pod_mounts_below(shares, served / "k1") == [f"{served}/k1/0"]
    shares.remove(POD)


def test_a_share_is_found_again_by_a_new_daemon_and_removed_whole(shares: PodShares, volumes: Path) -> None:
    """A restart of the daemon: a new PodShares over the same directory binds in the pinned
    namespace and removes it; then nothing of it is left, the pins' own mount included."""
    served = shares.make(POD)
    pin = os.stat(shares.namespace(POD))
    again = PodShares(shares.directory(POD).parent)
    assert again.make(POD) == served and os.stat(again.namespace(POD)).st_ino == pin.st_ino  # the same
    again.bind(POD, "k1", (bind(volumes / "rw", "/v", "rprivate"),))
    assert pod_mounts_below(again, served / "k1") == [f"{served}/k1/0"]
    again.remove(POD)
    root = shares.directory(POD).parent
    assert mounts_below(root) == [] and not root.exists()
    with pytest.raises(CriError):
        again.bind(POD, "k1", (bind(volumes / "rw", "/v", "rprivate"),))


def test_the_pods_namespace_holds_no_copy_of_the_hosts_namespace_pins(
    shares: PodShares, tmp_path: Path
) -> None:
    """A namespace pinned on the host when the share is made (a cell pod's network namespace,
    another pod's share): the pod's namespace drops its copy, which the host's unpin would not
    reach, so the pinned namespace ends when the host lets it go."""
    network = tmp_path / "net"
    namespaces.create_network_namespace(network)
    try:
        shares.make(POD)
        other = POD[::-1]
        shares.make(other)  # after the first pod's share was pinned
        kinds = {entry.fs_type for entry in pod_mounts(shares, other).values()}
        assert "tmpfs" in kinds and "nsfs" not in kinds
        assert [
            e.mount_point for e in read_mounts() if e.fs_type == "nsfs" and str(tmp_path) in e.mount_point
        ] == [str(network), str(shares.namespace(POD)), str(shares.namespace(other))]
        shares.remove(other)
        shares.remove(POD)
    finally:
        namespaces.remove_network_namespace(network)
