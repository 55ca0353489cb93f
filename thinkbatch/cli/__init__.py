"""The `thinkbatch` command line: submit a JSONL file, watch it, fetch its results."""
