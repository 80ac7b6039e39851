/* autodiff.c - the reverse sweep over a graph (see autodiff.h). */
#include <stdio.h>
#include <stdlib.h>

#include "graph/autodiff.h"
#include "graph/build.h"
#include "graph/optable.h"

const char *kl__node_desc(const kl_graph *g, int32_t i, char *buf, size_t cap)
{
	const kl_node *n = &g->nodes[i];
	char sh[192];
	snprintf(buf, cap, "node #%d, %s %s", (int)i, kl__shape_str(sh, sizeof sh, n->ndim, n->shape),
	         kl_dtype_name((kl_dtype)n->dtype));
	return buf;
}

static bool same_shape(const kl_node *a, const kl_node *b)
{
	if (a->ndim != b->ndim)
		return false;
	for (int d = 0; d < a->ndim; d++)
		if (a->shape[d] != b->shape[d])
			return false;
	return true;
}

/* contribution c to the gradient of node x, fitted to x: summed over the
 * dims a broadcast added, cast to x's dtype */
static int32_t fit(kl_graph *g, int32_t x, int32_t c)
{
	if (c < 0)
		return -1;
	if (!same_shape(&g->nodes[c], &g->nodes[x]))
		c = kl__gb_sum_to(g, c, g->nodes[x].ndim, g->nodes[x].shape);
	if (c >= 0 && g->nodes[c].dtype != g->nodes[x].dtype)
		c = kl__gb_cast(g, c, (kl_dtype)g->nodes[x].dtype);
	return c;
}

/* a fill of zeros: what a slice's gradient puts around its values */
static bool is_zeros(const kl_graph *g, int32_t x)
{
	const kl_node *n = &g->nodes[x];
	return n->op == KL_OP_FULL && n->nin == 0 && n->a.s[0] == 0;
}

/* a + c where both are concatenations along one axis whose parts other than
 * zeros do not overlap (the gradients of slices of one tensor, each its
 * values between zeros: vjp_slice): one concatenation of those parts, zeros
 * between them. No additions of zeros, and a packed product's gradient (q,
 * k and v sliced from one qkv) is the concatenation of theirs, which
 * lowering may have the attention backward write where it lies
 * (kl__attention_bwd_layout). -1 when a and c are no such pair. */
static int32_t sum_of_pads(kl_graph *g, int32_t a, int32_t c)
{
	const kl_node *na = &g->nodes[a], *nc = &g->nodes[c];
	if (na->op != KL_OP_CONCAT || nc->op != KL_OP_CONCAT || na->a.axis != nc->a.axis ||
	    na->dtype != nc->dtype || !same_shape(na, nc))
		return -1;
	int ax = na->a.axis, nd = na->ndim;
	kl_dtype dt = (kl_dtype)na->dtype;
	int64_t sh[KL_MAX_DIMS];
	memcpy(sh, na->shape, sizeof sh);
	/* the parts that are not zeros, by where they start on the axis */
	int32_t part[2 * KL_NODE_MAX_IN];
	int64_t at[2 * KL_NODE_MAX_IN], len[2 * KL_NODE_MAX_IN];
	int np = 0;
	for (int t = 0; t < 2; t++) {
		const kl_node *n = &g->nodes[t ? c : a];
		int64_t pos = 0;
		for (int i = 0; i < n->nin; i++) {
			int32_t p = n->in[i];
			int64_t w = g->nodes[p].shape[ax];
			if (!is_zeros(g, p) && w > 0) {
				int k = np++;
				while (k > 0 && at[k - 1] > pos) {
					part[k] = part[k - 1];
					at[k] = at[k - 1];
					len[k] = len[k - 1];
					k--;
				}
				part[k] = p;
				at[k] = pos;
				len[k] = w;
			}
			pos += w;
		}
	}
	for (int k = 1; k < np; k++)
		if (at[k] < at[k - 1] + len[k - 1])
			return -1; /* both have values there: a real sum */
	/* the parts in order, zeros in the gaps */
	int32_t in[KL_NODE_MAX_IN];
	int n = 0;
	int64_t pos = 0;
	for (int k = 0; k <= np; k++) {
		int64_t end = k < np ? at[k] : sh[ax];
		if (end > pos) {
			if (n == KL_NODE_MAX_IN)
				return -1;
			int64_t zs[KL_MAX_DIMS];
			memcpy(zs, sh, sizeof zs);
			zs[ax] = end - pos;
			if ((in[n++] = kl__gb_full(g, dt, nd, zs, 0.0)) < 0)
				return -1;
		}
		if (k == np)
			break;
		if (n == KL_NODE_MAX_IN)
			return -1;
		in[n++] = part[k];
		pos = at[k] + len[k];
	}
	return n == 1 ? in[0] : kl__gb_concat(g, n, in, ax);
}

