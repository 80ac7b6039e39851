/* device.h - kiln's CUDA layer for the rest of the library: a device on its
 * primary context with one stream and a caching allocator; NVRTC compilation
 * and modules; cuBLASLt matrix products with epilogues; CUDA graph capture.
 * Everything here assumes the driver tables of loader.h are loaded.
 */
#ifndef KILN_CUDA_DEVICE_H
#define KILN_CUDA_DEVICE_H

#include "backend/cuda/backend.h"
#include "backend/cuda/loader.h"
#include "backend/cuda/pool.h"
#include "graph/optable.h"
#include "plan/plan.h"

/* ---- errors ------------------------------------------------------------------ */

/* Turns a failed driver call into a kl__err message naming the call, the
 * CUDA error's name and text, and where: returns KL_OK for CUDA_SUCCESS,
 * KL_ENOMEM for out-of-memory, KL_EDEVICE otherwise. */
kl_status kl__cu_check(kl_ctx *ctx, CUresult r, const char *call, const char *file, int line);
#define KL_CU(ctx, fn, ...) kl__cu_check((ctx), kl__cu.fn(__VA_ARGS__), #fn, __FILE__, __LINE__)
#define KL_CU_TRY(ctx, fn, ...)                                 \
	do {                                                    \
		kl_status cu_st_ = KL_CU(ctx, fn, __VA_ARGS__); \
		if (cu_st_ != KL_OK)                            \
			return cu_st_;                          \
	} while (0)

/* ---- the device ------------------------------------------------------------------ */

struct kl_lt_state; /* blaslt.c */

typedef struct kl_cuda_dev {
	kl_ctx *ctx; /* where the allocator's errors go */
	int index;
	CUdevice dev;
	CUcontext cu; /* the device's primary context, retained */
	CUstream stream;
	char name[128];
	int cc_major, cc_minor;
	int sm_count;
	int l2_bytes;
	int smem_per_block;       /* without opt-in (48 KiB) */
	int smem_per_block_optin; /* the most a kernel may ask for after cuFuncSetAttribute */
	int smem_per_sm;
	int regs_per_block;
	int max_threads_per_block;
	int warp_size;
	size_t total_mem;
	kl_pool pool;
	/* launches flagged KL_LAUNCH_PDL overlap the kernel before them (sm_90
	 * and later; KILN_CUDA_PDL=0 turns it off) */
	bool pdl;
	bool capturing;         /* inside kl__cuda_capture_begin/end */
	bool synced;            /* the stream was waited for once (the startup log) */
	struct kl_lt_state *lt; /* cuBLASLt handle, plans, workspace: made at device open */
	kl_cuda_hooks hooks;          /* lent by the layers above (kl__cuda_ctx_init) */
	void *eager; /* hooks.exec_generated's state (runtime/cuda/eager_cuda.c) */
	struct kl_cuda_attn *attn;    /* attention_cuda.c: compiled attention kernels, workspace */
	struct kl_cuda_optim *optim;  /* optim_cuda.c: the fused optimizer's modules, table */
	struct kl_cuda_cw *cw;        /* cache_write_cuda.c: its kernel, the error word */
	struct kl_cuda_gemv *gemv;    /* gemv_cuda.c: the few-row product's modules */
	struct kl_cuda_pkgmod *pkgmods; /* fixed kernels' images a package brought (nvrtc.c) */
	int npkgmods;
} kl_cuda_dev;

/* The number of CUDA devices (loads the driver). */
kl_status kl__cuda_device_count(kl_ctx *ctx, int *n);
/* Opens device `index`: retains its primary context, reads its properties,
 * makes the stream. Errors name the device and the driver's reason. */
kl_status kl__cuda_dev_open(kl_ctx *ctx, int index, kl_cuda_dev **out);
/* Waits for the stream, frees every block and the device state. */
void kl__cuda_dev_close(kl_cuda_dev *d);
/* Makes d's context current on this thread (cheap when it already is). */
kl_status kl__cuda_bind(kl_ctx *ctx, kl_cuda_dev *d);

