/* exec_cuda.c - the runtime's CUDA half: a compiled variant's source becomes one
 * NVRTC module for the device's architecture (its cubin cached on disk next
 * to the plan), temps live in a device arena, kernel steps launch on the
 * context's stream and products go through cuBLASLt. Under reduce-overhead
 * and max-autotune the whole variant is captured into a CUDA graph after one
 * warm-up run, on the call's own buffers, and replayed with a single launch;
 * when buffers move between calls the kernel nodes that use them are
 * re-pointed, and buffers a library call holds go through a static copy
 * whose copy node is re-pointed instead.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime/cuda/exec_cuda.h"
#include "codegen/render.h"
#include "codegen/row_onepass.h"

#define BLOCK 256

static atomic_long n_captures, n_replays, n_kupdates, n_cupdates, n_tunes, n_tune_hits,
        n_tune_rejects;

void kl__cuda_counters(kl_cuda_counters *o)
{
	o->captures = atomic_load(&n_captures);
	o->replays = atomic_load(&n_replays);
	o->kernel_updates = atomic_load(&n_kupdates);
	o->copy_updates = atomic_load(&n_cupdates);
	o->tunes = atomic_load(&n_tunes);
	o->tune_hits = atomic_load(&n_tune_hits);
	o->tune_rejects = atomic_load(&n_tune_rejects);
}

void kl__cuda_count_tune(int which)
{
	atomic_fetch_add(which == 0 ? &n_tunes : which == 1 ? &n_tune_hits : &n_tune_rejects, 1);
}

uint64_t kl__cuda_rt_identity(kl_ctx *ctx)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	/* the forced row group, the one-reduction pairs and the dot rows' knobs
	 * change the generated kernels */
	kl_cuda_dot dot = kl__cuda_dot_knobs();
	int v[12] = {d->cc_major, d->cc_minor, 0,         0,        kl__cuda_row_group(),
	             kl__cuda_row_onepass(), dot.chunks, dot.threads, dot.f32, dot.minb,
	             dot.hold, dot.pw};
	if (kl__cuda_load_nvrtc(ctx) == KL_OK) {
		v[2] = kl__nvrtc.major;
		v[3] = kl__nvrtc.minor;
	} else {
		kl_clear_error(ctx);
	}
	return kl__hash_bytes(KL_HASH_SEED, v, sizeof v);
}

static void bin_name(uint64_t key, uint64_t h, char *buf, size_t cap)
{
	snprintf(buf, cap, "cubin-%016" PRIx64 "-%016" PRIx64 ".bin", key, h);
}

/* The points a thread of pointwise (or copy) step sp takes: U chunks
 * (KILN_CUDA_PW_UNROLL) of V points, V as the renderer chooses it from the
 * narrowest element the step touches (a scalar kernel takes fewer and loops
 * over the rest); 0 for any other step. */
static int64_t pointwise_points(const kl_program *p, const kl_step *sp, int unroll)
{
	if (sp->kind != KL_STEP_KERNEL ||
	    (strncmp(sp->what, "pointwise", 9) != 0 && strncmp(sp->what, "copy", 4) != 0))
		return 0;
	size_t minsz = 8;
	for (int32_t i = 0; i < sp->nreads + sp->nwrites; i++) {
		int32_t b = i < sp->nreads ? sp->reads[i] : sp->writes[i - sp->nreads];
		size_t sz = kl_dtype_size(p->bufs[b].dtype);
		if (sz && sz < minsz)
			minsz = sz;
	}
	int64_t v = 16 / (int64_t)minsz > 8 ? 8 : 16 / (int64_t)minsz;
	return v * unroll;
}

/* A slot's per-buffer and per-step arrays (its graph comes at capture). */
static bool slot_init(const kl_compiled *c, kl_cuda_gslot *g, kl_gstate gs)
{
	size_t nb = (size_t)(c->prog.nbufs > 0 ? c->prog.nbufs : 1);
	size_t ns = (size_t)(c->prog.nsteps > 0 ? c->prog.nsteps : 1);
	memset(g, 0, sizeof *g);
	g->gs = gs;
	g->knode = calloc(ns, sizeof *g->knode);
	g->kparams = calloc(ns, sizeof *g->kparams);
	g->must_stage = calloc(nb, sizeof *g->must_stage);
	g->warm = calloc(nb, sizeof *g->warm);
	g->bound = calloc(nb, sizeof *g->bound);
	g->how = calloc(nb, sizeof *g->how);
	g->stat = calloc(nb, sizeof *g->stat);
	g->stat_bytes = calloc(nb, sizeof *g->stat_bytes);
	g->copy_node = calloc(nb, sizeof *g->copy_node);
	g->copy_params = calloc(nb, sizeof *g->copy_params);
	return g->knode && g->kparams && g->must_stage && g->warm && g->bound && g->how &&
	       g->stat && g->stat_bytes && g->copy_node && g->copy_params;
}

/* Give up a slot: its graph, static copies and arena (the stream drained
 * first: queued work may still read them) and its arrays. */
static void slot_free(kl_cuda_rt *rt, int32_t nbufs, kl_cuda_gslot *g)
{
	if (g->graph.exec || g->arena || g->stat)
		kl__cuda_sync(NULL, rt->dev);
	kl__cuda_graph_free(&g->graph);
	for (int32_t b = 0; g->stat && b < nbufs; b++)
		if (g->stat[b])
			kl__cuda_free(rt->ctx, rt->dev, g->stat[b]);
	if (g->arena)
		kl__cuda_free(rt->ctx, rt->dev, g->arena);
	free(g->knode);
	free(g->kparams);
	free(g->must_stage);
	free(g->warm);
	free(g->bound);
	free(g->how);
	free(g->stat);
	free(g->stat_bytes);
	free(g->copy_node);
	free(g->copy_params);
	memset(g, 0, sizeof *g);
}

/* Point rt->g at the slot for the symbol values syms: a variant with static
 * dims (or not in a graph mode) has one; with dynamic dims each vector gets
 * its own, a new one in warm-up, the least recently used given up past the
 * limit. */
static kl_status pick_slot(kl_ctx *ctx, kl_compiled *c, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	int ns = c->prog.nsyms;
	if (!c->dynamic || ns <= 0 || ns > KL_GSLOT_KEY ||
	    (c->mode != KL_MODE_REDUCE_OVERHEAD && c->mode != KL_MODE_MAX_AUTOTUNE)) {
		rt->g = &rt->slots[0];
		return KL_OK;
	}
	kl_gslot_pick_how how;
	int i = kl__gslot_pick(rt->keys, rt->used, rt->nslots, rt->maxslots, ns, syms, &how);
	kl_cuda_gslot *g = &rt->slots[i];
	if (how != KL_GSLOT_HIT) {
		if (how == KL_GSLOT_EVICT) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "evict: the graph of the least recently used sizes (slot %d) for "
			        "new sizes: %d graphs kept (KILN_CUDA_GRAPHS_MAX)",
			        i, rt->maxslots);
			slot_free(rt, c->prog.nbufs, g);
			rt->evictions++;
		} else {
			rt->nslots++;
		}
		if (!slot_init(c, g, rt->gs0)) {
			slot_free(rt, c->prog.nbufs, g);
			if (how == KL_GSLOT_NEW)
				rt->nslots--;
			else /* a zeroed slot no call's sizes name (sizes are >= 0) */
				rt->keys[(size_t)i * KL_GSLOT_KEY] = -1;
			rt->g = &rt->slots[0];
			return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory for a CUDA graph slot");
		}
		memcpy(rt->keys + (size_t)i * KL_GSLOT_KEY, syms, sizeof(int64_t) * (size_t)ns);
	}
	rt->used[i] = ++rt->calls;
	rt->g = g;
	return KL_OK;
}

