// Mamba-1 selective scan, forward and backward (the Triton twin is
// paddlenlp_fused/kernels/triton/selective_scan.py).
//
// Shapes (b batch, d dim, n dstate, l seqlen, g groups; 64-bit offsets, any strides):
//   u, delta, z, out, dout, du, ddelta, dz, out_z   [b, d, l]   dtype T (template: fp32, fp16, bf16)
//   A                                              [d, n]      real (any float dtype) or complex64
//   B, C                                           [d, n] (fixed) or [b, g, n, l] (input-dependent;
//                                                  a [b, n, l] tensor is g = 1); any float dtype
//   D, delta_bias                                  [d]         any float dtype
//   states                                         [b, d, n_seg, n] fp32: the state at the end of each
//                                                  kSegment-step segment (the backward's restart points)
//   last_state                                     [b, d, n]   any float dtype
//   dA [d, n], dB/dC shaped like B/C, dD, ddelta_bias [d]: fp32, accumulated (+=, caller zeroes)
//
// Recurrence per (b, d, n), fp32: dt_t = softplus(delta_t + delta_bias) (softplus optional, threshold
// 20), h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t, y_t = sum_n C_t h_t + D u_t, out_t = y_t silu(z_t).
//
// Complex A (template kComplex; mamba_ssm's convention): A, fixed B/C, states, last_state, dA and fixed
// dB/dC are complex64, i.e. (re, im) float pairs (the host passes their strides in floats);
// input-dependent B/C (and dB/dC) are real [b, g, n, 2 l] holding (re, im) pairs along the last axis;
// h is complex and y_t = 2 Re(sum_n C_t h_t) + D u_t. Gradients of complex tensors are
// dL/dre + i dL/dim (Paddle's and torch's convention): dh_t = 2 dy_t conj(C_t) + conj(exp(dt_{t+1} A))
// dh_{t+1}, dA = sum_t dt_t dh_t conj(exp(dt_t A) h_{t-1}), dB_t = dt_t u_t dh_t, dC_t = 2 dy_t conj(h_t),
// and a real input x gets Re(conj(dh_t) dh_t/dx). One kernel body serves both: the arithmetic on
// states goes through the overloads below (float or cfloat).
//
// One warp owns one (batch, dim) row and walks seqlen in chunks of 32 * ITEMS steps: lane j holds
// steps [j * ITEMS, (j + 1) * ITEMS) of the chunk in registers (vector loads when aligned). For each
// state n the lane composes its steps' (decay, input) pairs, a warp shuffle scan gives every lane the
// state entering its steps, and the carry between chunks (per state) sits in shared memory. A block
// holds a few warps (consecutive dims of one group); the scans need no block barrier.
// Backward: chunks of kSegment steps in reverse. Per state, the chunk's states are recomputed from the
// saved segment-start state (forward shuffle scan), then the adjoint w_t = conj(exp(dt_t A)) g_t,
// g_t = dL/dh_t = (C_t dy_t, or 2 dy_t conj(C_t)) + w_{t+1}, runs as a reverse shuffle scan carrying w
// between chunks. Input-dependent dB/dC are summed over the block's warps (dims of one group) in shared
// memory and added to global memory with coalesced fp32 atomics; dA, fixed dB/dC, dD and ddelta_bias
// take warp sums and atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>
#include <utility>

#include "pnf.h"
#include "pnf_convert.cuh"

namespace {

// Launch choices from sweeps at the benchmark shape (timings: benchmarks/NOTES.md).
constexpr int kBwdItems = 8;                  // steps a backward lane holds (more tiles stay alive)
constexpr int kSegment = 32 * kBwdItems;      // backward chunk = the forward's state interval
constexpr int kMaxWarps = 8;
constexpr int kFwdWarps = 4, kBwdWarps = 8;   // default block sizes
constexpr int kMaxDstate = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// What changes with complex A: floats a state value (kComps), steps a forward lane holds (a complex
// state doubles the per-step tiles, so 8 rather than 16 keep the forward out of local memory), the
// most warps a backward block takes (its dB/dC staging buffer holds twice the floats a step), and the
// backward's register cap (kBwdMinBlocks blocks of kBwdMaxWarps a multiprocessor: real 2 x 8 warps, 128
// registers; complex 3 x 4 warps, 168 registers and about 50 bytes of spills, where 2 x 4 took 241).
template <bool kComplex>
struct Plan {
  static constexpr int kComps = kComplex ? 2 : 1;
  static constexpr int kFwdItems = kComplex ? 8 : 16;
  static constexpr int kBwdMaxWarps = kComplex ? kMaxWarps / 2 : kMaxWarps;
  static constexpr int kBwdMinBlocks = kComplex ? 3 : 2;
  static_assert(kSegment % kFwdItems == 0, "a forward lane's steps must not straddle a state interval");
};

// Steps [t0, t0 + K) of a row as floats (0 at or past seqlen). VEC: the row is contiguous along l and
// 16-byte aligned at t0, so whole steps load as 16-byte vectors.
template <typename E, int K>
__device__ __forceinline__ void load_steps(const E* row, int64_t t0, int64_t seqlen, int64_t stride, bool vec,
                                           float (&v)[K]) {
  static_assert((K * sizeof(E)) % 16 == 0, "steps of a lane must fill 16-byte vectors");
  if (vec && t0 + K <= seqlen) {
    uint4 raw[K * sizeof(E) / 16];
#pragma unroll
    for (int j = 0; j < K * static_cast<int>(sizeof(E)) / 16; ++j) raw[j] = reinterpret_cast<const uint4*>(row + t0)[j];
    const E* e = reinterpret_cast<const E*>(raw);
#pragma unroll
    for (int i = 0; i < K; ++i) v[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) v[i] = t0 + i < seqlen ? to_float(row[(t0 + i) * stride]) : 0.f;
  }
}

template <typename E, int K>
__device__ __forceinline__ void store_steps(E* row, int64_t t0, int64_t seqlen, int64_t stride, bool vec,
                                            const float (&v)[K]) {
  if (vec && t0 + K <= seqlen) {
    uint4 raw[K * sizeof(E) / 16];
    E* e = reinterpret_cast<E*>(raw);
#pragma unroll
    for (int i = 0; i < K; ++i) e[i] = from_float<E>(v[i]);
#pragma unroll
    for (int j = 0; j < K * static_cast<int>(sizeof(E)) / 16; ++j) reinterpret_cast<uint4*>(row + t0)[j] = raw[j];
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i)
      if (t0 + i < seqlen) row[(t0 + i) * stride] = from_float<E>(v[i]);
  }
}

