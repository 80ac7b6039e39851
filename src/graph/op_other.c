/* op_other.c - the descriptors of the ops that are not pointwise or
 * reductions: sources, movement (views and copies), the matrix product, and
 * the composites that lowering decomposes (softmax, log_softmax, the norms)
 * or rewrites (attention). Their public builders in api/ops.c set their
 * result dtype and shape from attributes; the shape rules here hold every
 * node to what the builders compute; their reference evaluation is in
 * reference.c, one function per family.
 */
#include <stdio.h>

#include <string.h>

#include "core/shape.h"
#include "graph/build.h"
#include "graph/optable.h"

bool kl__matmul_shapes_ok(int nd, const int64_t *out, int and_, const int64_t *as, int bnd,
                          const int64_t *bs)
{
	bool ok = nd >= 2 && and_ == nd && bnd == nd;
	for (int d = 0; ok && d < nd - 2; d++)
		ok = as[d] == out[d] && bs[d] == out[d];
	if (ok)
		ok = as[nd - 2] == out[nd - 2] && bs[nd - 1] == out[nd - 1] &&
		     as[nd - 1] == bs[nd - 2];
	return ok;
}

static bool sh_matmul(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	if (kl__matmul_shapes_ok(n->ndim, n->shape, ndim[0], shape[0], ndim[1], shape[1]))
		return true;
	char b1[96], b2[96], b3[96];
	snprintf(why, cap, "operands %s and %s do not give %s",
	         kl__shape_str(b1, sizeof b1, ndim[0], shape[0]),
	         kl__shape_str(b2, sizeof b2, ndim[1], shape[1]),
	         kl__shape_str(b3, sizeof b3, n->ndim, n->shape));
	return false;
}

/* ---- shape rules ---------------------------------------------------------------------
 * What the public builders in api/ops.c compute, restated as a check of a
 * finished node so that any node, from the front end, a rewrite or a
 * gradient rule, is held to it by the reference. */

/* "inputs S0, S1 ... give S (node): " + the reason, into why */
static bool sh_fail(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                    size_t cap, const char *reason)
{
	char b[96];
	int k = snprintf(why, cap, "%s", "inputs");
	for (int i = 0; i < n->nin && k >= 0 && (size_t)k < cap; i++)
		k += snprintf(why + k, cap - (size_t)k, " %s",
		              kl__shape_str(b, sizeof b, ndim[i], shape[i]));
	if (k >= 0 && (size_t)k < cap)
		snprintf(why + k, cap - (size_t)k, " and node %s: %s",
		         kl__shape_str(b, sizeof b, n->ndim, n->shape), reason);
	return false;
}

/* the node has its first input's shape (contiguous, softmax, log_softmax) */
static bool sh_same(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                    size_t cap)
{
	if (n->ndim > 0 && n->a.axis >= n->ndim)
		return sh_fail(n, ndim, shape, why, cap, "axis out of range");
	if (kl__shape_eq(n->ndim, n->shape, ndim[0], shape[0]))
		return true;
	return sh_fail(n, ndim, shape, why, cap, "the shapes differ");
}

/* arange: one dim (its length is the builder's: start and step are kept,
 * stop is not); full, rand, randn: any shape */
static bool sh_source(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	/* rand, randn keyed at run time: two 0-dim key words */
	for (int i = 0; i < n->nin; i++)
		if (ndim[i] != 0)
			return sh_fail(n, ndim, shape, why, cap, "the key words must be 0-dim");
	if (n->op != KL_OP_ARANGE || n->ndim == 1)
		return true;
	return sh_fail(n, ndim, shape, why, cap, "arange gives one dim");
}

static bool sh_reshape(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                       size_t cap)
{
	int64_t a, b;
	if (kl__dims_product(ndim[0], shape[0], &a) && kl__dims_product(n->ndim, n->shape, &b) &&
	    a == b)
		return true;
	return sh_fail(n, ndim, shape, why, cap, "the element counts differ");
}

static bool sh_permute(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                       size_t cap)
{
	uint32_t seen = 0;
	bool ok = n->ndim == ndim[0];
	for (int d = 0; ok && d < n->ndim; d++) {
		int64_t p = n->a.v[d];
		ok = p >= 0 && p < n->ndim && !(seen & (1u << p)) && shape[0][p] == n->shape[d];
		if (ok)
			seen |= 1u << p;
	}
	return ok || sh_fail(n, ndim, shape, why, cap, "not a permutation of the input's dims");
}

