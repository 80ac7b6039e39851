/* kernel_build.c - one group of graph nodes into the kernel IR of one kernel.
 *
 * Every member is a function of its own index: the builder evaluates the
 * stored members at their canonical index (the kernel's loop variables) and
 * pulls producers in at whatever index the consumer maps to (broadcast,
 * permute, reshape, slice, concat are index arithmetic). Nodes outside the
 * group are loads. A reduction is one accumulator per outer point, so it can
 * only be read at its own row; reading it elsewhere makes the group illegal,
 * which is how the scheduler learns what it may fuse.
 */
#include <stdlib.h>

#include "lower/lower_int.h"

typedef struct memo_e {
	int32_t node;
	int32_t val;
	uint8_t blk;
	int32_t I[KL_MAX_DIMS];
} memo_e;

typedef struct kb {
	kl_lctx *L;
	const kl_group *G;
	kir_kernel *k;
	bool validate;
	int cur; /* block being emitted */
	memo_e *memo;
	int32_t nmemo, capmemo;
	int32_t full[KL_MAX_DIMS];
	int32_t zero;
	int32_t row_ix; /* the index of a point within its row (row-local arrays) */
	char *why;
	size_t cap;
	bool fail;
} kb;

static void kb_fail(kb *b, const char *fmt, ...) KL_PRINTF(2, 3);
static void kb_fail(kb *b, const char *fmt, ...)
{
	if (b->fail)
		return;
	b->fail = true;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(b->why, b->cap, fmt, ap);
	va_end(ap);
}

static const kl_node *nd(const kb *b, int32_t n)
{
	return &b->L->g.nodes[n];
}

static const char *lab(const kb *b, int32_t n, char *buf, size_t cap)
{
	return kl__node_label(b->L, n, buf, cap);
}

/* ---- emitting ------------------------------------------------------------------ */

static uint32_t addr_vars(const kir_kernel *k, const kir_addr *ad)
{
	uint32_t v = k->ixa.ex[ad->ix].vars;
	for (int i = 0; i < ad->ns; i++)
		v |= k->ixa.ex[ad->six[i]].vars;
	return v;
}

static int32_t emit(kb *b, kir_ins in)
{
	if (b->fail)
		return -1;
	kir_kernel *k = b->k;
	bool inner = false;
	int32_t ops[3] = {in.a, in.b, in.c};
	for (int i = 0; i < 3; i++)
		if (ops[i] >= 0)
			inner |= k->ins[ops[i]].inner;
	if (in.opc == KIR_LOAD || in.opc == KIR_STORE || in.opc == KIR_INDEX || in.opc == KIR_IDXLT)
		inner |= (addr_vars(k, &in.ad) & k->rmask) != 0;
	if (in.opc == KIR_ACC)
		inner = true;
	in.inner = inner;
	if (k->rmask == 0)
		in.blk = 0;
	else if (b->cur % 2 == 1)
		in.blk = (uint8_t)(inner ? b->cur : b->cur - 1);
	else if (inner)
		return kb_fail(b, "internal: a value of the reduced loop is needed outside it"), -1;
	else
		in.blk = (uint8_t)b->cur;
	int32_t id = kl__kir_push(k, &in);
	if (id < 0)
		kb_fail(b, "out of memory");
	return id;
}

static kir_ins ins0(kir_opc opc, kl_dtype dt)
{
	kir_ins in;
	memset(&in, 0, sizeof(in));
	in.opc = (uint8_t)opc;
	in.dt = (uint8_t)dt;
	in.a = in.b = in.c = -1;
	in.buf = -1;
	in.acc = -1;
	return in;
}

static int32_t konst(kb *b, kl_dtype dt, double v)
{
	kir_ins in = ins0(KIR_CONST, dt);
	in.k = v;
	return emit(b, in);
}

static bool float_dt(kl_dtype dt)
{
	return dt == KL_F32 || dt == KL_F16 || dt == KL_BF16;
}

/* v as dtype dt's compute type (dt F16/BF16 round explicitly) */
static int32_t want(kb *b, int32_t v, kl_dtype dt)
{
	if (v < 0)
		return -1;
	kl_dtype have = (kl_dtype)b->k->ins[v].dt;
	if (have == dt || (dt == KL_F32 && float_dt(have)))
		return v;
	kir_ins in = ins0(KIR_CAST, dt);
	in.in_dt = (uint8_t)have;
	in.a = v;
	return emit(b, in);
}

