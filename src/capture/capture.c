/* capture.c - kl_compile and kl_fn_call, kiln's TorchDynamo: a call runs fn
 * under a lazy trace, sync points inside it become graph breaks, every graph
 * is keyed and compiled once per variant (guards on the inputs), fullgraph
 * variants replay without calling fn, and past the recompile limit fn runs
 * eagerly.
 */
#define _GNU_SOURCE /* dladdr: names functions in logs when it can */
#include <dlfcn.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "capture/capture.h"

static atomic_int fn_counter;

/* ---- counting eager launches -------------------------------------------------
 * Eager ops reach the backend through ctx->be->exec; for the length of an
 * eager call the context gets a copy of its backend whose exec counts. */

static _Thread_local const kl_backend *tl_real_be;
static _Thread_local int tl_exec_count;

static kl_status counting_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	tl_exec_count++;
	return tl_real_be->exec(ctx, n, in, out);
}

/* ---- creation ---------------------------------------------------------------- */

static void name_fn(kl_fn *f, kl_fn_body fn)
{
	Dl_info di;
	void *p;
	memcpy(&p, &fn, sizeof p);
	if (dladdr(p, &di) && di.dli_sname && di.dli_saddr == p) {
		size_t i = 0;
		for (; di.dli_sname[i] && i < sizeof f->name - 1; i++) {
			char c = di.dli_sname[i];
			f->name[i] = (c > 0x20 && c < 0x7f) ? c : '?';
		}
		f->name[i] = '\0';
		return;
	}
	snprintf(f->name, sizeof f->name, "fn#%d", atomic_fetch_add(&fn_counter, 1) + 1);
}

kl_fn *kl_compile(kl_ctx *ctx, kl_fn_body fn, void *user, int nin, int nout,
                  const kl_compile_opts *opts)
{
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl_compile: ctx is NULL");
		return NULL;
	}
	kl_compile_opts o = opts ? *opts : (kl_compile_opts){0};
	const char *bad = NULL;
	if (!fn)
		bad = "fn is NULL";
	else if (nin < 0 || nout < 0 || nin > 65536 || nout > 65536)
		bad = "nin and nout must be in 0..65536";
	else if ((unsigned)o.mode > KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS)
		bad = "unknown mode";
	else if (o.recompile_limit < 0)
		bad = "recompile_limit must be >= 0";
	else if (o.dynamic != 0 && o.dynamic != KL_DYNAMIC_ALL)
		bad = "dynamic takes 0 or KL_DYNAMIC_ALL (every dim of every input); to mark some "
		      "dims, set dynamic_dims[i] to input i's mask (bit d = dim d, e.g. "
		      "(uint32_t[]){KL_DIM(0)} for input 0's first dim) and ndynamic_dims";
	else if (o.ndynamic_dims < 0 || o.ndynamic_dims > nin ||
	         (o.ndynamic_dims > 0 && !o.dynamic_dims))
		bad = "ndynamic_dims must be in 0..nin, with dynamic_dims set";
	for (int i = 0; !bad && i < o.ndynamic_dims; i++)
		if (o.dynamic_dims[i] >> KL_MAX_DIMS)
			bad = "a dynamic_dims mask names a dim >= 8 (bit d is dim d; at most "
			      "KL_MAX_DIMS dims)";
	if (!bad && o.nbuckets != 0) {
		if (o.nbuckets < 0 && o.nbuckets != KL_BUCKETS_DEFAULT)
			bad = "nbuckets takes 0, KL_BUCKETS_DEFAULT or the count of buckets";
		else if (o.nbuckets > 0 && !o.buckets)
			bad = "nbuckets > 0 needs buckets";
		else if ((nin > 0 && !o.bucket_in_dims) || (nout > 0 && !o.bucket_out_dims))
			bad = "buckets need bucket_in_dims (nin entries) and bucket_out_dims (nout "
			      "entries): each input's and output's batch dim, -1 for none";
		for (int i = 1; !bad && i < o.nbuckets; i++)
			if (o.buckets[i] <= o.buckets[i - 1])
				bad = "buckets must be ascending";
		if (!bad && o.nbuckets > 0 && o.buckets[0] < 1)
			bad = "buckets must be >= 1";
		for (int i = 0; !bad && i < nin; i++)
			if (o.bucket_in_dims[i] < -1 || o.bucket_in_dims[i] >= KL_MAX_DIMS)
				bad = "a bucket_in_dims entry is outside -1..7";
		for (int k = 0; !bad && k < nout; k++)
			if (o.bucket_out_dims[k] < -1 || o.bucket_out_dims[k] >= KL_MAX_DIMS)
				bad = "a bucket_out_dims entry is outside -1..7";
		bool any = false;
		for (int i = 0; !bad && i < nin; i++)
			any |= o.bucket_in_dims[i] >= 0;
		if (!bad && !any)
			bad = "buckets need a batch dim on at least one input";
	}
	if (bad && o.dynamic != 0 && o.dynamic != KL_DYNAMIC_ALL) {
		kl__err(ctx, KL_EINVAL, "kl_compile: dynamic is %d: %s", o.dynamic, bad);
		return NULL;
	}
	if (bad) {
		kl__err(ctx, KL_EINVAL, "kl_compile: %s", bad);
		return NULL;
	}
	kl_fn *f = calloc(1, sizeof *f);
	uint32_t *dyn = calloc((size_t)(nin ? nin : 1), sizeof *dyn);
	if (!f || !dyn) {
		free(f);
		free(dyn);
		kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		return NULL;
	}
	for (int i = 0; i < nin; i++)
		dyn[i] = o.dynamic == KL_DYNAMIC_ALL ? (1u << KL_MAX_DIMS) - 1
		         : i < o.ndynamic_dims       ? o.dynamic_dims[i]
		                                     : 0;
	if (o.nbuckets != 0) {
		/* vLLM's capture sizes: 1, 2, 4, 8..256 by 8, 272..512 by 16 */
		int n = o.nbuckets > 0 ? o.nbuckets : 3 + 32 + 16;
		f->bk = malloc(sizeof *f->bk * (size_t)n);
		f->bk_in = malloc(sizeof(int) * (size_t)(nin ? nin : 1));
		f->bk_out = malloc(sizeof(int) * (size_t)(nout ? nout : 1));
		if (!f->bk || !f->bk_in || !f->bk_out) {
			free(f->bk);
			free(f->bk_in);
			free(f->bk_out);
			free(f);
			free(dyn);
			kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
			return NULL;
		}
		for (int i = 0; i < n; i++)
			f->bk[i] = o.nbuckets > 0 ? o.buckets[i]
			           : i < 3        ? (int64_t)1 << i
			           : i < 35       ? 8 * (int64_t)(i - 2)
			                          : 256 + 16 * (int64_t)(i - 34);
		f->nbk = n;
		for (int i = 0; i < nin; i++) {
			f->bk_in[i] = o.bucket_in_dims[i];
			if (f->bk_in[i] >= 0)
				dyn[i] |= 1u << f->bk_in[i]; /* a bucketed dim is dynamic */
		}
		for (int k = 0; k < nout; k++)
			f->bk_out[k] = o.bucket_out_dims[k];
	}
	o.dynamic_dims = NULL; /* the caller's array need not outlive this call */
	o.buckets = NULL;
	o.bucket_in_dims = o.bucket_out_dims = NULL;
	f->ctx = ctx;
	f->body = fn;
	f->user = user;
	f->nin = nin;
	f->nout = nout;
	f->o = o;
	f->dyn = dyn;
	const char *nf = getenv("KILN_DISABLE_FUSION");
	f->fusion = !(nf && *nf && strcmp(nf, "0") != 0);
	/* a bucketed dim its graph specialises compiles one variant per bucket:
	 * the default limit leaves room for every bucket */
	f->limit = o.recompile_limit ? o.recompile_limit : f->nbk > 8 ? f->nbk : 8;
	f->last_kernels = -1;
	name_fn(f, fn);
	return f;
}