/* rt->lse_link and the pairs' arrays (static programs only: the rows' count
 * is then fixed, and a buffer once given to a captured graph never moves).
 * KILN_CUDA_ATTN_LSE=0 pairs nothing (an A/B knob: every backward then
 * computes L itself; read when the module loads). */
static kl_status lse_links(kl_ctx *ctx, kl_cuda_rt *rt, const kl_program *p)
{
	const char *e = getenv("KILN_CUDA_ATTN_LSE");
	if (p->nsyms > 0 || p->nsteps <= 0 || (e && strcmp(e, "0") == 0))
		return KL_OK;
	rt->lse_link = calloc((size_t)p->nsteps, sizeof *rt->lse_link);
	if (!rt->lse_link)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	for (int32_t s = 0; s < p->nsteps; s++)
		rt->lse_link[s] = -1;
	for (int32_t s = 0; s < p->nsteps; s++) {
		if (p->steps[s].kind != KL_STEP_ATTENTION || !p->steps[s].at.bwd)
			continue;
		int32_t f = kl__attn_lse_source(p, s);
		if (f < 0)
			continue;
		if (rt->lse_link[f] < 0)
			rt->lse_link[f] = rt->nlse++;
		rt->lse_link[s] = rt->lse_link[f];
	}
	if (rt->nlse == 0)
		return KL_OK;
	rt->lse_buf = calloc((size_t)rt->nlse, sizeof *rt->lse_buf);
	rt->lse_ok = calloc((size_t)rt->nlse, sizeof *rt->lse_ok);
	if (!rt->lse_buf || !rt->lse_ok)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	return KL_OK;
}

/* the pair step s belongs to (rt->lse_link), or -1 */
static int32_t lse_pair(const kl_cuda_rt *rt, int32_t s)
{
	return rt->lse_link ? rt->lse_link[s] : -1;
}

/* The L buffer of forward attention step at (pair li), allocated at its
 * first run; 0 where there is none (no pair, or a first run inside a
 * capture, or no memory: the backward then computes L itself). */
static CUdeviceptr lse_for(kl_ctx *ctx, kl_cuda_rt *rt, int32_t s, const kl_attn_step *at)
{
	int32_t li = lse_pair(rt, s);
	if (li < 0)
		return 0;
	if (!rt->lse_buf[li] && !rt->dev->capturing) {
		size_t rows = (size_t)at->tq;
		for (int i = 0; i < at->nbatch; i++)
			rows *= (size_t)at->batch[i];
		CUdeviceptr p = 0;
		if (rows > 0 && kl__cuda_malloc(ctx, rt->dev, rows * 4, &p) == KL_OK)
			rt->lse_buf[li] = p;
		else
			kl_clear_error(ctx);
	}
	return rt->lse_buf[li];
}

static kl_status load_module(kl_ctx *ctx, kl_compiled *c, const kl_cuda_image *im)
{
	kl_cuda_rt *rt = calloc(1, sizeof *rt);
	if (!rt)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	rt->ctx = ctx;
	rt->dev = kl__cuda_dev_of(ctx);
	rt->gs0 = getenv("KILN_DISABLE_CUDAGRAPHS") && atoi(getenv("KILN_DISABLE_CUDAGRAPHS")) == 1
	                  ? KL_G_OFF
	                  : KL_G_WARMUP;
	const char *wv = getenv("KILN_CUDA_WAVES");
	rt->waves = wv && *wv && atoi(wv) >= 0 && atoi(wv) <= 64 ? atoi(wv) : -1;
	const char *pf = getenv("KILN_CUDA_PW_FLAT");
	rt->pw_flat = !(pf && strcmp(pf, "0") == 0);
	c->dev = rt;
	size_t nb = (size_t)(c->prog.nbufs > 0 ? c->prog.nbufs : 1);
	size_t ns = (size_t)(c->prog.nsteps > 0 ? c->prog.nsteps : 1);
	rt->nargs = nb + (size_t)(c->prog.nsyms > 0 ? c->prog.nsyms : 1);
	rt->args = calloc(rt->nargs, sizeof *rt->args);
	rt->gcap = calloc(ns, sizeof *rt->gcap);
	rt->algo = calloc(ns, sizeof *rt->algo);
	rt->has_algo = calloc(ns, sizeof *rt->has_algo);
	rt->dirty = calloc(ns, sizeof *rt->dirty);
	rt->mm_touch = calloc(nb, sizeof *rt->mm_touch);
	rt->sb = calloc(nb, sizeof *rt->sb);
	rt->fit = calloc((size_t)c->prog.nkernels + 1, sizeof *rt->fit);
	rt->pts = calloc(ns, sizeof *rt->pts);
	/* slot 0 now; a variant with dynamic dims may add more (pick_slot).
	 * From the program: c->dynamic is set after the module loads (it was
	 * read here unset, so every dynamic plan kept one graph and captured
	 * again at each change of size) */
	rt->maxslots = c->prog.nsyms > 0 ? kl__gslot_limit() : 1;
	rt->slots = calloc((size_t)rt->maxslots, sizeof *rt->slots);
	rt->keys = calloc((size_t)rt->maxslots * KL_GSLOT_KEY, sizeof *rt->keys);
	rt->used = calloc((size_t)rt->maxslots, sizeof *rt->used);
	bool slot0 = rt->slots && slot_init(c, &rt->slots[0], rt->gs0);
	rt->g = rt->slots;
	rt->nslots = slot0 ? 1 : 0;
	if (c->dynamic)
		memcpy(rt->keys, c->plan_syms, sizeof(int64_t) * (size_t)c->prog.nsyms);
	if (!rt->args || !rt->gcap || !rt->algo || !rt->has_algo || !rt->dirty || !rt->mm_touch ||
	    !rt->sb || !rt->fit || !rt->pts || !slot0 || !rt->keys || !rt->used)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	if (kl__cuda_args_indirect(c->prog.nbufs, c->prog.nsyms)) {
		kl_status ast = kl__cuda_malloc(ctx, rt->dev, rt->nargs * sizeof *rt->args, &rt->dargs);
		if (ast != KL_OK)
			return ast;
		/* its block is copied to the device before each range of launches,
		 * which a captured graph would not repeat */
		if (rt->g->gs != KL_G_OFF &&
		    (c->mode == KL_MODE_REDUCE_OVERHEAD || c->mode == KL_MODE_MAX_AUTOTUNE))
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "skip: %zu kernel arguments pass through device memory (more than "
			        "%d fit a kernel's parameters)",
			        rt->nargs, KL_CUDA_ARGS_MAX);
		rt->gs0 = rt->g->gs = KL_G_OFF;
	}
	int unroll = kl__cuda_dot_knobs().pw;
	for (int32_t s = 0; s < c->prog.nsteps; s++)
		rt->pts[s] = pointwise_points(&c->prog, &c->prog.steps[s], unroll);
	kl_status lst = lse_links(ctx, rt, &c->prog);
	if (lst != KL_OK)
		return lst;
	for (int32_t s = 0; s < c->prog.nsteps; s++) {
		const kl_step *sp = &c->prog.steps[s];
		if (sp->kind == KL_STEP_KERNEL)
			continue;
		/* library products and attention: their launches cannot be
		 * re-pointed; every buffer they read or write (operands, residual,
		 * bias) is listed in the step */
		for (int32_t i = 0; i < sp->nreads; i++)
			rt->mm_touch[sp->reads[i]] = true;
		for (int32_t i = 0; i < sp->nwrites; i++)
			rt->mm_touch[sp->writes[i]] = true;
		if (sp->kind == KL_STEP_MATMUL)
			rt->mm_touch[sp->mm.a] = rt->mm_touch[sp->mm.b] = rt->mm_touch[sp->mm.c] = true;
	}
	if (c->prog.nkernels == 0)
		return KL_OK;
	double t0 = kl__now_ms();
	kl_status st = kl__cuda_module_load(ctx, rt->dev, im, &rt->mod);
	if (st != KL_OK)
		return st;
	double t1 = kl__now_ms();
	rt->fns = calloc((size_t)c->prog.nkernels, sizeof *rt->fns);
	if (!rt->fns)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	rt->nfns = c->prog.nkernels;
	for (int32_t k = 0; k < c->prog.nkernels && st == KL_OK; k++)
		st = kl__cuda_module_fn(ctx, rt->mod, c->prog.kernel_names[k], &rt->fns[k]);
	kl__log(ctx, KL_LOG_STARTUP,
	        "variant %016" PRIx64 ": cuModuleLoadData (%zu-byte %s) %.3f ms, %d kernels "
	        "looked up %.3f ms",
	        c->key, im->size, im->ptx ? "PTX" : "cubin", t1 - t0, (int)c->prog.nkernels,
	        kl__now_ms() - t1);
	return st;
}

