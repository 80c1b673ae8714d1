// Depthwise causal conv1d forward and backward (the Triton twin is
// paddlenlp_fused/kernels/triton/causal_conv1d.py).
//
// Shapes (b batch, d dim, l seqlen, w width in 2..4; strides in elements, 64-bit offsets):
//   x, out, dout, dx            [b, d, l]   activation dtype E (template: fp32, fp16, bf16)
//   weight [d, w], bias [d]                 any float dtype (run-time code)
//   seq_idx [b, l]                          int32 or int64: positions of different ids never mix
//   initial_states, dinitial [b, d, w-1]    any float dtype: x at positions -(w-1) .. -1
//   dweight [d, w], dbias [d]               fp32 contiguous, accumulated (+=, the caller zeroes them)
//
//   out[t] = act(bias + sum_k weight[k] * x[t - (w-1) + k]),  act = identity or silu; x at a
//   position of another sequence counts as 0.  Internally the taps are right-aligned in a window
//   of kMaxWidth: tap j (0..3) multiplies x[t - 3 + j] and is live when j >= 4 - w.
//
// Two kernel geometries, both fp32 math:
//  * "seq" (channel-first, l contiguous): one block per (row = b*d + d, chunk of l); thread t owns
//    kItems vectors of 16 bytes at vector slots it*kThreads + t (coalesced). The w-1 inputs before
//    a vector (its left halo) are the previous vector's tail, exchanged through shared memory;
//    the backward likewise shares the first w-1 pre-activation gradients of each vector (the dx
//    look-ahead). dweight/dbias: block reduction, then one fp32 atomic per tap per block.
//    Rows that are not 16-byte aligned take the same code with element-wise accesses.
//  * "walk" (any strides; vectorised when d is contiguous, e.g. channel-last x stored [b, l, d]):
//    thread (x, y) owns VEC consecutive channels and walks a run of positions, the window in
//    registers. dweight/dbias: reduced over the block's y threads in shared memory, then atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pnf.h"
#include "pnf_convert.cuh"

