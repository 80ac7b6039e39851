/* attention_mod.c - torch.nn.MultiheadAttention (batch first) as a kl_nn
 * module, on kiln.h's public API only. The attention itself is written as
 * one kl_sdpa call (causal as its flag), as kiln_nn.h documents.
 */
#include "nn/nn_int.h"

#include <math.h>
#include <string.h>

kl_status kl_nn_mha_init(kl_nn_mha *m, kl_ctx *ctx, int64_t d_model, int64_t n_heads,
                         kl_dtype dt, uint64_t seed)
{
	kl_status st = kl__nn_init_begin(m, sizeof *m, ctx, "kl_nn_mha_init", dt);
	if (st != KL_OK)
		return st;
	if (d_model < 1 || n_heads < 1 || d_model % n_heads != 0)
		return kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_init: d_model %lld is not a positive "
		                    "multiple of n_heads %lld", (long long)d_model,
		                    (long long)n_heads);
	m->base.kind = KL_NN_MHA;
	m->base.ctx = ctx;
	m->base.dtype = dt;
	m->d_model = d_model;
	m->n_heads = n_heads;
	/* xavier_uniform_ on [3d, d]: bound sqrt(6 / (fan_in + fan_out)) */
	double xb = sqrt(6.0 / (double)(d_model + 3 * d_model));
	st = kl__nn_uniform(ctx, &m->in_proj_weight, dt, 2, (int64_t[]){3 * d_model, d_model}, xb,
	                    kl__nn_seed(seed, 0));
	if (st == KL_OK)
		st = kl__nn_fill(ctx, &m->in_proj_bias, dt, 1, (int64_t[]){3 * d_model}, 0.0);
	/* out_proj: a Linear's weight init, its bias then zeroed (torch's
	 * _reset_parameters) */
	if (st == KL_OK)
		st = kl_nn_linear_init(&m->out_proj, ctx, d_model, d_model, false, dt,
		                       kl__nn_seed(seed, 1));
	if (st == KL_OK)
		st = kl__nn_fill(ctx, &m->out_proj.bias, dt, 1, &d_model, 0.0);
	return kl__nn_init_end(&m->base, st);
}

/* [B, T, d] -> [B, H, T, Dh] */
static kl_tensor *heads(kl_tensor *x, int64_t B, int64_t T, int64_t H, int64_t Dh)
{
	return kl_permute(kl_reshape(x, 4, (int64_t[]){B, T, H, Dh}), (int[]){0, 2, 1, 3});
}

kl_tensor *kl_nn_mha_forward(const kl_nn_mha *m, kl_tensor *query, kl_tensor *key,
                             kl_tensor *value, bool causal)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_MHA, "kl_nn_mha_forward", query))
		return NULL;
	kl_ctx *ctx = m->base.ctx;
	kl_tensor *in[3] = {query, key, value};
	const char *nm[3] = {"query", "key", "value"};
	int64_t d = m->d_model, H = m->n_heads, Dh = d / H;
	for (int i = 0; i < 3; i++) {
		if (!in[i]) {
			kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_forward: %s is NULL%s%s", nm[i],
			             kl_last_status(ctx) != KL_OK ? " after: " : "",
			             kl_last_status(ctx) != KL_OK ? kl_last_error(ctx) : "");
			return NULL;
		}
		if (kl_ndim(in[i]) != 3 || kl_dim(in[i], 2) != d) {
			char b[96];
			int n = kl_ndim(in[i]), k = snprintf(b, sizeof b, "[");
			for (int j = 0; j < n && k < (int)sizeof b; j++)
				k += snprintf(b + k, sizeof b - (size_t)k, "%s%lld", j ? "," : "",
				              (long long)kl_shape(in[i])[j]);
			if (k < (int)sizeof b)
				snprintf(b + k, sizeof b - (size_t)k, "]");
			kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_forward: %s has shape %s, need "
			             "[batch, seq, %lld] (batch first)", nm[i], b, (long long)d);
			return NULL;
		}
	}
	int64_t B = kl_dim(query, 0), T = kl_dim(query, 1), S = kl_dim(key, 1);
	if (kl_dim(key, 0) != B || kl_dim(value, 0) != B || kl_dim(value, 1) != S) {
		kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_forward: query [%lld,%lld,%lld], key "
		             "[%lld,%lld,%lld] and value [%lld,%lld,%lld] disagree on batch or "
		             "key length", (long long)B, (long long)T, (long long)d,
		             (long long)kl_dim(key, 0), (long long)S, (long long)d,
		             (long long)kl_dim(value, 0), (long long)kl_dim(value, 1), (long long)d);
		return NULL;
	}
	if (causal && T != S) {
		kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_forward: a causal mask needs query length "
		             "%lld equal to key length %lld", (long long)T, (long long)S);
		return NULL;
	}
	kl_scope_begin(ctx);
	kl_tensor *W = m->in_proj_weight, *b = m->in_proj_bias, *q, *k, *v;
	if (query == key && key == value) {
		/* self-attention: one product for q, k and v */
		kl_tensor *qkv = kl_linear(query, W, b); /* [B, T, 3d] */
		q = heads(kl_slice(qkv, 2, 0, d, 1), B, T, H, Dh);
		k = heads(kl_slice(qkv, 2, d, 2 * d, 1), B, T, H, Dh);
		v = heads(kl_slice(qkv, 2, 2 * d, 3 * d, 1), B, T, H, Dh);
	} else {
		kl_tensor *p[3];
		for (int i = 0; i < 3; i++)
			p[i] = kl_linear(in[i], kl_slice(W, 0, i * d, (i + 1) * d, 1),
			                 kl_slice(b, 0, i * d, (i + 1) * d, 1));
		q = heads(p[0], B, T, H, Dh);
		k = heads(p[1], B, S, H, Dh);
		v = heads(p[2], B, S, H, Dh);
	}
	/* one attention op (kiln_nn.h): fused forward, and its own gradient rule in
	 * training; the causal mask is a flag, so the sequence length may be a
	 * dynamic dim */
	kl_tensor *o = kl_sdpa(q, k, v, causal, 1.0 / sqrt((double)Dh)); /* [B, H, T, Dh] */
	o = kl_reshape(kl_permute(o, (int[]){0, 2, 1, 3}), 3, (int64_t[]){B, T, d});
	kl_retain(o);
	kl_scope_end(ctx);
	kl_tensor *y = kl_nn_linear_forward(&m->out_proj, o);
	kl_release(o);
	return y;
}

