/* bench_workloads.c - the workloads `kiln bench` measures: one table row each,
 * with a setup that makes random inputs of the row's dtype and sizes and
 * states the cost of one call, and a body that is one call. Adding a
 * workload is one row and its two functions; another size of one is a row.
 *
 * The CPU rows are f32 at sizes a two-core box with a few GiB holds; the
 * CUDA rows are those of ANCHORS.md (fp16/bf16, the sizes torch was timed
 * at), so that bench/peer_torch.py measures the very same problems.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools.h"

static const double NORM_EPS = 1e-5;

static kl_tensor *randn2(kl_ctx *ctx, kl_dtype dt, int64_t r, int64_t c, uint64_t seed)
{
	return kl_randn(ctx, dt, 2, (int64_t[]){r, c}, seed);
}

/* randn scaled by 1/sqrt(fan_in), so that products keep unit scale. */
static kl_tensor *randn_weight(kl_ctx *ctx, kl_dtype dt, int64_t out, int64_t in, uint64_t seed)
{
	kl_tensor *w = randn2(ctx, dt, out, in, seed);
	kl_tensor *s = kl_mul_scalar(w, 1.0 / sqrt((double)in));
	kl_release(w);
	return s;
}

static kl_status setup_status(kl_ctx *ctx, kl_tensor **in, int n)
{
	for (int i = 0; i < n; i++)
		if (!in[i])
			return kl_last_status(ctx);
	return KL_OK;
}

void *kt_state_user(kt_state *state)
{
	return state && (state->base.kind || state->opt || state->leaf[0] || state->nstack) ? state
	                                                                                   : NULL;
}

void kt_state_free(kt_state *state)
{
	if (!state)
		return;
	kl_optim_free(state->opt);
	for (int i = 0; i < 3; i++)
		kl_release(state->leaf[i]);
	if (state->base.kind)
		kl_nn_free(&state->base);
	for (int i = 0; i < state->nstack; i++) {
		kl_nn_free(&state->stack[i].base);
		kl_release(state->cache[2 * i]);
		kl_release(state->cache[2 * i + 1]);
	}
	memset(state, 0, sizeof *state);
}

static kl_status body_status(kl_ctx *ctx, kl_tensor **out)
{
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static double esize(const kt_workload *w)
{
	return (double)kl_dtype_size(w->dtype);
}

/* Rows and columns of the pointwise and row-wise workloads: dims[0] x dims[1]. */
static double matrix_bytes(const kt_workload *w)
{
	return (double)w->dims[0] * (double)w->dims[1] * esize(w);
}

static void shape_2d(const kt_workload *w, kt_cost *cost)
{
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lld", (long long)w->dims[0],
	         (long long)w->dims[1]);
}

/* ---- relu(a*b + c) ----------------------------------------------------------- */

static kl_status relu_fma_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	for (int i = 0; i < 3; i++)
		in[i] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 101 + (uint64_t)i);
	*cost = (kt_cost){.bytes = 4 * matrix_bytes(w),
	                  .flops = 3.0 * (double)w->dims[0] * (double)w->dims[1],
	                  .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 3);
}

static kl_status relu_fma_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	out[0] = kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
	return body_status(ctx, out);
}

/* ---- eight chained pointwise ops ------------------------------------------- */

/* y = tanh(relu(x * 1.1 + 0.5) * a - b) * 0.5 + x: scalar, tensor and unary
 * ops mixed, the kind of chain fusion turns into one pass over memory. */
static kl_status pointwise8_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                  kt_cost *cost)
{
	for (int i = 0; i < 3; i++)
		in[i] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 201 + (uint64_t)i);
	*cost = (kt_cost){.bytes = 4 * matrix_bytes(w),
	                  .flops = 8.0 * (double)w->dims[0] * (double)w->dims[1],
	                  .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 3);
}

static kl_status pointwise8_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                 int nout, void *user)
{
	kl_tensor *x = in[0], *a = in[1], *b = in[2];
	kl_tensor *t = kl_relu(kl_add_scalar(kl_mul_scalar(x, 1.1), 0.5));
	t = kl_tanh(kl_sub(kl_mul(t, a), b));
	out[0] = kl_add(kl_mul_scalar(t, 0.5), x);
	return body_status(ctx, out);
}

/* ---- row-wise: softmax, layer_norm, rms_norm ------------------------------- */

static kl_status softmax_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 301);
	*cost = (kt_cost){.bytes = 2 * matrix_bytes(w),
	                  .flops = 5.0 * (double)w->dims[0] * (double)w->dims[1],
	                  .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 1);
}

static kl_status softmax_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                              void *user)
{
	out[0] = kl_softmax(in[0], -1);
	return body_status(ctx, out);
}

static kl_status layer_norm_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                  kt_cost *cost)
{
	in[0] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 401);
	in[1] = kl_randn(ctx, w->dtype, 1, &w->dims[1], 402);
	in[2] = kl_randn(ctx, w->dtype, 1, &w->dims[1], 403);
	*cost = (kt_cost){.bytes = 2 * matrix_bytes(w) + 2.0 * (double)w->dims[1] * esize(w),
	                  .flops = 8.0 * (double)w->dims[0] * (double)w->dims[1],
	                  .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 3);
}

static kl_status layer_norm_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                 int nout, void *user)
{
	out[0] = kl_layer_norm(in[0], in[1], in[2], NORM_EPS);
	return body_status(ctx, out);
}

static kl_status rms_norm_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 501);
	in[1] = kl_randn(ctx, w->dtype, 1, &w->dims[1], 502);
	*cost = (kt_cost){.bytes = 2 * matrix_bytes(w) + (double)w->dims[1] * esize(w),
	                  .flops = 4.0 * (double)w->dims[0] * (double)w->dims[1],
	                  .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 2);
}

static kl_status rms_norm_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	out[0] = kl_rms_norm(in[0], in[1], NORM_EPS);
	return body_status(ctx, out);
}

