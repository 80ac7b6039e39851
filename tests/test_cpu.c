/* test_cpu.c - the CPU backend's exec, driven directly with hand-built nodes
 * and tensors (strided, broadcast, every dtype) and checked against values
 * computed here in double: the corners the op-level tests reach rarely.
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cmocka.h>

#include "backend/cpu/cpu.h"
#include "core/core.h"
#include "core/half.h"
#include "graph/graph.h"

#define SH(...) ((const int64_t[]){__VA_ARGS__})

static kl_ctx *ctx;

static int setup(void **state)
{
	/* 3 threads: an odd split of every parallel path, even on 2 cores */
	ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 3});
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	kl_ctx_free(ctx);
	ctx = NULL;
	return 0;
}

/* ---- tensors and nodes by hand -------------------------------------------- */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static double urand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (double)(rng >> 11) * 0x1p-53;
}

static kl_tensor *mk(kl_dtype dt, int nd, const int64_t *shape)
{
	kl_tensor *t = kl__tensor_alloc(ctx, dt, nd, shape);
	assert_non_null(t);
	return t;
}

static int64_t nelem(const kl_tensor *t)
{
	size_t es = kl_dtype_size(t->dtype);
	return (int64_t)(t->st->nbytes / es);
}

/* every element of t's storage: uniform in [lo, hi), integers rounded */
static void fill(kl_tensor *t, double lo, double hi)
{
	bool integral = !kl_dtype_is_float(t->dtype);
	for (int64_t i = 0; i < nelem(t); i++) {
		double v = lo + (hi - lo) * urand();
		if (integral)
			v = floor(v);
		kl__store(t->st->data, t->dtype, i, v);
	}
}

static void set_all(kl_tensor *t, const double *v, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		kl__store(t->st->data, t->dtype, i, v[i]);
}

static kl_tensor *view(kl_tensor *base, int nd, const int64_t *shape, const int64_t *strides,
                       int64_t off)
{
	kl_tensor *t = kl__tensor_view(base, nd, shape, strides, off);
	assert_non_null(t);
	return t;
}

static int64_t numel(const kl_tensor *t)
{
	return kl__numel(t->ndim, t->shape);
}

static int64_t offset_of(const kl_tensor *t, int64_t i)
{
	int64_t off = 0;
	for (int d = t->ndim - 1; d >= 0; d--) {
		off += (i % t->shape[d]) * t->strides[d];
		i /= t->shape[d];
	}
	return off;
}

/* logical element i (row-major over t's shape) as a double */
static double at(const kl_tensor *t, int64_t i)
{
	return kl__load(kl__tensor_data(t), t->dtype, offset_of(t, i));
}

/* the same, exactly, for integer and bool tensors */
static int64_t ati(const kl_tensor *t, int64_t i)
{
	const void *p = kl__tensor_data(t);
	int64_t off = offset_of(t, i);
	switch (t->dtype) {
	case KL_I32: return ((const int32_t *)p)[off];
	case KL_I64: return ((const int64_t *)p)[off];
	case KL_BOOL: return ((const uint8_t *)p)[off] != 0;
	default: return 0;
	}
}

static kl_node mknode(kl_op op, kl_dtype dt, int nd, const int64_t *shape, int nin)
{
	kl_node n;
	memset(&n, 0, sizeof n);
	n.op = (uint16_t)op;
	n.dtype = (uint8_t)dt;
	n.ndim = (uint8_t)nd;
	n.nin = (uint8_t)nin;
	for (int d = 0; d < nd; d++)
		n.shape[d] = shape[d];
	return n;
}

/* exec n into a fresh, poisoned output; the status is returned in *st */
static kl_tensor *exec_st(const kl_node *n, kl_tensor *const *in, kl_status *st)
{
	kl_tensor *out = mk((kl_dtype)n->dtype, n->ndim, n->shape);
	memset(out->st->data, 0xff, out->st->nbytes);
	kl_clear_error(ctx);
	*st = kl__cpu_backend.exec(ctx, n, in, out);
	return out;
}

static kl_tensor *run(const kl_node *n, kl_tensor *const *in)
{
	kl_status st;
	kl_tensor *out = exec_st(n, in, &st);
	if (st != KL_OK)
		fail_msg("%s: exec failed: %s", kl__ops[n->op].name, kl_last_error(ctx));
	return out;
}

/* Compare out with ref (numel values): NaN only with NaN, infinities exactly,
 * finite values within tol * (|ref| + atol). Returns the mismatches. */
static int check_tol(const char *what, const kl_tensor *out, const double *ref, double tol,
                     double atol)
{
	int bad = 0;
	for (int64_t i = 0; i < numel(out); i++) {
		double g = at(out, i), w = ref[i];
		bool ok;
		if (isnan(w))
			ok = isnan(g);
		else if (isinf(w) || tol == 0)
			ok = g == w;
		else
			ok = !isnan(g) && fabs(g - w) <= tol * (fabs(w) + atol);
		if (!ok && bad++ < 4)
			fprintf(stderr, "%s [%s]: element %lld: got %.17g, want %.17g\n", what,
			        kl_dtype_name(out->dtype), (long long)i, g, w);
	}
	return bad;
}

static int check(const char *what, const kl_tensor *out, const double *ref)
{
	return check_tol(what, out, ref, 0, 0);
}

static double *alloc_ref(int64_t n)
{
	double *r = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	assert_non_null(r);
	return r;
}

static const kl_dtype num_dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16, KL_I32, KL_I64};

static bool is_int(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64 || dt == KL_BOOL;
}

static double wrap_to(kl_dtype dt, uint64_t u)
{
	if (dt == KL_I32)
		return (double)(int32_t)(uint32_t)u;
	return (double)(int64_t)u;
}

/* ---- pointwise -------------------------------------------------------------- */

static double ref_binary(kl_op op, kl_dtype dt, double a, double b)
{
	a = kl__round_to(dt, a);
	b = kl__round_to(dt, b);
	if (is_int(dt) && dt != KL_BOOL && op != KL_OP_DIV) {
		int64_t x = (int64_t)a, y = (int64_t)b;
		uint64_t ux = (uint64_t)x, uy = (uint64_t)y;
		switch (op) {
		case KL_OP_ADD: return wrap_to(dt, ux + uy);
		case KL_OP_SUB: return wrap_to(dt, ux - uy);
		case KL_OP_MUL: return wrap_to(dt, ux * uy);
		case KL_OP_MAXIMUM: return x > y ? a : b;
		case KL_OP_MINIMUM: return x < y ? a : b;
		case KL_OP_POW: {
			uint64_t r = 1;
			for (int64_t k = 0; k < y; k++)
				r *= ux;
			return wrap_to(dt, r);
		}
		default: return NAN;
		}
	}
	double r;
	switch (op) {
	case KL_OP_ADD: r = a + b; break;
	case KL_OP_SUB: r = a - b; break;
	case KL_OP_MUL: r = a * b; break;
	case KL_OP_DIV: r = a / b; break;
	case KL_OP_POW: r = pow(a, b); break;
	case KL_OP_MAXIMUM: r = (isnan(a) || isnan(b)) ? NAN : a > b ? a : b; break;
	case KL_OP_MINIMUM: r = (isnan(a) || isnan(b)) ? NAN : a < b ? a : b; break;
	default: r = NAN;
	}
	return kl__round_to(dt, r);
}

/* op on a dense [R, C] lhs of dtype dt and an rhs of dtype bdt that is a
 * transposed view, then a broadcast row; the mismatches */
static int binary_case(kl_op op, kl_dtype dt, kl_dtype bdt, int64_t R, int64_t C)
{
	bool ipow = op == KL_OP_POW && is_int(dt);
	kl_tensor *a = mk(dt, 2, SH(R, C));
	kl_tensor *bs = mk(bdt, 2, SH(C, R));
	kl_tensor *crow = mk(bdt, 1, SH(C));
	if (op == KL_OP_POW) {
		fill(a, ipow ? -3 : 0.25, ipow ? 4 : 3);
		fill(bs, ipow ? 0 : -2, ipow ? 5 : 2);
		fill(crow, ipow ? 0 : -2, ipow ? 5 : 2);
	} else {
		fill(a, -20, 20);
		fill(bs, -20, 20);
		fill(crow, -20, 20);
	}
	kl_tensor *b = view(bs, 2, SH(R, C), SH(1, R), 0);
	kl_tensor *c = view(crow, 2, SH(R, C), SH(0, 1), 0);
	kl_dtype odt = kl_promote_types(dt, bdt);
	if (op == KL_OP_DIV && is_int(odt))
		odt = KL_F32;
	/* exact, but for pow: libm's against double's */
	double tol = 0;
	if (op == KL_OP_POW)
		tol = odt == KL_F64 ? 1e-14 : (odt == KL_F16 || odt == KL_BF16) ? 8e-3 : 2e-6;
	int bad = 0;
	for (int which = 0; which < 2; which++) {
		kl_tensor *rhs = which ? c : b;
		kl_node n = mknode(op, odt, 2, SH(R, C), 2);
		kl_tensor *out = run(&n, (kl_tensor *[]){a, rhs});
		double *ref = alloc_ref(R * C);
		for (int64_t i = 0; i < R * C; i++)
			ref[i] = ref_binary(op, odt, at(a, i), at(rhs, i));
		char what[64];
		snprintf(what, sizeof what, "%s %lldx%lld rhs %d", kl__ops[op].name, (long long)R,
		         (long long)C, which);
		bad += check_tol(what, out, ref, tol, 1e-30);
		free(ref);
	}
	return bad;
}

