/* grad_other.c - the vector-Jacobian rules of the matrix product, the
 * composites (softmax, log_softmax, layer_norm, rms_norm, sdpa) and
 * gather / index_add, in kiln's own graph ops (graph/build.h), so that a
 * backward graph lowers and fuses like any other.
 *
 * Each rule reads the forward node's inputs and, where the math is cheaper
 * from it, its output (softmax, log_softmax, sdpa's row term); the norms'
 * statistics and sdpa's probabilities are recomputed, not saved. Half
 * precision composites compute in f32 and round once, as their forward
 * decompositions do; every gradient has the dtype of the input it is for.
 */
#include <math.h>

#include "graph/build.h"
#include "graph/optable.h"

/* the dtype a composite over dt computes in */
static kl_dtype work_dt(kl_dtype dt)
{
	return dt == KL_F16 || dt == KL_BF16 ? KL_F32 : dt;
}

/* x as dtype dt (x itself when it has it) */
static int32_t as_dt(kl_graph *g, int32_t x, kl_dtype dt)
{
	if (x < 0 || g->nodes[x].dtype == dt)
		return x;
	return kl__gb_cast(g, x, dt);
}

static int32_t bin(kl_graph *g, kl_op op, int32_t a, int32_t b)
{
	return a < 0 || b < 0 ? -1 : kl__gb_binary(g, op, a, b);
}

static int32_t scal(kl_graph *g, kl_op op, int32_t a, double s)
{
	return a < 0 ? -1 : kl__gb_scalar(g, op, a, s);
}

/* sum (or mean: times 1/len) over one axis, kept */
static int32_t row_sum(kl_graph *g, int32_t x, int axis)
{
	return x < 0 ? -1 : kl__gb_reduce(g, KL_OP_SUM, x, 1u << axis, true);
}

static int32_t row_mean(kl_graph *g, int32_t x, int axis)
{
	if (x < 0)
		return -1;
	int64_t len = g->nodes[x].shape[axis];
	return scal(g, KL_OP_MUL, row_sum(g, x, axis), len > 0 ? 1.0 / (double)len : INFINITY);
}

/* x with its last two dims swapped (a view) */
static int32_t transpose_last(kl_graph *g, int32_t x)
{
	if (x < 0)
		return -1;
	int nd = g->nodes[x].ndim, perm[KL_MAX_DIMS];
	for (int d = 0; d < nd; d++)
		perm[d] = d;
	perm[nd - 2] = nd - 1;
	perm[nd - 1] = nd - 2;
	return kl__gb_permute(g, x, perm);
}

static kl_status done(int n, const int32_t *gin, const bool *want)
{
	for (int i = 0; i < n; i++)
		if (want[i] && gin[i] < 0)
			return KL_ENOMEM; /* a builder failed: g could not grow */
	return KL_OK;
}

/* x, or where x is a norm's output, the norm again (a node of its own):
 * a product's operand that a norm made (the DecoderLayer's two) is read
 * again by the product's weight gradient, late in the backward; computing
 * it again there from the norm's input, which the norm's own gradient keeps
 * anyway, costs one pass over the rows and frees the forward's copy after
 * the forward's product (train_decoder 4x1024x2048 bf16: 33.6 MB fewer at
 * the step's peak; torch's partitioner recomputes norms the same way). */
static int32_t norm_again(kl_graph *g, int32_t x)
{
	if (x < 0 || (g->nodes[x].op != KL_OP_RMS_NORM && g->nodes[x].op != KL_OP_LAYER_NORM))
		return x;
	kl_node c = g->nodes[x];
	/* one recomputation for every product that reads it (gate and up) */
	for (int32_t i = x + 1; i < g->n; i++)
		if (!memcmp(&g->nodes[i], &c, sizeof c))
			return i;
	return kl__graph_add(g, &c);
}

/* C = A @ B: dA = dC @ B^T, dB = A^T @ dC (batch dims equal in the node;
 * the expand the front end added sums them back). Integer products have
 * no gradient. */
