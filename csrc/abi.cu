// ABI version and error reporting shared by every entry point.
#include <stdio.h>

#include "pnf.h"

static thread_local char g_last_cuda_error[256] = "";

int pnf_check_launch() {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return PNF_OK;
  snprintf(g_last_cuda_error, sizeof(g_last_cuda_error), "%s: %s", cudaGetErrorName(err),
           cudaGetErrorString(err));
  return PNF_ERR_CUDA;
}

PNF_EXPORT int pnf_abi_version() { return PNF_ABI_VERSION; }

PNF_EXPORT const char* pnf_last_cuda_error() { return g_last_cuda_error; }
