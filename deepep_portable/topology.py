"""Where the ranks of a group run: which machine (node) each is on. A node is the set of ranks that can
map each other's memory (CUDA IPC), the unit every intranode kernel and window is limited to.
(The internode mode will add ranks per node and logical nodes here.)"""
from __future__ import annotations


def node_identity() -> str:
    """Which machine this process runs on: the host name and the kernel's boot id (containers on
    different nodes may share a host name; two processes of one kernel always share the boot id)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def on_one_node(comm) -> bool:
    """Collective over `comm`: whether every rank runs on this rank's machine."""
    return len(set(comm.allgather_object(node_identity()))) == 1
