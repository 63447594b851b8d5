"""Host side of the transport conformance kernel (csrc/common/kernels/transport_selftest.cu): every
primitive of the contract and its promise, run on the GPU over any backend's window.

    test = TransportSelftest(ctx, window)      # window: a backend's, of window_bytes(num_ranks) bytes
    local = test.run()                          # collective: one conformance launch on every rank
    report = test.verdict(ctx.comm.allgather_object(local))   # {} when every promise held

`run` and `run_timeout` are collective over ctx.comm (every rank calls them the same number of times);
they return this rank's raw results, and `verdict` turns everyone's into the failures found.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Dict, List, Optional

import torch

from .. import jit
from .. import layout as L
from ..contract import BufferContext
from ..windows.base import Window
from .launch import params_struct

SOURCE = "common/kernels/transport_selftest.cu"
KERNEL = jit.kernel_symbol("deepep_portable::selftest::transport_selftest", "SelftestParams")
THREADS = 512                               # kThreads in transport_selftest.cu
OUT_MISMATCHES, OUT_GET_VALUE, OUT_WAITS, OUT_TIMED_OUT, OUT_PEER_PTR = 0, 1, 2, 3, 4   # kOut* there

_FIELDS = ["local_base", "rank", "num_ranks", "rounds", "bytes", "seq_base", "mode", "timeout_peer", "timeout_ns",
           "error_claim", "error_host", "out", "id_off", "counter_off", "silent_off", "sig_a_off", "sig_b_off",
           "value_off", "zone_a_off", "zone_b_off", "zone_c0_off", "zone_c1_off", "stage_off"]


@functools.lru_cache(maxsize=None)
def params_type(transport_struct: type) -> type:
    """Mirror of SelftestParams for kernels built for the backend whose Transport `transport_struct` mirrors."""
    return params_struct("SelftestParams", [("transport", transport_struct), *_FIELDS])


def register_family(build) -> None:
    """Declare the conformance kernel for a backend's KernelBuild (what precompile and CI compile)."""
    jit.register_family("transport_selftest", SOURCE, [KERNEL], variants=[build.kernel_defines({})],
                        extra_flags=build.flags)


def window_bytes(num_ranks: int, bytes_per_put: int = 4096) -> int:
    return L.SelftestLayout(num_ranks, bytes_per_put).total_bytes