/* each input dim, aligned from the right, equals the node's or is 1 */
static bool sh_expand(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	int off = n->ndim - ndim[0];
	bool ok = off >= 0;
	for (int d = 0; ok && d < ndim[0]; d++)
		ok = shape[0][d] == n->shape[d + off] || shape[0][d] == 1;
	return ok || sh_fail(n, ndim, shape, why, cap, "the input does not broadcast to the node");
}

/* v[0..2] = start, stop, step, normalized: 0 <= start <= stop <= dim */
static bool sh_slice(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                     size_t cap)
{
	int ax = n->a.axis;
	int64_t start = n->a.v[0], stop = n->a.v[1], step = n->a.v[2];
	bool ok = n->ndim == ndim[0] && ax >= 0 && ax < n->ndim && step >= 1 && start >= 0 &&
	          start <= stop && stop <= shape[0][ax];
	/* (stop - start - 1) / step + 1 elements, never past INT64_MAX */
	int64_t len = ok && stop > start ? (stop - start - 1) / step + 1 : 0;
	for (int d = 0; ok && d < n->ndim; d++)
		ok = n->shape[d] == (d == ax ? len : shape[0][d]);
	if (ok)
		return true;
	char r[128];
	snprintf(r, sizeof r, "slice %lld:%lld:%lld along dim %d does not give it", (long long)start,
	         (long long)stop, (long long)step, ax);
	return sh_fail(n, ndim, shape, why, cap, r);
}

static bool sh_concat(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	int ax = n->a.axis;
	bool ok = n->nin >= 1 && ax >= 0 && ax < n->ndim;
	int64_t total = 0;
	for (int i = 0; ok && i < n->nin; i++) {
		ok = ndim[i] == n->ndim && !__builtin_add_overflow(total, shape[i][ax], &total);
		for (int d = 0; ok && d < n->ndim; d++)
			ok = d == ax || shape[i][d] == n->shape[d];
	}
	ok = ok && total == n->shape[ax];
	return ok || sh_fail(n, ndim, shape, why, cap, "the inputs do not stack along the axis");
}

/* out = idx's shape followed by the table's rows: table[idx[i...], j...] */
static bool sh_gather(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                      size_t cap)
{
	bool ok = ndim[0] >= 1 && n->ndim == ndim[1] + ndim[0] - 1;
	for (int d = 0; ok && d < n->ndim; d++)
		ok = n->shape[d] == (d < ndim[1] ? shape[1][d] : shape[0][d - ndim[1] + 1]);
	return ok ||
	       sh_fail(n, ndim, shape, why, cap, "not the index's shape then the table's rows");
}

/* x's shape; weight and bias (when the flags say they follow) [last dim] */
static bool sh_norm(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                    size_t cap)
{
	bool ok = n->ndim >= 1 && kl__shape_eq(n->ndim, n->shape, ndim[0], shape[0]);
	for (int i = 1; ok && i < n->nin; i++)
		ok = ndim[i] == 1 && shape[i][0] == n->shape[n->ndim - 1];
	return ok || sh_fail(n, ndim, shape, why, cap,
	                     "x's shape, with weight and bias of its last dim, expected");
}

/* q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] -> [..., Tq, Dv]; with a
 * 4th operand, the lengths [the first batch dim] (rank >= 3) */
static bool sh_attention(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                         size_t cap)
{
	int nd = n->ndim;
	bool ok = nd >= 2 && ndim[0] == nd && ndim[1] == nd && ndim[2] == nd;
	if (ok && n->nin == 4)
		ok = nd >= 3 && ndim[3] == 1 && shape[3][0] == n->shape[0];
	ok = ok && n->nin == 3 + !!(n->a.flags & KL_F_LENGTHS);
	for (int d = 0; ok && d < nd - 2; d++)
		ok = shape[0][d] == n->shape[d] && shape[1][d] == n->shape[d] &&
		     shape[2][d] == n->shape[d];
	ok = ok && shape[0][nd - 2] == n->shape[nd - 2] && shape[2][nd - 1] == n->shape[nd - 1] &&
	     shape[1][nd - 1] == shape[0][nd - 1] && shape[2][nd - 2] == shape[1][nd - 2];
	return ok || sh_fail(n, ndim, shape, why, cap, "q, k and v do not give the node");
}