// The same for a tensor whose dtype is a run-time PnfDtype code (a uniform branch).
template <int K>
__device__ __forceinline__ void load_steps_any(const void* row, int dtype, int64_t t0, int64_t seqlen,
                                               int64_t stride, bool vec, float (&v)[K]) {
  switch (dtype) {
    case PNF_FLOAT16: load_steps<__half, K>(static_cast<const __half*>(row), t0, seqlen, stride, vec, v); break;
    case PNF_BFLOAT16:
      load_steps<__nv_bfloat16, K>(static_cast<const __nv_bfloat16*>(row), t0, seqlen, stride, vec, v);
      break;
    default: load_steps<float, K>(static_cast<const float*>(row), t0, seqlen, stride, vec, v);
  }
}

__device__ __forceinline__ float load_one(const void* p, int dtype, int64_t offset) {
  switch (dtype) {
    case PNF_FLOAT16: return __half2float(static_cast<const __half*>(p)[offset]);
    case PNF_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[offset]);
    default: return static_cast<const float*>(p)[offset];
  }
}

__device__ __forceinline__ void store_one(void* p, int dtype, int64_t offset, float v) {
  switch (dtype) {
    case PNF_FLOAT16: static_cast<__half*>(p)[offset] = __float2half_rn(v); break;
    case PNF_BFLOAT16: static_cast<__nv_bfloat16*>(p)[offset] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[offset] = v;
  }
}

__device__ __forceinline__ const void* at(const void* base, int dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * (dtype == PNF_FLOAT32 ? 4 : 2);
}

__device__ __forceinline__ float softplus(float x) { return x <= 20.f ? log1pf(expf(x)) : x; }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// ---------------------------------------------------------------------------------------------
// State arithmetic on float (real A) or cfloat (complex A): the kernels are written once over these.

struct cfloat {
  float re, im;
};

template <bool kComplex>
struct StateOf {
  using type = float;
};
template <>
struct StateOf<true> {
  using type = cfloat;
};

template <typename S>
__device__ __forceinline__ S one();
template <>
__device__ __forceinline__ float one<float>() { return 1.f; }
template <>
__device__ __forceinline__ cfloat one<cfloat>() { return {1.f, 0.f}; }

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ cfloat add(cfloat a, cfloat b) { return {a.re + b.re, a.im + b.im}; }
__device__ __forceinline__ float mul(float a, float b) { return a * b; }
__device__ __forceinline__ cfloat mul(cfloat a, cfloat b) {
  return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
}
template <typename S>
__device__ __forceinline__ S mul_add(S a, S b, S c) { return add(mul(a, b), c); }
__device__ __forceinline__ float scale(float s, float x) { return s * x; }
__device__ __forceinline__ cfloat scale(float s, cfloat x) { return {s * x.re, s * x.im}; }
__device__ __forceinline__ float conjugate(float x) { return x; }
__device__ __forceinline__ cfloat conjugate(cfloat x) { return {x.re, -x.im}; }
// Re(conj(g) x): what a real input contributes to a real loss along x, given the gradient g of x
__device__ __forceinline__ float re_dot(float g, float x) { return g * x; }
__device__ __forceinline__ float re_dot(cfloat g, cfloat x) { return g.re * x.re + g.im * x.im; }
// A state's term of y (C h; complex: 2 Re(C h)) and its gradient with respect to h (or C) given dy
__device__ __forceinline__ float out_term(float c, float h) { return c * h; }
__device__ __forceinline__ float out_term(cfloat c, cfloat h) { return 2.f * (c.re * h.re - c.im * h.im); }
__device__ __forceinline__ float out_grad(float c, float dy) { return c * dy; }
__device__ __forceinline__ cfloat out_grad(cfloat c, float dy) { return {2.f * dy * c.re, -2.f * dy * c.im}; }
// A with its real part in log2 units (exp2f), and the decay exp(dt A) from it
__device__ __forceinline__ float log2_scaled(float A) { return A * kLog2e; }
__device__ __forceinline__ cfloat log2_scaled(cfloat A) { return {A.re * kLog2e, A.im}; }
__device__ __forceinline__ float decay(float dt, float A2) { return exp2f(dt * A2); }
__device__ __forceinline__ cfloat decay(float dt, cfloat A2) {
  float s, c;
  sincosf(dt * A2.im, &s, &c);
  const float m = exp2f(dt * A2.re);
  return {m * c, m * s};
}

__device__ __forceinline__ cfloat warp_sum(cfloat v) { return {warp_sum(v.re), warp_sum(v.im)}; }
__device__ __forceinline__ float shfl_up(float v, int o) { return __shfl_up_sync(kFull, v, o); }
__device__ __forceinline__ cfloat shfl_up(cfloat v, int o) {
  return {__shfl_up_sync(kFull, v.re, o), __shfl_up_sync(kFull, v.im, o)};
}
__device__ __forceinline__ float shfl_down(float v, int o) { return __shfl_down_sync(kFull, v, o); }
__device__ __forceinline__ cfloat shfl_down(cfloat v, int o) {
  return {__shfl_down_sync(kFull, v.re, o), __shfl_down_sync(kFull, v.im, o)};
}
__device__ __forceinline__ float shfl(float v, int lane) { return __shfl_sync(kFull, v, lane); }
__device__ __forceinline__ cfloat shfl(cfloat v, int lane) {
  return {__shfl_sync(kFull, v.re, lane), __shfl_sync(kFull, v.im, lane)};
}