kl_tensor *kl_nn_mha_decode(const kl_nn_mha *m, kl_tensor *x, kl_tensor *k_cache,
                            kl_tensor *v_cache, kl_tensor *pos, kl_tensor *lengths)
{
	if (!kl__nn_is(m ? &m->base : NULL, KL_NN_MHA, "kl_nn_mha_decode", x))
		return NULL;
	kl_ctx *ctx = m->base.ctx;
	int64_t d = m->d_model, H = m->n_heads, Dh = d / H;
	kl_tensor *t[4] = {k_cache, v_cache, pos, lengths};
	const char *nm[4] = {"k_cache", "v_cache", "pos", "lengths"};
	for (int i = 0; i < 4; i++)
		if (!t[i]) {
			kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_decode: %s is NULL%s%s", nm[i],
			             kl_last_status(ctx) != KL_OK ? " after: " : "",
			             kl_last_status(ctx) != KL_OK ? kl_last_error(ctx) : "");
			return NULL;
		}
	if (kl_ndim(x) != 3 || kl_dim(x, 1) != 1 || kl_dim(x, 2) != d) {
		kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_decode: x has %d dims [%lld, %lld, ...], need "
		             "[batch, 1, %lld] (one token a row)", kl_ndim(x),
		             (long long)kl_dim(x, 0), kl_ndim(x) > 1 ? (long long)kl_dim(x, 1) : -1LL,
		             (long long)d);
		return NULL;
	}
	int64_t B = kl_dim(x, 0);
	for (int i = 0; i < 2; i++)
		if (kl_ndim(t[i]) != 4 || kl_dim(t[i], 0) < B || kl_dim(t[i], 1) != H ||
		    kl_dim(t[i], 3) != Dh) {
			kl_set_error(ctx, KL_EINVAL, "kl_nn_mha_decode: %s must be [rows >= %lld, %lld, "
			             "positions, %lld]; it has %d dims, rows %lld", nm[i], (long long)B,
			             (long long)H, (long long)Dh, kl_ndim(t[i]), (long long)kl_dim(t[i], 0));
			return NULL;
		}
	kl_scope_begin(ctx);
	kl_tensor *qkv = kl_linear(x, m->in_proj_weight, m->in_proj_bias); /* [B, 1, 3d] */
	kl_tensor *q = heads(kl_slice(qkv, 2, 0, d, 1), B, 1, H, Dh);
	kl_tensor *k = heads(kl_slice(qkv, 2, d, 2 * d, 1), B, 1, H, Dh);
	kl_tensor *v = heads(kl_slice(qkv, 2, 2 * d, 3 * d, 1), B, 1, H, Dh);
	kl_status st = kl_cache_write(k_cache, 2, pos, k);
	if (st == KL_OK)
		st = kl_cache_write(v_cache, 2, pos, v);
	kl_tensor *o = NULL;
	if (st == KL_OK) {
		kl_tensor *kr = kl_slice(k_cache, 0, 0, B, 1), *vr = kl_slice(v_cache, 0, 0, B, 1);
		o = kl_sdpa_lengths(q, kr, vr, lengths, false, 1.0 / sqrt((double)Dh));
		o = kl_reshape(kl_permute(o, (int[]){0, 2, 1, 3}), 3, (int64_t[]){B, 1, d});
	}
	kl_retain(o);
	kl_scope_end(ctx);
	if (!o)
		return NULL;
	kl_tensor *y = kl_nn_linear_forward(&m->out_proj, o);
	kl_release(o);
	return y;
}
