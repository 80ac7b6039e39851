/* render.c - walks one kernel's IR and writes it out with a renderer table:
 * buffer pointers, the loop nest (parallel over the outer dims, a simd
 * innermost loop where that is legal), one statement per live SSA value.
 */
#include <stdarg.h>
#include <stdlib.h>

#include "codegen/render.h"
#include "codegen/row_onepass.h"

/* ---- index expressions -------------------------------------------------------------- */

static void put_ix(kl_sb *sb, const kl_ixa *a, int32_t id);

static void put_atom(kl_sb *sb, const kl_ixa *a, int32_t at)
{
	const kl_atom *t = &a->atoms[at];
	switch (t->kind) {
	case KL_AT_VAR:
		kl__sb_printf(sb, "i%d", t->var);
		return;
	case KL_AT_DIV:
		put_ix(sb, a, t->e);
		kl__sb_printf(sb, " / %lld", (long long)t->a);
		return;
	case KL_AT_MOD:
		put_ix(sb, a, t->e);
		kl__sb_printf(sb, " %% %lld", (long long)t->a);
		return;
	default:
		kl__sb_puts(sb, "kl_clampi(");
		put_ix(sb, a, t->e);
		kl__sb_printf(sb, ", %lld, %lld)", (long long)t->a, (long long)t->b);
		return;
	}
}

static void put_ix(kl_sb *sb, const kl_ixa *a, int32_t id)
{
	const kl_ix *e = &a->ex[id];
	if (e->nt == 0) {
		kl__sb_printf(sb, "%lld", (long long)e->c);
		return;
	}
	kl__sb_puts(sb, "(");
	for (int i = 0; i < e->nt; i++) {
		int64_t k = e->k[i];
		if (i > 0)
			kl__sb_puts(sb, k < 0 ? " - " : " + ");
		else if (k < 0)
			kl__sb_puts(sb, "-");
		int64_t ak = k < 0 ? -k : k;
		bool wrap = a->atoms[e->at[i]].kind != KL_AT_VAR &&
		            a->atoms[e->at[i]].kind != KL_AT_CLAMP;
		if (wrap)
			kl__sb_puts(sb, "(");
		put_atom(sb, a, e->at[i]);
		if (wrap)
			kl__sb_puts(sb, ")");
		if (ak != 1)
			kl__sb_printf(sb, " * %lld", (long long)ak);
	}
	if (e->c)
		kl__sb_printf(sb, " %s %lld", e->c < 0 ? "-" : "+", (long long)(e->c < 0 ? -e->c : e->c));
	kl__sb_puts(sb, ")");
}

static void put_mono(kl_sb *sb, const kl_renderer *r, const kl_mono *m)
{
	kl__sb_printf(sb, "%lld", (long long)m->c);
	for (int i = 0; i < m->ns; i++) {
		kl__sb_puts(sb, " * ");
		kl__sb_printf(sb, r->sym_fmt, m->s[i] - 1);
	}
}

static void put_addr(kl_sb *sb, const kl_renderer *r, const kl_ixa *a, const kir_addr *ad)
{
	put_ix(sb, a, ad->ix);
	for (int i = 0; i < ad->ns; i++) {
		kl__sb_puts(sb, " + ");
		put_ix(sb, a, ad->six[i]);
		kl__sb_puts(sb, " * (");
		put_mono(sb, r, &ad->sst[i]);
		kl__sb_puts(sb, ")");
	}
}

static void put_extent(kl_sb *sb, const kl_renderer *r, kl_symdim d)
{
	if (d.sym > 0)
		kl__sb_printf(sb, r->sym_fmt, d.sym - 1);
	else
		kl__sb_printf(sb, "%lld", (long long)d.v);
}

/* ---- statements ------------------------------------------------------------------------ */

/* columns of a column reduction handled together (accumulator arrays) */
#define COL_TILE 64

typedef struct rctx {
	const kl_renderer *r;
	const kir_kernel *k;
	kl_sb *sb;
	uint8_t *live;
	int depth;
	bool col;  /* column order: accumulators are arrays indexed by jj */
	int col_d; /* the dim whose points are the columns */
	/* stores of the last pass written to row array ss<i> then streamed */
	int32_t stream[KIR_MAX_LOCAL];
	int nstream;
	int stream_var; /* the reduced dim the rows run along */
	/* the last pass is lc<stream_lc>[iJ] * t<stream_m>, streamed by
	 * kl_stream_scale_f32 (no loop of its own); stream_m < 0: not so.
	 * stream_pf: a load of pass 1 whose next row to prefetch, else -1 */
	int32_t stream_m, stream_lc, stream_pf;
	/* A parallel loop nest is outlined (kiln's thread pool runs it, not
	 * OpenMP: pool.c): its text goes to a function of its own, appended to
	 * pre, whose first loop runs over [kl_lo, kl_hi) of its range; the
	 * kernel calls kl_jit_par_for with the range and that function. */
	const char *name;   /* the kernel's */
	kl_sb *pre;         /* outlined functions, emitted before the kernel */
	int npar;           /* outlined so far */
	kl_sb *outer_sb;    /* the kernel's text while a nest is outlined */
	int outer_depth;    /* its depth there */
	bool par_first;     /* the next loop opened is the outlined range */
	const char *par_rest; /* then this pragma before the remaining loops */
	int par_rest_n;     /* collapse of that pragma */
	kl_sb par_range;    /* the range's extent (in tiles for a column tile loop) */
	kl_sb par_cond;     /* the run-time condition to use the pool ("" always) */
	uint8_t *fsum;      /* per accumulator: a sum kept in float (exp_sum_float_max) */
} rctx;

static int stream_slot(const rctx *c, int32_t id)
{
	for (int i = 0; i < c->nstream; i++)
		if (c->stream[i] == id)
			return i;
	return -1;
}

static void indent(rctx *c)
{
	for (int i = 0; i < c->depth; i++)
		kl__sb_puts(c->sb, "\t");
}

static void vname(char *buf, size_t cap, int32_t v)
{
	snprintf(buf, cap, "t%d", (int)v);
}