// A state-typed value in memory: one element, or (complex) the float pair at offset, offset + 1.
template <typename S>
__device__ __forceinline__ S load_value(const void* p, int dtype, int64_t offset);
template <>
__device__ __forceinline__ float load_value<float>(const void* p, int dtype, int64_t offset) {
  return load_one(p, dtype, offset);
}
template <>
__device__ __forceinline__ cfloat load_value<cfloat>(const void* p, int dtype, int64_t offset) {
  return {load_one(p, dtype, offset), load_one(p, dtype, offset + 1)};
}
__device__ __forceinline__ void store_value(void* p, int dtype, int64_t offset, float v) {
  store_one(p, dtype, offset, v);
}
__device__ __forceinline__ void store_value(void* p, int dtype, int64_t offset, cfloat v) {
  store_one(p, dtype, offset, v.re);
  store_one(p, dtype, offset + 1, v.im);
}
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(float* p, cfloat v) {
  atomicAdd(p, v.re);
  atomicAdd(p + 1, v.im);
}
// Entry i of a per-step float array holding one or two floats a step.
template <int N>
__device__ __forceinline__ void put(float (&v)[N], int i, float x) { v[i] = x; }
template <int N>
__device__ __forceinline__ void put(float (&v)[N], int i, cfloat x) {
  v[2 * i] = x.re;
  v[2 * i + 1] = x.im;
}

// Warp scan of the affine maps h -> a h + b held by the lanes in order (lane 0 first). Returns, in
// (a, b), the composition of the maps of lanes [0, lane) (identity on lane 0), and in (ta, tb) the
// composition of all 32.
template <typename S>
__device__ __forceinline__ void warp_scan_fwd(int lane, S& a, S& b, S& ta, S& tb) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const S pa = shfl_up(a, o), pb = shfl_up(b, o);
    if (lane >= o) {  // earlier maps (pa, pb) first, then ours
      b = mul_add(a, pb, b);
      a = mul(a, pa);
    }
  }
  ta = shfl(a, 31);
  tb = shfl(b, 31);
  const S ea = shfl_up(a, 1), eb = shfl_up(b, 1);
  a = lane ? ea : one<S>();
  b = lane ? eb : S{};
}

// The mirror image: maps w -> a w + b applied from lane 31 down to lane 0. Returns the composition of
// lanes (lane, 31] (identity on lane 31), and in (ta, tb) that of all 32.
template <typename S>
__device__ __forceinline__ void warp_scan_rev(int lane, S& a, S& b, S& ta, S& tb) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const S na = shfl_down(a, o), nb = shfl_down(b, o);
    if (lane + o < 32) {  // later lanes' maps (na, nb) first, then ours
      b = mul_add(a, nb, b);
      a = mul(a, na);
    }
  }
  ta = shfl(a, 0);
  tb = shfl(b, 0);
  const S ea = shfl_down(a, 1), eb = shfl_down(b, 1);
  a = lane < 31 ? ea : one<S>();
  b = lane < 31 ? eb : S{};
}

// Strides in elements, in the order of the host's stride array (see pnf_selective_scan_fwd).
enum StrideIndex {
  kSU = 0, kSDelta = 3, kSZ = 6, kSOut = 9, kSDout = 12, kSDu = 15, kSDdelta = 18, kSDz = 21, kSOutZ = 24,
  kSA = 27, kSB = 29, kSC = 34, kSDB = 39, kSDC = 44, kSLast = 49, kNumStrides = 52
};

struct ScanArgs {
  const void *u, *delta, *A, *B, *C, *D, *z, *delta_bias, *dout;
  void *out, *last_state, *du, *ddelta, *dz, *out_z;
  float *states, *dA, *dB, *dC, *dD, *ddelta_bias;
  int64_t batch, dim, seqlen, dstate, dim_per_group, n_seg;
  int64_t s[kNumStrides];
  int A_dtype, B_dtype, C_dtype, D_dtype, bias_dtype, last_dtype;
  int B_variable, C_variable, softplus, vec;
  int vec_grad;   // input-dependent dB/dC rows contiguous along l and 16-byte aligned (vector atomics)
  int complex_A;  // the kComplex kernels (see the top of the file)
};

// Row pointer of a [b, d, l] tensor of dtype T.
template <typename T>
__device__ __forceinline__ const T* seq_row(const void* p, const ScanArgs& a, int which, int64_t b, int64_t d) {
  return static_cast<const T*>(p) + b * a.s[which] + d * a.s[which + 1];
}
template <typename T>
__device__ __forceinline__ T* seq_row(void* p, const ScanArgs& a, int which, int64_t b, int64_t d) {
  return static_cast<T*>(p) + b * a.s[which] + d * a.s[which + 1];
}

// Steps [t0, t0 + K) of an input-dependent B/C row as states: K floats, or (complex) the K (re, im)
// pairs at [2 t0, 2 t0 + 2 K) of the row of 2 seqlen floats.
template <int K>
__device__ __forceinline__ void load_row_states(const void* row, int dtype, int64_t t0, const ScanArgs& a,
                                                int64_t stride, float (&v)[K]) {
  load_steps_any<K>(row, dtype, t0, a.seqlen, stride, a.vec, v);
}
template <int K>
__device__ __forceinline__ void load_row_states(const void* row, int dtype, int64_t t0, const ScanArgs& a,
                                                int64_t stride, cfloat (&v)[K]) {
  float pairs[2 * K];
  load_steps_any<2 * K>(row, dtype, 2 * t0, 2 * a.seqlen, stride, a.vec, pairs);
#pragma unroll
  for (int i = 0; i < K; ++i) v[i] = {pairs[2 * i], pairs[2 * i + 1]};
}

