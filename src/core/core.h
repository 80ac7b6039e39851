/* core.h - what every layer inside libkiln shares: the context, tensors and
 * their storage, the error path, dtype conversions and the random generator.
 * Internal names are kl__ (two underscores); they are not exported.
 */
#ifndef KILN_CORE_H
#define KILN_CORE_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/half.h"
#include "kiln.h"
#include "core/shape.h"

#if defined(__GNUC__)
#define KL_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define KL_UNUSED __attribute__((unused))
#else
#define KL_PRINTF(f, a)
#define KL_UNUSED
#endif

/* ---- storage and tensors -------------------------------------------------- */

typedef struct kl_storage {
	int refs;
	kl_device device;
	void *data;   /* host pointer on the CPU, device pointer on CUDA */
	size_t nbytes;
	/* Bumped by every write into this memory after it was first filled
	 * (kl__storage_written): the version counter compiled functions guard
	 * the tensors they captured with. Views share it with their base. */
	uint64_t version;
	/* unique in the process, never reused (kl__storage_id): with version,
	 * names the memory's contents across calls (matmul_step.c's weights
	 * packed ahead), where an address may be freed and handed out again */
	uint64_t id;
	/* the memory is someone else's (a package's mapping): never freed here */
	bool borrowed;
} kl_storage;

struct kl_trace; /* capture/trace.h */
struct kl_node;  /* graph/graph.h: core includes nothing of kiln but the public header */

struct kl_tensor {
	kl_ctx *ctx;
	int refs;
	kl_dtype dtype;
	int ndim;
	int64_t shape[KL_MAX_DIMS];
	int64_t strides[KL_MAX_DIMS]; /* elements */
	int64_t offset;               /* elements from storage->data */
	kl_storage *st;               /* NULL while the tensor is lazy */
	/* Lazy tensors (made inside a trace) name a node of the active trace.
	 * trace_id tells traces apart: a lazy tensor of an ended trace that
	 * was never materialized is an error to use. */
	uint64_t trace_id;
	int32_t node;
	/* references held by compiled functions that captured this tensor (it
	 * was reached through user state): refs - capture_refs is what the
	 * program itself holds, 0 once it let the tensor go */
	int32_t capture_refs;
	int32_t scoped; /* entries of open scopes that hold this tensor's references */
	/* Autograd (api/autograd.c). requires_grad: a leaf the user marked
	 * (kl_set_requires_grad). tape_node: this tensor's node on its
	 * context's tape, -1 when it is not on it. grad: the gradient
	 * kl_backward left (one reference held, released with the tensor).
	 * grad_stop: 1 + the op through which a tensor that requires grad
	 * reached this one without a gradient (argmax, a comparison), 0 none. */
	bool requires_grad;
	uint16_t grad_stop;
	int32_t tape_node;
	/* its storage's version when a lazy tensor on the tape got its storage
	 * (the tape records a lazy tensor before it has a version to check) */
	uint64_t tape_ver;
	bool tape_leaf; /* its tape node is an INPUT: the tape cannot compute it again */
	kl_tensor *grad;
	kl_tensor *prev, *next; /* the context's list of live tensors */
};

/* ---- the fused optimizer step (api/optim.c builds it, backends run it) ---- */

typedef enum kl_optim_algo { KL_ALGO_SGD = 1, KL_ALGO_ADAMW = 2 } kl_optim_algo;

/* One parameter of a fused step: dense memory of n elements (device
 * pointers on CUDA), all of the launch's dtype. m is the momentum buffer
 * (SGD) or exp_avg (AdamW); v exp_avg_sq; vmax max_exp_avg_sq (amsgrad);
 * unused ones are NULL. step: the parameter's f32 step count, incremented
 * by the step (its value before decides SGD's first-step buffer). */
typedef struct kl_optim_item {
	void *p;
	const void *g;
	void *m, *v, *vmax;
	float *step;
	int64_t n;
} kl_optim_item;

/* Every parameter of one dtype, updated as torch's SGD / AdamW would
 * (torch.optim semantics; see kiln.h), computing in f32 (f64 for f64). */
