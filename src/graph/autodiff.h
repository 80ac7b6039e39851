/* autodiff.h - the reverse sweep: reverse-mode differentiation of a graph
 * through the vector-Jacobian rules of the op table (kl_opdesc.vjp).
 *
 * It knows nothing of tensors or devices: it appends the gradient nodes to
 * the graph it is given. The eager tape (api/autograd.c) and anything else
 * that differentiates a graph call it.
 */
#ifndef KILN_AUTODIFF_H
#define KILN_AUTODIFF_H

#include "graph/graph.h"

/* Whether values of dtype dt carry gradients (floats only: integer and bool
 * paths carry none). */
static inline bool kl__differentiable(kl_dtype dt)
{
	return kl_dtype_is_float(dt);
}

/* Differentiate the nodes roots[0..nroots) of g, whose cotangents are the
 * nodes cots[i] (same shape and dtype), with respect to the nodes
 * leaves[0..nleaves): appends the gradient nodes to g and sets grads[j] to
 * the node holding the gradient of leaves[j] (its shape and dtype), or -1
 * when no path from that leaf reaches a root. Nodes on a path from a leaf to
 * a root are visited in reverse topological order; each calls its op's
 * vjp; a node read by several others gets the sum of their contributions
 * (ADD nodes; the gradients of slices that do not overlap, values between
 * zeros, one CONCAT of their values instead); a rule's result is summed down to its input's shape
 * (broadcasting) and cast to its input's dtype here, once. Integer and bool
 * nodes carry no gradient. Only nodes below `limit` are differentiated (the
 * graph as it was before the cotangents were added): pass g->n to take all.
 * Errors (KL_EINVAL, message in err): a float node on such a path whose op
 * has no rule ("<op> has no gradient (node #12, [4,8] f32)"), and a rule
 * that failed (an internal error naming the op). */
kl_status kl__autodiff(kl_graph *g, int32_t limit, int nroots, const int32_t *roots,
                       const int32_t *cots, int nleaves, const int32_t *leaves, int32_t *grads,
                       char *err, size_t errcap);

/* Describe node i of g as "#12, [4,8] f32" into buf. */
const char *kl__node_desc(const kl_graph *g, int32_t i, char *buf, size_t cap);

#endif /* KILN_AUTODIFF_H */
