/* plan.h - the plan (kl_program): the buffers of a compiled graph, the steps
 * that fill them (generated kernels and library calls: matrix products,
 * attention), and the source of the generated kernels.
 *
 * This is the contract between `lower` (which builds a plan from a graph),
 * `runtime` (which compiles its source once, plans its memory, caches it on
 * disk and executes it) and the backends (which run its library-call steps).
 * It is plain data so that it hashes, serializes (plan_io.c: disk cache, and
 * next AOT packages) and prints. It includes graph and core, nothing above.
 */
#ifndef KILN_PLAN_H
#define KILN_PLAN_H

#include "graph/graph.h"

typedef enum kl_buf_role {
	KL_BUF_INPUT,  /* graph input #index, bound at each call (any strides it was traced with) */
	KL_BUF_OUTPUT, /* graph output #index, fresh dense tensor per call */
	KL_BUF_TEMP    /* intermediate, dense; placed by the memory planner */
} kl_buf_role;

/* A dimension is a constant, or symbol k (a dynamic input dim) when sym > 0:
 * its value at run time is ints[sym - 1] of the call. */
typedef struct kl_symdim {
	int64_t v;   /* value at trace time (the constant when sym == 0) */
	int32_t sym; /* 0: static; k: symbol k */
} kl_symdim;

typedef struct kl_buf {
	kl_buf_role role;
	int32_t index; /* input / output number for INPUT and OUTPUT */
	kl_dtype dtype;
	int ndim;
	kl_symdim shape[KL_MAX_DIMS];
	/* OUTPUT: an output may alias an INPUT (returned unchanged) or another
	 * output; alias >= 0 names that buffer, the runtime then returns a view. */
	int32_t alias;
	int64_t view_strides[KL_MAX_DIMS]; /* alias: the view's strides */
	int64_t view_offset;
} kl_buf;

typedef enum kl_step_kind {
	KL_STEP_KERNEL, /* generated kernel: fn(bufs, ints) */
	KL_STEP_MATMUL, /* library matrix product (BLAS / cuBLASLt) */
	KL_STEP_ATTENTION, /* fused attention (CPU: backend/cpu/attention_cpu.c; CUDA:
	                    * backend/cuda/attention_cuda.c) */
	KL_STEP_CACHE_WRITE /* rows at run-time positions (CPU: backend/cpu/movement.c;
	                     * CUDA: backend/cuda/cache_write_cuda.c) */
} kl_step_kind;

/* The activation a product's epilogue applies last. The numbering is part of
 * the plan format; kl__mm_act_op gives each its op (the op table's unary op,
 * which the CPU epilogue runs through the eager kernels and lowering matches
 * by): a new epilogue activation is one enum value and one row there, plus
 * the CUDA backend's cuBLASLt epilogue where cuBLASLt has one. */
typedef enum kl_mm_act {
	KL_MM_ACT_NONE = 0,
	KL_MM_ACT_RELU,
	KL_MM_ACT_GELU,      /* erf GELU (kl_gelu): the C target only, cuBLASLt has the tanh form */
	KL_MM_ACT_GELU_TANH, /* kl_gelu_tanh: cuBLASLt's GELU epilogue */
	KL_MM_ACT_COUNT
} kl_mm_act;

/* The op of each activation (KL_OP_INPUT for none). */
extern const kl_op kl__mm_act_op[KL_MM_ACT_COUNT];

/* How a library product (cuBLASLt) reads a rows x cols matrix operand with
 * row stride rs and column stride cs: 0 row-wise (unit column stride,
 * leading dimension *ld = rs >= cols), 1 column-wise (unit row stride,
 * *ld = cs >= rows), -1 neither. A dim of extent 1 takes any stride.
 * Lowering for CUDA copies an operand that gives -1 before the product
 * (CPU BLAS steps read any strides). */
static inline int kl__mm_operand_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                                        int64_t *ld)
{
	if (cols == 1)
		cs = 1;
	if (rows == 1)
		rs = cs == 1 ? cols : 1;
	if (cs == 1 && rs >= cols && rs >= 1) {
		*ld = rs;
		return 0;
	}
	if (rs == 1 && cs >= rows && cs >= 1) {
		*ld = cs;
		return 1;
	}
	return -1;
}

/* A generated CUDA kernel takes the program's buffer pointers and symbol
 * values (kl_args) by value, in the 4 KiB kernel parameter block, while they
 * fit: nbufs + nsyms entries of 8 bytes, at most KL_CUDA_ARGS_MAX. Past that
 * the block lives in device memory and the kernel takes its address (the
 * renderer's struct kl_args then holds one pointer; the runtime copies the
 * block to the device before each range of launches, and such a program is
 * not captured as a CUDA graph). Both sides decide by this function. */
