// Fused dense layers over cuBLASLt: GEMMs whose epilogue adds the bias, applies GELU (tanh) or ReLU,
// saves the pre-activation, reduces the bias gradient, or applies the activation's gradient.
//
// Row-major entry points (Paddle's [in, out] weight layout), all fp32 accumulation, dtype fp16 /
// bf16 / fp32 (PnfDtype), every matrix with a unit stride along its last axis and a row stride `ld*`:
//   pnf_fused_dense_fwd      out[M,N] = act(x[M,K] @ op(w) + bias[N]);  op(w) = w[K,N], or w[N,K]^T
//                            when w_trans; optional aux = pre-activation (GELU: values [M, ld_aux];
//                            ReLU: 1 bit per element, rows of ld_aux bits)
//   pnf_fused_dense_wgrad    dw[K,N] = x[M,K]^T @ dout[M,N],  dbias[N] = sum_m dout[m, :]   (one GEMM)
//   pnf_fused_dense_bwd_act  dpre[M,H] = act'(pre) * (dout[M,N] @ w[H,N]^T),  dbias[H] = sum_m dpre
// cuBLASLt is column-major: a row-major [R, C] matrix with row stride ld is the column-major C x R
// matrix with leading dimension ld, i.e. its transpose. So row-major D = A @ B is computed as the
// column-major D^T = B^T @ A^T, with the weight as cuBLASLt's A operand and the activations as B.
//
// cuBLASLt is loaded at run time (dlopen), so this library loads where CUDA's BLAS is absent (CI);
// the few types and constants used are declared below and checked against cublasLt.h where the
// toolkit ships it.
#include <dlfcn.h>
#include <library_types.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

#include "pnf.h"

namespace {

// ---- the subset of cuBLASLt's C API used here (values from cublasLt.h / cublas_api.h) ----------
typedef int LtStatus;  // cublasStatus_t
constexpr LtStatus LT_SUCCESS = 0;
constexpr LtStatus LT_NOT_SUPPORTED = 15;
typedef struct LtContext* LtHandle;
typedef struct LtMatmulDescOpaque* LtMatmulDesc;
typedef struct LtMatrixLayoutOpaque* LtLayout;
typedef struct LtPreferenceOpaque* LtPreference;
struct LtAlgo {
  uint64_t data[8];
};
struct LtHeuristicResult {
  LtAlgo algo;
  size_t workspaceSize;
  LtStatus state;
  float wavesCount;
  int reserved[4];
};

constexpr int32_t OP_N = 0, OP_T = 1;    // cublasOperation_t
constexpr int32_t COMPUTE_32F = 68;      // cublasComputeType_t CUBLAS_COMPUTE_32F
// cublasLtMatmulDescAttributes_t
constexpr int DESC_TRANSA = 3, DESC_TRANSB = 4, DESC_EPILOGUE = 7, DESC_BIAS_POINTER = 8,
              DESC_EPILOGUE_AUX_POINTER = 11, DESC_EPILOGUE_AUX_LD = 12;
// cublasLtMatmulPreferenceAttributes_t
constexpr int PREF_MAX_WORKSPACE_BYTES = 1, PREF_MIN_ALIGNMENT_A = 5, PREF_MIN_ALIGNMENT_B = 6,
              PREF_MIN_ALIGNMENT_C = 7, PREF_MIN_ALIGNMENT_D = 8;
// cublasLtEpilogue_t
constexpr uint32_t EPI_DEFAULT = 1, EPI_RELU = 2, EPI_BIAS = 4, EPI_GELU = 32, EPI_AUX = 128,
                   EPI_DRELU = 136, EPI_DRELU_BGRAD = 152, EPI_DGELU = 192, EPI_DGELU_BGRAD = 208,
                   EPI_BGRADA = 256;

constexpr int kMaxAlgos = 8;  // how many candidates the heuristic is asked for

}  // namespace

