/* plan_io.c - plans as bytes: a strict validator (every count, id and
 * name checked, so a plan from the disk cache or a buggy pass cannot make
 * the executor index out of bounds), a little-endian serializer, and
 * kl__program_free.
 */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"
#include "core/le.h"
#include "plan/plan.h"

void kl__program_free(kl_program *p)
{
	if (!p)
		return;
	free(p->bufs);
	free(p->steps);
	free(p->symf);
	for (int32_t i = 0; i < p->nkernels; i++)
		free(p->kernel_names[i]);
	free(p->kernel_names);
	free(p->source);
	free(p->fusion_log);
	memset(p, 0, sizeof(*p));
}

#define PROG_MAGIC "KLPROG01"
/* 2: attention steps; 3: product epilogues (residual, bias, activation);
 * 4: a row kernel's rows a block and rows (kl_step.row_per, rowdims);
 * 5: its waves (kl_step.waves); 6: library steps' symbolic fields (symf);
 * 7: cache writes; 8: the attention backward (kl_attn_step.bwd); 9: attention
 * lengths (kl_attn_step.len); 10: cache writes of value views (val_off,
 * val_rs); 11: the backward's gradients each at its own place (dq_off,
 * dk_off, dv_off and dk's and dv's strides) */
#define PROG_FORMAT 12u
#define MAX_COUNT (1 << 20)
#define MAX_NAME 63

kl_status kl__plan_fail(char *err, size_t cap, const char *fmt, ...)
{
	if (err && cap) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, cap, fmt, ap);
		va_end(ap);
	}
	return KL_EFORMAT;
}

static bool name_ok(const char *s)
{
	if (!s || !*s || (*s >= '0' && *s <= '9'))
		return false;
	size_t n = 0;
	for (; s[n]; n++)
		if (!((s[n] >= 'a' && s[n] <= 'z') || (s[n] >= '0' && s[n] <= '9') ||
		      s[n] == '_') ||
		    n >= MAX_NAME)
			return false;
	return true;
}

static bool text_ok(const char *s, size_t max)
{
	for (size_t i = 0; i < max; i++) {
		unsigned char c = (unsigned char)s[i];
		if (c == '\0')
			return true;
		if ((c < 0x20 && c != '\n' && c != '\t') || c > 0x7e)
			return false;
	}
	return false;
}

static void buf_dims(const kl_buf *b, int64_t *dims)
{
	for (int d = 0; d < b->ndim; d++)
		dims[d] = b->shape[d].v;
}

/* numel of a buffer that kl__program_validate has checked (core/shape.h) */
static int64_t buf_numel(const kl_buf *b)
{
	int64_t dims[KL_MAX_DIMS];
	buf_dims(b, dims);
	return kl__numel(b->ndim, dims);
}

/* The largest element index an operand addresses, or -1 when the operand is
 * empty; -2 on overflow or a negative stride. */
/* pad: an empty dim counts as 1, so that the index arithmetic of an empty
 * operand (which reads nothing) is checked not to overflow either */
static int64_t operand_extent_pad(int64_t off, int nbatch, const int64_t *batch, const int64_t *bst,
                                  int64_t rows, int64_t rs, int64_t cols, int64_t cs, bool pad)
{
	if (pad) {
		rows = rows ? rows : 1;
		cols = cols ? cols : 1;
	}
	if (rows == 0 || cols == 0)
		return -1;
	int64_t hi = off, t;
	for (int i = 0; i < nbatch; i++) {
		if (batch[i] == 0 && !pad)
			return -1;
		if (bst[i] < 0 || __builtin_mul_overflow((batch[i] ? batch[i] : 1) - 1, bst[i], &t) ||
		    __builtin_add_overflow(hi, t, &hi))
			return -2;
	}
	if (rs < 0 || cs < 0 || __builtin_mul_overflow(rows - 1, rs, &t) ||
	    __builtin_add_overflow(hi, t, &hi) || __builtin_mul_overflow(cols - 1, cs, &t) ||
	    __builtin_add_overflow(hi, t, &hi))
		return -2;
	return hi;
}

static int64_t mm_ext(const kl_matmul_step *mm, int which, bool pad)
{
	switch (which) {
	case 0:
		return operand_extent_pad(mm->a_off, mm->nbatch, mm->batch, mm->a_bstride, mm->m,
		                      mm->a_rs, mm->k, mm->a_cs, pad);
	case 1:
		return operand_extent_pad(mm->b_off, mm->nbatch, mm->batch, mm->b_bstride, mm->k,
		                      mm->b_rs, mm->n, mm->b_cs, pad);
	case 2:
		return operand_extent_pad(mm->c_off, mm->nbatch, mm->batch, mm->c_bstride, mm->m,
		                      mm->ldc, mm->n, 1, pad);
	case 3:
		return operand_extent_pad(mm->r_off, mm->nbatch, mm->batch, mm->r_bstride, mm->m,
		                      mm->r_ld, mm->n, 1, pad);
	default:
		return operand_extent_pad(mm->bias_off, 0, NULL, NULL, 1, 0, mm->n, 1, pad);
	}
}

/* The farthest element the backward's gradient g (0 dq, 1 dk, 2 dv) reaches
 * in o (operand_extent_pad's -1 and -2). */
static int64_t attn_grad_ext(const kl_attn_step *a, int g, bool pad)
{
	switch (g) {
	case 0:
		return operand_extent_pad(a->dq_off, a->nbatch, a->batch, a->o_bs, a->tq, a->o_rs,
		                          a->dv, 1, pad);
	case 1:
		return operand_extent_pad(a->dk_off, a->nbatch, a->batch, a->dk_bs, a->tk, a->dk_rs,
		                          a->dv, 1, pad);
	default:
		return operand_extent_pad(a->dv_off, a->nbatch, a->batch, a->dv_bs, a->tk, a->dv_rs,
		                          a->dv, 1, pad);
	}
}

/* the farthest of the three (-1 when all are empty, -2 when one overflows) */
static int64_t attn_bwd_out_ext(const kl_attn_step *a, bool pad)
{
	int64_t hi = -1;
	for (int g = 0; g < 3; g++) {
		int64_t e = attn_grad_ext(a, g, pad);
		if (e == -2)
			return -2;
		hi = e > hi ? e : hi;
	}
	return hi;
}

/* which: 0 q, 1 k, 2 v, 3 o (the backward's gradients), 4 the backward's O,
 * 5 its dO */
static int64_t attn_ext(const kl_attn_step *a, int which, bool pad)
{
	switch (which) {
	case 0:
		return operand_extent_pad(a->q_off, a->nbatch, a->batch, a->q_bs, a->tq, a->q_rs, a->d,
		                      a->q_cs, pad);
	case 1:
		return operand_extent_pad(a->k_off, a->nbatch, a->batch, a->k_bs, a->tk, a->k_rs, a->d,
		                      a->k_cs, pad);
	case 2:
		return operand_extent_pad(a->v_off, a->nbatch, a->batch, a->v_bs, a->tk, a->v_rs, a->dv,
		                      a->v_cs, pad);
	case 3:
		if (a->bwd)
			return attn_bwd_out_ext(a, pad);
		return operand_extent_pad(0, a->nbatch, a->batch, a->o_bs, a->tq, a->o_rs, a->dv, 1,
		                          pad);
	case 4:
		return operand_extent_pad(a->fo_off, a->nbatch, a->batch, a->fo_bs, a->tq, a->fo_rs,
		                      a->dv, a->fo_cs, pad);
	case 5:
		return operand_extent_pad(a->go_off, a->nbatch, a->batch, a->go_bs, a->tq, a->go_rs,
		                      a->dv, a->go_cs, pad);
	default: {
		if (a->len < 0)
			return -1;
		int64_t rows = 1; /* the batch entries before the inner ones */
		for (int i = 0; i < a->nbatch - a->len_inner; i++)
			if (a->batch[i] < 0 || __builtin_mul_overflow(rows, a->batch[i], &rows))
				return -2;
		return operand_extent_pad(a->len_off, 0, NULL, NULL, 1, 0, rows, a->len_st, pad);
	}
	}
}