/* every binary op and dtype; small (strided path) and large (parallel) */
static void test_binary_dtypes(void **state)
{
	static const kl_op ops[] = {KL_OP_ADD, KL_OP_SUB, KL_OP_MUL, KL_OP_DIV,
	                            KL_OP_POW, KL_OP_MAXIMUM, KL_OP_MINIMUM};
	static const int64_t sizes[2][2] = {{37, 29}, {300, 150}};
	int bad = 0;
	for (size_t s = 0; s < 2; s++) {
		for (size_t di = 0; di < sizeof num_dts / sizeof *num_dts; di++) {
			kl_dtype dt = num_dts[di];
			/* the rhs is another dtype half of the time: the op converts it */
			kl_dtype bdt = (di % 2) ? (is_int(dt) ? KL_I32 : KL_F16) : dt;
			for (size_t oi = 0; oi < sizeof ops / sizeof *ops; oi++)
				bad += binary_case(ops[oi], dt, bdt, sizes[s][0], sizes[s][1]);
		}
	}
	assert_int_equal(bad, 0);
}

static void test_binary_scalar_nan(void **state)
{
	int bad = 0;
	/* NaN on either side wins maximum/minimum */
	kl_tensor *a = mk(KL_F32, 1, SH(6));
	kl_tensor *b = mk(KL_F32, 1, SH(6));
	set_all(a, (double[]){NAN, 1, NAN, -INFINITY, 2, 0}, 6);
	set_all(b, (double[]){1, NAN, NAN, -1, INFINITY, -0.0}, 6);
	kl_node n = mknode(KL_OP_MAXIMUM, KL_F32, 1, SH(6), 2);
	bad += check("maximum nan", run(&n, (kl_tensor *[]){a, b}),
	             (double[]){NAN, NAN, NAN, -1, INFINITY, 0});
	n.op = KL_OP_MINIMUM;
	bad += check("minimum nan", run(&n, (kl_tensor *[]){a, b}),
	             (double[]){NAN, NAN, NAN, -INFINITY, 2, 0});

	/* scalar rhs, rounded to the result dtype first; f16 and i32 */
	kl_tensor *h = mk(KL_F16, 1, SH(4));
	set_all(h, (double[]){1, 2, -3, 1000}, 4);
	n = mknode(KL_OP_MUL, KL_F16, 1, SH(4), 1);
	n.a.scalar_rhs = 1;
	n.a.s[0] = 0.1;
	double ref[4];
	for (int i = 0; i < 4; i++)
		ref[i] = kl__round_to(KL_F16, at(h, i) * kl__round_to(KL_F16, 0.1));
	bad += check("f16 * 0.1", run(&n, (kl_tensor *[]){h}), ref);
	kl_tensor *iv = mk(KL_I32, 1, SH(3));
	set_all(iv, (double[]){2147483647.0, -5, 7}, 3);
	n = mknode(KL_OP_ADD, KL_I32, 1, SH(3), 1);
	n.a.scalar_rhs = 1;
	n.a.s[0] = 1;
	bad += check("i32 + 1 wraps", run(&n, (kl_tensor *[]){iv}),
	             (double[]){-2147483648.0, -4, 8});

	/* a 0-dim tensor broadcast to every element (all strides 0) */
	kl_tensor *s0 = mk(KL_F64, 0, NULL);
	set_all(s0, (double[]){2.5}, 1);
	kl_tensor *sb = view(s0, 2, SH(300, 200), SH(0, 0), 0);
	kl_tensor *x = mk(KL_F32, 2, SH(300, 200));
	fill(x, -1, 1);
	n = mknode(KL_OP_SUB, KL_F64, 2, SH(300, 200), 2);
	kl_tensor *o = run(&n, (kl_tensor *[]){sb, x});
	double *r2 = alloc_ref(60000);
	for (int64_t i = 0; i < 60000; i++)
		r2[i] = 2.5 - at(x, i);
	bad += check("broadcast scalar - x", o, r2);
	free(r2);
	assert_int_equal(bad, 0);
}

static void test_compare(void **state)
{
	int bad = 0;
	/* int64 beyond 2^53 compares exactly */
	kl_tensor *a = mk(KL_I64, 1, SH(3));
	kl_tensor *b = mk(KL_I64, 1, SH(3));
	int64_t av[3] = {(1ll << 60) + 1, 5, -7}, bv[3] = {1ll << 60, 5, -8};
	memcpy(a->st->data, av, sizeof av);
	memcpy(b->st->data, bv, sizeof bv);
	kl_node n = mknode(KL_OP_EQ, KL_BOOL, 1, SH(3), 2);
	bad += check("i64 eq", run(&n, (kl_tensor *[]){a, b}), (double[]){0, 1, 0});
	n.op = KL_OP_GT;
	bad += check("i64 gt", run(&n, (kl_tensor *[]){a, b}), (double[]){1, 0, 1});

	/* i32 against f32 meets in double: 2^24 + 1 is not 2^24 */
	kl_tensor *i = mk(KL_I32, 1, SH(2));
	kl_tensor *f = mk(KL_F32, 1, SH(2));
	set_all(i, (double[]){16777217, 3}, 2);
	set_all(f, (double[]){16777216, 3}, 2);
	n = mknode(KL_OP_NE, KL_BOOL, 1, SH(2), 2);
	bad += check("i32 ne f32", run(&n, (kl_tensor *[]){i, f}), (double[]){1, 0});

	/* a float against the scalar as given, not rounded to float */
	kl_tensor *x = mk(KL_F32, 1, SH(3));
	set_all(x, (double[]){0.1, NAN, -1}, 3);
	n = mknode(KL_OP_GT, KL_BOOL, 1, SH(3), 1);
	n.a.scalar_rhs = 1;
	n.a.s[0] = 0.1;
	bad += check("0.1f > 0.1", run(&n, (kl_tensor *[]){x}), (double[]){1, 0, 0});
	n.op = KL_OP_NE;
	bad += check("nan != 0.1", run(&n, (kl_tensor *[]){x}), (double[]){1, 1, 1});
	/* an integer tensor against a fractional scalar */
	n = mknode(KL_OP_LT, KL_BOOL, 1, SH(2), 1);
	n.a.scalar_rhs = 1;
	n.a.s[0] = 3.5;
	bad += check("i32 < 3.5", run(&n, (kl_tensor *[]){i}), (double[]){0, 1});

	/* strided bf16 against broadcast f16, large enough to run in parallel */
	kl_tensor *bs = mk(KL_BF16, 2, SH(200, 400));
	kl_tensor *hr = mk(KL_F16, 1, SH(200));
	fill(bs, -3, 3);
	fill(hr, -3, 3);
	kl_tensor *bv2 = view(bs, 2, SH(200, 200), SH(400, 2), 1);
	kl_tensor *hv = view(hr, 2, SH(200, 200), SH(1, 0), 0);
	n = mknode(KL_OP_LE, KL_BOOL, 2, SH(200, 200), 2);
	kl_tensor *o = run(&n, (kl_tensor *[]){bv2, hv});
	double *ref = alloc_ref(40000);
	for (int64_t k = 0; k < 40000; k++)
		ref[k] = at(bv2, k) <= at(hv, k);
	bad += check("bf16 <= f16", o, ref);
	free(ref);
	assert_int_equal(bad, 0);
}

static double ref_unary(kl_op op, double x)
{
	switch (op) {
	case KL_OP_NEG: return -x;
	case KL_OP_ABS: return fabs(x);
	case KL_OP_EXP: return exp(x);
	case KL_OP_LOG: return log(x);
	case KL_OP_SQRT: return sqrt(x);
	case KL_OP_RSQRT: return 1 / sqrt(x);
	case KL_OP_SIN: return sin(x);
	case KL_OP_COS: return cos(x);
	case KL_OP_TANH: return tanh(x);
	case KL_OP_SIGMOID: return 1 / (1 + exp(-x));
	case KL_OP_RELU: return isnan(x) ? x : x > 0 ? x : 0;
	/* 1 + erf(z) as erfc(-z) and 1 + tanh(u) as 2 / (1 + exp(-2u)): the
	 * textbook forms cancel for negative x even in double */
	case KL_OP_GELU: return 0.5 * x * erfc(-x / sqrt(2.0));
	case KL_OP_GELU_TANH:
		return x / (1 + exp(-2 * sqrt(2 / 3.14159265358979323846) *
		                    (x + 0.044715 * x * x * x)));
	case KL_OP_SILU: return x / (1 + exp(-x));
	default: return NAN;
	}
}

