// LayerNorm / RMSNorm forward and backward (the Triton twin is paddlenlp_fused/kernels/triton/norm.py).
//
// Shapes (M rows, N columns, last axis contiguous, rows at any stride, 64-bit offsets):
//   x, y, dy, dx                          [M, N]  activation dtype T (template: fp32, fp16, bf16)
//   residual, residual_out, dresidual     [M, N]  each its own float dtype (run-time code)
//   weight, bias, dweight, dbias          [N]     fp32 or T (run-time code)
//   mean, rstd                            [M]     fp32; mean unused (may be null) for RMSNorm
//   partials (backward workspace)         [n_sums, P, N] fp32, P from pnf_norm_bwd_workspace
//   rowstats (backward workspace)         [M, 2] fp32, only when N needs several column slabs
//
//   h = x (+ residual, rounded to residual_out's dtype and stored); xhat = (h - mean) * rstd
//   (RMSNorm: mean = 0); y = xhat * (weight + weight_offset) (+ bias).
//
// Forward: one block per row (grid-stride), each thread owns VEC-element vectors (16 bytes of T)
// at stride blockDim; up to kFwdItems vectors a thread stay in registers, any further ones are
// re-read (from L1/L2) in the later sweeps, so every N works. Exact two-sweep variance.
// Backward: a persistent grid of P blocks per column slab; thread t of a block owns the same
// columns for every row it visits, so its dweight/dbias sums stay in fp32 registers; each block
// writes one partial row and a last kernel sums the P rows. When N exceeds one slab
// (kBwdThreads * kBwdItems vectors), a pre-pass computes the per-row sums the slabs need.
// Unaligned rows (a pointer not 16-byte aligned, a stride or N not a multiple of VEC) take the
// same code with element-wise loads (template flag), so the geometry never depends on alignment.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>

#include "pnf.h"

