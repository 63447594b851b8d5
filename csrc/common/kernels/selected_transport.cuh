// The one transport a kernel over the contract (transport.cuh) is built for.
//
// The kernel core never names a backend. The host chooses it: a window's KernelBuild
// (deepep_portable/windows/base.py) compiles the kernel with
//     nvcc -include backends/<name>/device.cuh -DDEEPEP_TRANSPORT=<Struct>
// so the backend's header is read before the kernel's own source, and <Struct> (a type of namespace
// deepep_portable::transport) becomes `transport::Selected`. Adding a backend therefore edits nothing
// here or in the kernels. The struct travels by value in each kernel's params (host mirror: the
// window's transport_params()), so it must be plain data packed in 8-byte words.
#pragma once

#include <type_traits>

#include "common/kernels/transport.cuh"

#ifndef DEEPEP_TRANSPORT
#error "kernels over the transport contract are built for one backend: -include backends/<name>/device.cuh -DDEEPEP_TRANSPORT=<Struct> (KernelBuild in deepep_portable/windows/base.py)"
#endif

namespace deepep_portable::transport {

using Selected = ::deepep_portable::transport::DEEPEP_TRANSPORT;

static_assert(std::is_trivially_copyable_v<Selected>, "a Transport struct is copied into kernel params");
static_assert(alignof(Selected) <= 8 && sizeof(Selected) % 8 == 0,
              "a Transport struct is packed in 8-byte words (the params after it stay 64-bit aligned)");
static_assert(std::is_same_v<decltype(Selected::kCheapFetchAdd), const bool>,
              "a Transport states whether fetch_add is cheap (kCheapFetchAdd)");
static_assert(std::is_same_v<decltype(Selected::kSignalCoversWarp), const bool>,
              "a Transport states whether one lane's signal covers its warp's earlier puts (kSignalCoversWarp)");

}  // namespace deepep_portable::transport
