/* joint.c - the joint forward + backward graph of a compiled call whose
 * forward is recorded for a kl_backward after it (AOTAutograd's
 * partitioner): which taped values the graph keeps (saved for backward) and
 * which the backward computes again, chosen by a min-cut once per graph
 * structure and remembered on the kl_fn, so a training loop's later calls
 * only hash their trace.
 */
#include <stdlib.h>

#include "capture/capture.h"
#include "graph/autodiff.h"
#include "graph/partition.h"

#define JOINT_MEMO 16 /* partitions remembered per kl_fn (oldest replaced) */

/* Which of the values fn's forward leaves on the autograd tape (for a
 * kl_backward after the call) the forward keeps: fn's joint graph (the
 * trace, a cotangent per output that requires grad, the gradient nodes of
 * every input that requires grad or is on the tape) and its min-cut
 * partition. keep[] per node of tr's graph; false when no joint graph can be
 * built (an op without a gradient rule: every taped value is kept). The
 * values not kept, kl_backward computes again in its backward graph. */
static bool saved_for_backward(kl_fn *f, kl_trace *tr, kl_tensor *const *out, bool *keep)
{
	kl_graph j;
	if (kl__graph_copy(&j, &tr->g) != 0)
		return false;
	int32_t nf = j.n, ni = tr->g.ninputs;
	int32_t *roots = malloc(sizeof *roots * (size_t)(2 * f->nout + 2 * ni + 2));
	bool *reads = calloc((size_t)nf + 1, sizeof *reads), *fr = calloc((size_t)nf + 1, 1);
	bool *need = NULL;
	bool ok = roots && reads && fr;
	int32_t *cots = roots ? roots + f->nout + 1 : NULL;
	int32_t *leaves = cots ? cots + f->nout + 1 : NULL, *grads = leaves ? leaves + ni : NULL;
	int nr = 0, nl = 0;
	for (int k = 0; ok && k < f->nout; k++) {
		const kl_tensor *t = out[k];
		if (t->st || t->trace_id != tr->id || t->node < 0 || t->tape_node < 0 ||
		    !kl__differentiable(t->dtype))
			continue;
		fr[t->node] = true; /* returned: kept whatever the cut says */
		kl_node c;
		memset(&c, 0, sizeof c);
		c.op = KL_OP_INPUT;
		c.dtype = (uint8_t)t->dtype;
		c.ndim = (uint8_t)t->ndim;
		memcpy(c.shape, t->shape, sizeof c.shape);
		roots[nr] = t->node;
		cots[nr] = kl__graph_add(&j, &c);
		ok = cots[nr++] >= 0;
	}
	for (int32_t i = 0; ok && i < ni; i++) {
		const kl_tensor *t = tr->in_tensors[i];
		if (kl__differentiable(t->dtype) && (t->requires_grad || t->tape_node >= 0))
			leaves[nl++] = tr->g.inputs[i];
	}
	for (int i = 0; ok && i < tr->nwrites; i++)
		if (tr->wsrc[i]->trace_id == tr->id && tr->wsrc[i]->node >= 0)
			fr[tr->wsrc[i]->node] = true;
	char err[256];
	ok = ok && nr > 0 && nl > 0 &&
	     kl__autodiff(&j, nf, nr, roots, cots, nl, leaves, grads, err, sizeof err) == KL_OK;
	if (ok)
		ok = (need = calloc((size_t)j.n, sizeof *need)) != NULL;
	for (int q = 0; ok && q < nl; q++)
		if (grads[q] >= 0)
			need[grads[q]] = true;
	for (int32_t i = ok ? j.n - 1 : -1; i >= 0; i--)
		if (need[i] && (i >= nf || !reads[i])) {
			if (i < nf) {
				reads[i] = true; /* a gradient that is a forward value */
				continue;
			}
			for (int q = 0; q < j.nodes[i].nin; q++)
				need[j.nodes[i].in[q]] = true;
		}
	for (int32_t i = 0; ok && i < nf; i++)
		reads[i] = need[i];
	ok = ok && kl__partition(&j, nf, reads, fr, keep) >= 0;
	free(need);
	free(roots);
	free(reads);
	free(fr);
	kl__graph_free(&j);
	return ok;
}

/* What the partition depends on: the trace's graph (ops, wiring, shapes,
 * dtypes, input strides), which outputs are cotangent roots, which inputs
 * are leaves, and which nodes are written in place. Equal keys give the
 * same keep[] (saved_for_backward reads nothing else). */
static uint64_t joint_key(const kl_fn *f, const kl_trace *tr, kl_tensor *const *out)
{
	uint64_t h = kl__graph_hash(&tr->g);
	for (int k = 0; k < f->nout; k++) {
		const kl_tensor *t = out[k];
		int32_t r = -1;
		if (!t->st && t->trace_id == tr->id && t->node >= 0 && t->tape_node >= 0 &&
		    kl__differentiable(t->dtype))
			r = t->node;
		h = kl__hash_bytes(h, &r, sizeof r);
	}
	for (int32_t i = 0; i < tr->g.ninputs; i++) {
		const kl_tensor *t = tr->in_tensors[i];
		uint8_t leaf = kl__differentiable(t->dtype) && (t->requires_grad || t->tape_node >= 0);
		h = kl__hash_bytes(h, &leaf, 1);
	}
	for (int i = 0; i < tr->nwrites; i++) {
		int32_t w = tr->wsrc[i]->trace_id == tr->id ? tr->wsrc[i]->node : -1;
		h = kl__hash_bytes(h, &w, sizeof w);
	}
	return h;
}

bool kl__joint_keep(kl_fn *f, kl_trace *tr, kl_tensor *const *out, bool *keep)
{
	uint64_t key = joint_key(f, tr, out);
	int32_t n = tr->g.n;
	for (int i = 0; i < f->njoint; i++) {
		const kl_joint_memo *m = &f->joint[i];
		if (m->key == key && m->n == n) {
			memcpy(keep, m->keep, (size_t)n * sizeof *keep);
			f->joint_reuses++;
			return m->ok;
		}
	}
	bool ok = saved_for_backward(f, tr, out, keep);
	f->joint_cuts++;
	bool *copy = malloc((size_t)(n ? n : 1) * sizeof *copy);
	if (!copy)
		return ok; /* not remembered: the next call cuts again */
	memcpy(copy, keep, (size_t)n * sizeof *keep);
	kl_joint_memo *m;
	if (f->njoint < JOINT_MEMO) {
		if (!f->joint && !(f->joint = calloc(JOINT_MEMO, sizeof *f->joint))) {
			free(copy);
			return ok;
		}
		m = &f->joint[f->njoint++];
	} else {
		m = &f->joint[f->next_joint];
		f->next_joint = (f->next_joint + 1) % JOINT_MEMO;
		free(m->keep);
	}
	*m = (kl_joint_memo){.key = key, .n = n, .ok = ok, .keep = copy};
	return ok;
}

void kl__joint_free(kl_fn *f)
{
	for (int i = 0; i < f->njoint; i++)
		free(f->joint[i].keep);
	free(f->joint);
	f->joint = NULL;
	f->njoint = 0;
}
