"""api tier: see tests/README.md."""
