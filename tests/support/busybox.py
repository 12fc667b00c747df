"""Test root filesystems built from Debian's busybox-static: no network, no registry needed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
PASSWD = """root:x:0:0:root:/root:/bin/sh
app:x:1000:1000:app:/home/app:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
"""
GROUP = """root:x:0:
app:x:1000:
nogroup:x:65534:
"""


def applets() -> list[str]:
    result = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True)
    return [name for name in result.stdout.split() if name and name != "busybox"]


def make_busybox_rootfs(root: Path) -> Path:
    """A minimal root filesystem: busybox with every applet linked in /bin, users root, app, nobody."""
    for directory in ("bin", "etc", "proc", "sys", "dev", "tmp", "root", "home/app", "var"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in applets():
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    (root / "etc" / "hostname").write_text("busybox\n")
    return root