/* The same math from primitives; compiled modes should match rms_norm. */
static kl_status rms_norm_prims_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                     int nout, void *user)
{
	kl_tensor *x = in[0];
	kl_tensor *ms = kl_mean(kl_mul(x, x), 1, (int[]){-1}, true);
	out[0] = kl_mul(kl_mul(x, kl_rsqrt(kl_add_scalar(ms, NORM_EPS))), in[1]);
	return body_status(ctx, out);
}

/* ---- contractions ------------------------------------------------------------- */

/* [m, k] @ [k, n]: dims m, k, n. */
static kl_status gemm_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	double m = (double)w->dims[0], k = (double)w->dims[1], n = (double)w->dims[2];
	in[0] = randn_weight(ctx, w->dtype, w->dims[0], w->dims[1], 601);
	in[1] = randn_weight(ctx, w->dtype, w->dims[1], w->dims[2], 602);
	*cost = (kt_cost){.bytes = (m * k + k * n + m * n) * esize(w),
	                  .flops = 2 * m * n * k,
	                  .memory_bound = false};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lld", (long long)w->dims[0],
	         (long long)w->dims[1], (long long)w->dims[2]);
	return setup_status(ctx, in, 2);
}

static kl_status gemm_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	out[0] = kl_matmul(in[0], in[1]);
	return body_status(ctx, out);
}

/* The seed's FeedForward (SwiGLU, no biases): down(silu(gate(x)) * up(x)),
 * x [batch, seq, dim], hidden width h: dims batch, seq, dim, h. */
static kl_status swiglu_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t b = w->dims[0], s = w->dims[1], d = w->dims[2], h = w->dims[3];
	in[0] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, s, d}, 701);
	in[1] = randn_weight(ctx, w->dtype, h, d, 702);
	in[2] = randn_weight(ctx, w->dtype, h, d, 703);
	in[3] = randn_weight(ctx, w->dtype, d, h, 704);
	double tok = (double)b * (double)s, dd = (double)d, hh = (double)h;
	*cost = (kt_cost){.bytes = (2 * tok * dd + 3 * dd * hh) * esize(w),
	                  .flops = 3 * 2 * tok * dd * hh + 5 * tok * hh,
	                  .memory_bound = false};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lld->%lld", (long long)b,
	         (long long)s, (long long)d, (long long)h);
	return setup_status(ctx, in, 4);
}

static kl_status swiglu_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	kl_tensor *x = in[0];
	kl_tensor *gate = kl_silu(kl_linear(x, in[1], NULL));
	kl_tensor *up = kl_linear(x, in[2], NULL);
	out[0] = kl_linear(kl_mul(gate, up), in[3], NULL);
	return body_status(ctx, out);
}

/* A stack of small layers, x = gelu(x W_i^T + b_i): launch overhead, not
 * arithmetic, is the cost (the reduce-overhead case). dims batch, width,
 * layers; inputs x, then W_i and b_i for each layer. */
enum { MLP_MAX_LAYERS = (KT_MAX_INPUTS - 1) / 2 };

static kl_status mlp_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t b = w->dims[0], d = w->dims[1], L = w->dims[2];
	if (L > MLP_MAX_LAYERS || 1 + 2 * L != w->nin)
		return kl_set_error(ctx, KL_EINVAL, "bench %s: %lld layers need %lld inputs, not %d",
		                    w->name, (long long)L, (long long)(1 + 2 * L), w->nin);
	in[0] = randn2(ctx, w->dtype, b, d, 801);
	for (int64_t i = 0; i < L; i++) {
		in[1 + 2 * i] = randn_weight(ctx, w->dtype, d, d, 802 + 2 * (uint64_t)i);
		kl_tensor *bias = kl_randn(ctx, w->dtype, 1, &d, 803 + 2 * (uint64_t)i);
		in[2 + 2 * i] = kl_mul_scalar(bias, 0.1);
		kl_release(bias);
	}
	double bb = (double)b, dd = (double)d, ll = (double)L;
	*cost = (kt_cost){.bytes = (2 * bb * dd + ll * (dd * dd + dd)) * esize(w),
	                  .flops = ll * (2 * bb * dd * dd + 2 * bb * dd),
	                  .memory_bound = false};
	snprintf(cost->shape, sizeof cost->shape, "%lldx(%lldx%lld)", (long long)L, (long long)b,
	         (long long)d);
	return setup_status(ctx, in, w->nin);
}

static kl_status mlp_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	kl_tensor *x = in[0];
	for (int i = 0; 2 * i + 2 < nin; i++)
		x = kl_gelu(kl_linear(x, in[1 + 2 * i], in[2 + 2 * i]));
	out[0] = x;
	return body_status(ctx, out);
}

/* ---- attention and the seed's DecoderLayer -------------------------------------- */

/* kl_sdpa over q, k, v [batch, heads, seq, head dim] (dims in that order),
 * scale 1/sqrt(head dim). FLOPs: the two products, 4 * B * H * T * T * D;
 * causal counts half of them (the masked half need not be computed). */
static kl_status attention_setup_causal(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                        kt_cost *cost, bool causal)
{
	int64_t b = w->dims[0], h = w->dims[1], t = w->dims[2], d = w->dims[3];
	for (int i = 0; i < 3; i++)
		in[i] = kl_randn(ctx, w->dtype, 4, (int64_t[]){b, h, t, d}, 1101 + (uint64_t)i);
	double qkv = (double)b * (double)h * (double)t * (double)d;
	*cost = (kt_cost){.bytes = 4 * qkv * esize(w),
	                  .flops = (causal ? 0.5 : 1.0) * 4 * qkv * (double)t,
	                  .memory_bound = false};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lldx%lld", (long long)b,
	         (long long)h, (long long)t, (long long)d);
	return setup_status(ctx, in, 3);
}

static kl_status attention_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	return attention_setup_causal(ctx, w, in, cost, false);
}

static kl_status attention_causal_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                        kt_cost *cost)
{
	return attention_setup_causal(ctx, w, in, cost, true);
}