static void test_unary(void **state)
{
	static const kl_op ops[] = {KL_OP_NEG, KL_OP_ABS, KL_OP_EXP, KL_OP_LOG, KL_OP_SQRT,
	                            KL_OP_RSQRT, KL_OP_SIN, KL_OP_COS, KL_OP_TANH, KL_OP_SIGMOID,
	                            KL_OP_RELU, KL_OP_GELU, KL_OP_GELU_TANH, KL_OP_SILU};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	static const double tols[] = {3e-6, 1e-14, 2e-3, 1e-2};
	int bad = 0;
	for (size_t di = 0; di < 4; di++) {
		kl_dtype dt = dts[di];
		for (size_t oi = 0; oi < sizeof ops / sizeof *ops; oi++) {
			kl_op op = ops[oi];
			bool pos = op == KL_OP_LOG || op == KL_OP_SQRT || op == KL_OP_RSQRT;
			/* a slice with step 3 of a bigger tensor, plus special values */
			kl_tensor *base = mk(dt, 1, SH(3 * 700));
			fill(base, pos ? 0.01 : -6, 6);
			kl_tensor *x = view(base, 1, SH(700), SH(3), 2);
			double sp[] = {NAN, INFINITY, -INFINITY, 0, -0.0, 100, -100, -1000, 1000};
			for (int k = 0; k < 9; k++)
				kl__store(base->st->data, dt, 2 + 3 * k, sp[k]);
			kl_node n = mknode(op, dt, 1, SH(700), 1);
			kl_tensor *o = run(&n, (kl_tensor *[]){x});
			double ref[700];
			for (int k = 0; k < 700; k++)
				ref[k] = kl__round_to(dt, ref_unary(op, at(x, k)));
			bad += check_tol(kl__ops[op].name, o, ref, tols[di], 1e-6);
		}
	}
	/* an integer input of a float op converts first; relu/neg/abs of ints
	 * stay integers and wrap */
	kl_tensor *iv = mk(KL_I64, 1, SH(4));
	int64_t vals[4] = {INT64_MIN, -3, 0, 9};
	memcpy(iv->st->data, vals, sizeof vals);
	kl_node n = mknode(KL_OP_EXP, KL_F32, 1, SH(4), 1);
	kl_tensor *o = run(&n, (kl_tensor *[]){iv});
	bad += check_tol("exp(i64)", o, (double[]){0, (float)exp(-3.0), 1, (float)exp(9.0)}, 1e-6,
	                 0);
	n = mknode(KL_OP_ABS, KL_I64, 1, SH(4), 1);
	o = run(&n, (kl_tensor *[]){iv});
	bad += ((int64_t *)o->st->data)[0] != INT64_MIN; /* abs(INT64_MIN) wraps to itself */
	bad += check("abs i64 rest", view(o, 1, SH(3), SH(1), 1), (double[]){3, 0, 9});
	n.op = KL_OP_NEG;
	o = run(&n, (kl_tensor *[]){iv});
	bad += ((int64_t *)o->st->data)[0] != INT64_MIN;
	n.op = KL_OP_RELU;
	o = run(&n, (kl_tensor *[]){iv});
	bad += check("relu i64", o, (double[]){0, 0, 0, 9});

	/* sigmoid of extreme inputs: exact 0/1 ends, tiny values kept */
	kl_tensor *x = mk(KL_F32, 1, SH(4));
	set_all(x, (double[]){-1000, -80, 80, 1000}, 4);
	n = mknode(KL_OP_SIGMOID, KL_F32, 1, SH(4), 1);
	bad += check_tol("sigmoid ends", run(&n, (kl_tensor *[]){x}),
	                 (double[]){0, (float)exp(-80.0), 1, 1}, 1e-6, 0);
	assert_int_equal(bad, 0);
}

static void test_int_pow_wrap(void **state)
{
	int bad = 0;
	static const kl_dtype dts[] = {KL_I32, KL_I64};
	for (int k = 0; k < 2; k++) {
		kl_dtype dt = dts[k];
		/* every base in [-3, 3] against every exponent in [-3, 3] */
		kl_tensor *b = mk(dt, 1, SH(7));
		kl_tensor *e = mk(dt, 1, SH(7));
		set_all(b, (double[]){-3, -2, -1, 0, 1, 2, 3}, 7);
		set_all(e, (double[]){-3, -2, -1, 0, 1, 2, 3}, 7);
		kl_tensor *bb = view(b, 2, SH(7, 7), SH(1, 0), 0);
		kl_tensor *ee = view(e, 2, SH(7, 7), SH(0, 1), 0);
		kl_node n = mknode(KL_OP_POW, dt, 2, SH(7, 7), 2);
		kl_tensor *o = run(&n, (kl_tensor *[]){bb, ee});
		double ref[49];
		for (int i = 0; i < 7; i++) {
			for (int j = 0; j < 7; j++) {
				double base = i - 3, ex = j - 3;
				double r;
				if (ex < 0 && fabs(base) == 1)
					r = base == 1 || ((int)-ex & 1) == 0 ? 1 : -1;
				else if (ex < 0)
					r = 0;
				else
					r = pow(base, ex);
				ref[i * 7 + j] = r;
			}
		}
		bad += check("int pow", o, ref);
		/* big powers wrap */
		kl_tensor *x = mk(dt, 1, SH(2));
		set_all(x, (double[]){3, -7}, 2);
		n = mknode(KL_OP_POW, dt, 1, SH(2), 1);
		n.a.scalar_rhs = 1;
		n.a.s[0] = 41;
		o = run(&n, (kl_tensor *[]){x});
		uint64_t p3 = 1, p7 = 1;
		for (int q = 0; q < 41; q++) {
			p3 *= 3;
			p7 *= (uint64_t)-7;
		}
		bad += check("pow wraps", o, (double[]){wrap_to(dt, p3), wrap_to(dt, p7)});
		/* mul wraps */
		n = mknode(KL_OP_MUL, dt, 1, SH(2), 2);
		kl_tensor *y = mk(dt, 1, SH(2));
		set_all(x, (double[]){dt == KL_I32 ? 65536 : 4294967296.0, -3}, 2);
		set_all(y, (double[]){dt == KL_I32 ? 65536 : 4294967296.0, 5}, 2);
		bad += check("mul wraps", run(&n, (kl_tensor *[]){x, y}), (double[]){0, -15});
	}
	assert_int_equal(bad, 0);
}

static void test_cast(void **state)
{
	int bad = 0;
	double src[] = {NAN, INFINITY, -INFINITY, 3e9, -3e9, 2.7, -2.7, 0.0, -0.5, 1e20};
	int ns = 10;
	kl_tensor *f = mk(KL_F32, 1, SH(10));
	set_all(f, src, ns);
	kl_node n = mknode(KL_OP_CAST, KL_I32, 1, SH(10), 1);
	bad += check("f32->i32", run(&n, (kl_tensor *[]){f}),
	             (double[]){0, 2147483647.0, -2147483648.0, 2147483647.0, -2147483648.0, 2, -2,
	                        0, 0, 2147483647.0});
	n.dtype = KL_I64;
	kl_tensor *o = run(&n, (kl_tensor *[]){f});
	int64_t *ov = o->st->data;
	bad += ov[0] != 0 || ov[1] != INT64_MAX || ov[2] != INT64_MIN || ov[3] != 3000000000ll ||
	       ov[5] != 2 || ov[6] != -2 || ov[9] != INT64_MAX;
	n.dtype = KL_BOOL;
	bad += check("f32->bool", run(&n, (kl_tensor *[]){f}),
	             (double[]){1, 1, 1, 1, 1, 1, 1, 0, 1, 1});

	/* f64 -> f16/bf16 is one correct rounding, bit for bit kl__store */
	kl_tensor *d = mk(KL_F64, 1, SH(400));
	double *dv = d->st->data;
	for (int i = 0; i < 400; i++) {
		/* ties between f16 (or bf16) neighbours, exact or a double ulp
		 * above: float rounds the latter onto the tie, a trap for double
		 * rounding */
		int k = i % 50, kind = (i / 50) % 4;
		double h = kind < 2 ? 1.0 + k * 0x1p-10 + 0x1p-11 : 1.0 + k * 0x1p-7 + 0x1p-8;
		dv[i] = (i < 200 ? 1 : -1) * (kind % 2 ? nextafter(h, 10) : h) * 4.0;
	}
	for (int k = 0; k < 2; k++) {
		kl_dtype dt = k ? KL_BF16 : KL_F16;
		n = mknode(KL_OP_CAST, dt, 1, SH(400), 1);
		o = run(&n, (kl_tensor *[]){d});
		for (int i = 0; i < 400; i++) {
			uint16_t want;
			kl__store(&want, dt, 0, dv[i]);
			bad += ((uint16_t *)o->st->data)[i] != want;
		}
	}

	/* integer narrowing saturates as kl__store does; ints and bools widen */
	kl_tensor *l = mk(KL_I64, 1, SH(4));
	int64_t lv[4] = {1ll << 40, -(1ll << 40), -5, (1ll << 53) + 1};
	memcpy(l->st->data, lv, sizeof lv);
	n = mknode(KL_OP_CAST, KL_I32, 1, SH(4), 1);
	bad += check("i64->i32", run(&n, (kl_tensor *[]){l}),
	             (double[]){2147483647.0, -2147483648.0, -5, 2147483647.0});
	n.dtype = KL_F64;
	bad += check("i64->f64", run(&n, (kl_tensor *[]){l}),
	             (double[]){0x1p40, -0x1p40, -5, 0x1p53});
	kl_tensor *bl = mk(KL_BOOL, 1, SH(3));
	((uint8_t *)bl->st->data)[0] = 0;
	((uint8_t *)bl->st->data)[1] = 1;
	((uint8_t *)bl->st->data)[2] = 7; /* any nonzero byte is true */
	n = mknode(KL_OP_CAST, KL_F16, 1, SH(3), 1);
	bad += check("bool->f16", run(&n, (kl_tensor *[]){bl}), (double[]){0, 1, 1});

	/* every dtype to every dtype over a transposed view, large */
	for (size_t a = 0; a < 6; a++) {
		for (size_t b = 0; b < 6; b++) {
			kl_tensor *s = mk(num_dts[a], 2, SH(250, 160));
			fill(s, -100, 100);
			kl_tensor *t = view(s, 2, SH(160, 250), SH(1, 160), 0);
			n = mknode(KL_OP_CAST, num_dts[b], 2, SH(160, 250), 1);
			o = run(&n, (kl_tensor *[]){t});
			double *ref = alloc_ref(40000);
			for (int64_t i = 0; i < 40000; i++)
				ref[i] = kl__round_to(num_dts[b], at(t, i));
			bad += check("cast grid", o, ref);
			free(ref);
		}
	}
	assert_int_equal(bad, 0);
}

