"""The nvshmem backend on GPUs, under mpirun (2 or 4 PEs; several PEs may share one GPU under MPS):

  mpirun -n 2 python -m pytest --with-mpi -q tests/mpi/test_nvshmem_gpu_mpi.py

NVSHMEM is initialised by unique id over the test's gloo group (deepep_portable.nvshmem_runtime),
a symmetric window is allocated, and the device-linked self-test kernel (jit_link.SELFTEST_SOURCE,
every NvshmemTransport primitive) runs twice:
  round 1: every PE put_signal_warps a pattern to the next PE (and put2_warps it, halves swapped, to
           a second zone; fetch_adds 5 to a word there) and waits for the previous PE's signal; the
           data, both signals, the put_value word and the fetch_add word must be there;
  round 2: PE 0 sends nothing to PE 1: PE 1's wait_ge must return false and its ErrorSink must
           record a timeout naming PE 0; every other PE succeeds.
Skipped without CUDA, NVSHMEM, nvcc, or with fewer than 2 ranks. NVSHMEM is initialised once per
process (one test function). Collectives never meet a rank that failed alone: compile and module
load are agreed over MPI before the first NVSHMEM collective, every kernel wait has a deadline, and
results are exchanged before any assert. Wrap the run in `timeout` anyway (a rank dying inside an
NVSHMEM collective leaves the others there).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from deepep_portable import jit
from deepep_portable.transports.nvshmem import link as jit_link
from deepep_portable.transports.nvshmem import runtime as nr
from deepep_portable.transports.nvshmem.abi import NvshmemTransportParams
from deepep_portable.comm import Comm

DATA = 4096              # bytes put per PE (each of the window's two data zones)
WINDOW = 2 * DATA + 64   # + u64 slots (see jit_link.SELFTEST_SOURCE)
SIG = 2 * DATA


def _skip_reason(size: int):
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if size < 2:
        return "needs >= 2 ranks (mpirun -n 2)"
    why = nr.load_error()
    if why:
        return why
    try:
        jit.find_nvcc()
        jit_link.nvshmem_build_paths()
    except jit.JitCompileError as e:
        return str(e)
    return None


def _pattern(rank: int) -> bytes:
    return bytes((rank * 31 + i) % 251 for i in range(DATA))


@pytest.mark.mpi(min_size=2)
def test_nvshmem_put_signal_ring_and_timeout(mpi_comm, pg, device):
    size, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    reasons = mpi_comm.allgather(_skip_reason(size))
    if any(reasons):
        pytest.skip(next(r for r in reasons if r))
    comm = Comm(pg)
    dev = device.index
    torch.zeros(1, device=device)  # make the device's primary context current on this thread
    torch.cuda.synchronize(device)

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    if rank == 0:  # compile once; the others hit the cache (the per-key lock would also serialize)
        jit_link.compile_selftest(arch, DATA)
    mpi_comm.Barrier()
    compiled = jit_link.compile_selftest(arch, DATA)

    from deepep_portable import _C

    cu = ctypes.CDLL("libcuda.so.1")  # our own handle: argtypes set here touch nobody else's
    cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]

    rt = nr.NvshmemRuntime(comm, dev)  # raises on every rank if any rank is not ready
    results = {}
    all_results = []
    try:
        # Local steps that can fail alone (installation check, module load, cumodule_init), agreed
        # before the first collective (nvshmem_malloc) so that no rank is left inside it.
        err = None
        try:
            mod = rt.load_module(compiled)
            fn = mod.function(jit_link.SELFTEST_KERNEL)
            if fn.param_size >= 0:
                assert fn.param_size == ctypes.sizeof(jit_link.SelftestParams), (fn.param_size,
                                                                          ctypes.sizeof(jit_link.SelftestParams))
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        errs = [e for e in mpi_comm.allgather(err) if e]
        if errs:  # every rank takes this branch together: straight to the teardown
            raise RuntimeError("module setup failed: " + "; ".join(errs))
        window = rt.malloc(WINDOW)  # collective, same size on every PE
        src = rt.malloc(DATA)
        assert window and src
        pat = _pattern(rank)
        _C.memset_d8_async(dev, window, 0, WINDOW, 0)
        _C.stream_synchronize(dev, 0)
        assert cu.cuMemcpyHtoD_v2(src, pat, DATA) == 0
        results["peer_ptr_self"] = rt.ptr(window, rank) == window

        claim = torch.zeros(1, dtype=torch.int32, device=device)
        out = torch.zeros(5, dtype=torch.int64, device=device)
        host = torch.zeros(6, dtype=torch.int32).pin_memory()  # UVA: the device can write it

        def run(seq: int, skip_to: int, timeout_s: float):
            claim.zero_()
            out.fill_(-7)
            host.zero_()
            torch.cuda.synchronize(device)
            rt.barrier_all()  # every PE's window is ready before anyone sends
            p = jit_link.SelftestParams(NvshmemTransportParams(window, rt.my_pe, rt.n_pes, 0), src, seq, int(timeout_s * 1e9),
                                  claim.data_ptr(), host.data_ptr(), out.data_ptr(), skip_to, 0)
            fn.launch(1, 32, 0, 0, bytes(p))   # one warp, legacy default stream
            _C.stream_synchronize(dev, 0)
            rt.barrier_all()  # every PE's kernel (and its nvshmem_quiet) is done
            got = ctypes.create_string_buffer(WINDOW)
            assert cu.cuMemcpyDtoH_v2(got, window, WINDOW) == 0
            sig = [int.from_bytes(got.raw[SIG + 8 * k:SIG + 8 * k + 8], "little") for k in range(5)]
            return got.raw[:2 * DATA], sig, out.cpu().tolist(), host.tolist()

        prev = (rank - 1) % size
        data, sig, o, h = run(seq=1, skip_to=-1, timeout_s=30.0)
        half = DATA // 2
        results["r1_data"] = data[:DATA] == _pattern(prev)
        results["r1_put2"] = data[DATA:] == _pattern(prev)[half:] + _pattern(prev)[:half]
        results["r1_signals"] = sig == [1, 2, 3, 0, 5]   # the last: the word prev fetch_added 5 to
        results["r1_fetch_add"] = o[4] == 0
        results["r1_waits"] = o[:3] == [1, 1, -1]
        results["r1_no_error"] = h[0] == 0
        results["peer_ptr_next"] = o[3]  # 1 on one node (P2P), informative only

        _, sig, o, h = run(seq=10, skip_to=1 if rank == 0 else -1, timeout_s=2.0)
        if rank == 1:
            results["r2_timed_out"] = o[0] == 0 and o[1] == 0
            results["r2_error_record"] = (h[0], h[1], h[2], h[3]) == (1, 1, 1, 0)  # timeout, op, rank, peer
            results["r2_no_signal"] = sig[0] == 1 and sig[4] == 5
        else:
            results["r2_waits"] = o[:2] == [1, 1] and h[0] == 0 and sig == [10, 11, 12, 0, 10]
        if rank != 0:   # PE 0 sends nothing in round 2
            results["r2_fetch_add"] = o[4] == 5
    except Exception as e:  # noqa: BLE001 - report after the collective teardown
        results["exception"] = f"{type(e).__name__}: {e}"
    finally:
        all_results = mpi_comm.allgather(results)
        rt.finalize()  # cumodule_finalize of the loaded module, nvshmem_free, hostlib_finalize

    for r, res in enumerate(all_results):
        assert "exception" not in res, f"rank {r}: {res['exception']}"
        bad = {k: v for k, v in res.items() if v is False}
        assert not bad, f"rank {r}: failed checks {sorted(bad)} (all: {res})"
