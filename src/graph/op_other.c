/* op_other.c - the descriptors of the ops that are not pointwise or
 * reductions: sources, movement (views and copies), the matrix product, and
 * the composites that lowering decomposes (softmax, log_softmax, the norms)
 * or rewrites (attention). Their public builders in api/ops.c set their
 * result dtype and shape from attributes; their reference evaluation is in
 * reference.c, one function per family.
 */
#include <stdio.h>

#include <string.h>

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

/* the promoted type of the operands (concat casts each to it; attention's
 * q, k, v take no 0-dim operands) */
static kl_dtype dt_promote(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	kl_dtype dt = in->dt[0];
	for (int i = 1; i < in->n; i++)
		dt = kl_promote_types(dt, in->dt[i]);
	return dt;
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
DESC(FULL, KL_EAGER_SOURCE, kl__ref_source)
DESC(ARANGE, KL_EAGER_SOURCE, kl__ref_source)
DESC(RAND, KL_EAGER_SOURCE, kl__ref_source)
DESC(RANDN, KL_EAGER_SOURCE, kl__ref_source)

DESC(RESHAPE, KL_EAGER_VIEW, kl__ref_movement, .vjp = vjp_reshape)
DESC(PERMUTE, KL_EAGER_VIEW, kl__ref_movement, .vjp = vjp_permute)
DESC(EXPAND, KL_EAGER_VIEW, kl__ref_movement, .vjp = vjp_expand)
DESC(SLICE, KL_EAGER_VIEW, kl__ref_movement, .vjp = vjp_slice)
DESC(CONCAT, KL_EAGER_COPY, kl__ref_movement, .dtype = dt_promote, .vjp = vjp_concat)
DESC(CONTIGUOUS, KL_EAGER_COPY, kl__ref_movement, .vjp = vjp_identity)
DESC(GATHER, KL_EAGER_COPY, kl__ref_movement, .vjp = kl__vjp_gather)

DESC(MATMUL, KL_EAGER_MATMUL, kl__ref_matmul, .dtype = dt_matmul, .shape = sh_matmul,
     .vjp = kl__vjp_matmul)

DESC(SOFTMAX, KL_EAGER_ROWS, kl__ref_softmax, .dtype = dt_float_input, .vjp = kl__vjp_softmax)
DESC(LOG_SOFTMAX, KL_EAGER_ROWS, kl__ref_softmax, .dtype = dt_float_input,
     .vjp = kl__vjp_softmax)
DESC(LAYER_NORM, KL_EAGER_ROWS, kl__ref_norm, .dtype = dt_float_input, .vjp = kl__vjp_norm)
DESC(RMS_NORM, KL_EAGER_ROWS, kl__ref_norm, .dtype = dt_float_input, .vjp = kl__vjp_norm)
DESC(ATTENTION, KL_EAGER_SDPA, kl__ref_attention, .dtype = dt_promote, .vjp = kl__vjp_sdpa)
DESC(INDEX_ADD, KL_EAGER_COPY, kl__ref_index_add, .dtype = dt_index_add, .shape = sh_index_add,
     .vjp = kl__vjp_index_add)
#undef DESC

/* ---- the table ---------------------------------------------------------------------- */

const kl_opdesc *const kl__opdesc[KL_NOPS] = {
#define KL_OP(ID, name, arity, cat) [KL_OP_##ID] = &kl__desc_##ID,
#include "graph/ops.def"
#undef KL_OP
};

/* ggml-style: a new op changes this count, and whoever changes it adds the
 * op's descriptor (op_*.c) and its entry in tests/test_optable.c's walk. */
_Static_assert(KL_NOPS == 55, "new op: give it a descriptor and a walk entry, then update");
_Static_assert(sizeof kl__opdesc / sizeof kl__opdesc[0] == KL_NOPS, "one descriptor per op");