static void test_where_clamp(void **state)
{
	int bad = 0;
	/* a float condition: NaN and 0.5 are true */
	kl_tensor *c = mk(KL_F32, 1, SH(4));
	set_all(c, (double[]){NAN, 0.5, 0, -0.0}, 4);
	kl_tensor *a0 = mk(KL_I32, 0, NULL);
	set_all(a0, (double[]){7}, 1);
	kl_tensor *a = view(a0, 1, SH(4), SH(0), 0);
	kl_tensor *b = mk(KL_F64, 1, SH(4));
	set_all(b, (double[]){1.5, 2.5, 3.5, 4.5}, 4);
	kl_node n = mknode(KL_OP_WHERE, KL_F64, 1, SH(4), 3);
	bad += check("where", run(&n, (kl_tensor *[]){c, a, b}), (double[]){7, 7, 3.5, 4.5});

	/* bool condition, large, strided */
	kl_tensor *cb = mk(KL_BOOL, 2, SH(300, 300));
	fill(cb, 0, 2);
	kl_tensor *x = mk(KL_F32, 2, SH(300, 300));
	kl_tensor *y = mk(KL_F32, 1, SH(300));
	fill(x, -1, 1);
	fill(y, -1, 1);
	kl_tensor *xt = view(x, 2, SH(300, 300), SH(1, 300), 0);
	kl_tensor *yb = view(y, 2, SH(300, 300), SH(0, 1), 0);
	n = mknode(KL_OP_WHERE, KL_F32, 2, SH(300, 300), 3);
	kl_tensor *o = run(&n, (kl_tensor *[]){cb, xt, yb});
	double *ref = alloc_ref(90000);
	for (int64_t i = 0; i < 90000; i++)
		ref[i] = at(cb, i) != 0 ? at(xt, i) : at(yb, i);
	bad += check("where big", o, ref);
	free(ref);

	/* clamp keeps NaN, lo > hi gives hi; integer clamp with open ends */
	kl_tensor *f = mk(KL_F32, 1, SH(5));
	set_all(f, (double[]){NAN, -5, 0.5, 5, INFINITY}, 5);
	n = mknode(KL_OP_CLAMP, KL_F32, 1, SH(5), 1);
	n.a.s[0] = -1;
	n.a.s[1] = 1;
	bad += check("clamp", run(&n, (kl_tensor *[]){f}), (double[]){NAN, -1, 0.5, 1, 1});
	n.a.s[0] = 2;
	n.a.s[1] = 1;
	bad += check("clamp lo>hi", run(&n, (kl_tensor *[]){f}), (double[]){NAN, 1, 1, 1, 1});
	kl_tensor *iv = mk(KL_I32, 1, SH(3));
	set_all(iv, (double[]){-2147483648.0, 5, 2147483647.0}, 3);
	n = mknode(KL_OP_CLAMP, KL_I32, 1, SH(3), 1);
	n.a.s[0] = -INFINITY;
	n.a.s[1] = 4;
	bad += check("clamp i32", run(&n, (kl_tensor *[]){iv}), (double[]){-2147483648.0, 4, 4});
	assert_int_equal(bad, 0);
}

/* ---- reductions ---------------------------------------------------------------- */

/* Reference reduction of x over mask into ref (kept dims row-major). */
static void ref_reduce(const kl_tensor *x, kl_op op, uint32_t mask, int corr, double *ref,
                       int64_t *nout)
{
	int nd = x->ndim;
	int64_t ko = 1;
	for (int d = 0; d < nd; d++)
		if (!(mask >> d & 1))
			ko *= x->shape[d];
	*nout = ko;
	int64_t total = numel(x);
	int64_t nred = ko ? total / ko : 0;
	double *s = calloc((size_t)ko + 1, sizeof(double)), *s2 = calloc((size_t)ko + 1, 8);
	double *m = malloc(((size_t)ko + 1) * 8);
	int64_t *arg = calloc((size_t)ko + 1, 8);
	uint64_t *u = calloc((size_t)ko + 1, 8);
	for (int64_t o = 0; o < ko; o++)
		m[o] = op == KL_OP_MIN ? INFINITY : -INFINITY;
	for (int pass = 0; pass < 2; pass++) {
		int64_t *cnt = calloc((size_t)ko + 1, 8);
		for (int64_t i = 0; i < total; i++) {
			int64_t rem = i, o = 0, mul = 1;
			for (int d = nd - 1; d >= 0; d--) {
				int64_t id = rem % x->shape[d];
				rem /= x->shape[d];
				if (!(mask >> d & 1)) {
					o += id * mul;
					mul *= x->shape[d];
				}
			}
			double v = at(x, i);
			if (pass == 0) {
				s[o] += v;
				if (is_int(x->dtype))
					u[o] += (uint64_t)ati(x, i);
				if (op == KL_OP_MAX && (isnan(v) || v > m[o]) && !isnan(m[o]))
					m[o] = v;
				if (op == KL_OP_MIN && (isnan(v) || v < m[o]) && !isnan(m[o]))
					m[o] = v;
				bool better = !isnan(m[o]) && (isnan(v) || v > m[o]);
				if (op == KL_OP_ARGMAX && (cnt[o] == 0 || better)) {
					m[o] = v;
					arg[o] = cnt[o];
				}
			} else {
				double dv = v - s[o] / (double)nred;
				s2[o] += dv * dv;
			}
			cnt[o]++;
		}
		free(cnt);
	}
	for (int64_t o = 0; o < ko; o++) {
		switch (op) {
		case KL_OP_SUM: ref[o] = is_int(x->dtype) ? (double)(int64_t)u[o] : s[o]; break;
		case KL_OP_MEAN: ref[o] = s[o] / (double)nred; break;
		case KL_OP_VAR: {
			double div = (double)nred - corr;
			ref[o] = s2[o] / (div > 0 ? div : 0);
			break;
		}
		case KL_OP_ARGMAX: ref[o] = (double)arg[o]; break;
		default: ref[o] = m[o]; break;
		}
	}
	free(s);
	free(s2);
	free(m);
	free(arg);
	free(u);
}

static kl_tensor *reduce(kl_tensor *x, kl_op op, kl_dtype odt, uint32_t mask, int corr,
                         bool keep)
{
	int64_t shape[KL_MAX_DIMS];
	int nd = 0;
	for (int d = 0; d < x->ndim; d++) {
		if (!(mask >> d & 1))
			shape[nd++] = x->shape[d];
		else if (keep)
			shape[nd++] = 1;
	}
	kl_node n = mknode(op, odt, nd, shape, 1);
	n.a.axes = mask;
	n.a.keepdim = keep;
	n.a.correction = corr;
	if (op == KL_OP_ARGMAX) {
		n.a.axes = 0;
		n.a.axis = __builtin_ctz(mask);
	}
	return run(&n, (kl_tensor *[]){x});
}

static int check_reduce(const char *what, kl_tensor *x, kl_op op, kl_dtype odt, uint32_t mask,
                        int corr, bool keep, double tol)
{
	kl_tensor *o = reduce(x, op, odt, mask, corr, keep);
	int64_t ko = 1;
	for (int d = 0; d < x->ndim; d++)
		if (!(mask >> d & 1))
			ko *= x->shape[d];
	double *ref = alloc_ref(ko);
	int64_t nout;
	ref_reduce(x, op, mask, corr, ref, &nout);
	for (int64_t i = 0; i < nout; i++)
		ref[i] = kl__round_to(odt, ref[i]);
	char w[96];
	snprintf(w, sizeof w, "%s %s mask 0x%x", what, kl__ops[op].name, (unsigned)mask);
	int bad = check_tol(w, o, ref, tol, 1);
	free(ref);
	return bad;
}

/* every axes mask of a permuted 3-d input, every op, float and int dtypes */
static void test_reduce_axes(void **state)
{
	static const kl_op ops[] = {KL_OP_SUM, KL_OP_MEAN, KL_OP_MAX, KL_OP_MIN, KL_OP_VAR};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_I32, KL_BOOL};
	int bad = 0;
	for (size_t di = 0; di < 5; di++) {
		kl_dtype dt = dts[di];
		/* stored [5, 4, 6]; seen as [6, 5, 4] through a permutation */
		kl_tensor *s = mk(dt, 3, SH(5, 4, 6));
		fill(s, dt == KL_BOOL ? 0 : -9, dt == KL_BOOL ? 2 : 9);
		kl_tensor *x = view(s, 3, SH(6, 5, 4), SH(1, 24, 6), 0);
		for (uint32_t mask = 1; mask < 8; mask++) {
			for (size_t oi = 0; oi < 5; oi++) {
				kl_op op = ops[oi];
				if (dt == KL_BOOL && op != KL_OP_SUM && op != KL_OP_MAX)
					continue;
				kl_dtype odt = dt;
				if (op == KL_OP_SUM && is_int(dt))
					odt = KL_I64;
				if ((op == KL_OP_MEAN || op == KL_OP_VAR) && is_int(dt))
					odt = KL_F32;
				double tol = is_int(odt) ? 0 : odt == KL_F16 ? 1e-3 : 1e-6;
				bool keep = mask & 1;
				int ncorr = op == KL_OP_VAR ? 2 : 1;
				for (int c = 0; c < ncorr; c++)
					bad += check_reduce("axes", x, op, odt, mask, c, keep, tol);
			}
			/* argmax along each single axis */
			if (__builtin_popcount(mask) == 1 && dt != KL_BOOL)
				bad += check_reduce("axes", x, KL_OP_ARGMAX, KL_I64, mask, 0, false,
				                    0);
		}
	}
	assert_int_equal(bad, 0);
}