static void emit_ins(rctx *c, int32_t id)
{
	const kir_ins *in = &c->k->ins[id];
	const kl_renderer *r = c->r;
	kl_sb *sb = c->sb;
	char a[24], b[24], cc[24], acc[24], t[24];
	vname(a, sizeof(a), in->a);
	vname(b, sizeof(b), in->b);
	vname(cc, sizeof(cc), in->c);
	vname(t, sizeof(t), id);
	snprintf(acc, sizeof(acc), "acc%d", (int)in->acc);
	kl_dtype dt = (kl_dtype)in->dt;
	indent(c);
	switch ((kir_opc)in->opc) {
	case KIR_LOAD: {
		kl_sb el = {0};
		kl__sb_printf(&el, "b%d[", (int)in->buf);
		put_addr(&el, r, &c->k->ixa, &in->ad);
		if (in->a >= 0) { /* a gather: the row index clamped into the table */
			kl__sb_printf(&el, " + (%s < 0 ? 0 : %s >= (", a, a);
			put_mono(&el, r, &in->grows);
			kl__sb_printf(&el, ") ? (");
			put_mono(&el, r, &in->grows);
			kl__sb_printf(&el, ") - 1 : %s) * (", a);
			put_mono(&el, r, &in->gst);
			kl__sb_puts(&el, ")");
		}
		kl__sb_puts(&el, "]");
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		kl__sb_printf(sb, r->load_fmt[in->in_dt], kl__sb_str(&el));
		kl__sb_puts(sb, ";\n");
		kl__sb_free(&el);
		return;
	}
	case KIR_STORE: {
		int ss = stream_slot(c, id);
		if (ss >= 0) { /* the row's own position: the address is i<J> + base */
			kl__sb_printf(sb, "ss%d[i%d] = %s;\n", ss, c->stream_var, a);
			return;
		}
		kl__sb_printf(sb, "b%d[", (int)in->buf);
		put_addr(sb, r, &c->k->ixa, &in->ad);
		kl__sb_puts(sb, "] = ");
		/* a value just rounded to the half type it is stored as: narrowing
		 * what it was rounded from gives the same bits, and the round trip
		 * is left to whatever else reads it (nothing, often) */
		const kir_ins *v = in->a >= 0 ? &c->k->ins[in->a] : NULL;
		bool narrow = v && v->opc == KIR_CAST && v->dt == dt &&
		              (dt == KL_F16 || dt == KL_BF16) &&
		              (v->in_dt == KL_F32 || v->in_dt == KL_F16 || v->in_dt == KL_BF16);
		if (narrow)
			vname(b, sizeof(b), v->a);
		kl__sb_printf(sb, r->store_fmt[dt], narrow ? b : a);
		if (narrow) /* maybe its only reader (-Wunused-variable) */
			kl__sb_printf(sb, "; (void)%s", a);
		kl__sb_puts(sb, ";\n");
		return;
	}
	case KIR_CONST:
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		r->constant(sb, dt, in->k);
		break;
	case KIR_INDEX:
		kl__sb_printf(sb, "%s %s = ", r->index_t, t);
		put_addr(sb, r, &c->k->ixa, &in->ad);
		break;
	case KIR_IDXLT:
		kl__sb_printf(sb, "%s %s = ", r->ctype[KL_BOOL], t);
		put_ix(sb, &c->k->ixa, in->ad.ix);
		kl__sb_printf(sb, " < %lld", (long long)in->k);
		break;
	case KIR_UNARY:
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		r->unary(sb, (kl_op)in->op, dt, a);
		break;
	case KIR_BINARY:
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		r->binary(sb, (kl_op)in->op, (kl_dtype)in->in_dt, a, b);
		break;
	case KIR_WHERE:
		kl__sb_printf(sb, "%s %s = %s ? %s : %s", r->ctype[dt], t, a, b, cc);
		break;
	case KIR_CAST:
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		r->cast(sb, dt, (kl_dtype)in->in_dt, a);
		break;
	case KIR_RAND:
		kl__sb_printf(sb, "%s %s = ", r->ctype[KL_F64], t);
		if (in->b >= 0) { /* keyed at run time by two i32 words */
			char key[64];
			snprintf(key, sizeof key, "kl_rand_key(%s, %s)", b, cc);
			r->rand(sb, (kl_op)in->op, 0, key, a);
		} else {
			r->rand(sb, (kl_op)in->op, in->seed, NULL, a);
		}
		break;
	case KIR_ACC_INIT: {
		if (c->fsum && c->fsum[in->acc] && !c->col) {
			kl__sb_printf(sb, "float %s = 0;\n", acc);
			return;
		}
		kl_accvar v[2];
		int nv = r->acc_vars((kl_op)in->op, (kl_dtype)in->in_dt, v);
		for (int i = 0; i < nv; i++) {
			if (c->col)
				kl__sb_printf(sb, "%s%s %s%s[%d];", i ? " " : "", v[i].type, acc,
				              v[i].suffix, COL_TILE);
			else
				kl__sb_printf(sb, "%s%s %s%s = %s;", i ? " " : "", v[i].type, acc,
				              v[i].suffix, v[i].init);
		}
		kl__sb_puts(sb, "\n");
		if (c->col) { /* one accumulator per column of the tile */
			indent(c);
			kl__sb_puts(sb, "for (int64_t jj = 0; jj < jn; jj++) {");
			for (int i = 0; i < nv; i++)
				kl__sb_printf(sb, " %s%s[jj] = %s;", acc, v[i].suffix, v[i].init);
			kl__sb_puts(sb, " }\n");
		}
		return;
	}
	case KIR_ACC:
		if (c->fsum && c->fsum[in->acc] && !c->col) {
			kl__sb_printf(sb, "%s += %s;\n", acc, a);
			return;
		}
		r->acc_update(sb, (kl_op)in->op, (kl_dtype)in->in_dt, acc, c->col ? "[jj]" : "", a,
		              b);
		kl__sb_puts(sb, "\n");
		return;
	case KIR_LSTORE:
		kl__sb_printf(sb, "lc%d[", (int)in->acc);
		put_ix(sb, &c->k->ixa, in->ad.ix);
		kl__sb_printf(sb, "] = %s;\n", a);
		return;
	case KIR_LLOAD:
		kl__sb_printf(sb, "%s %s = lc%d[", r->ctype[dt], t, (int)in->acc);
		put_ix(sb, &c->k->ixa, in->ad.ix);
		kl__sb_puts(sb, "]");
		break;
	case KIR_ACC_READ:
		kl__sb_printf(sb, "%s %s = ", r->ctype[dt], t);
		r->acc_read(sb, (kl_op)in->op, (kl_dtype)in->in_dt, dt, acc, c->col ? "[jj]" : "");
		break;
	}
	kl__sb_puts(sb, ";\n");
}

void kl__render_ins(const kl_renderer *r, const kir_kernel *k, int32_t id, int depth, kl_sb *sb)
{
	rctx c = {.r = r, .k = k, .sb = sb, .depth = depth};
	emit_ins(&c, id);
}

static void emit_block(rctx *c, int blk)
{
	for (int32_t i = 0; i < c->k->nins; i++)
		if (c->k->ins[i].blk == blk && c->live[i])
			emit_ins(c, i);
}

