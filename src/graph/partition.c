/* partition.c - the min-cut of a joint graph (see partition.h).
 *
 * The flow network: each forward node v is an edge v_in -> v_out whose
 * capacity is what keeping v costs: its bytes, or nothing for a free node.
 * A node the backward may not compute (an input, a product, a free value
 * the forward has anyway) has its v_in on the source. Every graph edge
 * u -> v is u_out -> v_in, unbounded, and every value the backward reads is
 * v_out -> sink, unbounded. A minimum cut then crosses only v_in -> v_out
 * edges: those are the values kept; the nodes on the sink side are computed
 * again in the backward from kept ones. Edmonds-Karp finds it: graphs here
 * have hundreds of nodes.
 */
#include <stdlib.h>

#include "core/shape.h"
#include "graph/partition.h"

#define INF (INT64_MAX / 4)

bool kl__recomputable(const kl_node *n)
{
	kl_cat c = kl__ops[n->op].cat;
	if (n->op == KL_OP_INPUT)
		return false;
	return kl__op_pointwise((kl_op)n->op) || c == KL_CAT_MOVEMENT || c == KL_CAT_SOURCE;
}

typedef struct net {
	int32_t n, m, cap;
	int32_t *head, *next, *to; /* adjacency lists of edge ids */
	int64_t *c;                /* residual capacity per edge */
} net;

static bool net_edge(net *k, int32_t a, int32_t b, int64_t c)
{
	if (k->m + 2 > k->cap) {
		int32_t nc = k->cap ? 2 * k->cap : 256;
		int32_t *nx = realloc(k->next, sizeof *nx * (size_t)nc);
		if (nx)
			k->next = nx;
		int32_t *to = realloc(k->to, sizeof *to * (size_t)nc);
		if (to)
			k->to = to;
		int64_t *cc = realloc(k->c, sizeof *cc * (size_t)nc);
		if (cc)
			k->c = cc;
		if (!nx || !to || !cc)
			return false;
		k->cap = nc;
	}
	/* edge e and its reverse e ^ 1 */
	k->to[k->m] = b, k->c[k->m] = c, k->next[k->m] = k->head[a], k->head[a] = k->m, k->m++;
	k->to[k->m] = a, k->c[k->m] = 0, k->next[k->m] = k->head[b], k->head[b] = k->m, k->m++;
	return true;
}

/* One augmenting path by breadth-first search; false when none is left.
 * seen[] then marks the source side of the minimum cut. */
static bool augment(net *k, int32_t s, int32_t t, int32_t *prev_e, int32_t *queue, bool *seen)
{
	for (int32_t i = 0; i < k->n; i++)
		seen[i] = false, prev_e[i] = -1;
	int32_t qh = 0, qt = 0;
	queue[qt++] = s;
	seen[s] = true;
	while (qh < qt && !seen[t]) {
		int32_t a = queue[qh++];
		for (int32_t e = k->head[a]; e >= 0; e = k->next[e])
			if (k->c[e] > 0 && !seen[k->to[e]]) {
				seen[k->to[e]] = true;
				prev_e[k->to[e]] = e;
				queue[qt++] = k->to[e];
			}
	}
	if (!seen[t])
		return false;
	int64_t f = INF;
	for (int32_t v = t; v != s; v = k->to[prev_e[v] ^ 1])
		f = k->c[prev_e[v]] < f ? k->c[prev_e[v]] : f;
	for (int32_t v = t; v != s; v = k->to[prev_e[v] ^ 1]) {
		k->c[prev_e[v]] -= f;
		k->c[prev_e[v] ^ 1] += f;
	}
	return true;
}

static int64_t bytes_of(const kl_node *n)
{
	int64_t b = kl__numel(n->ndim, n->shape) * (int64_t)kl_dtype_size((kl_dtype)n->dtype);
	return b > 0 ? b : 1; /* an empty value still costs a handle */
}

int64_t kl__partition(const kl_graph *g, int32_t nfwd, const bool *reads, const bool *free_,
                      bool *save)
{
	net k = {.n = 2 * nfwd + 2};
	int32_t s = 2 * nfwd, t = 2 * nfwd + 1;
	k.head = malloc(sizeof *k.head * (size_t)k.n);
	int32_t *prev_e = malloc(sizeof *prev_e * (size_t)k.n);
	int32_t *queue = malloc(sizeof *queue * (size_t)k.n);
	bool *seen = malloc(sizeof *seen * (size_t)k.n);
	bool ok = k.head && prev_e && queue && seen;
	for (int32_t i = 0; ok && i < k.n; i++)
		k.head[i] = -1;
	for (int32_t v = 0; ok && v < nfwd; v++) {
		const kl_node *n = &g->nodes[v];
		bool fr = free_[v] || n->op == KL_OP_INPUT;
		ok = net_edge(&k, 2 * v, 2 * v + 1, fr ? 0 : bytes_of(n));
		if (ok && (fr || !kl__recomputable(n)))
			ok = net_edge(&k, s, 2 * v, INF);
		for (int j = 0; ok && j < n->nin; j++)
			ok = net_edge(&k, 2 * n->in[j] + 1, 2 * v, INF);
		if (ok && reads[v])
			ok = net_edge(&k, 2 * v + 1, t, INF);
	}
	int64_t kept = 0;
	if (ok) {
		while (augment(&k, s, t, prev_e, queue, seen))
			;
		/* seen: the source side of the cut */
		for (int32_t v = 0; v < nfwd; v++) {
			save[v] = seen[2 * v] && !seen[2 * v + 1] && !free_[v] &&
			          g->nodes[v].op != KL_OP_INPUT;
			kept += save[v] ? bytes_of(&g->nodes[v]) : 0;
		}
	} else {
		for (int32_t v = 0; v < nfwd; v++)
			save[v] = reads[v];
		kept = -1;
	}
	free(k.head), free(k.next), free(k.to), free(k.c);
	free(prev_e), free(queue), free(seen);
	return kept;
}