void kl__cuda_rt_prepare(kl_ctx *ctx, kl_compiled *c)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	if (!rt)
		return;
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		if (sp->kind != KL_STEP_MATMUL)
			continue;
		const kl_matmul_step *mm = &sp->mm;
		/* where the buffers will be at the first call, as far as alignment
		 * goes: pool blocks (256-byte aligned) and, for temps, their arena
		 * offset; one distinct base per buffer id */
		int32_t ids[5] = {mm->a, mm->b, mm->c, mm->has_r ? mm->r : -1,
		                  mm->has_bias ? mm->bias : -1};
		CUdeviceptr at[5];
		for (int i = 0; i < 5; i++) {
			at[i] = 0;
			if (ids[i] < 0)
				continue;
			at[i] = (CUdeviceptr)((uint64_t)(ids[i] + 1) << 32);
			if (p->bufs[ids[i]].role == KL_BUF_TEMP && c->plan.off)
				at[i] += (CUdeviceptr)c->plan.off[ids[i]];
		}
		double t0 = kl__now_ms();
		kl_status st = kl__lt_prepare_step(ctx, rt->dev, mm, p->bufs[mm->a].dtype,
		                                   p->bufs[mm->c].dtype, at[0], at[1], at[2], at[3],
		                                   at[4]);
		if (st != KL_OK) {
			/* the first call meets the same problem and reports it */
			kl__log(ctx, KL_LOG_STARTUP,
			        "variant %016" PRIx64 " step %d: cuBLASLt not prepared (%s)", c->key,
			        (int)s, kl_last_error(ctx));
			kl_clear_error(ctx);
			continue;
		}
		kl__log(ctx, KL_LOG_STARTUP,
		        "variant %016" PRIx64 " step %d (%s): cuBLASLt prepared at plan load %.3f ms",
		        c->key, (int)s, sp->what, kl__now_ms() - t0);
	}
}

kl_status kl__cuda_rt_build(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t *bin_hash,
                            uint64_t *bin_size)
{
	*bin_hash = *bin_size = 0;
	kl_cuda_image im;
	memset(&im, 0, sizeof im);
	kl_status st = KL_OK;
	if (c->prog.nkernels > 0) {
		/* no contraction: kernels round like the C target and the reference */
		kl_nvrtc_opts o = kl__nvrtc_opts_for(kl__cuda_dev_of(ctx));
		o.no_fmad = true;
		st = kl__nvrtc_compile(ctx, c->prog.source, "kiln_graph.cu", &o, &im);
		if (st != KL_OK) {
			kl__cuda_image_free(&im);
			return st;
		}
		size_t len;
		uint8_t *payload = kl__cuda_image_payload(&im, &len);
		if (!payload) {
			kl__cuda_image_free(&im);
			return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		}
		*bin_size = len;
		*bin_hash = kl__hash_bytes(KL_HASH_SEED, payload, len);
		if (dir) {
			char name[96];
			bin_name(c->key, *bin_hash, name, sizeof name);
			if (kl__cache_put(ctx, dir, name, c->key, payload, len) == KL_OK)
				kl__log(ctx, KL_LOG_CACHE, "wrote %s (%zu bytes)", name, len);
			else
				kl_clear_error(ctx);
		}
		free(payload);
	}
	st = load_module(ctx, c, &im);
	kl__cuda_image_free(&im);
	return st;
}

kl_status kl__cuda_rt_from_image(kl_ctx *ctx, kl_compiled *c, const struct kl_cuda_image *im)
{
	return load_module(ctx, c, im);
}

kl_status kl__cuda_rt_load(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t bin_hash,
                           uint64_t bin_size)
{
	kl_cuda_image im;
	memset(&im, 0, sizeof im);
	if (c->prog.nkernels == 0)
		return load_module(ctx, c, &im);
	char name[96];
	bin_name(c->key, bin_hash, name, sizeof name);
	void *payload = NULL;
	size_t len = 0;
	kl_status st = kl__cache_get(ctx, dir, name, c->key, &payload, &len);
	if (st != KL_OK)
		return st == KL_EIO ? KL_EFORMAT : st;
	if (len != bin_size || len < 2 || kl__hash_bytes(KL_HASH_SEED, payload, len) != bin_hash) {
		free(payload);
		kl__log(ctx, KL_LOG_CACHE, "entry %s corrupt: rebuilding", name);
		return KL_EFORMAT;
	}
	bool ok = kl__cuda_image_from_payload(payload, len, &im);
	free(payload);
	if (!ok)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	st = load_module(ctx, c, &im);
	kl__cuda_image_free(&im);
	return st;
}


