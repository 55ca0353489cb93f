"""Development tooling: thinkbatch's processes and services on one machine, for the demo, the
benchmarks, `make gpu-check` and the tests. Not shipped: neither the wheel nor the images hold
it, and nothing in thinkbatch/, api/ or worker/ imports it."""

from devstack.local import LocalStack
from devstack.local import local_stack

__all__ = ["LocalStack", "local_stack"]