#if defined(__has_include)
#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
static_assert(LT_NOT_SUPPORTED == CUBLAS_STATUS_NOT_SUPPORTED, "cublasStatus_t");
static_assert(OP_T == CUBLAS_OP_T && COMPUTE_32F == CUBLAS_COMPUTE_32F, "cublas enums");
static_assert(DESC_TRANSA == CUBLASLT_MATMUL_DESC_TRANSA && DESC_TRANSB == CUBLASLT_MATMUL_DESC_TRANSB &&
                  DESC_EPILOGUE == CUBLASLT_MATMUL_DESC_EPILOGUE &&
                  DESC_BIAS_POINTER == CUBLASLT_MATMUL_DESC_BIAS_POINTER &&
                  DESC_EPILOGUE_AUX_POINTER == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER &&
                  DESC_EPILOGUE_AUX_LD == CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
              "cublasLtMatmulDescAttributes_t");
static_assert(PREF_MAX_WORKSPACE_BYTES == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES &&
                  PREF_MIN_ALIGNMENT_A == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
                  PREF_MIN_ALIGNMENT_D == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
              "cublasLtMatmulPreferenceAttributes_t");
static_assert(EPI_DEFAULT == CUBLASLT_EPILOGUE_DEFAULT && EPI_RELU == CUBLASLT_EPILOGUE_RELU &&
                  EPI_BIAS == CUBLASLT_EPILOGUE_BIAS && EPI_GELU == CUBLASLT_EPILOGUE_GELU &&
                  (EPI_GELU | EPI_AUX | EPI_BIAS) == CUBLASLT_EPILOGUE_GELU_AUX_BIAS &&
                  (EPI_RELU | EPI_AUX | EPI_BIAS) == CUBLASLT_EPILOGUE_RELU_AUX_BIAS &&
                  EPI_DRELU == CUBLASLT_EPILOGUE_DRELU && EPI_DRELU_BGRAD == CUBLASLT_EPILOGUE_DRELU_BGRAD &&
                  EPI_DGELU == CUBLASLT_EPILOGUE_DGELU && EPI_DGELU_BGRAD == CUBLASLT_EPILOGUE_DGELU_BGRAD &&
                  EPI_BGRADA == CUBLASLT_EPILOGUE_BGRADA,
              "cublasLtEpilogue_t");
static_assert(sizeof(LtHeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t), "heuristic result");
#endif
#endif

namespace {

struct LtApi {
  LtStatus (*create)(LtHandle*);
  LtStatus (*desc_create)(LtMatmulDesc*, int32_t compute_type, int32_t scale_type);
  LtStatus (*desc_destroy)(LtMatmulDesc);
  LtStatus (*desc_set)(LtMatmulDesc, int attr, const void* buf, size_t size);
  LtStatus (*layout_create)(LtLayout*, int32_t type, uint64_t rows, uint64_t cols, int64_t ld);
  LtStatus (*layout_destroy)(LtLayout);
  LtStatus (*pref_create)(LtPreference*);
  LtStatus (*pref_destroy)(LtPreference);
  LtStatus (*pref_set)(LtPreference, int attr, const void* buf, size_t size);
  LtStatus (*heuristic)(LtHandle, LtMatmulDesc, LtLayout a, LtLayout b, LtLayout c, LtLayout d, LtPreference,
                        int requested, LtHeuristicResult* results, int* returned);
  LtStatus (*matmul)(LtHandle, LtMatmulDesc, const void* alpha, const void* a, LtLayout, const void* b, LtLayout,
                     const void* beta, const void* c, LtLayout, void* d, LtLayout, const LtAlgo*, void* workspace,
                     size_t workspace_bytes, cudaStream_t);
  size_t (*version)();
};

constexpr int kMaxDevices = 64;
std::mutex g_mutex;
void* g_dl = nullptr;
LtApi g_api;
LtHandle g_handles[kMaxDevices] = {};
thread_local char g_error[512] = "";

int fail(int status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return status;
}

template <typename F>
bool resolve(void* dl, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(dl, name));
  return fn != nullptr;
}

