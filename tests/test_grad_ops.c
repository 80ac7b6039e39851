/* test_grad_ops.c - the vector-Jacobian rules of matmul, softmax,
 * log_softmax, layer_norm, rms_norm, sdpa, gather and index_add
 * (graph/grad_other.c) on the graphs they build, and the ops added with
 * them (index_add, one_hot, logsumexp). Their finite-difference, eager and
 * compiled checks through kl_backward are rows of test_grad.c's table; here:
 *
 *  - each rule's backward graph built directly (graph/build.h over INPUT
 *    nodes), compiled (CPU, fusion on) in f32, f16 and bf16 with every input
 *    in every layout (dense, permuted, strided), against the reference's
 *    evaluation of the same graph in the same dtypes;
 *  - kernel counts of those backward graphs and of whole compiled training
 *    steps whose fusion across the forward/backward boundary the issue asks
 *    for (sigmoid(x @ w), log_softmax + cross-entropy, layer_norm);
 *  - index_add eager (determinism, errors), one_hot, logsumexp.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "core/core.h"
#include "graph/build.h"
#include "graph/optable.h"
#include "graph/reference.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/compiled.h"
#include "runtime/runtime_int.h"
#ifdef KILN_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

static kl_ctx *ctx;

/* launches of the whole compiled steps of test_step_kernel_counts, as
 * measured on the CPU target:
 *  - sigmoid(x @ w): the three products (BLAS) and ONE generated kernel that
 *    computes y = sigmoid(z), the loss and dz = t * y * (1 - y) from the
 *    saved y, feeding both gradient products (no separate pointwise pass);
 *  - log_softmax + cross-entropy: one row kernel over the logits (max, sum
 *    of exponentials, the picked log-probability and the logits' gradient),
 *    one tiny kernel for the mean over the rows;
 *  - layer_norm (weight, bias): the forward row kernel, the loss's sum, dx's
 *    row kernel, and one kernel for dw's and db's sums over the rows. 6
 *    before lower/fuse.c recomputed constant sources in every kernel that
 *    needs them (the scalar 1 that seeds the backward was a kernel of its
 *    own, stored for the kernel of dw), 5 before it merged sibling
 *    reductions (dw and db in two kernels). */
#define STEP_MM_MAX 4
#define STEP_XENT_MAX 2
#define STEP_LN_MAX 4

typedef struct gcase {
	const char *name;
	kl_op op;
	int nin;
	int nd[3];
	int64_t sh[3][4];
	bool index[3]; /* an index input: fixed values, no gradient */
	int k;         /* the variant: flags, axis, causal, scale */
} gcase;

/* the forward node of case c over input nodes in[] */
static int32_t forward(kl_graph *g, const gcase *c, const int32_t *in)
{
	switch (c->op) {
	case KL_OP_MATMUL: return kl__gb_matmul(g, in[0], in[1]);
	case KL_OP_SOFTMAX:
	case KL_OP_LOG_SOFTMAX: {
		kl_node n = g->nodes[in[0]];
		n.op = (uint16_t)c->op;
		n.nin = 1;
		n.in[0] = in[0];
		memset(n.strides, 0, sizeof n.strides);
		n.a.axis = c->k;
		return kl__gb_node(g, &n);
	}
	case KL_OP_LAYER_NORM:
	case KL_OP_RMS_NORM: {
		kl_node n = g->nodes[in[0]];
		n.op = (uint16_t)c->op;
		n.nin = (uint8_t)c->nin;
		memset(n.strides, 0, sizeof n.strides);
		for (int i = 0; i < c->nin; i++)
			n.in[i] = in[i];
		n.a.axis = n.ndim - 1;
		n.a.s[0] = 1e-5;
		n.a.flags = (uint8_t)c->k;
		return kl__gb_node(g, &n);
	}
	case KL_OP_ATTENTION: {
		kl_node n = g->nodes[in[0]];
		n.op = KL_OP_ATTENTION;
		n.nin = 3;
		memset(n.strides, 0, sizeof n.strides);
		for (int i = 0; i < 3; i++)
			n.in[i] = in[i];
		n.shape[n.ndim - 1] = g->nodes[in[2]].shape[n.ndim - 1];
		n.a.s[0] = c->k & 2 ? 1.0 / sqrt((double)g->nodes[in[0]].shape[n.ndim - 1]) : 0.35;
		n.a.flags = c->k & 1 ? KL_F_CAUSAL : 0;
		return kl__gb_node(g, &n);
	}
	case KL_OP_GATHER: {
		const kl_node *t = &g->nodes[in[0]], *x = &g->nodes[in[1]];
		kl_node n;
		memset(&n, 0, sizeof n);
		n.op = KL_OP_GATHER;
		n.dtype = t->dtype;
		n.nin = 2;
		n.in[0] = in[0];
		n.in[1] = in[1];
		for (int d = 0; d < x->ndim; d++)
			n.shape[n.ndim++] = x->shape[d];
		for (int d = 1; d < t->ndim; d++)
			n.shape[n.ndim++] = t->shape[d];
		return kl__gb_node(g, &n);
	}
	case KL_OP_INDEX_ADD: {
		kl_node n = g->nodes[in[0]];
		n.op = KL_OP_INDEX_ADD;
		n.nin = 3;
		memset(n.strides, 0, sizeof n.strides);
		for (int i = 0; i < 3; i++)
			n.in[i] = in[i];
		return kl__gb_node(g, &n);
	}
	default: return -1;
	}
}

