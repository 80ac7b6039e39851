/* optim.c - torch.optim's SGD and AdamW (kiln.h, "optimizers"): parameters,
 * their state as tensors, the learning rate as a device scalar, the step
 * and saving/loading the state as safetensors.
 *
 * A step has two paths with one meaning:
 *  - the fused update: one kl_optim_launch per dtype over every parameter
 *    that has a gradient, run by the backend (optim_step:
 *    backend/cpu/optim_cpu.c, one parallel loop; backend/cuda/optim_cuda.c,
 *    one kernel launch over a pointer table). Eagerly at once; inside a
 *    compiled function deferred to the end of the graph that computes the
 *    gradients (kl__trace_defer), which then reads them materialized;
 *  - with .unfused, or on a backend without optim_step, the same update as
 *    kiln ops, each new value written back with kl_copy (a trace records
 *    the writes and applies them when the graph ends; the scheduler fuses
 *    each parameter's update into a kernel or two).
 * Both compute in f32 (f64 for f64 parameters) and round once into the
 * parameter's dtype; tests/test_optim.c holds both to a float64 reference
 * of torch's update.
 */
#include <stdio.h>
#include <stdlib.h>

#include "api/dispatch.h"

typedef struct oparam {
	kl_tensor *p;
	kl_tensor *m, *v, *vmax; /* SGD: m = momentum_buffer; AdamW: exp_avg, exp_avg_sq,
	                          * max_exp_avg_sq; NULL when unused */
	kl_tensor *step;         /* f32 0-dim view of element i of the optimizer's steps */
	char name[160];
} oparam;

struct kl_optim {
	kl_ctx *ctx;
	kl_optim_algo algo;
	int n;
	oparam *ps;
	kl_tensor *lr;    /* f64 0-dim */
	kl_tensor *steps; /* f32 [n] */
	kl_sgd_opts sgd;
	kl_adamw_opts adam;
	bool unfused;
};

kl_sgd_opts kl_sgd_defaults(void)
{
	return (kl_sgd_opts){.lr = 1e-3};
}

kl_adamw_opts kl_adamw_defaults(void)
{
	return (kl_adamw_opts){
	        .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2};
}

void kl_optim_free(kl_optim *o)
{
	if (!o)
		return;
	for (int i = 0; o->ps && i < o->n; i++) {
		oparam *q = &o->ps[i];
		kl_release(q->p);
		kl_release(q->m);
		kl_release(q->v);
		kl_release(q->vmax);
		kl_release(q->step);
	}
	kl_release(o->lr);
	kl_release(o->steps);
	free(o->ps);
	free(o);
}

/* ---- construction ---------------------------------------------------------------- */

/* torch's checks of the hyperparameters; NULL when they are fine */
static const char *bad_hyper(const kl_optim *o, char *why, size_t cap)
{
	if (o->algo == KL_ALGO_SGD) {
		const kl_sgd_opts *s = &o->sgd;
		if (!(s->lr >= 0) || isinf(s->lr))
			snprintf(why, cap, "invalid learning rate: %g", s->lr);
		else if (!(s->momentum >= 0) || isinf(s->momentum))
			snprintf(why, cap, "invalid momentum value: %g", s->momentum);
		else if (!(s->weight_decay >= 0) || isinf(s->weight_decay))
			snprintf(why, cap, "invalid weight_decay value: %g", s->weight_decay);
		else if (!isfinite(s->dampening))
			snprintf(why, cap, "invalid dampening value: %g", s->dampening);
		else if (s->nesterov && (s->momentum <= 0 || s->dampening != 0))
			snprintf(why, cap,
			         "nesterov momentum requires a momentum and zero dampening (momentum "
			         "%g, dampening %g)",
			         s->momentum, s->dampening);
		else
			return NULL;
		return why;
	}
	const kl_adamw_opts *a = &o->adam;
	if (!(a->lr >= 0) || isinf(a->lr))
		snprintf(why, cap, "invalid learning rate: %g", a->lr);
	else if (!(a->eps >= 0) || isinf(a->eps))
		snprintf(why, cap, "invalid epsilon value: %g", a->eps);
	else if (!(a->beta1 >= 0 && a->beta1 < 1))
		snprintf(why, cap, "invalid beta parameter at index 0: %g", a->beta1);
	else if (!(a->beta2 >= 0 && a->beta2 < 1))
		snprintf(why, cap, "invalid beta parameter at index 1: %g", a->beta2);
	else if (!(a->weight_decay >= 0) || isinf(a->weight_decay))
		snprintf(why, cap, "invalid weight_decay value: %g", a->weight_decay);
	else
		return NULL;
	return why;
}

