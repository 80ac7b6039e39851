/* render_cuda.c - the CUDA C renderer: kernels for NVRTC (with kiln_prelude.cuh),
 * the same expression spellings and helpers as the C renderer (so the math,
 * NaN rules, casts and Philox agree bit for bit), its own loop walker.
 *
 * Launch contract with the runtime: every kernel takes one by-value
 * `kl_args` (all buffer pointers of the program, then the symbol values) and
 * runs with 256 threads per block on any grid (one block is enough, more
 * than needed only idle): pointwise kernels are grid-stride loops over the
 * flattened iteration space; reductions give each outer point ("row") a
 * group of G threads (32, 64, 128 or the block: see plan_rows), BLOCK/G
 * rows a block, that reduce through warp shuffles and shared memory, each
 * group behind its own named barrier, the groups striding over the rows. A launch that finds every chunked buffer 16-byte aligned takes
 * the fast path (16-byte loads and stores; rows held in registers), decided
 * inside the kernel; the runtime needs to know nothing about it. Two
 * passes that row_onepass.c matches (max then sum of exp, sum then squared
 * deviations) share one group reduction of per-thread partials.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/render.h"
#include "codegen/row_onepass.h"
#include "core/core.h"

#define BLOCK KL_CUDA_BLOCK

/* ---- expressions: the C renderer's spellings ------------------------------------- */

static void cu_constant(kl_sb *sb, kl_dtype dt, double k)
{
	kl__render_c.constant(sb, dt, k);
}

static void cu_cast(kl_sb *sb, kl_dtype to, kl_dtype from, const char *a)
{
	if (from == KL_F64 && (to == KL_F16 || to == KL_BF16)) {
		kl__sb_printf(sb, to == KL_F16 ? "kl_h2f(kl_d2h(%s))" : "kl_bf2f(kl_d2bf(%s))", a);
		return;
	}
	kl__render_c.cast(sb, to, from, a);
}

static void cu_unary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a)
{
	kl__render_c.unary(sb, op, dt, a);
}

static void cu_binary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b)
{
	kl__render_c.binary(sb, op, dt, a, b);
}

static void cu_rand(kl_sb *sb, kl_op op, uint64_t seed, const char *index)
{
	kl__render_c.rand(sb, op, seed, index);
}

/* float max and min: NaN is folded into the value (kl_maxn/kl_minn let a
 * NaN operand win), not kept as a flag beside it as on the CPU, so a group
 * combines one variable per accumulator */
static bool nan_folded(kl_op op, kl_dtype in)
{
	return (op == KL_OP_MAX || op == KL_OP_MIN) &&
	       (in == KL_F32 || in == KL_F64 || in == KL_F16 || in == KL_BF16);
}

static int cu_acc_vars(kl_op op, kl_dtype in, kl_accvar *vars)
{
	int n = kl__render_c.acc_vars(op, in, vars);
	return nan_folded(op, in) ? 1 : n;
}

static void cu_acc_update(kl_sb *sb, kl_op op, kl_dtype in, const char *acc, const char *ix,
                          const char *v, const char *pos)
{
	if (nan_folded(op, in))
		kl__sb_printf(sb, "%s%s = kl_%sn<%s>(%s%s, %s);", acc, ix,
		              op == KL_OP_MAX ? "max" : "min", kl__render_cuda.ctype[in], acc, ix, v);
	else
		kl__render_c.acc_update(sb, op, in, acc, ix, v, pos);
}

static void cu_acc_read(kl_sb *sb, kl_op op, kl_dtype in, kl_dtype dt, const char *acc,
                        const char *ix)
{
	if (nan_folded(op, in) && dt != KL_BOOL)
		kl__sb_printf(sb, "(%s)%s%s", kl__render_cuda.ctype[dt], acc, ix);
	else
		kl__render_c.acc_read(sb, op, in, dt, acc, ix);
}

static bool cu_acc_clause(kl_sb *sb, kl_op op, kl_dtype in, const char *acc)
{
	(void)sb;
	(void)op;
	(void)in;
	(void)acc;
	return false;
}

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
} cctx;

static void ind(cctx *c)
{
	for (int i = 0; i < c->depth; i++)
		kl__sb_puts(c->sb, "\t");
}

/* a line at the current depth */
static void line(cctx *c, const char *fmt, ...) KL_PRINTF(2, 3);
static void line(cctx *c, const char *fmt, ...)
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

static void open_brace(cctx *c)
{
	line(c, "{");
	c->depth++;
}

static void close_brace(cctx *c)
{
	c->depth--;
	line(c, "}");
}

static bool unit(const kir_kernel *k, int d)
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

static int msize(kl_dtype dt)
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

static bool addr_eq(const kir_addr *a, const kir_addr *b)
{
	if (a->ix != b->ix || a->ns != b->ns)
		return false;
	for (int i = 0; i < a->ns; i++) {
		const kl_mono *x = &a->sst[i], *y = &b->sst[i];
		if (a->six[i] != b->six[i] || x->c != y->c || x->ns != y->ns)
			return false;
		for (int s = 0; s < x->ns; s++)
			if (x->s[s] != y->s[s])
				return false;
	}
	return true;
}

/* How ad moves with loop variable d. *al: the terms without i_d (and the
 * constant) are multiples of V, as far as is known here (symbolic strides
 * are tested at run time). */
static vkind along(const kir_kernel *k, const kir_addr *ad, int d, int V, bool *al)
{
	const kl_ixa *a = &k->ixa;
	const kl_ix *e = &a->ex[ad->ix];
	uint32_t bit = 1u << d;
	bool cont = false;
	*al = e->c % V == 0;
	for (int i = 0; i < ad->ns; i++)
		if (a->ex[ad->six[i]].vars & bit)
			return VK_NO;
	for (int t = 0; t < e->nt; t++) {
		const kl_atom *at = &a->atoms[e->at[t]];
		if (at->vars & bit) {
			if (at->kind != KL_AT_VAR || e->k[t] != 1)
				return VK_NO;
			cont = true;
		} else if (e->k[t] % V) {
			*al = false;
		}
	}
	return cont ? VK_CONT : VK_BCAST;
}

/* ad is the flat (row-major) index of a static iteration space plus a constant */
static bool flat_addr(const kir_kernel *k, const kir_addr *ad)
{
	const kl_ix *e = &k->ixa.ex[ad->ix];
	if (ad->ns)
		return false;
	int64_t stride = 1;
	int n = 0;
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (k->dims[d].sym > 0)
			return false;
		if (unit(k, d))
			continue;
		bool found = false;
		for (int t = 0; t < e->nt && !found; t++) {
			const kl_atom *at = &k->ixa.atoms[e->at[t]];
			found = at->kind == KL_AT_VAR && at->var == d && e->k[t] == stride;
		}
		if (!found)
			return false;
		n++;
		stride *= k->dims[d].v;
	}
	return e->nt == n;
}

static bool is_chunk_blk(const cctx *c, int blk)
{
	return c->k->rmask ? blk % 2 == 1 : blk == 0;
}

static bool buf_written(const cctx *c, int32_t buf)
{
	for (int32_t i = 0; i < c->k->nins; i++)
		if (c->live[i] && c->k->ins[i].opc == KIR_STORE && c->k->ins[i].buf == buf)
			return true;
	return false;
}

static void plan_free(vplan *vp)
{
	free(vp->acc);
	free(vp->of);
	memset(vp, 0, sizeof *vp);
}