namespace {

constexpr int kMaxWidth = 4;
constexpr int kHalo = kMaxWidth - 1;
// Launch geometry: the defaults won a sweep at the benchmark shape (benchmarks/NOTES.md); a tuning run rebuilds
// this file alone with -D overrides.
#ifndef PNF_CONV_SEQ_THREADS
#define PNF_CONV_SEQ_THREADS 128
#endif
#ifndef PNF_CONV_SEQ_ITEMS
#define PNF_CONV_SEQ_ITEMS 2
#endif
#ifndef PNF_CONV_WALK_RUN
#define PNF_CONV_WALK_RUN 32
#endif
constexpr int kSeqThreads = PNF_CONV_SEQ_THREADS;
constexpr int kSeqItems = PNF_CONV_SEQ_ITEMS;  // 16-byte vectors a thread of the seq kernels holds
constexpr int kWalkX = 32, kWalkY = 4;   // walk block: channel groups x position runs
constexpr int kWalkRunFwd = PNF_CONV_WALK_RUN, kWalkRunBwd = 2 * PNF_CONV_WALK_RUN;  // positions a thread walks
constexpr int kWalkBatch = 8;  // positions loaded together (the loads of a batch are in flight at once)

struct Strides3 {
  int64_t b, d, l;
};

struct ConvParams {
  const void* x;
  const void* weight;
  const void* bias;     // may be null
  const void* seq_idx;  // may be null
  const void* init;     // may be null
  const void* dout;     // backward only
  void* out;            // forward: out; backward: dx
  float* dweight;       // backward only
  float* dbias;         // backward, may be null
  void* dinit;          // backward, null exactly when init is
  int64_t batch, dim, seqlen;
  int width;
  Strides3 sx, so, sg, si, sdi;  // x, out (or dx), dout, initial_states, dinitial
  int64_t sw_d, sw_k, ss_b, ss_l;
  int w_dtype, bias_dtype, init_dtype, seq_idx64, silu;
};

// One element of a tensor whose dtype is a run-time PnfDtype code.
__device__ __forceinline__ float load_code(const void* p, int code, int64_t i) {
  switch (code) {
    case PNF_FLOAT16: return __half2float(static_cast<const __half*>(p)[i]);
    case PNF_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_code(void* p, int code, int64_t i, float v) {
  switch (code) {
    case PNF_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case PNF_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// Sequence id of position t (t < 0 continues position 0's sequence; t >= seqlen, whose values are
// all zero, reads the last one); 0 without seq_idx.
__device__ __forceinline__ int64_t seq_id(const ConvParams& p, int64_t b, int64_t t) {
  if (!p.seq_idx) return 0;
  t = t < 0 ? 0 : (t < p.seqlen ? t : p.seqlen - 1);
  const int64_t off = b * p.ss_b + t * p.ss_l;
  return p.seq_idx64 ? static_cast<const int64_t*>(p.seq_idx)[off] : static_cast<const int*>(p.seq_idx)[off];
}

// x[b, d, t] for t < seqlen, t >= -(w-1) reading the initial states (zeros without them).
template <typename E>
__device__ __forceinline__ float x_at(const ConvParams& p, int64_t b, int64_t d, int64_t t) {
  if (t >= 0) return to_float(static_cast<const E*>(p.x)[b * p.sx.b + d * p.sx.d + t * p.sx.l]);
  const int64_t k = t + p.width - 1;
  if (!p.init || k < 0) return 0.f;
  return load_code(p.init, p.init_dtype, b * p.si.b + d * p.si.d + k * p.si.l);
}


// The weights as right-aligned taps (tap j multiplies x[t - 3 + j]; taps j < 4 - w are 0 and skipped).
__device__ __forceinline__ void load_taps(const ConvParams& p, int64_t d, float (&w)[kMaxWidth]) {
#pragma unroll
  for (int j = 0; j < kMaxWidth; ++j) {
    const int k = j - (kMaxWidth - p.width);
    w[j] = k >= 0 ? load_code(p.weight, p.w_dtype, d * p.sw_d + k * p.sw_k) : 0.f;
  }
}

__device__ __forceinline__ float bias_of(const ConvParams& p, int64_t d) {
  return p.bias ? load_code(p.bias, p.bias_dtype, d) : 0.f;
}

// (__fdividef: 1 / inf is 0, so large negative v gives 0 as it should)
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.f, 1.f + __expf(-v)); }

__device__ __forceinline__ float activate(const ConvParams& p, float pre) { return p.silu ? pre * sigmoid(pre) : pre; }

// d act / d pre times dout.
__device__ __forceinline__ float dactivate(const ConvParams& p, float pre, float dout) {
  if (!p.silu) return dout;
  const float s = sigmoid(pre);
  return dout * s * (1.f + pre * (1.f - s));
}

template <int BYTES>
struct RawOf;
template <>
struct RawOf<16> {
  using type = uint4;
};
template <>
struct RawOf<8> {
  using type = uint2;
};

// v[i] = row[t0 + i * step] for i < N, zeros at or past n. VECTOR: one 8- or 16-byte access (step 1,
// row + t0 aligned to it, and t0 < n implies t0 + N <= n).
template <typename E, int N, bool VECTOR>
__device__ __forceinline__ void load_n(const E* row, int64_t t0, int64_t step, int64_t n, float (&v)[N]) {
  if constexpr (VECTOR) {
    using Raw = typename RawOf<N * sizeof(E)>::type;
    if (t0 < n) {
      const Raw raw = *reinterpret_cast<const Raw*>(row + t0);
      const E* e = reinterpret_cast<const E*>(&raw);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = to_float(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = t0 + i < n ? to_float(row[(t0 + i) * step]) : 0.f;
  }
}

template <typename E, int N, bool VECTOR>
__device__ __forceinline__ void store_n(E* row, int64_t t0, int64_t step, int64_t n, const float (&v)[N]) {
  if constexpr (VECTOR) {
    using Raw = typename RawOf<N * sizeof(E)>::type;
    if (t0 >= n) return;
    Raw raw;
    E* e = reinterpret_cast<E*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_float<E>(v[i]);
    *reinterpret_cast<Raw*>(row + t0) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (t0 + i < n) row[(t0 + i) * step] = from_float<E>(v[i]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Adds the right-aligned tap sums dw[j] (j >= 4 - w) and db to dweight[d, :] and dbias[d].
__device__ __forceinline__ void flush_grads(const ConvParams& p, int64_t d, const float (&dw)[kMaxWidth], float db) {
  for (int k = 0; k < p.width; ++k) atomicAdd(p.dweight + d * p.width + k, dw[k + kMaxWidth - p.width]);
  if (p.dbias) atomicAdd(p.dbias + d, db);
}

// ---------------------------------------------------------------------------------------------
// "seq" geometry: channel-first rows, l contiguous. Block (row, chunk of kSlots vectors).

template <typename E>
constexpr int kWalkVec = 8 / sizeof(E);

template <typename E>
struct SeqShape {
  static constexpr int kVec = 16 / sizeof(E);
  static constexpr int kSlots = kSeqThreads * kSeqItems;
  static constexpr int64_t kChunk = static_cast<int64_t>(kSlots) * kVec;
};

// Loads the thread's vectors of x into v and their tails into tails[slot + 1]; thread 0 puts the
// kHalo inputs before the chunk (initial states or zeros before position 0) into tails[0]. Every
// global load is issued before the first shared store (a store to shared memory through which the
// compiler cannot move a later global load would serialise their latencies).
template <typename E, bool ALIGNED>
__device__ __forceinline__ void load_seq_x(const ConvParams& p, int64_t b, int64_t d, int64_t chunk0,
                                           float (&v)[kSeqItems][SeqShape<E>::kVec],
                                           float (*tails)[kHalo]) {
  constexpr int kVec = SeqShape<E>::kVec;
  const E* x = static_cast<const E*>(p.x) + b * p.sx.b + d * p.sx.d;
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it)
    load_n<E, kVec, ALIGNED>(x, chunk0 + (it * kSeqThreads + threadIdx.x) * kVec, 1, p.seqlen, v[it]);
  float before[kHalo];
  if (threadIdx.x == 0)
#pragma unroll
    for (int h = 0; h < kHalo; ++h) before[h] = x_at<E>(p, b, d, chunk0 - kHalo + h);
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it)
#pragma unroll
    for (int h = 0; h < kHalo; ++h) tails[it * kSeqThreads + threadIdx.x + 1][h] = v[it][kVec - kHalo + h];
  if (threadIdx.x == 0)
#pragma unroll
    for (int h = 0; h < kHalo; ++h) tails[0][h] = before[h];
}

template <typename E, bool ALIGNED>
__global__ void __launch_bounds__(kSeqThreads) conv_fwd_seq(const ConvParams p) {
  using S = SeqShape<E>;
  constexpr int kVec = S::kVec;
  __shared__ float tails[S::kSlots + 1][kHalo];
  const int64_t row = blockIdx.x, b = row / p.dim, d = row - b * p.dim;
  const int64_t chunk0 = blockIdx.y * S::kChunk;
  float w[kMaxWidth];
  load_taps(p, d, w);
  const float bias = bias_of(p, d);
  float v[kSeqItems][kVec];
  load_seq_x<E, ALIGNED>(p, b, d, chunk0, v, tails);
  const int first = kMaxWidth - p.width;
  E* out = static_cast<E*>(p.out) + b * p.so.b + d * p.so.d;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it) {
    const int slot = it * kSeqThreads + threadIdx.x;
    const int64_t t0 = chunk0 + slot * kVec;
    if (t0 >= p.seqlen) break;
    float win[kHalo + kVec];
    int64_t sid[kHalo + kVec];
#pragma unroll
    for (int i = 0; i < kHalo + kVec; ++i) {
      win[i] = i < kHalo ? tails[slot][i] : v[it][i - kHalo];
      sid[i] = seq_id(p, b, t0 - kHalo + i);
    }
    float o[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float acc = bias;
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j)
        if (j >= first && sid[i + j] == sid[i + kHalo]) acc = fmaf(w[j], win[i + j], acc);
      o[i] = activate(p, acc);
    }
    store_n<E, kVec, ALIGNED>(out, t0, 1, p.seqlen, o);
  }
}

template <typename E, bool ALIGNED>
__global__ void __launch_bounds__(kSeqThreads) conv_bwd_seq(const ConvParams p) {
  using S = SeqShape<E>;
  constexpr int kVec = S::kVec;
  __shared__ float tails[S::kSlots + 1][kHalo];  // x: [0] before the chunk, [s + 1] the tail of vector s
  __shared__ float heads[S::kSlots + 1][kHalo];  // dpre: [s] the head of vector s, [kSlots] after the chunk
  __shared__ float partial[kSeqThreads / 32][kMaxWidth + 1];
  const int64_t row = blockIdx.x, b = row / p.dim, d = row - b * p.dim;
  const int64_t chunk0 = blockIdx.y * S::kChunk;
  float w[kMaxWidth];
  load_taps(p, d, w);
  const float bias = bias_of(p, d);
  const int first = kMaxWidth - p.width;
  float v[kSeqItems][kVec], g[kSeqItems][kVec];
  const E* dout = static_cast<const E*>(p.dout) + b * p.sg.b + d * p.sg.d;
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it)
    load_n<E, kVec, ALIGNED>(dout, chunk0 + (it * kSeqThreads + threadIdx.x) * kVec, 1, p.seqlen, g[it]);
  // the last thread also takes the vector after the chunk (x and dout): the dpre look-ahead of dx
  const bool last = threadIdx.x == kSeqThreads - 1;
  const int64_t chunk_end = chunk0 + S::kChunk;
  float x_next[kVec], g_next[kVec];
  if (last) {
    load_n<E, kVec, ALIGNED>(static_cast<const E*>(p.x) + b * p.sx.b + d * p.sx.d, chunk_end, 1, p.seqlen, x_next);
    load_n<E, kVec, ALIGNED>(dout, chunk_end, 1, p.seqlen, g_next);
  }
  load_seq_x<E, ALIGNED>(p, b, d, chunk0, v, tails);
  if (last) {  // dpre at the kHalo positions after the chunk (0 past seqlen, where dout reads 0); the
               // window before them is the tail of this thread's last vector
    float win[kHalo + kHalo];
    int64_t sid[kHalo + kHalo];
#pragma unroll
    for (int i = 0; i < kHalo + kHalo; ++i) {
      win[i] = i < kHalo ? v[kSeqItems - 1][kVec - kHalo + i] : x_next[i - kHalo];
      sid[i] = seq_id(p, b, chunk_end - kHalo + i);
    }
#pragma unroll
    for (int h = 0; h < kHalo; ++h) {
      float acc = bias;
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j)
        if (j >= first && sid[h + j] == sid[h + kHalo]) acc = fmaf(w[j], win[h + j], acc);
      heads[S::kSlots][h] = dactivate(p, acc, g_next[h]);
    }
  }
  __syncthreads();

  float dw[kMaxWidth] = {0.f, 0.f, 0.f, 0.f}, db = 0.f;
  float dp[kSeqItems][kVec];
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it) {
    const int slot = it * kSeqThreads + threadIdx.x;
    const int64_t t0 = chunk0 + slot * kVec;
    float win[kHalo + kVec];
    int64_t sid[kHalo + kVec];
#pragma unroll
    for (int i = 0; i < kHalo + kVec; ++i) {
      win[i] = i < kHalo ? tails[slot][i] : v[it][i - kHalo];
      sid[i] = seq_id(p, b, t0 - kHalo + i);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float acc = bias;
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j)
        if (j >= first && sid[i + j] == sid[i + kHalo]) acc = fmaf(w[j], win[i + j], acc);
      dp[it][i] = dactivate(p, acc, g[it][i]);  // 0 past seqlen, where dout reads 0
      db += dp[it][i];
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j)
        if (j >= first && sid[i + j] == sid[i + kHalo]) dw[j] = fmaf(dp[it][i], win[i + j], dw[j]);
    }
#pragma unroll
    for (int h = 0; h < kHalo; ++h) heads[slot][h] = dp[it][h];
  }
  __syncthreads();

  // dx[t] = sum_s w[3 - s] dpre[t + s] over the live taps of t's sequence
  E* dx = static_cast<E*>(p.out) + b * p.so.b + d * p.so.d;