static int32_t unary(kb *b, kl_op op, kl_dtype dt, int32_t a)
{
	if (a < 0)
		return -1;
	kir_ins in = ins0(KIR_UNARY, dt);
	in.op = (uint16_t)op;
	in.a = a;
	return emit(b, in);
}

static int32_t binary(kb *b, kl_op op, kl_dtype dt, kl_dtype in_dt, int32_t x, int32_t y)
{
	if (x < 0 || y < 0)
		return -1;
	kir_ins in = ins0(KIR_BINARY, dt);
	in.op = (uint16_t)op;
	in.in_dt = (uint8_t)in_dt;
	in.a = x;
	in.b = y;
	return emit(b, in);
}

static int32_t where(kb *b, kl_dtype dt, int32_t c, int32_t x, int32_t y)
{
	if (c < 0 || x < 0 || y < 0)
		return -1;
	kir_ins in = ins0(KIR_WHERE, dt);
	in.a = c;
	in.b = x;
	in.c = y;
	return emit(b, in);
}

/* ---- memo ----------------------------------------------------------------------- */

static bool visible(int blk, int cur)
{
	return blk % 2 == 0 ? blk <= cur : blk == cur;
}

static int32_t memo_find(kb *b, int32_t node, const int32_t *I)
{
	int nd_ = nd(b, node)->ndim;
	for (int32_t i = b->nmemo - 1; i >= 0; i--) {
		const memo_e *e = &b->memo[i];
		if (e->node == node && !memcmp(e->I, I, sizeof(int32_t) * (size_t)nd_) &&
		    visible(e->blk, b->cur))
			return e->val;
	}
	return -1;
}

static void memo_put(kb *b, int32_t node, const int32_t *I, int32_t val)
{
	if (val < 0)
		return;
	if (b->nmemo == b->capmemo) {
		int32_t cap = b->capmemo ? b->capmemo * 2 : 64;
		memo_e *p = realloc(b->memo, sizeof(*p) * (size_t)cap);
		if (!p) {
			kb_fail(b, "out of memory");
			return;
		}
		b->memo = p;
		b->capmemo = cap;
	}
	memo_e *e = &b->memo[b->nmemo++];
	memset(e, 0, sizeof(*e));
	e->node = node;
	e->val = val;
	e->blk = b->k->ins[val].blk;
	memcpy(e->I, I, sizeof(int32_t) * (size_t)nd(b, node)->ndim);
}

/* ---- canonical indices -------------------------------------------------------- */

static bool dim_eq(const kb *b, int32_t n, int d, int f)
{
	return nd(b, n)->shape[d] == b->G->F[f] && b->L->sym[n * KL_MAX_DIMS + d] == b->G->Fsym[f];
}

static bool full_index(const kb *b, int32_t n, int32_t *I)
{
	const kl_node *x = nd(b, n);
	if (x->ndim != b->G->ndim)
		return false;
	for (int d = 0; d < x->ndim; d++) {
		if (!dim_eq(b, n, d, d))
			return false;
		I[d] = b->full[d];
	}
	return true;
}

/* the index of n's element in the current row (n has the reduced shape) */
static bool outer_index(const kb *b, int32_t n, int32_t *I)
{
	const kl_node *x = nd(b, n);
	const kl_group *G = b->G;
	uint32_t R = G->rmask;
	if (x->ndim == G->ndim) {
		bool ok = true;
		for (int d = 0; d < x->ndim && ok; d++) {
			if (R & (1u << d)) {
				ok = x->shape[d] == 1;
				I[d] = b->zero;
			} else {
				ok = dim_eq(b, n, d, d);
				I[d] = b->full[d];
			}
		}
		if (ok)
			return true;
	}
	if (x->ndim == G->ndim - __builtin_popcount(R)) {
		int j = 0;
		for (int d = 0; d < G->ndim; d++) {
			if (R & (1u << d))
				continue;
			if (!dim_eq(b, n, j, d))
				return false;
			I[j++] = b->full[d];
		}
		return true;
	}
	return false;
}


/* ---- evaluation --------------------------------------------------------------------- */

static int32_t eval(kb *b, int32_t n, const int32_t *I);
static int32_t row_reuse(kb *b, int32_t n, const int32_t *I);

