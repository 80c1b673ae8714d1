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
// Forward: rows that fit in one block's registers (aligned, no residual stream) take a persistent
// grid (norm_fwd_staged_kernel): weight and bias stay in registers and x of the next rows streams
// into shared memory with cp.async while the current row is reduced. Other rows: one block per row
// (grid-stride), each thread owns VEC-element vectors (16 bytes of T) at stride blockDim; up to
// kFwdItems vectors a thread stay in registers, any further ones are re-read (from L1/L2) in the
// later sweeps, so every N works. Exact two-sweep variance in both.
// Backward: a persistent grid of P blocks per column slab, sized to one wave; thread t of a block
// owns the same columns for every row it visits, so its dweight/dbias sums stay in fp32 registers;
// each block writes one partial row and a last kernel sums the P rows. With aligned rows, h and dy
// of the block's next rows stream into shared memory (cp.async, kBwdStages deep) while the current
// row is reduced: the rows in flight hide DRAM latency without holding registers. When N exceeds
// one slab (kBwdThreads * kBwdItems vectors), a pre-pass computes the per-row sums the slabs need.
// Unaligned rows (a pointer not 16-byte aligned, a stride or N not a multiple of VEC) take the
// same code with element-wise loads (template flag), so the geometry never depends on alignment.
// Variants (vectors per thread, stages, blocks per SM) are arguments of the entry points, 0/-1 for
// the defaults below (tuning sweeps them; tests/gpu/test_norm.py checks each). The defaults won the
// sweep at the benchmark shape (figures: benchmarks/NOTES.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>
#include <mutex>

#include "pnf.h"
#include "pnf_convert.cuh"

namespace {

constexpr int kFwdItems = 4;      // vectors per thread kept in registers by the forward
constexpr int kFwdThreads = 512;    // so 128 registers a thread fit
constexpr int kFwdStagedItems = 2; // vectors per thread of the staged forward
constexpr int kFwdStages = 2;      // rows in flight per block of the staged forward (0: block per row)
constexpr int kBwdItems = 2;      // vectors per thread (and slab width) of the backward
constexpr int kBwdStages = 2;     // rows staged in shared memory by the backward (0: none)
constexpr int kBwdThreads = 512;
constexpr int kStatThreads = 1024; // backward pre-pass for sliced rows (nothing held in registers)
constexpr int kSumRows = 8;       // partial rows summed in parallel by the final reduction

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
__device__ __forceinline__ void bwd_terms(const BwdArgs& a, int64_t row, float mean, float rstd, int64_t v0,
                                          int64_t step, int64_t v_end, const float (&w)[ITEMS][VEC],
                                          float (&xhat)[ITEMS][VEC], float (&dy)[ITEMS][VEC], float (&c)[2]) {
  load_items_any<ITEMS, VEC, ALIGNED, false>(offset_row(a.h, a.h_dtype, row * a.stride_h), a.h_dtype, v0, step,
                                             v_end, a.cols, xhat);
  load_items<T, ITEMS, VEC, ALIGNED, false>(static_cast<const T*>(a.dy) + row * a.stride_dy, v0, step, v_end,
                                            a.cols, dy);
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
      bwd_terms<T, 1, VEC, ALIGNED>(a, row, a.is_rms ? 0.f : a.mean[row], a.rstd[row], v, blockDim.x, nvec, w, xhat,
                                    dy, c);
    }
    block_sum<2>(c, smem);
    if (threadIdx.x == 0) {
      a.rowstats[2 * row] = c[0] / a.cols;
      a.rowstats[2 * row + 1] = c[1] / a.cols;
    }
  }
}

