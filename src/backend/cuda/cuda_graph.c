/* cuda_graph.c - CUDA graph primitives for reduce-overhead mode: capture a region
 * of the stream, instantiate (or update in place), replay, and rewrite the
 * arguments of captured kernels between replays.
 */
#include "backend/cuda/device.h"

#include <stdlib.h>

kl_status kl__cuda_capture_begin(kl_ctx *ctx, kl_cuda_dev *d)
{
	if (d->capturing)
		return kl__err(ctx, KL_ESTATE, "kl_cuda: a CUDA graph capture is already open");
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	/* Thread-local: other threads' unrelated CUDA calls stay legal. */
	KL_CU_TRY(ctx, cuStreamBeginCapture, d->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
	d->capturing = true;
	return KL_OK;
}

kl_status kl__cuda_capture_last_node(kl_ctx *ctx, kl_cuda_dev *d, CUgraphNode *out)
{
	*out = NULL;
	CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
	cuuint64_t id = 0;
	CUgraph g = NULL;
	const CUgraphNode *deps = NULL;
	const CUgraphEdgeData *edges = NULL;
	size_t n = 0;
	KL_CU_TRY(ctx, cuStreamGetCaptureInfo, d->stream, &cs, &id, &g, &deps, &edges, &n);
	if (cs != CU_STREAM_CAPTURE_STATUS_ACTIVE)
		return kl__err(ctx, KL_ESTATE, "kl_cuda: the stream is not capturing (%s)",
		               cs == CU_STREAM_CAPTURE_STATUS_NONE ? "no capture open"
		                                                   : "the capture was invalidated");
	/* On one stream, the capture's frontier is the node just added. */
	if (n != 1)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: the capture frontier has %zu nodes; no single last node",
		               n);
	*out = deps[0];
	return KL_OK;
}

kl_status kl__cuda_capture_end(kl_ctx *ctx, kl_cuda_dev *d, kl_cuda_graph *g)
{
	if (!d->capturing)
		return kl__err(ctx, KL_ESTATE, "kl_cuda: no CUDA graph capture is open");
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	CUgraph ng = NULL;
	CUresult r = kl__cu.cuStreamEndCapture(d->stream, &ng);
	d->capturing = false;
	if (r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
		return kl__err(
		        ctx, KL_ESTATE,
		        "kl_cuda: the CUDA graph capture was invalidated by an operation not "
		        "allowed while capturing (a synchronization, an allocation or a copy "
		        "to pageable host memory)");
	if ((s = kl__cu_check(ctx, r, "cuStreamEndCapture", __FILE__, __LINE__)) != KL_OK)
		return s;
	/* A fresh instantiation, never cuGraphExecUpdate: per-node updates must
	 * name nodes of the graph the exec was instantiated from, and after an
	 * update that graph's recorded parameters would no longer match the exec. */
	if (g->exec) {
		kl__cu.cuGraphExecDestroy(g->exec);
		g->exec = NULL;
	}
	if (g->graph)
		kl__cu.cuGraphDestroy(g->graph);
	g->graph = ng;
	if ((s = KL_CU(ctx, cuGraphInstantiate, &g->exec, ng, 0)) != KL_OK) {
		g->exec = NULL;
		return s;
	}
	KL_CU_TRY(ctx, cuGraphUpload, g->exec, d->stream);
	if (ctx && (ctx->logs & KL_LOG_CUDAGRAPHS)) {
		size_t n = 0;
		kl__cu.cuGraphGetNodes(ng, NULL, &n);
		kl__log(ctx, KL_LOG_CUDAGRAPHS,
		        "captured %zu nodes on CUDA device %d, instantiated", n, d->index);
	}
	return KL_OK;
}

kl_status kl__cuda_graph_launch(kl_ctx *ctx, kl_cuda_dev *d, const kl_cuda_graph *g)
{
	if (!g->exec)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: launch of a CUDA graph never instantiated");
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuGraphLaunch, g->exec, d->stream);
	return KL_OK;
}

kl_status kl__cuda_graph_kernel_nodes(kl_ctx *ctx, const kl_cuda_graph *g, CUgraphNode **nodes,
                                      int *n)
{
	*nodes = NULL;
	*n = 0;
	size_t total = 0;
	KL_CU_TRY(ctx, cuGraphGetNodes, g->graph, NULL, &total);
	if (total == 0)
		return KL_OK;
	CUgraphNode *all = malloc(total * sizeof *all);
	if (!all)
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory");
	kl_status s = KL_CU(ctx, cuGraphGetNodes, g->graph, all, &total);
	int k = 0;
	for (size_t i = 0; s == KL_OK && i < total; i++) {
		CUgraphNodeType t;
		s = KL_CU(ctx, cuGraphNodeGetType, all[i], &t);
		if (s == KL_OK && t == CU_GRAPH_NODE_TYPE_KERNEL)
			all[k++] = all[i];
	}
	if (s != KL_OK) {
		free(all);
		return s;
	}
	*nodes = all;
	*n = k;
	return KL_OK;
}

kl_status kl__cuda_graph_set_args(kl_ctx *ctx, kl_cuda_graph *g, CUgraphNode node, void **args)
{
	CUDA_KERNEL_NODE_PARAMS p;
	memset(&p, 0, sizeof p);
	KL_CU_TRY(ctx, cuGraphKernelNodeGetParams, node, &p);
	p.kernelParams = args;
	p.extra = NULL;
	return kl__cuda_graph_set_kernel(ctx, g, node, &p);
}

kl_status kl__cuda_graph_set_kernel(kl_ctx *ctx, kl_cuda_graph *g, CUgraphNode node,
                                    const CUDA_KERNEL_NODE_PARAMS *p)
{
	if (!g->exec)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: kernel update on a CUDA graph never "
		               "instantiated");
	KL_CU_TRY(ctx, cuGraphExecKernelNodeSetParams, g->exec, node, p);
	return KL_OK;
}

kl_status kl__cuda_graph_copy_params(kl_ctx *ctx, CUgraphNode node, CUDA_MEMCPY3D *p)
{
	memset(p, 0, sizeof *p);
	CUgraphNodeType t;
	KL_CU_TRY(ctx, cuGraphNodeGetType, node, &t);
	if (t != CU_GRAPH_NODE_TYPE_MEMCPY)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: a captured copy became a graph node of type %d, not a "
		               "memcpy node",
		               (int)t);
	KL_CU_TRY(ctx, cuGraphMemcpyNodeGetParams, node, p);
	return KL_OK;
}

kl_status kl__cuda_graph_set_copy(kl_ctx *ctx, kl_cuda_dev *d, kl_cuda_graph *g, CUgraphNode node,
                                  const CUDA_MEMCPY3D *p, CUdeviceptr dst, CUdeviceptr src)
{
	if (!g->exec)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: copy update on a CUDA graph never instantiated");
	CUDA_MEMCPY3D q = *p;
	/* whole 1-D ranges from the given addresses */
	q.srcDevice = src;
	q.dstDevice = dst;
	q.srcXInBytes = q.srcY = q.srcZ = 0;
	q.dstXInBytes = q.dstY = q.dstZ = 0;
	KL_CU_TRY(ctx, cuGraphExecMemcpyNodeSetParams, g->exec, node, &q, d->cu);
	return KL_OK;
}

void kl__cuda_graph_free(kl_cuda_graph *g)
{
	if (g->exec)
		kl__cu.cuGraphExecDestroy(g->exec);
	if (g->graph)
		kl__cu.cuGraphDestroy(g->graph);
	g->exec = NULL;
	g->graph = NULL;
}