static const gcase cases[] = {
	{"matmul", KL_OP_MATMUL, 2, {2, 2}, {{5, 7}, {7, 3}}, {0}, 0},
	{"matmul batched", KL_OP_MATMUL, 2, {3, 3}, {{2, 3, 4}, {2, 4, 5}}, {0}, 0},
	{"matmul 1x1", KL_OP_MATMUL, 2, {2, 2}, {{1, 1}, {1, 1}}, {0}, 0},
	{"matmul K=0", KL_OP_MATMUL, 2, {2, 2}, {{4, 0}, {0, 3}}, {0}, 0},
	{"softmax last", KL_OP_SOFTMAX, 1, {2}, {{7, 13}}, {0}, 1},
	{"softmax mid", KL_OP_SOFTMAX, 1, {3}, {{3, 4, 5}}, {0}, 1},
	{"softmax 1", KL_OP_SOFTMAX, 1, {2}, {{3, 1}}, {0}, 1},
	{"log_softmax last", KL_OP_LOG_SOFTMAX, 1, {2}, {{7, 13}}, {0}, 1},
	{"log_softmax first", KL_OP_LOG_SOFTMAX, 1, {3}, {{3, 4, 5}}, {0}, 0},
	{"layer_norm w b", KL_OP_LAYER_NORM, 3, {2, 1, 1}, {{5, 12}, {12}, {12}}, {0},
	 KL_F_HAS_WEIGHT | KL_F_HAS_BIAS},
	{"layer_norm w", KL_OP_LAYER_NORM, 2, {3, 1}, {{3, 4, 7}, {7}}, {0}, KL_F_HAS_WEIGHT},
	{"layer_norm b", KL_OP_LAYER_NORM, 2, {2, 1}, {{4, 9}, {9}}, {0}, KL_F_HAS_BIAS},
	{"layer_norm", KL_OP_LAYER_NORM, 1, {2}, {{6, 5}}, {0}, 0},
	{"layer_norm D=1", KL_OP_LAYER_NORM, 3, {2, 1, 1}, {{4, 1}, {1}, {1}}, {0},
	 KL_F_HAS_WEIGHT | KL_F_HAS_BIAS},
	{"rms_norm w", KL_OP_RMS_NORM, 2, {2, 1}, {{5, 12}, {12}}, {0}, KL_F_HAS_WEIGHT},
	{"rms_norm", KL_OP_RMS_NORM, 1, {3}, {{2, 3, 7}}, {0}, 0},
	{"sdpa", KL_OP_ATTENTION, 3, {3, 3, 3}, {{2, 5, 8}, {2, 7, 8}, {2, 7, 4}}, {0}, 0},
	{"sdpa causal", KL_OP_ATTENTION, 3, {3, 3, 3}, {{2, 6, 8}, {2, 6, 8}, {2, 6, 4}}, {0}, 1},
	{"sdpa causal Tq<Tk default scale", KL_OP_ATTENTION, 3, {4, 4, 4},
	 {{1, 2, 3, 8}, {1, 2, 5, 8}, {1, 2, 5, 3}}, {0}, 3},
	{"sdpa 1 query", KL_OP_ATTENTION, 3, {3, 3, 3}, {{1, 1, 5}, {1, 3, 5}, {1, 3, 1}}, {0}, 2},
	{"gather", KL_OP_GATHER, 2, {2, 1}, {{10, 3}, {6}}, {false, true}, 0},
	{"gather 1-d table", KL_OP_GATHER, 2, {1, 2}, {{10}, {2, 3}}, {false, true}, 0},
	{"index_add", KL_OP_INDEX_ADD, 3, {2, 1, 2}, {{10, 3}, {6}, {6, 3}}, {false, true, false}, 0},
	{"index_add none", KL_OP_INDEX_ADD, 3, {2, 1, 2}, {{4, 3}, {0}, {0, 3}}, {false, true, false},
	 0},
};

