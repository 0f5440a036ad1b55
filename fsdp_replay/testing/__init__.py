"""Workloads, a multi-process gloo launcher and an FSDP2-state observer, shared by tests and benchmarks."""
