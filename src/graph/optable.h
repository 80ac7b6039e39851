/* optable.h - the op table: everything kiln knows about one op, in one
 * descriptor per op.
 *
 * ops.def gives each op its row (enum, public name, arity, category). The
 * rest of an op's meaning is its descriptor, kl__desc_<ID>, defined in the
 * file of its family:
 *   op_pointwise.c  binary, compare, unary, cast, clamp, where
 *   op_reduce.c     sum, mean, max, min, var, argmax
 *   op_other.c      sources, movement, matmul, composites, attention
 * kl__opdesc[op] points at it; the table is expanded from ops.def, so an op
 * whose descriptor is missing does not link, and tests/test_optable.c fails
 * when a descriptor lacks a field its category needs.
 *
 * Adding a pointwise op: one row in ops.def, one PW_* row in op_pointwise.c
 * (its reference math and its generated-code expression). The C and CUDA
 * renderers spell it from the expression, eager CPU runs it through the
 * reference math when the backend has no hand-vectorized loop for it, and
 * the table walk tests it in every mode.
 */
#ifndef KILN_OPTABLE_H
#define KILN_OPTABLE_H

#include "graph/graph.h"

/* The operands an op's dtype rule sees: each tensor's dtype and rank, and
 * the numbers among its arguments (a binary op's right-hand number, clamp's
 * bounds), which promote like Python numbers. */
typedef struct kl_operands {
	int n;
	kl_dtype dt[KL_NODE_MAX_IN];
	int ndim[KL_NODE_MAX_IN];
	int nscalar;
	double scalar[2];
} kl_operands;

/* How the eager path runs an op: the backend's kernel family for it. */
typedef enum kl_eager {
	KL_EAGER_NONE,      /* never executed on its own (graph inputs) */
	KL_EAGER_SOURCE,    /* fill, arange, rand, randn */
	KL_EAGER_POINTWISE, /* the backend's pointwise engine */
	KL_EAGER_REDUCE,    /* the backend's reduction engine */
	KL_EAGER_VIEW,      /* a view of the input's storage (no kernel) */
	KL_EAGER_COPY,      /* contiguous, concat, gather: the movement kernels */
	KL_EAGER_MATMUL,    /* the backend's product (BLAS, cuBLASLt) */
	KL_EAGER_ROWS,      /* softmax, log_softmax, the norms: row kernels */
	KL_EAGER_SDPA       /* the backend's attention */
} kl_eager;

typedef struct kl_refstate kl_refstate; /* reference.c's evaluation state */

/* A vector-Jacobian rule (NULL: the op has no gradient, or its rule is
 * still to come; the sweep in graph/autodiff.c then names it): given the forward node n (index
 * `node` of graph g) and the node holding the gradient of its output
 * (`gout`), append to g the nodes of the gradient of each input and store
 * their indices in gin[0..n->nin) (-1: no gradient flows to that input,
 * e.g. an integer operand or where's condition). Returns KL_OK, or an error
 * status when g cannot grow. */
typedef kl_status (*kl_vjp_fn)(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);

typedef struct kl_opdesc {
	/* Dtype rule: the result dtype from the operands (torch's promotion,
	 * see kl__result_type), or KL_NDTYPES with the reason in why. NULL: the
	 * op's result dtype is set by its public builder from attributes
	 * (sources, cast) or is its input's (movement). */
	kl_dtype (*dtype)(kl_op op, const kl_operands *in, char *why, size_t cap);
	/* Shape rule: does node n's shape follow from its inputs' shapes?
	 * false with the reason in why. Checked by the reference on every node. */
	bool (*shape)(const kl_node *n, const int *ndim, const int64_t *const *shape, char *why,
	              size_t cap);
	/* Float64 reference: node n's values into out (dense, row-major),
	 * before rounding to its dtype. */
	kl_status (*ref)(kl_refstate *st, const kl_node *n, double *out);
	/* Pointwise math in double: unary ops read a, binary a and b, where
	 * (a ? b : c) all three; attrs for clamp's bounds. Used by the
	 * reference, and by eager execution of ops without a hand-written loop. */
	double (*math)(const kl_attrs *at, double a, double b, double c);
	/* The same in integers, wrapping at dt's width (NULL: integer operands
	 * go through math in double, exactly for the values ops produce). */
	double (*imath)(kl_dtype dt, int64_t a, int64_t b);
	/* Reductions: the value of one row of len elements. */
	double (*row)(const kl_node *n, const double *x, int64_t len);
	/* The generated-code expression, shared by the C and CUDA renderers,
	 * for float compute types (f32, f16, bf16), for double and for the
	 * integer types: "$a", "$b" are the operands; "$f" is the libm suffix
	 * ("f" or ""), "$t" kiln's helper suffix ("f" or "d"), "$s" and "$u"
	 * the signed and unsigned C types of the integer width, "$w" its bits. NULL: the op
	 * has no such form (a renderer then emits text that fails to compile,
	 * and the table test fails first). */
	const char *expr_f, *expr_d, *expr_i;
	/* The reference applies math to the operand as given, not first
	 * rounded to the result dtype (cast, clamp). */
	bool raw;
	/* Lowering builds the op from other instructions (cast: a conversion,
	 * clamp: maximum and minimum, where: a select): no expression needed. */
	bool composed;
	/* A reduction without an identity (max, min, argmax): a row of no
	 * elements is an error. */
	bool no_identity;
	kl_eager eager;
	kl_vjp_fn vjp; /* the vector-Jacobian rule, written with graph/build.h; NULL: none */
} kl_opdesc;

