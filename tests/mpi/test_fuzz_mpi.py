"""Fuzz: seeded random but valid calls of every normal-mode and low-latency feature, each checked exactly
against tests/oracle.py (in CI: the reference transport, over gloo).

A case's shape (hidden, top-k, experts per rank, precision, alignment, padding, biases, logical nodes,
skewed routing, hooks, zero-copy...) comes from its seed, the same on every rank; its data and token counts
(0 and 1 included) from the seed and the rank. A failing case names its seed; rerun just that case with
    DEEPEP_FUZZ_SEED=<seed> DEEPEP_FUZZ_CASES=1 DEEPEP_FUZZ_PALETTE=<0|1> mpirun -n <ranks> \
        python -m pytest --with-mpi tests/mpi/test_fuzz_mpi.py
DEEPEP_FUZZ_CASES (default 150 per mode) sets how many cases run; DEEPEP_FUZZ_SEED (default: from the run's
base seed) the first seed; DEEPEP_FUZZ_PALETTE (below) whether hidden and top-k come from a small palette.
DEEPEP_FUZZ_TRANSPORT (default "reference") runs the same cases on another transport (on a GPU machine:
"nvlink", whose normal mode needs one node, so logical nodes are left out; "nvshmem", whose cases over
logical nodes run the internode kernels).
"""
from __future__ import annotations

import os
import random
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepep_portable as deep_ep  # noqa: E402
from deepep_portable.engines import internode, low_latency  # noqa: E402
from test_reference_mpi import num_experts_for, run_low_latency, run_normal, world  # noqa: E402

pytestmark = pytest.mark.mpi
CASES = int(os.environ.get("DEEPEP_FUZZ_CASES", "150"))
TRANSPORT = os.environ.get("DEEPEP_FUZZ_TRANSPORT", "reference")
INTERNODE = ("reference", "nvshmem")   # transports whose normal mode spans (logical) nodes
# On a GPU every new (hidden, top-k) is kernels to JIT-compile, seconds each: there the cases draw them from a
# small palette (DEEPEP_FUZZ_PALETTE=1, the default off the reference transport), so thousands of cases fit
# in minutes once the JIT cache holds the palette; everything else stays free. The palette keeps a hidden that
# is not a multiple of 512 and odd top-k widths. A seed replays the same case only with the same setting.
PALETTE = os.environ.get("DEEPEP_FUZZ_PALETTE", "0" if TRANSPORT == "reference" else "1") == "1"
# Off the reference transport a Buffer's set-up (IPC handles, windows, barriers) costs more than a case: there
# (with the palette) most cases share one Buffer sized for the palette's largest case, as a model's Buffer
# serves every shape, and every FRESH_EVERY-th case makes its own of exactly its size, so tight sizes stay
# covered. DEEPEP_FUZZ_SHARED=0 gives every case its own Buffer (=1 shares them on any transport); a seed
# replays alike either way.
REUSE = os.environ.get("DEEPEP_FUZZ_SHARED", "1" if PALETTE and TRANSPORT != "reference" else "0") == "1"
FRESH_EVERY = 8
LARGEST_TOKENS = 64   # the largest max_tokens of either mode's cases
MAX_WORST_EXTRA = 3   # the most num_worst_tokens rows a normal case pads beyond what any rank receives
NORMAL_HIDDEN = {False: [264, 7168], True: [384, 7168]}   # by fp8
LL_HIDDEN, LL_HIDDEN_UE8M0 = [2944, 7168], [1536, 7168]
PALETTE_TOPK = [1, 5, 8]


def _topk(r: random.Random, experts: int) -> int:
    if PALETTE:
        return r.choice([k for k in PALETTE_TOPK if k <= experts])
    return min(r.randint(1, 16), experts)


def _first_seed(base_seed: int, salt: int) -> int:
    env = os.environ.get("DEEPEP_FUZZ_SEED")
    return int(env) if env else (base_seed * 7919 + salt) % (1 << 31)


