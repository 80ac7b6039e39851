/* test_grad.c - autograd: the vector-Jacobian rules of the op table, the
 * reverse sweep, the tape, kl_backward's errors and a whole training step
 * compiled into one graph.
 *
 * The gradient checks are table-driven (`cases` below): each row names the
 * op whose rule it exercises, builds a small forward from public ops, and
 * is checked
 *   (a) the float64 reference's evaluation of the backward graph (the
 *       forward and kl_backward traced in f64, then kl__ref_eval) against
 *       central finite differences of the same reference forward, and
 *   (b) kiln's eager gradients, and (c) one compiled function computing every
 *       row's gradients, in f64 and f32 (and f16/bf16 for rows marked so),
 *       against (a), at the same input values.
 * test_table_covers_rules fails when an op whose descriptor has a rule has
 * no row; ops without one (sources, comparisons, argmax) are checked to stop
 * gradients with a clear error. Adding a rule = adding rows here.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/autodiff.h"
#include "graph/build.h"
#include "graph/optable.h"
#include "graph/partition.h"
#include "graph/reference.h"
#include "kltest.h"

static kl_ctx *ctx;

/* ---- the case table -------------------------------------------------------------- */

typedef struct shp {
	int nd;
	int64_t d[4];
} shp;

typedef struct gcase {
	const char *name;
	kl_op op; /* the op whose rule the row exercises */
	kltest_apply_fn f;
	int nin;
	shp s[3];
	kltest_range r[3];
	kltest_layout layout; /* of input 0 */
	bool no_fd;           /* at a tie or kink: finite differences are one-sided */
	bool low;             /* also checked in f16 and bf16 */
} gcase;

#define IN0 in[0]
#define IN1 in[1]
#define IN2 in[2]
#define F(fn, expr)                                                           \
	static kl_tensor *fn(kl_tensor *const *in, const void *p)             \
	{                                                                     \
		(void)p, (void)in;                                            \
		return (expr);                                                \
	}

static const int ax1[] = {1}, ax0[] = {0}, ax02[] = {0, 2};
static const int perm201[] = {2, 0, 1}, perm10[] = {1, 0};

F(f_add, kl_add(IN0, IN1))
F(f_add_s, kl_add_scalar(IN0, 1.5))
F(f_sub, kl_sub(IN0, IN1))
F(f_sub_s, kl_sub_scalar(IN0, 0.25))
F(f_mul, kl_mul(IN0, IN1))
F(f_mul_s, kl_mul_scalar(IN0, -3.0))
F(f_div, kl_div(IN0, IN1))
F(f_div_s, kl_div_scalar(IN0, 4.0))
F(f_pow, kl_pow(IN0, IN1))
F(f_pow_s, kl_pow_scalar(IN0, 2.5))
F(f_pow_3, kl_pow_scalar(IN0, 3.0))
F(f_max, kl_maximum(IN0, IN1))
F(f_min, kl_minimum(IN0, IN1))
F(f_max_s, kl_maximum_scalar(IN0, 0.3))
F(f_min_s, kl_minimum_scalar(IN0, -0.2))
F(f_neg, kl_neg(IN0))
F(f_abs, kl_abs(IN0))
F(f_exp, kl_exp(IN0))
F(f_log, kl_log(IN0))
F(f_sqrt, kl_sqrt(IN0))
F(f_rsqrt, kl_rsqrt(IN0))
F(f_sin, kl_sin(IN0))
F(f_cos, kl_cos(IN0))
F(f_tanh, kl_tanh(IN0))
F(f_sigmoid, kl_sigmoid(IN0))
F(f_relu, kl_relu(IN0))
F(f_gelu, kl_gelu(IN0))
F(f_gelu_tanh, kl_gelu_tanh(IN0))
F(f_silu, kl_silu(IN0))
F(f_where, kl_where(kl_gt_scalar(IN0, 0.0), IN0, IN1))
/* to f64 (the reference's own dtype, so that its finite differences are of
 * a smooth function): the gradient comes back cast to the input's dtype */
F(f_cast, kl_mul(kl_cast(IN0, KL_F64), kl_sin(kl_cast(IN0, KL_F64))))
F(f_clamp, kl_clamp(IN0, -0.5, 0.7))
F(f_sum1, kl_sum(IN0, 1, ax1, false))
F(f_sum_all, kl_sum(IN0, 0, NULL, false))
F(f_sum0, kl_sum(IN0, 1, ax0, true))
F(f_mean, kl_mean(IN0, 2, ax02, true))
F(f_max1, kl_max(IN0, 1, ax1, false))
F(f_min0, kl_min(IN0, 1, ax0, true))
F(f_max_all, kl_max(IN0, 0, NULL, false))
F(f_var1, kl_var(IN0, 1, ax1, 1, false))
F(f_var_all, kl_var(IN0, 0, NULL, 0, true))
F(f_reshape, kl_reshape(IN0, 2, (const int64_t[]){2, 6}))
F(f_permute, kl_permute(IN0, perm201))
F(f_transpose, kl_transpose(IN0, 0, 1))
F(f_expand, kl_expand(IN0, 3, (const int64_t[]){2, 3, 4}))
F(f_slice1, kl_slice(IN0, 0, 1, 4, 1))
F(f_slice2, kl_slice(IN0, 1, 1, 7, 2))
F(f_slice3, kl_slice(IN0, 1, 0, 8, 3))
F(f_slice_one, kl_slice(IN0, 0, 2, 3, 1))
F(f_concat0, kl_concat(2, (kl_tensor *const[]){IN0, IN1}, 0))
F(f_concat1, kl_concat(3, (kl_tensor *const[]){IN0, IN1, IN2}, 1))
F(f_contig, kl_contiguous(kl_permute(IN0, perm10)))
F(f_chain, kl_sum(kl_sigmoid(kl_mul(IN0, IN1)), 1, ax1, false))
F(f_reuse, kl_mul(kl_add(IN0, IN0), kl_exp(IN0))) /* x used three times: accumulation */

/* the rules of grad_other.c. Indices are built inside the forward (an int
 * input would be drawn in the checked float dtype): 4, 3, 2, 4, 3, 2 into a
 * table of 5 rows (repeats; rows 0 and 1 get no gradient), and the same as a
 * [2, 3] expand view (a non-contiguous index). */
static kl_tensor *idx_view(void)
{
	return kl_expand(kl_arange(ctx, KL_I64, 4, 1, -1), 2, (const int64_t[]){2, 3});
}
static kl_tensor *idx6(void)
{
	return kl_reshape(idx_view(), 1, (const int64_t[]){6});
}
F(f_matmul, kl_matmul(IN0, IN1))
F(f_linear, kl_linear(IN0, IN1, IN2))
F(f_softmax, kl_softmax(IN0, -1))
F(f_softmax0, kl_softmax(IN0, 0))
F(f_log_softmax, kl_log_softmax(IN0, 1))
F(f_ln, kl_layer_norm(IN0, IN1, IN2, 1e-5))
F(f_ln_w, kl_layer_norm(IN0, IN1, NULL, 1e-5))
F(f_ln_plain, kl_layer_norm(IN0, NULL, NULL, 1e-5))
F(f_ln_b, kl_layer_norm(IN0, NULL, IN1, 1e-5))
F(f_rms, kl_rms_norm(IN0, IN1, 1e-6))
F(f_rms_plain, kl_rms_norm(IN0, NULL, 1e-6))
F(f_sdpa, kl_sdpa(IN0, IN1, IN2, false, KL_SDPA_DEFAULT_SCALE))
F(f_sdpa_causal, kl_sdpa(IN0, IN1, IN2, true, 0.5))
/* one key/value head shared by three query heads (an expand of k and v) */
F(f_sdpa_heads, kl_sdpa(IN0, kl_expand(IN1, 4, (const int64_t[]){2, 3, 5, 4}),
                        kl_expand(IN2, 4, (const int64_t[]){2, 3, 5, 2}), true, 0.3))
/* the same with v's head dim q's: the fused backward (sdpa_bwd) */
F(f_sdpa_heads_d, kl_sdpa(IN0, kl_expand(IN1, 4, (const int64_t[]){2, 3, 5, 4}),
                          kl_expand(IN2, 4, (const int64_t[]){2, 3, 5, 4}), true, 0.3))
/* lengths {4, 1} causal (batch 1's first two queries see no key: 0) and
 * {5, 0} (batch 1 sees none) */
F(f_sdpa_len_causal, kl_sdpa_lengths(IN0, IN1, IN2, kl_arange(ctx, KL_I64, 4, -2, -3), true, 0.5))
F(f_sdpa_len, kl_sdpa_lengths(IN0, IN1, IN2, kl_arange(ctx, KL_I32, 5, -1, -5), false, 0))
F(f_gather, kl_gather(IN0, idx6()))
F(f_embedding, kl_embedding(idx_view(), IN0))
F(f_index_add, kl_index_add(IN0, idx6(), IN1))
F(f_logsumexp, kl_logsumexp(IN0, 1, ax1, false))
F(f_logsumexp_all, kl_logsumexp(IN0, 0, NULL, true))

#define S1(a) {1, {a}}
#define S2(a, b) {2, {a, b}}
#define S3(a, b, c) {3, {a, b, c}}
#define S4(a, b, c, d) {4, {a, b, c, d}}
#define S0 {0, {0}}
#define N KLTEST_NORMAL
#define P KLTEST_POS
#define T KLTEST_SMALLINT
#define CG KLTEST_CONTIG
#define PM KLTEST_PERMUTED
#define ST KLTEST_STRIDED