static int32_t load(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	int32_t v = memo_find(b, n, I);
	if (v >= 0)
		return v;
	kl_mono st[KL_MAX_DIMS];
	kl__base_strides(b->L, n, st);
	kir_ins in = ins0(KIR_LOAD, kl__compute_dt((kl_dtype)x->dtype));
	in.in_dt = x->dtype;
	if (!kl__ix_linearize(&b->k->ixa, x->ndim, I, st, &in.ad)) {
		kb_fail(b, "index expression too complex");
		return -1;
	}
	if (!b->validate) {
		in.buf = b->L->bufof[n];
		if (in.buf < 0) {
			char l[64];
			kb_fail(b, "internal: %s is read but has no buffer", lab(b, n, l, sizeof(l)));
			return -1;
		}
	}
	bool seen = false;
	for (int32_t i = 0; i < b->nmemo && !seen; i++)
		seen = b->memo[i].node == n;
	if (!seen)
		b->k->nloads++;
	v = emit(b, in);
	memo_put(b, n, I, v);
	return v;
}

/* index of input x read by pointwise node n at I (numpy broadcasting) */
static void bcast(kb *b, int32_t n, int32_t x, const int32_t *I, int32_t *J)
{
	const kl_node *o = nd(b, n), *in = nd(b, x);
	int off = o->ndim - in->ndim;
	for (int d = 0; d < in->ndim; d++)
		J[d] = in->shape[d] == 1 ? b->zero : I[d + off];
}

static int32_t eval_in(kb *b, int32_t n, int i, const int32_t *I)
{
	int32_t J[KL_MAX_DIMS];
	int32_t x = nd(b, n)->in[i];
	bcast(b, n, x, I, J);
	return eval(b, x, J);
}

static int32_t eval_pointwise(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	kl_op op = (kl_op)x->op;
	kl_dtype D = (kl_dtype)x->dtype;
	kl_dtype cd = kl__compute_dt(D);
	kl_cat cat = kl__ops[op].cat;
	if (cat == KL_CAT_BINARY || cat == KL_CAT_COMPARE) {
		kl_dtype da = (kl_dtype)nd(b, x->in[0])->dtype;
		double s = x->a.s[0];
		kl_dtype od = cd;
		if (cat == KL_CAT_COMPARE && x->a.scalar_rhs) {
			/* a Python number compares exactly (as the reference does) */
			od = (da == KL_I64 && s == floor(s) && fabs(s) < 9.2e18) ? KL_I64 : KL_F64;
		} else if (cat == KL_CAT_COMPARE) {
			kl_dtype db = (kl_dtype)nd(b, x->in[1])->dtype;
			od = kl__compute_dt(kl_promote_types(da, db));
		} else {
			/* arithmetic happens in the result dtype, the scalar rounded to it */
			s = kl__round_to(D, s);
		}
		if (od == KL_BOOL && cat == KL_CAT_BINARY && op != KL_OP_MAXIMUM && op != KL_OP_MINIMUM)
			od = KL_I32; /* bool arithmetic: in int, then != 0 */
		if (od == KL_BOOL && cat == KL_CAT_COMPARE)
			od = KL_I32;
		int32_t va = want(b, eval_in(b, n, 0, I), od);
		int32_t vb = x->a.scalar_rhs ? konst(b, od, s) : want(b, eval_in(b, n, 1, I), od);
		int32_t r = binary(b, op, cat == KL_CAT_COMPARE ? KL_BOOL : od, od, va, vb);
		return want(b, r, cd);
	}
	if (cat == KL_CAT_UNARY || cat == KL_CAT_UNARY_FLOAT) {
		int32_t v = eval_in(b, n, 0, I);
		if (op == KL_OP_CAST)
			return want(b, v, D == KL_F16 || D == KL_BF16 ? D : cd);
		kl_dtype od = cd == KL_BOOL ? KL_I32 : cd;
		if (cat == KL_CAT_UNARY_FLOAT && !kl_dtype_is_float(od))
			od = KL_F32; /* exp of an int tensor typed int: compute in float */
		v = want(b, v, od);
		if (op == KL_OP_CLAMP) {
			for (int s = 0; s < 2; s++) {
				double bound = x->a.s[s];
				if (isinf(bound) || isnan(bound))
					continue;
				int32_t c = konst(b, od, kl__round_to(od, bound)); /* saturated */
				v = binary(b, s == 0 ? KL_OP_MAXIMUM : KL_OP_MINIMUM, od, od, v, c);
			}
			return want(b, v, cd);
		}
		return want(b, unary(b, op, od, v), cd);
	}
	if (cat == KL_CAT_WHERE) {
		int32_t c = want(b, eval_in(b, n, 0, I), KL_BOOL);
		int32_t va = want(b, eval_in(b, n, 1, I), cd);
		int32_t vb = want(b, eval_in(b, n, 2, I), cd);
		return where(b, cd, c, va, vb);
	}
	kb_fail(b, "internal: %s is not pointwise", kl__ops[op].name);
	return -1;
}

