/* trace.h - the lazy trace of a compiled call (capture/trace.c): while one is
 * active on a context, ops append nodes to its graph instead of running.
 */
#ifndef KILN_TRACE_H
#define KILN_TRACE_H

#include "core/core.h"
#include "graph/graph.h"

typedef struct kl_trace {
	uint64_t id;
	kl_graph g;
	/* the materialized tensor behind each INPUT node (one reference held) */
	kl_tensor **in_tensors;
	int nin_tensors, cap_in_tensors;
} kl_trace;

/* Start recording: ops on ctx append nodes instead of running. */
kl_status kl__trace_begin(kl_ctx *ctx);
/* Stop recording; returns the trace (caller frees with kl__trace_free).
 * outputs[] are lazy tensors of this trace: they become the graph's
 * outputs in order. */
kl_trace *kl__trace_end(kl_ctx *ctx, int noutputs, kl_tensor *const *outputs);
void kl__trace_free(kl_trace *tr);
/* The node a tensor is in the active trace, adding an INPUT node for a
 * materialized tensor; -1 on error. */
int32_t kl__trace_node_of(kl_ctx *ctx, kl_tensor *t);

#endif /* KILN_TRACE_H */
