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
#include <string.h>

#include "graph/build.h"
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

/* ---- vector-Jacobian rules ------------------------------------------------------------ */

/* gout brought back to the reduction's keepdim shape (it broadcasts
 * against the input from there); *count: the elements each output reduced */
static int32_t unreduce(kl_graph *g, int32_t node, int32_t go, int64_t *count)
{
	const kl_node *n = &g->nodes[node];
	const kl_node *x = &g->nodes[n->in[0]];
	uint32_t mask = kl__reduce_mask(n, x->ndim);
	int64_t shape[KL_MAX_DIMS];
	*count = 1;
	for (int d = 0; d < x->ndim; d++) {
		bool r = mask >> d & 1;
		shape[d] = r ? 1 : x->shape[d];
		*count *= r ? x->shape[d] : 1;
	}
	return n->a.keepdim ? go : kl__gb_reshape(g, go, x->ndim, shape);
}

static kl_status one(int32_t *gin, int32_t v)
{
	gin[0] = v;
	return v < 0 ? KL_EINVAL : KL_OK;
}

static kl_status vjp_sum(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t cnt;
	const kl_node *x = &g->nodes[g->nodes[node].in[0]];
	int nd = x->ndim;
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, x->shape, sizeof shape);
	return one(gin, kl__gb_expand(g, unreduce(g, node, go, &cnt), nd, shape));
}

static kl_status vjp_mean(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t cnt;
	int32_t k = unreduce(g, node, go, &cnt);
	const kl_node *x = &g->nodes[g->nodes[node].in[0]];
	int nd = x->ndim;
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, x->shape, sizeof shape);
	return one(gin, kl__gb_expand(g, kl__gb_scalar(g, KL_OP_DIV, k, (double)cnt), nd, shape));
}

/* torch's amax/amin: the gradient shared evenly among the elements equal to
 * the result */
static kl_status vjp_max(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t cnt;
	int32_t x = g->nodes[node].in[0];
	kl_dtype dt = (kl_dtype)g->nodes[node].dtype;
	uint32_t mask = kl__reduce_mask(&g->nodes[node], g->nodes[x].ndim);
	int32_t k = unreduce(g, node, go, &cnt);
	int32_t outk = unreduce(g, node, node, &cnt);
	int32_t hit = kl__gb_binary(g, KL_OP_EQ, x, outk);
	int32_t n = kl__gb_reduce(g, KL_OP_SUM, kl__gb_cast(g, hit, dt), mask, true);
	int32_t share = kl__gb_binary(g, KL_OP_DIV, k, n);
	return one(gin, kl__gb_where(g, hit, share, kl__gb_full(g, dt, 0, NULL, 0.0)));
}

/* d var = go * 2 (x - mean) / (n - correction) */
static kl_status vjp_var(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t cnt;
	int32_t x = g->nodes[node].in[0];
	int corr = g->nodes[node].a.correction;
	uint32_t mask = kl__reduce_mask(&g->nodes[node], g->nodes[x].ndim);
	int32_t k = unreduce(g, node, go, &cnt);
	int64_t div = cnt - corr > 0 ? cnt - corr : 0;
	int32_t xm = kl__gb_binary(g, KL_OP_SUB, x, kl__gb_reduce(g, KL_OP_MEAN, x, mask, true));
	int32_t d = kl__gb_scalar(g, KL_OP_MUL, xm, 2.0 / (double)div);
	return one(gin, kl__gb_binary(g, KL_OP_MUL, k, d));
}

/* ---- the rows ---------------------------------------------------------------------- */

#define RED(ID, DT, ROW, VJP, ...)                                                                \
	const kl_opdesc kl__desc_##ID = {.dtype = DT,                                          \
	                                 .shape = sh_reduce,                                   \
	                                 .ref = kl__ref_reduce,                                \
	                                 .row = ROW,                                           \
	                                 .eager = KL_EAGER_REDUCE,                             \
	                                 .vjp = VJP,                                           \
	                                 __VA_ARGS__};
RED(SUM, dt_sum, r_sum, vjp_sum)
RED(MEAN, dt_float_only, r_mean, vjp_mean)
RED(MAX, dt_same, r_max, vjp_max, .no_identity = true)
RED(MIN, dt_same, r_max, vjp_max, .no_identity = true)
RED(VAR, dt_float_only, r_var, vjp_var)
RED(ARGMAX, dt_index, r_argmax, NULL, .no_identity = true) /* an index: no gradient */
#undef RED