class TransportSelftest:
    def __init__(self, ctx: BufferContext, window: Window, bytes_per_put: int = 4096, rounds: int = 8,
                 timeout_s: float = 30.0) -> None:
        if bytes_per_put <= 0 or bytes_per_put % 32:
            raise ValueError(f"bytes_per_put must be a positive multiple of 32, got {bytes_per_put}")
        self.ctx, self.window, self.rounds, self.timeout_s = ctx, window, rounds, timeout_s
        self.layout = L.SelftestLayout(ctx.num_ranks, bytes_per_put)
        if self.layout.total_bytes > window.size:
            raise ValueError(f"the window holds {window.size} bytes, the self-test needs {self.layout.total_bytes} "
                             f"(window_bytes({ctx.num_ranks}, {bytes_per_put}))")
        self.fn = window.kernel(SOURCE, KERNEL, {})
        R = ctx.num_ranks
        self.out = torch.zeros(OUT_PEER_PTR + R + R * rounds, dtype=torch.int64, device=ctx.device)
        self.claim = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        self.runs = 0

    def _params(self, transport: Optional[ctypes.Structure], mode: int, timeout_peer: int, timeout_s: float):
        lay, ctx = self.layout, self.ctx
        t = transport if transport is not None else self.window.transport_params()
        p = params_type(type(t))()
        p.transport = t
        p.local_base, p.rank, p.num_ranks = self.window.base, ctx.rank, ctx.num_ranks
        p.rounds, p.bytes, p.seq_base = self.rounds, lay.bytes, self.runs * self.rounds
        p.mode, p.timeout_peer, p.timeout_ns = mode, timeout_peer, int(timeout_s * 1e9)
        p.error_claim, p.error_host, p.out = self.claim.data_ptr(), self.window.errors.dev, self.out.data_ptr()
        p.id_off, p.counter_off, p.silent_off = lay.id_offset, lay.counter_offset, lay.silent_offset
        p.sig_a_off, p.sig_b_off, p.value_off = lay.sig_a_offset, lay.sig_b_offset, lay.value_offset
        p.zone_a_off, p.zone_b_off = lay.zone_a_offset, lay.zone_b_offset
        p.zone_c0_off, p.zone_c1_off, p.stage_off = lay.zone_c0_offset, lay.zone_c1_offset, lay.stage_offset
        return p

    def _agree(self, step: str, fn) -> None:
        """Run the local `fn`, then exchange every rank's failure: all ranks raise together, so nobody
        is left in the next collective (this also serves as the barrier between steps)."""
        err = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"rank {self.ctx.rank}: {type(e).__name__}: {e}"
        errs = [e for e in self.ctx.comm.allgather_object(err) if e]
        if errs:
            raise RuntimeError(f"transport self-test, {step}: " + "; ".join(errs))

    def _launch(self, params) -> None:
        dev = self.ctx.device

        def prepare() -> None:   # counters and id word of this run, before any rank starts
            self.out.zero_()
            self.claim.zero_()
            for i in range(len(self.window.errors.words)):
                self.window.errors.words[i] = 0
            self.window.view(self.layout.id_offset, 8, dev).view(torch.int64).fill_(self.ctx.rank * 1000 + 7)
            self.window.view(self.layout.counter_offset, 8, dev).zero_()
            torch.cuda.synchronize(dev)

        def launch() -> None:
            self.fn.launch(1, THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, bytes(params))
            torch.cuda.synchronize(dev)

        self._agree("preparing a launch", prepare)   # and every earlier launch is over everywhere
        self._agree("the kernel", launch)            # every rank's kernel is done: the counters are final

    def run(self, transport: Optional[ctypes.Structure] = None) -> Dict:
        """Collective: one conformance launch. `transport`: another filling of the window's Transport
        struct (e.g. NVSHMEM without its load/store table, so its network routines run between P2P
        peers). Returns this rank's results for verdict()."""
        self._launch(self._params(transport, 0, -1, self.timeout_s))
        self.runs += 1
        R, out = self.ctx.num_ranks, self.out.cpu().tolist()
        counter = int(self.window.view(self.layout.counter_offset, 8, self.ctx.device).view(torch.int64).item())
        return dict(rank=self.ctx.rank, mismatches=out[OUT_MISMATCHES],
                    get_value_errors=out[OUT_GET_VALUE], waits=out[OUT_WAITS],
                    peer_ptr=out[OUT_PEER_PTR:OUT_PEER_PTR + R],
                    peer_ptr_expected=[int(b != 0) for b in self.window.bases],   # 0: no load/store address
                    # fetch_add is asked where the backend has it: load/store peers, or network atomics
                    atomics_expected=[int(b != 0 or self.window.remote_atomics) for b in self.window.bases],
                    fetched=[out[OUT_PEER_PTR + R + p * self.rounds:OUT_PEER_PTR + R + (p + 1) * self.rounds]
                             for p in range(R)],
                    counter=counter, error=self.window.recorded_error())

    def run_timeout(self, peer: int, timeout_s: float = 0.2) -> Dict:
        """Collective: every rank waits on a word nobody writes, naming `peer` in its record."""
        self._launch(self._params(None, 1, peer, timeout_s))
        return dict(rank=self.ctx.rank, timed_out=int(self.out[OUT_TIMED_OUT]), error=self.window.recorded_error())

    def verdict(self, results: List[Dict]) -> Dict[str, str]:
        """The broken promises in every rank's run() results ({} when the backend conforms)."""
        R, rounds = len(results), self.rounds
        bad: Dict[str, str] = {}
        for res in results:
            r = res["rank"]
            if res["mismatches"]:
                bad[f"rank {r}: data"] = f"{res['mismatches']} words older than their signal, poison or wrong"
            if res["get_value_errors"]:
                bad[f"rank {r}: get_value"] = f"{res['get_value_errors']} reads were not the peer's id word"
            if res["waits"] != 2 * R * rounds:
                bad[f"rank {r}: waits"] = f"{res['waits']} of {2 * R * rounds} succeeded (error {res['error']})"
            if res["error"] is not None:
                bad[f"rank {r}: error record"] = str(res["error"])
            if res["peer_ptr"] != res["peer_ptr_expected"]:
                bad[f"rank {r}: peer_ptr"] = f"non-null for {res['peer_ptr']}, want {res['peer_ptr_expected']}"
            asked = [int(all(v != -1 for v in f)) for f in res["fetched"]]
            if asked != res.get("atomics_expected", [1] * R):
                bad[f"rank {r}: fetch_add asked"] = f"for peers {asked}, want {res['atomics_expected']}"
        by_rank = {res["rank"]: res for res in results}
        for target in range(R):   # fetch_add: every rank added 1 per round to every rank's (zeroed) counter,
            # except over a network without atomics (-1: not asked, see transport_selftest.cu)
            got = sorted(v for res in results for v in res["fetched"][target] if v != -1)
            if got != list(range(len(got))):
                bad[f"fetch_add on rank {target}"] = f"returned {got}, want each of 0..{len(got) - 1} once"
            if by_rank[target]["counter"] != len(got):
                bad[f"counter of rank {target}"] = f"{by_rank[target]['counter']}, want {len(got)}"
        return bad
