/* render_cuda_walk.h - private to the CUDA renderer (render_cuda.c: the
 * table, chunk planning and I/O, pointwise kernels, the walker's entry;
 * render_cuda_rows.c: row kernels): the walker's context, the chunk plan's
 * types, and the pieces both files use.
 */
#ifndef KILN_RENDER_CUDA_WALK_H
#define KILN_RENDER_CUDA_WALK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "codegen/render.h"
#include "codegen/row_onepass.h"
#include "core/core.h"

#define BLOCK KL_CUDA_BLOCK

/* ---- the walker ---------------------------------------------------------------------- */

typedef struct vplan vplan;

typedef struct cctx {
	const kl_renderer *r;
	const kir_kernel *k;
	kl_sb *sb;
	uint8_t *live;
	int depth;
	int G;  /* threads per row (reductions) */
	int nj; /* row-cache slots per thread (0: no row cache) */
	uint32_t mask; /* emit_block writes the instructions of these opcodes */
	const kl_onepass *one; /* per pass p: passes p and p+1 as one reduction */
	int fixp[KIR_MAX_LOCAL]; /* a row-local array rescaled as read: by kl_fx<p> */
	bool wait;  /* kl_pdl_wait is still to be emitted (row_loop does it) */
	bool early; /* the first row's early loads were emitted before the wait */
	int32_t per; /* rows a block of the fast path's row loop (0: none) */
	int minb;    /* __launch_bounds__'s blocks an SM (0: none) */
	bool pair; /* in onepass_pair: a thread's partials stay its own */
	bool redo; /* emit_block: a pass's float partials again in double (dot_partial):
	            * their sums only, no store, no other accumulator */
	int waves; /* a row kernel's grid in waves (kl_row_grid.waves; render_rows) */
} cctx;

static inline void ind(cctx *c)
{
	for (int i = 0; i < c->depth; i++)
		kl__sb_puts(c->sb, "\t");
}

/* a line at the current depth */
static inline void line(cctx *c, const char *fmt, ...) KL_PRINTF(2, 3);
static inline void line(cctx *c, const char *fmt, ...)
{
	char small[256], *buf = small;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(small, sizeof small, fmt, ap);
	va_end(ap);
	if (n >= 0 && (size_t)n >= sizeof small && (buf = malloc((size_t)n + 1)) != NULL) {
		va_start(ap, fmt);
		vsnprintf(buf, (size_t)n + 1, fmt, ap);
		va_end(ap);
	}
	if (n < 0 || !buf) {
		c->sb->oom = true;
		return;
	}
	ind(c);
	kl__sb_puts(c->sb, buf);
	kl__sb_puts(c->sb, "\n");
	if (buf != small)
		free(buf);
}

static inline void open_brace(cctx *c)
{
	line(c, "{");
	c->depth++;
}

static inline void close_brace(cctx *c)
{
	c->depth--;
	line(c, "}");
}

static inline bool unit(const kir_kernel *k, int d)
{
	return k->dims[d].sym == 0 && k->dims[d].v == 1;
}

/* ---- chunks: 16-byte loads and stores -------------------------------------------------
 *
 * The fast path of a kernel moves memory in chunks of V consecutive elements
 * along one loop variable d (the innermost iterated dim of a pointwise
 * kernel, the reduced dim of a row kernel). Along d an address is
 * contiguous (1 * i_d plus terms without i_d), a broadcast (no i_d), or
 * neither (then the kernel has no fast path). Each contiguous access gets a
 * union kv<a> holding one chunk as 16-byte words and as elements; the
 * kernel's instructions then run once per element e of the chunk, exactly
 * as the scalar path spells them (the same rounding), reading and writing
 * kv<a>.e[e]. Whether a launch may take the fast path is one uniform test,
 * kl_vok: every chunked buffer 16-byte aligned, and every stride or extent
 * known only at run time a multiple of V (the static ones are checked here).
 */

#define VMAX 8              /* elements per chunk at most */
#define ROW_REGS 64         /* row values one thread holds (32 when 8 bytes wide) */
#define ROW_BYTES 512       /* bytes of chunks and row-local arrays one thread holds */
#define UNROLL_BUDGET 1024 /* cost (body_cost) the unrolled element loops may reach */

typedef enum vkind { VK_NO, VK_BCAST, VK_CONT } vkind;

typedef struct vacc {
	int32_t buf;
	kl_dtype dt; /* in memory */
	bool store;
	bool ro;  /* the kernel only reads buf: the read-only cache path */
	int blk;  /* the first block that uses it */
	bool each; /* rows: row-invariant, loaded by every row in block blk
	            * right before use, not held (KILN_CUDA_ROW_HOLD=0) */
	const kir_addr *ad;
} vacc;

struct vplan {
	int d;     /* the chunked loop variable */
	int V;     /* elements per chunk */
	bool flat; /* pointwise: each chunk address is the flat index plus a constant */
	int nacc;
	vacc *acc;
	int32_t *of; /* per instruction: its chunked access, -1 for a scalar one */
	int G;       /* rows: threads per row */
	int nj;      /* rows: chunks per thread */
	int64_t nch; /* rows: chunks per row */
	uint32_t outer; /* rows: the dims rows run over (a load whose address
	                 * depends on them is fetched a row ahead) */
	bool dot;       /* rows: one pass that reads the row and stores none of
	                 * it (plan_rows) */
	bool part;      /* rows: float sums go through a float partial per
	                 * thread and chunk pass (dot_partial) */
};

static inline int msize(kl_dtype dt)
{
	switch (dt) {
	case KL_F64:
	case KL_I64:
		return 8;
	case KL_F32:
	case KL_I32:
		return 4;
	case KL_F16:
	case KL_BF16:
		return 2;
	default:
		return 1;
	}
}

/* a float sum that a row's thread adds up in float first (vp->part) */
static inline bool part_acc(const kir_ins *in)
{
	return in->opc == KIR_ACC && in->op == KL_OP_SUM &&
	       (in->in_dt == KL_F32 || in->in_dt == KL_F16 || in->in_dt == KL_BF16);
}

/* ---- shared between the two files --------------------------------------------- */

/* a's address moves with the row (or has symbolic strides): not one chunk
 * for every row */
static inline bool row_dependent(const cctx *c, const vplan *vp, const vacc *a)
{
	return a->ad->ns > 0 || (c->k->ixa.ex[a->ad->ix].vars & vp->outer) != 0;
}

int64_t kl__cu_body_cost(const cctx *c);
void kl__cu_chunk_decls(cctx *c, const vplan *vp, int slots);
void kl__cu_chunk_io(cctx *c, const vplan *vp, int blk, bool store, const char *slot);
void kl__cu_chunk_io_to(cctx *c, const vplan *vp, int blk, bool store, const char *slot,
                        bool ahead, int which);
void kl__cu_chunk_word(const vplan *vp, const vacc *a, const char **w, int *nw);
void kl__cu_decompose(cctx *c, uint32_t mask, const char *q);
void kl__cu_decompose_to(cctx *c, uint32_t mask, const char *q, bool declare);
bool kl__cu_early_acc(const cctx *c, const vacc *a);
void kl__cu_emit_block(cctx *c, int blk, const vplan *vp, const char *slot, const char *lc);
bool kl__cu_plan_aligned(const cctx *c, const vplan *vp);
bool kl__cu_plan_collect(cctx *c, vplan *vp);
void kl__cu_plan_cond(cctx *c, const vplan *vp);
void kl__cu_plan_free(vplan *vp);
void kl__cu_render_rows(cctx *c);

#endif /* KILN_RENDER_CUDA_WALK_H */
