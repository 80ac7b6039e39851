/* dispatch.h - the op front end shared by every public op: validation, shape and
 * dtype rules, then dispatch to the eager backend or the active trace. */
#ifndef KILN_FRONT_H
#define KILN_FRONT_H

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"

/* Run (eager) or record (trace) node n over inputs in[0..n->nin-1].
 * n's op, dtype, shape, nin and attrs must be set; in[] are the tensors
 * behind n->in (the front end fills n->in itself). Returns a new reference
 * (owned by the caller or the open scope) or NULL with the error set. */
kl_tensor *kl__dispatch(kl_ctx *ctx, kl_node *n, kl_tensor *const *in);
/* A dense copy of materialized a through the backend's CONTIGUOUS, run at
 * once even while a trace is active (never recorded: after a graph break a
 * new trace would only record the copy). NULL with the error set. */
kl_tensor *kl__eager_contiguous(kl_ctx *ctx, kl_tensor *a);

#endif