// cp.async (sm_80+): 16 bytes global -> shared, zero-filled when !valid (src is then not read).
// A thread reads back only what it copied itself, so cp.async.wait_group (no barrier) suffices.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Grid (P, slabs): block (p, s) takes rows p, p + P, ... and the columns of slab s; each thread
// ITEMS vectors of them. STAGES > 1 (aligned rows, h in x's dtype): h and dy of the next
// STAGES - 1 rows stream into shared memory (cp.async) while the current row is reduced, so a
// block keeps rows in flight without holding them in registers; STAGES == 0 loads each row when
// it is needed.
template <typename T, bool ALIGNED, int ITEMS, int STAGES>
__global__ void __launch_bounds__(kBwdThreads) norm_bwd_kernel(const BwdArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  static_assert(STAGES == 0 || (STAGES > 1 && ALIGNED), "staged loads need aligned rows");
  extern __shared__ uint4 staged[];  // [STAGES][2 (h, dy)][ITEMS][blockDim.x]
  __shared__ float smem[64];
  const int64_t n = a.cols, nvec = (n + VEC - 1) / VEC, step = blockDim.x;
  const int64_t v0 = blockIdx.y * step * ITEMS + threadIdx.x;
  const int64_t v_end = min(nvec, (blockIdx.y + 1) * step * ITEMS);
  const bool whole_row = gridDim.y == 1;
  float w[ITEMS][VEC], dw[ITEMS][VEC] = {}, db[ITEMS][VEC] = {};
  load_weight<ITEMS, VEC, ALIGNED>(a, v0, step, v_end, w);
  auto slot = [&](int stage, int which, int it) { return staged + ((stage * 2 + which) * ITEMS + it) * step + threadIdx.x; };
  auto issue = [&](int stage, int64_t row) {  // one commit group per row (empty past the last row)
    if (row < a.rows) {
      const T* h = static_cast<const T*>(a.h) + row * a.stride_h;
      const T* dy = static_cast<const T*>(a.dy) + row * a.stride_dy;
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int64_t v = v0 + it * step;
        cp_async16(slot(stage, 0, it), v < v_end ? h + v * VEC : h, v < v_end);
        cp_async16(slot(stage, 1, it), v < v_end ? dy + v * VEC : dy, v < v_end);
      }
    }
    cp_async_commit();
  };
  if constexpr (STAGES > 1) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s, blockIdx.x + static_cast<int64_t>(s) * gridDim.x);
  }
  int stage = 0;
  // this row's mean and rstd, loaded one row ahead (their latency would stall every row otherwise)
  float next_mean = 0.f, next_rstd = 0.f;
  if (blockIdx.x < a.rows) {
    next_mean = a.is_rms ? 0.f : a.mean[blockIdx.x];
    next_rstd = a.rstd[blockIdx.x];
  }
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float xhat[ITEMS][VEC], g[ITEMS][VEC];  // g: dy, then dh
    float c[2] = {0.f, 0.f};
    const float mean = next_mean, rstd = next_rstd;
    if (row + gridDim.x < a.rows) {
      next_mean = a.is_rms ? 0.f : a.mean[row + gridDim.x];
      next_rstd = a.rstd[row + gridDim.x];
    }
    if constexpr (STAGES > 1) {
      issue((stage + STAGES - 1) % STAGES, row + static_cast<int64_t>(STAGES - 1) * gridDim.x);
      cp_async_wait<STAGES - 1>();  // this row's group has landed
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        alignas(16) T raw_h[VEC], raw_dy[VEC];
        *reinterpret_cast<uint4*>(raw_h) = *slot(stage, 0, it);
        *reinterpret_cast<uint4*>(raw_dy) = *slot(stage, 1, it);
        const bool in_row = v0 + it * step < v_end;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xhat[it][i] = in_row ? (to_float(raw_h[i]) - mean) * rstd : 0.f;
          g[it][i] = in_row ? to_float(raw_dy[i]) : 0.f;
          c[0] += xhat[it][i] * g[it][i] * w[it][i];
          c[1] += g[it][i] * w[it][i];
        }
      }
      stage = (stage + 1) % STAGES;
    } else {
      bwd_terms<T, ITEMS, VEC, ALIGNED>(a, row, mean, rstd, v0, step, v_end, w, xhat, g, c);
    }
    if (whole_row) {
      block_sum<2>(c, smem);
      c[0] /= n;
      c[1] /= n;
    } else {
      c[0] = a.rowstats[2 * row];
      c[1] = a.rowstats[2 * row + 1];
    }
    if (a.is_rms) c[1] = 0.f;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        dw[it][i] += g[it][i] * xhat[it][i];
        db[it][i] += g[it][i];
        g[it][i] = (g[it][i] * w[it][i] - xhat[it][i] * c[0] - c[1]) * rstd;
      }
    if (a.dres_out)
      load_items_any<ITEMS, VEC, ALIGNED, true>(offset_row(a.dres_out, a.dres_out_dtype, row * a.stride_dres_out),
                                                a.dres_out_dtype, v0, step, v_end, n, g);
    store_items<T, ITEMS, VEC, ALIGNED>(static_cast<T*>(a.dx) + row * a.stride_dx, v0, step, v_end, n, g);
    if (a.dres)
      store_items_any<ITEMS, VEC, ALIGNED>(offset_row(a.dres, a.dres_dtype, row * a.stride_dres), a.dres_dtype, v0,
                                           step, v_end, n, g);
  }
  if constexpr (STAGES > 1) cp_async_wait<0>();
  store_items<float, ITEMS, VEC, false>(a.partials + blockIdx.x * n, v0, step, v_end, n, dw);
  if (a.has_bias)
    store_items<float, ITEMS, VEC, false>(a.partials + (a.num_partials + blockIdx.x) * n, v0, step, v_end, n, db);
}

