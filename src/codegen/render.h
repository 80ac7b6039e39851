/* render.h - turning kernel IR into source text.
 *
 * A renderer is a table: the spellings of one target language (type names
 * per dtype, memory load/store conversions, the kernel signature, loop and
 * parallel-for syntax) plus callbacks that spell one operation as an
 * expression. render.c walks a kernel with any table; render_c.c holds the
 * C table and the helpers every C translation unit starts with. A CUDA
 * renderer fills the same table.
 */
#ifndef KILN_RENDER_H
#define KILN_RENDER_H

#include "lower/kernel_ir.h"

/* ---- the table --------------------------------------------------------------- */

/* A row kernel's grid, as its renderer lays it out: per, the rows one
 * block takes at a time (0: not a row kernel, or a renderer without thread
 * groups); waves, the most full waves of resident blocks its grid should
 * hold (0 with per; the launcher's cap unless KILN_CUDA_WAVES is set) */
typedef struct kl_row_grid {
	int32_t per, waves;
} kl_row_grid;

typedef struct kl_accvar {
	const char *suffix, *type, *init;
} kl_accvar;

typedef struct kl_renderer {
	const char *name;
	const char *prelude;            /* emitted once at the top of a translation unit */
	const char *ctype[KL_NDTYPES];  /* type values of a dtype are computed in */
	const char *mtype[KL_NDTYPES];  /* element type in memory */
	const char *load_fmt[KL_NDTYPES];  /* memory element (%s) to compute type */
	const char *store_fmt[KL_NDTYPES]; /* compute value (%s) to memory element */
	const char *kernel_fmt;         /* signature, %s = name */
	/* declares buffer pointer b<i>; printf args: const-qualifier, memory
	 * type, i, const-qualifier, memory type, i, i (a format may skip the last) */
	const char *buf_decl_fmt;
	/* the same without restrict: the buffers of a kernel that writes in place
	 * of one it reads (kir_kernel.shares), which alias */
	const char *buf_decl_alias_fmt;
	const char *index_t;            /* type of loop variables and indices */
	const char *simd_fmt;           /* vectorizable loops: %d = n, %s = an extra clause */
	const char *sym_fmt;            /* the value of symbol k: %d = k - 1 */
	double par_threshold;           /* parallelize loops visiting at least this many elements */
	/* A row kernel's f32 output rows of at least this many bytes in all
	 * (0: never) are written through a row-local array and then streamed
	 * out with non-temporal stores by the prelude's kl_stream_f32(dst, src,
	 * n), so that a large result costs no read-for-ownership. */
	double stream_min_bytes;
	/* The sum of a softmax row (sum(exp(v - max(v))), row_onepass.c's LSE
	 * pattern: every term in [0, 1]) over a static row of at most this many
	 * elements is kept in float, not double (0: never): the vector lanes
	 * are partial sums of at most n/V terms each */
	int64_t exp_sum_float_max;
	/* The prelude has kl_expsum_f32 / _f16 / _bf16(e, x, m, n, pf):
	 * e[i] = exp(x[i] - m) for i < n (x f32, f16 or bf16), bit for bit the
	 * prelude's exp, returning their float sum and prefetching pf[0, n)
	 * meanwhile (NULL: nothing), and kl_scale_f16(d, s, m, n): d[i] =
	 * f16(s[i] * m). A softmax row's exp pass (render.c's match_exp_sum)
	 * and an f16 row's scale-out (match_scale_f16) call them. */
	bool exp_sum_row;
	/* expression callbacks: append the spelling of one operation */
	void (*constant)(kl_sb *sb, kl_dtype dt, double k);
	void (*cast)(kl_sb *sb, kl_dtype to, kl_dtype from, const char *a);
	void (*unary)(kl_sb *sb, kl_op op, kl_dtype dt, const char *a);
	void (*binary)(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b);
	/* key: NULL for the constant seed, else the expression of a key known
	 * at run time (a uint64_t) */
	void (*rand)(kl_sb *sb, kl_op op, uint64_t seed, const char *key, const char *index);
	/* Accumulators. A reduction keeps up to two variables (the value and a
	 * NaN flag or position), named acc + suffix + ix, where ix is "" for a
	 * scalar or "[j]" for one of an array (a column of reductions):
	 * their types and initial values, the update, the result, and the
	 * clause that lets a vectorized loop update them (false: it cannot). */
	int (*acc_vars)(kl_op op, kl_dtype in, kl_accvar *vars);
	void (*acc_update)(kl_sb *sb, kl_op op, kl_dtype in, const char *acc, const char *ix,
	                   const char *v, const char *pos);
	void (*acc_read)(kl_sb *sb, kl_op op, kl_dtype in, kl_dtype dt, const char *acc,
	                 const char *ix);
	bool (*acc_clause)(kl_sb *sb, kl_op op, kl_dtype in, const char *acc);
	/* A target whose loops look nothing like the CPU's (CUDA: grid-stride
	 * loops, a thread group per row) walks kernels itself; NULL: render.c's
	 * loop nests. */
	kl_row_grid (*walk)(const struct kl_renderer *r, const kir_kernel *k, const char *name,
	                    kl_sb *sb);
} kl_renderer;

