/* backend.h - how a kl_ctx becomes a CUDA context. Includes no CUDA header,
 * so ctx.c can call these whether or not kiln was built with the CUDA
 * backend (KILN_CUDA=OFF links absent.c, which explains what is missing).
 */
#ifndef KILN_CUDA_BACKEND_H
#define KILN_CUDA_BACKEND_H

#include "core/core.h"

/* Opens CUDA device `index` for ctx: loads the driver, retains the device's
 * primary context, makes a stream and a caching allocator, then sets
 * ctx->device, ctx->index, ctx->be and ctx->backend_state. On failure ctx is
 * left as it was and the error (KL_EDEVICE: "no CUDA driver found (...)",
 * "no CUDA device found (...)", "CUDA device 3 does not exist (2 devices)")
 * is set on it. */
kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index);
/* Releases what kl__cuda_ctx_init made; call after every tensor of ctx has
 * been freed through ctx->be. Safe on a context that was never initialized. */
void kl__cuda_ctx_fini(kl_ctx *ctx);

#endif /* KILN_CUDA_BACKEND_H */
