/* kernel_ir.c - index arithmetic and instruction storage of the kernel IR.
 *
 * Index expressions are simplified on construction with the rules that make
 * views compose back into plain strides: (e / a) % b and (e / (a*b)) pair
 * back into e / a, a division drops the part of e it cannot see when the
 * range of the rest is known, and nested divisions flatten. All index values
 * are non-negative, which is what makes these rules exact.
 */
#include <stdlib.h>

#include "lower/kernel_ir.h"

/* ---- the arena -------------------------------------------------------------- */

void kl__ixa_init(kl_ixa *a)
{
	memset(a, 0, sizeof(*a));
	for (int i = 0; i < KL_MAX_DIMS; i++)
		a->var_hi[i] = KL_IX_UNKNOWN;
}

void kl__ixa_free(kl_ixa *a)
{
	free(a->atoms);
	free(a->ex);
	memset(a, 0, sizeof(*a));
}

static int64_t sat_add(int64_t x, int64_t y)
{
	if (x == KL_IX_UNKNOWN || y == KL_IX_UNKNOWN)
		return KL_IX_UNKNOWN;
	if ((y > 0 && x > INT64_MAX / 2) || (y < 0 && x < INT64_MIN / 2))
		return KL_IX_UNKNOWN;
	return x + y;
}

static int64_t sat_mul(int64_t x, int64_t k)
{
	if (x == KL_IX_UNKNOWN)
		return KL_IX_UNKNOWN;
	if (k != 0 && (x > INT64_MAX / 4 / (k < 0 ? -k : k) || x < -(INT64_MAX / 4) / (k < 0 ? -k : k)))
		return KL_IX_UNKNOWN;
	return x * k;
}

/* range of e: lo is exact, hi may be unknown */
static void range_of(const kl_ixa *a, const kl_ix *e, int64_t *lo, int64_t *hi)
{
	int64_t l = e->c, h = e->c;
	for (int i = 0; i < e->nt; i++) {
		const kl_atom *t = &a->atoms[e->at[i]];
		int64_t k = e->k[i];
		if (k > 0) {
			l = sat_add(l, sat_mul(t->lo, k));
			h = t->hi == KL_IX_UNKNOWN ? KL_IX_UNKNOWN : sat_add(h, sat_mul(t->hi, k));
		} else {
			l = t->hi == KL_IX_UNKNOWN ? INT64_MIN / 2 : sat_add(l, sat_mul(t->hi, k));
			h = sat_add(h, sat_mul(t->lo, k));
		}
	}
	*lo = l == KL_IX_UNKNOWN ? INT64_MIN / 2 : l;
	*hi = h;
}

static int32_t intern_ex(kl_ixa *a, kl_ix *e)
{
	if (a->failed)
		return -1;
	e->vars = 0;
	for (int i = 0; i < e->nt; i++)
		e->vars |= a->atoms[e->at[i]].vars;
	range_of(a, e, &e->lo, &e->hi);
	for (int32_t i = a->nex - 1; i >= 0; i--) {
		const kl_ix *o = &a->ex[i];
		if (o->c == e->c && o->nt == e->nt &&
		    !memcmp(o->at, e->at, sizeof(int32_t) * (size_t)e->nt) &&
		    !memcmp(o->k, e->k, sizeof(int64_t) * (size_t)e->nt))
			return i;
	}
	if (a->nex == a->cap_ex) {
		int32_t cap = a->cap_ex ? a->cap_ex * 2 : 64;
		kl_ix *p = realloc(a->ex, sizeof(*p) * (size_t)cap);
		if (!p) {
			a->failed = true;
			return -1;
		}
		a->ex = p;
		a->cap_ex = cap;
	}
	a->ex[a->nex] = *e;
	return a->nex++;
}

static int32_t intern_atom(kl_ixa *a, const kl_atom *t)
{
	if (a->failed)
		return -1;
	for (int32_t i = 0; i < a->natoms; i++) {
		const kl_atom *o = &a->atoms[i];
		if (o->kind == t->kind && o->var == t->var && o->e == t->e && o->a == t->a &&
		    o->b == t->b)
			return i;
	}
	if (a->natoms == a->cap_atoms) {
		int32_t cap = a->cap_atoms ? a->cap_atoms * 2 : 64;
		kl_atom *p = realloc(a->atoms, sizeof(*p) * (size_t)cap);
		if (!p) {
			a->failed = true;
			return -1;
		}
		a->atoms = p;
		a->cap_atoms = cap;
	}
	a->atoms[a->natoms] = *t;
	return a->natoms++;
}

