/* replay.c - fullgraph replays: after a variant's first traced call, how a
 * later call runs its plan without running fn (which graph inputs are fn's
 * inputs and which tensors fn reached through user state, the writes in
 * place to repeat, where each output comes from), the guards on those
 * captured tensors, and the replay itself.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "capture/capture.h"

/* Forget how a fullgraph variant replays (its captured tensors go back). */
void kl__replay_reset(kl_variant *v)
{
	for (int i = 0; i < v->ncaptured; i++) {
		v->captured[i]->capture_refs--;
		kl_release(v->captured[i]);
	}
	free(v->captured);
	free(v->cap_version);
	free(v->cap_state);
	v->cap_state = NULL;
	free(v->cap_rng);
	v->cap_rng = NULL;
	free(v->rng_cap);
	free(v->rng_rel);
	v->rng_cap = NULL;
	v->rng_rel = NULL;
	v->nrng = 0;
	v->rng_advance = 0;
	for (int q = 0; q < v->nre; q++) {
		v->re[q].free_user(v->re[q].user);
		free(v->re[q].rd);
		free(v->re[q].state);
	}
	free(v->re);
	v->re = NULL;
	v->nre = 0;
	free(v->in_src);
	free(v->out_src);
	free(v->w_src);
	free(v->w_dst);
	free(v->chk);
	v->chk = NULL;
	v->nchk = 0;
	v->captured = NULL;
	v->cap_version = NULL;
	v->in_src = v->out_src = NULL;
	v->w_src = v->w_dst = NULL;
	v->nw = 0;
	v->ncaptured = 0;
	v->replay = false;
}

/* Capture t (a tensor fn reached through user state) for replays: its index
 * in v->captured, or -1 when out of memory. */
static int capture(kl_variant *v, kl_tensor *t)
{
	for (int i = 0; i < v->ncaptured; i++)
		if (v->captured[i] == t)
			return i;
	kl_tensor **p = realloc(v->captured, (size_t)(v->ncaptured + 1) * sizeof *p);
	if (!p)
		return -1;
	v->captured = p;
	uint64_t *q = realloc(v->cap_version, (size_t)(v->ncaptured + 1) * sizeof *q);
	if (!q)
		return -1;
	v->cap_version = q;
	v->captured[v->ncaptured] = kl_retain(t);
	t->capture_refs++;
	v->cap_version[v->ncaptured] = t->st->version;
	return v->ncaptured++;
}

/* Why a replay of v would compute with tensors the program no longer means
 * (the guards on captured tensors, see kl_fn_body in kiln.h); NULL if none. */
static const char *captured_stale(const kl_variant *v, char *why, size_t cap)
{
	/* on every replay: two compares a tensor, words only on a failure */
	for (int i = 0; i < v->ncaptured; i++) {
		const kl_tensor *t = v->captured[i];
		if (v->cap_rng && v->cap_rng[i])
			continue;
		bool gone = t->refs <= t->capture_refs;
		if (!gone && (t->st->version == v->cap_version[i] || (v->cap_state && v->cap_state[i])))
			continue;
		char sh[128], what[96];
		if (gone)
			snprintf(what, sizeof what, "is no longer held by the program");
		else
			snprintf(what, sizeof what, "was written in place (version %" PRIu64
			         " -> %" PRIu64 ")", v->cap_version[i], t->st->version);
		snprintf(why, cap, "captured tensor %d (%s %s, reached through user state) %s", i,
		         kl_dtype_name(t->dtype), kl__shape_str(sh, sizeof sh, t->ndim, t->shape),
		         what);
		return why;
	}
	return NULL;
}

