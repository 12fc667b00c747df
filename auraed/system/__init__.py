"""Low-level Linux system access: cgroups, namespaces and processes."""