/* sdpa_bwd (ops.def): q, k, v, o, do of one batch shape and last dim D,
 * o and do q's shape, v k's; the node [..., Tq + 2 Tk, D] */
static bool sh_attention_bwd(const kl_node *n, const int *ndim, const int64_t *const *shape,
                             char *why, size_t cap)
{
	int nd = n->ndim;
	bool ok = nd >= 2;
	for (int i = 0; ok && i < 5; i++)
		ok = ndim[i] == nd && shape[i][nd - 1] == n->shape[nd - 1];
	for (int d = 0; ok && d < nd - 2; d++)
		for (int i = 0; ok && i < 5; i++)
			ok = shape[i][d] == n->shape[d];
	ok = ok && shape[2][nd - 2] == shape[1][nd - 2] && shape[3][nd - 2] == shape[0][nd - 2] &&
	     shape[4][nd - 2] == shape[0][nd - 2] &&
	     n->shape[nd - 2] == shape[0][nd - 2] + 2 * shape[1][nd - 2];
	return ok || sh_fail(n, ndim, shape, why, cap, "q, k, v, o and do do not give the node");
}

/* sdpa_bwd: its five operands share one float dtype */
static kl_dtype dt_attention_bwd(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	for (int i = 0; i < in->n; i++)
		if (in->dt[i] != in->dt[0] || !kl_dtype_is_float(in->dt[i])) {
			snprintf(why, cap, "operands of dtypes %s and %s: one float dtype wanted",
			         kl_dtype_name(in->dt[0]), kl_dtype_name(in->dt[i]));
			return KL_NDTYPES;
		}
	return in->dt[0];
}

/* the promoted type of the operands (concat casts each to it) */
static kl_dtype dt_promote(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	kl_dtype dt = in->dt[0];
	for (int i = 1; i < in->n; i++)
		dt = kl_promote_types(dt, in->dt[i]);
	return dt;
}

/* attention: q, k, v promoted; the lengths (a 4th operand) i32 or i64 */
static kl_dtype dt_attention(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (in->n == 4 && in->dt[3] != KL_I32 && in->dt[3] != KL_I64) {
		snprintf(why, cap, "lengths have dtype %s, need i32 or i64", kl_dtype_name(in->dt[3]));
		return KL_NDTYPES;
	}
	return kl_promote_types(kl_promote_types(in->dt[0], in->dt[1]), in->dt[2]);
}

/* the product takes operands of one dtype, not bool */
static kl_dtype dt_matmul(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (in->dt[0] != in->dt[1]) {
		snprintf(why, cap, "dtypes %s and %s differ", kl_dtype_name(in->dt[0]),
		         kl_dtype_name(in->dt[1]));
		return KL_NDTYPES;
	}
	if (in->dt[0] == KL_BOOL) {
		snprintf(why, cap, "dtype bool is not supported");
		return KL_NDTYPES;
	}
	return in->dt[0];
}

/* x's dtype, which must be a float (softmax, the norms) */
static kl_dtype dt_float_input(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (!kl_dtype_is_float(in->dt[0])) {
		snprintf(why, cap, "dtype %s is not floating point", kl_dtype_name(in->dt[0]));
		return KL_NDTYPES;
	}
	return in->dt[0];
}

/* index_add: base and src of one dtype, not bool; integer indices */
static kl_dtype dt_index_add(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (in->dt[1] != KL_I32 && in->dt[1] != KL_I64) {
		snprintf(why, cap, "indices have dtype %s, need i32 or i64", kl_dtype_name(in->dt[1]));
		return KL_NDTYPES;
	}
	if (in->dt[0] != in->dt[2] || !kl_dtype_is_float(in->dt[0])) {
		snprintf(why, cap, "base dtype %s and source dtype %s must be one floating-point dtype",
		         kl_dtype_name(in->dt[0]), kl_dtype_name(in->dt[2]));
		return KL_NDTYPES;
	}
	return in->dt[0];
}