#pragma unroll
  for (int it = 0; it < kSeqItems; ++it) {
    const int slot = it * kSeqThreads + threadIdx.x;
    const int64_t t0 = chunk0 + slot * kVec;
    if (t0 >= p.seqlen) break;
    float ahead[kVec + kHalo];
    int64_t sid[kVec + kHalo];
#pragma unroll
    for (int i = 0; i < kVec + kHalo; ++i) {
      ahead[i] = i < kVec ? dp[it][i] : heads[slot + 1][i - kVec];
      sid[i] = seq_id(p, b, t0 + i);
    }
    float o[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int s = 0; s < kMaxWidth; ++s)
        if (kMaxWidth - 1 - s >= first && sid[i + s] == sid[i]) acc = fmaf(w[kMaxWidth - 1 - s], ahead[i + s], acc);
      o[i] = acc;
    }
    store_n<E, kVec, ALIGNED>(dx, t0, 1, p.seqlen, o);
  }
  if (p.dinit && blockIdx.y == 0 && threadIdx.x == 0) {  // positions -(w-1) .. -1: heads[0] = dpre[0 .. 2]
    const int64_t sid0 = seq_id(p, b, 0);
    for (int q = 1 - p.width; q < 0; ++q) {
      float acc = 0.f;
      for (int s = -q; s < kMaxWidth; ++s)
        if (kMaxWidth - 1 - s >= first && seq_id(p, b, q + s) == sid0)
          acc = fmaf(w[kMaxWidth - 1 - s], heads[0][q + s], acc);
      store_code(p.dinit, p.init_dtype, b * p.sdi.b + d * p.sdi.d + (q + p.width - 1) * p.sdi.l, acc);
    }
  }

  // dweight, dbias: warp sums, then the block's
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < kMaxWidth; ++j) dw[j] = warp_sum(dw[j]);
  db = warp_sum(db);
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kMaxWidth; ++j) partial[warp][j] = dw[j];
    partial[warp][kMaxWidth] = db;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < kSeqThreads / 32; ++k) {
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j) dw[j] += partial[k][j];
      db += partial[k][kMaxWidth];
    }
    flush_grads(p, d, dw, db);
  }
}

