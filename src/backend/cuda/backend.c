/* backend.c - the kl_backend of KL_CUDA contexts: memory from the caching
 * allocator, host copies on the stream, and eager execution: matmul through
 * cuBLASLt, every other node through the same code generator as compiled
 * graphs, which the layers above lend (kl_cuda_hooks.exec_generated:
 * runtime/cuda/eager_cuda.c).
 */
#include "backend/cuda/device.h"

#include <stdint.h>
#include <stdlib.h>

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

static void cuda_memory(kl_ctx *ctx, kl_memory_usage *out, bool reset_peak)
{
	kl_pool *p = &kl__cuda_dev_of(ctx)->pool;
	if (reset_peak)
		kl__pool_reset_peak(p);
	*out = (kl_memory_usage){p->st.in_use, p->st.peak, p->st.reserved};
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

/* Nodes no library call serves: through the compiler, which the layers
 * above lend (kl_cuda_hooks.exec_generated). */
static kl_status exec_generated(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                                kl_tensor *out)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	if (!d->hooks.exec_generated)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: this CUDA context runs no generated kernels",
		               kl__ops[n->op].name);
	return d->hooks.exec_generated(ctx, n, in, out);
}

static kl_status cuda_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	if (n->op == KL_OP_MATMUL && in[0]->dtype != KL_I32 && in[0]->dtype != KL_I64 &&
	    in[0]->dtype != KL_BOOL) {
		kl_status st = exec_matmul(ctx, n, in, out);
		if (st != KL_EUNSUPPORTED && st != KL_EINVAL)
			return st;
		/* operands cuBLASLt cannot address: dense copies of both first */
		kl_clear_error(ctx);
		kl_tensor *dense[2] = {NULL, NULL};
		for (int i = 0; i < 2 && st != KL_OK; i++) {
			kl_node c;
			memset(&c, 0, sizeof c);
			c.op = KL_OP_CONTIGUOUS;
			c.dtype = (uint8_t)in[i]->dtype;
			c.ndim = (uint8_t)in[i]->ndim;
			c.nin = 1;
			memcpy(c.shape, in[i]->shape, sizeof c.shape);
			dense[i] = kl__tensor_alloc(ctx, in[i]->dtype, in[i]->ndim, in[i]->shape);
			if (!dense[i] || exec_generated(ctx, &c, &in[i], dense[i]) != KL_OK)
				break;
		}
		st = dense[0] && dense[1] && ctx->status == KL_OK ? exec_matmul(ctx, n, dense, out)
		                                                   : kl_last_status(ctx);
		for (int i = 0; i < 2; i++)
			if (dense[i])
				kl__tensor_discard(dense[i]);
		return st;
	}
	if (n->op == KL_OP_CACHE_WRITE)
		return kl__cuda_cache_write_eager(ctx, n, in, out);
	return exec_generated(ctx, n, in, out);
}

static kl_status cuda_synchronize(kl_ctx *ctx)
{
	return kl__cuda_sync(ctx, kl__cuda_dev_of(ctx));
}

const kl_backend kl__cuda_backend = {
        .name = "cuda",
        .alloc = cuda_alloc,
        .free = cuda_free,
        .exec = cuda_exec,
        .to_host = cuda_to_host,
        .from_host = cuda_from_host,
        .memory = cuda_memory,
        .synchronize = cuda_synchronize,
        .optim_step = kl__cuda_optim_step,
        .optim_table = kl__cuda_optim_table,
        .optim_launch = kl__cuda_optim_launch,
};

/* A library kiln needs for any real work, made ready at device open so
 * that a first call does not pay for it; when it fails the context still
 * opens, and the first use reports the library's error. */
static void open_library(kl_ctx *ctx, kl_status s, const char *what)
{
	if (s == KL_OK)
		return;
	kl__log(ctx, KL_LOG_STARTUP, "%s not ready at device open (%s): its first use says why",
	        what, kl_last_error(ctx));
	kl_clear_error(ctx);
}

kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index, const kl_cuda_hooks *hooks)
{
	kl_cuda_dev *d = NULL;
	double t0 = kl__now_ms();
	kl_status s = kl__cuda_dev_open(ctx, index, &d);
	if (s != KL_OK)
		return s;
	ctx->device = KL_CUDA;
	ctx->index = index;
	ctx->be = &kl__cuda_backend;
	ctx->backend_state = d;
	if (hooks)
		d->hooks = *hooks;
	double t1 = kl__now_ms();
	/* NVRTC names every kernel cache entry (kl__cuda_rt_identity), so even
	 * a process whose kernels all come from the disk cache loads it */
	open_library(ctx, kl__cuda_load_nvrtc(ctx), "NVRTC");
	double t2 = kl__now_ms();
	open_library(ctx, kl__lt_open(ctx, d), "cuBLASLt");
	double t3 = kl__now_ms();
	kl__log(ctx, KL_LOG_STARTUP,
	        "kl_ctx_new(cuda:%d) %.3f ms: driver and device %.3f ms, NVRTC %.3f ms, "
	        "cuBLASLt %.3f ms",
	        index, t3 - t0, t1 - t0, t2 - t1, t3 - t2);
	return KL_OK;
}

void kl__cuda_ctx_fini(kl_ctx *ctx)
{
	if (!ctx || !ctx->backend_state || ctx->be != &kl__cuda_backend)
		return;
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	if (d->hooks.eager_free)
		d->hooks.eager_free(ctx);
	d->eager = NULL;
	kl__cuda_dev_close(d);
	ctx->backend_state = NULL;
}

int kl__cuda_arch(const kl_ctx *ctx)
{
	if (!ctx || ctx->device != KL_CUDA || !ctx->backend_state)
		return 0;
	const kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	return d->cc_major * 10 + d->cc_minor;
}