static void free_statics(kl_cuda_rt *rt, int32_t nbufs, bool keep_staged)
{
	for (int32_t b = 0; b < nbufs; b++)
		if (rt->g->stat[b] && !(keep_staged && rt->g->how[b] == KL_GB_STAGED)) {
			kl__cuda_free(rt->ctx, rt->dev, rt->g->stat[b]);
			rt->g->stat[b] = 0;
			rt->g->stat_bytes[b] = 0;
		}
}

void kl__cuda_rt_free(kl_compiled *c)
{
	kl_cuda_rt *rt = c->dev;
	if (!rt)
		return;
	kl__cuda_sync(NULL, rt->dev);
	for (int i = 0; rt->slots && i < rt->nslots; i++)
		slot_free(rt, c->prog.nbufs, &rt->slots[i]);
	free(rt->slots);
	free(rt->keys);
	free(rt->used);
	if (rt->dargs)
		kl__cuda_free(rt->ctx, rt->dev, rt->dargs);
	kl__cuda_module_free(rt->mod);
	free(rt->fns);
	free(rt->pkg_choices);
	free(rt->args);
	free(rt->gcap);
	free(rt->pts);
	free(rt->algo);
	free(rt->has_algo);
	free(rt->dirty);
	free(rt->mm_touch);
	free(rt->sb);
	free(rt->fit);
	for (int32_t i = 0; rt->lse_buf && i < rt->nlse; i++)
		kl__cuda_free(rt->ctx, rt->dev, rt->lse_buf[i]);
	free(rt->lse_link);
	free(rt->lse_buf);
	free(rt->lse_ok);
	free(rt);
	c->dev = NULL;
}

kl_status kl__cuda_rt_arena(kl_ctx *ctx, kl_compiled *c, size_t bytes, void **base)
{
	kl_cuda_rt *rt = c->dev;
	/* the plan is at the call's sizes now: their graph's own arena */
	kl_status pst = pick_slot(ctx, c, c->plan_syms);
	if (pst != KL_OK)
		return pst;
	if (bytes > rt->g->arena_cap || !rt->g->arena) {
		CUdeviceptr p = 0;
		size_t want = bytes ? bytes : KL_ARENA_ALIGN;
		kl_status st = kl__cuda_malloc(ctx, rt->dev, want, &p);
		if (st != KL_OK)
			return st;
		if (rt->g->arena)
			kl__cuda_free(ctx, rt->dev, rt->g->arena);
		rt->g->arena = p;
		rt->g->arena_cap = want;
		/* the captured graph addressed the old arena */
		if (rt->g->gs == KL_G_READY) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "re-capture: the temps' arena grew to %zu bytes and moved (the "
			        "graph addressed the old one)",
			        want);
			kl__cuda_graph_free(&rt->g->graph);
			rt->g->gs = KL_G_CAPTURE;
		}
	}
	*base = (void *)(uintptr_t)rt->g->arena;
	return KL_OK;
}

static int64_t buf_numel(const kl_buf *bf, const int64_t *syms)
{
	int64_t n = 1;
	for (int d = 0; d < bf->ndim; d++)
		n *= kl__dim_value(&bf->shape[d], syms);
	return n;
}

/* Blocks per SM for kernel k: as many blocks of BLOCK threads as are
 * resident on an SM at once; a big launch is a few full waves of them
 * (the step's, or KILN_CUDA_WAVES), whose grid-stride loops share the work. */
static int64_t blocks_per_sm(kl_cuda_rt *rt, int32_t kernel)
{
	if (rt->fit[kernel] == 0) {
		int n = 0;
		if (kl__cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, rt->fns[kernel], BLOCK,
		                                                        0) != CUDA_SUCCESS ||
		    n < 1)
			n = 2048 / BLOCK; /* Hopper's threads per SM */
		rt->fit[kernel] = n;
	}
	return rt->fit[kernel];
}

/* Steps [s0, s1), in order, on the stream: kernels with one kl_args block
 * each, products through cuBLASLt, with the variant's launch choices. While
 * capturing, each kernel's graph node is noted for later re-pointing. */
