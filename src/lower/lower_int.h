/* lower_int.h - what the passes of lowering share: the decomposed graph, its
 * symbols, the kernel groups the scheduler forms, and the entry points of
 * each pass (decompose.c, symbolic.c, fuse.c, kernel_build.c, lower.c).
 */
#ifndef KILN_LOWER_INT_H
#define KILN_LOWER_INT_H

#include "lower/kernel_ir.h"
#include "lower/lower.h"

/* A kernel being formed: an iteration space F with reduced dims rmask, and
 * its members in topological order. A member is "home" (this kernel
 * computes it and stores it if anyone else needs it) or a copy (recomputed
 * here because that is cheaper than a round trip through memory). */
typedef struct kl_group {
	bool alive;
	bool matmul; /* a library step: the one member is the MATMUL (or ATTENTION) node */
	int ndim;
	int64_t F[KL_MAX_DIMS];
	int32_t Fsym[KL_MAX_DIMS];
	uint32_t rmask;
	int32_t *m;
	uint8_t *copy;
	int32_t nm, cap;
	int32_t first; /* first home member, names the kernel in the log */
	uint8_t epi;   /* matmul: the kl_epart parts folded in so far (members 1..) */
} kl_group;

/* a hand-written attention that ends at a product (attention_match.c) */
typedef struct kl_attn_match {
	int32_t q, k, v; /* src nodes; q < 0: no match */
	double scale;
	bool causal;
	int32_t chain[8]; /* the src nodes it replaces, the product first */
	int nchain;
} kl_attn_match;

typedef struct kl_lctx {
	const kl_lower_opts *o;
	const kl_graph *src; /* the caller's graph */
	kl_graph g;          /* decomposed */
	int32_t *orig;       /* g node -> src node */
	kl_attn_match *am;   /* per src node: attention ending at this product */
	int32_t *src_sym;    /* symbols of src (NULL: static), decides how products lower */
	int32_t *sym;        /* g.n * KL_MAX_DIMS */
	int32_t nsyms;
	int32_t sym_input[KL_MAX_DIMS * 4], sym_dim[KL_MAX_DIMS * 4];
	uint8_t *live;       /* contributes to an output */
	int32_t *nuse;       /* live nodes reading each node (an input used twice counts twice) */
	int32_t *out_of;     /* node -> first graph output it is, -1 */
	int32_t *alias_of;   /* graph output -> buffer it aliases, -1 */
	uint8_t *mat;        /* movement node that must be stored (output copy, matmul operand) */
	int32_t *home;       /* node -> group, -1 */
	kl_group *gr;
	int32_t ngr, cap_gr;
	uint8_t *mem;        /* scratch: membership in the group being built (1 home, 2 copy) */
	int32_t *lvl;        /* scratch: reduction levels while building */
	int32_t *bufof;      /* node -> buffer id, -1 (final build) */
	int32_t *cw_base;    /* cache_write node -> the input buffer it writes in place, -1 */
	uint8_t *stored;     /* home member whose value others need (final build) */
	int32_t *order;      /* live groups in execution order */
	int32_t norder;
	int32_t *mlead;      /* per src node: the first product of the merged run it is in, -1 */
	int64_t *mcol;       /* per src node of a run: its first column in the wider product */
	int64_t *mspan;      /* per run's first product: [start, stop) of the wider weight slice */
	/* decompose.c's relayouts, four ids each: the attention node, the copy
	 * of its output that later readers read through views, and the first
	 * and last of those views; the copy is stored when a view is live */
	int32_t *relay;
	int32_t nrelay, cap_relay;
	kl_sb log;
	char *err;
	size_t errcap;
} kl_lctx;

/* one line of the fusion log (and KL_LOG_FUSION) */
void kl__lower_logf(kl_lctx *L, const char *fmt, ...) KL_PRINTF(2, 3);

/* attention_match.c: L->am, hand-written attention in src (logged either way) */
kl_status kl__attention_match(kl_lctx *L);

/* merge.c: which products of src become one wider product (L->mlead etc.) */
kl_status kl__merge_plan(kl_lctx *L);
/* "matmul#44": a src node in log lines */
const char *kl__src_label(const kl_lctx *L, int32_t n, char *buf, size_t cap);

/* decompose.c: L->g and L->orig from src */
kl_status kl__decompose(kl_lctx *L);
/* A product of [rows, n] by inner dim k of dtype D is lowered to a generated
 * row reduction (a skinny product: the CUDA target, with fusion). */
bool kl__skinny_product(const kl_lctx *L, kl_dtype D, int64_t rows, int64_t n, int64_t k);

/* symbolic.c: L->sym etc. over L->g (dyn_masks may be NULL: all static) */
kl_status kl__symbolize_lowered(kl_lctx *L);

/* fuse.c: form the groups (L->gr), decide what is stored */
kl_status kl__schedule(kl_lctx *L);
/* lower.c: bytes of P's buffer b at its traced sizes (dense) */
double kl__traced_bytes(const kl_program *P, int32_t b);
/* step_order.c: P's steps reordered where that frees temps sooner (the
 * buffers' dependencies kept); symbolic fields follow their steps */
kl_status kl__order_steps(kl_program *P);
/* "add#7" or "exp#3(softmax)" for log lines */
const char *kl__node_label(const kl_lctx *L, int32_t n, char *buf, size_t cap);