def normal_case(seed: int, num_ranks: int) -> dict:
    """The shape of one normal-mode case (identical on every rank)."""
    r = random.Random(seed)
    fp8 = r.choice([None, None, "float", "int32", "float-column-major"])
    if PALETTE:
        hidden = r.choice(NORMAL_HIDDEN[fp8 is not None])
    else:
        hidden = 128 * r.randint(1, 12) if fp8 else 8 * r.randint(1, 160)
    divisors = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
    experts = num_ranks * r.randint(1, 64)
    return dict(hidden=hidden, topk=_topk(r, experts), experts=experts, fp8=fp8,
                use_topk=r.random() < 0.8, expert_alignment=r.choice([1, 1, 2, 4, 8]),
                num_worst_extra=r.choice([None, None, 0, MAX_WORST_EXTRA]), num_bias=r.randint(0, 2),
                p_none=r.choice([0.0, 0.1, 0.5, 1.0]), skew=r.random() < 0.15,
                ranks_per_node=r.choice(divisors) if TRANSPORT in INTERNODE and r.random() < 0.4 else 0,
                max_tokens=r.choice([1, 2, 17, 64]),
                overlap=r.choice([None, None, "caller", "comm"]),   # drawn last: earlier seeds keep their shapes
                zero_copy=r.random() < 0.3,   # expert outputs written into get_next_combine_buffer's tensor
                zero_copy_dispatch=r.random() < 0.3)   # tokens written into get_next_dispatch_buffer's (drawn last)


def ll_case(seed: int, num_ranks: int) -> dict:
    r = random.Random(seed)
    mode = r.choice(["bf16", "fp8", "fp8-round", "fp8-ue8m0"])
    if PALETTE:
        hidden = r.choice(LL_HIDDEN_UE8M0 if mode == "fp8-ue8m0" else LL_HIDDEN)
    else:
        hidden = 512 * r.randint(1, 6) if mode == "fp8-ue8m0" else 128 * r.randint(1, 24)
    experts = num_ranks * r.randint(1, 64)
    return dict(hidden=hidden, topk=_topk(r, experts), experts=experts, mode=mode,
                max_tokens=r.choice([1, 3, 16, 64]), hook=r.random() < 0.5, zero_copy=r.random() < 0.3,
                use_out=r.random() < 0.3, p_none=r.choice([0.0, 0.1, 0.5, 1.0]),
                # drawn last, so earlier seeds keep their shapes: async_finish (without a hook); on a GPU, a
                # BF16 round captured in a CUDA graph and replayed with new contents
                overlap=r.random() < 0.3, graph=r.random() < 0.2)


# A graph case runs where the LL kernels serve the ops (the reference transport computes on the host).
GRAPHS = (torch.cuda.is_available() and TRANSPORT != "reference"
          and os.environ.get("DEEPEP_PORTABLE_LL_KERNELS", "1") != "0")


def _nvshmem_heap(nbytes: int) -> None:
    """NVSHMEM's symmetric heap is sized once per process, at the first window (transports/nvshmem/window.py):
    over nvshmem, ask up front for room for the largest Buffers the test holds at once (+ 256 MiB). Too late
    if an earlier test of the same process already started NVSHMEM: run the fuzz on its own there."""
    if TRANSPORT != "nvshmem":
        return
    from deepep_portable.transports.nvshmem.runtime import _parse_size
    want = nbytes + (256 << 20)
    if _parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "0")) < want:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(want)


def _compile_ahead(rank: int, seeds, variants_of) -> None:
    """Over nvshmem every kernel shape is a device-linked build of about 10 s (the intranode ones over nvlink take
    about 1 s): build the shapes of the cases `seeds` draw (variants_of(seed): (source, defines) pairs) up front,
    in parallel (one nvcc per core; the JIT's lock files let one rank build each while the others wait for it),
    instead of one at a time inside the cases."""
    if TRANSPORT != "nvshmem" or not torch.cuda.is_available():
        return
    from deepep_portable import jit
    from deepep_portable.transports.nvshmem.transport import precompile
    unique = sorted({(source, tuple(sorted(defines.items())))
                     for seed in seeds for source, defines in variants_of(seed)})
    t0 = time.perf_counter()
    built = precompile((jit.device_arch(torch.cuda.current_device()),),
                       variants=[(source, dict(defines)) for source, defines in unique])
    print(f"\n[rank {rank}] {len(unique)} kernel shapes ready in {time.perf_counter() - t0:.1f} s "
          f"({sum(not hit for *_, hit in built)} built here)")


def _graph_case(buf, pg, gen, device, *, num_tokens, experts, hidden, topk, max_tokens, **_unused) -> None:
    """The case's shape through test_low_latency_gpu_mpi.run_ll_graph: BF16 dispatch, y = 2 * recv_x, combine,
    eager once, then captured and replayed twice with new contents; every result checked against the oracle."""
    from test_intranode_gpu_mpi import GpuChecker
    from test_low_latency_gpu_mpi import run_ll_graph
    ck = GpuChecker(pg)
    run_ll_graph(buf, pg, gen, device, ck, experts=experts, hidden=hidden, num_tokens=num_tokens,
                 max_tokens=max_tokens, topk=topk, replays=2)
    ck.done()


