"""rebound.torch (placeholder; the lead owns this file)."""