// Caller holds g_mutex.
int load_locked(const char* path) {
  if (g_dl) return PNF_OK;
  const char* candidates[] = {path, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
  void* dl = nullptr;
  for (const char* name : candidates) {
    if (name && *name && (dl = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (name && *name && path) break;  // an explicit path is the only one tried
  }
  if (!dl) return fail(PNF_ERR_UNSUPPORTED, "cannot load cuBLASLt (%s): %s", path ? path : "libcublasLt.so.{13,12}",
                       dlerror());
  LtApi api;
  bool ok = resolve(dl, api.create, "cublasLtCreate") && resolve(dl, api.desc_create, "cublasLtMatmulDescCreate") &&
            resolve(dl, api.desc_destroy, "cublasLtMatmulDescDestroy") &&
            resolve(dl, api.desc_set, "cublasLtMatmulDescSetAttribute") &&
            resolve(dl, api.layout_create, "cublasLtMatrixLayoutCreate") &&
            resolve(dl, api.layout_destroy, "cublasLtMatrixLayoutDestroy") &&
            resolve(dl, api.pref_create, "cublasLtMatmulPreferenceCreate") &&
            resolve(dl, api.pref_destroy, "cublasLtMatmulPreferenceDestroy") &&
            resolve(dl, api.pref_set, "cublasLtMatmulPreferenceSetAttribute") &&
            resolve(dl, api.heuristic, "cublasLtMatmulAlgoGetHeuristic") &&
            resolve(dl, api.matmul, "cublasLtMatmul") && resolve(dl, api.version, "cublasLtGetVersion");
  if (!ok) {
    dlclose(dl);
    return fail(PNF_ERR_UNSUPPORTED, "cuBLASLt at %s lacks a required function", path ? path : "default path");
  }
  g_api = api;
  g_dl = dl;
  return PNF_OK;
}

int handle_for_current_device(LtHandle* out) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return pnf_check_launch();
  if (device < 0 || device >= kMaxDevices)
    return fail(PNF_ERR_UNSUPPORTED, "device index %d >= %d", device, kMaxDevices);
  std::lock_guard<std::mutex> lock(g_mutex);
  int status = load_locked(nullptr);
  if (status != PNF_OK) return status;
  if (!g_handles[device]) {
    LtStatus s = g_api.create(&g_handles[device]);
    if (s != LT_SUCCESS) return fail(PNF_ERR_CUBLAS, "cublasLtCreate failed with status %d", s);
  }
  *out = g_handles[device];
  return PNF_OK;
}

bool cuda_type(int dtype, int32_t* type, int* itemsize) {
  switch (dtype) {
    case PNF_FLOAT32: *type = CUDA_R_32F; *itemsize = 4; return true;
    case PNF_FLOAT16: *type = CUDA_R_16F; *itemsize = 2; return true;
    case PNF_BFLOAT16: *type = CUDA_R_16BF; *itemsize = 2; return true;
    default: return false;
  }
}

// The largest power of two (<= 256) dividing the address and the row pitch: what the heuristic may
// assume about a matrix (it assumes 256 unless told).
uint32_t alignment(const void* ptr, int64_t ld, int itemsize) {
  uint64_t bits = reinterpret_cast<uint64_t>(ptr) | static_cast<uint64_t>(ld * itemsize) | 256;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Column-major D[m,n] = alpha op(A)[m,k] @ op(B)[k,n] + beta D with an epilogue (C = D); D in the
// inputs' dtype unless d_dtype names another (fp32 accumulation buffers).
struct LtGemm {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  uint32_t epilogue;
  const void* bias;  // bias (forward) or bias gradient (BGRAD epilogues)
  const void* aux;   // pre-activation / ReLU mask, written (forward) or read (backward)
  int64_t ld_aux;
  float alpha = 1.0f, beta = 0.0f;
  int d_dtype = -1;         // a PnfDtype, or -1: the inputs' dtype
  bool cache_algo = false;  // remember the heuristic's choice per problem (see AlgoCache)
};

// The heuristic's algorithm per problem (sizes, strides, alignments, dtypes, workspace, index): a
// chunked caller issues hundreds of GEMMs of a few shapes a step, and asking the heuristic each time
// costs more host time than a chunk's GEMM takes on the GPU. Guarded by g_mutex; round-robin reuse.
struct AlgoKey {
  int64_t v[17];
  bool operator==(const AlgoKey& o) const { return memcmp(v, o.v, sizeof(v)) == 0; }
};
constexpr int kAlgoCache = 128;
AlgoKey g_algo_keys[kAlgoCache];
LtAlgo g_algos[kAlgoCache];
int g_algo_count = 0, g_algo_next = 0;

bool find_algo(const AlgoKey& key, LtAlgo* algo) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (int i = 0; i < g_algo_count; ++i)
    if (g_algo_keys[i] == key) {
      *algo = g_algos[i];
      return true;
    }
  return false;
}

void store_algo(const AlgoKey& key, const LtAlgo& algo) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_algo_keys[g_algo_next] = key;
  g_algos[g_algo_next] = algo;
  g_algo_next = (g_algo_next + 1) % kAlgoCache;
  if (g_algo_count < kAlgoCache) ++g_algo_count;
}

const char* epilogue_name(uint32_t e) {
  switch (e) {
    case EPI_DEFAULT: return "DEFAULT";
    case EPI_BIAS: return "BIAS";
    case EPI_GELU: return "GELU";
    case EPI_GELU | EPI_BIAS: return "GELU_BIAS";
    case EPI_GELU | EPI_AUX: return "GELU_AUX";
    case EPI_GELU | EPI_AUX | EPI_BIAS: return "GELU_AUX_BIAS";
    case EPI_RELU: return "RELU";
    case EPI_RELU | EPI_BIAS: return "RELU_BIAS";
    case EPI_RELU | EPI_AUX: return "RELU_AUX";
    case EPI_RELU | EPI_AUX | EPI_BIAS: return "RELU_AUX_BIAS";
    case EPI_DGELU: return "DGELU";
    case EPI_DGELU_BGRAD: return "DGELU_BGRAD";
    case EPI_DRELU: return "DRELU";
    case EPI_DRELU_BGRAD: return "DRELU_BGRAD";
    case EPI_BGRADA: return "BGRADA";
    default: return "?";
  }
}

int run_gemm(int dtype, const LtGemm& g, int heuristic, void* workspace, size_t workspace_bytes, void* stream) {
  int32_t type, d_type;
  int itemsize, d_itemsize;
  if (!cuda_type(dtype, &type, &itemsize)) return fail(PNF_ERR_UNSUPPORTED, "dtype code %d", dtype);
  if (!cuda_type(g.d_dtype < 0 ? dtype : g.d_dtype, &d_type, &d_itemsize))
    return fail(PNF_ERR_UNSUPPORTED, "output dtype code %d", g.d_dtype);
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) return fail(PNF_ERR_INVALID_ARGUMENT, "empty GEMM %lldx%lldx%lld",
                                                    (long long)g.m, (long long)g.n, (long long)g.k);
  if (heuristic < 0) return fail(PNF_ERR_INVALID_ARGUMENT, "heuristic index %d < 0", heuristic);
  if (workspace_bytes && !workspace) return fail(PNF_ERR_INVALID_ARGUMENT, "workspace is null");
  LtHandle handle;
  int status = handle_for_current_device(&handle);
  if (status != PNF_OK) return status;

  LtMatmulDesc desc = nullptr;
  LtLayout la = nullptr, lb = nullptr, ld = nullptr;
  LtPreference pref = nullptr;
  LtHeuristicResult results[kMaxAlgos];
  int returned = 0;
  const char* where = "";
  LtStatus s = LT_SUCCESS;
  const int32_t op_a = g.trans_a ? OP_T : OP_N, op_b = g.trans_b ? OP_T : OP_N;
  const uint64_t max_ws = workspace_bytes;
  const uint32_t align_a = alignment(g.a, g.lda, itemsize), align_b = alignment(g.b, g.ldb, itemsize),
                 align_d = alignment(g.d, g.ldd, d_itemsize);
  int device = 0;
  cudaGetDevice(&device);  // handle_for_current_device above succeeded, so this does too
  const AlgoKey key{{device, dtype, d_type, op_a, op_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, align_a, align_b, align_d,
                     static_cast<int64_t>(max_ws), heuristic, static_cast<int64_t>(g.epilogue)}};
  LtAlgo algo;
  const bool cached = g.cache_algo && find_algo(key, &algo);
#define LT_TRY(call, what)   \
  if ((s = (call)) != LT_SUCCESS) { \
    where = what;            \
    goto done;               \
  }
  LT_TRY(g_api.desc_create(&desc, COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  LT_TRY(g_api.desc_set(desc, DESC_TRANSA, &op_a, sizeof(op_a)), "set TRANSA");
  LT_TRY(g_api.desc_set(desc, DESC_TRANSB, &op_b, sizeof(op_b)), "set TRANSB");
  LT_TRY(g_api.desc_set(desc, DESC_EPILOGUE, &g.epilogue, sizeof(g.epilogue)), "set EPILOGUE");
  if (g.bias) LT_TRY(g_api.desc_set(desc, DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)), "set BIAS_POINTER");
  if (g.aux) {
    LT_TRY(g_api.desc_set(desc, DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)), "set EPILOGUE_AUX_POINTER");
    LT_TRY(g_api.desc_set(desc, DESC_EPILOGUE_AUX_LD, &g.ld_aux, sizeof(g.ld_aux)), "set EPILOGUE_AUX_LD");
  }
  LT_TRY(g_api.layout_create(&la, type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda), "layout A");
  LT_TRY(g_api.layout_create(&lb, type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb), "layout B");
  LT_TRY(g_api.layout_create(&ld, d_type, g.m, g.n, g.ldd), "layout D");
  if (!cached) {
    LT_TRY(g_api.pref_create(&pref), "PreferenceCreate");
    LT_TRY(g_api.pref_set(pref, PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)), "set MAX_WORKSPACE_BYTES");
    LT_TRY(g_api.pref_set(pref, PREF_MIN_ALIGNMENT_A, &align_a, sizeof(align_a)), "set MIN_ALIGNMENT_A");
    LT_TRY(g_api.pref_set(pref, PREF_MIN_ALIGNMENT_B, &align_b, sizeof(align_b)), "set MIN_ALIGNMENT_B");
    LT_TRY(g_api.pref_set(pref, PREF_MIN_ALIGNMENT_C, &align_d, sizeof(align_d)), "set MIN_ALIGNMENT_C");
    LT_TRY(g_api.pref_set(pref, PREF_MIN_ALIGNMENT_D, &align_d, sizeof(align_d)), "set MIN_ALIGNMENT_D");
    LT_TRY(g_api.heuristic(handle, desc, la, lb, ld, ld, pref, kMaxAlgos, results, &returned), "AlgoGetHeuristic");
    if (returned <= 0) {
      s = LT_NOT_SUPPORTED;
      where = "AlgoGetHeuristic (no algorithm)";
      goto done;
    }
    // The list is ordered by expected speed and is shorter for small problems: an index past its end
    // takes the last entry, so one index works for every shape.
    algo = results[heuristic < returned ? heuristic : returned - 1].algo;
    if (g.cache_algo) store_algo(key, algo);
  }
  LT_TRY(g_api.matmul(handle, desc, &g.alpha, g.a, la, g.b, lb, &g.beta, g.d, ld, g.d, ld, &algo, workspace,
                      workspace_bytes, static_cast<cudaStream_t>(stream)),
         "Matmul");
