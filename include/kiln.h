/* kiln.h - the one public header of kiln, a tensor compiler and runtime in C11.
 *
 * Every public name starts with kl_ (types, functions) or KL_ (constants).
 * The header is the contract; docs/design.md is the map behind it.
 *
 * Errors. Every call that can fail returns NULL or a kl_status other than
 * KL_OK and leaves a message in kl_last_error(ctx) naming the op, the shapes,
 * the dtypes and the offending value, e.g.
 *     kl_add: shapes [4,3] and [5] do not broadcast
 * The message names the call the caller made, even when it failed inside
 * another op it is built on (kl_zeros, not kl_full; kl_embedding, not
 * kl_gather; "kl_add: out of memory allocating ... bytes for f32 [...]").
 * The library never exits or aborts on bad input, and a failed call writes no
 * partial output. Ops accept NULL inputs and fail cleanly, so a chain such as
 * kl_relu(kl_add(kl_mul(a, b), c)) reports the first failure and returns NULL.
 *
 * Lifetime. A tensor is a reference-counted handle.
 *  - Outside a scope, every call that returns a kl_tensor * hands the caller
 *    one reference; drop it with kl_release().
 *  - Inside kl_scope_begin(ctx) ... kl_scope_end(ctx), new tensors belong to
 *    the scope (an autorelease pool): kl_scope_end drops them. Call
 *    kl_retain() on a tensor to keep it past the scope, then kl_release() it.
 *  - Views (reshape, permute, slice, ...) share their base's memory and keep
 *    it alive; releasing the base while a view lives is fine.
 *  - kl_ctx_free() frees every tensor of the context still alive. A tensor
 *    handle must not be used after its context is freed.
 * A context and its tensors are used by one thread at a time; two contexts
 * share nothing, so separate threads may use separate contexts freely.
 */
#ifndef KILN_H
#define KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KL_VERSION_MAJOR 0
#define KL_VERSION_MINOR 1
#define KL_VERSION_PATCH 0
#define KL_VERSION_STRING "0.1.0"

#define KL_MAX_DIMS 8

/* Shapes. Every shape kiln accepts, from the caller or computed by an op, has
 * at most KL_MAX_DIMS dims, each >= 0, whose product with a zero dim counted
 * as 1 is at most KL_MAX_NUMEL. So numel, contiguous strides and the byte size
 * (at most 2^62) always fit an int64_t. Anything else is KL_EINVAL naming
 * the call and the shape, e.g.
 *     kl_reshape: cannot reshape [4,6] (24 elements) to [1099511627776,
 *     1099511627776]: its dims multiply past 2^59 (KL_MAX_NUMEL; a zero dim
 *     counts as 1)
 * Empty shapes are held to the same bound: {0, 2^62, 2^62} is refused (so does
 * PyTorch: its contiguous strides overflow int64), and so is {2^62, 0}, which
 * PyTorch accepts but which would make loops over rows of an empty tensor
 * run 2^62 times. */
#define KL_MAX_NUMEL (INT64_C(1) << 59)

typedef struct kl_ctx kl_ctx;
typedef struct kl_tensor kl_tensor;

typedef enum kl_status {
	KL_OK = 0,
	KL_EINVAL,       /* bad argument: shapes, axes, dtypes, NULL */
	KL_ENOMEM,       /* an allocation failed */
	KL_EDEVICE,      /* the device or its libraries are missing or failed */
	KL_EIO,          /* a file could not be read or written */
	KL_EFORMAT,      /* a file or cache entry is malformed */
	KL_EUNSUPPORTED, /* valid, but not supported on this device/dtype */
	KL_ECOMPILE,     /* the JIT compiler failed */
	KL_ESTATE        /* called in the wrong state (e.g. sync in fullgraph) */
} kl_status;

typedef enum kl_dtype {
	KL_F32 = 0,
	KL_F64,
	KL_F16,
	KL_BF16,
	KL_I32,
	KL_I64,
	KL_BOOL,
	KL_NDTYPES
} kl_dtype;

typedef enum kl_device { KL_CPU = 0, KL_CUDA = 1 } kl_device;

/* ---- contexts and errors ------------------------------------------------ */

typedef struct kl_ctx_opts {
	kl_device device; /* KL_CPU (default) or KL_CUDA */
	int index;        /* device index */
	int nthreads;     /* CPU worker threads; 0 = the cores this process may use (its
	                   * affinity mask, capped by a cgroup CPU quota); at most
	                   * KL_MAX_THREADS. Idle workers sleep after a brief spin. */
} kl_ctx_opts;

/* The most CPU worker threads a context takes (kl_ctx_opts.nthreads); more is
 * KL_EINVAL from kl_ctx_new. 1024 is far above any core count kiln runs on;
 * a team of 65536 once overflowed the stack at the first op. */
#define KL_MAX_THREADS 1024

/* opts may be NULL for a CPU context. On failure returns NULL and
 * kl_last_error(NULL) says why (for this thread). While any context is
 * alive, OpenBLAS (process-wide) runs single-threaded: kiln splits its own
 * products over its threads; the last kl_ctx_free puts OpenBLAS's thread
 * count back. */
kl_ctx *kl_ctx_new(const kl_ctx_opts *opts);
void kl_ctx_free(kl_ctx *ctx);
kl_device kl_ctx_device(const kl_ctx *ctx);
/* The CPU worker threads ctx's ops and compiled calls use (kl_ctx_opts.nthreads,
 * or the cores this process may use when that was 0); 1 for NULL. */
int kl_ctx_threads(const kl_ctx *ctx);
/* Wait until every op and compiled call issued on ctx so far has finished on
 * its device (torch.cuda.synchronize): on CUDA a wait on the context's
 * stream, on the CPU nothing (ops have finished when they return). Calls on
 * CUDA return once their work is queued, so time them between two
 * synchronizes. Inside a compiled function it is a sync point: a graph break
 * (with .fullgraph, an error). */
kl_status kl_ctx_synchronize(kl_ctx *ctx);

/* The message of the last failed call on ctx ("" if none). With ctx NULL:
 * the last failure of kl_ctx_new on this thread. */
const char *kl_last_error(const kl_ctx *ctx);
kl_status kl_last_status(const kl_ctx *ctx);
void kl_clear_error(kl_ctx *ctx);
/* Set ctx's error (printf-style message) and return status, for code built on
 * the public API (the nn layer, extensions) to report failures the same way. */
kl_status kl_set_error(kl_ctx *ctx, kl_status status, const char *fmt, ...)
#if defined(__GNUC__)
	__attribute__((format(printf, 3, 4)))
#endif
	;
const char *kl_status_name(kl_status s);
const char *kl_version(void);

/* ---- memory statistics ---------------------------------------------------- */

/* What ctx's allocator holds, in bytes as the allocator hands them out
 * (rounded up to its block sizes). On CUDA: every device allocation of the
 * context (tensors, compiled functions' arenas and static buffers, library
 * workspaces) through its caching allocator. On the CPU: tensor storage
 * (compiled functions' scratch arenas are not counted). */