/* The accesses of the chunked blocks along vp->d, and V; false when some
 * access cannot be chunked or none can. */
static bool plan_collect(cctx *c, vplan *vp)
{
	const kir_kernel *k = c->k;
	vp->acc = calloc((size_t)k->nins + 1, sizeof *vp->acc);
	vp->of = malloc(((size_t)k->nins + 1) * sizeof *vp->of);
	if (!vp->acc || !vp->of) {
		c->sb->oom = true;
		return false;
	}
	int minsz = 8;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		vp->of[i] = -1;
		if (!c->live[i] || !is_chunk_blk(c, in->blk) ||
		    (in->opc != KIR_LOAD && in->opc != KIR_STORE))
			continue;
		/* a gather reads at a row only known per element: no chunks */
		if (in->opc == KIR_LOAD && in->a >= 0)
			return false;
		bool st = in->opc == KIR_STORE, al;
		vkind kd = along(k, &in->ad, vp->d, 1, &al);
		if (kd == VK_NO || (st && kd != VK_CONT))
			return false;
		if (kd == VK_BCAST)
			continue;
		int a = 0;
		while (a < vp->nacc && !(vp->acc[a].buf == in->buf && vp->acc[a].store == st &&
		                         addr_eq(vp->acc[a].ad, &in->ad)))
			a++;
		if (a == vp->nacc) {
			vacc *x = &vp->acc[vp->nacc++];
			x->buf = in->buf;
			x->dt = (kl_dtype)(st ? in->dt : in->in_dt);
			x->store = st;
			x->ro = !st && !buf_written(c, in->buf);
			x->blk = in->blk;
			x->ad = &in->ad;
			if (msize(x->dt) < minsz)
				minsz = msize(x->dt);
		}
		if (in->blk < vp->acc[a].blk)
			vp->acc[a].blk = in->blk;
		vp->of[i] = a;
	}
	vp->V = 16 / minsz > VMAX ? VMAX : 16 / minsz;
	return vp->nacc > 0;
}

/* every chunk starts V-aligned: the terms beside i_d (statically) */
static bool plan_aligned(const cctx *c, const vplan *vp)
{
	for (int a = 0; a < vp->nacc; a++) {
		bool al;
		if (along(c->k, vp->acc[a].ad, vp->d, vp->V, &al) != VK_CONT || !al)
			return false;
	}
	return true;
}

/* What the chunked blocks cost, unrolled once: the element loops repeat
 * them V (rows: nj * V) times, so kernels heavy in arithmetic (which gain
 * little from wide accesses) keep the scalar path and compile fast. */
static int64_t body_cost(const cctx *c)
{
	int64_t n = 0;
	for (int32_t i = 0; i < c->k->nins; i++) {
		const kir_ins *in = &c->k->ins[i];
		if (!c->live[i] || !is_chunk_blk(c, in->blk))
			continue;
		if (in->opc == KIR_UNARY)
			n += kl__ops[in->op].cat == KL_CAT_UNARY_FLOAT ? 16 : 1;
		else if (in->opc == KIR_BINARY)
			n += in->op == KL_OP_POW ? 16 : in->op == KL_OP_DIV ? 2 : 1;
		else
			n += in->opc == KIR_RAND ? 128 : 1;
	}
	return n;
}

static bool plan_pointwise(cctx *c, vplan *vp)
{
	const kir_kernel *k = c->k;
	memset(vp, 0, sizeof *vp);
	vp->d = -1;
	for (int d = 0; d < k->ndim; d++)
		if (!unit(k, d))
			vp->d = d;
	if (vp->d < 0 || !plan_collect(c, vp))
		return false;
	int V = vp->V;
	if (body_cost(c) * V > UNROLL_BUDGET)
		return false;
	/* flat: chunks may cross rows, any size (a scalar tail) */
	bool flat = true;
	for (int a = 0; a < vp->nacc && flat; a++)
		flat = flat_addr(k, vp->acc[a].ad) && k->ixa.ex[vp->acc[a].ad->ix].c % V == 0;
	for (int32_t i = 0; i < k->nins && flat; i++)
		if (c->live[i] && k->ins[i].opc == KIR_LOAD && vp->of[i] < 0)
			flat = k->ins[i].ad.ns == 0 && k->ixa.ex[k->ins[i].ad.ix].vars == 0;
	vp->flat = flat;
	if (flat)
		return true;
	/* otherwise chunks stay inside rows of d: its extent a multiple of V */
	const kl_symdim *dd = &k->dims[vp->d];
	if (dd->sym == 0 && dd->v % V)
		return false;
	return plan_aligned(c, vp);
}

int kl__cuda_row_group(void)
{
	const char *e = getenv("KILN_CUDA_ROW_GROUP");
	int g = e ? atoi(e) : 0;
	return g == 32 || g == 64 || g == 128 || g == BLOCK ? g : 0;
}

kl_cuda_dot kl__cuda_dot_knobs(void)
{
	kl_cuda_dot d = {4, 131072, 1, 0, -1, 1};
	const char *e = getenv("KILN_CUDA_DOT_CHUNKS");
	if (e && atoi(e) >= 1 && atoi(e) <= 8)
		d.chunks = atoi(e);
	if ((e = getenv("KILN_CUDA_DOT_THREADS")) && atol(e) >= 0 && atol(e) <= (1L << 24))
		d.threads = (int)atol(e);
	if ((e = getenv("KILN_CUDA_DOT_F32")) && (atoi(e) == 0 || atoi(e) == 1))
		d.f32 = atoi(e);
	if ((e = getenv("KILN_CUDA_ROW_MINBLOCKS")) && atoi(e) >= 1 && atoi(e) <= 8)
		d.minb = atoi(e);
	if ((e = getenv("KILN_CUDA_ROW_HOLD")) && (strcmp(e, "0") == 0 || strcmp(e, "1") == 0))
		d.hold = atoi(e);
	if ((e = getenv("KILN_CUDA_PW_UNROLL")) &&
	    (!strcmp(e, "1") || !strcmp(e, "2") || !strcmp(e, "4") || !strcmp(e, "8")))
		d.pw = atoi(e);
	return d;
}

/* G threads per row of vp->nch chunks: each thread's nj chunks within cap
 * values, its chunks and row-local values within max_bytes, the unrolled
 * element loops within the budget; sets vp->G and vp->nj when they are */
static bool row_fits(const cctx *c, vplan *vp, int G, int cap, int64_t max_bytes)
{
	const kir_kernel *k = c->k;
	int V = vp->V;
	int64_t nj = (vp->nch + G - 1) / G;
	if (nj * V > cap || body_cost(c) * nj * V > UNROLL_BUDGET)
		return false;
	int64_t bytes = 0;
	for (int a = 0; a < vp->nacc; a++)
		bytes += nj * V * msize(vp->acc[a].dt);
	for (int i = 0; i < k->nlocal; i++)
		bytes += nj * V * msize((kl_dtype)k->local_dt[i]);
	if (bytes > max_bytes)
		return false;
	vp->G = G;
	vp->nj = (int)nj;
	return true;
}

/* The group of a dot row (vp->dot): the smallest of 32 ... 256 threads at
 * which a thread holds at most kl_cuda_dot.chunks chunks and the rows keep
 * kl_cuda_dot.threads threads busy (fewer rows: a larger group each; one
 * row: the block), within the limits. Several loads in flight a thread,
 * several rows a block where rows are short; a long row (a down
 * projection's 8192) takes the block. The block when nothing smaller fits
 * the knobs. */
