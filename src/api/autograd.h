/* autograd.h - the eager tape (api/autograd.c): kl__dispatch records here
 * every op whose input requires grad, eager or inside a trace alike. */
#ifndef KILN_API_AUTOGRAD_H
#define KILN_API_AUTOGRAD_H

#include "core/core.h"
#include "graph/graph.h"

/* Whether t requires grad: a marked leaf, or recorded on the tape. */
bool kl__requires_grad(const kl_tensor *t);
/* Called by kl__dispatch once out was made from in[] by node n (n->in is
 * rewritten here): records the node when grad mode is on and an input
 * requires grad, else passes a stopped gradient's op on (grad_stop).
 * KL_OK or KL_ENOMEM with the error set. */
kl_status kl__tape_record(kl_ctx *ctx, kl_node *n, kl_tensor *const *in, kl_tensor *out);
/* kl_ctx_free's part: the tape's arrays (the tensors go with the context). */
void kl__tape_free(kl_ctx *ctx);

#endif