typedef struct kl_memory_usage {
	size_t in_use;   /* held by live allocations now */
	size_t peak;     /* the most in_use reached since kl_ctx_new or kl_memory_reset_peak */
	size_t reserved; /* CUDA: held from the driver, cached free blocks included;
	                    CPU: in_use (the host block cache is process-wide) */
} kl_memory_usage;

kl_status kl_memory_stats(kl_ctx *ctx, kl_memory_usage *out);
/* Restart the peak from the bytes in use now. */
kl_status kl_memory_reset_peak(kl_ctx *ctx);

/* ---- dtypes --------------------------------------------------------------- */

const char *kl_dtype_name(kl_dtype dt); /* "f32", "bf16", ... */
size_t kl_dtype_size(kl_dtype dt);
bool kl_dtype_is_float(kl_dtype dt);
/* The dtype torch would give a binary op on a and b. */
kl_dtype kl_promote_types(kl_dtype a, kl_dtype b);

/* ---- tensors: lifetime and inspection ------------------------------------ */

kl_tensor *kl_retain(kl_tensor *t);
void kl_release(kl_tensor *t);
void kl_scope_begin(kl_ctx *ctx);
void kl_scope_end(kl_ctx *ctx);

kl_ctx *kl_tensor_ctx(const kl_tensor *t);
kl_dtype kl_tensor_dtype(const kl_tensor *t);
int kl_ndim(const kl_tensor *t);
const int64_t *kl_shape(const kl_tensor *t);   /* ndim entries */
const int64_t *kl_strides(const kl_tensor *t); /* in elements */
int64_t kl_dim(const kl_tensor *t, int axis);  /* negative axes count back */
int64_t kl_numel(const kl_tensor *t);
bool kl_is_contiguous(const kl_tensor *t);

/* ---- creation ------------------------------------------------------------ */

kl_tensor *kl_empty(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape);
kl_tensor *kl_zeros(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape);
kl_tensor *kl_full(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, double value);
/* 0-dim tensor holding value */
kl_tensor *kl_scalar(kl_ctx *ctx, kl_dtype dt, double value);
/* [start, stop) by step: ceil((stop - start) / step) elements */
kl_tensor *kl_arange(kl_ctx *ctx, kl_dtype dt, double start, double stop, double step);
/* Uniform [0,1) and standard normal numbers from a counter-based generator
 * (Philox-4x32-10 keyed by seed): element i of a tensor is a function of
 * (seed, i) only, so the same seed gives the same numbers on every device
 * and every thread count. */
kl_tensor *kl_rand(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, uint64_t seed);
kl_tensor *kl_randn(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, uint64_t seed);
/* A new tensor holding a copy of host data (dense, row-major, dtype dt;
 * f16 and bf16 as their 16-bit patterns, bool as one byte 0/1). nbytes is the
 * size of the buffer at data and must equal the shape's byte size (numel *
 * kl_dtype_size(dt), see kl_shape_nbytes), as kl_to_host's does: a shorter
 * or longer buffer is KL_EINVAL, never read past its end. */
kl_tensor *kl_from_host(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape,
                        const void *data, size_t nbytes);
/* The byte size of a dense tensor of dtype dt and this shape, into *nbytes.
 * KL_EINVAL for an unknown dtype or a shape kiln refuses (see KL_MAX_NUMEL),
 * with the reason in kl_last_error(NULL). */
kl_status kl_shape_nbytes(kl_dtype dt, int ndim, const int64_t *shape, size_t *nbytes);

/* ---- host access (sync points: inside a compiled function, a graph break) */

/* Copy t, dense row-major in its own dtype, to dst; nbytes must equal
 * numel * dtype size. */
kl_status kl_to_host(kl_tensor *t, void *dst, size_t nbytes);
/* The value of a one-element tensor, as a double. */
kl_status kl_item(kl_tensor *t, double *out);
/* Print values (torch's layout: above 1000 elements only the edges of each
 * dim), shape and dtype, e.g. "tensor([[1., 2.]], size=[1,2], dtype=f32)". */
kl_status kl_print(kl_tensor *t, FILE *f);

/* ---- writing in place ---------------------------------------------------- */

/* torch's dst.copy_(src): write src's values, broadcast to dst's shape and
 * cast to dst's dtype, into dst's memory (which dst's views share). dst may
 * be strided but must not repeat an element (a stride-0 dim); src may
 * overlap it. Every write bumps the version counter of dst's memory, which
 * compiled functions that captured dst guard (see kl_fn_body). A dense dst
 * is written by one copy on its device, a strided one through the host.
 * Inside a compiled function the write is recorded: src's value becomes an
 * output of the graph and is written into dst when the graph ends (at the
 * function's return or at a graph break); until then the function reads
 * dst itself as the new value, and reading another tensor that overlaps
 * dst's memory is an error. dst must exist before the call (not a tensor
 * made inside it). A fullgraph function that writes replays its plan and
 * repeats the writes (see kl_fn_body: dst is state, not guarded by version). */
kl_status kl_copy(kl_tensor *dst, kl_tensor *src);

/* ---- pointwise ops (numpy/torch broadcasting and type promotion) ---------
 * The result dtype is torch.result_type's: categories bool < int < float;
 * dimensioned tensors decide within their category; a 0-dim tensor counts
 * only when its category is above theirs (f16 tensor + f32 0-dim: f16;
 * i32 tensor + f64 0-dim: f64), and is then converted to the result dtype
 * like every operand; a number (the _scalar forms, clamp's bounds) counts
 * only across categories, as i64 if integral, else f32. */

