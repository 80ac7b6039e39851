/* build.c - the node builders of build.h: one node appended to a graph, its
 * shape and dtype inferred by the rules the public ops follow (core/shape.h
 * for broadcasting and slices, the op table's dtype rules for promotion).
 *
 * Every builder takes -1 for an input as "an earlier builder failed" and
 * returns -1 itself, so a rule can chain builders and test only the last
 * result. Each node is held to its descriptor's shape rule before it is
 * added: a rule that builds a malformed node fails there, not in lowering.
 */
#include <stdio.h>
#include <string.h>

#include "graph/build.h"
#include "graph/optable.h"

static bool valid(const kl_graph *g, int32_t i)
{
	return i >= 0 && i < g->n;
}

static const kl_node *at(const kl_graph *g, int32_t i)
{
	return &g->nodes[i];
}

static void proto_init(kl_node *n, kl_op op, kl_dtype dt, int ndim, const int64_t *shape, int nin)
{
	memset(n, 0, sizeof *n);
	n->op = (uint16_t)op;
	n->dtype = (uint8_t)dt;
	n->ndim = (uint8_t)ndim;
	n->nin = (uint8_t)nin;
	if (ndim > 0)
		memcpy(n->shape, shape, (size_t)ndim * sizeof *shape);
}

/* A copy of a caller's shape: it may point into g->nodes, which any append
 * moves. false for a bad ndim or a NULL shape with dims. */
static bool copy_shape(int ndim, const int64_t *shape, int64_t *out)
{
	if (ndim < 0 || ndim > KL_MAX_DIMS || (ndim > 0 && !shape))
		return false;
	memset(out, 0, sizeof(int64_t) * KL_MAX_DIMS);
	if (ndim > 0)
		memcpy(out, shape, sizeof(int64_t) * (size_t)ndim);
	return true;
}

/* Append n after checking its inputs and its descriptor's shape rule. */
static int32_t add(kl_graph *g, const kl_node *n)
{
	if (n->ndim > KL_MAX_DIMS || n->dtype >= KL_NDTYPES ||
	    kl__shape_check(n->ndim, n->shape, NULL) != KL_SHAPE_OK)
		return -1;
	int nd[KL_NODE_MAX_IN];
	const int64_t *sh[KL_NODE_MAX_IN];
	for (int i = 0; i < n->nin; i++) {
		if (!valid(g, n->in[i]))
			return -1;
		nd[i] = at(g, n->in[i])->ndim;
		sh[i] = at(g, n->in[i])->shape;
	}
	const kl_opdesc *d = kl__opdesc[n->op];
	char why[256];
	if (d->shape && !d->shape(n, nd, sh, why, sizeof why))
		return -1;
	kl_node c = *n;
	for (int dd = c.ndim; dd < KL_MAX_DIMS; dd++)
		c.shape[dd] = 0;
	memset(c.strides, 0, sizeof c.strides);
	for (int i = c.nin; i < KL_NODE_MAX_IN; i++)
		c.in[i] = 0;
	return kl__graph_add(g, &c);
}

/* The op's dtype rule over nodes in[0..n) and numbers sc[0..ns). */
static kl_dtype rule(const kl_graph *g, kl_op op, int n, const int32_t *in, int ns,
                     const double *sc)
{
	kl_operands o = {.n = n, .nscalar = ns};
	for (int i = 0; i < n; i++) {
		o.dt[i] = (kl_dtype)at(g, in[i])->dtype;
		o.ndim[i] = at(g, in[i])->ndim;
	}
	for (int i = 0; i < ns; i++)
		o.scalar[i] = sc[i];
	char why[160];
	return kl__opdesc[op]->dtype(op, &o, why, sizeof why);
}

/* An operand wider than the dtype the op computes in (a 0-dim f32 beside an
 * f16 tensor) is cast to it first, as api/ops.c does for the public ops:
 * backends then see operands no wider than their result. */
static int32_t narrow_to(kl_graph *g, int32_t a, kl_dtype common)
{
	kl_dtype dt = (kl_dtype)at(g, a)->dtype;
	if (dt == common || kl_promote_types(dt, common) == common)
		return a;
	return kl__gb_cast(g, a, common);
}

