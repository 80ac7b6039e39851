/* trace.h - the lazy trace of a compiled call (capture/trace.c): while one is
 * active on a context, ops append nodes to its graph instead of running.
 */
#ifndef KILN_TRACE_H
#define KILN_TRACE_H

#include "core/core.h"
#include "graph/graph.h"

/* An action that runs once the graph of the trace it was recorded in has
 * run (after the graph's writes in place): the fused optimizer step inside
 * a compiled function, one launch over every parameter. */
typedef struct kl_deferred {
	/* run true: the graph ran (reads are materialized), do the action and
	 * say how many kernels it launched; false: the trace is dropped. Either
	 * way fn frees user. */
	kl_status (*fn)(kl_ctx *ctx, void *user, bool run, int *launches);
	void *user;
	char what[80];
	kl_tensor **reads; /* values it reads: computed by the graph (held) */
	int nreads;
	kl_tensor **guard; /* tensors it changes: no later node of the trace may read them (held) */
	int nguard;
	int32_t mark; /* the trace's node count when it was recorded */
	bool done;
	/* optional (kl__trace_defer_again): the same action in a fullgraph
	 * replay, in two halves as a kl_run_tail (runtime/compiled.h):
	 * again_prepare with reads[k] the replay's value of this action's read
	 * k (materialized) before the plan runs, again_launch after its steps
	 * (inside its CUDA graph under reduce-overhead). again_user is the
	 * trace's (free_again) until a variant takes it (capture/replay.c) */
	kl_status (*again_prepare)(kl_ctx *ctx, void *user, kl_tensor *const *reads);
	kl_status (*again_launch)(kl_ctx *ctx, void *user, int *launches);
	void *again_user;
	void (*free_again)(void *user);
} kl_deferred;

/* A range check on the values of a materialized tensor a graph reads
 * (kl__trace_check): before the graph runs, every value of t must lie in
 * [0, hi], else the call fails naming op, what, the index and the value
 * (kl_sdpa_lengths: the lengths against the cache's keys). op and what are
 * static strings. */
typedef struct kl_vcheck {
	kl_tensor *t; /* one reference held */
	int64_t hi;
	int dim;
	const char *op, *what;
} kl_vcheck;

typedef struct kl_trace {
	uint64_t id;
	kl_graph g;
	/* the materialized tensor behind each INPUT node (one reference held) */
	kl_tensor **in_tensors;
	int nin_tensors, cap_in_tensors;
	/* Ended traces of the same capture that this one continues (newest
	 * first, owned). A lazy tensor of one of them that was not materialized
	 * at its break is still usable: its node and what it reads are copied
	 * into this trace when it is used (computed again, in the new graph). */
	struct kl_trace *prev;
	/* Set on a trace once ended: per node, the tensor that received its
	 * value (one reference held), else NULL; and, per node, its copy in the
	 * trace with id imported_for (-1: none yet). */
	kl_tensor **mat;
	int32_t *imported;
	uint64_t imported_for;
	/* Writes in place recorded by kl_copy while the trace is active
	 * (kl__trace_write), in order: wdst[i] (materialized) receives the
	 * value of wsrc[i] (lazy in this trace: dense, of wdst[i]'s dtype and
	 * shape) when the graph ends, after every kernel of it ran. One
	 * reference held on each. */
	kl_tensor **wdst, **wsrc;
	int nwrites, cap_writes;
	/* actions to run after the graph (kl__trace_defer), in order */
	kl_deferred *defer;
	int ndefer, cap_defer;
	/* the graph reads values made for this call only (a run-time rng key,
	 * kl__rand_keyed): a fullgraph replay would reuse them */
	bool per_call;
	/* keys drawn from the context's generator (kl_dropout_rng), which a
	 * replay can make again: draw i's key words are the materialized
	 * tensors rng_key[2i], rng_key[2i + 1] (INPUTs of the graph, a reference
	 * held on each), drawn at the generator offset rng_start + rng_rel[i];
	 * rng_start and rng_seed are the generator's when the trace began */
	kl_tensor **rng_key;
	uint64_t *rng_rel;
	int nrng, cap_rng;
	uint64_t rng_start, rng_seed;
	/* value checks before the graph runs (kl__trace_check) */
	kl_vcheck *chk;
	int nchk, cap_chk;
} kl_trace;

