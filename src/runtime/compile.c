/* compile.c - graph -> compiled variant: key the graph, then either load its
 * plan and shared object from the disk cache (no lowering, no codegen, no
 * compiler) or lower it, JIT-build it and store both; finally plan memory.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "kiln_source_digest.h" /* generated: cmake/source_digest.cmake */
#include "backend/cpu/cpu.h" /* kl__mm_pack_free */
#include "core/le.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"

/* Bump when the meaning of a cached plan changes without its bytes changing.
 * A change to what lowering makes of a graph needs no bump: the digest of
 * the sources (KILN_SOURCE_DIGEST) is part of every key, so a rebuilt
 * library never serves an older build's plans. 2: softmax by a row
 * reciprocal, skinny CUDA products, register-row prefetch; 3: kernel splits,
 * merged products; 4: library steps over symbolic dims (this file is not in
 * the digest, and an entry keyed symbolically must hold a symbolic plan). */
#define RT_PLAN_VERSION 4u

static atomic_long n_lowerings, n_cache_hits;

long kl__rt_lowerings(void)
{
	return atomic_load(&n_lowerings);
}

long kl__rt_cache_hits(void)
{
	return atomic_load(&n_cache_hits);
}

static bool any_dynamic(const kl_graph *g, const uint32_t *masks)
{
	if (!masks)
		return false;
	for (int32_t i = 0; i < g->ninputs; i++)
		if (masks[i])
			return true;
	return false;
}

/* What compiling g dynamically keeps symbolic: per node dim its symbol
 * (sym; NULL when nothing stays dynamic), the masks lowering gets (the
 * caller's, less the dims that must be static) and those dims with why. */
typedef struct symres {
	int32_t *sym;
	uint32_t *masks;
	kl_spec spec[KL_MAX_SPEC];
	int nspec;
} symres;

static void symres_free(symres *r)
{
	free(r->sym);
	free(r->masks);
	r->sym = NULL;
	r->masks = NULL;
}

static kl_status symbolize(kl_ctx *ctx, const kl_graph *g, const uint32_t *masks, symres *r)
{
	memset(r, 0, sizeof *r);
	if (!any_dynamic(g, masks))
		return KL_OK;
	/* room for every input dim: symbolize may name each one */
	size_t nsrc = (size_t)g->ninputs * KL_MAX_DIMS + 1;
	int32_t *s = calloc((size_t)(g->n ? g->n : 1) * KL_MAX_DIMS, sizeof *s);
	int32_t *si = calloc(nsrc, sizeof *si), *sd = calloc(nsrc, sizeof *sd);
	r->masks = calloc((size_t)(g->ninputs ? g->ninputs : 1), sizeof *r->masks);
	if (!s || !si || !sd || !r->masks) {
		free(s);
		free(si);
		free(sd);
		symres_free(r);
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	}
	char err[256] = "";
	int n = -1;
	kl_status st = kl__graph_specialize(g, masks, r->masks, r->spec, KL_MAX_SPEC, &r->nspec,
	                                    err, sizeof err);
	for (int i = 0; i < r->nspec; i++)
		kl__log(ctx, KL_LOG_RECOMPILES, "graph input %d dim %d specialised to %" PRId64 ": %s",
		        (int)r->spec[i].input, (int)r->spec[i].dim, r->spec[i].value, r->spec[i].why);
	if (st == KL_ENOMEM) {
		free(s);
		free(si);
		free(sd);
		symres_free(r);
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	}
	if (st == KL_OK)
		n = kl__graph_symbolize(g, r->masks, s, si, sd, err, sizeof err);
	free(si);
	free(sd);
	if (n > KL_MAX_DIMS * 4) {
		snprintf(err, sizeof err, "%d symbols, a program holds %d", n, KL_MAX_DIMS * 4);
		n = -1;
	}
	if (n <= 0) {
		/* nothing the compiler can keep symbolic: compile this graph for the
		 * traced sizes (its guards then cover the dims) */
		if (n < 0)
			kl__log(ctx, KL_LOG_RECOMPILES, "dynamic dims kept static: %s", err);
		free(s);
		free(r->masks);
		r->masks = NULL;
		return KL_OK;
	}
	r->sym = s;
	return KL_OK;
}