// Forward of rows that fit in a block's registers (aligned rows, no residual stream): a
// persistent grid, block p takes rows p, p + P, ...; weight and bias stay in registers, and x of
// the next STAGES - 1 rows streams into shared memory (cp.async) while the current row is
// normalised. Same arithmetic as norm_fwd_kernel.
template <typename T, int ITEMS, int STAGES>
__global__ void __launch_bounds__(kFwdThreads) norm_fwd_staged_kernel(const FwdArgs a) {
  constexpr int VEC = 16 / sizeof(T);
  static_assert(STAGES > 1, "at least one row in flight");
  extern __shared__ uint4 staged[];  // [STAGES][ITEMS][blockDim.x]
  __shared__ float smem[32];
  const int64_t n = a.cols, nvec = n / VEC, step = blockDim.x;
  float w[ITEMS][VEC], b[ITEMS][VEC];
  load_items_any<ITEMS, VEC, true, false>(a.weight, a.w_dtype, threadIdx.x, step, nvec, n, w);
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      w[it][i] += a.weight_offset;
      b[it][i] = 0.f;
    }
  if (a.bias) load_items_any<ITEMS, VEC, true, false>(a.bias, a.w_dtype, threadIdx.x, step, nvec, n, b);
  auto slot = [&](int stage, int it) { return staged + (stage * ITEMS + it) * step + threadIdx.x; };
  auto issue = [&](int stage, int64_t row) {  // one commit group per row (empty past the last row)
    if (row < a.rows) {
      const T* x = static_cast<const T*>(a.x) + row * a.stride_x;
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int64_t v = threadIdx.x + it * step;
        cp_async16(slot(stage, it), v < nvec ? x + v * VEC : x, v < nvec);  // zeros past the row
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s, blockIdx.x + static_cast<int64_t>(s) * gridDim.x);
  int stage = 0;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    issue((stage + STAGES - 1) % STAGES, row + static_cast<int64_t>(STAGES - 1) * gridDim.x);
    cp_async_wait<STAGES - 1>();  // this row's group has landed (vectors past the row read 0)
    float h[ITEMS][VEC], acc[1] = {0.f};
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      alignas(16) T raw[VEC];
      *reinterpret_cast<uint4*>(raw) = *slot(stage, it);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        h[it][i] = to_float(raw[i]);
        acc[0] += a.is_rms ? h[it][i] * h[it][i] : h[it][i];
      }
    }
    stage = (stage + 1) % STAGES;
    block_sum<1>(acc, smem);
    float mean = 0.f, var = acc[0] / n;
    if (!a.is_rms) {  // exact second sweep over the centred values
      mean = var;
      float sq[1] = {0.f};
#pragma unroll
      for (int it = 0; it < ITEMS; ++it)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = threadIdx.x + it * step < nvec ? h[it][i] - mean : 0.f;
          sq[0] += d * d;
        }
      block_sum<1>(sq, smem);
      var = sq[0] / n;
    }
    const float rstd = rsqrtf(var + a.eps);
    T* y = static_cast<T*>(a.y) + row * a.stride_y;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int64_t v = threadIdx.x + it * step;
      if (v >= nvec) continue;
      float out[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = (h[it][i] - mean) * rstd * w[it][i] + b[it][i];
      store_vec<T, VEC, true>(y, v * VEC, n, out);
    }
    if (threadIdx.x == 0) {
      if (!a.is_rms) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
  cp_async_wait<0>();
}

