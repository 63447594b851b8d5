"""The JIT cache key of a kernel build: what a cubin depends on, hashed.

A build depends on its source, the project headers it reads, its defines and flags, and the compiler.
The headers are found by following quoted `#include "..."` lines (and headers pre-included with nvcc's
`-include`) from the source, within the kernel tree: a change to one kernel family's files then leaves
every other family's cached builds valid. Angle-bracket includes are the toolkit's or an external
library's, versioned by the compiler and the flags (a backend puts its library's identity into its
flags). An include the scan cannot resolve statically (`#include MACRO`) makes the key hash the whole
tree instead, as a key that missed a dependency would serve a stale build.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import List, Optional, Sequence, Tuple

HASHED_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inc", ".inl")
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<[^>\n]*>|([^\s<"][^\n]*))', re.M)


def tree_files(root: str) -> List[str]:
    """Every kernel source and header of the tree (the fallback key's contents)."""
    files = []
    for sub in (os.path.join(root, "common", "kernels"), os.path.join(root, "backends")):
        for dirpath, dirnames, filenames in os.walk(sub):
            dirnames.sort()
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(HASHED_SUFFIXES)]
    return files


def _pre_included(flags: Sequence[str]) -> List[str]:
    out = []
    for i, f in enumerate(flags):
        if f == "-include" and i + 1 < len(flags):
            out.append(flags[i + 1])
        elif f.startswith("-include") and len(f) > len("-include"):
            out.append(f[len("-include"):].lstrip("="))
    return out


def dependencies(source: str, root: str, flags: Sequence[str]) -> Optional[List[str]]:
    """The files under `root` that compiling `source` reads besides itself (sorted), or None when an
    include cannot be resolved statically. Quoted includes resolve against the including file's folder,
    then `root` (the build's -I); files outside `root` are not followed."""
    root = os.path.abspath(root)
    source = os.path.abspath(source)
    pending = [source] + [p if os.path.isabs(p) else os.path.join(root, p) for p in _pre_included(flags)]
    seen = set()
    while pending:
        path = os.path.abspath(pending.pop())
        if path in seen or not os.path.isfile(path) or os.path.commonpath([root, path]) != root:
            continue
        seen.add(path)
        with open(path, "rb") as f:
            text = f.read()
        for quoted, other in _INCLUDE.findall(text):
            if other:   # #include MACRO: only the preprocessor knows
                return None
            if quoted:
                name = quoted.decode()
                here = os.path.join(os.path.dirname(path), name)
                pending.append(here if os.path.isfile(here) else os.path.join(root, name))
    seen.discard(source)
    return sorted(seen)


def cache_key(source: str, root: str, defines: List[Tuple[str, str]], flags: List[str], nvcc_ver: str) -> str:
    h = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    with open(source, "rb") as f:
        add("source", f.read())
    deps = dependencies(source, root, flags)
    for path in tree_files(root) if deps is None else deps:
        with open(path, "rb") as f:
            add("file:" + os.path.relpath(path, root).replace(os.sep, "/"), f.read())
    add("defines", repr(defines).encode())
    add("flags", repr(flags).encode())
    add("nvcc", nvcc_ver.encode())
    return h.hexdigest()