/* The graph with every symbolic dim replaced by -(symbol) and the strides of
 * inputs that have symbolic dims dropped (such inputs are bound dense), so
 * that one key covers every size of a dynamic dim. */
static bool symbolic_hash(const kl_graph *g, const int32_t *sym, uint64_t *h)
{
	if (!sym) {
		*h = kl__graph_hash(g);
		return true;
	}
	kl_graph c;
	if (kl__graph_copy(&c, g) != 0)
		return false;
	for (int32_t i = 0; i < c.n; i++) {
		kl_node *n = &c.nodes[i];
		bool dyn = false;
		for (int d = 0; d < n->ndim; d++)
			if (sym[i * KL_MAX_DIMS + d] > 0) {
				n->shape[d] = -(int64_t)sym[i * KL_MAX_DIMS + d];
				dyn = true;
			}
		if (dyn && n->op == KL_OP_INPUT)
			memset(n->strides, 0, sizeof n->strides);
	}
	*h = kl__graph_hash(&c);
	kl__graph_free(&c);
	return true;
}

static uint64_t hash_str(uint64_t h, const char *s)
{
	return kl__hash_bytes(h, s ? s : "", s ? strlen(s) + 1 : 1);
}

static kl_status key_of(kl_ctx *ctx, const kl_graph *g, const kl_compile_cfg *cfg,
                        const int32_t *sym, uint64_t *key)
{
	uint64_t h = hash_str(KL_HASH_SEED, "kiln plan");
	h = hash_str(h, KL_VERSION_STRING);
	uint64_t digest = KILN_SOURCE_DIGEST; /* the code that made the plan */
	h = kl__hash_bytes(h, &digest, sizeof digest);
	uint32_t head[4] = {RT_PLAN_VERSION, (uint32_t)ctx->device, cfg->fusion ? 1u : 0u,
	                    /* the CPU runs every mode alike: they share entries */
	                    ctx->device == KL_CPU ? 0u : (uint32_t)cfg->mode};
	h = kl__hash_bytes(h, head, sizeof head);
	uint64_t cc = ctx->device == KL_CPU ? kl__jit_cc_identity() : kl__cuda_rt_identity(ctx);
	h = kl__hash_bytes(h, &cc, sizeof cc);
	uint64_t gh;
	if (!symbolic_hash(g, sym, &gh))
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	h = kl__hash_bytes(h, &gh, sizeof gh);
	if (cfg->given) {
		uint8_t *bytes = NULL;
		size_t len = 0;
		if (kl__program_serialize(cfg->given, &bytes, &len) != KL_OK)
			return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		h = kl__hash_bytes(h, bytes, len);
		free(bytes);
		h = hash_str(h, cfg->given->source);
	}
	*key = h;
	return KL_OK;
}

bool kl__compiled_serves(kl_ctx *ctx, const kl_compiled *c, uint64_t key, const kl_graph *g,
                         const kl_compile_cfg *cfg)
{
	if (!c->src_sym || g->n != c->g.n || g->ninputs != c->g.ninputs)
		return false;
	uint64_t k;
	return key_of(ctx, g, cfg, c->src_sym, &k) == KL_OK && k == key;
}

kl_status kl__compile_key(kl_ctx *ctx, const kl_graph *g, const kl_compile_cfg *cfg, uint64_t *key)
{
	symres r;
	kl_status st = symbolize(ctx, g, cfg->dyn_masks, &r);
	if (st == KL_OK)
		st = key_of(ctx, g, cfg, r.sym, key);
	symres_free(&r);
	return st;
}

