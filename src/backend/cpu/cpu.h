/* cpu.h - private to the CPU backend: the inline dtype conversions its hot
 * loops use, the compute-type rules, chunk converters, and the entry point of
 * each kernel family (pointwise, reduce, movement, matmul, rows, sources).
 */
#ifndef KILN_CPU_H
#define KILN_CPU_H

#include <stdint.h>
#include <string.h>

#include "core/core.h"
#include "core/sat.h"
#include "graph/graph.h"
#include "graph/optable.h"
#include "plan/plan.h"

extern const kl_backend kl__cpu_backend;

/* OpenBLAS runs single-threaded while a context is alive (backend/cpu/blas.c:
 * kiln splits its products over its own thread pool instead): the first
 * kl_ctx_new sets its thread count to 1, the last kl_ctx_free puts it back. */
void kl__blas_hold(void);
void kl__blas_release(void);

/* Below this many elements a parallel region costs more than it saves. */
#define KL_CPU_PAR_MIN 32768
/* Elements per chunk of the strided paths: small enough that a handful of
 * chunk buffers live on the stack and in L1. */
#define KL_CPU_CHUNK 512

/* A hot function built for AVX-512 and AVX2+FMA beside the baseline x86-64
 * the library is compiled for, the CPU picking one when the library loads
 * (GCC's target_clones; elsewhere nothing): the vector exp and tanh loops
 * run 2-4 times the SSE2 width. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KL_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KL_CPU_CLONES
#endif

/* Mark a loop for vectorization. The build is -O2, whose cost model leaves
 * most loops scalar; an OpenMP simd loop is vectorized regardless, and every
 * loop marked so has independent iterations. */
#define KL_SIMD _Pragma("omp simd")

int kl__cpu_threads(const kl_ctx *ctx);

/* kiln's thread pool (pool.c): fn(arg, lo, hi) over chunks covering [0, n),
 * on at most nt threads, the caller one of them; returns when every chunk has
 * run. Workers spin briefly, then sleep; a chunk is claimed when a thread
 * gets to it, so a thread the scheduler holds back leaves its share to the
 * others. Inside a chunk (or while another thread's region runs) the loop
 * runs inline on the calling thread. */
typedef void (*kl_par_fn)(void *arg, int64_t lo, int64_t hi);
void kl__par_for(int nt, int64_t n, kl_par_fn fn, void *arg);
/* whether this thread is running a chunk of a region */
bool kl__par_active(void);
/* The generated C's regions (kl__par_for_call, bound into each loaded
 * binary) use the thread count the executor set for the running call. */
void kl__par_set_threads(int nt);
int kl__par_threads(void);
void kl__par_for_call(int64_t n, kl_par_fn fn, void *arg);
/* The cores this process may run on: its affinity mask, capped by a cgroup
 * CPU quota (v2 cpu.max or v1 cfs), at most KL_MAX_THREADS; a context's
 * default thread count. */
int kl__cpu_cores(void);

/* The fused optimizer step (optim_cpu.c): kl_backend.optim_step. */
kl_status kl__cpu_optim_step(kl_ctx *ctx, const kl_optim_launch *l);

/* Products through OpenBLAS (blas.c), row-major as cblas: C = alpha op(A)
 * op(B) + beta C, and y = alpha op(W) x + beta y with y contiguous; f64
 * picks d over s. Split over nt threads of kiln's pool (pool.c), OpenBLAS
 * single-threaded; inside a parallel region, or when small, one call. The
 * enum is cblas's, as an int here so that this header needs no cblas.h. */
void kl__blas_gemm(int nt, bool f64, int ta, int tb, int m, int n, int k, double alpha,
                   const void *A, int lda, const void *B, int ldb, double beta, void *C,
                   int ldc);
void kl__blas_gemv(int nt, bool f64, int tw, int rows, int cols, double alpha, const void *W,
                   int ldw, const void *x, int incx, double beta, void *y);

/* kiln's own f32 product for few rows against a row-major weight
 * (gemm_small.c): C = alpha A W^T + beta C, A m x k, W n x k, both with k
 * contiguous; kl__gemm_small computes C's columns [j0, j1). Used by
 * kl__blas_gemm where kl__gemm_small_fits: OpenBLAS's packing costs such
 * shapes more than their products. A product step's epilogue rides along:
 * C = act(C + rbeta R + bias) on each block of columns while it is in L1
 * (R: m x n at row stride ldr, or NULL; bias: n values, or NULL; act
 * KL_OP_INPUT for none), so a zeroed tail of the struct is a plain product.
 * kl__gemm_small_par: the product over nt threads of the pool, each a share
 * of C's columns, when it is big enough to repay the region. */
