"""A config disk as PID 1 mounts it on /etc/aurae (``auraed.config_disk=``): a squashfs image of
an ``auraed.toml`` and whatever files go beside it, for the tests that boot guests or hosts."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path


def config_disk(work: Path, config_text: str, files: Mapping[str, Path] | None = None) -> Path:
    """``work/config.img``: ``config_text`` as auraed.toml, and each of ``files`` (a path relative
    to /etc/aurae -> the file copied there)."""
    tree = work / "config"
    tree.mkdir(parents=True)
    for relative, source in (files or {}).items():
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, tree / relative)
    (tree / "auraed.toml").write_text(config_text)
    image = work / "config.img"
    subprocess.run(["mksquashfs", str(tree), str(image), "-quiet", "-noappend", "-all-root"], check=True)
    return image
