/* row_onepass.c - finds, in a row kernel's IR, two passes whose reductions
 * one cross-thread merge of per-thread partials can serve (row_onepass.h
 * says which); render_cuda_rows.c emits them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/row_onepass.h"

static bool fl_dt(int dt)
{
	return dt == KL_F32 || dt == KL_F64 || dt == KL_F16 || dt == KL_BF16;
}

/* a float-to-float cast: a rounding (to f16/bf16) or a widening */
static bool fcast(const kir_ins *in)
{
	return in->opc == KIR_CAST && fl_dt(in->dt) && fl_dt(in->in_dt);
}

/* id with its float casts in block blk stripped */
static int32_t uncast(const kir_kernel *k, int32_t id, int blk)
{
	while (id >= 0 && fcast(&k->ins[id]) && k->ins[id].blk == blk)
		id = k->ins[id].a;
	return id;
}

static bool addr_same(const kir_addr *a, const kir_addr *b)
{
	if (a->ix != b->ix || a->ns != b->ns)
		return false;
	for (int i = 0; i < a->ns; i++)
		if (a->six[i] != b->six[i] || memcmp(&a->sst[i], &b->sst[i], sizeof a->sst[i]))
			return false;
	return true;
}

/* x and y compute the same value: the same instructions on the same inputs
 * (a pass recomputes what an earlier one read); *budget bounds the walk */
static bool same_value(const kir_kernel *k, int32_t x, int32_t y, int *budget)
{
	if (x == y)
		return true;
	if (x < 0 || y < 0 || --*budget < 0)
		return false;
	const kir_ins *a = &k->ins[x], *b = &k->ins[y];
	if (a->opc != b->opc || a->dt != b->dt || a->in_dt != b->in_dt || a->op != b->op ||
	    memcmp(&a->k, &b->k, sizeof a->k) || a->seed != b->seed || a->buf != b->buf)
		return false;
	switch (a->opc) {
	case KIR_LOAD:
		if (!addr_same(&a->ad, &b->ad))
			return false;
		if (a->a >= 0 && (memcmp(&a->gst, &b->gst, sizeof a->gst) ||
		                  memcmp(&a->grows, &b->grows, sizeof a->grows)))
			return false;
		return same_value(k, a->a, b->a, budget);
	case KIR_INDEX:
	case KIR_IDXLT:
		return addr_same(&a->ad, &b->ad);
	case KIR_CONST:
		return true;
	case KIR_UNARY:
	case KIR_BINARY:
	case KIR_WHERE:
	case KIR_CAST:
	case KIR_RAND:
		return same_value(k, a->a, b->a, budget) && same_value(k, a->b, b->b, budget) &&
		       same_value(k, a->c, b->c, budget);
	default:
		return false; /* accumulators and row-local arrays: not recomputed values */
	}
}

/* the one live accumulation of block blk, or -1 */
static int32_t sole_acc(const kir_kernel *k, const uint8_t *live, int blk)
{
	int32_t found = -1;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (!live[i] || in->opc != KIR_ACC || in->blk != blk)
			continue;
		if (found >= 0)
			return -1;
		found = i;
	}
	return found;
}

/* every live instruction on accumulator acc sits where it should: its
 * updates in block upd, its start before it, its reads after it */
static bool acc_placed(const kir_kernel *k, const uint8_t *live, int32_t acc, int upd, int read_from)
{
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (!live[i] || in->acc != acc)
			continue;
		if (in->opc == KIR_ACC && in->blk != upd)
			return false;
		if (in->opc == KIR_ACC_INIT && in->blk >= upd)
			return false;
		if (in->opc == KIR_ACC_READ && in->blk < read_from)
			return false;
	}
	return true;
}

/* M's way from pass p's accumulator, all in block blk: float casts and (VAR)
 * one division by the count n, as a product with 1/n or a quotient by n */
static bool m_chain(const kir_kernel *k, int32_t m, int32_t acc, int blk, bool mean, int64_t n)
{
	if (m < 0 || k->ins[m].blk != blk)
		return false;
	int32_t x = uncast(k, m, blk);
	if (x < 0 || k->ins[x].blk != blk)
		return false;
	if (mean) {
		const kir_ins *q = &k->ins[x];
		if (n <= 0 || q->opc != KIR_BINARY || !fl_dt(q->dt) || q->a < 0 || q->b < 0)
			return false;
		const kir_ins *qa = &k->ins[q->a], *qb = &k->ins[q->b];
		if (q->op == KL_OP_MUL && qb->opc == KIR_CONST &&
		    fabs(qb->k * (double)n - 1.0) <= 1e-6)
			x = q->a;
		else if (q->op == KL_OP_MUL && qa->opc == KIR_CONST &&
		         fabs(qa->k * (double)n - 1.0) <= 1e-6)
			x = q->b;
		else if (q->op == KL_OP_DIV && qb->opc == KIR_CONST && qb->k == (double)n)
			x = q->a;
		else
			return false;
		if (k->ins[x].blk != blk)
			return false;
		x = uncast(k, x, blk);
	}
	return x >= 0 && k->ins[x].opc == KIR_ACC_READ && k->ins[x].acc == acc &&
	       k->ins[x].blk == blk && fl_dt(k->ins[x].dt);
}

static bool operand_in(const kir_ins *in, const uint8_t *set)
{
	return (in->a >= 0 && set[in->a]) || (in->b >= 0 && set[in->b]) ||
	       (in->c >= 0 && set[in->c]);
}

/* every live instruction that depends on M's accumulator (dep) and sits in
 * pass p+1 is the chain to the sum (chain) or, for LSE, a row-local array
 * holding the exp or a rounding of it (post); none outside the pass reads a
 * value of the pass. */