#define KL_CUDA_ARGS_MAX 500
static inline bool kl__cuda_args_indirect(int64_t nbufs, int64_t nsyms)
{
	return (nbufs > 0 ? nbufs : 1) + (nsyms > 0 ? nsyms : 1) > KL_CUDA_ARGS_MAX;
}

/* C[b] = act(alpha * op(A[b]) @ op(B[b]) + beta * X[b] + bias) over a batch,
 * where each operand is addressed by element strides; batch index b spans up
 * to KL_MAX_DIMS-2 batch dims with their own strides per operand. X is the
 * residual buffer r when has_r, else C itself (in place, read only when
 * beta != 0). bias is n elements at unit stride, shared by every row and
 * batch. A zeroed epilogue (no r, no bias, KL_MM_ACT_NONE) is a plain
 * product. */
typedef struct kl_matmul_step {
	int32_t a, b, c; /* buffer ids */
	int64_t m, n, k;
	int nbatch;
	int64_t batch[KL_MAX_DIMS];
	int64_t a_bstride[KL_MAX_DIMS], b_bstride[KL_MAX_DIMS], c_bstride[KL_MAX_DIMS];
	int64_t a_off, b_off, c_off;  /* element offsets of the first matrix */
	int64_t a_rs, a_cs, b_rs, b_cs; /* row/col strides of A (m x k) and B (k x n) */
	int64_t ldc;
	double alpha, beta;
	/* epilogue (fused by the scheduler from the product's consumers) */
	bool has_r, has_bias;
	int32_t r, bias;                /* buffer ids when has_r / has_bias */
	int64_t r_off, r_ld;            /* residual: first element, row stride (unit columns) */
	int64_t r_bstride[KL_MAX_DIMS]; /* residual batch strides */
	int64_t bias_off;
	kl_mm_act act;
} kl_matmul_step;

/* O[b] = softmax(Q[b] K[b]^T * scale [+ causal mask]) V[b]: Q is tq x d, K
 * tk x d, V tk x dv, O tq x dv (unit column stride, row stride o_rs >= dv: the
 * step may write into a permuted layout, e.g. [b, t, h, d] for a [b, h, t, d]
 * result that a copy would have transposed). Operands are addressed
 * by element offset, row and column strides and per batch-dim strides; the
 * batch spans nbatch dims. causal: key j is allowed for query i iff
 * j <= i + (tk - tq). All four buffers have one float dtype. */
typedef struct kl_attn_step {
	int32_t q, k, v, o; /* buffer ids */
	int64_t tq, tk, d, dv;
	int nbatch;
	int64_t batch[KL_MAX_DIMS];
	int64_t q_bs[KL_MAX_DIMS], k_bs[KL_MAX_DIMS], v_bs[KL_MAX_DIMS], o_bs[KL_MAX_DIMS];
	int64_t q_off, k_off, v_off;
	int64_t q_rs, q_cs, k_rs, k_cs, v_rs, v_cs, o_rs;
	double scale;
	int32_t causal;
	/* bwd = 1: the backward (sdpa_bwd, graph/ops.def). It also reads the
	 * forward's output O (buffer fo) and its gradient dO (buffer go), both
	 * tq x dv (column strides fo_cs, go_cs: 1 in a plan, any in the CPU's
	 * eager op), and writes the three gradients, rows of d == dv elements at
	 * unit column stride, into o: dq (tq rows) from element dq_off at row
	 * stride o_rs and batch strides o_bs, dk and dv (tk rows each) from
	 * dk_off / dv_off at dk_rs / dv_rs and dk_bs / dv_bs. The packed result
	 * of the op, per batch [dq; dk; dv], is dq_off 0, dk_off tq o_rs, dv_off
	 * (tq + tk) o_rs, every row and batch stride o's; lowering gives other
	 * places where o is the concatenation of the three that a packed qkv
	 * product's gradient is (fuse.c, kl__attention_bwd_layout), so that no
	 * kernel gathers it from the packed result. */
	int32_t bwd;
	int32_t fo, go;
	int64_t fo_off, go_off, fo_rs, go_rs, fo_cs, go_cs;
	int64_t fo_bs[KL_MAX_DIMS], go_bs[KL_MAX_DIMS];
	int64_t dq_off, dk_off, dv_off, dk_rs, dv_rs;
	int64_t dk_bs[KL_MAX_DIMS], dv_bs[KL_MAX_DIMS];
	/* lengths (graph/ops.def), buffer len >= 0 (i32/i64, element len_off +
	 * r * len_st for row r), or -1: none. Flat batch index b (over the
	 * batch[] entries) is row b / (product of the last len_inner entries):
	 * the first batch entry alone is the lengths' dim, or none when that
	 * dim has size 1. Row b's keys end at clamp(lengths[row], 0, tk). */
	int32_t len, len_inner, len_dt;
	int64_t len_off, len_st;
} kl_attn_step;

