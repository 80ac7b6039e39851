/* decompose.c - composites into primitives, before anything else looks at
 * the graph, so that softmax, layer_norm, rms_norm, mean and var fuse
 * exactly like the same math written out by hand.
 *
 * Half-precision composites compute in f32 (cast in, cast out), as torch's
 * decompositions do. Each operand of a matrix product gets a CONTIGUOUS node
 * (and a cast when its dtype differs): a free view unless the scheduler finds
 * that BLAS cannot read the operand's layout, in which case it is the copy.
 */
#include <math.h>
#include <stdlib.h>

#include "graph/optable.h"
#include "lower/lower_int.h"

typedef struct dctx {
	kl_lctx *L;
	int32_t cap_orig;
	int32_t cur; /* source node being decomposed */
	bool oom;
	int32_t *map; /* source node -> new node, for the source nodes before cur */
	bool relaying; /* inside relayout(): its own nodes are not looked at */
} dctx;

static void relayout(dctx *d, int32_t c);

static int32_t add(dctx *d, const kl_node *n)
{
	if (d->oom)
		return -1;
	kl_lctx *L = d->L;
	if (L->g.n == d->cap_orig) {
		int32_t cap = d->cap_orig ? d->cap_orig * 2 : 64;
		int32_t *p = realloc(L->orig, sizeof(*p) * (size_t)cap);
		if (!p) {
			d->oom = true;
			return -1;
		}
		L->orig = p;
		d->cap_orig = cap;
	}
	int32_t id = kl__graph_add(&L->g, n);
	if (id < 0) {
		d->oom = true;
		return -1;
	}
	L->orig[id] = d->cur;
	if (n->op == KL_OP_CONTIGUOUS && d->map && !d->relaying)
		relayout(d, id);
	return id;
}

static const kl_node *nd(dctx *d, int32_t n)
{
	return &d->L->g.nodes[n];
}

static kl_node mk(kl_op op, kl_dtype dt, int ndim, const int64_t *shape, int nin)
{
	kl_node n;
	memset(&n, 0, sizeof(n));
	n.op = (uint16_t)op;
	n.dtype = (uint8_t)dt;
	n.ndim = (uint8_t)ndim;
	n.nin = (uint8_t)nin;
	for (int i = 0; i < ndim; i++)
		n.shape[i] = shape[i];
	return n;
}

static int32_t cast(dctx *d, int32_t x, kl_dtype dt)
{
	if (x < 0 || nd(d, x)->dtype == dt)
		return x;
	kl_node n = mk(KL_OP_CAST, dt, nd(d, x)->ndim, nd(d, x)->shape, 1);
	n.in[0] = x;
	return add(d, &n);
}

static int32_t un(dctx *d, kl_op op, int32_t x)
{
	if (x < 0)
		return -1;
	kl_node n = mk(op, (kl_dtype)nd(d, x)->dtype, nd(d, x)->ndim, nd(d, x)->shape, 1);
	n.in[0] = x;
	return add(d, &n);
}

static int32_t bin(dctx *d, kl_op op, int32_t x, int32_t y)
{
	if (x < 0 || y < 0)
		return -1;
	const kl_node *a = nd(d, x), *b = nd(d, y);
	int ndim;
	int64_t shape[KL_MAX_DIMS];
	if (!kl__broadcast(a->ndim, a->shape, b->ndim, b->shape, &ndim, shape)) {
		d->oom = true; /* cannot happen for well-formed composites */
		return -1;
	}
	kl_node n = mk(op, kl_promote_types((kl_dtype)a->dtype, (kl_dtype)b->dtype), ndim, shape, 2);
	n.in[0] = x;
	n.in[1] = y;
	return add(d, &n);
}

static int32_t bin_s(dctx *d, kl_op op, int32_t x, double s)
{
	if (x < 0)
		return -1;
	kl_node n = mk(op, (kl_dtype)nd(d, x)->dtype, nd(d, x)->ndim, nd(d, x)->shape, 1);
	n.in[0] = x;
	n.a.scalar_rhs = 1;
	n.a.s[0] = s;
	return add(d, &n);
}

static int32_t red(dctx *d, kl_op op, int32_t x, uint32_t axes, bool keepdim)
{
	if (x < 0)
		return -1;
	const kl_node *a = nd(d, x);
	int64_t shape[KL_MAX_DIMS];
	int ndim = 0;
	for (int i = 0; i < a->ndim; i++) {
		if (!(axes & (1u << i)))
			shape[ndim++] = a->shape[i];
		else if (keepdim)
			shape[ndim++] = 1;
	}
	kl_node n = mk(op, (kl_dtype)a->dtype, ndim, shape, 1);
	n.in[0] = x;
	n.a.axes = axes;
	n.a.keepdim = keepdim;
	return add(d, &n);
}

static double count(const kl_node *x, uint32_t axes)
{
	double c = 1;
	for (int i = 0; i < x->ndim; i++)
		if (axes & (1u << i))
			c *= (double)x->shape[i];
	return c;
}

/* the dtype a composite over dtype dt computes in */
static kl_dtype work_dt(kl_dtype dt)
{
	return (dt == KL_F16 || dt == KL_BF16 || !kl_dtype_is_float(dt)) ? KL_F32 : dt;
}

static int32_t view(dctx *d, kl_op op, int32_t x, int ndim, const int64_t *shape);

/* any dim of the source node being decomposed, or of its first input,
 * dynamic (the runtime binds its size per call) */
static bool sym_node(dctx *d, const kl_node *s)
{
	const int32_t *sym = d->L->src_sym;
	if (!sym)
		return false;
	int32_t ids[2] = {d->cur, s->nin > 0 ? s->in[0] : d->cur};
	for (int i = 0; i < 2; i++)
		for (int k = 0; k < KL_MAX_DIMS; k++)
			if (sym[ids[i] * KL_MAX_DIMS + k] > 0)
				return true;
	return false;
}

/* A float sum over every element of a large tensor (a loss's mean, a
 * gradient norm) as partial sums of nb rows, then their sum: as one row it
 * is one block of a CUDA kernel (one SM for 8M elements: a 25 ms training
 * step spent most of its time there) and one thread of the generated C.
 * nb is the largest power of two from 256 down to 16 that divides the
 * count into rows at least 1024 long; the partials are in x's dtype, which callers make f32 or f64.
 * -2: not such a sum (the caller reduces as usual). */
static int64_t split_rows(dctx *d, const kl_node *src, const kl_node *a, uint32_t axes)
{
	if (sym_node(d, src) || a->ndim == 0 || axes != (1u << a->ndim) - 1)
		return 0;
	int64_t n = kl__numel(a->ndim, a->shape);
	for (int64_t nb = 256; nb >= 16; nb /= 2)
		if (n % nb == 0 && n / nb >= 1024)
			return nb;
	return 0;
}