// Block (32, kSumRows), grid (cdiv(N, 32), n_sums): out[c] = sum over the first `used` rows p of
// partials[which, p, c] (num_partials rows per sum).
__global__ void sum_partials_kernel(const float* partials, int64_t used, int64_t num_partials, int64_t cols,
                                    void* dweight, void* dbias, int out_dtype) {
  __shared__ float smem[kSumRows][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const float* part = partials + blockIdx.y * num_partials * cols;
  float s = 0.f;
  if (col < cols) {
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < used; p += kSumRows) s += part[p * cols + col];
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

template <typename T>
void launch_rowstats(const BwdArgs& a, bool aligned, int threads, cudaStream_t stream) {
  if (aligned)
    norm_bwd_rowstats_kernel<T, true><<<grid_rows(a.rows), threads, 0, stream>>>(a);
  else
    norm_bwd_rowstats_kernel<T, false><<<grid_rows(a.rows), threads, 0, stream>>>(a);
}

// Backward variant: vectors per thread (ITEMS), staged rows (STAGES, 0: none), and blocks per SM
// (0: as many as fit). Chosen per call from N; tuning passes explicit values.
struct BwdConfig {
  int items, stages, blocks_per_sm;
};

BwdConfig bwd_config(int items, int stages, int blocks_per_sm) {
  return {items > 0 ? items : kBwdItems, stages >= 0 ? stages : kBwdStages, blocks_per_sm > 0 ? blocks_per_sm : 0};
}

bool valid_config(const BwdConfig& c) {
  return (c.items == 1 || c.items == 2) && (c.stages == 0 || c.stages == 2 || c.stages == 3) &&
         c.blocks_per_sm >= 0;
}

using BwdKernel = void (*)(BwdArgs);

template <typename T, bool ALIGNED, int ITEMS>
BwdKernel bwd_kernel_of(int stages) {
  if constexpr (ALIGNED) {
    if (stages == 2) return norm_bwd_kernel<T, true, ITEMS, 2>;
    if (stages == 3) return norm_bwd_kernel<T, true, ITEMS, 3>;
  }
  return norm_bwd_kernel<T, ALIGNED, ITEMS, 0>;
}

template <typename T>
BwdKernel bwd_kernel_of(bool aligned, const BwdConfig& c) {
  const int stages = aligned ? c.stages : 0;
  switch (c.items) {
    case 1: return aligned ? bwd_kernel_of<T, true, 1>(stages) : bwd_kernel_of<T, false, 1>(0);
    default: return aligned ? bwd_kernel_of<T, true, 2>(stages) : bwd_kernel_of<T, false, 2>(0);
  }
}

BwdKernel bwd_kernel_for(int x_dtype, bool aligned, const BwdConfig& c) {
  switch (x_dtype) {
    case PNF_FLOAT16: return bwd_kernel_of<__half>(aligned, c);
    case PNF_BFLOAT16: return bwd_kernel_of<__nv_bfloat16>(aligned, c);
    default: return bwd_kernel_of<float>(aligned, c);
  }
}

// Backward geometry: threads per block and column slabs for N columns of x_dtype.
void bwd_geometry(int x_dtype, int64_t cols, int items, int* threads, int64_t* slabs) {
  const int64_t nvec = (cols + vec_of(x_dtype) - 1) / vec_of(x_dtype);
  *threads = pow2_threads(nvec, items, 32, kBwdThreads);
  const int64_t slab_vecs = static_cast<int64_t>(*threads) * items;
  *slabs = (nvec + slab_vecs - 1) / slab_vecs;
}

size_t bwd_staged_bytes(bool staged, const BwdConfig& c, int threads) {
  return staged ? static_cast<size_t>(c.stages) * 2 * c.items * threads * sizeof(uint4) : 0;
}

// The status of a failed device query (never PNF_OK: nothing was launched).
int query_failed() {
  const int status = pnf_check_launch();
  return status != PNF_OK ? status : PNF_ERR_CUDA;
}

// Blocks of a kernel resident at once on the device (0 on error): per SM as many as fit (or
// c.blocks_per_sm), times the SMs. The occupancy query (and the shared-memory opt-in it needs)
// runs once per kernel, block size and device; later calls read a small table.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t smem, const BwdConfig& c) {
  struct Entry {
    const void* kernel;
    int threads, device, sms, per_sm;
    size_t smem;
  };
  static std::mutex mutex;
  static Entry table[64];
  static int used = 0;
  int device;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const void* key = reinterpret_cast<const void*>(kernel);
  int sms = 0, per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (int i = 0; i < used && !sms; ++i)
      if (table[i].kernel == key && table[i].threads == threads && table[i].smem == smem && table[i].device == device) {
        sms = table[i].sms;
        per_sm = table[i].per_sm;
      }
  }
  if (!sms) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    // Dynamic shared memory past 48 KiB (less the static part) must be opted into; raise the
    // kernel's limit, never lower it (a narrower row asks for less than a wider one did).
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) return 0;
    if (static_cast<size_t>(attr.maxDynamicSharedSizeBytes) < smem &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess)
      return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) return 0;
    std::lock_guard<std::mutex> lock(mutex);
    if (used < 64) table[used++] = {key, threads, device, sms, per_sm, smem};
  }
  if (c.blocks_per_sm > 0) per_sm = c.blocks_per_sm;
  return static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
}

