/* test_ops.c - every public op of kiln.h held to the float64 reference, table
 * by table: every dtype an op accepts, broadcasting, non-contiguous inputs,
 * edge sizes (0, 1, odd, one large), dtype/shape rules and error messages.
 *
 * Two oracles: kltest_check_op compares the eager result with the reference
 * run on the op's own traced graph (backend vs math); where the front end
 * interprets arguments (negative axes, python slices, -1 dims, 1-D matmul,
 * softmax axis, norms' weight and bias) the expected result is also computed
 * here on the host from the public semantics, independently of the graph.
 * Every op in every dtype over broadcast shapes, layouts, special and wide
 * values, eager and compiled, is test_optable's walk of the op table; the
 * tables here cover what that walk does not (scalars, mixed dtypes, large
 * parallel sizes, argument forms, messages).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/core.h"
#include "graph/graph.h"
#include "kltest.h"

static kl_ctx *ctx;
static uint64_t seed = 1;
static int fails; /* failed checks in the running test (each printed) */

#define DT(x) (1u << (x))
#define ALL_DT 0x7fu
#define FLOAT_DT (DT(KL_F32) | DT(KL_F64) | DT(KL_F16) | DT(KL_BF16))
#define NOBOOL_DT (ALL_DT & ~DT(KL_BOOL))
#define LARGE ((int64_t)1 << 17)

typedef struct shp {
	int n;
	int64_t d[4];
} shp;

static kl_tensor *mk(kl_dtype dt, shp s, kltest_range r, kltest_layout l)
{
	kl_tensor *t = kltest_rand(ctx, dt, s.n, s.d, r, l, seed++);
	assert_non_null(t);
	return t;
}

static kltest_layout lay(int i)
{
	return (kltest_layout)(i % 3);
}

/* Check an op against the reference, then drop its inputs. */
static void check(const char *what, kltest_apply_fn f, const void *p, int nin, kl_tensor **in,
                  double factor)
{
	if (!kltest_check_op(ctx, what, f, nin, in, p, factor))
		fails++;
	for (int i = 0; i < nin; i++)
		kl_release(in[i]);
}

static void expect_ok(bool ok)
{
	if (!ok)
		fails++;
}

/* out (released here) must be exactly dt/shape and hold want (per
 * kltest_compare with factor). */
static void expect_tensor(const char *what, kl_tensor *out, kl_dtype dt, int ndim,
                          const int64_t *shape, const double *want, double factor)
{
	char b1[128], b2[128];
	if (!out) {
		fprintf(stderr, "FAIL %s: NULL result: %s\n", what, kl_last_error(ctx));
		fails++;
		return;
	}
	if (kl_tensor_dtype(out) != dt || kl_ndim(out) != ndim ||
	    memcmp(kl_shape(out), shape, sizeof(int64_t) * (size_t)ndim) != 0) {
		fprintf(stderr, "FAIL %s: got %s %s, want %s %s\n", what,
		        kl_dtype_name(kl_tensor_dtype(out)),
		        kl__shape_str(b1, sizeof b1, kl_ndim(out), kl_shape(out)),
		        kl_dtype_name(dt), kl__shape_str(b2, sizeof b2, ndim, shape));
		fails++;
		kl_release(out);
		return;
	}
	double *got = kltest_read(out);
	if (!got || !kltest_compare(what, dt, ndim, shape, got, want, factor))
		fails++;
	free(got);
	kl_release(out);
}

static void expect_dtype(const char *what, kl_tensor *out, kl_dtype dt)
{
	if (!out || kl_tensor_dtype(out) != dt) {
		fprintf(stderr, "FAIL %s: dtype %s, want %s (%s)\n", what,
		        out ? kl_dtype_name(kl_tensor_dtype(out)) : "none", kl_dtype_name(dt),
		        out ? "" : kl_last_error(ctx));
		fails++;
	}
	kl_release(out);
}

#define EXPECT_ERROR(expr, ...) expect_ok(KLTEST_EXPECT_ERROR(ctx, expr, __VA_ARGS__))

/* KILN_TEST_DEVICE=cuda runs every table on CUDA device 0 (ctest's
 * test_ops_cuda); without a usable device that run is skipped (77). */
static int setup(void **state)
{
	(void)state;
	ctx = kltest_ctx_from_env("test_ops");
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(ctx);
	return 0;
}

static int live_tensors(void)
{
	int n = 0;
	for (kl_tensor *t = ctx->live; t; t = t->next)
		n++;
	return n;
}

static int live_at_start;

static int reset(void **state)
{
	(void)state;
	fails = 0;
	kl_clear_error(ctx);
	live_at_start = live_tensors();
	return 0;
}

/* The end of every test: no failed check, and every tensor the test and the
 * ops made is released again (an op that leaks a reference shows here). */
static void done(void)
{
	int live = live_tensors();
	if (live != live_at_start) {
		fprintf(stderr, "FAIL %d tensors leaked\n", live - live_at_start);
		fails++;
	}
	assert_int_equal(fails, 0);
}

/* ---- pointwise binary ------------------------------------------------------ */

typedef struct binop {
	const char *name;
	kl_tensor *(*f)(kl_tensor *, kl_tensor *);
	kl_tensor *(*fs)(kl_tensor *, double);
	kltest_range ra, rb;
	unsigned dts; /* dtypes accepted; the others must fail */
} binop;

