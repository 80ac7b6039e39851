/* modules.c - the kl_nn modules but attention (attention_mod.c): Linear,
 * RMSNorm, LayerNorm, Embedding, the SwiGLU FeedForward and the DecoderLayer,
 * and the calls every module shares (parameters by name, load, save, free).
 * Only kiln.h's public API is used, as a user of the library would.
 *
 * A forward call runs all its ops but the last in a private scope, keeps the
 * last op's operands past it, and makes the last op outside: its result then
 * belongs to the caller's scope (or to the caller) exactly as an op's does.
 */
#include "nn/nn_int.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- shared helpers -------------------------------------------------------- */

uint64_t kl__nn_seed(uint64_t seed, uint64_t k)
{
	uint64_t z = seed + 0x9e3779b97f4a7c15ull * (k + 1);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

kl_status kl__nn_check_dtype(kl_ctx *ctx, const char *fn, kl_dtype dt)
{
	if (!ctx)
		return kl_set_error(NULL, KL_EINVAL, "%s: ctx is NULL", fn);
	if ((unsigned)dt >= KL_NDTYPES || !kl_dtype_is_float(dt))
		return kl_set_error(ctx, KL_EINVAL, "%s: parameters need a float dtype, not %s", fn,
		                    (unsigned)dt < KL_NDTYPES ? kl_dtype_name(dt) : "unknown");
	return KL_OK;
}

kl_status kl__nn_init_begin(void *m, size_t size, kl_ctx *ctx, const char *fn, kl_dtype dt)
{
	if (!m)
		return kl_set_error(ctx, KL_EINVAL, "%s: module is NULL", fn);
	memset(m, 0, size);
	return kl__nn_check_dtype(ctx, fn, dt);
}

kl_status kl__nn_init_end(kl_nn_module *m, kl_status st)
{
	if (st != KL_OK)
		kl_nn_free(m);
	return st;
}

/* t (made in the caller's private scope) kept in *slot past the scope */
static kl_status own(kl_ctx *ctx, kl_tensor **slot, kl_tensor *t)
{
	if (!t)
		return kl_last_status(ctx) != KL_OK ? kl_last_status(ctx) : KL_ENOMEM;
	*slot = kl_retain(t);
	return KL_OK;
}

kl_status kl__nn_uniform(kl_ctx *ctx, kl_tensor **slot, kl_dtype dt, int ndim,
                         const int64_t *shape, double bound, uint64_t seed)
{
	kl_dtype ct = dt == KL_F64 ? KL_F64 : KL_F32;
	kl_scope_begin(ctx);
	kl_tensor *r = kl_rand(ctx, ct, ndim, shape, seed);
	kl_tensor *u = kl_cast(kl_mul_scalar(kl_sub_scalar(r, 0.5), 2.0 * bound), dt);
	kl_status st = own(ctx, slot, u);
	kl_scope_end(ctx);
	return st;
}

kl_status kl__nn_fill(kl_ctx *ctx, kl_tensor **slot, kl_dtype dt, int ndim, const int64_t *shape,
                      double value)
{
	kl_scope_begin(ctx);
	kl_status st = own(ctx, slot, kl_full(ctx, dt, ndim, shape, value));
	kl_scope_end(ctx);
	return st;
}

bool kl__nn_is(const kl_nn_module *m, kl_nn_kind k, const char *fn, kl_tensor *x)
{
	if (m && m->kind == k && m->ctx)
		return true;
	kl_ctx *ctx = m && m->ctx ? m->ctx : x ? kl_tensor_ctx(x) : NULL;
	kl_set_error(ctx, KL_EINVAL, "%s: the module is %s", fn,
	             !m ? "NULL" : m->kind == 0 ? "not initialized" : "of another kind");
	return false;
}

static void header(kl_nn_module *m, kl_nn_kind k, kl_ctx *ctx, kl_dtype dt)
{
	m->kind = k;
	m->ctx = ctx;
	m->dtype = dt;
}

/* ---- Linear ------------------------------------------------------------------ */

kl_status kl_nn_linear_init(kl_nn_linear *m, kl_ctx *ctx, int64_t in_features,
                            int64_t out_features, bool bias, kl_dtype dt, uint64_t seed)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_linear_init", dt);
	if (st != KL_OK)
		return st;
	if (in_features < 1 || out_features < 1)
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_linear_init: in_features %lld and "
		                    "out_features %lld must be >= 1", (long long)in_features,
		                    (long long)out_features);
	header(&m->base, KL_NN_LINEAR, ctx, dt);
	m->in_features = in_features;
	m->out_features = out_features;
	/* kaiming_uniform_(a = sqrt(5)) gives bound 1/sqrt(fan_in), as does the bias */
	double bound = 1.0 / sqrt((double)in_features);
	st = kl__nn_uniform(ctx, &m->weight, dt, 2, (int64_t[]){out_features, in_features}, bound,
	                    kl__nn_seed(seed, 0));
	if (st == KL_OK && bias)
		st = kl__nn_uniform(ctx, &m->bias, dt, 1, &out_features, bound, kl__nn_seed(seed, 1));
	return kl__nn_init_end(&m->base, st);
}