/* which values some store or accumulator needs */
static void liveness(const kir_kernel *k, uint8_t *live, uint8_t *acc_live)
{
	uint8_t loc_live[KIR_MAX_LOCAL] = {0};
	for (int32_t i = k->nins - 1; i >= 0; i--) {
		const kir_ins *in = &k->ins[i];
		bool l = live[i] || in->opc == KIR_STORE;
		if ((in->opc == KIR_ACC || in->opc == KIR_ACC_INIT) && acc_live[in->acc])
			l = true;
		if (in->opc == KIR_LSTORE && loc_live[in->acc])
			l = true;
		if (!l)
			continue;
		live[i] = 1;
		if (in->opc == KIR_ACC_READ)
			acc_live[in->acc] = 1;
		if (in->opc == KIR_LLOAD)
			loc_live[in->acc] = 1;
		int32_t ops[3] = {in->a, in->b, in->c};
		for (int j = 0; j < 3; j++)
			if (ops[j] >= 0)
				live[ops[j]] = 1;
	}
}

uint8_t *kl__render_live(const kir_kernel *k)
{
	uint8_t *live = calloc((size_t)k->nins + 1, 1);
	uint8_t *acc_live = calloc((size_t)k->nacc + 1, 1);
	if (live && acc_live) {
		liveness(k, live, acc_live);
	} else {
		free(live);
		live = NULL;
	}
	free(acc_live);
	return live;
}

void kl__render_buf_decls(const kl_renderer *r, const kir_kernel *k, const uint8_t *live,
                          kl_sb *sb)
{
	int32_t maxb = -1;
	for (int32_t i = 0; i < k->nins; i++)
		if (k->ins[i].buf > maxb)
			maxb = k->ins[i].buf;
	for (int32_t bi = 0; bi <= maxb; bi++) {
		bool rd = false, wr = false;
		kl_dtype dt = KL_F32;
		for (int32_t i = 0; i < k->nins; i++) {
			const kir_ins *in = &k->ins[i];
			if (in->buf != bi || !live[i]) /* only loads and stores name a buffer */
				continue;
			if (in->opc == KIR_STORE) {
				wr = true;
				dt = (kl_dtype)in->dt;
			} else {
				rd = true;
				dt = (kl_dtype)in->in_dt;
			}
		}
		if (!rd && !wr)
			continue;
		/* in place (kir_kernel.shares): the buffer read and the one written
		 * are one memory, so neither is restrict (nor read as constant) */
		bool alias = k->shares >= 0 && (bi == k->shares || wr);
		const char *q = wr || alias ? "" : "const ";
		kl__sb_printf(sb, alias ? r->buf_decl_alias_fmt : r->buf_decl_fmt, q, r->mtype[dt],
		              (int)bi, q, r->mtype[dt], (int)bi, (int)bi);
	}
}

/* ---- loops ------------------------------------------------------------------------------ */

/* "n" elements as an expression; static returns the value in *v */
static bool extent_expr(const kl_renderer *r, const kir_kernel *k, uint32_t dims, kl_sb *sb,
                        double *v)
{
	bool stat = true;
	*v = 1;
	kl__sb_puts(sb, "(int64_t)1");
	for (int d = 0; d < k->ndim; d++) {
		if (!(dims & (1u << d)))
			continue;
		*v *= (double)k->dims[d].v;
		if (k->dims[d].sym > 0)
			stat = false;
		kl__sb_puts(sb, " * ");
		put_extent(sb, r, k->dims[d]);
	}
	return stat;
}

bool kl__render_extent(const kl_renderer *r, const kir_kernel *k, uint32_t dims, kl_sb *sb,
                       double *v)
{
	return extent_expr(r, k, dims, sb, v);
}

void kl__render_dim(const kl_renderer *r, const kir_kernel *k, int d, kl_sb *sb)
{
	put_extent(sb, r, k->dims[d]);
}

static void par_range_loop(rctx *c, int d)
{
	indent(c);
	kl__sb_printf(c->sb, "for (%s i%d = kl_lo; i%d < kl_hi; i%d++)\n", c->r->index_t, d, d, d);
	put_extent(&c->par_range, c->r, c->k->dims[d]);
	c->par_first = false;
	if (c->par_rest && c->par_rest_n > 0) {
		indent(c);
		kl__sb_printf(c->sb, c->par_rest, c->par_rest_n, "");
		kl__sb_puts(c->sb, "\n");
	}
}

static void open_loops(rctx *c, uint32_t dims)
{
	for (int d = 0; d < c->k->ndim; d++) {
		if (!(dims & (1u << d)))
			continue;
		if (c->par_first) {
			par_range_loop(c, d);
			continue;
		}
		indent(c);
		kl__sb_printf(c->sb, "for (%s i%d = 0; i%d < ", c->r->index_t, d, d);
		put_extent(c->sb, c->r, c->k->dims[d]);
		kl__sb_printf(c->sb, "; i%d++)", d);
		kl__sb_puts(c->sb, "\n");
	}
	indent(c);
	kl__sb_puts(c->sb, "{\n");
	c->depth++;
}

static void end_outline(rctx *c);

static void close_loops(rctx *c)
{
	c->depth--;
	indent(c);
	kl__sb_puts(c->sb, "}\n");
	if (c->outer_sb && c->depth == 1)
		end_outline(c);
}

/* Start outlining the nest that follows: its text goes to a function of its
 * own. cond: when to use the pool (NULL: always); rest: the pragma for the
 * loops after the first (n of them), NULL for none. */
static void begin_outline(rctx *c, const char *cond, const char *rest, int n)
{
	c->outer_sb = c->sb;
	c->outer_depth = c->depth;
	c->sb = malloc(sizeof *c->sb);
	if (!c->sb) {
		c->sb = c->outer_sb;
		c->outer_sb = NULL;
		c->sb->oom = true;
		return;
	}
	*c->sb = (kl_sb){0};
	c->depth = 1;
	c->par_first = true;
	c->par_rest = rest;
	c->par_rest_n = n;
	c->par_range = (kl_sb){0};
	c->par_cond = (kl_sb){0};
	kl__sb_puts(&c->par_cond, cond ? cond : "");
}

