/* exec.c - the executor: bind a compiled variant's buffers (inputs, fresh
 * outputs or views, arena slots), evaluate its symbols from the input
 * shapes, then run its steps in order: generated kernels through their
 * function pointers, library steps through the backend (on the CPU:
 * backend/cpu/matmul_step.c, attention_cpu.c; CUDA: cuda/exec_cuda.c). Also its
 * explain printer.
 */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h" /* matmul and attention steps */
#include "runtime/runtime_int.h"

/* ---- binding and running ------------------------------------------------------- */

static kl_status check_input(kl_ctx *ctx, const kl_compiled *c, const kl_buf *bf,
                             const kl_tensor *t, const int64_t *syms)
{
	int i = bf->index;
	char have[128], want[128];
	int64_t shape[KL_MAX_DIMS];
	for (int d = 0; d < bf->ndim; d++)
		shape[d] = kl__dim_value(&bf->shape[d], syms);
	if (t->dtype != bf->dtype || t->ndim != bf->ndim ||
	    memcmp(t->shape, shape, sizeof(int64_t) * (size_t)bf->ndim) != 0)
		return kl__err(ctx, KL_EINVAL,
		               "kl_fn_call: input %d is %s %s; the compiled graph "
		               "takes %s %s",
		               i, kl_dtype_name(t->dtype),
		               kl__shape_str(have, sizeof have, t->ndim, t->shape),
		               kl_dtype_name(bf->dtype),
		               kl__shape_str(want, sizeof want, bf->ndim, shape));
	bool ok = true;
	if (c->in_dynamic[i])
		ok = kl__strides_contiguous(t->ndim, t->shape, t->strides);
	else
		for (int d = 0; d < t->ndim; d++)
			if (t->shape[d] != 1 && t->strides[d] != c->in_strides[i][d])
				ok = false;
	if (!ok)
		return kl__err(ctx, KL_EINVAL,
		               "kl_fn_call: input %d has strides %s; the compiled "
		               "graph was traced with %s",
		               i, kl__shape_str(have, sizeof have, t->ndim, t->strides),
		               c->in_dynamic[i] ? "dense ones"
		                                : kl__shape_str(want, sizeof want, t->ndim,
		                                                c->in_strides[i]));
	return KL_OK;
}

/* The strides of an output view whose dims are symbols: a view that was
 * dense at trace time is dense at every size; other layouts are refused. */
static bool view_strides(const kl_buf *bf, const int64_t *shape, int64_t *strides)
{
	int64_t traced[KL_MAX_DIMS], tshape[KL_MAX_DIMS];
	bool sym = false;
	for (int d = 0; d < bf->ndim; d++) {
		tshape[d] = bf->shape[d].v;
		sym |= bf->shape[d].sym > 0;
	}
	if (!sym) {
		memcpy(strides, bf->view_strides, sizeof(int64_t) * (size_t)bf->ndim);
		return true;
	}
	kl__contig_strides(bf->ndim, tshape, traced);
	for (int d = 0; d < bf->ndim; d++)
		if (tshape[d] != 1 && traced[d] != bf->view_strides[d])
			return false;
	kl__contig_strides(bf->ndim, shape, strides);
	return true;
}