static int32_t index_value(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	kl_mono st[KL_MAX_DIMS];
	kl__mono_dense(x->ndim, x->shape, &b->L->sym[n * KL_MAX_DIMS], st);
	kir_ins in = ins0(KIR_INDEX, KL_I64);
	if (!kl__ix_linearize(&b->k->ixa, x->ndim, I, st, &in.ad)) {
		kb_fail(b, "index expression too complex");
		return -1;
	}
	return emit(b, in);
}

static int32_t eval_source(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	kl_dtype cd = kl__compute_dt((kl_dtype)x->dtype);
	switch ((kl_op)x->op) {
	case KL_OP_FULL:
		return konst(b, cd, x->a.s[0]);
	case KL_OP_ARANGE: {
		int32_t i = want(b, index_value(b, n, I), KL_F64);
		int32_t v = binary(b, KL_OP_MUL, KL_F64, KL_F64, i, konst(b, KL_F64, x->a.s[1]));
		v = binary(b, KL_OP_ADD, KL_F64, KL_F64, konst(b, KL_F64, x->a.s[0]), v);
		return want(b, v, cd);
	}
	case KL_OP_RAND:
	case KL_OP_RANDN: {
		int32_t i = index_value(b, n, I);
		if (i < 0)
			return -1;
		kir_ins in = ins0(KIR_RAND, KL_F64);
		in.op = x->op;
		in.seed = x->a.seed;
		in.a = i;
		if (x->nin == 2) { /* keyed at run time: the two 0-dim i32 words */
			in.b = want(b, eval(b, x->in[0], I), KL_I32);
			in.c = want(b, eval(b, x->in[1], I), KL_I32);
			if (in.b < 0 || in.c < 0)
				return -1;
		}
		int32_t v = emit(b, in);
		if (x->dtype != KL_F16 && x->dtype != KL_BF16)
			return want(b, v, cd);
		/* the reference rounds the double once to the 16-bit float (not
		 * through f32), and keeps rand below 1 (kl__rand_uniform_as) */
		v = want(b, v, (kl_dtype)x->dtype);
		if (x->op == KL_OP_RAND)
			v = binary(b, KL_OP_MINIMUM, KL_F32, KL_F32, v,
			           konst(b, KL_F32, x->dtype == KL_F16 ? 1.0 - 0x1p-11 : 1.0 - 0x1p-8));
		return v;
	}
	default:
		kb_fail(b, "internal: %s is not a source", kl__ops[x->op].name);
		return -1;
	}
}

static int32_t eval_concat(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	kl_dtype cd = kl__compute_dt((kl_dtype)x->dtype);
	int ax = x->a.axis;
	int32_t vals[KL_NODE_MAX_IN];
	int64_t ends[KL_NODE_MAX_IN];
	int nv = 0;
	int64_t off = 0;
	for (int i = 0; i < x->nin; i++) {
		int64_t len = nd(b, x->in[i])->shape[ax];
		if (len == 0)
			continue;
		/* every input is read in bounds (clamped); the select keeps the right one */
		int32_t J[KL_MAX_DIMS];
		memcpy(J, I, sizeof(int32_t) * (size_t)x->ndim);
		J[ax] = kl__ix_clamp(&b->k->ixa, kl__ix_addc(&b->k->ixa, I[ax], -off), 0, len - 1);
		if (J[ax] < 0) {
			kb_fail(b, "index expression too complex");
			return -1;
		}
		vals[nv] = want(b, eval(b, x->in[i], J), cd);
		off += len;
		ends[nv++] = off;
	}
	if (nv == 0)
		return konst(b, cd, 0);
	int32_t r = vals[nv - 1];
	for (int k = nv - 2; k >= 0; k--) {
		kir_ins in = ins0(KIR_IDXLT, KL_BOOL);
		in.ad.ix = I[ax];
		in.k = (double)ends[k];
		r = where(b, cd, emit(b, in), vals[k], r);
	}
	return r;
}