/* an expression being built: terms unsorted, may repeat atoms */
typedef struct ix_acc {
	int64_t c;
	int32_t nt;
	int32_t at[KL_IX_MAXT * 2];
	int64_t k[KL_IX_MAXT * 2];
	bool overflow;
} ix_acc;

static void acc_term(ix_acc *s, int32_t atom, int64_t k)
{
	if (k == 0)
		return;
	for (int i = 0; i < s->nt; i++)
		if (s->at[i] == atom) {
			s->k[i] += k;
			return;
		}
	if (s->nt == KL_IX_MAXT * 2) {
		s->overflow = true;
		return;
	}
	s->at[s->nt] = atom;
	s->k[s->nt++] = k;
}

static void acc_expr(ix_acc *s, const kl_ix *e, int64_t k)
{
	s->c += e->c * k;
	for (int i = 0; i < e->nt; i++)
		acc_term(s, e->at[i], e->k[i] * k);
}

/* A term pair m * (x % b) + m*b * (x / b) is m * x (x >= 0); the division
 * may also be written (y / (a*b)) with x == y / a. */
static bool pair_once(kl_ixa *a, ix_acc *s)
{
	for (int i = 0; i < s->nt; i++) {
		if (s->k[i] == 0)
			continue;
		const kl_atom *m = &a->atoms[s->at[i]];
		if (m->kind != KL_AT_MOD)
			continue;
		const kl_ix *x = &a->ex[m->e];
		/* x as y / d with a single atom: the flattened spelling */
		const kl_atom *xd = NULL;
		if (x->nt == 1 && x->c == 0 && x->k[0] == 1 && a->atoms[x->at[0]].kind == KL_AT_DIV)
			xd = &a->atoms[x->at[0]];
		for (int j = 0; j < s->nt; j++) {
			if (j == i || s->k[j] == 0)
				continue;
			const kl_atom *d = &a->atoms[s->at[j]];
			if (d->kind != KL_AT_DIV || s->k[j] != s->k[i] * m->a)
				continue;
			bool same = d->e == m->e && d->a == m->a;
			bool flat = xd && d->e == xd->e && d->a == xd->a * m->a;
			if (!same && !flat)
				continue;
			int64_t k = s->k[i];
			s->k[i] = 0;
			s->k[j] = 0;
			acc_expr(s, x, k);
			return true;
		}
	}
	return false;
}

static int cmp_term(const void *x, const void *y)
{
	const int32_t *p = x, *q = y;
	return (*p > *q) - (*p < *q);
}

static int32_t finish(kl_ixa *a, ix_acc *s)
{
	if (a->failed)
		return -1;
	while (!s->overflow && pair_once(a, s))
		;
	if (s->overflow) {
		a->failed = true;
		return -1;
	}
	/* sort (atom, coefficient) pairs by atom, dropping zeros */
	struct {
		int32_t at;
		int64_t k;
	} t[KL_IX_MAXT * 2];
	int n = 0;
	for (int i = 0; i < s->nt; i++)
		if (s->k[i] != 0) {
			t[n].at = s->at[i];
			t[n++].k = s->k[i];
		}
	qsort(t, (size_t)n, sizeof(t[0]), cmp_term);
	if (n > KL_IX_MAXT) {
		a->failed = true;
		return -1;
	}
	kl_ix e;
	memset(&e, 0, sizeof(e));
	e.c = s->c;
	e.nt = n;
	for (int i = 0; i < n; i++) {
		e.at[i] = t[i].at;
		e.k[i] = t[i].k;
	}
	return intern_ex(a, &e);
}

static void acc_init(ix_acc *s)
{
	s->c = 0;
	s->nt = 0;
	s->overflow = false;
}

int32_t kl__ix_const(kl_ixa *a, int64_t c)
{
	ix_acc s;
	acc_init(&s);
	s.c = c;
	return finish(a, &s);
}

static int32_t atom_expr(kl_ixa *a, const kl_atom *t)
{
	int32_t id = intern_atom(a, t);
	if (id < 0)
		return -1;
	ix_acc s;
	acc_init(&s);
	acc_term(&s, id, 1);
	return finish(a, &s);
}

int32_t kl__ix_var(kl_ixa *a, int var)
{
	kl_atom t = {.kind = KL_AT_VAR, .var = var, .e = -1, .lo = 0, .hi = a->var_hi[var],
	             .vars = 1u << var};
	return atom_expr(a, &t);
}