/* Pointwise node over the broadcast of in[0..nin). */
static int32_t pointwise(kl_graph *g, kl_op op, kl_dtype dt, kl_dtype common, int nin,
                         const int32_t *in0)
{
	int32_t in[3];
	int nd = 0;
	int64_t shape[KL_MAX_DIMS] = {0};
	for (int i = 0; i < nin; i++) {
		in[i] = in0[i];
		const kl_node *x = at(g, in[i]);
		int tn;
		int64_t t[KL_MAX_DIMS];
		if (i == 0) {
			nd = x->ndim;
			memcpy(shape, x->shape, sizeof shape);
			continue;
		}
		if (!kl__broadcast(nd, shape, x->ndim, x->shape, &tn, t))
			return -1;
		nd = tn;
		memcpy(shape, t, sizeof t);
	}
	/* where's condition is not an operand of the arithmetic */
	for (int i = op == KL_OP_WHERE ? 1 : 0; i < nin; i++) {
		in[i] = narrow_to(g, in[i], common);
		if (in[i] < 0)
			return -1;
	}
	kl_node n;
	proto_init(&n, op, dt, nd, shape, nin);
	memcpy(n.in, in, sizeof(int32_t) * (size_t)nin);
	return add(g, &n);
}

int32_t kl__gb_unary(kl_graph *g, kl_op op, int32_t a)
{
	if (!valid(g, a) || kl__ops[op].arity != 1 || !kl__op_pointwise(op) || op == KL_OP_CAST ||
	    op == KL_OP_CLAMP)
		return -1;
	kl_dtype dt = rule(g, op, 1, &a, 0, NULL);
	if (dt == KL_NDTYPES)
		return -1;
	kl_node n;
	proto_init(&n, op, dt, at(g, a)->ndim, at(g, a)->shape, 1);
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_binary(kl_graph *g, kl_op op, int32_t a, int32_t b)
{
	kl_cat cat = kl__ops[op].cat;
	if (!valid(g, a) || !valid(g, b) || (cat != KL_CAT_BINARY && cat != KL_CAT_COMPARE))
		return -1;
	int32_t in[2] = {a, b};
	kl_dtype dt = rule(g, op, 2, in, 0, NULL);
	if (dt == KL_NDTYPES)
		return -1;
	/* a comparison computes in the operands' common dtype */
	kl_dtype common = dt;
	if (cat == KL_CAT_COMPARE) {
		kl_operands o = {.n = 2,
		                 .dt = {(kl_dtype)at(g, a)->dtype, (kl_dtype)at(g, b)->dtype},
		                 .ndim = {at(g, a)->ndim, at(g, b)->ndim}};
		common = kl__result_type(&o);
	}
	return pointwise(g, op, dt, common, 2, in);
}

int32_t kl__gb_scalar(kl_graph *g, kl_op op, int32_t a, double s)
{
	kl_cat cat = kl__ops[op].cat;
	if (!valid(g, a) || (cat != KL_CAT_BINARY && cat != KL_CAT_COMPARE))
		return -1;
	kl_dtype dt = rule(g, op, 1, &a, 1, &s);
	if (dt == KL_NDTYPES)
		return -1;
	kl_node n;
	proto_init(&n, op, dt, at(g, a)->ndim, at(g, a)->shape, 1);
	n.in[0] = a;
	n.a.scalar_rhs = 1;
	n.a.s[0] = s;
	return add(g, &n);
}

int32_t kl__gb_where(kl_graph *g, int32_t cond, int32_t a, int32_t b)
{
	if (!valid(g, cond) || !valid(g, a) || !valid(g, b))
		return -1;
	int32_t in[3] = {cond, a, b};
	kl_dtype dt = rule(g, KL_OP_WHERE, 3, in, 0, NULL);
	if (dt == KL_NDTYPES)
		return -1;
	return pointwise(g, KL_OP_WHERE, dt, dt, 3, in);
}

int32_t kl__gb_cast(kl_graph *g, int32_t a, kl_dtype dt)
{
	if (!valid(g, a) || (unsigned)dt >= KL_NDTYPES)
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_CAST, dt, at(g, a)->ndim, at(g, a)->shape, 1);
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_clamp(kl_graph *g, int32_t a, double lo, double hi)
{
	if (!valid(g, a) || lo != lo || hi != hi)
		return -1;
	double sc[2] = {lo, hi};
	kl_dtype dt = rule(g, KL_OP_CLAMP, 1, &a, 2, sc);
	if (dt == KL_NDTYPES)
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_CLAMP, dt, at(g, a)->ndim, at(g, a)->shape, 1);
	n.in[0] = a;
	n.a.s[0] = lo;
	n.a.s[1] = hi;
	return add(g, &n);
}

int32_t kl__gb_full(kl_graph *g, kl_dtype dt, int ndim, const int64_t *shape0, double value)
{
	int64_t shape[KL_MAX_DIMS];
	if ((unsigned)dt >= KL_NDTYPES || !copy_shape(ndim, shape0, shape))
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_FULL, dt, ndim, shape, 0);
	n.a.s[0] = value;
	return add(g, &n);
}