int64_t kl__attn_len_div(const kl_attn_step *a)
{
	int64_t div = 1;
	if (a->len < 0)
		return 1; /* no lengths: nothing divides */
	for (int i = a->nbatch - a->len_inner; i < a->nbatch; i++)
		div *= a->batch[i] > 0 ? a->batch[i] : 1;
	return div;
}

int64_t kl__attn_len_at(const kl_attn_step *a, const void *lens, int64_t r)
{
	int64_t at = a->len_off + r * a->len_st;
	int64_t l = a->len_dt == KL_I32 ? ((const int32_t *)lens)[at] : ((const int64_t *)lens)[at];
	return l < 0 ? 0 : l < a->tk ? l : a->tk;
}

int64_t kl__mm_extent(const kl_matmul_step *mm, int which)
{
	return mm_ext(mm, which, false);
}

int64_t kl__attn_extent(const kl_attn_step *a, int which)
{
	return attn_ext(a, which, false);
}

int64_t kl__cw_extent(const kl_cw_step *c, int which)
{
	if (which == 2) {
		/* rows of outer * s * inner elements, val_rs apart, from val_off */
		int64_t row = 1, last;
		int64_t dims[3] = {c->outer, c->s, c->inner};
		for (int i = 0; i < 3; i++)
			if (dims[i] < 0 || __builtin_mul_overflow(row, dims[i], &row))
				return -2;
		if (c->rows < 0 || c->val_off < 0 || c->val_rs < 0)
			return -2;
		if (c->rows == 0 || row == 0)
			return -1;
		if (__builtin_mul_overflow(c->rows - 1, c->val_rs, &last) ||
		    __builtin_add_overflow(last, c->val_off, &last) ||
		    __builtin_add_overflow(last, row - 1, &last))
			return -2;
		return last;
	}
	int64_t n = 1;
	int64_t dims[4] = {which == 0 || which == 3 ? c->R : c->rows,
	                   which == 1 ? 1 : c->outer,
	                   which == 1 ? 1 : which == 2 ? c->s : c->cap,
	                   which == 1 ? 1 : c->inner};
	for (int i = 0; i < 4; i++) {
		if (dims[i] < 0 || __builtin_mul_overflow(n, dims[i], &n))
			return -2;
	}
	return n - 1; /* -1: empty */
}

/* ---- symbolic step fields ---------------------------------------------------- */

#define MMF(f) offsetof(kl_step, mm.f)
#define ATF(f) offsetof(kl_step, at.f)
#define CWF(f) offsetof(kl_step, cw.f)
#define EACH8(F, f) F(f[0]), F(f[1]), F(f[2]), F(f[3]), F(f[4]), F(f[5]), F(f[6]), F(f[7])
static const size_t step_fields[] = {
        MMF(m),        MMF(n),          MMF(k),          MMF(a_off),       MMF(b_off),
        MMF(c_off),    MMF(a_rs),       MMF(a_cs),       MMF(b_rs),        MMF(b_cs),
        MMF(ldc),      MMF(r_off),      MMF(r_ld),       MMF(bias_off),    EACH8(MMF, batch),
        EACH8(MMF, a_bstride), EACH8(MMF, b_bstride), EACH8(MMF, c_bstride),
        EACH8(MMF, r_bstride), ATF(tq),  ATF(tk),         ATF(d),           ATF(dv),
        ATF(q_off),    ATF(k_off),      ATF(v_off),      ATF(q_rs),        ATF(q_cs),
        ATF(k_rs),     ATF(k_cs),       ATF(v_rs),       ATF(v_cs),        ATF(o_rs),
        EACH8(ATF, batch), EACH8(ATF, q_bs), EACH8(ATF, k_bs), EACH8(ATF, v_bs),
        EACH8(ATF, o_bs), CWF(rows), CWF(R), CWF(outer), CWF(cap), CWF(s), CWF(inner),
        ATF(fo_off),   ATF(go_off),     ATF(fo_rs),      ATF(go_rs),       EACH8(ATF, fo_bs),
        EACH8(ATF, go_bs), ATF(len_off), ATF(len_st), CWF(val_off), CWF(val_rs),
        ATF(dq_off),   ATF(dk_off),     ATF(dv_off),     ATF(dk_rs),       ATF(dv_rs),
        EACH8(ATF, dk_bs), EACH8(ATF, dv_bs)};
#define NFIELDS ((int)(sizeof step_fields / sizeof step_fields[0]))

int kl__step_nfields(void)
{
	return NFIELDS;
}

int64_t *kl__step_field(kl_step *sp, int field)
{
	return (int64_t *)(void *)((char *)sp + step_fields[field]);
}

/* numel of b at the symbol values syms; -1 on overflow */
static int64_t numel_at(const kl_buf *b, const int64_t *syms)
{
	int64_t n = 1;
	for (int d = 0; d < b->ndim; d++) {
		int64_t v = b->shape[d].sym > 0 ? syms[b->shape[d].sym - 1] : b->shape[d].v;
		if (v < 0 || __builtin_mul_overflow(n, v, &n))
			return -1;
	}
	return n;
}

static bool sym_buf(const kl_buf *b)
{
	for (int d = 0; d < b->ndim; d++)
		if (b->shape[d].sym > 0)
			return true;
	return false;
}

/* Does operand buffer id, reaching element ext (-1: empty), fit at syms? An
 * input with static dims keeps the strides it was traced with (checked by
 * kl__compile), so only its symbolic peers are checked here. */
static bool fits(const kl_program *p, int32_t id, int64_t ext, const int64_t *syms, bool dense)
{
	const kl_buf *b = &p->bufs[id];
	if (ext == -1)
		return true;
	if (ext < 0)
		return false;
	if (b->role == KL_BUF_INPUT && !sym_buf(b) && !dense)
		return true;
	int64_t n = numel_at(b, syms);
	return n >= 0 && ext < n;
}

static kl_status bind(kl_program *p, const int64_t *syms, bool dense, char *err, size_t cap)
{
	for (int32_t i = 0; i < p->nsymf; i++) {
		const kl_symf *f = &p->symf[i];
		int64_t v = f->c;
		for (int j = 0; j < f->ns; j++)
			if (__builtin_mul_overflow(v, syms[f->s[j] - 1], &v))
				return kl__plan_fail(err, cap, "step %d: a size overflows at these sizes",
				                     (int)f->step);
		*kl__step_field(&p->steps[f->step], f->field) = v;
	}
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		if (sp->kind == KL_STEP_MATMUL) {
			const kl_matmul_step *mm = &sp->mm;
			int32_t ids[5] = {mm->a, mm->b, mm->c, mm->r, mm->bias};
			for (int w = 0; w < 5; w++) {
				if ((w == 3 && !mm->has_r) || (w == 4 && !mm->has_bias))
					continue;
				if (!fits(p, ids[w], kl__mm_extent(mm, w), syms, dense) ||
				    (dense && mm_ext(mm, w, true) < 0))
					return kl__plan_fail(err, cap,
					                     "step %d: matmul operand %c reaches outside its "
					                     "buffer at these sizes",
					                     (int)s, "abcrv"[w]);
			}
		} else if (sp->kind == KL_STEP_ATTENTION) {
			const kl_attn_step *a = &sp->at;
			int32_t ids[7] = {a->q, a->k, a->v, a->o, a->fo, a->go, a->len};
			for (int w = 0; w < 7; w++)
				if ((w < 4 || (w < 6 && a->bwd) || (w == 6 && a->len >= 0)) &&
				    (!fits(p, ids[w], kl__attn_extent(a, w), syms, dense) ||
				     (dense && attn_ext(a, w, true) < 0)))
					return kl__plan_fail(err, cap,
					                     "step %d: attention operand %c reaches outside its "
					                     "buffer at these sizes",
					                     (int)s, "qkvoOGl"[w]);
		} else if (sp->kind == KL_STEP_CACHE_WRITE) {
			const kl_cw_step *c = &sp->cw;
			int32_t ids[4] = {c->cache, c->pos, c->val, c->out};
			for (int w = 0; w < 4; w++)
				if (!fits(p, ids[w], kl__cw_extent(c, w), syms, dense))
					return kl__plan_fail(err, cap,
					                     "step %d: cache write operand %s reaches outside "
					                     "its buffer at these sizes",
					                     (int)s, (const char *[]){"cache", "pos", "val",
					                                              "out"}[w]);
			if (c->rows > c->R || c->s > c->cap)
				return kl__plan_fail(err, cap,
				                     "step %d: cache write of %lld rows of %lld positions "
				                     "into a cache of %lld rows of %lld",
				                     (int)s, (long long)c->rows, (long long)c->s,
				                     (long long)c->R, (long long)c->cap);
		}
	}
	return KL_OK;
}