static bool dot_group(const cctx *c, vplan *vp, int cap, int64_t nrows)
{
	kl_cuda_dot kn = kl__cuda_dot_knobs();
	for (int g = 32; g < BLOCK; g *= 2) {
		if ((vp->nch + g - 1) / g > kn.chunks || nrows < ((int64_t)kn.threads + g - 1) / g)
			continue;
		if (row_fits(c, vp, g, cap, ROW_BYTES))
			return true;
	}
	return row_fits(c, vp, BLOCK, cap, ROW_BYTES);
}

/* a's address moves with the row (or has symbolic strides): not one chunk
 * for every row */
static bool row_dependent(const cctx *c, const vplan *vp, const vacc *a)
{
	return a->ad->ns > 0 || (c->k->ixa.ex[a->ad->ix].vars & vp->outer) != 0;
}

/* A wide row: a block's row (not a dot row), whose row-dependent loads
 * take at most 32 bytes a thread (a 4096-wide bf16 softmax, layer or RMS
 * norm row: two 16-byte chunks). Such a kernel streams: the more blocks an
 * SM, the more bytes in flight. So by default it gets __launch_bounds__
 * for ROW_WIDE_MINB blocks and leaves its row-invariant chunks to L1
 * rather than registers (KILN_CUDA_ROW_HOLD=0). On an H200 (run 23,
 * 16384 x 4096 bf16, eight waves) that took softmax from 71.0 to 70.5 us,
 * layer norm from 73.8 (72 registers: three blocks an SM) to 71.9, RMS
 * norm 70.0 either way, RMS norm from primitives 74.6 to 72.2; the same
 * knobs on every row kernel slowed the one-token layer's dot rows from
 * 47.8 to 60.1 us, so dot rows and longer rows keep none. */
#define ROW_WIDE_MINB 5
static bool wide_row(const cctx *c, const vplan *vp)
{
	if (vp->dot || vp->G != BLOCK)
		return false;
	int64_t bytes = 0;
	for (int a = 0; a < vp->nacc; a++)
		if (!vp->acc[a].store && row_dependent(c, vp, &vp->acc[a]))
			bytes += (int64_t)vp->nj * vp->V * msize(vp->acc[a].dt);
	return bytes > 0 && bytes <= 32;
}

/* nrows: the rows when static, else INT64_MAX */
static bool plan_rows(cctx *c, vplan *vp, int64_t nrows)
{
	const kir_kernel *k = c->k;
	memset(vp, 0, sizeof *vp);
	vp->d = -1;
	for (int d = 0; d < k->ndim; d++) {
		if (!(k->rmask & (1u << d)) || unit(k, d))
			continue;
		if (vp->d >= 0 || k->dims[d].sym > 0)
			return false; /* one static reduced dim only */
		vp->d = d;
	}
	if (vp->d < 0 || k->dims[vp->d].v <= 0 || !plan_collect(c, vp))
		return false;
	int V = vp->V;
	int64_t rn = k->dims[vp->d].v;
	if (rn % V)
		return false;
	vp->nch = rn / V;
	int wide = 0;
	for (int a = 0; a < vp->nacc; a++)
		wide |= msize(vp->acc[a].dt) == 8;
	for (int i = 0; i < k->nlocal; i++)
		wide |= msize((kl_dtype)k->local_dt[i]) == 8;
	int cap = wide ? ROW_REGS / 2 : ROW_REGS;
	vp->dot = k->npass == 1;
	for (int a = 0; a < vp->nacc; a++)
		vp->dot &= !vp->acc[a].store;
	/* float partials only where every chunked operand is 16-bit: they lose
	 * nothing such inputs had, while f32 inputs keep a double per element
	 * (an 8192-long f32 dot drifted 2.3e-4 relative with partials on an
	 * H200) */
	bool half = vp->nacc > 0;
	for (int a = 0; a < vp->nacc; a++)
		half &= msize(vp->acc[a].dt) == 2;
	/* every row kernel's sums, not only dot rows': a layer norm's two sums
	 * converted each bf16 element to double, 2 x 67 M F2F.F64 at 16 a clock
	 * an SM, about 36 us of its 88 on an H200 (run of 2026-12-03) */
	vp->part = half && kl__cuda_dot_knobs().f32;
	/* A dot row takes dot_group's choice. Otherwise the group: a warp when a lane's share fits (up to cap values and half
	 * the bytes: no barrier at all), else the block. Groups of 64 or 128
	 * threads (several rows a block, fewer chunks a thread) measured slower
	 * on an H200 for 4096-wide bf16 rows (softmax 88.2 vs 82.7 us, layer
	 * norm 96.9 vs 87.1, rms norm from primitives 104.3 vs 92.4 at 128
	 * against the block; 2026-12-03), so they are only taken when forced:
	 * KILN_CUDA_ROW_GROUP forces a group that fits the limits. */
	int force = kl__cuda_row_group();
	bool fits = force && row_fits(c, vp, force, cap, ROW_BYTES);
	if (!fits && vp->dot)
		fits = dot_group(c, vp, cap, nrows);
	if (!fits)
		fits = row_fits(c, vp, 32, cap, ROW_BYTES / 2);
	if (!fits && !row_fits(c, vp, BLOCK, cap, ROW_BYTES))
		return false;
	/* every chunk of the row is loaded at the start of the first pass, all
	 * in flight at once (not a wait for the weights of a layer norm in the
	 * last pass); KILN_CUDA_ROW_HOLD=0 leaves the row-invariant ones in the
	 * block that first uses them, loaded there by every row */
	for (int d = 0; d < k->ndim; d++)
		if (!(k->rmask & (1u << d)))
			vp->outer |= 1u << d;
	kl_cuda_dot kn = kl__cuda_dot_knobs();
	bool wrow = wide_row(c, vp);
	bool hold = kn.hold >= 0 ? kn.hold != 0 : !wrow;
	if (wrow && !kn.minb)
		c->minb = ROW_WIDE_MINB;
	for (int a = 0; a < vp->nacc; a++) {
		if (vp->acc[a].store)
			continue;
		if (!hold && !row_dependent(c, vp, &vp->acc[a]))
			vp->acc[a].each = true;
		else
			vp->acc[a].blk = 1;
	}
	return plan_aligned(c, vp);
}

/* "const bool kl_vok = ...": the run-time half of the fast path's conditions */
static void plan_cond(cctx *c, const vplan *vp)
{
	const kir_kernel *k = c->k;
	kl_sb *sb = c->sb;
	ind(c);
	kl__sb_puts(sb, "const bool kl_vok = ((0ull");
	for (int a = 0; a < vp->nacc; a++) {
		bool dup = false;
		for (int b = 0; b < a; b++)
			dup |= vp->acc[b].buf == vp->acc[a].buf;
		if (!dup)
			kl__sb_printf(sb, " | (unsigned long long)b%d", (int)vp->acc[a].buf);
	}
	kl__sb_puts(sb, ") & 15) == 0");
	for (int a = 0; a < vp->nacc && !vp->flat; a++) {
		const kir_addr *ad = vp->acc[a].ad;
		for (int i = 0; i < ad->ns; i++) {
			const kl_mono *m = &ad->sst[i];
			if (m->c % vp->V == 0)
				continue;
			kl__sb_printf(sb, " && ((int64_t)%lld", (long long)m->c);
			for (int s = 0; s < m->ns; s++) {
				kl__sb_puts(sb, " * ");
				kl__sb_printf(sb, c->r->sym_fmt, m->s[s] - 1);
			}
			kl__sb_printf(sb, ") %% %d == 0", vp->V);
		}
	}
	if (!vp->flat && k->dims[vp->d].sym > 0) {
		kl__sb_puts(sb, " && (");
		kl__render_dim(c->r, k, vp->d, sb);
		kl__sb_printf(sb, ") %% %d == 0", vp->V);
	}
	kl__sb_puts(sb, ";\n");
}