/* table[idx[I[0..k-1]], I[k..]]: one load whose row is a value */
static int32_t eval_gather(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	int32_t tn = x->in[0], xn = x->in[1];
	const kl_node *t = nd(b, tn);
	int k = nd(b, xn)->ndim;
	char l[64];
	if (b->L->mem[tn] || (kl__is_view((kl_op)t->op) && !b->L->mat[tn])) {
		kb_fail(b, "the table of %s must be read from memory", lab(b, n, l, sizeof(l)));
		return -1;
	}
	int32_t row = want(b, eval(b, xn, I), KL_I64);
	if (row < 0)
		return -1;
	int32_t J[KL_MAX_DIMS];
	J[0] = b->zero;
	for (int d = 1; d < t->ndim; d++)
		J[d] = I[k + d - 1];
	kl_mono st[KL_MAX_DIMS];
	kl__base_strides(b->L, tn, st);
	kir_ins in = ins0(KIR_LOAD, kl__compute_dt((kl_dtype)t->dtype));
	in.in_dt = t->dtype;
	in.a = row;
	in.gst = st[0];
	int32_t s0 = b->L->sym[tn * KL_MAX_DIMS];
	in.grows = s0 > 0 ? (kl_mono){.c = 1, .ns = 1, .s = {(int8_t)s0}}
	                  : (kl_mono){.c = t->shape[0], .ns = 0};
	if (!kl__ix_linearize(&b->k->ixa, t->ndim, J, st, &in.ad)) {
		kb_fail(b, "index expression too complex");
		return -1;
	}
	if (!b->validate) {
		in.buf = b->L->bufof[tn];
		if (in.buf < 0) {
			kb_fail(b, "internal: %s is read but has no buffer", lab(b, tn, l, sizeof(l)));
			return -1;
		}
	}
	bool seen = false;
	for (int32_t i = 0; i < b->nmemo && !seen; i++)
		seen = b->memo[i].node == tn;
	if (!seen)
		b->k->nloads++;
	return emit(b, in);
}

static int32_t eval_member(kb *b, int32_t n, const int32_t *I)
{
	const kl_node *x = nd(b, n);
	kl_op op = (kl_op)x->op;
	kl_cat cat = kl__ops[op].cat;
	char l[64];
	switch (cat) {
	case KL_CAT_SOURCE:
		return eval_source(b, n, I);
	case KL_CAT_REDUCE: {
		if (x->a.axes == 0) { /* over no axis: the value itself */
			if (op == KL_OP_ARGMAX)
				return konst(b, KL_I64, 0);
			return want(b, eval(b, x->in[0], I), kl__compute_dt((kl_dtype)x->dtype));
		}
		int32_t J[KL_MAX_DIMS];
		if (!outer_index(b, n, J) || memcmp(J, I, sizeof(int32_t) * (size_t)x->ndim)) {
			kb_fail(b, "%s is read at an index other than its own row",
			        lab(b, n, l, sizeof(l)));
			return -1;
		}
		kb_fail(b, "internal: %s is read before its pass", lab(b, n, l, sizeof(l)));
		return -1;
	}
	case KL_CAT_MOVEMENT: {
		if (op == KL_OP_CONCAT)
			return eval_concat(b, n, I);
		if (op == KL_OP_GATHER)
			return eval_gather(b, n, I);
		int32_t J[KL_MAX_DIMS];
		if (!kl__move_index(b->L, &b->k->ixa, n, I, J)) {
			kb_fail(b, "index expression too complex");
			return -1;
		}
		return eval(b, x->in[0], J);
	}
	case KL_CAT_CONTRACT:
	case KL_CAT_COMPOSITE:
		kb_fail(b, "internal: %s cannot be inside a kernel", lab(b, n, l, sizeof(l)));
		return -1;
	default:
		return eval_pointwise(b, n, I);
	}
}