static kl_status bind_outputs(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                              kl_tensor **outputs, const int64_t *syms, void **B)
{
	const kl_program *p = &c->prog;
	for (int pass = 0; pass < 2; pass++)
		for (int32_t b = 0; b < p->nbufs; b++) {
			const kl_buf *bf = &p->bufs[b];
			if (bf->role != KL_BUF_OUTPUT || (pass == 0) != (bf->alias < 0))
				continue;
			int64_t shape[KL_MAX_DIMS], strides[KL_MAX_DIMS];
			for (int d = 0; d < bf->ndim; d++)
				shape[d] = kl__dim_value(&bf->shape[d], syms);
			kl_tensor *t;
			if (bf->alias < 0 && c->plan.slot[b] >= 0) {
				/* lent: the arena's memory, until the next call */
				t = kl__tensor_borrow(ctx, bf->dtype, bf->ndim, shape,
				                      (char *)c->arena + c->plan.off[b],
				                      kl__buf_bytes(bf, syms));
			} else if (bf->alias < 0) {
				t = kl__tensor_alloc(ctx, bf->dtype, bf->ndim, shape);
			} else {
				const kl_buf *base = &p->bufs[bf->alias];
				kl_tensor *bt = base->role == KL_BUF_INPUT ? inputs[base->index]
				                                           : outputs[base->index];
				if (!view_strides(bf, shape, strides))
					return kl__err(ctx, KL_EUNSUPPORTED,
					               "kl_fn_call: output %d is a "
					               "non-dense view with dynamic dims",
					               (int)bf->index);
				t = kl__tensor_view(bt, bf->ndim, shape, strides,
				                    bt->offset + bf->view_offset);
			}
			if (!t)
				return kl_last_status(ctx);
			outputs[bf->index] = t;
			B[b] = kl__tensor_data(t);
		}
	return KL_OK;
}

static kl_status ensure_plan(kl_ctx *ctx, kl_compiled *c, const int64_t *syms)
{
	if (c->dynamic &&
	    memcmp(syms, c->plan_syms, sizeof(int64_t) * (size_t)c->prog.nsyms) != 0) {
		kl_memplan mp;
		char err[160];
		/* the library steps' sizes at these symbols (BLAS products, fused
		 * attention), then their buffers */
		if (kl__program_bind(&c->prog, syms, err, sizeof err) != KL_OK) {
			char e2[8];
			kl__program_bind(&c->prog, c->plan_syms, e2, sizeof e2); /* as it was */
			return kl__err(ctx, KL_EINVAL,
			               "kl_fn_call: the compiled graph cannot run at "
			               "these sizes: %s",
			               err);
		}
		if (kl__memplan_build(&c->prog, syms, c->lent, &mp) != KL_OK)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory planning buffers");
		kl__memplan_free(&c->plan);
		c->plan = mp;
		memcpy(c->plan_syms, syms, sizeof(int64_t) * (size_t)c->prog.nsyms);
	}
	if (c->cuda) {
		kl_status st = kl__cuda_rt_arena(ctx, c, c->plan.arena_bytes, &c->arena);
		if (st == KL_OK && c->plan.arena_bytes > c->arena_cap)
			c->arena_cap = c->plan.arena_bytes;
		return st;
	}
	if (c->plan.arena_bytes > c->arena_cap || !c->arena) {
		void *a = NULL;
		size_t want = c->plan.arena_bytes ? c->plan.arena_bytes : KL_ARENA_ALIGN;
		if (posix_memalign(&a, KL_ARENA_ALIGN, want) != 0)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory allocating a %zu-byte "
			               "arena",
			               want);
		free(c->arena);
		c->arena = a;
		c->arena_cap = want;
	}
	return KL_OK;
}

/* Step sp of c on the CPU; inputs: the call's (a product whose B is one
 * keeps it packed across calls, c->mm_pack). */
