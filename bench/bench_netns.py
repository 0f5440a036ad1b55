"""A bandwidth-limited interconnect for CPU runs: a network namespace whose loopback has a tbf qdisc.

Both ranks run inside the namespace (``ip netns exec NAME ...``) and rendezvous on its
127.0.0.1, so every gloo byte goes through the token bucket and communication costs real wall
time, as on a cluster link. Needs root and iproute2; netem is not required.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from typing import Iterator


def available() -> str | None:
    """None when a namespace can be created here, else why not."""
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


@contextlib.contextmanager
def rate_limited_namespace(*, rate: str, burst: str, latency: str, prefix: str = "fsdpbench") -> Iterator[str]:
    """Create a namespace with ``lo`` up and rate limited; yield its name; always delete it."""
    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        _run(
            "ip", "netns", "exec", name,
            "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst, "latency", latency,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def exec_argv(name: str, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``name``."""
    return ["ip", "netns", "exec", name, *argv]


def qdisc(name: str) -> str:
    """The loopback qdisc line, recorded in the results as evidence of the limit."""
    out = subprocess.run(
        ["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo"], check=True, capture_output=True, text=True
    ).stdout
    return out.strip()