static kl_status attention_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                int nout, void *user)
{
	out[0] = kl_sdpa(in[0], in[1], in[2], false, 1.0 / sqrt((double)kl_dim(in[0], -1)));
	return body_status(ctx, out);
}

static kl_status attention_causal_body(kl_ctx *ctx, kl_tensor *const *in, int nin,
                                       kl_tensor **out, int nout, void *user)
{
	out[0] = kl_sdpa(in[0], in[1], in[2], true, 1.0 / sqrt((double)kl_dim(in[0], -1)));
	return body_status(ctx, out);
}

static int64_t decoder_nparams(int64_t d, int64_t f)
{
	return 4 * d * d + 3 * d * f + 6 * d;
}

static kl_status no_state(kl_ctx *ctx, const kt_workload *w)
{
	return kl_set_error(ctx, KL_EINVAL,
	                    "bench %s: the harness keeps no state for this setup to make "
	                    "(kt_cost.state is NULL)",
	                    w->name);
}

/* The products' FLOPs of one DecoderLayer forward over n tokens in
 * sequences of t (d_model d, FeedForward width f): the in-projection 6nd^2,
 * attention 4ntd, the out-projection 2nd^2, the FeedForward 6ndf. */
static double decoder_flops(double n, double t, double d, double f)
{
	return 8 * n * d * d + 4 * n * t * d + 6 * n * d * f;
}

/* The seed's DecoderLayer (kiln_nn.h: pre-norm, RMSNorm, MultiheadAttention
 * with one fused in-projection, not causal as in the seed, SwiGLU
 * FeedForward), weights from kl_nn_decoder_init (PyTorch's initialization,
 * seeded) held by the run's module, x [batch, seq, d_model] the one input:
 * dims batch, seq, d_model, heads, ffn. FLOPs: the products only (the
 * in-projection 6Nd^2, attention 4BT^2d, out-projection 2Nd^2, the
 * FeedForward 6Ndf for N = B * T tokens): ANCHORS.md's 584 GFLOP. Bytes: x
 * read, the output written, every parameter read once. */
static kl_status decoder_setup_kind(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                    kt_cost *cost, bool memory_bound)
{
	int64_t b = w->dims[0], t = w->dims[1], d = w->dims[2], h = w->dims[3], f = w->dims[4];
	kt_state *state = cost->state;
	if (!state)
		return no_state(ctx, w);
	kl_status st = kl_nn_decoder_init(&state->decoder, ctx, d, h, f, w->dtype, 1201);
	if (st != KL_OK)
		return st;
	in[0] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, t, d}, 1202);
	double n = (double)b * (double)t, dd = (double)d;
	*cost = (kt_cost){.bytes = (2 * n * dd + (double)decoder_nparams(d, f)) * esize(w),
	                  .flops = decoder_flops(n, (double)t, dd, (double)f),
	                  .memory_bound = memory_bound,
	                  .state = state};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lld,h%lld,ffn%lld", (long long)b,
	         (long long)t, (long long)d, (long long)h, (long long)f);
	return setup_status(ctx, in, 1);
}

static kl_status decoder_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	return decoder_setup_kind(ctx, w, in, cost, false);
}

/* One token: every weight is read for two FLOPs a parameter, so the row
 * reports bandwidth (ANCHORS.md's 134 MB floor). */
static kl_status decoder_token_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                     kt_cost *cost)
{
	return decoder_setup_kind(ctx, w, in, cost, true);
}

static kl_status decoder_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user)
{
	const kt_state *state = user;
	if (!state)
		return kl_set_error(ctx, KL_EINVAL,
		                    "bench: the DecoderLayer body was given no module");
	out[0] = kl_nn_decoder_forward(&state->decoder, in[0], false);
	return body_status(ctx, out);
}

/* One decode step of a stack of KT_STACK DecoderLayers at batch b (issue
 * 23): a token a row attends over a KV cache (kl_nn_decoder_decode: the
 * new key and value written in place at position t - 1, attention over the
 * first t positions of a cache of 2t). dims: batch, t, d_model, heads, ffn;
 * inputs: x [b, 1, d], pos [b] (t - 1), lengths [b] (t). The caches are
 * state (as a server holds them), so a compiled step writes them in place.
 * Bytes: every weight once and the keys and values attended (the floor a
 * decode step cannot beat: its weights and cache read once). */
static kl_status decode_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t b = w->dims[0], t = w->dims[1], d = w->dims[2], h = w->dims[3], f = w->dims[4];
	kt_state *state = cost->state;
	if (!state)
		return no_state(ctx, w);
	for (int i = 0; i < KT_STACK; i++) {
		kl_status st = kl_nn_decoder_init(&state->stack[i], ctx, d, h, f, w->dtype,
		                                  1401 + (uint64_t)i);
		if (st != KL_OK)
			return st;
		state->nstack = i + 1;
		for (int j = 0; j < 2; j++) {
			kl_tensor *c = kl_randn(ctx, w->dtype, 4, (int64_t[]){b, h, 2 * t, d / h},
			                        1411 + 2 * (uint64_t)i + (uint64_t)j);
			if (!c)
				return kl_last_status(ctx);
			state->cache[2 * i + j] = c;
		}
	}
	int64_t *p = malloc(sizeof *p * (size_t)b);
	if (!p)
		return kl_set_error(ctx, KL_ENOMEM, "bench %s: out of memory", w->name);
	for (int64_t i = 0; i < b; i++)
		p[i] = t - 1;
	in[0] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, 1, d}, 1402);
	in[1] = kl_from_host(ctx, KL_I64, 1, &b, p, sizeof *p * (size_t)b);
	in[2] = in[1] ? kl_add_scalar(in[1], 1) : NULL;
	free(p);
	double dd = (double)d, n = (double)b;
	double wbytes = (double)decoder_nparams(d, f) * esize(w);
	double kv = 2 * n * (double)t * dd * esize(w);
	*cost = (kt_cost){.bytes = KT_STACK * (wbytes + kv) + 2 * n * dd * esize(w),
	                  .flops = KT_STACK * decoder_flops(n, (double)t, dd, (double)f),
	                  .memory_bound = true,
	                  .state = state};
	snprintf(cost->shape, sizeof cost->shape, "%dx(%lldx1x%lld,h%lld,ffn%lld,kv%lld)",
	         KT_STACK, (long long)b, (long long)d, (long long)h, (long long)f, (long long)t);
	return setup_status(ctx, in, 3);
}

