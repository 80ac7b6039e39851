/* test_cuda_gen.c - the second backend end to end: CUDA C generated for a set
 * of graphs (pointwise, reductions, row kernels, every dtype, fusion on and
 * off) must compile with NVRTC for sm_90 (no GPU needed); with a GPU, every
 * op eagerly on CUDA and compiled graphs against the float64 reference.
 */
#include <ctype.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "kltest.h"
#include "codegen/render.h"
#include "codegen/row_onepass.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"

#ifdef KILN_HAVE_CUDA
#include "backend/cuda/device.h"

typedef int (*build_fn)(kl_tensor *const *in, kl_tensor **out, const void *p);

static kl_trace *trace(kl_ctx *ctx, build_fn f, kl_tensor *const *in, const void *p)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *outs[8] = {NULL};
	int nout = f(in, outs, p);
	kl_trace *tr = kl__trace_end(ctx, nout, outs);
	kl_scope_end(ctx);
	return tr;
}

/* ---- graphs ---------------------------------------------------------------------- */

static int b_fma_relu(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
	return 1;
}

/* one load a point: a pointwise kernel whose chunks are unrolled most */
static int b_gelu1(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_gelu(in[0]);
	return 1;
}

/* four loads a point (in[0..3]) */
static int b_four(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_relu(kl_add(kl_mul(in[0], in[1]), kl_mul(in[2], in[3])));
	return 1;
}

/* a skinny linear layer (8 rows against a 256x256 weight): one generated
 * row reduction with its bias and GELU, no library product */
static int b_skinny_linear(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_gelu(kl_linear(in[0], in[1], in[2]));
	return 1;
}

/* two skinny layers: the second product's kernel (the program's second
 * step) may load its weight before it waits for the first */
static int b_two_linears(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_linear(kl_gelu(kl_linear(in[0], in[1], NULL)), in[2], NULL);
	return 1;
}

/* rms_norm written from primitives, as the bench's rms_norm_prims */
static int b_rms_prims(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *x = in[0];
	kl_tensor *ms = kl_mean(kl_mul(x, x), 1, (int[]){-1}, true);
	out[0] = kl_mul(kl_mul(x, kl_rsqrt(kl_add_scalar(ms, 1e-6))), in[1]);
	return 1;
}

static int b_softmax(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_softmax(in[0], -1);
	return 1;
}

/* softmax and layer norm written from primitives: the same one-reduction
 * pairs of passes are found in their kernels */
static int b_softmax_prims(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *x = in[0];
	kl_tensor *e = kl_exp(kl_sub(x, kl_max(x, 1, (int[]){-1}, true)));
	out[0] = kl_div(e, kl_sum(e, 1, (int[]){-1}, true));
	return 1;
}

static int b_layer_norm_prims(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *x = in[0];
	kl_tensor *d = kl_sub(x, kl_mean(x, 1, (int[]){-1}, true));
	kl_tensor *v = kl_mean(kl_mul(d, d), 1, (int[]){-1}, true);
	out[0] = kl_add(kl_mul(kl_mul(d, kl_rsqrt(kl_add_scalar(v, 1e-5))), in[1]), in[2]);
	return 1;
}

static int b_log_softmax(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_log_softmax(in[0], 1);
	return 1;
}

static int b_layer_norm(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_layer_norm(in[0], in[1], in[2], 1e-5);
	return 1;
}

/* a skinny product, then a layer norm with the product's own weight and
 * bias (the second step's row-invariant inputs) */
static int b_linear_layer_norm(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_layer_norm(kl_linear(in[0], in[1], NULL), in[2], in[2], 1e-5);
	return 1;
}

static int b_rms_norm(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_rms_norm(in[0], in[1], 1e-6);
	return 1;
}

/* every unary and binary op, casts, compares, where, rand */
static int b_zoo(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0], *b = in[1];
	kl_tensor *t = kl_add(kl_sub(a, b), kl_mul(kl_div(a, b), kl_pow(kl_abs(a), b)));
	t = kl_add(t, kl_maximum(kl_exp(a), kl_log(kl_abs(b))));
	t = kl_add(t, kl_minimum(kl_sqrt(kl_abs(a)), kl_rsqrt(kl_abs(b))));
	t = kl_add(t, kl_add(kl_sin(a), kl_cos(b)));
	t = kl_add(t, kl_add(kl_tanh(a), kl_sigmoid(b)));
	t = kl_add(t, kl_add(kl_gelu(a), kl_gelu_tanh(b)));
	t = kl_add(t, kl_add(kl_silu(a), kl_neg(kl_relu(b))));
	t = kl_where(kl_gt(a, b), t, kl_clamp(a, -1, 1));
	out[0] = t;
	out[1] = kl_cast(kl_le(a, b), KL_I32);
	out[2] = kl_cast(kl_cast(a, KL_I64), KL_F32);
	return 3;
}

static int b_ints(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0], *b = in[1];
	out[0] = kl_add(kl_mul(a, b), kl_sub(kl_neg(a), kl_abs(b)));
	out[1] = kl_maximum(kl_pow(a, kl_abs(b)), kl_minimum(a, kl_relu(b)));
	out[2] = kl_sum(a, 1, (int[]){1}, false);
	out[3] = kl_argmax(b, 1, false);
	out[4] = kl_div(a, b);
	out[5] = kl_matmul(a, kl_transpose(b, 0, 1)); /* no cuBLASLt: generated */
	return 6;
}

static int b_reduce(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0];
	out[0] = kl_sum(a, 1, (int[]){1}, false);
	out[1] = kl_max(a, 1, (int[]){0}, true);
	out[2] = kl_min(a, 2, (int[]){0, 1}, false);
	out[3] = kl_argmax(a, 0, false);
	kl_dtype dt = kl_tensor_dtype(a);
	if (dt == KL_I32 || dt == KL_I64)
		return 4;
	out[4] = kl_mean(a, 1, (int[]){1}, false);
	out[5] = kl_var(a, 1, (int[]){1}, 1, false);
	return 6;
}

/* reductions over the contiguous last dim: the register-row path */
static int b_reduce_last(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0];
	out[0] = kl_sum(a, 1, (int[]){1}, false);
	out[1] = kl_max(a, 1, (int[]){1}, true);
	out[2] = kl_argmax(a, 1, false);
	kl_dtype dt = kl_tensor_dtype(a);
	if (dt == KL_I32 || dt == KL_I64)
		return 3;
	out[3] = kl_mean(a, 1, (int[]){1}, false);
	out[4] = kl_var(a, 1, (int[]){1}, 1, false);
	return 5;
}

/* sums over the leading dims (a bias gradient): partials of 32 rows in a
 * column kernel (a thread an output, coalesced), then their sum; keepdim,
 * a fused prologue and a fused epilogue */
static int b_colsum(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0];
	out[0] = kl_sum(a, 2, (int[]){0, 1}, false);
	out[1] = kl_mul_scalar(kl_sum(kl_exp(a), 1, (int[]){0}, true), 0.5);
	return 2;
}

/* outputs of other widths than the input: chunks of 8 elements as 8, 16,
 * 32 and 64 bytes in one kernel */
static int b_mixed(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0];
	out[0] = kl_cast(kl_mul(a, a), KL_F32);
	out[1] = kl_gt_scalar(a, 0.25);
	out[2] = kl_add(kl_cast(a, KL_F64), kl_cast(in[1], KL_F64));
	return 3;
}

static int b_move(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = in[0];
	kl_tensor *t = kl_contiguous(kl_transpose(a, 0, 1));
	out[0] = kl_concat(2, (kl_tensor *[]){t, kl_slice(t, 0, 0, 4, 1)}, 0);
	out[1] = kl_reshape(kl_exp(a), 1, (int64_t[]){kl_numel(a)});
	return 2;
}

static int b_create(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_ctx *ctx = kl_tensor_ctx(in[0]);
	kl_dtype dt = kl_tensor_dtype(in[0]);
	out[0] = kl_add(in[0], kl_rand(ctx, dt, 2, (int64_t[]){37, 45}, 7));
	out[1] = kl_add(in[0], kl_randn(ctx, dt, 2, (int64_t[]){37, 45}, 9));
	out[2] = kl_arange(ctx, dt, 0, 50, 1);
	out[3] = kl_full(ctx, dt, 1, (int64_t[]){3}, 2.5);
	return 4;
}

/* dropout in a trace: rand keyed at run time by two i32 inputs (the
 * generated kernel reads the key), fused with the scaling into one kernel */
static int b_dropout(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	out[0] = kl_dropout(in[0], 0.3, 1234, 77, true);
	return 1;
}

/* embedding-style lookups: computed indices, a view as the table, a reduction after */
static int b_gather(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_ctx *ctx = kl_tensor_ctx(in[0]);
	kl_tensor *t = in[0]; /* [8, 12] */
	out[0] = kl_gather(t, kl_arange(ctx, KL_I64, 7, -1, -1));
	out[1] = kl_sum(kl_gather(kl_transpose(t, 0, 1), kl_arange(ctx, KL_I32, 0, 12, 2)), 1,
	                (int[]){-1}, false);
	return 2;
}

/* index_add: rows 7..3 twice into an [8, 12] base (repeats, untouched rows) */
static int b_index_add(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_ctx *ctx = kl_tensor_ctx(in[0]);
	kl_tensor *idx = kl_expand(kl_arange(ctx, KL_I64, 7, 2, -1), 2, (int64_t[]){2, 5});
	out[0] = kl_index_add(in[0], kl_reshape(idx, 1, (int64_t[]){10}), in[1]);
	return 1;
}

typedef struct gcase {
	const char *name;
	build_fn f;
	int nin;
	int ndim[3];
	int64_t shape[3][3];
	bool floats_only;
	bool ints_only;
	int kernels; /* fused kernel count expected (0: not checked) */
	/* > 0: input 0 is a view at this element offset in the last dim of a
	 * tensor 16 elements wider (offset 1: misaligned, the scalar path at run
	 * time; 8: 16-byte aligned, the chunked path with a wider row stride) */
	int off;
	bool chunked; /* fused f32, f16 and bf16 kernels have the chunked path */
	/* > 0: the threads per row of the fused bf16 kernel's chunked path */
	int group;
	/* input 0 (2-d, 4+ rows) gets a NaN in row 1, row 2 all -inf, +inf in row 3 */
	bool special;
} gcase;

