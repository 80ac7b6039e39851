/* graph.h - the SSA graph IR: op enum, nodes, graphs, shape rules, hash.
 *
 * A node is a small plain struct (op, dtype, shape, inputs, inline attrs), so
 * graphs copy, hash and compare cheaply. Nodes sit in topological order;
 * an input index always refers to an earlier node. This layer knows nothing
 * of devices or tensors' memory.
 */
#ifndef KILN_GRAPH_H
#define KILN_GRAPH_H

#include "core/core.h"
#include "kiln.h"

typedef enum kl_op {
#define KL_OP(ID, name, arity, cat) KL_OP_##ID,
#include "ops.def"
#undef KL_OP
	KL_NOPS
} kl_op;

typedef enum kl_cat {
	KL_CAT_SOURCE,
	KL_CAT_BINARY,
	KL_CAT_COMPARE,
	KL_CAT_UNARY,
	KL_CAT_UNARY_FLOAT,
	KL_CAT_WHERE,
	KL_CAT_REDUCE,
	KL_CAT_MOVEMENT,
	KL_CAT_CONTRACT,
	KL_CAT_COMPOSITE
} kl_cat;

typedef struct kl_opinfo {
	const char *name;
	int arity;
	kl_cat cat;
} kl_opinfo;

extern const kl_opinfo kl__ops[KL_NOPS];

static inline bool kl__op_pointwise(kl_op op)
{
	kl_cat c = kl__ops[op].cat;
	return c == KL_CAT_BINARY || c == KL_CAT_COMPARE || c == KL_CAT_UNARY ||
	       c == KL_CAT_UNARY_FLOAT || c == KL_CAT_WHERE;
}

#define KL_NODE_MAX_IN 8

/* attrs.flags */
#define KL_F_HAS_WEIGHT 1u /* layer_norm / rms_norm: a weight input follows x */
#define KL_F_HAS_BIAS 2u   /* layer_norm: a bias input follows */
#define KL_F_CAUSAL 4u     /* sdpa: causal mask, aligned to the last key */
#define KL_F_INPLACE 8u    /* cache_write: written back into in[0]'s memory (kl_cache_write) */
#define KL_F_LENGTHS 16u   /* sdpa: a lengths input follows v (kl_sdpa_lengths) */

/* Inline attributes; which fields mean what is said per op in ops.def.
 * Unused fields stay zero so that hashing and comparing the whole struct
 * is exact. */
typedef struct kl_attrs {
	double s[2];             /* scalars: rhs scalar, clamp lo/hi, eps, fill, arange start/step, sdpa scale */
	int64_t v[KL_MAX_DIMS];  /* perm, slice start/stop/step */
	uint64_t seed;           /* rand, randn (0 when keyed by inputs) */
	uint32_t axes;           /* reductions: bit i = input dim i */
	int32_t axis;            /* softmax, log_softmax, argmax, slice, concat (normalized, >= 0) */
	int32_t correction;      /* var */
	uint8_t keepdim;
	uint8_t scalar_rhs;      /* binary/compare: rhs is s[0], not in[1] */
	uint8_t flags;           /* KL_F_* */
	uint8_t pad_;
} kl_attrs;

typedef struct kl_node {
	uint16_t op;    /* kl_op */
	uint8_t dtype;  /* kl_dtype of the result */
	uint8_t ndim;
	uint8_t nin;
	uint8_t pad_[3];
	int32_t in[KL_NODE_MAX_IN]; /* indices of earlier nodes */
	int64_t shape[KL_MAX_DIMS];
	/* INPUT nodes only: the strides (elements) the input had when traced;
	 * part of the variant's guards, and what kernels index with. */
	int64_t strides[KL_MAX_DIMS];
	kl_attrs a;
} kl_node;

typedef struct kl_graph {
	kl_node *nodes;
	int32_t n, cap;
	int32_t *inputs; /* node index of each INPUT, in order of appearance */
	int32_t ninputs, cap_inputs;
	int32_t *outputs; /* node indices of the results */
	int32_t noutputs, cap_outputs;
} kl_graph;

void kl__graph_init(kl_graph *g);
void kl__graph_free(kl_graph *g);
/* Appends a copy of *n; returns its index or -1 when out of memory. */
int32_t kl__graph_add(kl_graph *g, const kl_node *n);
int kl__graph_add_input(kl_graph *g, int32_t node);
int kl__graph_add_output(kl_graph *g, int32_t node);
int kl__graph_copy(kl_graph *dst, const kl_graph *src);
/* Structural hash: ops, attrs, shapes, dtypes, wiring; never pointers. */
uint64_t kl__graph_hash(const kl_graph *g);
/* Human-readable listing, one node per line. */
void kl__graph_print(const kl_graph *g, FILE *f);

/* FNV-1a style 64-bit hash used for every content key in kiln */
uint64_t kl__hash_bytes(uint64_t h, const void *p, size_t n);
#define KL_HASH_SEED 0xcbf29ce484222325ull

#endif /* KILN_GRAPH_H */