typedef struct kl_gemm_small {
	int m, n, k, lda, ldw, ldc;
	float alpha, beta;
	const float *A, *W;
	float *C;
	const float *R, *bias;
	int ldr;
	float rbeta;
	kl_op act;
} kl_gemm_small;
bool kl__gemm_small_fits(int m, int n, int k);
void kl__gemm_small(const kl_gemm_small *g, int j0, int j1);
void kl__gemm_small_par(int nt, const kl_gemm_small *g);

/* kiln's own f32 product for medium shapes on AVX-512 or AVX2
 * (gemm_mid.c): the same C = alpha A W^T + beta C and epilogue as
 * kl_gemm_small's, with W stored n x k, or k x n (C = alpha A W + beta C)
 * where w_kn; B packed in panels a call, the product split over nt
 * threads. kl__gemm_mid_fits: the shapes where it is ahead of OpenBLAS
 * (never without AVX2 and FMA);
 * kl__gemm_mid_par returns false (nothing done) where it cannot run. */
bool kl__gemm_mid_fits(int m, int n, int k);
bool kl__gemm_mid_par(int nt, const kl_gemm_small *g, bool w_kn, const float *pre);
/* B packed ahead, for a weight that outlives the call (a compiled plan's
 * parameter, matmul_step.c): kl__gemm_mid_packed_floats(n, k) floats at
 * dst (64-byte aligned), then passed as kl__gemm_mid_par's pre; false
 * (nothing written) where gemm_mid cannot run */
size_t kl__gemm_mid_packed_floats(int n, int k);
bool kl__gemm_mid_packed_fits(int m, int n, int k);
bool kl__gemm_mid_pack(const kl_gemm_small *g, bool w_kn, float *dst);
/* tests and measurements: 3 runs the AVX2 half where the CPU has AVX-512
 * too, 1 none (OpenBLAS takes every product), 0 the widest again; returns
 * the half now in use (4, 3, or 0: none). Packings made before are in the
 * other half's layout: call it before any. */
int kl__gemm_mid_force_isa(int level);

/* e^x in float, branch-free so that loops over it vectorize (libm's expf
 * is a call per element). x = n ln2 + r with |r| <= ln2/2 (ln2 split in a
 * short exact head and a tail); e^r by Taylor to degree 7, whose truncation
 * error (< 1e-8) is below float's rounding; 2^n applied as two exponent
 * factors so that overflow gives inf and small results round once into the
 * subnormals. Within 2 ulp of the exact value; NaN and +-inf as libm. */
static inline float kl__cpu_expf(float x)
{
	float xc = x > 88.8f ? 88.8f : x;
	xc = xc < -104.0f ? -104.0f : xc;
	/* round to nearest integer by the 1.5 * 2^23 trick (no SSE4 needed) */
	float nf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
	float r = xc - nf * 0.693359375f;
	r = r + nf * 2.12194440e-4f;
	float p = 1.0f / 5040;
	p = p * r + 1.0f / 720;
	p = p * r + 1.0f / 120;
	p = p * r + 1.0f / 24;
	p = p * r + 1.0f / 6;
	p = p * r + 0.5f;
	p = p * r + 1.0f;
	p = p * r + 1.0f;
	float nz = nf == nf ? nf : 0.0f; /* NaN: p is NaN already */
	int32_t n = (int32_t)nz;
	int32_t n1 = n / 2, n2 = n - n1;
	float s1 = kl__bits_f32((uint32_t)(n1 + 127) << 23);
	float s2 = kl__bits_f32((uint32_t)(n2 + 127) << 23);
	return p * s1 * s2;
}

/* tanh in float, branch-free (libm's tanhf is a call per element: 4096^2
 * took 139 ms on 2 threads). |x| < 0.55: the odd Taylor series to x^17, whose
 * remainder there is below 1e-8 relative; above: 1 - 2 / (e^2|x| + 1), no
 * worse than the exp's error since tanh >= 0.5 there, with |x| capped at 9.5
 * (tanh is 1 in float from 9.01). The sign is x's (so -0 stays -0); NaN gives
 * NaN, +-inf gives +-1, subnormals themselves. */