int32_t kl__ix_add(kl_ixa *a, int32_t x, int32_t y)
{
	if (x < 0 || y < 0 || a->failed)
		return -1;
	ix_acc s;
	acc_init(&s);
	acc_expr(&s, &a->ex[x], 1);
	acc_expr(&s, &a->ex[y], 1);
	return finish(a, &s);
}

int32_t kl__ix_scale(kl_ixa *a, int32_t x, int64_t k)
{
	if (x < 0 || a->failed)
		return -1;
	ix_acc s;
	acc_init(&s);
	acc_expr(&s, &a->ex[x], k);
	return finish(a, &s);
}

int32_t kl__ix_addc(kl_ixa *a, int32_t x, int64_t c)
{
	if (x < 0 || a->failed)
		return -1;
	ix_acc s;
	acc_init(&s);
	acc_expr(&s, &a->ex[x], 1);
	s.c += c;
	return finish(a, &s);
}

static bool nonneg_terms(const kl_ix *e)
{
	if (e->c < 0)
		return false;
	for (int i = 0; i < e->nt; i++)
		if (e->k[i] < 0)
			return false;
	return true;
}

/* floor division and modulo of e (>= 0) by d > 0 */
int32_t kl__ix_div(kl_ixa *a, int32_t x, int64_t d)
{
	if (x < 0 || a->failed)
		return -1;
	if (d == 1)
		return x;
	const kl_ix *e = &a->ex[x];
	if (e->hi != KL_IX_UNKNOWN && e->lo >= 0 && e->hi < d)
		return kl__ix_const(a, 0);
	if (nonneg_terms(e)) {
		/* q*d + r with r >= 0: q + r / d */
		ix_acc q, r;
		acc_init(&q);
		acc_init(&r);
		q.c = e->c / d;
		r.c = e->c % d;
		for (int i = 0; i < e->nt; i++) {
			if (e->k[i] % d == 0)
				acc_term(&q, e->at[i], e->k[i] / d);
			else
				acc_term(&r, e->at[i], e->k[i]);
		}
		if (q.nt > 0 || q.c > 0) {
			int32_t rid = finish(a, &r);
			int32_t qid = finish(a, &q);
			if (rid < 0 || qid < 0)
				return -1;
			return kl__ix_add(a, qid, kl__ix_div(a, rid, d));
		}
		/* (y / b) / d is y / (b*d) */
		if (e->nt == 1 && e->c == 0 && e->k[0] == 1 && a->atoms[e->at[0]].kind == KL_AT_DIV) {
			const kl_atom *in = &a->atoms[e->at[0]];
			if (in->a <= INT64_MAX / d)
				return kl__ix_div(a, in->e, in->a * d);
		}
	}
	kl_atom t = {.kind = KL_AT_DIV, .e = x, .a = d, .lo = e->lo < 0 ? 0 : e->lo / d,
	             .hi = e->hi == KL_IX_UNKNOWN ? KL_IX_UNKNOWN : e->hi / d, .vars = e->vars};
	return atom_expr(a, &t);
}

int32_t kl__ix_mod(kl_ixa *a, int32_t x, int64_t d)
{
	if (x < 0 || a->failed)
		return -1;
	if (d == 1)
		return kl__ix_const(a, 0);
	const kl_ix *e = &a->ex[x];
	if (e->hi != KL_IX_UNKNOWN && e->lo >= 0 && e->hi < d)
		return x;
	if (nonneg_terms(e)) {
		/* terms that are multiples of d vanish */
		ix_acc r;
		acc_init(&r);
		r.c = e->c % d;
		bool dropped = r.c != e->c;
		for (int i = 0; i < e->nt; i++) {
			if (e->k[i] % d == 0)
				dropped = true;
			else
				acc_term(&r, e->at[i], e->k[i]);
		}
		if (dropped)
			return kl__ix_mod(a, finish(a, &r), d);
	}
	kl_atom t = {.kind = KL_AT_MOD, .e = x, .a = d, .lo = 0, .hi = d - 1, .vars = e->vars};
	return atom_expr(a, &t);
}

int32_t kl__ix_clamp(kl_ixa *a, int32_t x, int64_t lo, int64_t hi)
{
	if (x < 0 || a->failed)
		return -1;
	const kl_ix *e = &a->ex[x];
	if (e->lo >= lo && e->hi != KL_IX_UNKNOWN && e->hi <= hi)
		return x;
	if (e->hi != KL_IX_UNKNOWN && e->hi <= lo)
		return kl__ix_const(a, lo);
	if (e->lo >= hi)
		return kl__ix_const(a, hi);
	kl_atom t = {.kind = KL_AT_CLAMP, .e = x, .a = lo, .b = hi, .lo = lo, .hi = hi,
	             .vars = e->vars};
	return atom_expr(a, &t);
}