static const gcase cases[] = {
	{"add", KL_OP_ADD, f_add, 2, {S2(3, 4), S1(4)}, {N, N}, CG, false, true},
	{"add_scalar", KL_OP_ADD, f_add_s, 1, {S2(2, 3)}, {N}, PM, false, false},
	{"add_0dim", KL_OP_ADD, f_add, 2, {S0, S1(3)}, {N, N}, CG, false, false},
	{"sub", KL_OP_SUB, f_sub, 2, {S3(2, 1, 3), S2(4, 1)}, {N, N}, CG, false, true},
	{"sub_scalar", KL_OP_SUB, f_sub_s, 1, {S1(5)}, {N}, ST, false, false},
	{"mul", KL_OP_MUL, f_mul, 2, {S2(3, 4), S2(3, 1)}, {N, N}, ST, false, true},
	{"mul_scalar", KL_OP_MUL, f_mul_s, 1, {S2(3, 2)}, {N}, CG, false, false},
	{"mul_empty", KL_OP_MUL, f_mul, 2, {S2(0, 3), S1(3)}, {N, N}, CG, false, false},
	{"div", KL_OP_DIV, f_div, 2, {S2(3, 4), S1(4)}, {N, P}, CG, false, true},
	{"div_scalar", KL_OP_DIV, f_div_s, 1, {S2(3, 3)}, {N}, CG, false, false},
	{"pow", KL_OP_POW, f_pow, 2, {S2(3, 4), S1(4)}, {P, N}, CG, false, false},
	{"pow_scalar", KL_OP_POW, f_pow_s, 1, {S2(2, 3)}, {P}, PM, false, true},
	{"pow_cube", KL_OP_POW, f_pow_3, 1, {S1(7)}, {N}, CG, false, false},
	{"maximum", KL_OP_MAXIMUM, f_max, 2, {S2(3, 4), S1(4)}, {N, N}, CG, false, true},
	{"maximum_ties", KL_OP_MAXIMUM, f_max, 2, {S2(3, 5), S2(3, 5)}, {T, T}, CG, true, false},
	{"maximum_scalar", KL_OP_MAXIMUM, f_max_s, 1, {S2(3, 3)}, {N}, CG, false, false},
	{"minimum", KL_OP_MINIMUM, f_min, 2, {S2(3, 4), S2(3, 1)}, {N, N}, PM, false, false},
	{"minimum_ties", KL_OP_MINIMUM, f_min, 2, {S1(9), S1(9)}, {T, T}, CG, true, false},
	{"minimum_scalar", KL_OP_MINIMUM, f_min_s, 1, {S2(3, 3)}, {N}, CG, false, false},
	{"neg", KL_OP_NEG, f_neg, 1, {S2(5, 3)}, {N}, PM, false, false},
	{"abs", KL_OP_ABS, f_abs, 1, {S2(5, 3)}, {N}, PM, false, false},
	{"exp", KL_OP_EXP, f_exp, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"exp_one", KL_OP_EXP, f_exp, 1, {S1(1)}, {N}, CG, false, false},
	{"log", KL_OP_LOG, f_log, 1, {S2(5, 3)}, {P}, PM, false, true},
	{"sqrt", KL_OP_SQRT, f_sqrt, 1, {S2(5, 3)}, {P}, ST, false, false},
	{"rsqrt", KL_OP_RSQRT, f_rsqrt, 1, {S2(5, 3)}, {P}, PM, false, false},
	{"sin", KL_OP_SIN, f_sin, 1, {S2(5, 3)}, {N}, PM, false, false},
	{"cos", KL_OP_COS, f_cos, 1, {S2(5, 3)}, {N}, PM, false, false},
	{"tanh", KL_OP_TANH, f_tanh, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"sigmoid", KL_OP_SIGMOID, f_sigmoid, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"relu", KL_OP_RELU, f_relu, 1, {S2(5, 3)}, {N}, PM, false, false},
	{"gelu", KL_OP_GELU, f_gelu, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"gelu_tanh", KL_OP_GELU_TANH, f_gelu_tanh, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"silu", KL_OP_SILU, f_silu, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"where", KL_OP_WHERE, f_where, 2, {S2(3, 4), S1(4)}, {N, N}, CG, false, false},
	{"cast", KL_OP_CAST, f_cast, 1, {S2(2, 3)}, {N}, CG, false, false},
	{"clamp", KL_OP_CLAMP, f_clamp, 1, {S2(4, 4)}, {N}, ST, false, false},
	{"sum_axis", KL_OP_SUM, f_sum1, 1, {S3(3, 4, 2)}, {N}, PM, false, true},
	{"sum_all", KL_OP_SUM, f_sum_all, 1, {S1(5)}, {N}, CG, false, false},
	{"sum_empty", KL_OP_SUM, f_sum0, 1, {S2(0, 3)}, {N}, CG, false, false},
	{"mean", KL_OP_MEAN, f_mean, 1, {S3(3, 4, 2)}, {N}, CG, false, true},
	{"max_axis", KL_OP_MAX, f_max1, 1, {S2(3, 5)}, {N}, CG, false, false},
	{"max_ties", KL_OP_MAX, f_max_all, 1, {S2(3, 4)}, {T}, CG, true, false},
	{"min_axis", KL_OP_MIN, f_min0, 1, {S2(4, 3)}, {N}, ST, false, false},
	{"var", KL_OP_VAR, f_var1, 1, {S2(3, 5)}, {N}, CG, false, true},
	{"var_pop", KL_OP_VAR, f_var_all, 1, {S1(7)}, {N}, CG, false, false},
	{"reshape", KL_OP_RESHAPE, f_reshape, 1, {S2(3, 4)}, {N}, PM, false, false},
	{"permute", KL_OP_PERMUTE, f_permute, 1, {S3(2, 3, 4)}, {N}, CG, false, false},
	{"transpose", KL_OP_PERMUTE, f_transpose, 1, {S2(3, 5)}, {N}, ST, false, false},
	{"expand", KL_OP_EXPAND, f_expand, 1, {S2(3, 1)}, {N}, CG, false, true},
	{"slice", KL_OP_SLICE, f_slice1, 1, {S2(5, 4)}, {N}, PM, false, false},
	{"slice_step2", KL_OP_SLICE, f_slice2, 1, {S2(3, 7)}, {N}, CG, false, true},
	{"slice_step3", KL_OP_SLICE, f_slice3, 1, {S2(2, 8)}, {N}, ST, false, false},
	{"slice_one", KL_OP_SLICE, f_slice_one, 1, {S2(4, 3)}, {N}, CG, false, false},
	{"concat", KL_OP_CONCAT, f_concat0, 2, {S2(2, 3), S2(1, 3)}, {N, N}, CG, false, false},
	{"concat3", KL_OP_CONCAT, f_concat1, 3, {S2(2, 2), S2(2, 3), S2(2, 1)}, {N, N, N}, PM, false,
	 false},
	{"contiguous", KL_OP_CONTIGUOUS, f_contig, 1, {S2(3, 4)}, {N}, CG, false, false},
	{"chain", KL_OP_SIGMOID, f_chain, 2, {S2(3, 4), S1(4)}, {N, N}, CG, false, true},
	{"reuse", KL_OP_ADD, f_reuse, 1, {S2(2, 3)}, {N}, CG, false, false},
	{"matmul", KL_OP_MATMUL, f_matmul, 2, {S2(3, 4), S2(4, 5)}, {N, N}, PM, false, true},
	{"matmul_batch_bcast", KL_OP_MATMUL, f_matmul, 2, {S3(2, 3, 4), S2(4, 5)}, {N, N}, ST, false,
	 false},
	/* sums over the batch of products (decompose.c folds each into one
	 * product with k = batch * k, swapped where a transpose follows) */
	{"linear_4d", KL_OP_MATMUL, f_linear, 3, {S4(2, 1, 3, 4), S2(5, 4), S1(5)}, {N, N, N}, CG,
	 false, true},
	{"linear_strided", KL_OP_MATMUL, f_linear, 3, {S3(3, 2, 4), S2(5, 4), S1(5)}, {N, N, N}, ST,
	 false, false},
	{"matmul_bcast_lhs", KL_OP_MATMUL, f_matmul, 2, {S2(3, 4), S4(2, 2, 4, 5)}, {N, N}, PM, false,
	 true},
	{"matmul_vec", KL_OP_MATMUL, f_matmul, 2, {S1(4), S3(2, 4, 3)}, {N, N}, CG, false, false},
	{"matmul_1x1", KL_OP_MATMUL, f_matmul, 2, {S2(1, 1), S2(1, 1)}, {N, N}, CG, false, false},
	{"matmul_k0", KL_OP_MATMUL, f_matmul, 2, {S2(3, 0), S2(0, 2)}, {N, N}, CG, false, false},
	{"linear", KL_OP_MATMUL, f_linear, 3, {S3(2, 3, 4), S2(5, 4), S1(5)}, {N, N, N}, PM, false,
	 true},
	{"softmax", KL_OP_SOFTMAX, f_softmax, 1, {S2(3, 5)}, {N}, PM, false, true},
	{"softmax_axis0", KL_OP_SOFTMAX, f_softmax0, 1, {S3(4, 3, 2)}, {N}, ST, false, false},
	{"softmax_1", KL_OP_SOFTMAX, f_softmax, 1, {S2(1, 1)}, {N}, CG, false, false},
	{"softmax_rows0", KL_OP_SOFTMAX, f_softmax0, 1, {S3(3, 0, 2)}, {N}, CG, false, false},
	{"log_softmax", KL_OP_LOG_SOFTMAX, f_log_softmax, 1, {S3(2, 7, 3)}, {N}, PM, false, true},
	{"layer_norm", KL_OP_LAYER_NORM, f_ln, 3, {S2(3, 6), S1(6), S1(6)}, {N, N, N}, ST, false,
	 true},
	{"layer_norm_w", KL_OP_LAYER_NORM, f_ln_w, 2, {S3(2, 3, 5), S1(5)}, {N, N}, PM, false, false},
	{"layer_norm_plain", KL_OP_LAYER_NORM, f_ln_plain, 1, {S2(4, 7)}, {N}, CG, false, false},
	{"layer_norm_1d", KL_OP_LAYER_NORM, f_ln, 3, {S1(6), S1(6), S1(6)}, {N, N, N}, CG, false,
	 false},
	{"layer_norm_b", KL_OP_LAYER_NORM, f_ln_b, 2, {S2(3, 5), S1(5)}, {N, N}, PM, false, false},
	{"layer_norm_rows0", KL_OP_LAYER_NORM, f_ln, 3, {S2(0, 4), S1(4), S1(4)}, {N, N, N}, CG,
	 false, false},
	{"rms_norm", KL_OP_RMS_NORM, f_rms, 2, {S2(3, 6), S1(6)}, {N, N}, PM, false, true},
	{"rms_norm_plain", KL_OP_RMS_NORM, f_rms_plain, 1, {S3(2, 3, 5)}, {N}, ST, false, false},
	{"layer_norm_d1", KL_OP_LAYER_NORM, f_ln, 3, {S2(4, 1), S1(1), S1(1)}, {N, N, N}, CG, false,
	 false},
	{"sdpa", KL_OP_ATTENTION, f_sdpa, 3, {S3(2, 4, 8), S3(2, 6, 8), S3(2, 6, 3)}, {N, N, N}, PM,
	 false, true},
	{"sdpa_causal", KL_OP_ATTENTION, f_sdpa_causal, 3, {S3(2, 3, 4), S3(2, 5, 4), S3(2, 5, 2)},
	 {N, N, N}, CG, false, true},
	{"sdpa_one_query", KL_OP_ATTENTION, f_sdpa, 3, {S3(1, 1, 3), S3(1, 4, 3), S3(1, 4, 2)},
	 {N, N, N}, CG, false, false},
	{"sdpa_shared_kv_head", KL_OP_ATTENTION, f_sdpa_heads, 3,
	 {{4, {2, 3, 5, 4}}, {4, {2, 1, 5, 4}}, {4, {2, 1, 5, 2}}}, {N, N, N}, ST, false, false},
	{"gather", KL_OP_GATHER, f_gather, 1, {S2(5, 3)}, {N}, PM, false, true},
	{"embedding", KL_OP_GATHER, f_embedding, 1, {S1(5)}, {N}, CG, false, false},
	{"index_add", KL_OP_INDEX_ADD, f_index_add, 2, {S2(5, 3), S2(6, 3)}, {N, N}, ST, false, true},
	{"logsumexp", KL_OP_EXP, f_logsumexp, 1, {S3(2, 4, 3)}, {N}, PM, false, true},
	{"logsumexp_all", KL_OP_EXP, f_logsumexp_all, 1, {S2(3, 4)}, {N}, CG, false, false},
	{"sdpa_lengths_causal", KL_OP_ATTENTION, f_sdpa_len_causal, 3,
	 {S3(2, 3, 4), S3(2, 5, 4), S3(2, 5, 2)}, {N, N, N}, CG, false, true},
	{"sdpa_lengths", KL_OP_ATTENTION, f_sdpa_len, 3, {S3(2, 2, 4), S3(2, 5, 4), S3(2, 5, 3)},
	 {N, N, N}, PM, false, false},
	/* (rows are seeded by their index: new rows go last) */
	/* Dv == D: sdpa_bwd, the fused backward (key blocks of 64: 67 and 70
	 * rows cross one) */
	{"sdpa_fused", KL_OP_ATTENTION, f_sdpa, 3, {S3(2, 5, 8), S3(2, 7, 8), S3(2, 7, 8)},
	 {N, N, N}, PM, false, true},
	{"sdpa_fused_causal", KL_OP_ATTENTION, f_sdpa_causal, 3,
	 {S3(2, 6, 4), S3(2, 6, 4), S3(2, 6, 4)}, {N, N, N}, ST, false, true},
	{"sdpa_fused_causal_tq_lt_tk", KL_OP_ATTENTION, f_sdpa_causal, 3,
	 {S3(1, 3, 4), S3(1, 5, 4), S3(1, 5, 4)}, {N, N, N}, CG, false, true},
	{"sdpa_fused_blocks", KL_OP_ATTENTION, f_sdpa_causal, 3,
	 {S3(1, 67, 3), S3(1, 70, 3), S3(1, 70, 3)}, {N, N, N}, CG, false, true},
	{"sdpa_fused_blocks_full", KL_OP_ATTENTION, f_sdpa, 3,
	 {S3(1, 66, 2), S3(1, 70, 2), S3(1, 70, 2)}, {N, N, N}, PM, false, false},
	{"sdpa_fused_shared_kv_head", KL_OP_ATTENTION, f_sdpa_heads_d, 3,
	 {{4, {2, 3, 5, 4}}, {4, {2, 1, 5, 4}}, {4, {2, 1, 5, 4}}}, {N, N, N}, ST, false, false},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* Ops that have no gradient by design: sources and values that are not
 * floats (comparisons, argmax). Every other op needs a rule and a row. */
static bool no_rule_by_design(kl_op op)
{
	kl_cat c = kl__ops[op].cat;
	return c == KL_CAT_SOURCE || c == KL_CAT_COMPARE || op == KL_OP_ARGMAX;
}

/* ---- per-case data ------------------------------------------------------------------- */

typedef struct run {
	kl_tensor *x[3];   /* inputs in the checked dtype and layout */
	double *xv[3];     /* their values */
	int64_t xn[3];     /* numel */
	kl_tensor *cot;    /* cotangent in the output's dtype */
	double *ref[3];    /* (a): the reference gradients */
	int ynd;
	int64_t ysh[KL_MAX_DIMS];
	kl_dtype ydt;
} run;

static void run_free(run *r)
{
	for (int k = 0; k < 3; k++) {
		kl_release(r->x[k]);
		free(r->xv[k]);
		free(r->ref[k]);
	}
	kl_release(r->cot);
	memset(r, 0, sizeof *r);
}

/* sum(cot * y) from one reference evaluation of graph g (output 0: y) */
/* the largest finite magnitude of v[0..n) */
static double max_abs(const double *v, int64_t n)
{
	double m = 0;
	for (int64_t i = 0; i < n; i++)
		if (isfinite(v[i]) && fabs(v[i]) > m)
			m = fabs(v[i]);
	return m;
}

static double ref_loss(const kl_graph *g, double **vals, const double *cv, int64_t yn, bool *ok)
{
	double *outs[8] = {0};
	char err[512];
	double s = 0;
	if (kl__ref_eval(g, (const double *const *)vals, outs, err, sizeof err) != KL_OK) {
		fprintf(stderr, "reference: %s\n", err);
		*ok = false;
		return NAN;
	}
	for (int64_t i = 0; i < yn; i++)
		s += cv[i] * outs[0][i];
	for (int j = 0; j < g->noutputs; j++)
		free(outs[j]);
	return s;
}

/* (a): trace the forward and kl_backward in f64 at the values r->xv, evaluate
 * the backward graph with the reference, and hold it to central finite
 * differences of the reference forward. */
static bool reference_grads(const gcase *c, run *r, const double *cv)
{
	bool ok = true;
	kl_tensor *x[3] = {0};
	kl_scope_begin(ctx);
	for (int k = 0; k < c->nin; k++) {
		x[k] = kltest_from_values(ctx, KL_F64, c->s[k].nd, c->s[k].d, r->xv[k], KLTEST_CONTIG);
		kl_set_requires_grad(x[k], true);
	}
	kl_tensor *cot = kltest_from_values(ctx, KL_F64, r->ynd, r->ysh, cv, KLTEST_CONTIG);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = c->f(x, NULL);
	kl_tensor *y64 = y && y->dtype != KL_F64 ? kl_cast(y, KL_F64) : y;
	/* the cotangent of y, in y's dtype (a cast of the f64 values) */
	kl_tensor *cy = y && y->dtype != KL_F64 ? kl_cast(cot, y->dtype) : cot;
	kl_status st = y ? kl_backward(y, cy) : KL_EINVAL;
	if (st != KL_OK)
		fprintf(stderr, "FAIL %s: reference trace: %s\n", c->name, kl_last_error(ctx));
	kl_tensor *outs[4] = {y64};
	int nout = 1;
	for (int k = 0; st == KL_OK && k < c->nin; k++) {
		outs[nout] = kl_grad(x[k]);
		if (!outs[nout]) {
			fprintf(stderr, "FAIL %s: input %d got no gradient\n", c->name, k);
			st = KL_EINVAL;
		}
		nout++;
	}
	kl_trace *tr = kl__trace_end(ctx, st == KL_OK ? nout : 0, outs);
	for (int k = 0; k < c->nin; k++)
		kl_grad_clear(x[k]);
	if (st != KL_OK || !tr) {
		kl__trace_free(tr);
		kl_scope_end(ctx);
		return false;
	}
	const kl_graph *g = &tr->g;
	int ni = g->ninputs;
	double **vals = calloc((size_t)ni + 1, sizeof *vals);
	int at[3] = {-1, -1, -1};
	for (int i = 0; i < ni; i++) {
		vals[i] = kltest_read(tr->in_tensors[i]);
		for (int k = 0; k < c->nin; k++)
			if (tr->in_tensors[i] == x[k])
				at[k] = i;
	}
	double *gv[4] = {0};
	char err[512];
	if (kl__ref_eval(g, (const double *const *)vals, gv, err, sizeof err) != KL_OK) {
		fprintf(stderr, "FAIL %s: reference of the backward graph: %s\n", c->name, err);
		kl__graph_print(g, stderr);
		ok = false;
	}
	int64_t yn = kl__numel(r->ynd, r->ysh);
	for (int k = 0; ok && k < c->nin; k++) {
		r->ref[k] = gv[k + 1];
		gv[k + 1] = NULL;
		if (c->no_fd || at[k] < 0)
			continue;
		/* central differences, h relative to the value */
		double *fd = calloc((size_t)r->xn[k] + 1, sizeof *fd);
		for (int64_t e = 0; e < r->xn[k] && ok; e++) {
			double v = vals[at[k]][e], h = 1e-6 * fmax(1.0, fabs(v));
			vals[at[k]][e] = v + h;
			double fp = ref_loss(g, vals, cv, yn, &ok);
			vals[at[k]][e] = v - h;
			double fm = ref_loss(g, vals, cv, yn, &ok);
			vals[at[k]][e] = v;
			fd[e] = (fp - fm) / (2 * h);
		}
		char what[128];
		snprintf(what, sizeof what, "%s: reference gradient of input %d vs finite differences",
		         c->name, k);
		/* central differences of an f64 loss are good to about
		 * eps * |loss| / h: 1e-9 of the largest gradient is their noise
		 * floor (a gradient that is exactly 0, a masked query's, comes
		 * out of the rule as a few ulps) */
		double floor_ = 1e-9 * fmax(max_abs(fd, r->xn[k]), max_abs(r->ref[k], r->xn[k]));
		ok = ok && kltest_compare_atol(what, KL_F64, c->s[k].nd, c->s[k].d, r->ref[k], fd, 1e5,
		                               floor_);
		free(fd);
	}
	for (int j = 0; j < 4; j++)
		free(gv[j]);
	for (int i = 0; i < ni; i++)
		free(vals[i]);
	free(vals);
	kl__trace_free(tr);
	kl_scope_end(ctx);
	return ok;
}

static double factor_of(kl_dtype dt)
{
	return dt == KL_F64 ? 1e3 : dt == KL_F32 ? 20 : 8;
}

/* Inputs in dt, the output's shape, the cotangent and the reference. */
static bool prepare(const gcase *c, int ci, kl_dtype dt, run *r)
{
	memset(r, 0, sizeof *r);
	for (int k = 0; k < c->nin; k++) {
		r->x[k] = kltest_rand(ctx, dt, c->s[k].nd, c->s[k].d, c->r[k], k == 0 ? c->layout : CG,
		                      (uint64_t)(1000 * ci + 17 * k + dt));
		r->xv[k] = kltest_read(r->x[k]);
		r->xn[k] = kl__numel(c->s[k].nd, c->s[k].d);
		if (!r->x[k] || !r->xv[k])
			return false;
	}
	/* the output's shape and dtype, from an eager run with grad mode off */
	bool prev = kl_set_grad_enabled(ctx, false);
	kl_scope_begin(ctx);
	kl_tensor *y = c->f(r->x, NULL);
	if (y) {
		r->ynd = y->ndim;
		memcpy(r->ysh, y->shape, sizeof r->ysh);
		r->ydt = y->dtype;
	}
	kl_scope_end(ctx);
	kl_set_grad_enabled(ctx, prev);
	if (!y) {
		fprintf(stderr, "FAIL %s: forward: %s\n", c->name, kl_last_error(ctx));
		return false;
	}
	/* eighths in [-1, 1]: exact in every float dtype */
	int64_t yn = kl__numel(r->ynd, r->ysh);
	double *cv = malloc(sizeof *cv * (size_t)(yn + 1));
	uint64_t s = 77 + (uint64_t)ci;
	for (int64_t i = 0; i < yn; i++)
		cv[i] = (double)((int64_t)(kltest_uniform(&s) * 17) - 8) / 8.0;
	r->cot = kltest_from_values(ctx, r->ydt, r->ynd, r->ysh, cv, KLTEST_CONTIG);
	bool ok = r->cot && reference_grads(c, r, cv);
	free(cv);
	for (int k = 0; k < c->nin; k++)
		kl_set_requires_grad(r->x[k], true);
	return ok;
}

static bool check_grads(const gcase *c, const run *r, kl_tensor *const *g, const char *mode)
{
	bool ok = true;
	for (int k = 0; k < c->nin; k++) {
		char what[160];
		snprintf(what, sizeof what, "%s %s %s: gradient of input %d", c->name,
		         kl_dtype_name(r->x[k]->dtype), mode, k);
		if (!g[k]) {
			fprintf(stderr, "FAIL %s: none\n", what);
			ok = false;
			continue;
		}
		double *v = kltest_read(g[k]);
		bool shape_ok = g[k]->ndim == c->s[k].nd && g[k]->dtype == r->x[k]->dtype;
		for (int d = 0; shape_ok && d < c->s[k].nd; d++)
			shape_ok = g[k]->shape[d] == c->s[k].d[d];
		if (!shape_ok)
			fprintf(stderr, "FAIL %s: shape or dtype differs from the input's\n", what);
		/* a gradient is a sum of products: its rounding is relative to the
		 * largest terms, not to an element that cancels to near zero (a
		 * key seen by one query row under a mask) */
		kl_dtype dt = r->x[k]->dtype;
		double rtol = kltest_tol(dt) * factor_of(dt);
		double floor_ = rtol / 16 * max_abs(r->ref[k], r->xn[k]);
		ok &= shape_ok && v &&
		      kltest_compare_atol(what, dt, c->s[k].nd, c->s[k].d, v, r->ref[k], factor_of(dt),
		                          floor_);
		free(v);
	}
	return ok;
}

static bool eager_grads(const gcase *c, run *r)
{
	kl_scope_begin(ctx);
	kl_tensor *y = c->f(r->x, NULL);
	kl_status st = y ? kl_backward(y, r->cot) : KL_EINVAL;
	kl_scope_end(ctx);
	if (st != KL_OK) {
		fprintf(stderr, "FAIL %s eager: %s\n", c->name, kl_last_error(ctx));
		return false;
	}
	kl_tensor *g[3] = {kl_grad(r->x[0]), c->nin > 1 ? kl_grad(r->x[1]) : NULL,
	                   c->nin > 2 ? kl_grad(r->x[2]) : NULL};
	bool ok = check_grads(c, r, g, "eager");
	for (int k = 0; k < c->nin; k++)
		kl_grad_clear(r->x[k]);
	return ok;
}

/* (c): one compiled function over every row: inputs are each row's inputs
 * then its cotangent; outputs each row's input gradients */
typedef struct batch {
	const int *rows;
	int nrows;
} batch;

static kl_status batch_body(kl_ctx *c_, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)c_, (void)nin, (void)nout;
	const batch *b = user;
	int i = 0, o = 0;
	for (int j = 0; j < b->nrows; j++) {
		const gcase *c = &cases[b->rows[j]];
		kl_tensor *y = c->f(in + i, NULL);
		if (!y)
			return kl_last_status(c_);
		kl_status st = kl_backward(y, in[i + c->nin]);
		if (st != KL_OK)
			return st;
		for (int k = 0; k < c->nin; k++)
			out[o++] = kl_grad(in[i + k]);
		i += c->nin + 1;
	}
	return KL_OK;
}