static inline float kl__cpu_tanhf(float x)
{
	float ax = x < 0 ? -x : x;
	float z = x * x;
	float p = 6404582.0f / 10854718875.0f;
	p = p * z - 929569.0f / 638512875.0f;
	p = p * z + 21844.0f / 6081075.0f;
	p = p * z - 1382.0f / 155925.0f;
	p = p * z + 62.0f / 2835.0f;
	p = p * z - 17.0f / 315.0f;
	p = p * z + 2.0f / 15.0f;
	p = p * z - 1.0f / 3.0f;
	float small = x == 0 ? x : x + x * (z * p); /* -0 stays -0 */
	float ac = ax > 9.5f ? 9.5f : ax; /* NaN stays NaN */
	float big = 1.0f - 2.0f / (kl__cpu_expf(2.0f * ac) + 1.0f);
	big = x < 0 ? -big : big;
	return ax < 0.55f ? small : big;
}

/* erfc in float, branch-free (libm's erfcf is a call per element: exact
 * GELU's epilogue spent as long in it as in its product). |x| < 0.5:
 * 1 - x P(x^2), P a least-squares fit of erf(x)/x (relative error 6e-8).
 * Above: erfc(|x|) = e^-x^2 R(t), t = 1/(1 + |x|/2), R a fit of degree 9 in
 * t of erfc(x) e^(x^2) on [0.5, 10.5] (relative error 3e-8); e^-x^2 as
 * e^-h^2 e^-(x-h)(x+h) with h x's leading 12 bits (h^2 exact), so that x^2's
 * rounding does not cost ~x^2 ulps (the second factor's argument is small:
 * a polynomial); |x| capped at 10.5, past which erfc is
 * below half the least subnormal (0); erfc(-|x|) = 2 - erfc(|x|). Within
 * 7 ulp (4e-7 relative) against double's erfc over every 61st float of
 * [-11, 11]; NaN gives NaN, +inf 0, -inf 2. */
static inline float kl__cpu_erfcf(float x)
{
	float z = x * x;
	float p = 4.717543721e-03f;
	p = p * z - 2.675696090e-02f;
	p = p * z + 1.128281951e-01f;
	p = p * z - 3.761260808e-01f;
	p = p * z + 1.128379107e+00f;
	float small = 1.0f - x * p;
	float ax = x < 0 ? -x : x;
	float a = ax > 10.5f ? 10.5f : ax; /* NaN stays NaN */
	a = a < 0.5f ? 0.5f : a;
	float t = 1.0f / (1.0f + 0.5f * a);
	float r = -7.389768213e-02f;
	r = r * t + 3.489510417e-01f;
	r = r * t - 6.065953374e-01f;
	r = r * t + 4.017040730e-01f;
	r = r * t - 1.050492004e-01f;
	r = r * t + 2.341403663e-01f;
	r = r * t + 2.351631224e-01f;
	r = r * t + 2.835870683e-01f;
	r = r * t + 2.819853425e-01f;
	r = r * t + 3.500574167e-06f;
	float h = kl__bits_f32(kl__f32_bits(a) & 0xfffff000u);
	/* d = (a - h)(a + h) < a^2 2^-10 <= 0.108: e^-d by Taylor to degree 6
	 * (remainder below 3e-11), not a second exp (a fifth of GELU's time) */
	float d = (a - h) * (a + h);
	float q = 1.0f / 720;
	q = q * d - 1.0f / 120;
	q = q * d + 1.0f / 24;
	q = q * d - 1.0f / 6;
	q = q * d + 0.5f;
	q = q * d - 1.0f;
	q = q * d + 1.0f;
	float big = r * kl__cpu_expf(-h * h) * q;
	big = x < 0 ? 2.0f - big : big;
	return ax < 0.5f ? small : big;
}

/* Integers narrow by wrapping (two's complement), as torch does. */
static inline int32_t kl__cpu_wrap_i32(int64_t v)
{
	uint32_t u = (uint32_t)(uint64_t)v;
	int32_t r;
	memcpy(&r, &u, 4);
	return r;
}

/* ---- compute types ----------------------------------------------------------
 * f16/bf16/f32 compute in float, f64 in double, integers and bool in int64. */

typedef enum kl_cpu_ct { KL_CT_F32, KL_CT_F64, KL_CT_I64 } kl_cpu_ct;

static inline kl_cpu_ct kl__cpu_ct(kl_dtype dt)
{
	switch (dt) {
	case KL_F32:
	case KL_F16:
	case KL_BF16:
		return KL_CT_F32;
	case KL_F64:
		return KL_CT_F64;
	default:
		return KL_CT_I64;
	}
}

