// Programmatic dependent launch (sm_90+; the host's launch(..., programmatic=True)). A kernel so
// launched may be scheduled before the previous kernel in its stream has finished: once every block of
// that kernel has called allow_next_grid() or exited. What it saves is the kernel boundary (the
// previous grid's completion, then this grid's launch), not any work.
//   wait_previous_grid(): every thread, before it touches anything the previous kernel wrote: returns
//     once that kernel has completed and its writes are visible (at once when the launch was not
//     programmatic). Older GPUs: nothing to wait for, the launch is never programmatic there.
//   allow_next_grid(): this block is past every wait on something outside its grid (a peer's signal):
//     the next grid's blocks may then take SMs. Earlier would be unsafe where ranks share a GPU: the
//     kernels spin on their peers, so every block of a call on every rank must find an SM (Window.grid),
//     and a next grid waiting for an unfinished one would hold SMs that a late peer's blocks need. The
//     first call by any thread of a block counts for the block.
#pragma once

#include "common/kernels/common.cuh"

namespace deepep_portable {

DEEPEP_DEVICE void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

DEEPEP_DEVICE void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace deepep_portable