// B or C at steps [t0, t0 + K) of state n (input-dependent), or its fixed value broadcast.
template <int K, typename S>
__device__ __forceinline__ void load_bc(const void* p, int dtype, int variable, const ScanArgs& a, int which,
                                        int64_t b, int64_t g, int64_t d, int64_t n, int64_t t0, S (&v)[K]) {
  if (variable) {
    const void* row = at(p, dtype, b * a.s[which] + g * a.s[which + 1] + n * a.s[which + 3]);
    load_row_states<K>(row, dtype, t0, a, a.s[which + 4], v);
  } else {
    const S x = load_value<S>(p, dtype, d * a.s[which + 2] + n * a.s[which + 3]);
#pragma unroll
    for (int i = 0; i < K; ++i) v[i] = x;
  }
}

// dt at the steps (0 past seqlen, so padded steps neither decay nor feed the state) and delta + bias.
template <typename T, int K>
__device__ __forceinline__ void load_dt(const ScanArgs& a, int64_t b, int64_t d, int64_t t0, float bias,
                                        float (&dt)[K], float (&raw)[K]) {
  load_steps<T, K>(seq_row<T>(a.delta, a, kSDelta, b, d), t0, a.seqlen, a.s[kSDelta + 2], a.vec, raw);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    raw[i] += bias;
    dt[i] = t0 + i < a.seqlen ? (a.softplus ? softplus(raw[i]) : raw[i]) : 0.f;
  }
}

template <typename T, bool kComplex>
__global__ void __launch_bounds__(kMaxWarps * 32) scan_fwd_kernel(const ScanArgs a) {
  using S = typename StateOf<kComplex>::type;
  constexpr int K = Plan<kComplex>::kFwdItems, kComps = Plan<kComplex>::kComps;
  __shared__ S carry[kMaxWarps][kMaxDstate];  // each warp's state entering the chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y, d = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (d >= a.dim) return;  // no block barrier follows
  const int64_t g = d / a.dim_per_group;
  const float Dv = a.D ? load_one(a.D, a.D_dtype, d) : 0.f;
  const float bias = a.delta_bias ? load_one(a.delta_bias, a.bias_dtype, d) : 0.f;
  const T* u_row = seq_row<T>(a.u, a, kSU, b, d);
  T* out_row = seq_row<T>(a.out, a, kSOut, b, d);
  float* states = a.states ? a.states + (b * a.dim + d) * a.n_seg * a.dstate * kComps : nullptr;
  for (int64_t c0 = 0; c0 < a.seqlen; c0 += 32 * K) {
    const int64_t t0 = c0 + lane * K;
    float u[K], dt[K], raw[K], y[K];
    load_steps<T, K>(u_row, t0, a.seqlen, a.s[kSU + 2], a.vec, u);
    load_dt<T, K>(a, b, d, t0, bias, dt, raw);
#pragma unroll
    for (int i = 0; i < K; ++i) y[i] = Dv * u[i];
    // a lane ending a state interval (or holding the last step) saves its end state
    const int64_t t_end = t0 + K < a.seqlen ? t0 + K : a.seqlen;
    const bool saves = states && t0 < a.seqlen && (t_end % kSegment == 0 || t_end == a.seqlen);
    for (int64_t n = 0; n < a.dstate; ++n) {
      const S A2 = log2_scaled(load_value<S>(a.A, a.A_dtype, d * a.s[kSA] + n * a.s[kSA + 1]));
      S Bv[K], Cv[K], da[K], dbu[K];
      load_bc<K>(a.B, a.B_dtype, a.B_variable, a, kSB, b, g, d, n, t0, Bv);
      load_bc<K>(a.C, a.C_dtype, a.C_variable, a, kSC, b, g, d, n, t0, Cv);
      S pa = one<S>(), pb = S{};
#pragma unroll
      for (int i = 0; i < K; ++i) {
        da[i] = decay(dt[i], A2);
        dbu[i] = scale(dt[i] * u[i], Bv[i]);
        pa = mul(pa, da[i]);
        pb = mul_add(da[i], pb, dbu[i]);
      }
      S ta, tb;
      warp_scan_fwd(lane, pa, pb, ta, tb);
      const S h_in = c0 ? carry[warp][n] : S{};
      S h = mul_add(pa, h_in, pb);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        h = mul_add(da[i], h, dbu[i]);
        y[i] += out_term(Cv[i], h);
      }
      if (saves) store_value(states, PNF_FLOAT32, (((t_end - 1) / kSegment) * a.dstate + n) * kComps, h);
      __syncwarp();  // every lane has read the carry
      if (lane == 0) carry[warp][n] = mul_add(ta, h_in, tb);
    }
    __syncwarp();
    if (a.z) {
      float z[K];
      load_steps<T, K>(seq_row<T>(a.z, a, kSZ, b, d), t0, a.seqlen, a.s[kSZ + 2], a.vec, z);
#pragma unroll
      for (int i = 0; i < K; ++i) y[i] *= z[i] * sigmoid(z[i]);
    }
    store_steps<T, K>(out_row, t0, a.seqlen, a.s[kSOut + 2], a.vec, y);
  }
  if (a.last_state && lane == 0)
    for (int64_t n = 0; n < a.dstate; ++n)
      store_value(a.last_state, a.last_dtype, b * a.s[kSLast] + d * a.s[kSLast + 1] + n * a.s[kSLast + 2],
                  a.seqlen ? carry[warp][n] : S{});
}