/* Why parameter i of params cannot be optimized; NULL when it can. */
static const char *bad_param(kl_ctx *ctx, int i, kl_tensor *const *params, char *why, size_t cap)
{
	kl_tensor *t = params[i];
	char sh[128];
	if (!t) {
		snprintf(why, cap, "parameter %d is NULL", i);
		return why;
	}
	kl__shape_str(sh, sizeof sh, t->ndim, t->shape);
	if (t->ctx != ctx)
		snprintf(why, cap, "parameter %d belongs to another context", i);
	else if (!t->st)
		snprintf(why, cap, "parameter %d (%s %s) is a lazy tensor; parameters must exist "
		         "before a compiled call", i, kl_dtype_name(t->dtype), sh);
	else if (!kl_dtype_is_float(t->dtype))
		snprintf(why, cap, "parameter %d is %s %s: only float tensors can be optimized", i,
		         kl_dtype_name(t->dtype), sh);
	else if (!kl_is_contiguous(t))
		snprintf(why, cap, "parameter %d (%s %s) is not dense; pass kl_contiguous of it or "
		         "its base", i, kl_dtype_name(t->dtype), sh);
	else {
		int64_t lo, hi, ol, oh;
		kl__tensor_span(t, &lo, &hi);
		for (int j = 0; j < i; j++) {
			kl_tensor *u = params[j];
			kl__tensor_span(u, &ol, &oh);
			if (u == t) {
				snprintf(why, cap, "parameter %d is parameter %d again", i, j);
				return why;
			}
			if (u->st == t->st && kl_numel(t) > 0 && kl_numel(u) > 0 && lo <= oh &&
			    ol <= hi) {
				snprintf(why, cap, "parameter %d (%s) overlaps parameter %d in memory", i,
				         sh, j);
				return why;
			}
		}
		return NULL;
	}
	return why;
}

static kl_tensor *keep(kl_tensor *t)
{
	return t ? kl_retain(t) : NULL;
}

static kl_optim *optim_new(kl_ctx *ctx, kl_optim_algo algo, int n, kl_tensor *const *params,
                           const char *const *names, const kl_sgd_opts *so,
                           const kl_adamw_opts *ao)
{
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "ctx is NULL");
		return NULL;
	}
	if (ctx->trace) {
		kl__err(ctx, KL_ESTATE, "called inside a compiled function: build the optimizer "
		                        "before (its state must exist between calls)");
		return NULL;
	}
	if (n < 1 || !params) {
		kl__err(ctx, KL_EINVAL, "got an empty parameter list (n %d%s)", n,
		        params ? "" : ", params NULL");
		return NULL;
	}
	kl_optim *o = calloc(1, sizeof *o);
	if (!o || !(o->ps = calloc((size_t)n, sizeof *o->ps))) {
		free(o);
		kl__err(ctx, KL_ENOMEM, "out of memory");
		return NULL;
	}
	o->ctx = ctx;
	o->algo = algo;
	o->n = n;
	if (algo == KL_ALGO_SGD) {
		o->sgd = so ? *so : kl_sgd_defaults();
		o->unfused = o->sgd.unfused;
	} else {
		o->adam = ao ? *ao : kl_adamw_defaults();
		o->unfused = o->adam.unfused;
	}
	char why[320];
	const char *bad = bad_hyper(o, why, sizeof why);
	for (int i = 0; !bad && i < n; i++)
		bad = bad_param(ctx, i, params, why, sizeof why);
	for (int i = 0; !bad && i < n; i++) {
		const char *nm = names && names[i] ? names[i] : NULL;
		int w = nm ? snprintf(o->ps[i].name, sizeof o->ps[i].name, "%s", nm)
		           : snprintf(o->ps[i].name, sizeof o->ps[i].name, "%d", i);
		if (w <= 0 || (size_t)w >= sizeof o->ps[i].name) {
			snprintf(why, sizeof why, "the name of parameter %d is %s", i,
			         w <= 0 ? "empty" : "longer than 159 bytes");
			bad = why;
		}
		for (int j = 0; !bad && j < i; j++)
			if (!strcmp(o->ps[j].name, o->ps[i].name)) {
				snprintf(why, sizeof why, "parameters %d and %d are both named '%s'", j, i,
				         o->ps[i].name);
				bad = why;
			}
	}
	if (bad) {
		kl__err(ctx, KL_EINVAL, "%s", bad);
		kl_optim_free(o);
		return NULL;
	}
	/* state: zeros of each parameter's dtype and shape, a step count each */
	bool mom = algo == KL_ALGO_SGD && o->sgd.momentum != 0;
	bool adam = algo == KL_ALGO_ADAMW, ams = adam && o->adam.amsgrad;
	kl_scope_begin(ctx);
	o->lr = keep(kl_scalar(ctx, KL_F64, adam ? o->adam.lr : o->sgd.lr));
	o->steps = keep(kl_zeros(ctx, KL_F32, 1, (int64_t[]){n}));
	bool ok = o->lr && o->steps;
	for (int i = 0; ok && i < n; i++) {
		oparam *q = &o->ps[i];
		kl_tensor *p = params[i];
		q->p = kl_retain(p);
		if (mom || adam)
			q->m = keep(kl_zeros(ctx, p->dtype, p->ndim, p->shape));
		if (adam)
			q->v = keep(kl_zeros(ctx, p->dtype, p->ndim, p->shape));
		if (ams)
			q->vmax = keep(kl_zeros(ctx, p->dtype, p->ndim, p->shape));
		q->step = keep(kl_reshape(kl_slice(o->steps, 0, i, i + 1, 1), 0, NULL));
		ok = q->step && (q->m || !(mom || adam)) && (q->v || !adam) && (q->vmax || !ams);
	}
	kl_scope_end(ctx);
	if (!ok) {
		kl_optim_free(o);
		return NULL;
	}
	return o;
}

