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
 * This file: the expressions, chunk planning and I/O, pointwise kernels and
 * the walker's entry (cu_walk); the row kernels are render_cuda_rows.c, and
 * the context both walk with is render_cuda_walk.h.
 */
#include <math.h>
#include <string.h>

#include "codegen/render_cuda_walk.h"

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

static void cu_rand(kl_sb *sb, kl_op op, uint64_t seed, const char *key, const char *index)
{
	kl__render_c.rand(sb, op, seed, key, index);
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

/* ---- chunks (the types and the walker's context: render_cuda_walk.h) ---------- */

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
	if (buf == c->k->shares)
		return true;
	for (int32_t i = 0; i < c->k->nins; i++)
		if (c->live[i] && c->k->ins[i].opc == KIR_STORE && c->k->ins[i].buf == buf)
			return true;
	return false;
}

void kl__cu_plan_free(vplan *vp)
{
	free(vp->acc);
	free(vp->of);
	memset(vp, 0, sizeof *vp);
}

/* The accesses of the chunked blocks along vp->d, and V; false when some
 * access cannot be chunked or none can. */
bool kl__cu_plan_collect(cctx *c, vplan *vp)
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
bool kl__cu_plan_aligned(const cctx *c, const vplan *vp)
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
int64_t kl__cu_body_cost(const cctx *c)
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
	if (vp->d < 0 || !kl__cu_plan_collect(c, vp))
		return false;
	int V = vp->V;
	if (kl__cu_body_cost(c) * V > UNROLL_BUDGET)
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
	return kl__cu_plan_aligned(c, vp);
}

/* "const bool kl_vok = ...": the run-time half of the fast path's conditions */
void kl__cu_plan_cond(cctx *c, const vplan *vp)
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

void kl__cu_chunk_word(const vplan *vp, const vacc *a, const char **w, int *nw)
{
	int cb = vp->V * msize(a->dt);
	*w = cb >= 16 ? "uint4" : cb == 8 ? "uint2" : cb == 4 ? "unsigned int" : "unsigned short";
	*nw = cb >= 16 ? cb / 16 : 1;
}

void kl__cu_chunk_decls(cctx *c, const vplan *vp, int slots)
{
	for (int a = 0; a < vp->nacc; a++) {
		const char *w;
		int nw;
		kl__cu_chunk_word(vp, &vp->acc[a], &w, &nw);
		line(c, "union { %s u[%d]; %s e[%d]; } kv%d[%d];", w, nw,
		     c->r->mtype[vp->acc[a].dt], vp->V, a, slots);
	}
}

/* an access loaded before kl_pdl_wait (row_loop): the first row's, so not
 * one that every row loads again (vacc.each) */
bool kl__cu_early_acc(const cctx *c, const vacc *a)
{
	return c->k->early && !a->store && a->blk == 1 && !a->each && c->k->early[a->buf];
}

/* load or store the chunks of the accesses first used in block blk (the
 * loads) or stored there (the stores).
 * ahead: the loads of the next row into kn<a> (row-dependent ones only).
 * which: 0 every access, 1 the early ones, 2 all but the early ones, 3 the
 * loads every row makes right before use (vacc.each; 0-2 leave them out) */