kl_status kl__vjp_matmul(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	gin[0] = gin[1] = -1;
	if (!kl_dtype_is_float((kl_dtype)n.dtype))
		return KL_OK;
	int32_t dc = as_dt(g, gout, (kl_dtype)n.dtype);
	gin[0] = kl__gb_matmul(g, dc, transpose_last(g, n.in[1]));
	gin[1] = kl__gb_matmul(g, transpose_last(g, norm_again(g, n.in[0])), dc);
	return done(2, gin, (const bool[]){true, true});
}

/* softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy),
 * both along attrs.axis, from the saved output y */
kl_status kl__vjp_softmax(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	kl_dtype D = (kl_dtype)n.dtype, C = work_dt(D);
	int ax = n.a.axis;
	int32_t y = as_dt(g, node, C), dy = as_dt(g, gout, C), dx;
	if (n.op == KL_OP_SOFTMAX)
		dx = bin(g, KL_OP_MUL, y,
		         bin(g, KL_OP_SUB, dy, row_sum(g, bin(g, KL_OP_MUL, dy, y), ax)));
	else
		dx = bin(g, KL_OP_SUB, dy,
		         bin(g, KL_OP_MUL, y < 0 ? -1 : kl__gb_unary(g, KL_OP_EXP, y),
		             row_sum(g, dy, ax)));
	gin[0] = as_dt(g, dx, (kl_dtype)g->nodes[n.in[0]].dtype);
	return done(1, gin, (const bool[]){true});
}

/* x [..., D] summed over every dim but the last, to [D] (no reshape after:
 * the sums are stored as they are, and sibling sums share a kernel) */
static int32_t over_rows(kl_graph *g, int32_t x)
{
	if (x < 0 || g->nodes[x].ndim < 2)
		return x;
	uint32_t lead = (1u << (g->nodes[x].ndim - 1)) - 1;
	return kl__gb_reduce(g, KL_OP_SUM, x, lead, false);
}

/* layer_norm / rms_norm over the last dim D, statistics recomputed:
 *   xhat = (x - mean) * r (rms: x * r), r = rsqrt(mean((x - mean)^2) + eps)
 *   h = dy * w (dy without a weight)
 *   dx = r * (h - mean(h) - xhat * mean(h * xhat))   (rms: no mean(h) term)
 *   dw = sum over the rows of dy * xhat, db = sum over the rows of dy */
kl_status kl__vjp_norm(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	kl_dtype D = (kl_dtype)n.dtype, C = work_dt(D);
	bool ln = n.op == KL_OP_LAYER_NORM;
	int ax = n.ndim - 1, k = 1;
	int32_t w = -1, b = -1;
	if (n.a.flags & KL_F_HAS_WEIGHT)
		w = n.in[k++];
	if (ln && (n.a.flags & KL_F_HAS_BIAS))
		b = n.in[k++];
	int32_t x = as_dt(g, n.in[0], C), dy = as_dt(g, gout, C);
	int32_t z = ln ? bin(g, KL_OP_SUB, x, row_mean(g, x, ax)) : x;
	int32_t ms = row_mean(g, bin(g, KL_OP_MUL, z, z), ax);
	int32_t r = scal(g, KL_OP_ADD, ms, n.a.s[0]);
	r = r < 0 ? -1 : kl__gb_unary(g, KL_OP_RSQRT, r);
	int32_t xhat = bin(g, KL_OP_MUL, z, r);
	int32_t h = w >= 0 ? bin(g, KL_OP_MUL, dy, as_dt(g, w, C)) : dy;
	int32_t t = bin(g, KL_OP_MUL, xhat, row_mean(g, bin(g, KL_OP_MUL, h, xhat), ax));
	int32_t u = ln ? bin(g, KL_OP_SUB, bin(g, KL_OP_SUB, h, row_mean(g, h, ax)), t)
	               : bin(g, KL_OP_SUB, h, t);
	gin[0] = as_dt(g, bin(g, KL_OP_MUL, u, r), (kl_dtype)g->nodes[n.in[0]].dtype);
	bool want[3] = {true, false, false};
	k = 1;
	if (w >= 0) {
		gin[k] = as_dt(g, over_rows(g, bin(g, KL_OP_MUL, dy, xhat)), (kl_dtype)g->nodes[w].dtype);
		want[k++] = true;
	}
	if (b >= 0) {
		gin[k] = as_dt(g, over_rows(g, dy), (kl_dtype)g->nodes[b].dtype);
		want[k++] = true;
	}
	return done(k, gin, want);
}