extern const kl_renderer kl__render_c;
extern const kl_renderer kl__render_cuda;
/* threads of a CUDA block (a row kernel's largest group) */
#define KL_CUDA_BLOCK 256
/* the text that starts every generated CUDA translation unit
 * (render_cuda_prelude.c) */
extern const char kl__render_cuda_prelude[];

/* KILN_CUDA_ROW_GROUP (32, 64, 128 or 256): the threads per row the CUDA
 * row kernels are forced to (where the row fits), else 0: the renderer
 * chooses. Part of the compiled programs' cache key. */
int kl__cuda_row_group(void);
/* The dot rows' knobs (a row read in one pass and none of it stored: a
 * skinny product's dot, a norm's sum of squares), each from the environment,
 * for A/B timing; part of the compiled programs' cache key with the group.
 * chunks: KILN_CUDA_DOT_CHUNKS (1-8, default 4), the most 16-byte chunks of a
 * row one thread holds; the group is the smallest that holds the row so.
 * threads: KILN_CUDA_DOT_THREADS (default 131072), the fewest threads the
 * rows must keep busy for a group below the block (fewer rows: a larger
 * group each). f32: KILN_CUDA_DOT_F32 (0 or 1, default 1), each thread of
 * any chunked row kernel (dot rows, norms, softmax) sums its chunks in float
 * and adds that once to the double accumulator, where every chunked operand
 * is 16-bit (f32 inputs keep a double per element). */
typedef struct kl_cuda_dot {
	int chunks, threads, f32;
	int minb; /* KILN_CUDA_ROW_MINBLOCKS (1-8; default 0, by the kernel): a
	           * row kernel's blocks per SM for __launch_bounds__, which caps
	           * its registers. By default a wide row (render_cuda_rows.c,
	           * wide_row: softmax, layer and RMS norm rows held by the
	           * block) asks for ROW_WIDE_MINB, every other kernel for none */
	int hold; /* KILN_CUDA_ROW_HOLD (0 or 1; default -1, by the kernel): 1,
	           * a chunked row kernel loads its row-invariant chunks (a norm's
	           * weight and bias) once, with the first row's, and holds them
	           * in registers across rows; 0, every row loads them again
	           * (__ldg: L1/L2 hits) in the pass that first uses them, each
	           * chunk right before its use, so they hold registers only
	           * there. By default a wide row takes 0 (its registers go to
	           * more blocks an SM), every other kernel 1. The group and
	           * chunks per thread are chosen alike either way. */
	int pw; /* KILN_CUDA_PW_UNROLL (1, 2, 4 or 8; default 1):
	         * the chunks a pointwise kernel's thread loads before it computes
	         * and stores any of them */
} kl_cuda_dot;
kl_cuda_dot kl__cuda_dot_knobs(void);

/* For walkers: which instructions some store needs (a malloc'd flag per
 * instruction, NULL when out of memory), and one instruction as a statement
 * at depth tabs (not LSTORE/LLOAD, whose arrays a walker lays out itself). */
uint8_t *kl__render_live(const kir_kernel *k);
/* Declare each buffer some live load or store of k touches, typed, const
 * when only read, through r->buf_decl_fmt. */
void kl__render_buf_decls(const kl_renderer *r, const kir_kernel *k, const uint8_t *live,
                          kl_sb *sb);
void kl__render_ins(const kl_renderer *r, const kir_kernel *k, int32_t id, int depth, kl_sb *sb);
/* "(int64_t)1 * d0 * S[1] ..." for the dims in mask; static ones multiply into *v */
bool kl__render_extent(const kl_renderer *r, const kir_kernel *k, uint32_t dims, kl_sb *sb,
                       double *v);
/* the extent of dim d: its constant or symbol */
void kl__render_dim(const kl_renderer *r, const kir_kernel *k, int d, kl_sb *sb);

/* Appends kernel k as function name. Returns its row grid where the
 * renderer lays rows over thread groups (CUDA's row kernels: the launcher
 * sizes their grids from it), else zeros. */
kl_row_grid kl__render_kernel(const kl_renderer *r, const kir_kernel *k, const char *name,
                              kl_sb *sb);

#endif /* KILN_RENDER_H */
