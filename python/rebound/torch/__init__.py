"""rebound.torch: the PyTorch client (placeholder, the lead overwrites it)."""