/* Device memory from the caching allocator (256-byte aligned or better). */
kl_status kl__cuda_malloc(kl_ctx *ctx, kl_cuda_dev *d, size_t nbytes, CUdeviceptr *out);
kl_status kl__cuda_free(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr p);

/* Copies on the stream. h2d returns once src may be reused (the driver stages
 * pageable memory); d2h waits for the stream, so dst is ready on return. */
kl_status kl__cuda_h2d(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, const void *src, size_t n);
kl_status kl__cuda_d2h(kl_ctx *ctx, kl_cuda_dev *d, void *dst, CUdeviceptr src, size_t n);
kl_status kl__cuda_d2d(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, CUdeviceptr src, size_t n);
kl_status kl__cuda_memset(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, unsigned char v, size_t n);
kl_status kl__cuda_sync(kl_ctx *ctx, kl_cuda_dev *d);
kl_status kl__cuda_mem_info(kl_ctx *ctx, kl_cuda_dev *d, size_t *free_bytes, size_t *total);

/* Events for timing on the stream. */
kl_status kl__cuda_event_new(kl_ctx *ctx, kl_cuda_dev *d, CUevent *ev);
kl_status kl__cuda_event_record(kl_ctx *ctx, kl_cuda_dev *d, CUevent ev);
/* Milliseconds between two recorded events (waits for `end`). */
kl_status kl__cuda_event_ms(kl_ctx *ctx, CUevent start, CUevent end, float *ms);
void kl__cuda_event_free(kl_cuda_dev *d, CUevent ev);

/* ---- NVRTC and modules ------------------------------------------------------------ */

/* Every source compiled through kl__nvrtc_compile may #include this header:
 * f16/bf16 storage types and conversions, 16-byte vector access, warp and
 * block reductions. It needs no toolkit headers, so it works with NVRTC
 * alone (NVRTC ships no cuda_fp16.h of its own). */
#define KL_CUDA_PRELUDE_NAME "kiln_prelude.cuh"
extern const char kl__cuda_prelude[];

typedef struct kl_nvrtc_opts {
	int arch;           /* 90 for sm_90 */
	bool arch_specific; /* sm_90a (wgmma, setmaxnreg); falls back to sm_90 if NVRTC lacks it */
	bool fast_math;     /* --use_fast_math */
	bool lineinfo;      /* -lineinfo, for ncu and compute-sanitizer */
	int max_regs;       /* --maxrregcount, 0 = compiler's choice */
	bool no_fmad;       /* --fmad=false: a * b + c rounds twice, as generated C does */
	bool ptxas_info;    /* --ptxas-options=-v: registers, spills and ptxas's
	                     * performance notes in the log (for tests) */
	bool want_ptx;      /* a cubin's PTX too (kl_cuda_image.ptx_text): packages carry it
	                     * for GPUs newer than the cubin's architecture */
} kl_nvrtc_opts;

/* A compiled module image: a cubin, or PTX (text, NUL-terminated) when the
 * device is newer than every architecture this NVRTC knows. */
typedef struct kl_cuda_image {
	void *data;
	size_t size;
	bool ptx;
	int arch;  /* the architecture compiled for */
	char *log; /* NVRTC's log (warnings on success), may be NULL */
	char *ptx_text; /* want_ptx: the cubin's PTX (NUL-terminated), else NULL */
	size_t ptx_size; /* its length without the NUL */
} kl_cuda_image;

/* Compile one translation unit (name: for messages). Needs NVRTC only, no
 * GPU and no driver. On failure returns KL_ECOMPILE with the first lines of
 * the log in the message; out->log then has the whole log. out is always
 * initialized: release it with kl__cuda_image_free whatever the status. */
kl_status kl__nvrtc_compile(kl_ctx *ctx, const char *src, const char *name,
                            const kl_nvrtc_opts *opts, kl_cuda_image *out);
void kl__cuda_image_free(kl_cuda_image *im);
/* The options for d: its own architecture, everything else off. */
kl_nvrtc_opts kl__nvrtc_opts_for(const kl_cuda_dev *d);

typedef struct kl_cuda_module {
	CUmodule mod;
	kl_cuda_dev *dev;
} kl_cuda_module;

