"""OCI containers on the machine auraed runs on: images, runtime specs and the runc/crun runtime."""
