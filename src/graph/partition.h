/* partition.h - which forward values a backward keeps: the min-cut
 * partition of a joint forward + backward graph (AOTAutograd's idea).
 *
 * The backward reads some forward values. Each is either kept from the
 * forward (costing its bytes of memory from the forward until the backward)
 * or computed again inside the backward from values that are kept. Cheap
 * ops (pointwise, movement, sources) may be computed again; products,
 * reductions and the composite ops (softmax, norms, attention) may not.
 * The cheapest set of kept values is a minimum cut between "what the
 * forward has" and "what the backward reads".
 */
#ifndef KILN_PARTITION_H
#define KILN_PARTITION_H

#include "graph/graph.h"

/* Whether the backward may compute node n's value again from its inputs. */
bool kl__recomputable(const kl_node *n);

/* Nodes [0, nfwd) of g are the forward. reads[v]: the backward reads
 * forward node v. free_[v]: v is available to the backward at no cost (an
 * INPUT, a value the forward returns anyway); INPUT nodes are free whatever
 * free_ says. Sets save[v] for the forward nodes to keep, so that every
 * node the backward reads is free, kept, or recomputable from kept and free
 * values, with the fewest bytes kept. Returns the bytes kept, or -1 when
 * out of memory (save then marks every read node). */
int64_t kl__partition(const kl_graph *g, int32_t nfwd, const bool *reads, const bool *free_,
                      bool *save);

#endif /* KILN_PARTITION_H */
