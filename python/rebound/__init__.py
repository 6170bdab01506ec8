"""Rebound: a fault-tolerant parameter server; the Python client (placeholder, the lead overwrites it)."""