def _tokens(seed: int, rank: int, most: int) -> int:
    """0, 1, the most, or anything between, per rank."""
    r = random.Random(seed * 1_000_003 + rank)
    return r.choice([0, 1, most, r.randint(0, most)])


def _run(name: str, seed: int, params: dict, fn) -> None:
    try:
        fn()
    except AssertionError as e:
        raise AssertionError(f"fuzz {name} case seed={seed} {params} failed; reproduce with DEEPEP_FUZZ_SEED={seed} "
                             f"DEEPEP_FUZZ_CASES=1 DEEPEP_FUZZ_PALETTE={int(PALETTE)}:\n{e}") from None
    except Exception as e:   # a valid call that raised: name the case too (the error's own type kept)
        note = (f"fuzz {name} case seed={seed} {params} raised; reproduce with DEEPEP_FUZZ_SEED={seed} "
                f"DEEPEP_FUZZ_CASES=1 DEEPEP_FUZZ_PALETTE={int(PALETTE)}")
        if hasattr(e, "add_note"):   # Python 3.11+: shown with the traceback
            e.add_note(note)
        else:
            print(note, flush=True)
        raise


class _Buffers:
    """The Buffer a case runs on: shared ones (REUSE), kept per `key`, or one of the case's own.
    `setup_s` sums the time spent creating them (printed with the case count)."""

    def __init__(self) -> None:
        self.shared: dict = {}
        self.setup_s = 0.0

    def make(self, make) -> deep_ep.Buffer:
        t0 = time.perf_counter()
        buf = make()
        self.setup_s += time.perf_counter() - t0
        return buf

    def get(self, seed: int, key, make_exact, make_largest):
        """(buffer, owned): an owned buffer is the case's own, destroyed after it."""
        if not REUSE or seed % FRESH_EVERY == 0:
            return self.make(make_exact), True
        if key not in self.shared:
            self.shared[key] = self.make(make_largest)
        return self.shared[key], False

    def close(self) -> None:
        for buf in self.shared.values():
            buf.destroy()
        self.shared.clear()


def _report(rank: int, mode: str, cases: int, t0: float, buffers: _Buffers) -> None:
    print(f"\n[rank {rank}] {mode} fuzz: {cases} cases passed in {time.perf_counter() - t0:.1f} s "
          f"({buffers.setup_s:.1f} s creating Buffers; shared Buffers: {REUSE})")