static const gcase CASES[] = {
        {"relu(a*b+c)", b_fma_relu, 3, {2, 2, 1}, {{33, 70}, {33, 70}, {70}},
         false, false, 1, 0, 0, 0, false},
        {"softmax", b_softmax, 1, {2}, {{17, 300}}, true, false, 1, 0, 0, 0, false},
        {"softmax long", b_softmax, 1, {2}, {{3, 9000}}, true, false, 1, 0, 0, 0, false},
        {"softmax short", b_softmax, 1, {3}, {{4, 5, 10}}, true, false, 1, 0, 0, 0, false},
        {"log_softmax", b_log_softmax, 1, {3}, {{5, 40, 3}}, true, false, 0, 0, 0, 0, false},
        {"layer_norm", b_layer_norm, 3, {2, 1, 1}, {{9, 768}, {768}, {768}},
         true, false, 1, 0, 1, 0, false},
        {"rms_norm", b_rms_norm, 2, {2, 1}, {{9, 100}, {100}}, true, false, 1, 0, 0, 0, false},
        {"zoo", b_zoo, 2, {2, 2}, {{31, 19}, {31, 19}}, true, false, 0, 0, 0, 0, false},
        {"ints", b_ints, 2, {2, 2}, {{13, 29}, {13, 29}}, false, true, 0, 0, 0, 0, false},
        {"reduce", b_reduce, 1, {3}, {{6, 50, 7}}, false, false, 0, 0, 0, 0, false},
        {"move", b_move, 1, {2}, {{8, 12}}, false, false, 0, 0, 0, 0, false},
        {"gather", b_gather, 1, {2}, {{8, 12}}, false, false, 0, 0, 0, 0, false},
        {"index_add", b_index_add, 2, {2, 2}, {{8, 12}, {10, 12}}, true, false, 1, 0, 0, 0,
         false},
        {"create", b_create, 1, {2}, {{37, 45}}, true, false, 0, 0, 0, 0, false},
        {"dropout", b_dropout, 1, {2}, {{37, 45}}, true, false, 1, 0, 0, 0, false},
        /* the chunked paths (16-byte loads and stores, rows in registers):
         * broadcasts along rows, flat chunks with a scalar tail, views at
         * aligned and misaligned offsets, rows whose last chunk slot is
         * partly empty, a warp or the block per row, mixed widths */
        {"relu bcast", b_fma_relu, 3, {2, 2, 1}, {{33, 72}, {33, 72}, {72}},
         false, false, 1, 0, 1, 0, false},
        {"relu flat tail", b_fma_relu, 3, {2, 2, 2}, {{37, 45}, {37, 45}, {37, 45}}, false, false,
         1, 0, 1, 0, false},
        {"relu view+1", b_fma_relu, 3, {2, 2, 1}, {{33, 72}, {33, 72}, {72}},
         false, false, 1, 1, 1, 0, false},
        {"relu view+8", b_fma_relu, 3, {2, 2, 1}, {{33, 72}, {33, 72}, {72}},
         false, false, 1, 8, 1, 0, false},
        {"mixed", b_mixed, 2, {2, 2}, {{29, 64}, {29, 64}}, true, false, 0, 0, 1, 0, false},
        {"mixed tail", b_mixed, 2, {2, 2}, {{29, 61}, {29, 61}}, true, false, 0, 0, 1, 0, false},
        {"softmax 4096", b_softmax, 1, {2}, {{16, 4096}}, true, false, 1, 0, 1, 0, false},
        {"softmax 1000", b_softmax, 1, {2}, {{6, 1000}}, true, false, 1, 0, 1, 0, false},
        {"softmax view+8", b_softmax, 1, {2}, {{5, 512}}, true, false, 1, 8, 1, 0, false},
        {"layer_norm 2000", b_layer_norm, 3, {2, 1, 1}, {{4, 2000}, {2000}, {2000}}, true, false,
         1, 0, 1, 0, false},
        {"rms_norm 2048", b_rms_norm, 2, {2, 1}, {{7, 2048}, {2048}},
         true, false, 1, 0, 1, 0, false},
        {"rms_norm view+1", b_rms_norm, 2, {2, 1}, {{5, 512}, {512}},
         true, false, 1, 1, 1, 0, false},
        /* a misaligned view: the scalar path's 128-thread groups, two a
         * block, each many rows (one wave), a float max then double sums: a
         * group's double slot once overlapped the other group's float slots
         * (compute-sanitizer racecheck; wrong rows) */
        {"layer_norm view+1 2048x1024", b_layer_norm, 3, {2, 1, 1},
         {{2048, 1024}, {1024}, {1024}}, true, false, 1, 1, 1, 0, false},
        {"column sums", b_colsum, 1, {3}, {{4, 64, 1056}}, true, false, 0, 0, 0, 0, false},
        {"reduce last", b_reduce_last, 1, {2}, {{6, 64}}, false, false, 0, 0, 1, 0, false},
        {"rms prims 4096", b_rms_prims, 2, {2, 1}, {{6, 4096}, {4096}},
         true, false, 1, 0, 1, 0, false},
        /* skinny products are dot rows (plan_rows): mlp24's layer takes 64
         * threads a row (2048 rows of 32 chunks keep 131072 threads busy) */
        {"skinny linear", b_skinny_linear, 3, {2, 2, 1}, {{8, 256}, {256, 256}, {256}}, true,
         false, 1, 0, 1, 64, false},
        /* row groups between a warp and the block: rows not a multiple of
         * the rows a block takes, NaN and infinite rows */
        {"softmax 19x4096", b_softmax, 1, {2}, {{19, 4096}}, true, false, 1, 0, 1, 256, true},
        {"layer_norm 4096", b_layer_norm, 3, {2, 1, 1}, {{7, 4096}, {4096}, {4096}}, true, false,
         1, 0, 1, 256, true},
        {"rms_norm 4096", b_rms_norm, 2, {2, 1}, {{5, 4096}, {4096}}, true, false, 1, 0, 1, 256,
         true},
        /* few rows: the block each */
        {"skinny 2048", b_skinny_linear, 3, {2, 2, 1}, {{3, 2048}, {37, 2048}, {37}}, true, false,
         1, 0, 1, 256, false},
        /* the one-token decoder's products: 2048 -> 6144 (QKV), 2048 ->
         * 16384 (gate and up), 64 threads a row of 4 chunks each; 8192 ->
         * 2048 (down), the block a row */
        {"skinny qkv", b_skinny_linear, 3, {2, 2, 1}, {{1, 2048}, {6144, 2048}, {6144}}, true,
         false, 1, 0, 1, 64, false},
        {"skinny gate_up", b_skinny_linear, 3, {2, 2, 1}, {{1, 2048}, {16384, 2048}, {16384}},
         true, false, 1, 0, 1, 64, false},
        {"skinny down", b_skinny_linear, 3, {2, 2, 1}, {{1, 8192}, {2048, 8192}, {2048}}, true,
         false, 1, 0, 1, 256, false},
        {"two skinny linears", b_two_linears, 3, {2, 2, 2}, {{4, 256}, {512, 256}, {256, 512}},
         true, false, 2, 0, 1, 0, false},
        {"reduce last 2048", b_reduce_last, 1, {2}, {{9, 2048}}, true, false, 0, 0, 1, 0, true},
        /* the one-reduction pairs of passes (KILN_CUDA_ROW_ONEPASS): rows of
         * -inf, NaN, threads whose values are all -inf in finite rows; rows
         * of whole chunks (4096), of a last chunk slot partly empty (4100
         * f32), of no whole chunks (4100 bf16, 1001: the scalar path) */
        {"log_softmax 4096", b_log_softmax, 1, {2}, {{9, 4096}}, true, false, 1, 0, 1, 256, true},
        {"softmax prims 4096", b_softmax_prims, 1, {2}, {{19, 4096}}, true, false, 1, 0, 1, 256,
         true},
        {"layer_norm prims 4096", b_layer_norm_prims, 3, {2, 1, 1}, {{7, 4096}, {4096}, {4096}},
         true, false, 1, 0, 1, 256, true},
        {"softmax 4100", b_softmax, 1, {2}, {{7, 4100}}, true, false, 1, 0, 0, 0, true},
        {"layer_norm 4100", b_layer_norm, 3, {2, 1, 1}, {{7, 4100}, {4100}, {4100}}, true, false,
         1, 0, 0, 0, true},
        {"softmax 1001", b_softmax, 1, {2}, {{9, 1001}}, true, false, 1, 0, 0, 0, true},
        {"layer_norm prims 1001", b_layer_norm_prims, 3, {2, 1, 1}, {{7, 1001}, {1001}, {1001}},
         true, false, 1, 0, 0, 0, true},
};

/* the cases whose fused kernel has a pair of passes that one reduction
 * serves, in every float dtype */
static const char *const ONEPASS[] = {
        "softmax",          "softmax long",     "softmax short",         "log_softmax",
        "layer_norm",       "softmax 4096",     "softmax 1000",          "softmax view+8",
        "layer_norm 2000",  "softmax 19x4096",  "layer_norm 4096",       "log_softmax 4096",
        "softmax prims 4096", "layer_norm prims 4096", "softmax 4100",   "layer_norm 4100",
        "softmax 1001",     "layer_norm prims 1001",
};

static bool onepass_case(const gcase *c)
{
	for (size_t i = 0; i < sizeof(ONEPASS) / sizeof(ONEPASS[0]); i++)
		if (strcmp(ONEPASS[i], c->name) == 0)
			return true;
	return false;
}

/* The absolute error an f32 skinny product's output may carry, from the
 * rounding of its K-term sum (an f32 accumulation: cuBLASLt's
 * CUBLAS_COMPUTE_32F eagerly; compiled dot rows round each product to f32
 * and add in double, well inside it). Its inputs are uniform in [-2, 2): the
 * terms x*w have random signs and rms 4/3, a partial sum of j of them about
 * sqrt(j) * 4/3, and each of the K additions is off by up to u = 2^-24 of
 * its partial sum: for a sequential sum a standard deviation of
 * u * 4/3 * K / sqrt(2) (any blocked, split or tree order is smaller); three
 * of them, times gelu's steepest slope 1.13. K = 8192 (the down projection):
 * 1.6e-3 where the outputs are about 120 in size (1.3e-5 relative), where a
 * TF32 or 16-bit accumulation would be off by ~0.1; the median-based atol
 * (8e-5 times gelu's median, 0.16) failed an element that cancelled to 0.49
 * and was off by 7.7e-5 after a proper f32 sum.
 * In f16 and bf16 the sum is f32 too, but the product's output x may be
 * rounded to the 16-bit type before gelu (eagerly it is: two ops), by up to
 * u|x| (u = 2^-11, 2^-8). gelu's slope times |x| is at most 0.17 for x < 0
 * (at x = -2); for x > 0 the rounding is relative and rtol covers it. In the
 * negative tail the outputs are tiny and the median-based atol is too (on
 * the H100 skinny down bf16 gave -1.15e-5 for -1.33e-5 at x = -4.3). */