typedef struct kl_optim_launch {
	kl_optim_algo algo;
	kl_dtype dtype;
	int n;
	const kl_optim_item *items;
	const double *lr; /* the learning rate: a device scalar, read by the kernel */
	double weight_decay, momentum, dampening; /* SGD (weight_decay: both) */
	bool nesterov, amsgrad;
	double beta1, beta2, eps; /* AdamW */
} kl_optim_launch;

/* ---- the backend interface ---------------------------------------------- */

typedef struct kl_backend {
	const char *name;
	void *(*alloc)(kl_ctx *ctx, size_t nbytes);
	void (*free)(kl_ctx *ctx, void *p);
	/* Run one node eagerly: in[] are materialized tensors matching the
	 * node's inputs (shapes already broadcast-compatible, any strides);
	 * out is allocated, dense (contiguous) with the node's shape/dtype.
	 * Movement nodes that are plain views never reach exec; CONTIGUOUS and
	 * CONCAT do. Returns KL_OK or sets the error and returns a status. */
	kl_status (*exec)(kl_ctx *ctx, const struct kl_node *n, kl_tensor *const *in, kl_tensor *out);
	/* copy between host and device memory (CPU: memcpy) */
	kl_status (*to_host)(kl_ctx *ctx, void *dst, const void *src, size_t nbytes);
	kl_status (*from_host)(kl_ctx *ctx, void *dst, const void *src, size_t nbytes);
	/* kl_memory_stats: what the allocator holds for ctx; with reset_peak,
	 * the peak restarts from in_use first. */
	void (*memory)(kl_ctx *ctx, kl_memory_usage *out, bool reset_peak);
	/* kl_ctx_synchronize: wait until the work queued on ctx's device has
	 * finished. NULL: the backend runs every op to completion before it
	 * returns (the CPU), so there is nothing to wait for. */
	kl_status (*synchronize)(kl_ctx *ctx);
	/* One fused optimizer step over every item of l (one parallel loop on
	 * the CPU, one kernel launch on CUDA). NULL: the front end updates each
	 * parameter through ops instead. */
	kl_status (*optim_step)(kl_ctx *ctx, const kl_optim_launch *l);
	/* optim_step in two halves, for a step inside a CUDA graph: optim_table
	 * writes l's pointer table into device memory the caller owns (*table,
	 * *cap bytes; grown through the backend's own allocator, freed with
	 * free) and readies the kernel; optim_launch launches over that table
	 * with no allocation and no copy, so a stream capture records it and a
	 * graph replay reads the table written before it. NULL where
	 * optim_step is the only way (the CPU). */
	kl_status (*optim_table)(kl_ctx *ctx, const kl_optim_launch *l, void **table, size_t *cap);
	kl_status (*optim_launch)(kl_ctx *ctx, const kl_optim_launch *l, const void *table);
} kl_backend;

/* ---- the context ---------------------------------------------------------- */

#define KL_ERR_CAP 1024

typedef struct kl_scope {
	kl_tensor **items;
	int n, cap;
} kl_scope;

struct kl_ctx {
	kl_device device;
	int index;
	int nthreads;
	const kl_backend *be;
	kl_status status;
	char err[KL_ERR_CAP];
	kl_tensor *live; /* every tensor not yet freed */
	kl_scope *scopes;
	int nscopes, cap_scopes;
	struct kl_trace *trace; /* the active capture, or NULL (eager) */
	uint64_t next_trace_id;
	/* Called at a sync point (kl_item, kl_to_host, kl_print, kl_host_call,
	 * kl_ctx_synchronize) while a trace is active, with the n tensors the
	 * op reads: the capture layer compiles and runs the graph so far,
	 * materializes those tensors (and the live ones the program may still
	 * use, see capture.c) and continues in a new trace (a graph break), or
	 * refuses (fullgraph). NULL: sync points inside a trace are an error. */
	kl_status (*sync_hook)(kl_ctx *ctx, const char *op, int n, kl_tensor *const *ts);
	void *sync_user;
	unsigned logs; /* KL_LOG_* bits, from KILN_LOGS at kl_ctx_new */
	void *backend_state; /* per-backend data (CUDA context, streams, ...) */
	size_t host_in_use, host_peak; /* the CPU allocator's bytes for this context */
	FILE *profile;    /* kl_profile's stream while it runs (each compiled graph's
	                   * steps are timed and reported there), else NULL */
	int profile_segs; /* graphs reported so far by the running kl_profile */
	/* the context's generator (kl_manual_seed, kl_dropout_rng): draw k of
	 * it keys its mask with kl__philox_key(rng_seed, rng_offset), then
	 * rng_offset moves by one; a fullgraph replay moves it as the traced
	 * call did (capture/replay.c) */
	uint64_t rng_seed, rng_offset;
	int profile_graph; /* the graph about to run, numbered from 0 in the call as
	                    * kl_explain numbers them (the capture layer sets it) */
	void *tape;   /* the autograd tape (api/autograd.c), NULL until first used */
	/* set with the tape: kl_explain's part on the backward graphs kl_backward
	 * compiled (the api layer owns them) */
	void (*explain_backward)(kl_ctx *ctx, FILE *out, const char *indent);
	bool no_grad; /* kl_set_grad_enabled(ctx, false): ops are not recorded */
};