/* The element offset of flat batch index b (over a's batch[] entries) in an
 * operand whose per-entry strides are bs (q_bs, k_bs, ... of a). */
static inline int64_t kl__attn_batch_off(const kl_attn_step *a, const int64_t *bs, int64_t b)
{
	int64_t off = 0;
	for (int i = a->nbatch - 1; i >= 0; i--) {
		off += (b % a->batch[i]) * bs[i];
		b /= a->batch[i];
	}
	return off;
}

/* The backward's gradients as the op packs them (kl_attn_step.bwd): per
 * batch [dq; dk; dv] at o's row and batch strides, o_rs and o_bs set. */
static inline void kl__attn_bwd_packed(kl_attn_step *a)
{
	a->dq_off = 0;
	a->dk_off = a->tq * a->o_rs;
	a->dv_off = (a->tq + a->tk) * a->o_rs;
	a->dk_rs = a->dv_rs = a->o_rs;
	for (int i = 0; i < KL_MAX_DIMS; i++)
		a->dk_bs[i] = a->dv_bs[i] = a->o_bs[i];
}

/* Whether the CUDA backend runs the attention backward step for dtype dt
 * and head dim d (its tensor-core kernels: f16/bf16, d 64 or 128); lowering
 * expands any other sdpa_bwd for CUDA into primitives. */
static inline bool kl__attn_bwd_cuda_takes(kl_dtype dt, int64_t d)
{
	return (dt == KL_F16 || dt == KL_BF16) && (d == 64 || d == 128);
}

/* cache_write (graph/ops.def): out = cache with rows 0..rows-1 of val written
 * at positions pos[i] .. pos[i] + s - 1 of the position dim. Every buffer is
 * dense: cache and out [R, outer, cap, inner], val [rows, outer, s, inner],
 * pos (i32/i64) [rows]. out == cache writes in place (cache may then be a
 * graph input: the value the graph writes back into it); otherwise the step
 * first copies cache into out. A position outside [0, cap - s] writes
 * nothing for its row and fails the call. */
typedef struct kl_cw_step {
	int32_t cache, pos, val, out; /* buffer ids */
	int64_t rows, R, outer, cap, s, inner;
	/* the values: a view of val's buffer from element val_off, val_rs
	 * elements a row, each row dense (a slice of a packed product's output
	 * is read where it lies, not copied first) */
	int64_t val_off, val_rs;
	int32_t axis; /* the position dim of the user's cache, for messages */
} kl_cw_step;

#define KL_STEP_MAX_NODES 64

typedef struct kl_step {
	kl_step_kind kind;
	int32_t kernel;      /* KERNEL: index into program.kernel_names */
	/* KERNEL with a row loop: the rows one block takes at a time (0: not a
	 * row kernel, or a renderer without thread groups) and the kernel's
	 * rows, the product of these dims, so that a launch needs no more
	 * blocks than rows / row_per */
	int32_t row_per;
	/* with row_per: the most full waves of resident blocks the renderer
	 * wants the grid to hold (1-64; 0 without row_per) */
	int32_t waves;
	int32_t nrowdims;
	kl_symdim rowdims[KL_MAX_DIMS];
	kl_matmul_step mm;   /* MATMUL */
	kl_attn_step at;     /* ATTENTION */
	kl_cw_step cw;       /* CACHE_WRITE */
	/* buffers this step reads and writes (for liveness and explain) */
	int32_t reads[KL_NODE_MAX_IN * 2];
	int32_t nreads;
	int32_t writes[2];
	int32_t nwrites;
	/* KERNEL: writes[0] may take reads[0]'s memory when this step is its
	 * last reader (the memory planner's choice): both temps of one dtype
	 * and shape, and the kernel loads reads[0] only at the element it
	 * stores, in the thread that stores it (lower.c, inplace_read) */
	bool inplace;
	/* the graph nodes this step computes (fused into it) */
	int32_t nodes[KL_STEP_MAX_NODES];
	int32_t nnodes;
	double bytes; /* bytes read + written, each buffer once */
	double flops;
	char what[64]; /* short description: "pointwise", "row softmax", "matmul 64x64x64" */
} kl_step;

/* A library step's size, stride or offset that follows the dynamic dims:
 * field `field` (kl__step_field) of step `step` is c times the product of
 * symbols s[0..ns) (1-based ids). The step holds the value at the traced
 * sizes; kl__program_bind writes each at the call's sizes, so that one plan
 * runs BLAS products and fused attention at every size. */
typedef struct kl_symf {
	int32_t step, field;
	int64_t c;
	int32_t ns;
	int8_t s[KL_MAX_DIMS];
} kl_symf;

