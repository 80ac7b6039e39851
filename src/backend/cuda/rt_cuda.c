/* rt_cuda.c - the runtime's CUDA half: a compiled variant's source becomes one
 * NVRTC module for the device's architecture (its cubin cached on disk next
 * to the plan), temps live in a device arena, kernel steps launch on the
 * context's stream and products go through cuBLASLt. Under reduce-overhead
 * and max-autotune the whole variant is captured into a CUDA graph after one
 * warm-up run and replayed with a single launch.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/device.h"
#include "runtime/rt.h"

#define BLOCK 256

typedef enum gstate { G_WARMUP = 0, G_CAPTURE, G_READY, G_OFF } gstate;

typedef struct kl_cuda_rt {
	kl_ctx *ctx;
	kl_cuda_dev *dev;
	kl_cuda_module *mod;
	CUfunction *fns;
	int32_t nfns;
	CUdeviceptr arena;
	size_t arena_cap;
	uint64_t *args; /* the kl_args block: buffer pointers, then symbols */
	size_t nargs;
	/* CUDA graph replay */
	gstate gs;
	kl_cuda_graph graph;
	CUdeviceptr *stat; /* per buffer: its static copy (inputs, outputs), 0 otherwise */
	size_t *stat_bytes;
	/* launch geometry (launch_steps): grid_cap[s], blocks per SM step s may
	 * launch at most, 0 = fit (for a max-autotune pass to set); fit[k], the
	 * blocks of kernel k resident on one SM at once (occupancy), 0 = not
	 * asked yet */
	uint32_t *grid_cap;
	int *fit;
} kl_cuda_rt;

uint64_t kl__cuda_rt_identity(kl_ctx *ctx)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	int v[4] = {d->cc_major, d->cc_minor, 0, 0};
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

static kl_status load_module(kl_ctx *ctx, kl_compiled *c, const kl_cuda_image *im)
{
	kl_cuda_rt *rt = calloc(1, sizeof *rt);
	if (!rt)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	rt->ctx = ctx;
	rt->dev = kl__cuda_dev_of(ctx);
	rt->gs = getenv("KILN_DISABLE_CUDAGRAPHS") && atoi(getenv("KILN_DISABLE_CUDAGRAPHS")) == 1
	                 ? G_OFF
	                 : G_WARMUP;
	c->dev = rt;
	rt->nargs = (size_t)(c->prog.nbufs > 0 ? c->prog.nbufs : 1) +
	            (size_t)(c->prog.nsyms > 0 ? c->prog.nsyms : 1);
	rt->args = calloc(rt->nargs, sizeof *rt->args);
	rt->grid_cap = calloc((size_t)c->prog.nsteps + 1, sizeof *rt->grid_cap);
	rt->fit = calloc((size_t)c->prog.nkernels + 1, sizeof *rt->fit);
	if (!rt->args || !rt->grid_cap || !rt->fit)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	if (c->prog.nkernels == 0)
		return KL_OK;
	kl_status st = kl__cuda_module_load(ctx, rt->dev, im, &rt->mod);
	if (st != KL_OK)
		return st;
	rt->fns = calloc((size_t)c->prog.nkernels, sizeof *rt->fns);
	if (!rt->fns)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	rt->nfns = c->prog.nkernels;
	for (int32_t k = 0; k < c->prog.nkernels && st == KL_OK; k++)
		st = kl__cuda_module_fn(ctx, rt->mod, c->prog.kernel_names[k], &rt->fns[k]);
	return st;
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
		/* the entry: a flag byte (1: PTX text), then the image */
		uint8_t *payload = malloc(im.size + 1);
		if (!payload) {
			kl__cuda_image_free(&im);
			return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
		}
		payload[0] = im.ptx ? 1 : 0;
		memcpy(payload + 1, im.data, im.size);
		*bin_size = im.size + 1;
		*bin_hash = kl__hash_bytes(KL_HASH_SEED, payload, im.size + 1);
		if (dir) {
			char name[96];
			bin_name(c->key, *bin_hash, name, sizeof name);
			if (kl__cache_put(ctx, dir, name, c->key, payload, im.size + 1) == KL_OK)
				kl__log(ctx, KL_LOG_CACHE, "wrote %s (%zu bytes)", name,
				        im.size + 1);
			else
				kl_clear_error(ctx);
		}
		free(payload);
	}
	st = load_module(ctx, c, &im);
	kl__cuda_image_free(&im);
	return st;
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
	uint8_t *p = payload;
	/* PTX is text the driver wants NUL-terminated */
	im.data = calloc(1, len);
	if (!im.data) {
		free(payload);
		return kl__err(ctx, KL_ENOMEM, "kl_compile: out of memory");
	}
	memcpy(im.data, p + 1, len - 1);
	im.size = len - 1;
	im.ptx = p[0] == 1;
	free(payload);
	st = load_module(ctx, c, &im);
	kl__cuda_image_free(&im);
	return st;
}