/* the address of access a at the loop variables in scope (a chunk's start) */
static void addr_text(cctx *c, const vplan *vp, const vacc *a, kl_sb *out)
{
	if (vp->flat) {
		kl__sb_printf(out, "L0 + %lld", (long long)c->k->ixa.ex[a->ad->ix].c);
		return;
	}
	/* render.c spells addresses; an index instruction of the same address
	 * in a one-instruction copy of the kernel reads "int64_t t0 = ADDR;" */
	kir_kernel kk = *c->k;
	kir_ins one;
	memset(&one, 0, sizeof one);
	one.opc = KIR_INDEX;
	one.dt = KL_I64;
	one.a = one.b = one.c = one.buf = one.acc = -1;
	one.ad = *a->ad;
	kk.ins = &one;
	kk.nins = 1;
	kl_sb t = {0};
	kl__render_ins(c->r, &kk, 0, 0, &t);
	const char *s = kl__sb_str(&t), *eq = strstr(s, " = ");
	size_t n = strlen(s);
	if (!eq || n < 2 || s[n - 2] != ';' || s + n - 2 < eq + 3) {
		out->oom = true;
	} else {
		kl__sb_printf(out, "%.*s", (int)(s + n - 2 - (eq + 3)), eq + 3);
	}
	kl__sb_free(&t);
}

static void chunk_word(const vplan *vp, const vacc *a, const char **w, int *nw)
{
	int cb = vp->V * msize(a->dt);
	*w = cb >= 16 ? "uint4" : cb == 8 ? "uint2" : cb == 4 ? "unsigned int" : "unsigned short";
	*nw = cb >= 16 ? cb / 16 : 1;
}

static void chunk_decls(cctx *c, const vplan *vp, int slots)
{
	for (int a = 0; a < vp->nacc; a++) {
		const char *w;
		int nw;
		chunk_word(vp, &vp->acc[a], &w, &nw);
		line(c, "union { %s u[%d]; %s e[%d]; } kv%d[%d];", w, nw,
		     c->r->mtype[vp->acc[a].dt], vp->V, a, slots);
	}
}

/* an access loaded before kl_pdl_wait (row_loop): the first row's, so not
 * one that every row loads again (vacc.each) */
static bool early_acc(const cctx *c, const vacc *a)
{
	return c->k->early && !a->store && a->blk == 1 && !a->each && c->k->early[a->buf];
}

/* load or store the chunks of the accesses first used in block blk (the
 * loads) or stored there (the stores).
 * ahead: the loads of the next row into kn<a> (row-dependent ones only).
 * which: 0 every access, 1 the early ones, 2 all but the early ones, 3 the
 * loads every row makes right before use (vacc.each; 0-2 leave them out) */
static void chunk_io_to(cctx *c, const vplan *vp, int blk, bool store, const char *slot,
                        bool ahead, int which)
{
	for (int ai = 0; ai < vp->nacc; ai++) {
		const vacc *a = &vp->acc[ai];
		if (a->store != store || a->blk != blk || (ahead && !row_dependent(c, vp, a)))
			continue;
		if (!store && a->each != (which == 3))
			continue;
		if ((which == 1 && !early_acc(c, a)) || (which == 2 && early_acc(c, a)))
			continue;
		const char *kv = ahead ? "kn" : "kv";
		const char *w;
		int nw;
		chunk_word(vp, a, &w, &nw);
		kl_sb ad = {0};
		addr_text(c, vp, a, &ad);
		if (ad.oom)
			c->sb->oom = true;
		const char *s = kl__sb_str(&ad);
		int b = (int)a->buf;
		for (int i = 0; i < nw; i++) {
			if (store)
				line(c, "*((%s *)(b%d + (%s)) + %d) = kv%d%s.u[%d];", w, b, s, i, ai,
				     slot, i);
			else if (a->ro)
				line(c, "%s%d%s.u[%d] = __ldg((const %s *)(b%d + (%s)) + %d);", kv, ai,
				     slot, i, w, b, s, i);
			else
				line(c, "%s%d%s.u[%d] = *((const %s *)(b%d + (%s)) + %d);", kv, ai, slot,
				     i, w, b, s, i);
		}
		kl__sb_free(&ad);
	}
}

static void chunk_io(cctx *c, const vplan *vp, int blk, bool store, const char *slot)
{
	chunk_io_to(c, vp, blk, store, slot, false, 0);
}

/* A row-local array that holds exp(v - M) computed with a thread's own M
 * (a one-reduction pair of passes): read as the row's, rescaled by
 * kl_fx<p> and rounded again as the exp was on its way to the array. */
static void fixed_load(cctx *c, const kir_ins *in, int32_t id, const char *lc)
{
	const kir_kernel *k = c->k;
	int p = c->fixp[in->acc];
	const kl_onepass *op = &c->one[p];
	int32_t casts[16];
	int nc = 0;
	for (int32_t v = op->held[in->acc]; v != op->exp && v >= 0 && nc < 16; v = k->ins[v].a)
		casts[nc++] = v;
	kl_sb e = {0}, t = {0};
	kl__sb_printf(&e, "(lc%d[%s] * kl_fx%d)", (int)in->acc, lc, p);
	for (int i = nc - 1; i >= 0; i--) {
		const kir_ins *x = &k->ins[casts[i]];
		kl__sb_free(&t);
		c->r->cast(&t, (kl_dtype)x->dt, (kl_dtype)x->in_dt, kl__sb_str(&e));
		kl__sb_free(&e);
		e = t;
		memset(&t, 0, sizeof t);
	}
	if (e.oom)
		c->sb->oom = true;
	line(c, "%s t%d = %s;", c->r->ctype[in->dt], (int)id, kl__sb_str(&e));
	kl__sb_free(&e);
}

/* a float sum that a row's thread adds up in float first (vp->part) */
static bool part_acc(const kir_ins *in)
{
	return in->opc == KIR_ACC && in->op == KL_OP_SUM &&
	       (in->in_dt == KL_F32 || in->in_dt == KL_F16 || in->in_dt == KL_BF16);
}

/* A row's float partials of pass block blk: declared (open) or added to
 * their double accumulators (!open). A thread's share is at most 64
 * products; the F2F.F64 conversion per element, at 16 a clock an SM on
 * sm_90, would otherwise bound the product below the memory's rate. */
static void dot_partial(cctx *c, const vplan *vp, int blk, bool open)
{
	const kir_kernel *k = c->k;
	if (!vp->part)
		return;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (!c->live[i] || in->blk != blk || !part_acc(in))
			continue;
		bool first = true; /* one partial per accumulator */
		for (int32_t j = 0; j < i && first; j++)
			first = !(c->live[j] && k->ins[j].blk == blk && part_acc(&k->ins[j]) &&
			          k->ins[j].acc == in->acc);
		if (!first)
			continue;
		if (open)
			line(c, "float kp%d = 0.0f;", (int)in->acc);
		else
			line(c, "acc%d += (double)kp%d;", (int)in->acc, (int)in->acc);
	}
}

