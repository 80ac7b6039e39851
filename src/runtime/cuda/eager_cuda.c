/* eager_cuda.c - eager execution on CUDA of the nodes no library call
 * serves: a one-node graph lowered with fusion off, compiled once per node
 * signature and kept in memory (here, per context) and in the disk cache.
 * The backend reaches it through kl_cuda_hooks (kl__cuda_rt_hooks), which
 * also lends the NVRTC toolchain the disk cache.
 */
#include <stdint.h>
#include <stdlib.h>

#include "backend/cuda/device.h"
#include "runtime/runtime_int.h"


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
	 * attention and its backward, their primitives: all stay static) */
	/* index_add's masked sum ranges over its row count: static too */
	for (int i = 0; i < n->nin && n->op != KL_OP_MATMUL && n->op != KL_OP_ATTENTION &&
	                n->op != KL_OP_ATTENTION_BWD && n->op != KL_OP_INDEX_ADD;
	     i++) {
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
	kl_compiled *c = st == KL_OK ? eager_find((kl_eager_cache *)d->eager, key) : NULL;
	if (st == KL_OK && !c) {
		if (!d->eager && !(d->eager = calloc(1, sizeof(kl_eager_cache))))
			st = kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
		if (st == KL_OK && !(c = kl__compile(ctx, &g, &cfg)))
			st = kl_last_status(ctx);
		if (st == KL_OK && !eager_put((kl_eager_cache *)d->eager, key, c)) {
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
		if (kl__memplan_build(p, syms, c->lent, &mp) != KL_OK)
			return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
		kl__memplan_free(&c->plan);
		c->plan = mp;
		memcpy(c->plan_syms, syms, sizeof(int64_t) * (size_t)p->nsyms);
	}
	/* the temps' arena only for this run, back to the pool once the
	 * launches are queued (the pool's blocks are stream-ordered): a cached
	 * one-node program holds no device memory between calls, and one
	 * without temps takes none (each cached program kept a 512-byte block
	 * before: test_gpu_oom's 1536 bytes "in use" after three eager ops) */
	CUdeviceptr arena = 0;
	if (c->plan.arena_bytes &&
	    (st = kl__cuda_malloc(ctx, d, c->plan.arena_bytes, &arena)) != KL_OK)
		return st;
	void *base = (void *)(uintptr_t)arena;
	void **B = calloc((size_t)p->nbufs + 1, sizeof *B);
	if (!B) {
		if (arena)
			kl__cuda_free(ctx, d, arena);
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory", kl__ops[n->op].name);
	}
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
	st = kl__cuda_rt_run(ctx, c, (void *const *)B, syms, NULL, NULL, NULL, NULL, 0);
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
	if (arena)
		kl__cuda_free(ctx, d, arena);
	return st;
}

static void eager_free(kl_ctx *ctx)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	eager_cache_free((kl_eager_cache *)d->eager);
	d->eager = NULL;
}

const kl_cuda_hooks kl__cuda_rt_hooks = {
        .cache_dir = kl__cache_dir,
        .cache_get = kl__cache_get,
        .cache_put = kl__cache_put,
        .exec_generated = exec_generated,
        .eager_free = eager_free,
};