kl_status kl__cuda_module_load(kl_ctx *ctx, kl_cuda_dev *d, const kl_cuda_image *im,
                               kl_cuda_module **out);
/* compile for d, then load (one module per graph) */
kl_status kl__cuda_module_build(kl_ctx *ctx, kl_cuda_dev *d, const char *src, const char *name,
                                kl_cuda_module **out);
/* An image as a disk-cache payload: a flag byte (1: PTX text), then the
 * image (malloc'd; NULL when out of memory); and back (false when too short
 * or out of memory; im is then empty). */
uint8_t *kl__cuda_image_payload(const kl_cuda_image *im, size_t *len);
bool kl__cuda_image_from_payload(const void *payload, size_t len, kl_cuda_image *im);
/* the same through the disk cache (entry mod-<key>.klm, keyed by the source
 * and the target): a warm process loads the image without NVRTC; a corrupt
 * entry is rebuilt. arch_specific: sm_90a and the like. */
kl_status kl__cuda_module_cached(kl_ctx *ctx, kl_cuda_dev *d, const char *src, const char *name,
                                 bool arch_specific, kl_cuda_module **out);
/* The part of a fixed module's cache key that is its source (the rest is
 * the target): packages name the fixed modules they carry by it. */
uint64_t kl__cuda_module_src_key(const char *src);
/* An image a package brought for the fixed module of source key src_key
 * (arch_specific as kl__cuda_module_cached is asked): that call then loads
 * it instead of the disk cache or NVRTC, for as long as d is open. The image
 * is copied; it must suit d (the package loader picks cubin or PTX). */
kl_status kl__cuda_pkgmod_add(kl_ctx *ctx, kl_cuda_dev *d, uint64_t src_key, bool arch_specific,
                              const kl_cuda_image *im);
void kl__cuda_pkgmod_release(kl_cuda_dev *d);
kl_status kl__cuda_module_fn(kl_ctx *ctx, kl_cuda_module *m, const char *fn, CUfunction *out);
void kl__cuda_module_free(kl_cuda_module *m);

/* Lets f take smem bytes of dynamic shared memory: above 48 KiB an opt-in on
 * the function, made once before its launches; more than the device allows
 * per block is an error. */
kl_status kl__cuda_fn_smem(kl_ctx *ctx, kl_cuda_dev *d, CUfunction f, unsigned smem);
/* Launch on d's stream; args as cuLaunchKernelEx wants them (pointers to each
 * argument's value). smem above 48 KiB needs kl__cuda_fn_smem first; more
 * than the device allows is refused before the launch.
 * flags: KL_LAUNCH_PDL when the kernel calls kl_pdl_wait (kiln_prelude.cuh)
 * before any global access; on a device with d->pdl it may then start while
 * the kernel before it still runs (programmatic dependent launch; stream
 * capture keeps it as a programmatic edge). */
enum { KL_LAUNCH_PDL = 1u };
kl_status kl__cuda_launch(kl_ctx *ctx, kl_cuda_dev *d, CUfunction f, const unsigned grid[3],
                          const unsigned block[3], unsigned smem, void **args, unsigned flags);

/* ---- the fused optimizer step (optim_cuda.c) ---------------------------------------- */

/* kl_backend.optim_step: every item of l in one kernel launch. */
kl_status kl__cuda_optim_step(kl_ctx *ctx, const kl_optim_launch *l);
/* kl_backend.optim_table / optim_launch: the step in two halves, for a
 * CUDA graph (see core.h) */
kl_status kl__cuda_optim_table(kl_ctx *ctx, const kl_optim_launch *l, void **table, size_t *cap);
kl_status kl__cuda_optim_launch(kl_ctx *ctx, const kl_optim_launch *l, const void *table);
void kl__cuda_optim_release(kl_cuda_dev *d);
/* The kernel's source for parameters of dtype dt (malloc'd; NULL for a
 * dtype it does not serve or out of memory). */
char *kl__cuda_optim_source(kl_dtype dt);
/* The launch's pointer table as the kernel reads it, into out (l->n entries
 * of kl__optim_table_entry() bytes): each parameter's pointers, size and
 * first chunk of `chunk` elements; returns the chunks of all of them. */