void kl__compiled_free(kl_compiled *c)
{
	if (!c)
		return;
	free(c->src_sym);
	if (c->dev) {
		kl__cuda_rt_free(c);
		c->arena = NULL; /* the device arena went with it */
	}
	/* the packed weights, a slot per step: before the program (its step
	 * count) goes */
	for (int32_t s = 0; c->mm_pack && s < c->prog.nsteps; s++)
		kl__mm_pack_free(&c->mm_pack[s]);
	free(c->mm_pack);
	kl__jit_unload(c->dl);
	free(c->fns);
	free(c->bin);
	kl__program_free(&c->prog);
	kl__graph_free(&c->g);
	free(c->in_strides);
	free(c->in_dynamic);
	kl__memplan_free(&c->plan);
	free(c->arena);
	free(c->scratch);
	free(c);
}

/* ---- the cache entries: plan-<key>.klc and so-<key>-<digest>.so ------------ */

static void entry_names(uint64_t key, uint64_t so_hash, char *plan, char *so, size_t cap)
{
	snprintf(plan, cap, "plan-%016" PRIx64 ".klc", key);
	snprintf(so, cap, "so-%016" PRIx64 "-%016" PRIx64 ".so", key, so_hash);
}

static kl_status load_kernels(kl_ctx *ctx, kl_compiled *c, const char *so_path)
{
	if (c->prog.nkernels == 0)
		return KL_OK;
	c->fns = calloc((size_t)c->prog.nkernels, sizeof *c->fns);
	if (!c->fns)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	return kl__jit_load(ctx, so_path, c->prog.kernel_names, c->prog.nkernels, &c->dl, c->fns);
}

/* The plan a CPU binary is built for, as a digest of its serialized bytes:
 * the generated source ends with kl_plan_digest() returning it, so that a
 * plan read back can be bound to the binary it is loaded with. */
static bool plan_digest(const kl_program *p, uint64_t *d)
{
	uint8_t *bytes = NULL;
	size_t len = 0;
	if (kl__program_serialize(p, &bytes, &len) != KL_OK)
		return false;
	*d = kl__hash_bytes(KL_HASH_SEED, bytes, len);
	free(bytes);
	return true;
}

static bool plan_matches_binary(const kl_compiled *c)
{
	uint64_t want, have;
	return plan_digest(&c->prog, &want) && kl__jit_plan_digest(c->dl, &have) && have == want;
}