// ---------------------------------------------------------------------------------------------
// "walk" geometry: any strides. Thread (x, y) of block (bx, by, batch) owns channels
// [(bx * kWalkX + x) * VEC, + VEC) and the run of positions (by * kWalkY + y) * RUN .. + RUN.
// VEC > 1 needs d contiguous and 8-byte aligned channel groups (8 bytes, not 16: a thread keeps
// VEC x (weights, window, gradient sums) in registers).

template <typename E, int VEC>
__device__ __forceinline__ void load_channels(const E* base, int64_t step_d, float (&v)[VEC]) {
  load_n<E, VEC, (VEC > 1)>(base, 0, step_d, VEC, v);
}

template <typename E, int VEC>
__global__ void __launch_bounds__(kWalkX * kWalkY) conv_fwd_walk(const ConvParams p) {
  const int64_t d0 = (static_cast<int64_t>(blockIdx.x) * kWalkX + threadIdx.x) * VEC;
  const int64_t b = blockIdx.z;
  const int64_t t_begin = (static_cast<int64_t>(blockIdx.y) * kWalkY + threadIdx.y) * kWalkRunFwd;
  if (d0 >= p.dim || t_begin >= p.seqlen) return;
  const int64_t t_end = t_begin + kWalkRunFwd < p.seqlen ? t_begin + kWalkRunFwd : p.seqlen;
  const int first = kMaxWidth - p.width;
  float w[VEC][kMaxWidth], bias[VEC];
  float win[kMaxWidth][VEC];  // x at t - 3 .. t
  int64_t sid[kMaxWidth];
#pragma unroll
  for (int c = 0; c < VEC; ++c) {
    load_taps(p, d0 + c, w[c]);
    bias[c] = bias_of(p, d0 + c);
#pragma unroll
    for (int h = 0; h < kHalo; ++h) win[h][c] = x_at<E>(p, b, d0 + c, t_begin - kHalo + h);
  }
#pragma unroll
  for (int h = 0; h < kHalo; ++h) sid[h] = seq_id(p, b, t_begin - kHalo + h);
  const E* x = static_cast<const E*>(p.x) + b * p.sx.b + d0 * p.sx.d;
  E* out = static_cast<E*>(p.out) + b * p.so.b + d0 * p.so.d;
  for (int64_t tb = t_begin; tb < t_end; tb += kWalkBatch) {
    float xs[kWalkBatch][VEC];
#pragma unroll
    for (int u = 0; u < kWalkBatch; ++u) {
      if (tb + u < t_end) {
        load_channels<E, VEC>(x + (tb + u) * p.sx.l, p.sx.d, xs[u]);
      } else {
#pragma unroll
        for (int c = 0; c < VEC; ++c) xs[u][c] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kWalkBatch; ++u) {
      if (tb + u >= t_end) break;
      sid[kHalo] = seq_id(p, b, tb + u);
      float o[VEC];
#pragma unroll
      for (int c = 0; c < VEC; ++c) {
        win[kHalo][c] = xs[u][c];
        float acc = bias[c];
#pragma unroll
        for (int j = 0; j < kMaxWidth; ++j)
          if (j >= first && sid[j] == sid[kHalo]) acc = fmaf(w[c][j], win[j][c], acc);
        o[c] = activate(p, acc);
      }
      store_n<E, VEC, (VEC > 1)>(out + (tb + u) * p.so.l, 0, p.so.d, VEC, o);
#pragma unroll
      for (int j = 0; j < kHalo; ++j) {
        sid[j] = sid[j + 1];
#pragma unroll
        for (int c = 0; c < VEC; ++c) win[j][c] = win[j + 1][c];
      }
    }
  }
}

template <typename E, int VEC>
__global__ void __launch_bounds__(kWalkX * kWalkY) conv_bwd_walk(const ConvParams p) {
  __shared__ float partial[kWalkY][kWalkX][VEC][kMaxWidth + 1];
  const int64_t d0 = (static_cast<int64_t>(blockIdx.x) * kWalkX + threadIdx.x) * VEC;
  const int64_t b = blockIdx.z;
  const int64_t t_begin = (static_cast<int64_t>(blockIdx.y) * kWalkY + threadIdx.y) * kWalkRunBwd;
  const bool active = d0 < p.dim && t_begin < p.seqlen;  // (every thread reaches the block reduction)
  const int64_t q_end = t_begin + kWalkRunBwd < p.seqlen ? t_begin + kWalkRunBwd : p.seqlen;
  const int first = kMaxWidth - p.width;
  float w[VEC][kMaxWidth], bias[VEC], dw[VEC][kMaxWidth], db[VEC];
  float xw[kMaxWidth][VEC], dpw[kMaxWidth][VEC];  // x and dpre at t - 3 .. t
  int64_t sid[kMaxWidth];
#pragma unroll
  for (int c = 0; c < VEC; ++c) {
    db[c] = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxWidth; ++j) dw[c][j] = dpw[j][c] = 0.f;
  }
  if (active) {
#pragma unroll
    for (int c = 0; c < VEC; ++c) {
      load_taps(p, d0 + c, w[c]);
      bias[c] = bias_of(p, d0 + c);
#pragma unroll
      for (int h = 0; h < kHalo; ++h) xw[h][c] = x_at<E>(p, b, d0 + c, t_begin - kHalo + h);
    }
#pragma unroll
    for (int h = 0; h < kHalo; ++h) sid[h] = seq_id(p, b, t_begin - kHalo + h);
    const E* x = static_cast<const E*>(p.x) + b * p.sx.b + d0 * p.sx.d;
    const E* dout = static_cast<const E*>(p.dout) + b * p.sg.b + d0 * p.sg.d;
    E* dx = static_cast<E*>(p.out) + b * p.so.b + d0 * p.so.d;
    const bool owns_init = p.dinit && t_begin == 0;
    // step t computes dpre[t] and emits dx[t - 3] (or, before position 0, the initial states' gradient)
    const int64_t t_stop = q_end + kHalo;
    const int64_t t_load = t_stop < p.seqlen ? t_stop : p.seqlen;
    for (int64_t tb = t_begin; tb < t_stop; tb += kWalkBatch) {
      float xs[kWalkBatch][VEC], gs[kWalkBatch][VEC];
#pragma unroll
      for (int u = 0; u < kWalkBatch; ++u) {
        if (tb + u < t_load) {
          load_channels<E, VEC>(x + (tb + u) * p.sx.l, p.sx.d, xs[u]);
          load_channels<E, VEC>(dout + (tb + u) * p.sg.l, p.sg.d, gs[u]);
        } else {
#pragma unroll
          for (int c = 0; c < VEC; ++c) xs[u][c] = gs[u][c] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kWalkBatch; ++u) {
        const int64_t t = tb + u;
        if (t >= t_stop) break;
        sid[kHalo] = seq_id(p, b, t);
        const bool own_t = t < q_end;  // dweight/dbias count the run's own positions only
        const int64_t q = t - kHalo;
        float o[VEC];
#pragma unroll
        for (int c = 0; c < VEC; ++c) {
          xw[kHalo][c] = xs[u][c];
          float acc = bias[c];
#pragma unroll
          for (int j = 0; j < kMaxWidth; ++j)
            if (j >= first && sid[j] == sid[kHalo]) acc = fmaf(w[c][j], xw[j][c], acc);
          const float dpre = dactivate(p, acc, gs[u][c]);  // 0 past seqlen
          dpw[kHalo][c] = dpre;
          if (own_t) {
            db[c] += dpre;
#pragma unroll
            for (int j = 0; j < kMaxWidth; ++j)
              if (j >= first && sid[j] == sid[kHalo]) dw[c][j] = fmaf(dpre, xw[j][c], dw[c][j]);
          }
          float g = 0.f;  // dx[q] = sum_s w[3 - s] dpre[q + s]; sid[s] is the id of q + s
#pragma unroll
          for (int s = 0; s < kMaxWidth; ++s)
            if (kMaxWidth - 1 - s >= first && sid[s] == sid[0]) g = fmaf(w[c][kMaxWidth - 1 - s], dpw[s][c], g);
          o[c] = g;
        }
        if (q >= t_begin) {
          store_n<E, VEC, (VEC > 1)>(dx + q * p.so.l, 0, p.so.d, VEC, o);
        } else if (owns_init && q >= 1 - p.width) {
#pragma unroll
          for (int c = 0; c < VEC; ++c)
            store_code(p.dinit, p.init_dtype, b * p.sdi.b + (d0 + c) * p.sdi.d + (q + p.width - 1) * p.sdi.l, o[c]);
        }
#pragma unroll
        for (int j = 0; j < kHalo; ++j) {
          sid[j] = sid[j + 1];
#pragma unroll
          for (int c = 0; c < VEC; ++c) {
            xw[j][c] = xw[j + 1][c];
            dpw[j][c] = dpw[j + 1][c];
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < VEC; ++c) {
#pragma unroll
    for (int j = 0; j < kMaxWidth; ++j) partial[threadIdx.y][threadIdx.x][c][j] = dw[c][j];
    partial[threadIdx.y][threadIdx.x][c][kMaxWidth] = db[c];
  }
  __syncthreads();
  if (threadIdx.y != 0 || d0 >= p.dim) return;
#pragma unroll
  for (int c = 0; c < VEC; ++c) {
    for (int y = 1; y < kWalkY; ++y) {
#pragma unroll
      for (int j = 0; j < kMaxWidth; ++j) dw[c][j] += partial[y][threadIdx.x][c][j];
      db[c] += partial[y][threadIdx.x][c][kMaxWidth];
    }
    flush_grads(p, d0 + c, dw[c], db[c]);
  }
}

// ---------------------------------------------------------------------------------------------
// host side

bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The strides' geometry: seq (every l stride 1), walk with 8-byte channel groups, or walk scalar.
struct Geometry {
  bool seq, vector;
};

Geometry choose(const ConvParams& p, bool backward, int seq_vec, int walk_vec) {
  const Strides3* ts[3] = {&p.sx, &p.so, &p.sg};
  const void* ptrs[3] = {p.x, p.out, p.dout};
  const int n = backward ? 3 : 2;
  bool l_unit = true, d_unit = true, seq_aligned = p.seqlen % seq_vec == 0, walk_aligned = p.dim % walk_vec == 0;
  for (int i = 0; i < n; ++i) {
    const Strides3& s = *ts[i];
    l_unit &= s.l == 1 || p.seqlen == 1;
    d_unit &= s.d == 1 || p.dim == 1;
    seq_aligned &= aligned(ptrs[i], 16) && s.b % seq_vec == 0 && s.d % seq_vec == 0;
    walk_aligned &= aligned(ptrs[i], 8) && s.b % walk_vec == 0 && s.l % walk_vec == 0;
  }
  if (l_unit) return {true, seq_aligned};
  return {false, d_unit && walk_aligned};
}

template <typename E>
int launch(const ConvParams& p, bool backward, cudaStream_t stream) {
  using S = SeqShape<E>;
  const Geometry g = choose(p, backward, S::kVec, kWalkVec<E>);
  if (g.seq) {
    const int64_t rows = p.batch * p.dim, chunks = (p.seqlen + S::kChunk - 1) / S::kChunk;
    if (rows > 0x7fffffff || chunks > 65535) return PNF_ERR_UNSUPPORTED;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
    if (backward) {
      if (g.vector) conv_bwd_seq<E, true><<<grid, kSeqThreads, 0, stream>>>(p);
      else conv_bwd_seq<E, false><<<grid, kSeqThreads, 0, stream>>>(p);
    } else {
      if (g.vector) conv_fwd_seq<E, true><<<grid, kSeqThreads, 0, stream>>>(p);
      else conv_fwd_seq<E, false><<<grid, kSeqThreads, 0, stream>>>(p);
    }
    return pnf_check_launch();
  }
  const int vec = g.vector ? kWalkVec<E> : 1;
  const int64_t groups = (p.dim / vec + kWalkX - 1) / kWalkX;
  const int64_t span = static_cast<int64_t>(kWalkY) * (backward ? kWalkRunBwd : kWalkRunFwd);
  const int64_t runs = (p.seqlen + span - 1) / span;
  if (groups > 0x7fffffff || runs > 65535 || p.batch > 65535) return PNF_ERR_UNSUPPORTED;
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(runs), static_cast<unsigned>(p.batch));
  const dim3 block(kWalkX, kWalkY);
  if (backward) {
    if (g.vector) conv_bwd_walk<E, kWalkVec<E>><<<grid, block, 0, stream>>>(p);
    else conv_bwd_walk<E, 1><<<grid, block, 0, stream>>>(p);
  } else {
    if (g.vector) conv_fwd_walk<E, kWalkVec<E>><<<grid, block, 0, stream>>>(p);
    else conv_fwd_walk<E, 1><<<grid, block, 0, stream>>>(p);
  }
  return pnf_check_launch();
}

// ---------------------------------------------------------------------------------------------
// Decoding: one thread per (batch, channel) walks the new tokens with the window in registers, then
// rewrites its channel's state (every dtype a run-time code: the kernel is latency-bound).
//   x, out [b, d, s]; conv_state [b, d, state_len >= w-1]; cache_seqlens [b] (ring buffer) or null.

struct UpdateParams {
  ConvParams conv;  // weight, bias, width, their strides and dtypes, silu
  const void* x;
  void* state;
  const void* cache_seqlens;
  void* out;
  int64_t batch, dim, steps, state_len;
  Strides3 sx, sst, so;
  int x_dtype, state_dtype, seqlens64;
};

__global__ void conv_update(const UpdateParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.batch * p.dim) return;
  const int64_t b = i / p.dim, d = i - b * p.dim;
  const int64_t x0 = b * p.sx.b + d * p.sx.d, st0 = b * p.sst.b + d * p.sst.d, o0 = b * p.so.b + d * p.so.d;
  int64_t start = 0;  // ring slot of the first new token
  if (p.cache_seqlens) {
    const int64_t n = p.seqlens64 ? static_cast<const int64_t*>(p.cache_seqlens)[b]
                                  : static_cast<const int*>(p.cache_seqlens)[b];
    start = ((n % p.state_len) + p.state_len) % p.state_len;
  }
  // state slot of the input q tokens before the first new one (q >= 1)
  auto slot_before = [&](int64_t q) {
    return p.cache_seqlens ? ((start - q) % p.state_len + p.state_len) % p.state_len : p.state_len - q;
  };
  float w[kMaxWidth];
  load_taps(p.conv, d, w);
  const float bias = bias_of(p.conv, d);
  const int first = kMaxWidth - p.conv.width;
  float win[kMaxWidth] = {0.f, 0.f, 0.f, 0.f};  // inputs at t - 3 .. t
  for (int h = first; h < kHalo; ++h)
    win[h] = load_code(p.state, p.state_dtype, st0 + slot_before(kHalo - h) * p.sst.l);
  for (int64_t t = 0; t < p.steps; ++t) {
    win[kHalo] = load_code(p.x, p.x_dtype, x0 + t * p.sx.l);
    float acc = bias;
#pragma unroll
    for (int j = 0; j < kMaxWidth; ++j)
      if (j >= first) acc = fmaf(w[j], win[j], acc);
    store_code(p.out, p.x_dtype, o0 + t * p.so.l, activate(p.conv, acc));
#pragma unroll
    for (int j = 0; j < kHalo; ++j) win[j] = win[j + 1];
  }
  if (p.cache_seqlens) {  // the last min(steps, state_len) tokens go to their ring slots
    for (int64_t t = p.steps > p.state_len ? p.steps - p.state_len : 0; t < p.steps; ++t)
      store_code(p.state, p.state_dtype, st0 + ((start + t) % p.state_len) * p.sst.l,
                 load_code(p.x, p.x_dtype, x0 + t * p.sx.l));
  } else {  // new_state[j] = concat(state, x)[j + steps]; ascending j only reads slots not yet written
    for (int64_t j = 0; j < p.state_len; ++j) {
      const int64_t src = j + p.steps;
      const float v = src < p.state_len ? load_code(p.state, p.state_dtype, st0 + src * p.sst.l)
                                        : load_code(p.x, p.x_dtype, x0 + (src - p.state_len) * p.sx.l);
      store_code(p.state, p.state_dtype, st0 + j * p.sst.l, v);
    }
  }
}

bool valid_dtype(int code) { return code == PNF_FLOAT32 || code == PNF_FLOAT16 || code == PNF_BFLOAT16; }

// strides: x[3], out (or dx)[3], weight[2], seq_idx[2], initial_states[3], dout[3], dinitial[3].
int run(ConvParams& p, const int64_t* strides, int x_dtype, bool backward, cudaStream_t stream) {
  if (p.batch < 0 || p.dim < 0 || p.seqlen < 0 || !strides || !valid_dtype(x_dtype) || !valid_dtype(p.w_dtype) ||
      (p.bias && !valid_dtype(p.bias_dtype)) || (p.init && !valid_dtype(p.init_dtype)))
    return PNF_ERR_INVALID_ARGUMENT;
  if (p.width < 2 || p.width > kMaxWidth) return PNF_ERR_UNSUPPORTED;
  if (p.batch == 0 || p.dim == 0 || p.seqlen == 0) return PNF_OK;
  if (!p.x || !p.weight || !p.out || (backward && (!p.dout || !p.dweight || (!p.init) != (!p.dinit))))
    return PNF_ERR_INVALID_ARGUMENT;
  p.sx = {strides[0], strides[1], strides[2]};
  p.so = {strides[3], strides[4], strides[5]};
  p.sw_d = strides[6];
  p.sw_k = strides[7];
  p.ss_b = strides[8];
  p.ss_l = strides[9];
  p.si = {strides[10], strides[11], strides[12]};
  p.sg = {strides[13], strides[14], strides[15]};
  p.sdi = {strides[16], strides[17], strides[18]};
  switch (x_dtype) {
    case PNF_FLOAT16: return launch<__half>(p, backward, stream);
    case PNF_BFLOAT16: return launch<__nv_bfloat16>(p, backward, stream);
    default: return launch<float>(p, backward, stream);
  }
}

}  // namespace

// out = act(causal depthwise conv of x); see the top of this file for shapes and strides.
PNF_EXPORT int pnf_causal_conv1d_fwd(const void* x, const void* weight, const void* bias, const void* seq_idx,
                                     const void* initial_states, void* out, int64_t batch, int64_t dim,
                                     int64_t seqlen, int width, const int64_t* strides, int x_dtype, int w_dtype,
                                     int bias_dtype, int init_dtype, int seq_idx_int64, int silu, void* stream) {
  ConvParams p{};
  p.x = x;
  p.weight = weight;
  p.bias = bias;
  p.seq_idx = seq_idx;
  p.init = initial_states;
  p.out = out;
  p.batch = batch;
  p.dim = dim;
  p.seqlen = seqlen;
  p.width = width;
  p.w_dtype = w_dtype;
  p.bias_dtype = bias_dtype;
  p.init_dtype = init_dtype;
  p.seq_idx64 = seq_idx_int64;
  p.silu = silu;
  return run(p, strides, x_dtype, false, static_cast<cudaStream_t>(stream));
}

// Gradients: dx and dinitial (when initial_states is given) written; dweight [dim, width] and dbias
// [dim] (fp32, contiguous) accumulated.
PNF_EXPORT int pnf_causal_conv1d_bwd(const void* x, const void* weight, const void* bias, const void* seq_idx,
                                     const void* initial_states, const void* dout, void* dx, float* dweight,
                                     float* dbias, void* dinitial, int64_t batch, int64_t dim, int64_t seqlen,
                                     int width, const int64_t* strides, int x_dtype, int w_dtype, int bias_dtype,
                                     int init_dtype, int seq_idx_int64, int silu, void* stream) {
  ConvParams p{};
  p.x = x;
  p.weight = weight;
  p.bias = bias;
  p.seq_idx = seq_idx;
  p.init = initial_states;
  p.dout = dout;
  p.out = dx;
  p.dweight = dweight;
  p.dbias = bias ? dbias : nullptr;
  p.dinit = dinitial;
  p.batch = batch;
  p.dim = dim;
  p.seqlen = seqlen;
  p.width = width;
  p.w_dtype = w_dtype;
  p.bias_dtype = bias_dtype;
  p.init_dtype = init_dtype;
  p.seq_idx64 = seq_idx_int64;
  p.silu = silu;
  return run(p, strides, x_dtype, true, static_cast<cudaStream_t>(stream));
}

// Decoding step(s): out [b, d, steps] from x [b, d, steps] and conv_state [b, d, state_len], which is
// updated in place (shifted, or the ring buffer at cache_seqlens [b] when non-null).
// strides: x[3], conv_state[3], weight[2], out[3].
PNF_EXPORT int pnf_causal_conv1d_update(const void* x, void* conv_state, const void* weight, const void* bias,
                                        const void* cache_seqlens, void* out, int64_t batch, int64_t dim,
                                        int64_t steps, int64_t state_len, int width, const int64_t* strides,
                                        int x_dtype, int state_dtype, int w_dtype, int bias_dtype,
                                        int seqlens_int64, int silu, void* stream) {
  if (batch < 0 || dim < 0 || steps < 0 || !strides || !valid_dtype(x_dtype) || !valid_dtype(state_dtype) ||
      !valid_dtype(w_dtype) || (bias && !valid_dtype(bias_dtype)) || state_len < width - 1 || state_len < 1)
    return PNF_ERR_INVALID_ARGUMENT;
  if (width < 2 || width > kMaxWidth) return PNF_ERR_UNSUPPORTED;
  if (batch == 0 || dim == 0 || steps == 0) return PNF_OK;
  if (!x || !conv_state || !weight || !out) return PNF_ERR_INVALID_ARGUMENT;
  UpdateParams p{};
  p.conv.weight = weight;
  p.conv.bias = bias;
  p.conv.width = width;
  p.conv.sw_d = strides[6];
  p.conv.sw_k = strides[7];
  p.conv.w_dtype = w_dtype;
  p.conv.bias_dtype = bias_dtype;
  p.conv.silu = silu;
  p.x = x;
  p.state = conv_state;
  p.cache_seqlens = cache_seqlens;
  p.out = out;
  p.batch = batch;
  p.dim = dim;
  p.steps = steps;
  p.state_len = state_len;
  p.sx = {strides[0], strides[1], strides[2]};
  p.sst = {strides[3], strides[4], strides[5]};
  p.so = {strides[8], strides[9], strides[10]};
  p.x_dtype = x_dtype;
  p.state_dtype = state_dtype;
  p.seqlens64 = seqlens_int64;
  constexpr int kThreads = 128;
  const int64_t blocks = (batch * dim + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return PNF_ERR_UNSUPPORTED;
  conv_update<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return pnf_check_launch();
}