int64_t kl__optim_table(const kl_optim_launch *l, int64_t chunk, void *out);
size_t kl__optim_table_entry(void);

/* ---- cache writes (cache_write_cuda.c) ----------------------------------------------- */

/* A KL_STEP_CACHE_WRITE on the stream: cache copied into out first unless
 * they are one buffer, then the rows (capturable: a copy and one launch).
 * All or nothing: one position out of range and no row is written; the
 * device error word then holds the first bad row, its position and tag
 * (the step's index + 1), and later writes write nothing until the check. */
kl_status kl__cuda_cache_write_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_cw_step *c,
                                    kl_dtype dt, kl_dtype pdt, CUdeviceptr cache,
                                    CUdeviceptr pos, CUdeviceptr val, CUdeviceptr out,
                                    uint64_t tag);
/* After the stream ran cache writes: a position out of range is KL_EINVAL
 * naming the row, the position and the limit (steps[tag - 1].cw gives the
 * sizes); the error word is cleared. Waits for the stream. */
kl_status kl__cuda_cache_write_check(kl_ctx *ctx, kl_cuda_dev *d, const kl_step *steps,
                                     int32_t nsteps);
/* The error word read and cleared (waits for the stream): e[0] the first
 * bad row or index + 1 (0: none), e[1] its position or value, e[2] the tag
 * of the launch that set it. */
kl_status kl__cuda_err_word(kl_ctx *ctx, kl_cuda_dev *d, uint64_t e[3]);
/* The cache write's error of a word whose tag is a step's index + 1. */
kl_status kl__cuda_cache_write_err(kl_ctx *ctx, const uint64_t e[3], const kl_step *steps,
                                   int32_t nsteps);
/* A value check on the stream (one launch, nothing waits): the first of
 * v's n values (i32 or i64, stride elements apart) outside [0, hi] goes
 * into the error word with tag, unless the word holds an error already;
 * the cache writes after it then write nothing. */
kl_status kl__cuda_value_check(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr v, kl_dtype dt,
                               int64_t n, int64_t stride, int64_t hi, uint64_t tag);
/* eager cache_write (dense operands; out is in[0] or a new tensor) */
kl_status kl__cuda_cache_write_eager(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                                     kl_tensor *out);
void kl__cuda_cache_write_release(kl_cuda_dev *d);
/* the kernel's source (malloc'd; NULL when out of memory) */
char *kl__cuda_cache_write_source(void);

/* ---- cuBLASLt -------------------------------------------------------------------- */

typedef enum kl_epilogue {
	KL_EPI_DEFAULT = 0,
	KL_EPI_RELU,
	KL_EPI_GELU, /* cuBLASLt's GELU is the tanh approximation (kl_gelu_tanh) */
	KL_EPI_BIAS,
	KL_EPI_RELU_BIAS,
	KL_EPI_GELU_BIAS
} kl_epilogue;

/* D = epilogue(alpha * A @ B + beta * C [+ bias]) over `batch` matrices, in
 * row-major terms: A is m x k, B is k x n, C and D are m x n. The epilogue
 * applies after beta * C is added: a residual that must be added after an
 * activation fuses only with KL_EPI_DEFAULT or KL_EPI_BIAS. */
typedef struct kl_gemm {
	kl_dtype ab;     /* A and B: KL_F16, KL_BF16 (f32 accumulate), KL_F32, KL_F64 */
	kl_dtype cd;     /* C, D and bias: ab, or KL_F32 when ab is f16/bf16 */
	bool allow_tf32; /* f32 only: tensor cores with tf32 inputs */
	int64_t m, n, k;
	/* element strides; one of each operand's two must be 1 */
	int64_t a_rs, a_cs, b_rs, b_cs;
	int64_t ldc, ldd; /* row strides of C and D (their column stride is 1) */
	int64_t batch;    /* >= 1 */
	int64_t a_bs, b_bs, c_bs, d_bs, bias_bs; /* batch strides, elements (0: shared) */
	kl_epilogue epi;
	double alpha, beta;
	CUdeviceptr a, b, c, d; /* c may be 0 when beta == 0 */
	CUdeviceptr bias;       /* n elements of cd; needed by the *_BIAS epilogues */
} kl_gemm;