static double dot_atol(const gcase *c, kl_dtype dt)
{
	if (c->f != b_skinny_linear || (dt != KL_F32 && dt != KL_F16 && dt != KL_BF16))
		return 0;
	double K = (double)c->shape[0][c->ndim[0] - 1];
	double sum = 3.0 * 0x1p-24 * (4.0 / 3.0) * K / sqrt(2.0) * 1.13;
	double u = dt == KL_F16 ? 0x1p-11 : dt == KL_BF16 ? 0x1p-8 : 0;
	return sum + 0.2 * u;
}

static const kl_dtype ALL_DT[] = {KL_F32, KL_F16, KL_BF16, KL_F64, KL_I32, KL_I64, KL_BOOL};

static bool dt_fits(const gcase *c, kl_dtype dt)
{
	bool fl = dt == KL_F32 || dt == KL_F16 || dt == KL_BF16 || dt == KL_F64;
	if (c->floats_only)
		return fl;
	if (c->ints_only)
		return dt == KL_I32 || dt == KL_I64;
	return dt != KL_BOOL || c->f == b_move;
}

/* the NaN and infinities of a special case's input 0: a NaN in row 1, row
 * 2 all -inf, +inf in row 3; then rows (where there are) with -inf entries
 * that leave some threads of a row group only -inf: row 4 every chunk of 8
 * whose index is not a multiple of 3, row 5 positions 0..127 mod 256 (the
 * scalar path's lanes 0..127), row 6 all but the first 7 (a causal mask) */
static kl_tensor *with_specials(kl_ctx *ctx, kl_tensor *t, kl_dtype dt, const int64_t *shape)
{
	double *v = kltest_read(t);
	assert_non_null(v);
	int64_t n = shape[1];
	v[1 * n + 3] = NAN;
	for (int64_t i = 0; i < n; i++)
		v[2 * n + i] = -INFINITY;
	v[3 * n + n - 1] = INFINITY;
	for (int64_t i = 0; i < n; i++) {
		if (shape[0] > 4 && (i / 8) % 3 != 0)
			v[4 * n + i] = -INFINITY;
		if (shape[0] > 5 && i % 256 < 128)
			v[5 * n + i] = -INFINITY;
		if (shape[0] > 6 && i >= 7)
			v[6 * n + i] = -INFINITY;
	}
	kl_tensor *s = kltest_from_values(ctx, dt, 2, shape, v, KLTEST_CONTIG);
	assert_non_null(s);
	free(v);
	kl_release(t);
	return s;
}

static bool nvrtc_ok(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_status s = kl__cuda_load_nvrtc(ctx);
	if (s != KL_OK)
		print_message("test_cuda_gen: skipped, NVRTC is not loadable here: %s\n",
		              kl_last_error(ctx));
	kl_ctx_free(ctx);
	return s == KL_OK;
}

static void make_inputs(kl_ctx *ctx, const gcase *c, kl_dtype dt, uint64_t seed, kl_tensor **in)
{
	for (int i = 0; i < c->nin; i++) {
		int nd = c->ndim[i];
		int64_t shape[3];
		memcpy(shape, c->shape[i], sizeof shape);
		bool view = i == 0 && c->off > 0;
		if (view)
			shape[nd - 1] += 16;
		in[i] = kltest_rand(ctx, dt, nd, shape, c->f == b_zoo ? KLTEST_POS : KLTEST_NORMAL,
		                    KLTEST_CONTIG, seed + (uint64_t)i);
		assert_non_null(in[i]);
		if (view) {
			kl_tensor *v = kl_slice(in[i], nd - 1, c->off, c->off + c->shape[i][nd - 1], 1);
			assert_non_null(v);
			kl_release(in[i]);
			in[i] = v;
		}
		if (i == 0 && c->special && !view && nd == 2 && shape[0] >= 4)
			in[i] = with_specials(ctx, in[i], dt, shape);
	}
}

/* P's source compiles for sm_90 through NVRTC into a cubin; else the source
 * and NVRTC's log go to stderr and the test fails naming what (a format) */
static void must_compile(kl_ctx *ctx, const kl_program *P, const char *name, const char *fmt, ...)
        KL_PRINTF(4, 5);
static void must_compile(kl_ctx *ctx, const kl_program *P, const char *name, const char *fmt, ...)
{
	kl_cuda_image im;
	kl_nvrtc_opts no = {.arch = 90};
	if (kl__nvrtc_compile(ctx, P->source, name, &no, &im) != KL_OK) {
		char what[160];
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(what, sizeof what, fmt, ap);
		va_end(ap);
		fprintf(stderr, "%s\n---- log\n%s\n", P->source, im.log ? im.log : "");
		fail_msg("%s: %s", what, kl_last_error(ctx));
	}
	assert_memory_equal(im.data, "\177ELF", 4);
	kl__cuda_image_free(&im);
}

/* the group sizes of a source's row loops: "row group: G threads" (the
 * chunked path) or "row group (scalar): G threads" */
/* The runtime launches generated kernels with programmatic dependent launch:
 * each waits for the kernel before it (kl_pdl_wait) before it touches global
 * memory, except for loads of the program's inputs (__ldg) in a later step's
 * row kernel. Every kernel that accesses a buffer waits; *early counts the
 * kernels that load before they wait. */
static bool every_kernel_waits(const char *src, int *early)
{
	const char *sig = "extern \"C\" __global__";
	int n = 0;
	*early = 0;
	for (const char *p = strstr(src, sig); p; p = strstr(p + 1, sig)) {
		const char *body = strchr(p, '{'), *next = strstr(p + 1, sig);
		if (!body)
			return false;
		const char *w = strstr(body, "kl_pdl_wait();");
		if (!w || (next && w > next)) {
			/* no wait: only a kernel with nothing to do (no buffer access) */
			const char *end = next ? next : body + strlen(body);
			for (const char *q = strstr(body, "A.b["); q && q < end; q = strstr(q + 1, "A.b["))
				return false;
			continue;
		}
		/* before the wait: declarations and __ldg loads only; no store, no
		 * plain load, no scalar access b<n>[...] */
		for (const char *q = body; q < w; q++) {
			if (strncmp(q, "*((", 3) == 0 || strncmp(q, "= *(", 4) == 0)
				return false;
			if (*q == 'b' && q > body && !isalnum((unsigned char)q[-1]) && q[-1] != '_' &&
			    isdigit((unsigned char)q[1])) {
				const char *e = q + 1;
				while (isdigit((unsigned char)*e))
					e++;
				if (*e == '[')
					return false;
			}
		}
		char *ldg = strstr(body, "__ldg(");
		*early += ldg && ldg < w;
		n++;
	}
	return n > 0;
}

static bool has_group(const char *src, bool chunked, int G)
{
	char want[64];
	snprintf(want, sizeof want, "row group%s: %d threads,", chunked ? "" : " (scalar)", G);
	return strstr(src, want) != NULL;
}

/* The CUDA source of every case in every dtype, fused and not, compiles for
 * sm_90; fused row kernels and pointwise chains are one kernel each. */
/* The group reductions of the CUDA prelude give warp w word w of a half of
 * the shared scratch whatever the value's type (kl_slot): indexed by their
 * own size, a group's float slots shared words with the next group's double
 * slots, and groups do not wait for each other (a race compute-sanitizer
 * racecheck found in the norms). */
static void check_group_slots(void)
{
	const char *p = kl__render_cuda_prelude;
	static const char *const helpers[] = {"T kl_gred(", "void kl_glse(", "void kl_gvar(",
	                                      "void kl_gargmax("};
	for (size_t i = 0; i < sizeof helpers / sizeof helpers[0]; i++) {
		const char *h = strstr(p, helpers[i]);
		if (!h)
			fail_msg("the CUDA prelude has no %s", helpers[i]);
		const char *end = strstr(h, "\n}\n");
		assert_non_null(end);
		size_t n = (size_t)(end - h);
		char *body = malloc(n + 1);
		assert_non_null(body);
		memcpy(body, h, n);
		body[n] = 0;
		/* shared memory only through kl_slot: no typed pointer into the
		 * scratch, no [w] or [w0 + i] index of one */
		if (!strstr(body, "kl_slot<") || strstr(body, "[w]") || strstr(body, "[w0") ||
		    strstr(body, "*)(sh") || strstr(body, "*)(shi") || strstr(body, "*)(shv"))
			fail_msg("%s...: shared scratch not addressed by word (kl_slot):\n%s", helpers[i],
			         body);
		free(body);
	}
}

