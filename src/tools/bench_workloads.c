/* bench_workloads.c - the workloads `kiln bench` measures: one table row each,
 * with a setup that makes random inputs and states the cost of one call, and
 * a body that is one call. Adding a workload is one row and its two functions.
 */
#include <math.h>

#include "tools.h"

/* Sizes fit a two-core box with a few GiB free: the largest workload keeps
 * six 64 MiB tensors alive at once in eager mode. */
enum {
	PW_ROWS = 4096, /* pointwise and row-wise workloads: PW_ROWS x PW_COLS */
	PW_COLS = 4096,
	GEMM_N = 2048,
	FFN_BATCH = 4,
	FFN_SEQ = 128,
	FFN_DIM = 512,
	FFN_HIDDEN = 1408 /* ~ 8/3 * FFN_DIM, rounded to a multiple of 64 */
};

static const double NORM_EPS = 1e-5;

static kl_tensor *randn2(kl_ctx *ctx, int64_t r, int64_t c, uint64_t seed)
{
	return kl_randn(ctx, KL_F32, 2, (int64_t[]){r, c}, seed);
}

/* randn scaled by 1/sqrt(fan_in), so that products keep unit scale. */
static kl_tensor *randn_weight(kl_ctx *ctx, int64_t out, int64_t in, uint64_t seed)
{
	kl_tensor *w = randn2(ctx, out, in, seed);
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

static kl_status body_status(kl_ctx *ctx, kl_tensor **out)
{
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static const double PW_BYTES = (double)PW_ROWS * PW_COLS * sizeof(float);

/* ---- relu(a*b + c) ----------------------------------------------------------- */

static kl_status relu_fma_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	for (int i = 0; i < 3; i++)
		in[i] = randn2(ctx, PW_ROWS, PW_COLS, 101 + (uint64_t)i);
	*cost = (kt_cost){
	        .bytes = 4 * PW_BYTES, .flops = 3.0 * PW_ROWS * PW_COLS, .memory_bound = true};
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
static kl_status pointwise8_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	for (int i = 0; i < 3; i++)
		in[i] = randn2(ctx, PW_ROWS, PW_COLS, 201 + (uint64_t)i);
	*cost = (kt_cost){
	        .bytes = 4 * PW_BYTES, .flops = 8.0 * PW_ROWS * PW_COLS, .memory_bound = true};
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

static kl_status softmax_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, PW_ROWS, PW_COLS, 301);
	*cost = (kt_cost){
	        .bytes = 2 * PW_BYTES, .flops = 5.0 * PW_ROWS * PW_COLS, .memory_bound = true};
	return setup_status(ctx, in, 1);
}

static kl_status softmax_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                              void *user)
{
	out[0] = kl_softmax(in[0], -1);
	return body_status(ctx, out);
}

static kl_status layer_norm_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, PW_ROWS, PW_COLS, 401);
	in[1] = kl_randn(ctx, KL_F32, 1, (int64_t[]){PW_COLS}, 402);
	in[2] = kl_randn(ctx, KL_F32, 1, (int64_t[]){PW_COLS}, 403);
	*cost = (kt_cost){.bytes = 2 * PW_BYTES + 2.0 * PW_COLS * sizeof(float),
	                  .flops = 8.0 * PW_ROWS * PW_COLS,
	                  .memory_bound = true};
	return setup_status(ctx, in, 3);
}

static kl_status layer_norm_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                 int nout, void *user)
{
	out[0] = kl_layer_norm(in[0], in[1], in[2], NORM_EPS);
	return body_status(ctx, out);
}

static kl_status rms_norm_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, PW_ROWS, PW_COLS, 501);
	in[1] = kl_randn(ctx, KL_F32, 1, (int64_t[]){PW_COLS}, 502);
	*cost = (kt_cost){.bytes = 2 * PW_BYTES + (double)PW_COLS * sizeof(float),
	                  .flops = 4.0 * PW_ROWS * PW_COLS,
	                  .memory_bound = true};
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

static kl_status sgemm_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	in[0] = randn2(ctx, GEMM_N, GEMM_N, 601);
	in[1] = randn2(ctx, GEMM_N, GEMM_N, 602);
	double n = GEMM_N;
	*cost = (kt_cost){
	        .bytes = 3 * n * n * sizeof(float), .flops = 2 * n * n * n, .memory_bound = false};
	return setup_status(ctx, in, 2);
}

static kl_status sgemm_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	out[0] = kl_matmul(in[0], in[1]);
	return body_status(ctx, out);
}

/* LLaMA-style feed-forward: (silu(x Wg^T) * (x Wu^T)) Wd^T, no biases. */
static kl_status swiglu_setup(kl_ctx *ctx, kl_tensor **in, kt_cost *cost)
{
	in[0] = kl_randn(ctx, KL_F32, 3, (int64_t[]){FFN_BATCH, FFN_SEQ, FFN_DIM}, 701);
	in[1] = randn_weight(ctx, FFN_HIDDEN, FFN_DIM, 702);
	in[2] = randn_weight(ctx, FFN_HIDDEN, FFN_DIM, 703);
	in[3] = randn_weight(ctx, FFN_DIM, FFN_HIDDEN, 704);
	double tok = (double)FFN_BATCH * FFN_SEQ, d = FFN_DIM, h = FFN_HIDDEN;
	*cost = (kt_cost){.bytes = (2 * tok * d + 3 * d * h) * sizeof(float),
	                  .flops = 3 * 2 * tok * d * h + 5 * tok * h,
	                  .memory_bound = false};
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

/* ---- the table ---------------------------------------------------------------- */

#define EAGER KT_MODE_BIT(KT_MODE_EAGER)
#define COMPILED                                                                            \
	(KT_MODE_BIT(KT_MODE_DEFAULT) | KT_MODE_BIT(KT_MODE_REDUCE_OVERHEAD) |                  \
	 KT_MODE_BIT(KT_MODE_MAX_AUTOTUNE))
#define ALL (EAGER | COMPILED)

const kt_workload kt_workloads[] = {
	{"relu_fma", "relu(a*b + c), 4096x4096 f32", ALL, 3, 1, relu_fma_setup, relu_fma_body},
	{"pointwise8", "tanh(relu(x*1.1 + 0.5)*a - b)*0.5 + x: 8 ops, 4096x4096 f32", ALL, 3, 1,
	 pointwise8_setup, pointwise8_body},
	{"softmax", "softmax over rows, 4096x4096 f32", ALL, 1, 1, softmax_setup, softmax_body},
	{"layer_norm", "layer_norm over rows with weight and bias, 4096x4096 f32", ALL, 3, 1,
	 layer_norm_setup, layer_norm_body},
	{"rms_norm", "kl_rms_norm over rows with weight, 4096x4096 f32", ALL, 2, 1,
	 rms_norm_setup, rms_norm_body},
	{"rms_norm_prims", "x * rsqrt(mean(x*x, -1) + eps) * w from primitives, 4096x4096 f32",
	 ALL, 2, 1, rms_norm_setup, rms_norm_prims_body},
	{"sgemm", "matmul 2048x2048 @ 2048x2048 f32", ALL, 2, 1, sgemm_setup, sgemm_body},
	{"swiglu_ffn", "SwiGLU feed-forward, x 4x128x512, hidden 1408, f32", ALL, 4, 1,
	 swiglu_setup, swiglu_body},
};

const int kt_nworkloads = (int)(sizeof(kt_workloads) / sizeof(kt_workloads[0]));
