/* epilogue.c - which consumers of a matrix product can run as its epilogue.
 *
 * A library product computes C = act(alpha * A@B + beta * R + bias): cuBLASLt
 * does it in the GEMM's own epilogue, the CPU executor in one pass over C
 * after BLAS. This file classifies one consumer of the product's value (a
 * scale, a bias add, a residual add, an activation) and checks that its
 * other operand can be addressed the way both executors read it. The order
 * of the parts and the targets' limits are the scheduler's (fuse.c); the
 * program builder (lower.c) reads the same classification back.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "core/shape.h"
#include "lower/lower_int.h"

bool kl__stored_view(const kl_lctx *L, int32_t c, int32_t *base, int64_t *st, int64_t *off)
{
	const kl_node *x = kl__nd(L, c);
	if (L->mat[c]) {
		*base = c;
		kl__contig_strides(x->ndim, x->shape, st);
		*off = 0;
		return true;
	}
	/* a stored view inside the chain is a buffer of its own (dense, in its
	 * shape): the strides are in that buffer, not through to the bottom */
	for (int32_t v = c; kl__is_view((kl_op)kl__nd(L, v)->op); v = kl__nd(L, v)->in[0])
		if (v != c && L->mat[v])
			return kl__view_to(L, c, v, base, st, off);
	return kl__view_of(L, c, base, st, off);
}

kl_mm_act kl__epilogue_act(const kl_node *x)
{
	for (int a = KL_MM_ACT_NONE + 1; a < KL_MM_ACT_COUNT; a++)
		if (kl__mm_act_op[a] == (kl_op)x->op)
			return (kl_mm_act)a;
	return KL_MM_ACT_NONE;
}

static void fail(char *why, size_t cap, const char *fmt, ...) KL_PRINTF(3, 4);
static void fail(char *why, size_t cap, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, cap, fmt, ap);
	va_end(ap);
}

/* the bias or residual operand o of an add with the product p */
static kl_epart add_operand(const kl_lctx *L, int32_t o, const kl_node *p, char *why, size_t cap)
{
	const kl_node *on = kl__nd(L, o);
	char l[64], s1[96], s2[96];
	kl__node_label(L, o, l, sizeof l);
	if (on->dtype != p->dtype) {
		fail(why, cap, "its other operand %s is %s, the product %s", l,
		     kl_dtype_name((kl_dtype)on->dtype), kl_dtype_name((kl_dtype)p->dtype));
		return KL_EPART_NONE;
	}
	int32_t base;
	int64_t st[KL_MAX_DIMS], off;
	if (!kl__stored_view(L, o, &base, st, &off)) {
		fail(why, cap, "its other operand %s is not a strided view of a stored value", l);
		return KL_EPART_NONE;
	}
	for (int d = 0; d < on->ndim; d++)
		if (st[d] < 0) {
			fail(why, cap, "its other operand %s has a negative stride", l);
			return KL_EPART_NONE;
		}
	int nd = p->ndim;
	int64_t M = p->shape[nd - 2], N = p->shape[nd - 1];
	if (kl__shape_eq(on->ndim, on->shape, p->ndim, p->shape)) {
		if (N > 1 && st[nd - 1] != 1) {
			fail(why, cap, "the residual %s has column stride %lld (a unit stride is needed)",
			     l, (long long)st[nd - 1]);
			return KL_EPART_NONE;
		}
		if (M > 1 && st[nd - 2] < N) {
			fail(why, cap, "the residual %s has row stride %lld, below its %lld columns", l,
			     (long long)st[nd - 2], (long long)N);
			return KL_EPART_NONE;
		}
		return KL_EPART_RESID;
	}
	if (on->ndim >= 1 && on->ndim <= nd && on->shape[on->ndim - 1] == N &&
	    kl__numel(on->ndim, on->shape) == N) {
		if (N > 1 && st[on->ndim - 1] != 1) {
			fail(why, cap, "the bias %s has stride %lld (a unit stride is needed)", l,
			     (long long)st[on->ndim - 1]);
			return KL_EPART_NONE;
		}
		return KL_EPART_BIAS;
	}
	fail(why, cap, "its other operand %s %s is neither a [%lld] bias nor a residual of the "
	     "product's shape %s", l, kl__shape_str(s1, sizeof s1, on->ndim, on->shape),
	     (long long)N, kl__shape_str(s2, sizeof s2, p->ndim, p->shape));
	return KL_EPART_NONE;
}

kl_epart kl__epilogue_part(const kl_lctx *L, int32_t n, int32_t prev, int32_t *other, char *why,
                           size_t cap)
{
	const kl_node *x = kl__nd(L, n), *p = kl__nd(L, prev);
	char s1[96];
	int slot = -1, uses = 0;
	*other = -1;
	for (int i = 0; i < x->nin; i++)
		if (x->in[i] == prev) {
			slot = i;
			uses++;
		}
	if (slot < 0) {
		fail(why, cap, "it reads the product through a view");
		return KL_EPART_NONE;
	}
	if (uses > 1) {
		fail(why, cap, "it reads the product twice");
		return KL_EPART_NONE;
	}
	if (!kl__shape_eq(x->ndim, x->shape, p->ndim, p->shape)) {
		fail(why, cap, "it broadcasts the product to %s",
		     kl__shape_str(s1, sizeof s1, x->ndim, x->shape));
		return KL_EPART_NONE;
	}
	if (x->dtype != p->dtype) {
		fail(why, cap, "it computes %s, the product is %s", kl_dtype_name((kl_dtype)x->dtype),
		     kl_dtype_name((kl_dtype)p->dtype));
		return KL_EPART_NONE;
	}
	switch (x->op) {
	case KL_OP_MUL:
		if (!x->a.scalar_rhs) {
			fail(why, cap, "it multiplies by a tensor, not by a scalar");
			return KL_EPART_NONE;
		}
		if (!isfinite(x->a.s[0])) {
			fail(why, cap, "its scale %g is not finite", x->a.s[0]);
			return KL_EPART_NONE;
		}
		return KL_EPART_ALPHA;
	case KL_OP_ADD: {
		if (x->a.scalar_rhs) {
			fail(why, cap, "it adds a scalar, which no epilogue holds");
			return KL_EPART_NONE;
		}
		int32_t o = x->in[1 - slot];
		kl_epart k = add_operand(L, o, p, why, cap);
		if (k != KL_EPART_NONE)
			*other = o;
		return k;
	}
	default:
		if (kl__epilogue_act(x) != KL_MM_ACT_NONE)
			return KL_EPART_ACT;
		fail(why, cap, "%s is not a scale, bias, residual or activation (relu, gelu, gelu_tanh)",
		     kl__ops[x->op].name);
		return KL_EPART_NONE;
	}
}