/* axes == 0 reduces every dim, as a node's attrs.axes means (see
 * kl__reduce_mask); argmax takes the lowest bit of axes as its axis. */
int32_t kl__gb_reduce(kl_graph *g, kl_op op, int32_t a, uint32_t axes, bool keepdim)
{
	if (!valid(g, a) || kl__ops[op].cat != KL_CAT_REDUCE)
		return -1;
	const kl_node *x = at(g, a);
	if (x->ndim < 32 && (axes >> x->ndim))
		return -1;
	uint32_t mask = axes ? axes : (x->ndim ? (1u << x->ndim) - 1 : 0);
	if (op == KL_OP_ARGMAX && x->ndim > 0)
		mask = mask & (~mask + 1u); /* the lowest bit */
	kl_dtype dt = rule(g, op, 1, &a, 0, NULL);
	if (dt == KL_NDTYPES)
		return -1;
	int64_t shape[KL_MAX_DIMS];
	int nd = 0;
	for (int d = 0; d < x->ndim; d++) {
		if (!(mask >> d & 1))
			shape[nd++] = x->shape[d];
		else if (keepdim)
			shape[nd++] = 1;
	}
	kl_node n;
	proto_init(&n, op, dt, nd, shape, 1);
	n.in[0] = a;
	n.a.axes = mask;
	n.a.keepdim = keepdim;
	if (op == KL_OP_ARGMAX)
		for (int d = 0; d < x->ndim; d++)
			if (mask >> d & 1)
				n.a.axis = d;
	return add(g, &n);
}

int32_t kl__gb_reshape(kl_graph *g, int32_t a, int ndim, const int64_t *shape0)
{
	int64_t shape[KL_MAX_DIMS];
	if (!valid(g, a) || !copy_shape(ndim, shape0, shape))
		return -1;
	const kl_node *x = at(g, a);
	if (kl__shape_check(ndim, shape, NULL) != KL_SHAPE_OK ||
	    kl__numel(ndim, shape) != kl__numel(x->ndim, x->shape))
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_RESHAPE, (kl_dtype)x->dtype, ndim, shape, 1);
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_permute(kl_graph *g, int32_t a, const int *perm)
{
	if (!valid(g, a))
		return -1;
	const kl_node *x = at(g, a);
	if (x->ndim > 0 && !perm)
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_PERMUTE, (kl_dtype)x->dtype, x->ndim, x->shape, 1);
	uint32_t seen = 0;
	for (int i = 0; i < x->ndim; i++) {
		int p = perm[i];
		if (p < 0 || p >= x->ndim || (seen >> p & 1))
			return -1;
		seen |= 1u << p;
		n.a.v[i] = p;
		n.shape[i] = x->shape[p];
	}
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_expand(kl_graph *g, int32_t a, int ndim, const int64_t *shape0)
{
	int64_t shape[KL_MAX_DIMS];
	if (!valid(g, a) || !copy_shape(ndim, shape0, shape))
		return -1;
	const kl_node *x = at(g, a);
	if (ndim < x->ndim)
		return -1;
	int lead = ndim - x->ndim;
	for (int i = 0; i < ndim; i++) {
		int j = i - lead;
		if (shape[i] < 0 || (j >= 0 && x->shape[j] != shape[i] && x->shape[j] != 1))
			return -1;
	}
	kl_node n;
	proto_init(&n, KL_OP_EXPAND, (kl_dtype)x->dtype, ndim, shape, 1);
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_slice(kl_graph *g, int32_t a, int axis, int64_t start, int64_t stop, int64_t step)
{
	if (!valid(g, a))
		return -1;
	const kl_node *x = at(g, a);
	if (axis < 0 || axis >= x->ndim || step < 1 || start < 0 || start > stop ||
	    stop > x->shape[axis])
		return -1;
	int64_t len;
	if (!kl__slice_len(x->shape[axis], &start, &stop, step, &len))
		return -1;
	kl_node n;
	proto_init(&n, KL_OP_SLICE, (kl_dtype)x->dtype, x->ndim, x->shape, 1);
	n.shape[axis] = len;
	n.a.axis = axis;
	/* the public op's form: a slice of at most one element never steps */
	if (len < 2) {
		stop = start + len;
		step = 1;
	}
	n.a.v[0] = start;
	n.a.v[1] = stop;
	n.a.v[2] = step;
	n.in[0] = a;
	return add(g, &n);
}

/* More inputs than a node holds become a chain, as kl_concat builds it. */
int32_t kl__gb_concat(kl_graph *g, int n, const int32_t *in, int axis)
{
	if (n < 1 || !in)
		return -1;
	for (int i = 0; i < n; i++)
		if (!valid(g, in[i]))
			return -1;
	const kl_node *x0 = at(g, in[0]);
	if (axis < 0 || axis >= x0->ndim)
		return -1;
	kl_dtype dt = (kl_dtype)x0->dtype;
	for (int i = 1; i < n; i++)
		dt = kl_promote_types(dt, (kl_dtype)at(g, in[i])->dtype);
	int32_t cur = -1;
	int i = 0;
	while (i < n) {
		int32_t args[KL_NODE_MAX_IN];
		int k = 0;
		if (cur >= 0)
			args[k++] = cur;
		while (k < KL_NODE_MAX_IN && i < n) {
			int32_t t = in[i++];
			if (at(g, t)->dtype != dt)
				t = kl__gb_cast(g, t, dt);
			if (t < 0)
				return -1;
			args[k++] = t;
		}
		x0 = at(g, args[0]);
		int64_t shape[KL_MAX_DIMS];
		memcpy(shape, x0->shape, sizeof shape);
		shape[axis] = 0;
		for (int j = 0; j < k; j++) {
			const kl_node *x = at(g, args[j]);
			if (x->ndim != x0->ndim)
				return -1;
			for (int d = 0; d < x0->ndim; d++)
				if (d != axis && x->shape[d] != x0->shape[d])
					return -1;
			shape[axis] += x->shape[axis];
		}
		kl_node nd;
		proto_init(&nd, KL_OP_CONCAT, dt, x0->ndim, shape, k);
		memcpy(nd.in, args, sizeof(int32_t) * (size_t)k);
		nd.a.axis = axis;
		cur = add(g, &nd);
		if (cur < 0)
			return -1;
	}
	return cur;
}

int32_t kl__gb_contiguous(kl_graph *g, int32_t a)
{
	if (!valid(g, a))
		return -1;
	const kl_node *x = at(g, a);
	kl_node n;
	proto_init(&n, KL_OP_CONTIGUOUS, (kl_dtype)x->dtype, x->ndim, x->shape, 1);
	n.in[0] = a;
	return add(g, &n);
}

int32_t kl__gb_matmul(kl_graph *g, int32_t a, int32_t b)
{
	if (!valid(g, a) || !valid(g, b))
		return -1;
	const kl_node *x = at(g, a), *y = at(g, b);
	if (x->ndim < 2 || x->ndim != y->ndim || x->dtype != y->dtype || x->dtype == KL_BOOL)
		return -1;
	int nd = x->ndim;
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, x->shape, sizeof shape);
	shape[nd - 1] = y->shape[nd - 1];
	kl_node n;
	proto_init(&n, KL_OP_MATMUL, (kl_dtype)x->dtype, nd, shape, 2);
	n.in[0] = a;
	n.in[1] = b;
	return add(g, &n); /* the shape rule checks K and the batch dims */
}