static kl_status cpu_step(kl_ctx *ctx, kl_compiled *c, const kl_step *sp, void **B,
                          const int64_t *syms, kl_tensor *const *inputs)
{
	const kl_program *p = &c->prog;
	if (sp->kind == KL_STEP_KERNEL) {
		c->fns[sp->kernel]((void *const *)B, syms);
		return KL_OK;
	}
	if (sp->kind == KL_STEP_ATTENTION && sp->at.bwd)
		return kl__cpu_attention_bwd(&sp->at, p->bufs[sp->at.o].dtype, B[sp->at.q],
		                             B[sp->at.k], B[sp->at.v], B[sp->at.fo], B[sp->at.go],
		                             B[sp->at.o])
		               ? KL_OK
		               : kl__err(ctx, KL_ENOMEM,
		                         "kl_fn_call: out of memory for attention backward tiles");
	if (sp->kind == KL_STEP_ATTENTION)
		return kl__cpu_attention(&sp->at, p->bufs[sp->at.o].dtype, B[sp->at.q], B[sp->at.k],
		                         B[sp->at.v], sp->at.len >= 0 ? B[sp->at.len] : NULL,
		                         B[sp->at.o])
		               ? KL_OK
		               : kl__err(ctx, KL_ENOMEM,
		                         "kl_fn_call: out of memory for attention tiles");
	if (sp->kind == KL_STEP_CACHE_WRITE) {
		const kl_cw_step *w = &sp->cw;
		kl_cw_geom g = {.rows = w->rows,
		                .R = w->R,
		                .outer = w->outer,
		                .cap = w->cap,
		                .s = w->s,
		                .inner = w->inner,
		                .vrs = w->val_rs};
		size_t es = kl_dtype_size(p->bufs[w->out].dtype);
		if (B[w->out] != B[w->cache])
			memcpy(B[w->out], B[w->cache],
			       (size_t)(w->R * w->outer * w->cap * w->inner) * es);
		int64_t bad = kl__cpu_cache_rows(&g, es, p->bufs[w->pos].dtype, B[w->out],
		                                 B[w->pos],
		                                 (const char *)B[w->val] + (size_t)w->val_off * es);
		if (bad < 0)
			return KL_OK;
		const void *pp = B[w->pos];
		int64_t at = p->bufs[w->pos].dtype == KL_I32 ? ((const int32_t *)pp)[bad]
		                                             : ((const int64_t *)pp)[bad];
		return kl__cache_write_range_err(ctx, &g, w->axis, bad, at);
	}
	const kl_buf *bb = &p->bufs[sp->mm.b];
	kl_mm_pack *pk = NULL;
	kl_mm_weight w = {0, 0};
	if (c->mm_pack && bb->role == KL_BUF_INPUT) {
		const kl_storage *st = inputs[bb->index]->st;
		pk = &c->mm_pack[sp - p->steps];
		w = (kl_mm_weight){st->id, st->version};
	}
	return kl__cpu_matmul_step(ctx, &sp->mm, p->bufs, (void *const *)B, &c->scratch,
	                           &c->scratch_cap, pk, w, &c->mm_pack_bytes);
}

/* c->mm_pack at the first CPU call: a slot a step, or none where a step
 * writes in place (a cache write lands in an input's memory during the
 * call, before its version moves) or memory is short */
static void mm_pack_init(kl_compiled *c)
{
	const kl_program *p = &c->prog;
	if (c->mm_pack || p->nsteps <= 0)
		return;
	for (int32_t s = 0; s < p->nsteps; s++)
		if (p->steps[s].kind == KL_STEP_CACHE_WRITE)
			return;
	c->mm_pack = calloc((size_t)p->nsteps, sizeof *c->mm_pack);
}

static const char *human(double v, const char *unit, char *buf, size_t cap);
static const char *step_label(const kl_program *p, const kl_step *sp, char *buf, size_t cap);

/* kl_profile: after the call has run every step, each one again alone (the
 * program is functional: a step rewrites only its own outputs, from buffers
 * the call left in place), on the GPU by device events over about 2 ms of
 * plain launches, on the CPU by the host clock over at least 3 runs and
 * 2 ms; then a table to ctx->profile. Before a step is timed, the steps
 * before it run once more: a later step may have reused the memory of this
 * one's inputs (the memory plan's slots), and a step timed on what that
 * left (NaN, say) took twice its time in train_decoder's backward. */