static kl_status decode_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin;
	(void)nout;
	const kt_state *state = user;
	if (!state || !state->nstack)
		return kl_set_error(ctx, KL_EINVAL, "bench: the decode step was given no stack");
	kl_tensor *x = in[0];
	for (int i = 0; i < state->nstack && x; i++)
		x = kl_nn_decoder_decode(&state->stack[i], x, state->cache[2 * i],
		                         state->cache[2 * i + 1], in[1], in[2]);
	out[0] = x;
	return body_status(ctx, out);
}

/* GPT-2's block (issue 23): x + attn(ln1(x)), then + mlp(ln2(.)), attention
 * kl_sdpa causal over 12 heads of the fused qkv product, the MLP 4d wide
 * with tanh GELU; the weights are inputs 1..12 (so the dynamic mode marks
 * only x's batch and sequence). dims: batch, seq, d, heads. FLOPs: the
 * products (24 N d^2 for N tokens) and attention (4 B T^2 d, causal half). */
static kl_status gpt2_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t b = w->dims[0], t = w->dims[1], d = w->dims[2], h = w->dims[3];
	in[0] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, t, d}, 1301);
	const int64_t rows[12] = {1, 1, 3 * d, 3 * d, d, d, 1, 1, 4 * d, 4 * d, d, d};
	const int64_t cols[12] = {d, d, d, 0, d, 0, d, d, d, 0, 4 * d, 0};
	for (int i = 0; i < 12; i++) {
		bool vec = rows[i] == 1 || cols[i] == 0;
		int64_t n = rows[i] == 1 ? cols[i] : rows[i];
		double scale = vec ? 0.1 : 1.0 / sqrt((double)(i == 10 ? 4 * d : d));
		kl_tensor *r = vec ? kl_randn(ctx, w->dtype, 1, &n, 1302 + (uint64_t)i)
		                   : randn2(ctx, w->dtype, rows[i], cols[i], 1302 + (uint64_t)i);
		in[1 + i] = kl_add_scalar(kl_mul_scalar(r, scale), i == 0 || i == 6 ? 1.0 : 0.0);
		kl_release(r);
	}
	double n = (double)b * (double)t, dd = (double)d, tt = (double)t;
	*cost = (kt_cost){.bytes = (2 * n * dd + 12 * dd * dd) * esize(w),
	                  .flops = 24 * n * dd * dd + 2 * n * tt * dd};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lld,h%lld", (long long)b,
	         (long long)t, (long long)d, (long long)h);
	return setup_status(ctx, in, 13);
}

static kl_tensor *gpt2_heads(kl_tensor *qkv, int part, const int64_t *dims)
{
	int64_t b = dims[0], t = dims[1], d = dims[2], h = dims[3];
	kl_tensor *s = kl_slice(qkv, 2, part * d, (part + 1) * d, 1);
	return kl_permute(kl_reshape(s, 4, (int64_t[]){b, t, h, d / h}), (int[]){0, 2, 1, 3});
}

static kl_status gpt2_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                           int nout, void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	kl_tensor *x = in[0];
	/* GPT-2's heads are 64 wide (768 / 12) */
	int64_t dims[4] = {kl_dim(x, 0), kl_dim(x, 1), kl_dim(x, 2), kl_dim(x, 2) / 64};
	kl_tensor *qkv = kl_linear(kl_layer_norm(x, in[1], in[2], NORM_EPS), in[3], in[4]);
	kl_tensor *o = kl_sdpa(gpt2_heads(qkv, 0, dims), gpt2_heads(qkv, 1, dims),
	                       gpt2_heads(qkv, 2, dims), true, KL_SDPA_DEFAULT_SCALE);
	o = kl_reshape(kl_permute(o, (int[]){0, 2, 1, 3}), 3, (int64_t[]){dims[0], dims[1], dims[2]});
	kl_tensor *x1 = kl_add(x, kl_linear(o, in[5], in[6]));
	kl_tensor *f = kl_linear(kl_layer_norm(x1, in[7], in[8], NORM_EPS), in[9], in[10]);
	out[0] = kl_add(x1, kl_linear(kl_gelu_tanh(f), in[11], in[12]));
	return body_status(ctx, out);
}

/* ---- training: the seed's step, its optimizer, attention's backward --------- */

/* The seed's training step (its chapter, examples/train_decoder.c): the
 * DecoderLayer of decoder_layer (not causal), an MSE loss against a fixed
 * label, kl_backward, AdamW (lr 1e-4, torch's other defaults) over every
 * parameter, the gradients cleared. Inputs x and label [batch, seq, d_model];
 * out[0] the loss before the update. dims as decoder_layer's. FLOPs: three
 * times the forward's products (the backward computes two products for each
 * of the forward's); bytes: x and the label read, and per parameter the least
 * a step moves: read by the forward, its gradient written, then the update
 * (parameter, gradient and two moments read, parameter and moments written). */
static const double TRAIN_LR = 1e-4;

/* The DecoderLayer with its parameters marked and AdamW over them. */
static kl_status train_state(kl_ctx *ctx, const kt_workload *w, kt_state *state)
{
	int64_t d = w->dims[2], h = w->dims[3], f = w->dims[4];
	kl_status st = kl_nn_decoder_init(&state->decoder, ctx, d, h, f, w->dtype, 1201);
	if (st == KL_OK)
		st = kl_nn_requires_grad(&state->base, true);
	if (st != KL_OK)
		return st;
	kl_adamw_opts ao = kl_adamw_defaults();
	ao.lr = TRAIN_LR;
	state->opt = kl_nn_adamw(&state->base, NULL, &ao);
	return state->opt ? KL_OK : kl_last_status(ctx);
}