/* index values: repeats, the first and the last row (tables of >= 4 rows) */
static double index_value(int64_t i, int64_t rows)
{
	static const int v[] = {3, 0, 3, 9, 1, 3, 7, 0, 2, 9};
	return (double)(v[i % 10] % rows);
}

typedef struct built {
	kl_graph g;
	int32_t y, gout;
	int32_t gin[KL_NODE_MAX_IN];
} built;

/* forward and backward of c in dtype dt (indices i64 / i32 alternately);
 * outputs: y (unless bwd_only: a compiled backward's graph, the forward's
 * output saved elsewhere), then each input's gradient */
static bool bwd_only;

static void build(const gcase *c, kl_dtype dt, built *b, const int64_t (*strides)[KL_MAX_DIMS])
{
	kl__graph_init(&b->g);
	int32_t in[3];
	for (int i = 0; i < c->nin; i++) {
		kl_node x;
		memset(&x, 0, sizeof x);
		x.op = KL_OP_INPUT;
		x.dtype = (uint8_t)(c->index[i] ? (i == 1 && c->nd[0] == 1 ? KL_I32 : KL_I64) : dt);
		x.ndim = (uint8_t)c->nd[i];
		memcpy(x.shape, c->sh[i], sizeof(int64_t) * (size_t)c->nd[i]);
		if (strides)
			memcpy(x.strides, strides[i], sizeof x.strides);
		else
			kl__contig_strides(x.ndim, x.shape, x.strides);
		in[i] = kl__graph_add(&b->g, &x);
		assert_true(in[i] >= 0);
		assert_int_equal(kl__graph_add_input(&b->g, in[i]), 0);
	}
	b->y = forward(&b->g, c, in);
	assert_true(b->y >= 0);
	kl_node go = b->g.nodes[b->y];
	memset(&go, 0, offsetof(kl_node, shape));
	go.op = KL_OP_INPUT;
	go.dtype = b->g.nodes[b->y].dtype;
	go.ndim = b->g.nodes[b->y].ndim;
	memset(&go.a, 0, sizeof go.a);
	kl__contig_strides(go.ndim, go.shape, go.strides);
	b->gout = kl__graph_add(&b->g, &go);
	assert_int_equal(kl__graph_add_input(&b->g, b->gout), 0);
	const kl_opdesc *d = kl__opdesc[c->op];
	assert_non_null(d->vjp);
	assert_int_equal(d->vjp(&b->g, b->y, b->gout, b->gin), KL_OK);
	if (!bwd_only)
		assert_int_equal(kl__graph_add_output(&b->g, b->y), 0);
	for (int i = 0; i < c->nin; i++) {
		if (c->index[i]) {
			assert_int_equal(b->gin[i], -1);
			continue;
		}
		assert_true(b->gin[i] >= 0);
		const kl_node *x = &b->g.nodes[in[i]], *gx = &b->g.nodes[b->gin[i]];
		assert_int_equal(gx->dtype, x->dtype);
		assert_int_equal(gx->ndim, x->ndim);
		assert_memory_equal(gx->shape, x->shape, sizeof(int64_t) * x->ndim);
		assert_int_equal(kl__graph_add_output(&b->g, b->gin[i]), 0);
	}
}

static double *random_values(int64_t n, uint64_t *seed, double lo, double hi)
{
	double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	assert_non_null(v);
	for (int64_t i = 0; i < n; i++)
		v[i] = lo + (hi - lo) * kltest_uniform(seed);
	return v;
}

/* the values of graph input i of case c: indices or uniform [-2, 2) */
static double *input_values(const gcase *c, const kl_graph *g, int i, uint64_t *seed)
{
	const kl_node *x = &g->nodes[g->inputs[i]];
	int64_t n = kl__numel(x->ndim, x->shape);
	double *v = random_values(n, seed, -2, 2);
	if (i < c->nin && c->index[i])
		for (int64_t j = 0; j < n; j++)
			v[j] = index_value(j, c->sh[0][0]);
	return v;
}

