/*
 * step_order.c - the order of a program's steps, for memory.
 *
 * The scheduler emits steps in the graph's order. A backward pass computes,
 * for each product of the forward, the input's gradient and then the
 * weight's: the second is the last reader of the saved activation, so
 * running it first frees that activation before the input's gradient is
 * made (train_decoder at 4x1024x2048: the 67 MB SwiGLU output dies before
 * the 67 MB gradient of the FFN's hidden layer is born). kl__order_steps
 * runs the steps in the program's order (each keyed by its first source
 * node), except that when the next step in it would allocate more temp
 * memory than it frees, a step that can run now (every step it depends on
 * has run) and frees more than it allocates runs first.
 * Dependencies are the buffers: a step follows the last writer of what it
 * reads or writes and every reader, since that write, of what it writes.
 */
#include <stdlib.h>

#include "lower/lower_int.h"

/* the buffer b names memory of (an output that is a view: its base) */
static int32_t root_of(const kl_program *P, int32_t b)
{
	for (int guard = 0; guard < 64 && P->bufs[b].role == KL_BUF_OUTPUT && P->bufs[b].alias >= 0;
	     guard++)
		b = P->bufs[b].alias;
	return b;
}

typedef struct edges {
	int32_t *to;
	int32_t n, cap;
} edges;

static bool push(edges *e, int32_t v)
{
	if (e->n == e->cap) {
		int32_t cap = e->cap ? 2 * e->cap : 4;
		int32_t *p = realloc(e->to, sizeof *p * (size_t)cap);
		if (!p)
			return false;
		e->to = p;
		e->cap = cap;
	}
	e->to[e->n++] = v;
	return true;
}

static bool has(const int32_t *ids, int n, int32_t b)
{
	for (int k = 0; k < n; k++)
		if (ids[k] == b)
			return true;
	return false;
}

/* the buffers step s touches (roots), each once: those it only reads, then
 * those it writes (*nw of them); returns the count */
static int touched(const kl_program *P, const kl_step *s, int32_t *ids, int *nw)
{
	int32_t w[2];
	int n = 0, m = 0;
	for (int i = 0; i < s->nwrites; i++) {
		int32_t b = root_of(P, s->writes[i]);
		if (!has(w, m, b))
			w[m++] = b;
	}
	for (int i = 0; i < s->nreads; i++) {
		int32_t b = root_of(P, s->reads[i]);
		if (!has(w, m, b) && !has(ids, n, b))
			ids[n++] = b;
	}
	for (int i = 0; i < m; i++)
		ids[n++] = w[i];
	*nw = m;
	return n;
}

