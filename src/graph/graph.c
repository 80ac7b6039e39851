/* graph.c - the graph IR's mechanics: the op table expanded from ops.def, node
 * arenas, the structural hash, a text printer, and the shape helpers that the
 * front end, lowering and the reference interpreter all share.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/graph.h"

const kl_opinfo kl__ops[KL_NOPS] = {
#define KL_OP(ID, name, arity, cat) {#name, arity, cat},
#include "graph/ops.def"
#undef KL_OP
};

void kl__graph_init(kl_graph *g)
{
	memset(g, 0, sizeof *g);
}

void kl__graph_free(kl_graph *g)
{
	if (!g)
		return;
	free(g->nodes);
	free(g->inputs);
	free(g->outputs);
	memset(g, 0, sizeof *g);
}

/* Grows *p (elements of size sz) so that it holds at least need elements. */
static int grow(void **p, int32_t *cap, int32_t need, size_t sz)
{
	if (need <= *cap)
		return 0;
	int32_t nc = *cap ? *cap : 16;
	while (nc < need) {
		if (nc > INT32_MAX / 2)
			return -1;
		nc *= 2;
	}
	void *q = realloc(*p, (size_t)nc * sz);
	if (!q)
		return -1;
	*p = q;
	*cap = nc;
	return 0;
}

int32_t kl__graph_add(kl_graph *g, const kl_node *n)
{
	if (grow((void **)&g->nodes, &g->cap, g->n + 1, sizeof *g->nodes))
		return -1;
	g->nodes[g->n] = *n;
	return g->n++;
}

int kl__graph_add_input(kl_graph *g, int32_t node)
{
	if (grow((void **)&g->inputs, &g->cap_inputs, g->ninputs + 1, sizeof *g->inputs))
		return -1;
	g->inputs[g->ninputs++] = node;
	return 0;
}

int kl__graph_add_output(kl_graph *g, int32_t node)
{
	if (grow((void **)&g->outputs, &g->cap_outputs, g->noutputs + 1, sizeof *g->outputs))
		return -1;
	g->outputs[g->noutputs++] = node;
	return 0;
}

int kl__graph_copy(kl_graph *dst, const kl_graph *src)
{
	kl__graph_init(dst);
	if (grow((void **)&dst->nodes, &dst->cap, src->n, sizeof *dst->nodes) ||
	    grow((void **)&dst->inputs, &dst->cap_inputs, src->ninputs, sizeof *dst->inputs) ||
	    grow((void **)&dst->outputs, &dst->cap_outputs, src->noutputs, sizeof *dst->outputs)) {
		kl__graph_free(dst);
		return -1;
	}
	if (src->n)
		memcpy(dst->nodes, src->nodes, (size_t)src->n * sizeof *src->nodes);
	if (src->ninputs)
		memcpy(dst->inputs, src->inputs, (size_t)src->ninputs * sizeof *src->inputs);
	if (src->noutputs)
		memcpy(dst->outputs, src->outputs, (size_t)src->noutputs * sizeof *src->outputs);
	dst->n = src->n;
	dst->ninputs = src->ninputs;
	dst->noutputs = src->noutputs;
	return 0;
}