bool kl__ix_affine1(const kl_ixa *a, int32_t id, int *var, int64_t *k, int64_t *c)
{
	const kl_ix *e = &a->ex[id];
	*c = e->c;
	*k = 0;
	*var = -1;
	if (e->nt == 0)
		return true;
	if (e->nt != 1 || a->atoms[e->at[0]].kind != KL_AT_VAR)
		return false;
	*var = a->atoms[e->at[0]].var;
	*k = e->k[0];
	return true;
}

/* ---- strides and addresses --------------------------------------------------- */

void kl__mono_dense(int ndim, const int64_t *shape, const int32_t *sym, kl_mono *st)
{
	kl_mono m = {.c = 1, .ns = 0};
	for (int d = ndim - 1; d >= 0; d--) {
		st[d] = m;
		if (sym && sym[d] > 0) {
			if (m.ns < KL_MAX_DIMS)
				m.s[m.ns++] = (int8_t)sym[d];
		} else {
			m.c *= shape[d];
		}
	}
}

bool kl__ix_linearize(kl_ixa *a, int ndim, const int32_t *I, const kl_mono *st, kir_addr *out)
{
	memset(out, 0, sizeof(*out));
	int32_t acc = kl__ix_const(a, 0);
	for (int d = 0; d < ndim; d++) {
		const kl_ix *e = &a->ex[I[d]];
		if (e->nt == 0 && e->c == 0)
			continue;
		if (st[d].ns == 0) {
			acc = kl__ix_add(a, acc, kl__ix_scale(a, I[d], st[d].c));
		} else {
			out->six[out->ns] = I[d];
			out->sst[out->ns++] = st[d];
		}
	}
	out->ix = acc;
	return acc >= 0;
}

/* ---- instructions ------------------------------------------------------------ */

void kl__kir_init(kir_kernel *k)
{
	memset(k, 0, sizeof(*k));
	kl__ixa_init(&k->ixa);
	k->shares = -1;
}

void kl__kir_free(kir_kernel *k)
{
	kl__ixa_free(&k->ixa);
	free(k->ins);
	memset(k, 0, sizeof(*k));
}

int32_t kl__kir_push(kir_kernel *k, const kir_ins *in)
{
	if (k->nins == k->cap) {
		int32_t cap = k->cap ? k->cap * 2 : 64;
		kir_ins *p = realloc(k->ins, sizeof(*p) * (size_t)cap);
		if (!p)
			return -1;
		k->ins = p;
		k->cap = cap;
	}
	k->ins[k->nins] = *in;
	return k->nins++;
}

static void print_ix(const kl_ixa *a, int32_t id, FILE *f)
{
	const kl_ix *e = &a->ex[id];
	fputc('(', f);
	fprintf(f, "%lld", (long long)e->c);
	for (int i = 0; i < e->nt; i++) {
		const kl_atom *t = &a->atoms[e->at[i]];
		fprintf(f, " + %lld*", (long long)e->k[i]);
		switch (t->kind) {
		case KL_AT_VAR:
			fprintf(f, "i%d", t->var);
			break;
		case KL_AT_DIV:
			print_ix(a, t->e, f);
			fprintf(f, "/%lld", (long long)t->a);
			break;
		case KL_AT_MOD:
			print_ix(a, t->e, f);
			fprintf(f, "%%%lld", (long long)t->a);
			break;
		default:
			fprintf(f, "clamp");
			print_ix(a, t->e, f);
			break;
		}
	}
	fputc(')', f);
}

void kl__kir_print(const kir_kernel *k, FILE *f)
{
	static const char *names[] = {"load",  "store", "const",    "index", "idxlt",
	                              "unary", "binary", "where",   "cast",  "rand",
	                              "acc_init", "acc", "acc_read", "lstore", "lload"};
	fprintf(f, "kernel ndim=%d rmask=%#x npass=%d\n", k->ndim, k->rmask, k->npass);
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		fprintf(f, "  [b%d] v%d = %s %s op=%s a=%d b=%d c=%d buf=%d acc=%d", in->blk, i,
		        names[in->opc], kl_dtype_name((kl_dtype)in->dt), kl__ops[in->op].name, in->a,
		        in->b, in->c, in->buf, in->acc);
		if (in->opc == KIR_LOAD || in->opc == KIR_STORE || in->opc == KIR_INDEX) {
			fputc(' ', f);
			print_ix(&k->ixa, in->ad.ix, f);
		}
		fputc('\n', f);
	}
}