kl_optim *kl_optim_sgd(kl_ctx *ctx, int n, kl_tensor *const *params, const char *const *names,
                       const kl_sgd_opts *opts)
{
	KL_API("kl_optim_sgd");
	return optim_new(ctx, KL_ALGO_SGD, n, params, names, opts, NULL);
}

kl_optim *kl_optim_adamw(kl_ctx *ctx, int n, kl_tensor *const *params,
                         const char *const *names, const kl_adamw_opts *opts)
{
	KL_API("kl_optim_adamw");
	return optim_new(ctx, KL_ALGO_ADAMW, n, params, names, NULL, opts);
}

/* ---- the step: as kiln ops --------------------------------------------------------- */

/* A 0-dim value computed once: a one-element sum is a kernel of its own,
 * which the update's kernel reads, where a pointwise chain of 0-dim values
 * (bias corrections: two pow a step) would be fused into the update and
 * recomputed for every element. */
static kl_tensor *once(kl_tensor *t)
{
	return kl_sum(kl_reshape(t, 1, (int64_t[]){1}), 1, (int[]){0}, false);
}

/* The new values of parameter q from gradient g, as ops in the compute
 * type ct, written back with kl_copy (recorded when a trace is active). */
static kl_status step_ops(kl_optim *o, oparam *q, kl_tensor *g)
{
	kl_ctx *ctx = o->ctx;
	kl_dtype ct = q->p->dtype == KL_F64 ? KL_F64 : KL_F32;
	kl_tensor *p = kl_cast(q->p, ct), *gc = kl_cast(g, ct), *lr = kl_cast(o->lr, ct);
	kl_tensor *s1 = kl_add_scalar(q->step, 1.0);
	kl_tensor *pn, *mn = NULL, *vn = NULL, *vm = NULL;
	if (o->algo == KL_ALGO_ADAMW) {
		const kl_adamw_opts *a = &o->adam;
		kl_tensor *sc = kl_cast(s1, ct);
		kl_tensor *bc1 = kl_add_scalar(kl_neg(kl_pow(kl_scalar(ctx, ct, a->beta1), sc)), 1.0);
		kl_tensor *bc2 = kl_add_scalar(kl_neg(kl_pow(kl_scalar(ctx, ct, a->beta2), sc)), 1.0);
		kl_tensor *step_size = once(kl_div(lr, bc1)), *bc2s = once(kl_sqrt(bc2));
		kl_tensor *decay = once(kl_add_scalar(kl_mul_scalar(lr, -a->weight_decay), 1.0));
		kl_tensor *m = kl_cast(q->m, ct), *v = kl_cast(q->v, ct);
		mn = kl_add(m, kl_mul_scalar(kl_sub(gc, m), 1.0 - a->beta1));
		vn = kl_add(kl_mul_scalar(v, a->beta2), kl_mul_scalar(kl_mul(gc, gc), 1.0 - a->beta2));
		vm = a->amsgrad ? kl_maximum(kl_cast(q->vmax, ct), vn) : vn;
		kl_tensor *den = kl_add_scalar(kl_div(kl_sqrt(vm), bc2s), a->eps);
		pn = kl_sub(kl_mul(p, decay), kl_mul(step_size, kl_div(mn, den)));
	} else {
		const kl_sgd_opts *s = &o->sgd;
		kl_tensor *d = s->weight_decay != 0 ? kl_add(gc, kl_mul_scalar(p, s->weight_decay))
		                                    : gc;
		if (q->m) {
			kl_tensor *run = kl_add(kl_mul_scalar(kl_cast(q->m, ct), s->momentum),
			                        kl_mul_scalar(d, 1.0 - s->dampening));
			mn = kl_where(kl_eq_scalar(q->step, 0.0), d, run);
			d = s->nesterov ? kl_add(d, kl_mul_scalar(mn, s->momentum)) : mn;
		}
		pn = kl_sub(p, kl_mul(lr, d));
	}
	/* every value is made before the first write: a write inside a trace
	 * would otherwise make later reads of the same tensor see the new value */
	if (!pn || !s1 || (q->m && !mn) || (q->v && !vn) || (q->vmax && !vm))
		return kl_last_status(ctx) != KL_OK ? kl_last_status(ctx) : KL_ENOMEM;
	kl_status st = kl_copy(q->p, pn);
	if (st == KL_OK && q->m)
		st = kl_copy(q->m, mn);
	if (st == KL_OK && q->v)
		st = kl_copy(q->v, vn);
	if (st == KL_OK && q->vmax)
		st = kl_copy(q->vmax, vm);
	if (st == KL_OK)
		st = kl_copy(q->step, s1);
	return st;
}