/* The instructions of block blk. With a plan vp, chunked loads and stores
 * take element e of their chunk in `slot`, and (pointwise) broadcast loads
 * are left out, hoisted before the element loop. lc: the row-local arrays'
 * index. */
static void emit_block(cctx *c, int blk, const vplan *vp, const char *slot, const char *lc)
{
	const kir_kernel *k = c->k;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i] || !(c->mask & (1u << in->opc)))
			continue;
		if (in->opc == KIR_LSTORE) {
			line(c, "lc%d[%s] = t%d;", (int)in->acc, lc, (int)in->a);
		} else if (in->opc == KIR_LLOAD && in->acc < KIR_MAX_LOCAL && c->fixp[in->acc]) {
			fixed_load(c, in, i, lc);
		} else if (in->opc == KIR_LLOAD) {
			line(c, "%s t%d = lc%d[%s];", c->r->ctype[in->dt], (int)i, (int)in->acc, lc);
		} else if (vp && vp->part && part_acc(in)) {
			line(c, "kp%d += t%d;", (int)in->acc, (int)in->a);
		} else if (vp && vp->of[i] >= 0) {
			char el[48];
			snprintf(el, sizeof el, "kv%d%s.e[e]", (int)vp->of[i], slot);
			ind(c);
			if (in->opc == KIR_LOAD) {
				kl__sb_printf(c->sb, "%s t%d = ", c->r->ctype[in->dt], (int)i);
				kl__sb_printf(c->sb, c->r->load_fmt[in->in_dt], el);
			} else {
				char v[24];
				snprintf(v, sizeof v, "t%d", (int)in->a);
				kl__sb_printf(c->sb, "%s = ", el);
				kl__sb_printf(c->sb, c->r->store_fmt[in->dt], v);
			}
			kl__sb_puts(c->sb, ";\n");
		} else if (vp && !k->rmask && in->opc == KIR_LOAD) {
			continue; /* a broadcast, loaded once per chunk */
		} else {
			kl__render_ins(c->r, k, i, c->depth, c->sb);
		}
	}
}

/* Sets the loop variables of the dims in mask from the flat index q (the
 * innermost dim fastest); unit dims are 0. */
static void decompose(cctx *c, uint32_t mask, const char *q)
{
	const kir_kernel *k = c->k;
	int first = -1;
	for (int d = 0; d < k->ndim && first < 0; d++)
		if ((mask & (1u << d)) && !unit(k, d))
			first = d;
	line(c, "int64_t q = %s;", q);
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (!(mask & (1u << d)))
			continue;
		ind(c);
		if (unit(k, d)) {
			kl__sb_printf(c->sb, "const int64_t i%d = 0;\n", d);
			continue;
		}
		if (d == first) {
			kl__sb_printf(c->sb, "const int64_t i%d = q;\n", d);
			continue;
		}
		kl__sb_printf(c->sb, "const int64_t i%d = q %% (", d);
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
		ind(c);
		kl__sb_puts(c->sb, "q /= (");
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
	}
	line(c, "(void)q;");
}

/* ---- pointwise kernels ------------------------------------------------------------------ */

/* Chunks of one thread in flight: U = KILN_CUDA_PW_UNROLL (default 1),
 * within the unrolled body's budget. More than one measured slower on the
 * H200 (run 15: the decoder layer 990 against 941 us, relu(a*b+c) at
 * 8192^2 4.16 against 4.21 TB/s, the copy 3.91 either way), so it is an
 * A/B knob. */
static int pw_unroll(const cctx *c, const vplan *vp)
{
	int u = kl__cuda_dot_knobs().pw;
	while (u > 1 && body_cost(c) * vp->V * u > UNROLL_BUDGET)
		u /= 2;
	return u;
}

/* The fast path: a grid-stride loop whose thread T takes U chunks of flat
 * indices a grid apart, [V*(T + u*G), ... + V) with G = the grid's threads:
 * the loads of all U first, then each one's elements and stores. The
 * scalar loop then does the rest (a tail, or everything when kl_vok is
 * false). */
static void pointwise_chunks(cctx *c, const vplan *vp, uint32_t all)
{
	const kir_kernel *k = c->k;
	int V = vp->V, U = pw_unroll(c, vp);
	plan_cond(c, vp);
	line(c, "const int64_t nv = kl_vok ? n / %d : 0;", V);
	line(c, "const int64_t kl_gs = (int64_t)gridDim.x * %d; /* %d chunk%s a thread in flight */",
	     BLOCK, U, U > 1 ? "s" : "");
	line(c, "for (int64_t T = (int64_t)blockIdx.x * %d + threadIdx.x; T < nv; T += kl_gs * %d)",
	     BLOCK, U);
	open_brace(c);
	chunk_decls(c, vp, U);
	bool vars = false;
	for (int32_t i = 0; i < k->nins; i++)
		vars |= c->live[i] && (k->ins[i].opc == KIR_INDEX || k->ins[i].opc == KIR_IDXLT);
	for (int pass = 0; pass < 2; pass++) {
		line(c, "#pragma unroll");
		line(c, "for (int u = 0; u < %d; u++)", U);
		open_brace(c);
		line(c, "if (T + u * kl_gs >= nv)");
		line(c, "\tbreak;");
		line(c, "const int64_t L0 = (T + u * kl_gs) * %d;", V);
		if (!vp->flat)
			decompose(c, all, "L0");
		if (pass == 0) {
			chunk_io(c, vp, 0, false, "[u]");
			close_brace(c);
			continue;
		}
		for (int32_t i = 0; i < k->nins; i++)
			if (c->live[i] && k->ins[i].opc == KIR_LOAD && vp->of[i] < 0)
				kl__render_ins(c->r, k, i, c->depth, c->sb);
		line(c, "#pragma unroll");
		line(c, "for (int e = 0; e < %d; e++)", V);
		open_brace(c);
		if (vars)
			decompose(c, all, "L0 + e");
		emit_block(c, 0, vp, "[u]", "0");
		close_brace(c);
		chunk_io(c, vp, 0, true, "[u]");
		close_brace(c);
	}
	close_brace(c);
}

static void render_pointwise(cctx *c)
{
	const kir_kernel *k = c->k;
	uint32_t all = k->ndim ? (uint32_t)((1ull << k->ndim) - 1) : 0;
	kl_sb n = {0};
	double v;
	kl__render_extent(c->r, k, all, &n, &v);
	line(c, "const int64_t n = %s;", kl__sb_str(&n));
	kl__sb_free(&n);
	vplan vp;
	bool vec = plan_pointwise(c, &vp);
	if (vec)
		pointwise_chunks(c, &vp, all);
	/* with chunks, the scalar loop starts after them */
	char from[32] = "";
	if (vec)
		snprintf(from, sizeof from, "nv * %d + ", vp.V);
	line(c,
	     "for (int64_t L = %s(int64_t)blockIdx.x * %d + threadIdx.x; L < n; "
	     "L += (int64_t)gridDim.x * %d)",
	     from, BLOCK, BLOCK);
	open_brace(c);
	decompose(c, all, "L");
	emit_block(c, 0, NULL, "", "0");
	close_brace(c);
	plan_free(&vp);
}

/* ---- row kernels -------------------------------------------------------------------------- */