static kl_status profile_steps(kl_ctx *ctx, kl_compiled *c, void **B, const int64_t *syms,
                               kl_tensor *const *inputs)
{
	const kl_program *p = &c->prog;
	double *us = calloc((size_t)(p->nsteps > 0 ? p->nsteps : 1), sizeof *us);
	if (!us)
		return kl__err(ctx, KL_ENOMEM, "kl_profile: out of memory");
	kl_status st = KL_OK;
	if (c->cuda) {
		st = kl__cuda_rt_time_steps(ctx, c, (void *const *)B, syms, us);
	} else {
		for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++) {
			for (int32_t q = 0; q < s && st == KL_OK; q++)
				st = cpu_step(ctx, c, &p->steps[q], B, syms, inputs);
			double t0 = kl__now_ms(), t1 = t0;
			int n = 0;
			do {
				st = cpu_step(ctx, c, &p->steps[s], B, syms, inputs);
				n++;
				t1 = kl__now_ms();
			} while (st == KL_OK && n < 1000 && (n < 3 || t1 - t0 < 2.0));
			us[s] = (t1 - t0) * 1e3 / n;
		}
	}
	if (st == KL_OK) {
		FILE *f = ctx->profile;
		double total = 0;
		for (int32_t s = 0; s < p->nsteps; s++)
			total += us[s];
		fprintf(f,
		        "kiln profile: graph %d: %d steps, each timed alone (%s): %.1f us in all\n",
		        ctx->profile_graph, (int)p->nsteps,
		        c->cuda ? "device events, plain launches" : "host clock", total);
		ctx->profile_segs++;
		fprintf(f, "  %-6s %12s %7s %12s %15s  %s\n", "step", "time", "share", "moved",
		        "computed", "what");
		for (int32_t s = 0; s < p->nsteps; s++) {
			const kl_step *sp = &p->steps[s];
			char b1[32], b2[32], idx[16], label[96];
			double sec = us[s] * 1e-6;
			snprintf(idx, sizeof idx, "[%d]", (int)s);
			fprintf(f, "  %-6s %9.1f us %6.1f%% %10s/s %13s/s  %s\n", idx, us[s],
			        total > 0 ? 100.0 * us[s] / total : 0.0,
			        human(sec > 0 ? sp->bytes / sec : 0, "B", b1, sizeof b1),
			        human(sec > 0 ? sp->flops / sec : 0, "FLOP", b2, sizeof b2),
			        step_label(p, sp, label, sizeof label));
		}
		if (ferror(f))
			st = kl__err(ctx, KL_EIO, "kl_profile: write error");
	}
	free(us);
	return st;
}

kl_status kl__compiled_run(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                           kl_tensor **outputs)
{
	return kl__compiled_run_tail(ctx, c, inputs, outputs, NULL, NULL, 0);
}

kl_status kl__check_values(kl_ctx *ctx, const kl_tensor *t, int64_t hi, int dim, const char *op,
                           const char *what)
{
	int64_t n = t->ndim == 1 ? t->shape[0] : 0;
	if (n == 0 || !t->st)
		return KL_OK;
	/* the span of storage the values cover */
	int64_t lo = t->offset, reach = (n - 1) * t->strides[0];
	lo += reach < 0 ? reach : 0;
	size_t es = kl_dtype_size(t->dtype), bytes = (size_t)(reach < 0 ? -reach : reach) * es + es;
	const unsigned char *h = (const unsigned char *)t->st->data + (size_t)lo * es;
	unsigned char *copy = NULL;
	kl_status st = KL_OK;
	if (ctx->device != KL_CPU) {
		if (!(copy = malloc(bytes)))
			return kl__err(ctx, KL_ENOMEM, "%s: out of memory reading %s", op, what);
		st = ctx->be->to_host(ctx, copy, h, bytes);
		h = copy;
	}
	for (int64_t i = 0; st == KL_OK && i < n; i++) {
		size_t at = (size_t)(t->offset - lo + i * t->strides[0]) * es;
		int64_t v = t->dtype == KL_I32 ? (int64_t)*(const int32_t *)(const void *)(h + at)
		                               : *(const int64_t *)(const void *)(h + at);
		if (v < 0 || v > hi)
			st = kl__err_value(ctx, op, what, i, v, hi, dim);
	}
	free(copy);
	return st;
}