kl_tensor *kl_nn_linear_forward(const kl_nn_linear *m, kl_tensor *x)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_LINEAR, "kl_nn_linear_forward", x))
		return NULL;
	return kl_linear(x, m->weight, m->bias);
}

/* ---- norms --------------------------------------------------------------------- */

kl_status kl_nn_rmsnorm_init(kl_nn_rmsnorm *m, kl_ctx *ctx, int64_t dim, double eps, kl_dtype dt)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_rmsnorm_init", dt);
	if (st != KL_OK)
		return st;
	if (dim < 1 || isnan(eps))
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_rmsnorm_init: dim %lld, eps %g",
		                    (long long)dim, eps);
	header(&m->base, KL_NN_RMSNORM, ctx, dt);
	m->dim = dim;
	m->eps = eps;
	st = kl__nn_fill(ctx, &m->weight, dt, 1, &dim, 1.0);
	return kl__nn_init_end(&m->base, st);
}

/* torch.finfo(dt).eps */
static double machine_eps(kl_dtype dt)
{
	switch (dt) {
	case KL_F64: return 0x1p-52;
	case KL_F16: return 0x1p-10;
	case KL_BF16: return 0x1p-7;
	default: return 0x1p-23;
	}
}

kl_tensor *kl_nn_rmsnorm_forward(const kl_nn_rmsnorm *m, kl_tensor *x)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_RMSNORM, "kl_nn_rmsnorm_forward", x))
		return NULL;
	double eps = m->eps >= 0 ? m->eps : machine_eps(x ? kl_tensor_dtype(x) : m->base.dtype);
	return kl_rms_norm(x, m->weight, eps);
}

kl_status kl_nn_layernorm_init(kl_nn_layernorm *m, kl_ctx *ctx, int64_t dim, double eps,
                               bool bias, kl_dtype dt)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_layernorm_init", dt);
	if (st != KL_OK)
		return st;
	if (dim < 1 || !(eps >= 0))
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_layernorm_init: dim %lld, eps %g",
		                    (long long)dim, eps);
	header(&m->base, KL_NN_LAYERNORM, ctx, dt);
	m->dim = dim;
	m->eps = eps;
	st = kl__nn_fill(ctx, &m->weight, dt, 1, &dim, 1.0);
	if (st == KL_OK && bias)
		st = kl__nn_fill(ctx, &m->bias, dt, 1, &dim, 0.0);
	return kl__nn_init_end(&m->base, st);
}

kl_tensor *kl_nn_layernorm_forward(const kl_nn_layernorm *m, kl_tensor *x)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_LAYERNORM, "kl_nn_layernorm_forward", x))
		return NULL;
	return kl_layer_norm(x, m->weight, m->bias, m->eps);
}

/* ---- Embedding ------------------------------------------------------------------ */