static kl_status train_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t b = w->dims[0], t = w->dims[1], d = w->dims[2], h = w->dims[3], f = w->dims[4];
	kt_state *state = cost->state;
	if (!state)
		return no_state(ctx, w);
	kl_status st = train_state(ctx, w, state);
	if (st != KL_OK)
		return st;
	in[0] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, t, d}, 1202);
	in[1] = kl_randn(ctx, w->dtype, 3, (int64_t[]){b, t, d}, 1203);
	double n = (double)b * (double)t, dd = (double)d;
	double p = (double)decoder_nparams(d, f);
	*cost = (kt_cost){.bytes = (2 * n * dd + 9 * p) * esize(w),
	                  .flops = 3 * decoder_flops(n, (double)t, dd, (double)f),
	                  .memory_bound = false,
	                  .state = state};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lld,h%lld,ffn%lld", (long long)b,
	         (long long)t, (long long)d, (long long)h, (long long)f);
	return setup_status(ctx, in, 2);
}

static kl_status train_forward_body(kl_ctx *ctx, kl_tensor *const *in, int nin,
                                    kl_tensor **out, int nout, void *user)
{
	kt_state *state = user;
	if (!state || !state->opt)
		return kl_set_error(ctx, KL_EINVAL, "bench: the training body was given no model");
	out[0] = kl_mse_loss(kl_nn_decoder_forward(&state->decoder, in[0], false), in[1]);
	return body_status(ctx, out);
}

static kl_status train_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	kl_status st = train_forward_body(ctx, in, nin, out, nout, user);
	if (st == KL_OK)
		st = kl_backward(out[0], NULL);
	kt_state *state = user;
	if (st == KL_OK)
		st = kl_optim_step(state->opt);
	kl_nn_grad_clear(&state->base);
	return st;
}

/* The fused AdamW alone over the DecoderLayer's parameters, each with a
 * fixed random gradient (inputs, in kl_nn_params' order): one step of
 * kl_optim_step_grads. Memory-bound: per element the parameter and both
 * moments read and written and the gradient read, 7 elements of the dtype.
 * out[0]: a one-row view of the first parameter after the step (a wait on
 * it waits for the step). */
static kl_status adamw_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	int64_t d = w->dims[2], f = w->dims[4];
	kt_state *state = cost->state;
	if (!state)
		return no_state(ctx, w);
	kl_status st = train_state(ctx, w, state);
	if (st != KL_OK)
		return st;
	int np = kl_optim_nparams(state->opt);
	if (np != w->nin)
		return kl_set_error(ctx, KL_EINVAL, "bench %s: the optimizer has %d parameters, "
		                    "the row %d inputs", w->name, np, w->nin);
	for (int i = 0; i < np; i++) {
		kl_tensor *p = kl_optim_param(state->opt, i);
		int64_t shape[8];
		int nd = kl_ndim(p);
		for (int k = 0; k < nd && k < 8; k++)
			shape[k] = kl_dim(p, k);
		kl_tensor *g = kl_randn(ctx, w->dtype, nd, shape, 1301 + (uint64_t)i);
		in[i] = g ? kl_mul_scalar(g, 1e-2) : NULL;
		kl_release(g);
	}
	double p = (double)decoder_nparams(d, f);
	*cost = (kt_cost){.bytes = 7 * p * esize(w),
	                  .flops = 12 * p,
	                  .memory_bound = true,
	                  .state = state};
	snprintf(cost->shape, sizeof cost->shape, "%.0f params,d%lld,ffn%lld", p, (long long)d,
	         (long long)f);
	return setup_status(ctx, in, np);
}

static kl_status adamw_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	kt_state *state = user;
	if (!state || !state->opt)
		return kl_set_error(ctx, KL_EINVAL, "bench: the AdamW body was given no optimizer");
	kl_status st = kl_optim_step_grads(state->opt, in);
	if (st != KL_OK)
		return st;
	out[0] = kl_slice(kl_optim_param(state->opt, 0), 0, 0, 1, 1);
	return body_status(ctx, out);
}

/* Attention forward and backward: q, k, v [batch, heads, seq, head dim]
 * leaves that require grad (kept in the state, as a model's parameters), the
 * cotangent of the output the input; one call clears their gradients, runs
 * kl_sdpa and kl_backward with that cotangent, and returns the output (the
 * gradients are left in .grad). FLOPs: 3.5 times the forward's (the backward
 * recomputes the scores and computes four products of the forward's size,
 * FlashAttention-2's count), causal half. Bytes: q, k, v, the output and its
 * cotangent read, the output and three gradients written. */
static kl_status attention_bwd_setup_causal(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                            kt_cost *cost, bool causal)
{
	int64_t b = w->dims[0], h = w->dims[1], t = w->dims[2], d = w->dims[3];
	int64_t shape[4] = {b, h, t, d};
	kt_state *state = cost->state;
	if (!state)
		return no_state(ctx, w);
	for (int i = 0; i < 3; i++) {
		state->leaf[i] = kl_randn(ctx, w->dtype, 4, shape, 1401 + (uint64_t)i);
		if (!state->leaf[i])
			return kl_last_status(ctx);
		kl_status st = kl_set_requires_grad(state->leaf[i], true);
		if (st != KL_OK)
			return st;
	}
	in[0] = kl_randn(ctx, w->dtype, 4, shape, 1404);
	double qkv = (double)b * (double)h * (double)t * (double)d;
	*cost = (kt_cost){.bytes = 9 * qkv * esize(w),
	                  .flops = 3.5 * (causal ? 0.5 : 1.0) * 4 * qkv * (double)t,
	                  .memory_bound = false,
	                  .state = state};
	snprintf(cost->shape, sizeof cost->shape, "%lldx%lldx%lldx%lld", (long long)b,
	         (long long)h, (long long)t, (long long)d);
	return setup_status(ctx, in, 1);
}

