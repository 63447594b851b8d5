// A stand-in for <nccl.h> used only to build the nccl_gin backend's device code (csrc/backends/nccl_gin/
// device.cuh) against the tests' mock of NCCL's device API (nccl_device.h here). Not NCCL: only the names
// device.cuh uses, with our own definitions. The version says "2.30.5": strong VA signals and GIN get.
#pragma once

#define NCCL_VERSION_CODE 23005

typedef struct ncclWindow_vidmem* ncclWindow_t;