kl_status kl_nn_embedding_init(kl_nn_embedding *m, kl_ctx *ctx, int64_t num, int64_t dim,
                               kl_dtype dt, uint64_t seed)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_embedding_init", dt);
	if (st != KL_OK)
		return st;
	if (num < 1 || dim < 1)
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_embedding_init: num %lld and dim %lld "
		                    "must be >= 1", (long long)num, (long long)dim);
	header(&m->base, KL_NN_EMBEDDING, ctx, dt);
	m->num = num;
	m->dim = dim;
	kl_scope_begin(ctx);
	st = own(ctx, &m->weight,
	         kl_cast(kl_randn(ctx, dt == KL_F64 ? KL_F64 : KL_F32, 2, (int64_t[]){num, dim},
	                          kl__nn_seed(seed, 0)),
	                 dt));
	kl_scope_end(ctx);
	return kl__nn_init_end(&m->base, st);
}

kl_tensor *kl_nn_embedding_forward(const kl_nn_embedding *m, kl_tensor *idx)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_EMBEDDING, "kl_nn_embedding_forward", idx))
		return NULL;
	return kl_embedding(idx, m->weight);
}

/* ---- FeedForward ------------------------------------------------------------------ */

/* gate and up ([ffn, d] each) as the halves of one new [2 * ffn, d] buffer
 * *gu, and *vg, *vu: views of its halves (new references, in no scope) */
static kl_status ffn_pack(const kl_nn_ffn *m, kl_tensor *gate, kl_tensor *up, kl_tensor **gu,
                          kl_tensor **vg, kl_tensor **vu)
{
	kl_ctx *ctx = m->base.ctx;
	int64_t f = m->gate_proj.out_features;
	kl_scope_begin(ctx);
	kl_tensor *both[2] = {gate, up};
	kl_tensor *b = kl_concat(2, both, 0);
	kl_tensor *g = b ? kl_slice(b, 0, 0, f, 1) : NULL;
	kl_tensor *u = b ? kl_slice(b, 0, f, 2 * f, 1) : NULL;
	kl_status st = b && g && u ? KL_OK
	                           : kl_last_status(ctx) != KL_OK ? kl_last_status(ctx) : KL_ENOMEM;
	if (st == KL_OK) {
		*gu = kl_retain(b);
		*vg = kl_retain(g);
		*vu = kl_retain(u);
	}
	kl_scope_end(ctx);
	return st;
}

kl_status kl_nn_ffn_init(kl_nn_ffn *m, kl_ctx *ctx, int64_t d_model, int64_t ffn_dim,
                         kl_dtype dt, uint64_t seed)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_ffn_init", dt);
	if (st != KL_OK)
		return st;
	header(&m->base, KL_NN_FFN, ctx, dt);
	st = kl_nn_linear_init(&m->gate_proj, ctx, d_model, ffn_dim, false, dt,
	                       kl__nn_seed(seed, 0));
	if (st == KL_OK)
		st = kl_nn_linear_init(&m->up_proj, ctx, d_model, ffn_dim, false, dt,
		                       kl__nn_seed(seed, 1));
	if (st == KL_OK)
		st = kl_nn_linear_init(&m->down_proj, ctx, ffn_dim, d_model, false, dt,
		                       kl__nn_seed(seed, 2));
	kl_tensor *gu = NULL, *vg = NULL, *vu = NULL;
	if (st == KL_OK)
		st = ffn_pack(m, m->gate_proj.weight, m->up_proj.weight, &gu, &vg, &vu);
	if (st == KL_OK) {
		kl_release(m->gate_proj.weight);
		kl_release(m->up_proj.weight);
		m->gate_proj.weight = vg;
		m->up_proj.weight = vu;
		m->gate_up = gu;
	}
	return kl__nn_init_end(&m->base, st);
}