static void variant_free(kl_variant *v)
{
	if (!v)
		return;
	kl__replay_reset(v);
	free(v->segs);
	free(v->g);
	free(v->spec);
	free(v);
}

void kl_fn_free(kl_fn *f)
{
	if (!f)
		return;
	for (int i = 0; i < f->nvars; i++)
		variant_free(f->vars[i]);
	free(f->vars);
	for (int i = 0; i < f->nentries; i++) {
		kl__compiled_free(f->entries[i]->c);
		free(f->entries[i]);
	}
	free(f->entries);
	kl__joint_free(f);
	free(f->dyn);
	free(f->reasons);
	free(f->bk);
	free(f->bk_in);
	free(f->bk_out);
	free(f);
}

int kl_fn_last_kernels(const kl_fn *f)
{
	return f ? f->last_kernels : -1;
}

bool kl__fn_graphs(const kl_fn *f)
{
	return f->ctx->device == KL_CUDA &&
	       (f->o.mode == KL_MODE_REDUCE_OVERHEAD || f->o.mode == KL_MODE_MAX_AUTOTUNE);
}

kl_status kl_fn_get_stats(const kl_fn *f, kl_fn_stats *out)
{
	if (!f || !out)
		return kl__err(f ? f->ctx : NULL, KL_EINVAL, "kl_fn_get_stats: %s is NULL",
		               !f ? "f" : "out");
	*out = (kl_fn_stats){.calls = f->calls,
	                     .replays = f->replays,
	                     .eager_calls = f->eager_calls,
	                     .failed_calls = f->failed_calls,
	                     .compiles = f->compiles,
	                     .recompiles = f->compiles > 0 ? f->compiles - 1 : 0,
	                     .variants = f->nvars,
	                     .over_limit = f->eager,
	                     .padded_calls = f->padded_calls,
	                     .partitions = f->joint_cuts,
	                     .partition_reuses = f->joint_reuses};
	for (int i = 0; i < f->nentries; i++) {
		double ms;
		out->graph_captures += kl__cuda_rt_captures(f->entries[i]->c, &ms);
		out->graph_replays += kl__cuda_rt_replays(f->entries[i]->c);
		out->capture_ms += ms;
	}
	return KL_OK;
}

const char *kl_fn_recompile_reason(const kl_fn *f, int i)
{
	return f && i >= 0 && i < f->nreasons ? f->reasons[i] : NULL;
}

kl_status kl_fn_dim_state(const kl_fn *f, int v, int input, int dim, kl_dim_state *state,
                          const char **why)
{
	if (!f || !state)
		return kl__err(f ? f->ctx : NULL, KL_EINVAL, "kl_fn_dim_state: %s is NULL",
		               !f ? "f" : "state");
	if (v < 0 || v >= f->nvars || input < 0 || input >= f->nin || dim < 0 ||
	    dim >= f->vars[v]->g[input].ndim)
		return kl__err(f->ctx, KL_EINVAL,
		               "kl_fn_dim_state: %s: variant %d input %d dim %d does not exist (%d "
		               "variants, %d inputs%s)",
		               f->name, v, input, dim, f->nvars, f->nin,
		               v >= 0 && v < f->nvars && input >= 0 && input < f->nin
		                       ? ", fewer dims"
		                       : "");
	const kl_variant *var = f->vars[v];
	if (why)
		*why = "";
	if (!(f->dyn[input] >> dim & 1))
		*state = KL_DIM_STATIC;
	else if (var->g[input].dyn >> dim & 1)
		*state = KL_DIM_SYMBOLIC;
	else {
		*state = KL_DIM_SPECIALIZED;
		for (int k = 0; why && k < var->nspec; k++)
			if (var->spec[k].input == input && var->spec[k].dim == dim)
				*why = var->spec[k].why;
	}
	return KL_OK;
}

/* ---- guards ------------------------------------------------------------------ */

/* NULL when t passes g; else the guard's name and the old/new values. */
static const char *guard_check(const kl_guard *g, const kl_tensor *t, int i, char *why, size_t cap,
                               char *name, size_t ncap)
{
	char a[128], b[128];
	if (t->dtype != g->dtype) {
		snprintf(name, ncap, "input %d dtype", i);
		snprintf(why, cap, "input %d dtype: %s -> %s", i, kl_dtype_name(g->dtype),
		         kl_dtype_name(t->dtype));
		return why;
	}
	if (t->ndim != g->ndim) {
		snprintf(name, ncap, "input %d rank", i);
		snprintf(why, cap, "input %d rank: %d -> %d", i, g->ndim, t->ndim);
		return why;
	}
	for (int d = 0; d < g->ndim; d++)
		if (!(g->dyn >> d & 1) && t->shape[d] != g->shape[d]) {
			snprintf(name, ncap, "input %d dim %d", i, d);
			snprintf(why, cap, "input %d dim %d: %" PRId64 " -> %" PRId64, i, d,
			         g->shape[d], t->shape[d]);
			return why;
		}
	if (g->dyn)
		return NULL; /* dynamic inputs are bound dense whatever their strides */
	for (int d = 0; d < g->ndim; d++)
		if (g->shape[d] != 1 && t->strides[d] != g->strides[d]) {
			snprintf(name, ncap, "input %d strides", i);
			snprintf(why, cap, "input %d strides: %s -> %s", i,
			         kl__shape_str(a, sizeof a, g->ndim, g->strides),
			         kl__shape_str(b, sizeof b, t->ndim, t->strides));
			return why;
		}
	return NULL;
}

static kl_variant *find_variant(kl_fn *f, kl_tensor *const *in)
{
	char why[160], name[48];
	for (int k = f->nvars - 1; k >= 0; k--) {
		kl_variant *v = f->vars[k];
		int i = 0;
		while (i < f->nin &&
		       !guard_check(&v->g[i], in[i], i, why, sizeof why, name, sizeof name))
			i++;
		if (i == f->nin)
			return v;
	}
	return NULL;
}

/* Why the latest variant does not fit in[] (for logs and the limit warning). */
static void explain_miss(kl_fn *f, kl_tensor *const *in, char *why, size_t cap, char *name,
                         size_t ncap)
{
	snprintf(why, cap, "no variant matches");
	snprintf(name, ncap, "inputs");
	if (!f->last)
		return;
	for (int i = 0; i < f->nin; i++)
		if (guard_check(&f->last->g[i], in[i], i, why, cap, name, ncap))
			return;
}

void kl__fn_tally(kl_fn *f, const char *name, const char *why)
{
	snprintf(f->last_fail, sizeof f->last_fail, "%s", why);
	int low = 0;
	for (int i = 0; i < 8; i++) {
		if (!strcmp(f->tally[i].name, name)) {
			f->tally[i].count++;
			return;
		}
		if (f->tally[i].count < f->tally[low].count)
			low = i;
	}
	snprintf(f->tally[low].name, sizeof f->tally[low].name, "%s", name);
	f->tally[low].count = 1;
}