/* the steps of a compiled graph that are generated kernels */
static int kernels_of(const kl_compiled *cc)
{
	int k = 0;
	for (int32_t i = 0; i < cc->prog.nsteps; i++)
		k += cc->prog.steps[i].kind == KL_STEP_KERNEL;
	return k;
}

/* b: c's graph in dtype dt over inputs made in the layouts layout_seed
 * picks (their strides are the graph's); in[] the inputs, iv[] their values */
static void build_laid(const gcase *c, kl_dtype dt, int layout_seed, built *b, kl_tensor **in,
                       double **iv)
{
	int64_t st[4][KL_MAX_DIMS];
	build(c, dt, b, NULL);
	uint64_t seed = 77 + (uint64_t)layout_seed;
	for (int i = 0; i < b->g.ninputs; i++) {
		const kl_node *x = &b->g.nodes[b->g.inputs[i]];
		iv[i] = input_values(c, &b->g, i, &seed);
		kltest_layout l = i < c->nin && !c->index[i] && x->ndim >= 2
		                          ? (kltest_layout)((layout_seed + i) % 3)
		                          : KLTEST_CONTIG;
		in[i] = kltest_from_values(ctx, (kl_dtype)x->dtype, x->ndim, x->shape, iv[i], l);
		assert_non_null(in[i]);
		free(iv[i]);
		iv[i] = kltest_read(in[i]);
		assert_non_null(iv[i]);
		memcpy(st[i], kl_strides(in[i]), sizeof(int64_t) * (size_t)x->ndim);
	}
	kl__graph_free(&b->g);
	build(c, dt, b, (const int64_t(*)[KL_MAX_DIMS])st);
}

/* Compile b's graph with fusion on, run it on inputs in the given layouts,
 * compare every output with the reference's evaluation in the same dtypes.
 * Returns the number of generated kernels (-1 on failure, each failure
 * printed with the case, the dtype, the layout and the error). */
static int run_compiled(const gcase *c, kl_dtype dt, int layout_seed, double factor)
{
	kl_tensor *in[4] = {0};
	double *iv[4] = {0};
	built b;
	build_laid(c, dt, layout_seed, &b, in, iv);
	char what[160];
	snprintf(what, sizeof what, "compiled %s %s layout %d", c->name, kl_dtype_name(dt),
	         layout_seed);
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "grad"};
	kl_compiled *cc = kl__compile(ctx, &b.g, &cfg);
	kl_tensor *out[4] = {0};
	double *ov[4] = {0};
	char err[320];
	bool ok = cc != NULL;
	if (!cc)
		fprintf(stderr, "FAIL %s: kl__compile: %s\n", what, kl_last_error(ctx));
	else if (kl__compiled_run(ctx, cc, in, out) != KL_OK) {
		fprintf(stderr, "FAIL %s: run: %s\n", what, kl_last_error(ctx));
		ok = false;
	} else if (kl__ref_eval(&b.g, (const double *const *)iv, ov, err, sizeof err) != KL_OK) {
		fprintf(stderr, "FAIL %s: reference: %s\n", what, err);
		ok = false;
	}
	for (int j = 0; ok && j < b.g.noutputs; j++) {
		const kl_node *n = &b.g.nodes[b.g.outputs[j]];
		double *got = kltest_read(out[j]);
		char w[200];
		snprintf(w, sizeof w, "%s output %d", what, j);
		if (!got)
			fprintf(stderr, "FAIL %s: read back: %s\n", w, kl_last_error(ctx));
		ok &= got && kltest_compare(w, (kl_dtype)n->dtype, n->ndim, n->shape, got, ov[j],
		                            factor);
		free(got);
	}
	for (int j = 0; j < b.g.noutputs; j++) {
		free(ov[j]);
		kl_release(out[j]);
	}
	int k = cc ? kernels_of(cc) : -1;
	kl__compiled_free(cc);
	for (int i = 0; i < b.g.ninputs; i++) {
		free(iv[i]);
		kl_release(in[i]);
	}
	kl__graph_free(&b.g);
	return ok ? k : -1;
}

static void test_rules_compiled(void **state)
{
	(void)state;
	int bad = 0;
	static const kl_dtype dts[] = {KL_F32, KL_F16, KL_BF16};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		for (int d = 0; d < 3; d++)
			for (int l = 0; l < (d == 0 ? 3 : 1); l++)
				bad += run_compiled(&cases[i], dts[d], l, 8) < 0;
	assert_int_equal(bad, 0);
}