kl_tensor *kl_nn_ffn_forward(const kl_nn_ffn *m, kl_tensor *x)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_FFN, "kl_nn_ffn_forward", x))
		return NULL;
	kl_ctx *ctx = m->base.ctx;
	kl_scope_begin(ctx);
	/* the halves of gate_up sliced here, inside the (traced) forward: the
	 * graph then shows two products of x with adjacent rows of one buffer,
	 * which the compiler merges into one */
	int64_t f = m->gate_proj.out_features;
	kl_tensor *a = kl_mul(kl_silu(kl_linear(x, kl_slice(m->gate_up, 0, 0, f, 1), NULL)),
	                      kl_linear(x, kl_slice(m->gate_up, 0, f, 2 * f, 1), NULL));
	kl_retain(a);
	kl_scope_end(ctx);
	kl_tensor *y = kl_nn_linear_forward(&m->down_proj, a);
	kl_release(a);
	return y;
}

/* ---- DecoderLayer ------------------------------------------------------------------ */

kl_status kl_nn_decoder_init(kl_nn_decoder *m, kl_ctx *ctx, int64_t d_model, int64_t n_heads,
                             int64_t ffn_dim, kl_dtype dt, uint64_t seed)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_decoder_init", dt);
	if (st != KL_OK)
		return st;
	header(&m->base, KL_NN_DECODER, ctx, dt);
	st = kl_nn_rmsnorm_init(&m->norm1, ctx, d_model, -1, dt);
	if (st == KL_OK)
		st = kl_nn_rmsnorm_init(&m->norm2, ctx, d_model, -1, dt);
	if (st == KL_OK)
		st = kl_nn_mha_init(&m->attn, ctx, d_model, n_heads, dt, kl__nn_seed(seed, 0));
	if (st == KL_OK)
		st = kl_nn_ffn_init(&m->ffn, ctx, d_model, ffn_dim, dt, kl__nn_seed(seed, 1));
	return kl__nn_init_end(&m->base, st);
}

/* x + h, then the FeedForward half of the layer */
static kl_tensor *decoder_rest(const kl_nn_decoder *m, kl_tensor *x, kl_tensor *h)
{
	kl_ctx *ctx = m->base.ctx;
	kl_scope_begin(ctx);
	kl_tensor *x1 = kl_add(x, h);
	kl_tensor *h2 = kl_nn_ffn_forward(&m->ffn, kl_nn_rmsnorm_forward(&m->norm2, x1));
	kl_retain(x1);
	kl_retain(h2);
	kl_scope_end(ctx);
	kl_tensor *y = kl_add(x1, h2);
	kl_release(x1);
	kl_release(h2);
	return y;
}

kl_tensor *kl_nn_decoder_forward(const kl_nn_decoder *m, kl_tensor *x, bool causal)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_DECODER, "kl_nn_decoder_forward", x))
		return NULL;
	kl_ctx *ctx = m->base.ctx;
	kl_scope_begin(ctx);
	kl_tensor *h = kl_nn_rmsnorm_forward(&m->norm1, x);
	h = kl_nn_mha_forward(&m->attn, h, h, h, causal);
	kl_retain(h);
	kl_scope_end(ctx);
	kl_tensor *y = decoder_rest(m, x, h);
	kl_release(h);
	return y;
}

kl_tensor *kl_nn_decoder_decode(const kl_nn_decoder *m, kl_tensor *x, kl_tensor *k_cache,
                                kl_tensor *v_cache, kl_tensor *pos, kl_tensor *lengths)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_DECODER, "kl_nn_decoder_decode", x))
		return NULL;
	kl_ctx *ctx = m->base.ctx;
	kl_scope_begin(ctx);
	kl_tensor *h = kl_nn_rmsnorm_forward(&m->norm1, x);
	h = kl_nn_mha_decode(&m->attn, h, k_cache, v_cache, pos, lengths);
	kl_retain(h);
	kl_scope_end(ctx);
	if (!h)
		return NULL;
	kl_tensor *y = decoder_rest(m, x, h);
	kl_release(h);
	return y;
}

/* ---- parameters by name ------------------------------------------------------------ */

typedef struct plist {
	kl_nn_param *out;
	int cap, n;
} plist;