static int check_dtype(kl_dtype dt, bool low_only)
{
	int fails = 0, rows[NCASES], nrows = 0, nin = 0, nout = 0;
	run *rs = calloc(NCASES, sizeof *rs);
	for (int ci = 0; ci < NCASES; ci++) {
		const gcase *c = &cases[ci];
		if (low_only && !c->low)
			continue;
		if (!prepare(c, ci, dt, &rs[ci]) || !eager_grads(c, &rs[ci])) {
			fails++;
			continue;
		}
		rows[nrows++] = ci;
		nin += c->nin + 1;
		nout += c->nin;
	}
	/* compiled: one function, one graph */
	batch b = {rows, nrows};
	kl_fn *f = kl_compile(ctx, batch_body, &b, nin, nout, NULL);
	kl_tensor **in = calloc((size_t)nin + 1, sizeof *in), **out = calloc((size_t)nout + 1, sizeof *out);
	int i = 0;
	for (int j = 0; j < nrows; j++) {
		run *r = &rs[rows[j]];
		for (int k = 0; k < cases[rows[j]].nin; k++)
			in[i++] = r->x[k];
		in[i++] = r->cot;
	}
	kl_status st = kl_fn_call(f, in, out);
	if (st != KL_OK) {
		fprintf(stderr, "FAIL compiled %s: %s\n", kl_dtype_name(dt), kl_last_error(ctx));
		fails++;
	} else {
		int o = 0;
		for (int j = 0; j < nrows; j++) {
			const gcase *c = &cases[rows[j]];
			fails += !check_grads(c, &rs[rows[j]], out + o, "compiled");
			o += c->nin;
		}
		/* and the .grad of each input after the call */
		for (int j = 0; j < nrows; j++) {
			const gcase *c = &cases[rows[j]];
			kl_tensor *g[3] = {0};
			for (int k = 0; k < c->nin; k++)
				g[k] = kl_grad(rs[rows[j]].x[k]);
			fails += !check_grads(c, &rs[rows[j]], g, "compiled, .grad after the call");
		}
	}
	for (int k = 0; k < nout; k++)
		kl_release(out[k]);
	free(in);
	free(out);
	kl_fn_free(f);
	for (int ci = 0; ci < NCASES; ci++) {
		for (int k = 0; k < 3; k++)
			if (rs[ci].x[k])
				kl_grad_clear(rs[ci].x[k]);
		run_free(&rs[ci]);
	}
	free(rs);
	return fails;
}