static void free_statics(kl_cuda_rt *rt, int32_t nbufs)
{
	if (rt->stat)
		for (int32_t b = 0; b < nbufs; b++)
			if (rt->stat[b])
				kl__cuda_free(rt->ctx, rt->dev, rt->stat[b]);
	free(rt->stat);
	free(rt->stat_bytes);
	rt->stat = NULL;
	rt->stat_bytes = NULL;
}

void kl__cuda_rt_free(kl_compiled *c)
{
	kl_cuda_rt *rt = c->dev;
	if (!rt)
		return;
	kl__cuda_sync(NULL, rt->dev);
	kl__cuda_graph_free(&rt->graph);
	free_statics(rt, c->prog.nbufs);
	if (rt->arena)
		kl__cuda_free(rt->ctx, rt->dev, rt->arena);
	kl__cuda_module_free(rt->mod);
	free(rt->fns);
	free(rt->args);
	free(rt->grid_cap);
	free(rt->fit);
	free(rt);
	c->dev = NULL;
}

kl_status kl__cuda_rt_arena(kl_ctx *ctx, kl_compiled *c, size_t bytes, void **base)
{
	kl_cuda_rt *rt = c->dev;
	if (bytes > rt->arena_cap || !rt->arena) {
		CUdeviceptr p = 0;
		size_t want = bytes ? bytes : KL_ARENA_ALIGN;
		kl_status st = kl__cuda_malloc(ctx, rt->dev, want, &p);
		if (st != KL_OK)
			return st;
		if (rt->arena)
			kl__cuda_free(ctx, rt->dev, rt->arena);
		rt->arena = p;
		rt->arena_cap = want;
		/* the captured graph addressed the old arena */
		if (rt->gs == G_READY) {
			kl__cuda_graph_free(&rt->graph);
			rt->gs = G_CAPTURE;
		}
	}
	*base = (void *)(uintptr_t)rt->arena;
	return KL_OK;
}

static int64_t buf_numel(const kl_buf *bf, const int64_t *syms)
{
	int64_t n = 1;
	for (int d = 0; d < bf->ndim; d++)
		n *= kl__dim_value(&bf->shape[d], syms);
	return n;
}

/* Blocks per SM for step s: its grid_cap, else as many blocks of BLOCK
 * threads as are resident on an SM at once, so that a big launch is one
 * full wave whose grid-stride loops share the work evenly (no partial
 * second wave), and the idle blocks of a small one start together. */