static void put(plist *p, const char *pre, const char *name, kl_tensor **slot, int ndim,
                int64_t d0, int64_t d1)
{
	if (p->n < p->cap) {
		kl_nn_param *q = &p->out[p->n];
		snprintf(q->name, sizeof q->name, "%s%s", pre, name);
		q->slot = slot;
		q->ndim = ndim;
		q->shape[0] = d0;
		q->shape[1] = d1;
	}
	p->n++;
}

static void sub(char *buf, size_t cap, const char *pre, const char *name)
{
	snprintf(buf, cap, "%s%s.", pre, name);
}

static bool collect(kl_nn_module *m, const char *pre, plist *p)
{
	char b[KL_NN_NAME_MAX];
	switch (m->kind) {
	case KL_NN_LINEAR: {
		kl_nn_linear *l = (kl_nn_linear *)m;
		put(p, pre, "weight", &l->weight, 2, l->out_features, l->in_features);
		if (l->bias)
			put(p, pre, "bias", &l->bias, 1, l->out_features, 0);
		return true;
	}
	case KL_NN_RMSNORM: {
		kl_nn_rmsnorm *r = (kl_nn_rmsnorm *)m;
		put(p, pre, "weight", &r->weight, 1, r->dim, 0);
		return true;
	}
	case KL_NN_LAYERNORM: {
		kl_nn_layernorm *l = (kl_nn_layernorm *)m;
		put(p, pre, "weight", &l->weight, 1, l->dim, 0);
		if (l->bias)
			put(p, pre, "bias", &l->bias, 1, l->dim, 0);
		return true;
	}
	case KL_NN_EMBEDDING: {
		kl_nn_embedding *e = (kl_nn_embedding *)m;
		put(p, pre, "weight", &e->weight, 2, e->num, e->dim);
		return true;
	}
	case KL_NN_MHA: {
		kl_nn_mha *a = (kl_nn_mha *)m;
		put(p, pre, "in_proj_weight", &a->in_proj_weight, 2, 3 * a->d_model, a->d_model);
		put(p, pre, "in_proj_bias", &a->in_proj_bias, 1, 3 * a->d_model, 0);
		sub(b, sizeof b, pre, "out_proj");
		return a->out_proj.base.kind == 0 || collect(&a->out_proj.base, b, p);
	}
	case KL_NN_FFN: {
		kl_nn_ffn *f = (kl_nn_ffn *)m;
		kl_nn_linear *ls[3] = {&f->gate_proj, &f->up_proj, &f->down_proj};
		const char *names[3] = {"gate_proj", "up_proj", "down_proj"};
		for (int i = 0; i < 3; i++) {
			sub(b, sizeof b, pre, names[i]);
			if (ls[i]->base.kind && !collect(&ls[i]->base, b, p))
				return false;
		}
		return true;
	}
	case KL_NN_DECODER: {
		kl_nn_decoder *d = (kl_nn_decoder *)m;
		kl_nn_module *ms[4] = {&d->norm1.base, &d->norm2.base, &d->attn.base, &d->ffn.base};
		const char *names[4] = {"norm1", "norm2", "attn", "ffn"};
		for (int i = 0; i < 4; i++) {
			sub(b, sizeof b, pre, names[i]);
			if (ms[i]->kind && !collect(ms[i], b, p))
				return false;
		}
		return true;
	}
	}
	return false;
}

int kl_nn_params(kl_nn_module *m, kl_nn_param *out, int cap)
{
	if (!m || m->kind == 0)
		return -1;
	plist p = {.out = out, .cap = out ? cap : 0};
	if (!collect(m, "", &p))
		return -1;
	return p.n;
}

#define MAX_PARAMS 64