/* Keep recompile #f->compiles's reason for kl_fn_recompile_reason. */
static void note_recompile(kl_fn *f, const char *fmt, ...) KL_PRINTF(2, 3);
static void note_recompile(kl_fn *f, const char *fmt, ...)
{
	if (f->nreasons >= KL_FN_REASONS)
		return;
	if (!f->reasons && !(f->reasons = calloc(KL_FN_REASONS, sizeof *f->reasons)))
		return; /* only the API's copy of the log is lost */
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(f->reasons[f->nreasons++], KL_FN_REASON_LEN, fmt, ap);
	va_end(ap);
}

/* The bucket list of f, shortened: "1, 2, 4, 8, ..., 512 (51 sizes)". */
static void bucket_list(const kl_fn *f, char *buf, size_t cap)
{
	size_t at = 0;
	buf[0] = 0;
	for (int k = 0; k < f->nbk && at < cap; k++) {
		int w;
		if (f->nbk > 8 && k == 6) {
			w = snprintf(buf + at, cap - at, ", ...");
			k = f->nbk - 2;
		} else {
			w = snprintf(buf + at, cap - at, "%s%lld", k ? ", " : "", (long long)f->bk[k]);
		}
		at += w > 0 ? (size_t)w : 0;
	}
	if (at < cap)
		snprintf(buf + at, cap - at, " (%d size%s)", f->nbk, f->nbk == 1 ? "" : "s");
}

/* Why some variant of f specialised input i dim d ("" when none says). */
static const char *spec_why(const kl_fn *f, int i, int d)
{
	for (int v = f->nvars - 1; v >= 0; v--)
		for (int k = 0; k < f->vars[v]->nspec; k++)
			if (f->vars[v]->spec[k].input == i && f->vars[v]->spec[k].dim == d &&
			    f->vars[v]->spec[k].why[0])
				return f->vars[v]->spec[k].why;
	return "";
}

/* What to write to compile the dim of guard `name` once ("" when the
 * guard is no input dim). at_limit: the recompile-limit warning (a bucket
 * dim then names the fix). */
static void dim_advice(const kl_fn *f, const char *name, bool at_limit, char *buf, size_t cap)
{
	int i, d;
	buf[0] = 0;
	if (sscanf(name, "input %d dim %d", &i, &d) != 2 || i < 0 || i >= f->nin || d < 0 ||
	    d >= KL_MAX_DIMS)
		return;
	if (f->nbk && f->bk_in[i] == d) {
		char list[160];
		const char *why = spec_why(f, i, d);
		bucket_list(f, list, sizeof list);
		if (at_limit)
			snprintf(buf, cap,
			         "; input %d dim %d is the batch dim of buckets %s and its graph "
			         "specialises it%s%s%s, so each bucket compiles a variant of its own: "
			         "set kl_compile_opts.recompile_limit to at least %d (the bucket "
			         "count; 0 does so) or list fewer buckets",
			         i, d, list, why[0] ? " (" : "", why, why[0] ? ")" : "", f->nbk);
		else
			snprintf(buf, cap, "; a bucket of input %d dim %d (buckets %s), which its graph "
			         "specialises: one variant per bucket", i, d, list);
		return;
	}
	if (f->dyn[i] >> d & 1)
		snprintf(buf, cap,
		         "; the dim is marked dynamic but its graph needs it static (kl_explain "
		         "says why)");
	else
		snprintf(buf, cap,
		         "; mark it dynamic to compile one variant for every size: "
		         "kl_compile_opts.dynamic_dims[%d] |= 1u << %d (with ndynamic_dims > %d)",
		         i, d, i);
}

static void go_eager(kl_fn *f)
{
	if (f->eager)
		return;
	f->eager = true;
	int best = 0;
	for (int i = 1; i < 8; i++)
		if (f->tally[i].count > f->tally[best].count)
			best = i;
	char advice[512];
	dim_advice(f, f->tally[best].name, true, advice, sizeof advice);
	fprintf(stderr,
	        "kiln: warning: kl_fn_call: %s reached its recompile limit (%d variants); guard "
	        "'%s' kept failing (%d times, last: %s)%s; its %d compiled variants keep serving "
	        "their shapes, other shapes run eagerly from now on\n",
	        f->name, f->limit, f->tally[best].count ? f->tally[best].name : "?",
	        f->tally[best].count, f->last_fail[0] ? f->last_fail : "?", advice, f->nvars);
	kl__log(f->ctx, KL_LOG_RECOMPILES, "%s: recompile limit %d reached: eager from now on",
	        f->name, f->limit);
}

static kl_variant *new_variant(kl_fn *f, kl_tensor *const *in)
{
	if (f->nvars == f->cap_vars) {
		int nc = f->cap_vars ? f->cap_vars * 2 : 4;
		kl_variant **p = realloc(f->vars, (size_t)nc * sizeof *p);
		if (!p)
			return NULL;
		f->vars = p;
		f->cap_vars = nc;
	}
	kl_variant *v = calloc(1, sizeof *v);
	if (!v || !(v->g = calloc((size_t)(f->nin ? f->nin : 1), sizeof *v->g))) {
		free(v);
		return NULL;
	}
	for (int i = 0; i < f->nin; i++) {
		kl_guard *g = &v->g[i];
		const kl_tensor *t = in[i];
		g->dtype = t->dtype;
		g->ndim = t->ndim;
		memcpy(g->shape, t->shape, sizeof g->shape);
		memcpy(g->strides, t->strides, sizeof g->strides);
		g->dyn = f->dyn[i] & ((1u << t->ndim) - 1);
	}
	v->id = f->nvars;
	f->vars[f->nvars++] = v;
	return v;
}

/* A variant whose first call failed compiled nothing that a later call can
 * use as it is: it goes, and is not counted as a compile. */
static void drop_variant(kl_fn *f, kl_variant *v)
{
	if (f->nvars == 0 || f->vars[f->nvars - 1] != v)
		return;
	f->nvars--;
	f->compiles--;
	if (f->last == v)
		f->last = NULL;
	variant_free(v);
}

/* ---- one call under a trace -------------------------------------------------- */

typedef struct dynrec {
	kl_tensor *t;
	uint32_t mask;
} dynrec;

typedef struct call {
	kl_fn *f;
	kl_variant *v;
	kl_tensor *const *in; /* as fn sees them */
	bool new_variant;
	int seg;
	int launches;
	kl_status err; /* a failure inside the hook: the call fails */
	char errmsg[KL_ERR_CAP];
	dynrec *dyn; /* tensors materialized at breaks whose dims were symbols */
	int ndyn, cap_dyn;
	bool over_limit;
	bool taped; /* the call left values on the autograd tape: never replayed */
	double compile_ms, run_ms; /* the segments' compiles and runs (the startup log) */
	bool wrote; /* fn wrote tensors in place (kl_copy, kl_cache_write) */
	/* fullgraph: the writes are recorded for replays (v->w_src, w_dst),
	 * and the deferred actions (the fused optimizer step: v->re); false
	 * when one of those has no replay form (only fn's trace repeats it) */
	bool writes_replay;
	bool no_replay; /* something only fn's trace can repeat */
	int32_t lent; /* the graph's last outputs lent from its arena (lend_tail) */
} call;