/* Start recording: ops on ctx append nodes instead of running. */
kl_status kl__trace_begin(kl_ctx *ctx);
/* kl__trace_begin, continuing prev (ended, its values handed to tensors
 * through kl__trace_materialized): lazy tensors of prev and of the traces it
 * continues stay usable. Takes prev (freed with the new trace, or at once on
 * failure). */
kl_status kl__trace_continue(kl_ctx *ctx, kl_trace *prev);
/* Record that output i of ended trace tr now lives in tensor t. */
kl_status kl__trace_materialized(kl_trace *tr, int i, kl_tensor *t);
/* Whether t can be used by an op now: materialized, or lazy in the active
 * trace or in one it continues. */
bool kl__trace_holds(const kl_ctx *ctx, const kl_tensor *t);
/* Stop recording; returns the trace (caller frees with kl__trace_free).
 * outputs[] are lazy tensors of this trace: they become the graph's
 * outputs in order. */
kl_trace *kl__trace_end(kl_ctx *ctx, int noutputs, kl_tensor *const *outputs);
void kl__trace_free(kl_trace *tr);
/* The node a tensor is in the active trace, adding an INPUT node for a
 * materialized tensor, or copying a lazy tensor of a trace the active one
 * continues (with what it reads) into it, the tensor then naming the copy;
 * -1 on error. */
int32_t kl__trace_node_of(kl_ctx *ctx, kl_tensor *t);

/* Record that materialized dst receives val (a lazy tensor of the active
 * trace, dense, of dst's dtype and shape) when the graph ends. Until then a
 * read of dst itself in the trace reads val (the write is functionalized);
 * a read of another tensor whose memory overlaps dst's is an error (it
 * would see the value before the write). */
kl_status kl__trace_write(kl_ctx *ctx, kl_tensor *dst, kl_tensor *val);
/* Write the values of dense (materialized, dense, dst's dtype and shape)
 * into dst's memory, through dst's strides, and bump its storage's version.
 * A dense dst is one backend copy (on the device); a strided one goes
 * through the host. dense must not overlap dst unless it is dst. */
kl_status kl__write_into(kl_ctx *ctx, kl_tensor *dst, kl_tensor *dense);
/* Record that key words k[0], k[1] (materialized 0-dim i32 tensors the
 * active trace reads) hold the context generator's key at offset (see
 * kl_trace.rng_key); a key of a seed other than the trace's start marks
 * the trace per_call. */
kl_status kl__trace_rng_draw(kl_ctx *ctx, kl_tensor *const k[2], uint64_t offset);
/* Record an action that runs after the active trace's graph (see
 * kl_deferred): reads[] are made outputs of the graph, guard[] may not be
 * read by any node recorded after this call (the graph would see them
 * before the action changes them: an error when the graph ends). Takes
 * user (fn(ctx, user, false, NULL) frees it on failure). */
kl_status kl__trace_defer(kl_ctx *ctx, kl_status (*fn)(kl_ctx *, void *, bool, int *),
                          void *user, const char *what, int nreads, kl_tensor *const *reads,
                          int nguard, kl_tensor *const *guard);
/* Give the latest deferred action of the active trace its replay form
 * (kl_deferred.again); takes user (free_again(user) on failure). */
kl_status kl__trace_defer_again(kl_ctx *ctx,
                                kl_status (*prepare)(kl_ctx *, void *, kl_tensor *const *),
                                kl_status (*launch)(kl_ctx *, void *, int *), void *user,
                                void (*free_again)(void *));
/* The first deferred action of tr whose guarded memory a later node reads,
 * as an error (KL_ESTATE, naming the op); KL_OK when none does. */
kl_status kl__trace_check_deferred(kl_ctx *ctx, const kl_trace *tr);
/* Run tr's deferred actions, in order; adds their launches to *launches. */
kl_status kl__trace_run_deferred(kl_ctx *ctx, kl_trace *tr, int *launches);

/* Record a value check (kl_vcheck) of materialized t (1-D, i32 or i64)
 * in the active trace: run before its graph, at every call of the variant
 * (replays included). */
kl_status kl__trace_check(kl_ctx *ctx, kl_tensor *t, int64_t hi, int dim, const char *op,
                          const char *what);

/* The smallest and largest element offset (from its storage's start) t covers. */
void kl__tensor_span(const kl_tensor *t, int64_t *lo, int64_t *hi);

#endif /* KILN_TRACE_H */