// Adds a block's input-dependent dB and/or dC of one state and chunk: each warp (dim) leaves K floats a
// lane in `part` ([2][kWarps][32 * K]: dB, dC), one barrier, then the sums over the warps go to global
// memory as coalesced fp32 atomics (4-wide vector atomics on sm_90 when the rows allow). The floats are
// those at [c0, c0 + 32 K) of rows of `length` (complex A: two a step, c0 and length doubled).
template <int K, int kWarps>
__device__ __forceinline__ void flush_bc_grads(float* part, const float (&dB)[K], const float (&dC)[K],
                                               float* dB_dst, float* dC_dst, const ScanArgs& a, int64_t c0,
                                               int64_t length, int warps) {
  constexpr int kChunk = 32 * K;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < K; i += 4) {
    if (dB_dst)
      *reinterpret_cast<float4*>(part + warp * kChunk + lane * K + i) =
          make_float4(dB[i], dB[i + 1], dB[i + 2], dB[i + 3]);
    if (dC_dst)
      *reinterpret_cast<float4*>(part + (kWarps + warp) * kChunk + lane * K + i) =
          make_float4(dC[i], dC[i + 1], dC[i + 2], dC[i + 3]);
  }
  __syncthreads();
  for (int p = 4 * threadIdx.x; p < 2 * kChunk; p += 4 * blockDim.x) {
    const int which = p / kChunk, q = p % kChunk;  // (dB or dC, step in the chunk)
    float* dst = which ? dC_dst : dB_dst;
    if (!dst) continue;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < warps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(part + (which * kWarps + w) * kChunk + q);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    const int64_t t = c0 + q, stride = a.s[(which ? kSDC : kSDB) + 4];
#if __CUDA_ARCH__ >= 900
    if (a.vec_grad && t + 4 <= length) {
      atomicAdd(reinterpret_cast<float4*>(dst + t), s);
      continue;
    }
#endif
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (t + i < length) atomicAdd(dst + (t + i) * stride, v[i]);
  }
}

// The end of a backward chunk of K steps a thread: softplus' derivative (delta + bias re-read),
// masking past seqlen, the ddelta_bias sum, the stores of du, ddelta, dz and out_z (dout, z re-read).
template <typename T, int K>
__device__ __forceinline__ void finish_steps(const ScanArgs& a, int64_t b, int64_t d, int64_t t0, float bias,
                                             const float (&du)[K], float (&ddt)[K], float (&y)[K],
                                             float& dbias_sum) {
  if (a.softplus) {
    float dt_again[K], raw[K];
    load_dt<T, K>(a, b, d, t0, bias, dt_again, raw);
#pragma unroll
    for (int i = 0; i < K; ++i)
      if (raw[i] <= 20.f) ddt[i] *= sigmoid(raw[i]);
  }
#pragma unroll
  for (int i = 0; i < K; ++i) {
    ddt[i] = t0 + i < a.seqlen ? ddt[i] : 0.f;
    dbias_sum += ddt[i];
  }
  store_steps<T, K>(seq_row<T>(a.du, a, kSDu, b, d), t0, a.seqlen, a.s[kSDu + 2], a.vec, du);
  store_steps<T, K>(seq_row<T>(a.ddelta, a, kSDdelta, b, d), t0, a.seqlen, a.s[kSDdelta + 2], a.vec, ddt);
  if (a.z) {
    float dout[K], z[K], dz[K];
    load_steps<T, K>(seq_row<T>(a.dout, a, kSDout, b, d), t0, a.seqlen, a.s[kSDout + 2], a.vec, dout);
    load_steps<T, K>(seq_row<T>(a.z, a, kSZ, b, d), t0, a.seqlen, a.s[kSZ + 2], a.vec, z);
#pragma unroll
    for (int i = 0; i < K; ++i) {
      const float s = sigmoid(z[i]);
      dz[i] = dout[i] * y[i] * s * (1.f + z[i] * (1.f - s));
      y[i] *= z[i] * s;
    }
    store_steps<T, K>(seq_row<T>(a.dz, a, kSDz, b, d), t0, a.seqlen, a.s[kSDz + 2], a.vec, dz);
    if (a.out_z) store_steps<T, K>(seq_row<T>(a.out_z, a, kSOutZ, b, d), t0, a.seqlen, a.s[kSOutZ + 2], a.vec, y);
  }
}

