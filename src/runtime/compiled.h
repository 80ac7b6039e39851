/* compiled.h - the runtime's contract with capture (and tools): turn a graph
 * into a compiled variant (lowered or loaded from the disk cache, JIT-built,
 * memory-planned) and run it on materialized tensors.
 */
#ifndef KILN_COMPILED_H
#define KILN_COMPILED_H

#include "backend/cpu/cpu.h"
#include "backend/cuda/backend.h"
#include "core/core.h"
#include "plan/plan.h"

/* The most specialised dims a compiled graph records (more are compiled
 * static all the same, only not listed). */
#define KL_MAX_SPEC 16

typedef struct kl_compile_cfg {
	kl_mode mode;
	bool fusion;
	/* per graph input: bitmask of its dims that are dynamic (NULL: none) */
	const uint32_t *dyn_masks;
	/* for logs and explain: the compiled function and the graph's index */
	const char *name;
	int graph_index;
	/* Non-NULL: compile this program instead of lowering the graph (hand-written
	 * programs in tests, AOT). Its source is part of the cache key. */
	const kl_program *given;
	/* keep the CPU binary's bytes in kl_compiled.bin (packages embed them) */
	bool keep_binary;
	/* lower for CUDA whatever ctx's device, then stop: no disk cache, no
	 * build, nothing loaded (CUDA packages, built on any machine); the
	 * result holds the plan, its source and memory plan, and runs nothing */
	bool lower_for_cuda;
	/* the last `lent` outputs are read only until the call returns (the
	 * gradients a fused optimizer step deferred to the graph's end reads,
	 * the values of writes in place): they live in the arena with the
	 * temps, planned from the step that writes them to the call's end, and
	 * the call's output tensors borrow that memory, which the next call of
	 * the plan overwrites. 0: every output has memory of its own. */
	int32_t lent;
} kl_compile_cfg;

/* The memory plan of the TEMP buffers: one arena, a slot per buffer. */
typedef struct kl_memplan {
	int32_t *slot; /* per buffer: slot index, -1 when not planned (not TEMP, empty) */
	size_t *off;   /* per buffer: byte offset in the arena */
	int32_t nslots;
	size_t arena_bytes; /* planned peak of the temps (sum of the slots) */
	size_t temp_bytes;  /* the temps' sizes added up, as if none were reused */
	size_t live_bytes;  /* the most temp bytes live at one step: no plan needs less */
	size_t out_bytes;   /* the outputs (fresh per call), lent ones not counted */
	int32_t nlent;      /* outputs lent from the arena (kl_compile_cfg.lent) */
	int32_t ninplace;   /* kernels writing into their input's slot (kl_step.inplace) */
} kl_memplan;

typedef struct kl_compiled {
	kl_program prog; /* validated; prog.source is NULL when loaded from the cache */
	kl_graph g;      /* the graph it was compiled from (explain, guards) */
	uint64_t key;    /* content key of the cache entry */
	bool from_cache; /* no lowering, codegen or compiler ran for it */
	bool dynamic;    /* some dim is a symbol */
	kl_mode mode;
	bool fusion;
	int32_t lent; /* kl_compile_cfg.lent: not part of the key (the program is
	               * the same), so the callers that keep entries compare it */
	int nin;  /* graph inputs */
	int nout; /* graph outputs */
	/* per graph input: the strides kernels index it with (static inputs) */
	int64_t (*in_strides)[KL_MAX_DIMS];
	bool *in_dynamic;
	/* dynamic graph-input dims compiled static because they must be (the
	 * hidden size meeting a weight), with why */
	kl_spec spec[KL_MAX_SPEC];
	int nspec;
	/* per node dim of g: its symbol, 0 static (NULL: nothing symbolic) */
	int32_t *src_sym;
	/* the shared object and its kernels */
	void *dl;
	kl_kernel_fn *fns;
	/* cfg.keep_binary: the shared object's bytes (malloc'd; NULL without kernels) */
	bool keep_bin;
	uint8_t *bin;
	size_t bin_len;
	/* CUDA contexts: module, functions, device arena, graph (cuda/exec_cuda.c) */
	bool cuda;
	struct kl_cuda_rt *dev;
	/* memory: the plan for plan_syms, its arena, scratch for library calls */
	kl_memplan plan;
	int64_t plan_syms[KL_MAX_DIMS * 4];
	void *arena;
	size_t arena_cap;
	void *scratch;
	size_t scratch_cap;
	/* CPU: each product step's weight packed ahead (backend/cpu/cpu.h
	 * kl_mm_pack; NULL until the first call, and in a plan that writes
	 * in place), their bytes */
	struct kl_mm_pack *mm_pack;
	size_t mm_pack_bytes;
	/* counters */
	int last_launches;
	uint64_t runs;
	uint64_t launches;
} kl_compiled;

