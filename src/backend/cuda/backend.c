/* backend.c - the kl_backend of KL_CUDA contexts: memory from the caching
 * allocator, host copies on the stream, and eager execution of the nodes the
 * CUDA layer can run without generated kernels (matmul, through cuBLASLt).
 */
#include "backend/cuda/device.h"

#include <stdint.h>

static void *cuda_alloc(kl_ctx *ctx, size_t nbytes)
{
	CUdeviceptr p = 0;
	if (kl__cuda_malloc(ctx, kl__cuda_dev_of(ctx), nbytes, &p) != KL_OK)
		return NULL;
	return (void *)(uintptr_t)p;
}

static void cuda_free(kl_ctx *ctx, void *p)
{
	/* A bad pointer is a bug of kiln's own bookkeeping; the message stays. */
	kl__cuda_free(ctx, kl__cuda_dev_of(ctx), (CUdeviceptr)(uintptr_t)p);
}

static kl_status cuda_to_host(kl_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
	return kl__cuda_d2h(ctx, kl__cuda_dev_of(ctx), dst, (CUdeviceptr)(uintptr_t)src, nbytes);
}

static kl_status cuda_from_host(kl_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
	return kl__cuda_h2d(ctx, kl__cuda_dev_of(ctx), (CUdeviceptr)(uintptr_t)dst, src, nbytes);
}

static CUdeviceptr dptr(const kl_tensor *t)
{
	return (CUdeviceptr)(uintptr_t)kl__tensor_data(t);
}

/* torch.matmul over materialized tensors: 1-D operands count as a row (A) or
 * a column (B); batch dims line up from the right, missing ones broadcast. */
static kl_status exec_matmul(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	const kl_tensor *a = in[0], *b = in[1];
	if (a->dtype != b->dtype)
		return kl__err(ctx, KL_EINVAL,
		               "kl_matmul: operands of %s and %s reached the CUDA "
		               "backend unconverted",
		               kl_dtype_name(a->dtype), kl_dtype_name(b->dtype));
	bool a1 = a->ndim == 1, b1 = b->ndim == 1;
	kl_gemm g;
	memset(&g, 0, sizeof g);
	g.ab = a->dtype;
	g.cd = out->dtype;
	g.alpha = 1.0;
	g.m = a1 ? 1 : a->shape[a->ndim - 2];
	g.k = a->shape[a->ndim - 1];
	g.n = b1 ? 1 : b->shape[b->ndim - 1];
	g.a_rs = a1 ? g.k : a->strides[a->ndim - 2];
	g.a_cs = a->strides[a->ndim - 1];
	g.b_rs = b->strides[b1 ? 0 : b->ndim - 2];
	g.b_cs = b1 ? 1 : b->strides[b->ndim - 1];
	g.ldd = g.n;
	g.a = dptr(a);
	g.b = dptr(b);
	g.d = dptr(out);
	int64_t bk = b1 ? b->shape[0] : b->shape[b->ndim - 2];
	int nb = out->ndim - (a1 ? 0 : 1) - (b1 ? 0 : 1);
	if (bk != g.k || nb < 0 || nb > KL_MAX_DIMS)
		return kl__err(ctx, KL_EINVAL,
		               "kl_matmul: node shapes do not form a product "
		               "(k %lld vs %lld)",
		               (long long)g.k, (long long)bk);
	int64_t batch[KL_MAX_DIMS], abs_[KL_MAX_DIMS], bbs[KL_MAX_DIMS], dbs[KL_MAX_DIMS];
	int64_t ostr[KL_MAX_DIMS];
	kl__contig_strides(out->ndim, out->shape, ostr);
	int an = a1 ? 0 : a->ndim - 2, bn = b1 ? 0 : b->ndim - 2;
	for (int i = 0; i < nb; i++) {
		int ai = i - (nb - an), bi = i - (nb - bn);
		batch[i] = out->shape[i];
		abs_[i] = ai >= 0 && a->shape[ai] != 1 ? a->strides[ai] : 0;
		bbs[i] = bi >= 0 && b->shape[bi] != 1 ? b->strides[bi] : 0;
		dbs[i] = ostr[i];
	}
	int64_t numel = kl__numel(out->ndim, out->shape);
	if (numel == 0)
		return KL_OK;
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	if (g.k == 0) /* an empty sum */
		return kl__cuda_memset(ctx, d, g.d, 0, (size_t)numel * kl_dtype_size(out->dtype));
	return kl__lt_matmul_nd(ctx, d, &g, nb, batch, abs_, bbs, dbs, dbs);
}

static kl_status cuda_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	if (n->op == KL_OP_MATMUL)
		return exec_matmul(ctx, n, in, out);
	/* Every other node needs a generated kernel, and the CUDA C renderer is
	 * not part of kiln yet: say so precisely instead of computing garbage. */
	return kl__err(ctx, KL_EUNSUPPORTED,
	               "kl_%s: eager execution on CUDA needs a generated kernel, and this kiln has "
	               "no CUDA C renderer yet (src/codegen); on CUDA only matmul runs today "
	               "(cuBLASLt)",
	               n->op < KL_NOPS ? kl__ops[n->op].name : "?");
}

const kl_backend kl__cuda_backend = {
        .name = "cuda",
        .alloc = cuda_alloc,
        .free = cuda_free,
        .exec = cuda_exec,
        .to_host = cuda_to_host,
        .from_host = cuda_from_host,
};

kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index)
{
	kl_cuda_dev *d = NULL;
	kl_status s = kl__cuda_dev_open(ctx, index, &d);
	if (s != KL_OK)
		return s;
	ctx->device = KL_CUDA;
	ctx->index = index;
	ctx->be = &kl__cuda_backend;
	ctx->backend_state = d;
	return KL_OK;
}

void kl__cuda_ctx_fini(kl_ctx *ctx)
{
	if (!ctx || !ctx->backend_state || ctx->be != &kl__cuda_backend)
		return;
	kl__cuda_dev_close(kl__cuda_dev_of(ctx));
	ctx->backend_state = NULL;
}
