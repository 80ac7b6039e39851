/* absent.c - the CUDA entry points of a kiln built without the CUDA backend
 * (KILN_CUDA=OFF, usually because the toolkit headers were not found): a
 * CUDA context then fails with a message saying so, instead of a link error.
 */
#include "backend/cuda/backend.h"
#include "runtime/compiled.h"

kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index)
{
	return kl__err(ctx, KL_EDEVICE,
	               "CUDA device %d requested, but this kiln was built without the "
	               "CUDA backend (KILN_CUDA=OFF: the CUDA toolkit headers were not found at "
	               "configure time)",
	               index);
}

void kl__cuda_ctx_fini(kl_ctx *ctx)
{
	(void)ctx;
}

/* The runtime's CUDA half: unreachable without a CUDA context, which this
 * build cannot make; each still answers with the same reason. */
static kl_status absent(kl_ctx *ctx)
{
	return kl__err(ctx, KL_EDEVICE,
	               "kl_compile: this kiln was built without the CUDA backend (KILN_CUDA=OFF)");
}

uint64_t kl__cuda_rt_identity(kl_ctx *ctx)
{
	(void)ctx;
	return 0;
}

kl_status kl__cuda_rt_build(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t *bin_hash,
                            uint64_t *bin_size)
{
	(void)c;
	(void)dir;
	*bin_hash = *bin_size = 0;
	return absent(ctx);
}

kl_status kl__cuda_rt_load(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t bin_hash,
                           uint64_t bin_size)
{
	(void)c;
	(void)dir;
	(void)bin_hash;
	(void)bin_size;
	return absent(ctx);
}

void kl__cuda_rt_prepare(kl_ctx *ctx, kl_compiled *c)
{
	(void)ctx;
	(void)c;
}

kl_status kl__cuda_rt_arena(kl_ctx *ctx, kl_compiled *c, size_t bytes, void **base)
{
	(void)c;
	(void)bytes;
	*base = NULL;
	return absent(ctx);
}

kl_status kl__cuda_rt_run(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
{
	(void)c;
	(void)B;
	(void)syms;
	return absent(ctx);
}

kl_status kl__cuda_rt_time_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                 const int64_t *syms, double *us)
{
	(void)c;
	(void)B;
	(void)syms;
	(void)us;
	return kl__err(ctx, KL_EUNSUPPORTED, "kl_profile: kiln was built without CUDA");
}

bool kl__cuda_rt_replaying(const kl_compiled *c)
{
	(void)c;
	return false;
}

void kl__cuda_rt_free(kl_compiled *c)
{
	(void)c;
}