static void end_outline(rctx *c)
{
	kl_sb *body = c->sb;
	int id = c->npar++;
	kl_sb *pre = c->pre;
	kl__sb_printf(pre, "static void %s_p%d(void *kl_arg, int64_t kl_lo, int64_t kl_hi)\n{\n",
	              c->name, id);
	kl__sb_puts(pre, "\tconst kl_penv *kl_e = kl_arg;\n\tvoid *const *B = kl_e->B;\n"
	                 "\tconst int64_t *S = kl_e->S;\n");
	kl__render_buf_decls(c->r, c->k, c->live, pre);
	kl__sb_puts(pre, "\t(void)B;\n\t(void)S;\n");
	kl__sb_puts(pre, kl__sb_str(body));
	kl__sb_puts(pre, "}\n\n");
	pre->oom |= body->oom;
	kl__sb_free(body);
	free(body);
	c->sb = c->outer_sb;
	c->outer_sb = NULL;
	c->depth = c->outer_depth;
	const char *n = c->par_range.n ? kl__sb_str(&c->par_range) : "1";
	indent(c);
	kl__sb_puts(c->sb, "{\n");
	indent(c);
	kl__sb_puts(c->sb, "\tkl_penv kl_e = {B, S};\n");
	indent(c);
	if (c->par_cond.n)
		kl__sb_printf(c->sb, "\tif (%s)\n", kl__sb_str(&c->par_cond));
	else
		kl__sb_puts(c->sb, "\tif (1)\n");
	indent(c);
	kl__sb_printf(c->sb, "\t\tkl_jit_par_for(%s, %s_p%d, &kl_e);\n", n, c->name, id);
	indent(c);
	kl__sb_puts(c->sb, "\telse\n");
	indent(c);
	kl__sb_printf(c->sb, "\t\t%s_p%d(&kl_e, 0, %s);\n", c->name, id, n);
	indent(c);
	kl__sb_puts(c->sb, "}\n");
	c->sb->oom |= c->par_range.oom || c->par_cond.oom;
	kl__sb_free(&c->par_range);
	kl__sb_free(&c->par_cond);
}

static int popc(uint32_t x)
{
	return __builtin_popcount(x);
}

static uint32_t low_bits(uint32_t dims, int n)
{
	uint32_t out = 0;
	for (int d = 0; d < 32 && n > 0; d++)
		if (dims & (1u << d)) {
			out |= 1u << d;
			n--;
		}
	return out;
}

/* A loop nest: parallel ones are outlined for kiln's thread pool (pool.c),
 * their first loop shared out (a run-time condition when the size is only
 * known at run time); simd ones get the simd pragma, with reduction clauses.
 * A pass that is a reduction runs serially (the pool has no reduction
 * clause), and so does a parallel nest inside an outlined one: the pool
 * shares out the outer range only. */
static void pragma(rctx *c, bool par, const char *ifcond, int collapse, bool simd,
                   const char *red)
{
	const kl_renderer *r = c->r;
	if (par && !red && c->pre && !c->outer_sb) {
		if (simd && collapse == 1) {
			begin_outline(c, ifcond, NULL, 0);
			pragma(c, false, NULL, 1, true, NULL);
		} else {
			begin_outline(c, ifcond, simd ? r->simd_fmt : NULL, collapse - 1);
		}
		return;
	}
	if (!simd)
		return;
	indent(c);
	kl__sb_printf(c->sb, r->simd_fmt, collapse, red ? red : "");
	kl__sb_puts(c->sb, "\n");
}

/* parallelize when worth it: returns whether, and the run-time condition */
static bool want_par(const rctx *c, uint32_t dims, double mult, kl_sb *cond)
{
	double v;
	kl_sb e = {0};
	bool stat = extent_expr(c->r, c->k, dims, &e, &v);
	bool par;
	if (stat) {
		par = v * mult >= c->r->par_threshold && v >= 2;
	} else {
		par = true;
		kl__sb_printf(cond, "%s * %g >= %g", kl__sb_str(&e), mult, c->r->par_threshold);
	}
	kl__sb_free(&e);
	return par;
}

static void render_pointwise(rctx *c)
{
	const kir_kernel *k = c->k;
	uint32_t loops = 0;
	for (int d = 0; d < k->ndim; d++)
		if (k->dims[d].sym > 0 || k->dims[d].v != 1)
			loops |= 1u << d;
	int n = popc(loops);
	if (n == 0) {
		indent(c);
		kl__sb_puts(c->sb, "{\n");
		c->depth++;
		emit_block(c, 0);
		close_loops(c);
		return;
	}
	kl_sb cond = {0};
	bool par = want_par(c, loops, 1, &cond);
	const char *ifc = cond.n ? kl__sb_str(&cond) : NULL;
	uint32_t outer = low_bits(loops, n - 1), inner = loops & ~outer;
	double ov = 1;
	bool ostat = true;
	for (int d = 0; d < k->ndim; d++)
		if (outer & (1u << d)) {
			ov *= (double)k->dims[d].v;
			ostat &= k->dims[d].sym == 0;
		}
	if (n == 1 || (ostat && ov < 64)) {
		/* few rows: one collapsed parallel simd nest */
		pragma(c, par, ifc, n, true, NULL);
		open_loops(c, loops);
	} else {
		if (par)
			pragma(c, true, ifc, n - 1, false, NULL);
		open_loops(c, outer);
		pragma(c, false, NULL, 1, true, NULL);
		open_loops(c, inner);
		emit_block(c, 0);
		close_loops(c);
		close_loops(c);
		kl__sb_free(&cond);
		return;
	}
	emit_block(c, 0);
	close_loops(c);
	kl__sb_free(&cond);
}

/* the reduction clauses of pass p; false when some accumulator it updates
 * cannot be updated by a vectorized loop (argmax) */
static bool pass_sums(const rctx *c, int p, kl_sb *red)
{
	bool ok = true;
	for (int32_t i = 0; i < c->k->nins; i++) {
		const kir_ins *in = &c->k->ins[i];
		if (in->opc != KIR_ACC || in->blk != 2 * p - 1 || !c->live[i])
			continue;
		char acc[24];
		snprintf(acc, sizeof(acc), "acc%d", (int)in->acc);
		ok &= c->r->acc_clause(red, (kl_op)in->op, (kl_dtype)in->in_dt, acc);
	}
	return ok;
}

/* instructions of block 0 that live instructions of the blocks in mask need */
static void needed_from(const rctx *c, uint32_t mask, uint8_t *need)
{
	const kir_kernel *k = c->k;
	memset(need, 0, (size_t)k->nins);
	for (int32_t i = k->nins - 1; i >= 0; i--) {
		const kir_ins *in = &k->ins[i];
		if (!c->live[i] || in->opc == KIR_ACC_INIT)
			continue;
		if (!(in->blk < 32 && (mask & (1u << in->blk))) && !need[i])
			continue;
		need[i] = 1;
		int32_t ops[3] = {in->a, in->b, in->c};
		for (int j = 0; j < 3; j++)
			if (ops[j] >= 0 && k->ins[ops[j]].blk == 0)
				need[ops[j]] = 1;
	}
}

static void emit_needed(rctx *c, const uint8_t *need, int blk)
{
	for (int32_t i = 0; i < c->k->nins; i++)
		if (c->k->ins[i].blk == blk && c->live[i] && need[i])
			emit_ins(c, i);
}

/* The loop over a column tile's columns (jj, with i<J> = jt + jj) and in it
 * what pass blk needs, then pass blk itself; the caller closes the loop. */
