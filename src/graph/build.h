/* build.h - node builders for code that writes graphs: the vector-Jacobian
 * rules of the op table, and the autograd sweep that calls them.
 *
 * Each builder appends one node to g, with its shape and dtype inferred from
 * its inputs and arguments by the same rules the public ops follow
 * (broadcasting, torch's result_type, reductions' keepdim), and returns the
 * new node's index; -1 when g cannot grow or the arguments do not fit (a bug
 * in the rule that called it: the sweep reports it as an internal error
 * naming the op being differentiated). Inputs are indices of earlier nodes
 * of g. No builder validates more than it must to infer: they are for kiln's
 * own rules, never for user input (the public ops in api/ops.c do that).
 */
#ifndef KILN_GRAPH_BUILD_H
#define KILN_GRAPH_BUILD_H

#include "graph/graph.h"

/* Pointwise. Binary ops broadcast their operands (no expand node is added:
 * graph pointwise nodes read broadcast-compatible inputs directly) and
 * promote dtypes as torch does; comparisons give KL_BOOL. */
int32_t kl__gb_unary(kl_graph *g, kl_op op, int32_t a);
int32_t kl__gb_binary(kl_graph *g, kl_op op, int32_t a, int32_t b);
/* a op s, s a Python number (attrs.scalar_rhs): the result keeps a's dtype
 * when a is float. */
int32_t kl__gb_scalar(kl_graph *g, kl_op op, int32_t a, double s);
int32_t kl__gb_where(kl_graph *g, int32_t cond, int32_t a, int32_t b);
int32_t kl__gb_cast(kl_graph *g, int32_t a, kl_dtype dt);
int32_t kl__gb_clamp(kl_graph *g, int32_t a, double lo, double hi);

/* Sources. */
int32_t kl__gb_full(kl_graph *g, kl_dtype dt, int ndim, const int64_t *shape, double value);

/* Reductions over the dims in axes (bit i: dim i of a). */
int32_t kl__gb_reduce(kl_graph *g, kl_op op, int32_t a, uint32_t axes, bool keepdim);

/* Movement (views where the layout allows). */
int32_t kl__gb_reshape(kl_graph *g, int32_t a, int ndim, const int64_t *shape);
int32_t kl__gb_permute(kl_graph *g, int32_t a, const int *perm);
int32_t kl__gb_expand(kl_graph *g, int32_t a, int ndim, const int64_t *shape);
/* a[start:stop:step] along axis, all normalized (0 <= start <= stop <= dim, step >= 1) */
int32_t kl__gb_slice(kl_graph *g, int32_t a, int axis, int64_t start, int64_t stop, int64_t step);
int32_t kl__gb_concat(kl_graph *g, int n, const int32_t *in, int axis);
int32_t kl__gb_contiguous(kl_graph *g, int32_t a);

/* [..., M, K] x [..., K, N], batch dims equal (expand first where they are not). */
int32_t kl__gb_matmul(kl_graph *g, int32_t a, int32_t b);

/* The gradient of a broadcast: x summed over the dims that broadcasting
 * added or stretched to reach x's shape from (ndim, shape), reshaped to
 * (ndim, shape). Returns x itself when the shapes are already equal. */
int32_t kl__gb_sum_to(kl_graph *g, int32_t x, int ndim, const int64_t *shape);

/* Any other node: proto's op, dtype, shape, nin, in[] and attrs as given
 * (for composites whose shape the caller knows, e.g. softmax's). */
int32_t kl__gb_node(kl_graph *g, const kl_node *proto);

#endif /* KILN_GRAPH_BUILD_H */
