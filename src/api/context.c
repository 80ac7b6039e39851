/* context.c - kl_ctx_new and kl_ctx_free: a context is made here, above
 * every layer it sets up: the CPU backend and OpenBLAS's thread count, the
 * CUDA device (backend/cuda/backend.h) when asked for, and at teardown the
 * active trace (capture) and the tensors (core).
 */
#include <stdlib.h>

#include "api/autograd.h"
#include "backend/cpu/cpu.h"
#include "backend/cuda/backend.h"
#include "capture/trace.h"
#include "core/core.h"
#include "runtime/compiled.h"

kl_ctx *kl_ctx_new(const kl_ctx_opts *opts)
{
	kl_ctx_opts o = {0};
	if (opts)
		o = *opts;
	if (o.device != KL_CPU && o.device != KL_CUDA) {
		kl__err(NULL, KL_EINVAL, "kl_ctx_new: unknown device %d", (int)o.device);
		return NULL;
	}
	if (o.nthreads < 0 || o.nthreads > KL_MAX_THREADS) {
		kl__err(NULL, KL_EINVAL, "kl_ctx_new: nthreads %d is outside [0,%d] (0: all cores)",
		        o.nthreads, KL_MAX_THREADS);
		return NULL;
	}
	if (o.index < 0) {
		kl__err(NULL, KL_EINVAL, "kl_ctx_new: device index %d must be >= 0", o.index);
		return NULL;
	}
	kl_ctx *ctx = calloc(1, sizeof *ctx);
	if (!ctx) {
		kl__err(NULL, KL_ENOMEM, "kl_ctx_new: out of memory");
		return NULL;
	}
	ctx->device = KL_CPU;
	ctx->index = o.index;
	ctx->nthreads = o.nthreads ? o.nthreads : kl__cpu_cores();
	ctx->be = &kl__cpu_backend;
	ctx->logs = kl__parse_logs(getenv("KILN_LOGS"));
	if (o.device == KL_CUDA && kl__cuda_ctx_init(ctx, o.index, &kl__cuda_rt_hooks) != KL_OK) {
		kl__err(NULL, ctx->status, "kl_ctx_new: %s", ctx->err);
		free(ctx);
		return NULL;
	}
	kl__blas_hold();
	return ctx;
}

/* Frees every tensor still alive (kl__ctx_free_tensors), so a context is a
 * memory arena as well. Traces handed out by kl__trace_end must be freed
 * before (they hold tensor references). */
void kl_ctx_free(kl_ctx *ctx)
{
	if (!ctx)
		return;
	if (ctx->trace) {
		kl_trace *tr = ctx->trace;
		ctx->trace = NULL;
		kl__trace_free(tr);
	}
	kl__tape_free(ctx);
	kl__ctx_free_tensors(ctx);
	kl__cuda_ctx_fini(ctx);
	free(ctx);
	kl__blas_release();
}

/* ---- the context's generator ------------------------------------------------- */

/* A new seed or offset while a trace records: the call's draws are not the
 * ones a replay would make from the generator, so fn runs at every call. */
static void rng_moved(kl_ctx *ctx)
{
	if (ctx->trace)
		ctx->trace->per_call = true;
}

kl_status kl_manual_seed(kl_ctx *ctx, uint64_t seed)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_manual_seed: ctx is NULL");
	ctx->rng_seed = seed;
	ctx->rng_offset = 0;
	rng_moved(ctx);
	return KL_OK;
}

kl_status kl_rng_get_state(kl_ctx *ctx, uint64_t *seed, uint64_t *offset)
{
	if (!ctx || !seed || !offset)
		return kl__err(ctx, KL_EINVAL, "kl_rng_get_state: %s is NULL",
		               !ctx    ? "ctx"
		               : !seed ? "seed"
		                       : "offset");
	*seed = ctx->rng_seed;
	*offset = ctx->rng_offset;
	return KL_OK;
}

kl_status kl_rng_set_state(kl_ctx *ctx, uint64_t seed, uint64_t offset)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_rng_set_state: ctx is NULL");
	ctx->rng_seed = seed;
	ctx->rng_offset = offset;
	rng_moved(ctx);
	return KL_OK;
}