static int32_t eval(kb *b, int32_t n, const int32_t *I)
{
	if (b->fail)
		return -1;
	const kl_node *x = nd(b, n);
	if (!b->L->mem[n]) {
		if (kl__is_view((kl_op)x->op) && !b->L->mat[n]) {
			int32_t J[KL_MAX_DIMS];
			if (!kl__move_index(b->L, &b->k->ixa, n, I, J)) {
				kb_fail(b, "index expression too complex");
				return -1;
			}
			return eval(b, x->in[0], J);
		}
		return load(b, n, I);
	}
	int32_t v = memo_find(b, n, I);
	if (v >= 0)
		return v;
	v = row_reuse(b, n, I);
	if (v >= 0) {
		memo_put(b, n, I, v);
		return v;
	}
	v = eval_member(b, n, I);
	/* a half-precision result is rounded where it is made, as eager does:
	 * fused and unfused kernels then agree with each other and the reference */
	kl_dtype D = (kl_dtype)x->dtype;
	if ((D == KL_F16 || D == KL_BF16) && kl__ops[x->op].cat != KL_CAT_MOVEMENT)
		v = want(b, v, D);
	memo_put(b, n, I, v);
	return v;
}

/* ---- rows kept between passes ------------------------------------------------------ */

/* A value a later pass needs again at the same point of the row: when the
 * row is short (static, at most KIR_ROW_CACHE elements) and the value costs
 * a few ops (an exp, say), the pass that made it keeps it in a row-local
 * array and the later pass reads it back instead of recomputing. */
static void row_cache_init(kb *b)
{
	kir_kernel *k = b->k;
	k->row_n = 0;
	if (!k->rmask)
		return;
	int64_t n = 1;
	int32_t idx = b->zero;
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (!(k->rmask & (1u << d)))
			continue;
		if (k->dims[d].sym > 0 || n * k->dims[d].v > KIR_ROW_CACHE)
			return;
		idx = kl__ix_add(&k->ixa, idx, kl__ix_scale(&k->ixa, b->full[d], n));
		n *= k->dims[d].v;
	}
	k->row_n = n;
	b->row_ix = idx;
}

static int cost(const kir_kernel *k, int32_t v, int blk, int depth)
{
	const kir_ins *in = &k->ins[v];
	if (in->blk != blk || depth > 16)
		return 0;
	int c = 0;
	switch ((kir_opc)in->opc) {
	case KIR_UNARY:
		c = kl__ops[in->op].cat == KL_CAT_UNARY_FLOAT ? 8 : 1;
		break;
	case KIR_BINARY:
		c = in->op == KL_OP_POW ? 8 : in->op == KL_OP_DIV ? 2 : 1;
		break;
	case KIR_CAST:
	case KIR_WHERE:
		c = 1;
		break;
	case KIR_RAND:
		c = 20;
		break;
	default:
		return 0;
	}
	int32_t ops[3] = {in->a, in->b, in->c};
	for (int i = 0; i < 3; i++)
		if (ops[i] >= 0)
			c += cost(k, ops[i], blk, depth + 1);
	return c;
}

/* n at I made in an earlier pass: read it back from a row-local array */
static int32_t row_reuse(kb *b, int32_t n, const int32_t *I)
{
	kir_kernel *k = b->k;
	if (!k->row_n || b->cur % 2 == 0)
		return -1;
	int nd_ = nd(b, n)->ndim;
	int32_t v = -1;
	for (int32_t i = b->nmemo - 1; i >= 0 && v < 0; i--) {
		const memo_e *e = &b->memo[i];
		if (e->node == n && e->blk % 2 == 1 && e->blk < b->cur &&
		    !memcmp(e->I, I, sizeof(int32_t) * (size_t)nd_))
			v = e->val;
	}
	if (v < 0 || cost(k, v, k->ins[v].blk, 0) < 4)
		return -1;
	int32_t loc = -1;
	for (int32_t i = 0; i < k->nins && loc < 0; i++)
		if (k->ins[i].opc == KIR_LSTORE && k->ins[i].a == v)
			loc = k->ins[i].acc;
	if (loc < 0) {
		if (k->nlocal == KIR_MAX_LOCAL)
			return -1;
		loc = k->nlocal++;
		k->local_dt[loc] = k->ins[v].dt;
		kir_ins st = ins0(KIR_LSTORE, (kl_dtype)k->ins[v].dt);
		st.a = v;
		st.acc = loc;
		st.ad.ix = b->row_ix;
		st.blk = k->ins[v].blk;
		st.inner = true;
		if (kl__kir_push(k, &st) < 0)
			return -1;
	}
	kir_ins ld = ins0(KIR_LLOAD, (kl_dtype)k->ins[v].dt);
	ld.acc = loc;
	ld.ad.ix = b->row_ix;
	ld.blk = (uint8_t)b->cur;
	ld.inner = true;
	return kl__kir_push(k, &ld);
}