static const binop binops[] = {
	{"kl_add", kl_add, kl_add_scalar, KLTEST_NORMAL, KLTEST_NORMAL, ALL_DT},
	{"kl_sub", kl_sub, kl_sub_scalar, KLTEST_NORMAL, KLTEST_NORMAL, NOBOOL_DT},
	{"kl_mul", kl_mul, kl_mul_scalar, KLTEST_NORMAL, KLTEST_NORMAL, ALL_DT},
	{"kl_div", kl_div, kl_div_scalar, KLTEST_NORMAL, KLTEST_NORMAL, ALL_DT},
	/* float exponents on positive bases; ints: big powers wrap around */
	{"kl_pow", kl_pow, kl_pow_scalar, KLTEST_POS, KLTEST_NORMAL, ALL_DT},
	/* negative bases, integral exponents of both signs, 0^negative */
	{"kl_pow", kl_pow, NULL, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_maximum", kl_maximum, kl_maximum_scalar, KLTEST_NORMAL, KLTEST_SMALLINT, ALL_DT},
	{"kl_minimum", kl_minimum, kl_minimum_scalar, KLTEST_SMALLINT, KLTEST_NORMAL, ALL_DT},
	{"kl_eq", kl_eq, kl_eq_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_ne", kl_ne, kl_ne_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_lt", kl_lt, kl_lt_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_le", kl_le, kl_le_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_gt", kl_gt, kl_gt_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
	{"kl_ge", kl_ge, kl_ge_scalar, KLTEST_SMALLINT, KLTEST_SMALLINT, ALL_DT},
};
#define NBIN (int)(sizeof binops / sizeof binops[0])

static kl_tensor *ap_bin(kl_tensor *const *in, const void *p)
{
	return ((const binop *)p)->f(in[0], in[1]);
}

typedef struct binscal {
	const binop *op;
	double s;
} binscal;

static kl_tensor *ap_binscal(kl_tensor *const *in, const void *p)
{
	const binscal *b = p;
	return b->op->fs(in[0], b->s);
}


/* Every binary op in every dtype over broadcast shapes, layouts, special and
 * wide values, eager and compiled: test_optable's walk. */

static void test_binary_scalar(void **state)
{
	(void)state;
	/* integral scalars keep int dtypes; non-integral ones make them f32 */
	static const double scalars[] = {2, -1.5, 0.5, 0, 3};
	static const shp shapes[] = {{2, {7, 13}}, {0, {0}}, {1, {0}}, {3, {2, 1, 3}}};
	char w[128];
	for (int o = 0; o < NBIN; o++) {
		const binop *op = &binops[o];
		if (!op->fs)
			continue;
		for (int dt = 0; dt < KL_NDTYPES; dt++) {
			if (!(op->dts & DT(dt)))
				continue;
			for (int s = 0; s < 5; s++) {
				binscal p = {op, scalars[s]};
				for (int i = 0; i < 4; i++) {
					kl_tensor *in[1] = {mk(dt, shapes[i], op->ra, lay(i + s))};
					snprintf(w, sizeof w, "%s_scalar %s s=%g shape#%d",
					         op->name, kl_dtype_name(dt), scalars[s], i);
					check(w, ap_binscal, &p, 1, in, 1);
				}
			}
			binscal p = {op, INFINITY};
			kl_tensor *in[1] = {mk(dt, (shp){1, {31}}, KLTEST_SPECIAL, KLTEST_STRIDED)};
			snprintf(w, sizeof w, "%s_scalar %s s=inf", op->name, kl_dtype_name(dt));
			check(w, ap_binscal, &p, 1, in, 1);
		}
	}
	done();
}

static void test_binary_mixed_and_large(void **state)
{
	(void)state;
	static const kl_dtype pairs[][2] = {{KL_I32, KL_F32},  {KL_F16, KL_F32},  {KL_BOOL, KL_I64},
	                                    {KL_BF16, KL_F16}, {KL_I32, KL_I64},  {KL_F64, KL_I32},
	                                    {KL_BOOL, KL_F16}, {KL_BF16, KL_I64}, {KL_F32, KL_F64},
	                                    {KL_BOOL, KL_I32}};
	char w[128];
	for (int o = 0; o < NBIN; o++) {
		const binop *op = &binops[o];
		for (int k = 0; k < 10; k++) {
			kl_dtype da = pairs[k][0], db = pairs[k][1];
			if (!(op->dts & DT(kl_promote_types(da, db))))
				continue;
			kl_tensor *in[2] = {mk(da, (shp){3, {3, 1, 5}}, op->ra, lay(k)),
			                    mk(db, (shp){2, {4, 5}}, op->rb, lay(k + 2))};
			snprintf(w, sizeof w, "%s %s,%s", op->name, kl_dtype_name(da),
			         kl_dtype_name(db));
			check(w, ap_bin, op, 2, in, 1);
		}
	}
	/* big enough for the parallel paths: flat, broadcast rows, scalar rhs */
	for (int o = 0; o < NBIN; o += 3) {
		const binop *op = &binops[o];
		kl_dtype dts[2] = {KL_F32, o % 2 ? KL_F16 : KL_I32};
		for (int k = 0; k < 2; k++) {
			kl_tensor *in[2] = {mk(dts[k], (shp){1, {LARGE}}, op->ra, KLTEST_CONTIG),
			                    mk(dts[k], (shp){1, {LARGE}}, op->rb, KLTEST_CONTIG)};
			snprintf(w, sizeof w, "%s %s large", op->name, kl_dtype_name(dts[k]));
			check(w, ap_bin, op, 2, in, 1);
		}
		kl_tensor *in[2] = {mk(KL_F32, (shp){2, {256, 512}}, op->ra, KLTEST_PERMUTED),
		                    mk(KL_F32, (shp){1, {512}}, op->rb, KLTEST_CONTIG)};
		snprintf(w, sizeof w, "%s f32 large broadcast", op->name);
		check(w, ap_bin, op, 2, in, 1);
	}
	done();
}

/* ---- pointwise unary, where, cast, clamp ------------------------------------- */

typedef struct unop {
	const char *name;
	kl_tensor *(*f)(kl_tensor *);
	kltest_range r;
	unsigned dts;
	bool special; /* also run on NaN/inf/huge inputs */
	double factor;
} unop;

/* gelu/silu at -inf are 0 in the limit but inf * 0 in their formulas:
 * that corner is left undefined, so they skip the special inputs */
static const unop unops[] = {
	{"kl_neg", kl_neg, KLTEST_NORMAL, NOBOOL_DT, true, 1},
	{"kl_abs", kl_abs, KLTEST_NORMAL, NOBOOL_DT, true, 1},
	{"kl_relu", kl_relu, KLTEST_NORMAL, NOBOOL_DT, true, 1},
	{"kl_exp", kl_exp, KLTEST_NORMAL, ALL_DT, true, 2},
	{"kl_log", kl_log, KLTEST_POS, ALL_DT, true, 2},
	{"kl_sqrt", kl_sqrt, KLTEST_POS, ALL_DT, true, 1},
	{"kl_rsqrt", kl_rsqrt, KLTEST_POS, ALL_DT, true, 2},
	{"kl_sin", kl_sin, KLTEST_NORMAL, ALL_DT, true, 2},
	{"kl_cos", kl_cos, KLTEST_NORMAL, ALL_DT, true, 2},
	{"kl_tanh", kl_tanh, KLTEST_NORMAL, ALL_DT, true, 2},
	{"kl_sigmoid", kl_sigmoid, KLTEST_NORMAL, ALL_DT, true, 2},
	{"kl_gelu", kl_gelu, KLTEST_NORMAL, ALL_DT, false, 2},
	{"kl_gelu_tanh", kl_gelu_tanh, KLTEST_NORMAL, ALL_DT, false, 2},
	{"kl_silu", kl_silu, KLTEST_NORMAL, ALL_DT, false, 2},
};

static kl_tensor *ap_un(kl_tensor *const *in, const void *p)
{
	return ((const unop *)p)->f(in[0]);
}

static void test_unary(void **state)
{
	(void)state;
	char w[128];
	/* every dtype over shapes, layouts, wide and special values: test_optable's
	 * walk; here the tails and the large (parallel) path */
	for (size_t o = 0; o < sizeof unops / sizeof unops[0]; o++) {
		const unop *op = &unops[o];
		/* the negative tail, where 1 + erf / 1 + tanh cancel: the result
		 * must keep its relative accuracy there too */
		static const double tail[] = {-3, -4, -5, -6, -7, -8, -9};
		for (int dt = KL_F32; dt <= KL_F64; dt++) {
			if (op->r != KLTEST_NORMAL || !(op->dts & DT(dt)))
				continue;
			kl_tensor *in[1] = {kltest_from_values(ctx, dt, 1, (int64_t[]){7}, tail,
			                                       KLTEST_CONTIG)};
			snprintf(w, sizeof w, "%s %s negative tail", op->name, kl_dtype_name(dt));
			check(w, ap_un, op, 1, in, op->factor);
		}
		kl_dtype ldt = o % 2 ? KL_F32 : KL_BF16;
		kl_tensor *in[1] = {mk(ldt, (shp){1, {LARGE}}, op->r, KLTEST_CONTIG)};
		snprintf(w, sizeof w, "%s %s large", op->name, kl_dtype_name(ldt));
		check(w, ap_un, op, 1, in, op->factor);
	}
	done();
}

static kl_tensor *ap_where(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_where(in[0], in[1], in[2]);
}

static void test_where(void **state)
{
	(void)state;
	static const struct {
		kl_dtype dc, da, db;
		shp sc, sa, sb;
		kltest_range rc;
	} cases[] = {
		{KL_BOOL, KL_F32, KL_F32, {3, {3, 1, 5}}, {2, {4, 5}}, {0, {0}}, KLTEST_NORMAL},
		/* a non-bool condition is compared with zero (NaN counts as true) */
		{KL_F32, KL_I32, KL_F16, {1, {7}}, {1, {7}}, {1, {7}}, KLTEST_SMALLINT},
		{KL_F16, KL_F64, KL_F64, {2, {7, 13}}, {2, {7, 13}}, {2, {1, 13}}, KLTEST_SPECIAL},
		{KL_BOOL, KL_BF16, KL_BF16, {2, {7, 13}}, {2, {7, 13}}, {2, {7, 1}}, KLTEST_NORMAL},
		{KL_I64, KL_BOOL, KL_BOOL, {1, {1}}, {2, {2, 3}}, {2, {2, 1}}, KLTEST_SMALLINT},
		{KL_I32, KL_I64, KL_I32, {2, {0, 3}}, {1, {3}}, {0, {0}}, KLTEST_SMALLINT},
		{KL_BOOL, KL_F32, KL_F32, {1, {LARGE}}, {1, {LARGE}}, {0, {0}}, KLTEST_NORMAL},
		{KL_BOOL, KL_BF16, KL_F16, {2, {256, 1}}, {2, {1, 512}}, {2, {256, 512}},
		 KLTEST_NORMAL},
	};
	char w[64];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		kl_tensor *in[3] = {mk(cases[i].dc, cases[i].sc, cases[i].rc, lay((int)i)),
		                    mk(cases[i].da, cases[i].sa, KLTEST_SPECIAL, lay((int)i + 1)),
		                    mk(cases[i].db, cases[i].sb, KLTEST_NORMAL, lay((int)i + 2))};
		snprintf(w, sizeof w, "kl_where case#%d", (int)i);
		check(w, ap_where, NULL, 3, in, 1);
	}
	done();
}

static kl_tensor *ap_cast(kl_tensor *const *in, const void *p)
{
	return kl_cast(in[0], *(const kl_dtype *)p);
}

static void test_cast(void **state)
{
	(void)state;
	static const kl_dtype dts[KL_NDTYPES] = {KL_F32, KL_F64, KL_F16, KL_BF16,
	                                         KL_I32, KL_I64, KL_BOOL};
	char w[64];
	/* specials exercise saturation (float -> int), NaN -> 0, overflow to inf,
	 * and x != 0 for bool */
	for (int a = 0; a < KL_NDTYPES; a++) {
		for (int b = 0; b < KL_NDTYPES; b++) {
			kltest_range r[3] = {KLTEST_SPECIAL, KLTEST_WIDE, KLTEST_NORMAL};
			shp s[3] = {{2, {7, 13}}, {1, {40}}, {0, {0}}};
			for (int k = 0; k < 3; k++) {
				kl_tensor *in[1] = {mk((kl_dtype)a, s[k], r[k], lay(a + b + k))};
				snprintf(w, sizeof w, "kl_cast %s->%s #%d", kl_dtype_name(a),
				         kl_dtype_name(b), k);
				check(w, ap_cast, &dts[b], 1, in, 1);
			}
		}
	}
	kl_tensor *in[1] = {mk(KL_F32, (shp){1, {LARGE}}, KLTEST_WIDE, KLTEST_CONTIG)};
	check("kl_cast f32->bf16 large", ap_cast, &dts[KL_BF16], 1, in, 1);
	in[0] = mk(KL_F16, (shp){2, {256, 512}}, KLTEST_SPECIAL, KLTEST_PERMUTED);
	check("kl_cast f16->i32 large", ap_cast, &dts[KL_I32], 1, in, 1);
	done();
}

static kl_tensor *ap_clamp(kl_tensor *const *in, const void *p)
{
	const double *b = p;
	return kl_clamp(in[0], b[0], b[1]);
}

static void test_clamp(void **state)
{
	(void)state;
	/* (lo > hi gives hi everywhere, as torch) */
	static const double bounds[][2] = {{-1, 1}, {-INFINITY, 0.5}, {0, INFINITY},
	                                   {1, -1}, {-2.5, 2.5},      {-INFINITY, INFINITY}};
	char w[96];
	for (int dt = 0; dt < KL_NDTYPES; dt++) {
		if (dt == KL_BOOL) {
			kl_tensor *a = mk(dt, (shp){1, {3}}, KLTEST_NORMAL, KLTEST_CONTIG);
			EXPECT_ERROR(kl_clamp(a, 0, 1), "kl_clamp", "bool");
			kl_release(a);
			continue;
		}
		for (int k = 0; k < 6; k++) {
			for (int r = 0; r < 2; r++) {
				kl_tensor *in[1] = {mk(dt, (shp){2, {7, 13}},
				                       r ? KLTEST_SPECIAL : KLTEST_NORMAL,
				                       lay(k + r))};
				snprintf(w, sizeof w, "kl_clamp %s [%g,%g] #%d", kl_dtype_name(dt),
				         bounds[k][0], bounds[k][1], r);
				check(w, ap_clamp, bounds[k], 1, in, 1);
			}
		}
	}
	kl_tensor *in[1] = {mk(KL_F32, (shp){1, {LARGE}}, KLTEST_NORMAL, KLTEST_CONTIG)};
	check("kl_clamp f32 large", ap_clamp, bounds[0], 1, in, 1);
	done();
}

/* ---- reductions -------------------------------------------------------------- */

enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_VAR, R_ARGMAX };
static const char *const rname[] = {"kl_sum", "kl_mean", "kl_max", "kl_min", "kl_var", "kl_argmax"};

typedef struct red {
	int kind;
	int naxes;
	int axes[4];
	bool keepdim;
	int corr;
} red;

static kl_tensor *ap_red(kl_tensor *const *in, const void *p)
{
	const red *r = p;
	switch (r->kind) {
	case R_SUM: return kl_sum(in[0], r->naxes, r->axes, r->keepdim);
	case R_MEAN: return kl_mean(in[0], r->naxes, r->axes, r->keepdim);
	case R_MAX: return kl_max(in[0], r->naxes, r->axes, r->keepdim);
	case R_MIN: return kl_min(in[0], r->naxes, r->axes, r->keepdim);
	case R_VAR: return kl_var(in[0], r->naxes, r->axes, r->corr, r->keepdim);
	default: return kl_argmax(in[0], r->axes[0], r->keepdim);
	}
}

/* The result shape of reducing s per r, from the documented semantics. */
static shp red_shape(shp s, const red *r)
{
	uint32_t mask = 0;
	for (int i = 0; i < r->naxes; i++)
		mask |= 1u << (r->axes[i] < 0 ? r->axes[i] + s.n : r->axes[i]);
	if (r->naxes == 0)
		mask = (1u << s.n) - 1;
	shp o = {0, {0}};
	for (int d = 0; d < s.n; d++) {
		if (!(mask >> d & 1))
			o.d[o.n++] = s.d[d];
		else if (r->keepdim)
			o.d[o.n++] = 1;
	}
	return o;
}

static kl_dtype red_dtype(int kind, kl_dtype dt)
{
	if (kind == R_ARGMAX || (kind == R_SUM && !kl_dtype_is_float(dt)))
		return KL_I64;
	return dt;
}

/* Runs one reduction case through the reference and checks the result's
 * shape and dtype against the semantics too. */