kl_status kl__program_bind(kl_program *p, const int64_t *syms, char *err, size_t cap)
{
	return bind(p, syms, false, err, cap);
}

kl_status kl__program_bind_dense(kl_program *p, const int64_t *syms, char *err, size_t cap)
{
	return bind(p, syms, true, err, cap);
}

static bool in_ids(const int32_t *ids, int32_t n, int32_t b)
{
	for (int32_t i = 0; i < n; i++)
		if (ids[i] == b)
			return true;
	return false;
}

const kl_op kl__mm_act_op[KL_MM_ACT_COUNT] = {
	[KL_MM_ACT_NONE] = KL_OP_INPUT,
	[KL_MM_ACT_RELU] = KL_OP_RELU,
	[KL_MM_ACT_GELU] = KL_OP_GELU,
	[KL_MM_ACT_GELU_TANH] = KL_OP_GELU_TANH,
};

static kl_status check_matmul(const kl_program *p, int32_t s, char *err, size_t cap)
{
	const kl_step *sp = &p->steps[s];
	const kl_matmul_step *mm = &sp->mm;
	/* operands a, b, c, then the residual and the bias when present */
	int32_t ids[5] = {mm->a, mm->b, mm->c, mm->r, mm->bias};
	int which[5] = {0, 1, 2, 3, 4}, nid = 3;
	if ((unsigned)mm->act >= KL_MM_ACT_COUNT)
		return kl__plan_fail(err, cap, "step %d: matmul activation %d out of range", s, (int)mm->act);
	if (mm->has_r)
		nid++;
	if (mm->has_bias) {
		ids[nid] = mm->bias;
		which[nid++] = 4;
	}
	for (int i = 0; i < nid; i++)
		if (ids[i] < 0 || ids[i] >= p->nbufs)
			return kl__plan_fail(err, cap, "step %d: matmul operand %d out of range", s, ids[i]);
	for (int i = 3; i < nid; i++) {
		if (ids[i] == mm->c)
			return kl__plan_fail(err, cap, "step %d: matmul %s is its result buffer", s,
			            which[i] == 3 ? "residual" : "bias");
		if (p->bufs[ids[i]].dtype != p->bufs[mm->c].dtype)
			return kl__plan_fail(err, cap, "step %d: matmul %s is %s, the result %s", s,
			            which[i] == 3 ? "residual" : "bias",
			            kl_dtype_name(p->bufs[ids[i]].dtype),
			            kl_dtype_name(p->bufs[mm->c].dtype));
	}
	/* the planner knows a step's buffers from its reads and writes only */
	if (!in_ids(sp->writes, sp->nwrites, mm->c))
		return kl__plan_fail(err, cap, "step %d: matmul result %d is not among its writes", s, mm->c);
	for (int i = 0; i < nid; i++)
		if (i != 2 && !in_ids(sp->reads, sp->nreads, ids[i]))
			return kl__plan_fail(err, cap, "step %d: matmul operand %d is not among its reads", s,
			            ids[i]);
	if (mm->has_r && (mm->r_off < 0 || mm->r_ld < (mm->m > 1 ? mm->n : 0)))
		return kl__plan_fail(err, cap, "step %d: matmul residual offset or row stride out of range", s);
	if (mm->has_bias && mm->bias_off < 0)
		return kl__plan_fail(err, cap, "step %d: matmul bias offset out of range", s);
	const kl_buf *c = &p->bufs[mm->c];
	if (c->role == KL_BUF_INPUT || (c->role == KL_BUF_OUTPUT && c->alias >= 0))
		return kl__plan_fail(err, cap, "step %d: matmul writes an input or a view", s);
	if (mm->m < 0 || mm->n < 0 || mm->k < 0 || mm->nbatch < 0 || mm->nbatch > KL_MAX_DIMS - 2)
		return kl__plan_fail(err, cap, "step %d: matmul sizes out of range", s);
	for (int i = 0; i < mm->nbatch; i++)
		if (mm->batch[i] < 0)
			return kl__plan_fail(err, cap, "step %d: matmul batch out of range", s);
	if (!isfinite(mm->alpha) || !isfinite(mm->beta) || mm->ldc < (mm->n ? mm->n : 0) ||
	    mm->a_off < 0 || mm->b_off < 0 || mm->c_off < 0)
		return kl__plan_fail(err, cap, "step %d: matmul scalars or strides out of range", s);
	for (int i = 0; i < nid; i++) {
		int64_t ext = kl__mm_extent(mm, which[i]), n = buf_numel(&p->bufs[ids[i]]);
		/* an input is addressed through the strides it was traced with, which
		 * the program does not hold: kl__compile checks those against them */
		if (ext == -2 || (p->bufs[ids[i]].role != KL_BUF_INPUT && ext >= n))
			return kl__plan_fail(err, cap,
			            "step %d: matmul operand %c reaches element %lld of %lld", s,
			            "abcrv"[which[i]], (long long)ext, (long long)n);
	}
	return KL_OK;
}

static bool float_dt(kl_dtype dt)
{
	return dt == KL_F32 || dt == KL_F64 || dt == KL_F16 || dt == KL_BF16;
}

static kl_status check_cache_write(const kl_program *p, int32_t s, char *err, size_t cap)
{
	const kl_step *sp = &p->steps[s];
	const kl_cw_step *c = &sp->cw;
	int32_t ids[4] = {c->cache, c->pos, c->val, c->out};
	for (int i = 0; i < 4; i++)
		if (ids[i] < 0 || ids[i] >= p->nbufs)
			return kl__plan_fail(err, cap, "step %d: cache write operand %d out of range", s,
			                     ids[i]);
	kl_dtype dt = p->bufs[c->out].dtype, pdt = p->bufs[c->pos].dtype;
	if (p->bufs[c->cache].dtype != dt || p->bufs[c->val].dtype != dt ||
	    (pdt != KL_I32 && pdt != KL_I64))
		return kl__plan_fail(err, cap, "step %d: cache write dtypes do not match", s);
	const kl_buf *o = &p->bufs[c->out];
	if ((o->role == KL_BUF_INPUT && c->out != c->cache) ||
	    (o->role == KL_BUF_OUTPUT && o->alias >= 0 && o->alias != c->cache))
		return kl__plan_fail(err, cap, "step %d: cache write into an input or view other "
		                     "than its cache", s);
	if (c->rows < 0 || c->R < 0 || c->outer < 0 || c->cap < 0 || c->s < 0 || c->inner < 0 ||
	    c->rows > c->R || c->s > c->cap || c->axis < 1 || c->axis >= KL_MAX_DIMS)
		return kl__plan_fail(err, cap, "step %d: cache write sizes out of range", s);
	if (!in_ids(sp->writes, sp->nwrites, c->out) || !in_ids(sp->reads, sp->nreads, c->pos) ||
	    !in_ids(sp->reads, sp->nreads, c->val) ||
	    (c->out != c->cache && !in_ids(sp->reads, sp->nreads, c->cache)))
		return kl__plan_fail(err, cap, "step %d: cache write operands not among its reads "
		                     "and writes", s);
	for (int i = 0; i < 4; i++) {
		int64_t n = buf_numel(&p->bufs[ids[i]]), ext = kl__cw_extent(c, i);
		if (ext == -2 || (p->bufs[ids[i]].role != KL_BUF_INPUT && ext >= n))
			return kl__plan_fail(err, cap, "step %d: cache write operand %d reaches element "
			                     "%lld of %lld", s, i, (long long)ext, (long long)n);
	}
	return KL_OK;
}