static void test_grad_f64(void **state)
{
	(void)state;
	assert_int_equal(check_dtype(KL_F64, false), 0);
}

static void test_grad_f32(void **state)
{
	(void)state;
	assert_int_equal(check_dtype(KL_F32, false), 0);
}

static void test_grad_f16_bf16(void **state)
{
	(void)state;
	int fails = check_dtype(KL_F16, true);
	fails += check_dtype(KL_BF16, true);
	assert_int_equal(fails, 0);
}

/* Every op with a rule has a row; every op without one is a source, a
 * comparison or argmax, or a composite whose rule is still to come. */
static void test_table_covers_rules(void **state)
{
	(void)state;
	int missing = 0;
	for (int op = 0; op < KL_NOPS; op++) {
		bool row = false;
		for (int ci = 0; ci < NCASES; ci++)
			row |= cases[ci].op == (kl_op)op;
		if (kl__opdesc[op]->vjp && !row) {
			fprintf(stderr, "FAIL: %s has a gradient rule but no row in test_grad's table\n",
			        kl__ops[op].name);
			missing++;
		}
		if (!kl__opdesc[op]->vjp && no_rule_by_design((kl_op)op) && row) {
			fprintf(stderr, "FAIL: %s has a row but no rule\n", kl__ops[op].name);
			missing++;
		}
	}
	assert_int_equal(missing, 0);
}

/* ---- ties, exactly: torch's conventions -------------------------------------------- */

static double *grad_values(kl_tensor *t)
{
	return kltest_read(kl_grad(t));
}