/* shapes that take the column, row and split-row paths in parallel */
static void test_reduce_big(void **state)
{
	int bad = 0;
	kl_tensor *x = mk(KL_F32, 2, SH(1000, 300));
	fill(x, -1, 1);
	float *xv = x->st->data;
	xv[7 * 300 + 5] = NAN;       /* column 5, row 7 */
	xv[3 * 300 + 9] = 50;        /* a tie for column 9 ... */
	xv[800 * 300 + 9] = 50;      /* ... the first wins */
	for (uint32_t mask = 1; mask < 4; mask++) {
		bad += check_reduce("big", x, KL_OP_SUM, KL_F32, mask, 0, false, 1e-6);
		bad += check_reduce("big", x, KL_OP_MAX, KL_F32, mask, 0, true, 0);
		bad += check_reduce("big", x, KL_OP_VAR, KL_F32, mask, 1, false, 1e-5);
	}
	bad += check_reduce("big", x, KL_OP_ARGMAX, KL_I64, 1, 0, false, 0);
	bad += check_reduce("big", x, KL_OP_ARGMAX, KL_I64, 2, 0, true, 0);
	/* a transposed view: the reduced axis is strided, a kept one is not */
	kl_tensor *t = view(x, 2, SH(300, 1000), SH(1, 300), 0);
	bad += check_reduce("big^T", t, KL_OP_MIN, KL_F32, 2, 0, false, 0);
	bad += check_reduce("big^T", t, KL_OP_MEAN, KL_F64, 2, 0, false, 1e-9);
	bad += check_reduce("big^T", t, KL_OP_ARGMAX, KL_I64, 2, 0, false, 0);
	/* more kept lanes than one column task holds */
	kl_tensor *wide = mk(KL_F32, 2, SH(5, 4500));
	fill(wide, -1, 1);
	((float *)wide->st->data)[2 * 4500 + 4200] = NAN;
	bad += check_reduce("wide", wide, KL_OP_SUM, KL_F32, 1, 0, false, 1e-6);
	bad += check_reduce("wide", wide, KL_OP_MIN, KL_F32, 1, 0, false, 0);
	bad += check_reduce("wide", wide, KL_OP_ARGMAX, KL_I64, 1, 0, false, 0);
	bad += check_reduce("wide", wide, KL_OP_VAR, KL_F32, 1, 0, true, 1e-5);
	/* one long row split over threads; an i64 sum that wraps */
	kl_tensor *l = mk(KL_I64, 1, SH(100000));
	fill(l, -1e6, 1e6);
	((int64_t *)l->st->data)[5] = INT64_MAX;
	((int64_t *)l->st->data)[6] = INT64_MAX;
	bad += check_reduce("long", l, KL_OP_SUM, KL_I64, 1, 0, false, 0);
	bad += check_reduce("long", l, KL_OP_MAX, KL_I64, 1, 0, false, 0);
	bad += check_reduce("long", l, KL_OP_ARGMAX, KL_I64, 1, 0, false, 0);
	kl_tensor *h = mk(KL_BF16, 1, SH(70000));
	fill(h, 0, 4);
	bad += check_reduce("long", h, KL_OP_MEAN, KL_BF16, 1, 0, false, 4e-3);
	bad += check_reduce("long", h, KL_OP_VAR, KL_F32, 1, 1, false, 1e-5);
	assert_int_equal(bad, 0);
}

static void test_reduce_edges(void **state)
{
	int bad = 0;
	/* var: n - correction == 0 gives inf (or NaN for 0/0), below 0 as well */
	kl_tensor *x = mk(KL_F64, 2, SH(2, 3));
	set_all(x, (double[]){1, 2, 4, 5, 5, 5}, 6);
	bad += check("var c=3", reduce(x, KL_OP_VAR, KL_F64, 2, 3, false),
	             (double[]){INFINITY, NAN});
	bad += check("var c=5", reduce(x, KL_OP_VAR, KL_F64, 2, 5, false),
	             (double[]){INFINITY, NAN});
	bad += check_tol("var c=1", reduce(x, KL_OP_VAR, KL_F64, 2, 1, false),
	                 (double[]){7.0 / 3.0, 0}, 1e-15, 1);
	/* a size-1 reduced axis: var with correction 1 is 0/0 */
	kl_tensor *one = mk(KL_F32, 2, SH(1, 3));
	set_all(one, (double[]){1, 2, 3}, 3);
	bad += check("var n=1", reduce(one, KL_OP_VAR, KL_F32, 1, 1, false),
	             (double[]){NAN, NAN, NAN});
	/* empty reduced axis: sum 0, mean and var NaN; max has no identity */
	kl_tensor *e = mk(KL_F32, 2, SH(3, 0));
	bad += check("sum empty", reduce(e, KL_OP_SUM, KL_F32, 2, 0, false), (double[]){0, 0, 0});
	bad += check("mean empty", reduce(e, KL_OP_MEAN, KL_F32, 2, 0, false),
	             (double[]){NAN, NAN, NAN});
	bad += check("var empty", reduce(e, KL_OP_VAR, KL_F32, 2, 1, false),
	             (double[]){NAN, NAN, NAN});
	kl_node n = mknode(KL_OP_MAX, KL_F32, 1, SH(3), 1);
	n.a.axes = 2;
	kl_status st;
	exec_st(&n, (kl_tensor *[]){e}, &st);
	bad += st != KL_EINVAL || !strstr(kl_last_error(ctx), "max");
	/* empty kept axis: nothing to do */
	kl_tensor *ek = mk(KL_F32, 2, SH(0, 4));
	n = mknode(KL_OP_SUM, KL_F32, 1, SH(0), 1);
	n.a.axes = 2;
	exec_st(&n, (kl_tensor *[]){ek}, &st);
	bad += st != KL_OK;
	/* argmax: ties go to the first, the first NaN beats everything */
	kl_tensor *a = mk(KL_F16, 2, SH(3, 5));
	set_all(a, (double[]){1, 3, 3, 2, 3, 1, NAN, 9, NAN, 2, -INFINITY, -INFINITY, -INFINITY,
	                      -INFINITY, -INFINITY},
	        15);
	bad += check("argmax", reduce(a, KL_OP_ARGMAX, KL_I64, 2, 0, false), (double[]){1, 1, 0});
	/* sum of bools counts; mask 0 means every dim */
	kl_tensor *b = mk(KL_BOOL, 1, SH(5));
	set_all(b, (double[]){1, 0, 1, 1, 0}, 5);
	n = mknode(KL_OP_SUM, KL_I64, 0, NULL, 1);
	bad += check("sum bool", run(&n, (kl_tensor *[]){b}), (double[]){3});
	assert_int_equal(bad, 0);
}

/* ---- movement ---------------------------------------------------------------- */

static void test_contiguous_concat(void **state)
{
	int bad = 0;
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_I32, KL_BOOL};
	for (size_t di = 0; di < 5; di++) {
		kl_dtype dt = dts[di];
		for (int big = 0; big < 2; big++) {
			int64_t R = big ? 300 : 7, C = big ? 260 : 5;
			/* a transposed view with a step-2 slice and an offset */
			kl_tensor *s = mk(dt, 2, SH(2 * C + 1, R));
			fill(s, -50, 50);
			kl_tensor *v = view(s, 2, SH(R, C), SH(1, 2 * R), R);
			kl_node n = mknode(KL_OP_CONTIGUOUS, dt, 2, SH(R, C), 1);
			kl_tensor *o = run(&n, (kl_tensor *[]){v});
			double *ref = alloc_ref(R * C);
			for (int64_t i = 0; i < R * C; i++)
				ref[i] = at(v, i);
			bad += check("contiguous", o, ref);
			free(ref);

			/* concat along axis 1: the view, a dense block, a broadcast */
			kl_tensor *d = mk(dt, 2, SH(R, 3));
			fill(d, -50, 50);
			kl_tensor *r1 = mk(dt, 1, SH(2));
			fill(r1, -50, 50);
			kl_tensor *bc = view(r1, 2, SH(R, 2), SH(0, 1), 0);
			n = mknode(KL_OP_CONCAT, dt, 2, SH(R, C + 5), 3);
			n.a.axis = 1;
			o = run(&n, (kl_tensor *[]){v, d, bc});
			ref = alloc_ref(R * (C + 5));
			for (int64_t i = 0; i < R; i++) {
				double *r = ref + i * (C + 5);
				for (int64_t j = 0; j < C; j++)
					r[j] = at(v, i * C + j);
				for (int64_t j = 0; j < 3; j++)
					r[C + j] = at(d, i * 3 + j);
				for (int64_t j = 0; j < 2; j++)
					r[C + 3 + j] = at(bc, i * 2 + j);
			}
			bad += check("concat axis 1", o, ref);
			free(ref);
			/* concat along axis 0 */
			n = mknode(KL_OP_CONCAT, dt, 2, SH(2 * R, C), 2);
			n.a.axis = 0;
			o = run(&n, (kl_tensor *[]){v, v});
			ref = alloc_ref(2 * R * C);
			for (int64_t i = 0; i < 2 * R * C; i++)
				ref[i] = at(v, i % (R * C));
			bad += check("concat axis 0", o, ref);
			free(ref);
		}
	}
	/* inputs of another dtype than the result are converted */
	kl_tensor *h = mk(KL_F16, 2, SH(2, 2));
	kl_tensor *l = mk(KL_I64, 2, SH(2, 1));
	set_all(h, (double[]){0.5, -1, 2, 65504}, 4);
	set_all(l, (double[]){7, -9}, 2);
	kl_node nc = mknode(KL_OP_CONCAT, KL_F32, 2, SH(2, 3), 2);
	nc.a.axis = 1;
	bad += check("concat f16 i64", run(&nc, (kl_tensor *[]){h, l}),
	             (double[]){0.5, -1, 7, 2, 65504, -9});
	/* a bad concat is an error naming the op */
	kl_tensor *a = mk(KL_F32, 2, SH(2, 3));
	kl_node n = mknode(KL_OP_CONCAT, KL_F32, 2, SH(2, 7), 2);
	n.a.axis = 1;
	kl_status st;
	exec_st(&n, (kl_tensor *[]){a, a}, &st);
	bad += st != KL_EINVAL || !strstr(kl_last_error(ctx), "kl_concat");
	assert_int_equal(bad, 0);
}

