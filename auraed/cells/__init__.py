"""CellService: cgroups with optional namespaces, and the executables that run in them."""
