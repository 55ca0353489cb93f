"""unit tier: see tests/README.md."""
