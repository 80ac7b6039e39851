/* backend.c - the kl_backend of KL_CUDA contexts: memory from the caching
 * allocator, host copies on the stream, and eager execution: matmul through
 * cuBLASLt, every other node through the same code generator as compiled
 * graphs (a one-node graph lowered with fusion off, compiled once per node
 * signature and kept in memory and in the disk cache).
 */
#include "backend/cuda/device.h"

#include <stdint.h>
#include <stdlib.h>

#include "runtime/rt.h"

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

/* ---- generated kernels for single nodes ---------------------------------------- */

/* compiled one-node programs by compile key: open addressing, power-of-two size */
typedef struct kl_eager_cache {
	uint64_t *keys;
	kl_compiled **vals;
	size_t cap, n;
} kl_eager_cache;

static void eager_cache_free(kl_eager_cache *ec)
{
	if (!ec)
		return;
	for (size_t i = 0; i < ec->cap; i++)
		kl__compiled_free(ec->vals[i]);
	free(ec->keys);
	free(ec->vals);
	free(ec);
}

static kl_compiled *eager_find(const kl_eager_cache *ec, uint64_t key)
{
	if (!ec || !ec->cap)
		return NULL;
	for (size_t i = key & (ec->cap - 1);; i = (i + 1) & (ec->cap - 1)) {
		if (!ec->vals[i])
			return NULL;
		if (ec->keys[i] == key)
			return ec->vals[i];
	}
}

static bool eager_put(kl_eager_cache *ec, uint64_t key, kl_compiled *c)
{
	if (2 * (ec->n + 1) > ec->cap) {
		size_t cap = ec->cap ? ec->cap * 2 : 64;
		uint64_t *k = calloc(cap, sizeof *k);
		kl_compiled **v = calloc(cap, sizeof *v);
		if (!k || !v) {
			free(k);
			free(v);
			return false;
		}
		for (size_t i = 0; i < ec->cap; i++) {
			if (!ec->vals[i])
				continue;
			size_t j = ec->keys[i] & (cap - 1);
			while (v[j])
				j = (j + 1) & (cap - 1);
			k[j] = ec->keys[i];
			v[j] = ec->vals[i];
		}
		free(ec->keys);
		free(ec->vals);
		ec->keys = k;
		ec->vals = v;
		ec->cap = cap;
	}
	size_t j = key & (ec->cap - 1);
	while (ec->vals[j])
		j = (j + 1) & (ec->cap - 1);
	ec->keys[j] = key;
	ec->vals[j] = c;
	ec->n++;
	return true;
}

/* The graph INPUT x (the geometry of each input tensor) -> n -> output. */
static kl_status one_node_graph(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_graph *g)
{
	kl__graph_init(g);
	for (int i = 0; i < n->nin; i++) {
		kl_node x;
		memset(&x, 0, sizeof x);
		x.op = KL_OP_INPUT;
		x.dtype = (uint8_t)in[i]->dtype;
		x.ndim = (uint8_t)in[i]->ndim;
		memcpy(x.shape, in[i]->shape, sizeof x.shape);
		memcpy(x.strides, in[i]->strides, sizeof x.strides);
		int32_t id = kl__graph_add(g, &x);
		if (id < 0 || kl__graph_add_input(g, id) != 0)
			return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
	}
	kl_node y = *n;
	for (int i = 0; i < n->nin; i++)
		y.in[i] = i;
	memset(y.strides, 0, sizeof y.strides);
	int32_t id = kl__graph_add(g, &y);
	if (id >= 0 && kl__ops[n->op].cat == KL_CAT_MOVEMENT && n->op != KL_OP_CONCAT &&
	    n->op != KL_OP_GATHER) {
		/* a view as a graph's output would alias its input: a cast to its
		 * own dtype makes the kernel that gathers it into out */
		kl_node c;
		memset(&c, 0, sizeof c);
		c.op = KL_OP_CAST;
		c.dtype = n->dtype;
		c.ndim = n->ndim;
		c.nin = 1;
		c.in[0] = id;
		memcpy(c.shape, n->shape, sizeof c.shape);
		id = kl__graph_add(g, &c);
	}
	if (id < 0 || kl__graph_add_output(g, id) != 0)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
	return KL_OK;
}