uint64_t kl__hash_bytes(uint64_t h, const void *p, size_t n)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < n; i++) {
		h ^= b[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

/* Only the meaningful part of each node is hashed (inputs up to nin, dims up
 * to ndim, strides of INPUT nodes), so stale bytes beyond them never split a
 * cache key. kl_attrs has no padding and unused fields are zero by contract,
 * so it is hashed whole. */
uint64_t kl__graph_hash(const kl_graph *g)
{
	uint64_t h = KL_HASH_SEED;
	h = kl__hash_bytes(h, &g->n, sizeof g->n);
	for (int32_t i = 0; i < g->n; i++) {
		const kl_node *n = &g->nodes[i];
		unsigned char head[4] = {(unsigned char)(n->op & 0xff), (unsigned char)(n->op >> 8),
		                         n->dtype, n->ndim};
		h = kl__hash_bytes(h, head, sizeof head);
		h = kl__hash_bytes(h, &n->nin, 1);
		h = kl__hash_bytes(h, n->in, (size_t)n->nin * sizeof n->in[0]);
		h = kl__hash_bytes(h, n->shape, (size_t)n->ndim * sizeof n->shape[0]);
		if (n->op == KL_OP_INPUT)
			h = kl__hash_bytes(h, n->strides, (size_t)n->ndim * sizeof n->strides[0]);
		h = kl__hash_bytes(h, &n->a, sizeof n->a);
	}
	h = kl__hash_bytes(h, &g->ninputs, sizeof g->ninputs);
	h = kl__hash_bytes(h, g->inputs, (size_t)g->ninputs * sizeof g->inputs[0]);
	h = kl__hash_bytes(h, &g->noutputs, sizeof g->noutputs);
	h = kl__hash_bytes(h, g->outputs, (size_t)g->noutputs * sizeof g->outputs[0]);
	return h;
}

static void print_dims(FILE *f, int ndim, const int64_t *d)
{
	fputc('[', f);
	for (int i = 0; i < ndim; i++)
		fprintf(f, "%s%" PRId64, i ? "," : "", d[i]);
	fputc(']', f);
}

static void print_attrs(const kl_node *n, FILE *f)
{
	const kl_attrs *a = &n->a;
	switch (kl__ops[n->op].cat) {
	case KL_CAT_SOURCE:
		if (n->op == KL_OP_FULL)
			fprintf(f, " value=%.9g", a->s[0]);
		else if (n->op == KL_OP_ARANGE)
			fprintf(f, " start=%.9g step=%.9g", a->s[0], a->s[1]);
		else if ((n->op == KL_OP_RAND || n->op == KL_OP_RANDN) && n->nin == 2)
			fputs(" key=inputs", f); /* keyed at run time */
		else if (n->op == KL_OP_RAND || n->op == KL_OP_RANDN)
			fprintf(f, " seed=%" PRIu64, a->seed);
		break;
	case KL_CAT_BINARY:
	case KL_CAT_COMPARE:
		if (a->scalar_rhs)
			fprintf(f, " scalar=%.9g", a->s[0]);
		break;
	case KL_CAT_UNARY:
		if (n->op == KL_OP_CLAMP)
			fprintf(f, " lo=%.9g hi=%.9g", a->s[0], a->s[1]);
		break;
	case KL_CAT_REDUCE:
		fprintf(f, " axes=0x%x keepdim=%d", (unsigned)a->axes, a->keepdim);
		if (n->op == KL_OP_VAR)
			fprintf(f, " correction=%d", (int)a->correction);
		break;
	case KL_CAT_MOVEMENT:
		if (n->op == KL_OP_PERMUTE) {
			fputs(" perm=", f);
			print_dims(f, n->ndim, a->v);
		} else if (n->op == KL_OP_SLICE) {
			fprintf(f, " axis=%d start=%" PRId64 " stop=%" PRId64 " step=%" PRId64,
			        (int)a->axis, a->v[0], a->v[1], a->v[2]);
		} else if (n->op == KL_OP_CONCAT) {
			fprintf(f, " axis=%d", (int)a->axis);
		}
		break;
	case KL_CAT_COMPOSITE:
		if (n->op == KL_OP_ATTENTION || n->op == KL_OP_ATTENTION_BWD) {
			fprintf(f, " scale=%.9g causal=%d", a->s[0], (a->flags & KL_F_CAUSAL) != 0);
			break;
		}
		fprintf(f, " axis=%d", (int)a->axis);
		if (n->op == KL_OP_LAYER_NORM || n->op == KL_OP_RMS_NORM)
			fprintf(f, " eps=%.9g flags=%u", a->s[0], (unsigned)a->flags);
		break;
	default:
		break;
	}
}

void kl__graph_print(const kl_graph *g, FILE *f)
{
	fprintf(f, "graph: %d nodes, inputs (", (int)g->n);
	for (int32_t i = 0; i < g->ninputs; i++)
		fprintf(f, "%s%%%d", i ? ", " : "", (int)g->inputs[i]);
	fputs("), outputs (", f);
	for (int32_t i = 0; i < g->noutputs; i++)
		fprintf(f, "%s%%%d", i ? ", " : "", (int)g->outputs[i]);
	fputs(")\n", f);
	for (int32_t i = 0; i < g->n; i++) {
		const kl_node *n = &g->nodes[i];
		fprintf(f, "  %%%d = %s(", (int)i, n->op < KL_NOPS ? kl__ops[n->op].name : "?");
		for (int j = 0; j < n->nin; j++)
			fprintf(f, "%s%%%d", j ? ", " : "", (int)n->in[j]);
		fprintf(f, ") %s", kl_dtype_name((kl_dtype)n->dtype));
		print_dims(f, n->ndim, n->shape);
		if (n->op == KL_OP_INPUT) {
			fputs(" strides=", f);
			print_dims(f, n->ndim, n->strides);
		}
		if (n->op < KL_NOPS)
			print_attrs(n, f);
		fputc('\n', f);
	}
}