static void check_red(const red *r, kl_dtype dt, shp s, kltest_range rg, kltest_layout l,
                      double factor)
{
	char w[160], b[64];
	kl_tensor *in[1] = {mk(dt, s, rg, l)};
	shp os = red_shape(s, r);
	kl_tensor *out = ap_red(in, r);
	if (!out || kl_ndim(out) != os.n ||
	    memcmp(kl_shape(out), os.d, sizeof(int64_t) * (size_t)os.n) != 0 ||
	    kl_tensor_dtype(out) != red_dtype(r->kind, dt)) {
		fprintf(stderr, "FAIL %s %s axes#%d keepdim %d: result %s %s, want %s %s (%s)\n",
		        rname[r->kind], kl_dtype_name(dt), r->naxes, r->keepdim,
		        out ? kl_dtype_name(kl_tensor_dtype(out)) : "none",
		        out ? kl__shape_str(w, sizeof w, kl_ndim(out), kl_shape(out)) : "",
		        kl_dtype_name(red_dtype(r->kind, dt)),
		        kl__shape_str(b, sizeof b, os.n, os.d), kl_last_error(ctx));
		fails++;
	}
	kl_release(out);
	snprintf(w, sizeof w, "%s %s %s axes(%d:%d,%d,%d) keepdim %d corr %d", rname[r->kind],
	         kl_dtype_name(dt), kl__shape_str(b, sizeof b, s.n, s.d), r->naxes, r->axes[0],
	         r->axes[1], r->axes[2], r->keepdim, r->corr);
	check(w, ap_red, r, 1, in, factor);
}

static unsigned red_dts(int kind)
{
	return kind == R_MEAN || kind == R_VAR ? FLOAT_DT : ALL_DT;
}

static void test_reductions(void **state)
{
	(void)state;
	static const struct {
		int n;
		int axes[3];
	} axsets[] = {{0, {0}},    {1, {0}},    {1, {1}},       {1, {-1}},
	              {2, {0, 2}}, {2, {2, 0}}, {3, {0, 1, 2}}, {2, {-3, -2}}};
	static const int kinds[][2] = {{R_SUM, 0}, {R_MEAN, 0}, {R_MAX, 0}, {R_MIN, 0},
	                               {R_VAR, 0}, {R_VAR, 1},  {R_VAR, 2}};
	for (int k = 0; k < 7; k++) {
		int kind = kinds[k][0];
		for (int dt = 0; dt < KL_NDTYPES; dt++) {
			red r = {kind, 0, {0}, false, kinds[k][1]};
			if (!(red_dts(kind) & DT(dt))) {
				kl_tensor *a = mk(dt, (shp){1, {3}}, KLTEST_NORMAL, KLTEST_CONTIG);
				EXPECT_ERROR(ap_red(&a, &r), rname[kind], kl_dtype_name(dt));
				kl_release(a);
				continue;
			}
			kltest_range rg =
				kind == R_MAX || kind == R_MIN ? KLTEST_SPECIAL : KLTEST_NORMAL;
			for (int a = 0; a < 8; a++) {
				for (int kd = 0; kd < 2; kd++) {
					r.naxes = axsets[a].n;
					memcpy(r.axes, axsets[a].axes, sizeof axsets[a].axes);
					r.keepdim = kd;
					check_red(&r, dt, (shp){3, {2, 3, 4}}, rg, lay(a + kd), 1);
				}
			}
			/* odd sizes, non-contiguous; rows of one; 0-dim; empty */
			r.naxes = 1;
			r.keepdim = false;
			for (int ax = 0; ax < 2; ax++) {
				r.axes[0] = ax;
				check_red(&r, dt, (shp){2, {7, 13}}, rg, KLTEST_PERMUTED, 1);
				check_red(&r, dt, (shp){2, {1, 9}}, rg, KLTEST_STRIDED, 1);
			}
			r.naxes = 0;
			check_red(&r, dt, (shp){0, {0}}, rg, KLTEST_CONTIG, 1);
			r.naxes = 1;
			r.axes[0] = 1;
			check_red(&r, dt, (shp){2, {0, 3}}, rg, KLTEST_CONTIG, 1);
			if (kind != R_MAX && kind != R_MIN) {
				r.axes[0] = 0; /* sum 0; mean and var NaN */
				check_red(&r, dt, (shp){2, {0, 3}}, rg, KLTEST_CONTIG, 1);
			}
		}
		/* long rows and columns, for the parallel and blocked paths; positive
		 * values keep sums free of cancellation */
		kltest_range pos = kind == R_VAR ? KLTEST_NORMAL : KLTEST_POS;
		red r = {kind, 0, {0}, false, kinds[k][1]};
		check_red(&r, KL_F32, (shp){1, {LARGE}}, pos, KLTEST_CONTIG, 10);
		if (kind == R_SUM || kind == R_MAX)
			check_red(&r, KL_BF16, (shp){1, {LARGE}}, pos, KLTEST_CONTIG, 1);
		for (int ax = 0; ax < 2; ax++) {
			r.naxes = 1;
			r.axes[0] = ax;
			check_red(&r, KL_F32, (shp){2, {256, 512}}, pos, lay(ax), 4);
		}
		if (kind == R_SUM) {
			r.naxes = 0;
			check_red(&r, KL_I32, (shp){1, {LARGE}}, KLTEST_WIDE, KLTEST_CONTIG, 1);
		}
	}
	done();
}

static void test_argmax(void **state)
{
	(void)state;
	static const int axes[] = {0, 1, 2, -1, -3};
	for (int dt = 0; dt < KL_NDTYPES; dt++) {
		/* SPECIAL: the first NaN wins; SMALLINT: ties keep the first */
		for (int rg = 0; rg < 2; rg++) {
			kltest_range range = rg ? KLTEST_SMALLINT : KLTEST_SPECIAL;
			for (int a = 0; a < 5; a++)
				for (int kd = 0; kd < 2; kd++) {
					red r = {R_ARGMAX, 1, {axes[a]}, kd, 0};
					check_red(&r, dt, (shp){3, {2, 3, 4}}, range, lay(a + kd),
					          1);
				}
			red r = {R_ARGMAX, 1, {1}, false, 0};
			check_red(&r, dt, (shp){2, {7, 13}}, range, KLTEST_PERMUTED, 1);
			check_red(&r, dt, (shp){2, {0, 13}}, range, KLTEST_CONTIG, 1);
			r.axes[0] = 0;
			check_red(&r, dt, (shp){0, {0}}, range, KLTEST_CONTIG, 1);
		}
	}
	red r = {R_ARGMAX, 1, {0}, false, 0};
	check_red(&r, KL_F32, (shp){1, {LARGE}}, KLTEST_NORMAL, KLTEST_CONTIG, 1);
	r.axes[0] = 1;
	check_red(&r, KL_F16, (shp){2, {256, 512}}, KLTEST_NORMAL, KLTEST_PERMUTED, 1);
	done();
}

/* ---- movement: reference check plus a host model of the semantics ------------ */

/* want[o] = src[off + sum_d idx_d(o) * str[d]] over the output shape s */
static double *gather(const double *src, shp s, const int64_t *str, int64_t off)
{
	int64_t n = kl__numel(s.n, s.d);
	double *want = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	assert_non_null(want);
	int64_t idx[4] = {0};
	for (int64_t o = 0; o < n; o++) {
		int64_t at = off;
		for (int d = 0; d < s.n; d++)
			at += idx[d] * str[d];
		want[o] = src[at];
		for (int d = s.n - 1; d >= 0; d--) {
			if (++idx[d] < s.d[d])
				break;
			idx[d] = 0;
		}
	}
	return want;
}

static void dense_strides(shp s, int64_t *str)
{
	int64_t acc = 1;
	for (int d = s.n - 1; d >= 0; d--) {
		str[d] = acc;
		acc *= s.d[d];
	}
}

typedef struct mv {
	int kind;      /* 0 reshape, 1 permute, 2 transpose, 3 expand, 4 slice, 5 contiguous */
	shp shape;     /* reshape / expand target */
	int perm[4];   /* permute; transpose uses perm[0], perm[1] */
	int axis;      /* slice */
	int64_t sl[3]; /* slice start, stop, step */
} mv;

static kl_tensor *ap_mv(kl_tensor *const *in, const void *p)
{
	const mv *m = p;
	switch (m->kind) {
	case 0: return kl_reshape(in[0], m->shape.n, m->shape.d);
	case 1: return kl_permute(in[0], m->perm);
	case 2: return kl_transpose(in[0], m->perm[0], m->perm[1]);
	case 3: return kl_expand(in[0], m->shape.n, m->shape.d);
	case 4: return kl_slice(in[0], m->axis, m->sl[0], m->sl[1], m->sl[2]);
	default: return kl_contiguous(in[0]);
	}
}

/* The expected shape and source mapping of m applied to shape s, worked
 * out from the documented semantics (python slices, -1 dims, ...). */
static double *mv_model(const mv *m, shp s, const double *src, shp *os)
{
	int64_t st[4], str[4] = {0};
	dense_strides(s, st);
	int64_t off = 0;
	*os = s;
	switch (m->kind) {
	case 0: {
		int64_t known = 1;
		int infer = -1;
		*os = m->shape;
		for (int d = 0; d < os->n; d++) {
			if (os->d[d] == -1)
				infer = d;
			else
				known *= os->d[d];
		}
		if (infer >= 0)
			os->d[infer] = kl__numel(s.n, s.d) / known;
		dense_strides(*os, str);
		break;
	}
	case 1:
	case 2: {
		int perm[4] = {0, 1, 2, 3};
		if (m->kind == 1) {
			memcpy(perm, m->perm, sizeof perm);
		} else {
			int x = m->perm[0] < 0 ? m->perm[0] + s.n : m->perm[0];
			int y = m->perm[1] < 0 ? m->perm[1] + s.n : m->perm[1];
			perm[x] = y;
			perm[y] = x;
		}
		for (int d = 0; d < s.n; d++) {
			int p = perm[d] < 0 ? perm[d] + s.n : perm[d];
			os->d[d] = s.d[p];
			str[d] = st[p];
		}
		break;
	}
	case 3: {
		*os = m->shape;
		int lead = os->n - s.n;
		for (int d = 0; d < os->n; d++) {
			int k = d - lead;
			if (k >= 0 && os->d[d] == -1)
				os->d[d] = s.d[k];
			str[d] = k < 0 || s.d[k] == 1 ? 0 : st[k];
		}
		break;
	}
	case 4: {
		int ax = m->axis < 0 ? m->axis + s.n : m->axis;
		int64_t n = s.d[ax], a = m->sl[0], b = m->sl[1], step = m->sl[2];
		a = a < 0 ? (a + n < 0 ? 0 : a + n) : (a > n ? n : a);
		b = b < 0 ? (b + n < 0 ? 0 : b + n) : (b > n ? n : b);
		memcpy(str, st, sizeof str);
		os->d[ax] = b > a ? (b - a + step - 1) / step : 0;
		str[ax] = st[ax] * step;
		off = a * st[ax];
		break;
	}
	default: memcpy(str, st, sizeof str); break;
	}
	return gather(src, *os, str, off);
}