static int32_t split_sum(dctx *d, const kl_node *src, int32_t x, uint32_t axes, bool keepdim)
{
	if (x < 0)
		return -1;
	int64_t nb = split_rows(d, src, nd(d, x), axes);
	const kl_node *a = nd(d, x);
	kl_dtype dt = (kl_dtype)a->dtype;
	if (nb == 0 || (dt != KL_F32 && dt != KL_F64))
		return -2;
	int64_t n = kl__numel(a->ndim, a->shape);
	int ndim = a->ndim;
	int64_t rows[2] = {nb, n / nb}, ones[KL_MAX_DIMS];
	for (int i = 0; i < ndim; i++)
		ones[i] = 1;
	kl_node c = mk(KL_OP_CONTIGUOUS, dt, ndim, a->shape, 1);
	c.in[0] = x;
	int32_t r = view(d, KL_OP_RESHAPE, add(d, &c), 2, rows);
	int32_t part = red(d, KL_OP_SUM, r, 1u << 1, false);
	int32_t t = red(d, KL_OP_SUM, part, 1u << 0, false);
	return keepdim ? view(d, KL_OP_RESHAPE, t, ndim, ones) : t;
}

/* A float sum over the leading dims of x (a bias gradient: dY [B, T, N]
 * summed to [N]) on CUDA, as partial sums of COL_ROWS rows, then their
 * sum: [R, C] -> [R / COL_ROWS, COL_ROWS, C] -> [R / COL_ROWS, C] -> [C].
 * The first is a column kernel (render_cuda_rows.c: a thread per output,
 * a warp reading a row's neighbouring elements, coalesced) with R / 32 times
 * the outputs to spread over the device; a sum over rows read as whole
 * columns by a group of threads each (G lanes G rows apart) reads a sector
 * per lane. Partials in x's dtype, which the caller makes f32 for
 * f16/bf16. */
#define COL_ROWS 32
#define COL_MIN_PARTIALS 8192
/* the count of leading reduced dims of a (0: not such a sum) */
static int column_dims(dctx *d, const kl_node *src, const kl_node *a, uint32_t axes)
{
	kl_lctx *L = d->L;
	if (L->o->target != KL_TARGET_CUDA || !L->o->fusion || sym_node(d, src))
		return 0;
	int nd0 = a->ndim, j = 0;
	while (j < nd0 && (axes & (1u << j)))
		j++;
	/* the reduced dims lead, at least one dim is kept */
	if (j == 0 || j == nd0 || (axes >> j) != 0)
		return 0;
	int64_t R = kl__numel(j, a->shape), C = kl__numel(nd0 - j, a->shape + j);
	if (R % COL_ROWS || R / COL_ROWS < 2 || (R / COL_ROWS) * C < COL_MIN_PARTIALS)
		return 0;
	return j;
}

static int32_t column_sum(dctx *d, int j, int32_t x, bool keepdim)
{
	if (x < 0)
		return -1;
	const kl_node *a = nd(d, x);
	int nd0 = a->ndim;
	int64_t out[KL_MAX_DIMS], R = kl__numel(j, a->shape), C = kl__numel(nd0 - j, a->shape + j);
	int no = 0;
	for (int i = 0; i < nd0; i++)
		if (i >= j)
			out[no++] = a->shape[i];
		else if (keepdim)
			out[no++] = 1;
	int64_t sh3[3] = {R / COL_ROWS, COL_ROWS, C};
	int32_t part = red(d, KL_OP_SUM, view(d, KL_OP_RESHAPE, x, 3, sh3), 1u << 1, false);
	return view(d, KL_OP_RESHAPE, red(d, KL_OP_SUM, part, 1u << 0, false), no, out);
}

static int32_t mean(dctx *d, int32_t x, uint32_t axes, bool keepdim)
{
	int32_t s = red(d, KL_OP_SUM, x, axes, keepdim);
	return bin_s(d, KL_OP_MUL, s, 1.0 / count(nd(d, x), axes));
}

/* mean for a MEAN node src: a whole-tensor one split as split_sum says */
static int32_t mean_of(dctx *d, const kl_node *src, int32_t x, uint32_t axes, bool keepdim)
{
	int32_t s = split_sum(d, src, x, axes, keepdim);
	if (s == -2)
		return mean(d, x, axes, keepdim);
	return bin_s(d, KL_OP_MUL, s, 1.0 / count(nd(d, x), axes));
}

/* The built-in norms' rows scaled so that their statistics cannot overflow:
 * *sc = min(1, T / max|x|) per row (keepdim), x * sc returned. A row whose
 * magnitudes stay within T (2^40 in f32, 2^480 in f64) has sc exactly 1, so
 * its values are those of the unscaled formula; above T, (x - mean)^2
 * summed over the row would overflow the compute type (3e38 in f32 squares
 * to inf, and the norm came out 0), while x * sc stays within T and the
 * norm, invariant under scaling (eps scaled by sc^2), is right. A cap at
 * the largest finite value keeps an inf in the row from making sc 0 (the
 * row then gives what the unscaled formula gives); a NaN stays a NaN. The
 * cost is one max reduction per row, fused into the row kernel. Norms
 * written out from primitives are left alone: x * x overflows in them as it
 * does in PyTorch. */
static int32_t norm_scaled(dctx *d, int32_t x, uint32_t ax, int32_t *sc)
{
	bool f64 = x >= 0 && nd(d, x)->dtype == KL_F64;
	int32_t m = red(d, KL_OP_MAX, un(d, KL_OP_ABS, x), ax, true);
	m = bin_s(d, KL_OP_MINIMUM, m, f64 ? 0x1.fffffffffffffp+1023 : 0x1.fffffep+127);
	if (m < 0) {
		*sc = -1;
		return -1;
	}
	kl_node t = mk(KL_OP_FULL, (kl_dtype)nd(d, m)->dtype, nd(d, m)->ndim, nd(d, m)->shape, 0);
	t.a.s[0] = f64 ? 0x1p480 : 0x1p40;
	*sc = bin_s(d, KL_OP_MINIMUM, bin(d, KL_OP_DIV, add(d, &t), m), 1.0);
	return bin(d, KL_OP_MUL, x, *sc);
}

/* a product with a dynamic dim (a library step whose sizes the runtime
 * binds per call) */
static bool sym_product(dctx *d, const kl_node *s)
{
	const int32_t *sym = d->L->src_sym;
	if (!sym)
		return false;
	int32_t ids[3] = {d->cur, s->in[0], s->in[1]};
	for (int i = 0; i < 3; i++)
		for (int k = 0; k < KL_MAX_DIMS; k++)
			if (sym[ids[i] * KL_MAX_DIMS + k] > 0)
				return true;
	return false;
}

static int32_t view(dctx *d, kl_op op, int32_t x, int ndim, const int64_t *shape)
{
	if (x < 0)
		return -1;
	kl_node n = mk(op, (kl_dtype)nd(d, x)->dtype, ndim, shape, 1);
	n.in[0] = x;
	return add(d, &n);
}

