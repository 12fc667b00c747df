"""auraed as an orka node agent: orka's WorkloadService, and joining its scheduler."""