void kl_nn_free(kl_nn_module *m)
{
	if (!m || m->kind == 0)
		return;
	kl_nn_param ps[MAX_PARAMS];
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	for (int i = 0; i < n && i < MAX_PARAMS; i++) {
		kl_release(*ps[i].slot);
		*ps[i].slot = NULL;
	}
	/* submodules are marked uninitialized too, then the module itself */
	switch (m->kind) {
	case KL_NN_MHA: ((kl_nn_mha *)m)->out_proj.base.kind = 0; break;
	case KL_NN_FFN: {
		kl_nn_ffn *f = (kl_nn_ffn *)m;
		f->gate_proj.base.kind = f->up_proj.base.kind = f->down_proj.base.kind = 0;
		kl_release(f->gate_up);
		f->gate_up = NULL;
		break;
	}
	case KL_NN_DECODER: {
		kl_nn_decoder *d = (kl_nn_decoder *)m;
		kl_release(d->ffn.gate_up);
		d->ffn.gate_up = NULL;
		d->norm1.base.kind = d->norm2.base.kind = d->attn.base.kind = 0;
		d->attn.out_proj.base.kind = d->ffn.base.kind = 0;
		d->ffn.gate_proj.base.kind = d->ffn.up_proj.base.kind = 0;
		d->ffn.down_proj.base.kind = 0;
		break;
	}
	default: break;
	}
	m->kind = 0;
}

/* ---- training ---------------------------------------------------------------------- */

/* The tensor the forward reads for parameter t: the FFN's gate and up
 * weights are views of its gate_up buffer, which the forward slices. */
static kl_tensor *read_by_forward(kl_nn_module *m, kl_tensor *t)
{
	kl_nn_ffn *f = m->kind == KL_NN_FFN       ? (kl_nn_ffn *)m
	               : m->kind == KL_NN_DECODER ? &((kl_nn_decoder *)m)->ffn
	                                          : NULL;
	if (f && f->gate_up && (t == f->gate_proj.weight || t == f->up_proj.weight))
		return f->gate_up;
	return t;
}

kl_status kl_nn_requires_grad(kl_nn_module *m, bool on)
{
	kl_nn_param ps[MAX_PARAMS];
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	if (n < 0 || n > MAX_PARAMS)
		return kl_set_error(m ? m->ctx : NULL, KL_EINVAL, "kl_nn_requires_grad: the module is %s",
		                    !m ? "NULL" : n < 0 ? "not initialized" : "too large");
	for (int i = 0; i < n; i++) {
		kl_status st = kl_set_requires_grad(read_by_forward(m, *ps[i].slot), on);
		if (st != KL_OK)
			return st;
	}
	return KL_OK;
}

void kl_nn_grad_clear(kl_nn_module *m)
{
	kl_nn_param ps[MAX_PARAMS];
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	for (int i = 0; i < n && i < MAX_PARAMS; i++)
		kl_grad_clear(read_by_forward(m, *ps[i].slot));
}

/* ---- optimizers over a module ------------------------------------------------------ */

static bool join_key(char *dst, size_t cap, const char *pre, const char *name);

static kl_optim *nn_optim(kl_nn_module *m, const char *prefix, const char *fn,
                          const kl_sgd_opts *so, const kl_adamw_opts *ao)
{
	kl_nn_param ps[MAX_PARAMS];
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	if (n < 1 || n > MAX_PARAMS) {
		kl_set_error(m ? m->ctx : NULL, KL_EINVAL, "%s: the module is %s", fn,
		             !m ? "NULL" : n < 0 ? "not initialized" : "too large");
		return NULL;
	}
	kl_tensor *ts[MAX_PARAMS];
	char keys[MAX_PARAMS][2 * KL_NN_NAME_MAX];
	const char *names[MAX_PARAMS];
	for (int i = 0; i < n; i++) {
		if (!join_key(keys[i], sizeof keys[i], prefix ? prefix : "", ps[i].name)) {
			kl_set_error(m->ctx, KL_EINVAL, "%s: prefix '%s' is too long", fn, prefix);
			return NULL;
		}
		names[i] = keys[i];
		ts[i] = *ps[i].slot;
	}
	return ao ? kl_optim_adamw(m->ctx, n, ts, names, ao) : kl_optim_sgd(m->ctx, n, ts, names, so);
}