#define KL_OP(ID, name, arity, cat) extern const kl_opdesc kl__desc_##ID;
#include "graph/ops.def"
#undef KL_OP

extern const kl_opdesc *const kl__opdesc[KL_NOPS];

/* ---- the rules the descriptors share ----------------------------------------- */

/* torch.result_type over tensors and numbers: categories bool < int <
 * float; dimensioned tensors decide within their category; 0-dim tensors
 * count only when their category is above the dimensioned ones' (then they
 * decide among themselves, as torch's "sufficient size and category to hold
 * all zero-dim tensor operands of that category"); a number counts only
 * when its category is above every tensor's, and then as the default of
 * its category (an integral number i64, any other f32). */
kl_dtype kl__result_type(const kl_operands *in);

/* matmul's shape rule on plain arrays: [..., M, K] x [..., K, N] -> out,
 * batch dims equal (the front end broadcasts them). */
bool kl__matmul_shapes_ok(int nd, const int64_t *out, int and_, const int64_t *as, int bnd,
                          const int64_t *bs);

/* Pointwise op `op` on one element, as the reference defines it: a, b, c
 * are the operands' values (b: the number of a scalar_rhs op); arithmetic
 * happens in the result dtype dt (operands rounded to it first, except for
 * comparisons, where, cast and clamp), with the op's integer math for an
 * integer dt where it has one. The result is not yet rounded to dt. */
double kl__op_eval(kl_op op, const kl_attrs *at, kl_dtype dt, double a, double b, double c);

/* The reduced dims of reduction n over an input of xndim dims (bit i: dim i). */
uint32_t kl__reduce_mask(const kl_node *n, int xndim);

/* Sum of x[0..n) with Neumaier compensation (the reference's sum). */
double kl__ref_sum(const double *x, int64_t n);

/* Two's-complement value of u at dt's width (i32 or i64), as a double. */
double kl__wrap_to(kl_dtype dt, uint64_t u);

/* The reference's drivers for the families (reference.c). */
kl_status kl__ref_pointwise(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_reduce(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_source(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_movement(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_matmul(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_softmax(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_norm(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_attention(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_attention_bwd(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_index_add(kl_refstate *st, const kl_node *n, double *out);
kl_status kl__ref_cache_write(kl_refstate *st, const kl_node *n, double *out);

/* cache_write's geometry: the cache [R, A..., T, I...] with its position dim
 * at axis, values [rows, A..., s, I...], positions [rows]; outer = the
 * product of A..., inner of I.... false with the reason in why (naming
 * the shapes) when they do not fit. */
typedef struct kl_cw_geom {
	int64_t rows, R, outer, cap, s, inner;
	int64_t vrs; /* elements from one row of values to the next (dense: outer * s * inner) */
} kl_cw_geom;
bool kl__cache_write_geom(int axis, int cnd, const int64_t *cs, int pnd, const int64_t *ps,
                          int vnd, const int64_t *vs, kl_cw_geom *g, char *why, size_t cap);

/* index_add's shape rule on plain arrays: base [R, row...], indices [I...],
 * source [I..., row...] give out = base's shape. */
bool kl__index_add_shapes_ok(int nd, const int64_t *out, int bnd, const int64_t *bs, int ind,
                             const int64_t *is, int snd, const int64_t *ss);

/* The vector-Jacobian rules of the contraction, composite and gather ops
 * (grad_other.c), written in graph ops through graph/build.h. */
kl_status kl__vjp_matmul(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);
kl_status kl__vjp_softmax(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);
kl_status kl__vjp_norm(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);
kl_status kl__vjp_sdpa(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);
/* sdpa_bwd node bwd (its inputs in g) as primitives appended to g: the packed
 * [dq; dk; dv] (a concat) in bwd's dtype, or -1 when g cannot grow. Lowering's
 * expansion where the target has no fused backward. */
int32_t kl__sdpa_bwd_primitives(kl_graph *g, const kl_node *bwd);
kl_status kl__vjp_gather(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);
kl_status kl__vjp_index_add(kl_graph *g, int32_t node, int32_t gout, int32_t *gin);

#endif /* KILN_OPTABLE_H */