static void tile_columns(rctx *c, int J, int blk, uint8_t *need)
{
	indent(c);
	kl__sb_printf(c->sb, "for (int64_t jj = 0; jj < jn; jj++)\n");
	indent(c);
	kl__sb_printf(c->sb, "{\n");
	c->depth++;
	indent(c);
	kl__sb_printf(c->sb, "int64_t i%d = jt + jj;\n", J);
	indent(c);
	kl__sb_printf(c->sb, "(void)i%d;\n", J);
	needed_from(c, 1u << blk, need);
	emit_needed(c, need, 0);
	emit_block(c, blk);
}

/* A reduction over dims before the innermost one (a column sum): the rows
 * would be walked with a large stride, so the loop order turns around:
 * accumulators for a tile of columns, the reduced dims outside, the
 * columns inside (contiguous, vectorized). One pass only. */
static int column_dim(const rctx *c)
{
	const kir_kernel *k = c->k;
	if (k->npass != 1 || k->nlocal)
		return -1;
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (k->dims[d].sym == 0 && k->dims[d].v == 1)
			continue;
		if (k->rmask & (1u << d))
			return -1;
		bool reduced_before = false;
		for (int e = 0; e < d; e++)
			reduced_before |= (k->rmask & (1u << e)) &&
			                  (k->dims[e].sym > 0 || k->dims[e].v > 1);
		return reduced_before ? d : -1;
	}
	return -1;
}

static void render_columns(rctx *c, int J)
{
	const kir_kernel *k = c->k;
	uint32_t outer = 0, inner = 0;
	for (int d = 0; d < k->ndim; d++) {
		if ((k->dims[d].sym == 0 && k->dims[d].v == 1) || d == J)
			continue;
		if (k->rmask & (1u << d))
			inner |= 1u << d;
		else
			outer |= 1u << d;
	}
	c->col = true;
	uint8_t *need = malloc((size_t)k->nins + 1);
	if (!need) {
		c->sb->oom = true;
		return;
	}
	kl_sb cond = {0}, ext = {0};
	bool par = want_par(c, outer | inner | (1u << J), 1, &cond);
	const char *ifc = cond.n ? kl__sb_str(&cond) : NULL;
	put_extent(&ext, c->r, k->dims[J]);
	if (par)
		pragma(c, true, ifc, popc(outer) + 1, false, NULL);
	for (int d = 0; d < k->ndim; d++) {
		if (!(outer & (1u << d)))
			continue;
		if (c->par_first) {
			par_range_loop(c, d);
			continue;
		}
		indent(c);
		kl__sb_printf(c->sb, "for (%s i%d = 0; i%d < ", c->r->index_t, d, d);
		put_extent(c->sb, c->r, k->dims[d]);
		kl__sb_printf(c->sb, "; i%d++)\n", d);
	}
	indent(c);
	if (c->par_first) { /* the column tiles are the outlined range */
		kl__sb_printf(c->sb, "for (int64_t jt = kl_lo * %d; jt < kl_hi * %d; jt += %d)\n",
		              COL_TILE, COL_TILE, COL_TILE);
		kl__sb_printf(&c->par_range, "((%s + %d) / %d)", kl__sb_str(&ext), COL_TILE - 1,
		              COL_TILE);
		c->par_first = false;
	} else {
		kl__sb_printf(c->sb, "for (int64_t jt = 0; jt < %s; jt += %d)\n", kl__sb_str(&ext),
		              COL_TILE);
	}
	indent(c);
	kl__sb_puts(c->sb, "{\n");
	c->depth++;
	indent(c);
	kl__sb_printf(c->sb, "int64_t jn = %s - jt < %d ? %s - jt : %d;\n", kl__sb_str(&ext),
	              COL_TILE, kl__sb_str(&ext), COL_TILE);
	for (int32_t i = 0; i < k->nins; i++)
		if (k->ins[i].opc == KIR_ACC_INIT && c->live[i])
			emit_ins(c, i);
	/* the reduced dims, and inside them the columns */
	open_loops(c, inner); /* no dims: a plain block */
	pragma(c, false, NULL, 1, true, NULL);
	tile_columns(c, J, 1, need);
	close_loops(c);
	close_loops(c);
	/* the results of the tile */
	tile_columns(c, J, 2, need);
	close_loops(c);
	close_loops(c);
	c->col = false;
	free(need);
	kl__sb_free(&cond);
	kl__sb_free(&ext);
}

/* whether address ix is i<J> plus terms free of i<J> (unit) or exactly i<J> (only) */
static bool row_unit(const kir_kernel *k, int32_t ix, int J, bool only)
{
	const kl_ix *e = kl__ix_get(&k->ixa, ix);
	bool unit = false, other = false;
	for (int t = 0; t < e->nt; t++) {
		const kl_atom *at = &k->ixa.atoms[e->at[t]];
		if (at->kind == KL_AT_VAR && at->var == J && e->k[t] == 1)
			unit = true;
		else if ((at->vars & (1u << J)) || only)
			other = true;
	}
	return unit && !other && (!only || e->c == 0);
}

/* The one streamed store's pass is nothing but lc[iJ] * m, m computed
 * before the pass (softmax's normalization): then the stream itself
 * scales (stream_m, stream_lc), and it prefetches the next row of pass
 * 1's first contiguous f32 load (stream_pf). */
static void plan_stream_scale(rctx *c, int J)
{
	const kir_kernel *k = c->k;
	int last = 2 * k->npass - 1;
	c->stream_m = c->stream_lc = c->stream_pf = -1;
	if (c->nstream != 1)
		return;
	const kir_ins *st = &k->ins[c->stream[0]];
	const kir_ins *mul = &k->ins[st->a];
	if (mul->opc != KIR_BINARY || mul->op != KL_OP_MUL || mul->dt != KL_F32 ||
	    mul->in_dt != KL_F32 || mul->blk != last)
		return;
	int32_t ld = -1, m = -1;
	int32_t ops[2] = {mul->a, mul->b};
	for (int j = 0; j < 2; j++) {
		const kir_ins *o = &k->ins[ops[j]];
		if (o->opc == KIR_LLOAD && o->blk == last && ld < 0)
			ld = ops[j];
		else if (o->blk != last)
			m = ops[j];
	}
	if (ld < 0 || m < 0 || k->ins[m].dt != KL_F32 || k->local_dt[k->ins[ld].acc] != KL_F32 ||
	    !row_unit(k, k->ins[ld].ad.ix, J, true))
		return;
	for (int32_t i = 0; i < k->nins; i++) /* nothing else in the pass */
		if (k->ins[i].blk == last && c->live[i] && i != ld && i != st->a && i != c->stream[0])
			return;
	c->stream_m = m;
	c->stream_lc = k->ins[ld].acc;
	for (int32_t i = 0; i < k->nins && c->stream_pf < 0; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc == KIR_LOAD && in->blk == 1 && c->live[i] && in->in_dt == KL_F32 &&
		    in->a < 0 && !in->ad.ns && row_unit(k, in->ad.ix, J, false))
			c->stream_pf = i;
	}
}