/* ---- products of few rows (gemv_cuda.c) ------------------------------------------- */

/* The most rows of A kiln's own few-row product takes. */
#define KL_GEMV_ROWS 4
typedef struct kl_cuda_gemv kl_cuda_gemv;
/* Does kiln's few-row kernel take g (f16/bf16, one matrix, m <= KL_GEMV_ROWS,
 * A rows and B columns contiguous and 16-byte aligned)? */
bool kl__cuda_gemv_fits(const kl_gemm *g);
/* Launches it for g (kl__cuda_gemv_fits(g)); *done false: its module could
 * not be had (no NVRTC, not in a package), the caller runs cuBLASLt. */
kl_status kl__cuda_gemv(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, bool *done);
void kl__cuda_gemv_release(kl_cuda_dev *d);
/* launches of it in this process (tests) */
uint64_t kl__cuda_gemv_launches(void);
/* The kernel's source for dt (malloc'd; NULL for a dtype it does not serve
 * or out of memory). */
char *kl__cuda_gemv_source(kl_dtype dt);

/* The column-major problem cuBLASLt is given for a row-major kl_gemm:
 * D^T = B^T A^T, so cuBLASLt's A is our B and its B is our A. Plain data,
 * computed without a GPU (and tested so). */
typedef struct kl_lt_geom {
	int64_t m, n, k;                         /* cuBLASLt's: n_ours, m_ours, k */
	int trans_a, trans_b;                    /* 0: N, 1: T */
	uint64_t a_rows, a_cols, b_rows, b_cols; /* as stored */
	int64_t lda, ldb, ldc, ldd;
} kl_lt_geom;
/* Returns KL_OK, or KL_EUNSUPPORTED/KL_EINVAL with the reason in why. */
kl_status kl__lt_geometry(const kl_gemm *g, kl_lt_geom *out, char *why, size_t cap);

typedef struct kl_lt_algo {
	cublasLtMatmulAlgo_t algo;
	size_t workspace; /* bytes it needs */
	float waves;      /* cuBLASLt's estimate of its SM waves */
	/* the pointer alignments (bytes: our a, b, c, d) it was found for: on
	 * less aligned pointers kl__lt_matmul uses the heuristic's choice */
	uint32_t align[4];
} kl_lt_algo;

/* Up to `want` candidate algorithms, best first by cuBLASLt's estimate, for
 * an autotuner to time; *n receives how many. */
kl_status kl__lt_heuristics(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, int want,
                            kl_lt_algo *out, int *n);
/* Runs g on the stream with `algo`, or (NULL) the heuristic's first choice,
 * cached with the descriptors by shape. */
kl_status kl__lt_matmul(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, const kl_lt_algo *algo);
/* Milliseconds per call of g with `algo` (NULL: the heuristic's choice):
 * one warm-up call, then reps calls between two events. What an autotuner
 * compares candidates by; g's output is overwritten. */
kl_status kl__lt_time(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, const kl_lt_algo *algo,
                      int reps, float *ms);
/* g over a grid of batch dims (outermost first) with per-operand strides:
 * dims that nest are merged into one strided batch, the rest loop. g->batch
 * and g's batch strides are ignored. */
kl_status kl__lt_matmul_nd(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, int nbatch,
                           const int64_t *batch, const int64_t *a_bs, const int64_t *b_bs,
                           const int64_t *c_bs, const int64_t *d_bs);
/* A runtime matrix-product step (plan/plan.h) on buffers a, b, c: A and
 * B of dtype ab, C of cd. Its epilogue runs in cuBLASLt's: beta scales the
 * residual buffer r (mm->has_r; else C in place, read first), bias is the
 * bias buffer (mm->has_bias), relu and gelu_tanh are its RELU and GELU
 * epilogues (erf GELU has none: KL_EUNSUPPORTED). r and bias are the
 * buffers' base pointers (0 when absent). algo: an autotuned choice for
 * kl__lt_step_gemm's product, or NULL. */