// Forward variant (BwdConfig's fields): stages 0 is the block-per-row kernel; stages 2 or 3 the
// staged persistent one where it applies (aligned rows of at most kFwdThreads * items vectors,
// no residual stream).
using FwdKernel = void (*)(FwdArgs);

template <typename T>
FwdKernel fwd_staged_kernel_of(const BwdConfig& c) {
  if (c.items == 1) return c.stages == 3 ? norm_fwd_staged_kernel<T, 1, 3> : norm_fwd_staged_kernel<T, 1, 2>;
  return c.stages == 3 ? norm_fwd_staged_kernel<T, 2, 3> : norm_fwd_staged_kernel<T, 2, 2>;
}

template <typename T>
int launch_fwd(const FwdArgs& a, bool aligned, const BwdConfig& c, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t nvec = (a.cols + kVec - 1) / kVec;
  const int staged_threads = pow2_threads(nvec, c.items, 32, kFwdThreads);
  if (c.stages > 1 && aligned && !a.residual && !a.residual_out &&
      nvec <= static_cast<int64_t>(staged_threads) * c.items) {
    const FwdKernel kernel = fwd_staged_kernel_of<T>(c);
    const size_t smem = static_cast<size_t>(c.stages) * c.items * staged_threads * sizeof(uint4);
    const int64_t resident = resident_blocks(kernel, staged_threads, smem, c);
    if (resident == 0) return query_failed();
    const int64_t blocks = resident < a.rows ? resident : a.rows;
    kernel<<<static_cast<unsigned>(blocks), staged_threads, smem, stream>>>(a);
    return pnf_check_launch();
  }
  const int threads = pow2_threads(nvec, kFwdItems, 32, kFwdThreads);
  if (aligned)
    norm_fwd_kernel<T, true><<<grid_rows(a.rows), threads, 0, stream>>>(a);
  else
    norm_fwd_kernel<T, false><<<grid_rows(a.rows), threads, 0, stream>>>(a);
  return pnf_check_launch();
}

}  // namespace