static void test_ties(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	/* maximum(a, b) with a == b: each gets half */
	kl_tensor *a = kltest_from_values(ctx, KL_F32, 1, (int64_t[]){3}, (double[]){1, 2, 3}, CG);
	kl_tensor *b = kltest_from_values(ctx, KL_F32, 1, (int64_t[]){3}, (double[]){1, 5, 0}, CG);
	kl_set_requires_grad(a, true);
	kl_set_requires_grad(b, true);
	assert_int_equal(kl_backward(kl_sum(kl_maximum(a, b), 0, NULL, false), NULL), KL_OK);
	double *ga = grad_values(a), *gb = grad_values(b);
	assert_true(ga[0] == 0.5 && ga[1] == 0 && ga[2] == 1);
	assert_true(gb[0] == 0.5 && gb[1] == 1 && gb[2] == 0);
	free(ga);
	free(gb);
	/* max over a row with two maxima: split evenly (amax) */
	kl_tensor *x = kltest_from_values(ctx, KL_F32, 1, (int64_t[]){4}, (double[]){3, 1, 3, 2}, CG);
	kl_set_requires_grad(x, true);
	assert_int_equal(kl_backward(kl_max(x, 0, NULL, false), NULL), KL_OK);
	double *gx = grad_values(x);
	assert_true(gx[0] == 0.5 && gx[1] == 0 && gx[2] == 0.5 && gx[3] == 0);
	free(gx);
	kl_scope_end(ctx);
}

/* ---- the tape ---------------------------------------------------------------------- */

static void test_accumulate_clear_detach(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	kl_tensor *x = kltest_from_values(ctx, KL_F32, 1, (int64_t[]){2}, (double[]){1, 2}, CG);
	assert_false(kl_requires_grad(x));
	assert_int_equal(kl_set_requires_grad(x, true), KL_OK);
	assert_true(kl_requires_grad(x));
	assert_null(kl_grad(x));
	/* d sum(x*x) = 2x, twice: accumulated */
	for (int i = 0; i < 2; i++)
		assert_int_equal(kl_backward(kl_sum(kl_mul(x, x), 0, NULL, false), NULL), KL_OK);
	double *g = grad_values(x);
	assert_true(g[0] == 4 && g[1] == 8);
	free(g);
	kl_grad_clear(x);
	assert_null(kl_grad(x));
	/* a detached value carries nothing back */
	kl_tensor *d = kl_detach(x);
	assert_false(kl_requires_grad(d));
	kl_tensor *y = kl_mul(x, d);
	assert_true(kl_requires_grad(y));
	assert_int_equal(kl_backward(kl_sum(y, 0, NULL, false), NULL), KL_OK);
	g = grad_values(x);
	assert_true(g[0] == 1 && g[1] == 2);
	free(g);
	kl_grad_clear(x);
	/* grad mode off: nothing recorded */
	assert_true(kl_set_grad_enabled(ctx, false));
	kl_tensor *z = kl_mul(x, x);
	assert_false(kl_requires_grad(z));
	assert_false(kl_set_grad_enabled(ctx, true));
	/* backward on a leaf: its gradient is the cotangent */
	assert_int_equal(kl_backward(x, kltest_from_values(ctx, KL_F32, 1, (int64_t[]){2},
	                                                   (double[]){3, -1}, CG)),
	                 KL_OK);
	g = grad_values(x);
	assert_true(g[0] == 3 && g[1] == -1);
	free(g);
	kl_grad_clear(x);
	/* a result is not a leaf; an integer tensor cannot require grad */
	kl_clear_error(ctx);
	assert_int_equal(kl_set_requires_grad(kl_mul(x, x), true), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "not a leaf"));
	kl_clear_error(ctx);
	assert_int_equal(kl_set_requires_grad(kl_arange(ctx, KL_I64, 0, 3, 1), true), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "floating-point"));
	kl_scope_end(ctx);
}

/* ---- errors -------------------------------------------------------------------------- */

static void expect(kl_status got, kl_status want, const char *const *words)
{
	assert_int_equal(got, want);
	for (int i = 0; words[i]; i++)
		if (!strstr(kl_last_error(ctx), words[i]))
			fail_msg("error '%s' lacks '%s'", kl_last_error(ctx), words[i]);
}
#define EXPECT(call, want, ...)                                                            \
	do {                                                                               \
		kl_clear_error(ctx);                                                       \
		expect((call), (want), (const char *const[]){__VA_ARGS__, NULL});          \
	} while (0)

static void test_errors(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 5);
	kl_set_requires_grad(x, true);
	/* a non-scalar loss without a cotangent */
	kl_tensor *y = kl_mul(x, x);
	EXPECT(kl_backward(y, NULL), KL_EINVAL, "kl_backward", "[4,3] f32", "12 elements",
	       "cotangent");
	/* a cotangent of the wrong shape, and of the wrong dtype */
	EXPECT(kl_backward(y, kl_zeros(ctx, KL_F32, 1, (int64_t[]){3})), KL_EINVAL, "kl_backward",
	       "cotangent [3] f32 does not match loss [4,3] f32");
	EXPECT(kl_backward(y, kl_zeros(ctx, KL_F64, 2, (int64_t[]){4, 3})), KL_EINVAL,
	       "cotangent [4,3] f64 does not match loss [4,3] f32");
	/* after the refusals the graph is intact: a good cotangent works */
	assert_int_equal(kl_backward(y, kl_zeros(ctx, KL_F32, 2, (int64_t[]){4, 3})), KL_OK);
	/* ... and is consumed */
	EXPECT(kl_backward(y, kl_zeros(ctx, KL_F32, 2, (int64_t[]){4, 3})), KL_EINVAL,
	       "kl_backward", "no tensor that requires grad reaches loss [4,3] f32");
	kl_grad_clear(x);
	/* a loss no parameter reaches */
	kl_tensor *c = kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 6);
	EXPECT(kl_backward(kl_sum(c, 0, NULL, false), NULL), KL_EINVAL,
	       "kl_backward: no tensor that requires grad reaches loss [] f32");
	/* through ops without a gradient: an index and a comparison */
	kl_tensor *am = kl_cast(kl_argmax(x, 1, false), KL_F32);
	EXPECT(kl_backward(kl_sum(am, 0, NULL, false), NULL), KL_EINVAL, "kl_backward",
	       "the path stops at argmax, which has no gradient");
	kl_tensor *gt = kl_cast(kl_gt_scalar(x, 0.0), KL_F32);
	EXPECT(kl_backward(kl_sum(gt, 0, NULL, false), NULL), KL_EINVAL,
	       "the path stops at gt, which has no gradient");
	/* a shared subgraph: the second backward finds it consumed */
	kl_tensor *h = kl_exp(x);
	kl_tensor *l1 = kl_sum(h, 0, NULL, false), *l2 = kl_mean(h, 0, NULL, false);
	assert_int_equal(kl_backward(l1, NULL), KL_OK);
	EXPECT(kl_backward(l2, NULL), KL_ESTATE, "kl_backward", "consumed by an earlier kl_backward");
	kl_grad_clear(x);
	/* a value the backward needs, written in place after the forward */
	kl_tensor *w = kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 7);
	kl_tensor *loss = kl_sum(kl_mul(x, w), 0, NULL, false);
	assert_int_equal(kl_copy(w, kl_zeros(ctx, KL_F32, 1, (int64_t[]){3})), KL_OK);
	EXPECT(kl_backward(loss, NULL), KL_ESTATE, "kl_backward", "input [3] f32",
	       "written in place", "version 0 -> 1");
	assert_null(kl_grad(x));
	/* a loss that is not floating point */
	EXPECT(kl_backward(kl_argmax(x, 0, false), NULL), KL_EINVAL, "kl_backward",
	       "not floating point");
	assert_int_equal(kl_backward(NULL, NULL), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(NULL), "kl_backward: loss is NULL"));
	kl_scope_end(ctx);
}

/* An op that has no rule yet (the composites another change writes) is
 * named by the error, with its node and shape. */
static void test_error_no_rule(void **state)
{
	(void)state;
	typedef kl_tensor *(*fn1)(kl_tensor *);
	kl_scope_begin(ctx);
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, 3}, N, CG, 8);
	kl_set_requires_grad(x, true);
	struct {
		kl_op op;
		kl_tensor *y;
	} rows[] = {
		{KL_OP_MATMUL, kl_matmul(x, x)},
		{KL_OP_SOFTMAX, kl_softmax(x, 1)},
		{KL_OP_LOG_SOFTMAX, kl_log_softmax(x, 0)},
		{KL_OP_LAYER_NORM, kl_layer_norm(x, NULL, NULL, 1e-5)},
		{KL_OP_RMS_NORM, kl_rms_norm(x, NULL, 1e-5)},
		{KL_OP_ATTENTION, kl_sdpa(x, x, x, false, 0)},
	};
	(void)(fn1)NULL;
	int tried = 0;
	for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
		assert_non_null(rows[i].y);
		if (kl__opdesc[rows[i].op]->vjp)
			continue; /* has its rule: test_grad's table checks it */
		char want[64];
		snprintf(want, sizeof want, "kl_backward: %s has no gradient (node #",
		         kl__ops[rows[i].op].name);
		EXPECT(kl_backward(kl_sum(rows[i].y, 0, NULL, false), NULL), KL_EINVAL, want,
		       "[3,3] f32)");
		tried++;
	}
	fprintf(stderr, "test_error_no_rule: %d ops without a rule checked\n", tried);
	/* grad_other.c gave every one of these its rule: none may lose it (the
	 * error for an op without one is test_errors' argmax and gt) */
	assert_int_equal(tried, 0);
	kl_scope_end(ctx);
}

/* ---- builders ------------------------------------------------------------------------ */