/* ---- the step: fused ---------------------------------------------------------------- */

static const kl_dtype fused_dts[4] = {KL_F32, KL_BF16, KL_F16, KL_F64};

/* The launch over every parameter of dtype fused_dts[k] that has a gradient
 * g[i] (materialized, dense), its items written into items[]; l->n 0 when
 * there is none. */
static void fused_launch(const kl_optim *o, kl_tensor *const *g, int k, kl_optim_item *items,
                         kl_optim_launch *l)
{
	int n = 0;
	for (int i = 0; i < o->n; i++) {
		const oparam *q = &o->ps[i];
		if (!g[i] || q->p->dtype != fused_dts[k])
			continue;
		items[n++] = (kl_optim_item){
		        .p = kl__tensor_data(q->p),
		        .g = kl__tensor_data(g[i]),
		        .m = q->m ? kl__tensor_data(q->m) : NULL,
		        .v = q->v ? kl__tensor_data(q->v) : NULL,
		        .vmax = q->vmax ? kl__tensor_data(q->vmax) : NULL,
		        .step = kl__tensor_data(q->step),
		        .n = kl_numel(q->p),
		};
	}
	*l = (kl_optim_launch){
	        .algo = o->algo,
	        .dtype = fused_dts[k],
	        .n = n,
	        .items = items,
	        .lr = kl__tensor_data(o->lr),
	};
	if (o->algo == KL_ALGO_SGD) {
		l->weight_decay = o->sgd.weight_decay;
		l->momentum = o->sgd.momentum;
		l->dampening = o->sgd.dampening;
		l->nesterov = o->sgd.nesterov;
	} else {
		l->weight_decay = o->adam.weight_decay;
		l->amsgrad = o->adam.amsgrad;
		l->beta1 = o->adam.beta1;
		l->beta2 = o->adam.beta2;
		l->eps = o->adam.eps;
	}
}

/* The step changed the memory of every parameter with a gradient g[i],
 * its state and the step counts. */
static void fused_written(kl_optim *o, kl_tensor *const *g)
{
	for (int i = 0; i < o->n; i++) {
		oparam *q = &o->ps[i];
		if (!g[i])
			continue;
		kl__storage_written(q->p->st);
		if (q->m)
			kl__storage_written(q->m->st);
		if (q->v)
			kl__storage_written(q->v->st);
		if (q->vmax)
			kl__storage_written(q->vmax->st);
	}
	kl__storage_written(o->steps->st);
}

static kl_status step_fused(kl_optim *o, kl_tensor *const *g)
{
	kl_ctx *ctx = o->ctx;
	kl_optim_item *items = malloc(sizeof *items * (size_t)o->n);
	if (!items)
		return kl__err(ctx, KL_ENOMEM, "out of memory");
	kl_status st = KL_OK;
	for (int k = 0; k < 4 && st == KL_OK; k++) {
		kl_optim_launch l;
		fused_launch(o, g, k, items, &l);
		if (l.n > 0)
			st = ctx->be->optim_step(ctx, &l);
	}
	free(items);
	if (st == KL_OK)
		fused_written(o, g);
	return st;
}

/* Inside a compiled function the fused step runs once the graph has run
 * (kl__trace_defer): one launch per dtype over every parameter, as eagerly;
 * the graph computes the gradients it reads. */
typedef struct deferred_step {
	kl_optim *o;
	kl_tensor **g; /* per parameter (the trace's reads hold them); NULL: none */
} deferred_step;

/* The fused step over gradients gsrc[i] per parameter (NULL: none),
 * materialized; adds its launches (one per dtype) to *launches. */
static kl_status fused_from(kl_ctx *ctx, kl_optim *o, kl_tensor *const *gsrc, int *launches)
{
	kl_status st = KL_OK;
	bool no_grad = ctx->no_grad, seen[4] = {0};
	ctx->no_grad = true;
	kl_scope_begin(ctx);
	kl_tensor **g = calloc((size_t)o->n, sizeof *g);
	if (!g)
		st = kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	for (int i = 0; g && i < o->n && st == KL_OK; i++) {
		if (gsrc[i] && !(g[i] = kl_contiguous(gsrc[i])))
			st = kl_last_status(ctx);
		/* one launch per dtype of fused_dts */
		int k = 0;
		while (k < 3 && fused_dts[k] != o->ps[i].p->dtype)
			k++;
		*launches += gsrc[i] && !seen[k];
		seen[k] |= gsrc[i] != NULL;
	}
	if (st == KL_OK)
		st = step_fused(o, g);
	free(g);
	kl_scope_end(ctx);
	ctx->no_grad = no_grad;
	return st;
}

