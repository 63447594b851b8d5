"""Where the ranks of a group run: which machine (node) each is on. A node is the set of ranks that can
map each other's memory (CUDA IPC, NVLink), the unit every intranode kernel and window is limited to.

`NodeLayout` is how the internode mode sees a group: M nodes of P ranks each, rank r on node r // P at
local index r % P (DeepEP's convention, without its fixed 8 per node). P is detected from the hosts, or
set (`Buffer(..., ranks_per_node=K)` or DEEPEP_PORTABLE_RANKS_PER_NODE=K): a *logical* node is any K
consecutive ranks of one machine, which is how tests build several nodes on one machine.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

RANKS_PER_NODE_ENV = "DEEPEP_PORTABLE_RANKS_PER_NODE"


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


@dataclass(frozen=True)
class NodeLayout:
    num_ranks: int
    ranks_per_node: int
    on_one_machine: bool = True   # every rank on one machine (logical nodes, if more than one)

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node


def layout_from_hosts(hosts: Sequence[str], ranks_per_node: Optional[int] = None) -> NodeLayout:
    """The node layout of ranks running on `hosts` (one entry per rank). Without `ranks_per_node`: the
    machines, which must each hold the same number of consecutive ranks. With it: nodes of that many
    consecutive ranks, each inside one machine."""
    num_ranks = len(hosts)
    on_one = len(set(hosts)) == 1
    if ranks_per_node is None:
        groups: List[int] = []
        for i, h in enumerate(hosts):
            if i == 0 or h != hosts[i - 1]:
                groups.append(0)
            groups[-1] += 1
        if len(groups) != len(set(hosts)) or len(set(groups)) != 1:
            raise ValueError(f"the ranks of each machine must be consecutive and equally many per machine "
                             f"(ranks per machine, in rank order: {groups}); pass ranks_per_node= or set "
                             f"{RANKS_PER_NODE_ENV} to say what a node is")
        return NodeLayout(num_ranks, groups[0], on_one)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    if num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the {num_ranks} ranks of the group")
    for r in range(num_ranks):
        if hosts[r] != hosts[r - r % ranks_per_node]:
            raise ValueError(f"ranks_per_node={ranks_per_node}: node {r // ranks_per_node} would span two machines "
                             f"(ranks {r - r % ranks_per_node} and {r}); a node's ranks must share memory")
    return NodeLayout(num_ranks, ranks_per_node, on_one)


def node_layout(comm, ranks_per_node: Optional[int] = None) -> NodeLayout:
    """Collective over `comm`: this group's NodeLayout (`ranks_per_node`, else the environment variable,
    else the machines). Every rank gets the same answer or the same exception."""
    # Gather first, decide after: a rank whose argument or environment is bad must still take part in
    # the collective, and every rank must reach the same answer (or the same exception).
    mine = (node_identity(), ranks_per_node, os.environ.get(RANKS_PER_NODE_ENV) or None)
    everyone = comm.allgather_object(mine)
    asked = {(arg, env) for _, arg, env in everyone}
    if len(asked) != 1:
        raise ValueError(f"ranks disagree on ranks_per_node / {RANKS_PER_NODE_ENV}: {sorted(asked, key=str)}")
    arg, env = asked.pop()
    if arg is None and env is not None:
        try:
            arg = int(env)
        except ValueError:
            raise ValueError(f"{RANKS_PER_NODE_ENV} must be an integer, got {env!r}") from None
    return layout_from_hosts([host for host, _, _ in everyone], arg)