/* ---- passes -------------------------------------------------------------------- */

/* the pass a value needs: 1 + the deepest reduction it depends on */
static int32_t level(kb *b, int32_t n)
{
	const kl_node *x = nd(b, n);
	if (!b->L->mem[n]) {
		if (kl__is_view((kl_op)x->op) && !b->L->mat[n])
			return level(b, x->in[0]);
		return 0;
	}
	if (b->L->lvl[n] >= 0)
		return b->L->lvl[n];
	int32_t l = 0;
	for (int i = 0; i < x->nin; i++) {
		int32_t li = level(b, x->in[i]);
		l = li > l ? li : l;
	}
	if (kl__is_reduction(x))
		l++;
	b->L->lvl[n] = l;
	return l;
}

static void store(kb *b, int32_t n, const int32_t *I, int32_t v)
{
	const kl_node *x = nd(b, n);
	if (v < 0 || b->validate)
		return;
	kl_mono st[KL_MAX_DIMS];
	kl__mono_dense(x->ndim, x->shape, &b->L->sym[n * KL_MAX_DIMS], st);
	kir_ins in = ins0(KIR_STORE, (kl_dtype)x->dtype);
	in.a = want(b, v, kl__compute_dt((kl_dtype)x->dtype));
	in.buf = b->L->bufof[n];
	if (!kl__ix_linearize(&b->k->ixa, x->ndim, I, st, &in.ad)) {
		kb_fail(b, "index expression too complex");
		return;
	}
	emit(b, in);
}

static void reduce(kb *b, int32_t n, int pass)
{
	const kl_node *x = nd(b, n);
	const kl_node *in = nd(b, x->in[0]);
	char l[64];
	int32_t I[KL_MAX_DIMS];
	if (x->a.axes != b->G->rmask || !full_index(b, x->in[0], I)) {
		kb_fail(b, "%s reduces another space than the kernel's", lab(b, n, l, sizeof(l)));
		return;
	}
	kl_op op = (kl_op)x->op;
	kl_dtype vdt = op == KL_OP_ARGMAX ? kl__compute_dt((kl_dtype)in->dtype)
	                                  : kl__compute_dt((kl_dtype)x->dtype);
	int32_t acc = b->k->nacc++;
	kir_ins ai = ins0(KIR_ACC_INIT, vdt);
	ai.op = (uint16_t)op;
	ai.in_dt = (uint8_t)vdt;
	ai.acc = acc;
	ai.blk = (uint8_t)(2 * pass - 2);
	if (kl__kir_push(b->k, &ai) < 0) {
		kb_fail(b, "out of memory");
		return;
	}
	b->cur = 2 * pass - 1;
	int32_t v = want(b, eval(b, x->in[0], I), vdt);
	int32_t pos = -1;
	if (op == KL_OP_ARGMAX) {
		int ax = __builtin_ctz(x->a.axes);
		kir_ins ii = ins0(KIR_INDEX, KL_I64);
		ii.ad.ix = b->full[ax];
		pos = emit(b, ii);
	}
	kir_ins au = ins0(KIR_ACC, vdt);
	au.op = (uint16_t)op;
	au.in_dt = (uint8_t)vdt;
	au.acc = acc;
	au.a = v;
	au.b = pos;
	emit(b, au);
	b->cur = 2 * pass;
	kir_ins ar = ins0(KIR_ACC_READ, kl__compute_dt((kl_dtype)x->dtype));
	ar.op = (uint16_t)op;
	ar.in_dt = (uint8_t)vdt;
	ar.acc = acc;
	int32_t r = emit(b, ar);
	kl_dtype D = (kl_dtype)x->dtype;
	if (D == KL_F16 || D == KL_BF16)
		r = want(b, r, D);
	int32_t J[KL_MAX_DIMS];
	if (!outer_index(b, n, J)) {
		kb_fail(b, "%s does not have the kernel's row shape", lab(b, n, l, sizeof(l)));
		return;
	}
	memo_put(b, n, J, r);
}

static bool needs_store(const kb *b, int32_t n, uint8_t mem)
{
	if (mem != 1)
		return false;
	return b->validate || b->L->stored[n];
}