static void test_cuda_source_compiles(void **state)
{
	(void)state;
	check_group_slots();
	if (!nvrtc_ok())
		skip();
	kl_ctx *ctx = kl_ctx_new(NULL);
	int compiled = 0;
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++) {
		const gcase *c = &CASES[ci];
		for (size_t di = 0; di < sizeof(ALL_DT) / sizeof(ALL_DT[0]); di++) {
			kl_dtype dt = ALL_DT[di];
			if (!dt_fits(c, dt))
				continue;
			kl_tensor *in[3] = {NULL};
			make_inputs(ctx, c, dt, 100 + ci, in);
			kl_trace *tr = trace(ctx, c->f, in, NULL);
			if (!tr)
				fail_msg("%s %s: trace failed: %s", c->name, kl_dtype_name(dt),
				         kl_last_error(ctx));
			/* 2: fused, with every input dim symbolic (the run-time
			 * checks of the chunked paths on symbolic extents; a view
			 * input cannot be dynamic) */
			uint32_t dyn[3] = {~0u, ~0u, ~0u};
			for (int fu = 0; fu < (c->chunked && !c->off ? 3 : 2); fu++) {
				kl_lower_opts o = {.target = KL_TARGET_CUDA,
				                   .fusion = fu >= 1,
				                   .dyn_masks = fu == 2 ? dyn : NULL};
				kl_program P;
				char err[512];
				kl_status st = kl__lower(&tr->g, &o, &P, err, sizeof err);
				if (st != KL_OK && fu == 2) {
					/* a row length must stay static: only the rows vary */
					uint32_t rows[3] = {1u, 0, 0};
					o.dyn_masks = rows;
					st = kl__lower(&tr->g, &o, &P, err, sizeof err);
				}
				if (st != KL_OK)
					fail_msg("%s %s: lower: %s", c->name, kl_dtype_name(dt),
					         err);
				for (int32_t s = 0; c->f == b_ints && s < P.nsteps; s++)
					if (P.steps[s].kind == KL_STEP_MATMUL)
						fail_msg(
						        "ints %s: an integer product went to cuBLASLt",
						        kl_dtype_name(dt));
				if (fu == 1 && c->kernels && dt == KL_F32) {
					int nk = 0;
					for (int32_t s = 0; s < P.nsteps; s++)
						nk += P.steps[s].kind == KL_STEP_KERNEL;
					if (nk != c->kernels)
						fail_msg("%s: %d kernels, want %d", c->name, nk,
						         c->kernels);
				}
				if (fu == 1 && c->chunked &&
				    (dt == KL_F32 || dt == KL_F16 || dt == KL_BF16) &&
				    !strstr(P.source, "kl_vok"))
					fail_msg("%s %s: no chunked path generated", c->name,
					         kl_dtype_name(dt));
				if (fu == 1 && dt == KL_BF16 && c->group &&
				    !getenv("KILN_CUDA_ROW_GROUP") &&
				    !has_group(P.source, true, c->group))
					fail_msg("%s bf16 fusion %d: no chunked row group of %d threads",
					         c->name, fu, c->group);
				if (getenv("KILN_TEST_DUMP") &&
				    strstr(c->name, getenv("KILN_TEST_DUMP")))
					fprintf(stderr, "==== %s %s fusion %d\n%s\n", c->name,
					        kl_dtype_name(dt), fu,
					        getenv("KILN_TEST_DUMP_ALL") ? P.source : strstr(P.source, "struct kl_args"));
				/* float partials (16-bit rows) fall back to double where one
				 * is not finite, and never reduce across the group in float:
				 * bf16 has f32's range (a bf16 mean of +-3e38 was NaN) */
				if (strstr(P.source, "float kp") &&
				    (!strstr(P.source, "this thread's share in double") ||
				     strstr(P.source, ">(kp")))
					fail_msg("%s %s fusion %d: float partials without the double "
					         "fallback, or reduced in float",
					         c->name, kl_dtype_name(dt), fu);
				int early = 0;
				if (!every_kernel_waits(P.source, &early))
					fail_msg("%s %s fusion %d: a kernel touches memory before "
					         "kl_pdl_wait",
					         c->name, kl_dtype_name(dt), fu);
				/* the second product's weight: loaded before the wait */
				if (c->f == b_two_linears && fu == 1 && dt == KL_BF16 && early != 1)
					fail_msg("%s: %d kernels load early, want 1", c->name, early);
				must_compile(ctx, &P, c->name, "%s %s fusion %d", c->name, kl_dtype_name(dt),
				             fu);
				kl__program_free(&P);
				compiled++;
			}
			kl__trace_free(tr);
			for (int i = 0; i < c->nin; i++)
				kl_release(in[i]);
		}
	}
	print_message("test_cuda_gen: %d generated CUDA translation units compiled for sm_90\n",
	              compiled);
	kl_ctx_free(ctx);
}

/* ---- backward graphs (kl_backward inside a trace) ------------------------------- */

/* leaves: detached handles on in[0..n) marked as requiring grad; loss:
 * sum(y * y); outputs: the leaves' gradients */
static int grads_of(kl_tensor *const *in, int n, kl_tensor *(*fwd)(kl_tensor *const *),
                    kl_tensor **out)
{
	kl_tensor *x[3];
	for (int i = 0; i < n; i++) {
		x[i] = kl_detach(in[i]);
		assert_int_equal(kl_set_requires_grad(x[i], true), KL_OK);
	}
	kl_tensor *y = fwd(x);
	assert_int_equal(kl_backward(kl_sum(kl_mul(y, y), 0, NULL, false), NULL), KL_OK);
	for (int i = 0; i < n; i++)
		out[i] = kl_grad(x[i]);
	return n;
}

static kl_tensor *f_ln(kl_tensor *const *x)
{
	return kl_layer_norm(x[0], x[1], x[2], 1e-5);
}
static kl_tensor *f_attn(kl_tensor *const *x)
{
	return kl_sdpa(x[0], x[1], x[2], true, KL_SDPA_DEFAULT_SCALE);
}
static kl_tensor *f_sig_mm(kl_tensor *const *x)
{
	return kl_sigmoid(kl_matmul(x[0], x[1]));
}
static kl_tensor *f_xent(kl_tensor *const *x)
{
	return kl_log_softmax(x[0], 1);
}
static kl_tensor *f_gather(kl_tensor *const *x)
{
	kl_ctx *ctx = kl_tensor_ctx(x[0]);
	return kl_embedding(kl_arange(ctx, KL_I32, 0, 8, 3), x[0]);
}

/* The backward graphs of the rules in graph/grad_other.c lower for CUDA
 * (fused and not) and their source compiles for sm_90 in every float dtype. */
static void test_cuda_backward_source(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	static const struct {
		const char *name;
		kl_tensor *(*fwd)(kl_tensor *const *);
		int nin;
		int64_t shape[3][3];
		int ndim[3];
	} bc[] = {
		{"layer_norm backward", f_ln, 3, {{9, 96}, {96}, {96}}, {2, 1, 1}},
		{"sdpa backward", f_attn, 3, {{4, 7, 16}, {4, 9, 16}, {4, 9, 8}}, {3, 3, 3}},
		{"sigmoid(x @ w) backward", f_sig_mm, 2, {{16, 32}, {32, 24}}, {2, 2}},
		{"log_softmax backward", f_xent, 1, {{6, 50}}, {2}},
		{"embedding backward", f_gather, 1, {{10, 12}}, {2}},
	};
	const kl_dtype dts[] = {KL_F32, KL_BF16, KL_F16, KL_F64};
	kl_ctx *ctx = kl_ctx_new(NULL);
	int compiled = 0;
	for (size_t ci = 0; ci < sizeof bc / sizeof bc[0]; ci++) {
		for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
			kl_tensor *in[3] = {NULL}, *outs[3] = {NULL};
			for (int i = 0; i < bc[ci].nin; i++)
				in[i] = kltest_rand(ctx, dts[di], bc[ci].ndim[i], bc[ci].shape[i],
				                    KLTEST_NORMAL, KLTEST_CONTIG, 500 + ci * 8 + (size_t)i);
			kl_scope_begin(ctx);
			assert_int_equal(kl__trace_begin(ctx), KL_OK);
			int nout = grads_of(in, bc[ci].nin, bc[ci].fwd, outs);
			kl_trace *tr = kl__trace_end(ctx, nout, outs);
			kl_scope_end(ctx);
			if (!tr)
				fail_msg("%s %s: trace failed: %s", bc[ci].name,
				         kl_dtype_name(dts[di]), kl_last_error(ctx));
			for (int fu = 0; fu < 2; fu++) {
				kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = fu == 1};
				kl_program P;
				char err[512];
				if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
					fail_msg("%s %s: lower: %s", bc[ci].name, kl_dtype_name(dts[di]),
					         err);
				must_compile(ctx, &P, bc[ci].name, "%s %s fusion %d", bc[ci].name,
				             kl_dtype_name(dts[di]), fu);
				kl__program_free(&P);
				compiled++;
			}
			kl__trace_free(tr);
			for (int i = 0; i < bc[ci].nin; i++)
				kl_release(in[i]);
		}
	}
	print_message("test_cuda_gen: %d backward translation units compiled for sm_90\n",
	              compiled);
	kl_ctx_free(ctx);
}

static void set_or_unset(const char *name, const char *v)
{
	if (v)
		setenv(name, v, 1);
	else
		unsetenv(name);
}

/* a copy of the environment's name (NULL: unset), for env_restore */
static char *env_save(const char *name)
{
	const char *v = getenv(name);
	return v ? strdup(v) : NULL;
}

/* name back to what env_save found; frees that */
static void env_restore(const char *name, char *saved)
{
	set_or_unset(name, saved);
	free(saved);
}

/* KILN_CUDA_ROW_GROUP forces every group size on the row cases: the scalar
 * path always, the chunked path from the chosen group up (a larger group
 * holds less a thread); each source compiles */
static void test_cuda_row_groups(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	char *saved = env_save("KILN_CUDA_ROW_GROUP");
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[] = {KL_BF16, KL_F32};
	int compiled = 0;
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++) {
		const gcase *c = &CASES[ci];
		if (!c->group)
			continue;
		for (size_t di = 0; di < 2; di++) {
			kl_tensor *in[3] = {NULL};
			make_inputs(ctx, c, dts[di], 300 + ci, in);
			kl_trace *tr = trace(ctx, c->f, in, NULL);
			assert_non_null(tr);
			for (int G = 32; G <= 256; G *= 2) {
				char g[16];
				snprintf(g, sizeof g, "%d", G);
				setenv("KILN_CUDA_ROW_GROUP", g, 1);
				assert_int_equal(kl__cuda_row_group(), G);
				kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
				kl_program P;
				char err[512];
				if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
					fail_msg("%s %s group %d: lower: %s", c->name,
					         kl_dtype_name(dts[di]), G, err);
				if (!has_group(P.source, false, G))
					fail_msg("%s %s: the scalar path is not forced to %d", c->name,
					         kl_dtype_name(dts[di]), G);
				if (dts[di] == KL_BF16 && G >= c->group && !has_group(P.source, true, G))
					fail_msg("%s bf16: the chunked path is not forced to %d",
					         c->name, G);
				must_compile(ctx, &P, c->name, "%s %s group %d", c->name,
				             kl_dtype_name(dts[di]), G);
				kl__program_free(&P);
				compiled++;
			}
			kl__trace_free(tr);
			for (int i = 0; i < c->nin; i++)
				kl_release(in[i]);
		}
	}
	setenv("KILN_CUDA_ROW_GROUP", "48", 1); /* not a group size: ignored */
	assert_int_equal(kl__cuda_row_group(), 0);
	env_restore("KILN_CUDA_ROW_GROUP", saved);
	print_message("test_cuda_gen: %d row kernels with forced groups compiled for sm_90\n",
	              compiled);
	kl_ctx_free(ctx);
}

/* KILN_CUDA_ROW_ONEPASS set to `knob` (NULL: unset) around a test; returns
 * the value it had, malloc'd, or NULL */
static char *onepass_set(const char *knob)
{
	char *saved = env_save("KILN_CUDA_ROW_ONEPASS");
	set_or_unset("KILN_CUDA_ROW_ONEPASS", knob);
	return saved;
}

static void onepass_restore(char *saved)
{
	env_restore("KILN_CUDA_ROW_ONEPASS", saved);
}

/* The one-reduction pairs of passes: with KILN_CUDA_ROW_ONEPASS=1 every
 * ONEPASS case's fused kernel has one, unset (the default) none has; either
 * source compiles for sm_90, every float dtype, static and dynamic rows. */