kl_status kl__lt_matmul_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_matmul_step *mm, kl_dtype ab,
                             kl_dtype cd, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c,
                             CUdeviceptr r, CUdeviceptr bias, const kl_lt_algo *algo);
/* The one product (batch dims merged where they nest) that each cuBLASLt
 * call of such a step computes, at its first batch offset: what an
 * autotuner asks candidates for. *lib is false when the step calls no
 * library (empty, k = 0). */
kl_status kl__lt_step_gemm(kl_ctx *ctx, const kl_matmul_step *mm, kl_dtype ab, kl_dtype cd,
                           CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, CUdeviceptr r,
                           CUdeviceptr bias, kl_gemm *out, bool *lib);
/* Whether algo (e.g. read back from the disk cache) runs g: KL_OK, or
 * KL_EFORMAT with the reason in why (cublasLtMatmulAlgoCheck's verdict,
 * its workspace). */
kl_status kl__lt_algo_check(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, const kl_lt_algo *algo,
                            char *why, size_t cap);
/* Makes d's cuBLASLt state: loads the library, creates the handle and
 * allocates the workspace (device open does this; a product retries it when
 * that failed, and reports why). */
kl_status kl__lt_open(kl_ctx *ctx, kl_cuda_dev *d);
/* Builds the descriptors of a runtime product step and asks the heuristic
 * for its algorithm, as kl__lt_matmul_step on these buffers would, so that
 * a later call on buffers of the same alignments finds both cached (a
 * compiled variant does this when its plan is ready, with stand-in
 * addresses of the alignments its buffers will have). Runs nothing. */
kl_status kl__lt_prepare_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_matmul_step *mm, kl_dtype ab,
                              kl_dtype cd, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c,
                              CUdeviceptr r, CUdeviceptr bias);
/* Frees the handle, cached plans and workspace (device close does this). */
void kl__lt_release(kl_cuda_dev *d);

/* ---- attention (attention_cuda.c, attention_src.c) -------------------------------------- */

/* The fixed CUDA source of the attention kernels (variants by macros), and
 * that of kl_attn_fa3 (attention_fa3_src.c), which follows it. */
extern const char kl__cuda_attention_src[];
extern const char kl__cuda_attention_fa3_src[];
/* That source for one variant: dtype, and head_dim 64 or 128 for the
 * tensor-core kernels (f16/bf16; wgmma 1: the sm_90a one too, two
 * warpgroups a block; 2: the same with one; 3: kl_attn_fa3 in its place,
 * TMA-fed, two consumer warpgroups and a producer warp) or 0 for the general
 * kernels; malloc'd, NULL for a variant that does not exist (or out of
 * memory). */
char *kl__cuda_attention_source(kl_dtype dt, int head_dim, int wgmma);
/* One attention step (plan/plan.h) on the stream; q, k, v, len (0 when the
 * step has no lengths) and o are the buffers' bases. lse (0: none): f32
 * [batch * tq] where the kernel also writes each row's log2-sum-exp2 of its
 * scaled scores when it is one that can (kl_attn_fa3, kl_attn_wgmma), which
 * *lse_written then says (the backward's L, kl__cuda_attention_bwd_step). */
kl_status kl__cuda_attention_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_attn_step *s,
                                  kl_dtype dt, CUdeviceptr q, CUdeviceptr k, CUdeviceptr v,
                                  CUdeviceptr len, CUdeviceptr o, CUdeviceptr lse,
                                  bool *lse_written);
/* Attention steps since the process began that ran kl_attn_fa3, those
 * that chose it but fell back to the two-warpgroup kernel (an operand that
 * no tensor map describes, too many work items, too few registers), and
 * backward steps that read L as their forward wrote it. */
void kl__cuda_attn_counts(long *fa3, long *fa3_fallbacks, long *lse_reused);
/* The attention backward's source (attention_bwd_src.c), kl_attnb_wg's
 * (attention_bwd_wg_src.c, sm_90a), and the module's source for dtype dt
 * (f16, bf16) and head dim 64 or 128, behind the forward's (wgmma: for
 * sm_90a, with kl_attnb_wg; malloc'd; NULL for a variant that does not
 * exist, or out of memory). */