/* sdpa's gradient in primitives, P recomputed and materialized, in dtype C
 * (f32 for half types): dv = P^T do, dP = do v^T, dS = P * (dP - rowsum(do *
 * o)) (the softmax rule, its row term from the saved output), dq = s * dS k,
 * dk = s * dS^T q. Masked keys have P = 0, so dS is 0 there; a query with no
 * allowed key is NaN in the forward and in its gradients. The rule's
 * fallback where the fused op does not apply, and lowering's expansion of
 * that op where the target has no step for it (kl__sdpa_bwd_primitives).
 * lens: the per-batch key lengths (kl_sdpa_lengths) or -1. */
static void sdpa_bwd_prims(kl_graph *g, double s, bool causal, int nd, kl_dtype C,
                           const int32_t *in, int32_t lens, int32_t *gin)
{
	int32_t q = as_dt(g, in[0], C), k = as_dt(g, in[1], C), v = as_dt(g, in[2], C);
	int32_t o = as_dt(g, in[3], C), dout = as_dt(g, in[4], C);
	int32_t sc = scal(g, KL_OP_MUL, kl__gb_matmul(g, q, transpose_last(g, k)), s);
	int32_t valid = -1;
	if (sc >= 0 && lens >= 0) {
		/* the mask of graph/ops.def: key j < L (j + tq - i < L + 1 when
		 * causal); the values past L zeroed (they may be anything) */
		int64_t tq = g->nodes[sc].shape[nd - 2], tk = g->nodes[sc].shape[nd - 1];
		int64_t ksh[KL_MAX_DIMS], lsh[KL_MAX_DIMS], qsh[KL_MAX_DIMS], vsh[KL_MAX_DIMS];
		for (int d = 0; d < nd; d++)
			ksh[d] = lsh[d] = qsh[d] = vsh[d] = 1;
		ksh[nd - 1] = vsh[nd - 2] = tk;
		qsh[nd - 2] = tq;
		lsh[0] = g->nodes[in[0]].shape[0];
		kl_node ar;
		memset(&ar, 0, sizeof ar);
		ar.op = KL_OP_ARANGE;
		ar.dtype = KL_I64;
		ar.ndim = 1;
		ar.a.s[1] = 1;
		ar.shape[0] = tk;
		int32_t j = kl__gb_node(g, &ar);
		int32_t len = as_dt(g, lens, KL_I64);
		len = len < 0 ? -1 : kl__gb_reshape(g, len, nd, lsh);
		int32_t lhs = j < 0 ? -1 : kl__gb_reshape(g, j, nd, ksh), lim = len;
		if (causal) {
			ar.shape[0] = tq;
			int32_t i = kl__gb_node(g, &ar);
			i = i < 0 ? -1 : kl__gb_reshape(g, i, nd, qsh);
			lhs = bin(g, KL_OP_SUB, scal(g, KL_OP_ADD, lhs, (double)tq), i);
			lim = scal(g, KL_OP_ADD, len, 1);
		}
		valid = bin(g, KL_OP_LT, lhs, lim);
		int32_t kv = bin(g, KL_OP_LT, j < 0 ? -1 : kl__gb_reshape(g, j, nd, vsh), len);
		int32_t ninf = kl__gb_full(g, C, 0, NULL, -INFINITY);
		int32_t zero = kl__gb_full(g, C, 0, NULL, 0);
		sc = valid < 0 || ninf < 0 ? -1 : kl__gb_where(g, valid, sc, ninf);
		v = kv < 0 || v < 0 || zero < 0 ? -1 : kl__gb_where(g, kv, v, zero);
	} else if (sc >= 0 && causal) {
		int64_t tq = g->nodes[sc].shape[nd - 2], tk = g->nodes[sc].shape[nd - 1];
		kl_node ar;
		memset(&ar, 0, sizeof ar);
		ar.op = KL_OP_ARANGE;
		ar.dtype = KL_I64;
		ar.ndim = 1;
		ar.a.s[1] = 1;
		ar.shape[0] = tq;
		int32_t i = kl__gb_node(g, &ar);
		ar.shape[0] = tk;
		int32_t j = kl__gb_node(g, &ar);
		/* key j allowed for query i iff j <= i + (tk - tq) */
		int64_t col[2] = {tq, 1};
		i = i < 0 ? -1 : scal(g, KL_OP_ADD, kl__gb_reshape(g, i, 2, col), (double)(tk - tq));
		int32_t allowed = bin(g, KL_OP_GE, i, j);
		int32_t ninf = kl__gb_full(g, C, 0, NULL, -INFINITY);
		sc = allowed < 0 || ninf < 0 ? -1 : kl__gb_where(g, allowed, sc, ninf);
	}
	int32_t p = -1;
	if (sc >= 0) {
		kl_node sm = g->nodes[sc];
		sm.op = KL_OP_SOFTMAX;
		sm.nin = 1;
		sm.in[0] = sc;
		memset(&sm.a, 0, sizeof sm.a);
		sm.a.axis = nd - 1;
		p = kl__gb_node(g, &sm);
		if (valid >= 0) /* a row with no key: p 0, not NaN */
			p = p < 0 ? -1
			          : kl__gb_where(g, valid, p, kl__gb_full(g, C, 0, NULL, 0));
	}
	int32_t dp = kl__gb_matmul(g, dout, transpose_last(g, v));
	int32_t rowt = row_sum(g, bin(g, KL_OP_MUL, dout, o), nd - 1);
	int32_t ds = bin(g, KL_OP_MUL, p, bin(g, KL_OP_SUB, dp, rowt));
	gin[0] = scal(g, KL_OP_MUL, kl__gb_matmul(g, ds, k), s);
	gin[1] = scal(g, KL_OP_MUL, kl__gb_matmul(g, transpose_last(g, ds), q), s);
	gin[2] = kl__gb_matmul(g, transpose_last(g, p), dout);
}