static void test_cuda_row_onepass(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	char *saved = onepass_set(NULL);
	assert_int_equal(kl__cuda_row_onepass(), 0);
	setenv("KILN_CUDA_ROW_ONEPASS", "1", 1);
	assert_int_equal(kl__cuda_row_onepass(), 1);
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[] = {KL_F32, KL_BF16, KL_F16, KL_F64};
	int compiled = 0;
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++) {
		const gcase *c = &CASES[ci];
		if (!onepass_case(c))
			continue;
		for (size_t di = 0; di < sizeof(dts) / sizeof(dts[0]); di++) {
			kl_tensor *in[3] = {NULL};
			make_inputs(ctx, c, dts[di], 1100 + ci, in);
			kl_trace *tr = trace(ctx, c->f, in, NULL);
			assert_non_null(tr);
			for (int v = 0; v < 4; v++) {
				bool on = v % 2 == 0, dyn = v >= 2;
				if (on)
					setenv("KILN_CUDA_ROW_ONEPASS", "1", 1);
				else
					unsetenv("KILN_CUDA_ROW_ONEPASS");
				assert_int_equal(kl__cuda_row_onepass(), on ? 1 : 0);
				uint32_t rows[3] = {1u, 0, 0};
				kl_lower_opts o = {.target = KL_TARGET_CUDA,
				                   .fusion = true,
				                   .dyn_masks = dyn && !c->off ? rows : NULL};
				kl_program P;
				char err[512];
				if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
					fail_msg("%s %s: lower: %s", c->name, kl_dtype_name(dts[di]), err);
				bool has = strstr(P.source, ", one reduction:") != NULL;
				if (has != on)
					fail_msg("%s %s onepass %d%s: %s one-reduction pair", c->name,
					         kl_dtype_name(dts[di]), on, dyn ? " dynamic rows" : "",
					         has ? "a" : "no");
				if (getenv("KILN_TEST_DUMP") && strstr(c->name, getenv("KILN_TEST_DUMP")))
					fprintf(stderr, "==== %s %s onepass %d dyn %d\n%s\n", c->name,
					        kl_dtype_name(dts[di]), on, dyn,
					        strstr(P.source, "struct kl_args"));
				must_compile(ctx, &P, c->name, "%s %s onepass %d", c->name,
				             kl_dtype_name(dts[di]), on);
				kl__program_free(&P);
				compiled++;
			}
			kl__trace_free(tr);
			for (int i = 0; i < c->nin; i++)
				kl_release(in[i]);
		}
	}
	setenv("KILN_CUDA_ROW_ONEPASS", "yes", 1); /* anything but "1" leaves it off */
	assert_int_equal(kl__cuda_row_onepass(), 0);
	onepass_restore(saved);
	print_message("test_cuda_gen: %d row kernels with and without one-reduction pairs "
	              "compiled for sm_90\n",
	              compiled);
	kl_ctx_free(ctx);
}

/* The dot rows' knobs (KILN_CUDA_DOT_*): each changes the chosen group or
 * the partial sums as documented, out-of-range values are ignored, and every
 * source compiles for sm_90. */
typedef struct dot_try {
	const char *chunks, *threads, *f32;
	int64_t rows, n, k; /* linear [rows, k] x [n, k]^T, bf16 */
	int group;          /* the chunked path's threads per row */
	bool partial;       /* float partials (kp0) in the source */
} dot_try;

static void test_cuda_dot_knobs(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	static const char *const names[3] = {"KILN_CUDA_DOT_CHUNKS", "KILN_CUDA_DOT_THREADS",
	                                     "KILN_CUDA_DOT_F32"};
	char *saved[3];
	for (int i = 0; i < 3; i++)
		saved[i] = env_save(names[i]);
	static const dot_try tries[] = {
	        {NULL, NULL, NULL, 8, 256, 256, 64, true},
	        {NULL, "0", NULL, 8, 256, 256, 32, true},     /* any rows: the warp */
	        {NULL, "1000000", NULL, 8, 256, 256, 256, true}, /* never enough: the block */
	        {NULL, NULL, "0", 8, 256, 256, 64, false},
	        {"8", NULL, NULL, 1, 6144, 2048, 32, true},  /* 8 chunks a lane */
	        {"2", NULL, NULL, 1, 6144, 2048, 128, true}, /* 2 chunks a thread */
	        {"9", "-4", "7", 1, 6144, 2048, 64, true},   /* out of range: defaults */
	        {"8", NULL, NULL, 1, 2048, 8192, 128, true}, /* a long row: 8 of 1024 chunks */
	};
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	for (size_t t = 0; t < sizeof tries / sizeof tries[0]; t++) {
		const dot_try *d = &tries[t];
		set_or_unset(names[0], d->chunks);
		set_or_unset(names[1], d->threads);
		set_or_unset(names[2], d->f32);
		kl_tensor *in[3];
		in[0] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){d->rows, d->k}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 700 + t);
		in[1] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){d->n, d->k}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 710 + t);
		in[2] = kltest_rand(ctx, KL_BF16, 1, (int64_t[]){d->n}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    720 + t);
		kl_trace *tr = trace(ctx, b_skinny_linear, in, NULL);
		assert_non_null(tr);
		kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
		kl_program P;
		char err[512];
		if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
			fail_msg("dot knobs %zu: lower: %s", t, err);
		if (!has_group(P.source, true, d->group))
			fail_msg("dot knobs %zu (%lldx%lld @ %lld): no chunked row group of %d threads",
			         t, (long long)d->rows, (long long)d->k, (long long)d->n, d->group);
		if ((strstr(P.source, "kp0 += ") != NULL) != d->partial)
			fail_msg("dot knobs %zu: float partials %s", t, d->partial ? "missing" : "taken");
		must_compile(ctx, &P, "dot knobs", "dot knobs %zu", t);
		kl__program_free(&P);
		kl__trace_free(tr);
		for (int i = 0; i < 3; i++)
			kl_release(in[i]);
	}
	for (int i = 0; i < 3; i++) {
		env_restore(names[i], saved[i]);
	}
	/* a layer norm's two sums: float partials for bf16 rows, a double per
	 * element for f32 ones; KILN_CUDA_ROW_MINBLOCKS caps the row kernel's
	 * registers through __launch_bounds__; unset or out of range, the
	 * kernel's choice: five blocks for a wide bf16 row, none for an f32 one
	 * (64 bytes of row a thread) */
	char *saved_mb = env_save("KILN_CUDA_ROW_MINBLOCKS");
	static const struct {
		kl_dtype dt;
		const char *minb;
		bool partial;
		const char *bounds;
	} ln[] = {{KL_BF16, NULL, true, "__launch_bounds__(256, 5) "},
	          {KL_F32, NULL, false, "__launch_bounds__(256) "},
	          {KL_BF16, "6", true, "__launch_bounds__(256, 6) "},
	          {KL_BF16, "9", true, "__launch_bounds__(256, 5) "}};
	for (size_t t = 0; t < sizeof ln / sizeof ln[0]; t++) {
		set_or_unset("KILN_CUDA_ROW_MINBLOCKS", ln[t].minb);
		kl_tensor *in[3];
		in[0] = kltest_rand(ctx, ln[t].dt, 2, (int64_t[]){64, 4096}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 730 + t);
		in[1] = kltest_rand(ctx, ln[t].dt, 1, (int64_t[]){4096}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    740 + t);
		in[2] = kltest_rand(ctx, ln[t].dt, 1, (int64_t[]){4096}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    750 + t);
		kl_trace *tr = trace(ctx, b_layer_norm, in, NULL);
		assert_non_null(tr);
		kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
		kl_program P;
		char err[512];
		if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
			fail_msg("layer norm %zu: lower: %s", t, err);
		/* the two sums' accumulators follow the max of the row's
		 * magnitudes (kl_layer_norm's overflow guard, decompose.c) */
		bool part = strstr(P.source, "kp1 += ") && strstr(P.source, "kp2 += ");
		if (part != ln[t].partial)
			fail_msg("layer norm %zu (%s): float partials %s", t, kl_dtype_name(ln[t].dt),
			         ln[t].partial ? "missing" : "taken");
		if (!strstr(P.source, ln[t].bounds))
			fail_msg("layer norm %zu: no %s", t, ln[t].bounds);
		must_compile(ctx, &P, "layer norm", "layer norm %zu", t);
		kl__program_free(&P);
		kl__trace_free(tr);
		for (int i = 0; i < 3; i++)
			kl_release(in[i]);
	}
	env_restore("KILN_CUDA_ROW_MINBLOCKS", saved_mb);
	kl_ctx_free(ctx);
}

/* KILN_CUDA_ROW_HOLD and KILN_CUDA_ROW_ONEPASS set to hold and one (NULL:
 * unset) while f's graph of in is lowered for CUDA with fusion into *P */
static void lower_hold(kl_ctx *ctx, build_fn f, kl_tensor *const *in, const char *hold,
                       const char *one, kl_program *P)
{
	set_or_unset("KILN_CUDA_ROW_HOLD", hold);
	set_or_unset("KILN_CUDA_ROW_ONEPASS", one);
	kl_trace *tr = trace(ctx, f, in, NULL);
	assert_non_null(tr);
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
	char err[512];
	if (kl__lower(&tr->g, &o, P, err, sizeof err) != KL_OK)
		fail_msg("row hold %s: lower: %s", hold ? hold : "unset", err);
	kl__trace_free(tr);
}

/* the buffer of graph input `index` in P */
static int input_buf(const kl_program *P, int index)
{
	for (int32_t b = 0; b < P->nbufs; b++)
		if (P->bufs[b].role == KL_BUF_INPUT && P->bufs[b].index == index)
			return (int)b;
	fail_msg("no buffer for input %d", index);
	return -1;
}

/* Where, in the chunked row loop of src (from "if (kl_vok)" to the scalar
 * loop), buffer b's 16-byte chunks are loaded: each load after `after`
 * and before `before` (NULL: the region's ends); *n counts them */
static bool loads_between(const char *src, int b, const char *after, const char *before, int *n)
{
	const char *start = strstr(src, "if (kl_vok)");
	const char *end = start ? strstr(start, "row group (scalar)") : NULL;
	if (!start || !end)
		return false;
	char want[64];
	snprintf(want, sizeof want, "__ldg((const uint4 *)(b%d + ", b);
	/* the last `after` and the first `before` in the region */
	const char *lo = start, *hi = end;
	for (const char *q = after ? strstr(start, after) : NULL; q && q < end;
	     q = strstr(q + 1, after))
		lo = q;
	const char *q = before ? strstr(lo, before) : NULL;
	if (q && q < end)
		hi = q;
	*n = 0;
	bool inside = true;
	for (q = strstr(start, want); q && q < end; q = strstr(q + 1, want)) {
		(*n)++;
		inside &= q > lo && q < hi;
	}
	return inside && *n > 0;
}

/* a knob's value for v (NULL: unset) and the field kl__cuda_dot_knobs
 * gives for it */
