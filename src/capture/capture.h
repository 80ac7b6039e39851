/* capture.h - private to the capture layer: a compiled function, its
 * variants (one per guard set on its inputs), the graphs each variant's calls
 * produced and the graph breaks between them.
 */
#ifndef KILN_CAPTURE_H
#define KILN_CAPTURE_H

#include "capture/trace.h"
#include "runtime/compiled.h"

#define KL_FN_REASONS 64
#define KL_FN_REASON_LEN 256

/* What a variant requires of fn input i (dims in dyn are free). */
typedef struct kl_guard {
	kl_dtype dtype;
	int ndim;
	int64_t shape[KL_MAX_DIMS];
	int64_t strides[KL_MAX_DIMS];
	uint32_t dyn;
} kl_guard;

/* One compiled graph, shared by every variant whose call produced it. */
typedef struct kl_gentry {
	uint64_t key;
	kl_compiled *c;
	int nops; /* nodes other than inputs */
} kl_gentry;

/* One graph of a call, in order, with what ended it. */
typedef struct kl_seg {
	kl_gentry *e;    /* NULL: nothing lazy was alive, nothing ran */
	char reason[32]; /* the sync op that broke the graph; "" when fn returned */
	int nops;        /* ops recorded before the break */
	int last_op;     /* the op of the last node before it (-1: none) */
	int last_node;
	char after[160]; /* what ran after the graph (deferred actions), "" none */
} kl_seg;

/* A dim the caller marked dynamic that this variant's graph keeps static,
 * and why (kl_explain, kl_fn_dim_status). */
typedef struct kl_vspec {
	int input, dim;
	int64_t value;
	char why[200];
} kl_vspec;

typedef struct kl_variant {
	int id;
	kl_guard *g;
	kl_vspec *spec;
	int nspec;
	/* past the recompile limit its graph changed (user state baked into it):
	 * its shapes run eagerly from then on */
	bool retired;
	kl_seg *segs;
	int nsegs, cap_segs;
	long calls;
	/* fullgraph: how to replay without calling fn. in_src[i] >= 0: graph
	 * input i is fn input in_src[i]; else captured[-1 - in_src[i]].
	 * out_src[k] >= 0: fn output k is graph output out_src[k]; else
	 * -1 - j: fn input j (j < nin) or captured[j - nin]. */
	bool replay;
	int32_t *in_src, *out_src;
	/* and the writes in place it repeats after the plan ran (kl_copy,
	 * kl_cache_write): write w stores graph output w_src[w] into w_dst[w]
	 * (-1 - j: fn input j (j < nin) or captured[j - nin]) */
	int nw;
	int32_t *w_src, *w_dst;
	/* and the actions deferred to the graph's end it repeats after the
	 * writes (the fused optimizer step: kl_deferred.again): action q reads
	 * graph outputs re[q].rd[0..nreads); captured[re[q].state[..]] are the
	 * tensors it changes (state: written, never version-guarded; held, so
	 * that freeing their owner fails the guard before a replay) */
	struct kl_vagain {
		kl_status (*prepare)(kl_ctx *ctx, void *user, kl_tensor *const *reads);
		kl_status (*launch)(kl_ctx *ctx, void *user, int *launches);
		void *user;
		void (*free_user)(void *user);
		int nreads, nstate;
		int32_t *rd, *state;
	} *re;
	int nre;
	uint64_t re_id; /* the replay's tail's identity (kl_run_tail.id): unique in the process */
	/* and the value checks its runs make first (a trace's kl_vcheck):
	 * chk[i].in is the graph input whose values are checked */
	kl_value_check *chk;
	int nchk;
	/* fn's forward left values on the autograd tape for a kl_backward after
	 * the call: how many its last traced call kept (the min-cut partition of
	 * the joint graph), their bytes, and how many the backward computes
	 * again instead; bw_joint false when no joint graph could be built (every
	 * taped value kept) */
	int bw_saved, bw_recompute;
	int64_t bw_bytes;
	bool bw_taped, bw_joint;
	/* and the context generator's draws it makes again (kl_dropout_rng):
	 * draw d's key words go into captured[rng_cap[2d]] and
	 * captured[rng_cap[2d + 1]] (-1: the graph does not read it), keyed at
	 * the generator's offset before the call plus rng_rel[d]; the call
	 * then moves the offset by rng_advance */
	int nrng;
	int32_t *rng_cap;
	uint64_t *rng_rel, rng_advance;
	kl_tensor **captured; /* each holds one capture reference (capture_refs) */
	uint64_t *cap_version; /* captured[i]'s storage version when captured */
	/* captured[i]'s memory is state fn itself writes in place (a KV cache):
	 * writes to it, fn's or anyone's, do not fail its guard (the plan reads
	 * the memory at every call); identity still does */
	bool *cap_state;
	/* captured[i] is a key word of a generator draw: the variant's own,
	 * written before each replay, never guarded */
	bool *cap_rng;
	int ncaptured;
} kl_variant;