int32_t kl__sdpa_bwd_primitives(kl_graph *g, const kl_node *bwd)
{
	if (bwd->op != KL_OP_ATTENTION_BWD || bwd->nin != 5 || bwd->ndim < 2)
		return -1;
	kl_dtype D = (kl_dtype)bwd->dtype;
	int32_t gin[3], in[5];
	memcpy(in, bwd->in, sizeof in);
	sdpa_bwd_prims(g, bwd->a.s[0], (bwd->a.flags & KL_F_CAUSAL) != 0, bwd->ndim, work_dt(D), in,
	               -1, gin);
	for (int i = 0; i < 3; i++)
		if ((gin[i] = as_dt(g, gin[i], D)) < 0)
			return -1;
	return kl__gb_concat(g, 3, gin, bwd->ndim - 2);
}

/* o = softmax(q k^T * s [masked]) v. Where q, k and v have the output's
 * float dtype, v's head dim is q's and no lengths mask the keys, one sdpa_bwd node (ops.def) whose
 * packed result is sliced into dq, dk, dv: the backends' fused backward
 * (nothing [..., Tq, Tk] is stored); else the primitives above. */
kl_status kl__vjp_sdpa(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	kl_dtype D = (kl_dtype)n.dtype;
	int nd = n.ndim;
	const kl_node *q = &g->nodes[n.in[0]], *k = &g->nodes[n.in[1]], *v = &g->nodes[n.in[2]];
	bool fused = n.nin == 3 && kl_dtype_is_float(D) && nd >= 2 && q->dtype == D && k->dtype == D &&
	             v->dtype == D && q->shape[nd - 1] == v->shape[nd - 1];
	if (fused) {
		int64_t tq = q->shape[nd - 2], tk = k->shape[nd - 2];
		kl_node b = n;
		b.op = KL_OP_ATTENTION_BWD;
		b.nin = 5;
		b.in[3] = node;
		b.in[4] = as_dt(g, gout, D);
		b.shape[nd - 2] = tq + 2 * tk;
		b.a.flags = n.a.flags & KL_F_CAUSAL;
		int32_t p = b.in[4] < 0 ? -1 : kl__gb_node(g, &b);
		int64_t cut[4] = {0, tq, tq + tk, tq + 2 * tk};
		for (int i = 0; i < 3; i++)
			gin[i] = p < 0 ? -1 : kl__gb_slice(g, p, nd - 2, cut[i], cut[i + 1], 1);
		return done(3, gin, (const bool[]){true, true, true});
	}
	int32_t in[5] = {n.in[0], n.in[1], n.in[2], node, gout};
	sdpa_bwd_prims(g, n.a.s[0], (n.a.flags & KL_F_CAUSAL) != 0, nd, work_dt(D), in,
	               n.nin == 4 ? n.in[3] : -1, gin);
	for (int i = 0; i < 3; i++)
		gin[i] = as_dt(g, gin[i], (kl_dtype)g->nodes[n.in[i]].dtype);
	if (n.nin == 4)
		gin[3] = -1; /* the lengths have none */
	return done(3, gin, (const bool[]){true, true, true});
}