typedef struct knob_try {
	const char *v;
	int want;
} knob_try;

static int knob_hold(void)
{
	return kl__cuda_dot_knobs().hold;
}

static int knob_pw(void)
{
	return kl__cuda_dot_knobs().pw;
}

/* each of the n settings of environment variable name reads as its want */
static void knob_parses(const char *name, const knob_try *t, size_t n, int (*get)(void))
{
	for (size_t i = 0; i < n; i++) {
		set_or_unset(name, t[i].v);
		if (get() != t[i].want)
			fail_msg("%s=%s: %d, want %d", name, t[i].v ? t[i].v : "unset", get(),
			         t[i].want);
	}
}

/* KILN_CUDA_ROW_HOLD: 1, a bf16 layer norm's weight and bias are loaded
 * with the first row's chunks (under !kl_ahead, before the reductions) and
 * held; 0, every row loads them after its reductions, in the pass that
 * uses them, none under kl_ahead; unset (or not 0 or 1), the kernel's
 * choice: 0 for a wide row (the 4096-wide bf16 layer norm: the same source
 * as 0), 1 for a narrower one (a 512-wide layer norm after a skinny
 * product, whose weights then load early); the scalar path is the same
 * either way; the one-reduction pairs keep working; every source compiles
 * for sm_90. */
static void test_cuda_row_hold(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	char *saved = env_save("KILN_CUDA_ROW_HOLD");
	char *saved_one = onepass_set(NULL);
	static const knob_try parse[] = {{NULL, -1}, {"1", 1},   {"0", 0},   {"2", -1},
	                                 {"no", -1}, {"", -1},  {"01", -1}};
	knob_parses("KILN_CUDA_ROW_HOLD", parse, sizeof parse / sizeof parse[0], knob_hold);
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *in[3];
	in[0] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){64, 4096}, KLTEST_NORMAL, KLTEST_CONTIG, 760);
	in[1] = kltest_rand(ctx, KL_BF16, 1, (int64_t[]){4096}, KLTEST_NORMAL, KLTEST_CONTIG, 761);
	in[2] = kltest_rand(ctx, KL_BF16, 1, (int64_t[]){4096}, KLTEST_NORMAL, KLTEST_CONTIG, 762);
	kl_program P[3];
	static const char *const holds[3] = {NULL, "1", "0"};
	for (int h = 0; h < 3; h++)
		lower_hold(ctx, b_layer_norm, in, holds[h], NULL, &P[h]);
	if (strcmp(P[0].source, P[2].source) != 0)
		fail_msg("wide layer norm: KILN_CUDA_ROW_HOLD unset is not 0");
	assert_true(strcmp(P[1].source, P[2].source) != 0);
	for (int h = 1; h < 3; h++) {
		const char *src = P[h].source;
		for (int w = 1; w <= 2; w++) {
			int b = input_buf(&P[h], w), n;
			bool ok = h == 1 ? loads_between(src, b, "if (!kl_ahead)", "kl_next", &n) &&
			                           loads_between(src, b, NULL, "kl_gred<", &n)
			                 : loads_between(src, b, "kl_gred<", "kl_ahead = true;", &n) &&
			                           !loads_between(src, b, "if (!kl_ahead)", "kl_next", &n);
			if (!ok || n != 1) /* one load in the loop over a thread's chunks */
				fail_msg("layer norm, hold %s: input %d (b%d) loaded %d times, not %s",
				         holds[h], w, b, n,
				         h == 2 ? "after the reductions" : "with the first row's chunks");
		}
		must_compile(ctx, &P[h], "row hold", "layer norm hold %s", holds[h]);
	}
	/* the scalar path (misaligned launches) is untouched */
	const char *s0 = strstr(P[1].source, "row group (scalar)");
	const char *s2 = strstr(P[2].source, "row group (scalar)");
	assert_non_null(s0);
	assert_non_null(s2);
	assert_string_equal(s0, s2);
	for (int h = 0; h < 3; h++)
		kl__program_free(&P[h]);
	/* with one reduction for the two sums: the weight after it all the same */
	lower_hold(ctx, b_layer_norm, in, "0", "1", &P[0]);
	int n;
	if (!strstr(P[0].source, ", one reduction:") ||
	    !loads_between(P[0].source, input_buf(&P[0], 1), "kl_gvar<", "kl_ahead = true;", &n))
		fail_msg("layer norm, hold 0, one-reduction pair: the weight not loaded after it");
	must_compile(ctx, &P[0], "row hold", "layer norm hold 0 onepass");
	kl__program_free(&P[0]);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	/* a layer norm after a skinny product: its weight and bias load before
	 * kl_pdl_wait when held, not when every row loads them */
	in[0] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){8, 256}, KLTEST_NORMAL, KLTEST_CONTIG, 763);
	in[1] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){512, 256}, KLTEST_NORMAL, KLTEST_CONTIG,
	                    764);
	in[2] = kltest_rand(ctx, KL_BF16, 1, (int64_t[]){512}, KLTEST_NORMAL, KLTEST_CONTIG, 765);
	for (int h = 0; h < 3; h += 2) {
		lower_hold(ctx, b_linear_layer_norm, in, holds[h], NULL, &P[0]);
		int early = 0;
		if (P[0].nkernels != 2 || !every_kernel_waits(P[0].source, &early) ||
		    early != (h ? 0 : 1))
			fail_msg("linear then layer norm, hold %s: %d kernels, %d load early",
			         h ? "0" : "unset", P[0].nkernels, early);
		must_compile(ctx, &P[0], "row hold", "linear then layer norm hold %s",
		             h ? "0" : "unset");
		kl__program_free(&P[0]);
	}
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	env_restore("KILN_CUDA_ROW_HOLD", saved);
	onepass_restore(saved_one);
	kl_ctx_free(ctx);
}

/* KILN_CUDA_PW_UNROLL: parsed (1, 2, 4, 8; anything else is the default,
 * 1); a pointwise kernel's thread loads that many chunks before it
 * computes, whatever its loads; every source compiles for sm_90 */
static void test_cuda_pw_unroll(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	char *saved = env_save("KILN_CUDA_PW_UNROLL");
	static const knob_try parse[] = {{NULL, 1}, {"1", 1}, {"2", 2},  {"4", 4}, {"8", 8},
	                                 {"3", 1},  {"0", 1}, {"16", 1}, {"x", 1}, {"", 1}};
	knob_parses("KILN_CUDA_PW_UNROLL", parse, sizeof parse / sizeof parse[0], knob_pw);
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *in[4];
	for (int i = 0; i < 4; i++)
		in[i] = kltest_rand(ctx, KL_F16, 2, (int64_t[]){64, 4096}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    770 + (uint64_t)i);
	static const struct {
		build_fn f;
		const char *knob;
		const char *want;
	} tries[] = {
	        {b_gelu1, NULL, "/* 1 chunk a thread in flight */"},
	        {b_fma_relu, NULL, "/* 1 chunk a thread in flight */"},
	        {b_four, "4", "/* 4 chunks a thread in flight */"},
	        {b_gelu1, "1", "/* 1 chunk a thread in flight */"},
	        {b_fma_relu, "8", "/* 8 chunks a thread in flight */"},
	        {b_gelu1, "2", "/* 2 chunks a thread in flight */"},
	};
	for (size_t t = 0; t < sizeof tries / sizeof tries[0]; t++) {
		set_or_unset("KILN_CUDA_PW_UNROLL", tries[t].knob);
		kl_trace *tr = trace(ctx, tries[t].f, in, NULL);
		assert_non_null(tr);
		kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
		kl_program P;
		char err[512];
		if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
			fail_msg("pointwise %zu: lower: %s", t, err);
		if (P.nkernels != 1 || !strstr(P.source, tries[t].want))
			fail_msg("pointwise %zu (KILN_CUDA_PW_UNROLL=%s): %d kernels, no \"%s\"", t,
			         tries[t].knob ? tries[t].knob : "unset", P.nkernels, tries[t].want);
		must_compile(ctx, &P, "pointwise unroll", "pointwise %zu", t);
		kl__program_free(&P);
		kl__trace_free(tr);
	}
	for (int i = 0; i < 4; i++)
		kl_release(in[i]);
	env_restore("KILN_CUDA_PW_UNROLL", saved);
	kl_ctx_free(ctx);
}

/* The SwiGLU backward (train_decoder's k10: from dY of silu(a) * b, da =
 * dY b sig(a) (1 + a (1 - sig(a))) and db = dY silu(a), bf16, rounded to
 * bf16 between the graph's ops) is issue-bound on an H100 unless its eight
 * roundings and its sigmoid's reciprocal stay cheap: its PTX rounds with
 * cvt.rn.bf16.f32 (not half.h's integer form) and takes 1 / (1 + z) as
 * rcp.approx plus a Newton step (not rcp.rn.f32, whose range check and
 * slow-path call cost six instructions a point and split the loop);
 * unset and at KILN_CUDA_PW_UNROLL=2 (2 chunks a thread: the body's cost
 * must not cut it to 1) every kernel fits 64 registers without spills. */
static int b_swiglu_bwd(kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)p;
	kl_tensor *a = kl_detach(in[0]), *b = kl_detach(in[1]);
	assert_int_equal(kl_set_requires_grad(a, true), KL_OK);
	assert_int_equal(kl_set_requires_grad(b, true), KL_OK);
	assert_int_equal(kl_backward(kl_mul(kl_silu(a), b), in[2]), KL_OK);
	out[0] = kl_grad(a);
	out[1] = kl_grad(b);
	return 2;
}

/* the most registers any function of a ptxas -v log uses; *spill: some
 * function spills */
static int log_max_regs(const char *log, bool *spill)
{
	int most = 0;
	*spill = false;
	for (const char *q = strstr(log, "Used "); q; q = strstr(q + 1, "Used ")) {
		int r;
		if (sscanf(q, "Used %d registers", &r) == 1 && r > most)
			most = r;
	}
	for (const char *q = strstr(log, " bytes spill stores"); q; q = strstr(q + 1, " bytes spill stores")) {
		const char *d = q;
		while (d > log && isdigit((unsigned char)d[-1]))
			d--;
		*spill |= atoi(d) != 0;
	}
	return most;
}