// y = norm(x (+ residual)); writes y, residual_out (if non-null), mean (LayerNorm) and rstd.
// items, stages, blocks_per_sm: the variant (0, -1, 0: the default; see launch_fwd).
PNF_EXPORT int pnf_norm_fwd(const void* x, const void* residual, const void* weight, const void* bias, void* y,
                            void* residual_out, float* mean, float* rstd, int64_t rows, int64_t cols,
                            int64_t stride_x, int64_t stride_res, int64_t stride_y, int64_t stride_res_out,
                            int x_dtype, int res_dtype, int res_out_dtype, int w_dtype, float eps,
                            float weight_offset, int is_rms, int items, int stages, int blocks_per_sm, void* stream) {
  const BwdConfig c{items > 0 ? items : kFwdStagedItems, stages >= 0 ? stages : kFwdStages,
                    blocks_per_sm > 0 ? blocks_per_sm : 0};
  if (rows < 0 || cols < 0 || !valid_dtype(x_dtype) || !valid_dtype(res_dtype) || !valid_dtype(res_out_dtype) ||
      !valid_dtype(w_dtype) || !valid_config(c))
    return PNF_ERR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return PNF_OK;  // (empty tensors may have null pointers)
  if (!x || !weight || !y || !rstd || (!is_rms && !mean)) return PNF_ERR_INVALID_ARGUMENT;
  FwdArgs a{x, residual, weight, bias, y, residual_out, mean, rstd, rows, cols, stride_x, stride_res, stride_y,
            stride_res_out, res_dtype, res_out_dtype, w_dtype, eps, weight_offset, is_rms};
  const int vec = vec_of(x_dtype);
  const bool aligned = aligned_rows(vec, cols, {x, residual, weight, bias, y, residual_out},
                                    {stride_x, residual ? stride_res : 0, stride_y, residual_out ? stride_res_out : 0});
  auto s = static_cast<cudaStream_t>(stream);
  switch (x_dtype) {
    case PNF_FLOAT16: return launch_fwd<__half>(a, aligned, c, s);
    case PNF_BFLOAT16: return launch_fwd<__nv_bfloat16>(a, aligned, c, s);
    default: return launch_fwd<float>(a, aligned, c, s);
  }
}