/* ---- matmul ------------------------------------------------------------------- */

/* element (bi, i, j) of a @ b in double: the sum, the sum of |terms| (the
 * scale of its rounding error) and the wrapping integer sum */
static void matmul_elem(kl_tensor *a, kl_tensor *b, int64_t bi, int64_t i, int64_t j, double *s,
                        double *sabs, uint64_t *u)
{
	int nd = a->ndim;
	int64_t M = a->shape[nd - 2], K = a->shape[nd - 1], N = b->shape[nd - 1];
	*s = *sabs = 0;
	*u = 0;
	for (int64_t k = 0; k < K; k++) {
		int64_t ia = (bi * M + i) * K + k, ib = (bi * K + k) * N + j;
		double x = at(a, ia), y = at(b, ib);
		*s += x * y;
		*sabs += fabs(x * y);
		if (is_int(a->dtype))
			*u += (uint64_t)ati(a, ia) * (uint64_t)ati(b, ib);
	}
}

static int check_matmul(const char *what, kl_tensor *a, kl_tensor *b, kl_dtype odt, double tol)
{
	int nd = a->ndim;
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, a->shape, sizeof shape);
	shape[nd - 1] = b->shape[nd - 1];
	int64_t M = a->shape[nd - 2], N = b->shape[nd - 1];
	kl_node n = mknode(KL_OP_MATMUL, odt, nd, shape, 2);
	kl_tensor *o = run(&n, (kl_tensor *[]){a, b});
	int64_t batch = kl__numel(nd - 2, shape);
	int bad = 0;
	for (int64_t idx = 0; idx < batch * M * N; idx++) {
		int64_t bi = idx / (M * N), i = idx / N % M, j = idx % N;
		double s, sabs;
		uint64_t u;
		matmul_elem(a, b, bi, i, j, &s, &sabs, &u);
		double want = is_int(odt) ? wrap_to(odt, u) : kl__round_to(odt, s);
		double got = at(o, idx);
		bool ok = tol == 0 ? got == want : fabs(got - want) <= tol * (sabs + 1e-3);
		if (!ok && bad++ < 4)
			fprintf(stderr, "%s: [%lld,%lld,%lld] got %.10g want %.10g\n", what,
			        (long long)bi, (long long)i, (long long)j, got, want);
	}
	return bad;
}

static void test_matmul(void **state)
{
	int bad = 0;
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16, KL_I32, KL_I64};
	static const double tols[] = {1e-6, 1e-14, 2e-3, 1e-2, 0, 0};
	for (size_t di = 0; di < 6; di++) {
		kl_dtype dt = dts[di];
		double lo = is_int(dt) ? -9 : -1, hi = is_int(dt) ? 10 : 1;
		/* A [3,17,13] read as a transpose of [3,13,17]; B [13,11] shared by
		 * every batch (batch stride 0) */
		kl_tensor *as = mk(dt, 3, SH(3, 13, 17));
		kl_tensor *bs = mk(dt, 2, SH(13, 11));
		fill(as, lo, hi);
		fill(bs, lo, hi);
		kl_tensor *a = view(as, 3, SH(3, 17, 13), SH(13 * 17, 1, 17), 0);
		kl_tensor *b = view(bs, 3, SH(3, 13, 11), SH(0, 11, 1), 0);
		bad += check_matmul("A^T B", a, b, dt, tols[di]);
		/* B transposed as well, and A strided both ways (a copy) */
		kl_tensor *bts = mk(dt, 2, SH(11, 13));
		fill(bts, lo, hi);
		kl_tensor *bt = view(bts, 3, SH(3, 13, 11), SH(0, 1, 13), 0);
		kl_tensor *big = mk(dt, 3, SH(3, 40, 30));
		fill(big, lo, hi);
		kl_tensor *ast = view(big, 3, SH(3, 17, 13), SH(1200, 60, 2), 3);
		bad += check_matmul("A~ B^T", ast, bt, dt, tols[di]);
		/* vectors: M = 1 and N = 1 with odd strides */
		kl_tensor *row = view(big, 2, SH(1, 13), SH(999, 2), 0);
		kl_tensor *col = view(big, 2, SH(13, 1), SH(30, 999), 1);
		bad += check_matmul("row col", row, col, dt, tols[di]);
		bad += check_matmul("col row", col, row, dt, tols[di]);
		/* many small matrices run batch-parallel */
		kl_tensor *pa = mk(dt, 3, SH(70, 16, 16));
		kl_tensor *pb = mk(dt, 3, SH(70, 16, 16));
		fill(pa, lo, hi);
		fill(pb, lo, hi);
		bad += check_matmul("batched", pa, pb, dt, tols[di]);
	}
	/* i32 accumulation wraps */
	kl_tensor *a = mk(KL_I32, 2, SH(1, 2));
	kl_tensor *b = mk(KL_I32, 2, SH(2, 1));
	set_all(a, (double[]){65536, 65536}, 2);
	set_all(b, (double[]){32768, 32768}, 2);
	bad += check_matmul("i32 wrap", a, b, KL_I32, 0);
	/* K == 0 gives zeros */
	kl_tensor *e1 = mk(KL_F32, 2, SH(3, 0));
	kl_tensor *e2 = mk(KL_F32, 2, SH(0, 4));
	kl_node n = mknode(KL_OP_MATMUL, KL_F32, 2, SH(3, 4), 2);
	kl_tensor *o = run(&n, (kl_tensor *[]){e1, e2});
	for (int i = 0; i < 12; i++)
		bad += ((float *)o->st->data)[i] != 0;
	/* mismatched inner dims: an error naming the op */
	kl_tensor *c = mk(KL_F32, 2, SH(5, 4));
	n = mknode(KL_OP_MATMUL, KL_F32, 2, SH(3, 4), 2);
	kl_status st;
	exec_st(&n, (kl_tensor *[]){mk(KL_F32, 2, SH(3, 2)), c}, &st);
	bad += st != KL_EINVAL || !strstr(kl_last_error(ctx), "kl_matmul");
	assert_int_equal(bad, 0);
}

/* ---- row ops --------------------------------------------------------------------- */

static void ref_softmax(const kl_tensor *x, int ax, bool lg, double *ref)
{
	int64_t L = x->shape[ax], inner = 1;
	for (int d = ax + 1; d < x->ndim; d++)
		inner *= x->shape[d];
	int64_t rows = numel(x) / L;
	for (int64_t r = 0; r < rows; r++) {
		/* row r starts at (o, 0, in) and steps by inner */
		int64_t base = r / inner * L * inner + r % inner;
		double m = -INFINITY, s = 0;
		for (int64_t j = 0; j < L; j++)
			m = fmax(m, at(x, base + j * inner));
		for (int64_t j = 0; j < L; j++)
			s += exp(at(x, base + j * inner) - m);
		for (int64_t j = 0; j < L; j++) {
			double v = at(x, base + j * inner);
			double y = lg ? v - m - log(s) : exp(v - m) / s;
			ref[base + j * inner] = kl__round_to(x->dtype, y);
		}
	}
}

static int softmax_case(kl_tensor *x, int ax, bool lg, double tol)
{
	kl_node n = mknode(lg ? KL_OP_LOG_SOFTMAX : KL_OP_SOFTMAX, x->dtype, 2, x->shape, 1);
	n.a.axis = ax;
	kl_tensor *o = run(&n, (kl_tensor *[]){x});
	double *ref = alloc_ref(numel(x));
	ref_softmax(x, ax, lg, ref);
	int bad = check_tol(lg ? "log_softmax" : "softmax", o, ref, tol, 1e-3);
	free(ref);
	return bad;
}