/* epilogue.c: what consumer n does to the value of prev (one of its inputs)
 * as a step of a matrix product's epilogue, C = act(alpha * A@B + beta * R +
 * bias): *other receives the bias or residual node. KL_EPART_NONE with the
 * reason when n is no such step (ordering and target rules are the
 * scheduler's). */
typedef enum kl_epart {
	KL_EPART_NONE = 0,
	KL_EPART_ALPHA = 1, /* mul by a scalar */
	KL_EPART_BIAS = 2,  /* add of [n] (broadcast over rows) */
	KL_EPART_RESID = 4, /* add of a tensor of the product's shape */
	KL_EPART_ACT = 8    /* relu, gelu, gelu_tanh */
} kl_epart;
kl_epart kl__epilogue_part(const kl_lctx *L, int32_t n, int32_t prev, int32_t *other, char *why,
                           size_t cap);
/* Is node c a copy into a dense buffer of attention node at's output, seen
 * through a permutation that keeps the last dim last (and reshapes above
 * it), so that the attention step can write straight into c's buffer and
 * the copy is gone? When it is and os is not NULL, os receives the strides,
 * in c's buffer, of each dim of the attention's output. False with the
 * reason in why otherwise. */
bool kl__attention_layout(const kl_lctx *L, int32_t at, int32_t c, int64_t *os, char *why,
                          size_t cap);
/* Where the attention backward (sdpa_bwd node at) writes its gradients when
 * node c, a concatenation, is their consumer's layout: per gradient (0 dq,
 * 1 dk, 2 dv), its first element and the strides of its dims (at's
 * [batch..., rows, d]) in c's dense buffer. */
typedef struct kl_bwd_layout {
	int64_t off[3];
	int64_t st[3][KL_MAX_DIMS];
} kl_bwd_layout;
/* Is node c a concatenation whose every part is a view (slice, permute,
 * reshape) of one of the three gradients sdpa_bwd node at packs, each
 * gradient exactly one part, with nothing else reading them, so that the
 * backward step can write dq, dk and dv where c's buffer holds them and c
 * costs nothing? That is a packed qkv product's gradient: the sum of the
 * slices' gradients (pads) that autodiff makes one concatenation. When it
 * is and lay is not NULL, lay receives the places. False with the reason
 * in why otherwise (the target's alignment is the scheduler's). */
bool kl__attention_bwd_layout(const kl_lctx *L, int32_t at, int32_t c, kl_bwd_layout *lay,
                              char *why, size_t cap);
/* the activation of an KL_EPART_ACT node */
kl_mm_act kl__epilogue_act(const kl_node *x);
/* How node c is read from memory: the buffer of *base with element strides
 * and offset (a stored view is its own dense buffer). False when c is not a
 * strided view of a stored node. */
bool kl__stored_view(const kl_lctx *L, int32_t c, int32_t *base, int64_t *st, int64_t *off);

/* kernel_build.c: the kernel IR of group gi. validate: evaluate every home member
 * (no buffers assigned yet) to decide whether the group is legal. Returns
 * false with the reason in why. */
bool kl__kbuild(kl_lctx *L, const kl_group *G, bool validate, kir_kernel *k, char *why, size_t cap);
/* distinct nodes the last kl__kbuild loaded (buffers the kernel reads) */
int kl__kbuild_loads(const kir_kernel *k);
/* Index of the input of movement node m given an index J of m (ids in a). */
bool kl__move_index(const kl_lctx *L, kl_ixa *a, int32_t m, const int32_t *J, int32_t *I);
/* Index I of a tensor of shape [nin: ish] given index J of its reshape to
 * [nout: osh] (the same row-major element; ids in a). A reshape read the
 * other way round is the same call with the shapes swapped. */
bool kl__reshape_ix(kl_ixa *a, int nin, const int64_t *ish, int nout, const int64_t *osh,
                    const int32_t *J, int32_t *I);
/* Strides (elements) of the buffer a node's value lives in, when read. */
void kl__base_strides(const kl_lctx *L, int32_t n, kl_mono *st);
/* Element strides and offset of node n as a view of the buffer of the
 * non-movement node it reads through (*base); false when it is not a
 * strided view (a reshape that needs division) or strides are symbolic. */
bool kl__view_of(const kl_lctx *L, int32_t n, int32_t *base, int64_t *strides, int64_t *offset);
/* kl__view_of, walking down no further than node stop (a view stored in a
 * buffer of its own: the strides are in that buffer) */
bool kl__view_to(const kl_lctx *L, int32_t n, int32_t stop, int32_t *base, int64_t *strides,
                 int64_t *offset);

static inline const kl_node *kl__nd(const kl_lctx *L, int32_t n)
{
	return &L->g.nodes[n];
}
static inline bool kl__is_reduction(const kl_node *x)
{
	return kl__ops[x->op].cat == KL_CAT_REDUCE && x->a.axes != 0;
}
static inline bool kl__is_view(kl_op op)
{
	return kl__ops[op].cat == KL_CAT_MOVEMENT && op != KL_OP_CONCAT && op != KL_OP_GATHER;
}
/* follow views down to the node whose buffer they read (a view that is
 * itself materialized is read from its own buffer) */
static inline int32_t kl__resolve(const kl_lctx *L, int32_t n)
{
	while (kl__is_view((kl_op)L->g.nodes[n].op) && !L->mat[n])
		n = L->g.nodes[n].in[0];
	return n;
}

#endif /* KILN_LOWER_INT_H */