static kl_status run_deferred(kl_ctx *ctx, void *user, bool run, int *launches)
{
	deferred_step *d = user;
	kl_status st = run ? fused_from(ctx, d->o, d->g, launches) : KL_OK;
	free(d->g);
	free(d);
	return st;
}

/* The step again in a fullgraph replay: read k is the gradient of
 * parameter param[k]. Two halves (kl_deferred.again_prepare / launch):
 * where the backend splits the fused step (CUDA), prepare writes each
 * dtype's pointer table into device memory of this step's own and launch
 * launches over it, so that a CUDA graph of the replay captures the launch
 * and each replay reads the table written before it; elsewhere prepare
 * notes the gradients and launch runs the fused step. The replay's guards
 * hold the optimizer's state tensors, so it never runs once the optimizer
 * is freed (free_again touches only ctx and the tables). */
typedef struct again_step {
	kl_ctx *ctx;
	kl_optim *o;
	int nreads;
	int *param;
	kl_tensor **g;           /* per parameter, this call's gradient (borrowed) */
	kl_optim_item *items[4]; /* per dtype (fused_dts) */
	kl_optim_launch l[4];
	void *table[4];
	size_t cap[4];
} again_step;

static kl_status prepare_again(kl_ctx *ctx, void *user, kl_tensor *const *reads)
{
	again_step *a = user;
	kl_optim *o = a->o;
	for (int i = 0; i < o->n; i++)
		a->g[i] = NULL;
	for (int k = 0; k < a->nreads; k++)
		a->g[a->param[k]] = reads[k];
	if (!ctx->be->optim_table || !ctx->be->optim_launch)
		return KL_OK;
	for (int i = 0; i < o->n; i++)
		if (a->g[i] && !kl_is_contiguous(a->g[i]))
			return kl__err(ctx, KL_EINVAL,
			               "kl_optim_step: the gradient of '%s' the replay "
			               "computed is not dense",
			               o->ps[i].name);
	kl_status st = KL_OK;
	for (int k = 0; k < 4 && st == KL_OK; k++) {
		if (!a->items[k] && !(a->items[k] = malloc(sizeof *a->items[k] * (size_t)o->n)))
			return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
		fused_launch(o, a->g, k, a->items[k], &a->l[k]);
		if (a->l[k].n > 0)
			st = ctx->be->optim_table(ctx, &a->l[k], &a->table[k], &a->cap[k]);
	}
	if (st == KL_OK)
		fused_written(o, a->g);
	return st;
}

static kl_status launch_again(kl_ctx *ctx, void *user, int *launches)
{
	again_step *a = user;
	if (!ctx->be->optim_table || !ctx->be->optim_launch)
		return fused_from(ctx, a->o, a->g, launches);
	kl_status st = KL_OK;
	for (int k = 0; k < 4 && st == KL_OK; k++)
		if (a->l[k].n > 0) {
			st = ctx->be->optim_launch(ctx, &a->l[k], a->table[k]);
			(*launches)++;
		}
	return st;
}

static void free_again(void *user)
{
	again_step *a = user;
	if (!a)
		return;
	for (int k = 0; k < 4; k++) {
		free(a->items[k]);
		if (a->table[k])
			a->ctx->be->free(a->ctx, a->table[k]);
	}
	free(a->param);
	free(a->g);
	free(a);
}

static kl_status defer_step(kl_optim *o, kl_tensor *const *grads)
{
	kl_ctx *ctx = o->ctx;
	deferred_step *d = calloc(1, sizeof *d);
	kl_tensor **reads = calloc((size_t)o->n + 1, sizeof *reads);
	kl_tensor **guard = calloc((size_t)(4 * o->n + 1), sizeof *guard);
	if (d)
		d->g = calloc((size_t)o->n + 1, sizeof *d->g);
	if (!d || !d->g || !reads || !guard) {
		if (d)
			free(d->g);
		free(d);
		free(reads);
		free(guard);
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	}
	d->o = o;
	int nr = 0, ng = 0, np = 0;
	for (int i = 0; i < o->n; i++) {
		oparam *q = &o->ps[i];
		if (!grads[i])
			continue;
		np++;
		d->g[i] = grads[i]; /* the trace's reads hold it until after the step */
		reads[nr++] = grads[i];
		guard[ng++] = q->p;
		if (q->m)
			guard[ng++] = q->m;
		if (q->v)
			guard[ng++] = q->v;
		if (q->vmax)
			guard[ng++] = q->vmax;
	}
	guard[ng++] = o->steps;
	char what[80];
	snprintf(what, sizeof what, "the fused %s step over %d parameters",
	         o->algo == KL_ALGO_SGD ? "SGD" : "AdamW", np);
	kl_status st = kl__trace_defer(ctx, run_deferred, d, what, nr, reads, ng, guard);
	free(reads);
	free(guard);
	if (st != KL_OK)
		return st;
	again_step *a = calloc(1, sizeof *a);
	if (a) {
		a->ctx = ctx;
		a->param = calloc((size_t)nr + 1, sizeof *a->param);
		a->g = calloc((size_t)o->n + 1, sizeof *a->g);
	}
	if (!a || !a->param || !a->g) {
		free_again(a);
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	}
	a->o = o;
	for (int i = 0; i < o->n; i++)
		if (grads[i])
			a->param[a->nreads++] = i;
	return kl__trace_defer_again(ctx, prepare_again, launch_again, a, free_again);
}