typedef struct kl_program {
	kl_buf *bufs;
	int32_t nbufs;
	kl_step *steps;
	int32_t nsteps;
	int32_t nsyms;          /* symbols used by dims (ints[] length) */
	/* symbol k's value = dim sym_dim[k-1] of graph input sym_input[k-1] */
	int32_t sym_input[KL_MAX_DIMS * 4];
	int32_t sym_dim[KL_MAX_DIMS * 4];
	kl_symf *symf;          /* library steps' symbolic fields (NULL when none) */
	int32_t nsymf;
	char **kernel_names;    /* generated function names: "k0", "k1", ... */
	int32_t nkernels;
	char *source;           /* all kernels of the graph: one translation unit */
	char *fusion_log;       /* every fusion refused, with its reason (malloc'd, may be NULL) */
} kl_program;

/* A dynamic input dim that lowering kept static, and why, in the words of
 * the user's calls ("it meets a static dim of a f32 [2304,768] tensor ..."):
 * what kl_explain and kl_fn_stats report as specialised. */
typedef struct kl_spec {
	int32_t input, dim; /* graph input, dim */
	int64_t value;      /* its traced size, which the compiled graph keeps */
	char why[200];
} kl_spec;

/* How the runtime calls a generated CPU kernel of a plan: the buffers'
 * addresses (by buffer id) and the symbols' values. */
typedef void (*kl_kernel_fn)(void *const *bufs, const int64_t *syms);

/* ---- plan_io.c: plans as data ----------------------------------------------- */

void kl__program_free(kl_program *p);
/* Strict structural check of a program: counts, ids in range, names
 * [a-z0-9_], inputs/outputs complete. ninputs/noutputs < 0: not checked. */
kl_status kl__program_validate(const kl_program *p, int ninputs, int noutputs, char *err,
                               size_t errcap);
/* Whether a kernel may write buffer w in place of buffer r (kl_step.inplace):
 * two temps, not one, of one dtype and shape */
bool kl__inplace_bufs(const kl_buf *r, const kl_buf *w);
/* The forward attention step whose rows' L the backward attention step s can
 * read (the same q and k: buffers, offsets, strides, batch dims, sizes,
 * scale, mask; no lengths; no step between them writes q's or k's buffer),
 * or -1. The CUDA runtime pairs the two (runtime/cuda/exec_cuda.c). */
int32_t kl__attn_lse_source(const kl_program *p, int32_t s);
/* Serialize everything but the source (malloc'd buffer). */
kl_status kl__program_serialize(const kl_program *p, uint8_t **out, size_t *len);
/* Parse and validate; out's source is NULL. */
kl_status kl__program_deserialize(const void *data, size_t len, kl_program *out, char *err,
                                  size_t errcap);
/* The largest element index operand which (0 cache, 1 pos, 2 val, 3 out)
 * of a cache write reaches; -1 when empty, -2 when it overflows. */
int64_t kl__cw_extent(const kl_cw_step *c, int which);
/* The largest element index operand which (0 a, 1 b, 2 c) of a product
 * reaches; -1 when empty, -2 when it overflows. */
int64_t kl__mm_extent(const kl_matmul_step *mm, int which);
/* The int64 fields of a library step that may follow the dynamic dims
 * (sizes, strides, offsets of kl_matmul_step and kl_attn_step), numbered
 * 0 .. kl__step_nfields() - 1. */
int kl__step_nfields(void);
int64_t *kl__step_field(kl_step *sp, int field);
/* Write p's symbolic step fields at the symbol values syms and check every
 * library step still addresses only its buffers at those sizes (inputs
 * with symbolic dims are dense, as the runtime binds them). KL_EFORMAT with
 * the reason in err when one would reach outside. */
kl_status kl__program_bind(kl_program *p, const int64_t *syms, char *err, size_t cap);
/* The same where every input is bound dense at its shape (AOT packages,
 * whose plans have no graph to be checked against): static inputs are
 * checked too. */
kl_status kl__program_bind_dense(kl_program *p, const int64_t *syms, char *err, size_t cap);

/* Format a plan's rejection into err (cap bytes; err may be NULL) and
 * return KL_EFORMAT: the one error path of plan_io.c and the runtime's
 * plan check. */
kl_status kl__plan_fail(char *err, size_t cap, const char *fmt, ...) KL_PRINTF(3, 4);
/* The same for an attention step's operand which (0 q, 1 k, 2 v, 3 o: the
 * backward's three gradients, the farthest of them; the backward's 4 O, 5
 * dO; 6 lengths: -1 when it has none). */
int64_t kl__attn_extent(const kl_attn_step *a, int which);
/* Flat batch entries that share one length (the last len_inner batch
 * sizes' product), and the end of the keys of length row r (lens: the
 * lengths buffer's base), clamp(lengths[r], 0, tk). */
int64_t kl__attn_len_div(const kl_attn_step *a);
int64_t kl__attn_len_at(const kl_attn_step *a, const void *lens, int64_t r);

#endif /* KILN_PLAN_H */