kl_status kl__order_steps(kl_program *P)
{
	int32_t n = P->nsteps, nb = P->nbufs;
	if (n < 3)
		return KL_OK;
	kl_status st = KL_ENOMEM;
	edges *succ = calloc((size_t)n, sizeof *succ);
	int32_t *npred = calloc((size_t)n, sizeof *npred);
	int32_t *last_w = malloc(sizeof *last_w * (size_t)nb);
	edges *readers = calloc((size_t)nb, sizeof *readers); /* since the last write */
	int32_t *left = calloc((size_t)nb, sizeof *left);     /* steps yet to run that read b */
	bool *born = calloc((size_t)nb, 1);
	double *size = malloc(sizeof *size * (size_t)nb);
	int32_t *order = malloc(sizeof *order * (size_t)n);
	int32_t *key = malloc(sizeof *key * (size_t)n);
	if (!succ || !npred || !last_w || !readers || !left || !born || !size || !order || !key)
		goto out;
	/* the program's order: where the step's first node is in the source
	 * graph (the forward as written, then the backward as the sweep made
	 * it), not the order the scheduler happened to emit independent
	 * kernels in (a norm computed again for the backward, ready since the
	 * forward, runs where the backward needs it) */
	for (int32_t j = 0; j < n; j++) {
		key[j] = INT32_MAX;
		for (int32_t i = 0; i < P->steps[j].nnodes; i++)
			if (P->steps[j].nodes[i] < key[j])
				key[j] = P->steps[j].nodes[i];
	}
	for (int32_t b = 0; b < nb; b++) {
		last_w[b] = -1;
		size[b] = P->bufs[b].role == KL_BUF_TEMP ? kl__traced_bytes(P, b) : 0;
	}
	int32_t ids[KL_NODE_MAX_IN * 2 + 2];
	for (int32_t j = 0; j < n; j++) {
		int nw, nt = touched(P, &P->steps[j], ids, &nw);
		for (int i = 0; i < nt; i++) {
			int32_t b = ids[i];
			bool wr = i >= nt - nw;
			if (last_w[b] >= 0) {
				if (!push(&succ[last_w[b]], j))
					goto out;
				npred[j]++;
			}
			if (wr) {
				for (int32_t r = 0; r < readers[b].n; r++)
					if (readers[b].to[r] != j) {
						if (!push(&succ[readers[b].to[r]], j))
							goto out;
						npred[j]++;
					}
				readers[b].n = 0;
				last_w[b] = j;
			} else {
				if (!push(&readers[b], j))
					goto out;
				left[b]++;
			}
		}
	}
	/* list scheduling over the ready steps: the earliest, unless it grows
	 * the temps and another ready step shrinks them */
	int32_t *ready = malloc(sizeof *ready * (size_t)n), nready = 0;
	if (!ready)
		goto out;
	for (int32_t j = 0; j < n; j++)
		if (npred[j] == 0)
			ready[nready++] = j;
	for (int32_t k = 0; k < n; k++) {
		int32_t first = -1, best = -1;
		double best_net = 0, first_net = 0;
		for (int32_t r = 0; r < nready; r++) {
			int32_t s = ready[r];
			bool earlier = first < 0 || key[s] < key[ready[first]] ||
			               (key[s] == key[ready[first]] && s < ready[first]);
			int nw, nt = touched(P, &P->steps[s], ids, &nw);
			double net = 0;
			for (int i = 0; i < nt; i++) {
				int32_t b = ids[i];
				if (i >= nt - nw)
					net += born[b] ? 0 : size[b];
				else if (left[b] == 1)
					net -= size[b];
			}
			if (earlier) {
				first = r;
				first_net = net;
			}
			if (net < best_net || (best >= 0 && net == best_net && key[s] < key[ready[best]])) {
				best = r;
				best_net = net;
			}
		}
		if (first < 0) {
			/* a cycle, which buffers written once cannot make: the order
			 * stays as emitted */
			free(ready);
			st = KL_OK;
			goto out;
		}
		int32_t r = first_net > 0 && best >= 0 ? best : first, s = ready[r];
		ready[r] = ready[--nready];
		order[k] = s;
		int nw, nt = touched(P, &P->steps[s], ids, &nw);
		for (int i = 0; i < nt; i++) {
			if (i >= nt - nw)
				born[ids[i]] = true;
			else
				left[ids[i]]--;
		}
		for (int32_t e = 0; e < succ[s].n; e++)
			if (--npred[succ[s].to[e]] == 0)
				ready[nready++] = succ[s].to[e];
	}
	free(ready);
	/* permute the steps, and the symbolic fields that name them */
	kl_step *steps = malloc(sizeof *steps * (size_t)n);
	if (!steps)
		goto out;
	int32_t *pos = npred; /* all zero now: reused as old index -> new */
	for (int32_t k = 0; k < n; k++) {
		steps[k] = P->steps[order[k]];
		pos[order[k]] = k;
	}
	for (int32_t k = 0; k < n; k++)
		P->steps[k] = steps[k];
	free(steps);
	for (int32_t i = 0; i < P->nsymf; i++)
		P->symf[i].step = pos[P->symf[i].step];
	st = KL_OK;
out:
	for (int32_t s = 0; succ && s < n; s++)
		free(succ[s].to);
	for (int32_t b = 0; readers && b < nb; b++)
		free(readers[b].to);
	free(succ);
	free(npred);
	free(last_w);
	free(readers);
	free(left);
	free(born);
	free(size);
	free(order);
	free(key);
	return st;
}