static void test_builders(void **state)
{
	(void)state;
	kl_graph g;
	kl__graph_init(&g);
	kl_node in = {.op = KL_OP_INPUT, .dtype = KL_F16, .ndim = 2, .shape = {3, 1}};
	int32_t a = kl__graph_add(&g, &in);
	kl_node in2 = {.op = KL_OP_INPUT, .dtype = KL_F32, .ndim = 1, .shape = {4}};
	int32_t b = kl__graph_add(&g, &in2);
	int32_t s = kl__gb_binary(&g, KL_OP_ADD, a, b); /* broadcast, promoted */
	assert_true(s >= 0);
	assert_int_equal(g.nodes[s].dtype, KL_F32);
	assert_int_equal(g.nodes[s].ndim, 2);
	assert_int_equal(g.nodes[s].shape[1], 4);
	/* [3,1] + [5] broadcasts; [3,4] + [5] does not */
	assert_true(kl__gb_binary(&g, KL_OP_ADD, a, kl__gb_full(&g, KL_F32, 1, (int64_t[]){5}, 0)) >= 0);
	assert_int_equal(kl__gb_binary(&g, KL_OP_ADD, s, kl__gb_full(&g, KL_F32, 1, (int64_t[]){5}, 0)),
	                 -1);
	assert_int_equal(kl__gb_unary(&g, KL_OP_EXP, -1), -1); /* -1 propagates */
	int32_t t = kl__gb_sum_to(&g, s, 1, (int64_t[]){4});
	assert_true(t >= 0);
	assert_int_equal(g.nodes[t].ndim, 1);
	assert_int_equal(g.nodes[t].shape[0], 4);
	assert_int_equal(kl__gb_sum_to(&g, s, 2, (int64_t[]){3, 4}), s);
	int32_t sl = kl__gb_slice(&g, s, 1, 1, 4, 2);
	assert_int_equal(g.nodes[sl].shape[1], 2);
	int32_t r = kl__gb_reduce(&g, KL_OP_MAX, s, 2, true);
	assert_int_equal(g.nodes[r].shape[1], 1);
	int32_t m = kl__gb_matmul(&g, s, kl__gb_permute(&g, s, (const int[]){1, 0}));
	assert_int_equal(g.nodes[m].shape[0], 3);
	assert_int_equal(g.nodes[m].shape[1], 3);
	int32_t cs[9];
	for (int i = 0; i < 9; i++)
		cs[i] = s;
	int32_t cc = kl__gb_concat(&g, 9, cs, 0); /* a chain past 8 inputs */
	assert_int_equal(g.nodes[cc].shape[0], 27);
	kl__graph_free(&g);
}

/* ---- the whole step, compiled --------------------------------------------------------- */

typedef struct model {
	kl_tensor *w, *b; /* [4,3], [3]: parameters, reached through user state */
	double lr;
} model;

/* forward (x @ w written as a product and a sum), MSE loss, backward, SGD
 * in place with grad mode off, grads cleared; returns the loss */
static kl_status train_step(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin, (void)nout;
	model *m = user;
	kl_tensor *x = in[0], *tgt = in[1];
	int64_t xs[3] = {x->shape[0], 4, 1};
	kl_tensor *y = kl_add(kl_sum(kl_mul(kl_reshape(x, 3, xs), m->w), 1, ax1, false), m->b);
	kl_tensor *d = kl_sub(y, tgt);
	kl_tensor *loss = kl_mean(kl_mul(d, d), 0, NULL, false);
	kl_status st = kl_backward(loss, NULL);
	if (st != KL_OK)
		return st;
	bool prev = kl_set_grad_enabled(c, false);
	kl_tensor *ps[2] = {m->w, m->b};
	for (int i = 0; i < 2 && st == KL_OK; i++) {
		st = kl_copy(ps[i], kl_sub(ps[i], kl_mul_scalar(kl_grad(ps[i]), m->lr)));
		kl_grad_clear(ps[i]);
	}
	kl_set_grad_enabled(c, prev);
	out[0] = loss;
	return st;
}

static void test_whole_step_compiled(void **state)
{
	(void)state;
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 4}, N, CG, 11);
	kl_tensor *tgt = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 3}, N, CG, 12);
	model me = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 13),
	            kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 14), 0.1};
	model mc = {kl_contiguous(me.w), kl_contiguous(me.b), 0.1};
	/* distinct memory for the compiled model's parameters */
	mc.w = kl_add_scalar(me.w, 0.0);
	mc.b = kl_add_scalar(me.b, 0.0);
	kl_set_requires_grad(me.w, true);
	kl_set_requires_grad(me.b, true);
	kl_set_requires_grad(mc.w, true);
	kl_set_requires_grad(mc.b, true);
	kl_fn *f = kl_compile(ctx, train_step, &mc, 2, 1, NULL);
	kl_tensor *in[2] = {x, tgt};
	double first = 0, last = 0;
	for (int step = 0; step < 4; step++) {
		kl_tensor *le = NULL, *lc = NULL;
		kl_scope_begin(ctx);
		assert_int_equal(train_step(ctx, in, 2, &le, 1, &me), KL_OK);
		kl_retain(le);
		kl_scope_end(ctx);
		if (kl_fn_call(f, in, &lc) != KL_OK)
			fail_msg("kl_fn_call: %s", kl_last_error(ctx));
		double ve, vc;
		assert_int_equal(kl_item(le, &ve), KL_OK);
		assert_int_equal(kl_item(lc, &vc), KL_OK);
		assert_true(fabs(ve - vc) <= 1e-5 * fabs(ve));
		if (step == 0)
			first = vc;
		last = vc;
		kl_release(le);
		kl_release(lc);
		double *pe = kltest_read(me.w), *pc = kltest_read(mc.w);
		assert_true(kltest_compare("w after the step", KL_F32, 2, (int64_t[]){4, 3}, pc, pe, 1));
		free(pe);
		free(pc);
		pe = kltest_read(me.b);
		pc = kltest_read(mc.b);
		assert_true(kltest_compare("b after the step", KL_F32, 1, (int64_t[]){3}, pc, pe, 1));
		free(pe);
		free(pc);
	}
	assert_true(last < first); /* it trains */
	/* one graph a call: forward, backward and update */
	char *buf = NULL;
	size_t len = 0;
	FILE *mf = open_memstream(&buf, &len);
	assert_int_equal(kl_explain(f, mf), KL_OK);
	fclose(mf);
	if (!strstr(buf, "graph 0") || strstr(buf, "graph 1"))
		fail_msg("kl_explain does not show one graph:\n%s", buf);
	free(buf);
	kl_fn_free(f);
	kl_release(x);
	kl_release(tgt);
	kl_release(me.w);
	kl_release(me.b);
	kl_release(mc.w);
	kl_release(mc.b);
}

/* Writes in place inside a compiled function: a later read of the tensor
 * written, in the same graph, sees the value written (p + v reads v twice),
 * and p holds v after the call. */
static kl_status read_after_write(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                                  int nout, void *user)
{
	(void)c, (void)nin, (void)nout;
	kl_tensor *p = user;
	kl_status st = kl_copy(p, in[0]);
	if (st != KL_OK)
		return st;
	out[0] = kl_add(p, in[0]);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_copy_in_trace(void **state)
{
	(void)state;
	kl_tensor *p = kl_zeros(ctx, KL_F32, 1, (int64_t[]){3});
	kl_tensor *v = kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 21);
	kl_fn *f = kl_compile(ctx, read_after_write, p, 1, 1, NULL);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, &v, &out), KL_OK);
	double *got = kltest_read(out), *pv = kltest_read(p), *vv = kltest_read(v);
	assert_true(got && pv && vv);
	for (int i = 0; i < 3; i++) {
		assert_true(got[i] == 2 * vv[i]);
		assert_true(pv[i] == vv[i]);
	}
	free(got);
	free(pv);
	free(vv);
	kl_release(out);
	kl_fn_free(f);
	kl_release(p);
	kl_release(v);
}

/* Compiled forward, eager backward after the call (the seed's loop:
 * torch.compile(model), then loss.backward()): the values the tape holds
 * are outputs of the compiled graph, so kl_backward outside runs on them. */
static kl_status forward_only(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                              void *user)
{
	(void)nin, (void)nout;
	model *m = user;
	kl_tensor *x = in[0], *tgt = in[1];
	int64_t xs[3] = {x->shape[0], 4, 1};
	kl_tensor *y = kl_add(kl_sum(kl_mul(kl_reshape(x, 3, xs), m->w), 1, ax1, false), m->b);
	kl_tensor *d = kl_sub(kl_sigmoid(y), tgt);
	out[0] = kl_mean(kl_mul(d, d), 0, NULL, false);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_compiled_forward_eager_backward(void **state)
{
	(void)state;
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 4}, N, CG, 31);
	kl_tensor *tgt = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 3}, N, CG, 32);
	model m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 33),
	           kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 34), 0};
	kl_set_requires_grad(m.w, true);
	kl_set_requires_grad(m.b, true);
	kl_tensor *in[2] = {x, tgt};
	/* eager reference */
	kl_tensor *le = NULL;
	kl_scope_begin(ctx);
	assert_int_equal(forward_only(ctx, in, 2, &le, 1, &m), KL_OK);
	assert_int_equal(kl_backward(le, NULL), KL_OK);
	kl_scope_end(ctx);
	double *gw = kltest_read(kl_grad(m.w)), *gb = kltest_read(kl_grad(m.b));
	kl_grad_clear(m.w);
	kl_grad_clear(m.b);
	for (int fg = 0; fg < 2; fg++) {
		kl_compile_opts o = {.fullgraph = fg == 1};
		kl_fn *f = kl_compile(ctx, forward_only, &m, 2, 1, &o);
		/* fullgraph: never replayed past the tape. The third call's
		 * backward adds into the second's .grad (the compiled backward
		 * graph reads .grad and adds) */
		for (int call = 0; call < 3; call++) {
			kl_tensor *lc = NULL;
			if (kl_fn_call(f, in, &lc) != KL_OK)
				fail_msg("kl_fn_call: %s", kl_last_error(ctx));
			assert_true(kl_requires_grad(lc));
			if (kl_backward(lc, NULL) != KL_OK)
				fail_msg("kl_backward after the call: %s", kl_last_error(ctx));
			kl_release(lc);
			if (call == 1)
				continue;
			double *cw = kltest_read(kl_grad(m.w)), *cb = kltest_read(kl_grad(m.b));
			double k = call == 2 ? 2 : 1;
			for (int i = 0; i < 12; i++)
				cw[i] /= k, cb[i % 3] /= i < 3 ? k : 1;
			assert_true(kltest_compare("w.grad, compiled forward", KL_F32, 2,
			                           (int64_t[]){4, 3}, cw, gw, 1));
			assert_true(kltest_compare("b.grad, compiled forward", KL_F32, 1, (int64_t[]){3},
			                           cb, gb, 1));
			free(cw);
			free(cb);
			kl_grad_clear(m.w);
			kl_grad_clear(m.b);
		}
		kl_fn_free(f);
	}
	free(gw);
	free(gb);
	kl_release(x);
	kl_release(tgt);
	kl_release(m.w);
	kl_release(m.b);
}

