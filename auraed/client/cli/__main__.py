"""``python -m auraed.client.cli``: aer (which is ``auraed.aer``, the same command line)."""

from auraed.client.cli import main

main()
