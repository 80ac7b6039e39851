/* op_other.c - the descriptors of the ops that are not pointwise or
 * reductions: sources, movement (views and copies), the matrix product, and
 * the composites that lowering decomposes (softmax, log_softmax, the norms)
 * or rewrites (attention). Their public builders in api/ops.c set their
 * result dtype and shape from attributes; their reference evaluation is in
 * reference.c, one function per family.
 */
#include <stdio.h>

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

#define DESC(ID, EAGER, REF, ...)                                                              \
	const kl_opdesc kl__desc_##ID = {.ref = REF, .eager = EAGER, __VA_ARGS__};

DESC(INPUT, KL_EAGER_NONE, NULL)
DESC(FULL, KL_EAGER_SOURCE, kl__ref_source)
DESC(ARANGE, KL_EAGER_SOURCE, kl__ref_source)
DESC(RAND, KL_EAGER_SOURCE, kl__ref_source)
DESC(RANDN, KL_EAGER_SOURCE, kl__ref_source)

DESC(RESHAPE, KL_EAGER_VIEW, kl__ref_movement)
DESC(PERMUTE, KL_EAGER_VIEW, kl__ref_movement)
DESC(EXPAND, KL_EAGER_VIEW, kl__ref_movement)
DESC(SLICE, KL_EAGER_VIEW, kl__ref_movement)
DESC(CONCAT, KL_EAGER_COPY, kl__ref_movement, .dtype = dt_promote)
DESC(CONTIGUOUS, KL_EAGER_COPY, kl__ref_movement)
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