int32_t kl__gb_sum_to(kl_graph *g, int32_t x, int ndim, const int64_t *shape0)
{
	int64_t shape[KL_MAX_DIMS];
	if (!valid(g, x) || !copy_shape(ndim, shape0, shape))
		return -1;
	const kl_node *xn = at(g, x);
	int lead = xn->ndim - ndim;
	if (lead < 0)
		return -1;
	uint32_t axes = 0;
	for (int d = 0; d < xn->ndim; d++) {
		int j = d - lead;
		if (j < 0)
			axes |= 1u << d;
		else if (shape[j] == 1 && xn->shape[d] != 1)
			axes |= 1u << d;
		else if (shape[j] != xn->shape[d])
			return -1; /* not a broadcast of shape */
	}
	int32_t r = x;
	if (axes) {
		r = kl__gb_reduce(g, KL_OP_SUM, x, axes, true);
		if (r < 0)
			return -1;
	}
	if (!axes && lead == 0)
		return x;
	return kl__gb_reshape(g, r, ndim, shape);
}

int32_t kl__gb_node(kl_graph *g, const kl_node *proto)
{
	if (!proto || proto->op >= KL_NOPS || proto->nin > KL_NODE_MAX_IN)
		return -1;
	int ar = kl__ops[proto->op].arity;
	if (proto->op == KL_OP_ATTENTION) /* flags say whether lengths follow */
		ar = 3 + !!(proto->a.flags & KL_F_LENGTHS);
	if (ar >= 0 && proto->op != KL_OP_LAYER_NORM && proto->op != KL_OP_RMS_NORM &&
	    proto->nin != ar)
		return -1;
	return add(g, proto);
}