static void call_fail(call *cs, kl_status st)
{
	if (cs->err == KL_OK) {
		cs->err = st;
		snprintf(cs->errmsg, sizeof cs->errmsg, "%s", kl_last_error(cs->f->ctx));
	}
}

static uint32_t dyn_of(const call *cs, const kl_tensor *t)
{
	for (int j = 0; j < cs->f->nin; j++)
		if (cs->in[j] == t)
			return cs->v->g[j].dyn;
	for (int k = 0; k < cs->ndyn; k++)
		if (cs->dyn[k].t == t)
			return cs->dyn[k].mask;
	return 0;
}

static kl_status add_entry(kl_fn *f, uint64_t key, kl_compiled *c, int nops, kl_gentry **out)
{
	if (f->nentries == f->cap_entries) {
		int nc = f->cap_entries ? f->cap_entries * 2 : 4;
		kl_gentry **p = realloc(f->entries, (size_t)nc * sizeof *p);
		if (!p)
			return KL_ENOMEM;
		f->entries = p;
		f->cap_entries = nc;
	}
	kl_gentry *e = calloc(1, sizeof *e);
	if (!e)
		return KL_ENOMEM;
	e->key = key;
	e->c = c;
	e->nops = nops;
	f->entries[f->nentries++] = e;
	*out = e;
	return KL_OK;
}

/* The compiled graph for tr: found by key, or compiled now. */
static kl_status graph_entry(call *cs, kl_trace *tr, int nops, kl_gentry **out)
{
	kl_fn *f = cs->f;
	kl_ctx *ctx = f->ctx;
	const kl_graph *g = &tr->g;
	uint32_t *masks = calloc((size_t)(g->ninputs ? g->ninputs : 1), sizeof *masks);
	if (!masks)
		return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	bool any = false;
	for (int32_t i = 0; i < g->ninputs; i++) {
		masks[i] = dyn_of(cs, tr->in_tensors[i]) & ((1u << tr->in_tensors[i]->ndim) - 1);
		any |= masks[i] != 0;
	}
	kl_compile_cfg cfg = {.mode = f->o.mode,
	                      .fusion = f->fusion,
	                      .dyn_masks = any ? masks : NULL,
	                      .name = f->name,
	                      .graph_index = cs->seg,
	                      .lent = cs->lent};
	uint64_t key;
	kl_status st = kl__compile_key(ctx, g, &cfg, &key);
	for (int i = 0; st == KL_OK && i < f->nentries; i++)
		if (f->entries[i]->c->lent == cs->lent &&
		    (f->entries[i]->key == key ||
		     (any &&
		      kl__compiled_serves(ctx, f->entries[i]->c, f->entries[i]->key, g, &cfg)))) {
			/* the second: a dynamic dim at 0 or 1 (not a symbol when
			 * traced at that size), which the entry runs all the same */
			*out = f->entries[i];
			free(masks);
			return KL_OK;
		}
	if (st == KL_OK) {
		kl_gentry *prev = cs->seg < cs->v->nsegs ? cs->v->segs[cs->seg].e : NULL;
		if (!cs->new_variant && prev) {
			/* same inputs, another graph: user state baked into it changed,
			 * or control flow after a break took another path */
			char why[256];
			kl__graph_diff(&prev->c->g, g, why, sizeof why);
			f->compiles++;
			char name[48];
			snprintf(name, sizeof name, "graph %d", cs->seg);
			kl__fn_tally(f, name, why);
			kl__log(ctx, KL_LOG_RECOMPILES, "recompile #%d of %s: graph %d: %s",
			        f->compiles, f->name, cs->seg, why);
			note_recompile(f, "recompile #%d: graph %d changed: %s", f->compiles, cs->seg,
			               why);
			if (f->eager)
				cs->v->retired = true; /* its shapes go eager after this call */
			if (f->compiles > f->limit)
				cs->over_limit = true;
		}
		kl_compiled *c = kl__compile(ctx, g, &cfg);
		if (!c)
			st = kl_last_status(ctx);
		else if ((st = add_entry(f, key, c, nops, out)) != KL_OK) {
			kl__compiled_free(c);
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		}
	}
	free(masks);
	return st;
}

/* Give the lazy handle fn holds the storage of the value computed for it. */
static kl_status transplant(kl_ctx *ctx, kl_tensor *lazy, const kl_tensor *val)
{
	if (lazy->st)
		return KL_OK; /* listed twice */
	if (lazy->dtype != val->dtype || lazy->ndim != val->ndim ||
	    memcmp(lazy->shape, val->shape, sizeof(int64_t) * (size_t)val->ndim) != 0) {
		char a[128], b[128];
		return kl__err(ctx, KL_EINVAL,
		               "kl_fn_call: compiled value is %s %s but the traced "
		               "tensor is %s %s",
		               kl_dtype_name(val->dtype),
		               kl__shape_str(a, sizeof a, val->ndim, val->shape),
		               kl_dtype_name(lazy->dtype),
		               kl__shape_str(b, sizeof b, lazy->ndim, lazy->shape));
	}
	lazy->st = val->st;
	lazy->st->refs++;
	lazy->tape_ver = lazy->st->version;
	lazy->offset = val->offset;
	memcpy(lazy->strides, val->strides, sizeof lazy->strides);
	lazy->trace_id = 0;
	lazy->node = -1;
	return KL_OK;
}

static void remember_dyn(call *cs, const kl_compiled *c, kl_tensor *const *lazy, int n)
{
	for (int32_t b = 0; b < c->prog.nbufs; b++) {
		const kl_buf *bf = &c->prog.bufs[b];
		if (bf->role != KL_BUF_OUTPUT || bf->index >= n)
			continue;
		uint32_t mask = 0;
		for (int d = 0; d < bf->ndim; d++)
			if (bf->shape[d].sym > 0)
				mask |= 1u << d;
		if (!mask)
			continue;
		if (cs->ndyn == cs->cap_dyn) {
			int nc = cs->cap_dyn ? cs->cap_dyn * 2 : 16;
			dynrec *p = realloc(cs->dyn, (size_t)nc * sizeof *p);
			if (!p)
				return; /* only costs recompiles later */
			cs->dyn = p;
			cs->cap_dyn = nc;
		}
		cs->dyn[cs->ndyn++] = (dynrec){lazy[bf->index], mask};
	}
}

/* A new variant's first graph decides which of its dynamic dims really
 * are: a dim the graph kept static (say a size-1 dim that broadcasts) is
 * guarded like any other. */
static void refine_guards(call *cs, const kl_trace *tr, const kl_compiled *c)
{
	kl_variant *v = cs->v;
	for (int32_t b = 0; b < c->prog.nbufs; b++) {
		const kl_buf *bf = &c->prog.bufs[b];
		if (bf->role != KL_BUF_INPUT)
			continue;
		const kl_tensor *t = tr->in_tensors[bf->index];
		for (int j = 0; j < cs->f->nin; j++) {
			if (cs->in[j] != t)
				continue;
			kl_guard *g = &v->g[j];
			for (int d = 0; d < bf->ndim && d < g->ndim; d++) {
				if (!(g->dyn >> d & 1) || bf->shape[d].sym != 0)
					continue;
				g->dyn &= ~(1u << d);
				kl_vspec *p = realloc(v->spec, sizeof *p * (size_t)(v->nspec + 1));
				if (!p)
					continue; /* explain loses the reason, the guard holds */
				v->spec = p;
				kl_vspec *sp = &v->spec[v->nspec++];
				*sp = (kl_vspec){.input = j, .dim = d, .value = t->shape[d]};
				snprintf(sp->why, sizeof sp->why,
				         "traced at size %" PRId64 ": a dim first traced at 0 or 1 is "
				         "specialised (a later call at another size compiles a second, "
				         "symbolic variant)",
				         t->shape[d]);
				for (int k = 0; k < c->nspec; k++)
					if (c->spec[k].input == bf->index && c->spec[k].dim == d)
						snprintf(sp->why, sizeof sp->why, "%s", c->spec[k].why);
			}
		}
	}
}