/* the group reduction of every accumulator pass p updates */
static void combine(cctx *c, int p)
{
	const kir_kernel *k = c->k;
	uint8_t *done = calloc((size_t)k->nacc + 1, 1);
	if (!done) {
		c->sb->oom = true;
		return;
	}
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc != KIR_ACC || in->blk != 2 * p - 1 || !c->live[i] || done[in->acc])
			continue;
		done[in->acc] = 1;
		kl_op op = (kl_op)in->op;
		int a = (int)in->acc;
		if (op == KL_OP_ARGMAX) {
			line(c,
			     "{ long long ai_ = acc%di; kl_gargmax<%d>(acc%d, ai_, kl_sh, kl_shi, kl_ph); "
			     "acc%di = ai_; }",
			     a, c->G, a, a);
			continue;
		}
		/* one variable each: float max/min fold NaN in (cu_acc_vars) */
		const char *f = op == KL_OP_SUM   ? "kl_add_op"
		                : op == KL_OP_MAX ? "kl_max_op"
		                                  : "kl_min_op";
		line(c, "acc%d = kl_gred<%d>(acc%d, %s(), kl_sh, kl_ph);", a, c->G, a, f);
	}
	free(done);
}

/* pass p over the row, the scalar way: position r = lane + G * j */
static void pass_scalar(cctx *c, int p, uint32_t inner)
{
	const kir_kernel *k = c->k;
	if (c->nj) {
		line(c, "#pragma unroll");
		line(c, "for (int j = 0; j < %d; j++)", c->nj);
		open_brace(c);
		line(c, "const int64_t r = lane + (int64_t)j * %d;", c->G);
		line(c, "if (r >= rn)");
		line(c, "\tbreak;");
	} else {
		/* NVRTC 13.0 crashes (SIGSEGV) unrolling this loop when it divides
		 * the position by a dim's extent, for some extents and G (e.g.
		 * 6 x 50 by 64, 6 x 100 by 256): such loops stay rolled */
		int nd = 0;
		for (int d = 0; d < k->ndim; d++)
			nd += (inner & (1u << d)) && !unit(k, d);
		if (nd > 1)
			line(c, "#pragma unroll 1");
		line(c, "for (int64_t r = lane; r < rn; r += %d)", c->G);
		open_brace(c);
	}
	/* the reduced dims from the flat position in the row */
	line(c, "int64_t q = r;");
	int first = -1;
	for (int d = 0; d < k->ndim && first < 0; d++)
		if ((inner & (1u << d)) && !unit(k, d))
			first = d;
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (!(inner & (1u << d)) || unit(k, d))
			continue;
		ind(c);
		if (d == first) {
			kl__sb_printf(c->sb, "i%d = q;\n", d);
			continue;
		}
		kl__sb_printf(c->sb, "i%d = q %% (", d);
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
		ind(c);
		kl__sb_puts(c->sb, "q /= (");
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
	}
	line(c, "(void)q;");
	emit_block(c, 2 * p - 1, NULL, "", "j");
	close_brace(c);
}

/* the chunk slots of one thread: j, the chunk ch = lane + G * j of the row,
 * i_d at the chunk's start; closed by close_brace twice */
static void open_slots(cctx *c, const vplan *vp)
{
	line(c, "#pragma unroll");
	line(c, "for (int j = 0; j < %d; j++)", vp->nj);
	open_brace(c);
	line(c, "const int64_t ch = lane + (int64_t)j * %d;", vp->G);
	if (vp->nch % vp->G)
		line(c, "if (ch < %lld)", (long long)vp->nch);
	open_brace(c);
	line(c, "i%d = ch * %d;", vp->d, vp->V);
}

/* pass p over a row held in registers: thread lane has the chunks
 * lane + G * j, all loaded (in flight together) before the first pass
 * reads them */
static void pass_chunks(cctx *c, int p, const vplan *vp)
{
	int V = vp->V, d = vp->d, blk = 2 * p - 1;
	bool loads = false, each = false, stores = false;
	for (int a = 0; a < vp->nacc; a++) {
		loads |= !vp->acc[a].store && vp->acc[a].blk == blk && !vp->acc[a].each;
		each |= vp->acc[a].each && vp->acc[a].blk == blk;
		stores |= vp->acc[a].store && vp->acc[a].blk == blk;
	}
	if (loads) {
		/* a later row's chunks came ahead (and row-invariant ones, such
		 * as a norm's weight, are still held, unless KILN_CUDA_ROW_HOLD=0
		 * has every row load them below): loaded on the first only */
		line(c, "if (!kl_ahead)");
		open_brace(c);
		open_slots(c, vp);
		chunk_io_to(c, vp, blk, false, "[j]", false, c->early ? 2 : 0);
		close_brace(c);
		close_brace(c);
		close_brace(c);
		/* the next row's chunks, in flight while this one is reduced */
		bool any = false;
		for (int a = 0; a < vp->nacc; a++)
			any |= !vp->acc[a].store && vp->acc[a].blk == blk &&
			       row_dependent(c, vp, &vp->acc[a]);
		if (any) {
			open_brace(c);
			line(c, "const int64_t kl_next = row + (int64_t)gridDim.x * %d;",
			     BLOCK / vp->G);
			line(c, "if (kl_next < nrows)");
			open_brace(c);
			decompose(c, vp->outer, "kl_next");
			open_slots(c, vp);
			chunk_io_to(c, vp, blk, false, "[j]", true, 0);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			close_brace(c);
		}
	}
	dot_partial(c, vp, blk, true);
	open_slots(c, vp);
	/* KILN_CUDA_ROW_HOLD=0: this row's row-invariant chunks, each right
	 * before the elements that read it */
	if (each)
		chunk_io_to(c, vp, blk, false, "[j]", false, 3);
	line(c, "#pragma unroll");
	line(c, "for (int e = 0; e < %d; e++)", V);
	open_brace(c);
	line(c, "i%d = ch * %d + e;", d, V);
	char lc[32];
	snprintf(lc, sizeof lc, "j * %d + e", V);
	emit_block(c, blk, vp, "[j]", lc);
	close_brace(c);
	if (stores) {
		line(c, "i%d = ch * %d;", d, V);
		chunk_io(c, vp, blk, true, "[j]");
	}
	close_brace(c);
	close_brace(c);
	dot_partial(c, vp, blk, false);
}

static void pass_body(cctx *c, int p, const vplan *vp, uint32_t inner)
{
	if (vp)
		pass_chunks(c, p, vp);
	else
		pass_scalar(c, p, inner);
}

/* block blk with only (or without) the instructions of the opcodes in mask */
static void emit_part(cctx *c, int blk, uint32_t mask)
{
	c->mask = mask;
	emit_block(c, blk, NULL, "", "0");
	c->mask = ~0u;
}

/* Passes p and p+1 of a matched pair (row_onepass.h) with one group
 * reduction: each thread reduces its own values in both passes, pass p+1
 * seeing block 2p computed from its own partial result (a thread of -inf
 * values subtracts 0; VAR: the sum scaled so that M is the thread's mean);
 * the partials merge; block 2p then runs on the row's result, and pass
 * p+1's sum is moved to the row's M. */