/* the dtype whose memory already is the compute type */
static inline kl_dtype kl__cpu_ct_dtype(kl_cpu_ct ct)
{
	return ct == KL_CT_F32 ? KL_F32 : ct == KL_CT_F64 ? KL_F64 : KL_I64;
}

static inline size_t kl__cpu_ct_size(kl_cpu_ct ct)
{
	return ct == KL_CT_F32 ? 4 : 8;
}

/* n elements of dtype dt at src (element stride, may be 0) into a dense
 * compute-type array. */
void kl__cpu_load_f32(float *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n);
void kl__cpu_load_f64(double *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n);
void kl__cpu_load_i64(int64_t *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n);
void kl__cpu_load_ct(kl_cpu_ct ct, void *dst, const void *src, kl_dtype dt, int64_t stride,
                     int64_t n);
/* n dense compute-type values into dtype dt at dst with element stride. */
void kl__cpu_store_f32(void *dst, kl_dtype dt, int64_t stride, const float *src, int64_t n);
void kl__cpu_store_f64(void *dst, kl_dtype dt, int64_t stride, const double *src, int64_t n);
void kl__cpu_store_i64(void *dst, kl_dtype dt, int64_t stride, const int64_t *src, int64_t n);
void kl__cpu_store_ct(kl_cpu_ct ct, void *dst, kl_dtype dt, int64_t stride, const void *src,
                      int64_t n);

/* Merge dims that every operand walks contiguously and drop size-1 dims.
 * st[k] are the strides of operand k. Returns the new ndim (>= 1; a
 * zero-dim or all-ones shape becomes [1]). */
int kl__cpu_coalesce(int ndim, int64_t *shape, int nops, int64_t (*st)[KL_MAX_DIMS]);

/* ---- kernel families ---------------------------------------------------- */