/* both axes of a transposed and a dense input: in place, gathered, scattered */
static void test_softmax(void **state)
{
	int bad = 0;
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	static const double tols[] = {2e-6, 1e-13, 2e-3, 1e-2};
	for (size_t di = 0; di < 4; di++) {
		kl_dtype dt = dts[di];
		for (int big = 0; big < 2; big++) {
			int64_t R = big ? 300 : 9, C = big ? 200 : 33;
			kl_tensor *s = mk(dt, 2, SH(C, R));
			fill(s, -8, 8);
			kl_tensor *xt = view(s, 2, SH(R, C), SH(1, R), 0);
			kl_tensor *xc = mk(dt, 2, SH(R, C));
			fill(xc, -8, 8);
			for (int k = 0; k < 8; k++)
				bad += softmax_case(k & 1 ? xc : xt, k >> 1 & 1, k >> 2, tols[di]);
		}
	}
	/* -inf entries get 0; a row of -inf and a NaN row are NaN */
	kl_tensor *x = mk(KL_F32, 2, SH(3, 3));
	set_all(x, (double[]){-INFINITY, 0, 0, -INFINITY, -INFINITY, -INFINITY, 1, NAN, 2}, 9);
	kl_node n = mknode(KL_OP_SOFTMAX, KL_F32, 2, SH(3, 3), 1);
	n.a.axis = 1;
	bad += check("softmax inf", run(&n, (kl_tensor *[]){x}),
	             (double[]){0, 0.5, 0.5, NAN, NAN, NAN, NAN, NAN, NAN});
	assert_int_equal(bad, 0);
}

/* layer_norm (rms: rms_norm) of x [R, D] with weight w / bias b as flags say */
static int norm_case(kl_tensor *x, kl_tensor *w, kl_tensor *b, int flags, bool rms, double tol)
{
	int64_t R = x->shape[0], D = x->shape[1];
	kl_tensor *in[3] = {x, NULL, NULL};
	int nin = 1;
	if (flags & KL_F_HAS_WEIGHT)
		in[nin++] = w;
	if (flags & KL_F_HAS_BIAS)
		in[nin++] = b;
	kl_node n = mknode(rms ? KL_OP_RMS_NORM : KL_OP_LAYER_NORM, x->dtype, 2, x->shape, nin);
	n.a.flags = (uint8_t)flags;
	n.a.s[0] = 1e-5;
	kl_tensor *o = run(&n, in);
	double *ref = alloc_ref(R * D);
	for (int64_t r = 0; r < R; r++) {
		double mean = 0, ss = 0;
		for (int64_t j = 0; j < D; j++)
			mean += at(x, r * D + j);
		mean = rms ? 0 : mean / (double)D;
		for (int64_t j = 0; j < D; j++) {
			double dv = at(x, r * D + j) - mean;
			ss += dv * dv;
		}
		double inv = 1 / sqrt(ss / (double)D + 1e-5);
		for (int64_t j = 0; j < D; j++) {
			double y = (at(x, r * D + j) - mean) * inv;
			if (flags & KL_F_HAS_WEIGHT)
				y *= at(w, j);
			if (flags & KL_F_HAS_BIAS)
				y += at(b, j);
			ref[r * D + j] = kl__round_to(x->dtype, y);
		}
	}
	int bad = check_tol(rms ? "rms_norm" : "layer_norm", o, ref, tol, 1);
	free(ref);
	return bad;
}

static void test_norms(void **state)
{
	int bad = 0;
	for (int big = 0; big < 2; big++) {
		int64_t R = big ? 400 : 5, D = big ? 256 : 37;
		for (int dk = 0; dk < 3; dk++) {
			kl_dtype dt = dk == 0 ? KL_F32 : dk == 1 ? KL_F64 : KL_F16;
			double tol = dt == KL_F64 ? 1e-12 : dt == KL_F32 ? 3e-6 : 2e-3;
			/* x is a column slice of a wider tensor; weight f64 stride 2,
			 * bias bf16 */
			kl_tensor *xs = mk(dt, 2, SH(R, D + 3));
			fill(xs, -3, 5);
			kl_tensor *x = view(xs, 2, SH(R, D), SH(D + 3, 1), 2);
			kl_tensor *ws = mk(KL_F64, 1, SH(2 * D));
			fill(ws, 0.5, 1.5);
			kl_tensor *w = view(ws, 1, SH(D), SH(2), 1);
			kl_tensor *b = mk(KL_BF16, 1, SH(D));
			fill(b, -1, 1);
			for (int flags = 0; flags < 4; flags++) {
				bad += norm_case(x, w, b, flags, false, tol);
				if (!(flags & KL_F_HAS_BIAS))
					bad += norm_case(x, w, b, flags, true, tol);
			}
		}
	}
	/* a weight of the wrong length is an error */
	kl_tensor *x = mk(KL_F32, 2, SH(2, 4));
	kl_node n = mknode(KL_OP_RMS_NORM, KL_F32, 2, SH(2, 4), 2);
	n.a.flags = KL_F_HAS_WEIGHT;
	kl_status st;
	exec_st(&n, (kl_tensor *[]){x, mk(KL_F32, 1, SH(3))}, &st);
	bad += st != KL_EINVAL || !strstr(kl_last_error(ctx), "rms_norm");
	assert_int_equal(bad, 0);
}

/* ---- sources, backend, errors ------------------------------------------------------ */

static void test_sources(void **state)
{
	int bad = 0;
	for (size_t di = 0; di < 6; di++) {
		kl_dtype dt = num_dts[di];
		for (int big = 0; big < 2; big++) {
			int64_t N = big ? 70000 : 37;
			kl_node n = mknode(KL_OP_FULL, dt, 2, SH(N / 7 + (N % 7 != 0), 7), 0);
			int64_t total = kl__numel(2, n.shape);
			double *ref = alloc_ref(total);
			n.a.s[0] = -2.7;
			for (int64_t i = 0; i < total; i++)
				ref[i] = kl__round_to(dt, -2.7);
			bad += check("full", run(&n, NULL), ref);
			n.op = KL_OP_ARANGE;
			n.a.s[0] = -3;
			n.a.s[1] = 0.5;
			for (int64_t i = 0; i < total; i++)
				ref[i] = kl__round_to(dt, -3 + (double)i * 0.5);
			bad += check("arange", run(&n, NULL), ref);
			n.op = KL_OP_RAND;
			n.a.seed = 1234 + di;
			for (int64_t i = 0; i < total; i++) {
				double u = kl__rand_uniform_as(dt, n.a.seed, (uint64_t)i);
				ref[i] = kl__round_to(dt, u);
			}
			kl_tensor *o = run(&n, NULL);
			bad += check("rand", o, ref);
			/* never 1.0, even in f16 where the top values round up */
			for (int64_t i = 0; kl_dtype_is_float(dt) && i < total; i++)
				bad += !(at(o, i) >= 0 && at(o, i) < 1);
			n.op = KL_OP_RANDN;
			for (int64_t i = 0; i < total; i++)
				ref[i] = kl__round_to(dt, kl__rand_normal(n.a.seed, (uint64_t)i));
			bad += check("randn", run(&n, NULL), ref);
			free(ref);
		}
	}
	kl_node n = mknode(KL_OP_FULL, KL_BOOL, 1, SH(3), 0);
	n.a.s[0] = NAN;
	bad += check("full bool nan", run(&n, NULL), (double[]){1, 1, 1});
	assert_int_equal(bad, 0);
}

static void test_backend(void **state)
{
	int bad = 0;
	/* 64-byte alignment, any size, and memcpy host copies */
	for (size_t sz = 0; sz < 300; sz += 37) {
		void *p = kl__cpu_backend.alloc(ctx, sz);
		assert_non_null(p);
		bad += ((uintptr_t)p % 64) != 0;
		char src[300];
		for (size_t i = 0; i < sz; i++)
			src[i] = (char)i;
		bad += kl__cpu_backend.from_host(ctx, p, src, sz) != KL_OK;
		char dst[300];
		bad += kl__cpu_backend.to_host(ctx, dst, p, sz) != KL_OK;
		bad += memcmp(dst, src, sz) != 0;
		kl__cpu_backend.free(ctx, p);
	}
	/* errors, not crashes: a view op, a wrong output, a float op on ints */
	kl_tensor *x = mk(KL_F32, 2, SH(2, 3));
	kl_node n = mknode(KL_OP_RESHAPE, KL_F32, 1, SH(6), 1);
	kl_status st;
	exec_st(&n, (kl_tensor *[]){x}, &st);
	bad += st == KL_OK || !strstr(kl_last_error(ctx), "reshape");
	n = mknode(KL_OP_ADD, KL_F32, 2, SH(2, 3), 2);
	kl_tensor *wrong = mk(KL_F32, 2, SH(3, 2));
	kl_clear_error(ctx);
	st = kl__cpu_backend.exec(ctx, &n, (kl_tensor *[]){x, x}, wrong);
	bad += st != KL_EINVAL || !strstr(kl_last_error(ctx), "add");
	n = mknode(KL_OP_ADD, KL_F32, 2, SH(2, 3), 2);
	exec_st(&n, (kl_tensor *[]){x, mk(KL_F32, 2, SH(2, 4))}, &st);
	bad += st != KL_EINVAL;
	kl_tensor *i = mk(KL_I32, 1, SH(3));
	n = mknode(KL_OP_EXP, KL_I32, 1, SH(3), 1);
	exec_st(&n, (kl_tensor *[]){i}, &st);
	bad += st != KL_EUNSUPPORTED || !strstr(kl_last_error(ctx), "exp");
	n = mknode(KL_OP_SOFTMAX, KL_I32, 1, SH(3), 1);
	exec_st(&n, (kl_tensor *[]){i}, &st);
	bad += st != KL_EUNSUPPORTED || !strstr(kl_last_error(ctx), "softmax");
	assert_int_equal(bad, 0);
}

