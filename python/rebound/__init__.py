"""Rebound's Python client (placeholder; the lead owns this file)."""
