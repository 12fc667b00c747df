"""Every test file that boots a guest or a host machine is in one of the parallel workers' guest
groups (tests/conftest.py): outside them it would boot its machines beside both groups' own."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import GUEST_GROUP_OF

INTEGRATION = Path(__file__).resolve().parent.parent / "integration"
# A guest_image fixture, a Booted guest, or a vm pods' node (vm_pods_helpers.vm_node_fixture).
BOOTS = re.compile(r"\bguest_image: Path\b|\bBooted\[|\bvm_node_fixture\(")


def test_every_file_that_boots_machines_is_in_a_guest_group() -> None:
    booting = {
        f"tests/integration/{path.name}"
        for path in INTEGRATION.glob("test_*.py")
        if BOOTS.search(path.read_text())
    }
    assert len(booting) >= 10, booting  # the pattern still finds them
    assert sorted(booting - set(GUEST_GROUP_OF)) == []
    fixture_made = {
        "tests/integration/test_cri_vm_containers.py",
        "tests/integration/test_cri_vm_templates.py",
    }
    assert fixture_made <= booting  # found by the node fixture they make