static kl_status launch_steps(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                              int32_t s0, int32_t s1)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	size_t nb = (size_t)(p->nbufs > 0 ? p->nbufs : 1);
	for (int32_t b = 0; b < p->nbufs; b++)
		rt->args[b] = (uint64_t)(uintptr_t)B[b];
	for (int32_t k = 0; k < p->nsyms; k++)
		rt->args[nb + (size_t)k] = (uint64_t)syms[k];
	int64_t sms = rt->dev->sm_count > 0 ? rt->dev->sm_count : 1;
	kl_status st = KL_OK;
	/* a block too large for the kernel parameters: copied to the device in
	 * stream order (the kernels of an earlier range have read theirs) */
	if (rt->dargs)
		st = kl__cuda_h2d(ctx, rt->dev, rt->dargs, rt->args, rt->nargs * sizeof *rt->args);
	for (int32_t s = s0; s < s1 && st == KL_OK; s++) {
		const kl_step *sp = &p->steps[s];
		if (sp->kind == KL_STEP_MATMUL) {
			const kl_matmul_step *mm = &sp->mm;
			st = kl__lt_matmul_step(
			        ctx, rt->dev, mm, p->bufs[mm->a].dtype, p->bufs[mm->c].dtype,
			        (CUdeviceptr)(uintptr_t)B[mm->a], (CUdeviceptr)(uintptr_t)B[mm->b],
			        (CUdeviceptr)(uintptr_t)B[mm->c],
			        mm->has_r ? (CUdeviceptr)(uintptr_t)B[mm->r] : 0,
			        mm->has_bias ? (CUdeviceptr)(uintptr_t)B[mm->bias] : 0,
			        /* an algorithm tuned at one size need not serve another */
			        rt->has_algo[s] && !c->dynamic ? &rt->algo[s] : NULL);
			continue;
		}
		if (sp->kind == KL_STEP_CACHE_WRITE) {
			const kl_cw_step *cw = &sp->cw;
			st = kl__cuda_cache_write_step(ctx, rt->dev, cw, p->bufs[cw->out].dtype,
			                               p->bufs[cw->pos].dtype,
			                               (CUdeviceptr)(uintptr_t)B[cw->cache],
			                               (CUdeviceptr)(uintptr_t)B[cw->pos],
			                               (CUdeviceptr)(uintptr_t)B[cw->val] +
			                                       (CUdeviceptr)cw->val_off *
			                                               kl_dtype_size(p->bufs[cw->out].dtype),
			                               (CUdeviceptr)(uintptr_t)B[cw->out],
			                               (uint64_t)s + 1);
			continue;
		}
		if (sp->kind == KL_STEP_ATTENTION && sp->at.bwd) {
			const kl_attn_step *at = &sp->at;
			int32_t li = lse_pair(rt, s);
			st = kl__cuda_attention_bwd_step(ctx, rt->dev, at, p->bufs[at->o].dtype,
			                                 (CUdeviceptr)(uintptr_t)B[at->q],
			                                 (CUdeviceptr)(uintptr_t)B[at->k],
			                                 (CUdeviceptr)(uintptr_t)B[at->v],
			                                 (CUdeviceptr)(uintptr_t)B[at->fo],
			                                 (CUdeviceptr)(uintptr_t)B[at->go],
			                                 (CUdeviceptr)(uintptr_t)B[at->o],
			                                 li >= 0 && rt->lse_ok[li] ? rt->lse_buf[li] : 0);
			continue;
		}
		if (sp->kind == KL_STEP_ATTENTION) {
			const kl_attn_step *at = &sp->at;
			bool wrote = false;
			st = kl__cuda_attention_step(ctx, rt->dev, at, p->bufs[at->o].dtype,
			                             (CUdeviceptr)(uintptr_t)B[at->q],
			                             (CUdeviceptr)(uintptr_t)B[at->k],
			                             (CUdeviceptr)(uintptr_t)B[at->v],
			                             at->len >= 0 ? (CUdeviceptr)(uintptr_t)B[at->len]
			                                          : 0,
			                             (CUdeviceptr)(uintptr_t)B[at->o],
			                             lse_for(ctx, rt, s, at), &wrote);
			int32_t fi = lse_pair(rt, s);
			if (fi >= 0)
				rt->lse_ok[fi] = wrote && st == KL_OK;
			continue;
		}
		int64_t work = 0;
		for (int32_t w = 0; w < sp->nwrites; w++) {
			int64_t n = buf_numel(&p->bufs[sp->writes[w]], syms);
			if (n > work)
				work = n;
		}
		if (work == 0)
			continue; /* nothing stored: every iterated dim or result is empty */
		/* pointwise: a thread per rt->pts[s] points, the grid flat, every
		 * chunk its own thread (rt->pw_flat; else at most one wave, or
		 * KILN_CUDA_WAVES); row kernels: a block per sp->row_per rows (a
		 * block per point where the program does not say: an upper
		 * bound), at most the step's waves (the renderer's, one where it
		 * gives none), or KILN_CUDA_WAVES waves where set (0: no cap) */
		bool pw = rt->pts[s] > 0;
		int64_t blocks = work;
		if (pw) {
			blocks = (work + BLOCK * rt->pts[s] - 1) / (BLOCK * rt->pts[s]);
		} else if (sp->row_per > 0) {
			int64_t rows = 1;
			for (int32_t d = 0; d < sp->nrowdims; d++)
				rows *= kl__dim_value(&sp->rowdims[d], syms);
			blocks = (rows + sp->row_per - 1) / sp->row_per;
		}
		int waves = rt->waves >= 0 ? rt->waves : sp->waves > 0 ? sp->waves : 1;
		int64_t cap = sms * blocks_per_sm(rt, sp->kernel) * waves;
		if (waves > 0 && blocks > cap && !(pw && rt->pw_flat))
			blocks = cap;
		if (blocks < 1)
			blocks = 1;
		/* max-autotune's cap for this step (0: none) */
		if (rt->gcap[s] && blocks > (int64_t)rt->gcap[s])
			blocks = (int64_t)rt->gcap[s];
		if (blocks > INT32_MAX)
			blocks = INT32_MAX;
		unsigned grid[3] = {(unsigned)blocks, 1, 1}, block[3] = {BLOCK, 1, 1};
		void *argv[1] = {rt->dargs ? (void *)&rt->dargs : (void *)rt->args};
		/* the range's first kernel waits for whatever ran before it in full:
		 * a later one may read the program's inputs before its wait
		 * (kir_kernel.early), which only a kernel outside the program writes */
		st = kl__cuda_launch(ctx, rt->dev, rt->fns[sp->kernel], grid, block, 0, argv,
		                     s == s0 ? 0 : KL_LAUNCH_PDL);
		if (st == KL_OK && rt->recording)
			st = kl__cuda_capture_last_node(ctx, rt->dev, &rt->g->knode[s]);
	}
	return st;
}

kl_status kl__cuda_rt_launch(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                             int32_t s0, int32_t s1)
{
	return launch_steps(ctx, c, B, syms, s0, s1);
}

/* bytes an input's kernels can reach: from its first element to its last
 * (an input with dynamic dims is bound dense at the call's sizes) */
static size_t input_span(const kl_compiled *c, const kl_buf *bf, const int64_t *syms)
{
	int64_t n = 1, last = 0;
	for (int d = 0; d < bf->ndim; d++)
		if (bf->shape[d].sym > 0)
			return kl__buf_bytes(bf, syms);
	for (int d = 0; d < bf->ndim; d++) {
		n *= bf->shape[d].v;
		last += (bf->shape[d].v - 1) * c->in_strides[bf->index][d];
	}
	if (n == 0)
		return 0;
	return (size_t)(last + 1) * kl_dtype_size(bf->dtype);
}

static bool graph_mode(const kl_compiled *c)
{
	return c->mode == KL_MODE_REDUCE_OVERHEAD || c->mode == KL_MODE_MAX_AUTOTUNE;
}

static bool tune_mode(const kl_compiled *c)
{
	return c->mode == KL_MODE_MAX_AUTOTUNE || c->mode == KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS;
}

/* The bytes a static copy of b must hold; 0 when b cannot be staged (a
 * temp, a view of another buffer) or is empty. */
static size_t stage_bytes(const kl_compiled *c, const kl_buf *bf, const int64_t *syms)
{
	if (bf->role == KL_BUF_INPUT)
		return input_span(c, bf, syms);
	if (bf->role == KL_BUF_OUTPUT && bf->alias < 0)
		return kl__buf_bytes(bf, syms);
	return 0;
}

/* Does a cache write write input buffer b in place? Such a buffer is never
 * staged (the write must land in the program's tensor): the graph holds its
 * address, and is captured again when it moves. */
static bool written_in_place(const kl_program *p, int32_t b)
{
	for (int32_t s = 0; s < p->nsteps; s++)
		if (p->steps[s].kind == KL_STEP_CACHE_WRITE && p->steps[s].cw.out == b &&
		    p->steps[s].cw.cache == b)
			return true;
	return false;
}

static const char *buf_what(const kl_buf *bf, char *buf, size_t cap)
{
	if (bf->role == KL_BUF_TEMP)
		snprintf(buf, cap, "a temp");
	else
		snprintf(buf, cap, "%s %d%s", bf->role == KL_BUF_INPUT ? "input" : "output",
		         (int)bf->index, bf->alias >= 0 ? " (a view)" : "");
	return buf;
}