static kl_status exec_generated(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                                kl_tensor *out)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	kl_graph g;
	kl_status st = one_node_graph(ctx, n, in, &g);
	/* dense inputs' dims are symbols (sizes 0 and 1 stay specialized): one
	 * kernel serves every size of an op, dtype and layout */
	uint32_t masks[KL_NODE_MAX_IN];
	bool dyn = false;
	/* (a product with symbolic dims becomes a generated loop, not cuBLASLt;
	 * attention, its primitives: both stay static) */
	for (int i = 0; i < n->nin && n->op != KL_OP_MATMUL && n->op != KL_OP_ATTENTION; i++) {
		bool dense = kl__strides_contiguous(in[i]->ndim, in[i]->shape, in[i]->strides);
		masks[i] = dense && in[i]->ndim ? (uint32_t)((1ull << in[i]->ndim) - 1) : 0;
		dyn |= masks[i] != 0;
	}
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT,
	                      .fusion = false,
	                      .name = "eager",
	                      .dyn_masks = dyn ? masks : NULL};
	uint64_t key = 0;
	if (st == KL_OK)
		st = kl__compile_key(ctx, &g, &cfg, &key);
	kl_compiled *c = st == KL_OK ? eager_find(d->eager, key) : NULL;
	if (st == KL_OK && !c) {
		if (!d->eager && !(d->eager = calloc(1, sizeof *d->eager)))
			st = kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
		if (st == KL_OK && !(c = kl__compile(ctx, &g, &cfg)))
			st = kl_last_status(ctx);
		if (st == KL_OK && !eager_put(d->eager, key, c)) {
			kl__compiled_free(c);
			c = NULL;
			st = kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
		}
	}
	kl__graph_free(&g);
	if (st != KL_OK)
		return st;
	const kl_program *p = &c->prog;
	int64_t syms[KL_MAX_DIMS * 4] = {0};
	for (int32_t k = 0; k < p->nsyms; k++)
		syms[k] = in[p->sym_input[k]]->shape[p->sym_dim[k]];
	if (c->dynamic &&
	    memcmp(syms, c->plan_syms, sizeof(int64_t) * (size_t)p->nsyms) != 0) {
		kl_memplan mp;
		if (kl__memplan_build(p, syms, &mp) != KL_OK)
			return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
		kl__memplan_free(&c->plan);
		c->plan = mp;
		memcpy(c->plan_syms, syms, sizeof(int64_t) * (size_t)p->nsyms);
	}
	void *base = NULL;
	if ((st = kl__cuda_rt_arena(ctx, c, c->plan.arena_bytes, &base)) != KL_OK)
		return st;
	c->arena = base;
	void **B = calloc((size_t)p->nbufs + 1, sizeof *B);
	if (!B)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
	const kl_buf *alias = NULL;
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->role == KL_BUF_INPUT)
			B[b] = kl__tensor_data(in[bf->index]);
		else if (bf->role == KL_BUF_TEMP)
			B[b] = (char *)base + c->plan.off[b];
		else if (bf->alias < 0)
			B[b] = kl__tensor_data(out);
		else
			alias = bf;
	}
	st = kl__cuda_rt_run(ctx, c, (void *const *)B, syms);
	if (st == KL_OK && alias) {
		/* the result is a view of an input: out gets a copy, which only a
		 * dense view allows in one piece */
		const kl_buf *src = &p->bufs[alias->alias];
		int64_t dense[KL_MAX_DIMS], shape[KL_MAX_DIMS];
		bool ok = src->role == KL_BUF_INPUT;
		for (int i = 0; i < alias->ndim; i++)
			shape[i] = kl__dim_value(&alias->shape[i], syms);
		kl__contig_strides(alias->ndim, shape, dense);
		for (int i = 0; i < alias->ndim; i++)
			ok &= shape[i] == 1 || alias->view_strides[i] == dense[i];
		size_t es = kl_dtype_size(out->dtype);
		size_t bytes = (size_t)kl__numel(alias->ndim, shape) * es;
		if (!ok)
			st = kl__err(ctx, KL_EUNSUPPORTED,
			             "kl_%s: on CUDA the result is a strided view of an input, which "
			             "eager execution cannot copy",
			             kl__ops[n->op].name);
		else if (bytes)
			st = kl__cuda_d2d(ctx, d, (CUdeviceptr)(uintptr_t)kl__tensor_data(out),
			                  (CUdeviceptr)(uintptr_t)B[alias->alias] +
			                          (CUdeviceptr)(alias->view_offset * (int64_t)es),
			                  bytes);
	}
	free(B);
	return st;
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

kl_status kl__cuda_ctx_init(kl_ctx *ctx, int index)
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
	eager_cache_free(d->eager);
	d->eager = NULL;
	kl__cuda_dev_close(d);
	ctx->backend_state = NULL;
}