def test_fuzz_normal(pg, device, base_seed):
    rank, num_ranks = world(pg)
    first = _first_seed(base_seed, 1)
    print(f"\n[rank {rank}] normal-mode fuzz: {CASES} cases from seed {first} ({TRANSPORT})")

    def sizes(hidden: int, most: int, per_node: int):
        nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, max(most, 1))
        rdma = 0 if TRANSPORT == "reference" or not per_node else deep_ep.Config().get_rdma_buffer_size_hint(
            hidden * 2, num_ranks, max(most, 1), ranks_per_node=per_node)   # the internode kernels' window
        return nvl, rdma

    def make(hidden: int, most: int, per_node: int):
        return lambda: deep_ep.Buffer(pg, *sizes(hidden, most, per_node), transport=TRANSPORT,
                                      ranks_per_node=per_node or None, explicitly_destroy=True)

    buffers, t0 = _Buffers(), time.perf_counter()
    largest_hidden = max(max(h) for h in NORMAL_HIDDEN.values())
    # shared Buffers (one per node shape: at most 4 divisors of the rank count in use) and a case's own
    _nvshmem_heap(5 * sum(sizes(largest_hidden, LARGEST_TOKENS + MAX_WORST_EXTRA, max(1, num_ranks // 2))))

    def internode_kernels(seed: int):   # over logical nodes (ranks_per_node below the rank count) only
        c = normal_case(seed, num_ranks)
        if not 0 < c["ranks_per_node"] < num_ranks:
            return []
        fp8 = c["fp8"] is not None
        return internode.round_variants(num_ranks, c["ranks_per_node"], c["hidden"], 1 if fp8 else 2,
                                        c["hidden"] // 128 if fp8 else 0, c["topk"] if c["use_topk"] else 0)
    _compile_ahead(rank, range(first, first + CASES), internode_kernels)
    try:
        for seed in range(first, first + CASES):
            p = normal_case(seed, num_ranks)
            gen = torch.Generator().manual_seed(seed * 131 + rank)
            most, per_node = p.pop("max_tokens"), p.pop("ranks_per_node")
            # A zero-copy combine's area holds the handle's rows, num_worst_tokens of them when padded (up to
            # num_worst_extra beyond the most any rank receives): a Buffer sized for that many more tokens holds them
            room = (p["num_worst_extra"] or 0) if p["zero_copy"] else 0
            buf, owned = buffers.get(seed, per_node, make(p["hidden"], most + room, per_node),
                                     make(largest_hidden, LARGEST_TOKENS + MAX_WORST_EXTRA, per_node))
            try:
                _run("normal", seed, dict(p, ranks_per_node=per_node), lambda: run_normal(
                    buf, pg, gen, device, num_tokens=_tokens(seed, rank, most), ranks_per_node=per_node, **p))
            finally:   # every rank gets here (a case's checker raises on all of them), all ops done: free it now
                if owned:
                    buf.destroy()
    finally:
        buffers.close()
    _report(rank, "normal-mode", CASES, t0, buffers)


def test_fuzz_low_latency(pg, device, base_seed):
    rank, num_ranks = world(pg)
    first = _first_seed(base_seed, 2)
    print(f"\n[rank {rank}] low-latency fuzz: {CASES} cases from seed {first} ({TRANSPORT})")

    def make(tokens: int, hidden: int, experts: int):
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts)
        return lambda: deep_ep.Buffer(pg, 0, rdma, low_latency_mode=True, transport=TRANSPORT,
                                      explicitly_destroy=True)

    buffers, t0 = _Buffers(), time.perf_counter()
    largest_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        LARGEST_TOKENS, max(LL_HIDDEN + LL_HIDDEN_UE8M0), num_ranks, num_ranks * 64)
    _nvshmem_heap(2 * largest_bytes)   # the shared Buffer and a case's own of the same size at once

    def ll_kernels(seed: int):   # and the clean kernel: a shared Buffer is cleaned when the expert count changes
        c = ll_case(seed, num_ranks)
        return low_latency.round_variants(c["hidden"], c["topk"]) + [(low_latency.CLEAN_SOURCE, {})]
    _compile_ahead(rank, range(first, first + CASES), ll_kernels)
    largest = make(LARGEST_TOKENS, max(LL_HIDDEN + LL_HIDDEN_UE8M0), num_ranks * 64)
    shared_experts = None   # the num_experts the shared Buffer's signals were last cleaned for
    try:
        for seed in range(first, first + CASES):
            p = ll_case(seed, num_ranks)
            gen = torch.Generator().manual_seed(seed * 131 + rank)
            experts = num_experts_for(p["experts"], num_ranks)
            buf, owned = buffers.get(seed, "ll", make(p["max_tokens"], p["hidden"], experts), largest)
            if not owned:
                if shared_experts not in (None, experts):
                    # A shared Buffer changes num_experts only through a clean (collective; every earlier LL op of
                    # every rank is complete: the previous case's checks read its results, then met in a collective).
                    buf.clean_low_latency_buffer(p["max_tokens"], p["hidden"], experts)
                shared_experts = experts
            graph = p.pop("graph") and GRAPHS
            try:
                if graph:
                    _run("low-latency graph", seed, p, lambda: _graph_case(
                        buf, pg, gen, device, num_tokens=_tokens(seed, rank, p["max_tokens"]), **p))
                else:
                    _run("low-latency", seed, p, lambda: run_low_latency(
                        buf, pg, gen, device, num_tokens=_tokens(seed, rank, p["max_tokens"]), **p))
            finally:
                if owned:
                    buf.destroy()
    finally:
        buffers.close()
    _report(rank, "low-latency", CASES, t0, buffers)


FAILURE_CASES = int(os.environ.get("DEEPEP_FUZZ_FAILURE_CASES", "40"))
FAILURE_TIMEOUT_S = float(os.environ.get("DEEPEP_FUZZ_FAILURE_TIMEOUT_S", "2"))


def failure_case(seed: int, num_ranks: int) -> dict:
    """One case of the failure fuzz (identical on every rank): a refusal (one rank, a few, or every rank makes a
    bad call of a random kind while the others make the good one), or two Buffers in flight at once."""
    from test_failures_mpi import CASES as BAD_CALLS

    r = random.Random(seed)
    if r.random() < 0.35:
        return dict(kind="two_buffers", tokens=r.choice([0, 1, 7, 24]), num_bias=r.randint(0, 1))
    how_many = r.choice([1, 1, 1, 2, num_ranks])
    return dict(kind="refusal", call=r.choice(BAD_CALLS), bad=sorted(r.sample(range(num_ranks), min(how_many,
                                                                                                 num_ranks))))


def test_fuzz_failures(pg, device, base_seed):
    """Seeded cases of what can fail: a rank (or several, or all) refusing a call before its launch, and two
    Buffers in flight at once. Refusals end on every rank with the refusing rank's own error or a CommError that
    names a refusing rank, and a correct round trip (against the oracle) works after, on the same Buffer when the
    errors say it is usable, else on a new one; two Buffers' dispatches and combines issued before either is read
    give bit for bit what each gives alone."""
    import torch.distributed as dist
    from test_failures_mpi import LL_MAX, SMALL, TOKENS, _call, _outcome
    from test_two_buffers_mpi import BIG, run_both_at_once

    rank, num_ranks = world(pg)
    first = _first_seed(base_seed, 3)
    print(f"\n[rank {rank}] failure fuzz: {FAILURE_CASES} cases from seed {first} ({TRANSPORT}, "
          f"timeout_s {FAILURE_TIMEOUT_S:g})")
    hidden = SMALL["hidden"]
    experts = num_experts_for(SMALL["experts"], num_ranks)
    nvl = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks, TOKENS)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_MAX, hidden, num_ranks, experts)

    def make():
        return deep_ep.Buffer(pg, nvl, rdma, low_latency_mode=True, transport=TRANSPORT, explicitly_destroy=True,
                              timeout_s=FAILURE_TIMEOUT_S)

    buffers, t0 = _Buffers(), time.perf_counter()
    buf = buffers.make(make)
    pair = None
    counts = {"refusal": 0, "two_buffers": 0, "new_buffers": 0}
    try:
        for seed in range(first, first + FAILURE_CASES):
            p = failure_case(seed, num_ranks)
            gen = torch.Generator().manual_seed(seed * 131 + rank)
            counts[p["kind"]] += 1
            if p["kind"] == "two_buffers":
                if pair is None:   # sized for the two-Buffers round trip's shape (test_two_buffers_mpi.BIG)
                    big = deep_ep.Config().get_nvl_buffer_size_hint(BIG["hidden"] * 2, num_ranks, 24)
                    pair = [buffers.make(lambda: deep_ep.Buffer(pg, big, 0, transport=TRANSPORT, explicitly_destroy=True,
                                                                timeout_s=FAILURE_TIMEOUT_S)) for _ in range(2)]
                _run("failures", seed, p, lambda: run_both_at_once(pair, pg, gen, device, p["tokens"], p["num_bias"]))
                continue
            outcome = _outcome(lambda: _call(buf, p["call"], rank in p["bad"], gen, device, num_ranks), buf)
            everyone = [None] * num_ranks
            dist.all_gather_object(everyone, outcome, group=pg)
            problems = []
            for r, (kind, text, usable, elapsed) in enumerate(everyone):
                if r in p["bad"] and kind != "refused":
                    problems.append(f"rank {r} (bad call) ended {kind}: {text[:300]}")
                elif r not in p["bad"] and (kind != "comm" or not any(f"rank {b}" in text for b in p["bad"])):
                    problems.append(f"rank {r} must raise a CommError naming one of ranks {p['bad']}; got {kind}: "
                                    f"{text[:300]}")
            if len({o[2] for o in everyone}) != 1:
                problems.append(f"ranks disagree on whether the Buffer is usable: {[o[2] for o in everyone]}")
            _run("failures", seed, p, lambda: None if not problems else (_ for _ in ()).throw(AssertionError(problems)))
            if not everyone[0][2]:
                try:   # an unusable Buffer's windows still close (collective: every rank gets here)
                    buf.destroy()
                except Exception:   # noqa: BLE001 - the window's close is collective and still meets every rank
                    pass
                buf = buffers.make(make)
                counts["new_buffers"] += 1
            _run("failures", seed, p, lambda: run_normal(buf, pg, gen, device, **SMALL, num_tokens=TOKENS))
    finally:
        for b in [buf] + (pair or []):
            try:
                b.destroy()
            except Exception:   # noqa: BLE001
                pass
    print(f"\n[rank {rank}] failure fuzz: {FAILURE_CASES} cases passed in {time.perf_counter() - t0:.1f} s "
          f"({counts}; {buffers.setup_s:.1f} s creating Buffers)")