/* out = table[idx]: dtable = index_add(zeros like table, idx, dout); the
 * indices have none */
kl_status kl__vjp_gather(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	const kl_node *t = &g->nodes[n.in[0]];
	gin[0] = gin[1] = -1;
	if (!kl_dtype_is_float((kl_dtype)t->dtype))
		return KL_OK;
	int32_t z = kl__gb_full(g, (kl_dtype)t->dtype, t->ndim, t->shape, 0.0);
	int32_t src = as_dt(g, gout, (kl_dtype)g->nodes[n.in[0]].dtype);
	if (z >= 0 && src >= 0) {
		kl_node ia = g->nodes[z];
		ia.op = KL_OP_INDEX_ADD;
		ia.nin = 3;
		ia.in[0] = z;
		ia.in[1] = n.in[1];
		ia.in[2] = src;
		memset(&ia.a, 0, sizeof ia.a);
		gin[0] = kl__gb_node(g, &ia);
	}
	return done(1, gin, (const bool[]){true});
}

/* out = index_add(base, idx, src): dbase = dout, dsrc = dout[idx] */
kl_status kl__vjp_index_add(kl_graph *g, int32_t node, int32_t gout, int32_t *gin)
{
	kl_node n = g->nodes[node];
	int32_t dout = as_dt(g, gout, (kl_dtype)n.dtype);
	gin[0] = dout;
	gin[1] = -1;
	gin[2] = -1;
	if (dout >= 0) {
		const kl_node *src = &g->nodes[n.in[2]];
		kl_node ga;
		memset(&ga, 0, sizeof ga);
		ga.op = KL_OP_GATHER;
		ga.dtype = n.dtype;
		ga.ndim = src->ndim;
		memcpy(ga.shape, src->shape, sizeof ga.shape);
		ga.nin = 2;
		ga.in[0] = dout;
		ga.in[1] = n.in[1];
		gin[2] = kl__gb_node(g, &ga);
	}
	return done(3, gin, (const bool[]){true, false, true});
}