kl_status kl__compiled_run_tail(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                                kl_tensor **outputs, const kl_run_tail *tail,
                                const kl_value_check *chk, int nchk)
{
	const kl_program *p = &c->prog;
	for (int j = 0; j < c->nout; j++)
		outputs[j] = NULL;
	for (int i = 0; i < c->nin; i++) {
		const kl_tensor *t = inputs[i];
		if (!t || t->ctx != ctx || !t->st)
			return kl__err(ctx, KL_EINVAL, "kl_fn_call: input %d is %s", i,
			               !t              ? "NULL"
			               : t->ctx != ctx ? "of another context"
			                               : "not materialized");
	}
	int64_t syms[KL_MAX_DIMS * 4] = {0};
	for (int32_t k = 0; k < p->nsyms; k++)
		syms[k] = inputs[p->sym_input[k]]->shape[p->sym_dim[k]];
	kl_status st = KL_OK;
	for (int32_t b = 0; b < p->nbufs && st == KL_OK; b++)
		if (p->bufs[b].role == KL_BUF_INPUT)
			st = check_input(ctx, c, &p->bufs[b], inputs[p->bufs[b].index], syms);
	for (int k = 0; k < nchk && st == KL_OK; k++) {
		const kl_tensor *t = chk[k].in >= 0 && chk[k].in < c->nin ? inputs[chk[k].in] : NULL;
		if (!t || t->ndim != 1 || (t->dtype != KL_I32 && t->dtype != KL_I64))
			st = kl__err(ctx, KL_EINVAL, "kl_fn_call: value check %d names input %d, not "
			             "a 1-D integer input", k, chk[k].in);
	}
	for (int k = 0; k < nchk && st == KL_OK && !c->cuda; k++)
		st = kl__check_values(ctx, inputs[chk[k].in], chk[k].hi, chk[k].dim, chk[k].op,
		                      chk[k].what);
	if (st == KL_OK)
		st = ensure_plan(ctx, c, syms);
	void **B = malloc(sizeof(void *) * (size_t)(p->nbufs ? p->nbufs : 1));
	if (st != KL_OK || !B) {
		free(B);
		return st != KL_OK ? st : kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	}
	/* outputs are made in a private scope, so that a failure frees them and
	 * success hands the caller plain references */
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1) {
		free(B);
		return kl_last_status(ctx);
	}
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->role == KL_BUF_INPUT)
			B[b] = kl__tensor_data(inputs[bf->index]);
		else if (bf->role == KL_BUF_TEMP)
			B[b] = (char *)c->arena + c->plan.off[b];
		else
			B[b] = NULL;
	}
	st = bind_outputs(ctx, c, inputs, outputs, syms, B);
	int tail_launches = 0;
	if (st == KL_OK && tail)
		st = tail->prepare(ctx, tail->user, outputs);
	if (st == KL_OK && c->cuda) {
		st = kl__cuda_rt_run(ctx, c, (void *const *)B, syms, tail, &tail_launches, inputs,
		                     chk, nchk);
	} else if (st == KL_OK) {
		kl__par_set_threads(ctx->nthreads);
		mm_pack_init(c);
		for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++)
			st = cpu_step(ctx, c, &p->steps[s], B, syms, inputs);
		if (st == KL_OK && tail)
			st = tail->launch(ctx, tail->user, &tail_launches);
	}
	if (st == KL_OK && ctx->profile)
		st = profile_steps(ctx, c, B, syms, inputs);
	free(B);
	if (st == KL_OK)
		for (int j = 0; j < c->nout; j++)
			kl_retain(outputs[j]);
	kl_scope_end(ctx);
	if (st != KL_OK) {
		for (int j = 0; j < c->nout; j++)
			outputs[j] = NULL;
		return st;
	}
	c->runs++;
	/* a CUDA graph replay: one launch, the tail's inside it */
	c->last_launches = c->cuda && kl__cuda_rt_replaying(c) ? 1 : (int)p->nsteps + tail_launches;
	c->launches += (uint64_t)c->last_launches;
	return KL_OK;
}