kl_status kl_optim_step_grads(kl_optim *o, kl_tensor *const *grads)
{
	KL_API("kl_optim_step_grads");
	if (!o)
		return kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
	kl_ctx *ctx = o->ctx;
	if (!grads)
		return kl__err(ctx, KL_EINVAL, "grads is NULL (pass an array of %d entries, NULL "
		                               "for a parameter without a gradient)", o->n);
	char a[128], b[128];
	for (int i = 0; i < o->n; i++) {
		kl_tensor *g = grads[i], *p = o->ps[i].p;
		if (!g)
			continue;
		bool same = g->ndim == p->ndim;
		for (int d = 0; same && d < p->ndim; d++)
			same = g->shape[d] == p->shape[d];
		if (g->ctx != ctx)
			return kl__err(ctx, KL_EINVAL, "the gradient of parameter %d ('%s') belongs "
			               "to another context", i, o->ps[i].name);
		if (!same || g->dtype != p->dtype)
			return kl__err(ctx, KL_EINVAL,
			               "the gradient of parameter %d ('%s') is %s %s, the parameter "
			               "%s %s",
			               i, o->ps[i].name, kl_dtype_name(g->dtype),
			               kl__shape_str(a, sizeof a, g->ndim, g->shape),
			               kl_dtype_name(p->dtype),
			               kl__shape_str(b, sizeof b, p->ndim, p->shape));
		if (!kl__trace_holds(ctx, g))
			return kl__err(ctx, KL_ESTATE, "the gradient of parameter %d ('%s') is a lazy "
			               "tensor of a finished trace", i, o->ps[i].name);
	}
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1)
		return kl_last_status(ctx);
	bool no_grad = ctx->no_grad; /* the update is not recorded for autograd */
	ctx->no_grad = true;
	kl_status st = KL_OK;
	if (ctx->trace && !o->unfused && ctx->be->optim_step) {
		st = defer_step(o, grads);
	} else if (ctx->trace || o->unfused || !ctx->be->optim_step) {
		for (int i = 0; i < o->n && st == KL_OK; i++)
			if (grads[i])
				st = step_ops(o, &o->ps[i], grads[i]);
	} else {
		/* the kernels read dense gradients */
		kl_tensor **g = calloc((size_t)o->n, sizeof *g);
		if (!g)
			st = kl__err(ctx, KL_ENOMEM, "out of memory");
		for (int i = 0; g && i < o->n && st == KL_OK; i++)
			if (grads[i] && !(g[i] = kl_contiguous(grads[i])))
				st = kl_last_status(ctx);
		if (st == KL_OK)
			st = step_fused(o, g);
		free(g);
	}
	ctx->no_grad = no_grad;
	kl_scope_end(ctx);
	return st;
}

/* The gradient kl_optim_step uses for parameter p: its own (kl_grad), or,
 * where p is a block of rows of a leaf that requires grad (a module's packed
 * weights: the FFN's gate and up weights are the row halves of the gate_up
 * buffer its forward reads, see kl_nn_requires_grad), the same rows of that
 * leaf's gradient. *out NULL: none, and the step skips p as torch skips a
 * parameter whose grad is None. */
static kl_status param_grad(kl_ctx *ctx, kl_tensor *p, kl_tensor **out)
{
	*out = p->grad;
	if (p->grad || p->requires_grad || p->ndim < 1)
		return KL_OK;
	for (kl_tensor *t = ctx->live; t; t = t->next) {
		if (t == p || !t->requires_grad || !t->grad || t->st != p->st || t->ndim != p->ndim ||
		    !kl_is_contiguous(t) || t->strides[0] <= 0)
			continue;
		int64_t off = p->offset - t->offset;
		bool rows = off >= 0 && off % t->strides[0] == 0 &&
		            (p->shape[0] <= 1 || p->strides[0] == t->strides[0]);
		for (int d = 1; rows && d < p->ndim; d++)
			rows = p->shape[d] == t->shape[d] && p->strides[d] == t->strides[d];
		int64_t r0 = rows ? off / t->strides[0] : 0;
		if (rows && r0 + p->shape[0] <= t->shape[0])
			return (*out = kl_slice(t->grad, 0, r0, r0 + p->shape[0], 1)) ? KL_OK
			                                                              : kl_last_status(ctx);
	}
	return KL_OK;
}