static void test_movement(void **state)
{
	(void)state;
	static const struct {
		shp in;
		mv m;
	} cases[] = {
		{{3, {2, 3, 4}}, {.kind = 0, .shape = {2, {4, 6}}}},
		{{3, {2, 3, 4}}, {.kind = 0, .shape = {1, {-1}}}},
		{{3, {2, 3, 4}}, {.kind = 0, .shape = {3, {-1, 2, 3}}}},
		{{2, {4, 6}}, {.kind = 0, .shape = {3, {3, 1, 8}}}},
		{{0, {0}}, {.kind = 0, .shape = {2, {1, 1}}}},
		{{1, {1}}, {.kind = 0, .shape = {0, {0}}}},
		{{2, {0, 3}}, {.kind = 0, .shape = {2, {3, 0}}}},
		{{3, {2, 3, 4}}, {.kind = 1, .perm = {2, 0, 1}}},
		{{3, {2, 3, 4}}, {.kind = 1, .perm = {-1, 0, -2}}},
		{{2, {7, 13}}, {.kind = 1, .perm = {1, 0}}},
		{{3, {2, 3, 4}}, {.kind = 2, .perm = {0, 2}}},
		{{3, {2, 3, 4}}, {.kind = 2, .perm = {-1, -2}}},
		{{2, {7, 13}}, {.kind = 2, .perm = {1, 1}}},
		{{2, {3, 1}}, {.kind = 3, .shape = {3, {2, -1, 4}}}},
		{{1, {1}}, {.kind = 3, .shape = {1, {5}}}},
		{{0, {0}}, {.kind = 3, .shape = {2, {2, 2}}}},
		{{2, {1, 13}}, {.kind = 3, .shape = {2, {7, 13}}}},
		{{2, {3, 1}}, {.kind = 3, .shape = {3, {0, 3, 5}}}},
		{{2, {10, 7}}, {.kind = 4, .sl = {2, 8, 1}}},
		{{2, {10, 7}}, {.kind = 4, .sl = {0, 10, 3}}},
		{{2, {10, 7}}, {.kind = 4, .sl = {-3, 10, 1}}},
		{{2, {10, 7}}, {.kind = 4, .sl = {-100, 100, 2}}},
		{{2, {10, 7}}, {.kind = 4, .sl = {5, 2, 1}}},
		{{2, {10, 7}}, {.kind = 4, .axis = -1, .sl = {1, -1, 2}}},
		{{2, {10, 7}}, {.kind = 4, .axis = 1, .sl = {0, 1000, 4}}},
		{{2, {10, 7}}, {.kind = 4, .axis = -2, .sl = {-4, -1, 2}}},
		{{3, {2, 3, 4}}, {.kind = 5}},
		{{2, {7, 13}}, {.kind = 5}},
		{{0, {0}}, {.kind = 5}},
	};
	char w[96];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		for (int dt = 0; dt < KL_NDTYPES; dt++) {
			for (int l = 0; l < 3; l++) {
				kl_tensor *in[1] = {
					mk(dt, cases[i].in, KLTEST_SPECIAL, (kltest_layout)l)};
				double *src = kltest_read(in[0]);
				assert_non_null(src);
				shp os;
				double *want = mv_model(&cases[i].m, cases[i].in, src, &os);
				snprintf(w, sizeof w, "movement case#%d %s layout %d (host model)",
				         (int)i, kl_dtype_name(dt), l);
				expect_tensor(w, ap_mv(in, &cases[i].m), dt, os.n, os.d, want, 0);
				free(want);
				free(src);
				snprintf(w, sizeof w, "movement case#%d %s layout %d", (int)i,
				         kl_dtype_name(dt), l);
				check(w, ap_mv, &cases[i].m, 1, in, 0);
			}
		}
	}
	/* a view of a view, then a copy of it through a pointwise op */
	kl_tensor *in[1] = {mk(KL_F32, (shp){1, {LARGE}}, KLTEST_NORMAL, KLTEST_CONTIG)};
	mv big = {.kind = 4, .axis = 0, .sl = {3, LARGE - 5, 3}};
	check("kl_slice large", ap_mv, &big, 1, in, 0);
	in[0] = mk(KL_F16, (shp){2, {256, 512}}, KLTEST_NORMAL, KLTEST_PERMUTED);
	mv contig = {.kind = 5};
	check("kl_contiguous large", ap_mv, &contig, 1, in, 0);
	done();
}

typedef struct cat {
	int n;
	int axis;
} cat;

static kl_tensor *ap_concat(kl_tensor *const *in, const void *p)
{
	const cat *c = p;
	return kl_concat(c->n, in, c->axis);
}

static void test_concat(void **state)
{
	(void)state;
	static const struct {
		int n, axis;
		shp s[3];
		kl_dtype dt[3];
	} cases[] = {
		{2, 1, {{2, {2, 3}}, {2, {2, 5}}}, {KL_F32, KL_F32}},
		{3, 0, {{2, {2, 3}}, {2, {4, 3}}, {2, {1, 3}}}, {KL_I32, KL_I32, KL_I32}},
		{2, -1, {{3, {2, 3, 4}}, {3, {2, 3, 1}}}, {KL_BF16, KL_BF16}},
		{3, 0, {{2, {0, 3}}, {2, {2, 3}}, {2, {0, 3}}}, {KL_F16, KL_F16, KL_F16}},
		{1, 0, {{1, {7}}}, {KL_F64}},
		{2, -2, {{3, {2, 3, 4}}, {3, {2, 5, 4}}}, {KL_BOOL, KL_BOOL}},
		/* mixed dtypes are promoted */
		{3, 1, {{2, {3, 2}}, {2, {3, 1}}, {2, {3, 4}}}, {KL_I32, KL_F16, KL_BOOL}},
		{2, 0, {{1, {5}}, {1, {3}}}, {KL_I64, KL_F32}},
		{2, 0, {{2, {256, 512}}, {2, {256, 512}}}, {KL_F32, KL_F32}},
	};
	char w[64];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		for (int l = 0; l < 3; l++) {
			kl_tensor *in[3];
			double *src[3];
			kl_dtype odt = cases[i].dt[0];
			for (int k = 0; k < cases[i].n; k++) {
				in[k] = mk(cases[i].dt[k], cases[i].s[k], KLTEST_SPECIAL,
				           lay(l + k));
				src[k] = kltest_read(in[k]);
				assert_non_null(src[k]);
				odt = kl_promote_types(odt, cases[i].dt[k]);
			}
			/* host model: rows of each input side by side along the axis */
			shp os = cases[i].s[0];
			int ax = cases[i].axis < 0 ? cases[i].axis + os.n : cases[i].axis;
			os.d[ax] = 0;
			for (int k = 0; k < cases[i].n; k++)
				os.d[ax] += cases[i].s[k].d[ax];
			int64_t outer = kl__numel(ax, os.d),
				inner = kl__numel(os.n - ax - 1, os.d + ax + 1);
			double *want = malloc(sizeof(double) * (size_t)(kl__numel(os.n, os.d) + 1));
			assert_non_null(want);
			int64_t at = 0;
			for (int64_t o = 0; o < outer; o++)
				for (int k = 0; k < cases[i].n; k++) {
					int64_t row = cases[i].s[k].d[ax] * inner;
					for (int64_t j = 0; j < row; j++)
						want[at++] = kl__round_to(odt, src[k][o * row + j]);
				}
			cat c = {cases[i].n, cases[i].axis};
			snprintf(w, sizeof w, "kl_concat case#%d layout %d (host model)", (int)i,
			         l);
			expect_tensor(w, ap_concat(in, &c), odt, os.n, os.d, want, 0);
			for (int k = 0; k < cases[i].n; k++)
				free(src[k]);
			free(want);
			snprintf(w, sizeof w, "kl_concat case#%d layout %d", (int)i, l);
			check(w, ap_concat, &c, cases[i].n, in, 0);
		}
	}
	done();
}

/* ---- gather (embedding lookup) ---------------------------------------------- */

static kl_tensor *ap_gather(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_gather(in[0], in[1]);
}