static bool build(kb *b)
{
	kl_lctx *L = b->L;
	const kl_group *G = b->G;
	kir_kernel *k = b->k;
	char l[64];
	k->ndim = G->ndim;
	k->rmask = G->rmask;
	for (int d = 0; d < G->ndim; d++) {
		k->dims[d].v = G->F[d];
		k->dims[d].sym = G->Fsym[d];
		k->ixa.var_hi[d] = G->Fsym[d] > 0 ? KL_IX_UNKNOWN : G->F[d] - 1;
	}
	b->zero = kl__ix_const(&k->ixa, 0);
	for (int d = 0; d < G->ndim; d++)
		b->full[d] = (G->F[d] == 1 && G->Fsym[d] == 0) ? b->zero : kl__ix_var(&k->ixa, d);

	/* the passes: reductions of level p accumulate in pass p; a full-shaped
	 * store goes in the first pass after the reductions it reads */
	int32_t P = 0, S = -1;
	for (int32_t i = 0; i < G->nm; i++) {
		int32_t n = G->m[i];
		int32_t lv = level(b, n);
		int32_t I[KL_MAX_DIMS];
		if (kl__is_reduction(nd(b, n)))
			P = lv > P ? lv : P;
		else if (needs_store(b, n, L->mem[n]) && full_index(b, n, I))
			S = lv > S ? lv : S;
	}
	if (G->rmask == 0 && P > 0)
		return kb_fail(b, "internal: a reduction in a pointwise kernel"), false;
	k->npass = G->rmask ? (S + 1 > P ? S + 1 : P) : 0;
	row_cache_init(b);

	for (int p = 1; p <= (G->rmask ? k->npass : 1) && !b->fail; p++) {
		for (int32_t i = 0; i < G->nm && !b->fail; i++) {
			int32_t n = G->m[i];
			if (kl__is_reduction(nd(b, n)) && L->lvl[n] == p)
				reduce(b, n, p);
		}
		b->cur = G->rmask ? 2 * p - 1 : 0;
		for (int32_t i = 0; i < G->nm && !b->fail; i++) {
			int32_t n = G->m[i];
			int32_t I[KL_MAX_DIMS];
			if (!needs_store(b, n, L->mem[n]) || kl__is_reduction(nd(b, n)) ||
			    !full_index(b, n, I) || (G->rmask && L->lvl[n] != p - 1))
				continue;
			store(b, n, I, eval(b, n, I));
		}
	}
	b->cur = G->rmask ? 2 * k->npass : 0;
	for (int32_t i = 0; i < G->nm && !b->fail; i++) {
		int32_t n = G->m[i];
		int32_t I[KL_MAX_DIMS];
		if (!needs_store(b, n, L->mem[n]))
			continue;
		if (!kl__is_reduction(nd(b, n)) && full_index(b, n, I))
			continue;
		if (G->rmask == 0 || !outer_index(b, n, I)) {
			kb_fail(b, "%s has neither the kernel's shape nor its rows' shape",
			        lab(b, n, l, sizeof(l)));
			break;
		}
		store(b, n, I, eval(b, n, I));
	}
	if (!b->fail && k->ixa.failed)
		kb_fail(b, "index expression too complex");
	if (!b->fail && k->nloads > KL_NODE_MAX_IN * 2)
		kb_fail(b, "it would read %d buffers (at most %d)", k->nloads, KL_NODE_MAX_IN * 2);
	if (!b->fail && k->nins > 20000)
		kb_fail(b, "kernel too large (%d instructions)", (int)k->nins);
	return !b->fail;
}

int kl__kbuild_loads(const kir_kernel *k)
{
	return k->nloads;
}

bool kl__kbuild(kl_lctx *L, const kl_group *G, bool validate, kir_kernel *k, char *why, size_t cap)
{
	kb b;
	memset(&b, 0, sizeof(b));
	b.L = L;
	b.G = G;
	b.k = k;
	b.validate = validate;
	b.why = why;
	b.cap = cap;
	kl__kir_init(k);
	for (int32_t i = 0; i < G->nm; i++) {
		L->mem[G->m[i]] = G->copy[i] ? 2 : 1;
		L->lvl[G->m[i]] = -1;
	}
	bool ok = build(&b);
	for (int32_t i = 0; i < G->nm; i++)
		L->mem[G->m[i]] = 0;
	free(b.memo);
	return ok;
}