kl_status kl__replay_record_inputs(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                   const kl_trace *tr, bool *no_replay)
{
	int n = tr->nin_tensors;
	if (tr->per_call)
		*no_replay = true; /* dropout's key: fn makes it anew each call */
	free(v->chk);
	v->nchk = 0;
	v->chk = calloc((size_t)(tr->nchk ? tr->nchk : 1), sizeof *v->chk);
	if (!v->chk)
		return KL_ENOMEM;
	for (int c = 0; c < tr->nchk; c++) {
		int i = 0;
		while (i < n && tr->in_tensors[i] != tr->chk[c].t)
			i++;
		if (i == n) {
			*no_replay = true; /* a check of no graph input: fn must run */
			continue;
		}
		/* the same input against the same bound once (a decoder stack's
		 * layers each check its lengths: one check of them a call, not one
		 * a layer) */
		int dup = 0;
		while (dup < v->nchk && !(v->chk[dup].in == i && v->chk[dup].dim == tr->chk[c].dim &&
		                          v->chk[dup].hi == tr->chk[c].hi))
			dup++;
		if (dup < v->nchk)
			continue;
		v->chk[v->nchk++] = (kl_value_check){i, tr->chk[c].dim, tr->chk[c].hi, tr->chk[c].op,
		                                     tr->chk[c].what};
	}
	free(v->in_src);
	v->in_src = calloc((size_t)(n ? n : 1), sizeof *v->in_src);
	if (!v->in_src)
		return KL_ENOMEM;
	for (int i = 0; i < n; i++) {
		kl_tensor *t = tr->in_tensors[i];
		int j = 0;
		while (j < f->nin && in[j] != t)
			j++;
		if (j < f->nin) {
			v->in_src[i] = j;
			continue;
		}
		/* a tensor fn reached through user state: bound as traced */
		int k = capture(v, t);
		if (k < 0)
			return KL_ENOMEM;
		v->in_src[i] = -1 - k;
	}
	/* the generator's draws: which captured tensors hold their key words */
	free(v->rng_cap);
	free(v->rng_rel);
	v->nrng = tr->nrng;
	v->rng_advance = f->ctx->rng_offset - tr->rng_start;
	v->rng_cap = malloc(sizeof *v->rng_cap * 2 * (size_t)(tr->nrng ? tr->nrng : 1));
	v->rng_rel = malloc(sizeof *v->rng_rel * (size_t)(tr->nrng ? tr->nrng : 1));
	if (!v->rng_cap || !v->rng_rel)
		return KL_ENOMEM;
	for (int d = 0; d < tr->nrng; d++) {
		v->rng_rel[d] = tr->rng_rel[d];
		for (int w = 0; w < 2; w++) {
			int i = 0;
			while (i < n && tr->in_tensors[i] != tr->rng_key[2 * d + w])
				i++;
			v->rng_cap[2 * d + w] = i < n && v->in_src[i] < 0 ? -1 - v->in_src[i] : -1;
		}
	}
	return KL_OK;
}

/* Record how a replay repeats the writes in place of the graph tr, whose
 * outputs are lazy[0..n): each write's value is one of them, and its
 * destination an fn input or a tensor fn reached (captured: guarded like
 * the tensors the graph reads). *writes_replay says whether every write
 * was recorded. */
kl_status kl__replay_record_writes(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                   const kl_trace *tr, kl_tensor *const *lazy, int n,
                                   bool *writes_replay)
{
	*writes_replay = false;
	free(v->w_src);
	free(v->w_dst);
	v->nw = 0;
	v->w_src = calloc((size_t)(tr->nwrites ? tr->nwrites : 1), sizeof *v->w_src);
	v->w_dst = calloc((size_t)(tr->nwrites ? tr->nwrites : 1), sizeof *v->w_dst);
	if (!v->w_src || !v->w_dst)
		return KL_ENOMEM;
	for (int w = 0; w < tr->nwrites; w++) {
		int j = 0;
		while (j < n && lazy[j] != tr->wsrc[w])
			j++;
		if (j == n)
			return KL_OK; /* a value no graph output holds: fn must run */
		int k = 0;
		while (k < f->nin && in[k] != tr->wdst[w])
			k++;
		if (k == f->nin) {
			int c = capture(v, tr->wdst[w]);
			if (c < 0)
				return KL_ENOMEM;
			k = f->nin + c;
		}
		v->w_src[w] = j;
		v->w_dst[w] = -1 - k;
		v->nw = w + 1;
	}
	*writes_replay = true;
	return KL_OK;
}