bool kl__index_add_shapes_ok(int nd, const int64_t *out, int bnd, const int64_t *bs, int ind,
                             const int64_t *is, int snd, const int64_t *ss)
{
	bool ok = bnd >= 1 && nd == bnd && snd == ind + bnd - 1;
	for (int d = 0; ok && d < bnd; d++)
		ok = out[d] == bs[d];
	for (int d = 0; ok && d < ind; d++)
		ok = ss[d] == is[d];
	for (int d = 1; ok && d < bnd; d++)
		ok = ss[ind + d - 1] == bs[d];
	return ok;
}

static bool sh_index_add(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
                         size_t cap)
{
	if (kl__index_add_shapes_ok(n->ndim, n->shape, ndim[0], shape[0], ndim[1], shape[1],
	                            ndim[2], shape[2]))
		return true;
	char b1[96], b2[96], b3[96];
	snprintf(why, cap, "base %s, indices %s and source %s do not match (source must be the "
	         "indices' shape then the base's row dims, the result the base's shape)",
	         kl__shape_str(b1, sizeof b1, ndim[0], shape[0]),
	         kl__shape_str(b2, sizeof b2, ndim[1], shape[1]),
	         kl__shape_str(b3, sizeof b3, ndim[2], shape[2]));
	return false;
}

bool kl__cache_write_geom(int axis, int cnd, const int64_t *cs, int pnd, const int64_t *ps,
                          int vnd, const int64_t *vs, kl_cw_geom *g, char *why, size_t cap)
{
	char b1[96], b2[96], b3[96];
	memset(g, 0, sizeof *g);
	bool ok = cnd >= 2 && axis >= 1 && axis < cnd && vnd == cnd && pnd == 1;
	for (int d = 1; ok && d < cnd; d++)
		ok = d == axis || vs[d] == cs[d];
	ok = ok && vs[0] <= cs[0] && vs[axis] <= cs[axis] && ps[0] == vs[0];
	if (!ok) {
		snprintf(why, cap, "cache %s (position dim %d), positions %s and values %s do not fit "
		         "(the cache needs a row dim first and the position dim after it; values "
		         "are the cache's shape with at most its rows and positions; one position "
		         "per row of values)",
		         kl__shape_str(b1, sizeof b1, cnd, cs), axis,
		         kl__shape_str(b2, sizeof b2, pnd, ps), kl__shape_str(b3, sizeof b3, vnd, vs));
		return false;
	}
	g->rows = vs[0];
	g->R = cs[0];
	g->cap = cs[axis];
	g->s = vs[axis];
	g->outer = g->inner = 1;
	for (int d = 1; d < axis; d++)
		g->outer *= cs[d];
	for (int d = axis + 1; d < cnd; d++)
		g->inner *= cs[d];
	g->vrs = g->outer * g->s * g->inner;
	return true;
}

static kl_dtype dt_cache_write(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (in->dt[1] != KL_I32 && in->dt[1] != KL_I64) {
		snprintf(why, cap, "positions have dtype %s, need i32 or i64", kl_dtype_name(in->dt[1]));
		return KL_NDTYPES;
	}
	if (in->dt[0] != in->dt[2]) {
		snprintf(why, cap, "cache dtype %s and values dtype %s differ",
		         kl_dtype_name(in->dt[0]), kl_dtype_name(in->dt[2]));
		return KL_NDTYPES;
	}
	return in->dt[0];
}

static bool sh_cache_write(const kl_node *n, const int *ndim, const int64_t *const *shape,
                           char *why, size_t cap)
{
	kl_cw_geom g;
	if (!kl__cache_write_geom(n->a.axis, ndim[0], shape[0], ndim[1], shape[1], ndim[2],
	                          shape[2], &g, why, cap))
		return false;
	if (n->ndim == ndim[0] && !memcmp(n->shape, shape[0], sizeof(int64_t) * (size_t)n->ndim))
		return true;
	snprintf(why, cap, "the result is not the cache's shape");
	return false;
}

/* ---- vector-Jacobian rules of the movement ops ------------------------------------------ */

static kl_status one(int32_t *gin, int32_t v)
{
	gin[0] = v;
	return v < 0 ? KL_EINVAL : KL_OK;
}