/* The same graphs lowered for CUDA, here without a GPU: every product's
 * operands are matrices cuBLASLt can address (kl__mm_operand_layout; a
 * strided operand, [7,3] with strides [7,2], reached cuBLASLt unchanged and
 * the compiled run failed with KL_EUNSUPPORTED on test_grad_ops_cuda), and
 * where NVRTC loads the source compiles for sm_90. */
static void test_rules_cuda_lowering(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	bool nvrtc = kl__cuda_load_nvrtc(ctx) == KL_OK;
	kl_clear_error(ctx);
#endif
	int bad = 0;
	static const kl_dtype dts[] = {KL_F32, KL_F16, KL_BF16};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		for (int d = 0; d < 3; d++)
			for (int l = 0; l < (d == 0 ? 3 : 1); l++) {
				kl_tensor *in[4] = {0};
				double *iv[4] = {0};
				built b;
				build_laid(&cases[i], dts[d], l, &b, in, iv);
				kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
				kl_program P;
				char err[512];
				if (kl__lower(&b.g, &o, &P, err, sizeof err) != KL_OK)
					fail_msg("%s %s layout %d: lower for CUDA: %s", cases[i].name,
					         kl_dtype_name(dts[d]), l, err);
				for (int32_t s = 0; s < P.nsteps; s++) {
					const kl_matmul_step *m = &P.steps[s].mm;
					int64_t ld;
					if (P.steps[s].kind != KL_STEP_MATMUL || m->m <= 0 || m->n <= 0 ||
					    m->k <= 0)
						continue;
					if (kl__mm_operand_layout(m->m, m->k, m->a_rs, m->a_cs, &ld) < 0 ||
					    kl__mm_operand_layout(m->k, m->n, m->b_rs, m->b_cs, &ld) < 0) {
						fprintf(stderr,
						        "FAIL %s %s layout %d: step %d: %s with A strides "
						        "[%lld,%lld], B [%lld,%lld]: not for cuBLASLt\n",
						        cases[i].name, kl_dtype_name(dts[d]), l, (int)s,
						        P.steps[s].what, (long long)m->a_rs, (long long)m->a_cs,
						        (long long)m->b_rs, (long long)m->b_cs);
						bad++;
					}
				}
#ifdef KILN_HAVE_CUDA
				kl_cuda_image im;
				kl_nvrtc_opts no = {.arch = 90};
				if (nvrtc && P.source && P.nkernels > 0 &&
				    kl__nvrtc_compile(ctx, P.source, "grad.cu", &no, &im) != KL_OK) {
					fprintf(stderr, "FAIL %s %s layout %d: NVRTC: %s\n%s\n",
					        cases[i].name, kl_dtype_name(dts[d]), l, kl_last_error(ctx),
					        im.log ? im.log : "");
					bad++;
				}
				if (nvrtc && P.source && P.nkernels > 0)
					kl__cuda_image_free(&im);
#endif
				kl__program_free(&P);
				for (int k = 0; k < b.g.ninputs; k++) {
					free(iv[k]);
					kl_release(in[k]);
				}
				kl__graph_free(&b.g);
			}
	assert_int_equal(bad, 0);
}

/* The public ops this work added: index_add (eager) against the reference
 * through kltest_check_op, one_hot and logsumexp against their definitions. */
static kl_tensor *apply_index_add(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_index_add(in[0], in[1], in[2]);
}