static void test_cuda_swiglu_backward(void **state)
{
	(void)state;
	if (!nvrtc_ok())
		skip();
	char *saved = env_save("KILN_CUDA_PW_UNROLL");
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *in[3];
	for (int i = 0; i < 3; i++)
		in[i] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){64, 8192}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 780 + (uint64_t)i);
	static const char *const knobs[] = {NULL, "2"};
	for (size_t t = 0; t < sizeof knobs / sizeof knobs[0]; t++) {
		set_or_unset("KILN_CUDA_PW_UNROLL", knobs[t]);
		kl_trace *tr = trace(ctx, b_swiglu_bwd, in, NULL);
		assert_non_null(tr);
		kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
		kl_program P;
		char err[512];
		if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
			fail_msg("swiglu backward: lower: %s", err);
		const char *sig = strstr(P.source, "= kl_sigmoidf(");
		const char *kern = sig ? strstr(P.source, "__global__") : NULL;
		/* the kernel holding the sigmoid: the last "__global__" before it */
		for (const char *q = kern; q && q < sig; q = strstr(q + 1, "__global__"))
			kern = q;
		char want[64];
		snprintf(want, sizeof want, "/* %s chunk%s a thread in flight */",
		         knobs[t] ? knobs[t] : "1", knobs[t] ? "s" : "");
		const char *fl = kern ? strstr(kern, want) : NULL;
		if (!sig || !fl || fl > sig)
			fail_msg("swiglu backward (KILN_CUDA_PW_UNROLL=%s): no \"%s\" in the sigmoid's "
			         "kernel", knobs[t] ? knobs[t] : "unset", want);
		kl_cuda_image im;
		kl_nvrtc_opts no = {.arch = 90, .no_fmad = true, .ptxas_info = true, .want_ptx = true};
		if (kl__nvrtc_compile(ctx, P.source, "swiglu_bwd", &no, &im) != KL_OK)
			fail_msg("swiglu backward: %s\n%s", kl_last_error(ctx), im.log ? im.log : "");
		assert_non_null(im.ptx_text);
		assert_non_null(im.log);
		bool spill;
		int regs = log_max_regs(im.log, &spill);
		/* a sigmoid (one ex2) a point and at least 3 roundings beside it
		 * (k10: 8 and its store's; half.h's form leaves only the stores) */
		int ncvt = 0, nex2 = 0;
		for (const char *q = strstr(im.ptx_text, "cvt.rn.bf16.f32"); q;
		     q = strstr(q + 1, "cvt.rn.bf16.f32"))
			ncvt++;
		for (const char *q = strstr(im.ptx_text, "ex2.approx"); q; q = strstr(q + 1, "ex2.approx"))
			nex2++;
		if (strstr(im.ptx_text, "rcp.rn.f32") || strstr(im.ptx_text, "div.rn.f32") ||
		    !strstr(im.ptx_text, "rcp.approx.ftz.f32") || nex2 == 0 || ncvt <= 2 * nex2 ||
		    regs == 0 || regs > 64 || spill)
			fail_msg("swiglu backward (KILN_CUDA_PW_UNROLL=%s): rcp.rn %d, div.rn %d, "
			         "rcp.approx %d, %d cvt.rn.bf16 for %d ex2, %d registers, spills %d\n%s",
			         knobs[t] ? knobs[t] : "unset", !!strstr(im.ptx_text, "rcp.rn.f32"),
			         !!strstr(im.ptx_text, "div.rn.f32"),
			         !!strstr(im.ptx_text, "rcp.approx.ftz.f32"), ncvt, nex2, regs, spill,
			         im.log);
		kl__cuda_image_free(&im);
		kl__program_free(&P);
		kl__trace_free(tr);
	}
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	env_restore("KILN_CUDA_PW_UNROLL", saved);
	kl_ctx_free(ctx);
}

/* ---- more buffers than a kernel's parameters hold ----------------------------------- */

/* MANY inputs, out[i] = in[i] * 2 + in[(i + 1) % MANY]: 2 * MANY buffers,
 * more than KL_CUDA_ARGS_MAX entries of the 4 KiB kernel parameter block */
#define MANY 260

static kl_status b_many(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                        void *user)
{
	(void)c, (void)user, (void)nout;
	for (int i = 0; i < nin; i++)
		out[i] = kl_add(kl_mul_scalar(in[i], 2.0), in[(i + 1) % nin]);
	return KL_OK;
}

static void many_inputs(kl_ctx *ctx, kl_tensor **in, uint64_t seed)
{
	for (int i = 0; i < MANY; i++) {
		in[i] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, 6}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, seed + (uint64_t)i);
		assert_non_null(in[i]);
	}
}

/* A program of 520 buffers lowers for CUDA with its kl_args block in device
 * memory (kl__cuda_args_indirect) and compiles for sm_90; it used to be
 * refused ("exceed what one CUDA kernel parameter block holds") */
static void test_cuda_many_buffers(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_tensor *in[MANY], *out[MANY];
	many_inputs(ctx, in, 40);
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	assert_int_equal(b_many(ctx, in, MANY, out, MANY, NULL), KL_OK);
	kl_trace *tr = kl__trace_end(ctx, MANY, out);
	kl_scope_end(ctx);
	if (!tr)
		fail_msg("trace: %s", kl_last_error(ctx));
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
	kl_program P;
	char err[512];
	if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
		fail_msg("%d buffers: lower for CUDA: %s", 2 * MANY, err);
	assert_true(P.nbufs >= 2 * MANY);
	assert_true(kl__cuda_args_indirect(P.nbufs, P.nsyms));
	assert_non_null(strstr(P.source, "struct kl_args_mem { void *b["));
	if (nvrtc_ok())
		must_compile(ctx, &P, "many", "%d buffers", (int)P.nbufs);
	kl__program_free(&P);
	kl__trace_free(tr);
	for (int i = 0; i < MANY; i++)
		kl_release(in[i]);
	kl_ctx_free(ctx);
}

/* A float sum over the leading dims lowers for CUDA as partials of 32 rows
 * in a column kernel (one thread an output, no group reduction) and their
 * sum; the source compiles for sm_90. Too few outputs, or the sum over the
 * last dim: no column kernel. */
static void test_cuda_column_sums(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const int64_t shapes[2][3] = {{4, 64, 1056}, {4, 8, 64}};
	const kl_dtype dts[2] = {KL_BF16, KL_F32};
	for (int si = 0; si < 2; si++)
		for (int di = 0; di < 2; di++) {
			kl_tensor *in[1] = {kltest_rand(ctx, dts[di], 3, shapes[si], KLTEST_NORMAL,
			                                KLTEST_CONTIG, 500 + (uint64_t)si)};
			kl_trace *tr = trace(ctx, b_colsum, in, NULL);
			assert_non_null(tr);
			kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
			kl_program P;
			char err[512];
			if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
				fail_msg("column sums %s: lower: %s", kl_dtype_name(dts[di]), err);
			bool col = has_group(P.source, false, 1);
			if (col != (si == 0))
				fail_msg("column sums %s [%lld,%lld,%lld]: column kernel %s", kl_dtype_name(dts[di]),
				         (long long)shapes[si][0], (long long)shapes[si][1],
				         (long long)shapes[si][2], col ? "taken" : "missing");
			if (nvrtc_ok())
				must_compile(ctx, &P, "column sums", "column sums %s",
				             kl_dtype_name(dts[di]));
			kl__program_free(&P);
			kl__trace_free(tr);
			kl_release(in[0]);
		}
	kl_ctx_free(ctx);
}

/* ---- with a GPU -------------------------------------------------------------------- */

static kl_ctx *gctx;
static char gwhy[KL_ERR_CAP];

static int gpu_setup(void **state)
{
	(void)state;
	kl_ctx_opts o = {.device = KL_CUDA};
	gctx = kl_ctx_new(&o);
	if (!gctx) {
		snprintf(gwhy, sizeof gwhy, "%s", kl_last_error(NULL));
		print_message("test_cuda_gen: GPU tests skipped: %s\n", gwhy);
	}
	return 0;
}

static int gpu_teardown(void **state)
{
	(void)state;
	kl_ctx_free(gctx);
	gctx = NULL;
	return 0;
}

#define NEED_GPU()                                                                        \
	do {                                                                              \
		if (!gctx) {                                                              \
			print_message("test_cuda_gen: %s skipped: %s\n", __func__, gwhy); \
			skip();                                                           \
		}                                                                         \
	} while (0)

typedef struct body_arg {
	build_fn f;
	int which;
} body_arg;

/* output `which` of a case, as a kltest op */
static kl_tensor *apply_one(kl_tensor *const *in, const void *param)
{
	const body_arg *b = param;
	kl_tensor *outs[8] = {NULL};
	int n = b->f(in, outs, NULL);
	return b->which < n ? outs[b->which] : NULL;
}

static kl_status body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin;
	const body_arg *b = user;
	int n = b->f(in, out, NULL);
	return n == nout ? KL_OK : kl_last_status(ctx);
}

static int n_outputs(const gcase *c, kl_tensor *const *in)
{
	kl_tensor *outs[8] = {NULL};
	kl_scope_begin(gctx);
	int n = c->f(in, outs, NULL);
	kl_scope_end(gctx);
	return n;
}

/* compiled (mode; full: .fullgraph, whose later calls replay the plan
 * without the body) vs the float64 reference, output by output; four calls,
 * each but the first with fresh inputs, so that a replayed graph must see
 * the new data */
static void check_compiled_as(const gcase *c, kl_dtype dt, kl_mode mode, bool dyn, bool full,
                              uint64_t seed)
{
	body_arg ba = {c->f, 0};
	kl_compile_opts co = {.mode = mode, .fullgraph = full, .dynamic = dyn ? KL_DYNAMIC_ALL : 0};
	kl_tensor *in[3] = {NULL};
	make_inputs(gctx, c, dt, seed, in);
	int nout = n_outputs(c, in);
	kl_fn *fn = kl_compile(gctx, body, &ba, c->nin, nout, &co);
	assert_non_null(fn);
	for (int call = 0; call < 4; call++) {
		if (call) {
			for (int i = 0; i < c->nin; i++)
				kl_release(in[i]);
			make_inputs(gctx, c, dt, seed + 17 * (uint64_t)call, in);
		}
		kl_tensor *out[8] = {NULL};
		if (kl_fn_call(fn, in, out) != KL_OK)
			fail_msg("%s %s mode %d call %d: %s", c->name, kl_dtype_name(dt), (int)mode,
			         call, kl_last_error(gctx));
		if (call == 0 && c->kernels && mode == KL_MODE_DEFAULT && !dyn && dt == KL_F32 &&
		    kl_fn_last_kernels(fn) != c->kernels)
			fail_msg("%s: %d kernels launched, want %d", c->name,
			         kl_fn_last_kernels(fn), c->kernels);
		if (call == 3 && mode == KL_MODE_REDUCE_OVERHEAD && !dyn &&
		    !getenv("KILN_DISABLE_CUDAGRAPHS"))
			assert_int_equal(kl_fn_last_kernels(fn), 1);
		for (int j = 0; j < nout; j++) {
			body_arg one = {c->f, j};
			int nd;
			int64_t shape[KL_MAX_DIMS];
			kl_dtype rdt;
			double *ref = kltest_reference(gctx, c->name, apply_one, in, &one, &nd,
			                               shape, &rdt);
			assert_non_null(ref);
			double *got = kltest_read(out[j]);
			assert_non_null(got);
			char what[128];
			snprintf(what, sizeof what, "%s %s mode %d%s%s call %d output %d", c->name,
			         kl_dtype_name(dt), (int)mode, dyn ? " dynamic" : "",
			         full ? " fullgraph" : "", call, j);
			bool ok = kl_tensor_dtype(out[j]) == rdt &&
			          kltest_compare_atol(what, rdt, nd, shape, got, ref, 8, dot_atol(c, dt));
			free(ref);
			free(got);
			kl_release(out[j]);
			if (!ok)
				fail_msg("%s differs from the reference", what);
		}
	}
	for (int i = 0; i < c->nin; i++)
		kl_release(in[i]);
	kl_fn_free(fn);
}