static void onepass_pair(cctx *c, const kl_onepass *op, const vplan *vp, uint32_t inner)
{
	const kir_kernel *k = c->k;
	int p = op->p, a = (int)op->acc_a, b = (int)op->acc_b, m = (int)op->m, G = c->G;
	const uint32_t init = 1u << KIR_ACC_INIT, store = 1u << KIR_STORE;
	const char *mt = c->r->ctype[k->ins[op->m].dt];
	bool lse = op->kind == KL_ONEPASS_LSE;
	line(c, "/* passes %d and %d, one reduction: %s */", p, p + 1,
	     lse ? "max and sum of exp" : "count, sum and squared deviations");
	pass_body(c, p, vp, inner);
	emit_part(c, 2 * p, init);
	if (lse) {
		kl_dtype adt = KL_F32;
		for (int32_t i = 0; i < k->nins; i++)
			if (k->ins[i].opc == KIR_ACC && k->ins[i].acc == op->acc_a)
				adt = (kl_dtype)k->ins[i].in_dt;
		line(c, "const %s kl_m%d = acc%d;", c->r->ctype[adt], p, a);
	} else {
		if (vp)
			line(c, "double kl_n%d = %d.0 * (%lld > lane ? (%lld - lane + %d) / %d : 0);", p,
			     vp->V, (long long)vp->nch, (long long)vp->nch, G - 1, G);
		else
			line(c, "double kl_n%d = (double)(rn > lane ? (rn - lane + %d) / %d : 0);", p,
			     G - 1, G);
		line(c, "const double kl_s%d = acc%d;", p, a);
	}
	line(c, "%s kl_ml%d;", mt, p);
	open_brace(c);
	if (lse)
		line(c, "acc%d = acc%d == -INFINITY ? 0 : acc%d;", a, a, a);
	else
		line(c, "acc%d = kl_n%d > 0 ? acc%d * (%lld.0 / kl_n%d) : 0;", a, p, a,
		     (long long)op->n, p);
	emit_part(c, 2 * p, ~(init | store));
	line(c, "acc%d = kl_%s%d;", a, lse ? "m" : "s", p);
	line(c, "kl_ml%d = t%d;", p, m);
	pass_body(c, p + 1, vp, inner);
	close_brace(c);
	if (lse) {
		line(c, "acc%d = kl_rebase(acc%d, kl_ml%d, (%s)acc%d);", b, b, p, mt, a);
		line(c, "kl_glse<%d>(acc%d, acc%d, kl_sh, kl_shi, kl_ph);", G, a, b);
		/* a row of -inf: every exp(v - M) is NaN */
		line(c, "if (acc%d == -INFINITY && rn > 0)", a);
		line(c, "\tacc%d = NAN;", b);
	} else {
		line(c, "if (kl_n%d > 0)", p);
		line(c, "\tacc%d -= kl_n%d * (kl_s%d / kl_n%d - (double)kl_ml%d) * "
		        "(kl_s%d / kl_n%d - (double)kl_ml%d);",
		     b, p, p, p, p, p, p, p);
		/* sums of squares about 0 for values of f32 or narrower (held in
		 * double), Chan's merge for f64 */
		bool sq = k->ins[op->m].dt != KL_F64;
		line(c, "kl_gvar<%d, %s>(kl_n%d, acc%d, acc%d, kl_sh, kl_shi, kl_shv, kl_ph);", G,
		     sq ? "true" : "false", p, a, b);
	}
	emit_part(c, 2 * p, ~init);
	if (lse) {
		line(c, "acc%d = kl_rebase(acc%d, (%s)acc%d, t%d);", b, b, mt, a, m);
		bool held = false;
		for (int i = 0; i < KIR_MAX_LOCAL; i++)
			if (op->held[i] >= 0) {
				c->fixp[i] = p;
				held = true;
			}
		if (held)
			line(c, "const %s kl_fx%d = kl_lse_fix((%s)kl_m%d, kl_ml%d, (%s)acc%d, t%d);", mt,
			     p, mt, p, p, mt, a, m);
	} else {
		line(c, "acc%d += %lld.0 * (acc%d / %lld.0 - (double)t%d) * (acc%d / %lld.0 - (double)t%d);",
		     b, (long long)op->n, a, (long long)op->n, m, a, (long long)op->n, m);
	}
}

/* the loop over rows: a group of G threads per row; with vp, the row in
 * registers */
static void row_loop(cctx *c, uint32_t outer, uint32_t inner, int G, const vplan *vp)
{
	const kir_kernel *k = c->k;
	c->G = G;
	int per = BLOCK / G;
	if (!c->per)
		c->per = per;
	open_brace(c);
	if (vp)
		line(c, "/* row group: %d threads, %d rows a block, %d chunks of %d a thread */", G,
		     per, vp->nj, vp->V);
	else
		line(c, "/* row group (scalar): %d threads, %d rows a block */", G, per);
	line(c, "const int lane = threadIdx.x %% %d;", G);
	line(c, "int kl_ph = 0; /* which half of kl_sh the next reduction uses */");
	line(c, "(void)kl_ph;");
	if (vp) {
		/* the row's chunks, kept across rows: kn<a> holds the next row's */
		chunk_decls(c, vp, vp->nj);
		for (int a = 0; a < vp->nacc; a++) {
			if (vp->acc[a].store || !row_dependent(c, vp, &vp->acc[a]))
				continue;
			const char *w;
			int nw;
			chunk_word(vp, &vp->acc[a], &w, &nw);
			line(c, "union { %s u[%d]; %s e[%d]; } kn%d[%d];", w, nw,
			     c->r->mtype[vp->acc[a].dt], vp->V, a, vp->nj);
		}
		line(c, "bool kl_ahead = false;");
	}
	c->early = false;
	if (c->wait) {
		/* the first row's chunks of buffers no step writes (weights) are
		 * in flight while the kernel before this one finishes */
		bool any = false;
		for (int a = 0; vp && !c->one && a < vp->nacc; a++)
			any |= early_acc(c, &vp->acc[a]);
		if (any) {
			open_brace(c);
			line(c, "const int64_t row = (int64_t)blockIdx.x * %d + threadIdx.x / %d;", per,
			     G);
			line(c, "if (row < nrows)");
			open_brace(c);
			decompose(c, outer, "row");
			for (int d = 0; d < k->ndim; d++)
				if (inner & (1u << d))
					line(c, "int64_t i%d = 0;", d);
			open_slots(c, vp);
			chunk_io_to(c, vp, 1, false, "[j]", false, 1);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			close_brace(c);
			c->early = true;
		}
		line(c, "kl_pdl_wait();");
	}
	/* every thread of a group runs the same number of iterations: the
	 * shuffles and barriers inside see full groups */
	line(c,
	     "for (int64_t row = (int64_t)blockIdx.x * %d + threadIdx.x / %d; row < nrows; "
	     "row += (int64_t)gridDim.x * %d)",
	     per, G, per);
	open_brace(c);
	decompose(c, outer, "row");
	for (int d = 0; d < k->ndim; d++)
		if (inner & (1u << d))
			line(c, "int64_t i%d = 0;", d);
	int slots = vp ? vp->nj * vp->V : c->nj;
	for (int i = 0; i < k->nlocal; i++)
		line(c, "%s lc%d[%d];", c->r->ctype[k->local_dt[i]], i, slots);
	emit_block(c, 0, NULL, "", "0");
	memset(c->fixp, 0, sizeof c->fixp);
	for (int p = 1; p <= k->npass; p++) {
		if (c->one && c->one[p].kind != KL_ONEPASS_NONE) {
			onepass_pair(c, &c->one[p], vp, inner);
			p++;
		} else {
			pass_body(c, p, vp, inner);
			combine(c, p);
		}
		emit_block(c, 2 * p, NULL, "", "0");
	}
	if (vp) {
		for (int a = 0; a < vp->nacc; a++) {
			if (vp->acc[a].store || !row_dependent(c, vp, &vp->acc[a]))
				continue;
			const char *w;
			int nw;
			chunk_word(vp, &vp->acc[a], &w, &nw);
			line(c, "#pragma unroll");
			line(c, "for (int j = 0; j < %d; j++)", vp->nj);
			line(c, "\tfor (int u = 0; u < %d; u++)", nw);
			line(c, "\t\tkv%d[j].u[u] = kn%d[j].u[u];", a, a);
		}
		line(c, "kl_ahead = true;");
	}
	close_brace(c);
	close_brace(c);
}