kl_optim *kl_nn_adamw(kl_nn_module *m, const char *prefix, const kl_adamw_opts *opts)
{
	kl_adamw_opts d = kl_adamw_defaults();
	return nn_optim(m, prefix, "kl_nn_adamw", NULL, opts ? opts : &d);
}

kl_optim *kl_nn_sgd(kl_nn_module *m, const char *prefix, const kl_sgd_opts *opts)
{
	kl_sgd_opts d = kl_sgd_defaults();
	return nn_optim(m, prefix, "kl_nn_sgd", opts ? opts : &d, NULL);
}

/* ---- training mode ------------------------------------------------------------------ */

kl_status kl_nn_train(kl_nn_module *m, bool on)
{
	if (!m || m->kind == 0)
		return kl_set_error(m ? m->ctx : NULL, KL_EINVAL, "kl_nn_train: the module is %s",
		                    m ? "not initialized" : "NULL");
	kl_nn_module *subs[8];
	int k = 0;
	switch (m->kind) {
	case KL_NN_MHA: subs[k++] = &((kl_nn_mha *)m)->out_proj.base; break;
	case KL_NN_FFN: {
		kl_nn_ffn *f = (kl_nn_ffn *)m;
		subs[k++] = &f->gate_proj.base;
		subs[k++] = &f->up_proj.base;
		subs[k++] = &f->down_proj.base;
		break;
	}
	case KL_NN_DECODER: {
		kl_nn_decoder *d = (kl_nn_decoder *)m;
		subs[k++] = &d->norm1.base;
		subs[k++] = &d->norm2.base;
		subs[k++] = &d->attn.base;
		subs[k++] = &d->ffn.base;
		break;
	}
	default: break;
	}
	m->training = on;
	for (int i = 0; i < k; i++)
		if (subs[i]->kind)
			kl_nn_train(subs[i], on);
	return KL_OK;
}

bool kl_nn_is_training(const kl_nn_module *m)
{
	return m && m->kind && m->training;
}

/* ---- load and save --------------------------------------------------------------- */

static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
	size_t k = (size_t)snprintf(buf, cap, "[");
	for (int i = 0; i < ndim && k < cap; i++)
		k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? "," : "", (long long)shape[i]);
	if (k < cap)
		snprintf(buf + k, cap - k, "]");
	return buf;
}

/* pre + name into dst (cap bytes); false when it does not fit */
static bool join_key(char *dst, size_t cap, const char *pre, const char *name)
{
	size_t a = strlen(pre), b = strlen(name);
	if (a + b + 1 > cap)
		return false;
	memcpy(dst, pre, a);
	memcpy(dst + a, name, b + 1);
	return true;
}

static bool has_key(const kl_safetensors *st, const char *key)
{
	for (int i = 0; i < kl_safetensors_count(st); i++)
		if (strcmp(kl_safetensors_name(st, i), key) == 0)
			return true;
	return false;
}

/* The tensor for parameter p from st, as the module's dtype: a new
 * reference (in no scope), or NULL and an error naming the key. */
static kl_tensor *fetch(kl_nn_module *m, kl_safetensors *st, const char *key,
                        const kl_nn_param *p)
{
	kl_ctx *ctx = m->ctx;
	char b1[96], b2[96];
	if (!has_key(st, key)) {
		kl_set_error(ctx, KL_EINVAL, "kl_nn_load: missing key '%s' (a %s parameter of "
		             "shape %s)", key, kl_dtype_name(m->dtype),
		             shape_str(b1, sizeof b1, p->ndim, p->shape));
		return NULL;
	}
	kl_scope_begin(ctx);
	kl_tensor *t = kl_safetensors_get(st, key), *r = NULL;
	if (t && kl_tensor_ctx(t) != ctx) {
		kl_set_error(ctx, KL_EINVAL, "kl_nn_load: '%s': the file was opened on another "
		             "context than the module's", key);
	} else if (t) {
		bool same = kl_ndim(t) == p->ndim;
		for (int d = 0; same && d < p->ndim; d++)
			same = kl_shape(t)[d] == p->shape[d];
		if (!same)
			kl_set_error(ctx, KL_EINVAL, "kl_nn_load: '%s' has shape %s (%s), the "
			             "module needs %s (%s)", key,
			             shape_str(b1, sizeof b1, kl_ndim(t), kl_shape(t)),
			             kl_dtype_name(kl_tensor_dtype(t)),
			             shape_str(b2, sizeof b2, p->ndim, p->shape), kl_dtype_name(m->dtype));
		else if (!kl_dtype_is_float(kl_tensor_dtype(t)))
			kl_set_error(ctx, KL_EINVAL, "kl_nn_load: '%s' has dtype %s, the module "
			             "needs a float (%s)", key, kl_dtype_name(kl_tensor_dtype(t)),
			             kl_dtype_name(m->dtype));
		else
			r = kl_retain(kl_tensor_dtype(t) == m->dtype ? t : kl_cast(t, m->dtype));
	}
	kl_scope_end(ctx);
	return r;
}