/* x's shape, copied (g->nodes moves as builders append) */
static int shape_of(const kl_graph *g, int32_t x, int64_t *shape)
{
	memcpy(shape, g->nodes[x].shape, sizeof(int64_t) * KL_MAX_DIMS);
	return g->nodes[x].ndim;
}

static kl_status vjp_reshape(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t sh[KL_MAX_DIMS];
	int nd = shape_of(g, g->nodes[node].in[0], sh);
	return one(gin, kl__gb_reshape(g, go, nd, sh));
}

static kl_status vjp_permute(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int inv[KL_MAX_DIMS];
	for (int i = 0; i < g->nodes[node].ndim; i++)
		inv[g->nodes[node].a.v[i]] = i;
	return one(gin, kl__gb_permute(g, go, inv));
}

static kl_status vjp_expand(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int64_t sh[KL_MAX_DIMS];
	int nd = shape_of(g, g->nodes[node].in[0], sh);
	return one(gin, kl__gb_sum_to(g, go, nd, sh));
}

static kl_status vjp_identity(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	(void)g, (void)node;
	return one(gin, go);
}

/* zeros of x's shape with dim ax of size len */
static int32_t zeros_like_along(kl_graph *g, int32_t x, int ax, int64_t len)
{
	int64_t sh[KL_MAX_DIMS];
	int nd = shape_of(g, x, sh);
	sh[ax] = len;
	return kl__gb_full(g, (kl_dtype)g->nodes[x].dtype, nd, sh, 0.0);
}

/* The slice's gradient: go placed at start, start + step, ... of a zero
 * tensor of the input's shape. A stepped slice first interleaves go with
 * step - 1 zeros ([.., L, 1] beside [.., L, step-1], merged to L * step). */
static kl_status vjp_slice(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	const kl_node *n = &g->nodes[node];
	int ax = n->a.axis;
	int64_t start = n->a.v[0], step = n->a.v[2], len = n->shape[ax];
	int32_t x = n->in[0];
	int64_t size = g->nodes[x].shape[ax];
	if (len == 0) {
		int64_t sh[KL_MAX_DIMS];
		int nd = shape_of(g, x, sh);
		return one(gin, kl__gb_full(g, (kl_dtype)g->nodes[x].dtype, nd, sh, 0.0));
	}
	int32_t mid = go;
	int64_t span = len;
	if (step > 1) {
		int64_t sh[KL_MAX_DIMS + 1], zs[KL_MAX_DIMS + 1];
		int nd = shape_of(g, go, sh);
		if (nd + 1 > KL_MAX_DIMS)
			return KL_EUNSUPPORTED;
		memmove(sh + ax + 2, sh + ax + 1, sizeof(int64_t) * (size_t)(nd - ax - 1));
		sh[ax + 1] = 1;
		memcpy(zs, sh, sizeof zs);
		zs[ax + 1] = step - 1;
		int32_t parts[2] = {kl__gb_reshape(g, go, nd + 1, sh),
		                    kl__gb_full(g, (kl_dtype)g->nodes[go].dtype, nd + 1, zs, 0.0)};
		int32_t il = kl__gb_concat(g, 2, parts, ax + 1);
		int64_t ms[KL_MAX_DIMS];
		shape_of(g, go, ms);
		ms[ax] = len * step;
		span = len * step < size - start ? len * step : size - start;
		mid = kl__gb_slice(g, kl__gb_reshape(g, il, nd, ms), ax, 0, span, 1);
	}
	int32_t parts[3];
	int np = 0;
	if (start > 0)
		parts[np++] = zeros_like_along(g, x, ax, start);
	parts[np++] = mid;
	if (size - start - span > 0)
		parts[np++] = zeros_like_along(g, x, ax, size - start - span);
	return one(gin, np == 1 ? mid : kl__gb_concat(g, np, parts, ax));
}

static kl_status vjp_concat(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	int ax = g->nodes[node].a.axis, nin = g->nodes[node].nin;
	int64_t off = 0;
	for (int k = 0; k < nin; k++) {
		int64_t len = g->nodes[g->nodes[node].in[k]].shape[ax];
		gin[k] = kl__gb_slice(g, go, ax, off, off + len, 1);
		if (gin[k] < 0)
			return KL_EINVAL;
		off += len;
	}
	return KL_OK;
}