static kl_status attention_bwd_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                     kt_cost *cost)
{
	return attention_bwd_setup_causal(ctx, w, in, cost, false);
}

static kl_status attention_bwd_causal_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                            kt_cost *cost)
{
	return attention_bwd_setup_causal(ctx, w, in, cost, true);
}

static kl_status attention_bwd_run(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out,
                                   void *user, bool causal)
{
	kt_state *state = user;
	if (!state || !state->leaf[0])
		return kl_set_error(ctx, KL_EINVAL, "bench: the attention body was given no q, k, v");
	for (int i = 0; i < 3; i++)
		kl_grad_clear(state->leaf[i]);
	kl_tensor *q = state->leaf[0];
	out[0] = kl_sdpa(q, state->leaf[1], state->leaf[2], causal,
	                 1.0 / sqrt((double)kl_dim(q, -1)));
	kl_status st = body_status(ctx, out);
	return st == KL_OK ? kl_backward(out[0], in[0]) : st;
}

static kl_status attention_bwd_body(kl_ctx *ctx, kl_tensor *const *in, int nin,
                                    kl_tensor **out, int nout, void *user)
{
	return attention_bwd_run(ctx, in, out, user, false);
}

static kl_status attention_bwd_causal_body(kl_ctx *ctx, kl_tensor *const *in, int nin,
                                           kl_tensor **out, int nout, void *user)
{
	return attention_bwd_run(ctx, in, out, user, true);
}

/* ---- the device's copy ceiling ---------------------------------------------- */

/* A one-input concat is a plain copy that no pass turns into a view (a
 * compiled kl_contiguous of a dense input is one), so it measures a real
 * read + write of every byte. */
static kl_status copy_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, w->dtype, w->dims[0], w->dims[1], 901);
	*cost = (kt_cost){.bytes = 2 * matrix_bytes(w), .flops = 0, .memory_bound = true};
	shape_2d(w, cost);
	return setup_status(ctx, in, 1);
}

static kl_status copy_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	out[0] = kl_concat(1, in, 0);
	return body_status(ctx, out);
}

const kt_workload kt_copy_workload = {"memory_bandwidth",
                                      "compiled copy of a 1 GiB f16 tensor (2 GiB moved)",
                                      KT_ON_CUDA,
                                      KT_MODE_BIT(KT_MODE_DEFAULT),
                                      KL_F16,
                                      {32768, 16384},
                                      1,
                                      1,
                                      copy_setup,
                                      copy_body, NULL};

/* ---- the table ---------------------------------------------------------------- */

#define EAGER KT_MODE_BIT(KT_MODE_EAGER)
#define FUSED                                                                               \
	(KT_MODE_BIT(KT_MODE_EAGER) | KT_MODE_BIT(KT_MODE_DEFAULT) |                         \
	 KT_MODE_BIT(KT_MODE_REDUCE_OVERHEAD))
#define ALL (FUSED | KT_MODE_BIT(KT_MODE_MAX_AUTOTUNE))
#define SDPA (KT_MODE_BIT(KT_MODE_EAGER) | KT_MODE_BIT(KT_MODE_DEFAULT))
#define DYNAMIC (ALL | KT_MODE_BIT(KT_MODE_DYNAMIC))
#define TRAIN (ALL | KT_MODE_BIT(KT_MODE_COMPILED_FORWARD))
#define CPU KT_ON_CPU
#define GPU KT_ON_CUDA
/* the CPU's f16/bf16 rows (issue 22: within 1.5x of the f32 row of the same
 * workload and shape, bench/compare.py's "f16/f32" column): eager and
 * default only, the other modes run as default there anyway */
#define HALF (KT_MODE_BIT(KT_MODE_EAGER) | KT_MODE_BIT(KT_MODE_DEFAULT))

/* CUDA: max-autotune only where there is a matrix product to tune (and
 * gpu-check's time is short); one fused kl_sdpa has no launches for
 * reduce-overhead to save, so attention runs eager and default. The CPU runs
 * every mode (the last two as default). The FeedForward hidden width on the
 * CPU is ~8/3 * 512 rounded to a multiple of 64; the CPU DecoderLayer is the
 * seed's at a quarter of its width (ffn 4 * d_model as in the seed). */