/* The attention's output in another layout. When a dense copy c reads an
 * attention's output a through one permutation p that keeps the last dim
 * (then reshapes), the attention step can write its output in c's layout
 * (fuse.c, kl__attention_layout) and no kernel copies it, but only while c's
 * chain is a's one reader. A training graph reads a again (the backward's O,
 * the out-projection's weight gradient): every later reader of a, of p or of
 * a node of the chain reads it from c instead, through views (the source
 * nodes before cur that map to them are pointed at the views), and c is
 * stored when one of them is read (L->relay), so that the forward writes one buffer in the layout its
 * product wants, the backward reads it with strides, and neither a copy nor
 * a second buffer is made. The first such copy of a is the one. */
static void relayout(dctx *d, int32_t c)
{
	kl_lctx *L = d->L;
	int32_t chain[KL_MAX_DIMS * 2], nc = 0, v = nd(d, c)->in[0];
	while ((nd(d, v)->op == KL_OP_RESHAPE || nd(d, v)->op == KL_OP_CONTIGUOUS) &&
	       nc < (int)(sizeof chain / sizeof chain[0])) {
		chain[nc++] = v;
		v = nd(d, v)->in[0];
	}
	const kl_node *p = nd(d, v);
	if (p->op != KL_OP_PERMUTE || nd(d, p->in[0])->op != KL_OP_ATTENTION)
		return;
	int32_t pv = v, a = p->in[0];
	const kl_node *an = nd(d, a);
	int r = an->ndim;
	if (p->ndim != r || p->a.v[r - 1] != r - 1 || nd(d, c)->dtype != an->dtype)
		return;
	for (int32_t i = 0; i < L->nrelay; i++)
		if (L->relay[4 * i] == a)
			return;
	if (L->nrelay == L->cap_relay) {
		int32_t cap = L->cap_relay ? 2 * L->cap_relay : 8;
		int32_t *q = realloc(L->relay, sizeof(int32_t) * 4 * (size_t)cap);
		if (!q) {
			d->oom = true;
			return;
		}
		L->relay = q;
		L->cap_relay = cap;
	}
	d->relaying = true;
	int32_t lo = L->g.n;
	/* p's value is c's elements in row-major order; a's is that permuted back */
	int32_t vp = view(d, KL_OP_RESHAPE, c, p->ndim, nd(d, pv)->shape);
	kl_node q = mk(KL_OP_PERMUTE, (kl_dtype)an->dtype, r, an->shape, 1);
	for (int i = 0; i < r; i++)
		q.a.v[nd(d, pv)->a.v[i]] = i;
	q.in[0] = vp;
	int32_t va = add(d, &q);
	int32_t vc[KL_MAX_DIMS * 2];
	for (int i = 0; i < nc; i++)
		vc[i] = view(d, KL_OP_RESHAPE, c, nd(d, chain[i])->ndim, nd(d, chain[i])->shape);
	d->relaying = false;
	if (d->oom)
		return;
	int32_t *e = &L->relay[4 * L->nrelay++];
	e[0] = a;
	e[1] = c;
	e[2] = lo;
	e[3] = L->g.n - 1;
	for (int32_t k = 0; k < d->cur; k++) {
		int32_t m = d->map[k];
		if (m == a)
			d->map[k] = va;
		else if (m == pv)
			d->map[k] = vp;
		for (int i = 0; i < nc; i++)
			if (m == chain[i])
				d->map[k] = vc[i];
	}
}

/* A slice that is exactly one part of a concatenation along its axis (a
 * packed parameter's gradient, the concatenation of its blocks' gradients,
 * sliced back into the blocks for the optimizer): that part, -1 when s is no
 * such slice. Nothing copies the part out of a concatenated buffer, and the
 * concatenation is made only where something else reads it. */
static int32_t slice_of_concat(dctx *d, const kl_node *s, int32_t x)
{
	if (s->op != KL_OP_SLICE || s->a.v[2] != 1 || x < 0)
		return -1;
	int ax = s->a.axis;
	int64_t lo = s->a.v[0], hi = s->a.v[1];
	for (;;) {
		const kl_node *c = nd(d, x);
		if (c->op != KL_OP_CONCAT || c->a.axis != ax)
			return -1;
		int64_t pos = 0;
		int32_t next = -1;
		for (int j = 0; j < c->nin && next < 0; j++) {
			const kl_node *p = nd(d, c->in[j]);
			int64_t w = p->shape[ax];
			if (pos == lo && pos + w == hi && p->dtype == s->dtype)
				return c->in[j];
			if (lo >= pos && hi <= pos + w && p->op == KL_OP_CONCAT) {
				/* inside a nested concatenation (a chain of them) */
				next = c->in[j];
				lo -= pos;
				hi -= pos;
			}
			pos += w;
		}
		if (next < 0)
			return -1;
		x = next;
	}
}

/* x with its last two dims swapped (a view) */
static int32_t transpose_last(dctx *d, int32_t x)
{
	if (x < 0)
		return -1;
	const kl_node *n = nd(d, x);
	int k = n->ndim;
	kl_node p = mk(KL_OP_PERMUTE, (kl_dtype)n->dtype, k, n->shape, 1);
	for (int i = 0; i < k; i++)
		p.a.v[i] = i;
	p.a.v[k - 2] = k - 1;
	p.a.v[k - 1] = k - 2;
	p.shape[k - 2] = n->shape[k - 1];
	p.shape[k - 1] = n->shape[k - 2];
	p.in[0] = x;
	return add(d, &p);
}

static int32_t product(dctx *d, const kl_node *s, const int32_t *in)
{
	kl_dtype D = (kl_dtype)s->dtype;
	/* f16/bf16 products and sums in f32, rounded once at the end, as a
	 * library product accumulates */
	kl_dtype C = D == KL_F16 || D == KL_BF16 ? KL_F32 : D;
	int k = s->ndim; /* [..., m, n] */
	int64_t full[KL_MAX_DIMS], sh[KL_MAX_DIMS];
	memcpy(full, s->shape, sizeof(int64_t) * (size_t)k);
	int64_t kk = nd(d, in[0])->shape[k - 1];
	full[k] = kk;
	/* a: [..., m, k] -> [..., m, 1, k] -> [..., m, n, k] */
	int32_t a = cast(d, in[0], C);
	memcpy(sh, full, sizeof(sh));
	sh[k - 1] = 1;
	a = view(d, KL_OP_EXPAND, view(d, KL_OP_RESHAPE, a, k + 1, sh), k + 1, full);
	/* b: [..., k, n] -> [..., n, k] -> [..., 1, n, k] -> [..., m, n, k] */
	int32_t b = transpose_last(d, cast(d, in[1], C));
	if (b < 0 || a < 0)
		return -1;
	memcpy(sh, full, sizeof(sh));
	sh[k - 2] = 1;
	b = view(d, KL_OP_EXPAND, view(d, KL_OP_RESHAPE, b, k + 1, sh), k + 1, full);
	return cast(d, red(d, KL_OP_SUM, bin(d, KL_OP_MUL, a, b), 1u << k, false), D);
}

