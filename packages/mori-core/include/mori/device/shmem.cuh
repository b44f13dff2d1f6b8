// mori device API: the one header a kernel includes.
//
//   #define MORI_DEVICE_DEFINE_STATE   // in exactly one translation unit of the module
//   #include <mori/device/shmem.cuh>
//
// Everything is in namespace mori::device. Compiles with nvcc, NVRTC and
// clang -x cuda -nocudainc -nocudalib (sm_70 or newer); needs no CUDA header. See
// docs/device-api.md for every function, its scope and its ordering guarantees.
#pragma once

#include "atomic.cuh"
#include "copy.cuh"
#include "group.cuh"
#include "p2p.cuh"
#include "platform.cuh"
#include "proxy.cuh"
#include "ptx.cuh"
#include "rma.cuh"
#include "state.cuh"
#include "sync.cuh"