/* Stores of the last pass that write f32 rows contiguously along the one
 * reduced dim J (address: a base over the outer dims, plus iJ) go to a row
 * array and out through the target's streaming copy, when the whole result
 * is large enough that read-for-ownership would cost (stream_min_bytes). */
static void plan_stream(rctx *c, uint32_t outer, uint32_t inner)
{
	const kir_kernel *k = c->k;
	c->nstream = 0;
	c->stream_m = -1;
	if (c->r->stream_min_bytes <= 0 || k->npass < 2 || popc(inner) != 1)
		return;
	int J = 0;
	while (!(inner & (1u << J)))
		J++;
	if (k->dims[J].sym > 0 || k->dims[J].v < 16 || k->dims[J].v > KIR_ROW_CACHE)
		return;
	double bytes = (double)k->dims[J].v * 4;
	for (int d = 0; d < k->ndim; d++) {
		if (!(outer & (1u << d)))
			continue;
		if (k->dims[d].sym > 0)
			return;
		bytes *= (double)k->dims[d].v;
	}
	if (bytes < c->r->stream_min_bytes)
		return;
	for (int32_t i = 0; i < k->nins && c->nstream < KIR_MAX_LOCAL; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc != KIR_STORE || in->blk != 2 * k->npass - 1 || !c->live[i] ||
		    in->dt != KL_F32 || in->ad.ns)
			continue;
		const kl_ix *e = kl__ix_get(&k->ixa, in->ad.ix);
		bool unit = false, other = false;
		for (int t = 0; t < e->nt; t++) {
			const kl_atom *at = &k->ixa.atoms[e->at[t]];
			if (at->kind == KL_AT_VAR && at->var == J && e->k[t] == 1)
				unit = true;
			else if (at->vars & (1u << J))
				other = true;
		}
		if (unit && !other)
			c->stream[c->nstream++] = i;
	}
	c->stream_var = J;
	plan_stream_scale(c, J);
}

/* The chunk loop around the exp pass (plan_stream_scale's stream_pf): for
 * each chunk kl_c of the row, the next row's input at kl_c fetched first. */
#define PF_CHUNK 256
static void open_pf_chunks(rctx *c)
{
	const kir_kernel *k = c->k;
	const kir_ins *ld = &k->ins[c->stream_pf];
	int J = c->stream_var;
	int64_t n = k->dims[J].v;
	indent(c);
	kl__sb_printf(c->sb, "for (%s kl_c = 0; kl_c < %lld; kl_c += %d) {\n", c->r->index_t,
	              (long long)n, PF_CHUNK);
	c->depth++;
	indent(c);
	kl__sb_printf(c->sb, "{ %s i%d = kl_c; kl_prefetch_f32(&b%d[", c->r->index_t, J,
	              (int)ld->buf);
	put_addr(c->sb, c->r, &k->ixa, &ld->ad);
	kl__sb_printf(c->sb, "] + %lld, %lld - kl_c < %d ? %lld - kl_c : %d); }\n", (long long)n,
	              (long long)n, PF_CHUNK, (long long)n, PF_CHUNK);
}

/* the exp pass's loop over its chunk */
static void open_chunk_loop(rctx *c)
{
	int J = c->stream_var;
	int64_t n = c->k->dims[J].v;
	indent(c);
	kl__sb_printf(c->sb, "for (%s i%d = kl_c; i%d < (kl_c + %d < %lld ? kl_c + %d : %lld); "
	              "i%d++)\n", c->r->index_t, J, J, PF_CHUNK, (long long)n, PF_CHUNK,
	              (long long)n, J);
	indent(c);
	kl__sb_puts(c->sb, "{\n");
	c->depth++;
}

/* A pass that is nothing but lc[iJ] = exp(x[iJ] - m), acc += that, with x
 * a contiguous f32, f16 or bf16 row, m an f32 value computed before the pass and
 * acc a float sum (plan_float_sums: a softmax's exp pass): then the
 * target's exp-sum helper runs it (exp_sum_row), one call a row. *ld, *m,
 * *acc, *lc: the load, the value, the accumulator and the array; false when
 * the pass is anything else. */
static bool match_exp_sum(const rctx *c, int J, int blk, int32_t *ld, int32_t *m, int32_t *acc,
                          int32_t *lc)
{
	const kir_kernel *k = c->k;
	int n = 0;
	int32_t ex = -1, sub = -1;
	*ld = *m = *acc = *lc = -1;
	if (!c->r->exp_sum_row || !c->fsum || J < 0)
		return false;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i])
			continue;
		n++;
		if (in->opc == KIR_UNARY && in->op == KL_OP_EXP && in->dt == KL_F32)
			ex = i;
	}
	if (n != 5 || ex < 0)
		return false;
	sub = k->ins[ex].a;
	const kir_ins *s = &k->ins[sub];
	if (s->opc != KIR_BINARY || s->op != KL_OP_SUB || s->dt != KL_F32 || s->in_dt != KL_F32 ||
	    s->blk != blk || s->a < 0 || s->b < 0)
		return false;
	const kir_ins *l = &k->ins[s->a], *mv = &k->ins[s->b];
	if (l->opc != KIR_LOAD || l->blk != blk ||
	    (l->in_dt != KL_F32 && l->in_dt != KL_F16 && l->in_dt != KL_BF16) ||
	    l->dt != KL_F32 || l->a >= 0 || l->ad.ns || !row_unit(k, l->ad.ix, J, false) ||
	    mv->blk >= blk || mv->dt != KL_F32)
		return false;
	*ld = s->a;
	*m = s->b;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i] || i == ex || i == sub || i == *ld)
			continue;
		if (in->a != ex)
			return false;
		if (in->opc == KIR_ACC && in->op == KL_OP_SUM && c->fsum[in->acc])
			*acc = in->acc;
		else if (in->opc == KIR_LSTORE && k->local_dt[in->acc] == KL_F32 &&
		         row_unit(k, in->ad.ix, J, true))
			*lc = in->acc;
		else
			return false;
	}
	return *acc >= 0 && *lc >= 0;
}

/* the matched exp pass as one call a row (match_exp_sum), prefetching the
 * next row of pf (a load along the row) meanwhile */