kl_status kl__replay_record_deferred(kl_variant *v, kl_trace *tr, kl_tensor *const *lazy, int n,
                                     bool *ok)
{
	*ok = false;
	for (int q = 0; q < tr->ndefer; q++) {
		kl_deferred *d = &tr->defer[q];
		if (!d->again_user)
			return KL_OK; /* no replay form: fn must run */
		for (int k = 0; k < d->nreads; k++) {
			int j = 0;
			while (j < n && lazy[j] != d->reads[k])
				j++;
			if (j == n)
				return KL_OK; /* a value no graph output holds */
		}
	}
	int nd = tr->ndefer > 0 ? tr->ndefer : 1;
	v->re = calloc((size_t)nd, sizeof *v->re);
	if (!v->re)
		return KL_ENOMEM;
	for (int q = 0; q < tr->ndefer; q++) {
		kl_deferred *d = &tr->defer[q];
		struct kl_vagain *a = &v->re[q];
		a->rd = calloc((size_t)d->nreads + 1, sizeof *a->rd);
		a->state = calloc((size_t)d->nguard + 1, sizeof *a->state);
		if (!a->rd || !a->state) {
			free(a->rd);
			free(a->state);
			return KL_ENOMEM;
		}
		for (int k = 0; k < d->nreads; k++) {
			int j = 0;
			while (lazy[j] != d->reads[k])
				j++;
			a->rd[a->nreads++] = j;
		}
		for (int k = 0; k < d->nguard; k++) {
			int c = capture(v, d->guard[k]);
			if (c < 0) {
				free(a->rd);
				free(a->state);
				return KL_ENOMEM;
			}
			a->state[a->nstate++] = c;
		}
		a->prepare = d->again_prepare;
		a->launch = d->again_launch;
		a->user = d->again_user;
		a->free_user = d->free_again;
		d->again_user = NULL;
		v->nre = q + 1;
	}
	static atomic_uint_fast64_t tails;
	v->re_id = atomic_fetch_add(&tails, 1) + 1;
	*ok = true;
	return KL_OK;
}

kl_status kl__replay_record_outputs(kl_fn *f, kl_variant *v, kl_tensor *const *in,
                                    kl_tensor **out, kl_tensor **lazy, int nl)
{
	free(v->out_src);
	v->out_src = calloc((size_t)(f->nout ? f->nout : 1), sizeof *v->out_src);
	if (!v->out_src)
		return KL_ENOMEM;
	for (int k = 0; k < f->nout; k++) {
		int j;
		for (j = 0; j < nl && lazy[j] != out[k]; j++)
			;
		if (j < nl) {
			v->out_src[k] = j;
			continue;
		}
		for (j = 0; j < f->nin && in[j] != out[k]; j++)
			;
		if (j == f->nin) {
			int c = capture(v, out[k]);
			if (c < 0)
				return KL_ENOMEM;
			j = f->nin + c;
		}
		v->out_src[k] = -1 - j;
	}
	/* the captured tensors whose memory fn writes in place are state */
	free(v->cap_state);
	v->cap_state = calloc((size_t)(v->ncaptured ? v->ncaptured : 1), sizeof *v->cap_state);
	if (!v->cap_state)
		return KL_ENOMEM;
	for (int w = 0; w < v->nw; w++) {
		int j = -1 - v->w_dst[w];
		const kl_storage *ws = j < f->nin ? in[j]->st : v->captured[j - f->nin]->st;
		for (int i = 0; i < v->ncaptured; i++)
			v->cap_state[i] |= v->captured[i]->st == ws;
	}
	for (int q = 0; q < v->nre; q++)
		for (int k = 0; k < v->re[q].nstate; k++)
			for (int i = 0; i < v->ncaptured; i++)
				v->cap_state[i] |=
				        v->captured[i]->st == v->captured[v->re[q].state[k]]->st;
	free(v->cap_rng);
	v->cap_rng = calloc((size_t)(v->ncaptured ? v->ncaptured : 1), sizeof *v->cap_rng);
	if (!v->cap_rng)
		return KL_ENOMEM;
	for (int d = 0; d < 2 * v->nrng; d++)
		if (v->rng_cap[d] >= 0)
			v->cap_rng[v->rng_cap[d]] = true;
	v->replay = true;
	return KL_OK;
}

/* The deferred actions of a replay as one kl_run_tail: prepare gathers
 * each action's reads from the plan's outputs. */
static kl_status tail_prepare(kl_ctx *ctx, void *user, kl_tensor *const *outputs)
{
	const kl_variant *v = user;
	kl_status st = KL_OK;
	for (int q = 0; q < v->nre && st == KL_OK; q++) {
		const struct kl_vagain *a = &v->re[q];
		kl_tensor *rd[64],
		        **reads = a->nreads <= 64 ? rd : malloc(sizeof *reads * (size_t)a->nreads);
		if (!reads)
			return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		for (int k = 0; k < a->nreads; k++)
			reads[k] = outputs[a->rd[k]];
		st = a->prepare(ctx, a->user, reads);
		if (reads != rd)
			free(reads);
	}
	return st;
}

static kl_status tail_launch(kl_ctx *ctx, void *user, int *launches)
{
	const kl_variant *v = user;
	kl_status st = KL_OK;
	for (int q = 0; q < v->nre && st == KL_OK; q++)
		st = v->re[q].launch(ctx, v->re[q].user, launches);
	return st;
}