static kl_status check_attention(const kl_program *p, int32_t s, char *err, size_t cap)
{
	const kl_attn_step *a = &p->steps[s].at;
	int32_t ids[6] = {a->q, a->k, a->v, a->o, a->fo, a->go};
	if (a->bwd != 0 && a->bwd != 1)
		return kl__plan_fail(err, cap, "step %d: attention mode %d", s, (int)a->bwd);
	int nops = a->bwd ? 6 : 4;
	for (int i = 0; i < nops; i++)
		if (ids[i] < 0 || ids[i] >= p->nbufs)
			return kl__plan_fail(err, cap, "step %d: attention operand %d out of range", s, ids[i]);
	kl_dtype dt = p->bufs[a->o].dtype;
	for (int i = 0; i < nops; i++) {
		if (p->bufs[ids[i]].dtype != dt || !float_dt(dt))
			return kl__plan_fail(err, cap, "step %d: attention operands of mixed or non-float dtypes",
			            s);
	}
	const kl_buf *o = &p->bufs[a->o];
	if (o->role == KL_BUF_INPUT || (o->role == KL_BUF_OUTPUT && o->alias >= 0))
		return kl__plan_fail(err, cap, "step %d: attention writes an input or a view", s);
	if (a->tq < 0 || a->tk < 0 || a->d < 0 || a->dv < 0 || a->nbatch < 0 ||
	    a->nbatch > KL_MAX_DIMS - 2 || !isfinite(a->scale) ||
	    (a->causal != 0 && a->causal != 1) || a->o_rs < a->dv || a->q_off < 0 || a->k_off < 0 ||
	    a->v_off < 0 ||
	    (a->bwd &&
	     (a->d != a->dv || a->fo_off < 0 || a->go_off < 0 || a->fo_cs != 1 || a->go_cs != 1 ||
	      a->tk > INT64_MAX / 4 || a->tq > INT64_MAX / 4 || a->dq_off < 0 || a->dk_off < 0 ||
	      a->dv_off < 0 || a->dk_rs < a->dv || a->dv_rs < a->dv)))
		return kl__plan_fail(err, cap, "step %d: attention sizes, strides or scale out of range", s);
	for (int i = 0; i < a->nbatch; i++)
		if (a->batch[i] < 0)
			return kl__plan_fail(err, cap, "step %d: attention batch out of range", s);
	for (int i = 0; i < nops; i++) {
		int64_t n = buf_numel(&p->bufs[ids[i]]), ext = kl__attn_extent(a, i);
		if (i == 3 && a->bwd)
			continue; /* below, gradient by gradient */
		if (ext == -2 || (p->bufs[ids[i]].role != KL_BUF_INPUT && ext >= n))
			return kl__plan_fail(err, cap, "step %d: attention operand %c reaches element %lld of %lld",
			            s, "qkvoOG"[i], (long long)ext, (long long)n);
	}
	/* the backward's o (never an input): each gradient inside it, named */
	for (int g = 0; a->bwd && g < 3; g++) {
		int64_t n = buf_numel(o), ext = attn_grad_ext(a, g, false);
		int64_t off[3] = {a->dq_off, a->dk_off, a->dv_off};
		int64_t rs[3] = {a->o_rs, a->dk_rs, a->dv_rs};
		if (ext == -2 || ext >= n)
			return kl__plan_fail(
			        err, cap,
			        "step %d: the attention backward's %s (from "
			        "element %lld, rows %lld apart) reaches element %lld of "
			        "the %lld of buffer %d",
			        s, (const char *[]){"dq", "dk", "dv"}[g], (long long)off[g],
			        (long long)rs[g], (long long)ext, (long long)n, a->o);
	}
	/* the backward writes o while it reads the others: none may share it */
	for (int i = 0; a->bwd && i < nops; i++)
		if (i != 3 && ids[i] == a->o)
			return kl__plan_fail(err, cap, "step %d: attention backward writes its operand %c",
			                     s, "qkvoOG"[i]);
	/* read even without lengths (kl__attn_len_div): in range either way */
	if (a->len_inner < 0 || a->len_inner > a->nbatch)
		return kl__plan_fail(err, cap, "step %d: attention lengths' inner dims %d of %d", s,
		                     a->len_inner, a->nbatch);
	if (a->len < 0)
		return a->len == -1 ? KL_OK
		                    : kl__plan_fail(err, cap, "step %d: attention lengths %d out of range",
		                                    s, a->len);
	if (a->len >= p->nbufs || a->len_dt != (int32_t)p->bufs[a->len].dtype ||
	    (a->len_dt != KL_I32 && a->len_dt != KL_I64) || a->len_inner < 0 ||
	    a->len_inner > a->nbatch || a->nbatch - a->len_inner > 1 || a->len_off < 0 ||
	    a->len_st < 0)
		return kl__plan_fail(err, cap, "step %d: attention lengths out of range", s);
	int64_t n = buf_numel(&p->bufs[a->len]), ext = kl__attn_extent(a, 6);
	if (ext == -2 || (p->bufs[a->len].role != KL_BUF_INPUT && ext >= n))
		return kl__plan_fail(err, cap, "step %d: attention lengths reach element %lld of %lld", s,
		                     (long long)ext, (long long)n);
	return KL_OK;
}

/* The forward attention step whose rows' L the backward step s can read:
 * the last one before s over the same q and k (buffers, offsets, strides,
 * batch dims, sizes, scale and mask), without lengths, with no step between
 * them writing q's or k's buffer; -1 when there is none. */
int32_t kl__attn_lse_source(const kl_program *p, int32_t s)
{
	if (s < 0 || s >= p->nsteps || p->steps[s].kind != KL_STEP_ATTENTION || !p->steps[s].at.bwd)
		return -1;
	const kl_attn_step *b = &p->steps[s].at;
	for (int32_t f = s - 1; f >= 0; f--) {
		const kl_step *fp = &p->steps[f];
		for (int32_t w = 0; w < fp->nwrites; w++)
			if (fp->writes[w] == b->q || fp->writes[w] == b->k)
				return -1;
		const kl_attn_step *a = &fp->at;
		if (fp->kind != KL_STEP_ATTENTION || a->bwd || a->len >= 0 || a->q != b->q ||
		    a->k != b->k || a->q_off != b->q_off || a->k_off != b->k_off ||
		    a->q_rs != b->q_rs || a->q_cs != b->q_cs || a->k_rs != b->k_rs ||
		    a->k_cs != b->k_cs || a->tq != b->tq || a->tk != b->tk || a->d != b->d ||
		    a->causal != b->causal || a->scale != b->scale || a->nbatch != b->nbatch)
			continue;
		bool same = true;
		for (int i = 0; i < a->nbatch; i++)
			same = same && a->batch[i] == b->batch[i] && a->q_bs[i] == b->q_bs[i] &&
			       a->k_bs[i] == b->k_bs[i];
		if (same)
			return f;
	}
	return -1;
}

bool kl__inplace_bufs(const kl_buf *r, const kl_buf *w)
{
	if (r == w || r->role != KL_BUF_TEMP || w->role != KL_BUF_TEMP || r->dtype != w->dtype ||
	    r->ndim != w->ndim)
		return false;
	for (int d = 0; d < r->ndim; d++)
		if (r->shape[d].v != w->shape[d].v || r->shape[d].sym != w->shape[d].sym)
			return false;
	return true;
}