const kt_workload kt_workloads[] = {
	{"relu_fma", "relu(a*b + c), 4096x4096 f32", CPU, ALL, KL_F32, {4096, 4096}, 3, 1,
	 relu_fma_setup, relu_fma_body, NULL},
	{"relu_fma", "relu(a*b + c), 4096x4096 f16", CPU, HALF, KL_F16, {4096, 4096}, 3, 1,
	 relu_fma_setup, relu_fma_body, NULL},
	{"relu_fma", "relu(a*b + c), 4096x4096 bf16", CPU, HALF, KL_BF16, {4096, 4096}, 3, 1,
	 relu_fma_setup, relu_fma_body, NULL},
	{"relu_fma", "relu(a*b + c), 4096x4096 f16", GPU, FUSED, KL_F16, {4096, 4096}, 3, 1,
	 relu_fma_setup, relu_fma_body, NULL},
	{"relu_fma", "relu(a*b + c), 8192x8192 f16", GPU, FUSED, KL_F16, {8192, 8192}, 3, 1,
	 relu_fma_setup, relu_fma_body, NULL},
	{"pointwise8", "tanh(relu(x*1.1 + 0.5)*a - b)*0.5 + x: 8 ops, 4096x4096 f32", CPU, ALL,
	 KL_F32, {4096, 4096}, 3, 1, pointwise8_setup, pointwise8_body, NULL},
	{"pointwise8", "tanh(relu(x*1.1 + 0.5)*a - b)*0.5 + x: 8 ops, 4096x4096 f16", GPU, FUSED,
	 KL_F16, {4096, 4096}, 3, 1, pointwise8_setup, pointwise8_body, NULL},
	{"softmax", "softmax over rows, 4096x4096 f32", CPU, ALL, KL_F32, {4096, 4096}, 1, 1,
	 softmax_setup, softmax_body, NULL},
	{"softmax", "softmax over rows, 4096x4096 f16", CPU, HALF, KL_F16, {4096, 4096}, 1, 1,
	 softmax_setup, softmax_body, NULL},
	{"softmax", "softmax over rows, 4096x4096 bf16", CPU, HALF, KL_BF16, {4096, 4096}, 1, 1,
	 softmax_setup, softmax_body, NULL},
	{"softmax", "softmax over rows, 16384x4096 bf16", GPU, FUSED, KL_BF16, {16384, 4096}, 1, 1,
	 softmax_setup, softmax_body, NULL},
	{"layer_norm", "layer_norm over rows with weight and bias, 4096x4096 f32", CPU, ALL, KL_F32,
	 {4096, 4096}, 3, 1, layer_norm_setup, layer_norm_body, NULL},
	{"layer_norm", "layer_norm over rows with weight and bias, 4096x4096 f16", CPU, HALF,
	 KL_F16, {4096, 4096}, 3, 1, layer_norm_setup, layer_norm_body, NULL},
	{"layer_norm", "layer_norm over rows with weight and bias, 4096x4096 bf16", CPU, HALF,
	 KL_BF16, {4096, 4096}, 3, 1, layer_norm_setup, layer_norm_body, NULL},
	{"layer_norm", "layer_norm over rows with weight and bias, 16384x4096 bf16", GPU, FUSED,
	 KL_BF16, {16384, 4096}, 3, 1, layer_norm_setup, layer_norm_body, NULL},
	{"rms_norm", "kl_rms_norm over rows with weight, 4096x4096 f32", CPU, ALL, KL_F32,
	 {4096, 4096}, 2, 1, rms_norm_setup, rms_norm_body, NULL},
	{"rms_norm", "kl_rms_norm over rows with weight, 16384x4096 bf16", GPU, FUSED, KL_BF16,
	 {16384, 4096}, 2, 1, rms_norm_setup, rms_norm_body, NULL},
	{"rms_norm_prims", "x * rsqrt(mean(x*x, -1) + eps) * w from primitives, 4096x4096 f32", CPU,
	 ALL, KL_F32, {4096, 4096}, 2, 1, rms_norm_setup, rms_norm_prims_body, NULL},
	{"rms_norm_prims", "x * rsqrt(mean(x*x, -1) + eps) * w from primitives, 16384x4096 bf16",
	 GPU, FUSED, KL_BF16, {16384, 4096}, 2, 1, rms_norm_setup, rms_norm_prims_body, NULL},
	{"sgemm", "matmul 2048x2048 @ 2048x2048 f32", CPU, ALL, KL_F32, {2048, 2048, 2048}, 2, 1,
	 gemm_setup, gemm_body, NULL},
	{"gemm", "matmul 8192x8192 @ 8192x8192 bf16 (the card's product ceiling)", GPU, ALL,
	 KL_BF16, {8192, 8192, 8192}, 2, 1, gemm_setup, gemm_body, NULL},
	{"swiglu_ffn", "SwiGLU feed-forward, x 4x128x512, hidden 1408, f32", CPU, ALL, KL_F32,
	 {4, 128, 512, 1408}, 4, 1, swiglu_setup, swiglu_body, NULL},
	{"swiglu_ffn", "SwiGLU feed-forward, x 4x128x512, hidden 1408, f16", CPU, HALF, KL_F16,
	 {4, 128, 512, 1408}, 4, 1, swiglu_setup, swiglu_body, NULL},
	{"swiglu_ffn", "SwiGLU feed-forward, x 4x128x512, hidden 1408, bf16", CPU, HALF, KL_BF16,
	 {4, 128, 512, 1408}, 4, 1, swiglu_setup, swiglu_body, NULL},
	{"swiglu_ffn", "SwiGLU feed-forward (the seed's FeedForward), x 4x1024x2048, hidden 8192, "
	               "bf16",
	 GPU, ALL, KL_BF16, {4, 1024, 2048, 8192}, 4, 1, swiglu_setup, swiglu_body, NULL},
	{"mlp24", "24 x (linear 256 + bias, exact gelu), batch 8, f32", CPU, ALL, KL_F32,
	 {8, 256, 24}, 49, 1, mlp_setup, mlp_body, NULL},
	{"mlp24", "24 x (linear 256 + bias, exact gelu), batch 8, f16", GPU, ALL, KL_F16,
	 {8, 256, 24}, 49, 1, mlp_setup, mlp_body, NULL},
	{"attention", "kl_sdpa, batch 2, 4 heads, seq 256, head dim 64, f32", CPU, ALL, KL_F32,
	 {2, 4, 256, 64}, 3, 1, attention_setup, attention_body, NULL},
	{"attention", "kl_sdpa, batch 4, 16 heads, seq 1024, head dim 128, bf16", GPU, SDPA,
	 KL_BF16, {4, 16, 1024, 128}, 3, 1, attention_setup, attention_body, NULL},
	{"attention_causal", "kl_sdpa causal, batch 2, 4 heads, seq 256, head dim 64, f32", CPU,
	 ALL, KL_F32, {2, 4, 256, 64}, 3, 1, attention_causal_setup, attention_causal_body, NULL},
	{"attention_causal", "kl_sdpa causal, batch 4, 16 heads, seq 1024, head dim 128, bf16",
	 GPU, SDPA, KL_BF16, {4, 16, 1024, 128}, 3, 1, attention_causal_setup,
	 attention_causal_body, NULL},
	{"decoder_layer", "the seed's DecoderLayer (small), x 2x64x256, 4 heads, ffn 1024, f32",
	 CPU, ALL, KL_F32, {2, 64, 256, 4, 1024}, 1, 1, decoder_setup, decoder_body, NULL},
	{"decoder_layer", "the seed's DecoderLayer (small), x 2x64x256, 4 heads, ffn 1024, f16",
	 CPU, HALF, KL_F16, {2, 64, 256, 4, 1024}, 1, 1, decoder_setup, decoder_body, NULL},
	{"decoder_layer", "the seed's DecoderLayer (small), x 2x64x256, 4 heads, ffn 1024, bf16",
	 CPU, HALF, KL_BF16, {2, 64, 256, 4, 1024}, 1, 1, decoder_setup, decoder_body, NULL},
	{"decoder_layer", "the seed's DecoderLayer, x 4x1024x2048, 16 heads, ffn 8192, bf16", GPU,
	 ALL, KL_BF16, {4, 1024, 2048, 16, 8192}, 1, 1, decoder_setup, decoder_body, NULL},
	{"decoder_token", "the DecoderLayer (small) on one token, x 1x1x256, 4 heads, ffn 1024, "
	                  "f32",
	 CPU, ALL, KL_F32, {1, 1, 256, 4, 1024}, 1, 1, decoder_token_setup, decoder_body, NULL},
	{"decoder_token", "the seed's DecoderLayer on one token, x 1x1x2048, 16 heads, ffn 8192, "
	                  "bf16",
	 GPU, FUSED, KL_BF16, {1, 1, 2048, 16, 8192}, 1, 1, decoder_token_setup, decoder_body, NULL},
	/* issue 23: a decode step over a KV cache, state written in place */
	{"decode_step", "4 DecoderLayers (small) on one token a row over a KV cache of 64, "
	                "batch 1, d 256, 4 heads, ffn 1024, f32",
	 CPU, ALL, KL_F32, {1, 64, 256, 4, 1024}, 3, 1, decode_setup, decode_body, NULL},
	{"decode_step", "4 of the seed's DecoderLayers on one token over a KV cache of 512, "
	                "batch 1, d 2048, 16 heads, ffn 8192, bf16",
	 GPU, FUSED, KL_BF16, {1, 512, 2048, 16, 8192}, 3, 1, decode_setup, decode_body, NULL},
	/* issue 23: the dynamic plan (batch and sequence symbolic, traced at
	 * another length) against the static plan at the same sizes */
	{"gpt2_block", "GPT-2 block, x 2x128x768, 12 heads, f32: static vs dynamic plan", CPU,
	 DYNAMIC, KL_F32, {2, 128, 768, 12}, 13, 1, gpt2_setup, gpt2_body, NULL},
	{"gpt2_block", "GPT-2 block, x 2x33x768, 12 heads, f32: static vs dynamic plan", CPU,
	 DYNAMIC, KL_F32, {2, 33, 768, 12}, 13, 1, gpt2_setup, gpt2_body, NULL},
	{"gpt2_block", "GPT-2 block, x 8x64x768, 12 heads, f32: static vs dynamic plan", CPU,
	 DYNAMIC, KL_F32, {8, 64, 768, 12}, 13, 1, gpt2_setup, gpt2_body, NULL},
	{"gpt2_block", "GPT-2 block, x 8x128x768, 12 heads, bf16: static vs dynamic plan", GPU,
	 DYNAMIC, KL_BF16, {8, 128, 768, 12}, 13, 1, gpt2_setup, gpt2_body, NULL},
	/* issue 21: training */
	{"train_decoder", "the seed's training step: DecoderLayer (small) x 2x32x256, 4 heads, "
	                  "ffn 1024, MSE loss, backward, AdamW lr 1e-4, f32",
	 CPU, TRAIN, KL_F32, {2, 32, 256, 4, 1024}, 2, 1, train_setup, train_body,
	 train_forward_body},
	{"train_decoder", "the seed's training step: DecoderLayer x 4x1024x2048, 16 heads, "
	                  "ffn 8192, MSE loss, backward, AdamW lr 1e-4, bf16",
	 GPU, TRAIN, KL_BF16, {4, 1024, 2048, 16, 8192}, 2, 1, train_setup, train_body,
	 train_forward_body},
	{"adamw", "the fused AdamW alone over the small DecoderLayer's 9 parameters, f32", CPU,
	 EAGER, KL_F32, {2, 32, 256, 4, 1024}, 9, 1, adamw_setup, adamw_body, NULL},
	{"adamw", "the fused AdamW alone over the DecoderLayer's 9 parameters (d 2048, ffn "
	          "8192), bf16",
	 GPU, EAGER, KL_BF16, {4, 1024, 2048, 16, 8192}, 9, 1, adamw_setup, adamw_body, NULL},
	{"attention_bwd", "kl_sdpa forward + backward, batch 2, 4 heads, seq 256, head dim 64, "
	                  "f32",
	 CPU, ALL, KL_F32, {2, 4, 256, 64}, 1, 1, attention_bwd_setup, attention_bwd_body, NULL},
	{"attention_bwd", "kl_sdpa forward + backward, batch 4, 16 heads, seq 1024, head dim "
	                  "128, bf16",
	 GPU, SDPA, KL_BF16, {4, 16, 1024, 128}, 1, 1, attention_bwd_setup, attention_bwd_body, NULL},
	{"attention_bwd_causal", "kl_sdpa causal forward + backward, batch 2, 4 heads, seq 256, "
	                         "head dim 64, f32",
	 CPU, ALL, KL_F32, {2, 4, 256, 64}, 1, 1, attention_bwd_causal_setup,
	 attention_bwd_causal_body, NULL},
	{"attention_bwd_causal", "kl_sdpa causal forward + backward, batch 4, 16 heads, seq 1024, "
	                         "head dim 128, bf16",
	 GPU, SDPA, KL_BF16, {4, 16, 1024, 128}, 1, 1, attention_bwd_causal_setup,
	 attention_bwd_causal_body, NULL},
};

const int kt_nworkloads = (int)(sizeof(kt_workloads) / sizeof(kt_workloads[0]));