static int32_t decompose_one(dctx *d, const kl_node *s, const int32_t *in);

bool kl__skinny_product(const kl_lctx *L, kl_dtype D, int64_t rows, int64_t n, int64_t k)
{
	return L->o->target == KL_TARGET_CUDA && L->o->fusion &&
	       (D == KL_F32 || D == KL_F16 || D == KL_BF16) && rows <= 16 && n * k >= 65536;
}

/* The run of products that merge.c merged, first product lead: one product
 * over the wider weight slice, and a column slice of it for each product
 * (pre[j], which map[j] becomes when j's turn comes). */
static bool merged(dctx *d, int32_t lead, const int32_t *map, int32_t *pre)
{
	kl_lctx *L = d->L;
	const kl_graph *g = L->src;
	const kl_node *s = &g->nodes[lead];
	int64_t start = L->mspan[2 * lead], stop = L->mspan[2 * lead + 1], N = stop - start;
	/* the lead's weight chain, as merge.c read it: expand?(permute?(slice)) */
	const kl_node *ex = NULL, *pm = NULL, *sl = &g->nodes[s->in[1]];
	if (sl->op == KL_OP_EXPAND) {
		ex = sl;
		sl = &g->nodes[sl->in[0]];
	}
	if (sl->op == KL_OP_PERMUTE) {
		pm = sl;
		sl = &g->nodes[sl->in[0]];
	}
	int32_t base = map[sl->in[0]];
	kl_node n = mk(KL_OP_SLICE, (kl_dtype)sl->dtype, 2, sl->shape, 1);
	n.shape[sl->a.axis] = N;
	n.a.axis = sl->a.axis;
	n.a.v[0] = start;
	n.a.v[1] = stop;
	n.a.v[2] = 1;
	n.in[0] = base;
	int32_t b = add(d, &n);
	if (pm && b >= 0) {
		n = *pm;
		n.shape[1] = N;
		n.in[0] = b;
		b = add(d, &n);
	}
	if (ex && b >= 0) {
		n = *ex;
		n.shape[n.ndim - 1] = N;
		n.in[0] = b;
		b = add(d, &n);
	}
	if (b < 0)
		return false;
	kl_node m = *s;
	m.shape[m.ndim - 1] = N;
	int32_t in[2] = {map[s->in[0]], b};
	int32_t p = decompose_one(d, &m, in);
	if (p < 0)
		return false;
	for (int32_t j = lead; j < g->n; j++) {
		if (L->mlead[j] != lead)
			continue;
		const kl_node *t = &g->nodes[j];
		d->cur = j;
		kl_node c = mk(KL_OP_SLICE, (kl_dtype)t->dtype, t->ndim, t->shape, 1);
		c.a.axis = t->ndim - 1;
		c.a.v[0] = L->mcol[j];
		c.a.v[1] = L->mcol[j] + t->shape[t->ndim - 1];
		c.a.v[2] = 1;
		c.in[0] = p;
		pre[j] = add(d, &c);
		if (pre[j] < 0)
			return false;
	}
	d->cur = lead;
	return true;
}

/* a product of lowered a and b through the MATMUL rules (src ids for the
 * dynamic-dim check) */
static int32_t product_of(dctx *d, int32_t a, int32_t b, int32_t sa, int32_t sb)
{
	if (a < 0 || b < 0)
		return -1;
	const kl_node *x = nd(d, a), *y = nd(d, b);
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, x->shape, sizeof(shape));
	shape[x->ndim - 1] = y->shape[y->ndim - 1];
	kl_node m = mk(KL_OP_MATMUL, (kl_dtype)x->dtype, x->ndim, shape, 2);
	m.in[0] = sa;
	m.in[1] = sb;
	int32_t in[2] = {a, b};
	return decompose_one(d, &m, in);
}

/* ---- a batch of products summed: one product ---------------------------------------- */

/* A src node's users: how many read it (an output counts), and the last. */
typedef struct users {
	int32_t *n, *last;
} users;

static bool src_sym_any(const kl_lctx *L, const int32_t *ids, int nid)
{
	if (!L->src_sym)
		return false;
	for (int i = 0; i < nid; i++)
		for (int k = 0; k < KL_MAX_DIMS; k++)
			if (L->src_sym[ids[i] * KL_MAX_DIMS + k] > 0)
				return true;
	return false;
}

/* The weight gradient of a linear layer over a batch, dW = sum_b X_b^T dY_b
 * (the sum the weight's expand adds to a batched product), costs a product
 * with b partials of W's size and a reduction over them. The same sum is
 * ONE product whose inner dim runs over the batch as well:
 *   sum_b A_b @ B_b = A' @ B',  A' = [m, (b.., k)] (A's batch dims moved
 *   next to k), B' = [(b.., k), n]   (views: A' is X read as [m, B*T] for
 *   a contiguous X)
 * accumulated in the library's f32, never rounded per partial. When the sum
 * goes on through reshapes dropping unit dims into a swap of its two dims
 * (a linear's W^T: the gradient wanted is [n, m]), the product is computed
 * swapped, B'^T @ A'^T, and that swap (*tail) takes it as it is: no
 * transpose copy. s is a SUM over batch dims of a product read by it
 * alone; returns the new node of s (-2: not such a sum). */
