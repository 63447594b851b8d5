"""Reusing torch's NCCL communicator for the nccl_gin window (issue 18; ../shared/research/NCCL_GIN.md §1.1).

When the Buffer's group is a torch NCCL process group, its communicator already connects exactly these ranks in
this order; a second one would cost another bootstrap and another set of NCCL resources. Reused only when it is
safe, decided collectively (every rank must take the same branch: the window's NCCL calls are collective):

  * the group's CUDA backend has `_comm_ptr()` (torch's binding; DeepEP reuses it the same way) and, after a
    collective if torch had not created the communicator yet (it does so lazily), the pointer is non-zero;
  * exactly one libnccl is mapped into this process and it is the library our host glue is linked to: a
    communicator handle of one libnccl copy passed to another would be read with the wrong struct layouts.

Otherwise the window makes its own communicator, and says why (Window.comm_source). A reused communicator is
never destroyed by us: torch owns it.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple


def mapped_libraries(name: str = "libnccl", maps: str = "/proc/self/maps") -> List[str]:
    """Real paths of the shared objects whose file name starts with `name` mapped into this process."""
    found = set()
    try:
        with open(maps) as f:
            for line in f:   # address perms offset dev inode [path]
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith(name) and ".so" in path:
                    found.add(os.path.realpath(path))
    except OSError:
        return []
    return sorted(found)


def local_candidate(group, linked_lib: str, device, warm_up: Optional[Callable[[], None]] = None,
                    maps: str = "/proc/self/maps") -> Tuple[int, str]:
    """(communicator pointer, "") if this rank could reuse the group's NCCL communicator, else (0, why). Never
    raises. `warm_up`: one collective on the group (torch creates the communicator lazily), run whenever the group
    is NCCL with `_comm_ptr`: the same on every rank, so it cannot leave a peer waiting in it."""
    try:
        import torch.distributed as dist

        if group is None or str(dist.get_backend(group)).lower() != "nccl":
            return 0, "the Buffer's group is not a torch NCCL group"
        backend = group._get_backend(device)
        if not hasattr(backend, "_comm_ptr"):
            return 0, "this torch has no ProcessGroupNCCL._comm_ptr"
        if warm_up is not None:
            warm_up()
        ptr = int(backend._comm_ptr() or 0)
        if ptr == 0:
            return 0, "torch has not created the group's NCCL communicator"
    except Exception as e:   # a probe: any failure means "make our own"
        return 0, f"torch's communicator is not reachable ({type(e).__name__}: {e})"
    libs = mapped_libraries("libnccl", maps)
    linked = os.path.realpath(linked_lib)
    if libs != [linked]:
        return 0, (f"the process maps libnccl {libs or 'nowhere'}, our glue is linked to {linked}: a communicator "
                   "is only valid inside the library copy that made it")
    return ptr, ""


def collective_choice(candidates: List[Tuple[int, str]]) -> Tuple[bool, str]:
    """Every rank's (pointer, why) -> (reuse, why not): reuse only if every rank can."""
    for rank, (ptr, why) in enumerate(candidates):
        if not ptr:
            return False, f"rank {rank}: {why}"
    return True, "torch's NCCL communicator of the Buffer's group"