static kl_status record_seg(call *cs, kl_gentry *e, const char *reason, int nops, int last_op,
                            int last_node)
{
	kl_variant *v = cs->v;
	if (cs->seg >= v->cap_segs) {
		int nc = v->cap_segs ? v->cap_segs * 2 : 4;
		kl_seg *p = realloc(v->segs, (size_t)nc * sizeof *p);
		if (!p)
			return KL_ENOMEM;
		v->segs = p;
		v->cap_segs = nc;
	}
	kl_seg *s = &v->segs[cs->seg];
	s->e = e;
	snprintf(s->reason, sizeof s->reason, "%s", reason ? reason : "");
	s->nops = nops;
	s->last_op = last_op;
	s->last_node = last_node;
	if (v->nsegs < cs->seg + 1)
		v->nsegs = cs->seg + 1;
	return KL_OK;
}

/* How many references the trace's writes and deferred actions hold on t */
static int trace_holds(const kl_trace *tr, const kl_tensor *t)
{
	int h = 0;
	for (int w = 0; w < tr->nwrites; w++)
		h += tr->wsrc[w] == t;
	for (int q = 0; q < tr->ndefer; q++)
		for (int k = 0; k < tr->defer[q].nreads; k++)
			h += tr->defer[q].reads[k] == t;
	return h;
}

/* The outputs lazy[n0..n) are there because the trace's writes or its
 * deferred actions (the fused optimizer step) read them. At fn's return,
 * one that nothing else holds (no reference beyond the open scopes, which
 * end with the call, and the trace's) is read only until the call returns:
 * those go last, and their count is what the compiled graph may lend from
 * its arena (kl_compile_cfg.lent) instead of giving them memory of their
 * own. A gradient the caller keeps (.grad, a kl_retain) is not lent. */
static int32_t lend_tail(const kl_trace *tr, kl_tensor **lazy, int n0, int n)
{
	int k = n0; /* the kept ones first, both groups in the order they came */
	for (int i = n0; i < n; i++) {
		kl_tensor *t = lazy[i];
		if (t->refs > t->scoped + trace_holds(tr, t)) {
			memmove(&lazy[k + 1], &lazy[k], sizeof *lazy * (size_t)(i - k));
			lazy[k++] = t;
		}
	}
	return (int32_t)(n - k);
}

/* End the active trace with lazy[] as its outputs, compile and run it, and
 * give every lazy[i] its value. reason: the sync op (a break), or NULL. */
static kl_status run_segment(call *cs, kl_tensor **lazy, int n, const char *reason,
                             kl_trace **keep)
{
	kl_fn *f = cs->f;
	kl_ctx *ctx = f->ctx;
	const kl_graph *live = &ctx->trace->g;
	int nops = 0, last_op = -1, last_node = -1;
	for (int32_t i = 0; i < live->n; i++)
		if (live->nodes[i].op != KL_OP_INPUT) {
			nops++;
			last_op = live->nodes[i].op;
			last_node = i;
		}
	/* the values of the writes in place fn made (kl_copy) are outputs too,
	 * after lazy[]; they land in their tensors once the graph ran */
	/* and so are the values the actions deferred to the graph's end read
	 * (the fused optimizer step: the gradients) */
	const kl_trace *cur = ctx->trace;
	kl_tensor **all = NULL;
	kl_status bad = KL_OK;
	int n0 = n;
	bool deferred = cur->ndefer > 0;
	int more = cur->nwrites;
	for (int q = 0; q < cur->ndefer; q++)
		more += cur->defer[q].nreads;
	if (more > 0) {
		if (!(all = malloc(sizeof *all * (size_t)(n + more)))) {
			kl__trace_free(kl__trace_end(ctx, 0, NULL));
			return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		}
		memcpy(all, lazy, sizeof *all * (size_t)n);
		for (int q = -1; q < cur->ndefer; q++) {
			int m = q < 0 ? cur->nwrites : cur->defer[q].nreads;
			for (int w = 0; w < m; w++) {
				kl_tensor *t = q < 0 ? cur->wsrc[w] : cur->defer[q].reads[w];
				if (t->st)
					continue; /* computed already */
				if (t->trace_id != cur->id && kl__trace_node_of(ctx, t) < 0) {
					bad = kl_last_status(ctx);
					continue;
				}
				int j = 0;
				while (j < n && all[j] != t)
					j++;
				if (j == n)
					all[n++] = t;
			}
		}
		lazy = all;
		cs->wrote = true;
	}
	cs->lent = !reason && more > 0 ? lend_tail(cur, lazy, n0, n) : 0;
	kl_status st = bad != KL_OK ? bad : kl__trace_check_deferred(ctx, cur);
	kl_trace *tr = kl__trace_end(ctx, n, lazy);
	if (!tr) {
		free(all);
		return kl_last_status(ctx);
	}
	kl_gentry *e = NULL;
	kl_tensor **outs = NULL;
	if (n > 0 && st == KL_OK) {
		double t0 = kl__now_ms();
		st = graph_entry(cs, tr, nops, &e);
		double t1 = kl__now_ms();
		cs->compile_ms += t1 - t0;
		if (st == KL_OK && !(outs = calloc((size_t)n, sizeof *outs)))
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		if (st == KL_OK && cs->seg == 0 && cs->new_variant)
			refine_guards(cs, tr, e->c);
		ctx->profile_graph = cs->seg;
		for (int c = 0; st == KL_OK && c < tr->nchk; c++)
			st = kl__check_values(ctx, tr->chk[c].t, tr->chk[c].hi, tr->chk[c].dim,
			                      tr->chk[c].op, tr->chk[c].what);
		if (st == KL_OK)
			st = kl__compiled_run(ctx, e->c, tr->in_tensors, outs);
		cs->run_ms += kl__now_ms() - t1;
		if (st == KL_OK) {
			cs->launches += e->c->last_launches;
			for (int i = 0; i < n && st == KL_OK; i++)
				if ((st = transplant(ctx, lazy[i], outs[i])) == KL_OK && keep &&
				    kl__trace_materialized(tr, i, lazy[i]) != KL_OK)
					st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
			if (st == KL_OK && reason && e->c->dynamic)
				remember_dyn(cs, e->c, lazy, n);
		}
		for (int i = 0; outs && i < n; i++)
			kl_release(outs[i]);
		free(outs);
	}
	for (int w = 0; st == KL_OK && w < tr->nwrites; w++)
		st = kl__write_into(ctx, tr->wdst[w], tr->wsrc[w]);
	if (st == KL_OK)
		st = kl__trace_run_deferred(ctx, tr, &cs->launches);
	/* the writes are done: the captured versions recorded next are theirs;
	 * a replay repeats the writes, then the deferred actions that have a
	 * replay form (the fused optimizer step) */
	if (st == KL_OK && f->o.fullgraph && cs->seg == 0 && !cs->v->replay && !reason &&
	    (deferred || tr->nwrites > 0)) {
		bool again = true;
		if (kl__replay_record_writes(f, cs->v, cs->in, tr, lazy, n, &cs->writes_replay) !=
		            KL_OK ||
		    (deferred && cs->writes_replay &&
		     kl__replay_record_deferred(cs->v, tr, lazy, n, &again) != KL_OK))
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		cs->writes_replay &= again;
	}
	free(all);
	if (st == KL_OK && f->o.fullgraph && cs->seg == 0 && !cs->v->replay &&
	    kl__replay_record_inputs(f, cs->v, cs->in, tr, &cs->no_replay) != KL_OK)
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	if (st == KL_OK && record_seg(cs, e, reason, nops, last_op, last_node) != KL_OK)
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	if (st == KL_OK) {
		kl_seg *sg = &cs->v->segs[cs->seg];
		sg->after[0] = 0;
		for (int q = 0, at = 0; q < tr->ndefer && at < (int)sizeof sg->after; q++)
			at += snprintf(sg->after + at, sizeof sg->after - (size_t)at, "%s%s",
			               q ? "; " : "", tr->defer[q].what);
	}
	if (keep && st == KL_OK)
		*keep = tr;
	else
		kl__trace_free(tr);
	return st;
}