kl_status kl__cpu_pointwise(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
/* Tests only: every pointwise op through the op table's math (the path an
 * op without a hand-written loop takes), so that path is held to the
 * reference too. */
extern bool kl__cpu_pw_generic_only;
/* Tests: every eager reduction through the op table's row rule (reduce.c). */
extern bool kl__cpu_rd_generic_only;
/* attention_cpu.c: s[j] = e^(s[j] - mx) for j < n, returning their sum: the
 * attention kernels' row loop (f32: built for the wider vector units too). */
float kl__cpu_exp_row_f32(float *s, int64_t n, float mx);
double kl__cpu_exp_row_f64(double *s, int64_t n, double mx);
/* attention_cpu.c: one attention step over q, k, v, o (their buffers' bases);
 * false when out of memory. kl__cpu_sdpa: the eager op on tensors. */
bool kl__cpu_attention(const kl_attn_step *a, kl_dtype dt, const void *q, const void *k,
                       const void *v, const void *lens, void *o);
kl_status kl__cpu_sdpa(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
/* attention_bwd_cpu.c: the attention step's backward mode (a->bwd) over q,
 * k, v, the forward's output o, its gradient go and the packed result out;
 * false when out of memory. kl__cpu_sdpa_bwd: the eager sdpa_bwd. */
bool kl__cpu_attention_bwd(const kl_attn_step *a, kl_dtype dt, const void *q, const void *k,
                           const void *v, const void *o, const void *go, void *out);
kl_status kl__cpu_sdpa_bwd(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                           kl_tensor *out);
kl_status kl__cpu_reduce(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
kl_status kl__cpu_contiguous(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                             kl_tensor *out);
kl_status kl__cpu_concat(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
/* out[i, ...] = table[idx[i], ...]; an index out of range is an error naming it */
kl_status kl__cpu_gather(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
/* cache_write (graph/ops.def) over dense buffers: values' rows into the
 * cache at their positions (pdt i32/i64). Checks every position before it
 * writes; returns -1, or the first row whose position is out of range
 * (nothing written). */
int64_t kl__cpu_cache_rows(const kl_cw_geom *g, size_t es, kl_dtype pdt, void *cache,
                           const void *pos, const void *val);
/* The error of a position out of range, naming kl_cache_write, the row,
 * the position and the limit. */
kl_status kl__cache_write_range_err(kl_ctx *ctx, const kl_cw_geom *g, int axis, int64_t row,
                                    int64_t pos);
/* eager cache_write: out is in[0] (in place) or a new tensor */
kl_status kl__cpu_cache_write(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                              kl_tensor *out);
kl_status kl__cpu_index_add(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                            kl_tensor *out);
kl_status kl__cpu_matmul(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
kl_status kl__cpu_rows(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);
kl_status kl__cpu_source(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out);

/* A unary float op without attributes (relu, gelu, gelu_tanh, exp, ...) over
 * n dense values, as the eager kernels compute it; o must not overlap a.
 * The compiled CPU executor applies product epilogues through these. */
void kl__cpu_unary_f32(kl_op op, const float *a, float *restrict o, int64_t n);
void kl__cpu_unary_f64(kl_op op, const double *a, double *restrict o, int64_t n);

/* The op's public name for messages. */
const char *kl__cpu_opname(const kl_node *n);

/* ---- plan steps the runtime's executor hands the CPU ------------------------ */

/* A product step's B packed ahead for gemm_mid, kept by the compiled plan
 * from call to call (a Linear's weight is packed once, as ONNX Runtime
 * prepacks its initializers): valid while B is the same storage
 * (kl_storage.id) at the same version, offset, shape, strides and dtype
 * (a symbolic dim may give one storage's views other shapes from call to
 * call); any write in place bumps the version and the next call packs
 * again. */
typedef struct kl_mm_key {
	uint64_t id, version; /* B's storage; id 0: none */
	int64_t off, n, k, rs, cs; /* B's offset, shape and strides as the step reads it */
	int64_t dtype;
} kl_mm_key;
typedef struct kl_mm_pack {
	kl_mm_key key; /* what p holds (id 0: nothing) */
	float *p;      /* 64-byte aligned */
	size_t floats; /* allocated */
	/* the B of the last call that did not pack: a weight is packed at its
	 * second call unchanged, so that one rewritten every step (training)
	 * is never packed for one use */
	kl_mm_key seen;
} kl_mm_pack;
/* B's storage this call (id 0: not a caller's tensor, nothing kept) */
typedef struct kl_mm_weight {
	uint64_t id, version;
} kl_mm_weight;
void kl__mm_pack_free(kl_mm_pack *pk);
/* The most bytes a compiled plan keeps packed (past it, products pack per
 * call as before) */
#define KL_MM_PACK_MAX ((size_t)512 << 20)

/* matmul_step.c: step on the plan's buffers (bufs: its buffer table, B: their
 * addresses); *scratch (*scratch_cap bytes) is the caller's conversion
 * buffer, grown as needed; pk (or NULL) the step's packed weight, w B's
 * storage, *pack_bytes the plan's packed total. KL_ENOMEM with ctx's error
 * set on failure. */
kl_status kl__cpu_matmul_step(kl_ctx *ctx, const kl_matmul_step *step, const kl_buf *bufs,
                              void *const *B, void **scratch, size_t *scratch_cap,
                              kl_mm_pack *pk, kl_mm_weight w, size_t *pack_bytes);

/* ---- toolchain.c: C source -> shared object -> kernel pointers ----------- */

/* A hash naming the toolchain: the compiler's resolved path, size and
 * modification time, the flags, and the host CPU (-march=native code must
 * not be loaded on another CPU). Computed without running the compiler. */
uint64_t kl__jit_cc_identity(void);
/* Compile source into a shared object inside workdir (a private directory
 * the caller owns); *so_path receives its path. KL_ECOMPILE with the first
 * lines of the compiler's stderr on failure. */
kl_status kl__jit_cc_build(kl_ctx *ctx, const char *source, const char *workdir, char *so_path,
                           size_t cap);
/* dlopen so_path and look up each kernel. */
kl_status kl__jit_load(kl_ctx *ctx, const char *so_path, char *const *names, int32_t n, void **dl,
                       kl_kernel_fn *fns);
void kl__jit_unload(void *dl);
/* Look up each kernel in a loaded binary (status code, naming fn and a
 * missing one). */
kl_status kl__jit_symbols(kl_ctx *ctx, const char *fn, kl_status code, void *dl,
                          char *const *names, int32_t n, kl_kernel_fn *fns);
/* Load a shared object from bytes in memory (an in-memory file, dlopen):
 * a package's kernels, with no file written and no compiler run. The
 * caller has checked the bytes (ELF header, checksum). */
kl_status kl__jit_load_image(kl_ctx *ctx, const char *fn, const void *bytes, size_t len, void **dl);
/* The digest of the plan a loaded binary was built for (compile.c appends
 * kl_plan_digest() to every CPU source); false when it has none. */
bool kl__jit_plan_digest(void *dl, uint64_t *out);
/* Compiler invocations so far in this process (a warm process shows none). */
long kl__jit_compiles(void);

#endif
