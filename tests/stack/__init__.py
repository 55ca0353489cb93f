"""stack tier: see tests/README.md."""