kl_status kl__program_validate(const kl_program *p, int ninputs, int noutputs, char *err,
                               size_t cap)
{
	if (p->nbufs < 0 || p->nbufs > MAX_COUNT || p->nsteps < 0 || p->nsteps > MAX_COUNT ||
	    p->nkernels < 0 || p->nkernels > MAX_COUNT || p->nsyms < 0 ||
	    p->nsyms > KL_MAX_DIMS * 4)
		return kl__plan_fail(err, cap, "counts out of range");
	if ((p->nbufs && !p->bufs) || (p->nsteps && !p->steps) || (p->nkernels && !p->kernel_names))
		return kl__plan_fail(err, cap, "missing arrays");
	int32_t nout = 0, maxin = -1, maxout = -1;
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		if ((unsigned)bf->role > KL_BUF_TEMP || (unsigned)bf->dtype >= KL_NDTYPES ||
		    bf->ndim < 0 || bf->ndim > KL_MAX_DIMS)
			return kl__plan_fail(err, cap, "buffer %d: role, dtype or rank out of range", b);
		for (int d = 0; d < bf->ndim; d++)
			if (bf->shape[d].v < 0 || bf->shape[d].sym < 0 ||
			    bf->shape[d].sym > p->nsyms)
				return kl__plan_fail(err, cap, "buffer %d: dim %d out of range", b, d);
		int64_t dims[KL_MAX_DIMS];
		buf_dims(bf, dims);
		kl_shape_err se = kl__shape_check(bf->ndim, dims, NULL);
		if (se != KL_SHAPE_OK) {
			char why[128];
			return kl__plan_fail(err, cap, "buffer %d: %s", b,
			            kl__shape_why(why, sizeof why, se, bf->ndim, dims, -1));
		}
		if (bf->role == KL_BUF_INPUT) {
			if (bf->index < 0 || (ninputs >= 0 && bf->index >= ninputs))
				return kl__plan_fail(err, cap, "buffer %d: input index %d out of range", b,
				            bf->index);
			for (int32_t o = 0; o < b; o++)
				if (p->bufs[o].role == KL_BUF_INPUT &&
				    p->bufs[o].index == bf->index)
					return kl__plan_fail(err, cap, "input %d has two buffers",
					            bf->index);
			maxin = bf->index > maxin ? bf->index : maxin;
		} else if (bf->role == KL_BUF_OUTPUT) {
			if (bf->index < 0 || bf->index >= p->nbufs)
				return kl__plan_fail(err, cap, "buffer %d: output index out of range", b);
			for (int32_t o = 0; o < b; o++)
				if (p->bufs[o].role == KL_BUF_OUTPUT &&
				    p->bufs[o].index == bf->index)
					return kl__plan_fail(err, cap, "output %d has two buffers",
					            bf->index);
			nout++;
			maxout = bf->index > maxout ? bf->index : maxout;
		}
		if (bf->alias != -1) {
			if (bf->role != KL_BUF_OUTPUT || bf->alias < 0 || bf->alias >= p->nbufs ||
			    bf->alias == b || bf->view_offset < 0)
				return kl__plan_fail(err, cap, "buffer %d: alias out of range", b);
			const kl_buf *base = &p->bufs[bf->alias];
			if (!(base->role == KL_BUF_INPUT ||
			      (base->role == KL_BUF_OUTPUT && base->alias == -1)))
				return kl__plan_fail(err, cap, "buffer %d: aliases a temp or another view",
				            b);
			if (base->dtype != bf->dtype)
				return kl__plan_fail(err, cap, "buffer %d: a view of another dtype", b);
			for (int d = 0; d < bf->ndim; d++)
				if (bf->view_strides[d] < 0)
					return kl__plan_fail(err, cap, "buffer %d: negative view stride", b);
		}
	}
	if (maxout != nout - 1 || (noutputs >= 0 && nout != noutputs))
		return kl__plan_fail(err, cap, "outputs are not numbered 0..%d",
		            noutputs >= 0 ? noutputs - 1 : nout - 1);
	(void)maxin;
	for (int32_t k = 0; k < p->nsyms; k++) {
		bool found = false;
		for (int32_t b = 0; b < p->nbufs; b++)
			if (p->bufs[b].role == KL_BUF_INPUT &&
			    p->bufs[b].index == p->sym_input[k] && p->sym_dim[k] >= 0 &&
			    p->sym_dim[k] < p->bufs[b].ndim &&
			    p->bufs[b].shape[p->sym_dim[k]].sym == k + 1)
				found = true;
		if (!found)
			return kl__plan_fail(err, cap, "symbol %d is no dim of an input buffer", k + 1);
	}
	if (p->nsymf < 0 || p->nsymf > MAX_COUNT || (p->nsymf > 0 && !p->symf))
		return kl__plan_fail(err, cap, "symbolic step fields: count %d", (int)p->nsymf);
	for (int32_t i = 0; i < p->nsymf; i++) {
		const kl_symf *f = &p->symf[i];
		if (f->step < 0 || f->step >= p->nsteps ||
		    p->steps[f->step].kind == KL_STEP_KERNEL || f->field < 0 ||
		    f->field >= NFIELDS || f->ns < 0 || f->ns > KL_MAX_DIMS)
			return kl__plan_fail(err, cap, "symbolic step field %d out of range", (int)i);
		for (int j = 0; j < f->ns; j++)
			if (f->s[j] < 1 || f->s[j] > p->nsyms)
				return kl__plan_fail(err, cap, "symbolic step field %d: symbol %d out of range",
				                     (int)i, (int)f->s[j]);
	}
	bool *written = calloc((size_t)(p->nbufs ? p->nbufs : 1), 1);
	if (!written)
		return KL_ENOMEM;
	kl_status st = KL_OK;
	for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++) {
		const kl_step *sp = &p->steps[s];
		if (sp->nreads < 0 || sp->nreads > KL_NODE_MAX_IN * 2 || sp->nwrites < 0 ||
		    sp->nwrites > 2 || sp->nnodes < 0 || sp->nnodes > KL_STEP_MAX_NODES) {
			st = kl__plan_fail(err, cap, "step %d: counts out of range", s);
			break;
		}
		for (int i = 0; i < sp->nreads + sp->nwrites && st == KL_OK; i++) {
			int32_t b = i < sp->nreads ? sp->reads[i] : sp->writes[i - sp->nreads];
			if (b < 0 || b >= p->nbufs)
				st = kl__plan_fail(err, cap, "step %d: buffer %d out of range", s, b);
			else if (i < sp->nreads && p->bufs[b].role == KL_BUF_TEMP && !written[b])
				st = kl__plan_fail(err, cap,
				          "step %d reads temp buffer %d before any step writes it",
				          s, b);
			else if (i >= sp->nreads &&
			         (p->bufs[b].role == KL_BUF_INPUT || p->bufs[b].alias >= 0) &&
			         !(sp->kind == KL_STEP_CACHE_WRITE && b == sp->cw.out &&
			           b == sp->cw.cache)) /* in place: checked below */
				st = kl__plan_fail(err, cap, "step %d writes input or view buffer %d", s, b);
		}
		if (st == KL_OK && sp->inplace) {
			if (sp->kind != KL_STEP_KERNEL || sp->nreads < 1 || sp->nwrites != 1 ||
			    !kl__inplace_bufs(&p->bufs[sp->reads[0]], &p->bufs[sp->writes[0]]))
				st = kl__plan_fail(err, cap,
				                   "step %d: written in place, but not one temp into "
				                   "another of its dtype and shape",
				                   s);
		}
		for (int i = 0; i < sp->nwrites && st == KL_OK; i++)
			written[sp->writes[i]] = true;
		for (int i = 0; i < sp->nnodes && st == KL_OK; i++)
			if (sp->nodes[i] < 0)
				st = kl__plan_fail(err, cap, "step %d: node id out of range", s);
		if (st != KL_OK)
			break;
		if (!isfinite(sp->bytes) || sp->bytes < 0 || !isfinite(sp->flops) ||
		    sp->flops < 0 || !text_ok(sp->what, sizeof sp->what))
			st = kl__plan_fail(err, cap, "step %d: bad cost or description", s);
		else if (sp->kind == KL_STEP_KERNEL) {
			if (sp->kernel < 0 || sp->kernel >= p->nkernels)
				st = kl__plan_fail(err, cap, "step %d: kernel %d out of range", s,
				          sp->kernel);
			else if (sp->row_per < 0 || sp->row_per > 1024 || sp->nrowdims < 0 ||
			         sp->nrowdims > KL_MAX_DIMS || (sp->row_per == 0 && sp->nrowdims > 0))
				st = kl__plan_fail(err, cap, "step %d: row grid of %d rows a block over %d dims", s,
				          sp->row_per, sp->nrowdims);
			else if (sp->waves < 0 || sp->waves > 64 || (sp->row_per == 0) != (sp->waves == 0))
				st = kl__plan_fail(err, cap, "step %d: row grid of %d waves for %d rows a block", s,
				          sp->waves, sp->row_per);
			for (int d = 0; st == KL_OK && d < sp->nrowdims; d++)
				if (sp->rowdims[d].v < 0 || sp->rowdims[d].sym < 0 ||
				    sp->rowdims[d].sym > p->nsyms)
					st = kl__plan_fail(err, cap, "step %d: row dim %d (%lld, symbol %d) out of range",
					          s, d, (long long)sp->rowdims[d].v, sp->rowdims[d].sym);
		} else if (sp->kind == KL_STEP_MATMUL) {
			st = check_matmul(p, s, err, cap);
			if (st == KL_OK)
				written[sp->mm.c] = true;
		} else if (sp->kind == KL_STEP_ATTENTION) {
			st = check_attention(p, s, err, cap);
			if (st == KL_OK)
				written[sp->at.o] = true;
		} else if (sp->kind == KL_STEP_CACHE_WRITE) {
			st = check_cache_write(p, s, err, cap);
			if (st == KL_OK)
				written[sp->cw.out] = true;
		} else
			st = kl__plan_fail(err, cap, "step %d: unknown kind %d", s, (int)sp->kind);
	}
	free(written);
	if (st != KL_OK)
		return st;
	for (int32_t k = 0; k < p->nkernels; k++) {
		if (!name_ok(p->kernel_names[k]))
			return kl__plan_fail(err, cap, "kernel %d: name is not [a-z0-9_]", k);
		for (int32_t o = 0; o < k; o++)
			if (!strcmp(p->kernel_names[o], p->kernel_names[k]))
				return kl__plan_fail(err, cap, "kernel name %s appears twice",
				            p->kernel_names[k]);
	}
	if (p->fusion_log && !text_ok(p->fusion_log, strlen(p->fusion_log) + 1))
		return kl__plan_fail(err, cap, "fusion log is not printable text");
	return KL_OK;
}