static void test_gather(void **state)
{
	(void)state;
	static const struct {
		shp t, i;
	} cases[] = {
		{{2, {7, 3}}, {1, {4}}},    {{1, {5}}, {2, {2, 3}}},      {{3, {6, 2, 3}}, {0, {0}}},
		{{2, {9, 4}}, {1, {0}}},    {{2, {1, 5}}, {2, {3, 2}}},   {{2, {300, 64}}, {2, {4, 50}}},
		{{3, {4, 1, 2}}, {3, {2, 2, 2}}},
	};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16, KL_I32, KL_I64, KL_BOOL};
	uint64_t rs = 77;
	char w[96];
	for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
		for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++) {
			int l = (int)(c + t) % 3;
			kl_dtype idt = (c + t) % 2 ? KL_I64 : KL_I32;
			shp ts = cases[c].t, is = cases[c].i;
			kl_tensor *tab = mk(dts[t], ts, KLTEST_SPECIAL, lay(l));
			int64_t ni = kl__numel(is.n, is.d), rows = ts.d[0];
			double *iv = malloc(sizeof(double) * (size_t)(ni + 1));
			assert_non_null(iv);
			for (int64_t e = 0; e < ni; e++)
				iv[e] = (double)(int64_t)(kltest_uniform(&rs) * (double)rows);
			kl_tensor *idx = kltest_from_values(ctx, idt, is.n, is.d, iv, lay(l + 1));
			assert_non_null(idx);
			double *tv = kltest_read(tab);
			assert_non_null(tv);
			/* host model: row iv[e] of the table for each index */
			int64_t row = kl__numel(ts.n - 1, ts.d + 1);
			int on = is.n; /* idx dims, then the table's row dims */
			int64_t od[KL_MAX_DIMS];
			memcpy(od, is.d, sizeof(int64_t) * (size_t)is.n);
			for (int d = 1; d < ts.n; d++)
				od[on++] = ts.d[d];
			double *want = malloc(sizeof(double) * (size_t)(ni * row + 1));
			assert_non_null(want);
			for (int64_t e = 0; e < ni; e++)
				memcpy(want + e * row, tv + (int64_t)iv[e] * row,
				       sizeof(double) * (size_t)row);
			kl_tensor *in[2] = {tab, idx};
			snprintf(w, sizeof w, "kl_gather case#%d %s idx %s (host model)", (int)c,
			         kl_dtype_name(dts[t]), kl_dtype_name(idt));
			expect_tensor(w, ap_gather(in, NULL), dts[t], on, od, want, 0);
			snprintf(w, sizeof w, "kl_gather case#%d %s idx %s", (int)c,
			         kl_dtype_name(dts[t]), kl_dtype_name(idt));
			check(w, ap_gather, NULL, 2, in, 0);
			free(iv);
			free(tv);
			free(want);
		}
	/* embedding is gather with torch's argument order */
	kl_tensor *wt = mk(KL_F32, (shp){2, {10, 4}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *ix = kltest_from_values(ctx, KL_I64, 1, (int64_t[]){3},
	                                   (double[]){9, 0, 9}, KLTEST_CONTIG);
	double *wv = kltest_read(wt);
	assert_non_null(wv);
	double want[12];
	for (int e = 0; e < 3; e++)
		memcpy(want + e * 4, wv + (e == 1 ? 0 : 9) * 4, sizeof(double) * 4);
	expect_tensor("kl_embedding", kl_embedding(ix, wt), KL_F32, 2, (int64_t[]){3, 4}, want,
	              0);
	/* indices out of range are errors naming the value, never a crash */
	kl_tensor *bad = kltest_from_values(ctx, KL_I32, 1, (int64_t[]){2}, (double[]){3, 10},
	                                    KLTEST_CONTIG);
	kl_tensor *neg = kltest_from_values(ctx, KL_I64, 1, (int64_t[]){1}, (double[]){-1},
	                                    KLTEST_CONTIG);
	kl_tensor *fl = mk(KL_F32, (shp){1, {2}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *s0 = kl_scalar(ctx, KL_F32, 1.0);
	kl_tensor *e0 = mk(KL_F32, (shp){2, {0, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	/* on every device: CUDA reads eager indices back (kl__index_scan) */
	EXPECT_ERROR(kl_gather(wt, bad), "kl_gather", "index 10 (element 1)", "10 rows");
	EXPECT_ERROR(kl_embedding(neg, wt), "kl_embedding", "index -1");
	/* a strided view of indices: the element is counted in its own order */
	kl_tensor *bad2 = kltest_from_values(ctx, KL_I64, 2, (int64_t[]){2, 3},
	                                     (double[]){0, 1, 2, 9, 10, 9}, KLTEST_PERMUTED);
	EXPECT_ERROR(kl_gather(wt, bad2), "kl_gather", "index 10 (element 4)");
	kl_release(bad2);
	EXPECT_ERROR(kl_gather(wt, fl), "kl_gather", "f32", "i32 or i64");
	EXPECT_ERROR(kl_gather(s0, ix), "kl_gather", "[]");
	EXPECT_ERROR(kl_gather(e0, ix), "kl_gather", "[0,3]", "no rows");
	EXPECT_ERROR(kl_gather(NULL, ix), "kl_gather", "NULL");
	free(wv);
	kl_tensor *made[] = {wt, ix, bad, neg, fl, s0, e0};
	for (size_t i = 0; i < sizeof made / sizeof made[0]; i++)
		kl_release(made[i]);
	done();
}

/* ---- matmul and linear ------------------------------------------------------ */

/* torch.matmul on the host, in double: 1-D operands become [1,K] / [K,1],
 * batch dims broadcast, the added dims are dropped again. */
static double *host_matmul(const double *A, shp sa, const double *B, shp sb, shp *os)
{
	int64_t M = sa.n == 1 ? 1 : sa.d[sa.n - 2], K = sa.d[sa.n - 1];
	int64_t N = sb.n == 1 ? 1 : sb.d[sb.n - 1];
	int na = sa.n > 2 ? sa.n - 2 : 0, nb = sb.n > 2 ? sb.n - 2 : 0;
	int nbat = na > nb ? na : nb;
	int64_t bat[4], sta[4], stb[4];
	int64_t acc_a = M * K, acc_b = K * N;
	for (int d = nbat - 1; d >= 0; d--) {
		int ka = d - (nbat - na), kb = d - (nbat - nb);
		int64_t da = ka >= 0 ? sa.d[ka] : 1, db = kb >= 0 ? sb.d[kb] : 1;
		bat[d] = da > db ? da : db;
		sta[d] = da == 1 ? 0 : acc_a;
		stb[d] = db == 1 ? 0 : acc_b;
		acc_a *= da;
		acc_b *= db;
	}
	os->n = 0;
	for (int d = 0; d < nbat; d++)
		os->d[os->n++] = bat[d];
	if (sa.n > 1)
		os->d[os->n++] = M;
	if (sb.n > 1)
		os->d[os->n++] = N;
	int64_t nb_all = kl__numel(nbat, bat);
	double *C = malloc(sizeof(double) * (size_t)(nb_all * M * N + 1));
	assert_non_null(C);
	int64_t idx[4] = {0};
	for (int64_t b = 0; b < nb_all; b++) {
		int64_t oa = 0, ob = 0;
		for (int d = 0; d < nbat; d++) {
			oa += idx[d] * sta[d];
			ob += idx[d] * stb[d];
		}
		for (int64_t i = 0; i < M; i++)
			for (int64_t j = 0; j < N; j++) {
				double s = 0;
				for (int64_t k = 0; k < K; k++)
					s += A[oa + i * K + k] * B[ob + k * N + j];
				C[(b * M + i) * N + j] = s;
			}
		for (int d = nbat - 1; d >= 0; d--) {
			if (++idx[d] < bat[d])
				break;
			idx[d] = 0;
		}
	}
	return C;
}

static kl_tensor *ap_matmul(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_matmul(in[0], in[1]);
}

/* matmul of a transposed view: b is stored [N, K] and transposed */
static kl_tensor *ap_matmul_bt(kl_tensor *const *in, const void *p)
{
	(void)p;
	kl_tensor *bt = kl_transpose(in[1], -1, -2);
	return kl_matmul(in[0], bt);
}

static void round_all(kl_dtype dt, double *v, int64_t n)
{
	for (int64_t i = 0; i < n; i++)
		v[i] = kl__round_to(dt, v[i]);
}

static void test_matmul(void **state)
{
	(void)state;
	static const struct {
		shp a, b;
	} cases[] = {
		{{1, {5}}, {1, {5}}},
		{{1, {5}}, {2, {5, 3}}},
		{{2, {4, 5}}, {1, {5}}},
		{{2, {4, 5}}, {2, {5, 3}}},
		{{2, {1, 1}}, {2, {1, 1}}},
		{{2, {7, 13}}, {2, {13, 9}}},
		{{4, {2, 3, 4, 5}}, {4, {2, 3, 5, 6}}},
		{{4, {2, 1, 4, 5}}, {3, {3, 5, 6}}},
		{{2, {4, 5}}, {3, {2, 5, 6}}},
		{{3, {2, 4, 5}}, {1, {5}}},
		{{1, {5}}, {3, {2, 5, 6}}},
		{{2, {3, 0}}, {2, {0, 4}}},
		{{2, {0, 5}}, {2, {5, 4}}},
		{{2, {64, 96}}, {2, {96, 80}}},
	};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16, KL_I32, KL_I64};
	char w[96];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++) {
			kl_dtype dt = dts[t];
			kltest_range rg = kl_dtype_is_float(dt) ? KLTEST_NORMAL : KLTEST_SMALLINT;
			double factor = cases[i].a.d[cases[i].a.n - 1] > 50 ? 4 : 1;
			kl_tensor *in[2] = {mk(dt, cases[i].a, rg, lay((int)(i + t))),
			                    mk(dt, cases[i].b, rg, lay((int)(i + t + 1)))};
			double *va = kltest_read(in[0]), *vb = kltest_read(in[1]);
			assert_true(va && vb);
			shp os;
			double *want = host_matmul(va, cases[i].a, vb, cases[i].b, &os);
			round_all(dt, want, kl__numel(os.n, os.d));
			snprintf(w, sizeof w, "kl_matmul case#%d %s (host model)", (int)i,
			         kl_dtype_name(dt));
			expect_tensor(w, kl_matmul(in[0], in[1]), dt, os.n, os.d, want, factor);
			free(va);
			free(vb);
			free(want);
			snprintf(w, sizeof w, "kl_matmul case#%d %s", (int)i, kl_dtype_name(dt));
			check(w, ap_matmul, NULL, 2, in, factor);
		}
	}
	/* transposed operands: column-major B, and A stored transposed */
	for (int t = 0; t < 4; t++) {
		kl_dtype dt = dts[t];
		kl_tensor *in[2] = {mk(dt, (shp){3, {2, 7, 13}}, KLTEST_NORMAL, KLTEST_PERMUTED),
		                    mk(dt, (shp){3, {2, 9, 13}}, KLTEST_NORMAL, KLTEST_CONTIG)};
		snprintf(w, sizeof w, "kl_matmul %s transposed operands", kl_dtype_name(dt));
		check(w, ap_matmul_bt, NULL, 2, in, 1);
	}
	done();
}

/* Products big enough that blas.c splits them over kiln's threads (3, an
 * odd count, so the shares are uneven): C's rows (64 or more), its columns
 * (fewer rows than threads, or under 64), a matrix-vector product's outputs
 * (one row, in the compiled program), f32 and f64, each operand plain and
 * transposed; eager and compiled, against the float64 reference. */
static kl_status body_matmul2(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user)
{
	(void)c;
	(void)nin;
	(void)nout;
	out[0] = user ? ap_matmul_bt(in, NULL) : ap_matmul(in, NULL);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_matmul_threads(void **state)
{
	(void)state;
	kl_ctx *shared = ctx;
	ctx = kl_ctx_new(&(kl_ctx_opts){.nthreads = 3});
	assert_non_null(ctx);
	static const struct {
		int64_t m, k, n;
	} cases[] = {{67, 129, 45}, {3, 200, 300}, {20, 100, 200}, {1, 512, 600}, {130, 64, 70}};
	char w[96];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		for (int f = 0; f < 2; f++)
			for (int bt = 0; bt < 2; bt++) {
				kl_dtype dt = f ? KL_F64 : KL_F32;
				int64_t m = cases[i].m, k = cases[i].k, n = cases[i].n;
				/* A plain or stored transposed (PERMUTED), B as [k, n] or as
				 * [n, k] transposed by the op */
				kl_tensor *in[2] = {
				        mk(dt, (shp){2, {m, k}}, KLTEST_NORMAL,
				           bt ? KLTEST_PERMUTED : KLTEST_CONTIG),
				        mk(dt, bt ? (shp){2, {n, k}} : (shp){2, {k, n}}, KLTEST_NORMAL,
				           KLTEST_CONTIG)};
				kltest_apply_fn ap = bt ? ap_matmul_bt : ap_matmul;
				snprintf(w, sizeof w, "kl_matmul %lldx%lldx%lld %s%s, 3 threads, compiled",
				         (long long)m, (long long)k, (long long)n, kl_dtype_name(dt),
				         bt ? " transposed" : "");
				kl_fn *fn = kl_compile(ctx, body_matmul2, bt ? (void *)1 : NULL, 2, 1, NULL);
				kl_tensor *out = NULL;
				if (!fn || kl_fn_call(fn, in, &out) != KL_OK) {
					fprintf(stderr, "FAIL %s: %s\n", w, kl_last_error(ctx));
					fails++;
				} else {
					int nd;
					int64_t shape[KL_MAX_DIMS];
					kl_dtype rdt;
					double *ref = kltest_reference(ctx, w, ap, in, NULL, &nd, shape, &rdt);
					double *got = kltest_read(out);
					if (!ref || !got || !kltest_compare(w, rdt, nd, shape, got, ref, 4))
						fails++;
					free(ref);
					free(got);
				}
				kl_release(out);
				kl_fn_free(fn);
				snprintf(w, sizeof w, "kl_matmul %lldx%lldx%lld %s%s, 3 threads, eager",
				         (long long)m, (long long)k, (long long)n, kl_dtype_name(dt),
				         bt ? " transposed" : "");
				check(w, ap, NULL, 2, in, 4);
			}
	kl_ctx_free(ctx);
	ctx = shared;
	done();
}

static kl_tensor *ap_linear(kl_tensor *const *in, const void *p)
{
	return kl_linear(in[0], in[1], p ? in[2] : NULL);
}

static void test_linear(void **state)
{
	(void)state;
	static const struct {
		shp x;
		int64_t out;
		bool bias;
	} cases[] = {
		{{2, {3, 5}}, 4, true}, {{2, {3, 5}}, 4, false}, {{3, {2, 3, 5}}, 6, true},
		{{1, {5}}, 4, true},    {{2, {0, 5}}, 3, true},  {{2, {33, 64}}, 48, true},
	};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	char w[96];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		for (int t = 0; t < 4; t++) {
			kl_dtype dt = dts[t];
			int64_t K = cases[i].x.d[cases[i].x.n - 1], O = cases[i].out;
			kl_tensor *in[3] = {
				mk(dt, cases[i].x, KLTEST_NORMAL, lay((int)i + t)),
				mk(dt, (shp){2, {O, K}}, KLTEST_NORMAL, lay((int)i + t + 1)),
				mk(dt, (shp){1, {O}}, KLTEST_NORMAL, KLTEST_STRIDED)};
			double *x = kltest_read(in[0]), *wv = kltest_read(in[1]),
			       *b = kltest_read(in[2]);
			assert_true(x && wv && b);
			/* y = x @ w^T + b, straight from the definition */
			shp os = cases[i].x;
			os.d[os.n - 1] = O;
			int64_t rows = kl__numel(cases[i].x.n - 1, cases[i].x.d);
			double *want = malloc(sizeof(double) * (size_t)(rows * O + 1));
			assert_non_null(want);
			for (int64_t r = 0; r < rows; r++)
				for (int64_t o = 0; o < O; o++) {
					double s = 0;
					for (int64_t k = 0; k < K; k++)
						s += x[r * K + k] * wv[o * K + k];
					/* the product is rounded before the bias is added */
					s = kl__round_to(dt, s);
					want[r * O + o] =
						kl__round_to(dt, cases[i].bias ? s + b[o] : s);
				}
			snprintf(w, sizeof w, "kl_linear case#%d %s (host model)", (int)i,
			         kl_dtype_name(dt));
			expect_tensor(w, kl_linear(in[0], in[1], cases[i].bias ? in[2] : NULL), dt,
			              os.n, os.d, want, K > 50 ? 4 : 1);
			free(x);
			free(wv);
			free(b);
			free(want);
			snprintf(w, sizeof w, "kl_linear case#%d %s", (int)i, kl_dtype_name(dt));
			check(w, ap_linear, cases[i].bias ? "bias" : NULL, 3, in, K > 50 ? 4 : 1);
		}
	}
	done();
}

/* ---- softmax, log_softmax, layer_norm, rms_norm -------------------------------- */

typedef struct smx {
	bool log;
	int axis;
} smx;

static kl_tensor *ap_softmax(kl_tensor *const *in, const void *p)
{
	const smx *s = p;
	return s->log ? kl_log_softmax(in[0], s->axis) : kl_softmax(in[0], s->axis);
}

static void test_softmax(void **state)
{
	(void)state;
	static const struct {
		shp s;
		int axis;
	} cases[] = {
		{{2, {3, 7}}, 0},     {{2, {3, 7}}, 1},     {{2, {3, 7}}, -1}, {{3, {2, 3, 4}}, 1},
		{{3, {2, 3, 4}}, -3}, {{1, {1}}, 0},        {{2, {0, 5}}, 1},  {{2, {5, 1}}, 1},
		{{2, {4, 4096}}, -1}, {{2, {512, 256}}, 0},
	};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	char w[96];
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		for (int t = 0; t < 4; t++) {
			for (int lg = 0; lg < 2; lg++) {
				kl_dtype dt = dts[t];
				shp s = cases[i].s;
				/* (the long rows in f32 and f16 only, for time) */
				if (kl__numel(s.n, s.d) > 4096 && t % 2)
					continue;
				/* WIDE: magnitudes up to 2^13 need the max subtracted */
				kl_tensor *in[1] = {mk(dt, s, t % 2 ? KLTEST_WIDE : KLTEST_NORMAL,
				                       lay((int)i + t + lg))};
				double *x = kltest_read(in[0]);
				assert_non_null(x);
				int ax = cases[i].axis < 0 ? cases[i].axis + s.n : cases[i].axis;
				int64_t len = s.d[ax],
					inner = kl__numel(s.n - ax - 1, s.d + ax + 1);
				int64_t outer = kl__numel(ax, s.d), n = kl__numel(s.n, s.d);
				double *want = malloc(sizeof(double) * (size_t)(n + 1));
				assert_non_null(want);
				for (int64_t o = 0; o < outer; o++)
					for (int64_t j = 0; j < inner; j++) {
						const double *r = x + o * len * inner + j;
						double m = -INFINITY, sum = 0;
						for (int64_t k = 0; k < len; k++)
							m = r[k * inner] > m ? r[k * inner] : m;
						for (int64_t k = 0; k < len; k++)
							sum += exp(r[k * inner] - m);
						for (int64_t k = 0; k < len; k++) {
							double v = r[k * inner] - m;
							want[o * len * inner + j + k * inner] =
								kl__round_to(dt, lg ? v - log(sum)
							                            : exp(v) / sum);
						}
					}
				smx p = {lg, cases[i].axis};
				snprintf(w, sizeof w, "kl_%ssoftmax case#%d %s (host model)",
				         lg ? "log_" : "", (int)i, kl_dtype_name(dt));
				expect_tensor(w, ap_softmax(in, &p), dt, s.n, s.d, want, 4);
				free(x);
				free(want);
				snprintf(w, sizeof w, "kl_%ssoftmax case#%d %s", lg ? "log_" : "",
				         (int)i, kl_dtype_name(dt));
				check(w, ap_softmax, &p, 1, in, 4);
			}
		}
	}
	done();
}

typedef struct nrm {
	bool rms, w, b;
	double eps;
} nrm;

static kl_tensor *ap_norm(kl_tensor *const *in, const void *p)
{
	const nrm *n = p;
	if (n->rms)
		return kl_rms_norm(in[0], n->w ? in[1] : NULL, n->eps);
	return kl_layer_norm(in[0], n->w ? in[1] : NULL, n->b ? in[2] : NULL, n->eps);
}

static void test_norms(void **state)
{
	(void)state;
	static const shp shapes[] = {{2, {3, 7}}, {3, {2, 3, 64}}, {1, {5}},
	                             {2, {0, 4}}, {2, {4, 1}},     {2, {64, 1024}}};
	static const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	char w[128];
	for (int cfg = 0; cfg < 6; cfg++) {
		nrm p = {cfg >= 4, cfg & 1, (cfg >> 1) & 1, cfg % 3 ? 1e-5 : 0.1};
		if (p.rms)
			p.b = false;
		for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
			for (int t = 0; t < 4; t++) {
				kl_dtype dt = dts[t];
				shp s = shapes[i];
				int64_t D = s.d[s.n - 1], rows = kl__numel(s.n - 1, s.d);
				if (rows * D > 4096 && (t % 2 || cfg % 2))
					continue; /* long rows: some dtypes and configs, for time */
				/* weights of another float dtype are allowed */
				kl_dtype wdt = dts[(t + cfg) % 4];
				kl_tensor *in[3] = {
					mk(dt, s, KLTEST_NORMAL, lay((int)i + t)),
					mk(wdt, (shp){1, {D}}, KLTEST_NORMAL, KLTEST_STRIDED),
					mk(wdt, (shp){1, {D}}, KLTEST_NORMAL, KLTEST_CONTIG)};
				double *x = kltest_read(in[0]), *wv = kltest_read(in[1]);
				double *bv = kltest_read(in[2]);
				assert_true(x && wv && bv);
				double *want = malloc(sizeof(double) * (size_t)(rows * D + 1));
				assert_non_null(want);
				for (int64_t r = 0; r < rows; r++) {
					const double *xr = x + r * D;
					double mean = 0, ms = 0;
					for (int64_t j = 0; j < D && !p.rms; j++)
						mean += xr[j] / (double)D;
					for (int64_t j = 0; j < D; j++)
						ms += (xr[j] - mean) * (xr[j] - mean) / (double)D;
					for (int64_t j = 0; j < D; j++) {
						double y = (xr[j] - mean) / sqrt(ms + p.eps);
						y = p.w ? y * wv[j] : y;
						y = p.b ? y + bv[j] : y;
						want[r * D + j] = kl__round_to(dt, y);
					}
				}
				snprintf(w, sizeof w, "kl_%s w%d b%d %s x %s (host model)",
				         p.rms ? "rms_norm" : "layer_norm", p.w, p.b,
				         kl_dtype_name(dt), kl_dtype_name(wdt));
				expect_tensor(w, ap_norm(in, &p), dt, s.n, s.d, want, 4);
				free(x);
				free(wv);
				free(bv);
				free(want);
				snprintf(w, sizeof w, "kl_%s w%d b%d %s shape#%d",
				         p.rms ? "rms_norm" : "layer_norm", p.w, p.b,
				         kl_dtype_name(dt), (int)i);
				check(w, ap_norm, &p, 3, in, 4);
			}
		}
	}
	done();
}

/* ---- creation ------------------------------------------------------------------- */

typedef struct mkp {
	int kind; /* 0 zeros, 1 full, 2 arange, 3 rand, 4 randn, 5 scalar */
	kl_dtype dt;
	shp s;
	double v[3];
	uint64_t seed;
} mkp;

static kl_tensor *ap_make(kl_tensor *const *in, const void *p)
{
	(void)in;
	const mkp *m = p;
	switch (m->kind) {
	case 0: return kl_zeros(ctx, m->dt, m->s.n, m->s.d);
	case 1: return kl_full(ctx, m->dt, m->s.n, m->s.d, m->v[0]);
	case 2: return kl_arange(ctx, m->dt, m->v[0], m->v[1], m->v[2]);
	case 3: return kl_rand(ctx, m->dt, m->s.n, m->s.d, m->seed);
	case 4: return kl_randn(ctx, m->dt, m->s.n, m->s.d, m->seed);
	default: return kl_scalar(ctx, m->dt, m->v[0]);
	}
}

/* ---- norms of rows whose squares overflow -------------------------------------- */

/* The same norm written out from primitives, as a user would. */
static kl_tensor *ap_norm_prim(kl_tensor *const *in, const void *p)
{
	const nrm *n = p;
	int ax = -1;
	kl_tensor *x = in[0], *z = x;
	if (!n->rms)
		z = kl_sub(x, kl_mean(x, 1, &ax, true));
	kl_tensor *y = kl_mul(z, kl_rsqrt(kl_add_scalar(kl_mean(kl_mul(z, z), 1, &ax, true), n->eps)));
	y = n->w ? kl_mul(y, in[1]) : y;
	return n->b ? kl_add(y, in[2]) : y;
}

typedef struct nrm_run {
	const nrm *p;
	bool prim;
} nrm_run;

static kl_status body_norm(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	const nrm_run *r = user;
	out[0] = (r->prim ? ap_norm_prim : ap_norm)(in, r->p);
	return out[0] ? KL_OK : kl_last_status(c);
}

/* run the norm eagerly (compiled false) or through kl_compile; the values */
static double *run_norm(const nrm *p, bool prim, bool compiled, kl_tensor **in)
{
	nrm_run r = {p, prim};
	kl_tensor *out = NULL;
	kl_fn *fn = NULL;
	if (compiled) {
		fn = kl_compile(ctx, body_norm, &r, 3, 1, NULL);
		if (fn && kl_fn_call(fn, in, &out) != KL_OK)
			out = NULL;
	} else {
		kl_scope_begin(ctx);
		out = (prim ? ap_norm_prim : ap_norm)(in, p);
		if (out)
			kl_retain(out);
		kl_scope_end(ctx);
	}
	double *v = out ? kltest_read(out) : NULL;
	if (!v)
		fprintf(stderr, "FAIL norm run: %s\n", kl_last_error(ctx));
	kl_release(out);
	kl_fn_free(fn);
	return v;
}

/* Rows of huge finite values (+-3e38 in f32 and bf16, +-1e300 in f64: their
 * squares overflow), a constant huge row, huge mixed with tiny values, and an
 * ordinary row, at several widths: kl_layer_norm and kl_rms_norm, eager and
 * compiled, against a float64 model (compiled used to give 0). Ordinary rows
 * come out bit for bit as the primitive formula gives them; the norm written
 * from primitives keeps PyTorch's semantics (x * x overflows), compiled as
 * eager. */
static void test_norms_overflow(void **state)
{
	(void)state;
	static const int64_t widths[] = {1, 8, 7, 33, 1000, 4096};
	static const kl_dtype dts[] = {KL_F32, KL_BF16, KL_F64};
	char w[160];
	for (int cfg = 0; cfg < 3; cfg++) {
		nrm p = {cfg == 2, true, cfg == 1, 1e-5};
		for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++)
			for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
				kl_dtype dt = dts[t];
				int64_t D = widths[wi], R = 4;
				double big = dt == KL_F64 ? 1e300 : 3e38;
				double *x = malloc(sizeof(double) * (size_t)(R * D));
				assert_non_null(x);
				/* signs alternate, so that no row's sum passes the largest
				 * finite value (a mean of huge values is another matter) */
				for (int64_t j = 0; j < D; j++) {
					double sg = j % 2 ? -1.0 : 1.0;
					x[j] = sg * big * (double)(4 + j * 7 % 7) / 10.0;  /* +-big */
					x[D + j] = sg * big * (j % 4 < 2 ? 1.0 : 0.5);
					x[2 * D + j] = j % 3 == 0   ? sg * big /* huge and tiny */
					               : j % 3 == 1 ? sg * 1e-30
					                            : 2.5e-38;
					x[3 * D + j] = sin((double)j * 0.7 + 0.3) * 1.7; /* ordinary */
				}
				int64_t sh[2] = {R, D};
				kl_tensor *in[3] = {
				        kltest_from_values(ctx, dt, 2, sh, x, KLTEST_CONTIG),
				        mk(dt, (shp){1, {D}}, KLTEST_NORMAL, KLTEST_CONTIG),
				        mk(dt, (shp){1, {D}}, KLTEST_NORMAL, KLTEST_CONTIG)};
				double *xv = kltest_read(in[0]), *wv = kltest_read(in[1]);
				double *bv = kltest_read(in[2]);
				double *want = malloc(sizeof(double) * (size_t)(R * D));
				assert_true(xv && wv && bv && want);
				for (int64_t r = 0; r < R; r++) {
					const double *xr = xv + r * D;
					double mean = 0, ms = 0, sc = 0;
					for (int64_t j = 0; j < D; j++) /* scaled: no overflow in f64 */
						sc = fmax(sc, fabs(xr[j]));
					sc = sc > 0 ? sc : 1;
					for (int64_t j = 0; j < D && !p.rms; j++)
						mean += xr[j] / sc;
					mean /= (double)D;
					for (int64_t j = 0; j < D; j++)
						ms += (xr[j] / sc - mean) * (xr[j] / sc - mean) / (double)D;
					for (int64_t j = 0; j < D; j++) {
						/* eps / sc^2 may underflow: a deviation of 0 is 0 */
						double dv = xr[j] / sc - mean, den = ms + p.eps / sc / sc;
						double y = dv == 0 ? 0 : dv / sqrt(den);
						y = y * wv[j] + (p.b ? bv[j] : 0);
						want[r * D + j] = kl__round_to(dt, y);
					}
				}
				for (int compiled = 0; compiled < 2; compiled++) {
					double *got = run_norm(&p, false, compiled, in);
					snprintf(w, sizeof w, "kl_%s %s width %lld, huge rows, %s",
					         p.rms ? "rms_norm" : "layer_norm", kl_dtype_name(dt),
					         (long long)D, compiled ? "compiled" : "eager");
					if (!got || !kltest_compare(w, dt, 2, sh, got, want, 4))
						fails++;
					/* the ordinary row as the primitive formula gives it */
					double *prim = run_norm(&p, true, compiled, in);
					snprintf(w, sizeof w, "kl_%s %s width %lld, ordinary row, %s, "
					         "against primitives",
					         p.rms ? "rms_norm" : "layer_norm", kl_dtype_name(dt),
					         (long long)D, compiled ? "compiled" : "eager");
					if (got && prim && dt == KL_F32 && compiled &&
					    !kltest_compare(w, dt, 1, &D, got + 3 * D, prim + 3 * D, 0))
						fails++;
					free(got);
					free(prim);
				}
				/* primitives: compiled as eager, overflow and all */
				double *pe = run_norm(&p, true, false, in), *pc = run_norm(&p, true, true, in);
				snprintf(w, sizeof w, "%s from primitives %s width %lld, compiled as eager",
				         p.rms ? "rms_norm" : "layer_norm", kl_dtype_name(dt), (long long)D);
				if (!pe || !pc || !kltest_compare(w, dt, 2, sh, pc, pe, 4))
					fails++;
				free(pe);
				free(pc);
				free(x);
				free(xv);
				free(wv);
				free(bv);
				free(want);
				for (int i = 0; i < 3; i++)
					kl_release(in[i]);
			}
	}
	done();
}