static void emit_exp_sum(rctx *c, int J, int32_t ld, int32_t m, int32_t acc, int32_t lc,
                         int32_t pf)
{
	const kir_kernel *k = c->k;
	long long n = (long long)k->dims[J].v;
	const kir_ins *l = &k->ins[ld], *f = &k->ins[pf];
	indent(c);
	kl__sb_printf(c->sb, "{ %s i%d = 0; acc%d += kl_expsum_%s(lc%d, &b%d[", c->r->index_t, J,
	              (int)acc, l->in_dt == KL_F16 ? "f16" : l->in_dt == KL_BF16 ? "bf16" : "f32",
	              (int)lc, (int)l->buf);
	put_addr(c->sb, c->r, &k->ixa, &l->ad);
	kl__sb_printf(c->sb, "], t%d, %lld, &b%d[", (int)m, n, (int)f->buf);
	put_addr(c->sb, c->r, &k->ixa, &f->ad);
	kl__sb_printf(c->sb, "] + %lld); }\n", n);
}

/* The last pass is nothing but out[iJ] = f16(lc[iJ] * m), out a contiguous
 * f16 row, lc an f32 row-local array, m an f32 value computed before the
 * pass (an f16 softmax's scale by 1/sum): the target's kl_scale_f16 writes
 * it (exp_sum_row). *st, *m, *lc: the store, the value, the array. */
static bool match_scale_f16(const rctx *c, int J, int blk, int32_t *st, int32_t *m, int32_t *lc)
{
	const kir_kernel *k = c->k;
	int n = 0;
	*st = *m = *lc = -1;
	if (!c->r->exp_sum_row || J < 0)
		return false;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i])
			continue;
		n++;
		if (in->opc == KIR_STORE)
			*st = i;
	}
	if (*st < 0)
		return false;
	const kir_ins *s = &k->ins[*st];
	if (s->dt != KL_F16 || s->ad.ns || s->a < 0 || !row_unit(k, s->ad.ix, J, false))
		return false;
	/* the product, or a rounding of it to f16 that the store narrows */
	const kir_ins *mul = &k->ins[s->a];
	if (mul->opc == KIR_CAST && mul->dt == KL_F16 && mul->in_dt == KL_F32 && mul->blk == blk &&
	    mul->a >= 0 && n == 4)
		mul = &k->ins[mul->a];
	else if (n != 3)
		return false;
	if (mul->opc != KIR_BINARY || mul->op != KL_OP_MUL || mul->dt != KL_F32 ||
	    mul->in_dt != KL_F32 || mul->blk != blk || mul->a < 0 || mul->b < 0)
		return false;
	int32_t ops[2] = {mul->a, mul->b};
	for (int j = 0; j < 2; j++) {
		const kir_ins *o = &k->ins[ops[j]];
		if (o->opc == KIR_LLOAD && o->blk == blk && *lc < 0 &&
		    k->local_dt[o->acc] == KL_F32 && row_unit(k, o->ad.ix, J, true))
			*lc = o->acc;
		else if (o->blk < blk && o->dt == KL_F32)
			*m = ops[j];
	}
	return *lc >= 0 && *m >= 0;
}

/* the single reduced dim of a row kernel with a static extent, else -1 */
static int static_row_dim(const kir_kernel *k, uint32_t inner)
{
	if (popc(inner) != 1)
		return -1;
	int J = 0;
	while (!(inner & (1u << J)))
		J++;
	return k->dims[J].sym > 0 ? -1 : J;
}

/* after the last pass: each streamed row from its array to memory */
static void flush_stream(rctx *c)
{
	const kir_kernel *k = c->k;
	if (c->stream_m >= 0) {
		const kir_ins *in = &k->ins[c->stream[0]];
		int64_t n = k->dims[c->stream_var].v;
		indent(c);
		kl__sb_printf(c->sb, "{ int64_t i%d = 0; kl_stream_scale_f32(&b%d[", c->stream_var,
		              (int)in->buf);
		put_addr(c->sb, c->r, &k->ixa, &in->ad);
		kl__sb_printf(c->sb, "], lc%d, t%d, %lld, ", (int)c->stream_lc, (int)c->stream_m,
		              (long long)n);
		if (c->stream_pf >= 0) {
			const kir_ins *ld = &k->ins[c->stream_pf];
			kl__sb_printf(c->sb, "&b%d[", (int)ld->buf);
			put_addr(c->sb, c->r, &k->ixa, &ld->ad);
			kl__sb_printf(c->sb, "] + %lld); }\n", (long long)n);
		} else {
			kl__sb_puts(c->sb, "NULL); }\n");
		}
		return;
	}
	for (int i = 0; i < c->nstream; i++) {
		const kir_ins *in = &k->ins[c->stream[i]];
		indent(c);
		kl__sb_printf(c->sb, "{ int64_t i%d = 0; kl_stream_f32(&b%d[", c->stream_var,
		              (int)in->buf);
		put_addr(c->sb, c->r, &k->ixa, &in->ad);
		kl__sb_printf(c->sb, "], ss%d, %lld); }\n", i,
		              (long long)k->dims[c->stream_var].v);
	}
}

/* The softmax sums (row_onepass.c's LSE pattern) over a static row of at
 * most exp_sum_float_max elements whose terms are computed in float: those
 * accumulators are kept in float (c->fsum). */
static void plan_float_sums(rctx *c, uint32_t inner)
{
	const kir_kernel *k = c->k;
	int64_t rn = 1;
	for (int d = 0; d < k->ndim; d++)
		if (inner & (1u << d)) {
			if (k->dims[d].sym > 0)
				return;
			rn *= k->dims[d].v;
		}
	if (c->r->exp_sum_float_max <= 0 || rn > c->r->exp_sum_float_max || k->npass < 2)
		return;
	for (int p = 1; p < k->npass; p++) {
		kl_onepass op;
		if (!kl__onepass_match(k, c->live, p, rn, &op) || op.kind != KL_ONEPASS_LSE)
			continue;
		bool fl = true;
		for (int32_t i = 0; i < k->nins; i++) {
			const kir_ins *in = &k->ins[i];
			if (in->opc == KIR_ACC && in->acc == op.acc_b)
				fl &= in->in_dt == KL_F32 || in->in_dt == KL_F16 || in->in_dt == KL_BF16;
		}
		if (!fl)
			continue;
		if (!c->fsum && !(c->fsum = calloc((size_t)k->nacc + 1, 1))) {
			c->sb->oom = true;
			return;
		}
		c->fsum[op.acc_b] = 1;
	}
}

