"""Persistent state: the SQLite store every subsystem keeps its records in."""
