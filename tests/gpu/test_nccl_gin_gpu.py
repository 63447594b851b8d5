"""The nccl_gin backend at one rank on a GPU (passed on the H200 with NCCL 2.28.9): NCCL's communicator,
window and device communicator over a one-rank group, the transport contract's conformance kernel over LSA on
itself, and a request for GIN on a machine without a GIN-capable NIC refused with a clear error."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepep_portable.comm import Comm  # noqa: E402
from deepep_portable.contract import BufferContext  # noqa: E402
from deepep_portable.transports import available_transports  # noqa: E402


@pytest.fixture
def ctx(one_rank_group):
    status = available_transports()["nccl_gin"]
    if not status.usable:
        pytest.skip(f"nccl_gin: {status.reason}")
    device = torch.device("cuda", torch.cuda.current_device())
    return BufferContext(comm=Comm(one_rank_group), rank=0, num_ranks=1, device=device, num_nvl_bytes=0,
                         num_rdma_bytes=0, low_latency_mode=True, uid=-3, timeout_s=10.0)


def test_contract_over_lsa_on_itself(ctx):
    from deepep_portable.engines.transport_selftest import TransportSelftest, window_bytes
    from deepep_portable.transports.nccl_gin.window import NcclGinWindow

    window = NcclGinWindow(ctx, window_bytes(1))
    try:
        assert window.lsa_team == [0] and window.bases[0] != 0 and window.gin_contexts == 0
        test = TransportSelftest(ctx, window)
        results = [test.run(window.transport_params()), test.run(window.transport_params())]
        timeout = test.run_timeout(peer=0)
    finally:
        window.close()
    for res in results:
        assert not test.verdict([res]), test.verdict([res])
    assert timeout["timed_out"] == 1, timeout


def test_gin_without_a_nic_is_refused_clearly(ctx):
    from deepep_portable.transports.nccl_gin.window import NcclGinWindow

    with pytest.raises(RuntimeError, match="nccl_gin: .*(GIN|ncclDevCommCreate)"):
        NcclGinWindow(ctx, 1 << 20, options={"gin": True}).close()


def test_window_over_the_torch_nccl_groups_own_communicator(ctx):
    """A torch NCCL group: the window runs over torch's own communicator when torch has _comm_ptr and one libnccl
    is mapped (ours), else over its own and says why; either way the conformance kernel passes, and torch's
    communicator still works after the window is closed (we never destroy what torch owns)."""
    import dataclasses

    import torch.distributed as dist

    from deepep_portable.engines.transport_selftest import TransportSelftest, window_bytes
    from deepep_portable.transports import libraries
    from deepep_portable.transports.nccl_gin import torch_comm
    from deepep_portable.transports.nccl_gin.window import NcclGinWindow

    group = dist.new_group([0], backend="nccl")
    nctx = dataclasses.replace(ctx, comm=Comm(group))
    window = NcclGinWindow(nctx, window_bytes(1))
    try:
        backend = group._get_backend(ctx.device)
        # The rules' own answer now that the communicator exists (its reasons are CPU-tested): must match.
        ptr, why = torch_comm.local_candidate(group, ctx.device, libraries.nccl_info()["lib"],
                                              window.host.check_versions())
        print(f"\nnccl_gin communicator: {window.comm_source}; libnccl mapped: {torch_comm.mapped_libraries()}")
        assert window.owns_comm == (ptr == 0), (window.comm_source, why)
        if ptr:
            assert window.comm.value == ptr == backend._comm_ptr()
        test = TransportSelftest(nctx, window)
        res = test.run(window.transport_params())
        assert not test.verdict([res]), test.verdict([res])
    finally:
        window.close()
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t, group=group)
    assert t.item() == 1