/* ---- the vectorizable exp and tanh (cpu.h) ------------------------------------------ */

/* |got - want| in units of float's spacing at want (subnormal spacing below
 * the normals); -1 when got is not the float want rounds to at an extreme
 * (NaN, infinity, overflow) */
static double ulps(float got, double want)
{
	if (isnan(want))
		return isnan(got) ? 0 : -1;
	if (fabs(want) > 0x1.fffffe8p127) /* rounds to infinity */
		return isinf(got) && (got > 0) == (want > 0) ? 0 : -1;
	if (isnan(got) || isinf(got))
		return -1;
	double a = fabs(want);
	double spacing = a < 0x1p-126 ? 0x1p-149 : ldexp(1.0, ilogb(a) - 23);
	return fabs((double)got - want) / spacing;
}

static void fast_check(const char *what, float (*f)(float), double (*ref)(double), float x,
                       double max_ulps, double *worst)
{
	double u = ulps(f(x), ref((double)x));
	if (u < 0 || u > max_ulps)
		fail_msg("%s(%a) = %a, want %a (%g ulps)", what, (double)x, (double)f(x),
		         ref((double)x), u);
	if (u > *worst)
		*worst = u;
}

static float cpu_expf(float x)
{
	return kl__cpu_expf(x);
}

static float cpu_tanhf(float x)
{
	return kl__cpu_tanhf(x);
}

static float cpu_erfcf(float x)
{
	return kl__cpu_erfcf(x);
}

/* every 61st float bit pattern (both signs, subnormals, the largest), then
 * the special values: kl__cpu_expf within 2 ulps of e^x (down into the
 * subnormals, inf past overflow), kl__cpu_tanhf within 3 ulps of tanh,
 * kl__cpu_erfcf (exact GELU) within 8 ulps of erfc (its tail too) */
static void test_fast_math(void **state)
{
	(void)state;
	double we = 0, wt = 0, wc = 0;
	for (uint64_t u = 0; u <= 0xffffffffu; u += 61) {
		float x = kl__bits_f32((uint32_t)u);
		fast_check("kl__cpu_expf", cpu_expf, exp, x, 2, &we);
		fast_check("kl__cpu_tanhf", cpu_tanhf, tanh, x, 3, &wt);
		fast_check("kl__cpu_erfcf", cpu_erfcf, erfc, x, 8, &wc);
	}
	const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 0x1p-149f, -0x1p-149f,
	                         0x1p-127f, -0x1p-127f, 0x1p-126f, 0.55f, -0.55f, 0.5499999f,
	                         9.01f, -9.5f, 88.72f, 88.73f, -87.3f, -103.9f, -104.5f, 3e38f,
	                         -3e38f, 1e-30f};
	for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
		fast_check("kl__cpu_expf", cpu_expf, exp, special[i], 2, &we);
		fast_check("kl__cpu_tanhf", cpu_tanhf, tanh, special[i], 3, &wt);
		fast_check("kl__cpu_erfcf", cpu_erfcf, erfc, special[i], 8, &wc);
	}
	const float erfc_edges[] = {0.5f, -0.5f, 0.49999997f, -0.49999997f, 10.5f, 10.0f, 9.2f,
	                            -10.5f, 26.0f, -26.0f};
	for (size_t i = 0; i < sizeof erfc_edges / sizeof erfc_edges[0]; i++)
		fast_check("kl__cpu_erfcf", cpu_erfcf, erfc, erfc_edges[i], 8, &wc);
	/* signs and exact values where they are exact */
	assert_true(signbit(kl__cpu_tanhf(-0.0f)) && kl__cpu_tanhf(-0.0f) == 0.0f);
	assert_true(kl__cpu_tanhf(INFINITY) == 1.0f && kl__cpu_tanhf(-INFINITY) == -1.0f);
	assert_true(kl__cpu_expf(-INFINITY) == 0.0f && kl__cpu_expf(0.0f) == 1.0f);
	assert_true(isnan(kl__cpu_expf(NAN)) && isnan(kl__cpu_tanhf(NAN)));
	assert_true(isnan(kl__cpu_erfcf(NAN)) && kl__cpu_erfcf(INFINITY) == 0.0f &&
	            kl__cpu_erfcf(-INFINITY) == 2.0f && kl__cpu_erfcf(-0.0f) == 1.0f);
	print_message("kl__cpu_expf worst %.2f ulps, kl__cpu_tanhf worst %.2f ulps, kl__cpu_erfcf "
	              "worst %.2f ulps\n",
	              we, wt, wc);
}

/* ---- the thread pool (pool.c) --------------------------------------------------- */

typedef struct pool_probe {
	_Atomic int *hits;
	int nested_nt;
	_Atomic int nested_bad;
} pool_probe;

static void count_chunk(void *arg, int64_t lo, int64_t hi)
{
	pool_probe *p = arg;
	for (int64_t i = lo; i < hi; i++)
		atomic_fetch_add(&p->hits[i], 1);
	if (p->nested_nt > 1) {
		/* a region inside a chunk runs whole (inline, when the outer one
		 * holds the pool) */
		_Atomic int inner[5] = {0};
		pool_probe q = {.hits = inner};
		kl__par_for(p->nested_nt, 5, count_chunk, &q);
		for (int i = 0; i < 5; i++)
			if (atomic_load(&inner[i]) != 1)
				atomic_store(&p->nested_bad, 1);
	}
}

/* every index exactly once, for sizes around the chunk counts and thread
 * counts from 1 to more than the cores; regions back to back (the workers
 * catch them spinning) and after a pause (they sleep, and are woken) */
static void pool_check(int nt, int64_t n, int nested)
{
	_Atomic int *hits = calloc((size_t)n + 1, sizeof *hits);
	assert_non_null(hits);
	pool_probe p = {.hits = hits, .nested_nt = nested};
	kl__par_for(nt, n, count_chunk, &p);
	for (int64_t i = 0; i < n; i++)
		if (atomic_load(&hits[i]) != 1)
			fail_msg("kl__par_for(%d, %lld): index %lld ran %d times", nt, (long long)n,
			         (long long)i, atomic_load(&hits[i]));
	assert_int_equal(atomic_load(&p.nested_bad), 0);
	assert_false(kl__par_active());
	free(hits);
}

static void *pool_caller(void *arg)
{
	(void)arg;
	for (int r = 0; r < 200; r++)
		pool_check(3, 1 + r % 37, 0);
	return NULL;
}

static void test_pool(void **state)
{
	(void)state;
	const int64_t sizes[] = {0, 1, 2, 3, 7, 12, 13, 100, 4097};
	for (int nt = 1; nt <= 5; nt++)
		for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
			pool_check(nt, sizes[i], 0);
	for (int r = 0; r < 500; r++)
		pool_check(2 + r % 3, 1 + r % 50, r % 7 == 0 ? 3 : 0);
	/* a region of few chunks, then one of more, back to back: a worker
	 * still leaving the first must not claim a chunk of the second (it ran
	 * twice and the caller waited forever: kiln bench, decoder_token) */
	for (int r = 0; r < 4000; r++)
		pool_check(2, r % 2 ? 2 : 8 + r % 5, 0);
	struct timespec pause = {0, 2000000}; /* past the spin: workers sleep */
	for (int r = 0; r < 5; r++) {
		nanosleep(&pause, NULL);
		pool_check(3, 64, 0);
	}
	/* two callers at once: one region runs, the other inline, both whole */
	pthread_t t;
	assert_int_equal(pthread_create(&t, NULL, pool_caller, NULL), 0);
	pool_caller(NULL);
	pthread_join(t, NULL);
	/* the default thread count: the cores this process may use */
	assert_true(kl__cpu_cores() >= 1 && kl__cpu_cores() <= KL_MAX_THREADS);
	assert_int_equal(kl__cpu_threads(NULL), kl__cpu_cores());
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_binary_dtypes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_binary_scalar_nan, setup, teardown),
		cmocka_unit_test_setup_teardown(test_compare, setup, teardown),
		cmocka_unit_test_setup_teardown(test_unary, setup, teardown),
		cmocka_unit_test_setup_teardown(test_int_pow_wrap, setup, teardown),
		cmocka_unit_test_setup_teardown(test_cast, setup, teardown),
		cmocka_unit_test_setup_teardown(test_where_clamp, setup, teardown),
		cmocka_unit_test_setup_teardown(test_reduce_axes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_reduce_big, setup, teardown),
		cmocka_unit_test_setup_teardown(test_reduce_edges, setup, teardown),
		cmocka_unit_test_setup_teardown(test_contiguous_concat, setup, teardown),
		cmocka_unit_test_setup_teardown(test_matmul, setup, teardown),
		cmocka_unit_test_setup_teardown(test_softmax, setup, teardown),
		cmocka_unit_test_setup_teardown(test_norms, setup, teardown),
		cmocka_unit_test_setup_teardown(test_sources, setup, teardown),
		cmocka_unit_test_setup_teardown(test_backend, setup, teardown),
		cmocka_unit_test(test_pool),
		cmocka_unit_test(test_fast_math),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