kl_status kl__replay_run(kl_fn *f, kl_variant *v, kl_tensor *const *in, kl_tensor **out)
{
	kl_ctx *ctx = f->ctx;
	kl_gentry *e = v->nsegs > 0 ? v->segs[0].e : NULL;
	kl_tensor **gin = NULL, **gout = NULL;
	kl_status st = KL_OK;
	if (e) {
		gin = malloc(sizeof *gin * (size_t)(e->c->nin ? e->c->nin : 1));
		gout = calloc((size_t)(e->c->nout ? e->c->nout : 1), sizeof *gout);
		if (!gin || !gout)
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		for (int i = 0; st == KL_OK && i < e->c->nin; i++)
			gin[i] = v->in_src[i] >= 0 ? in[v->in_src[i]]
			                           : v->captured[-1 - v->in_src[i]];
		ctx->profile_graph = 0;
		/* the generator's keys this call draws, into the graph's key
		 * inputs (on CUDA a copy queued before the plan's launches) */
		uint64_t seed = ctx->rng_seed, base = ctx->rng_offset;
		for (int d = 0; st == KL_OK && d < v->nrng; d++) {
			uint64_t key = kl__philox_key(seed, base + v->rng_rel[d]);
			int32_t w[2] = {(int32_t)(uint32_t)key, (int32_t)(uint32_t)(key >> 32)};
			for (int k = 0; st == KL_OK && k < 2; k++)
				if (v->rng_cap[2 * d + k] >= 0)
					st = ctx->be->from_host(
					        ctx,
					        kl__tensor_data(v->captured[v->rng_cap[2 * d + k]]),
					        &w[k], sizeof w[k]);
		}
		/* the deferred actions (the fused optimizer step) run as the plan's
		 * tail, inside its CUDA graph, unless writes in place come first:
		 * the traced call ran them after its writes */
		kl_run_tail tail = {tail_prepare, tail_launch, v,
		                    (const void *)(uintptr_t)v->re_id};
		bool in_plan = v->nre > 0 && v->nw == 0;
		if (st == KL_OK)
			st = kl__compiled_run_tail(ctx, e->c, gin, gout, in_plan ? &tail : NULL, v->chk,
			                           v->nchk);
		if (st == KL_OK)
			ctx->rng_offset = base + v->rng_advance;
		/* the writes in place, as the traced call made them (a cache
		 * write's value is the cache's memory already: only its version
		 * moves); the captured tensors they wrote keep their guard */
		for (int w = 0; st == KL_OK && w < v->nw; w++) {
			int j = -1 - v->w_dst[w];
			kl_tensor *dst = j < f->nin ? in[j] : v->captured[j - f->nin];
			st = kl__write_into(ctx, dst, gout[v->w_src[w]]);
			for (int i = 0; st == KL_OK && i < v->ncaptured; i++)
				if (v->captured[i]->st == dst->st)
					v->cap_version[i] = dst->st->version;
		}
	}
	/* else the deferred actions after the writes, as the traced call ran them */
	int more = 0;
	if (st == KL_OK && e && v->nre > 0 && v->nw > 0) {
		st = tail_prepare(ctx, v, gout);
		if (st == KL_OK)
			st = tail_launch(ctx, v, &more);
	}
	if (st == KL_OK) {
		for (int k = 0; k < f->nout; k++) {
			int32_t s = v->out_src[k];
			int j = -1 - s;
			out[k] = kl_retain(s >= 0       ? gout[s]
			                   : j < f->nin ? in[j]
			                                : v->captured[j - f->nin]);
		}
		f->last_kernels = (e ? e->c->last_launches : 0) + more;
		f->last = v;
		v->calls++;
		f->replays++;
	}
	for (int j = 0; gout && e && j < e->c->nout; j++)
		kl_release(gout[j]);
	free(gin);
	free(gout);
	return st;
}

/* Check v's captured-tensor guards before a replay; when one fails, log it
 * and drop the replay state (the call traces fn again). */
bool kl__replay_stale(kl_fn *f, kl_variant *v)
{
	char why[256];
	if (!captured_stale(v, why, sizeof why))
		return false;
	kl__fn_tally(f, "captured tensor", why);
	kl__log(f->ctx, KL_LOG_RECOMPILES, "%s: variant %d: %s: tracing fn again", f->name, v->id,
	        why);
	kl__replay_reset(v);
	return true;
}
