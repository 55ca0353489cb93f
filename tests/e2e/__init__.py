"""e2e tier: see tests/README.md."""
