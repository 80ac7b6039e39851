/* backend.h - how a kl_ctx becomes a CUDA context. Includes no CUDA header,
 * so ctx.c can call these whether or not kiln was built with the CUDA
 * backend (KILN_CUDA=OFF links backend_no_cuda.c, which explains what is missing).
 */
#ifndef KILN_CUDA_BACKEND_H
#define KILN_CUDA_BACKEND_H

#include "core/core.h"

struct kl_node;

/* What the CUDA backend is handed by the layers above it (api/context.c
 * passes the runtime's, kl__cuda_rt_hooks), so that it never calls them:
 * the disk cache its NVRTC toolchain keeps compiled modules in, and eager
 * execution of the nodes no library call serves (the runtime compiles a
 * one-node graph). Any member may be NULL: no disk cache; no generated
 * eager kernels (such nodes fail with KL_EUNSUPPORTED). */
typedef struct kl_cuda_hooks {
	/* the cache directory, false when there is none to trust */
	bool (*cache_dir)(const kl_ctx *ctx, char *buf, size_t cap);
	/* entry `name` with key `key`: KL_OK with *payload malloc'd, else absent or corrupt */
	kl_status (*cache_get)(const kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
	                       void **payload, size_t *len);
	kl_status (*cache_put)(kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
	                       const void *payload, size_t len);
	/* run node n on in[] into out (allocated, dense), as kl_backend.exec */
	kl_status (*exec_generated)(kl_ctx *ctx, const struct kl_node *n, kl_tensor *const *in,
	                            kl_tensor *out);
	/* release what exec_generated keeps for ctx (called by kl__cuda_ctx_fini) */
	void (*eager_free)(kl_ctx *ctx);
} kl_cuda_hooks;

/* Opens CUDA device `index` for ctx: loads the driver, retains the device's
 * primary context, makes a stream and a caching allocator, then sets
 * ctx->device, ctx->index, ctx->be and ctx->backend_state; hooks (copied; may
 * be NULL) are what the layers above lend it. On failure ctx is
 * left as it was and the error (KL_EDEVICE: "no CUDA driver found (...)",
 * "no CUDA device found (...)", "CUDA device 3 does not exist (2 devices)")
 * is set on it. */
kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index, const kl_cuda_hooks *hooks);
/* Releases what kl__cuda_ctx_init made; call after every tensor of ctx has
 * been freed through ctx->be. Safe on a context that was never initialized. */
void kl__cuda_ctx_fini(kl_ctx *ctx);
/* The architecture of ctx's GPU (90 for sm_90); 0 for another device. */
int kl__cuda_arch(const kl_ctx *ctx);

#endif /* KILN_CUDA_BACKEND_H */