kl_status kl_optim_step(kl_optim *o)
{
	KL_API("kl_optim_step");
	if (!o)
		return kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
	kl_ctx *ctx = o->ctx;
	kl_tensor **g = calloc((size_t)(o->n > 0 ? o->n : 1), sizeof *g);
	if (!g)
		return kl__err(ctx, KL_ENOMEM, "out of memory");
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	kl_status st = ctx->nscopes == scopes + 1 ? KL_OK : kl_last_status(ctx);
	bool no_grad = ctx->no_grad;
	ctx->no_grad = true;
	for (int i = 0; st == KL_OK && i < o->n; i++)
		st = param_grad(ctx, o->ps[i].p, &g[i]);
	ctx->no_grad = no_grad;
	if (st == KL_OK)
		st = kl_optim_step_grads(o, g);
	if (ctx->nscopes == scopes + 1)
		kl_scope_end(ctx);
	free(g);
	return st;
}

/* ---- learning rate, accessors ------------------------------------------------------- */

kl_status kl_optim_set_lr(kl_optim *o, double lr)
{
	KL_API("kl_optim_set_lr");
	if (!o)
		return kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
	if (!(lr >= 0) || isinf(lr))
		return kl__err(o->ctx, KL_EINVAL, "invalid learning rate: %g", lr);
	if (o->algo == KL_ALGO_SGD)
		o->sgd.lr = lr;
	else
		o->adam.lr = lr;
	kl_ctx *ctx = o->ctx;
	kl_scope_begin(ctx);
	kl_tensor *v = kl_scalar(ctx, KL_F64, lr);
	kl_status st = v ? kl_copy(o->lr, v) : kl_last_status(ctx);
	kl_scope_end(ctx);
	return st;
}

kl_tensor *kl_optim_lr(kl_optim *o)
{
	return o ? o->lr : NULL;
}

int kl_optim_nparams(const kl_optim *o)
{
	return o ? o->n : 0;
}

static bool index_ok(kl_optim *o, int i)
{
	if (!o) {
		kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
		return false;
	}
	if (i < 0 || i >= o->n) {
		kl__err(o->ctx, KL_EINVAL, "parameter %d does not exist (%d parameters)", i, o->n);
		return false;
	}
	return true;
}

kl_tensor *kl_optim_param(kl_optim *o, int i)
{
	KL_API("kl_optim_param");
	return index_ok(o, i) ? o->ps[i].p : NULL;
}

/* The state keys of this optimizer, in saving order, and the slot of each. */
#define NKEYS 5
static int state_keys(const kl_optim *o, oparam *q, const char **keys, kl_tensor **ts)
{
	int k = 0;
	keys[k] = "step";
	ts[k++] = q->step;
	if (o->algo == KL_ALGO_SGD && q->m) {
		keys[k] = "momentum_buffer";
		ts[k++] = q->m;
	}
	if (o->algo == KL_ALGO_ADAMW) {
		keys[k] = "exp_avg";
		ts[k++] = q->m;
		keys[k] = "exp_avg_sq";
		ts[k++] = q->v;
		if (q->vmax) {
			keys[k] = "max_exp_avg_sq";
			ts[k++] = q->vmax;
		}
	}
	return k;
}

kl_tensor *kl_optim_state(kl_optim *o, int i, const char *key)
{
	KL_API("kl_optim_state");
	if (!index_ok(o, i))
		return NULL;
	const char *keys[NKEYS];
	kl_tensor *ts[NKEYS];
	int k = state_keys(o, &o->ps[i], keys, ts);
	for (int j = 0; key && j < k; j++)
		if (!strcmp(keys[j], key))
			return ts[j];
	kl__err(o->ctx, KL_EINVAL, "parameter %d ('%s') has no state '%s' (this %s has:%s%s%s%s)", i,
	        o->ps[i].name, key ? key : "(NULL)", o->algo == KL_ALGO_SGD ? "SGD" : "AdamW",
	        k > 0 ? " step" : "", k > 1 ? ", " : "", k > 1 ? keys[1] : "",
	        k > 2 ? ", ..." : "");
	return NULL;
}

/* ---- saving and loading ------------------------------------------------------------- */

#define LR_KEY "param_groups.0.lr"