/* KL_OK when the plan and its binary came from the cache and are loaded. */
static kl_status load_cached(kl_ctx *ctx, kl_compiled *c, const char *dir)
{
	char plan[96], so[96], path[PATH_MAX];
	entry_names(c->key, 0, plan, so, sizeof plan);
	void *payload;
	size_t len;
	kl_status st = kl__cache_get(ctx, dir, plan, c->key, &payload, &len);
	if (st == KL_EIO)
		kl__log(ctx, KL_LOG_CACHE, "miss %s", plan);
	if (st != KL_OK)
		return st;
	char err[256] = "";
	uint64_t so_hash = 0, so_size = 0;
	if (len < 16)
		st = KL_EFORMAT;
	else {
		so_hash = kl__le_get64(payload);
		so_size = kl__le_get64((uint8_t *)payload + 8);
		st = kl__program_deserialize((uint8_t *)payload + 16, len - 16, &c->prog, err,
		                             sizeof err);
	}
	free(payload);
	bool parsed = st == KL_OK;
	/* before its binary is loaded or anything is allocated by its sizes */
	if (parsed)
		st = kl__plan_check(&c->prog, &c->g, err, sizeof err);
	if (st != KL_OK) {
		kl__log(ctx, KL_LOG_CACHE, "entry %s %s (%s): rebuilding", plan,
		        parsed ? "rejected, not a plan of this graph" : "corrupt",
		        err[0] ? err : "short payload");
		kl__program_free(&c->prog);
		memset(&c->prog, 0, sizeof c->prog);
		return KL_EFORMAT;
	}
	if (c->cuda) {
		st = kl__cuda_rt_load(ctx, c, dir, so_hash, so_size);
		if (st != KL_OK) {
			kl_clear_error(ctx);
			kl__cuda_rt_free(c);
			kl__program_free(&c->prog);
			memset(&c->prog, 0, sizeof c->prog);
			return KL_EFORMAT;
		}
	} else if (c->prog.nkernels > 0) {
		entry_names(c->key, so_hash, plan, so, sizeof so);
		uint64_t h, n;
		const char *why = NULL;
		if (snprintf(path, sizeof path, "%s/%s", dir, so) >= (int)sizeof path ||
		    kl__file_digest(path, &h, &n) != KL_OK)
			why = "missing or not a regular file";
		else if (n != so_size)
			why = "size mismatch";
		else if (h != so_hash)
			why = "checksum mismatch";
		if (why) {
			kl__log(ctx, KL_LOG_CACHE, "entry %s corrupt (%s): rebuilding", so, why);
			st = KL_EFORMAT;
		} else if (c->keep_bin && kl__file_read(path, &c->bin, &c->bin_len) != KL_OK) {
			why = "unreadable";
			st = KL_EFORMAT;
		} else if ((st = load_kernels(ctx, c, path)) != KL_OK) {
			kl__log(ctx, KL_LOG_CACHE, "entry %s unusable (%s): rebuilding", so,
			        kl_last_error(ctx));
			kl_clear_error(ctx);
		} else if (!plan_matches_binary(c)) {
			/* a plan edited (checksums and all) beside its binary: the
			 * kernels would index buffers as the plan they were built
			 * with sized them */
			kl__log(ctx, KL_LOG_CACHE,
			        "entry %s rejected (its binary was built for another plan): "
			        "rebuilding",
			        plan);
			kl__jit_unload(c->dl);
			c->dl = NULL;
			st = KL_EFORMAT;
		}
		if (st != KL_OK) {
			free(c->fns);
			c->fns = NULL;
			free(c->bin);
			c->bin = NULL;
			c->bin_len = 0;
			kl__program_free(&c->prog);
			memset(&c->prog, 0, sizeof c->prog);
			return st;
		}
	}
	kl__log(ctx, KL_LOG_CACHE, "hit %s (%d steps, %d kernels)", plan, (int)c->prog.nsteps,
	        (int)c->prog.nkernels);
	return KL_OK;
}

/* A program we own, validated: the given one (copied) or a fresh lowering. */
static kl_status make_program(kl_ctx *ctx, kl_compiled *c, const kl_graph *g,
                              const kl_compile_cfg *cfg, const uint32_t *masks)
{
	char err[512] = "";
	kl_status st;
	if (cfg->given) {
		uint8_t *bytes = NULL;
		size_t len = 0;
		st = kl__program_serialize(cfg->given, &bytes, &len);
		if (st == KL_OK)
			st = kl__program_deserialize(bytes, len, &c->prog, err, sizeof err);
		free(bytes);
		if (st == KL_OK && cfg->given->source &&
		    !(c->prog.source = strdup(cfg->given->source)))
			st = KL_ENOMEM;
		if (st == KL_OK && cfg->given->fusion_log && !c->prog.fusion_log &&
		    !(c->prog.fusion_log = strdup(cfg->given->fusion_log)))
			st = KL_ENOMEM;
	} else {
		kl_lower_opts lo = {.target = ctx->device == KL_CUDA || cfg->lower_for_cuda
		                              ? KL_TARGET_CUDA
		                              : KL_TARGET_C,
		                    .fusion = cfg->fusion,
		                    .dyn_masks = masks,
		                    .log_ctx = ctx};
		atomic_fetch_add(&n_lowerings, 1);
		st = kl__lower(g, &lo, &c->prog, err, sizeof err);
		if (st != KL_OK)
			return kl__err(ctx, st, "kl_compile: lowering failed: %s", err);
	}
	if (st == KL_OK)
		st = kl__program_validate(&c->prog, c->nin, c->nout, err, sizeof err);
	if (st != KL_OK)
		return kl__err(ctx, st, "kl_compile: invalid program: %s", err);
	if (c->prog.nkernels > 0 && !c->prog.source)
		return kl__err(ctx, KL_EINVAL, "kl_compile: program has %d kernels but no source",
		               (int)c->prog.nkernels);
	const char *name = cfg->name ? cfg->name : "graph";
	kl__log(ctx, KL_LOG_FUSION, "%s graph %d: %d nodes -> %d steps (%d generated kernels)%s",
	        name, cfg->graph_index, (int)g->n, (int)c->prog.nsteps, (int)c->prog.nkernels,
	        cfg->fusion ? "" : ", fusion off");
	/* the fusion decisions themselves were logged by lowering (log_ctx) */
	if (c->prog.source && (ctx->logs & KL_LOG_OUTPUT_CODE)) {
		kl__log(ctx, KL_LOG_OUTPUT_CODE, "%s graph %d, key %016" PRIx64 ":", name,
		        cfg->graph_index, c->key);
		fputs(c->prog.source, stderr);
		fflush(stderr);
	}
	return KL_OK;
}