extern const char kl__cuda_attention_bwd_src[];
extern const char kl__cuda_attention_bwd_wg_src[];
char *kl__cuda_attention_bwd_source(kl_dtype dt, int head_dim, bool wgmma);
/* One attention backward step (kl_attn_step.bwd) on the stream: q, k, v, the
 * forward's output o, its gradient g and the gradients' buffer out (dq, dk
 * and dv at the step's offsets and strides in it) are the buffers' bases.
 * lse: the rows' L as the forward of these q and k wrote it this call
 * (kl__cuda_attention_step), used where the backward is kl_attnb_wg instead
 * of computing it again; 0: none. */
kl_status kl__cuda_attention_bwd_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_attn_step *s,
                                      kl_dtype dt, CUdeviceptr q, CUdeviceptr k, CUdeviceptr v,
                                      CUdeviceptr o, CUdeviceptr g, CUdeviceptr out,
                                      CUdeviceptr lse);
/* Frees the kernels and the workspace (device close does this). */
void kl__cuda_attention_release(kl_cuda_dev *d);

/* ---- CUDA graphs ----------------------------------------------------------------- */

typedef struct kl_cuda_graph {
	CUgraph graph;
	CUgraphExec exec;
} kl_cuda_graph;

/* Starts capturing d's stream (thread-local mode): launches, copies and
 * library calls on it are recorded, not run. Allocation in between must be
 * served from the pool's cache: warm up before capturing. */
kl_status kl__cuda_capture_begin(kl_ctx *ctx, kl_cuda_dev *d);
/* The node the last operation captured on d's stream added (for parameter
 * updates later). */
kl_status kl__cuda_capture_last_node(kl_ctx *ctx, kl_cuda_dev *d, CUgraphNode *out);
/* Ends the capture into g and instantiates it (uploaded, ready to launch),
 * replacing whatever g held. */
kl_status kl__cuda_capture_end(kl_ctx *ctx, kl_cuda_dev *d, kl_cuda_graph *g);
kl_status kl__cuda_graph_launch(kl_ctx *ctx, kl_cuda_dev *d, const kl_cuda_graph *g);
/* The kernel nodes of g (malloc'd; free() it). */
kl_status kl__cuda_graph_kernel_nodes(kl_ctx *ctx, const kl_cuda_graph *g, CUgraphNode **nodes,
                                      int *n);
/* New arguments for one kernel node of the executable graph: same function
 * and launch shape, args as for kl__cuda_launch. */
kl_status kl__cuda_graph_set_args(kl_ctx *ctx, kl_cuda_graph *g, CUgraphNode node, void **args);
/* Full replacement of a kernel node's parameters. */
kl_status kl__cuda_graph_set_kernel(kl_ctx *ctx, kl_cuda_graph *g, CUgraphNode node,
                                    const CUDA_KERNEL_NODE_PARAMS *p);
/* The parameters a captured 1-D device-to-device memcpy node was made with
 * (KL_ESTATE when node is not a memcpy node). */
kl_status kl__cuda_graph_copy_params(kl_ctx *ctx, CUgraphNode node, CUDA_MEMCPY3D *p);
/* Re-point such a node of the executable graph: p as read back, with new
 * source and destination addresses (same size). */
kl_status kl__cuda_graph_set_copy(kl_ctx *ctx, kl_cuda_dev *d, kl_cuda_graph *g, CUgraphNode node,
                                  const CUDA_MEMCPY3D *p, CUdeviceptr dst, CUdeviceptr src);
void kl__cuda_graph_free(kl_cuda_graph *g);

extern const kl_backend kl__cuda_backend;

/* The device behind a CUDA context (ctx->backend_state). */
static inline kl_cuda_dev *kl__cuda_dev_of(const kl_ctx *ctx)
{
	return (kl_cuda_dev *)ctx->backend_state;
}

#endif /* KILN_CUDA_DEVICE_H */