void kl__cu_chunk_io_to(cctx *c, const vplan *vp, int blk, bool store, const char *slot,
                        bool ahead, int which)
{
	for (int ai = 0; ai < vp->nacc; ai++) {
		const vacc *a = &vp->acc[ai];
		if (a->store != store || a->blk != blk || (ahead && !row_dependent(c, vp, a)))
			continue;
		if (!store && a->each != (which == 3))
			continue;
		if ((which == 1 && !kl__cu_early_acc(c, a)) || (which == 2 && kl__cu_early_acc(c, a)))
			continue;
		const char *kv = ahead ? "kn" : "kv";
		const char *w;
		int nw;
		kl__cu_chunk_word(vp, a, &w, &nw);
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

void kl__cu_chunk_io(cctx *c, const vplan *vp, int blk, bool store, const char *slot)
{
	kl__cu_chunk_io_to(c, vp, blk, store, slot, false, 0);
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

/* The instructions of block blk. With a plan vp, chunked loads and stores
 * take element e of their chunk in `slot`, and (pointwise) broadcast loads
 * are left out, hoisted before the element loop. lc: the row-local arrays'
 * index. */
void kl__cu_emit_block(cctx *c, int blk, const vplan *vp, const char *slot, const char *lc)
{
	const kir_kernel *k = c->k;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i] || !(c->mask & (1u << in->opc)))
			continue;
		if (c->redo && (in->opc == KIR_STORE || in->opc == KIR_LSTORE ||
		                (in->opc == KIR_ACC && !part_acc(in))))
			continue; /* done by the pass itself */
		if (c->redo && in->opc == KIR_ACC) {
			line(c, "acc%d += (double)t%d;", (int)in->acc, (int)in->a);
		} else if (in->opc == KIR_LSTORE) {
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
 * innermost dim fastest): declare, as new constants, unit dims 0; else
 * assigned to the i<d> already declared, unit dims left as they are. */
void kl__cu_decompose_to(cctx *c, uint32_t mask, const char *q, bool declare)
{
	const kir_kernel *k = c->k;
	const char *decl = declare ? "const int64_t " : "";
	int first = -1;
	for (int d = 0; d < k->ndim && first < 0; d++)
		if ((mask & (1u << d)) && !unit(k, d))
			first = d;
	line(c, "int64_t q = %s;", q);
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (!(mask & (1u << d)) || (!declare && unit(k, d)))
			continue;
		ind(c);
		if (unit(k, d)) {
			kl__sb_printf(c->sb, "const int64_t i%d = 0;\n", d);
			continue;
		}
		if (d == first) {
			kl__sb_printf(c->sb, "%si%d = q;\n", decl, d);
			continue;
		}
		kl__sb_printf(c->sb, "%si%d = q %% (", decl, d);
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
		ind(c);
		kl__sb_puts(c->sb, "q /= (");
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
	}
	line(c, "(void)q;");
}

void kl__cu_decompose(cctx *c, uint32_t mask, const char *q)
{
	kl__cu_decompose_to(c, mask, q, true);
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
	while (u > 1 && kl__cu_body_cost(c) * vp->V * u > UNROLL_BUDGET)
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
	kl__cu_plan_cond(c, vp);
	line(c, "const int64_t nv = kl_vok ? n / %d : 0;", V);
	line(c, "const int64_t kl_gs = (int64_t)gridDim.x * %d; /* %d chunk%s a thread in flight */",
	     BLOCK, U, U > 1 ? "s" : "");
	line(c, "for (int64_t T = (int64_t)blockIdx.x * %d + threadIdx.x; T < nv; T += kl_gs * %d)",
	     BLOCK, U);
	open_brace(c);
	kl__cu_chunk_decls(c, vp, U);
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
			kl__cu_decompose(c, all, "L0");
		if (pass == 0) {
			kl__cu_chunk_io(c, vp, 0, false, "[u]");
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
			kl__cu_decompose(c, all, "L0 + e");
		kl__cu_emit_block(c, 0, vp, "[u]", "0");
		close_brace(c);
		kl__cu_chunk_io(c, vp, 0, true, "[u]");
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
	kl__cu_decompose(c, all, "L");
	kl__cu_emit_block(c, 0, NULL, "", "0");
	close_brace(c);
	kl__cu_plan_free(&vp);
}

/* the rows a block takes: the first row loop's (the chunked path's where
 * there is one: the aligned case, which the grid is sized for; the scalar
 * path's grid-stride loop covers whatever a different group leaves) */
static kl_row_grid cu_walk(const kl_renderer *r, const kir_kernel *k, const char *name,
                           kl_sb *sb)
{
	/* the body first: its row plan chooses the launch bounds (c.minb) */
	kl_sb body = {0};
	cctx c = {.r = r, .k = k, .sb = &body, .depth = 1, .mask = ~0u};
	if (!(c.live = kl__render_live(k))) {
		sb->oom = true;
		return (kl_row_grid){0, 0};
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
			kl__cu_render_rows(&c);
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
	return (kl_row_grid){c.per, c.per > 0 ? c.waves : 0};
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
        .buf_decl_alias_fmt = "\t%s%s *b%d = (%s%s *)A.b[%d];\n",
        .index_t = "int64_t",
        .simd_fmt = "",
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