/* The cache key of compiling g with cfg on ctx's device (a graph structural
 * hash with dynamic dims symbolized, the inputs' strides, the options, the
 * target, compiler and flags, kiln's version). Equal keys compile alike. */
kl_status kl__compile_key(kl_ctx *ctx, const kl_graph *g, const kl_compile_cfg *cfg, uint64_t *key);

/* Whether c (compiled with key `key`) serves graph g: g is c's graph but
 * for the values of c's symbolic dims. A graph traced at a size of 0 or 1
 * keys apart (such dims are not symbols there), yet c runs it. */
bool kl__compiled_serves(kl_ctx *ctx, const kl_compiled *c, uint64_t key, const kl_graph *g,
                         const kl_compile_cfg *cfg);

/* Lower g (or load its plan and binary from the disk cache), JIT-compile,
 * plan memory. NULL with ctx's error set on failure. */
kl_compiled *kl__compile(kl_ctx *ctx, const kl_graph *g, const kl_compile_cfg *cfg);
void kl__compiled_free(kl_compiled *c);

/* A compiled variant made from a plan read from a package (already
 * validated and bound to the binary by the caller): every graph input bound
 * dense, dynamic where a dim is a symbol; its kernels from the loaded
 * shared object dl (taken over: freed with c). No graph (c->g is empty).
 * Errors name fn. */
kl_compiled *kl__compiled_from_plan(kl_ctx *ctx, const char *fn, kl_program *prog, void *dl, int nin,
                                    int nout);

/* Run c: inputs[i] is graph input i (materialized, the dtype/shape/strides it
 * was compiled for, dynamic dims free). outputs[j] receives a reference the
 * caller owns (in no scope, whether or not one is open). On failure no
 * output is left behind. */
kl_status kl__compiled_run(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                           kl_tensor **outputs);
/* Work that runs after c's steps, as part of the plan (a fullgraph replay
 * of a training step: the fused optimizer step over the gradients the plan
 * computes). prepare runs at every call, before the steps and outside any
 * CUDA graph capture, with the call's outputs (materialized): it readies
 * what launch reads (on CUDA the optimizer's pointer table, written into
 * device memory of its own). launch enqueues the work (adding to
 * *launches) after the steps: under reduce-overhead it is captured into
 * c's CUDA graph with them, so its launches' arguments must not change
 * from call to call (one graph launch a call then runs both). A graph
 * captured with one tail is captured again for another (id compared). */
typedef struct kl_run_tail {
	kl_status (*prepare)(kl_ctx *ctx, void *user, kl_tensor *const *outputs);
	kl_status (*launch)(kl_ctx *ctx, void *user, int *launches);
	void *user;
	const void *id; /* what the tail is (its launches' identity) */
} kl_run_tail;
/* A check of an input's values the run makes before its steps (a replay
 * of kl_sdpa_lengths: the lengths against the cache's keys): every value of
 * inputs[in] (1-D, i32 or i64) must lie in [0, hi], else the call fails
 * with kl__err_value and writes nothing. The CPU reads the values in place;
 * CUDA checks them on the device, on the stream before the steps, and the
 * call reads the result with its cache writes' (one wait a call). op and
 * what are static strings. */
typedef struct kl_value_check {
	int in, dim;
	int64_t hi;
	const char *op, *what;
} kl_value_check;
/* Check now: every value of t (materialized, 1-D, i32 or i64) in [0, hi];
 * else kl__err_value. Reads t in place on the CPU, through a copy to the
 * host elsewhere (eager kl_sdpa_lengths, a traced call, a CPU run's
 * kl_value_check). */
kl_status kl__check_values(kl_ctx *ctx, const kl_tensor *t, int64_t hi, int dim, const char *op,
                           const char *what);