namespace {

constexpr int kFwdItems = 4;      // vectors per thread kept in registers by the forward
constexpr int kFwdThreads = 512;    // so 128 registers a thread fit
constexpr int kBwdItems = 2;      // vectors per thread (and slab width) of the backward
constexpr int kBwdThreads = 512;
constexpr int kStatThreads = 1024; // backward pre-pass for sliced rows (nothing held in registers)
constexpr int kSumRows = 8;       // partial rows summed in parallel by the final reduction

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename E>
__device__ __forceinline__ E from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Elements [col, col + VEC) of a row as floats; columns >= n read as 0. ALIGNED: one or two
// 16-byte (or one 8-byte) accesses, valid when the row start is aligned and n % VEC == 0.
template <typename E, int VEC, bool ALIGNED>
__device__ __forceinline__ void load_vec(const E* row, int64_t col, int64_t n, float (&out)[VEC]) {
  if constexpr (ALIGNED && VEC > 1) {
    constexpr int kBytes = sizeof(E) * VEC;
    alignas(16) E raw[VEC];
    if constexpr (kBytes >= 16) {
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i)
        reinterpret_cast<uint4*>(raw)[i] = reinterpret_cast<const uint4*>(row + col)[i];
    } else {
      static_assert(kBytes == 8, "vector of 8 bytes expected");
      *reinterpret_cast<uint2*>(raw) = *reinterpret_cast<const uint2*>(row + col);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(raw[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = col + i < n ? to_float(row[col + i]) : 0.f;
  }
}

template <typename E, int VEC, bool ALIGNED>
__device__ __forceinline__ void store_vec(E* row, int64_t col, int64_t n, const float (&v)[VEC]) {
  if constexpr (ALIGNED && VEC > 1) {
    constexpr int kBytes = sizeof(E) * VEC;
    alignas(16) E raw[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) raw[i] = from_float<E>(v[i]);
    if constexpr (kBytes >= 16) {
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i)
        reinterpret_cast<uint4*>(row + col)[i] = reinterpret_cast<const uint4*>(raw)[i];
    } else {
      *reinterpret_cast<uint2*>(row + col) = *reinterpret_cast<const uint2*>(raw);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (col + i < n) row[col + i] = from_float<E>(v[i]);
  }
}

// The same for a tensor whose dtype is a run-time PnfDtype code (uniform branch).
template <int VEC, bool ALIGNED>
__device__ __forceinline__ void load_any(const void* row, int dtype, int64_t col, int64_t n, float (&out)[VEC]) {
  switch (dtype) {
    case PNF_FLOAT16: load_vec<__half, VEC, ALIGNED>(static_cast<const __half*>(row), col, n, out); break;
    case PNF_BFLOAT16:
      load_vec<__nv_bfloat16, VEC, ALIGNED>(static_cast<const __nv_bfloat16*>(row), col, n, out);
      break;
    default: load_vec<float, VEC, ALIGNED>(static_cast<const float*>(row), col, n, out);
  }
}

template <int VEC, bool ALIGNED>
__device__ __forceinline__ void store_any(void* row, int dtype, int64_t col, int64_t n, const float (&v)[VEC]) {
  switch (dtype) {
    case PNF_FLOAT16: store_vec<__half, VEC, ALIGNED>(static_cast<__half*>(row), col, n, v); break;
    case PNF_BFLOAT16: store_vec<__nv_bfloat16, VEC, ALIGNED>(static_cast<__nv_bfloat16*>(row), col, n, v); break;
    default: store_vec<float, VEC, ALIGNED>(static_cast<float*>(row), col, n, v);
  }
}

// A thread's ITEMS vectors v = v0 + it * step of a row (those at or past v_end read as 0), written
// to out or, with ACCUMULATE, added to it. No branch separates the items' loads, so all of them
// are in flight together (a dtype switch between them would serialise their latencies).
template <typename E, int ITEMS, int VEC, bool ALIGNED, bool ACCUMULATE>
__device__ __forceinline__ void load_items(const E* row, int64_t v0, int64_t step, int64_t v_end, int64_t n,
                                           float (&out)[ITEMS][VEC]) {
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t v = v0 + it * step;
    float t[VEC];
    if (v < v_end) {
      load_vec<E, VEC, ALIGNED>(row, v * VEC, n, t);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) t[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[it][i] = ACCUMULATE ? out[it][i] + t[i] : t[i];
  }
}

template <int ITEMS, int VEC, bool ALIGNED, bool ACCUMULATE>
__device__ __forceinline__ void load_items_any(const void* row, int dtype, int64_t v0, int64_t step, int64_t v_end,
                                               int64_t n, float (&out)[ITEMS][VEC]) {
  switch (dtype) {
    case PNF_FLOAT16:
      load_items<__half, ITEMS, VEC, ALIGNED, ACCUMULATE>(static_cast<const __half*>(row), v0, step, v_end, n, out);
      break;
    case PNF_BFLOAT16:
      load_items<__nv_bfloat16, ITEMS, VEC, ALIGNED, ACCUMULATE>(static_cast<const __nv_bfloat16*>(row), v0, step,
                                                                  v_end, n, out);
      break;
    default: load_items<float, ITEMS, VEC, ALIGNED, ACCUMULATE>(static_cast<const float*>(row), v0, step, v_end, n, out);
  }
}

template <typename E, int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void store_items(E* row, int64_t v0, int64_t step, int64_t v_end, int64_t n,
                                            const float (&v)[ITEMS][VEC]) {
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
    if (v0 + it * step < v_end) store_vec<E, VEC, ALIGNED>(row, (v0 + it * step) * VEC, n, v[it]);
}

template <int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void store_items_any(void* row, int dtype, int64_t v0, int64_t step, int64_t v_end,
                                                int64_t n, const float (&v)[ITEMS][VEC]) {
  switch (dtype) {
    case PNF_FLOAT16: store_items<__half, ITEMS, VEC, ALIGNED>(static_cast<__half*>(row), v0, step, v_end, n, v); break;
    case PNF_BFLOAT16:
      store_items<__nv_bfloat16, ITEMS, VEC, ALIGNED>(static_cast<__nv_bfloat16*>(row), v0, step, v_end, n, v);
      break;
    default: store_items<float, ITEMS, VEC, ALIGNED>(static_cast<float*>(row), v0, step, v_end, n, v);
  }
}

// Rounds every value to dtype (what storing and reloading it would give).
template <int ITEMS, int VEC>
__device__ __forceinline__ void round_items(int dtype, float (&v)[ITEMS][VEC]) {
  if (dtype == PNF_FLOAT32) return;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      v[it][i] = dtype == PNF_FLOAT16 ? __half2float(__float2half_rn(v[it][i]))
                                      : __bfloat162float(__float2bfloat16_rn(v[it][i]));
}

__device__ __forceinline__ const void* offset_row(const void* base, int dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * (dtype == PNF_FLOAT32 ? 4 : 2);
}

__device__ __forceinline__ void* offset_row(void* base, int dtype, int64_t offset) {
  return static_cast<char*>(base) + offset * (dtype == PNF_FLOAT32 ? 4 : 2);
}

// Sums K values over the block (blockDim.x a multiple of 32); every thread gets the totals.
template <int K>
__device__ __forceinline__ void block_sum(float (&v)[K], float* smem /* [K * 32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k)
    for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * 32 + warp] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = lane < warps ? smem[k * 32 + lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  }
  __syncthreads();  // smem is reused by the next call
}

struct FwdArgs {
  const void* x;
  const void* residual;
  const void* weight;
  const void* bias;
  void* y;
  void* residual_out;
  float* mean;
  float* rstd;
  int64_t rows, cols, stride_x, stride_res, stride_y, stride_res_out;
  int res_dtype, res_out_dtype, w_dtype;
  float eps, weight_offset;
  int is_rms;
};

// h of kItems vectors of a row (x + residual, rounded to residual_out's dtype and stored there).
template <typename T, int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void fwd_load_h(const FwdArgs& a, const T* x, const void* res, void* res_out, int64_t v0,
                                           int64_t step, int64_t v_end, bool store_res_out, float (&h)[ITEMS][VEC]) {
  load_items<T, ITEMS, VEC, ALIGNED, false>(x, v0, step, v_end, a.cols, h);
  if (res) load_items_any<ITEMS, VEC, ALIGNED, true>(res, a.res_dtype, v0, step, v_end, a.cols, h);
  if (res_out) {
    round_items(a.res_out_dtype, h);
    if (store_res_out) store_items_any<ITEMS, VEC, ALIGNED>(res_out, a.res_out_dtype, v0, step, v_end, a.cols, h);
  }
}

template <typename T, int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void fwd_store_y(const FwdArgs& a, T* y, int64_t v0, int64_t step, int64_t v_end,
                                            float mean, float rstd, const float (&h)[ITEMS][VEC]) {
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int64_t v = v0 + it * step;
    if (v >= v_end) continue;
    float w[VEC], out[VEC];
    load_any<VEC, ALIGNED>(a.weight, a.w_dtype, v * VEC, a.cols, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = (h[it][i] - mean) * rstd * (w[i] + a.weight_offset);
    if (a.bias) {
      load_any<VEC, ALIGNED>(a.bias, a.w_dtype, v * VEC, a.cols, w);
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] += w[i];
    }
    store_vec<T, VEC, ALIGNED>(y, v * VEC, a.cols, out);
  }
}

// One block per row (grid-stride). The first kFwdItems * blockDim vectors stay in registers; the
// rest (rows wider than that) are re-read in each sweep.
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(kFwdThreads) norm_fwd_kernel(const FwdArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[32];
  const int64_t n = a.cols, nvec = (n + VEC - 1) / VEC, step = blockDim.x;
  const int64_t cached_end = min(nvec, kFwdItems * step);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(a.x) + row * a.stride_x;
    const void* res = a.residual ? offset_row(a.residual, a.res_dtype, row * a.stride_res) : nullptr;
    void* res_out = a.residual_out ? offset_row(a.residual_out, a.res_out_dtype, row * a.stride_res_out) : nullptr;
    float h[kFwdItems][VEC];
    fwd_load_h<T, kFwdItems, VEC, ALIGNED>(a, x, res, res_out, threadIdx.x, step, cached_end, true, h);
    float acc[1] = {0.f};  // vectors past the row read as 0 and add nothing
#pragma unroll
    for (int it = 0; it < kFwdItems; ++it)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[0] += a.is_rms ? h[it][i] * h[it][i] : h[it][i];
    for (int64_t v = cached_end + threadIdx.x; v < nvec; v += step) {
      float t[1][VEC];
      fwd_load_h<T, 1, VEC, ALIGNED>(a, x, res, res_out, v, step, nvec, true, t);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[0] += a.is_rms ? t[0][i] * t[0][i] : t[0][i];
    }
    block_sum<1>(acc, smem);
    float mean = 0.f, var = acc[0] / n;
    if (!a.is_rms) {  // exact second sweep over the centred values (no E[h^2] - mean^2 cancellation)
      mean = var;
      float sq[1] = {0.f};
#pragma unroll
      for (int it = 0; it < kFwdItems; ++it)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = (threadIdx.x + it * step) * VEC + i < n ? h[it][i] - mean : 0.f;
          sq[0] += d * d;
        }
      for (int64_t v = cached_end + threadIdx.x; v < nvec; v += step) {
        float t[1][VEC];
        fwd_load_h<T, 1, VEC, ALIGNED>(a, x, res, res_out, v, step, nvec, false, t);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = v * VEC + i < n ? t[0][i] - mean : 0.f;
          sq[0] += d * d;
        }
      }
      block_sum<1>(sq, smem);
      var = sq[0] / n;
    }
    const float rstd = rsqrtf(var + a.eps);
    T* y = static_cast<T*>(a.y) + row * a.stride_y;
    fwd_store_y<T, kFwdItems, VEC, ALIGNED>(a, y, threadIdx.x, step, cached_end, mean, rstd, h);
    for (int64_t v = cached_end + threadIdx.x; v < nvec; v += step) {
      float t[1][VEC];
      fwd_load_h<T, 1, VEC, ALIGNED>(a, x, res, res_out, v, step, nvec, false, t);
      fwd_store_y<T, 1, VEC, ALIGNED>(a, y, v, step, nvec, mean, rstd, t);
    }
    if (threadIdx.x == 0) {
      if (!a.is_rms) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
}

struct BwdArgs {
  const void* h;
  const void* weight;
  const float* mean;
  const float* rstd;
  const void* dy;
  const void* dres_out;
  float* rowstats;
  void* dx;
  void* dres;
  float* partials;
  int64_t rows, cols, stride_h, stride_dy, stride_dres_out, stride_dx, stride_dres, num_partials;
  int h_dtype, dres_out_dtype, dres_dtype, w_dtype;
  float weight_offset;
  int is_rms, has_bias;
};

// xhat and dy of a thread's ITEMS vectors of a row (0 past the row), and their terms of
// sum(xhat * w dy) and sum(w dy) added to c.
template <typename T, int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void bwd_terms(const BwdArgs& a, int64_t row, int64_t v0, int64_t step, int64_t v_end,
                                          const float (&w)[ITEMS][VEC], float (&xhat)[ITEMS][VEC],
                                          float (&dy)[ITEMS][VEC], float (&c)[2]) {
  load_items_any<ITEMS, VEC, ALIGNED, false>(offset_row(a.h, a.h_dtype, row * a.stride_h), a.h_dtype, v0, step,
                                             v_end, a.cols, xhat);
  load_items<T, ITEMS, VEC, ALIGNED, false>(static_cast<const T*>(a.dy) + row * a.stride_dy, v0, step, v_end,
                                            a.cols, dy);
  const float mean = a.is_rms ? 0.f : a.mean[row], rstd = a.rstd[row];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      xhat[it][i] = (v0 + it * step) * VEC + i < a.cols ? (xhat[it][i] - mean) * rstd : 0.f;
      c[0] += xhat[it][i] * dy[it][i] * w[it][i];
      c[1] += dy[it][i] * w[it][i];
    }
}

// weight + weight_offset at a thread's ITEMS vectors (0 past the row).
template <int ITEMS, int VEC, bool ALIGNED>
__device__ __forceinline__ void load_weight(const BwdArgs& a, int64_t v0, int64_t step, int64_t v_end,
                                            float (&w)[ITEMS][VEC]) {
  load_items_any<ITEMS, VEC, ALIGNED, false>(a.weight, a.w_dtype, v0, step, v_end, a.cols, w);
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) w[it][i] = v0 + it * step < v_end ? w[it][i] + a.weight_offset : 0.f;
}

// Grid-stride over rows: rowstats[row] = (mean(xhat * w dy), mean(w dy)), for sliced rows.
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(kStatThreads) norm_bwd_rowstats_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[64];
  const int64_t nvec = (a.cols + VEC - 1) / VEC;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float c[2] = {0.f, 0.f};
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float w[1][VEC], xhat[1][VEC], dy[1][VEC];
      load_weight<1, VEC, ALIGNED>(a, v, blockDim.x, nvec, w);
      bwd_terms<T, 1, VEC, ALIGNED>(a, row, v, blockDim.x, nvec, w, xhat, dy, c);
    }
    block_sum<2>(c, smem);
    if (threadIdx.x == 0) {
      a.rowstats[2 * row] = c[0] / a.cols;
      a.rowstats[2 * row + 1] = c[1] / a.cols;
    }
  }
}

// Grid (P, slabs): block (p, s) takes rows p, p + P, ... and the columns of slab s.
template <typename T, bool ALIGNED>
__global__ void __launch_bounds__(kBwdThreads) norm_bwd_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float smem[64];
  const int64_t n = a.cols, nvec = (n + VEC - 1) / VEC, step = blockDim.x;
  const int64_t v0 = blockIdx.y * step * kBwdItems + threadIdx.x;
  const int64_t v_end = min(nvec, (blockIdx.y + 1) * step * kBwdItems);
  const bool whole_row = gridDim.y == 1;
  float w[kBwdItems][VEC], dw[kBwdItems][VEC] = {}, db[kBwdItems][VEC] = {};
  load_weight<kBwdItems, VEC, ALIGNED>(a, v0, step, v_end, w);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float xhat[kBwdItems][VEC], g[kBwdItems][VEC];  // g: dy, then dh
    float c[2] = {0.f, 0.f};
    bwd_terms<T, kBwdItems, VEC, ALIGNED>(a, row, v0, step, v_end, w, xhat, g, c);
    if (whole_row) {
      block_sum<2>(c, smem);
      c[0] /= n;
      c[1] /= n;
    } else {
      c[0] = a.rowstats[2 * row];
      c[1] = a.rowstats[2 * row + 1];
    }
    if (a.is_rms) c[1] = 0.f;
    const float rstd = a.rstd[row];
#pragma unroll
    for (int it = 0; it < kBwdItems; ++it)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        dw[it][i] += g[it][i] * xhat[it][i];
        db[it][i] += g[it][i];
        g[it][i] = (g[it][i] * w[it][i] - xhat[it][i] * c[0] - c[1]) * rstd;
      }
    if (a.dres_out)
      load_items_any<kBwdItems, VEC, ALIGNED, true>(offset_row(a.dres_out, a.dres_out_dtype, row * a.stride_dres_out),
                                                    a.dres_out_dtype, v0, step, v_end, n, g);
    store_items<T, kBwdItems, VEC, ALIGNED>(static_cast<T*>(a.dx) + row * a.stride_dx, v0, step, v_end, n, g);
    if (a.dres)
      store_items_any<kBwdItems, VEC, ALIGNED>(offset_row(a.dres, a.dres_dtype, row * a.stride_dres), a.dres_dtype,
                                               v0, step, v_end, n, g);
  }
  store_items<float, kBwdItems, VEC, false>(a.partials + blockIdx.x * n, v0, step, v_end, n, dw);
  if (a.has_bias) store_items<float, kBwdItems, VEC, false>(a.partials + (a.num_partials + blockIdx.x) * n, v0, step,
                                                            v_end, n, db);
}

// Block (32, kSumRows), grid (cdiv(N, 32), n_sums): out[c] = sum_p partials[which, p, c].
__global__ void sum_partials_kernel(const float* partials, int64_t num_partials, int64_t cols, void* dweight,
                                    void* dbias, int out_dtype) {
  __shared__ float smem[kSumRows][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const float* part = partials + blockIdx.y * num_partials * cols;
  float s = 0.f;
  if (col < cols) {
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < num_partials; p += kSumRows) s += part[p * cols + col];
  }
  smem[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int r = 1; r < kSumRows; ++r) s += smem[r][threadIdx.x];
    float out[1] = {s};
    store_any<1, false>(blockIdx.y == 0 ? dweight : dbias, out_dtype, col, cols, out);
  }
}

// ---------------------------------------------------------------------------------------------
// host side

int vec_of(int dtype) { return dtype == PNF_FLOAT32 ? 4 : 8; }

bool valid_dtype(int dtype) { return dtype == PNF_FLOAT32 || dtype == PNF_FLOAT16 || dtype == PNF_BFLOAT16; }

bool aligned_rows(int vec, int64_t cols, std::initializer_list<const void*> ptrs,
                  std::initializer_list<int64_t> strides) {
  if (cols % vec) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  for (int64_t s : strides)
    if (s % vec) return false;
  return true;
}

int pow2_threads(int64_t vectors, int items, int lo, int hi) {
  int t = lo;
  while (t < hi && static_cast<int64_t>(t) * items < vectors) t *= 2;
  return t;
}

unsigned grid_rows(int64_t rows) { return static_cast<unsigned>(rows < (1 << 20) ? (rows > 0 ? rows : 1) : (1 << 20)); }

template <typename T, bool ALIGNED>
int bwd_occupancy(int threads) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, norm_bwd_kernel<T, ALIGNED>, threads, 0) != cudaSuccess)
    return -1;
  return blocks;
}

int bwd_blocks_per_sm(int x_dtype, int threads) {
  switch (x_dtype) {
    case PNF_FLOAT16: return bwd_occupancy<__half, true>(threads);
    case PNF_BFLOAT16: return bwd_occupancy<__nv_bfloat16, true>(threads);
    default: return bwd_occupancy<float, true>(threads);
  }
}

template <typename T>
void launch_fwd(const FwdArgs& a, bool aligned, int threads, cudaStream_t stream) {
  if (aligned)
    norm_fwd_kernel<T, true><<<grid_rows(a.rows), threads, 0, stream>>>(a);
  else
    norm_fwd_kernel<T, false><<<grid_rows(a.rows), threads, 0, stream>>>(a);
}

template <typename T>
void launch_bwd(const BwdArgs& a, bool aligned, int threads, int slabs, cudaStream_t stream) {
  if (slabs > 1) {
    constexpr int kVec = 16 / sizeof(T);
    const int stat_threads = pow2_threads((a.cols + kVec - 1) / kVec, kFwdItems, 32, kStatThreads);
    if (aligned)
      norm_bwd_rowstats_kernel<T, true><<<grid_rows(a.rows), stat_threads, 0, stream>>>(a);
    else
      norm_bwd_rowstats_kernel<T, false><<<grid_rows(a.rows), stat_threads, 0, stream>>>(a);
  }
  const dim3 grid(static_cast<unsigned>(a.num_partials), static_cast<unsigned>(slabs));
  if (aligned)
    norm_bwd_kernel<T, true><<<grid, threads, 0, stream>>>(a);
  else
    norm_bwd_kernel<T, false><<<grid, threads, 0, stream>>>(a);
}

// Backward geometry: threads per block and column slabs for N columns of x_dtype.
void bwd_geometry(int x_dtype, int64_t cols, int* threads, int64_t* slabs) {
  const int64_t nvec = (cols + vec_of(x_dtype) - 1) / vec_of(x_dtype);
  *threads = pow2_threads(nvec, kBwdItems, 32, kBwdThreads);
  const int64_t slab_vecs = static_cast<int64_t>(*threads) * kBwdItems;
  *slabs = (nvec + slab_vecs - 1) / slab_vecs;
}

}  // namespace

// y = norm(x (+ residual)); writes y, residual_out (if non-null), mean (LayerNorm) and rstd.
PNF_EXPORT int pnf_norm_fwd(const void* x, const void* residual, const void* weight, const void* bias, void* y,
                            void* residual_out, float* mean, float* rstd, int64_t rows, int64_t cols,
                            int64_t stride_x, int64_t stride_res, int64_t stride_y, int64_t stride_res_out,
                            int x_dtype, int res_dtype, int res_out_dtype, int w_dtype, float eps,
                            float weight_offset, int is_rms, void* stream) {
  if (rows < 0 || cols < 0 || !valid_dtype(x_dtype) || !valid_dtype(res_dtype) || !valid_dtype(res_out_dtype) ||
      !valid_dtype(w_dtype))
    return PNF_ERR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return PNF_OK;  // (empty tensors may have null pointers)
  if (!x || !weight || !y || !rstd || (!is_rms && !mean)) return PNF_ERR_INVALID_ARGUMENT;
  FwdArgs a{x, residual, weight, bias, y, residual_out, mean, rstd, rows, cols, stride_x, stride_res, stride_y,
            stride_res_out, res_dtype, res_out_dtype, w_dtype, eps, weight_offset, is_rms};
  const int vec = vec_of(x_dtype);
  const bool aligned = aligned_rows(vec, cols, {x, residual, weight, bias, y, residual_out},
                                    {stride_x, residual ? stride_res : 0, stride_y, residual_out ? stride_res_out : 0});
  const int threads = pow2_threads((cols + vec - 1) / vec, kFwdItems, 32, kFwdThreads);
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case PNF_FLOAT16: launch_fwd<__half>(a, aligned, threads, s); break;
    case PNF_BFLOAT16: launch_fwd<__nv_bfloat16>(a, aligned, threads, s); break;
    default: launch_fwd<float>(a, aligned, threads, s);
  }
  return pnf_check_launch();
}

// The backward's workspace: partials [n_sums, *num_partials, cols] fp32, and rowstats [rows, 2] fp32
// when *needs_rowstats. Sized from the occupancy of the backward kernel on the current device.
PNF_EXPORT int pnf_norm_bwd_workspace(int x_dtype, int64_t rows, int64_t cols, int64_t* num_partials,
                                      int* needs_rowstats) {
  if (rows < 0 || cols < 0 || !valid_dtype(x_dtype) || !num_partials || !needs_rowstats)
    return PNF_ERR_INVALID_ARGUMENT;
  int threads, device, sms;
  int64_t slabs;
  bwd_geometry(x_dtype, cols, &threads, &slabs);
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return pnf_check_launch();
  const int per_sm = bwd_blocks_per_sm(x_dtype, threads);
  if (per_sm < 0) return pnf_check_launch();
  const int64_t programs = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1) / slabs;
  *num_partials = programs < 1 ? 1 : (programs < rows ? programs : (rows > 0 ? rows : 1));
  *needs_rowstats = slabs > 1;
  return PNF_OK;
}

// Gradients of pnf_norm_fwd: h is residual_out when the forward stored one, else x. Writes dx
// (dh, plus dres_out when given), dres (dh in its own dtype, if non-null), dweight and dbias.
PNF_EXPORT int pnf_norm_bwd(const void* h, const void* weight, const float* mean, const float* rstd, const void* dy,
                            const void* dres_out, void* dx, void* dres, void* dweight, void* dbias, float* partials,
                            float* rowstats, int64_t num_partials, int64_t rows, int64_t cols, int64_t stride_h,
                            int64_t stride_dy, int64_t stride_dres_out, int64_t stride_dx, int64_t stride_dres,
                            int x_dtype, int h_dtype, int dres_out_dtype, int dres_dtype, int w_dtype,
                            float weight_offset, int is_rms, void* stream) {
  if (rows < 0 || cols < 0 || num_partials < 1 || num_partials > 0x7fffffff || !valid_dtype(x_dtype) ||
      !valid_dtype(h_dtype) || !valid_dtype(dres_out_dtype) || !valid_dtype(dres_dtype) || !valid_dtype(w_dtype))
    return PNF_ERR_INVALID_ARGUMENT;
  if (cols == 0) return PNF_OK;
  if (!weight || !dweight || !partials || (rows > 0 && (!h || !rstd || !dy || !dx || (!is_rms && !mean))))
    return PNF_ERR_INVALID_ARGUMENT;  // (with no rows the row tensors are empty and may be null)
  int threads;
  int64_t slabs;
  bwd_geometry(x_dtype, cols, &threads, &slabs);
  if (slabs > 1 && !rowstats) return PNF_ERR_INVALID_ARGUMENT;
  BwdArgs a{h, weight, mean, rstd, dy, dres_out, rowstats, dx, dres, partials, rows, cols, stride_h, stride_dy,
            stride_dres_out, stride_dx, stride_dres, num_partials, h_dtype, dres_out_dtype, dres_dtype, w_dtype,
            weight_offset, is_rms, dbias != nullptr};
  const int vec = vec_of(x_dtype);
  const bool aligned = aligned_rows(vec, cols, {h, weight, dy, dres_out, dx, dres},
                                    {stride_h, stride_dy, dres_out ? stride_dres_out : 0, stride_dx,
                                     dres ? stride_dres : 0});
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {  // with no rows the blocks write zero partial sums
    case PNF_FLOAT16: launch_bwd<__half>(a, aligned, threads, static_cast<int>(slabs), s); break;
    case PNF_BFLOAT16: launch_bwd<__nv_bfloat16>(a, aligned, threads, static_cast<int>(slabs), s); break;
    default: launch_bwd<float>(a, aligned, threads, static_cast<int>(slabs), s);
  }
  int status = pnf_check_launch();
  if (status != PNF_OK) return status;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), dbias ? 2u : 1u);
  sum_partials_kernel<<<grid, dim3(32, kSumRows), 0, s>>>(partials, num_partials, cols, dweight, dbias, w_dtype);
  return pnf_check_launch();
}
