// paddlenlp_fused CUDA kernels: the shared C ABI.
//
// Every entry point is `extern "C" int pnf_<op>(...)`: raw device pointers, sizes, strides (in
// elements), the stream as `void*` (cudaStream_t), returning a PnfStatus. Nothing here depends on a
// framework, so one build serves every Paddle (and torch, for the GPU test suite) version.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#define PNF_ABI_VERSION 3

enum PnfStatus {
  PNF_OK = 0,
  PNF_ERR_INVALID_ARGUMENT = 1,   // a size, stride or pointer the kernel cannot take
  PNF_ERR_UNSUPPORTED = 2,        // a valid case this kernel does not implement (dtype, width, ...)
  PNF_ERR_CUDA = 3,               // a CUDA runtime call or launch failed; see pnf_last_cuda_error
  PNF_ERR_CUBLAS = 4,             // a cuBLAS(Lt) call failed
};

// Element dtypes, shared with kernels/cuda/library.py.
enum PnfDtype { PNF_FLOAT32 = 0, PNF_FLOAT16 = 1, PNF_BFLOAT16 = 2 };

#define PNF_EXPORT extern "C" __attribute__((visibility("default")))

// Record the CUDA error of the last launch (if any) and turn it into a status.
int pnf_check_launch();