/* Every (key, tensor) of o's state: *names and *ts malloc'd, key text in *buf. */
static int all_state(kl_optim *o, char **buf, const char ***names, kl_tensor ***ts)
{
	size_t cap = (size_t)o->n * NKEYS + 1;
	*buf = malloc(cap * 192);
	*names = malloc(cap * sizeof **names);
	*ts = malloc(cap * sizeof **ts);
	if (!*buf || !*names || !*ts)
		return -1;
	int n = 0;
	for (int i = 0; i < o->n; i++) {
		const char *keys[NKEYS];
		kl_tensor *t[NKEYS];
		int k = state_keys(o, &o->ps[i], keys, t);
		for (int j = 0; j < k; j++, n++) {
			snprintf(*buf + (size_t)n * 192, 192, "state.%s.%s", o->ps[i].name, keys[j]);
			(*names)[n] = *buf + (size_t)n * 192;
			(*ts)[n] = t[j];
		}
	}
	(*names)[n] = LR_KEY;
	(*ts)[n++] = o->lr;
	return n;
}

kl_status kl_optim_save(kl_optim *o, const char *path)
{
	KL_API("kl_optim_save");
	if (!o)
		return kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
	char *buf = NULL;
	const char **names = NULL;
	kl_tensor **ts = NULL;
	int n = all_state(o, &buf, &names, &ts);
	kl_status st = n < 0 ? kl__err(o->ctx, KL_ENOMEM, "out of memory")
	                     : kl_safetensors_save(o->ctx, path, n, names, ts);
	free(buf);
	free(names);
	free(ts);
	return st;
}

kl_status kl_optim_load(kl_optim *o, const char *path)
{
	KL_API("kl_optim_load");
	if (!o)
		return kl__err(NULL, KL_EINVAL, "the optimizer is NULL");
	kl_ctx *ctx = o->ctx;
	if (ctx->trace)
		return kl__err(ctx, KL_ESTATE, "called inside a compiled function (a file read is "
		                               "no graph op): load before the call");
	char *buf = NULL;
	const char **names = NULL;
	kl_tensor **ts = NULL, **got = NULL;
	int n = all_state(o, &buf, &names, &ts);
	kl_safetensors *sf = n < 0 ? NULL : kl_safetensors_open(ctx, path);
	kl_status st = n < 0 ? kl__err(ctx, KL_ENOMEM, "out of memory")
	               : !sf ? kl_last_status(ctx)
	                     : KL_OK;
	if (st == KL_OK && !(got = calloc((size_t)n, sizeof *got)))
		st = kl__err(ctx, KL_ENOMEM, "out of memory");
	/* a key of the file this optimizer does not have: another optimizer's state */
	for (int i = 0; st == KL_OK && i < kl_safetensors_count(sf); i++) {
		const char *key = kl_safetensors_name(sf, i);
		int j = 0;
		while (j < n && strcmp(names[j], key) != 0)
			j++;
		if (j == n)
			st = kl__err(ctx, KL_EINVAL, "%s: key '%s' is not state of this %s (of %d "
			             "parameters)", path, key, o->algo == KL_ALGO_SGD ? "SGD" : "AdamW",
			             o->n);
	}
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	char a[128], b[128];
	/* every tensor read and checked before anything is written */
	for (int j = 0; st == KL_OK && j < n; j++) {
		bool has = false;
		for (int i = 0; !has && i < kl_safetensors_count(sf); i++)
			has = !strcmp(kl_safetensors_name(sf, i), names[j]);
		if (!has) {
			st = kl__err(ctx, KL_EINVAL, "%s: missing key '%s' (%s %s)", path, names[j],
			             kl_dtype_name(ts[j]->dtype),
			             kl__shape_str(a, sizeof a, ts[j]->ndim, ts[j]->shape));
			break;
		}
		kl_tensor *t = kl_safetensors_get(sf, names[j]);
		if (!t) {
			st = kl_last_status(ctx);
			break;
		}
		bool same = t->ndim == ts[j]->ndim && t->dtype == ts[j]->dtype;
		for (int d = 0; same && d < t->ndim; d++)
			same = t->shape[d] == ts[j]->shape[d];
		if (!same)
			st = kl__err(ctx, KL_EINVAL, "%s: '%s' is %s %s, the optimizer holds %s %s", path,
			             names[j], kl_dtype_name(t->dtype),
			             kl__shape_str(a, sizeof a, t->ndim, t->shape),
			             kl_dtype_name(ts[j]->dtype),
			             kl__shape_str(b, sizeof b, ts[j]->ndim, ts[j]->shape));
		got[j] = t;
	}
	double lr = 0;
	if (st == KL_OK && (st = kl_item(got[n - 1], &lr)) == KL_OK && (!(lr >= 0) || isinf(lr)))
		st = kl__err(ctx, KL_EINVAL, "%s: invalid learning rate: %g", path, lr);
	for (int j = 0; st == KL_OK && j < n; j++)
		st = kl_copy(ts[j], got[j]);
	if (st == KL_OK) {
		if (o->algo == KL_ALGO_SGD)
			o->sgd.lr = lr;
		else
			o->adam.lr = lr;
	}
	if (ctx->nscopes == scopes + 1)
		kl_scope_end(ctx);
	kl_safetensors_close(sf);
	free(got);
	free(buf);
	free(names);
	free(ts);
	return st;
}