static void test_index_add_eager(void **state)
{
	(void)state;
	int64_t bs[2] = {6, 4}, is[2] = {2, 5}, ss[3] = {2, 5, 4};
	double idx[10] = {5, 0, 5, 5, 1, 2, 0, 3, 5, 4};
	kl_tensor *in[3] = {kltest_rand(ctx, KL_F32, 2, bs, KLTEST_NORMAL, KLTEST_PERMUTED, 1),
	                    kltest_from_values(ctx, KL_I64, 2, is, idx, KLTEST_CONTIG),
	                    kltest_rand(ctx, KL_F32, 3, ss, KLTEST_NORMAL, KLTEST_STRIDED, 2)};
	assert_true(kltest_check_op(ctx, "index_add", apply_index_add, 3, in, NULL, 4));
	/* the same bits every run */
	kl_tensor *r1 = kl_index_add(in[0], in[1], in[2]), *r2 = kl_index_add(in[0], in[1], in[2]);
	double *v1 = kltest_read(r1), *v2 = kltest_read(r2);
	assert_memory_equal(v1, v2, sizeof(double) * 24);
	free(v1);
	free(v2);
	kl_release(r1);
	kl_release(r2);
	/* errors name the call, the shapes and the value */
	idx[3] = 6;
	kl_tensor *bad = kltest_from_values(ctx, KL_I64, 2, is, idx, KLTEST_CONTIG);
	assert_true(kltest_expect_error(ctx, kl_index_add(in[0], bad, in[2]),
	                                "kl_index_add: index 6 (element 3) out of range"));
	assert_true(kltest_expect_error(ctx, kl_index_add(in[0], in[1], in[0]),
	                                "kl_index_add: base [6,4], indices [2,5] and source [6,4]"));
	kl_tensor *h = kl_cast(in[2], KL_F16);
	assert_true(kltest_expect_error(ctx, kl_index_add(in[0], in[1], h),
	                                "kl_index_add: base dtype f32 and source dtype f16"));
	assert_true(kltest_expect_error(ctx, kl_index_add(in[0], in[0], in[2]),
	                                "kl_index_add: indices have dtype f32"));
	kl_release(h);
	kl_release(bad);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
}

static void test_one_hot_logsumexp(void **state)
{
	(void)state;
	int64_t is[2] = {2, 3};
	double idx[6] = {0, 3, 1, 3, 2, 0};
	kl_tensor *ix = kltest_from_values(ctx, KL_I32, 2, is, idx, KLTEST_CONTIG);
	kl_tensor *oh = kl_one_hot(ix, 4);
	assert_non_null(oh);
	assert_int_equal(kl_tensor_dtype(oh), KL_I64);
	assert_int_equal(kl_ndim(oh), 3);
	assert_int_equal(kl_shape(oh)[2], 4);
	double *v = kltest_read(oh);
	for (int i = 0; i < 6; i++)
		for (int j = 0; j < 4; j++)
			assert_true(v[i * 4 + j] == (j == (int)idx[i] ? 1.0 : 0.0));
	free(v);
	kl_release(oh);
	assert_true(kltest_expect_error(ctx, kl_one_hot(ix, 3),
	                                "kl_one_hot: index 3 (element 1) out of range"));
	kl_release(ix);

	/* logsumexp: rows with -inf, +inf, large values, over one and two axes */
	int64_t xs[3] = {2, 3, 4};
	double x[24];
	uint64_t seed = 5;
	for (int i = 0; i < 24; i++)
		x[i] = 4 * kltest_uniform(&seed) - 2;
	for (int j = 0; j < 4; j++)
		x[j] = -INFINITY; /* row (0, 0): -inf */
	x[5] = INFINITY;      /* row (0, 1): +inf */
	x[8] = 1000;          /* row (0, 2): overflow without the max */
	kl_tensor *t = kltest_from_values(ctx, KL_F64, 3, xs, x, KLTEST_CONTIG);
	for (int k = 0; k < 2; k++) {
		int axes[2] = {-1, 0};
		kl_tensor *r = kl_logsumexp(t, k + 1, axes, k == 1);
		assert_non_null(r);
		assert_int_equal(kl_ndim(r), k == 0 ? 2 : 3);
		double *got = kltest_read(r);
		for (int b = 0; b < (k == 0 ? 6 : 3); b++) {
			/* k = 0: row b = (i, j) over the last axis; k = 1: column j over axes 0, 2 */
			double m = -INFINITY, s = 0;
			for (int e = 0; e < (k == 0 ? 4 : 8); e++) {
				int at = k == 0 ? b * 4 + e : (e / 4) * 12 + b * 4 + e % 4;
				m = fmax(m, x[at]);
			}
			double mm = isinf(m) ? 0 : m;
			for (int e = 0; e < (k == 0 ? 4 : 8); e++) {
				int at = k == 0 ? b * 4 + e : (e / 4) * 12 + b * 4 + e % 4;
				s += exp(x[at] - mm);
			}
			double want = log(s) + mm;
			if (isinf(want))
				assert_true(got[b] == want);
			else
				assert_true(fabs(got[b] - want) <= 1e-12 * (1 + fabs(want)));
		}
		free(got);
		kl_release(r);
	}
	kl_release(t);
}

/* Kernel counts of backward graphs whose fusion the issue asks for: the
 * backward alone (a compiled backward: the forward's output saved) and
 * joint (the forward's output computed in the same graph). */