static bool uses_ok(const kir_kernel *k, const uint8_t *live, kl_onepass *op, int32_t b_acc,
                    const uint8_t *dep, const uint8_t *chain, const uint8_t *post)
{
	int blk = 2 * op->p + 1;
	for (int i = 0; i < KIR_MAX_LOCAL; i++)
		op->held[i] = -1;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (!live[i])
			continue;
		if (in->blk != blk) {
			for (int32_t j = 0; j < 3; j++) {
				int32_t o = j == 0 ? in->a : j == 1 ? in->b : in->c;
				if (o >= 0 && k->ins[o].blk == blk)
					return false;
			}
			continue;
		}
		if (in->opc == KIR_LLOAD)
			return false; /* no array is read where it may be rescaled later */
		if (!dep[i] || chain[i] || i == b_acc)
			continue;
		if (op->kind != KL_ONEPASS_LSE || in->opc != KIR_LSTORE || !post[in->a] ||
		    in->acc < 0 || in->acc >= KIR_MAX_LOCAL)
			return false;
		if (op->held[in->acc] >= 0 && op->held[in->acc] != in->a)
			return false;
		op->held[in->acc] = in->a;
	}
	/* a held array is read only after pass p+1 */
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (live[i] && in->opc == KIR_LLOAD && in->acc >= 0 && in->acc < KIR_MAX_LOCAL &&
		    op->held[in->acc] >= 0 && in->blk <= blk)
			return false;
		if (live[i] && in->opc == KIR_LSTORE && in->acc >= 0 && in->acc < KIR_MAX_LOCAL &&
		    op->held[in->acc] >= 0 && in->a != op->held[in->acc])
			return false;
	}
	return true;
}

static bool match(const kir_kernel *k, const uint8_t *live, int p, int64_t rn, kl_onepass *op,
                  uint8_t *dep, uint8_t *chain, uint8_t *post)
{
	int pa = 2 * p - 1, pb = 2 * p + 1;
	if (p < 1 || p + 1 > k->npass)
		return false;
	int32_t A = sole_acc(k, live, pa), B = sole_acc(k, live, pb);
	if (A < 0 || B < 0)
		return false;
	const kir_ins *ia = &k->ins[A], *ib = &k->ins[B];
	if (ib->op != KL_OP_SUM || !fl_dt(ia->in_dt) || !fl_dt(ib->in_dt) || ia->a < 0 || ib->a < 0)
		return false;
	if (ia->op == KL_OP_MAX)
		op->kind = KL_ONEPASS_LSE;
	else if (ia->op == KL_OP_SUM)
		op->kind = KL_ONEPASS_VAR;
	else
		return false;
	if (!acc_placed(k, live, ia->acc, pa, 2 * p) || !acc_placed(k, live, ib->acc, pb, pb + 1))
		return false;
	/* the sum's value: [casts] exp [casts] (v - M), or [casts] d * d with
	 * d = [casts] (v - M) */
	int32_t top = uncast(k, ib->a, pb);
	if (top < 0 || k->ins[top].blk != pb)
		return false;
	const kir_ins *t = &k->ins[top];
	if (op->kind == KL_ONEPASS_LSE ? t->opc != KIR_UNARY || t->op != KL_OP_EXP
	                               : t->opc != KIR_BINARY || t->op != KL_OP_MUL || t->a != t->b)
		return false;
	int32_t sub = uncast(k, t->a, pb);
	if (sub < 0 || k->ins[sub].blk != pb)
		return false;
	const kir_ins *s = &k->ins[sub];
	if (s->opc != KIR_BINARY || s->op != KL_OP_SUB || (s->dt != KL_F32 && s->dt != KL_F64))
		return false;
	op->p = p;
	op->acc_a = ia->acc;
	op->acc_b = ib->acc;
	op->m = s->b;
	op->n = rn;
	op->exp = op->kind == KL_ONEPASS_LSE ? top : -1;
	if (!m_chain(k, s->b, ia->acc, 2 * p, op->kind == KL_ONEPASS_VAR, rn))
		return false;
	int budget = 4096;
	if (!same_value(k, s->a, ia->a, &budget))
		return false;
	/* the chain sub .. sum value; post: the exp and its roundings */
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		bool fc = fcast(in) && in->blk == pb && in->a >= 0;
		chain[i] = i == sub || i == top || (fc && chain[in->a]);
		post[i] = op->kind == KL_ONEPASS_LSE && (i == top || (fc && post[in->a]));
	}
	/* the chain's casts lead only along it: top's operand from sub, the
	 * sum's value from top */
	if (!chain[t->a] || !chain[ib->a])
		return false;
	/* dep: what reads pass p's result (to a fixed point: operands need not
	 * precede their readers) */
	for (bool more = true; more;) {
		more = false;
		for (int32_t i = 0; i < k->nins; i++) {
			const kir_ins *in = &k->ins[i];
			bool d = (in->opc == KIR_ACC_READ && in->acc == ia->acc) ||
			         (in->opc != KIR_LLOAD && operand_in(in, dep));
			if (d && !dep[i]) {
				dep[i] = 1;
				more = true;
			}
		}
	}
	return uses_ok(k, live, op, B, dep, chain, post);
}

bool kl__onepass_match(const kir_kernel *k, const uint8_t *live, int p, int64_t rn,
                       kl_onepass *op)
{
	memset(op, 0, sizeof *op);
	size_t n = (size_t)k->nins + 1;
	uint8_t *dep = calloc(n, 1), *chain = calloc(n, 1), *post = calloc(n, 1);
	bool ok = dep && chain && post && match(k, live, p, rn, op, dep, chain, post);
	free(dep);
	free(chain);
	free(post);
	if (!ok)
		memset(op, 0, sizeof *op);
	return ok;
}