/* kl_backward inside the function, the gradients left in .grad for the
 * caller (no optimizer inside): with fullgraph, a later call with new input
 * values must compute them again, not replay a plan that leaves the first
 * call's .grad behind. */
static kl_status grads_left(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	model *m = user;
	kl_grad_clear(m->w);
	kl_grad_clear(m->b);
	kl_status st = forward_only(c, in, nin, out, nout, user);
	return st == KL_OK ? kl_backward(out[0], NULL) : st;
}

static void test_grads_left_fullgraph(void **state)
{
	(void)state;
	model m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 43),
	           kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 44), 0};
	/* the eager reference's own parameters (same values, other memory), so
	 * that nothing but the compiled calls touches m */
	model me = {kl_add_scalar(m.w, 0.0), kl_add_scalar(m.b, 0.0), 0};
	kl_set_requires_grad(m.w, true);
	kl_set_requires_grad(m.b, true);
	kl_set_requires_grad(me.w, true);
	kl_set_requires_grad(me.b, true);
	kl_tensor *tgt = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 3}, N, CG, 42);
	kl_fn *f = kl_compile(ctx, grads_left, &m, 2, 1, &(kl_compile_opts){.fullgraph = true});
	for (int call = 0; call < 3; call++) {
		kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 4}, N, CG, 45 + call);
		kl_tensor *in[2] = {x, tgt}, *le = NULL, *lc = NULL;
		/* the eager reference for this call's input */
		kl_scope_begin(ctx);
		assert_int_equal(grads_left(ctx, in, 2, &le, 1, &me), KL_OK);
		kl_scope_end(ctx);
		double *gw = kltest_read(kl_grad(me.w)), *gb = kltest_read(kl_grad(me.b));
		if (kl_fn_call(f, in, &lc) != KL_OK)
			fail_msg("kl_fn_call: %s", kl_last_error(ctx));
		kl_release(lc);
		double *cw = kltest_read(kl_grad(m.w)), *cb = kltest_read(kl_grad(m.b));
		assert_true(kltest_compare("w.grad left by a fullgraph call", KL_F32, 2,
		                           (int64_t[]){4, 3}, cw, gw, 1));
		assert_true(kltest_compare("b.grad left by a fullgraph call", KL_F32, 1,
		                           (int64_t[]){3}, cb, gb, 1));
		free(gw);
		free(gb);
		free(cw);
		free(cb);
		kl_release(x);
	}
	kl_fn_free(f);
	kl_release(tgt);
	model *ms[2] = {&m, &me};
	for (int i = 0; i < 2; i++) {
		kl_grad_clear(ms[i]->w);
		kl_grad_clear(ms[i]->b);
		kl_release(ms[i]->w);
		kl_release(ms[i]->b);
	}
}

/* ---- create_graph: second derivatives ------------------------------------------------ */

/* Case c's scalar loss of leaves p[] (f64), its constants drawn afresh from
 * fixed seeds: tanh, a matmul (bilinear: the mixed second derivatives),
 * softmax, layer_norm (x and weight) and mse. */
enum { CG_CASES = 5 };
static const int cg_np[CG_CASES] = {1, 2, 1, 2, 1};
static const int64_t cg_shape[CG_CASES][2][2] = {
        {{3, 5}, {0, 0}}, {{3, 4}, {4, 5}}, {{3, 6}, {0, 0}}, {{3, 6}, {6, 0}}, {{4, 3}, {0, 0}}};
static const char *const cg_name[CG_CASES] = {"tanh", "matmul", "softmax", "layer_norm", "mse"};

static int cg_ndim(int c, int i)
{
	return cg_shape[c][i][1] ? 2 : 1;
}

static int64_t cg_numel(int c, int i)
{
	return cg_shape[c][i][0] * (cg_ndim(c, i) == 2 ? cg_shape[c][i][1] : 1);
}

static kl_tensor *cg_loss(int c, kl_tensor *const *p)
{
	int64_t out[2] = {3, c == 1 ? 5 : cg_shape[c][0][1]};
	if (c == 4)
		out[0] = 4;
	kl_tensor *k = kltest_rand(ctx, KL_F64, 2, out, N, CG, 900 + c);
	kl_tensor *y =
	        c == 0   ? kl_tanh(p[0])
	        : c == 1 ? kl_matmul(p[0], p[1])
	        : c == 2 ? kl_softmax(p[0], -1)
	        : c == 3 ? kl_layer_norm(p[0], p[1],
	                                 kltest_rand(ctx, KL_F64, 1, (int64_t[]){6}, N, CG, 950),
	                                 1e-5)
	                 : NULL;
	if (c == 4)
		return kl_mse_loss(kl_mul(p[0], p[0]), k);
	return kl_sum(kl_mul(y, k), 0, NULL, false);
}

/* Leaves from host values (f64), requiring grad. */
static void cg_leaves(int c, double *const *vals, kl_tensor **p)
{
	for (int i = 0; i < cg_np[c]; i++) {
		int64_t n = cg_numel(c, i);
		p[i] = kl_from_host(ctx, KL_F64, cg_ndim(c, i), cg_shape[c][i], vals[i],
		                    (size_t)n * sizeof(double));
		assert_non_null(p[i]);
		kl_set_requires_grad(p[i], true);
	}
}

/* F(vals) = sum_i <grad_i(vals), v_i>, the gradients by a plain kl_backward */
static double cg_dot_grad(int c, double *const *vals, double *const *v)
{
	kl_scope_begin(ctx);
	kl_tensor *p[2];
	cg_leaves(c, vals, p);
	assert_int_equal(kl_backward(cg_loss(c, p), NULL), KL_OK);
	double f = 0;
	for (int i = 0; i < cg_np[c]; i++) {
		double *g = grad_values(p[i]);
		for (int64_t e = 0; e < cg_numel(c, i); e++)
			f += g[e] * v[i][e];
		free(g);
		kl_grad_clear(p[i]);
	}
	kl_scope_end(ctx);
	return f;
}

/* kl_backward_ex with create_graph, then kl_backward of sum_i <grad_i, v_i>:
 * the leaves' new .grad is the Hessian-vector product, checked against
 * central differences (float64) of the first gradient's <grad, v>. */
static void test_create_graph(void **state)
{
	(void)state;
	for (int c = 0; c < CG_CASES; c++) {
		kl_scope_begin(ctx);
		double *vals[2] = {NULL, NULL}, *v[2] = {NULL, NULL}, *h[2] = {NULL, NULL};
		kl_tensor *p[2];
		for (int i = 0; i < cg_np[c]; i++) {
			kl_tensor *a = kltest_rand(ctx, KL_F64, cg_ndim(c, i), cg_shape[c][i], N,
			                           CG, 700 + 10 * c + i);
			kl_tensor *b = kltest_rand(ctx, KL_F64, cg_ndim(c, i), cg_shape[c][i], N,
			                           CG, 800 + 10 * c + i);
			vals[i] = kltest_read(a);
			v[i] = kltest_read(b);
		}
		cg_leaves(c, vals, p);
		assert_int_equal(kl_backward_ex(cg_loss(c, p), NULL,
		                                &(kl_backward_opts){.create_graph = true}),
		                 KL_OK);
		kl_tensor *second = NULL;
		for (int i = 0; i < cg_np[c]; i++) {
			kl_tensor *g = kl_grad(p[i]);
			assert_non_null(g);
			if (!kl_requires_grad(g))
				fail_msg("%s: the gradient of leaf %d does not require grad",
				         cg_name[c], i);
			kl_tensor *vi = kl_from_host(ctx, KL_F64, cg_ndim(c, i), cg_shape[c][i],
			                             v[i], (size_t)kl_numel(g) * sizeof(double));
			kl_tensor *d = kl_sum(kl_mul(g, vi), 0, NULL, false);
			second = second ? kl_add(second, d) : d;
		}
		/* the first gradients equal a plain backward's */
		double f0 = 0;
		for (int i = 0; i < cg_np[c]; i++) {
			double *g = grad_values(p[i]);
			for (int64_t e = 0; e < kl_numel(p[i]); e++)
				f0 += g[e] * v[i][e];
			free(g);
			kl_grad_clear(p[i]);
		}
		double plain = cg_dot_grad(c, vals, v);
		if (!(fabs(f0 - plain) <= 1e-12 * (1 + fabs(plain))))
			fail_msg("%s: <grad, v> with create_graph %.17g, without %.17g", cg_name[c],
			         f0, plain);
		assert_int_equal(kl_backward(second, NULL), KL_OK);
		for (int i = 0; i < cg_np[c]; i++) {
			assert_non_null(kl_grad(p[i]));
			h[i] = grad_values(p[i]);
			kl_grad_clear(p[i]);
		}
		const double eps = 1e-5;
		for (int i = 0; i < cg_np[c]; i++)
			for (int64_t e = 0; e < kl_numel(p[i]); e++) {
				double x0 = vals[i][e];
				vals[i][e] = x0 + eps;
				double fp = cg_dot_grad(c, vals, v);
				vals[i][e] = x0 - eps;
				double fm = cg_dot_grad(c, vals, v);
				vals[i][e] = x0;
				double fd = (fp - fm) / (2 * eps);
				if (!(fabs(h[i][e] - fd) <= 1e-6 * (1 + fabs(fd))))
					fail_msg(
					        "%s: second derivative of leaf %d [%lld]: %.12g, central "
					        "difference (float64) %.12g",
					        cg_name[c], i, (long long)e, h[i][e], fd);
			}
		for (int i = 0; i < cg_np[c]; i++) {
			free(vals[i]);
			free(v[i]);
			free(h[i]);
		}
		kl_scope_end(ctx);
	}
	/* after a compiled forward, or inside a compiled function: refused, and
	 * nothing changes */
	kl_tensor *cx = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 4}, N, CG, 47);
	kl_tensor *tgt = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 3}, N, CG, 48);
	model m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 49),
	           kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 50), 0};
	kl_set_requires_grad(m.w, true);
	kl_fn *f = kl_compile(ctx, forward_only, &m, 2, 1, NULL);
	kl_tensor *loss = NULL;
	assert_int_equal(kl_fn_call(f, (kl_tensor *[]){cx, tgt}, &loss), KL_OK);
	EXPECT(kl_backward_ex(loss, NULL, &(kl_backward_opts){.create_graph = true}),
	       KL_EUNSUPPORTED, "kl_backward_ex: create_graph after a compiled forward", "[] f32");
	assert_null(kl_grad(m.w));
	assert_int_equal(kl_backward(loss, NULL), KL_OK);
	assert_non_null(kl_grad(m.w));
	kl_grad_clear(m.w);
	kl_release(loss);
	kl_fn_free(f);
	kl_release(cx);
	kl_release(tgt);
	kl_release(m.w);
	kl_release(m.b);
}