static int32_t batch_sum_product(dctx *d, int32_t si, const int32_t *map, const users *u,
                                 int32_t *tail, int32_t *tail_node)
{
	kl_lctx *L = d->L;
	const kl_graph *g = L->src;
	const kl_node *s = &g->nodes[si];
	*tail = *tail_node = -1;
	if (s->op != KL_OP_SUM || !kl_dtype_is_float((kl_dtype)s->dtype) || s->nin != 1)
		return -2;
	int32_t mi = s->in[0];
	const kl_node *mm = &g->nodes[mi];
	int r = mm->ndim;
	if (mm->op != KL_OP_MATMUL || r < 3 || u->n[mi] != 1 || mm->dtype != s->dtype ||
	    (L->mlead && L->mlead[mi] >= 0) || (L->am && L->am[mi].q >= 0))
		return -2;
	/* the axes: batch dims only, every one of size > 1 among them */
	uint32_t bat = (1u << (r - 2)) - 1, big = 0;
	for (int i = 0; i < r - 2; i++)
		if (mm->shape[i] != 1)
			big |= 1u << i;
	if ((s->a.axes & ~bat) || !big || (big & ~s->a.axes))
		return -2;
	int32_t ids[4] = {si, mi, mm->in[0], mm->in[1]};
	if (src_sym_any(L, ids, 4))
		return -2;
	int32_t a = map[mm->in[0]], b = map[mm->in[1]];
	if (a < 0 || b < 0)
		return -1;
	int64_t m = mm->shape[r - 2], n = mm->shape[r - 1], k = nd(d, a)->shape[r - 1];
	int64_t bk = kl__numel(r - 2, mm->shape) * k;
	/* A [b.., m, k] -> [m, b.., k] -> [m, bk];  B [b.., k, n] -> [bk, n] */
	kl_node p = mk(KL_OP_PERMUTE, (kl_dtype)nd(d, a)->dtype, r, nd(d, a)->shape, 1);
	p.a.v[0] = r - 2;
	p.shape[0] = m;
	for (int i = 0; i < r - 2; i++) {
		p.a.v[i + 1] = i;
		p.shape[i + 1] = mm->shape[i];
	}
	p.a.v[r - 1] = r - 1;
	p.shape[r - 1] = k;
	p.in[0] = a;
	int32_t saved = d->cur;
	d->cur = mi; /* the product is the src product's, for explain */
	int32_t a2 = view(d, KL_OP_RESHAPE, add(d, &p), 2, (int64_t[]){m, bk});
	int32_t b2 = view(d, KL_OP_RESHAPE, b, 2, (int64_t[]){bk, n});
	/* the users after s: reshapes (unit dims only) into a 2-D swap */
	int32_t t = si;
	while (u->n[t] == 1 && u->last[t] >= 0) {
		const kl_node *x = &g->nodes[u->last[t]];
		if (x->op == KL_OP_RESHAPE && kl__numel(x->ndim, x->shape) == m * n) {
			t = u->last[t];
			continue;
		}
		if (x->op == KL_OP_PERMUTE && x->ndim == 2 && x->a.v[0] == 1 && x->shape[0] == n &&
		    x->shape[1] == m)
			*tail_node = u->last[t];
		break;
	}
	int32_t prod;
	if (*tail_node >= 0) {
		prod = product_of(d, transpose_last(d, b2), transpose_last(d, a2), mm->in[1],
		                  mm->in[0]);
		*tail = prod;
		prod = transpose_last(d, prod);
	} else {
		prod = product_of(d, a2, b2, mm->in[0], mm->in[1]);
	}
	d->cur = saved;
	return view(d, KL_OP_RESHAPE, prod, s->ndim, s->shape);
}

/* sdpa: one ATTENTION node whose operands are dense-row views (CONTIGUOUS:
 * a copy only when the scheduler finds the layout unreadable), or, when the
 * target lacks the step or the CUDA kernels do not cover its head dim, the
 * same math in primitives (dynamic dims stay dynamic either way: the step
 * binds its sizes per call, and symbolic.c keeps a causal mask's sequence
 * dims static where the mask must be built):
 * softmax(where(causal, q k^T * scale, -inf)) v. With lengths (graph/ops.def)
 * the mask is key j < lengths[b] (and j + tq - i < lengths[b] + 1 when
 * causal), the probabilities of a row with no key are zeroed after the
 * softmax and so are the values past each length, so that both forms give
 * 0 for such a row and never read past the lengths. src_in: src ids of q,
 * k, v. */
static int32_t attention(dctx *d, const kl_node *s, const int32_t *in, const int32_t *src_in)
{
	kl_dtype D = (kl_dtype)s->dtype;
	int rk = s->ndim;
	int64_t hd = nd(d, in[0])->shape[rk - 1];
	bool cuda_wide = d->L->o->target == KL_TARGET_CUDA && (hd > 256 || s->shape[rk - 1] > 256);
	bool has_len = (s->a.flags & KL_F_LENGTHS) != 0;
	if (!d->L->o->no_attention && !cuda_wide) {
		kl_node n = *s;
		n.op = KL_OP_ATTENTION;
		n.nin = has_len ? 4 : 3;
		for (int i = 0; i < n.nin; i++) {
			int32_t x = i < 3 ? cast(d, in[i], D) : in[i];
			if (x < 0)
				return -1;
			kl_node c = mk(KL_OP_CONTIGUOUS, (kl_dtype)nd(d, x)->dtype, nd(d, x)->ndim,
			               nd(d, x)->shape, 1);
			c.in[0] = x;
			n.in[i] = add(d, &c);
		}
		return add(d, &n);
	}
	int32_t q = cast(d, in[0], D), k = cast(d, in[1], D), v = cast(d, in[2], D);
	int32_t valid = -1;
	if (has_len && v >= 0) {
		int64_t tq = nd(d, q)->shape[rk - 2], tk = nd(d, k)->shape[rk - 2];
		int64_t ksh[KL_MAX_DIMS], lsh[KL_MAX_DIMS], qsh[KL_MAX_DIMS], vsh[KL_MAX_DIMS];
		for (int i = 0; i < rk; i++)
			ksh[i] = lsh[i] = qsh[i] = vsh[i] = 1;
		ksh[rk - 1] = vsh[rk - 2] = tk;
		qsh[rk - 2] = tq;
		lsh[0] = s->shape[0];
		kl_node aj = mk(KL_OP_ARANGE, KL_I64, 1, &tk, 0);
		aj.a.s[1] = 1;
		int32_t j = add(d, &aj);
		int32_t len = view(d, KL_OP_RESHAPE, cast(d, in[3], KL_I64), rk, lsh);
		/* the values past each length: zero, never read */
		int32_t kv = bin(d, KL_OP_LT, view(d, KL_OP_RESHAPE, j, rk, vsh), len);
		int32_t lhs = view(d, KL_OP_RESHAPE, j, rk, ksh), lim = len;
		if (s->a.flags & KL_F_CAUSAL) {
			kl_node ai = mk(KL_OP_ARANGE, KL_I64, 1, &tq, 0);
			ai.a.s[1] = 1;
			lhs = bin(d, KL_OP_SUB, bin_s(d, KL_OP_ADD, lhs, (double)tq),
			          view(d, KL_OP_RESHAPE, add(d, &ai), rk, qsh));
			lim = bin_s(d, KL_OP_ADD, len, 1);
		}
		valid = bin(d, KL_OP_LT, lhs, lim);
		kl_node z = mk(KL_OP_FULL, D, 0, NULL, 0);
		int32_t zero = add(d, &z);
		if (kv < 0 || valid < 0 || zero < 0)
			return -1;
		d->L->g.nodes[kv].dtype = KL_BOOL;
		d->L->g.nodes[valid].dtype = KL_BOOL;
		kl_node w = mk(KL_OP_WHERE, D, rk, nd(d, v)->shape, 3);
		w.in[0] = kv;
		w.in[1] = v;
		w.in[2] = zero;
		v = add(d, &w);
	}
	int32_t kt = transpose_last(d, k);
	if (kt < 0)
		return -1;
	int32_t sc = bin_s(d, KL_OP_MUL, product_of(d, q, kt, src_in[0], src_in[1]), s->a.s[0]);
	if (sc < 0)
		return -1;
	if (valid >= 0) {
		kl_node f = mk(KL_OP_FULL, D, 0, NULL, 0);
		f.a.s[0] = -INFINITY;
		int32_t fill = add(d, &f);
		if (fill < 0)
			return -1;
		kl_node w = mk(KL_OP_WHERE, D, rk, nd(d, sc)->shape, 3);
		w.in[0] = valid;
		w.in[1] = sc;
		w.in[2] = fill;
		sc = add(d, &w);
	} else if (s->a.flags & KL_F_CAUSAL) {
		int64_t tq = nd(d, sc)->shape[rk - 2], tk = nd(d, sc)->shape[rk - 1];
		int64_t sh[2] = {tq, 1};
		kl_node ai = mk(KL_OP_ARANGE, KL_I64, 1, &tq, 0);
		ai.a.s[1] = 1;
		kl_node aj = mk(KL_OP_ARANGE, KL_I64, 1, &tk, 0);
		aj.a.s[1] = 1;
		/* key j allowed iff i + (tk - tq) >= j */
		int32_t i = bin_s(d, KL_OP_ADD, view(d, KL_OP_RESHAPE, add(d, &ai), 2, sh),
		                  (double)(tk - tq));
		int32_t msk = bin(d, KL_OP_GE, i, add(d, &aj));
		if (msk >= 0)
			d->L->g.nodes[msk].dtype = KL_BOOL;
		kl_node f = mk(KL_OP_FULL, D, 0, NULL, 0);
		f.a.s[0] = -INFINITY;
		int32_t fill = add(d, &f);
		if (msk < 0 || fill < 0)
			return -1;
		kl_node w = mk(KL_OP_WHERE, D, rk, nd(d, sc)->shape, 3);
		w.in[0] = msk;
		w.in[1] = sc;
		w.in[2] = fill;
		sc = add(d, &w);
	}
	kl_node sm = mk(KL_OP_SOFTMAX, D, rk, sc >= 0 ? nd(d, sc)->shape : s->shape, 1);
	sm.a.axis = rk - 1;
	int32_t pin[1] = {sc};
	int32_t pr = sc >= 0 ? decompose_one(d, &sm, pin) : -1;
	if (valid >= 0 && pr >= 0) { /* a row with no key: 0, not NaN */
		kl_node z = mk(KL_OP_FULL, D, 0, NULL, 0);
		kl_node w = mk(KL_OP_WHERE, D, rk, nd(d, pr)->shape, 3);
		w.in[0] = valid;
		w.in[1] = pr;
		w.in[2] = add(d, &z);
		pr = w.in[2] < 0 ? -1 : add(d, &w);
	}
	return product_of(d, pr, v, src_in[0], src_in[2]);
}