static void render_reduction(rctx *c)
{
	int J = column_dim(c);
	if (J >= 0) {
		render_columns(c, J);
		return;
	}
	const kir_kernel *k = c->k;
	uint32_t outer = 0, inner = 0;
	for (int d = 0; d < k->ndim; d++) {
		if (k->dims[d].sym == 0 && k->dims[d].v == 1)
			continue;
		if (k->rmask & (1u << d))
			inner |= 1u << d;
		else
			outer |= 1u << d;
	}
	plan_float_sums(c, inner);
	kl_sb cond = {0};
	bool par = want_par(c, outer | inner, k->npass ? k->npass : 1, &cond);
	const char *ifc = cond.n ? kl__sb_str(&cond) : NULL;
	if (outer) {
		if (par)
			pragma(c, true, ifc, popc(outer), false, NULL);
		open_loops(c, outer);
	} else {
		indent(c);
		kl__sb_puts(c->sb, "{\n");
		c->depth++;
	}
	for (int i = 0; i < k->nlocal; i++) {
		indent(c);
		kl__sb_printf(c->sb, "%s lc%d[%lld];\n", c->r->ctype[k->local_dt[i]], i,
		              (long long)k->row_n);
	}
	plan_stream(c, outer, inner);
	for (int i = 0; i < c->nstream && c->stream_m < 0; i++) {
		indent(c);
		kl__sb_printf(c->sb, "_Alignas(64) %s ss%d[%lld];\n", c->r->ctype[KL_F32], i,
		              (long long)k->dims[c->stream_var].v);
	}
	emit_block(c, 0);
	/* reduced over an empty dim: the passes visit nothing, and a collapsed
	 * nest with no iterations trips some compilers */
	bool no_rows = false;
	for (int d = 0; d < k->ndim; d++)
		no_rows |= (inner & (1u << d)) && k->dims[d].sym == 0 && k->dims[d].v == 0;
	const int RJ = static_row_dim(k, inner);
	for (int p = 1; p <= k->npass; p++) {
		kl_sb red = {0};
		bool sums = pass_sums(c, p, &red);
		const char *rc = red.n ? kl__sb_str(&red) : NULL;
		if (p == k->npass && c->stream_m >= 0) { /* the stream is the pass */
			flush_stream(c);
			kl__sb_free(&red);
			emit_block(c, 2 * p);
			continue;
		}
		/* the pass before a streamed, scaled last pass (softmax's exp
		 * pass): in chunks of PF_CHUNK, each first fetching as much of
		 * the next row's input, so the memory works while the exps
		 * compute (the stream's own prefetch left it idle meanwhile:
		 * 4096-wide rows 4.73 -> 4.43 ms, 2 threads) */
		bool pf = p == k->npass - 1 && c->stream_m >= 0 && c->stream_pf >= 0 && inner &&
		          popc(inner) == 1 && sums && !no_rows;
		/* an exp pass, an f16 scale out: the target's helpers, a call a
		 * row (match_exp_sum, match_scale_f16) */
		int32_t xl, xm, xa, xc;
		if (sums && !no_rows && match_exp_sum(c, RJ, 2 * p - 1, &xl, &xm, &xa, &xc)) {
			emit_exp_sum(c, RJ, xl, xm, xa, xc, pf ? c->stream_pf : xl);
			if (pf)
				c->stream_pf = -1; /* fetched there: the stream does not */
			kl__sb_free(&red);
			emit_block(c, 2 * p);
			continue;
		}
		if (p == k->npass && c->nstream == 0 && !no_rows &&
		    match_scale_f16(c, RJ, 2 * p - 1, &xl, &xm, &xc)) {
			indent(c);
			kl__sb_printf(c->sb, "{ %s i%d = 0; kl_scale_f16(&b%d[", c->r->index_t, RJ,
			              (int)k->ins[xl].buf);
			put_addr(c->sb, c->r, &k->ixa, &k->ins[xl].ad);
			kl__sb_printf(c->sb, "], lc%d, t%d, %lld); }\n", (int)xc, (int)xm,
			              (long long)k->dims[RJ].v);
			kl__sb_free(&red);
			emit_block(c, 2 * p);
			continue;
		}
		if (pf)
			open_pf_chunks(c);
		if (inner && sums && !no_rows)
			/* no outer loop to share out: one thread (the pass's
			 * statements read block 0's values, which an outlined nest
			 * would not see) */
			pragma(c, false, ifc, popc(inner), true, rc);
		if (pf)
			open_chunk_loop(c);
		else
			open_loops(c, inner); /* no dims: a plain block */
		emit_block(c, 2 * p - 1);
		close_loops(c);
		if (pf) {
			c->depth--;
			indent(c);
			kl__sb_puts(c->sb, "}\n");
			c->stream_pf = -1; /* fetched here: the stream does not */
		}
		if (p == k->npass)
			flush_stream(c);
		kl__sb_free(&red);
		emit_block(c, 2 * p);
	}
	close_loops(c);
	c->nstream = 0;
	c->stream_m = -1;
	free(c->fsum);
	c->fsum = NULL;
	kl__sb_free(&cond);
}

kl_row_grid kl__render_kernel(const kl_renderer *r, const kir_kernel *k, const char *name,
                              kl_sb *sb)
{
	if (r->walk)
		return r->walk(r, k, name, sb);
	kl_row_grid none = {0, 0};
	kl_sb pre = {0}, body = {0};
	rctx c = {.r = r, .k = k, .sb = &body, .depth = 1, .name = name, .pre = &pre};
	if (!(c.live = kl__render_live(k))) {
		sb->oom = true;
		return none;
	}
	kl_sb *out = sb;
	sb = &body;
	kl__sb_printf(sb, r->kernel_fmt, name);
	kl__sb_puts(sb, ";\n");
	kl__sb_printf(sb, r->kernel_fmt, name);
	kl__sb_puts(sb, "\n{\n");
	/* nothing to visit when an iterated dim is empty (a reduced one still
	 * leaves the results to write); then emit no loop a compiler could trip on */
	bool empty = false;
	for (int d = 0; d < k->ndim; d++)
		empty |= k->dims[d].sym == 0 && k->dims[d].v == 0 && !(k->rmask & (1u << d));
	if (empty) { /* nothing to visit (and no loop a compiler could trip on) */
		kl__sb_puts(sb, "\t(void)B;\n\t(void)S;\n}\n\n");
		free(c.live);
		kl__sb_puts(out, kl__sb_str(&body));
		out->oom |= body.oom;
		kl__sb_free(&body);
		kl__sb_free(&pre);
		return none;
	}
	kl__render_buf_decls(r, k, c.live, sb);
	kl__sb_puts(sb, "\t(void)B;\n\t(void)S;\n");
	if (k->rmask == 0)
		render_pointwise(&c);
	else
		render_reduction(&c);
	kl__sb_puts(sb, "}\n\n");
	free(c.live);
	/* the outlined nests, then the kernel that calls them */
	kl__sb_puts(out, kl__sb_str(&pre));
	kl__sb_puts(out, kl__sb_str(&body));
	out->oom |= pre.oom || body.oom;
	kl__sb_free(&pre);
	kl__sb_free(&body);
	return none;
}