#undef LT_TRY
done:
  if (pref) g_api.pref_destroy(pref);
  if (ld) g_api.layout_destroy(ld);
  if (lb) g_api.layout_destroy(lb);
  if (la) g_api.layout_destroy(la);
  if (desc) g_api.desc_destroy(desc);
  if (s != LT_SUCCESS)
    return fail(s == LT_NOT_SUPPORTED ? PNF_ERR_UNSUPPORTED : PNF_ERR_CUBLAS,
                "cublasLt%s: status %d (epilogue %s, m=%lld n=%lld k=%lld, op_a=%c op_b=%c, dtype %d)", where, s,
                epilogue_name(g.epilogue), (long long)g.m, (long long)g.n, (long long)g.k, g.trans_a ? 'T' : 'N',
                g.trans_b ? 'T' : 'N', dtype);
  return pnf_check_launch();
}

enum Activation { ACT_NONE = 0, ACT_GELU = 1, ACT_RELU = 2 };  // GELU is the tanh approximation

bool valid_ld(int64_t ld, int64_t width) { return ld >= (width > 1 ? width : 1); }

}  // namespace

// Loads cuBLASLt from `path` (or, with NULL/"", libcublasLt.so.13 / .12 from the loader's search
// path). Idempotent: once loaded, later calls return PNF_OK.
PNF_EXPORT int pnf_fused_dense_init(const char* path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return load_locked(path && *path ? path : nullptr);
}

