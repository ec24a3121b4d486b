"""Where on the Ray cluster a process runs: what a process group's rank 0 tells its peers."""

from __future__ import annotations

from dapo_flow.core.ports import free_port


def node_address() -> tuple[str, int]:
    """This Ray node's address and a port free on it now: a process group's master (run on
    rank 0's node)."""
    import ray  # lazily: validate and explain import the executors without Ray

    return ray.util.get_node_ip_address(), free_port("")