/* sdpa_bwd: one node over dense-row views (the attention step's backward
 * mode), or, where the target has no such step (no_attention; on CUDA a
 * dtype or head dim its kernels do not take, kl__attn_bwd_cuda_takes), the
 * primitive rule of
 * graph/grad_other.c (kl__sdpa_bwd_primitives: the math is defined there
 * once), built in a scratch graph and decomposed here node by node. Its
 * sequence dims stay static (symbolic.c): the packed result's Tq + 2 Tk is
 * no product of symbols. */
static int32_t attention_bwd(dctx *d, const kl_node *s, const int32_t *in)
{
	kl_lctx *L = d->L;
	kl_dtype D = (kl_dtype)s->dtype;
	bool cuda_no = L->o->target == KL_TARGET_CUDA &&
	               !kl__attn_bwd_cuda_takes(D, s->shape[s->ndim - 1]);
	if (!L->o->no_attention && !cuda_no) {
		kl_node n = *s;
		for (int i = 0; i < 5; i++) {
			int32_t x = cast(d, in[i], D);
			if (x < 0)
				return -1;
			kl_node c = mk(KL_OP_CONTIGUOUS, D, nd(d, x)->ndim, nd(d, x)->shape, 1);
			c.in[0] = x;
			n.in[i] = add(d, &c);
		}
		return add(d, &n);
	}
	kl_graph t;
	kl__graph_init(&t);
	kl_node b = *s;
	for (int i = 0; i < 5; i++) {
		kl_node x = mk(KL_OP_INPUT, (kl_dtype)nd(d, in[i])->dtype, nd(d, in[i])->ndim,
		               nd(d, in[i])->shape, 0);
		b.in[i] = kl__graph_add(&t, &x);
	}
	int32_t r = kl__sdpa_bwd_primitives(&t, &b), res = -1;
	int32_t *map = r >= 0 ? malloc(sizeof(int32_t) * (size_t)t.n) : NULL;
	if (map) {
		/* the scratch nodes have no source dims of their own: static */
		int32_t *sym = L->src_sym;
		L->src_sym = NULL;
		for (int i = 0; i < 5; i++)
			map[i] = in[i];
		for (int32_t j = 5; j <= r; j++) {
			const kl_node *x = &t.nodes[j];
			int32_t xin[KL_NODE_MAX_IN];
			for (int k = 0; k < x->nin; k++)
				xin[k] = map[x->in[k]];
			map[j] = decompose_one(d, x, xin);
		}
		L->src_sym = sym;
		res = map[r];
	} else {
		d->oom = true;
	}
	free(map);
	kl__graph_free(&t);
	return res;
}

/* index_add(base, idx, src) as one masked sum per output element, no
 * atomics and a fixed order (deterministic):
 *   out[r, j] = base[r, j] + sum_i where(idx[i] == r, src[i, j], 0)
 * over [R, row, N] (N indices, the sum along the last axis), in f32 for
 * f16/bf16. An index outside [0, R) matches no row and adds nothing. It
 * costs R * row * N steps: right for the sizes gradients of small tables
 * and tests need; a sorted segmented kernel is the fast form, not built. */
static int32_t index_add(dctx *d, const kl_node *s, const int32_t *in)
{
	kl_dtype D = (kl_dtype)s->dtype, C = work_dt(D);
	int64_t R = s->shape[0], row = R ? kl__numel(s->ndim, s->shape) / R : 0;
	int64_t N = kl__numel(nd(d, in[1])->ndim, nd(d, in[1])->shape);
	int64_t sh[3] = {1, N, row};
	int32_t src = view(d, KL_OP_RESHAPE, cast(d, in[2], C), 3, sh);
	if (src < 0)
		return -1;
	kl_node p = mk(KL_OP_PERMUTE, C, 3, (const int64_t[]){1, row, N}, 1);
	p.a.v[0] = 0;
	p.a.v[1] = 2;
	p.a.v[2] = 1;
	p.in[0] = src;
	src = add(d, &p); /* [1, row, N] */
	sh[0] = sh[1] = 1;
	sh[2] = N;
	int32_t ix = view(d, KL_OP_RESHAPE, cast(d, in[1], KL_I64), 3, sh);
	kl_node ar = mk(KL_OP_ARANGE, KL_I64, 1, &R, 0);
	ar.a.s[1] = 1;
	sh[0] = R;
	sh[2] = 1;
	int32_t r = view(d, KL_OP_RESHAPE, add(d, &ar), 3, sh);
	/* the comparison over the sum's whole space [R, row, N], so that it
	 * fuses into the sum's kernel instead of being stored */
	sh[1] = row;
	r = view(d, KL_OP_EXPAND, r, 3, sh);
	int32_t hit = bin(d, KL_OP_EQ, r, ix); /* [R, row, N] */
	kl_node z = mk(KL_OP_FULL, C, 0, NULL, 0);
	int32_t zero = add(d, &z);
	if (hit < 0 || zero < 0 || src < 0)
		return -1;
	d->L->g.nodes[hit].dtype = KL_BOOL;
	sh[1] = row;
	sh[2] = N;
	kl_node w = mk(KL_OP_WHERE, C, 3, sh, 3);
	w.in[0] = hit;
	w.in[1] = src;
	w.in[2] = zero;
	int32_t sum = red(d, KL_OP_SUM, add(d, &w), 1u << 2, false); /* [R, row] */
	sum = view(d, KL_OP_RESHAPE, sum, s->ndim, s->shape);
	return cast(d, bin(d, KL_OP_ADD, cast(d, in[0], C), sum), D);
}