/* JIT-build the program's source in a private temp dir; store binary and
 * plan when dir is set and can take them (else the variant runs uncached). */
static kl_status build(kl_ctx *ctx, kl_compiled *c, const char *dir)
{
	char work[PATH_MAX], so_tmp[PATH_MAX], plan[96], so[96], final[PATH_MAX];
	uint64_t so_hash = 0, so_size = 0;
	kl_status st = KL_OK;
	if (c->cuda) {
		st = kl__cuda_rt_build(ctx, c, dir, &so_hash, &so_size);
		if (st != KL_OK)
			return st;
	} else if (c->prog.nkernels > 0) {
		st = kl__cache_workdir(ctx, dir, work, sizeof work);
		if (st != KL_OK)
			return st;
		uint64_t pd = 0;
		size_t cap = strlen(c->prog.source) + 160;
		char *src = malloc(cap);
		if (!src || !plan_digest(&c->prog, &pd))
			st = kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		else {
			snprintf(src, cap,
			         "%s\nunsigned long long kl_plan_digest(void);\n"
			         "unsigned long long kl_plan_digest(void)\n{\n"
			         "\treturn 0x%016" PRIx64 "ULL;\n}\n",
			         c->prog.source, pd);
			st = kl__jit_cc_build(ctx, src, work, so_tmp, sizeof so_tmp);
		}
		free(src);
		if (st == KL_OK && kl__file_digest(so_tmp, &so_hash, &so_size) != KL_OK)
			st = kl__err(ctx, KL_EIO, "kl_compile: cannot read back %s", so_tmp);
		if (st == KL_OK && c->keep_bin && kl__file_read(so_tmp, &c->bin, &c->bin_len) != KL_OK)
			st = kl__err(ctx, KL_EIO, "kl_compile: cannot read back %s", so_tmp);
		const char *load_from = so_tmp;
		if (st == KL_OK && dir) {
			entry_names(c->key, so_hash, plan, so, sizeof so);
			if (snprintf(final, sizeof final, "%s/%s", dir, so) < (int)sizeof final &&
			    kl__cache_put_file(ctx, dir, so, so_tmp, so_size) == KL_OK)
				load_from = final;
			else
				dir = NULL; /* no plan without its binary */
		}
		if (st == KL_OK)
			st = load_kernels(ctx, c, load_from);
		kl__rmtree_flat(work);
		if (st != KL_OK)
			return st;
	}
	if (dir) {
		uint8_t *bytes = NULL;
		size_t len = 0;
		if (kl__program_serialize(&c->prog, &bytes, &len) != KL_OK)
			return KL_OK; /* the variant works; only the cache misses out */
		uint8_t *payload = malloc(len + 16);
		if (payload) {
			kl__le_put64(payload, so_hash);
			kl__le_put64(payload + 8, so_size);
			memcpy(payload + 16, bytes, len);
			entry_names(c->key, so_hash, plan, so, sizeof plan);
			kl__cache_put(ctx, dir, plan, c->key, payload, len + 16);
		}
		free(payload);
		free(bytes);
	}
	return KL_OK;
}