/* Whether a lazy tensor alive at a graph break is computed by the graph that
 * ends there. A tensor that only the open scopes hold (the autoreleased
 * temporaries of fn, which kl_fn_call's own scope holds too) is not: if fn
 * uses it after the break, the next graph computes it again from what it
 * reads, so values fn never touches again cost nothing. Computed are the
 * tensors the sync op reads, those the program holds a reference to beyond
 * the scopes (kl_retain: kept for later), and the results of matrix
 * products and attention (computing those again would cost more than the
 * write). */
static bool computed_at_break(const kl_ctx *ctx, const kl_tensor *t, int nreq,
                              kl_tensor *const *req)
{
	for (int i = 0; i < nreq; i++)
		if (req[i] == t)
			return true;
	if (t->refs > t->scoped)
		return true;
	int op = ctx->trace->g.nodes[t->node].op;
	return op == KL_OP_MATMUL || op == KL_OP_ATTENTION;
}

/* The sync hook: a graph break, or (fullgraph) a refusal. */
static kl_status capture_sync(kl_ctx *ctx, const char *op, int nreq, kl_tensor *const *req)
{
	call *cs = ctx->sync_user;
	kl_fn *f = cs->f;
	const kl_graph *g = &ctx->trace->g;
	int nops = 0;
	for (int32_t i = 0; i < g->n; i++)
		nops += g->nodes[i].op != KL_OP_INPUT;
	if (f->o.fullgraph) {
		kl_status st = kl__err(ctx, KL_ESTATE,
		                       "kl_fn_call: %s is a sync point inside a "
		                       "fullgraph function (graph %d, after %d ops)",
		                       op, cs->seg, nops);
		call_fail(cs, st);
		return st;
	}
	if (cs->err != KL_OK)
		return kl__err(ctx, cs->err, "%s", cs->errmsg);
	/* what the op reads, if an earlier graph left it uncomputed, is
	 * computed by this one */
	for (int i = 0; i < nreq; i++)
		if (!req[i]->st && kl__trace_node_of(ctx, req[i]) < 0)
			return kl_last_status(ctx);
	uint64_t id = ctx->trace->id;
	int n = 0;
	for (kl_tensor *t = ctx->live; t; t = t->next)
		n += !t->st && t->trace_id == id && computed_at_break(ctx, t, nreq, req);
	kl_tensor **lazy = malloc(sizeof *lazy * (size_t)(n ? n : 1));
	kl_trace *ended = NULL;
	kl_status st;
	if (!lazy) {
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		kl__trace_free(kl__trace_end(ctx, 0, NULL));
	} else {
		/* the live list runs newest first: fill from the back for trace order */
		int k = n;
		for (kl_tensor *t = ctx->live; t; t = t->next)
			if (!t->st && t->trace_id == id && computed_at_break(ctx, t, nreq, req))
				lazy[--k] = t;
		st = run_segment(cs, lazy, n, op, &ended);
	}
	free(lazy);
	if (st == KL_OK) {
		const kl_seg *s = &cs->v->segs[cs->seg];
		kl__log(ctx, KL_LOG_GRAPH_BREAKS,
		        "%s: graph break at %s: graph %d ends after %d ops "
		        "(last op %s#%d), %d tensors materialized; graph %d begins",
		        f->name, op, cs->seg, s->nops,
		        s->last_op >= 0 ? kl__ops[s->last_op].name : "-", s->last_node, n,
		        cs->seg + 1);
	} else {
		call_fail(cs, st);
	}
	cs->seg++;
	/* fn goes on recording either way; a failure fails the call at its end.
	 * The new trace continues the ended one: what that left uncomputed is
	 * computed where fn uses it. */
	kl_status bst = ended ? kl__trace_continue(ctx, ended) : kl__trace_begin(ctx);
	if (st == KL_OK && bst != KL_OK) {
		call_fail(cs, bst);
		st = bst;
	}
	return st;
}

static kl_status check_outputs(kl_fn *f, kl_tensor **out)
{
	for (int k = 0; k < f->nout; k++) {
		if (!out[k])
			return kl__err(f->ctx, KL_EINVAL,
			               "kl_fn_call: %s returned KL_OK but out[%d] is "
			               "NULL",
			               f->name, k);
		if (out[k]->ctx != f->ctx)
			return kl__err(f->ctx, KL_EINVAL,
			               "kl_fn_call: %s: out[%d] belongs to another "
			               "context",
			               f->name, k);
	}
	return KL_OK;
}