// The last error of a pnf_fused_dense_* call on this thread (cuBLASLt status and where).
PNF_EXPORT const char* pnf_fused_dense_last_error() { return g_error; }

// cuBLASLt's version number (e.g. 130100), or 0 when it is not loaded.
PNF_EXPORT size_t pnf_fused_dense_cublaslt_version() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_dl ? g_api.version() : 0;
}

// Workspace to hand every call on `device`: 32 MiB on Hopper and later (what its large-tile
// kernels use), 4 MiB before. Returns 0 if the device cannot be queried.
PNF_EXPORT size_t pnf_fused_dense_workspace_bytes(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    pnf_check_launch();
    return 0;
  }
  return (major >= 9 ? 32u : 4u) << 20;
}

// out[M,N] = act(x[M,K] @ op(w) + bias[N]). w is [K,N] (w_trans = 0) or [N,K] (w_trans = 1) with
// row stride ldw; bias may be NULL. activation: 0 none, 1 GELU (tanh), 2 ReLU. With aux non-NULL
// the pre-activation is saved too: GELU as values [M, ld_aux] (ld_aux % 8 == 0), ReLU as a bit per
// element, row m starting at bit m * ld_aux (ld_aux % 128 == 0).
PNF_EXPORT int pnf_fused_dense_fwd(int dtype, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx,
                                   const void* w, int64_t ldw, int w_trans, const void* bias, int activation,
                                   void* out, int64_t ldo, void* aux, int64_t ld_aux, int heuristic,
                                   void* workspace, size_t workspace_bytes, void* stream) {
  if (!x || !w || !out) return fail(PNF_ERR_INVALID_ARGUMENT, "null x, w or out");
  if (!valid_ld(ldx, K) || !valid_ld(ldw, w_trans ? K : N) || !valid_ld(ldo, N))
    return fail(PNF_ERR_INVALID_ARGUMENT, "row stride below the row width");
  if (activation < ACT_NONE || activation > ACT_RELU)
    return fail(PNF_ERR_INVALID_ARGUMENT, "activation %d", activation);
  if (aux && activation == ACT_NONE) return fail(PNF_ERR_INVALID_ARGUMENT, "aux without an activation");
  if (aux && (ld_aux < N || ld_aux % (activation == ACT_RELU ? 128 : 8)))
    return fail(PNF_ERR_INVALID_ARGUMENT, "ld_aux %lld: must be >= N and a multiple of %d", (long long)ld_aux,
                activation == ACT_RELU ? 128 : 8);
  uint32_t epilogue = activation == ACT_GELU ? EPI_GELU : activation == ACT_RELU ? EPI_RELU : EPI_DEFAULT;
  if (bias) epilogue = epilogue == EPI_DEFAULT ? EPI_BIAS : epilogue | EPI_BIAS;
  if (aux) epilogue |= EPI_AUX;
  // column-major out^T[N,M] = op(w)^T[N,K] @ x^T[K,M]; w row-major [K,N] is column-major N x K.
  LtGemm g{w_trans != 0, false, N, M, K, w, ldw, x, ldx, out, ldo, epilogue, bias, aux, ld_aux};
  return run_gemm(dtype, g, heuristic, workspace, workspace_bytes, stream);
}