/* ---- writer ---------------------------------------------------------------- */

typedef struct wbuf {
	uint8_t *p;
	size_t n, cap;
	bool oom;
} wbuf;

static void w_bytes(wbuf *w, const void *src, size_t n)
{
	if (w->oom || n == 0)
		return;
	if (w->n + n > w->cap) {
		size_t cap = w->cap ? w->cap : 1024;
		while (cap < w->n + n)
			cap *= 2;
		uint8_t *q = realloc(w->p, cap);
		if (!q) {
			w->oom = true;
			return;
		}
		w->p = q;
		w->cap = cap;
	}
	memcpy(w->p + w->n, src, n);
	w->n += n;
}

static void w_u64(wbuf *w, uint64_t v)
{
	uint8_t b[8];
	kl__le_put64(b, v);
	w_bytes(w, b, 8);
}

static void w_i64(wbuf *w, int64_t v)
{
	w_u64(w, (uint64_t)v);
}

static void w_i32(wbuf *w, int32_t v)
{
	uint8_t b[4];
	kl__le_put32(b, (uint32_t)v);
	w_bytes(w, b, 4);
}

static void w_f64(wbuf *w, double v)
{
	uint64_t u;
	memcpy(&u, &v, 8);
	w_u64(w, u);
}

static void w_str(wbuf *w, const char *s)
{
	size_t n = s ? strlen(s) : 0;
	w_i32(w, s ? (int32_t)n : -1);
	w_bytes(w, s, n);
}

kl_status kl__program_serialize(const kl_program *p, uint8_t **out, size_t *len)
{
	wbuf w = {0};
	w_bytes(&w, PROG_MAGIC, 8);
	w_i32(&w, (int32_t)PROG_FORMAT);
	w_i32(&w, p->nbufs);
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		w_i32(&w, (int32_t)bf->role);
		w_i32(&w, bf->index);
		w_i32(&w, (int32_t)bf->dtype);
		w_i32(&w, bf->ndim);
		for (int d = 0; d < bf->ndim; d++) {
			w_i64(&w, bf->shape[d].v);
			w_i32(&w, bf->shape[d].sym);
		}
		w_i32(&w, bf->alias);
		for (int d = 0; d < bf->ndim; d++)
			w_i64(&w, bf->view_strides[d]);
		w_i64(&w, bf->view_offset);
	}
	w_i32(&w, p->nsteps);
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		const kl_matmul_step *mm = &sp->mm;
		w_i32(&w, (int32_t)sp->kind);
		w_i32(&w, sp->kernel);
		w_i32(&w, sp->row_per);
		w_i32(&w, sp->waves);
		w_i32(&w, sp->nrowdims);
		for (int d = 0; d < sp->nrowdims && d < KL_MAX_DIMS; d++) {
			w_i64(&w, sp->rowdims[d].v);
			w_i32(&w, sp->rowdims[d].sym);
		}
		w_i32(&w, mm->a);
		w_i32(&w, mm->b);
		w_i32(&w, mm->c);
		w_i64(&w, mm->m);
		w_i64(&w, mm->n);
		w_i64(&w, mm->k);
		w_i32(&w, mm->nbatch);
		for (int i = 0; i < mm->nbatch && i < KL_MAX_DIMS; i++) {
			w_i64(&w, mm->batch[i]);
			w_i64(&w, mm->a_bstride[i]);
			w_i64(&w, mm->b_bstride[i]);
			w_i64(&w, mm->c_bstride[i]);
		}
		int64_t rest[8] = {mm->a_off, mm->b_off, mm->c_off, mm->a_rs,
		                   mm->a_cs,  mm->b_rs,  mm->b_cs,  mm->ldc};
		for (int i = 0; i < 8; i++)
			w_i64(&w, rest[i]);
		w_f64(&w, mm->alpha);
		w_f64(&w, mm->beta);
		w_i32(&w, mm->has_r);
		w_i32(&w, mm->r);
		w_i64(&w, mm->r_off);
		w_i64(&w, mm->r_ld);
		for (int i = 0; i < mm->nbatch && i < KL_MAX_DIMS; i++)
			w_i64(&w, mm->r_bstride[i]);
		w_i32(&w, mm->has_bias);
		w_i32(&w, mm->bias);
		w_i64(&w, mm->bias_off);
		w_i32(&w, (int32_t)mm->act);
		if (sp->kind == KL_STEP_ATTENTION) {
			const kl_attn_step *a = &sp->at;
			int32_t ids[4] = {a->q, a->k, a->v, a->o};
			for (int i = 0; i < 4; i++)
				w_i32(&w, ids[i]);
			int64_t dims[14] = {a->tq,   a->tk,   a->d,    a->dv,   a->q_off,
			                    a->k_off, a->v_off, a->q_rs, a->q_cs, a->k_rs,
			                    a->k_cs, a->v_rs, a->v_cs, a->o_rs};
			for (int i = 0; i < 14; i++)
				w_i64(&w, dims[i]);
			w_i32(&w, a->nbatch);
			for (int i = 0; i < a->nbatch && i < KL_MAX_DIMS; i++) {
				w_i64(&w, a->batch[i]);
				w_i64(&w, a->q_bs[i]);
				w_i64(&w, a->k_bs[i]);
				w_i64(&w, a->v_bs[i]);
				w_i64(&w, a->o_bs[i]);
			}
			w_f64(&w, a->scale);
			w_i32(&w, a->causal);
			w_i32(&w, a->bwd);
			w_i32(&w, a->fo);
			w_i32(&w, a->go);
			int64_t bd[6] = {a->fo_off, a->go_off, a->fo_rs, a->go_rs, a->fo_cs, a->go_cs};
			for (int i = 0; i < 6; i++)
				w_i64(&w, bd[i]);
			for (int i = 0; i < a->nbatch && i < KL_MAX_DIMS; i++) {
				w_i64(&w, a->fo_bs[i]);
				w_i64(&w, a->go_bs[i]);
			}
			int64_t gd[5] = {a->dq_off, a->dk_off, a->dv_off, a->dk_rs, a->dv_rs};
			for (int i = 0; i < 5; i++)
				w_i64(&w, gd[i]);
			for (int i = 0; i < a->nbatch && i < KL_MAX_DIMS; i++) {
				w_i64(&w, a->dk_bs[i]);
				w_i64(&w, a->dv_bs[i]);
			}
			w_i32(&w, a->len);
			w_i32(&w, a->len_inner);
			w_i32(&w, a->len_dt);
			w_i64(&w, a->len_off);
			w_i64(&w, a->len_st);
		}
		if (sp->kind == KL_STEP_CACHE_WRITE) {
			const kl_cw_step *c = &sp->cw;
			int32_t ids[5] = {c->cache, c->pos, c->val, c->out, c->axis};
			for (int i = 0; i < 5; i++)
				w_i32(&w, ids[i]);
			int64_t dims[8] = {c->rows, c->R,     c->outer,   c->cap,
			                   c->s,    c->inner, c->val_off, c->val_rs};
			for (int i = 0; i < 8; i++)
				w_i64(&w, dims[i]);
		}
		w_i32(&w, sp->nreads);
		for (int i = 0; i < sp->nreads && i < KL_NODE_MAX_IN * 2; i++)
			w_i32(&w, sp->reads[i]);
		w_i32(&w, sp->nwrites);
		for (int i = 0; i < sp->nwrites && i < 2; i++)
			w_i32(&w, sp->writes[i]);
		w_i32(&w, sp->inplace ? 1 : 0);
		w_i32(&w, sp->nnodes);
		for (int i = 0; i < sp->nnodes && i < KL_STEP_MAX_NODES; i++)
			w_i32(&w, sp->nodes[i]);
		w_f64(&w, sp->bytes);
		w_f64(&w, sp->flops);
		w_str(&w, sp->what);
	}
	w_i32(&w, p->nsyms);
	for (int32_t k = 0; k < p->nsyms && k < KL_MAX_DIMS * 4; k++) {
		w_i32(&w, p->sym_input[k]);
		w_i32(&w, p->sym_dim[k]);
	}
	w_i32(&w, p->nsymf);
	for (int32_t i = 0; i < p->nsymf; i++) {
		const kl_symf *f = &p->symf[i];
		w_i32(&w, f->step);
		w_i32(&w, f->field);
		w_i64(&w, f->c);
		w_i32(&w, f->ns);
		for (int j = 0; j < f->ns && j < KL_MAX_DIMS; j++)
			w_i32(&w, f->s[j]);
	}
	w_i32(&w, p->nkernels);
	for (int32_t k = 0; k < p->nkernels; k++)
		w_str(&w, p->kernel_names[k]);
	w_str(&w, p->fusion_log);
	if (w.oom) {
		free(w.p);
		return KL_ENOMEM;
	}
	*out = w.p;
	*len = w.n;
	return KL_OK;
}