/* A partition of a joint graph remembered (capture/joint.c): keep[n] for
 * the trace whose structure hashed to key. */
typedef struct kl_joint_memo {
	uint64_t key;
	int32_t n;
	bool ok;
	bool *keep;
} kl_joint_memo;

typedef struct kl_guard_tally {
	char name[48];
	int count;
} kl_guard_tally;

struct kl_fn {
	kl_ctx *ctx;
	kl_fn_body body;
	void *user;
	int nin, nout;
	kl_compile_opts o;
	uint32_t *dyn; /* per input, from o (all-ones for KL_DYNAMIC_ALL) */
	bool fusion;
	int limit;
	char name[64];
	kl_variant **vars;
	int nvars, cap_vars;
	kl_variant *last; /* the variant of the latest call */
	kl_gentry **entries;
	int nentries, cap_entries;
	int compiles; /* compile events: the first, then every recompile */
	bool eager;   /* over the recompile limit: fn runs eagerly */
	kl_guard_tally tally[8];
	char last_fail[256];
	/* every recompile's reason, oldest first (the first KL_FN_REASONS kept) */
	char (*reasons)[KL_FN_REASON_LEN];
	int nreasons;
	long calls, eager_calls, replays, failed_calls;
	/* shape buckets: ascending sizes, per input / output the batch dim (-1) */
	int64_t *bk;
	int nbk;
	int *bk_in, *bk_out;
	long padded_calls;
	/* the joint graphs' partitions (capture/joint.c): remembered ones, how
	 * many min-cuts ran and how many calls reused one */
	kl_joint_memo *joint;
	int njoint, next_joint;
	int joint_cuts;
	long joint_reuses;
	bool last_failed; /* the latest kl_fn_call returned an error */
	int last_kernels; /* of the latest call that succeeded; -1 before one */
};

/* capture.c: count a failed guard (name) toward the recompile-limit warning,
 * and say why (KILN_LOGS=recompiles' tally). */
void kl__fn_tally(kl_fn *f, const char *name, const char *why);

/* replay.c: fullgraph replays. After v's first traced call (whose graph
 * is tr, its outputs lazy[0..n)), record how a replay binds the graph's
 * inputs (*no_replay set when fn must run: a value check of no graph
 * input, a per-call value such as dropout's key), repeats the writes in
 * place (*writes_replay: every write recorded) and finds fn's outputs (v
 * replays from then on). kl__replay_stale: whether a captured tensor's
 * guard fails (logged; v's replay state dropped, the call traces fn).
 * kl__replay_run: the plan alone, the writes repeated, out[] filled. */
void kl__replay_reset(kl_variant *v);
kl_status kl__replay_record_inputs(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                   const kl_trace *tr, bool *no_replay);
kl_status kl__replay_record_writes(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                   const kl_trace *tr, kl_tensor *const *lazy, int n,
                                   bool *writes_replay);
kl_status kl__replay_record_outputs(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                    kl_tensor **out, kl_tensor **lazy, int nl);
bool kl__replay_stale(kl_fn *f, kl_variant *v);
/* ... and the deferred actions of tr (after the writes), each read one of
 * lazy[0..n); *ok false when one has no replay form or reads no output. */
kl_status kl__replay_record_deferred(kl_variant *v, kl_trace *tr, kl_tensor *const *lazy, int n,
                                     bool *ok);
kl_status kl__replay_run(kl_fn *f, kl_variant *v, kl_tensor *const *in, kl_tensor **out);

/* capture.c: one call of f at the sizes given (buckets.c's kl_fn_call pads
 * to a bucket around it); whether f's calls run as CUDA graphs (a CUDA
 * context, reduce-overhead or max-autotune) */
kl_status kl__fn_call(kl_fn *f, kl_tensor *const *in, kl_tensor **out);
bool kl__fn_graphs(const kl_fn *f);

/* joint.c: keep[] (tr->g.n entries) says which nodes of tr's graph the
 * forward keeps for a kl_backward after the call (the min-cut partition of
 * fn's joint graph, computed once per trace structure and remembered);
 * false when no joint graph can be built (every taped value is kept). */
bool kl__joint_keep(kl_fn *f, kl_trace *tr, kl_tensor *const *out, bool *keep);
void kl__joint_free(kl_fn *f);

/* explain.c */
void kl__capture_explain(const kl_fn *f, FILE *out);
void kl__guard_str(const kl_guard *g, char *buf, size_t cap);
/* The first way graph b differs from graph a, for recompile logs. */
void kl__graph_diff(const kl_graph *a, const kl_graph *b, char *buf, size_t cap);

#endif /* KILN_CAPTURE_H */