/* kl_ctx_free's part in core (api/context.c calls it): every tensor still
 * alive and its storage (through ctx->be), and the scopes. */
void kl__ctx_free_tensors(kl_ctx *ctx);

/* Set the context's error; returns status for `return kl__err(...)`.
 * ctx may be NULL (thread-local message, see kl_last_error).
 * While a public call is in progress (KL_API below) the message is reported
 * under that call's name: a leading "kl_<name>: " is replaced by it (the
 * op kl_zeros is built on says kl_full, the dispatcher says the node's op,
 * the allocator says kl_tensor), and a message without one gets it in front. */
kl_status kl__err(kl_ctx *ctx, kl_status status, const char *fmt, ...) KL_PRINTF(3, 4);
/* A value check's failure (kl_sdpa_lengths' lengths against the cache),
 * KL_EINVAL "<op>: <what>[i] = v disagrees with the cache: k holds <hi>
 * keys (dim <dim>)": one message wherever the values were checked (the
 * host, or the device's error word). */
kl_status kl__err_value(kl_ctx *ctx, const char *op, const char *what, int64_t i, int64_t v,
                        int64_t hi, int dim);

/* ---- a growable string (strbuf.c) ----------------------------------------- */

typedef struct kl_sb {
	char *s;
	size_t n, cap;
	bool oom;
} kl_sb;

void kl__sb_printf(kl_sb *sb, const char *fmt, ...) KL_PRINTF(2, 3);
void kl__sb_puts(kl_sb *sb, const char *s);
void kl__sb_free(kl_sb *sb);
/* the text (never NULL), owned by sb */
const char *kl__sb_str(const kl_sb *sb);

/* KL_API("kl_zeros") at the top of a public function marks it as the call in
 * progress on this thread for the rest of its body (a cleanup handler ends
 * it on every return). Nested public calls (kl_zeros calling kl_full,
 * kl_linear calling kl_matmul) leave the outermost name in place. Only
 * functions that never run user code (callbacks, compiled bodies) may use
 * it: the ops a user's callback calls are calls of their own. */
const char *kl__api_enter(const char *name);
void kl__api_leave(const char *const *frame);
#if defined(__GNUC__)
#define KL_API(name)                                                             \
	const char *const kl__api_frame __attribute__((cleanup(kl__api_leave), unused)) = \
	        kl__api_enter(name)
#else
#define KL_API(name) ((void)0) /* messages then keep the inner names */
#endif

/* ---- logging (KILN_LOGS=graph_breaks,recompiles,fusion,output_code,cache,...) */

enum {
	KL_LOG_GRAPH_BREAKS = 1u << 0,
	KL_LOG_RECOMPILES = 1u << 1,
	KL_LOG_FUSION = 1u << 2,
	KL_LOG_OUTPUT_CODE = 1u << 3,
	KL_LOG_CACHE = 1u << 4,
	KL_LOG_CUDAGRAPHS = 1u << 5,
	KL_LOG_AUTOTUNE = 1u << 6,
	KL_LOG_GRAPH = 1u << 7,
	KL_LOG_STARTUP = 1u << 8 /* wall-clock ms of each one-time set-up phase */
};
/* Parse a KILN_LOGS value ("fusion,cache", "all"); unknown names ignored. */
unsigned kl__parse_logs(const char *s);
/* Print "[kiln:<cat>] message" to stderr when cat is enabled on ctx. */
void kl__log(const kl_ctx *ctx, unsigned cat, const char *fmt, ...) KL_PRINTF(3, 4);
/* A monotonic clock in milliseconds, for the startup log's phases. */
double kl__now_ms(void);

