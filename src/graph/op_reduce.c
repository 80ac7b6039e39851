/* op_reduce.c - the descriptors of the reductions: sum, mean, max, min, var,
 * argmax over attrs.axes (argmax: attrs.axis) with attrs.keepdim. Each row
 * gives the result dtype, the shape rule, and the float64 value of one row
 * (the reduced elements, in order), which the reference applies to every
 * row. Lowering builds mean and var from sums (decompose.c); the renderers
 * spell sum, max, min and argmax accumulators.
 */
#include <math.h>
#include <stdio.h>

#include "core/sat.h"
#include "graph/optable.h"

/* ---- dtype rules ---------------------------------------------------------------- */

/* sum of bool or ints is i64 (as torch) */
static kl_dtype dt_sum(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	return kl_dtype_is_float(in->dt[0]) ? in->dt[0] : KL_I64;
}

/* mean and var are defined for floats only */
static kl_dtype dt_float_only(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (!kl_dtype_is_float(in->dt[0])) {
		snprintf(why, cap, "dtype %s is not floating point", kl_dtype_name(in->dt[0]));
		return KL_NDTYPES;
	}
	return in->dt[0];
}

static kl_dtype dt_same(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	return in->dt[0];
}

static kl_dtype dt_index(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)in, (void)why, (void)cap;
	return KL_I64;
}

/* ---- shape rule ------------------------------------------------------------------ */

uint32_t kl__reduce_mask(const kl_node *n, int xndim)
{
	if (n->op == KL_OP_ARGMAX)
		return xndim > 0 && n->a.axis >= 0 && n->a.axis < xndim ? 1u << n->a.axis : 0;
	/* reducing no dim of a non-scalar is not an op the front end makes; 0
	 * can only mean "all" */
	return n->a.axes ? n->a.axes : (uint32_t)((1ull << xndim) - 1);
}

static bool sh_reduce(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	int xnd = ndim[0];
	const int64_t *xs = shape[0];
	if (n->op == KL_OP_ARGMAX) {
		if (xnd > 0 && (n->a.axis < 0 || n->a.axis >= xnd)) {
			snprintf(why, cap, "axis %d out of range for %d dims", n->a.axis, xnd);
			return false;
		}
	} else if (kl__reduce_mask(n, xnd) >> xnd) {
		snprintf(why, cap, "axes mask 0x%x out of range for %d dims",
		         (unsigned)n->a.axes, xnd);
		return false;
	}
	uint32_t mask = kl__reduce_mask(n, xnd);
	int64_t want[KL_MAX_DIMS];
	int wn = 0;
	for (int d = 0; d < xnd; d++) {
		if (!(mask >> d & 1))
			want[wn++] = xs[d];
		else if (n->a.keepdim)
			want[wn++] = 1;
	}
	bool ok = wn == n->ndim;
	for (int d = 0; ok && d < wn; d++)
		ok = want[d] == n->shape[d];
	if (!ok) {
		char b1[96], b2[96], b3[96];
		snprintf(why, cap, "reducing %s gives %s, node shape is %s",
		         kl__shape_str(b1, sizeof b1, xnd, xs), kl__shape_str(b2, sizeof b2, wn, want),
		         kl__shape_str(b3, sizeof b3, n->ndim, n->shape));
	}
	return ok;
}

/* ---- one row in float64 ---------------------------------------------------------- */

static bool is_int(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64;
}

static double r_sum(const kl_node *n, const double *x, int64_t len)
{
	kl_dtype dt = (kl_dtype)n->dtype;
	if (is_int(dt) || dt == KL_BOOL) {
		uint64_t u = 0;
		for (int64_t i = 0; i < len; i++)
			u += (uint64_t)kl__f2i64(x[i]);
		return dt == KL_BOOL ? (double)(u != 0) : kl__wrap_to(dt, u);
	}
	return kl__ref_sum(x, len);
}

static double r_mean(const kl_node *n, const double *x, int64_t len)
{
	(void)n;
	return kl__ref_sum(x, len) / (double)len;
}

/* the first NaN wins */
static double r_max(const kl_node *n, const double *x, int64_t len)
{
	bool mx = n->op == KL_OP_MAX;
	double m = x[0];
	for (int64_t i = 0; i < len; i++) {
		if (isnan(x[i]))
			return x[i];
		if (mx ? x[i] > m : x[i] < m)
			m = x[i];
	}
	return m;
}

static double r_var(const kl_node *n, const double *x, int64_t len)
{
	if (len == 0)
		return NAN;
	double mean = kl__ref_sum(x, len) / (double)len;
	double ss = 0;
	for (int64_t i = 0; i < len; i++)
		ss += (x[i] - mean) * (x[i] - mean);
	/* torch's divisor max(0, n - correction): too few elements give inf (or
	 * NaN when all are equal), never a negative variance */
	int64_t div = len - n->a.correction;
	return ss / (double)(div > 0 ? div : 0);
}

/* the position of the first maximum, or of the first NaN */
static double r_argmax(const kl_node *n, const double *x, int64_t len)
{
	(void)n;
	int64_t best = 0;
	for (int64_t i = 0; i < len; i++) {
		if (isnan(x[i]))
			return (double)i;
		if (x[i] > x[best])
			best = i;
	}
	return (double)best;
}

/* ---- the rows ---------------------------------------------------------------------- */

#define RED(ID, DT, ROW, ...)                                                                  \
	const kl_opdesc kl__desc_##ID = {.dtype = DT,                                          \
	                                 .shape = sh_reduce,                                   \
	                                 .ref = kl__ref_reduce,                                \
	                                 .row = ROW,                                           \
	                                 .eager = KL_EAGER_REDUCE,                             \
	                                 .vjp = NULL,                                          \
	                                 __VA_ARGS__};
RED(SUM, dt_sum, r_sum)
RED(MEAN, dt_float_only, r_mean)
RED(MAX, dt_same, r_max, .no_identity = true)
RED(MIN, dt_same, r_max, .no_identity = true)
RED(VAR, dt_float_only, r_var)
RED(ARGMAX, dt_index, r_argmax, .no_identity = true)
#undef RED