#define DESC(ID, EAGER, REF, ...)                                                              \
	const kl_opdesc kl__desc_##ID = {.ref = REF, .eager = EAGER, __VA_ARGS__};

DESC(INPUT, KL_EAGER_NONE, NULL)
DESC(FULL, KL_EAGER_SOURCE, kl__ref_source, .shape = sh_source)
DESC(ARANGE, KL_EAGER_SOURCE, kl__ref_source, .shape = sh_source)
DESC(RAND, KL_EAGER_SOURCE, kl__ref_source, .shape = sh_source)
DESC(RANDN, KL_EAGER_SOURCE, kl__ref_source, .shape = sh_source)

DESC(RESHAPE, KL_EAGER_VIEW, kl__ref_movement, .shape = sh_reshape, .vjp = vjp_reshape)
DESC(PERMUTE, KL_EAGER_VIEW, kl__ref_movement, .shape = sh_permute, .vjp = vjp_permute)
DESC(EXPAND, KL_EAGER_VIEW, kl__ref_movement, .shape = sh_expand, .vjp = vjp_expand)
DESC(SLICE, KL_EAGER_VIEW, kl__ref_movement, .shape = sh_slice, .vjp = vjp_slice)
DESC(CONCAT, KL_EAGER_COPY, kl__ref_movement, .dtype = dt_promote, .shape = sh_concat,
     .vjp = vjp_concat)
DESC(CONTIGUOUS, KL_EAGER_COPY, kl__ref_movement, .shape = sh_same, .vjp = vjp_identity)
DESC(GATHER, KL_EAGER_COPY, kl__ref_movement, .shape = sh_gather, .vjp = kl__vjp_gather)

DESC(MATMUL, KL_EAGER_MATMUL, kl__ref_matmul, .dtype = dt_matmul, .shape = sh_matmul,
     .vjp = kl__vjp_matmul)

DESC(SOFTMAX, KL_EAGER_ROWS, kl__ref_softmax, .dtype = dt_float_input, .shape = sh_same,
     .vjp = kl__vjp_softmax)
DESC(LOG_SOFTMAX, KL_EAGER_ROWS, kl__ref_softmax, .dtype = dt_float_input, .shape = sh_same,
     .vjp = kl__vjp_softmax)
DESC(LAYER_NORM, KL_EAGER_ROWS, kl__ref_norm, .dtype = dt_float_input, .shape = sh_norm,
     .vjp = kl__vjp_norm)
DESC(RMS_NORM, KL_EAGER_ROWS, kl__ref_norm, .dtype = dt_float_input, .shape = sh_norm,
     .vjp = kl__vjp_norm)
DESC(ATTENTION, KL_EAGER_SDPA, kl__ref_attention, .dtype = dt_attention, .shape = sh_attention,
     .vjp = kl__vjp_sdpa)
DESC(ATTENTION_BWD, KL_EAGER_SDPA, kl__ref_attention_bwd, .dtype = dt_attention_bwd,
     .shape = sh_attention_bwd, .vjp = NULL)
DESC(INDEX_ADD, KL_EAGER_COPY, kl__ref_index_add, .dtype = dt_index_add, .shape = sh_index_add,
     .vjp = kl__vjp_index_add)
/* a write of positions a program computes: not differentiable (.vjp NULL,
 * which the gradient sweep names) */
DESC(CACHE_WRITE, KL_EAGER_COPY, kl__ref_cache_write, .dtype = dt_cache_write,
     .shape = sh_cache_write, .vjp = NULL)
#undef DESC

/* ---- the table ---------------------------------------------------------------------- */

const kl_opdesc *const kl__opdesc[KL_NOPS] = {
#define KL_OP(ID, name, arity, cat) [KL_OP_##ID] = &kl__desc_##ID,
#include "graph/ops.def"
#undef KL_OP
};

/* ggml-style: a new op changes this count, and whoever changes it adds the
 * op's descriptor (op_*.c) and its entry in tests/test_optable.c's walk. */
_Static_assert(KL_NOPS == 57, "new op: give it a descriptor and a walk entry, then update");
_Static_assert(sizeof kl__opdesc / sizeof kl__opdesc[0] == KL_NOPS, "one descriptor per op");