/* the sum of two contributions to one gradient */
static int32_t accumulate(kl_graph *g, int32_t a, int32_t c)
{
	int32_t s = sum_of_pads(g, a, c);
	return s >= 0 ? s : kl__gb_binary(g, KL_OP_ADD, a, c);
}

kl_status kl__autodiff(kl_graph *g, int32_t limit, int nroots, const int32_t *roots,
                       const int32_t *cots, int nleaves, const int32_t *leaves, int32_t *grads,
                       char *err, size_t errcap)
{
	char d[256];
	if (limit < 0 || limit > g->n)
		limit = g->n;
	/* live[i]: bit 1 a leaf reaches node i through float nodes, bit 2 node
	 * i reaches a root; the sweep visits nodes with both */
	unsigned char *live = calloc((size_t)(limit ? limit : 1), 1);
	int32_t *acc = malloc(sizeof *acc * (size_t)(limit ? limit : 1));
	if (!live || !acc) {
		free(live);
		free(acc);
		snprintf(err, errcap, "out of memory");
		return KL_ENOMEM;
	}
	for (int32_t i = 0; i < limit; i++)
		acc[i] = -1;
	for (int j = 0; j < nleaves; j++)
		if (leaves[j] >= 0 && leaves[j] < limit &&
		    kl__differentiable((kl_dtype)g->nodes[leaves[j]].dtype))
			live[leaves[j]] |= 1;
	for (int32_t i = 0; i < limit; i++) {
		const kl_node *n = &g->nodes[i];
		if (!kl__differentiable((kl_dtype)n->dtype))
			continue;
		for (int k = 0; k < n->nin && !(live[i] & 1); k++)
			if (live[n->in[k]] & 1)
				live[i] |= 1;
	}
	kl_status st = KL_OK;
	for (int r = 0; r < nroots; r++) {
		int32_t x = roots[r];
		if (x < 0 || x >= limit)
			continue;
		live[x] |= 2;
		int32_t c = cots[r];
		acc[x] = acc[x] < 0 ? c : kl__gb_binary(g, KL_OP_ADD, acc[x], c);
	}
	for (int32_t i = limit - 1; i >= 0; i--)
		if (live[i] & 2)
			for (int k = 0; k < g->nodes[i].nin; k++)
				live[g->nodes[i].in[k]] |= 2;
	for (int32_t i = limit - 1; i >= 0 && st == KL_OK; i--) {
		if (live[i] != 3 || acc[i] < 0 || g->nodes[i].op == KL_OP_INPUT)
			continue;
		kl_op op = (kl_op)g->nodes[i].op;
		kl_vjp_fn vjp = kl__opdesc[op]->vjp;
		if (!vjp) {
			snprintf(err, errcap, "%s has no gradient (%s)", kl__ops[op].name,
			         kl__node_desc(g, i, d, sizeof d));
			st = KL_EINVAL;
			break;
		}
		int32_t gin[KL_NODE_MAX_IN];
		for (int k = 0; k < KL_NODE_MAX_IN; k++)
			gin[k] = -1;
		kl_status rs = vjp(g, i, acc[i], gin);
		int nin = g->nodes[i].nin; /* g->nodes may have moved */
		for (int k = 0; k < nin && rs == KL_OK; k++) {
			int32_t x = g->nodes[i].in[k];
			if (live[x] != 3 || gin[k] < 0)
				continue;
			int32_t c = fit(g, x, gin[k]);
			if (c >= 0 && acc[x] >= 0)
				c = accumulate(g, acc[x], c);
			if (c < 0)
				rs = KL_EINVAL;
			acc[x] = c;
		}
		if (rs != KL_OK) {
			snprintf(err, errcap, "internal error: the gradient rule of %s failed (%s)",
			         kl__ops[op].name, kl__node_desc(g, i, d, sizeof d));
			st = rs == KL_ENOMEM ? KL_ENOMEM : KL_EINVAL;
		}
	}
	for (int j = 0; j < nleaves; j++)
		grads[j] = st == KL_OK && leaves[j] >= 0 && leaves[j] < limit && live[leaves[j]] == 3
		                   ? acc[leaves[j]]
		                   : -1;
	free(live);
	free(acc);
	return st;
}