static void check_compiled(const gcase *c, kl_dtype dt, kl_mode mode, bool dyn, uint64_t seed)
{
	check_compiled_as(c, dt, mode, dyn, false, seed);
}

static void test_gpu_compiled(void **state)
{
	(void)state;
	NEED_GPU();
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++)
		for (size_t di = 0; di < sizeof(ALL_DT) / sizeof(ALL_DT[0]); di++)
			if (dt_fits(&CASES[ci], ALL_DT[di])) {
				check_compiled(&CASES[ci], ALL_DT[di], KL_MODE_DEFAULT, false,
				               500 + ci);
				/* symbolic extents: the chunked paths' run-time checks */
				if (CASES[ci].chunked)
					check_compiled(&CASES[ci], ALL_DT[di], KL_MODE_DEFAULT, true,
					               600 + ci);
			}
}

/* the one-reduction pairs on and off (KILN_CUDA_ROW_ONEPASS, part of the
 * plan's cache key) against the float64 reference: every ONEPASS case
 * (NaN, -inf rows and threads, 4096-wide bf16, rows of no whole chunks) in
 * every float dtype, static and dynamic rows */
static void test_gpu_onepass(void **state)
{
	(void)state;
	NEED_GPU();
	char *saved = onepass_set(NULL);
	const kl_dtype dts[] = {KL_F32, KL_BF16, KL_F16, KL_F64};
	for (int on = 0; on < 2; on++) {
		setenv("KILN_CUDA_ROW_ONEPASS", on ? "1" : "0", 1);
		for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++) {
			if (!onepass_case(&CASES[ci]))
				continue;
			for (size_t di = 0; di < sizeof(dts) / sizeof(dts[0]); di++) {
				check_compiled(&CASES[ci], dts[di], KL_MODE_DEFAULT, false,
				               1300 + ci + 50 * (uint64_t)on);
				if (!CASES[ci].off)
					check_compiled(&CASES[ci], dts[di], KL_MODE_DEFAULT, true,
					               1400 + ci + 50 * (uint64_t)on);
			}
		}
	}
	onepass_restore(saved);
}

/* pointwise kernels over more points than one wave of threads holds
 * (4.65 M: with KILN_CUDA_PW_FLAT=0 grid-stride iterations; the last
 * chunks cut short inside the unrolled loads) with every
 * KILN_CUDA_PW_UNROLL, flat grids and one wave, against the float64
 * reference, f32 and f16, static and dynamic extents */
static void test_gpu_pw_unroll(void **state)
{
	(void)state;
	NEED_GPU();
	static const gcase big[] = {
	        {"gelu big", b_gelu1, 1, {2}, {{517, 9001}}, true, false, 1, 0, 0, 0, false},
	        {"relu big", b_fma_relu, 3, {2, 2, 2}, {{517, 9001}, {517, 9001}, {517, 9001}},
	         false, false, 1, 0, 0, 0, false},
	};
	char *saved = env_save("KILN_CUDA_PW_UNROLL");
	char *flat = env_save("KILN_CUDA_PW_FLAT");
	static const char *const knobs[] = {NULL, "1", "2", "8"};
	const kl_dtype dts[] = {KL_F32, KL_F16};
	/* the flat grid (default) and one wave of grid-stride loops */
	for (int f = 0; f < 2; f++) {
		set_or_unset("KILN_CUDA_PW_FLAT", f ? "0" : NULL);
		for (size_t k = 0; k < sizeof knobs / sizeof knobs[0]; k++) {
			set_or_unset("KILN_CUDA_PW_UNROLL", knobs[k]);
			for (size_t ci = 0; ci < sizeof big / sizeof big[0]; ci++)
				for (size_t di = 0; di < 2; di++)
					check_compiled(&big[ci], dts[di], KL_MODE_DEFAULT, di == 1,
					               1500 + 100 * (uint64_t)f + 10 * k + 2 * ci + di);
		}
	}
	env_restore("KILN_CUDA_PW_UNROLL", saved);
	env_restore("KILN_CUDA_PW_FLAT", flat);
}

/* the 520-buffer program on the GPU, by default and in reduce-overhead mode
 * (no CUDA graph: its arguments are copied before each run), three calls on
 * fresh inputs each, against the float64 reference */
static void test_gpu_many_buffers(void **state)
{
	(void)state;
	NEED_GPU();
	const kl_mode modes[] = {KL_MODE_DEFAULT, KL_MODE_REDUCE_OVERHEAD};
	for (int m = 0; m < 2; m++) {
		kl_compile_opts co = {.mode = modes[m]};
		kl_fn *fn = kl_compile(gctx, b_many, NULL, MANY, MANY, &co);
		assert_non_null(fn);
		for (int call = 0; call < 3; call++) {
			kl_tensor *in[MANY], *out[MANY] = {NULL};
			many_inputs(gctx, in, 100 + 10 * (uint64_t)call + (uint64_t)m);
			if (kl_fn_call(fn, in, out) != KL_OK)
				fail_msg("%d buffers mode %d call %d: %s", 2 * MANY, (int)modes[m], call,
				         kl_last_error(gctx));
			for (int i = 0; i < MANY; i++) {
				double *a = kltest_read(in[i]), *b = kltest_read(in[(i + 1) % MANY]);
				double *got = kltest_read(out[i]);
				assert_true(a && b && got);
				int64_t n = kl_numel(in[i]);
				for (int64_t e = 0; e < n; e++)
					if (got[e] != (double)(float)(a[e] * 2.0 + b[e]))
						fail_msg("%d buffers mode %d call %d output %d [%lld]: %.9g, want "
						         "%.9g",
						         2 * MANY, (int)modes[m], call, i, (long long)e, got[e],
						         (double)(float)(a[e] * 2.0 + b[e]));
				free(a);
				free(b);
				free(got);
			}
			for (int i = 0; i < MANY; i++) {
				kl_release(in[i]);
				kl_release(out[i]);
			}
		}
		kl_fn_free(fn);
	}
}

static void test_gpu_reduce_overhead(void **state)
{
	(void)state;
	NEED_GPU();
	const kl_dtype dts[] = {KL_F32, KL_BF16};
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++)
		for (size_t di = 0; di < 2; di++)
			if (dt_fits(&CASES[ci], dts[di])) {
				check_compiled(&CASES[ci], dts[di], KL_MODE_REDUCE_OVERHEAD, false,
				               900 + ci);
				/* the bench's way: guards, then the graph replayed, no body */
				check_compiled_as(&CASES[ci], dts[di], KL_MODE_REDUCE_OVERHEAD, false,
				                  true, 950 + ci);
			}
}

/* every case eagerly: each op through its own generated one-node kernel */
static void test_gpu_eager(void **state)
{
	(void)state;
	NEED_GPU();
	for (size_t ci = 0; ci < sizeof(CASES) / sizeof(CASES[0]); ci++)
		for (size_t di = 0; di < sizeof(ALL_DT) / sizeof(ALL_DT[0]); di++) {
			const gcase *c = &CASES[ci];
			kl_dtype dt = ALL_DT[di];
			if (!dt_fits(c, dt))
				continue;
			kl_tensor *in[3] = {NULL};
			make_inputs(gctx, c, dt, 700 + ci, in);
			int nout = n_outputs(c, in);
			for (int j = 0; j < nout; j++) {
				body_arg one = {c->f, j};
				char what[128];
				snprintf(what, sizeof what, "eager %s %s output %d", c->name,
				         kl_dtype_name(dt), j);
				if (!kltest_check_op_atol(gctx, what, apply_one, c->nin, in, &one, 8,
				                          dot_atol(c, dt)))
					fail_msg("%s differs from the reference", what);
			}
			for (int i = 0; i < c->nin; i++)
				kl_release(in[i]);
		}
}

int main(void)
{
	const struct CMUnitTest host[] = {
	        cmocka_unit_test(test_cuda_source_compiles),
	        cmocka_unit_test(test_cuda_backward_source),
	        cmocka_unit_test(test_cuda_row_groups),
	        cmocka_unit_test(test_cuda_row_onepass),
	        cmocka_unit_test(test_cuda_dot_knobs),
	        cmocka_unit_test(test_cuda_row_hold),
	        cmocka_unit_test(test_cuda_pw_unroll),
	        cmocka_unit_test(test_cuda_swiglu_backward),
	        cmocka_unit_test(test_cuda_many_buffers),
	        cmocka_unit_test(test_cuda_column_sums),
	};
	const struct CMUnitTest gpu[] = {
	        cmocka_unit_test(test_gpu_eager),
	        cmocka_unit_test(test_gpu_compiled),
	        cmocka_unit_test(test_gpu_onepass),
	        cmocka_unit_test(test_gpu_pw_unroll),
	        cmocka_unit_test(test_gpu_reduce_overhead),
	        cmocka_unit_test(test_gpu_many_buffers),
	};
	/* ctest runs each GPU test, and the host ones, as a process of its own
	 * (KILN_TEST_FILTER, a cmocka name pattern), so that -j spreads them */
	const char *filter = getenv("KILN_TEST_FILTER");
	if (filter && *filter)
		cmocka_set_test_filter(filter);
	int fails = cmocka_run_group_tests_name("cuda_gen_host", host, NULL, NULL);
	fails += cmocka_run_group_tests_name("cuda_gen_gpu", gpu, gpu_setup, gpu_teardown);
	return fails;
}

#else /* !KILN_HAVE_CUDA */

static void test_cuda_gen_absent(void **state)
{
	(void)state;
	print_message("test_cuda_gen: skipped: kiln was built without the CUDA backend "
	              "(KILN_CUDA=OFF): no NVRTC to compile generated CUDA C with\n");
	skip();
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_cuda_gen_absent)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