/* ---- tensors -------------------------------------------------------------- */

/* A tensor header with no storage, counted in ctx->live and the open scope. */
kl_tensor *kl__tensor_new(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape);
/* A tensor with fresh dense storage (contents undefined). */
kl_tensor *kl__tensor_alloc(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape);
/* A dense tensor over memory the caller keeps alive and frees (the weights
 * of a loaded package, borrowed from its mapping): storage marked borrowed. */
kl_tensor *kl__tensor_borrow(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, void *data,
                             size_t nbytes);
/* A view of base's storage with the given geometry. */
kl_tensor *kl__tensor_view(kl_tensor *base, int ndim, const int64_t *shape, const int64_t *strides,
                           int64_t offset);
static inline void *kl__tensor_data(const kl_tensor *t)
{
	return (char *)t->st->data + t->offset * (int64_t)kl_dtype_size(t->dtype);
}
bool kl__strides_contiguous(int ndim, const int64_t *shape, const int64_t *strides);
/* A new storage's id (kl_storage.id): 1, 2, ... */
uint64_t kl__storage_id(void);
/* Every path that writes into an existing tensor's memory (rather than
 * filling fresh storage) calls this after the write. */
static inline void kl__storage_written(kl_storage *st)
{
	st->version++;
}
/* Drop a tensor made inside the library that is not handed out (a temporary,
 * or the output of a failed op): it also leaves the open scope, where a plain
 * kl_release would leave a dangling entry. */
void kl__tensor_discard(kl_tensor *t);

/* ---- shape helpers: the overflow-checked arithmetic is core/shape.h ------- */

/* "[4,3]" into buf */
const char *kl__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* ---- scalars, dtype conversion -------------------------------------------- */

/* element i (in elements) of memory p of dtype dt, as a double */
double kl__load(const void *p, kl_dtype dt, int64_t i);
/* store v as dtype dt (rounding / truncation toward zero for integers,
 * v != 0 for bool) */
void kl__store(void *p, kl_dtype dt, int64_t i, double v);
/* v as dtype dt would hold it (the value kl__store then kl__load gives) */
double kl__round_to(kl_dtype dt, double v);

/* ---- random numbers --------------------------------------------------------- */

/* Philox-4x32-10. Element i of rand(seed) is kl__rand_uniform(seed, i);
 * of randn(seed), kl__rand_normal(seed, i). Every backend must match. */
void kl__philox(uint64_t seed, uint64_t counter, uint32_t out[4]);
double kl__rand_uniform(uint64_t seed, uint64_t i); /* [0, 1) with 24-bit resolution */
/* A rand/randn node keyed at run time (two inputs, see ops.def) reads its
 * key as two 0-dim i32 words; the key is their bits, lo | hi << 32. */
static inline uint64_t kl__rand_key(int32_t lo, int32_t hi)
{
	return (uint64_t)(uint32_t)lo | (uint64_t)(uint32_t)hi << 32;
}
double kl__rand_normal(uint64_t seed, uint64_t i);  /* Box-Muller */
/* The key of the rand stream for (seed, offset): kl_dropout's mask for a
 * (seed, offset) pair is rand keyed by it (eager, traced and replayed). */
uint64_t kl__philox_key(uint64_t seed, uint64_t offset);
/* What element i of rand(seed) of float dtype dt holds: kl__rand_uniform
 * rounded to dt, except that values that round up to 1 (possible in f16 and
 * bf16 only) become the largest value below 1, so [0, 1) holds in every
 * dtype. Backends store, and the reference uses, exactly this. */
double kl__rand_uniform_as(kl_dtype dt, uint64_t seed, uint64_t i);

#endif /* KILN_CORE_H */