/* kl__compiled_run with a tail (NULL: none) and value checks (chk[0..nchk)). */
kl_status kl__compiled_run_tail(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                                kl_tensor **outputs, const kl_run_tail *tail,
                                const kl_value_check *chk, int nchk);

/* The steps of c with the nodes fused into each, bytes, FLOPs, planned peak. */
void kl__compiled_explain(const kl_compiled *c, FILE *f, const char *indent);

/* Process-wide counters: lowerings (with codegen), cache hits; compiler
 * invocations: kl__jit_compiles (backend/cpu/cpu.h). A warm process shows
 * zero compiles and zero lowerings. */
long kl__rt_lowerings(void);
long kl__rt_cache_hits(void);

/* ---- the CUDA half (runtime/cuda/; exec_no_cuda.c without CUDA) ----------- */

/* A hash of what a cubin depends on besides the source: the device's
 * architecture and the NVRTC version. */
uint64_t kl__cuda_rt_identity(kl_ctx *ctx);
/* Compile c's source with NVRTC for ctx's device, store the image in the
 * disk cache (dir may be NULL) and load it; *bin_hash / *bin_size name it in
 * the plan entry. */
kl_status kl__cuda_rt_build(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t *bin_hash,
                            uint64_t *bin_size);
/* Load c's module from an image a package brought (no NVRTC). */
struct kl_cuda_image;
kl_status kl__cuda_rt_from_image(kl_ctx *ctx, kl_compiled *c, const struct kl_cuda_image *im);
/* Load c's image from the disk cache; KL_EFORMAT when absent or corrupt. */
kl_status kl__cuda_rt_load(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t bin_hash,
                           uint64_t bin_size);
/* Set-up the first call would otherwise do, done once c is ready (built or
 * read from the cache, buffers planned): each product step's cuBLASLt
 * descriptors and algorithm choice. Runs nothing on the device; a failure
 * is logged (KILN_LOGS=startup) and left for the first call to report. */
void kl__cuda_rt_prepare(kl_ctx *ctx, kl_compiled *c);
/* A device arena of at least bytes; *base receives its address. */
kl_status kl__cuda_rt_arena(kl_ctx *ctx, kl_compiled *c, size_t bytes, void **base);
/* Run every step on the stream (B: device addresses per buffer), then
 * tail's launch (NULL: none; *tail_launches its launches when not a graph
 * replay), through a CUDA graph under reduce-overhead / max-autotune, the
 * tail captured into it. */
kl_status kl__cuda_rt_run(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                          const kl_run_tail *tail, int *tail_launches,
                          kl_tensor *const *inputs, const kl_value_check *chk, int nchk);
/* kl_profile: us[s] = microseconds of step s run alone, by device events over
 * about 2 ms of plain launches (no graph); the buffers as the last run left
 * them. */
kl_status kl__cuda_rt_time_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                 const int64_t *syms, double *us);
/* Whether the last run replayed a captured graph. */
bool kl__cuda_rt_replaying(const kl_compiled *c);
/* CUDA graphs captured for c so far and the milliseconds their captures
 * took (0 without CUDA graphs). */
long kl__cuda_rt_captures(const kl_compiled *c, double *ms);
/* Launches of c's CUDA graphs so far (0 without CUDA graphs). */
long kl__cuda_rt_replays(const kl_compiled *c);
void kl__cuda_rt_free(kl_compiled *c);
/* What the runtime lends a CUDA context (api/context.c passes it to
 * kl__cuda_ctx_init): its disk cache, and eager execution of nodes through
 * the compiler (runtime/cuda/eager_cuda.c; exec_no_cuda.c: all NULL). */
extern const kl_cuda_hooks kl__cuda_rt_hooks;

/* A plan against the graph it claims to implement (kl__program_validate
 * first): inputs and outputs the graph's dtypes and shapes at the traced
 * sizes, views inside their bases, temps no larger than any value lowering
 * makes of g, steps naming g's nodes, row grids inside their buffers, library
 * calls reaching only into inputs as traced. Run on every plan read from
 * outside (disk cache, packages) before anything is allocated or loaded for
 * it; KL_EFORMAT with the reason in err. */
kl_status kl__plan_check(const kl_program *p, const kl_graph *g, char *err, size_t errcap);

#endif /* KILN_COMPILED_H */