// The backward's workspace: partials [n_sums, *num_partials, cols] fp32, and rowstats [rows, 2] fp32
// when *needs_rowstats. Sized from the occupancy of the backward kernel on the current device;
// items, stages, blocks_per_sm: the variant (0, -1, 0: the default), the same as pnf_norm_bwd gets.
PNF_EXPORT int pnf_norm_bwd_workspace(int x_dtype, int64_t rows, int64_t cols, int items, int stages,
                                      int blocks_per_sm, int64_t* num_partials, int* needs_rowstats) {
  const BwdConfig c = bwd_config(items, stages, blocks_per_sm);
  if (rows < 0 || cols < 0 || !valid_dtype(x_dtype) || !valid_config(c) || !num_partials || !needs_rowstats)
    return PNF_ERR_INVALID_ARGUMENT;
  int threads;
  int64_t slabs;
  bwd_geometry(x_dtype, cols, c.items, &threads, &slabs);
  // an upper bound: the staged (aligned) and the element-wise kernels may fit differently
  int64_t resident = 0;
  for (bool aligned : {true, false}) {
    const int64_t r = resident_blocks(bwd_kernel_for(x_dtype, aligned, c), threads,
                                          bwd_staged_bytes(aligned && c.stages > 1, c, threads), c);
    if (r == 0) return query_failed();
    resident = r > resident ? r : resident;
  }
  const int64_t programs = resident / slabs;
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
                            float weight_offset, int is_rms, int items, int stages, int blocks_per_sm, void* stream) {
  const BwdConfig c = bwd_config(items, stages, blocks_per_sm);
  if (rows < 0 || cols < 0 || num_partials < 1 || num_partials > 0x7fffffff || !valid_dtype(x_dtype) ||
      !valid_dtype(h_dtype) || !valid_dtype(dres_out_dtype) || !valid_dtype(dres_dtype) || !valid_dtype(w_dtype) ||
      !valid_config(c))
    return PNF_ERR_INVALID_ARGUMENT;
  if (cols == 0) return PNF_OK;
  if (!weight || !dweight || !partials || (rows > 0 && (!h || !rstd || !dy || !dx || (!is_rms && !mean))))
    return PNF_ERR_INVALID_ARGUMENT;  // (with no rows the row tensors are empty and may be null)
  int threads;
  int64_t slabs;
  bwd_geometry(x_dtype, cols, c.items, &threads, &slabs);
  if (slabs > 1 && !rowstats) return PNF_ERR_INVALID_ARGUMENT;
  BwdArgs a{h, weight, mean, rstd, dy, dres_out, rowstats, dx, dres, partials, rows, cols, stride_h, stride_dy,
            stride_dres_out, stride_dx, stride_dres, num_partials, h_dtype, dres_out_dtype, dres_dtype, w_dtype,
            weight_offset, is_rms, dbias != nullptr};
  const int vec = vec_of(x_dtype);
  const bool aligned = aligned_rows(vec, cols, {h, weight, dy, dres_out, dx, dres},
                                    {stride_h, stride_dy, dres_out ? stride_dres_out : 0, stride_dx,
                                     dres ? stride_dres : 0});
  auto s = static_cast<cudaStream_t>(stream);
  if (slabs > 1 && rows > 0) {
    const int stat_threads = pow2_threads((cols + vec - 1) / vec, kFwdItems, 32, kStatThreads);
    switch (x_dtype) {
      case PNF_FLOAT16: launch_rowstats<__half>(a, aligned, stat_threads, s); break;
      case PNF_BFLOAT16: launch_rowstats<__nv_bfloat16>(a, aligned, stat_threads, s); break;
      default: launch_rowstats<float>(a, aligned, stat_threads, s);
    }
  }
  // the staged kernel reads h as x's dtype: a residual stream of another dtype takes the other
  const bool staged = aligned && c.stages > 1 && h_dtype == x_dtype;
  BwdConfig used = c;
  if (!staged) used.stages = 0;
  const BwdKernel kernel = bwd_kernel_for(x_dtype, aligned, used);
  const size_t smem = bwd_staged_bytes(staged, used, threads);
  const int64_t resident = resident_blocks(kernel, threads, smem, used);
  if (resident == 0) return query_failed();
  int64_t programs = resident / slabs;  // one wave, each block with its own partial row
  programs = programs < num_partials ? programs : num_partials;
  programs = programs < rows ? programs : (rows > 0 ? rows : 1);  // with no rows one block writes zeros
  programs = programs < 1 ? 1 : programs;
  kernel<<<dim3(static_cast<unsigned>(programs), static_cast<unsigned>(slabs)), threads, smem, s>>>(a);
  int status = pnf_check_launch();
  if (status != PNF_OK) return status;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), dbias ? 2u : 1u);
  sum_partials_kernel<<<grid, dim3(32, kSumRows), 0, s>>>(partials, programs, num_partials, cols, dweight, dbias,
                                                          w_dtype);
  return pnf_check_launch();
}