kl_status kl_nn_load(kl_nn_module *m, kl_safetensors *st, const char *prefix)
{
	if (!m || m->kind == 0 || !m->ctx)
		return kl_set_error(m ? m->ctx : NULL, KL_EINVAL, "kl_nn_load: the module is %s",
		                    m ? "not initialized" : "NULL");
	kl_ctx *ctx = m->ctx;
	if (!st)
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_load: the safetensors file is NULL");
	kl_nn_param ps[MAX_PARAMS];
	kl_tensor *got[MAX_PARAMS] = {NULL};
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	if (n < 0 || n > MAX_PARAMS)
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_load: the module has %d parameters", n);
	const char *pre = prefix ? prefix : "";
	kl_status s = KL_OK;
	/* every tensor is fetched and checked before any parameter changes */
	for (int i = 0; i < n && s == KL_OK; i++) {
		char key[2 * KL_NN_NAME_MAX];
		if (!join_key(key, sizeof key, pre, ps[i].name)) {
			s = kl_set_error(ctx, KL_EINVAL, "kl_nn_load: prefix '%s' is too long", pre);
			break;
		}
		got[i] = fetch(m, st, key, &ps[i]);
		if (!got[i])
			s = kl_last_status(ctx) != KL_OK ? kl_last_status(ctx) : KL_EINVAL;
	}
	/* written in place (torch's load_state_dict copies into each parameter):
	 * an optimizer or a compiled function holding the parameters sees the
	 * loaded values, and a FeedForward's gate and up weights, views of its
	 * gate_up buffer, write into their halves of it */
	for (int i = 0; i < n; i++) {
		if (s == KL_OK)
			s = kl_copy(*ps[i].slot, got[i]);
		kl_release(got[i]);
	}
	return s;
}

kl_status kl_nn_save(kl_nn_module *m, const char *path, const char *prefix)
{
	if (!m || m->kind == 0 || !m->ctx)
		return kl_set_error(m ? m->ctx : NULL, KL_EINVAL, "kl_nn_save: the module is %s",
		                    m ? "not initialized" : "NULL");
	kl_nn_param ps[MAX_PARAMS];
	int n = kl_nn_params(m, ps, MAX_PARAMS);
	if (n < 0 || n > MAX_PARAMS)
		return kl_set_error(m->ctx, KL_EINVAL, "kl_nn_save: the module has %d parameters",
		                    n);
	char keys[MAX_PARAMS][2 * KL_NN_NAME_MAX];
	const char *names[MAX_PARAMS];
	kl_tensor *ts[MAX_PARAMS];
	for (int i = 0; i < n; i++) {
		if (!join_key(keys[i], sizeof keys[i], prefix ? prefix : "", ps[i].name))
			return kl_set_error(m->ctx, KL_EINVAL, "kl_nn_save: prefix '%s' is too long",
			                    prefix);
		names[i] = keys[i];
		ts[i] = *ps[i].slot;
	}
	return kl_safetensors_save(m->ctx, path, n, names, ts);
}