/* How the graph about to be captured reaches each buffer: buffers no library
 * call touches are addressed directly (kernel nodes get re-pointed); those a
 * product touches are staged when they moved between the warm-up and this
 * call (or moved once while pinned), else pinned. Statics are allocated
 * here, before the capture opens. */
static kl_status classify(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		rt->g->how[b] = KL_GB_DIRECT;
		if (bf->role == KL_BUF_TEMP || !rt->mm_touch[b])
			continue;
		size_t n = stage_bytes(c, bf, syms);
		bool view = bf->role == KL_BUF_OUTPUT && bf->alias >= 0;
		if (n == 0 && !view)
			continue; /* empty: no node reads its address */
		if (n > 0 && (rt->g->must_stage[b] || rt->g->warm[b] != B[b]) &&
		    !written_in_place(p, b))
			rt->g->how[b] = KL_GB_STAGED;
		else
			rt->g->how[b] = KL_GB_PINNED;
	}
	free_statics(rt, p->nbufs, true);
	for (int32_t b = 0; b < p->nbufs; b++) {
		if (rt->g->how[b] != KL_GB_STAGED)
			continue;
		size_t n = stage_bytes(c, &p->bufs[b], syms);
		if (rt->g->stat[b] && rt->g->stat_bytes[b] == n)
			continue;
		if (rt->g->stat[b])
			kl__cuda_free(ctx, rt->dev, rt->g->stat[b]);
		rt->g->stat[b] = 0;
		rt->g->stat_bytes[b] = 0;
		kl_status st = kl__cuda_malloc(ctx, rt->dev, n, &rt->g->stat[b]);
		if (st != KL_OK)
			return st;
		rt->g->stat_bytes[b] = n;
	}
	for (int32_t b = 0; b < p->nbufs; b++)
		rt->sb[b] = rt->g->how[b] == KL_GB_STAGED ? (void *)(uintptr_t)rt->g->stat[b] : B[b];
	return KL_OK;
}

/* Staged inputs' copies in (at the start) or outputs' copies out (at the
 * end), each noted as its graph node. */
static kl_status capture_copies(kl_ctx *ctx, kl_compiled *c, void *const *B, kl_buf_role role)
{
	kl_cuda_rt *rt = c->dev;
	for (int32_t b = 0; b < c->prog.nbufs; b++) {
		if (rt->g->how[b] != KL_GB_STAGED || c->prog.bufs[b].role != role)
			continue;
		CUdeviceptr real = (CUdeviceptr)(uintptr_t)B[b];
		kl_status st = role == KL_BUF_INPUT
		                       ? kl__cuda_d2d(ctx, rt->dev, rt->g->stat[b], real,
		                                      rt->g->stat_bytes[b])
		                       : kl__cuda_d2d(ctx, rt->dev, real, rt->g->stat[b],
		                                      rt->g->stat_bytes[b]);
		if (st == KL_OK)
			st = kl__cuda_capture_last_node(ctx, rt->dev, &rt->g->copy_node[b]);
		if (st != KL_OK)
			return st;
	}
	return KL_OK;
}

/* After the capture: what each noted node was made with. */
static kl_status read_nodes(kl_ctx *ctx, kl_compiled *c)
{
	kl_cuda_rt *rt = c->dev;
	for (int32_t s = 0; s < c->prog.nsteps; s++) {
		if (!rt->g->knode[s])
			continue;
		CUDA_KERNEL_NODE_PARAMS *kp = &rt->g->kparams[s];
		memset(kp, 0, sizeof *kp);
		KL_CU_TRY(ctx, cuGraphKernelNodeGetParams, rt->g->knode[s], kp);
		kp->kernelParams = NULL; /* the driver's copy: ours are given per update */
		kp->extra = NULL;
	}
	for (int32_t b = 0; b < c->prog.nbufs; b++)
		if (rt->g->how[b] == KL_GB_STAGED) {
			kl_status st = kl__cuda_graph_copy_params(ctx, rt->g->copy_node[b],
			                                          &rt->g->copy_params[b]);
			if (st != KL_OK)
				return st;
		}
	return KL_OK;
}

static void log_capture(kl_ctx *ctx, kl_compiled *c)
{
	kl_cuda_rt *rt = c->dev;
	if (!(ctx->logs & KL_LOG_CUDAGRAPHS))
		return;
	char list[1024] = "";
	size_t used = 0;
	int nk = 0, nm = 0, ncp = 0;
	for (int32_t s = 0; s < c->prog.nsteps; s++) {
		nk += rt->g->knode[s] != NULL;
		nm += c->prog.steps[s].kind == KL_STEP_MATMUL;
	}
	for (int32_t b = 0; b < c->prog.nbufs && used < sizeof list; b++) {
		if (rt->g->how[b] == KL_GB_DIRECT)
			continue;
		char what[64];
		buf_what(&c->prog.bufs[b], what, sizeof what);
		ncp += rt->g->how[b] == KL_GB_STAGED;
		used += (size_t)snprintf(
		        list + used, sizeof list - used, "; %s %s", what,
		        rt->g->how[b] == KL_GB_PINNED
		                ? "pinned (a matmul holds its address, which did not move)"
		        : rt->g->must_stage[b]
		                ? "staged through a static copy (it moved while pinned)"
		                : "staged through a static copy (a matmul touches it and its "
		                  "address changed between warm-up and capture)");
	}
	size_t nodes = 0;
	kl__cu.cuGraphGetNodes(rt->g->graph.graph, NULL, &nodes);
	kl__log(ctx, KL_LOG_CUDAGRAPHS,
	        "captured %d steps into one graph (capture #%llu of this variant, %.3f ms of "
	        "capture so far): %zu nodes, %d kernels, %d library calls, %d copies%s",
	        (int)c->prog.nsteps, (unsigned long long)rt->captures, rt->capture_ms, nodes, nk,
	        nm, ncp, list);
}

static kl_status capture(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                         const kl_run_tail *tail)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	double t0 = kl__now_ms();
	kl_status st = classify(ctx, c, B, syms);
	if (st != KL_OK)
		return st;
	memset(rt->g->knode, 0, sizeof *rt->g->knode * (size_t)(p->nsteps > 0 ? p->nsteps : 1));
	memset(rt->g->copy_node, 0, sizeof *rt->g->copy_node * (size_t)(p->nbufs > 0 ? p->nbufs : 1));
	st = kl__cuda_capture_begin(ctx, rt->dev);
	if (st != KL_OK)
		return st;
	rt->recording = true;
	kl_status rs = capture_copies(ctx, c, B, KL_BUF_INPUT);
	if (rs == KL_OK)
		rs = launch_steps(ctx, c, rt->sb, syms, 0, p->nsteps);
	if (rs == KL_OK)
		rs = capture_copies(ctx, c, B, KL_BUF_OUTPUT);
	rt->recording = false;
	/* the tail after the outputs' copies out: it reads the call's outputs */
	int tl = 0;
	if (rs == KL_OK && tail)
		rs = tail->launch(ctx, tail->user, &tl);
	char why[KL_ERR_CAP] = "";
	if (rs != KL_OK)
		snprintf(why, sizeof why, "%s", kl_last_error(ctx));
	st = kl__cuda_capture_end(ctx, rt->dev, &rt->g->graph);
	if (rs != KL_OK)
		st = kl__err(ctx, rs, "%s", why);
	if (st == KL_OK)
		st = read_nodes(ctx, c);
	if (st != KL_OK) {
		kl__cuda_graph_free(&rt->g->graph);
		return st;
	}
	for (int32_t b = 0; b < p->nbufs; b++)
		rt->g->bound[b] = B[b];
	rt->g->tail_id = tail ? tail->id : NULL;
	rt->captures++;
	rt->capture_ms += kl__now_ms() - t0;
	atomic_fetch_add(&n_captures, 1);
	log_capture(ctx, c);
	return KL_OK;
}

