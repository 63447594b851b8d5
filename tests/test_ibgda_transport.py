"""The ibgda backend's operations (csrc/backends/ibgda/ops.cuh, what device.cuh's contract primitives post)
end to end between ranks played by host threads, against the software NIC of tests/native/mlx5_nic_model.hpp
(tests/native/ibgda_transport_model.cu): block WRITEs then a signal on the same queue, with the block's
pieces landing in random order, READ, FETCH_ADD from every rank, drains before staging rows are reused, ring
and 16-bit WQE index wrap-around, and an error completion. The device structs and the kernels compiled for
this backend are checked in tests/test_mirrors.py (test_ibgda_backend_params)."""


def test_operations_between_ranks_against_the_nic_model(run_native):
    out = run_native("ibgda_transport_model", timeout=600)
    assert "most WQEs on one queue 67500" in out   # the wrap-around case really wrapped the 16-bit index