static int64_t blocks_per_sm(kl_cuda_rt *rt, int32_t s, int32_t kernel)
{
	if (rt->grid_cap[s])
		return rt->grid_cap[s];
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

/* All steps, in order, on the stream: kernels with one kl_args block each,
 * products through cuBLASLt. */
static kl_status launch_steps(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
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
	for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++) {
		const kl_step *sp = &p->steps[s];
		if (sp->kind == KL_STEP_MATMUL) {
			const kl_matmul_step *mm = &sp->mm;
			st = kl__lt_matmul_step(
			        ctx, rt->dev, mm, p->bufs[mm->a].dtype, p->bufs[mm->c].dtype,
			        (CUdeviceptr)(uintptr_t)B[mm->a], (CUdeviceptr)(uintptr_t)B[mm->b],
			        (CUdeviceptr)(uintptr_t)B[mm->c]);
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
		/* pointwise: a thread per point; reductions: a block per result row
		 * (work counts points, so both are upper bounds), at most a wave */
		bool pw =
		        strncmp(sp->what, "pointwise", 9) == 0 || strncmp(sp->what, "copy", 4) == 0;
		int64_t blocks = pw ? (work + BLOCK - 1) / BLOCK : work;
		int64_t cap = sms * blocks_per_sm(rt, s, sp->kernel);
		if (blocks > cap)
			blocks = cap;
		if (blocks > INT32_MAX)
			blocks = INT32_MAX;
		unsigned grid[3] = {(unsigned)blocks, 1, 1}, block[3] = {BLOCK, 1, 1};
		void *argv[1] = {rt->args};
		st = kl__cuda_launch(ctx, rt->dev, rt->fns[sp->kernel], grid, block, 0, argv);
	}
	return st;
}

/* bytes an input's kernels can reach: from its first element to its last */
static size_t input_span(const kl_compiled *c, const kl_buf *bf)
{
	int64_t n = 1, last = 0;
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

/* Static copies of the inputs and dense outputs, B redirected to them. */
static kl_status make_statics(kl_ctx *ctx, kl_compiled *c, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	rt->stat = calloc((size_t)p->nbufs + 1, sizeof *rt->stat);
	rt->stat_bytes = calloc((size_t)p->nbufs + 1, sizeof *rt->stat_bytes);
	if (!rt->stat || !rt->stat_bytes)
		return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		size_t n = 0;
		if (bf->role == KL_BUF_INPUT)
			n = input_span(c, bf);
		else if (bf->role == KL_BUF_OUTPUT && bf->alias < 0)
			n = kl__buf_bytes(bf, syms);
		rt->stat_bytes[b] = n;
		if (n) {
			kl_status st = kl__cuda_malloc(ctx, rt->dev, n, &rt->stat[b]);
			if (st != KL_OK)
				return st;
		}
	}
	return KL_OK;
}

static kl_status copy_in(kl_ctx *ctx, kl_compiled *c, void *const *B)
{
	kl_cuda_rt *rt = c->dev;
	for (int32_t b = 0; b < c->prog.nbufs; b++)
		if (c->prog.bufs[b].role == KL_BUF_INPUT && rt->stat_bytes[b]) {
			kl_status st =
			        kl__cuda_d2d(ctx, rt->dev, rt->stat[b],
			                     (CUdeviceptr)(uintptr_t)B[b], rt->stat_bytes[b]);
			if (st != KL_OK)
				return st;
		}
	return KL_OK;
}

static kl_status copy_out(kl_ctx *ctx, kl_compiled *c, void *const *B)
{
	kl_cuda_rt *rt = c->dev;
	for (int32_t b = 0; b < c->prog.nbufs; b++)
		if (c->prog.bufs[b].role == KL_BUF_OUTPUT && rt->stat_bytes[b]) {
			kl_status st = kl__cuda_d2d(ctx, rt->dev, (CUdeviceptr)(uintptr_t)B[b],
			                            rt->stat[b], rt->stat_bytes[b]);
			if (st != KL_OK)
				return st;
		}
	return KL_OK;
}

static kl_status capture(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	kl_status st = make_statics(ctx, c, syms);
	void **SB = st == KL_OK ? malloc(sizeof(void *) * (size_t)(p->nbufs + 1)) : NULL;
	if (st == KL_OK && !SB)
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	if (st != KL_OK) {
		free_statics(rt, p->nbufs);
		return st;
	}
	for (int32_t b = 0; b < p->nbufs; b++)
		SB[b] = rt->stat[b] ? (void *)(uintptr_t)rt->stat[b] : B[b];
	st = kl__cuda_capture_begin(ctx, rt->dev);
	if (st == KL_OK) {
		kl_status rs = launch_steps(ctx, c, SB, syms);
		char why[KL_ERR_CAP] = "";
		if (rs != KL_OK)
			snprintf(why, sizeof why, "%s", kl_last_error(ctx));
		st = kl__cuda_capture_end(ctx, rt->dev, &rt->graph);
		if (rs != KL_OK) {
			kl__cuda_graph_free(&rt->graph);
			st = kl__err(ctx, rs, "%s", why);
		}
	}
	free(SB);
	if (st != KL_OK)
		free_statics(rt, p->nbufs);
	return st;
}

kl_status kl__cuda_rt_run(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	kl_status st = kl__cuda_bind(ctx, rt->dev);
	if (st != KL_OK)
		return st;
	if (!graph_mode(c) || rt->gs == G_OFF)
		return launch_steps(ctx, c, B, syms);
	if (c->dynamic) {
		kl__log(ctx, KL_LOG_CUDAGRAPHS,
		        "skip: graph has dynamic dims (sizes change per call)");
		rt->gs = G_OFF;
		return launch_steps(ctx, c, B, syms);
	}
	if (rt->gs == G_WARMUP) {
		/* warm the allocator and cuBLASLt's workspace: nothing may be
		 * allocated while capturing */
		st = launch_steps(ctx, c, B, syms);
		if (st == KL_OK)
			rt->gs = G_CAPTURE;
		kl__log(ctx, KL_LOG_CUDAGRAPHS, "warm-up run (%d steps) before capture",
		        (int)c->prog.nsteps);
		return st;
	}
	if (rt->gs == G_CAPTURE) {
		st = capture(ctx, c, B, syms);
		if (st != KL_OK) {
			kl__log(ctx, KL_LOG_CUDAGRAPHS, "skip: capture failed: %s",
			        kl_last_error(ctx));
			kl_clear_error(ctx);
			rt->gs = G_OFF;
			return launch_steps(ctx, c, B, syms);
		}
		kl__log(ctx, KL_LOG_CUDAGRAPHS, "captured %d steps into one graph",
		        (int)c->prog.nsteps);
		rt->gs = G_READY;
	}
	st = copy_in(ctx, c, B);
	if (st == KL_OK)
		st = kl__cuda_graph_launch(ctx, rt->dev, &rt->graph);
	if (st == KL_OK)
		st = copy_out(ctx, c, B);
	if (st == KL_OK && (ctx->logs & KL_LOG_CUDAGRAPHS) && c->runs < 4)
		kl__log(ctx, KL_LOG_CUDAGRAPHS, "replay (1 graph launch for %d steps)",
		        (int)c->prog.nsteps);
	return st;
}

bool kl__cuda_rt_replaying(const kl_compiled *c)
{
	const kl_cuda_rt *rt = c->dev;
	return rt && rt->gs == G_READY;
}
