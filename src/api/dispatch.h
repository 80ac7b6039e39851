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
/* rand (op KL_OP_RAND) or randn of dtype dt keyed at run time: the node
 * reads key from two 0-dim i32 tensors made here (see ops.def), so a
 * compiled graph serves every key (dropout's (seed, offset) in a training
 * loop). With rng_offset NULL the key is the caller's and the trace is
 * marked per_call (never replayed); else key is the context generator's
 * at *rng_offset (kl_dropout_rng), recorded so that a replay makes the
 * next call's key itself. The same values as kl_rand(ctx, dt, ndim,
 * shape, key). A reference the caller releases (not the open scope's);
 * NULL with the error set. */
kl_tensor *kl__rand_keyed(kl_ctx *ctx, kl_op op, kl_dtype dt, int ndim, const int64_t *shape,
                          uint64_t key, const uint64_t *rng_offset);
/* A dense copy of materialized a through the backend's CONTIGUOUS, run at
 * once even while a trace is active (never recorded: after a graph break a
 * new trace would only record the copy). NULL with the error set. */
kl_tensor *kl__eager_contiguous(kl_ctx *ctx, kl_tensor *a);

/* The first element (row-major order) of integer tensor idx (i32 or i64)
 * whose value lies outside [0, n) and is not skip (has_skip), when idx's
 * values are held now (eager, or a tensor made before the trace): *bad is its
 * element number and *val its value, *bad = -1 when every value is fine or
 * idx is lazy (a generated kernel then clamps). The one range check of every
 * index-taking op (gather, embedding, index_add, one_hot, cross_entropy's
 * targets) on every device: on CUDA the bytes idx spans come back first (one
 * copy to the host and a wait for the stream: eager index ops synchronise).
 * KL_OK, or the error of that copy (or of the host buffer) naming op. */
kl_status kl__index_scan(kl_ctx *ctx, const char *op, const kl_tensor *idx, int64_t n,
                         bool has_skip, int64_t skip, int64_t *bad, int64_t *val);

#endif
