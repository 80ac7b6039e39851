/* reference.h - the float64 reference interpreter: the oracle every backend,
 * every fusion and every compile mode is tested against.
 *
 * It evaluates a graph node by node in double precision, directly from the
 * op's mathematical definition (no shared code with the backends besides
 * the random generator and dtype rounding), and rounds each node's result
 * to the node's dtype, which is what the op promises to produce.
 */
#ifndef KILN_REFERENCE_H
#define KILN_REFERENCE_H

#include "graph/graph.h"

/* inputs[i]: dense row-major values of the graph's i-th INPUT node (already
 * as that node's dtype would hold them). On success outputs[j] is a malloc'd
 * dense row-major array with the j-th output's values (free() each).
 * Returns KL_OK, or KL_EINVAL/KL_ENOMEM with a message in err. */
kl_status kl__ref_eval(const kl_graph *g, const double *const *inputs, double **outputs, char *err,
                       size_t errcap);

#endif