/* ---- reader ---------------------------------------------------------------- */

typedef struct rbuf {
	const uint8_t *p;
	size_t n, pos;
	bool bad;
} rbuf;

static bool r_bytes(rbuf *r, void *dst, size_t n)
{
	if (r->bad || n > r->n - r->pos) {
		r->bad = true;
		return false;
	}
	memcpy(dst, r->p + r->pos, n);
	r->pos += n;
	return true;
}

static uint64_t r_u64(rbuf *r)
{
	uint8_t b[8] = {0};
	r_bytes(r, b, 8);
	return kl__le_get64(b);
}

static int64_t r_i64(rbuf *r)
{
	return (int64_t)r_u64(r);
}

static int32_t r_i32(rbuf *r)
{
	uint8_t b[4] = {0};
	r_bytes(r, b, 4);
	return (int32_t)kl__le_get32(b);
}

static double r_f64(rbuf *r)
{
	uint64_t u = r_u64(r);
	double v;
	memcpy(&v, &u, 8);
	return v;
}

/* A string of at most max bytes (-1 length: NULL). */
static char *r_str(rbuf *r, size_t max, bool *null)
{
	int32_t n = r_i32(r);
	*null = n == -1;
	if (r->bad || n == -1)
		return NULL;
	if (n < 0 || (size_t)n > max || (size_t)n > r->n - r->pos) {
		r->bad = true;
		return NULL;
	}
	char *s = malloc((size_t)n + 1);
	if (!s) {
		r->bad = true;
		return NULL;
	}
	memcpy(s, r->p + r->pos, (size_t)n);
	s[n] = '\0';
	if (memchr(s, '\0', (size_t)n)) {
		free(s);
		r->bad = true;
		return NULL;
	}
	r->pos += (size_t)n;
	return s;
}

/* A count that is in range and whose items could fit in what is left. */
static int32_t r_count(rbuf *r, int32_t max, size_t min_item)
{
	int32_t n = r_i32(r);
	if (r->bad || n < 0 || n > max || (size_t)n * min_item > r->n - r->pos) {
		r->bad = true;
		return 0;
	}
	return n;
}

static void clear_program(kl_program *p)
{
	free(p->bufs);
	free(p->steps);
	free(p->symf);
	if (p->kernel_names)
		for (int32_t k = 0; k < p->nkernels; k++)
			free(p->kernel_names[k]);
	free(p->kernel_names);
	free(p->source);
	free(p->fusion_log);
	memset(p, 0, sizeof *p);
}