/* ---- explain ------------------------------------------------------------------- */

static const char *human(double v, const char *unit, char *buf, size_t cap)
{
	static const char *const pre[] = {"", "K", "M", "G", "T", "P"};
	int i = 0;
	while (v >= 1000 && i < 5) {
		v /= 1000;
		i++;
	}
	snprintf(buf, cap, i ? "%.3g %s%s" : "%.0f %s%s", v, pre[i], unit);
	return buf;
}

/* A step in words: its kernel's name (or the library call) and what it is. */
static const char *step_label(const kl_program *p, const kl_step *sp, char *buf, size_t cap)
{
	snprintf(buf, cap, "%s %s",
	         sp->kind == KL_STEP_KERNEL      ? p->kernel_names[sp->kernel]
	         : sp->kind == KL_STEP_ATTENTION   ? "attn"
	         : sp->kind == KL_STEP_CACHE_WRITE ? "cache"
	                                           : "blas",
	         sp->what[0] ? sp->what : (sp->kind == KL_STEP_KERNEL ? "kernel" : "matmul"));
	return buf;
}

void kl__compiled_explain(const kl_compiled *c, FILE *f, const char *ind)
{
	const kl_program *p = &c->prog;
	int nk = 0, nm = 0;
	for (int32_t s = 0; s < p->nsteps; s++)
		p->steps[s].kind == KL_STEP_KERNEL ? nk++ : nm++;
	/* library calls: products and attention steps */
	char b1[32], b2[32], b3[32], b4[32], b5[32];
	fprintf(f, "%s%d steps per call: %d generated kernels, %d library calls%s%s\n", ind,
	        (int)p->nsteps, nk, nm, c->fusion ? "" : " (fusion off)",
	        c->from_cache ? "; plan and binary from the disk cache" : "");
	char lent[160] = "";
	if (c->plan.nlent > 0)
		snprintf(lent, sizeof lent, "; %d outputs lent from the temps' memory",
		         (int)c->plan.nlent);
	if (c->plan.ninplace > 0)
		snprintf(lent + strlen(lent), sizeof lent - strlen(lent),
		         "; %d kernels write in place of their input", (int)c->plan.ninplace);
	fprintf(f,
	        "%splanned peak memory: %s (temps %s in %d slots, %s live at most, %s without "
	        "reuse; outputs %s%s)%s\n",
	        ind, human((double)(c->plan.arena_bytes + c->plan.out_bytes), "B", b1, sizeof b1),
	        human((double)c->plan.arena_bytes, "B", b2, sizeof b2), (int)c->plan.nslots,
	        human((double)c->plan.live_bytes, "B", b5, sizeof b5),
	        human((double)c->plan.temp_bytes, "B", b3, sizeof b3),
	        human((double)c->plan.out_bytes, "B", b4, sizeof b4), lent,
	        c->dynamic ? " at the traced sizes" : "");
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		char label[96];
		fprintf(f, "%s  [%d] %s:", ind, (int)s, step_label(p, sp, label, sizeof label));
		for (int i = 0; i < sp->nnodes; i++) {
			int32_t id = sp->nodes[i];
			const char *op = id < c->g.n && c->g.nodes[id].op < KL_NOPS
			                         ? kl__ops[c->g.nodes[id].op].name
			                         : "?";
			fprintf(f, " %s#%d", op, (int)id);
		}
		fprintf(f, " | %s moved, %s\n", human(sp->bytes, "B", b1, sizeof b1),
		        human(sp->flops, "FLOP", b2, sizeof b2));
	}
	int npk = 0;
	for (int32_t s = 0; c->mm_pack && s < p->nsteps; s++)
		npk += c->mm_pack[s].key.id != 0;
	if (npk)
		fprintf(f, "%sweights kept packed across calls: %d product%s, %s\n", ind, npk,
		        npk == 1 ? "" : "s", human((double)c->mm_pack_bytes, "B", b1, sizeof b1));
}
