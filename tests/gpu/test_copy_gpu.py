"""The benchmark ceilings' copy kernels move exactly the bytes they are given (single process)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from deepep_portable import _C  # noqa: E402
from deepep_portable.tools.kernels import SegmentCopy, copy_with_blocks  # noqa: E402

_ok, _reason = _C.driver_status()
if not _ok:
    pytest.skip(f"CUDA driver unusable from _C: {_reason}", allow_module_level=True)


@pytest.mark.parametrize("blocks", [1, 7, 132])
def test_copy_with_blocks(blocks):
    src = torch.randint(0, 255, (3 * 4096 + 48,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    copy_with_blocks(dst, src, blocks)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


@pytest.mark.parametrize("blocks", [1, 5, 64])
def test_segment_copy_lands_each_span_and_nothing_else(blocks):
    sizes = [4096, 0, 16, 70000 // 16 * 16, 512]
    src = torch.randint(0, 255, (sum(sizes) + 32,), dtype=torch.uint8, device="cuda")
    dst = torch.full((sum(sizes) + 4096,), 0xAB, dtype=torch.uint8, device="cuda")
    # Spans go to the destination in reverse order, each 16 bytes after the previous one.
    offsets, at = [], 16
    for n in reversed(sizes):
        offsets.append(at)
        at += n
    offsets.reverse()
    copy = SegmentCopy(src, [dst.data_ptr() + off for off in offsets], sizes)
    copy(blocks)
    torch.cuda.synchronize()
    expected = torch.full_like(dst, 0xAB)
    begin = 0
    for off, n in zip(offsets, sizes):
        expected[off:off + n] = src[begin:begin + n]
        begin += n
    assert torch.equal(dst, expected)