static int kernels_for(const gcase *c, bool bwd)
{
	bwd_only = bwd;
	int k = run_compiled(c, KL_F32, 0, 8);
	bwd_only = false;
	assert_true(k >= 0);
	return k;
}

static void test_backward_kernel_counts(void **state)
{
	(void)state;
	static const gcase kc[] = {
		/* sum(dy * y) and y * (dy - s) in one row kernel */
		{"softmax", KL_OP_SOFTMAX, 1, {2}, {{16, 32}}, {0}, 1},
		/* sum(dy) and dy - exp(y) * s in one */
		{"log_softmax", KL_OP_LOG_SOFTMAX, 1, {2}, {{16, 32}}, {0}, 1},
		/* the row statistics recomputed and dx in one */
		{"rms_norm", KL_OP_RMS_NORM, 1, {2}, {{16, 32}}, {0}, 0},
		{"layer_norm", KL_OP_LAYER_NORM, 1, {2}, {{16, 32}}, {0}, 0},
		/* dx's row kernel, then dw and db: sums over the rows, one kernel */
		{"layer_norm w b", KL_OP_LAYER_NORM, 3, {2, 1, 1}, {{16, 32}, {32}, {32}}, {0},
		 KL_F_HAS_WEIGHT | KL_F_HAS_BIAS},
		/* the comparison, select and sum of each output element in one */
		{"index_add", KL_OP_INDEX_ADD, 3, {2, 1, 2}, {{10, 3}, {6}, {6, 3}},
		 {false, true, false}, 0},
	};
	/* alone, and with the forward's output computed in the same graph (the
	 * norms: the forward's row statistics and the backward's are sibling
	 * reductions over the same rows, one kernel) */
	static const int want_bwd[] = {1, 1, 1, 1, 2, 1}, want_joint[] = {1, 1, 1, 1, 3, 2};
	int n = (int)(sizeof kc / sizeof kc[0]), bad = 0;
	for (int i = 0; i < n; i++) {
		int kb = kernels_for(&kc[i], true), kj = kernels_for(&kc[i], false);
		fprintf(stderr, "%s backward: %d kernels alone, %d with its forward\n", kc[i].name,
		        kb, kj);
		if (kb > want_bwd[i] || kj > want_joint[i]) {
			fprintf(stderr, "FAIL %s backward: %d and %d kernels, want %d and %d\n",
			        kc[i].name, kb, kj, want_bwd[i], want_joint[i]);
			bad++;
		}
	}
	assert_int_equal(bad, 0);
}

/* ---- whole training steps compiled: fusion across the boundary ------------------ */

typedef enum step_kind { STEP_SIGMOID_MM, STEP_XENT, STEP_LN } step_kind;

/* in: the step's inputs (those that require grad first); out: the loss,
 * then the gradients */
static kl_status step_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin, (void)nout;
	step_kind k = *(const step_kind *)user;
	kl_tensor *loss = NULL;
	int ng = 0;
	if (k == STEP_SIGMOID_MM) { /* in: x, w, target */
		kl_tensor *y = kl_sigmoid(kl_matmul(in[0], in[1]));
		loss = kl_sum(kl_mul(y, in[2]), 0, NULL, false);
		ng = 2;
	} else if (k == STEP_XENT) { /* in: logits, targets (i64) */
		int64_t nrow = kl_shape(in[0])[0], ncls = kl_shape(in[0])[1];
		kl_tensor *oh = kl_cast(kl_one_hot(in[1], ncls), kl_tensor_dtype(in[0]));
		kl_tensor *picked = kl_sum(kl_mul(kl_log_softmax(in[0], 1), oh), 1, (const int[]){1},
		                           false);
		loss = kl_mul_scalar(kl_sum(picked, 0, NULL, false), -1.0 / (double)nrow);
		ng = 1;
	} else { /* in: x, w, b, target */
		kl_tensor *y = kl_layer_norm(in[0], in[1], in[2], 1e-5);
		loss = kl_sum(kl_mul(y, in[3]), 0, NULL, false);
		ng = 3;
	}
	kl_status st = loss ? kl_backward(loss, NULL) : kl_last_status(c);
	if (st != KL_OK)
		return st;
	out[0] = loss;
	for (int i = 0; i < ng; i++)
		out[1 + i] = kl_grad(in[i]);
	return KL_OK;
}