long kl__cuda_rt_replays(const kl_compiled *c)
{
	const kl_cuda_rt *rt = c->cuda ? c->dev : NULL;
	return rt ? (long)rt->replays : 0;
}

long kl__cuda_rt_captures(const kl_compiled *c, double *ms)
{
	const kl_cuda_rt *rt = c->cuda ? c->dev : NULL;
	*ms = rt ? rt->capture_ms : 0;
	return rt ? (long)rt->captures : 0;
}

static bool step_uses(const kl_step *sp, int32_t b)
{
	for (int32_t i = 0; i < sp->nreads; i++)
		if (sp->reads[i] == b)
			return true;
	for (int32_t i = 0; i < sp->nwrites; i++)
		if (sp->writes[i] == b)
			return true;
	return false;
}

typedef enum replay_verdict { R_READY, R_RECAPTURE, R_OFF } replay_verdict;

/* Bring the instantiated graph to this call's buffers: re-point the copy
 * node of each staged buffer that moved and every kernel node whose step
 * uses a moved buffer. A pinned buffer that moved asks for a re-capture
 * with that buffer staged (once per buffer); one that cannot be staged
 * turns the graph off. */
static kl_status repoint(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                         replay_verdict *v, int *nk, int *ncp)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	*v = R_READY;
	*nk = *ncp = 0;
	for (int32_t b = 0; b < p->nbufs; b++) {
		if (p->bufs[b].role == KL_BUF_TEMP || B[b] == rt->g->bound[b] ||
		    rt->g->how[b] != KL_GB_PINNED)
			continue;
		char what[64];
		buf_what(&p->bufs[b], what, sizeof what);
		if (written_in_place(p, b)) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "re-capture: %s moved (%p -> %p) and a cache write writes it in place",
			        what, rt->g->bound[b], B[b]);
			*v = R_RECAPTURE;
			continue;
		}
		if (stage_bytes(c, &p->bufs[b], syms) == 0) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "skip: %s moved (%p -> %p) and a matmul step holds its address; it "
			        "cannot be staged: plain launches from now on",
			        what, rt->g->bound[b], B[b]);
			*v = R_OFF;
			return KL_OK;
		}
		kl__log(ctx, KL_LOG_CUDAGRAPHS,
		        "re-capture: %s moved (%p -> %p) and a matmul step holds its address: it "
		        "goes through a static copy from now on",
		        what, rt->g->bound[b], B[b]);
		rt->g->must_stage[b] = true;
		*v = R_RECAPTURE;
	}
	if (*v != R_READY)
		return KL_OK;
	memset(rt->dirty, 0, sizeof *rt->dirty * (size_t)(p->nsteps > 0 ? p->nsteps : 1));
	bool any = false;
	for (int32_t b = 0; b < p->nbufs; b++) {
		if (p->bufs[b].role == KL_BUF_TEMP || B[b] == rt->g->bound[b])
			continue;
		if (rt->g->how[b] == KL_GB_STAGED) {
			CUdeviceptr real = (CUdeviceptr)(uintptr_t)B[b];
			bool in = p->bufs[b].role == KL_BUF_INPUT;
			kl_status st = kl__cuda_graph_set_copy(
			        ctx, rt->dev, &rt->g->graph, rt->g->copy_node[b], &rt->g->copy_params[b],
			        in ? rt->g->stat[b] : real, in ? real : rt->g->stat[b]);
			if (st != KL_OK)
				return st;
			(*ncp)++;
		} else {
			any = true;
			for (int32_t s = 0; s < p->nsteps; s++)
				if (rt->g->knode[s] && step_uses(&p->steps[s], b))
					rt->dirty[s] = true;
		}
	}
	if (any) {
		size_t nb = (size_t)(p->nbufs > 0 ? p->nbufs : 1);
		for (int32_t b = 0; b < p->nbufs; b++)
			rt->args[b] = (uint64_t)(uintptr_t)(rt->g->how[b] == KL_GB_STAGED
			                                            ? (void *)(uintptr_t)rt->g->stat[b]
			                                            : B[b]);
		for (int32_t k = 0; k < p->nsyms; k++)
			rt->args[nb + (size_t)k] = (uint64_t)syms[k];
		void *argv[1] = {rt->args};
		for (int32_t s = 0; s < p->nsteps; s++) {
			if (!rt->dirty[s])
				continue;
			CUDA_KERNEL_NODE_PARAMS kp = rt->g->kparams[s];
			kp.kernelParams = argv;
			kl_status st = kl__cuda_graph_set_kernel(ctx, &rt->g->graph, rt->g->knode[s], &kp);
			if (st != KL_OK)
				return st;
			(*nk)++;
		}
	}
	for (int32_t b = 0; b < p->nbufs; b++)
		if (p->bufs[b].role != KL_BUF_TEMP)
			rt->g->bound[b] = B[b];
	return KL_OK;
}

/* The steps as plain launches, then the tail's. */
static kl_status plain(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                       const kl_run_tail *tail, int *tl)
{
	kl_status st = launch_steps(ctx, c, B, syms, 0, c->prog.nsteps);
	return st == KL_OK && tail ? tail->launch(ctx, tail->user, tl) : st;
}

static kl_status graph_off(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                           const kl_run_tail *tail, int *tl)
{
	kl_cuda_rt *rt = c->dev;
	kl__cuda_graph_free(&rt->g->graph);
	rt->g->gs = KL_G_OFF;
	return plain(ctx, c, B, syms, tail, tl);
}

static void log_replay(kl_ctx *ctx, kl_compiled *c, int nk, int ncp)
{
	kl_cuda_rt *rt = c->dev;
	uint64_t r = rt->replays;
	/* the first few, then at powers of two: a steady state does not flood */
	if (!(ctx->logs & KL_LOG_CUDAGRAPHS) || (r > 8 && (r & (r - 1)) != 0))
		return;
	kl__log(ctx, KL_LOG_CUDAGRAPHS,
	        "replay #%llu: 1 graph launch for %d steps, %d kernel nodes and %d copies "
	        "re-pointed",
	        (unsigned long long)r, (int)c->prog.nsteps, nk, ncp);
}