static kl_status traced_call(kl_fn *f, kl_variant *v, bool fresh, kl_tensor *const *in,
                             kl_tensor **out)
{
	kl_ctx *ctx = f->ctx;
	call cs = {.f = f, .v = v, .in = in, .new_variant = fresh};
	double t0 = kl__now_ms();
	/* what an earlier traced call recorded for replays it never made
	 * (captured tensors of that call, its deferred actions) goes */
	if (f->o.fullgraph && !v->replay)
		kl__replay_reset(v);
	kl_status st = kl__trace_begin(ctx);
	if (st != KL_OK)
		return st;
	kl_status (*prev_hook)(kl_ctx *, const char *, int, kl_tensor *const *) = ctx->sync_hook;
	void *prev_user = ctx->sync_user;
	ctx->sync_hook = capture_sync;
	ctx->sync_user = &cs;
	st = f->body(ctx, in, f->nin, out, f->nout, f->user);
	ctx->sync_hook = prev_hook;
	ctx->sync_user = prev_user;
	if (st == KL_OK && cs.err != KL_OK)
		st = kl__err(ctx, cs.err, "%s", cs.errmsg); /* fn went on past a failed break */
	else if (st != KL_OK && ctx->status == KL_OK)
		kl__err(ctx, st, "kl_fn_call: %s returned %s", f->name, kl_status_name(st));
	if (st == KL_OK)
		st = check_outputs(f, out);
	kl_tensor **lazy = NULL;
	int nl = 0;
	bool grads = false; /* the graph also computes .grad of tensors fn reaches */
	if (st == KL_OK && ctx->trace) {
		lazy = malloc(sizeof *lazy * (size_t)(f->nout ? f->nout : 1));
		if (!lazy)
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		for (int k = 0; st == KL_OK && k < f->nout; k++) {
			kl_tensor *t = out[k];
			if (t->st)
				continue;
			if (!kl__trace_holds(ctx, t)) {
				st = kl__err(ctx, KL_ESTATE,
				             "kl_fn_call: %s: out[%d] is a lazy tensor of a "
				             "finished trace",
				             f->name, k);
				break;
			}
			/* one an earlier graph left uncomputed: the last graph computes it */
			if (t->trace_id != ctx->trace->id && kl__trace_node_of(ctx, t) < 0) {
				st = kl_last_status(ctx);
				break;
			}
			int j = 0;
			while (j < nl && lazy[j] != t)
				j++;
			if (j == nl)
				lazy[nl++] = t;
		}
		/* also computed: the values kl_copy writes in place, the
		 * gradients kl_backward left in .grad of tensors fn can reach, and
		 * the values the autograd tape holds for a kl_backward after the
		 * call (fn's forward recorded with no backward inside it: they are
		 * the saved tensors of that backward) */
		kl_trace *tr = ctx->trace;
		int extra = tr->nwrites;
		grads = false;
		bool *keep = NULL;
		for (kl_tensor *t = ctx->live; st == KL_OK && t; t = t->next)
			if (!t->st && t->trace_id == tr->id && t->tape_node >= 0)
				cs.taped = true;
		v->bw_taped = cs.taped;
		v->bw_saved = v->bw_recompute = 0;
		v->bw_bytes = 0;
		v->bw_joint = false;
		if (st == KL_OK && cs.taped) {
			keep = calloc((size_t)tr->g.n + 1, sizeof *keep);
			v->bw_joint = keep && kl__joint_keep(f, tr, out, keep);
		}
		for (kl_tensor *t = ctx->live; st == KL_OK && t; t = t->next) {
			extra += t->grad && !t->grad->st && t->grad->trace_id == tr->id;
			if (!t->st && t->trace_id == tr->id && t->tape_node >= 0) {
				bool kept = !v->bw_joint || keep[t->node] || t->tape_leaf, ret = false;
				for (int k = 0; k < f->nout; k++)
					ret |= out[k] == t;
				extra += kept;
				kept &= !ret; /* returned: no memory of its own */
				v->bw_saved += kept;
				v->bw_recompute += !kept;
				v->bw_bytes += kept ? kl__numel(t->ndim, t->shape) *
				                              (int64_t)kl_dtype_size(t->dtype)
				                    : 0;
			}
		}
		if (st == KL_OK && extra > 0) {
			kl_tensor **p = realloc(lazy, sizeof *lazy * (size_t)(nl + extra + 1));
			if (!p)
				st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
			else
				lazy = p;
			for (int i = 0; st == KL_OK && i < tr->nwrites; i++)
				lazy[nl++] = tr->wsrc[i];
			for (kl_tensor *t = ctx->live; st == KL_OK && t; t = t->next) {
				if (t->grad && !t->grad->st && t->grad->trace_id == tr->id) {
					lazy[nl++] = t->grad;
					grads = true;
				}
				if (!t->st && t->trace_id == tr->id && t->tape_node >= 0 &&
				    (!v->bw_joint || keep[t->node] || t->tape_leaf))
					lazy[nl++] = t;
			}
		}
		free(keep);
		if (st == KL_OK)
			st = run_segment(&cs, lazy, nl, NULL, NULL);
	}
	if (ctx->trace)
		kl__trace_free(kl__trace_end(ctx, 0, NULL));
	if (st == KL_OK) {
		v->nsegs = cs.seg + 1;
		v->calls++;
		/* a replay runs the plan alone and repeats the writes in place
		 * it recorded; deferred actions, the autograd tape and gradients
		 * left in .grad (kl_backward inside fn, a training step or not:
		 * a replay would leave the first call's) need fn's trace */
		if (f->o.fullgraph && !v->replay && (!cs.wrote || cs.writes_replay) && !grads &&
		    !cs.taped && !cs.no_replay &&
		    kl__replay_record_outputs(f, v, in, out, lazy, nl) != KL_OK)
			st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	}
	free(lazy);
	free(cs.dyn);
	if (st == KL_OK) {
		f->last_kernels = cs.launches;
		f->last = v;
	}
	if (st == KL_OK && fresh) {
		double all = kl__now_ms() - t0;
		kl__log(ctx, KL_LOG_STARTUP,
		        "%s variant %d, first call %.3f ms: tracing %.3f ms, cache or compile "
		        "%.3f ms, run (enqueue) %.3f ms, %d graph%s",
		        f->name, v->id, all, all - cs.compile_ms - cs.run_ms, cs.compile_ms,
		        cs.run_ms, cs.seg + 1, cs.seg ? "s" : "");
	}
	if (cs.over_limit)
		go_eager(f);
	return st;
}

static kl_status eager_call(kl_fn *f, kl_tensor *const *in, kl_tensor **out, bool count)
{
	kl_ctx *ctx = f->ctx;
	const kl_backend *saved_real = tl_real_be;
	kl_backend proxy;
	/* an eager call inside another one finds the counter installed already */
	bool install = count && ctx->be->exec != counting_exec;
	int start = tl_exec_count;
	if (install) {
		proxy = *ctx->be;
		proxy.exec = counting_exec;
		tl_real_be = ctx->be;
		ctx->be = &proxy;
	}
	kl_status st = f->body(ctx, in, f->nin, out, f->nout, f->user);
	if (count)
		f->last_kernels = tl_exec_count - start;
	if (install) {
		ctx->be = tl_real_be;
		tl_real_be = saved_real;
	}
	if (st != KL_OK && ctx->status == KL_OK)
		kl__err(ctx, st, "kl_fn_call: %s returned %s", f->name, kl_status_name(st));
	if (st == KL_OK)
		st = check_outputs(f, out);
	return st;
}

/* Input i of a call, bound dense (pin[i]) for its dynamic dims. A leaf that
 * requires grad is copied with grad mode off into a leaf of its own that
 * holds the original's .grad: fn's backward accumulates there, and
 * dense_grads_back hands the result to the original after the call (a
 * copy on the tape would leave the original's gradient NULL). The same
 * tensor passed twice shares one copy. */
static kl_status bind_dense(kl_fn *f, kl_tensor *const *in, kl_tensor **pin, int i)
{
	kl_ctx *ctx = f->ctx;
	for (int j = 0; j < i; j++)
		if (in[j] == in[i] && pin[j] != in[j]) {
			pin[i] = pin[j];
			return KL_OK;
		}
	bool leaf = in[i]->requires_grad;
	bool prev = leaf ? kl_set_grad_enabled(ctx, false) : false;
	pin[i] = kl_contiguous(in[i]);
	if (leaf)
		kl_set_grad_enabled(ctx, prev);
	if (!pin[i])
		return kl_last_status(ctx);
	if (leaf) {
		kl_status st = kl_set_requires_grad(pin[i], true);
		if (st != KL_OK)
			return st;
		if (in[i]->grad)
			pin[i]->grad = kl_retain(in[i]->grad);
	}
	return KL_OK;
}

/* After a call that bound leaves dense: each original leaf takes its
 * copy's .grad (its old .grad plus what fn's backward added). */