static int32_t decompose_one(dctx *d, const kl_node *s, const int32_t *in)
{
	kl_dtype D = (kl_dtype)s->dtype, C = work_dt(D);
	switch ((kl_op)s->op) {
	case KL_OP_SOFTMAX:
	case KL_OP_LOG_SOFTMAX: {
		uint32_t ax = 1u << s->a.axis;
		int32_t x = cast(d, in[0], C);
		int32_t m = red(d, KL_OP_MAX, x, ax, true);
		int32_t z = bin(d, KL_OP_SUB, x, m);
		int32_t e = un(d, KL_OP_EXP, z);
		int32_t sum = red(d, KL_OP_SUM, e, ax, true);
		int32_t y;
		if (s->op == KL_OP_SOFTMAX && sum >= 0) {
			/* one reciprocal per row, then a product per element (as the
			 * eager kernels do): a division per element costs the CPU
			 * more than the row's memory traffic */
			kl_node one = mk(KL_OP_FULL, C, nd(d, sum)->ndim, nd(d, sum)->shape, 0);
			one.a.s[0] = 1.0;
			y = bin(d, KL_OP_MUL, e, bin(d, KL_OP_DIV, add(d, &one), sum));
		} else {
			y = s->op == KL_OP_SOFTMAX ? -1 : bin(d, KL_OP_SUB, z, un(d, KL_OP_LOG, sum));
		}
		return cast(d, y, D);
	}
	case KL_OP_LAYER_NORM:
	case KL_OP_RMS_NORM: {
		int32_t w = -1, b = -1, k = 1;
		if (s->a.flags & KL_F_HAS_WEIGHT)
			w = in[k++];
		if (s->a.flags & KL_F_HAS_BIAS)
			b = in[k++];
		if (!s->a.flags && s->nin > 1) {
			w = in[1];
			b = s->nin > 2 ? in[2] : -1;
		}
		uint32_t ax = 1u << (s->ndim - 1);
		int32_t x = cast(d, in[0], C), y, sc;
		double eps = s->a.s[0];
		x = norm_scaled(d, x, ax, &sc);
		/* eps * s^2, plus (1 - s) * 2^-60 so that a constant row of huge
		 * values (s < 1, its deviations 0, eps * s^2 underflowed) gives 0,
		 * not 0 * rsqrt(0); both exactly eps where s == 1 */
		int32_t e = bin(d, KL_OP_ADD, bin_s(d, KL_OP_MUL, bin(d, KL_OP_MUL, sc, sc), eps),
		                bin_s(d, KL_OP_ADD, bin_s(d, KL_OP_MUL, sc, -0x1p-60), 0x1p-60));
		if (s->op == KL_OP_LAYER_NORM) {
			int32_t mu = mean(d, x, ax, true);
			int32_t z = bin(d, KL_OP_SUB, x, mu);
			int32_t var = mean(d, bin(d, KL_OP_MUL, z, z), ax, true);
			int32_t r = un(d, KL_OP_RSQRT, bin(d, KL_OP_ADD, var, e));
			y = bin(d, KL_OP_MUL, z, r);
		} else {
			int32_t ms = mean(d, bin(d, KL_OP_MUL, x, x), ax, true);
			int32_t r = un(d, KL_OP_RSQRT, bin(d, KL_OP_ADD, ms, e));
			y = bin(d, KL_OP_MUL, x, r);
		}
		if (w >= 0)
			y = bin(d, KL_OP_MUL, y, cast(d, w, C));
		if (b >= 0)
			y = bin(d, KL_OP_ADD, y, cast(d, b, C));
		return cast(d, y, D);
	}
	case KL_OP_MEAN: {
		int32_t x = cast(d, in[0], C);
		return cast(d, mean_of(d, s, x, s->a.axes, s->a.keepdim), D);
	}
	case KL_OP_SUM: {
		/* a float whole-tensor sum in partials (split_sum), in f32 for
		 * f16/bf16 so that the partials are not rounded to 16 bits */
		if (kl_dtype_is_float(D) && in[0] >= 0 && split_rows(d, s, nd(d, in[0]), s->a.axes))
			return cast(d, split_sum(d, s, cast(d, in[0], C), s->a.axes, s->a.keepdim), D);
		int j = kl_dtype_is_float(D) && in[0] >= 0
		                ? column_dims(d, s, nd(d, in[0]), s->a.axes)
		                : 0;
		if (j)
			return cast(d, column_sum(d, j, cast(d, in[0], C), s->a.keepdim), D);
		kl_node n = *s;
		n.in[0] = in[0];
		return add(d, &n);
	}
	case KL_OP_VAR: {
		int32_t x = cast(d, in[0], C);
		int32_t mu = mean(d, x, s->a.axes, true);
		int32_t z = bin(d, KL_OP_SUB, x, mu);
		int32_t ss = red(d, KL_OP_SUM, bin(d, KL_OP_MUL, z, z), s->a.axes, s->a.keepdim);
		double n = count(nd(d, x), s->a.axes) - s->a.correction;
		/* torch's divisor max(0, n - correction): inf, or NaN for ss == 0 */
		return cast(d, bin_s(d, KL_OP_MUL, ss, n > 0 ? 1.0 / n : (double)INFINITY), D);
	}
	case KL_OP_MATMUL: {
		/* cuBLASLt has no integer products: on CUDA they are a generated
		 * multiply and sum (operands of the result's rank) */
		bool cuda = d->L->o->target == KL_TARGET_CUDA &&
		            nd(d, in[0])->ndim == s->ndim && nd(d, in[1])->ndim == s->ndim;
		bool int_cuda = cuda && (D == KL_I32 || D == KL_I64);
		/* A skinny product (a few rows against a large weight: a decode
		 * step, a small batch) is latency-bound in a library GEMM; as a
		 * generated row reduction it reads each weight row once at full
		 * width and takes its bias and activation along in one kernel. */
		int64_t rows = s->ndim > 1 && s->shape[s->ndim - 1] > 0
		                       ? kl__numel(s->ndim, s->shape) / s->shape[s->ndim - 1]
		                       : 1;
		/* (not where the rows are dynamic: a row reduction traced at a
		 * few rows would read the weight once per row at every size) */
		bool skinny = cuda && !sym_product(d, s) &&
		              kl__skinny_product(d->L, D, rows, s->shape[s->ndim - 1],
		                                 nd(d, in[0])->shape[s->ndim - 1]);
		if (int_cuda || skinny)
			return product(d, s, in);
		kl_node n = *s;
		for (int i = 0; i < 2; i++) {
			int32_t x = cast(d, in[i], D);
			kl_node c = mk(KL_OP_CONTIGUOUS, D, nd(d, x)->ndim, nd(d, x)->shape, 1);
			c.in[0] = x;
			n.in[i] = add(d, &c);
		}
		return add(d, &n);
	}
	case KL_OP_ATTENTION:
		return attention(d, s, in, s->in);
	case KL_OP_ATTENTION_BWD:
		return attention_bwd(d, s, in);
	case KL_OP_INDEX_ADD:
		return index_add(d, s, in);
	case KL_OP_CACHE_WRITE: {
		/* its step reads dense buffers: a strided graph input is copied
		 * first (views of anything are stored dense by the scheduler) */
		kl_node n = *s;
		for (int i = 0; i < 3; i++) {
			const kl_node *x = nd(d, in[i]);
			int64_t want[KL_MAX_DIMS];
			kl__contig_strides(x->ndim, x->shape, want);
			bool dense = true;
			/* values: rows dense within, any row stride */
			for (int k = i == 2 ? 1 : 0; x->op == KL_OP_INPUT && k < x->ndim; k++)
				dense &= x->shape[k] == 1 || x->strides[k] == want[k];
			dense &= !(i == 2 && x->op == KL_OP_INPUT && x->ndim > 0 && x->shape[0] > 1 &&
			           x->strides[0] < 0);
			n.in[i] = in[i];
			if (!dense) {
				kl_node c = mk(KL_OP_CONTIGUOUS, (kl_dtype)x->dtype, x->ndim, x->shape, 1);
				c.in[0] = in[i];
				n.in[i] = add(d, &c);
			}
		}
		return add(d, &n);
	}
	default: {
		kl_node n = *s;
		for (int i = 0; i < s->nin; i++)
			n.in[i] = in[i];
		return add(d, &n);
	}
	}
}