static kl_status run_graph_or_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                    const int64_t *syms, const kl_run_tail *tail, int *tl);

/* The value checks on the stream, tagged (1 << 32) + k so the error word
 * tells them from the cache writes (tag: step index + 1). */
static kl_status launch_checks(kl_ctx *ctx, kl_cuda_dev *d, kl_tensor *const *in,
                               const kl_value_check *chk, int nchk)
{
	kl_status st = KL_OK;
	for (int k = 0; k < nchk && st == KL_OK; k++) {
		const kl_tensor *t = in[chk[k].in];
		st = kl__cuda_value_check(ctx, d, (CUdeviceptr)(uintptr_t)kl__tensor_data(t),
		                          t->dtype, t->shape[0], t->strides[0], chk[k].hi,
		                          (1ull << 32) + (uint64_t)k);
	}
	return st;
}

/* After a call whose stream ran value checks or cache writes: the error
 * word (one wait for the stream), as the error of the launch that set it. */
static kl_status read_checks(kl_ctx *ctx, kl_compiled *c, const kl_value_check *chk, int nchk)
{
	kl_cuda_rt *rt = c->dev;
	uint64_t e[3];
	kl_status st = kl__cuda_err_word(ctx, rt->dev, e);
	if (st != KL_OK || e[0] == 0)
		return st;
	if (e[2] >> 32 == 1 && (e[2] & 0xffffffffu) < (uint64_t)nchk) {
		const kl_value_check *k = &chk[e[2] & 0xffffffffu];
		return kl__err_value(ctx, k->op, k->what, (int64_t)(e[0] - 1), (int64_t)e[1], k->hi,
		                     k->dim);
	}
	return kl__cuda_cache_write_err(ctx, e, c->prog.steps, c->prog.nsteps);
}

kl_status kl__cuda_rt_run(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                          const kl_run_tail *tail, int *tail_launches,
                          kl_tensor *const *inputs, const kl_value_check *chk, int nchk)
{
	int tl_scratch = 0;
	if (!tail_launches)
		tail_launches = &tl_scratch;
	kl_cuda_rt *rt = c->dev;
	const int32_t ns = c->prog.nsteps;
	kl_status st = kl__cuda_bind(ctx, rt->dev);
	if (st == KL_OK)
		st = pick_slot(ctx, c, syms);
	if (st != KL_OK)
		return st;
	if ((tune_mode(c) || rt->pkg_choices) && !rt->tuned) {
		rt->tuned = true;
		st = kl__cuda_tune(ctx, c, B, syms);
		if (st != KL_OK) {
			kl__log(ctx, KL_LOG_AUTOTUNE, "failed: %s; the default launch choices stay",
			        kl_last_error(ctx));
			kl_clear_error(ctx);
			memset(rt->gcap, 0, sizeof *rt->gcap * (size_t)(ns > 0 ? ns : 1));
			memset(rt->has_algo, 0, sizeof *rt->has_algo * (size_t)(ns > 0 ? ns : 1));
		}
	}
	/* the value checks go first on the stream: a bad value stops the
	 * call's cache writes (the attention kernels clamp lengths to the keys,
	 * so nothing reads out of bounds meanwhile) */
	st = launch_checks(ctx, rt->dev, inputs, chk, nchk);
	bool armed = nchk > 0;
	if (st == KL_OK)
		st = run_graph_or_steps(ctx, c, B, syms, tail, tail_launches);
	/* both report when the call ends: one wait for the device a call */
	for (int32_t s = 0; !armed && s < ns; s++)
		armed = c->prog.steps[s].kind == KL_STEP_CACHE_WRITE;
	if (armed && st == KL_OK)
		return read_checks(ctx, c, chk, nchk);
	if (armed) {
		/* the call failed already: its error stands, the word is cleared */
		uint64_t e[3];
		(void)kl__cuda_err_word(ctx, rt->dev, e);
	}
	return st;
}

static kl_status run_graph_or_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                    const int64_t *syms, const kl_run_tail *tail, int *tl)
{
	kl_cuda_rt *rt = c->dev;
	const int32_t ns = c->prog.nsteps;
	kl_status st = KL_OK;
	/* dynamic dims: rt->g is the graph of these sizes (pick_slot) */
	if (!graph_mode(c) || rt->g->gs == KL_G_OFF)
		return plain(ctx, c, B, syms, tail, tl);
	if (rt->g->gs == KL_G_WARMUP) {
		/* warm the allocator and cuBLASLt's workspace: nothing may be
		 * allocated while capturing */
		st = plain(ctx, c, B, syms, tail, tl);
		if (st == KL_OK) {
			rt->g->gs = KL_G_CAPTURE;
			memcpy(rt->g->warm, B, sizeof *B * (size_t)c->prog.nbufs);
		}
		kl__log(ctx, KL_LOG_CUDAGRAPHS, "warm-up run (%d steps) before capture", (int)ns);
		return st;
	}
	int nk = 0, ncp = 0;
	if (rt->g->gs == KL_G_READY && (tail ? tail->id : NULL) != rt->g->tail_id) {
		kl__log(ctx, KL_LOG_CUDAGRAPHS, "re-capture: the work after the steps changed (%s)",
		        tail ? "a fused optimizer step or another tail" : "none now");
		rt->g->gs = KL_G_CAPTURE;
	}
	if (rt->g->gs == KL_G_READY) {
		replay_verdict v = R_READY;
		st = repoint(ctx, c, B, syms, &v, &nk, &ncp);
		if (st != KL_OK) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS,
			        "skip: re-pointing the graph's nodes failed: %s; plain launches from "
			        "now on",
			        kl_last_error(ctx));
			kl_clear_error(ctx);
			return graph_off(ctx, c, B, syms, tail, tl);
		}
		if (v == R_OFF)
			return graph_off(ctx, c, B, syms, tail, tl);
		if (v == R_RECAPTURE)
			rt->g->gs = KL_G_CAPTURE;
	}
	if (rt->g->gs == KL_G_CAPTURE) {
		st = capture(ctx, c, B, syms, tail);
		if (st != KL_OK) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS, "skip: capture failed: %s",
			        kl_last_error(ctx));
			kl_clear_error(ctx);
			return graph_off(ctx, c, B, syms, tail, tl);
		}
		rt->g->gs = KL_G_READY;
	}
	st = kl__cuda_graph_launch(ctx, rt->dev, &rt->g->graph);
	if (st != KL_OK)
		return st;
	rt->replays++;
	rt->kernel_updates += (uint64_t)nk;
	rt->copy_updates += (uint64_t)ncp;
	atomic_fetch_add(&n_replays, 1);
	atomic_fetch_add(&n_kupdates, nk);
	atomic_fetch_add(&n_cupdates, ncp);
	log_replay(ctx, c, nk, ncp);
	return KL_OK;
}

bool kl__cuda_rt_replaying(const kl_compiled *c)
{
	const kl_cuda_rt *rt = c->dev;
	return rt && rt->g->gs == KL_G_READY;
}
