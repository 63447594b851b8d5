"""The FP8 cast of the oracle and of the reference transport gives the same bits on the GPU as on the CPU.

torch divides a CUDA tensor by a Python scalar as a multiplication by the scalar's reciprocal, which is
one ulp off the correctly rounded quotient for some amax values (3.28125 / 448 is exact; amax * (1 / 448)
is not). The kernels divide correctly rounded, so an oracle computed on the GPU must too: a fuzz case
on the H200 failed on exactly this before the casts divided by a tensor.
"""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import oracle  # noqa: E402
from deepep_portable.transports.reference import _fp8_cast  # noqa: E402

# amax values whose quotient by 448 the reciprocal gets wrong (found on the H200), and the 1e-4 clamp
EXACT_AMAX = [3.28125, 2.484375, 2.75, 2.578125]


def _rows() -> torch.Tensor:
    x = torch.randn(64, 23 * 128, generator=torch.Generator().manual_seed(7))
    for i, a in enumerate(EXACT_AMAX):
        x[i, :128] = 0
        x[i, 5] = -a
    x[len(EXACT_AMAX), :128] *= 1e-7
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("cast", ["oracle", "reference"])
def test_fp8_cast_same_bits_on_gpu_and_cpu(cast, round_scale):
    fn = (lambda x: oracle.fp8_cast(x, round_scale)) if cast == "oracle" else (lambda x: _fp8_cast(x, round_scale))
    x = _rows()
    cpu_data, cpu_scales = fn(x)
    gpu_data, gpu_scales = fn(x.cuda())
    assert torch.equal(gpu_scales.cpu().view(torch.int32), cpu_scales.view(torch.int32))
    assert torch.equal(gpu_data.cpu().view(torch.uint8), cpu_data.view(torch.uint8))
    if not round_scale:
        assert cpu_scales[0, 0].view(torch.int32).item() == 0x3BF00000   # 3.28125 / 448, correctly rounded