kl_compiled *kl__compile(kl_ctx *ctx, const kl_graph *g, const kl_compile_cfg *cfg)
{
	if (ctx->device != KL_CPU && ctx->device != KL_CUDA) {
		kl__err(ctx, KL_EUNSUPPORTED, "kl_compile: no compiled runtime for this device");
		return NULL;
	}
	kl_compiled *c = calloc(1, sizeof *c);
	symres sr = {0};
	if (!c) {
		kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		return NULL;
	}
	c->mode = cfg->mode;
	c->fusion = cfg->fusion;
	c->lent = cfg->lent;
	c->keep_bin = cfg->keep_binary;
	c->cuda = ctx->device == KL_CUDA && !cfg->lower_for_cuda;
	c->nin = g->ninputs;
	c->nout = g->noutputs;
	c->in_strides = calloc((size_t)(c->nin ? c->nin : 1), sizeof *c->in_strides);
	c->in_dynamic = calloc((size_t)(c->nin ? c->nin : 1), sizeof *c->in_dynamic);
	if (!c->in_strides || !c->in_dynamic || kl__graph_copy(&c->g, g) != 0) {
		kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		goto fail;
	}
	if (symbolize(ctx, g, cfg->dyn_masks, &sr) != KL_OK ||
	    key_of(ctx, g, cfg, sr.sym, &c->key) != KL_OK)
		goto fail;
	for (int32_t i = 0; i < c->nin; i++) {
		const kl_node *n = &g->nodes[g->inputs[i]];
		memcpy(c->in_strides[i], n->strides, sizeof c->in_strides[i]);
		for (int d = 0; sr.sym && d < n->ndim; d++)
			if (sr.sym[g->inputs[i] * KL_MAX_DIMS + d] > 0)
				c->in_dynamic[i] = true;
	}
	memcpy(c->spec, sr.spec, sizeof c->spec);
	c->nspec = sr.nspec;
	c->src_sym = sr.sym; /* kept: kl__compiled_serves */
	sr.sym = NULL;

	char dir[PATH_MAX];
	bool have_dir = kl__cache_dir(ctx, dir, sizeof dir);
	double t0 = kl__now_ms();
	if (cfg->lower_for_cuda) {
		if (make_program(ctx, c, g, cfg, c->src_sym ? sr.masks : NULL) != KL_OK)
			goto fail;
	} else if (have_dir && load_cached(ctx, c, dir) == KL_OK) {
		c->from_cache = true;
		atomic_fetch_add(&n_cache_hits, 1);
		kl__log(ctx, KL_LOG_STARTUP,
		        "variant %016" PRIx64 ": plan and binary from the disk cache %.3f ms",
		        c->key, kl__now_ms() - t0);
	} else {
		double t1 = kl__now_ms();
		if (make_program(ctx, c, g, cfg, c->src_sym ? sr.masks : NULL) != KL_OK)
			goto fail;
		double t2 = kl__now_ms();
		if (build(ctx, c, have_dir ? dir : NULL) != KL_OK)
			goto fail;
		kl__log(ctx, KL_LOG_STARTUP,
		        "variant %016" PRIx64 ": cache lookup %.3f ms, lowering %.3f ms, build (%s) "
		        "%.3f ms",
		        c->key, t1 - t0, t2 - t1, c->cuda ? "NVRTC, module load" : "cc, dlopen",
		        kl__now_ms() - t2);
	}
	if (!c->from_cache) { /* a loaded plan was checked before its binary was loaded */
		char err[256] = "";
		if (kl__plan_check(&c->prog, g, err, sizeof err) != KL_OK) {
			kl__err(ctx, KL_EFORMAT, "kl_compile: the program does not match its graph: %s",
			        err);
			goto fail;
		}
	}
	c->dynamic = c->prog.nsyms > 0;
	for (int32_t k = 0; k < c->prog.nsyms; k++) {
		const kl_node *n = &g->nodes[g->inputs[c->prog.sym_input[k]]];
		c->plan_syms[k] = n->shape[c->prog.sym_dim[k]];
	}
	/* a plan from the disk cache may have been traced at other sizes of its
	 * symbols: its library steps are bound to this graph's */
	char berr[160];
	if (c->dynamic && kl__program_bind(&c->prog, c->plan_syms, berr, sizeof berr) != KL_OK) {
		kl__err(ctx, KL_EFORMAT, "kl_compile: the program does not fit its graph: %s", berr);
		goto fail;
	}
	if (kl__memplan_build(&c->prog, c->plan_syms, c->lent, &c->plan) != KL_OK) {
		kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory planning buffers");
		goto fail;
	}
	if (c->cuda && !cfg->lower_for_cuda)
		kl__cuda_rt_prepare(ctx, c);
	symres_free(&sr);
	return c;
fail:
	symres_free(&sr);
	kl__compiled_free(c);
	return NULL;
}

