"""DiscoveryService: who this auraed is and what the machine can do."""
