"""Workloads, a multi-process gloo launcher, an FSDP2-state observer and the bitwise comparison with plain
FSDP2, shared by tests and benchmarks."""