// dw[K,N] = x[M,K]^T @ dout[M,N] and, with dbias non-NULL, dbias[N] = sum over m of dout (BGRAD
// epilogue: the bias gradient comes out of the same GEMM).
PNF_EXPORT int pnf_fused_dense_wgrad(int dtype, int64_t M, int64_t K, int64_t N, const void* x, int64_t ldx,
                                     const void* dout, int64_t lddout, void* dw, int64_t lddw, void* dbias,
                                     int heuristic, void* workspace, size_t workspace_bytes, void* stream) {
  if (!x || !dout || !dw) return fail(PNF_ERR_INVALID_ARGUMENT, "null x, dout or dw");
  if (!valid_ld(ldx, K) || !valid_ld(lddout, N) || !valid_ld(lddw, N))
    return fail(PNF_ERR_INVALID_ARGUMENT, "row stride below the row width");
  // column-major dw^T[N,K] = dout^T[N,M] @ x[M,K]; the bias gradient reduces A = dout^T over k = M.
  LtGemm g{false, true, N, K, M, dout, lddout, x, ldx, dw, lddw, dbias ? EPI_BGRADA : EPI_DEFAULT, dbias, nullptr, 0};
  return run_gemm(dtype, g, heuristic, workspace, workspace_bytes, stream);
}