static void test_creation(void **state)
{
	(void)state;
	static const shp shapes[] = {{2, {3, 4}}, {0, {0}}, {1, {0}}, {1, {LARGE}}};
	static const double aranges[][3] = {{0, 10, 1}, {1, 2, 0.1},    {5, -3, -2},
	                                    {0, 0, 1},  {-2.5, 2, 0.5}, {0, 100000, 1}};
	char w[96];
	for (int dt = 0; dt < KL_NDTYPES; dt++) {
		for (int i = 0; i < 4; i++) {
			shp s = shapes[i];
			int64_t n = kl__numel(s.n, s.d);
			if (n == LARGE && dt != KL_F32 && dt != KL_F16 && dt != KL_I32)
				continue; /* the large case in a few dtypes, for time */
			double *want = malloc(sizeof(double) * (size_t)(n + 1));
			assert_non_null(want);
			for (int k = 0; k < 3; k++) {
				double v = k == 0 ? 0 : (k == 1 ? -2.75 : 1e10);
				mkp p = {k == 0 ? 0 : 1, (kl_dtype)dt, s, {v}, 0};
				for (int64_t j = 0; j < n; j++)
					want[j] = kl__round_to((kl_dtype)dt, v);
				snprintf(w, sizeof w, "kl_full %s shape#%d v=%g", kl_dtype_name(dt),
				         i, v);
				expect_tensor(w, ap_make(NULL, &p), (kl_dtype)dt, s.n, s.d, want,
				              0);
				check(w, ap_make, &p, 0, NULL, 0);
			}
			for (int k = 3; k < 5; k++) {
				mkp p = {k, (kl_dtype)dt, s, {0}, 1234567u + (uint64_t)i};
				snprintf(w, sizeof w, "kl_%s %s shape#%d",
				         k == 3 ? "rand" : "randn", kl_dtype_name(dt), i);
				if (!kl_dtype_is_float(dt)) {
					EXPECT_ERROR(ap_make(NULL, &p),
					             k == 3 ? "kl_rand" : "kl_randn",
					             kl_dtype_name(dt));
					continue;
				}
				/* element i is a function of (seed, i) only, exactly; except
				 * that a device's double log/cos (CUDA's libdevice) may differ
				 * from the host libm's in the last bit: randn f64 is held to
				 * the f64 tolerance, every narrower result rounds the same */
				check(w, ap_make, &p, 0, NULL, k == 4 && dt == KL_F64 ? 1 : 0);
				kl_tensor *t = ap_make(NULL, &p);
				double *v = kltest_read(t);
				assert_non_null(v);
				int64_t bad = 0;
				for (int64_t j = 0; j < n; j++)
					bad += k == 3 ? !(v[j] >= 0 && v[j] < 1) : !isfinite(v[j]);
				if (bad) {
					fprintf(stderr, "FAIL %s: %lld values out of range\n", w,
					        (long long)bad);
					fails++;
				}
				free(v);
				kl_release(t);
			}
			free(want);
		}
		for (int k = 0; k < 6; k++) {
			const double *a = aranges[k];
			int64_t n = (int64_t)ceil((a[1] - a[0]) / a[2]);
			double *want = malloc(sizeof(double) * (size_t)(n + 1));
			assert_non_null(want);
			for (int64_t j = 0; j < n; j++)
				want[j] = kl__round_to((kl_dtype)dt, a[0] + (double)j * a[2]);
			mkp p = {2, (kl_dtype)dt, {0, {0}}, {a[0], a[1], a[2]}, 0};
			snprintf(w, sizeof w, "kl_arange %s (%g,%g,%g)", kl_dtype_name(dt), a[0],
			         a[1], a[2]);
			/* a float result may differ by rounding: start + i * step
			 * computed in the dtype or in double */
			expect_tensor(w, ap_make(NULL, &p), (kl_dtype)dt, 1, &n, want, 1);
			check(w, ap_make, &p, 0, NULL, 1);
			free(want);
		}
		mkp p = {5, (kl_dtype)dt, {0, {0}}, {-7.5}, 0};
		double want = kl__round_to((kl_dtype)dt, -7.5);
		expect_tensor("kl_scalar", ap_make(NULL, &p), (kl_dtype)dt, 0, (int64_t[]){0},
		              &want, 0);
		/* kl_item reads the one element of any view; more is an error */
		kl_tensor *m = mk((kl_dtype)dt, (shp){2, {3, 4}}, KLTEST_SPECIAL, KLTEST_STRIDED);
		kl_tensor *row = kl_slice(m, 0, 2, 3, 1), *one = kl_slice(row, 1, -1, 4, 1);
		double *all = kltest_read(m), got = 0;
		expect_ok(one && all && kl_item(one, &got) == KL_OK &&
		          (got == all[11] || (isnan(got) && isnan(all[11]))));
		kl_clear_error(ctx);
		expect_ok(kl_item(m, &got) != KL_OK && strstr(kl_last_error(ctx), "kl_item"));
		FILE *f = tmpfile();
		expect_ok(f && kl_print(m, f) == KL_OK && ftell(f) > 0);
		if (f)
			fclose(f);
		free(all);
		kl_release(one);
		kl_release(row);
		kl_release(m);
		kl_tensor *e = kl_empty(ctx, (kl_dtype)dt, 2, (int64_t[]){2, 3});
		expect_ok(e && kl_numel(e) == 6 && (int)kl_tensor_dtype(e) == dt &&
		          kl_is_contiguous(e));
		kl_release(e);
	}
	done();
}