/* retain_graph: a second backward through the same graph adds the same
 * gradient again (against float64), a second loss over a shared forward
 * works after the first, the graph is consumed by the first backward
 * without it; eager and compiled forward + backward after. create_graph is
 * refused (KL_EUNSUPPORTED) and changes nothing. */
static void test_retain_graph(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	const kl_backward_opts keep = {.retain_graph = true};
	kl_tensor *x = kltest_rand(ctx, KL_F32, 1, (int64_t[]){7}, N, CG, 41);
	kl_tensor *w = kltest_rand(ctx, KL_F32, 1, (int64_t[]){7}, N, CG, 42);
	double *xv = kltest_read(x), *wv = kltest_read(w);
	kl_set_requires_grad(x, true);
	/* d sum(x*x*w)/dx = 2xw: twice retained, then once more consuming */
	kl_tensor *l = kl_sum(kl_mul(kl_mul(x, x), w), 0, NULL, false);
	for (int k = 1; k <= 3; k++) {
		assert_int_equal(k < 3 ? kl_backward_ex(l, NULL, &keep) : kl_backward(l, NULL), KL_OK);
		double *g = grad_values(x);
		for (int i = 0; i < 7; i++) {
			double want = k * 2.0 * xv[i] * wv[i];
			if (!(fabs(g[i] - want) <= 1e-5 * fabs(want) + 1e-30))
				fail_msg("retain_graph backward %d: grad[%d] = %.9g, float64 %.9g", k, i,
				         g[i], want);
		}
		free(g);
	}
	/* consumed: the loss is off the tape, as after any backward */
	EXPECT(kl_backward(l, NULL), KL_EINVAL, "kl_backward: no tensor that requires grad");
	EXPECT(kl_backward_ex(l, NULL, &keep), KL_EINVAL, "kl_backward_ex: no tensor");
	kl_grad_clear(x);
	/* two losses sharing h = x*w: d(sum(h*h) + sum(h))/dx = (2h + 1)w */
	kl_tensor *h = kl_mul(x, w);
	kl_tensor *l1 = kl_sum(kl_mul(h, h), 0, NULL, false), *l2 = kl_sum(h, 0, NULL, false);
	assert_int_equal(kl_backward_ex(l1, NULL, &keep), KL_OK);
	assert_int_equal(kl_backward(l2, NULL), KL_OK);
	double *g = grad_values(x);
	for (int i = 0; i < 7; i++) {
		double hv = xv[i] * wv[i], want = (2 * hv + 1) * wv[i];
		if (!(fabs(g[i] - want) <= 1e-5 * fabs(want) + 1e-30))
			fail_msg("shared forward: grad[%d] = %.9g, float64 %.9g", i, g[i], want);
	}
	free(g);
	kl_grad_clear(x);
	free(xv);
	free(wv);
	/* compiled forward, backward after it twice (retained), then once: the
	 * gradients of one backward, three times */
	kl_tensor *cx = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 4}, N, CG, 43);
	kl_tensor *tgt = kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 3}, N, CG, 44);
	model m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 3}, N, CG, 45),
	           kltest_rand(ctx, KL_F32, 1, (int64_t[]){3}, N, CG, 46), 0};
	kl_set_requires_grad(m.w, true);
	kl_fn *f = kl_compile(ctx, forward_only, &m, 2, 1, NULL);
	assert_non_null(f);
	double *once = NULL;
	for (int pass = 0; pass < 2; pass++) {
		kl_tensor *loss = NULL;
		assert_int_equal(kl_fn_call(f, (kl_tensor *[]){cx, tgt}, &loss), KL_OK);
		for (int k = 0; k < (pass ? 3 : 1); k++)
			assert_int_equal(k < 2 && pass ? kl_backward_ex(loss, NULL, &keep)
			                              : kl_backward(loss, NULL),
			                 KL_OK);
		double *gw = grad_values(m.w);
		if (!pass)
			once = gw;
		for (int i = 0; pass && i < 12; i++)
			if (!(fabs(gw[i] - 3 * once[i]) <= 1e-5 * fabs(3 * once[i]) + 1e-30))
				fail_msg("compiled forward, 3 backwards: grad[%d] = %.9g, want %.9g", i,
				         gw[i], 3 * once[i]);
		if (pass)
			free(gw);
		kl_grad_clear(m.w);
		kl_release(loss);
	}
	free(once);
	kl_fn_free(f);
	kl_scope_end(ctx);
}

/* The min-cut partition on a small joint graph: x (input) -> e = exp(x)
 * (recomputable) -> m = e @ w (a product: only kept, never recomputed) ->
 * s = sigmoid(m); the backward reads e and s. e comes again from x for
 * free; s costs as much as m: one of the two is kept. A reduction the
 * backward reads is kept whatever it costs. */
static void test_partition(void **state)
{
	(void)state;
	kl_graph g;
	kl__graph_init(&g);
	kl_node n;
	memset(&n, 0, sizeof n);
	n.dtype = KL_F32;
	n.ndim = 2;
	n.shape[0] = n.shape[1] = 64;
	n.op = KL_OP_INPUT;
	int32_t x = kl__graph_add(&g, &n), w = kl__graph_add(&g, &n);
	assert_int_equal(kl__graph_add_input(&g, x), 0);
	assert_int_equal(kl__graph_add_input(&g, w), 0);
	n.op = KL_OP_EXP, n.nin = 1, n.in[0] = x;
	int32_t e = kl__graph_add(&g, &n);
	n.op = KL_OP_MATMUL, n.nin = 2, n.in[0] = e, n.in[1] = w;
	int32_t m = kl__graph_add(&g, &n);
	n.op = KL_OP_SIGMOID, n.nin = 1, n.in[0] = m;
	int32_t sg = kl__graph_add(&g, &n);
	n.op = KL_OP_SUM, n.nin = 1, n.in[0] = sg, n.shape[1] = 1;
	int32_t r = kl__graph_add(&g, &n);
	bool reads[6] = {0}, fr[6] = {0}, save[6];
	reads[e] = reads[sg] = true;
	assert_int_equal(kl__partition(&g, g.n, reads, fr, save), 64 * 64 * 4);
	assert_false(save[x] || save[w] || save[e] || save[r]);
	assert_true(save[m] != save[sg]);
	/* returned anyway (free): nothing to keep for s */
	fr[sg] = true;
	assert_int_equal(kl__partition(&g, g.n, reads, fr, save), 0);
	/* the reduction, read: kept */
	fr[sg] = false;
	reads[r] = true;
	assert_int_equal(kl__partition(&g, g.n, reads, fr, save), 64 * 64 * 4 + 64 * 4);
	assert_true(save[r]);
	kl__graph_free(&g);
}

/* A forward whose results the program drops, with grad mode on and no
 * backward (inference that forgot kl_set_grad_enabled): the tape lets go of
 * what no backward can reach, so memory stays flat. */
static void test_tape_pruned(void **state)
{
	(void)state;
	kl_tensor *w = kltest_rand(ctx, KL_F32, 2, (int64_t[]){64, 64}, N, CG, 41);
	kl_set_requires_grad(w, true);
	kl_memory_usage u0, u1;
	size_t most = 0;
	for (int i = 0; i < 2000; i++) {
		kl_scope_begin(ctx);
		kl_tensor *y = kl_exp(kl_mul_scalar(w, 0.5));
		assert_true(kl_requires_grad(y));
		kl_scope_end(ctx);
		if (i == 100)
			assert_int_equal(kl_memory_stats(ctx, &u0), KL_OK);
		if (i > 100) {
			assert_int_equal(kl_memory_stats(ctx, &u1), KL_OK);
			if (u1.in_use > most)
				most = u1.in_use;
		}
	}
	/* 2000 iterations keep two 16 KiB tensors each: 64 MiB without pruning */
	if (most > u0.in_use + ((size_t)4 << 20))
		fail_msg("tape memory grows: %zu bytes in use after 100 forwards, %zu later",
		         u0.in_use, most);
	/* and a backward still works on a fresh forward */
	kl_tensor *l = kl_sum(kl_mul(w, w), 0, NULL, false);
	assert_int_equal(kl_backward(l, NULL), KL_OK);
	assert_non_null(kl_grad(w));
	kl_release(l);
	kl_release(w);
}

static int setup(void **state)
{
	(void)state;
	ctx = kltest_ctx_from_env("test_grad");
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(ctx);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_builders),
	        cmocka_unit_test(test_table_covers_rules),
	        cmocka_unit_test(test_ties),
	        cmocka_unit_test(test_accumulate_clear_detach),
	        cmocka_unit_test(test_errors),
	        cmocka_unit_test(test_error_no_rule),
	        cmocka_unit_test(test_copy_in_trace),
	        cmocka_unit_test(test_whole_step_compiled),
	        cmocka_unit_test(test_compiled_forward_eager_backward),
	        cmocka_unit_test(test_grads_left_fullgraph),
	        cmocka_unit_test(test_retain_graph),
	        cmocka_unit_test(test_create_graph),
	        cmocka_unit_test(test_tape_pruned),
	        cmocka_unit_test(test_partition),
	        cmocka_unit_test(test_grad_f64),
	        cmocka_unit_test(test_grad_f32),
	        cmocka_unit_test(test_grad_f16_bf16),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