// dpre[M,H] = act'(pre) * (dout[M,N] @ w[H,N]^T) where aux holds pre as pnf_fused_dense_fwd saved
// it (GELU values / ReLU bits, row stride ld_aux); with dbias non-NULL also dbias[H] = sum over m of
// dpre. activation: 1 GELU (tanh), 2 ReLU.
PNF_EXPORT int pnf_fused_dense_bwd_act(int dtype, int64_t M, int64_t H, int64_t N, const void* dout, int64_t lddout,
                                       const void* w, int64_t ldw, const void* aux, int64_t ld_aux, int activation,
                                       void* dpre, int64_t lddpre, void* dbias, int heuristic, void* workspace,
                                       size_t workspace_bytes, void* stream) {
  if (!dout || !w || !aux || !dpre) return fail(PNF_ERR_INVALID_ARGUMENT, "null dout, w, aux or dpre");
  if (activation != ACT_GELU && activation != ACT_RELU)
    return fail(PNF_ERR_INVALID_ARGUMENT, "activation %d: the backward epilogue takes 1 (GELU) or 2 (ReLU)",
                activation);
  if (!valid_ld(lddout, N) || !valid_ld(ldw, N) || !valid_ld(lddpre, H) || ld_aux < H ||
      ld_aux % (activation == ACT_RELU ? 128 : 8))
    return fail(PNF_ERR_INVALID_ARGUMENT, "row stride below the row width, or ld_aux not aligned");
  uint32_t epilogue = activation == ACT_GELU ? (dbias ? EPI_DGELU_BGRAD : EPI_DGELU)
                                             : (dbias ? EPI_DRELU_BGRAD : EPI_DRELU);
  // column-major dpre^T[H,M] = w[H,N] @ dout^T[N,M]; w row-major [H,N] is column-major N x H, so op T.
  LtGemm g{true, false, H, M, N, w, ldw, dout, lddout, dpre, lddpre, epilogue, dbias, aux, ld_aux};
  return run_gemm(dtype, g, heuristic, workspace, workspace_bytes, stream);
}

// Row-major D[M,N] = alpha op(A) @ op(B) + beta D, fp32 accumulation: op(A) = A[M,K] (trans_a = 0)
// or A[K,M]^T; op(B) = B[K,N] (trans_b = 0) or B[N,K]^T; row strides lda, ldb, ldd. A and B share
// `dtype`; D is `d_dtype` (the same, or fp32 to accumulate 16-bit products in fp32). beta = 0 does
// not read D. The linear cross-entropy's chunked GEMMs (logits, dW, dh) all go through here.
PNF_EXPORT int pnf_gemm(int dtype, int d_dtype, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                        float alpha, const void* a, int64_t lda, const void* b, int64_t ldb, float beta, void* d,
                        int64_t ldd, int heuristic, void* workspace, size_t workspace_bytes, void* stream) {
  if (!a || !b || !d) return fail(PNF_ERR_INVALID_ARGUMENT, "null a, b or d");
  if (d_dtype != dtype && d_dtype != PNF_FLOAT32)
    return fail(PNF_ERR_UNSUPPORTED, "d_dtype %d: expected the inputs' dtype %d or float32", d_dtype, dtype);
  if (!valid_ld(lda, trans_a ? M : K) || !valid_ld(ldb, trans_b ? K : N) || !valid_ld(ldd, N))
    return fail(PNF_ERR_INVALID_ARGUMENT, "row stride below the row width");
  // column-major D^T[N,M] = op(B)^T[N,K] @ op(A)^T[K,M]: B is cuBLASLt's A operand, A its B.
  LtGemm g{trans_b != 0, trans_a != 0, N, M, K, b, ldb, a, lda, d, ldd, EPI_DEFAULT, nullptr, nullptr, 0};
  g.alpha = alpha;
  g.beta = beta;
  g.d_dtype = d_dtype;
  g.cache_algo = true;
  return run_gemm(dtype, g, heuristic, workspace, workspace_bytes, stream);
}