/* ---- dtype rules (torch's), which the reference takes from the graph --------- */

static void test_dtype_rules(void **state)
{
	(void)state;
	static const kl_dtype promo[][3] = {
		{KL_F32, KL_F64, KL_F64},  {KL_F16, KL_BF16, KL_F32},  {KL_F16, KL_F32, KL_F32},
		{KL_I32, KL_F16, KL_F16},  {KL_I64, KL_BF16, KL_BF16}, {KL_I32, KL_I64, KL_I64},
		{KL_BOOL, KL_I32, KL_I32}, {KL_BOOL, KL_F16, KL_F16},  {KL_BOOL, KL_BOOL, KL_BOOL},
		{KL_I64, KL_F64, KL_F64},  {KL_I32, KL_I32, KL_I32},   {KL_BF16, KL_BF16, KL_BF16}};
	for (size_t i = 0; i < sizeof promo / sizeof promo[0]; i++) {
		kl_dtype a = promo[i][0], b = promo[i][1], want = promo[i][2];
		if (kl_promote_types(a, b) != want || kl_promote_types(b, a) != want) {
			fprintf(stderr, "FAIL kl_promote_types(%s, %s): %s, want %s\n",
			        kl_dtype_name(a), kl_dtype_name(b),
			        kl_dtype_name(kl_promote_types(a, b)), kl_dtype_name(want));
			fails++;
		}
	}
	shp s = {1, {3}};
	kl_tensor *i32 = mk(KL_I32, s, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *i64 = mk(KL_I64, s, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *f16 = mk(KL_F16, s, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *bf = mk(KL_BF16, s, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *b = mk(KL_BOOL, s, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *m = mk(KL_I32, (shp){2, {3, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	expect_dtype("add(i32, f16)", kl_add(i32, f16), KL_F16);
	expect_dtype("add(bool, bool)", kl_add(b, b), KL_BOOL);
	expect_dtype("mul(bool, i64)", kl_mul(b, i64), KL_I64);
	expect_dtype("div(i32, i32)", kl_div(i32, i32), KL_F32);
	expect_dtype("div(f16, f16)", kl_div(f16, f16), KL_F16);
	expect_dtype("div_scalar(i64, 2)", kl_div_scalar(i64, 2), KL_F32);
	expect_dtype("add_scalar(i32, 2)", kl_add_scalar(i32, 2), KL_I32);
	expect_dtype("add_scalar(i32, 2.5)", kl_add_scalar(i32, 2.5), KL_F32);
	expect_dtype("add_scalar(bool, 2)", kl_add_scalar(b, 2), KL_I64);
	expect_dtype("mul_scalar(f16, 1e10)", kl_mul_scalar(f16, 1e10), KL_F16);
	expect_dtype("pow_scalar(i32, 0.5)", kl_pow_scalar(i32, 0.5), KL_F32);
	expect_dtype("eq(i32, f16)", kl_eq(i32, f16), KL_BOOL);
	expect_dtype("lt_scalar(bf16, 1)", kl_lt_scalar(bf, 1), KL_BOOL);
	expect_dtype("maximum(bf16, f16)", kl_maximum(bf, f16), KL_F32);
	expect_dtype("exp(i64)", kl_exp(i64), KL_F32);
	expect_dtype("sigmoid(bool)", kl_sigmoid(b), KL_F32);
	expect_dtype("abs(i32)", kl_abs(i32), KL_I32);
	expect_dtype("relu(i64)", kl_relu(i64), KL_I64);
	expect_dtype("sum(i32)", kl_sum(i32, 0, NULL, false), KL_I64);
	expect_dtype("sum(bool)", kl_sum(b, 0, NULL, false), KL_I64);
	expect_dtype("sum(bf16)", kl_sum(bf, 0, NULL, false), KL_BF16);
	expect_dtype("max(i32)", kl_max(i32, 0, NULL, false), KL_I32);
	expect_dtype("argmax(f16)", kl_argmax(f16, 0, false), KL_I64);
	expect_dtype("where(bool, i32, f16)", kl_where(b, i32, f16), KL_F16);
	expect_dtype("clamp(i32, 0.5, 2)", kl_clamp(i32, 0.5, 2), KL_F32);
	expect_dtype("clamp(i32, 0, 2)", kl_clamp(i32, 0, 2), KL_I32);
	expect_dtype("clamp(i32, -inf, 2)", kl_clamp(i32, -INFINITY, 2), KL_I32);
	expect_dtype("concat(i32, f16)", kl_concat(2, (kl_tensor *[]){i32, f16}, 0), KL_F16);
	expect_dtype("matmul(i32, i32)", kl_matmul(m, m), KL_I32);
	expect_dtype("cast(f16, bool)", kl_cast(f16, KL_BOOL), KL_BOOL);
	kl_tensor *made[] = {i32, i64, f16, bf, b, m};
	for (size_t i = 0; i < sizeof made / sizeof made[0]; i++)
		kl_release(made[i]);
	done();
}

/* ---- error paths: NULL, with a message naming the op, shapes and values -------- */

static void test_errors(void **state)
{
	(void)state;
	kl_tensor *a43 = mk(KL_F32, (shp){2, {4, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *b5 = mk(KL_F32, (shp){1, {5}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *a23 = mk(KL_F32, (shp){2, {2, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *h45 = mk(KL_F16, (shp){2, {4, 5}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *i23 = mk(KL_I32, (shp){2, {2, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *bl = mk(KL_BOOL, (shp){2, {2, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *e03 = mk(KL_F32, (shp){2, {0, 3}}, KLTEST_NORMAL, KLTEST_CONTIG);
	kl_tensor *f45 = mk(KL_F32, (shp){2, {4, 5}}, KLTEST_NORMAL, KLTEST_CONTIG);

	EXPECT_ERROR(kl_add(a43, b5), "kl_add", "[4,3]", "[5]", "broadcast");
	EXPECT_ERROR(kl_ge(b5, a43), "kl_ge", "[4,3]", "[5]");
	EXPECT_ERROR(kl_where(bl, a43, b5), "kl_where", "[2,3]", "[4,3]", "[5]");
	EXPECT_ERROR(kl_sum(a23, 1, (int[]){3}, false), "kl_sum", "3", "[2,3]");
	EXPECT_ERROR(kl_max(a23, 1, (int[]){-3}, true), "kl_max", "-3", "[2,3]");
	EXPECT_ERROR(kl_sum(a23, 2, (int[]){1, -1}, false), "kl_sum", "[2,3]", "repeated");
	EXPECT_ERROR(kl_argmax(a23, 2, false), "kl_argmax", "2", "[2,3]");
	EXPECT_ERROR(kl_softmax(a23, -3), "kl_softmax", "-3", "[2,3]");
	EXPECT_ERROR(kl_matmul(a43, h45), "kl_matmul", "f32", "f16");
	EXPECT_ERROR(kl_matmul(a23, f45), "kl_matmul", "[2,3]", "[4,5]");
	EXPECT_ERROR(kl_reshape(a23, 2, (int64_t[]){4, 2}), "kl_reshape", "[2,3]", "[4,2]");
	EXPECT_ERROR(kl_reshape(a23, 2, (int64_t[]){-1, 4}), "kl_reshape", "[2,3]", "[-1,4]");
	EXPECT_ERROR(kl_slice(a23, 1, 0, 3, 0), "kl_slice", "step 0");
	EXPECT_ERROR(kl_slice(a23, 2, 0, 3, 1), "kl_slice", "2", "[2,3]");
	EXPECT_ERROR(kl_expand(a23, 2, (int64_t[]){2, 4}), "kl_expand", "[2,3]", "[2,4]");
	EXPECT_ERROR(kl_permute(a23, (int[]){1, 1}), "kl_permute", "[2,3]");
	EXPECT_ERROR(kl_transpose(a23, 0, 5), "kl_transpose", "5", "[2,3]");
	EXPECT_ERROR(kl_concat(2, (kl_tensor *[]){a23, a43}, 1), "kl_concat", "[2,3]", "[4,3]");
	EXPECT_ERROR(kl_concat(2, (kl_tensor *[]){a23, b5}, 0), "kl_concat", "[2,3]", "[5]");
	EXPECT_ERROR(kl_linear(a43, f45, NULL), "kl_linear", "[4,3]", "[4,5]");
	EXPECT_ERROR(kl_linear(a23, a23, b5), "kl_linear", "[5]");
	EXPECT_ERROR(kl_layer_norm(a43, b5, NULL, 1e-5), "kl_layer_norm", "[5]", "[4,3]");
	EXPECT_ERROR(kl_rms_norm(i23, NULL, 1e-5), "kl_rms_norm", "i32");
	EXPECT_ERROR(kl_mean(i23, 0, NULL, false), "kl_mean", "i32");
	EXPECT_ERROR(kl_var(bl, 0, NULL, 1, false), "kl_var", "bool");
	EXPECT_ERROR(kl_var(a23, 0, NULL, -1, false), "kl_var", "-1");
	EXPECT_ERROR(kl_neg(bl), "kl_neg", "bool");
	EXPECT_ERROR(kl_sub(bl, bl), "kl_sub", "bool");
	EXPECT_ERROR(kl_max(e03, 1, (int[]){0}, false), "kl_max", "[0,3]");
	EXPECT_ERROR(kl_argmax(e03, 0, false), "kl_argmax", "[0,3]");
	EXPECT_ERROR(kl_softmax(i23, 0), "kl_softmax", "i32");
	EXPECT_ERROR(kl_clamp(a23, NAN, 1), "kl_clamp", "NaN");
	EXPECT_ERROR(kl_cast(a23, (kl_dtype)99), "kl_cast", "99");
	EXPECT_ERROR(kl_arange(ctx, KL_F32, 0, 5, 0), "kl_arange", "step 0");
	EXPECT_ERROR(kl_rand(ctx, KL_I32, 1, (int64_t[]){3}, 1), "kl_rand", "i32");
	EXPECT_ERROR(kl_full(ctx, KL_F32, 2, (int64_t[]){2, -3}, 1), "kl_full", "-3");

	/* NULL inputs fail cleanly; a chain reports its root cause */
	EXPECT_ERROR(kl_add(NULL, a23), "kl_add", "NULL");
	EXPECT_ERROR(kl_matmul(a23, NULL), "kl_matmul", "NULL");
	expect_ok(kl_neg(NULL) == NULL && kl_sum(NULL, 0, NULL, false) == NULL &&
	          kl_reshape(NULL, 1, (int64_t[]){1}) == NULL && kl_concat(0, NULL, 0) == NULL);
	EXPECT_ERROR(kl_relu(kl_add(kl_mul(a43, b5), a43)), "kl_mul", "[4,3]", "[5]");

	/* tensors of two contexts do not mix */
	kl_ctx *other = kl_ctx_new(NULL);
	assert_non_null(other);
	kl_tensor *o = kl_zeros(other, KL_F32, 2, (int64_t[]){2, 3});
	EXPECT_ERROR(kl_add(a23, o), "kl_add", "context");
	kl_ctx_free(other);

	/* a failed op leaves the context usable */
	kl_tensor *in[2] = {kl_retain(a23), kl_retain(a23)};
	check("kl_add after errors", ap_bin, &binops[0], 2, in, 1);

	kl_tensor *made[] = {a43, b5, a23, h45, i23, bl, e03, f45};
	for (size_t i = 0; i < sizeof made / sizeof made[0]; i++)
		kl_release(made[i]);
	done();
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup(test_binary_scalar, reset),
		cmocka_unit_test_setup(test_binary_mixed_and_large, reset),
		cmocka_unit_test_setup(test_unary, reset),
		cmocka_unit_test_setup(test_where, reset),
		cmocka_unit_test_setup(test_cast, reset),
		cmocka_unit_test_setup(test_clamp, reset),
		cmocka_unit_test_setup(test_reductions, reset),
		cmocka_unit_test_setup(test_argmax, reset),
		cmocka_unit_test_setup(test_movement, reset),
		cmocka_unit_test_setup(test_concat, reset),
		cmocka_unit_test_setup(test_gather, reset),
		cmocka_unit_test_setup(test_matmul, reset),
		cmocka_unit_test_setup(test_matmul_threads, reset),
		cmocka_unit_test_setup(test_linear, reset),
		cmocka_unit_test_setup(test_softmax, reset),
		cmocka_unit_test_setup(test_norms, reset),
		cmocka_unit_test_setup(test_norms_overflow, reset),
		cmocka_unit_test_setup(test_creation, reset),
		cmocka_unit_test_setup(test_dtype_rules, reset),
		cmocka_unit_test_setup(test_errors, reset),
	};
	/* ctest runs the CUDA tables one per process, in parallel */
	if (getenv("KILN_TEST_FILTER"))
		cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
	return cmocka_run_group_tests(tests, setup, teardown);
}