template <typename T, bool kComplex>
__global__ void __launch_bounds__(Plan<kComplex>::kBwdMaxWarps * 32, Plan<kComplex>::kBwdMinBlocks)
    scan_bwd_kernel(const ScanArgs a) {
  using S = typename StateOf<kComplex>::type;
  constexpr int K = kBwdItems, kComps = Plan<kComplex>::kComps, kWarps = Plan<kComplex>::kBwdMaxWarps;
  __shared__ S w_carry[kWarps][kMaxDstate];  // each warp's adjoint w entering the chunk from the right
  __shared__ __align__(16) float part[2][2 * kWarps * 32 * K * kComps];  // [buffer][dB, dC][warp][step]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int64_t b = blockIdx.y, d_own = static_cast<int64_t>(blockIdx.x) * warps + warp;
  // warps past the last dim run on a clamped dim (the block's barriers need them) and contribute 0
  const bool valid = d_own < a.dim;
  const int64_t d = valid ? d_own : a.dim - 1;
  const float keep = valid ? 1.f : 0.f;
  const int64_t g = d / a.dim_per_group;
  const float Dv = a.D ? load_one(a.D, a.D_dtype, d) : 0.f;
  const float bias = a.delta_bias ? load_one(a.delta_bias, a.bias_dtype, d) : 0.f;
  const float* states = a.states + (b * a.dim + d) * a.n_seg * a.dstate * kComps;
  float* dB_row = a.B_variable ? a.dB + b * a.s[kSDB] + g * a.s[kSDB + 1] : nullptr;
  float* dC_row = a.C_variable ? a.dC + b * a.s[kSDC] + g * a.s[kSDC + 1] : nullptr;
  float dD_sum = 0.f, dbias_sum = 0.f;
  int buffer = 0;
  for (int64_t seg = a.n_seg - 1; seg >= 0; --seg) {
    const int64_t c0 = seg * kSegment, t0 = c0 + lane * K;
    // delta + bias, dout and z are re-read after the state loop (cache hits) rather than held in
    // registers across it: fewer registers, more warps a multiprocessor
    float u[K], dt[K], dy[K], y[K], du[K], ddt[K];
    load_steps<T, K>(seq_row<T>(a.u, a, kSU, b, d), t0, a.seqlen, a.s[kSU + 2], a.vec, u);
    {
      float raw[K], dout[K], z[K] = {};
      load_dt<T, K>(a, b, d, t0, bias, dt, raw);
      load_steps<T, K>(seq_row<T>(a.dout, a, kSDout, b, d), t0, a.seqlen, a.s[kSDout + 2], a.vec, dout);
      if (a.z) load_steps<T, K>(seq_row<T>(a.z, a, kSZ, b, d), t0, a.seqlen, a.s[kSZ + 2], a.vec, z);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        dy[i] = a.z ? dout[i] * z[i] * sigmoid(z[i]) : dout[i];
        y[i] = Dv * u[i];
        du[i] = Dv * dy[i];
        ddt[i] = 0.f;
        dD_sum += dy[i] * u[i];  // (u is 0 past seqlen)
      }
    }
    for (int64_t n = 0; n < a.dstate; ++n) {
      const S An = load_value<S>(a.A, a.A_dtype, d * a.s[kSA] + n * a.s[kSA + 1]), A2 = log2_scaled(An);
      S Bv[K], Cv[K], da[K], dbu[K], hs[K];
      load_bc<K>(a.B, a.B_dtype, a.B_variable, a, kSB, b, g, d, n, t0, Bv);
      load_bc<K>(a.C, a.C_dtype, a.C_variable, a, kSC, b, g, d, n, t0, Cv);
      // the chunk's states, from the saved state entering it
      S pa = one<S>(), pb = S{};
#pragma unroll
      for (int i = 0; i < K; ++i) {
        da[i] = decay(dt[i], A2);
        dbu[i] = scale(dt[i] * u[i], Bv[i]);
        pa = mul(pa, da[i]);
        pb = mul_add(da[i], pb, dbu[i]);
      }
      S ta, tb;
      warp_scan_fwd(lane, pa, pb, ta, tb);
      const S h_saved = seg ? load_value<S>(states, PNF_FLOAT32, ((seg - 1) * a.dstate + n) * kComps) : S{};
      const S h_start = mul_add(pa, h_saved, pb);
      S h = h_start;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        h = mul_add(da[i], h, dbu[i]);
        hs[i] = h;
        y[i] += out_term(Cv[i], h);
      }
      // adjoint: w_t = conj(da_t) (dL/dh_t from y_t + w_{t+1}), composed from the right
      S qa = one<S>(), qb = S{};
#pragma unroll
      for (int i = K - 1; i >= 0; --i) {
        const S back = conjugate(da[i]);
        qb = mul(back, add(out_grad(Cv[i], dy[i]), qb));
        qa = mul(qa, back);
      }
      warp_scan_rev(lane, qa, qb, ta, tb);
      const S w_in = seg + 1 < a.n_seg ? w_carry[warp][n] : S{};
      S w = mul_add(qa, w_in, qb);
      S dA_part{}, dBf_part{}, dCf_part{};
      float dBv[K * kComps], dCv[K * kComps];
#pragma unroll
      for (int i = K - 1; i >= 0; --i) {
        const S gi = add(out_grad(Cv[i], dy[i]), w);                 // dL/dh_t
        const S decayed = mul(da[i], i ? hs[i - 1] : h_start);       // exp(dt_t A) h_{t-1}
        const S gdt = scale(dt[i], gi);
        du[i] += re_dot(gdt, Bv[i]);
        ddt[i] += re_dot(gi, add(scale(u[i], Bv[i]), mul(An, decayed)));
        dA_part = mul_add(gdt, conjugate(decayed), dA_part);
        const S dBi = scale(keep, scale(u[i], gdt)), dCi = scale(keep, out_grad(hs[i], dy[i]));
        put(dBv, i, dBi);
        put(dCv, i, dCi);
        dBf_part = add(dBf_part, dBi);
        dCf_part = add(dCf_part, dCi);
        w = mul(conjugate(da[i]), gi);
      }
      __syncwarp();  // every lane has read the carry
      if (lane == 0) w_carry[warp][n] = mul_add(ta, w_in, tb);
      dA_part = warp_sum(dA_part);
      if (valid && lane == 0) atomic_add(a.dA + (d * a.dstate + n) * kComps, dA_part);
      if (!a.B_variable) {
        dBf_part = warp_sum(dBf_part);
        if (valid && lane == 0) atomic_add(a.dB + d * a.s[kSDB + 2] + n * a.s[kSDB + 3], dBf_part);
      }
      if (!a.C_variable) {
        dCf_part = warp_sum(dCf_part);
        if (valid && lane == 0) atomic_add(a.dC + d * a.s[kSDC + 2] + n * a.s[kSDC + 3], dCf_part);
      }
      if (a.B_variable || a.C_variable) {
        flush_bc_grads<K * kComps, kWarps>(part[buffer], dBv, dCv, dB_row ? dB_row + n * a.s[kSDB + 3] : nullptr,
                                           dC_row ? dC_row + n * a.s[kSDC + 3] : nullptr, a, c0 * kComps,
                                           a.seqlen * kComps, warps);
        buffer ^= 1;  // a barrier separates a buffer's reads from its next writes
      }
    }
    __syncwarp();
    if (valid) finish_steps<T, K>(a, b, d, t0, bias, du, ddt, y, dbias_sum);
  }
  if (!valid) return;
  dD_sum = warp_sum(dD_sum);
  dbias_sum = warp_sum(dbias_sum);
  if (lane == 0) {
    if (a.dD) atomicAdd(a.dD + d, dD_sum);
    if (a.ddelta_bias) atomicAdd(a.ddelta_bias + d, dbias_sum);
  }
}