kl_status kl__decompose(kl_lctx *L)
{
	const kl_graph *g = L->src;
	dctx d = {.L = L};
	kl__graph_init(&L->g);
	size_t cnt = (size_t)(g->n + 1);
	int32_t *map = malloc(sizeof(*map) * cnt);
	int32_t *pre = malloc(sizeof(*pre) * cnt);
	/* over[i] >= 0: src node i is that new node (a batch sum's swap) */
	int32_t *over = malloc(sizeof(*over) * cnt);
	users u = {calloc(cnt, sizeof(int32_t)), malloc(sizeof(int32_t) * cnt)};
	if (!map || !pre || !over || !u.n || !u.last) {
		free(map);
		free(pre);
		free(over);
		free(u.n);
		free(u.last);
		return KL_ENOMEM;
	}
	for (int32_t i = 0; i < g->n; i++) {
		over[i] = -1;
		u.last[i] = -1;
	}
	d.map = map;
	for (int32_t i = 0; i < g->n; i++)
		for (int j = 0; j < g->nodes[i].nin; j++) {
			u.n[g->nodes[i].in[j]]++;
			u.last[g->nodes[i].in[j]] = i;
		}
	for (int32_t i = 0; i < g->noutputs; i++) {
		u.n[g->outputs[i]]++;
		u.last[g->outputs[i]] = -1;
	}
	for (int32_t i = 0; i < g->n && !d.oom; i++) {
		const kl_node *s = &g->nodes[i];
		int32_t in[KL_NODE_MAX_IN];
		for (int j = 0; j < s->nin; j++)
			in[j] = map[s->in[j]];
		d.cur = i;
		if (over[i] >= 0) {
			map[i] = over[i];
			continue;
		}
		int32_t tail, tail_node;
		int32_t bs = batch_sum_product(&d, i, map, &u, &tail, &tail_node);
		if (bs != -2) {
			map[i] = bs;
			if (tail_node >= 0)
				over[tail_node] = tail;
			continue;
		}
		if (L->mlead && L->mlead[i] >= 0) {
			/* a product merged with others (merge.c) */
			if (L->mlead[i] == i && !merged(&d, i, map, pre))
				d.oom = true;
			map[i] = d.oom ? -1 : pre[i];
			continue;
		}
		int32_t part = slice_of_concat(&d, s, in[0]);
		if (part >= 0) {
			map[i] = part;
			continue;
		}
		const kl_attn_match *am = L->am ? &L->am[i] : NULL;
		if (am && am->q >= 0) {
			/* hand-written attention ending here (attention_match.c) */
			kl_node a = mk(KL_OP_ATTENTION, (kl_dtype)s->dtype, s->ndim, s->shape, 3);
			a.a.s[0] = am->scale;
			a.a.flags = am->causal ? KL_F_CAUSAL : 0;
			int32_t src_in[3] = {am->q, am->k, am->v};
			int32_t ain[3] = {map[am->q], map[am->k], map[am->v]};
			map[i] = attention(&d, &a, ain, src_in);
			continue;
		}
		map[i] = decompose_one(&d, s, in);
	}
	for (int32_t i = 0; i < g->ninputs && !d.oom; i++)
		if (kl__graph_add_input(&L->g, map[g->inputs[i]]))
			d.oom = true;
	/* an output that is an input or a view gets a node of its own: it is
	 * either returned as a view (aliased) or copied by a kernel */
	for (int32_t i = 0; i < g->noutputs && !d.oom; i++) {
		int32_t o = map[g->outputs[i]];
		if (o >= 0 && (nd(&d, o)->op == KL_OP_INPUT || kl__is_view((kl_op)nd(&d, o)->op))) {
			d.cur = g->outputs[i];
			kl_node c = mk(KL_OP_CONTIGUOUS, (kl_dtype)nd(&d, o)->dtype, nd(&d, o)->ndim,
			               nd(&d, o)->shape, 1);
			c.in[0] = o;
			o = add(&d, &c);
		}
		if (o < 0 || kl__graph_add_output(&L->g, o))
			d.oom = true;
	}
	free(map);
	free(pre);
	free(over);
	free(u.n);
	free(u.last);
	if (d.oom) {
		snprintf(L->err, L->errcap, "kl__lower: out of memory decomposing the graph");
		return KL_ENOMEM;
	}
	return KL_OK;
}