kl_status kl__program_deserialize(const void *data, size_t len, kl_program *out, char *err,
                                  size_t cap)
{
	memset(out, 0, sizeof *out);
	rbuf r = {data, len, 0, false};
	char magic[8];
	if (!r_bytes(&r, magic, 8) || memcmp(magic, PROG_MAGIC, 8) != 0)
		return kl__plan_fail(err, cap, "not a kiln program");
	uint32_t version = (uint32_t)r_i32(&r);
	if (version != PROG_FORMAT)
		return kl__plan_fail(
		        err, cap, "program format version %u, this build reads version %u%s",
		        version, PROG_FORMAT,
		        version < 3    ? " (written before product epilogues)"
		        : version < 4  ? " (written before row grids)"
		        : version < 5  ? " (written before row kernels' waves)"
		        : version < 6  ? " (written before symbolic library steps)"
		        : version < 7  ? " (written before cache writes)"
		        : version < 8  ? " (written before the attention backward)"
		        : version < 9  ? " (written before attention lengths)"
		        : version < 10 ? " (written before cache writes of value views)"
		        : version < 11 ? " (written before the attention backward's gradient "
		                         "layouts)"
		        : version < 12 ? " (written before kernels written in place)"
		                       : "");
	kl_program p = {0};
	bool null;
	p.nbufs = r_count(&r, MAX_COUNT, 24);
	p.bufs = calloc((size_t)(p.nbufs ? p.nbufs : 1), sizeof *p.bufs);
	if (!p.bufs)
		r.bad = true;
	for (int32_t b = 0; b < p.nbufs && !r.bad; b++) {
		kl_buf *bf = &p.bufs[b];
		bf->role = (kl_buf_role)r_i32(&r);
		bf->index = r_i32(&r);
		bf->dtype = (kl_dtype)r_i32(&r);
		bf->ndim = r_i32(&r);
		if (bf->ndim < 0 || bf->ndim > KL_MAX_DIMS) {
			r.bad = true;
			break;
		}
		for (int d = 0; d < bf->ndim; d++) {
			bf->shape[d].v = r_i64(&r);
			bf->shape[d].sym = r_i32(&r);
		}
		bf->alias = r_i32(&r);
		for (int d = 0; d < bf->ndim; d++)
			bf->view_strides[d] = r_i64(&r);
		bf->view_offset = r_i64(&r);
	}
	p.nsteps = r_count(&r, MAX_COUNT, 64);
	p.steps = calloc((size_t)(p.nsteps ? p.nsteps : 1), sizeof *p.steps);
	if (!p.steps)
		r.bad = true;
	for (int32_t s = 0; s < p.nsteps && !r.bad; s++) {
		kl_step *sp = &p.steps[s];
		kl_matmul_step *mm = &sp->mm;
		sp->kind = (kl_step_kind)r_i32(&r);
		sp->kernel = r_i32(&r);
		sp->row_per = r_i32(&r);
		sp->waves = r_i32(&r);
		sp->nrowdims = r_count(&r, KL_MAX_DIMS, 12);
		for (int d = 0; d < sp->nrowdims; d++) {
			sp->rowdims[d].v = r_i64(&r);
			sp->rowdims[d].sym = r_i32(&r);
		}
		mm->a = r_i32(&r);
		mm->b = r_i32(&r);
		mm->c = r_i32(&r);
		mm->m = r_i64(&r);
		mm->n = r_i64(&r);
		mm->k = r_i64(&r);
		mm->nbatch = r_count(&r, KL_MAX_DIMS - 2, 32);
		for (int i = 0; i < mm->nbatch; i++) {
			mm->batch[i] = r_i64(&r);
			mm->a_bstride[i] = r_i64(&r);
			mm->b_bstride[i] = r_i64(&r);
			mm->c_bstride[i] = r_i64(&r);
		}
		mm->a_off = r_i64(&r);
		mm->b_off = r_i64(&r);
		mm->c_off = r_i64(&r);
		mm->a_rs = r_i64(&r);
		mm->a_cs = r_i64(&r);
		mm->b_rs = r_i64(&r);
		mm->b_cs = r_i64(&r);
		mm->ldc = r_i64(&r);
		mm->alpha = r_f64(&r);
		mm->beta = r_f64(&r);
		int32_t has_r = r_i32(&r);
		mm->r = r_i32(&r);
		mm->r_off = r_i64(&r);
		mm->r_ld = r_i64(&r);
		for (int i = 0; i < mm->nbatch; i++)
			mm->r_bstride[i] = r_i64(&r);
		int32_t has_bias = r_i32(&r);
		mm->bias = r_i32(&r);
		mm->bias_off = r_i64(&r);
		mm->act = (kl_mm_act)r_i32(&r);
		if ((uint32_t)has_r > 1 || (uint32_t)has_bias > 1)
			r.bad = true;
		mm->has_r = has_r == 1;
		mm->has_bias = has_bias == 1;
		if (sp->kind == KL_STEP_ATTENTION) {
			kl_attn_step *a = &sp->at;
			a->q = r_i32(&r);
			a->k = r_i32(&r);
			a->v = r_i32(&r);
			a->o = r_i32(&r);
			int64_t *dims[14] = {&a->tq,   &a->tk,   &a->d,    &a->dv,   &a->q_off,
			                     &a->k_off, &a->v_off, &a->q_rs, &a->q_cs, &a->k_rs,
			                     &a->k_cs, &a->v_rs, &a->v_cs, &a->o_rs};
			for (int i = 0; i < 14; i++)
				*dims[i] = r_i64(&r);
			a->nbatch = r_count(&r, KL_MAX_DIMS - 2, 40);
			for (int i = 0; i < a->nbatch; i++) {
				a->batch[i] = r_i64(&r);
				a->q_bs[i] = r_i64(&r);
				a->k_bs[i] = r_i64(&r);
				a->v_bs[i] = r_i64(&r);
				a->o_bs[i] = r_i64(&r);
			}
			a->scale = r_f64(&r);
			a->causal = r_i32(&r);
			a->bwd = r_i32(&r);
			a->fo = r_i32(&r);
			a->go = r_i32(&r);
			int64_t *bd[6] = {&a->fo_off, &a->go_off, &a->fo_rs, &a->go_rs, &a->fo_cs,
			                  &a->go_cs};
			for (int i = 0; i < 6; i++)
				*bd[i] = r_i64(&r);
			for (int i = 0; i < a->nbatch; i++) {
				a->fo_bs[i] = r_i64(&r);
				a->go_bs[i] = r_i64(&r);
			}
			int64_t *gd[5] = {&a->dq_off, &a->dk_off, &a->dv_off, &a->dk_rs, &a->dv_rs};
			for (int i = 0; i < 5; i++)
				*gd[i] = r_i64(&r);
			for (int i = 0; i < a->nbatch; i++) {
				a->dk_bs[i] = r_i64(&r);
				a->dv_bs[i] = r_i64(&r);
			}
			a->len = r_i32(&r);
			a->len_inner = r_i32(&r);
			a->len_dt = r_i32(&r);
			a->len_off = r_i64(&r);
			a->len_st = r_i64(&r);
		}
		if (sp->kind == KL_STEP_CACHE_WRITE) {
			kl_cw_step *c = &sp->cw;
			int32_t *ids[5] = {&c->cache, &c->pos, &c->val, &c->out, &c->axis};
			for (int i = 0; i < 5; i++)
				*ids[i] = r_i32(&r);
			int64_t *dims[8] = {&c->rows, &c->R,     &c->outer,   &c->cap,
			                    &c->s,    &c->inner, &c->val_off, &c->val_rs};
			for (int i = 0; i < 8; i++)
				*dims[i] = r_i64(&r);
		}
		sp->nreads = r_count(&r, KL_NODE_MAX_IN * 2, 4);
		for (int i = 0; i < sp->nreads; i++)
			sp->reads[i] = r_i32(&r);
		sp->nwrites = r_count(&r, 2, 4);
		for (int i = 0; i < sp->nwrites; i++)
			sp->writes[i] = r_i32(&r);
		int32_t inplace = r_i32(&r);
		if (inplace != 0 && inplace != 1)
			r.bad = true;
		sp->inplace = inplace == 1;
		sp->nnodes = r_count(&r, KL_STEP_MAX_NODES, 4);
		for (int i = 0; i < sp->nnodes; i++)
			sp->nodes[i] = r_i32(&r);
		sp->bytes = r_f64(&r);
		sp->flops = r_f64(&r);
		char *what = r_str(&r, sizeof sp->what - 1, &null);
		if (what)
			memcpy(sp->what, what, strlen(what) + 1);
		else
			r.bad = true;
		free(what);
	}
	p.nsyms = r_count(&r, KL_MAX_DIMS * 4, 8);
	for (int32_t k = 0; k < p.nsyms; k++) {
		p.sym_input[k] = r_i32(&r);
		p.sym_dim[k] = r_i32(&r);
	}
	p.nsymf = r_count(&r, MAX_COUNT, 20);
	if (p.nsymf > 0 && !r.bad && !(p.symf = calloc((size_t)p.nsymf, sizeof *p.symf)))
		r.bad = true;
	for (int32_t i = 0; i < p.nsymf && !r.bad; i++) {
		kl_symf *f = &p.symf[i];
		f->step = r_i32(&r);
		f->field = r_i32(&r);
		f->c = r_i64(&r);
		f->ns = r_count(&r, KL_MAX_DIMS, 4);
		for (int j = 0; j < f->ns; j++) {
			int32_t v = r_i32(&r);
			if (v < 1 || v > KL_MAX_DIMS * 4)
				r.bad = true;
			f->s[j] = (int8_t)(v > 0 && v <= KL_MAX_DIMS * 4 ? v : 0);
		}
	}
	p.nkernels = r_count(&r, MAX_COUNT, 4);
	p.kernel_names = calloc((size_t)(p.nkernels ? p.nkernels : 1), sizeof(char *));
	if (!p.kernel_names)
		r.bad = true;
	for (int32_t k = 0; k < p.nkernels && !r.bad; k++) {
		p.kernel_names[k] = r_str(&r, MAX_NAME, &null);
		if (!p.kernel_names[k])
			r.bad = true;
	}
	if (!r.bad)
		p.fusion_log = r_str(&r, len, &null);
	if (r.bad || r.pos != r.n) {
		clear_program(&p);
		return kl__plan_fail(err, cap, r.bad ? "program truncated or malformed" : "trailing bytes");
	}
	kl_status st = kl__program_validate(&p, -1, -1, err, cap);
	if (st != KL_OK) {
		clear_program(&p);
		return st;
	}
	*out = p;
	return KL_OK;
}
