"""Reusing torch's NCCL communicator for the nccl_gin window.

When the Buffer's group is a torch NCCL process group, its communicator already connects exactly these ranks in
this order; a second one would cost another bootstrap and another set of NCCL resources. Reused only when it is
safe, decided collectively (every rank must take the same branch: the window's NCCL calls are collective):

  * the group's CUDA backend is a ProcessGroupNCCL with `_comm_ptr()` (torch's binding; DeepEP reuses it the
    same way) and, after a collective every rank runs (torch creates the communicator lazily), the pointer for
    the Buffer's device is non-zero;
  * the communicator is our libnccl's: exactly one libnccl.so is mapped into this process, it is the library
    our host glue is linked to, torch's libtorch_cuda.so loads it dynamically (ELF DT_NEEDED: a torch with NCCL
    linked in statically has its own copy, whose handles ours would read with the wrong layouts), and torch
    reports the same NCCL version;
  * no NCCL pass-through option was given: torch made its communicator with its own environment.

Otherwise the window makes its own communicator, and says why (Window.comm_source). A reused communicator is
never destroyed by us: torch owns it, and the window releases its registration on it only while torch still
has it (`still_owned`).
"""
from __future__ import annotations

import os
import struct
from typing import Callable, List, Optional, Tuple

from .. import libraries


def mapped_libraries(name: str = "libnccl.so", maps: str = "/proc/self/maps") -> List[str]:
    """Real paths of the shared objects `name` (or `name`.N...) mapped into this process: NCCL's own library, not
    its plugins (libnccl-net.so, libnccl-tuner.so, ...)."""
    found = set()
    for path in libraries.mapped_files(maps):
        base = os.path.basename(path)
        if path.startswith("/") and (base == name or base.startswith(name + ".")):
            found.add(os.path.realpath(path))
    return sorted(found)


def elf_needed(path: str) -> Optional[List[str]]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object, or None if it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        for _, kind, _, _, offset, size, link, _, _, entsize in sections:
            if kind != 6:   # SHT_DYNAMIC; its sh_link is the string table
                continue
            strtab = sections[link][4]
            needed = []
            for i in range(0, size, entsize or 16):
                tag, value = struct.unpack_from("<qQ", data, offset + i)
                if tag == 1:   # DT_NEEDED
                    end = data.index(b"\0", strtab + value)
                    needed.append(data[strtab + value:end].decode())
            return needed
    except (OSError, ValueError, struct.error, IndexError):
        return None
    return []


def _torch_nccl_dynamic(maps: str) -> Tuple[bool, str]:
    cuda = [p for p in mapped_libraries("libtorch_cuda.so", maps)]
    if not cuda:
        return False, "libtorch_cuda.so is not mapped"
    needed = elf_needed(cuda[0])
    if needed is None:
        return False, f"cannot read {cuda[0]}'s dynamic section"
    if not any(n.startswith("libnccl.so") for n in needed):
        return False, f"{cuda[0]} does not load libnccl.so dynamically (NCCL linked into torch: another copy)"
    return True, ""


def local_candidate(group, device, linked_lib: str, linked_version: int, warm_up: Optional[Callable[[], None]] = None,
                    maps: str = "/proc/self/maps") -> Tuple[int, str]:
    """(communicator pointer, "") if this rank could reuse the group's NCCL communicator, else (0, why). Never
    raises. `warm_up`: one collective on the group (torch creates the communicator lazily), run whenever the group
    is NCCL with `_comm_ptr`: the same on every rank, so it cannot leave a peer waiting in it. `linked_version`:
    ncclGetVersion() of our glue's library (e.g. 22809)."""
    try:
        import torch

        backend = group._get_backend(torch.device(device)) if group is not None else None
        if type(backend).__name__ != "ProcessGroupNCCL":
            return 0, "the Buffer's group has no torch NCCL backend on its device"
        if not hasattr(backend, "_comm_ptr"):
            return 0, "this torch has no ProcessGroupNCCL._comm_ptr"
        if warm_up is not None:
            warm_up()
        with torch.cuda.device(device):   # the lookup is keyed by the current device
            ptr = int(backend._comm_ptr() or 0)
        if ptr == 0:
            return 0, "torch has not created the group's NCCL communicator"
        theirs = torch.cuda.nccl.version()
        theirs = theirs[0] * 10000 + theirs[1] * 100 + theirs[2] if isinstance(theirs, tuple) else int(theirs)
    except Exception as e:   # a probe: any failure means "make our own"
        return 0, f"torch's communicator is not reachable ({type(e).__name__}: {e})"
    libs = mapped_libraries("libnccl.so", maps)
    linked = os.path.realpath(linked_lib)
    if libs != [linked]:
        return 0, (f"the process maps libnccl {libs or 'nowhere'}, our glue is linked to {linked}: a communicator "
                   "is only valid inside the library copy that made it")
    dynamic, why = _torch_nccl_dynamic(maps)
    if not dynamic:
        return 0, why
    if theirs != linked_version:
        return 0, f"torch reports NCCL {theirs}, our glue's library is {linked_version}"
    return ptr, ""


def still_owned(group, device, ptr: int) -> bool:
    """Whether torch still holds communicator `ptr` for `group` on `device` (never raises): a borrowed
    communicator is released from only while it is (torch may have destroyed or aborted it first)."""
    try:
        import torch

        with torch.cuda.device(device):
            return int(group._get_backend(torch.device(device))._comm_ptr() or 0) == ptr
    except Exception:
        return False


def collective_choice(candidates: List[Tuple[int, str]]) -> Tuple[bool, str]:
    """Every rank's (pointer, why) -> (reuse, why not): reuse only if every rank can."""
    for rank, (ptr, why) in enumerate(candidates):
        if not ptr:
            return False, f"rank {rank}: {why}"
    return True, "torch's NCCL communicator of the Buffer's group"