kl_compiled *kl__compiled_from_plan(kl_ctx *ctx, const char *fn, kl_program *prog, void *dl, int nin,
                                    int nout)
{
	kl_compiled *c = calloc(1, sizeof *c);
	if (!c) {
		kl__jit_unload(dl);
		kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		return NULL;
	}
	kl__graph_init(&c->g);
	c->prog = *prog;
	memset(prog, 0, sizeof *prog);
	c->dl = dl;
	c->from_cache = true;
	/* CUDA: the caller loads the module (package_cuda.h) */
	c->cuda = ctx->device == KL_CUDA;
	c->nin = nin;
	c->nout = nout;
	c->in_strides = calloc((size_t)(nin ? nin : 1), sizeof *c->in_strides);
	c->in_dynamic = calloc((size_t)(nin ? nin : 1), sizeof *c->in_dynamic);
	if (!c->in_strides || !c->in_dynamic ||
	    (c->prog.nkernels > 0 && !c->cuda &&
	     !(c->fns = calloc((size_t)c->prog.nkernels, sizeof *c->fns))))
		goto oom;
	for (int32_t b = 0; b < c->prog.nbufs; b++) {
		const kl_buf *bf = &c->prog.bufs[b];
		if (bf->role != KL_BUF_INPUT)
			continue;
		int64_t shape[KL_MAX_DIMS];
		for (int d = 0; d < bf->ndim; d++) {
			shape[d] = bf->shape[d].v;
			c->in_dynamic[bf->index] |= bf->shape[d].sym > 0;
		}
		kl__contig_strides(bf->ndim, shape, c->in_strides[bf->index]);
	}
	if (c->prog.nkernels > 0 && !c->cuda &&
	    kl__jit_symbols(ctx, fn, KL_EFORMAT, dl, c->prog.kernel_names, c->prog.nkernels, c->fns) != KL_OK) {
		kl__compiled_free(c);
		return NULL;
	}
	c->dynamic = c->prog.nsyms > 0;
	for (int32_t k = 0; k < c->prog.nsyms; k++) {
		const kl_buf *in = NULL;
		for (int32_t b = 0; b < c->prog.nbufs && !in; b++)
			if (c->prog.bufs[b].role == KL_BUF_INPUT &&
			    c->prog.bufs[b].index == c->prog.sym_input[k])
				in = &c->prog.bufs[b];
		c->plan_syms[k] = in ? in->shape[c->prog.sym_dim[k]].v : 0;
	}
	/* static plans too: the check that every library step stays inside its
	 * buffers (a package's plan has no graph to be checked against) */
	char berr[160];
	if (kl__program_bind_dense(&c->prog, c->plan_syms, berr, sizeof berr) != KL_OK) {
		kl__err(ctx, KL_EFORMAT, "%s: bad package: the plan does not fit its sizes: %s", fn,
		        berr);
		kl__compiled_free(c);
		return NULL;
	}
	if (kl__memplan_build(&c->prog, c->plan_syms, c->lent, &c->plan) != KL_OK)
		goto oom;
	return c;
oom:
	kl__compiled_free(c);
	kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
	return NULL;
}