kl_tensor *kl_add(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_sub(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_mul(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_div(kl_tensor *a, kl_tensor *b); /* true division: ints give f32 */
kl_tensor *kl_pow(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_maximum(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_minimum(kl_tensor *a, kl_tensor *b);
/* comparisons give KL_BOOL */
kl_tensor *kl_eq(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_ne(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_lt(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_le(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_gt(kl_tensor *a, kl_tensor *b);
kl_tensor *kl_ge(kl_tensor *a, kl_tensor *b);

/* Scalar variants: s acts like a Python number (it does not widen a float
 * tensor's dtype; an integer tensor with a non-integral s becomes f32). */
kl_tensor *kl_add_scalar(kl_tensor *a, double s);
kl_tensor *kl_sub_scalar(kl_tensor *a, double s);
kl_tensor *kl_mul_scalar(kl_tensor *a, double s);
kl_tensor *kl_div_scalar(kl_tensor *a, double s);
kl_tensor *kl_pow_scalar(kl_tensor *a, double s);
kl_tensor *kl_maximum_scalar(kl_tensor *a, double s);
kl_tensor *kl_minimum_scalar(kl_tensor *a, double s);
kl_tensor *kl_eq_scalar(kl_tensor *a, double s);
kl_tensor *kl_ne_scalar(kl_tensor *a, double s);
kl_tensor *kl_lt_scalar(kl_tensor *a, double s);
kl_tensor *kl_le_scalar(kl_tensor *a, double s);
kl_tensor *kl_gt_scalar(kl_tensor *a, double s);
kl_tensor *kl_ge_scalar(kl_tensor *a, double s);

kl_tensor *kl_neg(kl_tensor *a);
kl_tensor *kl_abs(kl_tensor *a);
kl_tensor *kl_exp(kl_tensor *a);
kl_tensor *kl_log(kl_tensor *a);
kl_tensor *kl_sqrt(kl_tensor *a);
kl_tensor *kl_rsqrt(kl_tensor *a);
kl_tensor *kl_sin(kl_tensor *a);
kl_tensor *kl_cos(kl_tensor *a);
kl_tensor *kl_tanh(kl_tensor *a);
kl_tensor *kl_sigmoid(kl_tensor *a);
kl_tensor *kl_relu(kl_tensor *a);
kl_tensor *kl_gelu(kl_tensor *a);      /* exact: x * Phi(x) */
kl_tensor *kl_gelu_tanh(kl_tensor *a); /* tanh approximation */
kl_tensor *kl_silu(kl_tensor *a);
/* cond is KL_BOOL (any other dtype is compared with zero) */
kl_tensor *kl_where(kl_tensor *cond, kl_tensor *a, kl_tensor *b);
kl_tensor *kl_cast(kl_tensor *a, kl_dtype dt);
/* lo/hi may be -INFINITY/INFINITY to leave a side open */
kl_tensor *kl_clamp(kl_tensor *a, double lo, double hi);

/* ---- reductions ---------------------------------------------------------- */

/* axes: naxes distinct axes (negative count back); naxes == 0 reduces all. */
kl_tensor *kl_sum(kl_tensor *a, int naxes, const int *axes, bool keepdim);
kl_tensor *kl_mean(kl_tensor *a, int naxes, const int *axes, bool keepdim);
kl_tensor *kl_max(kl_tensor *a, int naxes, const int *axes, bool keepdim);
kl_tensor *kl_min(kl_tensor *a, int naxes, const int *axes, bool keepdim);
/* correction 1 = unbiased (torch's default), 0 = population */
kl_tensor *kl_var(kl_tensor *a, int naxes, const int *axes, int correction, bool keepdim);
/* index (KL_I64) of the first maximum along one axis */
kl_tensor *kl_argmax(kl_tensor *a, int axis, bool keepdim);

/* ---- movement (views where the layout allows, copies otherwise) --------- */

/* one entry of shape may be -1 */
kl_tensor *kl_reshape(kl_tensor *a, int ndim, const int64_t *shape);
kl_tensor *kl_permute(kl_tensor *a, const int *perm);
kl_tensor *kl_transpose(kl_tensor *a, int d0, int d1);
/* shape entries of -1 keep the dim; new leading dims may be added */
kl_tensor *kl_expand(kl_tensor *a, int ndim, const int64_t *shape);
/* python a[start:stop:step] along axis; step >= 1; bounds are clamped */
kl_tensor *kl_slice(kl_tensor *a, int axis, int64_t start, int64_t stop, int64_t step);
kl_tensor *kl_concat(int n, kl_tensor *const *ts, int axis);
kl_tensor *kl_contiguous(kl_tensor *a);
/* index_select on dim 0: out[i..., j...] = table[idx[i...], j...], idx i32 or
 * i64 of any shape, result shape idx.shape + table.shape[1:] (a copy). An
 * index outside [0, rows) is an error when its value is held at the call
 * (eager on any device: on CUDA the indices are copied back first, which
 * waits for the device; a tensor made before a trace, at trace time);
 * compiled code clamps it to [0, rows - 1] instead. The same holds for
 * kl_index_add, kl_one_hot and kl_cross_entropy's targets. */
kl_tensor *kl_gather(kl_tensor *table, kl_tensor *idx);
/* torch.nn.functional.embedding(idx, weight): kl_gather(weight, idx) */
kl_tensor *kl_embedding(kl_tensor *idx, kl_tensor *weight);
/* torch.index_add(base, 0, idx, src) for idx of any shape: a copy of base
 * with out[idx[i...], j...] += src[i..., j...] for every element of idx
 * (repeated indices add up), src of shape idx.shape + base.shape[1:]; base
 * and src one float dtype (f16/bf16 sum in f32). Deterministic: the same
 * bits every run, on every device (no atomics). The gradient of kl_gather.
 * An index outside [0, rows) is an error when held at the call (as
 * kl_gather); compiled code adds nothing for it. */
kl_tensor *kl_index_add(kl_tensor *base, kl_tensor *idx, kl_tensor *src);
/* KV caches: rows written at positions a program computes, so that a decode
 * step neither copies its cache nor changes shape. The cache is [R, ..., T,
 * ...] with its position dim `axis` (>= 1, negative counts from the end):
 * R rows (sequences), T positions each. values is the cache's shape with
 * r <= R rows and s <= T positions; pos (i32/i64 [r]) gives row i's first
 * position: cache[i, ..., pos[i] + j, ...] = values[i, ..., j, ...] for
 * i < r, j < s. Every pos[i] must lie in [0, T - s]: one outside is
 * KL_EINVAL naming the row, the position and the limit, and nothing is
 * written (eagerly checked on the host before the write; in a compiled
 * graph, by the step: CPU before it writes; CUDA per row on the device,
 * the error reported when the call ends, with no write out of bounds).
 * values has the cache's dtype. Not differentiable.
 *
 * kl_cache_update returns the written copy (torch's index_put).
 * kl_cache_write writes in place into cache, which must be dense and exist
 * before a compiled call (like kl_copy's dst; reads of cache after it see
 * the new rows). Inside a compiled graph the step writes the rows straight
 * into the cache's memory: a [64, 16, 2048, 64] cache costs the bytes of
 * the rows written, not of the cache (kl_explain: "cache write ... in
 * place"). */
kl_tensor *kl_cache_update(kl_tensor *cache, int axis, kl_tensor *pos, kl_tensor *values);
kl_status kl_cache_write(kl_tensor *cache, int axis, kl_tensor *pos, kl_tensor *values);
/* torch.nn.functional.one_hot(idx, n): [idx..., n] of KL_I64, 1 where the
 * class is idx's value; n >= 0 is required (no inference from the data).
 * An index outside [0, n) is an error when held at the call (as kl_gather),
 * else (compiled) a zero row. */
kl_tensor *kl_one_hot(kl_tensor *idx, int64_t n);

/* ---- contractions -------------------------------------------------------- */

/* torch.matmul semantics: 1-D and N-D operands, batch dims broadcast */
kl_tensor *kl_matmul(kl_tensor *a, kl_tensor *b);
/* x @ w^T + bias; w is [out, in] as in torch; bias may be NULL */
kl_tensor *kl_linear(kl_tensor *x, kl_tensor *w, kl_tensor *bias);

/* ---- composites ---------------------------------------------------------- */

kl_tensor *kl_softmax(kl_tensor *a, int axis);
kl_tensor *kl_log_softmax(kl_tensor *a, int axis);
/* torch.logsumexp over naxes axes (0: all): log(sum(exp(a))) computed
 * stably (max subtracted); integer input gives f32. */
kl_tensor *kl_logsumexp(kl_tensor *a, int naxes, const int *axes, bool keepdim);
/* normalize over the last dim; weight and bias ([last dim]) may be NULL */
kl_tensor *kl_layer_norm(kl_tensor *x, kl_tensor *weight, kl_tensor *bias, double eps);
kl_tensor *kl_rms_norm(kl_tensor *x, kl_tensor *weight, double eps);
/* Scaled dot-product attention, one fused op: softmax(q k^T * scale) v over
 * q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] with equal batch dims and
 * one float dtype (mixed ones promote). causal: query i sees key j iff
 * j <= i + (Tk - Tq) (a row that sees no key is NaN). Result [..., Tq, Dv].
 * scale: KL_SDPA_DEFAULT_SCALE (0) means torch's scale=None, 1/sqrt(D); any
 * other finite value (negative included) is used as given; NaN and infinities
 * are an error. (A scale of exactly 0 would make every row a plain mean of v,
 * so 0 is the "not set" value, as 0 is elsewhere in kiln's options.) */
#define KL_SDPA_DEFAULT_SCALE 0.0
kl_tensor *kl_sdpa(kl_tensor *q, kl_tensor *k, kl_tensor *v, bool causal, double scale);
/* Attention over KV caches holding a valid length per sequence (a decode
 * step): q [B, ..., Tq, D], k/v [B, ..., Tk, D/Dv] (the caches), lengths
 * (i32/i64 [B], on the device like the caches). Key j of batch row b counts
 * iff j < lengths[b]; with causal also j <= i + lengths[b] - Tq (the
 * queries are the last Tq of the row's valid positions). A row with no
 * valid key gives zeros. scale 0: 1/sqrt(D). Lengths outside [0, Tk]
 * disagree with the cache: KL_EINVAL naming the row, its length and Tk,
 * eagerly and in a compiled function (checked before each run of its
 * graph, fullgraph replays included, when lengths is a tensor the call
 * reads: an input or one reached through user state; lengths the graph
 * computes itself are not checked, and a length above Tk then counts every
 * key; a negative one none). The compiled check reads the lengths to the
 * host. A fused attention step (the sdpa op with a lengths operand): keys
 * past a row's length are never read (a cache may hold anything there),
 * on CUDA the lengths are read from device memory at run time. Same batch
 * dims for q, k and v, as kl_sdpa. */
kl_tensor *kl_sdpa_lengths(kl_tensor *q, kl_tensor *k, kl_tensor *v, kl_tensor *lengths,
                           bool causal, double scale);

/* ---- autograd ------------------------------------------------------------
 * Reverse-mode differentiation, one mechanism for eager code and compiled
 * functions. Mark leaves (parameters) with kl_set_requires_grad; with grad
 * mode on (the default), every op one of whose inputs requires grad is
 * recorded on the context's tape, together with the tensors it read (the
 * tape holds a reference to each until a backward consumes them).
 * kl_backward(loss, NULL) then computes d loss / d leaf for every marked leaf
 * the loss depends on and leaves it in the leaf's .grad (kl_grad), adding to
 * a .grad that is already there. The gradient ops are kiln ops: eagerly they
 * run at once; inside a compiled function (kl_compile) they are appended to
 * the function's graph, so forward, loss, backward and an optimizer update
 * there become one graph. A compiled function whose forward is recorded but
 * not differentiated inside it keeps the values the backward needs (those
 * a minimum cut of its forward + backward graph chooses; its graph computes
 * them as extra outputs), so kl_backward may also be called after
 * kl_fn_call: it then runs the backward as one compiled graph that also
 * computes the values not kept; kl_explain shows both. Such a call always
 * runs the function's body (no fullgraph replay), and so does a call of a
 * function whose kl_backward inside leaves gradients in .grad. The tape lets go of what no tensor the program holds
 * can reach; still, turn grad mode off for inference. Only floating-point
 * values carry gradients; integer and bool results (argmax, comparisons)
 * stop them.
 *
 * Errors (KL_EINVAL / KL_ESTATE, naming kl_backward, the op and the shapes):
 * a loss of more than one element without a cotangent; a cotangent whose
 * shape or dtype differs from the loss's; a loss that no tensor requiring
 * grad reaches (naming the op where the path stopped, e.g. argmax); an op on
 * the path without a gradient rule; a tensor the backward reads that was
 * written in place (kl_copy) after the forward used it; a graph already
 * consumed by an earlier kl_backward. A kl_backward refused for one of these
 * reasons changes no .grad and leaves the tape as it was. */

/* Mark (on) or unmark a leaf tensor as requiring gradients. Only floating
 * point tensors; a tensor computed by a recorded op is not a leaf
 * (kl_detach it first). */
kl_status kl_set_requires_grad(kl_tensor *t, bool on);
/* Whether t requires grad: a marked leaf, or the result of a recorded op. */
bool kl_requires_grad(const kl_tensor *t);
/* Differentiate loss and accumulate into the .grad of each marked leaf it
 * depends on. cotangent: d(something)/d loss, of loss's shape and dtype;
 * NULL means ones and then needs a loss of one element. The part of the
 * tape that loss depends on is consumed (freed): a second kl_backward
 * through it is an error (unless the first was kl_backward_ex with
 * retain_graph). The gradient ops themselves are
 * not recorded (with kl_backward_ex's create_graph they are). Inside a compiled function the gradients are lazy tensors
 * of its graph; each .grad set there is computed by the graph and
 * materialized when the call returns. */
kl_status kl_backward(kl_tensor *loss, kl_tensor *cotangent);
/* torch's backward(retain_graph=, create_graph=) */
typedef struct kl_backward_opts {
	/* keep the loss's graph on the tape: a later kl_backward through it
	 * (the same loss, or another that shares part of its forward) works
	 * again and adds to the same .grad; the tape holds its tensors until a
	 * backward without retain_graph consumes it or the program drops them */
	bool retain_graph;
	/* record the backward for higher derivatives (torch's create_graph;
	 * implies retain_graph): the gradient ops are recorded on the tape as
	 * any op, so each .grad it sets requires grad and a kl_backward of a
	 * function of it gives second derivatives (added to .grad as always:
	 * clear it first to read them alone). Eager only: after a compiled
	 * forward or inside a compiled function KL_EUNSUPPORTED (nothing is
	 * computed, no .grad changes). */
	bool create_graph;
} kl_backward_opts;
/* kl_backward with options (NULL: kl_backward's); errors name kl_backward_ex. */
kl_status kl_backward_ex(kl_tensor *loss, kl_tensor *cotangent, const kl_backward_opts *opts);
/* t's gradient, or NULL when it has none. A borrowed reference owned by t:
 * valid until kl_grad_clear(t), the next kl_backward that adds to it (which
 * replaces it with a new tensor), or t's release; kl_retain it to keep it
 * longer. */
kl_tensor *kl_grad(const kl_tensor *t);
/* Drop t's gradient (set to none, as torch's zero_grad(set_to_none=True):
 * no memory is written; the next backward starts from nothing). */
void kl_grad_clear(kl_tensor *t);
/* A new handle on t's value (same memory, no copy) that requires no grad
 * and is not on the tape: ops on it are not recorded. */
kl_tensor *kl_detach(kl_tensor *t);
/* Turn recording on or off for ctx (on by default); returns the previous
 * state. Turn it off for inference and around optimizer updates. */
bool kl_set_grad_enabled(kl_ctx *ctx, bool on);

/* ---- compilation (kl_compile) -------------------------------------------- */

typedef struct kl_fn kl_fn;

typedef enum kl_mode {
	KL_MODE_DEFAULT = 0,
	KL_MODE_REDUCE_OVERHEAD,          /* CUDA graphs (on the CPU: as default) */
	KL_MODE_MAX_AUTOTUNE,             /* autotune + CUDA graphs */
	KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS
} kl_mode;

/* The function kl_compile captures: reads nin tensors, writes nout new
 * tensors to out[] (references the caller of kl_fn_call then owns).
 * It must compute only through kl_ ops on its inputs, on tensors it creates
 * and on tensors it reaches through user.
 *
 * State reached through user. Plain C values fn reads there (a double passed
 * to kl_mul_scalar, a flag deciding which ops run) are baked into the graph.
 * Tensors fn reads there are captured: the compiled plan reads their memory
 * at every call, never a copy. Without .fullgraph fn runs on every call, so
 * it always reads the tensors user holds now. With .fullgraph a call replays
 * the plan without running fn, so each captured tensor is guarded:
 *  - identity: the program must still hold the tensor (a reference other
 *    than the compiled function's). Replacing it (kl_release the old one,
 *    store a new one in user) fails the guard;
 *  - version: the counter of its memory, bumped by every write in place
 *    (kl_copy, kl_cache_write). A write fails the guard, except to state:
 *    a tensor whose memory fn itself writes in place (kl_copy,
 *    kl_cache_write: a KV cache) is read from memory at every call, so
 *    writes to it, the replay's own or anyone's (a row moved between
 *    calls), keep the replay. A replay repeats fn's writes in place after
 *    the plan ran (a cache write lands in the cache's memory during it).
 *    The parameters and state a fused optimizer step inside fn updates
 *    (kl_optim_step) are state too; freeing the optimizer fails the guard.
 *    The context generator's draws (kl_dropout_rng) are made anew by each
 *    replay.
 * A failed guard makes that call run fn again: when the graph it traces is
 * the same (same dtypes, shapes, strides) the plan is re-bound to the tensors
 * fn reads now, with no compile; otherwise the graph is recompiled, which
 * counts toward recompile_limit. KILN_LOGS=recompiles logs each with its
 * reason. (A loop that writes a weight in place before every call therefore
 * runs fn on every call, as without .fullgraph, but compiles nothing.)
 * Two things no guard can see: a tensor replaced while the program
 * keeps the old one alive elsewhere, and a plain C value changed in user;
 * without .fullgraph both are seen, since fn runs on every call. */
typedef kl_status (*kl_fn_body)(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                int nout, void *user);

/* Dynamic dims. By default every input dim is guarded: a call with a new
 * size compiles a new variant (a recompile). A dim marked dynamic is left
 * out of the guard and stays a symbol through the compiled plan (generated
 * kernels take it as an argument; BLAS products and fused attention take
 * their sizes per call; buffers are planned per size), so one variant runs
 * every size of it, 0 and 1 included.
 *
 * Mark dims per input with a bitmask, bit d = dim d (KL_DIM(d) = 1u << d),
 * dims counted from 0 as kl_shape gives them:
 *     // x [B, T, d]: batch and sequence dynamic, the hidden size static
 *     kl_compile_opts o = {.ndynamic_dims = 1,
 *                          .dynamic_dims = (uint32_t[]){KL_DIM(0) | KL_DIM(1)}};
 *     kl_fn *f = kl_compile(ctx, block, &weights, 1, 1, &o);
 * dynamic_dims[i] is input i's mask for i < ndynamic_dims; inputs past it
 * are static. Or .dynamic = KL_DYNAMIC_ALL marks every dim of every input.
 * Any other value of .dynamic (1, say) is KL_EINVAL naming what to write.
 *
 * A dim that must be static (a product's reduction dim meeting a weight,
 * e.g. the hidden size; the length of a kl_arange fn builds from a number;
 * a slice's bounds) is specialised: compiled at its traced size and
 * guarded, alone; the other dims stay symbolic. A dim first traced at size
 * 0 or 1 is specialised too (as Dynamo does), so trace with a typical size.
 * kl_explain lists each marked dim of each variant as symbolic or
 * specialised with why; kl_fn_dim_state gives the same to a program. */
#define KL_DYNAMIC_ALL (-1)
#define KL_DIM(d) (1u << (d))

typedef struct kl_compile_opts {
	kl_mode mode;
	bool fullgraph;      /* a sync point inside fn is an error; replay skips fn
	                      * while its guards (inputs, captured tensors) hold */
	bool disable;        /* run fn eagerly (the kill switch) */
	/* compiles before new shapes run eagerly; 0 = 8. Past it, the variants
	 * compiled so far keep serving their shapes; a call with a new shape
	 * runs fn eagerly. One warning names the guard that kept failing and,
	 * for an input dim, what to mark dynamic. */
	int recompile_limit;
	int dynamic;                  /* 0 or KL_DYNAMIC_ALL (see above) */
	int ndynamic_dims;            /* entries of dynamic_dims, 0..nin */
	const uint32_t *dynamic_dims; /* per input: bit d = dim d is dynamic */
	/* Shape buckets (see below): 0 none; KL_BUCKETS_DEFAULT vLLM's sizes;
	 * n > 0 the n ascending sizes of buckets */
	int nbuckets;
	const int64_t *buckets;
	const int *bucket_in_dims;  /* nin entries: input i's batch dim, -1: none */
	const int *bucket_out_dims; /* nout entries: output k's batch dim, -1: none */
} kl_compile_opts;

/* Shape buckets. A batch dim (rows computed independently of each other)
 * can carry a list of capture sizes: a call whose batch b is no bucket is
 * padded up to the nearest bucket B >= b (zeros appended to each input's
 * batch dim), run at B, and each output's batch dim is cut back to b (a
 * view of the first b rows), so results equal the unpadded call's. Only
 * the bucket sizes reach the compiled plans: one plan size (and on CUDA,
 * reduce-overhead, one captured graph: warmed up on a bucket's first call,
 * captured on its second, at most KILN_CUDA_GRAPHS_MAX = 32 kept per
 * variant, least recently used given up first) per bucket.
 * bucket_in_dims[i] names input i's batch dim (-1: not batched); every
 * batched input must have the same batch b in a call (else KL_EINVAL), and
 * its batch dim is made dynamic. bucket_out_dims[k] names output k's
 * batch dim (-1: returned whole). A batch above the largest bucket is
 * KL_EINVAL naming the input, the dim, the size and the largest bucket.
 * The padded rows must be harmless to the real ones: they are computed
 * from zeros, and a kl_cache_write they reach writes rows past b (free
 * rows when live sequences are kept in rows 0..b-1).
 * KL_BUCKETS_DEFAULT: 1, 2, 4, then 8 to 256 by 8, then 272 to 512 by 16. */
#define KL_BUCKETS_DEFAULT (-1)

/* opts may be NULL (defaults). nin/nout: the arity of fn. */
kl_fn *kl_compile(kl_ctx *ctx, kl_fn_body fn, void *user, int nin, int nout,
                  const kl_compile_opts *opts);
/* Call the compiled function: out[] receives nout new references. */
kl_status kl_fn_call(kl_fn *f, kl_tensor *const *in, kl_tensor **out);
/* Buckets ahead of time: call f at every bucket size up to max_batch (0:
 * all), so that a serving loop's first request of each size compiles and
 * captures nothing. in are example inputs at any batch b: each call gets
 * new tensors at the bucket's batch B holding in's first min(b, B) rows and
 * zeros after them (new addresses each call, as a loop's calls have). On
 * CUDA under reduce-overhead / max-autotune each bucket is called three
 * times (warm-up, capture, a replay), elsewhere once. These are real
 * calls: writes in place happen as in kl_fn_call (give a decode step's
 * positions of rows that are free). The captures and their time are in
 * kl_fn_get_stats; KILN_LOGS=cudagraphs prints the buckets' total. */
kl_status kl_fn_warmup(kl_fn *f, kl_tensor *const *in, int64_t max_batch);
/* The graphs, breaks (reason and op), guards of each variant, kernels with
 * the nodes fused into each, bytes and FLOPs per kernel, planned peak memory.
 * The graphs of a call are numbered from 0 (graph 0 ends at the first break),
 * as in kl_profile and the logs. Calls that failed are counted as such: a
 * variant whose first call failed is not kept, nor counted as a compile. */
kl_status kl_explain(kl_fn *f, FILE *out);
/* Call f on in once, then time each step of each compiled graph of the
 * call alone (on the GPU: device events over about 2 ms of plain launches,
 * no CUDA graph; on the CPU: the host clock over at least 3 runs and 2 ms)
 * and write a table per graph ("graph 0", "graph 1", ... as kl_explain
 * numbers them) to out: each step's time, share, bytes moved
 * and FLOPs computed per second, kernel and what it computes. The call's
 * outputs are released; its compile, if any, happens as in kl_fn_call. */
kl_status kl_profile(kl_fn *f, kl_tensor *const *in, FILE *out);
void kl_fn_free(kl_fn *f);
/* How many kernels (and library calls) the last kl_fn_call that succeeded
 * launched; -1 before one has. */
int kl_fn_last_kernels(const kl_fn *f);

/* What a compiled function has done so far (kl_explain's counters). */
typedef struct kl_fn_stats {
	long calls;        /* kl_fn_call calls */
	long replays;      /* fullgraph calls that replayed a plan without running fn */
	long eager_calls;  /* calls run eagerly: .disable, or a new shape past the limit */
	long failed_calls;
	int compiles;      /* the first compile and every recompile */
	int recompiles;    /* compiles after the first; each has a reason */
	int variants;      /* guard sets compiled */
	bool over_limit;   /* past recompile_limit: new shapes run eagerly */
	long padded_calls; /* calls padded up to a bucket (kl_compile_opts.buckets) */
	long graph_captures; /* CUDA graphs captured (reduce-overhead; each variant's
	                      * first, and re-captures when an address moved) */
	double capture_ms;   /* the time those captures took */
	long graph_replays;  /* CUDA graph launches (each call that ran a captured
	                      * graph, the capturing call included) */
	/* a forward recorded for a kl_backward after the call: the min-cut
	 * partitions of its joint graph computed (one per graph structure) and
	 * the calls that reused a remembered one instead */
	int partitions;
	long partition_reuses;
} kl_fn_stats;
kl_status kl_fn_get_stats(const kl_fn *f, kl_fn_stats *out);
/* The reason of recompile i (0 = the first recompile, i.e. the second
 * compile), as KILN_LOGS=recompiles prints it, e.g.
 *     recompile #2: input 0 dim 1: 128 -> 64; mark it dynamic to compile one
 *     variant for every size: kl_compile_opts.dynamic_dims[0] |= 1u << 1 ...
 * NULL when i is out of range (the first 64 are kept). Valid until the next
 * kl_fn_call or kl_fn_free. */
const char *kl_fn_recompile_reason(const kl_fn *f, int i);

typedef enum kl_dim_state {
	KL_DIM_STATIC = 0,  /* not marked dynamic: guarded */
	KL_DIM_SYMBOLIC,    /* marked dynamic and kept a symbol: any size runs the variant */
	KL_DIM_SPECIALIZED  /* marked dynamic but compiled at its traced size (why says why) */
} kl_dim_state;
/* How variant v (0 = the first compiled, as kl_explain numbers them)
 * compiled dim `dim` of input `input`. *why (may be NULL) receives the
 * reason for a specialised dim ("it meets a static dim of a f32 [2304,768]
 * tensor ..."), "" otherwise; valid until kl_fn_free. KL_EINVAL for a
 * variant, input or dim out of range. */
kl_status kl_fn_dim_state(const kl_fn *f, int v, int input, int dim, kl_dim_state *state,
                          const char **why);

/* Register a host callback that is a sync point: inside a compiled function
 * it is a graph break (the tensors it receives are materialized).
 *
 * At a graph break the graph so far computes the tensors the sync op reads,
 * those the program holds a reference to beyond the open scopes (kl_retain,
 * e.g. to keep one past the call) and any live matrix product or attention
 * result. Other live tensors (fn's temporaries, which the scope kl_fn_call
 * opens holds) are not written out: kl_scope_begin/end inside fn change
 * nothing, and a temporary fn uses after the break is computed again from
 * what it reads, in the graph that uses it. */
typedef kl_status (*kl_host_fn)(kl_ctx *ctx, kl_tensor *const *ts, int n, void *user);
kl_status kl_host_call(kl_ctx *ctx, kl_host_fn fn, kl_tensor *const *ts, int n, void *user);

/* ---- export and AOT packages ------------------------------------------------
 * kl_export traces fn once on example inputs into one whole graph (a sync
 * point inside fn is an error naming the op and the number of ops before
 * it: never a silent split), with its parameters (the tensors fn reaches
 * through user) by name, the dims declared dynamic kept symbolic over their
 * [min, max] ranges, and the constraints the trace relied on. A package is
 * one versioned, checksummed file: a manifest (inputs, outputs, dtypes, dim
 * names and ranges, parameters, target), the plan, the kernels' native code
 * (on the CPU a shared object built for this host's CPU) and the weights (a
 * safetensors file). Loading one runs no compiler; it checks the format
 * version, the target, every checksum and the manifest against the plan.
 * A package carries native code: load only packages you trust, as you
 * would a shared library. */

/* Input `input`'s dim `dim` is dynamic, named `name` (1-63 bytes of
 * [A-Za-z0-9_.:/+-]) over [min, max]; the same name ties dims of several
 * inputs (they must be equal at every call). The example's size must lie in
 * the range and be at least 2 (a size of 0 or 1 would be specialised). */
typedef struct kl_dim_spec {
	int input, dim;
	const char *name;
	int64_t min, max;
} kl_dim_spec;

typedef struct kl_export_opts {
	int ndims;
	const kl_dim_spec *dims;
	/* names of the parameters (state-dict keys): params[i] is called
	 * param_names[i]; a tensor fn captures that is not listed is named
	 * "captured.<k>". kiln_nn.h's kl_nn_params gives a module's. */
	int nparams;
	kl_tensor *const *params;
	const char *const *param_names;
	const char *const *input_names;  /* nin names, or NULL: "input0", ... */
	const char *const *output_names; /* nout names, or NULL: "output0", ... */
	/* 0: a package for the context's device (a CUDA context: its GPU's
	 * architecture). 90: a CUDA package for sm_90 from any context, a CPU
	 * one included: the trace is lowered for CUDA and its kernels (and the
	 * fused attention kernels it may launch) built by NVRTC as sm_90 cubins
	 * with their PTX, which the driver compiles for newer GPUs; no GPU is
	 * needed. Traced on a GPU under max-autotune, the launch choices it made
	 * go in too. */
	int cuda_arch;
	/* the traced call's mode (0: default). On a CUDA context
	 * KL_MODE_MAX_AUTOTUNE times the launch choices (cuBLASLt algorithms,
	 * grid caps) at the trace, and the package carries them: a GPU of the
	 * same kind uses them instead of cuBLASLt's heuristics. A static plan
	 * only (dynamic dims are not tuned). */
	kl_mode mode;
} kl_export_opts;

typedef struct kl_exported kl_exported;
/* Trace fn on example (nin dense tensors) and compile it once for the
 * package's target (opts->cuda_arch).
 * NULL and an error naming the reason: a sync point, a dynamic dim the
 * graph must keep static (with why), an example outside its range, an
 * output that is an input returned as is, a write in place into an input,
 * a draw from the context's generator (kl_dropout_rng in training mode). */
kl_exported *kl_export(kl_ctx *ctx, kl_fn_body fn, void *user, int nin, int nout,
                       kl_tensor *const *example, const kl_export_opts *opts);
/* The program as text: inputs, outputs, dims, parameters, constraints,
 * graph. */
kl_status kl_exported_print(const kl_exported *e, FILE *out);
/* AOT: write the package file (atomically: a temporary file, then rename). */
kl_status kl_exported_package(kl_exported *e, const char *path);
void kl_exported_free(kl_exported *e);

typedef struct kl_package kl_package;
/* Map and check a package (its weights are borrowed from the mapping). */
kl_package *kl_package_load(kl_ctx *ctx, const char *path);
/* The same from len bytes in memory (copied where they must be: the buffer
 * may be freed once this returns). */
kl_package *kl_package_load_buffer(kl_ctx *ctx, const void *data, size_t len);
int kl_package_ninputs(const kl_package *p);
int kl_package_noutputs(const kl_package *p);
const char *kl_package_input_name(const kl_package *p, int i);  /* NULL out of range */
const char *kl_package_output_name(const kl_package *p, int i); /* NULL out of range */
/* Run: in[] checked against the manifest (dtype, rank, static sizes, each
 * dynamic dim in its range, tied dims equal, dense); out[] receives new
 * references. */
kl_status kl_package_run(kl_package *p, kl_tensor *const *in, kl_tensor **out);
/* Manifest, kernels, section sizes and target as text (kiln inspect). */
kl_status kl_package_inspect(const kl_package *p, FILE *out);
/* The same for len bytes of a package of any target (a CUDA package on a
 * machine without a GPU): every section checked, nothing loaded or run. */
kl_status kl_package_describe(kl_ctx *ctx, const void *data, size_t len, FILE *out);
void kl_package_free(kl_package *p);

/* ---- losses and training ops ---------------------------------------------
 * Composites of the ops above (so gradients flow through their rules); each
 * returns a new tensor like any op, or NULL and an error naming the call. */

/* torch.nn.functional.mse_loss(input, target) with reduction "mean": the
 * mean of (input - target)^2 over every element (0-dim; NaN when empty).
 * Both float, of one shape (torch would broadcast with a warning; kiln
 * refuses); the result has their promoted dtype. */
kl_tensor *kl_mse_loss(kl_tensor *input, kl_tensor *target);
/* torch.nn.functional.cross_entropy(logits, target, ignore_index=...) with
 * reduction "mean": logits [N, C] float, target [N] of i32/i64 class
 * indices; the mean over the rows whose target is not ignore_index of
 * -log_softmax(logits)[row, target] (0-dim, logits' dtype). Every row
 * ignored (or N == 0) gives NaN, as torch does. A target outside [0, C)
 * that is not ignore_index is an error naming the row and value where the
 * targets are held at the call (as kl_gather: eager on any device, tensors
 * made before a trace), else (compiled) that row's loss is NaN (torch's CUDA
 * kernel asserts). torch's default
 * ignore_index is -100 (KL_IGNORE_INDEX). */
#define KL_IGNORE_INDEX (-100)
kl_tensor *kl_cross_entropy(kl_tensor *logits, kl_tensor *target, int64_t ignore_index);
/* torch.nn.functional.dropout(x, p, training): each element is kept with
 * probability 1 - p and scaled by 1 / (1 - p), else 0. The mask comes from
 * kl_rand's counter-based generator keyed by (seed, offset): the same
 * (seed, offset) gives the same mask on every device and thread count; use
 * a new offset (the step number) each call. p == 0 or !training: x itself
 * (a new handle on it, no copy); p == 1: x * 0 (zeros; NaN stays NaN, as
 * torch). p outside [0, 1] or a non-float x is an error. Inside a compiled
 * function the generator's key (of seed and offset) is a run-time input of
 * the graph, not part of it: a training loop that passes a new offset every
 * step compiles once, and each step's mask is bitwise the eager one. Such a
 * function traces its body at every call (a fullgraph variant is not
 * replayed: the body makes the key); kl_dropout_rng replays. */
kl_tensor *kl_dropout(kl_tensor *x, double p, uint64_t seed, uint64_t offset, bool training);
/* kl_dropout with the context's generator (torch's default generator):
 * the mask of kl_dropout(x, p, seed, offset, training) for the generator's
 * (seed, offset), after which its offset moves by one (only when a mask is
 * drawn: training and 0 < p < 1). A .fullgraph compiled function that uses
 * it replays: each replay draws the keys the traced call's body would
 * draw next (its offsets moved as many as that call moved them), written
 * into the graph's key inputs before the plan runs (on CUDA a copy on the
 * stream, so a CUDA graph of the plan reads them as it replays); N replayed
 * steps equal N eager steps with the same seed. A new seed or offset set
 * inside a compiled function's body makes it trace at every call. */
kl_tensor *kl_dropout_rng(kl_tensor *x, double p, bool training);
/* The context's generator: kl_manual_seed sets its seed and offset 0 (a
 * new context: seed 0, offset 0); its state is (seed, offset), read and
 * set for checkpoints. NULL arguments are KL_EINVAL. */
kl_status kl_manual_seed(kl_ctx *ctx, uint64_t seed);
kl_status kl_rng_get_state(kl_ctx *ctx, uint64_t *seed, uint64_t *offset);
kl_status kl_rng_set_state(kl_ctx *ctx, uint64_t seed, uint64_t offset);

/* ---- optimizers (optim) ----------------------------------------------------
 * torch.optim.SGD and torch.optim.AdamW over an array of parameter tensors,
 * updated in place. Parameters are float tensors of one context, each dense
 * (kl_is_contiguous; views with an offset are fine, e.g. the halves of a
 * packed buffer) and not overlapping another; the optimizer holds a
 * reference to each. State, as torch keeps it, is tensors of the
 * parameter's dtype and shape (torch keeps exp_avg etc. in the parameter's
 * dtype for f16/bf16 too, and so does kiln; the update computes in f32, in
 * f64 for f64 parameters, and rounds once), and per parameter a step count
 * (f32 0-dim, torch's `step`; SGD keeps one too, where torch's SGD has none,
 * to know a parameter's first step, where torch finds its momentum buffer
 * None and starts it as the gradient). The learning rate is a device scalar (f64
 * 0-dim): kl_optim_set_lr writes it in place, so a compiled step reads the
 * new value without recompiling.
 *
 * A step eagerly is one fused update of every parameter of a dtype: one
 * parallel loop on the CPU, one kernel launch on CUDA (a pointer table over
 * the parameters, apex's multi-tensor apply). Inside a compiled function the
 * same fused step runs once the graph that computes the gradients has run;
 * an op later in that function that reads a parameter or its state fails
 * (KL_ESTATE: it would see the value before the step). With .unfused the
 * step is kiln ops and writes in place (kl_copy), which land when the graph
 * ends. A .fullgraph function whose step leaves no gradient in .grad
 * (kl_grad_clear after kl_optim_step, inside it) replays after its first
 * call: the plan, then the fused step over the gradients it computed; in
 * KL_MODE_REDUCE_OVERHEAD on CUDA both in one CUDA graph launch. */

typedef struct kl_optim kl_optim;

typedef struct kl_sgd_opts {
	double lr;           /* torch default 1e-3 */
	double momentum;     /* 0 */
	double dampening;    /* 0 */
	double weight_decay; /* 0: L2, added to the gradient (torch's SGD) */
	bool nesterov;       /* needs momentum > 0 and dampening == 0 */
	bool unfused;        /* step through kiln ops even eagerly (for tests) */
} kl_sgd_opts;

typedef struct kl_adamw_opts {
	double lr;           /* torch default 1e-3 */
	double beta1, beta2; /* 0.9, 0.999 */
	double eps;          /* 1e-8, added after the square root */
	double weight_decay; /* 1e-2, decoupled: p -= lr * weight_decay * p */
	bool amsgrad;        /* false */
	bool unfused;        /* step through kiln ops even eagerly (for tests) */
} kl_adamw_opts;

/* torch's defaults, to start from (a zeroed struct is not the default:
 * weight_decay 0 is a valid choice). */
kl_sgd_opts kl_sgd_defaults(void);
kl_adamw_opts kl_adamw_defaults(void);

/* Build an optimizer over n >= 1 parameters. names[i] (names may be NULL,
 * or an entry NULL) names parameter i in saved state (torch's state-dict key
 * of the parameter, e.g. "layers.0.attn.in_proj_weight"; default: its
 * index). opts NULL: torch's defaults. A bad hyperparameter (as torch
 * checks them), a non-float, non-dense or overlapping parameter, or a
 * duplicate is KL_EINVAL naming the parameter and value. */
kl_optim *kl_optim_sgd(kl_ctx *ctx, int n, kl_tensor *const *params, const char *const *names,
                       const kl_sgd_opts *opts);
kl_optim *kl_optim_adamw(kl_ctx *ctx, int n, kl_tensor *const *params,
                         const char *const *names, const kl_adamw_opts *opts);
void kl_optim_free(kl_optim *o);

/* One step with grads[i] the gradient of parameter i (its shape and dtype,
 * any layout); a NULL entry skips that parameter, its state and its step
 * count, as torch skips parameters whose .grad is None. */
kl_status kl_optim_step_grads(kl_optim *o, kl_tensor *const *grads);
/* One step with each parameter's .grad (kl_grad) after kl_backward, torch's
 * optimizer.step(): a parameter with no gradient is skipped. A parameter
 * that is a block of rows of a leaf that requires grad (a module's packed
 * weights, see kl_nn_requires_grad) takes those rows of the leaf's gradient.
 * The update is never recorded for autograd. */
kl_status kl_optim_step(kl_optim *o);
/* Set the learning rate (>= 0, finite): a write into the lr device scalar. */
kl_status kl_optim_set_lr(kl_optim *o, double lr);
/* The learning rate as a 0-dim f64 tensor (borrowed: valid while o lives). */
kl_tensor *kl_optim_lr(kl_optim *o);
int kl_optim_nparams(const kl_optim *o);
kl_tensor *kl_optim_param(kl_optim *o, int i); /* borrowed */
/* State of parameter i by torch's key (borrowed), or NULL and an error:
 * "step" (f32 0-dim), SGD "momentum_buffer" (when momentum != 0), AdamW
 * "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad). */
kl_tensor *kl_optim_state(kl_optim *o, int i, const char *key);

/* Save the state as safetensors: "state.<name>.<key>" for each parameter's
 * state (names as given at construction) and "param_groups.0.lr". Load
 * checks every key, shape and dtype before it writes anything (in place),
 * and refuses a file with keys this optimizer does not have (another
 * optimizer's, or other parameters'); the hyperparameters other than lr
 * are not saved. Restoring then stepping gives bitwise the next step the
 * saved optimizer would have made. */
kl_status kl_optim_save(kl_optim *o, const char *path);
kl_status kl_optim_load(kl_optim *o, const char *path);

/* ---- safetensors (nn layer) ---------------------------------------------
 * The safetensors file format: an 8-byte little-endian header length N, N
 * bytes of JSON naming each tensor's dtype, shape and byte range, then the
 * data. Dtypes F32 F64 F16 BF16 I32 I64 BOOL map to kiln's; others are
 * rejected. Data is little-endian (kiln assumes a little-endian host). A
 * malformed file gives KL_EFORMAT, an unreadable one KL_EIO. */

typedef struct kl_safetensors kl_safetensors; /* an opened, validated file */
/* Read and validate the header; NULL and an error on failure. */
kl_safetensors *kl_safetensors_open(kl_ctx *ctx, const char *path);
int kl_safetensors_count(const kl_safetensors *st);
const char *kl_safetensors_name(const kl_safetensors *st, int i); /* in file order */
/* A new tensor on st's context holding the named tensor's data, or NULL and
 * an error ("no tensor 'x' in <file>"). */
kl_tensor *kl_safetensors_get(kl_safetensors *st, const char *name);
/* A "__metadata__" value, or NULL. */
const char *kl_safetensors_metadata(const kl_safetensors *st, const char *key);
void kl_safetensors_close(kl_safetensors *st);
/* Write n named tensors (any layout; written dense) atomically: a temporary
 * file in the same directory, fsync, rename, so an existing file is replaced
 * only by a complete one. Names must be unique, non-empty, valid UTF-8
 * without control characters. */
kl_status kl_safetensors_save(kl_ctx *ctx, const char *path, int n, const char *const *names,
                              kl_tensor *const *ts);

#ifdef __cplusplus
}
#endif
#endif /* KILN_H */
