/* backend_no_cuda.c - the CUDA entry points of a kiln built without the CUDA backend
 * (KILN_CUDA=OFF, usually because the toolkit headers were not found): a
 * CUDA context then fails with a message saying so, instead of a link error.
 */
#include "backend/cuda/backend.h"

kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index, const kl_cuda_hooks *hooks)
{
	(void)hooks;
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

int kl__cuda_arch(const kl_ctx *ctx)
{
	(void)ctx;
	return 0;
}