static void dense_grads_back(kl_fn *f, kl_tensor *const *in, kl_tensor **pin)
{
	for (int i = 0; i < f->nin; i++) {
		if (pin[i] == in[i] || !in[i]->requires_grad || in[i]->grad == pin[i]->grad)
			continue;
		kl_tensor *g = pin[i]->grad;
		if (g)
			kl_retain(g);
		kl_release(in[i]->grad);
		in[i]->grad = g;
	}
}

kl_status kl__fn_call(kl_fn *f, kl_tensor *const *in, kl_tensor **out)
{
	if (!f)
		return kl__err(NULL, KL_EINVAL, "kl_fn_call: f is NULL");
	kl_ctx *ctx = f->ctx;
	if ((f->nout > 0 && !out) || (f->nin > 0 && !in))
		return kl__err(ctx, KL_EINVAL, "kl_fn_call: %s is NULL", !out ? "out" : "in");
	for (int k = 0; k < f->nout; k++)
		out[k] = NULL;
	for (int i = 0; i < f->nin; i++) {
		const kl_tensor *t = in[i];
		if (!t)
			return kl__err(ctx, KL_EINVAL, "kl_fn_call: %s: input %d is NULL", f->name,
			               i);
		if (t->ctx != ctx)
			return kl__err(ctx, KL_EINVAL,
			               "kl_fn_call: %s: input %d belongs to another "
			               "context",
			               f->name, i);
		if (!kl__trace_holds(ctx, t))
			return kl__err(ctx, KL_ESTATE,
			               "kl_fn_call: %s: input %d is a lazy tensor of a "
			               "finished trace",
			               f->name, i);
	}
	f->calls++;
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1)
		return kl_last_status(ctx);
	kl_status st = KL_OK;
	bool owned = false; /* out[] holds the caller's references already */
	kl_tensor **pin = malloc(sizeof *pin * (size_t)(f->nin ? f->nin : 1));
	if (!pin)
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	for (int i = 0; st == KL_OK && i < f->nin; i++)
		pin[i] = in[i];
	if (st != KL_OK) {
		/* nothing else to do */
	} else if (ctx->trace) {
		/* called from inside another compiled function: inline it */
		st = eager_call(f, pin, out, false);
	} else if (f->o.disable) {
		f->eager_calls++;
		st = eager_call(f, pin, out, true);
	} else {
		/* dynamic inputs are bound dense: one layout serves every size */
		for (int i = 0; st == KL_OK && i < f->nin; i++)
			if (f->dyn[i] && !kl_is_contiguous(in[i]))
				st = bind_dense(f, in, pin, i);
		kl_variant *v = st == KL_OK ? find_variant(f, pin) : NULL;
		bool fresh = false, stale = false;
		if (v && v->retired)
			v = NULL; /* past the limit its graph changed: eager */
		if (st == KL_OK && !v && f->eager) {
			/* past the recompile limit: compiled variants serve their
			 * shapes, a new shape runs eagerly */
		} else if (st == KL_OK && !v) {
			char why[160], name[48];
			explain_miss(f, pin, why, sizeof why, name, sizeof name);
			if (f->nvars > 0)
				kl__fn_tally(f, name, why);
			if (f->nvars > 0 && f->compiles >= f->limit) {
				go_eager(f);
			} else if (!(v = new_variant(f, pin))) {
				st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
			} else {
				fresh = true;
				f->compiles++;
				if (f->nvars > 1) {
					char advice[400];
					dim_advice(f, name, false, advice, sizeof advice);
					kl__log(ctx, KL_LOG_RECOMPILES, "recompile #%d of %s: %s%s",
					        f->compiles, f->name, why, advice);
					note_recompile(f, "recompile #%d: %s%s", f->compiles, why, advice);
				}
			}
		}
		if (st != KL_OK) {
			/* failed above */
		} else if (!v) {
			f->eager_calls++;
			st = eager_call(f, pin, out, true);
		} else if (v->replay && !(stale = kl__replay_stale(f, v))) {
			/* replay hands out references of its own, not the scope's */
			st = kl__replay_run(f, v, pin, out);
			owned = true;
		} else if (stale) {
			/* a captured tensor changed: fn runs again to read the program's
			 * tensors; the same graph is only re-bound, another recompiles */
			int before = f->compiles;
			st = traced_call(f, v, false, pin, out);
			if (st == KL_OK)
				kl__log(ctx, KL_LOG_RECOMPILES, "%s: variant %d traced again: %s", f->name,
				        v->id,
				        f->compiles == before ? "the same graph, its plan re-bound to the "
				                                "tensors fn reads now (no compile)"
				                              : "its graph changed and was recompiled");
		} else {
			st = traced_call(f, v, fresh, pin, out);
			if (st != KL_OK && fresh)
				drop_variant(f, v);
		}
	}
	f->failed_calls += st != KL_OK;
	f->last_failed = st != KL_OK;
	if (st == KL_OK)
		dense_grads_back(f, in, pin);
	if (st == KL_OK && !owned)
		for (int k = 0; k < f->nout; k++)
			kl_retain(out[k]);
	free(pin);
	kl_scope_end(ctx);
	if (st != KL_OK)
		for (int k = 0; k < f->nout; k++)
			out[k] = NULL;
	return st;
}

kl_status kl_explain(kl_fn *f, FILE *out)
{
	if (!f)
		return kl__err(NULL, KL_EINVAL, "kl_explain: f is NULL");
	if (!out)
		return kl__err(f->ctx, KL_EINVAL, "kl_explain: out is NULL");
	kl__capture_explain(f, out);
	return ferror(out) ? kl__err(f->ctx, KL_EIO, "kl_explain: write error") : KL_OK;
}

kl_status kl_profile(kl_fn *f, kl_tensor *const *in, FILE *out)
{
	if (!f)
		return kl__err(NULL, KL_EINVAL, "kl_profile: f is NULL");
	kl_ctx *ctx = f->ctx;
	if (!out)
		return kl__err(ctx, KL_EINVAL, "kl_profile: out is NULL");
	if (ctx->profile)
		return kl__err(ctx, KL_ESTATE, "kl_profile: %s: another kl_profile is running",
		               f->name);
	if (ctx->trace)
		return kl__err(ctx, KL_ESTATE,
		               "kl_profile: %s: called inside a traced function (it would be "
		               "inlined, not run)",
		               f->name);
	kl_tensor **outs = calloc((size_t)(f->nout > 0 ? f->nout : 1), sizeof *outs);
	if (!outs)
		return kl__err(ctx, KL_ENOMEM, "kl_profile: out of memory");
	ctx->profile = out;
	ctx->profile_segs = 0;
	kl_status st = kl_fn_call(f, in, outs);
	int segs = ctx->profile_segs;
	ctx->profile = NULL;
	for (int k = 0; k < f->nout; k++)
		if (outs[k])
			kl_release(outs[k]);
	free(outs);
	if (st == KL_OK && segs == 0)
		fprintf(out, "kiln profile: %s: no compiled step to time (%s)\n", f->name,
		        f->o.disable ? "compilation is disabled: it ran eagerly"
		        : f->eager   ? "past its recompile limit: it ran eagerly"
		                     : "the call ran no graph");
	if (st == KL_OK && ferror(out))
		st = kl__err(ctx, KL_EIO, "kl_profile: write error");
	return st;
}