// ---------------------------------------------------------------------------------------------
// host side

bool valid_dtype(int dtype) { return dtype == PNF_FLOAT32 || dtype == PNF_FLOAT16 || dtype == PNF_BFLOAT16; }

int64_t segments(int64_t seqlen) { return seqlen > 0 ? (seqlen + kSegment - 1) / kSegment : 0; }

// Whether every [b, d, l] tensor (and input-dependent B/C) is contiguous along l with 16-byte aligned
// rows: then a lane's steps load and store as 16-byte vectors.
bool aligned_row(const void* p, int esize, const int64_t* row_strides, int count, int64_t step_stride) {
  if (!p) return true;
  if (step_stride != 1 || reinterpret_cast<uintptr_t>(p) % 16) return false;
  for (int k = 0; k < count; ++k)
    if ((row_strides[k] * esize) % 16) return false;
  return true;
}

bool vector_rows(const ScanArgs& a, int esize, std::initializer_list<std::pair<const void*, int>> seq_tensors) {
  for (const auto& t : seq_tensors)
    if (!aligned_row(t.first, esize, a.s + t.second, 2, a.s[t.second + 2])) return false;
  const int64_t bc_rows[2] = {kSB, kSC};
  const void* bc[2] = {a.B, a.C};
  const int variable[2] = {a.B_variable, a.C_variable}, dtype[2] = {a.B_dtype, a.C_dtype};
  for (int k = 0; k < 2; ++k) {
    const int64_t* s = a.s + bc_rows[k];
    const int64_t rows[3] = {s[0], s[1], s[3]};
    if (variable[k] && !aligned_row(bc[k], dtype[k] == PNF_FLOAT32 ? 4 : 2, rows, 3, s[4])) return false;
  }
  return true;
}

// Whether the input-dependent dB/dC rows take 4-wide vector atomics (contiguous, 16-byte aligned).
bool vector_grad_rows(const ScanArgs& a) {
  const float* grads[2] = {a.B_variable ? a.dB : nullptr, a.C_variable ? a.dC : nullptr};
  const int64_t* strides[2] = {a.s + kSDB, a.s + kSDC};
  for (int k = 0; k < 2; ++k) {
    const int64_t rows[3] = {strides[k][0], strides[k][1], strides[k][3]};
    if (grads[k] && !aligned_row(grads[k], 4, rows, 3, strides[k][4])) return false;
  }
  return true;
}

int check_common(const ScanArgs& a, int dtype) {
  if (a.batch < 0 || a.dim < 0 || a.seqlen < 0 || a.dstate < 1 || a.dstate > kMaxDstate || a.dim_per_group < 1 ||
      !valid_dtype(dtype) || !valid_dtype(a.A_dtype) || !valid_dtype(a.B_dtype) || !valid_dtype(a.C_dtype) ||
      !valid_dtype(a.D_dtype) || !valid_dtype(a.bias_dtype) || !valid_dtype(a.last_dtype))
    return PNF_ERR_INVALID_ARGUMENT;
  // complex A: A, fixed B/C, states and last_state are complex64 (float pairs)
  if (a.complex_A && (a.A_dtype != PNF_FLOAT32 || (!a.B_variable && a.B_dtype != PNF_FLOAT32) ||
                      (!a.C_variable && a.C_dtype != PNF_FLOAT32) || (a.last_state && a.last_dtype != PNF_FLOAT32)))
    return PNF_ERR_INVALID_ARGUMENT;
  if (a.batch > 65535) return PNF_ERR_UNSUPPORTED;  // grid y
  return PNF_OK;
}

// Warps a block (the warp kernels: consecutive dims that stay inside one group, as dB/dC are summed
// over the block).
int block_warps(const ScanArgs& a, bool backward, int requested, int fallback) {
  const int most = !backward ? kMaxWarps : a.complex_A ? Plan<true>::kBwdMaxWarps : Plan<false>::kBwdMaxWarps;
  int warps = requested > 0 ? requested : fallback;
  if (warps > most) warps = most;
  while (warps > 1 && a.dim_per_group != a.dim && a.dim_per_group % warps) warps >>= 1;
  return warps;
}

template <typename T, bool kComplex>
void launch(const ScanArgs& a, bool backward, int warps, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.dim + warps - 1) / warps), static_cast<unsigned>(a.batch));
  if (backward)
    scan_bwd_kernel<T, kComplex><<<grid, warps * 32, 0, stream>>>(a);
  else
    scan_fwd_kernel<T, kComplex><<<grid, warps * 32, 0, stream>>>(a);
}

template <typename T>
void launch(const ScanArgs& a, bool backward, int warps, cudaStream_t stream) {
  if (a.complex_A)
    launch<T, true>(a, backward, warps, stream);
  else
    launch<T, false>(a, backward, warps, stream);
}

int run(ScanArgs& a, int dtype, bool backward, int warps, void* stream) {
  a.vec = vector_rows(a, dtype == PNF_FLOAT32 ? 4 : 2,
                      {{a.u, kSU}, {a.delta, kSDelta}, {a.z, kSZ}, {a.out, kSOut}, {a.dout, kSDout}, {a.du, kSDu},
                       {a.ddelta, kSDdelta}, {a.dz, kSDz}, {a.out_z, kSOutZ}});
  a.vec_grad = backward && vector_grad_rows(a);
  warps = block_warps(a, backward, warps, backward ? kBwdWarps : kFwdWarps);
  if ((a.dim + warps - 1) / warps > 0x7fffffff) return PNF_ERR_UNSUPPORTED;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case PNF_FLOAT16: launch<__half>(a, backward, warps, s); break;
    case PNF_BFLOAT16: launch<__nv_bfloat16>(a, backward, warps, s); break;
    default: launch<float>(a, backward, warps, s);
  }
  return pnf_check_launch();
}