/* The step compiled and run once: its launches, every gradient compared
 * with the same step run eagerly. */
static int step_launches(step_kind k, int nin, kl_tensor **in, int ngrad)
{
	kl_tensor *out[4] = {0}, *eg[4] = {0};
	for (int i = 0; i < ngrad; i++)
		assert_int_equal(kl_set_requires_grad(in[i], true), KL_OK);
	kl_fn *f = kl_compile(ctx, step_body, &k, nin, 1 + ngrad, NULL);
	assert_non_null(f);
	if (kl_fn_call(f, in, out) != KL_OK)
		fail_msg("step %d: %s", (int)k, kl_last_error(ctx));
	int launches = kl_fn_last_kernels(f);
	if (getenv("KILN_TEST_EXPLAIN"))
		kl_explain(f, stderr);
	for (int i = 0; i < ngrad; i++)
		kl_grad_clear(in[i]);
	kl_scope_begin(ctx);
	assert_int_equal(step_body(ctx, in, nin, eg, 1 + ngrad, &k), KL_OK);
	for (int i = 0; i <= ngrad; i++) {
		double *a = kltest_read(out[i]), *b = kltest_read(eg[i]);
		int64_t n = kl_numel(out[i]);
		for (int64_t e = 0; e < n; e++)
			if (!(fabs(a[e] - b[e]) <= 1e-4 * (1 + fabs(b[e]))))
				fail_msg("step %d output %d [%lld]: compiled %g, eager %g", (int)k, i,
				         (long long)e, a[e], b[e]);
		free(a);
		free(b);
		kl_release(out[i]);
	}
	kl_scope_end(ctx);
	for (int i = 0; i < ngrad; i++) {
		kl_grad_clear(in[i]);
		kl_set_requires_grad(in[i], false);
	}
	kl_fn_free(f);
	return launches;
}

static void test_step_kernel_counts(void **state)
{
	(void)state;
	kl_tensor *in[4];
	/* sigmoid(x @ w): the forward product, one kernel for y = sigmoid(z)
	 * and dz = t * y * (1 - y) from it, the two gradient products */
	in[0] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, 1);
	in[1] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){32, 24}, KLTEST_NORMAL, KLTEST_CONTIG, 2);
	in[2] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 24}, KLTEST_NORMAL, KLTEST_CONTIG, 3);
	int k_mm = step_launches(STEP_SIGMOID_MM, 3, in, 2);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	/* log_softmax + cross-entropy and its gradient over the logits */
	double t[12] = {3, 0, 9, 9, 1, 4, 7, 2, 5, 5, 6, 8};
	in[0] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){12, 10}, KLTEST_NORMAL, KLTEST_CONTIG, 4);
	in[1] = kltest_from_values(ctx, KL_I64, 1, (int64_t[]){12}, t, KLTEST_CONTIG);
	int k_xent = step_launches(STEP_XENT, 2, in, 1);
	kl_release(in[0]);
	kl_release(in[1]);
	/* layer_norm with weight and bias */
	in[0] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, 5);
	in[1] = kltest_rand(ctx, KL_F32, 1, (int64_t[]){32}, KLTEST_NORMAL, KLTEST_CONTIG, 6);
	in[2] = kltest_rand(ctx, KL_F32, 1, (int64_t[]){32}, KLTEST_NORMAL, KLTEST_CONTIG, 7);
	in[3] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, 8);
	int k_ln = step_launches(STEP_LN, 4, in, 3);
	for (int i = 0; i < 4; i++)
		kl_release(in[i]);
	fprintf(stderr, "whole-step launches: sigmoid(x @ w) %d, log_softmax + cross-entropy %d, "
	        "layer_norm %d\n", k_mm, k_xent, k_ln);
	assert_true(k_mm >= 0 && k_mm <= STEP_MM_MAX);
	assert_true(k_xent >= 0 && k_xent <= STEP_XENT_MAX);
	assert_true(k_ln >= 0 && k_ln <= STEP_LN_MAX);
}

static int setup(void **state)
{
	(void)state;
	ctx = kltest_ctx_from_env("test_grad_ops");
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
		cmocka_unit_test(test_index_add_eager),
		cmocka_unit_test(test_one_hot_logsumexp),
		cmocka_unit_test(test_rules_compiled),
		cmocka_unit_test(test_rules_cuda_lowering),
		cmocka_unit_test(test_backward_kernel_counts),
		cmocka_unit_test(test_step_kernel_counts),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