static void render_rows(cctx *c)
{
	const kir_kernel *k = c->k;
	uint32_t outer = 0, inner = 0;
	for (int d = 0; d < k->ndim; d++) {
		if (k->rmask & (1u << d))
			inner |= 1u << d;
		else
			outer |= 1u << d;
	}
	kl_sb rows = {0}, rn = {0};
	double nrows, vr;
	bool nstat = kl__render_extent(c->r, k, outer, &rows, &nrows);
	bool rstat = kl__render_extent(c->r, k, inner, &rn, &vr);
	/* the scalar path: the smallest group at which a thread takes at most
	 * 8 positions of a static row, else the block */
	int G = kl__cuda_row_group();
	for (int g = 32; !G && rstat && g < BLOCK; g *= 2)
		if (vr <= 8.0 * g)
			G = g;
	if (!G)
		G = BLOCK;
	c->nj = k->nlocal ? (int)((k->row_n + G - 1) / G) : 0;
	line(c, "__shared__ unsigned long long kl_sh[%d];", 2 * BLOCK / 32);
	line(c, "__shared__ long long kl_shi[%d];", 2 * BLOCK / 32);
	line(c, "(void)kl_sh;");
	line(c, "(void)kl_shi;");
	/* pairs of passes that one reduction serves */
	kl_onepass *one = NULL;
	bool var = false;
	if (kl__cuda_row_onepass() && k->npass >= 2 &&
	    !(one = calloc((size_t)k->npass + 2, sizeof *one)))
		c->sb->oom = true;
	for (int p = 1; one && p < k->npass; p++) {
		/* a pass that ends a pair starts none */
		if (one[p - 1].kind == KL_ONEPASS_NONE)
			kl__onepass_match(k, c->live, p, rstat ? (int64_t)vr : 0, &one[p]);
		var |= one[p].kind == KL_ONEPASS_VAR;
	}
	c->one = one;
	if (var)
		line(c, "__shared__ unsigned long long kl_shv[%d];", 2 * BLOCK / 32);
	line(c, "const int64_t nrows = %s, rn = %s;", kl__sb_str(&rows), kl__sb_str(&rn));
	line(c, "(void)rn;");
	vplan vp;
	if (plan_rows(c, &vp, nstat && nrows < 9.0e18 ? (int64_t)nrows : INT64_MAX)) {
		plan_cond(c, &vp);
		line(c, "if (kl_vok)");
		row_loop(c, outer, inner, vp.G, &vp);
		line(c, "else");
	}
	row_loop(c, outer, inner, G, NULL);
	plan_free(&vp);
	c->one = NULL;
	free(one);
	kl__sb_free(&rows);
	kl__sb_free(&rn);
}

/* the rows a block takes: the first row loop's (the chunked path's where
 * there is one: the aligned case, which the grid is sized for; the scalar
 * path's grid-stride loop covers whatever a different group leaves) */
static int32_t cu_walk(const kl_renderer *r, const kir_kernel *k, const char *name, kl_sb *sb)
{
	/* the body first: its row plan chooses the launch bounds (c.minb) */
	kl_sb body = {0};
	cctx c = {.r = r, .k = k, .sb = &body, .depth = 1, .mask = ~0u};
	if (!(c.live = kl__render_live(k))) {
		sb->oom = true;
		return 0;
	}
	c.minb = k->rmask ? kl__cuda_dot_knobs().minb : 0;
	/* first, before any global access: the runtime may launch this kernel
	 * while the one before it still runs (kl_pdl_wait in the prelude); a row
	 * kernel's row_loop waits after the loads it may issue earlier */
	kl__sb_puts(&body, "\n{\n");
	c.wait = k->rmask && k->early;
	if (!c.wait)
		kl__sb_puts(&body, "\tkl_pdl_wait();\n");
	bool empty = false;
	for (int d = 0; d < k->ndim; d++)
		empty |= k->dims[d].sym == 0 && k->dims[d].v == 0 && !(k->rmask & (1u << d));
	if (!empty) {
		kl__render_buf_decls(r, k, c.live, &body);
		if (k->rmask == 0)
			render_pointwise(&c);
		else
			render_rows(&c);
	}
	kl__sb_puts(&body, "}\n\n");
	free(c.live);
	if (c.minb)
		kl__sb_printf(sb,
		              "extern \"C\" __global__ void __launch_bounds__(%d, %d) %s(const kl_args A)",
		              BLOCK, c.minb, name);
	else
		kl__sb_printf(sb, r->kernel_fmt, name);
	if (body.oom)
		sb->oom = true;
	else
		kl__sb_puts(sb, kl__sb_str(&body));
	kl__sb_free(&body);
	return c.per;
}

const kl_renderer kl__render_cuda = {
        .name = "cuda",
        .prelude = kl__render_cuda_prelude,
        .ctype = {[KL_F32] = "float",
                  [KL_F64] = "double",
                  [KL_F16] = "float",
                  [KL_BF16] = "float",
                  [KL_I32] = "int32_t",
                  [KL_I64] = "int64_t",
                  [KL_BOOL] = "int"},
        .mtype = {[KL_F32] = "float",
                  [KL_F64] = "double",
                  [KL_F16] = "uint16_t",
                  [KL_BF16] = "uint16_t",
                  [KL_I32] = "int32_t",
                  [KL_I64] = "int64_t",
                  [KL_BOOL] = "uint8_t"},
        .load_fmt = {[KL_F32] = "%s",
                     [KL_F64] = "%s",
                     [KL_F16] = "kl_h2f(%s)",
                     [KL_BF16] = "kl_bf2f(%s)",
                     [KL_I32] = "%s",
                     [KL_I64] = "%s",
                     [KL_BOOL] = "(%s != 0)"},
        .store_fmt = {[KL_F32] = "%s",
                      [KL_F64] = "%s",
                      [KL_F16] = "kl_f2h(%s)",
                      [KL_BF16] = "kl_f2bf(%s)",
                      [KL_I32] = "%s",
                      [KL_I64] = "%s",
                      [KL_BOOL] = "(uint8_t)(%s != 0)"},
        .kernel_fmt = "extern \"C\" __global__ void __launch_bounds__(256) %s(const kl_args A)",
        .buf_decl_fmt = "\t%s%s *__restrict__ b%d = (%s%s *)A.b[%d];\n",
        .index_t = "int64_t",
        .par_for_fmt = "",
        .par_for_simd_fmt = "",
        .simd_fmt = "",
        .if_fmt = "",
        .sym_fmt = "A.s[%d]",
        .par_threshold = 0,
        .constant = cu_constant,
        .cast = cu_cast,
        .unary = cu_unary,
        .binary = cu_binary,
        .rand = cu_rand,
        .acc_vars = cu_acc_vars,
        .acc_update = cu_acc_update,
        .acc_read = cu_acc_read,
        .acc_clause = cu_acc_clause,
        .walk = cu_walk,
};