ScanArgs make_args(const void* u, const void* delta, const void* A, const void* B, const void* C, const void* D,
                   const void* z, const void* delta_bias, int64_t batch, int64_t dim, int64_t seqlen, int64_t dstate,
                   int64_t groups, const int64_t* strides, const int* dtypes, int B_variable, int C_variable,
                   int delta_softplus, int complex_A) {
  ScanArgs a{};
  a.u = u, a.delta = delta, a.A = A, a.B = B, a.C = C, a.D = D, a.z = z, a.delta_bias = delta_bias;
  a.batch = batch, a.dim = dim, a.seqlen = seqlen, a.dstate = dstate;
  // groups must divide dim (-1 fails the check); with no dims any positive value will do
  a.dim_per_group = groups < 1 || dim % groups ? -1 : (dim > 0 ? dim / groups : 1);
  a.n_seg = segments(seqlen);
  for (int k = 0; k < kNumStrides; ++k) a.s[k] = strides[k];
  a.A_dtype = dtypes[1], a.B_dtype = dtypes[2], a.C_dtype = dtypes[3], a.D_dtype = dtypes[4];
  a.bias_dtype = dtypes[5], a.last_dtype = dtypes[6];
  a.B_variable = B_variable, a.C_variable = C_variable, a.softplus = delta_softplus, a.complex_A = complex_A;
  return a;
}

}  // namespace

// Steps between the states the forward saves for the backward (states is [b, d, cdiv(l, this), n]).
PNF_EXPORT int pnf_selective_scan_state_interval() { return kSegment; }

// strides: 52 int64 in elements: (b, d, l) of u, delta, z, out, dout, du, ddelta, dz, out_z; (d, n) of
// A; (b, g, d, n, l) of B, C, dB, dC (fixed: b, g, l ignored; input-dependent: d ignored); (b, d, n) of
// last_state. Entries of absent tensors are ignored. dtypes: [u's (all [b, d, l] tensors), A, B, C, D,
// delta_bias, last_state]. warps: dims (warps) a block (0: default). complex_A: A, fixed B/C,
// last_state and states are complex64 with strides (and dtype float32) given in floats, input-dependent
// B/C are [b, g, n, 2 l] (re, im) pairs (see the top of the file).
PNF_EXPORT int pnf_selective_scan_fwd(const void* u, const void* delta, const void* A, const void* B, const void* C,
                                      const void* D, const void* z, const void* delta_bias, void* out, float* states,
                                      void* last_state, int64_t batch, int64_t dim, int64_t seqlen, int64_t dstate,
                                      int64_t groups, const int64_t* strides, const int* dtypes, int B_variable,
                                      int C_variable, int delta_softplus, int complex_A, int warps, void* stream) {
  if (!strides || !dtypes) return PNF_ERR_INVALID_ARGUMENT;
  ScanArgs a = make_args(u, delta, A, B, C, D, z, delta_bias, batch, dim, seqlen, dstate, groups, strides, dtypes,
                         B_variable, C_variable, delta_softplus, complex_A);
  a.out = out, a.states = states, a.last_state = last_state;
  int status = check_common(a, dtypes[0]);
  if (status != PNF_OK) return status;
  if (batch == 0 || dim == 0 || (seqlen == 0 && !last_state)) return PNF_OK;  // (empty tensors may be null)
  if (!A || (seqlen > 0 && (!u || !delta || !B || !C || !out))) return PNF_ERR_INVALID_ARGUMENT;
  return run(a, dtypes[0], false, warps, stream);
}

// Gradients of pnf_selective_scan_fwd from its saved states: du, ddelta, dz (with z) and out_z (the
// forward output, optional) written; dA, dB, dC, dD, ddelta_bias (fp32; complex64 where A, B, C are)
// accumulated.
PNF_EXPORT int pnf_selective_scan_bwd(const void* u, const void* delta, const void* A, const void* B, const void* C,
                                      const void* D, const void* z, const void* delta_bias, const void* dout,
                                      const float* states, void* du, void* ddelta, float* dA, float* dB, float* dC,
                                      float* dD, void* dz, float* ddelta_bias, void* out_z, int64_t batch,
                                      int64_t dim, int64_t seqlen, int64_t dstate, int64_t groups,
                                      const int64_t* strides, const int* dtypes, int B_variable, int C_variable,
                                      int delta_softplus, int complex_A, int warps, void* stream) {
  if (!strides || !dtypes) return PNF_ERR_INVALID_ARGUMENT;
  ScanArgs a = make_args(u, delta, A, B, C, D, z, delta_bias, batch, dim, seqlen, dstate, groups, strides, dtypes,
                         B_variable, C_variable, delta_softplus, complex_A);
  a.dout = dout, a.states = const_cast<float*>(states), a.du = du, a.ddelta = ddelta, a.dA = dA, a.dB = dB;
  a.dC = dC, a.dD = dD, a.dz = dz, a.ddelta_bias = ddelta_bias, a.out_z = out_z;
  int status = check_common(a, dtypes[0]);
  if (status != PNF_OK) return status;
  if (batch == 0 || dim == 0 || seqlen == 0) return PNF_OK;
  if (!u || !delta || !A || !B || !C || !dout || !states || !du || !ddelta || !dA || !dB || !dC ||
      (D && !dD) || (delta_bias && !ddelta_bias) || (z && !dz) || (out_z && !z))
    return PNF_ERR_INVALID_ARGUMENT;
  return run(a, dtypes[0], true, warps, stream);
}
