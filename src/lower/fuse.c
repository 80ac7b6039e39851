/* fuse.c - the scheduler: which nodes run together in one kernel.
 *
 * Greedy, in topological order: every compute node starts as a kernel of
 * its own and is merged into each producer's kernel whose iteration space
 * it fits (same elements; the rows of a reduction; a reduction over the
 * kernel's elements). A producer that stays in another kernel is either
 * recomputed here, when it is a short pointwise chain, or read from memory.
 * Merges and recomputed producers never create a cycle between kernels
 * (legal() checks reachability over the kernels' reads first) and respect
 * the limits of a step (reads, writes, nodes); the kernel IR builder has the
 * last word on legality. A kernel no one reads is dropped; a value only it
 * computed may live on as a copy in another kernel, and whoever later
 * recomputes from that kernel recomputes the copy too (computed_by), so that
 * no kernel reads a value no kernel stores. Every refusal is logged with its
 * reason. Matrix products are library steps; a consumer chain of scale, bias, residual and activation
 * folds into the product's epilogue (epilogue.c says which nodes qualify),
 * other consumers start new kernels.
 */
#include <stdarg.h>
#include <stdlib.h>

#include "lower/lower_int.h"

#define RECOMPUTE_OPS 8 /* a producer chain this short is recomputed, not stored */
#define MAX_WRITES 2    /* kl_step.writes */

const char *kl__node_label(const kl_lctx *L, int32_t n, char *buf, size_t cap)
{
	const kl_node *x = &L->g.nodes[n];
	int32_t o = L->orig[n];
	const kl_node *s = &L->src->nodes[o];
	if (s->op != x->op)
		snprintf(buf, cap, "%s#%d(%s)", kl__ops[x->op].name, (int)o, kl__ops[s->op].name);
	else
		snprintf(buf, cap, "%s#%d", kl__ops[x->op].name, (int)o);
	return buf;
}

void kl__lower_logf(kl_lctx *L, const char *fmt, ...)
{
	char line[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	kl__sb_printf(&L->log, "fusion: %s\n", line);
	if (L->o->log_ctx)
		kl__log(L->o->log_ctx, KL_LOG_FUSION, "%s", line);
}

/* ---- groups ---------------------------------------------------------------------- */

static int32_t g_new(kl_lctx *L)
{
	if (L->ngr == L->cap_gr) {
		int32_t cap = L->cap_gr ? L->cap_gr * 2 : 64;
		kl_group *p = realloc(L->gr, sizeof(*p) * (size_t)cap);
		if (!p)
			return -1;
		L->gr = p;
		L->cap_gr = cap;
	}
	kl_group *G = &L->gr[L->ngr];
	memset(G, 0, sizeof(*G));
	G->alive = true;
	G->first = -1;
	return L->ngr++;
}

static bool g_push(kl_group *G, int32_t n, bool copy)
{
	if (G->nm == G->cap) {
		int32_t cap = G->cap ? G->cap * 2 : 8;
		int32_t *m = realloc(G->m, sizeof(*m) * (size_t)cap);
		if (!m)
			return false;
		G->m = m;
		uint8_t *c = realloc(G->copy, (size_t)cap);
		if (!c)
			return false;
		G->copy = c;
		G->cap = cap;
	}
	G->m[G->nm] = n;
	G->copy[G->nm++] = copy;
	return true;
}

static void g_free(kl_group *G)
{
	free(G->m);
	free(G->copy);
	G->m = NULL;
	G->copy = NULL;
	G->nm = G->cap = 0;
}

/* members in topological (node) order */
static void g_sort(kl_group *G)
{
	for (int32_t i = 1; i < G->nm; i++) {
		int32_t n = G->m[i];
		uint8_t c = G->copy[i];
		int32_t j = i - 1;
		while (j >= 0 && G->m[j] > n) {
			G->m[j + 1] = G->m[j];
			G->copy[j + 1] = G->copy[j];
			j--;
		}
		G->m[j + 1] = n;
		G->copy[j + 1] = c;
	}
}

static bool in_group(const kl_lctx *L, const kl_group *G, int32_t gi, int32_t n)
{
	if (gi >= 0 && L->home[n] == gi)
		return true;
	for (int32_t i = 0; i < G->nm; i++)
		if (G->m[i] == n)
			return true;
	return false;
}

/* the node whose buffer group G reads for input x of a member, or -1 when x
 * is computed inside G */
static int32_t read_base(const kl_lctx *L, const kl_group *G, int32_t gi, int32_t x)
{
	for (;;) {
		if (in_group(L, G, gi, x))
			return -1;
		const kl_node *nx = &L->g.nodes[x];
		if (!kl__is_view((kl_op)nx->op) || L->mat[x])
			return x;
		x = nx->in[0];
	}
}

static void node_space(const kl_lctx *L, int32_t n, kl_group *G)
{
	const kl_node *x = &L->g.nodes[n];
	int32_t src = n;
	G->rmask = 0;
	if (kl__is_reduction(x)) {
		src = x->in[0];
		G->rmask = x->a.axes;
	}
	const kl_node *s = &L->g.nodes[src];
	G->ndim = s->ndim;
	for (int d = 0; d < KL_MAX_DIMS; d++) {
		G->F[d] = d < s->ndim ? s->shape[d] : 0;
		G->Fsym[d] = d < s->ndim ? L->sym[src * KL_MAX_DIMS + d] : 0;
	}
}

static const char *space_str(const kl_group *G, char *buf, size_t cap)
{
	kl__shape_str(buf, cap, G->ndim, G->F);
	if (G->rmask) {
		size_t n = strlen(buf);
		snprintf(buf + n, cap - n, " reducing axes");
		for (int d = 0; d < G->ndim; d++)
			if (G->rmask & (1u << d)) {
				n = strlen(buf);
				snprintf(buf + n, cap - n, " %d", d);
			}
	}
	return buf;
}

static bool same_dims(const kl_group *A, const kl_group *B)
{
	if (A->ndim != B->ndim)
		return false;
	for (int d = 0; d < A->ndim; d++)
		if (A->F[d] != B->F[d] || A->Fsym[d] != B->Fsym[d])
			return false;
	return true;
}

/* P (pointwise) iterates the rows of reduction space R */
static bool rows_of(const kl_group *P, const kl_group *R)
{
	if (P->ndim == R->ndim) {
		bool ok = true;
		for (int d = 0; d < R->ndim && ok; d++)
			ok = (R->rmask & (1u << d)) ? (P->F[d] == 1 && P->Fsym[d] == 0)
			                            : (P->F[d] == R->F[d] && P->Fsym[d] == R->Fsym[d]);
		if (ok)
			return true;
	}
	if (P->ndim != R->ndim - __builtin_popcount(R->rmask))
		return false;
	int j = 0;
	for (int d = 0; d < R->ndim; d++) {
		if (R->rmask & (1u << d))
			continue;
		if (P->F[j] != R->F[d] || P->Fsym[j] != R->Fsym[d])
			return false;
		j++;
	}
	return true;
}

static void copy_space(kl_group *dst, const kl_group *src)
{
	dst->ndim = src->ndim;
	memcpy(dst->F, src->F, sizeof(dst->F));
	memcpy(dst->Fsym, src->Fsym, sizeof(dst->Fsym));
	dst->rmask = src->rmask;
}

/* the space of A and B in one kernel; false with a reason */
static bool space_merge(const kl_group *A, const kl_group *B, kl_group *out, char *why, size_t cap)
{
	char sa[160], sb[160];
	if (A->rmask == 0 && B->rmask == 0) {
		if (same_dims(A, B)) {
			copy_space(out, A);
			return true;
		}
	} else if (A->rmask && B->rmask) {
		if (same_dims(A, B) && A->rmask == B->rmask) {
			copy_space(out, A);
			return true;
		}
	} else {
		const kl_group *P = A->rmask ? B : A, *R = A->rmask ? A : B;
		if (same_dims(P, R) || rows_of(P, R)) {
			copy_space(out, R);
			return true;
		}
	}
	snprintf(why, cap, "it iterates %s, the kernel %s", space_str(B, sb, sizeof(sb)),
	         space_str(A, sa, sizeof(sa)));
	return false;
}

/* ---- reads between kernels ---------------------------------------------------------- */

typedef struct visit {
	uint32_t *mark; /* per group: stamp */
	uint32_t stamp;
	int32_t *stack;
} visit;

/* push every group gi reads from (not yet marked) */
static void push_reads(kl_lctx *L, const kl_group *G, int32_t gi, visit *v, int32_t *sp)
{
	for (int32_t i = 0; i < G->nm; i++) {
		const kl_node *x = &L->g.nodes[G->m[i]];
		for (int j = 0; j < x->nin; j++) {
			int32_t b = read_base(L, G, gi, x->in[j]);
			if (b < 0 || L->g.nodes[b].op == KL_OP_INPUT)
				continue;
			int32_t h = L->home[b];
			if (h < 0 || v->mark[h] == v->stamp)
				continue;
			v->mark[h] = v->stamp;
			v->stack[(*sp)++] = h;
		}
	}
}

/* would a kernel with T's members (replacing groups a and b) depend on itself? */
static bool creates_cycle(kl_lctx *L, visit *v, const kl_group *T, int32_t a, int32_t b)
{
	v->stamp++;
	int32_t sp = 0;
	/* T's reads, computed with T's own membership */
	for (int32_t i = 0; i < T->nm; i++)
		L->mem[T->m[i]] = 1;
	for (int32_t i = 0; i < T->nm; i++) {
		const kl_node *x = &L->g.nodes[T->m[i]];
		for (int j = 0; j < x->nin; j++) {
			int32_t c = x->in[j];
			while (!L->mem[c] && kl__is_view((kl_op)L->g.nodes[c].op) && !L->mat[c])
				c = L->g.nodes[c].in[0];
			if (L->mem[c] || L->g.nodes[c].op == KL_OP_INPUT)
				continue;
			int32_t h = L->home[c];
			if (h < 0 || h == a || h == b || v->mark[h] == v->stamp)
				continue;
			v->mark[h] = v->stamp;
			v->stack[sp++] = h;
		}
	}
	for (int32_t i = 0; i < T->nm; i++)
		L->mem[T->m[i]] = 0;
	while (sp > 0) {
		int32_t h = v->stack[--sp];
		if (h == a || h == b)
			return true;
		push_reads(L, &L->gr[h], h, v, &sp);
	}
	return false;
}

/* how many of T's home members someone outside {a, b} reads, or are outputs */
static int exports(kl_lctx *L, const kl_group *T, int32_t a, int32_t b, uint8_t *ext)
{
	memset(ext, 0, (size_t)L->g.n);
	for (int32_t gi = 0; gi < L->ngr; gi++) {
		const kl_group *X = &L->gr[gi];
		if (!X->alive || gi == a || gi == b)
			continue;
		for (int32_t i = 0; i < X->nm; i++) {
			const kl_node *x = &L->g.nodes[X->m[i]];
			for (int j = 0; j < x->nin; j++) {
				int32_t r = read_base(L, X, gi, x->in[j]);
				if (r >= 0)
					ext[r] = 1;
			}
		}
	}
	int n = 0;
	for (int32_t i = 0; i < T->nm; i++)
		if (!T->copy[i] && (ext[T->m[i]] || L->out_of[T->m[i]] >= 0))
			n++;
	return n;
}

static int distinct_orig(const kl_lctx *L, const kl_group *T)
{
	int n = 0;
	for (int32_t i = 0; i < T->nm; i++) {
		bool seen = false;
		for (int32_t j = 0; j < i && !seen; j++)
			seen = L->orig[T->m[j]] == L->orig[T->m[i]];
		n += !seen;
	}
	return n;
}

typedef struct sched {
	kl_lctx *L;
	visit v;
	uint8_t *ext;
} sched;

/* the checks every new shape of a group passes: step limits, no cycle, the
 * IR builder accepts it */
static bool legal(sched *s, const kl_group *T, int32_t a, int32_t b, char *why, size_t cap)
{
	kl_lctx *L = s->L;
	if (distinct_orig(L, T) > KL_STEP_MAX_NODES) {
		snprintf(why, cap, "the kernel would hold more than %d ops", KL_STEP_MAX_NODES);
		return false;
	}
	if (creates_cycle(L, &s->v, T, a, b)) {
		snprintf(why, cap, "it would create a cycle between kernels");
		return false;
	}
	int e = exports(L, T, a, b, s->ext);
	if (e > MAX_WRITES) {
		snprintf(why, cap, "the kernel would store %d values (at most %d)", e, MAX_WRITES);
		return false;
	}
	kir_kernel k;
	bool ok = kl__kbuild(L, T, true, &k, why, cap);
	kl__kir_free(&k);
	return ok;
}

/* merge group b into group a */
static bool try_merge(sched *s, int32_t a, int32_t b, char *why, size_t cap)
{
	kl_lctx *L = s->L;
	kl_group *A = &L->gr[a], *B = &L->gr[b];
	if (!L->o->fusion && L->orig[A->first] != L->orig[B->first]) {
		snprintf(why, cap, "fusion is off");
		return false;
	}
	kl_group T;
	memset(&T, 0, sizeof(T));
	if (!space_merge(A, B, &T, why, cap))
		return false;
	bool ok = true;
	for (int32_t i = 0; i < A->nm && ok; i++) {
		bool home_in_b = !A->copy[i] ? false : L->home[A->m[i]] == b;
		ok = g_push(&T, A->m[i], A->copy[i] && !home_in_b);
	}
	for (int32_t i = 0; i < B->nm && ok; i++) {
		int32_t n = B->m[i];
		bool dup = false;
		for (int32_t j = 0; j < A->nm && !dup; j++)
			dup = A->m[j] == n;
		if (dup)
			continue;
		ok = g_push(&T, n, B->copy[i] && L->home[n] != a);
	}
	if (!ok) {
		g_free(&T);
		snprintf(why, cap, "out of memory");
		return false;
	}
	g_sort(&T);
	T.first = A->first < B->first ? A->first : B->first;
	if (!legal(s, &T, a, b, why, cap)) {
		g_free(&T);
		return false;
	}
	for (int32_t i = 0; i < B->nm; i++)
		if (L->home[B->m[i]] == b)
			L->home[B->m[i]] = a;
	g_free(A);
	g_free(B);
	B->alive = false;
	T.alive = true;
	*A = T;
	return true;
}

/* x converts a float to a wider float: exact, so a kernel that reads x may
 * as well read x's input and convert it itself */
static bool widening(const kl_lctx *L, int32_t x)
{
	const kl_node *nx = &L->g.nodes[x];
	if (nx->op != KL_OP_CAST || nx->nin != 1)
		return false;
	kl_dtype to = (kl_dtype)nx->dtype, from = (kl_dtype)L->g.nodes[nx->in[0]].dtype;
	bool narrow = from == KL_F16 || from == KL_BF16;
	return (narrow && (to == KL_F32 || to == KL_F64)) || (from == KL_F32 && to == KL_F64);
}

/* x is computed by kernel h: its home, or a copy h recomputes because its
 * home kernel is gone (no kernel stores x: a reader must recompute it too) */
static bool computed_by(const kl_lctx *L, int32_t x, int32_t h)
{
	int32_t hx = L->home[x];
	if (hx == h)
		return true;
	if (hx < 0 || L->gr[hx].alive)
		return false;
	const kl_group *H = &L->gr[h];
	for (int32_t i = 0; i < H->nm; i++)
		if (H->m[i] == x)
			return true;
	return false;
}

/* a constant source (fill, arange): it reads no memory, so any kernel
 * computes it where it needs it rather than reading another kernel's copy */
static bool free_source(const kl_lctx *L, int32_t x)
{
	kl_op op = (kl_op)L->g.nodes[x].op;
	return op == KL_OP_FULL || op == KL_OP_ARANGE;
}

/* the members of p's kernel h that computing p in group s would need */
static int cone(kl_lctx *L, int32_t p, int32_t h, int32_t si, int32_t *out, int budget, char *why,
                size_t cap)
{
	const kl_group *S = &L->gr[si];
	int32_t stack[256];
	int sp = 0, n = 0;
	stack[sp++] = p;
	char l[64];
	while (sp > 0) {
		int32_t x = stack[--sp];
		if (in_group(L, S, si, x) || (!computed_by(L, x, h) && !free_source(L, x)))
			continue;
		bool seen = false;
		for (int i = 0; i < n && !seen; i++)
			seen = out[i] == x;
		if (seen)
			continue;
		const kl_node *nx = &L->g.nodes[x];
		if (kl__is_reduction(nx)) {
			snprintf(why, cap, "it depends on %s, a reduction",
			         kl__node_label(L, x, l, sizeof(l)));
			return -1;
		}
		if (n == budget) {
			snprintf(why, cap, "it costs more than %d ops to recompute", budget);
			return -1;
		}
		out[n++] = x;
		for (int j = 0; j < nx->nin; j++) {
			int32_t c = kl__resolve(L, nx->in[j]);
			/* p widens a value of h: read that narrower value (h stores it
			 * in place of p, in half the bytes) and widen it here; a 16-bit
			 * row operand also keeps its dot's sums in float (render_cuda) */
			if (x == p && widening(L, x) && L->home[c] == h &&
			    !kl__is_view((kl_op)L->g.nodes[c].op))
				continue;
			if (sp == 256) {
				snprintf(why, cap, "it depends on too many nodes");
				return -1;
			}
			stack[sp++] = c;
		}
	}
	return n;
}

/* recompute producer p inside group si instead of reading it from memory */
static bool try_copy(sched *s, int32_t si, int32_t p, char *why, size_t cap)
{
	kl_lctx *L = s->L;
	int32_t h = L->home[p];
	if (L->out_of[p] >= 0) {
		snprintf(why, cap, "it is a graph output, stored anyway");
		return false;
	}
	/* when reading p would make its kernel store too many values, recomputing
	 * is worth a longer chain */
	int budget = RECOMPUTE_OPS;
	if (exports(L, &L->gr[h], h, -1, s->ext) > MAX_WRITES)
		budget = KL_STEP_MAX_NODES;
	int32_t nodes[KL_STEP_MAX_NODES];
	int n = cone(L, p, h, si, nodes, budget, why, cap);
	if (n < 0)
		return false;
	kl_group *S = &L->gr[si];
	int32_t keep = S->nm;
	for (int i = 0; i < n; i++)
		if (!g_push(S, nodes[i], true)) {
			S->nm = keep;
			snprintf(why, cap, "out of memory");
			return false;
		}
	kl_group T = *S;
	T.m = malloc(sizeof(int32_t) * (size_t)S->nm);
	T.copy = malloc((size_t)S->nm);
	if (!T.m || !T.copy) {
		free(T.m);
		free(T.copy);
		S->nm = keep;
		snprintf(why, cap, "out of memory");
		return false;
	}
	memcpy(T.m, S->m, sizeof(int32_t) * (size_t)S->nm);
	memcpy(T.copy, S->copy, (size_t)S->nm);
	g_sort(&T);
	bool ok = legal(s, &T, si, -1, why, cap);
	if (ok) {
		memcpy(S->m, T.m, sizeof(int32_t) * (size_t)S->nm);
		memcpy(S->copy, T.copy, (size_t)S->nm);
	} else {
		S->nm = keep;
	}
	free(T.m);
	free(T.copy);
	return ok;
}

/* ---- before scheduling: what is live, what outputs alias, what views are stored ---- */

static int32_t input_index(const kl_lctx *L, int32_t n)
{
	for (int32_t i = 0; i < L->g.ninputs; i++)
		if (L->g.inputs[i] == n)
			return i;
	return -1;
}

/* The CUDA attention backward loads q, k, v and do 16 bytes at a time: each
 * row starts on 8 elements (of 2 bytes: its buffers' bases are aligned) */
static bool rows_of_16_bytes(const kl_node *y, const int64_t *st, int64_t off)
{
	bool ok = off % 8 == 0;
	for (int d = 0; d < y->ndim - 1; d++)
		ok &= y->shape[d] == 1 || st[d] % 8 == 0;
	return ok;
}

static void prepare(kl_lctx *L)
{
	const kl_graph *g = &L->g;
	for (int32_t j = 0; j < g->noutputs; j++)
		L->live[g->outputs[j]] = 1;
	for (int32_t n = g->n - 1; n >= 0; n--)
		if (L->live[n])
			for (int i = 0; i < g->nodes[n].nin; i++)
				L->live[g->nodes[n].in[i]] = 1;
	/* the copies later readers of an attention's output read (decompose.c) */
	for (int32_t i = 0; i < L->nrelay; i++) {
		const int32_t *e = &L->relay[4 * i];
		for (int32_t v = e[2]; v <= e[3]; v++)
			if (L->live[v])
				L->mat[e[1]] = 1;
	}
	/* outputs: computed ones are stored in their output buffer; views alias
	 * an input or another output when their layout allows, else are copied */
	for (int32_t j = 0; j < g->noutputs; j++) {
		int32_t o = g->outputs[j];
		L->alias_of[j] = -1;
		if (!kl__is_view((kl_op)g->nodes[o].op) && L->out_of[o] < 0)
			L->out_of[o] = j;
	}
	for (int32_t j = 0; j < g->noutputs; j++) {
		int32_t o = g->outputs[j];
		if (L->out_of[o] == j)
			continue;
		if (L->out_of[o] >= 0) {
			L->alias_of[j] = g->ninputs + L->out_of[o];
			continue;
		}
		int32_t base;
		int64_t st[KL_MAX_DIMS], off;
		if (kl__view_of(L, o, &base, st, &off)) {
			if (g->nodes[base].op == KL_OP_INPUT) {
				L->alias_of[j] = input_index(L, base);
				continue;
			}
			if (L->out_of[base] >= 0 && !kl__is_view((kl_op)g->nodes[base].op)) {
				L->alias_of[j] = g->ninputs + L->out_of[base];
				continue;
			}
		}
		L->mat[o] = 1;
		L->out_of[o] = j;
	}
	/* a gather's table is read at a row only known at run time: from a buffer */
	for (int32_t n = 0; n < g->n; n++)
		if (g->nodes[n].op == KL_OP_GATHER && L->live[n] &&
		    kl__is_view((kl_op)g->nodes[g->nodes[n].in[0]].op))
			L->mat[g->nodes[n].in[0]] = 1;
	/* a cache write reads and writes whole dense buffers (offset 0), but
	 * for its values: rows dense within, any row stride and offset (k and
	 * v as slices of the packed qkv product are read where they lie) */
	for (int32_t n = 0; n < g->n; n++) {
		const kl_node *x = &g->nodes[n];
		if (x->op != KL_OP_CACHE_WRITE || !L->live[n])
			continue;
		for (int i = 0; i < 3; i++) {
			int32_t c = x->in[i], base;
			int64_t st[KL_MAX_DIMS], off, want[KL_MAX_DIMS];
			const kl_node *cn = &g->nodes[c];
			kl__contig_strides(cn->ndim, cn->shape, want);
			bool ok = kl__stored_view(L, c, &base, st, &off) && (i == 2 || off == 0);
			for (int d = i == 2 ? 1 : 0; ok && d < cn->ndim; d++)
				ok = cn->shape[d] == 1 || st[d] == want[d];
			ok = ok && (i != 2 || cn->shape[0] <= 1 || st[0] >= 0);
			if (!ok)
				L->mat[c] = 1;
		}
	}
	/* operands of products BLAS cannot address are copied first (cuBLASLt:
	 * a unit stride in one of the last two dims, kl__mm_operand_layout; CPU
	 * BLAS steps read any strides); attention reads rows whose elements are
	 * adjacent. Last: a view over a view stored above (an output, a
	 * gather's table) is addressed in that view's buffer, or not at all
	 * (program.c's operand()). */
	for (int32_t n = 0; n < g->n; n++) {
		const kl_node *x = &g->nodes[n];
		bool att = x->op == KL_OP_ATTENTION || x->op == KL_OP_ATTENTION_BWD;
		if ((x->op != KL_OP_MATMUL && !att) || !L->live[n])
			continue;
		for (int i = 0; i < x->nin; i++) {
			int32_t c = x->in[i], base;
			int64_t st[KL_MAX_DIMS], off;
			const kl_node *y = &g->nodes[c];
			int64_t ld;
			if (!kl__stored_view(L, c, &base, st, &off) ||
			    (att && y->shape[y->ndim - 1] > 1 && st[y->ndim - 1] != 1) ||
			    (x->op == KL_OP_ATTENTION_BWD && L->o->target == KL_TARGET_CUDA &&
			     !rows_of_16_bytes(y, st, off)) ||
			    (!att && L->o->target == KL_TARGET_CUDA && y->ndim >= 2 &&
			     kl__mm_operand_layout(y->shape[y->ndim - 2], y->shape[y->ndim - 1],
			                           st[y->ndim - 2], st[y->ndim - 1], &ld) < 0))
				L->mat[c] = 1;
		}
	}
}

/* ---- matrix product epilogues ---------------------------------------------------------- */

static const char *epart_name(kl_epart k, const kl_node *x)
{
	switch (k) {
	case KL_EPART_ALPHA:
		return "a scale";
	case KL_EPART_BIAS:
		return "the bias";
	case KL_EPART_RESID:
		return "the residual";
	default:
		return kl__ops[x->op].name;
	}
}

/* Can n run in the epilogue of matmul group gi, whose last value it reads?
 * The product computes act(alpha * A@B + beta * R + bias): a scale comes
 * first, the adds before the activation, each part once. */
static bool epilogue_ok(kl_lctx *L, int32_t n, int32_t gi, kl_epart *part, char *why, size_t cap)
{
	const kl_group *G = &L->gr[gi];
	int32_t tail = G->m[G->nm - 1], mm = G->m[0];
	const kl_node *x = kl__nd(L, n), *pm = kl__nd(L, mm);
	kl_dtype dt = (kl_dtype)pm->dtype;
	char l[64];
	kl__node_label(L, tail, l, sizeof l);
	if (L->nuse[tail] != 1) {
		snprintf(why, cap, "%s has %d users (its value must be stored)", l,
		         (int)L->nuse[tail]);
		return false;
	}
	if (L->out_of[tail] >= 0) {
		snprintf(why, cap, "%s is a graph output, stored before any epilogue", l);
		return false;
	}
	if (kl__nd(L, pm->in[0])->shape[pm->ndim - 1] == 0) {
		snprintf(why, cap, "the product is empty (k = 0)");
		return false;
	}
	int32_t other;
	*part = kl__epilogue_part(L, n, tail, &other, why, cap);
	if (*part == KL_EPART_NONE)
		return false;
	/* parts already there that this one cannot follow */
	uint8_t after = *part == KL_EPART_ALPHA ? KL_EPART_BIAS | KL_EPART_RESID | KL_EPART_ACT
	                                       : *part | KL_EPART_ACT;
	if (G->epi & after) {
		snprintf(why, cap, "%s cannot follow what the epilogue already holds (it computes "
		         "act(alpha * A@B + beta * R + bias), each part once)",
		         epart_name(*part, x));
		return false;
	}
	bool act = *part == KL_EPART_ACT;
	if (L->o->target == KL_TARGET_C) {
		/* f16/bf16 products run in f32 copies (matmul_step.c), the epilogue
		 * on the f32 product before its one rounding */
		if (dt != KL_F32 && dt != KL_F64 && dt != KL_F16 && dt != KL_BF16) {
			snprintf(why, cap, "the C target runs epilogues after float BLAS only (a %s "
			         "product)", kl_dtype_name(dt));
			return false;
		}
		return true;
	}
	if (dt == KL_F64 && (*part == KL_EPART_BIAS || act)) {
		snprintf(why, cap, "cuBLASLt bias and activation epilogues are used for f16/bf16/f32 "
		         "products only");
		return false;
	}
	if (act && kl__epilogue_act(x) == KL_MM_ACT_GELU) {
		snprintf(why, cap, "cuBLASLt's GELU epilogue is the tanh approximation; gelu (erf) "
		         "stays a generated kernel");
		return false;
	}
	return true;
}

/* The attention backward step of group h writes its gradients where n, the
 * concatenation of the three (a packed qkv product's gradient), holds them,
 * when kl__attention_bwd_layout says n is that and the target can store
 * there: n joins h (no kernel gathers it). Logged either way; false only
 * out of memory. */
static bool try_bwd_layout(kl_lctx *L, int32_t n, int32_t h)
{
	char why[256], l1[64], l2[64];
	int32_t at = L->gr[h].first;
	kl_bwd_layout lay;
	bool ok = kl__attention_bwd_layout(L, at, n, &lay, why, sizeof why);
	if (ok && L->o->target == KL_TARGET_CUDA) {
		/* the CUDA kernels store two 16-bit elements at a time: each
		 * gradient row starts on 4 bytes (the buffer's base is aligned) */
		const kl_node *a = kl__nd(L, at);
		for (int g = 0; g < 3 && ok; g++) {
			ok = lay.off[g] % 2 == 0 && lay.st[g][a->ndim - 2] % 2 == 0;
			for (int d = 0; d < a->ndim - 2 && ok; d++)
				ok = a->shape[d] == 1 || lay.st[g][d] % 2 == 0;
		}
		if (!ok)
			snprintf(why, sizeof why,
			         "the CUDA kernels store pairs of elements: a gradient "
			         "row would start on an odd element of the concatenation");
	}
	if (!ok) {
		kl__lower_logf(L, "refused %s into %s: %s", kl__node_label(L, n, l1, sizeof l1),
		               kl__node_label(L, at, l2, sizeof l2), why);
		return true;
	}
	if (!g_push(&L->gr[h], n, false))
		return false;
	L->home[n] = h;
	kl__lower_logf(L,
	               "the attention backward %s writes its gradients in the layout of %s "
	               "(no gather)",
	               kl__node_label(L, at, l2, sizeof l2), kl__node_label(L, n, l1, sizeof l1));
	return true;
}

/* Fold n into the epilogue of a product it reads, when it can be; log why
 * not for each product it reads. */
static bool try_epilogue(kl_lctx *L, int32_t n, bool *folded)
{
	const kl_node *x = kl__nd(L, n);
	char why[384], l1[64], l2[64];
	int32_t seen[KL_NODE_MAX_IN];
	int ns = 0;
	*folded = false;
	for (int i = 0; i < x->nin; i++) {
		int32_t b = kl__resolve(L, x->in[i]), h = L->home[b];
		if (h < 0 || !L->gr[h].matmul || L->g.nodes[L->gr[h].first].op == KL_OP_CACHE_WRITE)
			continue;
		bool dup = false;
		for (int j = 0; j < ns && !dup; j++)
			dup = seen[j] == h;
		if (dup)
			continue;
		seen[ns++] = h;
		if (*folded || !L->o->fusion)
			continue;
		if (L->g.nodes[L->gr[h].first].op == KL_OP_ATTENTION_BWD) {
			/* only n reading the gradients themselves, and only while the
			 * step has taken no consumer yet */
			if (b != L->gr[h].first || L->gr[h].nm != 1)
				continue;
			if (!try_bwd_layout(L, n, h))
				return false;
			*folded = L->home[n] == h;
			continue;
		}
		if (L->g.nodes[L->gr[h].first].op == KL_OP_ATTENTION) {
			bool ok = L->gr[h].nm == 1; /* one copy at most */
			if (!ok)
				snprintf(why, sizeof why, "the attention step takes no epilogue, only a "
				                          "copy into another layout");
			else
				ok = kl__attention_layout(L, L->gr[h].first, n, NULL, why, sizeof why);
			if (!ok) {
				kl__lower_logf(L, "refused epilogue %s into %s: %s",
				               kl__node_label(L, n, l1, sizeof l1),
				               kl__node_label(L, L->gr[h].first, l2, sizeof l2), why);
				continue;
			}
			if (!g_push(&L->gr[h], n, false))
				return false;
			L->home[n] = h;
			*folded = true;
			kl__lower_logf(L, "the attention step %s writes its output in the layout of %s "
			               "(no copy)", kl__node_label(L, L->gr[h].first, l2, sizeof l2),
			               kl__node_label(L, n, l1, sizeof l1));
			continue;
		}
		kl_epart part;
		if (!epilogue_ok(L, n, h, &part, why, sizeof why)) {
			kl__lower_logf(L, "refused epilogue %s into %s: %s",
			      kl__node_label(L, n, l1, sizeof l1),
			      kl__node_label(L, L->gr[h].first, l2, sizeof l2), why);
			continue;
		}
		kl_group *G = &L->gr[h];
		if (!g_push(G, n, false))
			return false;
		G->epi |= (uint8_t)part;
		L->home[n] = h;
		*folded = true;
	}
	return true;
}

/* ---- the greedy pass -------------------------------------------------------------- */

static bool schedule_node(sched *s, int32_t n)
{
	kl_lctx *L = s->L;
	const kl_node *x = &L->g.nodes[n];
	char why[384], l1[64], l2[64];
	bool library = x->op == KL_OP_MATMUL || x->op == KL_OP_ATTENTION ||
	               x->op == KL_OP_ATTENTION_BWD || x->op == KL_OP_CACHE_WRITE;
	if (!library) {
		bool folded;
		if (!try_epilogue(L, n, &folded))
			return false;
		if (folded)
			return true;
	}
	int32_t si = g_new(L);
	if (si < 0)
		return false;
	kl_group *S = &L->gr[si];
	S->first = n;
	L->home[n] = si;
	if (!g_push(S, n, false))
		return false;
	if (library) {
		S->matmul = true;
		return true;
	}
	node_space(L, n, S);
	/* producers' kernels, in input order */
	int32_t prods[KL_NODE_MAX_IN];
	int np = 0;
	for (int i = 0; i < x->nin; i++) {
		int32_t b = kl__resolve(L, x->in[i]);
		if (L->g.nodes[b].op == KL_OP_INPUT || L->home[b] < 0)
			continue;
		bool dup = false;
		for (int j = 0; j < np && !dup; j++)
			dup = prods[j] == L->home[b];
		if (!dup)
			prods[np++] = L->home[b];
	}
	for (int j = 0; j < np; j++) {
		int32_t pg = prods[j];
		if (pg == si || !L->gr[pg].alive)
			continue;
		if (L->gr[pg].matmul)
			continue; /* try_epilogue said why not */
		if (try_merge(s, pg, si, why, sizeof(why))) {
			si = pg;
			continue;
		}
		if (L->o->fusion)
			kl__lower_logf(L, "refused %s into the kernel of %s: %s",
			      kl__node_label(L, n, l1, sizeof(l1)),
			      kl__node_label(L, L->gr[pg].first, l2, sizeof(l2)), why);
	}
	/* producers left in other kernels: recompute or read */
	for (int i = 0; i < x->nin && L->o->fusion; i++) {
		int32_t b = kl__resolve(L, x->in[i]);
		int32_t h = L->home[b];
		if (L->g.nodes[b].op == KL_OP_INPUT || h < 0 || h == si || L->gr[h].matmul ||
		    in_group(L, &L->gr[si], si, b))
			continue;
		if (try_copy(s, si, b, why, sizeof(why))) {
			if (widening(L, b) &&
			    L->g.nodes[kl__resolve(L, L->g.nodes[b].in[0])].op != KL_OP_INPUT)
				kl__lower_logf(L, "%s widens %s itself: it reads the narrower value",
				               kl__node_label(L, n, l1, sizeof(l1)),
				               kl__node_label(L, b, l2, sizeof(l2)));
			continue;
		}
		kl__lower_logf(L, "%s reads %s from memory, not recomputed: %s",
		      kl__node_label(L, n, l1, sizeof(l1)), kl__node_label(L, b, l2, sizeof(l2)), why);
	}
	return true;
}

/* ---- after: what is stored, which kernels are dead, the order ------------------------- */

static void mark_stored(kl_lctx *L)
{
	memset(L->stored, 0, (size_t)L->g.n);
	for (int32_t gi = 0; gi < L->ngr; gi++) {
		const kl_group *G = &L->gr[gi];
		if (!G->alive)
			continue;
		for (int32_t i = 0; i < G->nm; i++) {
			const kl_node *x = &L->g.nodes[G->m[i]];
			for (int j = 0; j < x->nin; j++) {
				int32_t r = read_base(L, G, gi, x->in[j]);
				if (r >= 0 && L->g.nodes[r].op != KL_OP_INPUT)
					L->stored[r] = 1;
			}
		}
	}
	for (int32_t j = 0; j < L->g.noutputs; j++)
		if (L->alias_of[j] < 0)
			L->stored[L->g.outputs[j]] = 1;
}

/* mark (need[q] = 1) the members of G before i that member i reads */
static void need_inputs(const kl_lctx *L, const kl_group *G, int32_t i, uint8_t *need)
{
	const kl_node *x = &L->g.nodes[G->m[i]];
	for (int k = 0; k < x->nin; k++) {
		int32_t c = x->in[k];
		while (kl__is_view((kl_op)L->g.nodes[c].op) && !L->mat[c])
			c = L->g.nodes[c].in[0];
		for (int32_t q = 0; q < i; q++)
			if (G->m[q] == c)
				need[q] = 1;
	}
}

/* The members of G (sorted) that need[] marks, as a group with its space
 * from its home members; false when there is no such space (or memory). */
static bool subgroup(kl_lctx *L, const kl_group *G, const uint8_t *need, kl_group *T)
{
	memset(T, 0, sizeof(*T));
	T->alive = true;
	T->first = -1;
	bool ok = true, spaced = false;
	char why[8];
	for (int32_t i = 0; i < G->nm && ok; i++) {
		if (!need[i])
			continue;
		ok = g_push(T, G->m[i], G->copy[i]);
		if (!ok || G->copy[i])
			continue;
		kl_group one, both;
		memset(&one, 0, sizeof(one));
		node_space(L, G->m[i], &one);
		if (!spaced) {
			copy_space(T, &one);
			T->first = G->m[i];
			spaced = true;
		} else if (space_merge(T, &one, &both, why, sizeof(why))) {
			copy_space(T, &both);
		} else {
			ok = false;
		}
	}
	if (!ok || !spaced)
		g_free(T);
	return ok && spaced;
}

/* G without its home member j (T: the other home members and the copies
 * they need) and j alone (X: j and the copies it needs, recomputed as in
 * G, so that X reads nothing G did not read but G's own values). */
static bool split_last(kl_lctx *L, const kl_group *G, int32_t j, kl_group *T, kl_group *X)
{
	uint8_t *need = calloc((size_t)G->nm * 2, 1);
	if (!need)
		return false;
	uint8_t *nx = need + G->nm;
	for (int32_t i = 0; i < G->nm; i++)
		need[i] = i != j && !G->copy[i];
	nx[j] = 1;
	for (int32_t i = G->nm - 1; i >= 0; i--) {
		if (need[i])
			need_inputs(L, G, i, need);
		if (nx[i])
			need_inputs(L, G, i, nx);
	}
	/* X reads G's home members from memory */
	for (int32_t i = 0; i < G->nm; i++)
		nx[i] = nx[i] && (i == j || G->copy[i]);
	need[j] = 0;
	bool ok = subgroup(L, G, need, T);
	if (ok && !subgroup(L, G, nx, X)) {
		g_free(T);
		ok = false;
	}
	free(need);
	return ok;
}

/* Every home member of kernel gi becomes a kernel of its own, with the
 * copies of gi it needs (their home kernels may be gone: nothing else
 * computes them then). */
static bool dissolve(kl_lctx *L, int32_t gi)
{
	kl_group G = L->gr[gi];
	L->gr[gi].m = NULL;
	L->gr[gi].copy = NULL;
	L->gr[gi].nm = L->gr[gi].cap = 0;
	L->gr[gi].alive = false;
	uint8_t *need = malloc((size_t)G.nm + 1);
	bool ok = need != NULL;
	for (int32_t i = 0; i < G.nm && ok; i++) {
		if (G.copy[i])
			continue;
		memset(need, 0, (size_t)G.nm);
		need[i] = 1;
		for (int32_t q = i; q >= 0; q--)
			if (need[q] && (q == i || G.copy[q]))
				need_inputs(L, &G, q, need);
		int32_t s = g_new(L);
		ok = s >= 0;
		for (int32_t q = 0; q <= i && ok; q++)
			if (q == i || (need[q] && G.copy[q]))
				ok = g_push(&L->gr[s], G.m[q], q != i);
		if (ok) {
			L->home[G.m[i]] = s;
			L->gr[s].first = G.m[i];
			node_space(L, G.m[i], &L->gr[s]);
		}
	}
	free(need);
	g_free(&G);
	return ok;
}

/* Kernel gi stores more values than a step may write: its last home member
 * becomes a kernel of its own (reading what it needs from gi), so that gi
 * keeps its reduction and the rest of its chain, and the kernels reading it
 * recompute it where they can; the next round looks at what gi stores then.
 * When that split is no pair of kernels, every member becomes its own. */
static bool peel(sched *s, int32_t gi, int nst)
{
	kl_lctx *L = s->L;
	kl_group *G = &L->gr[gi];
	char l1[64], l2[64], why[384];
	int32_t j = -1, nhome = 0;
	for (int32_t i = 0; i < G->nm; i++)
		if (!G->copy[i]) {
			j = i;
			nhome++;
		}
	kl_group T, X;
	if (nhome > 1 && split_last(L, G, j, &T, &X)) {
		kir_kernel k;
		bool ok = kl__kbuild(L, &T, true, &k, why, sizeof(why));
		kl__kir_free(&k);
		if (ok) {
			ok = kl__kbuild(L, &X, true, &k, why, sizeof(why));
			kl__kir_free(&k);
		}
		if (ok) {
			int32_t x = G->m[j];
			kl__lower_logf(L, "split the kernel of %s: it would store %d values (at most %d); "
			               "%s becomes a kernel of its own",
			               kl__node_label(L, G->first, l1, sizeof(l1)), nst, MAX_WRITES,
			               kl__node_label(L, x, l2, sizeof(l2)));
			g_free(G);
			*G = T;
			int32_t si = g_new(L); /* may move L->gr */
			if (si < 0) {
				g_free(&X);
				return false;
			}
			L->gr[si] = X;
			L->home[x] = si;
			/* its readers may recompute it now that what it reads is stored */
			for (int32_t r = 0; r < L->ngr; r++) {
				const kl_group *R = &L->gr[r];
				bool reads = false;
				for (int32_t i = 0; R->alive && !R->matmul && r != si && i < R->nm && !reads;
				     i++) {
					const kl_node *y = &L->g.nodes[R->m[i]];
					for (int q = 0; q < y->nin && !reads; q++)
						reads = read_base(L, R, r, y->in[q]) == x;
				}
				if (!reads)
					continue;
				if (try_copy(s, r, x, why, sizeof(why)))
					kl__lower_logf(L, "the kernel of %s recomputes %s",
					               kl__node_label(L, L->gr[r].first, l1, sizeof(l1)), l2);
				else
					kl__lower_logf(L, "the kernel of %s reads %s from memory: %s",
					               kl__node_label(L, L->gr[r].first, l1, sizeof(l1)), l2,
					               why);
			}
			return true;
		}
		g_free(&T);
		g_free(&X);
	}
	kl__lower_logf(L, "split the kernel of %s: it would store %d values (at most %d); "
	               "every op becomes a kernel of its own",
	               kl__node_label(L, G->first, l1, sizeof(l1)), nst, MAX_WRITES);
	return dissolve(L, gi);
}

static kl_status finish(sched *s)
{
	kl_lctx *L = s->L;
	for (int round = 0;; round++) {
		mark_stored(L);
		bool changed = false;
		/* the kernels a split makes this round wait for the next one: what
		 * they store is only known once mark_stored has seen them */
		int32_t ng0 = L->ngr;
		for (int32_t gi = 0; gi < ng0; gi++) {
			kl_group *G = &L->gr[gi];
			if (!G->alive)
				continue;
			int nst = 0;
			for (int32_t i = 0; i < G->nm; i++)
				nst += !G->copy[i] && L->stored[G->m[i]];
			if (nst == 0) {
				G->alive = false;
				g_free(G);
				changed = true;
			} else if (nst > MAX_WRITES && !G->matmul) {
				if (!peel(s, gi, nst))
					return KL_ENOMEM;
				changed = true;
			}
		}
		if (!changed)
			break;
	}
	/* every value a kernel reads is stored by a live kernel */
	for (int32_t gi = 0; gi < L->ngr; gi++) {
		const kl_group *G = &L->gr[gi];
		for (int32_t i = 0; G->alive && i < G->nm; i++) {
			const kl_node *x = &L->g.nodes[G->m[i]];
			for (int j = 0; j < x->nin; j++) {
				int32_t r = read_base(L, G, gi, x->in[j]);
				if (r < 0 || L->g.nodes[r].op == KL_OP_INPUT ||
				    (L->home[r] >= 0 && L->gr[L->home[r]].alive))
					continue;
				char l1[64], l2[64];
				snprintf(L->err, L->errcap, "kl__lower: internal error: the kernel of %s "
				         "reads %s, which no kernel stores",
				         kl__node_label(L, G->first, l1, sizeof l1),
				         kl__node_label(L, r, l2, sizeof l2));
				return KL_EINVAL;
			}
		}
	}
	/* execution order: Kahn over "reads from" */
	int32_t ng = L->ngr;
	int32_t *dep_off = calloc((size_t)ng + 1, sizeof(int32_t));
	int32_t *indeg = calloc((size_t)ng + 1, sizeof(int32_t));
	int32_t *deps = NULL, ndeps = 0;
	L->order = malloc(sizeof(int32_t) * ((size_t)ng + 1));
	bool ok = dep_off && indeg && L->order;
	for (int32_t gi = 0; gi < ng && ok; gi++) {
		dep_off[gi] = ndeps;
		if (!L->gr[gi].alive)
			continue;
		s->v.stamp++;
		int32_t sp = 0;
		push_reads(L, &L->gr[gi], gi, &s->v, &sp);
		int32_t *p = realloc(deps, sizeof(int32_t) * (size_t)(ndeps + sp + 1));
		if (!p) {
			ok = false;
			break;
		}
		deps = p;
		memcpy(deps + ndeps, s->v.stack, sizeof(int32_t) * (size_t)sp);
		ndeps += sp;
		indeg[gi] = sp;
	}
	if (ok)
		dep_off[ng] = ndeps;
	/* ready groups in index order, then whoever they unblock */
	int32_t head = 0;
	L->norder = 0;
	for (int32_t gi = 0; gi < ng && ok; gi++)
		if (L->gr[gi].alive && indeg[gi] == 0)
			L->order[L->norder++] = gi;
	while (ok && head < L->norder) {
		int32_t gi = L->order[head++];
		for (int32_t hj = 0; hj < ng; hj++) {
			if (!L->gr[hj].alive || indeg[hj] == 0)
				continue;
			for (int32_t k = dep_off[hj]; k < dep_off[hj + 1]; k++)
				if (deps[k] == gi && --indeg[hj] == 0)
					L->order[L->norder++] = hj;
		}
	}
	free(dep_off);
	free(indeg);
	free(deps);
	if (!ok)
		return KL_ENOMEM;
	int32_t alive = 0;
	for (int32_t gi = 0; gi < ng; gi++)
		alive += L->gr[gi].alive;
	if (alive == L->norder)
		return KL_OK;
	/* never, by legal(): name a kernel Kahn could not order */
	int32_t left = 0;
	for (int32_t gi = 0; gi < ng; gi++) {
		bool ordered = !L->gr[gi].alive;
		for (int32_t k = 0; k < L->norder && !ordered; k++)
			ordered = L->order[k] == gi;
		if (!ordered) {
			left = gi;
			break;
		}
	}
	char l[64];
	snprintf(L->err, L->errcap, "kl__lower: internal error: kernels depend on each other (the "
	         "kernel of %s among them)", kl__node_label(L, L->gr[left].first, l, sizeof l));
	return KL_EINVAL;
}

/* Per source node: a norm identical to an earlier one (the same op on the
 * same inputs: its output computed again on purpose for a product's weight
 * gradient, grad_other.c). NULL when there is none or memory ran out. */
static bool *norms_again(const kl_lctx *L)
{
	const kl_graph *g = L->src;
	int32_t *norms = malloc(sizeof *norms * (size_t)(g->n + 1)), nn = 0;
	bool *again = calloc((size_t)g->n + 1, sizeof *again), any = false;
	if (!norms || !again) {
		free(norms);
		free(again);
		return NULL;
	}
	for (int32_t i = 0; i < g->n; i++) {
		const kl_node *x = &g->nodes[i];
		if (x->op != KL_OP_RMS_NORM && x->op != KL_OP_LAYER_NORM)
			continue;
		for (int32_t k = 0; k < nn && !again[i]; k++)
			again[i] = !memcmp(&g->nodes[norms[k]], x, sizeof *x);
		any |= again[i];
		norms[nn++] = i;
	}
	free(norms);
	if (!any) {
		free(again);
		return NULL;
	}
	return again;
}

/* Whether group G computes such a norm: merged with a sibling it would be
 * made, and kept, where that sibling runs; alone, it runs where its reader
 * needs it. */
static bool again_in(const kl_lctx *L, const bool *again, const kl_group *G)
{
	for (int32_t i = 0; again && i < G->nm; i++)
		if (again[L->orig[G->m[i]]])
			return true;
	return false;
}

/* Sibling reductions: two reduction kernels over the same space and axes
 * (a norm's dw and db, both sums over the rows; a forward norm's row
 * statistics and its backward's) become one kernel, one launch and one
 * pass over what they both read, when legal (no cycle, at most MAX_WRITES
 * values stored). The greedy pass only merges a producer with its consumer. */
static void merge_siblings(sched *s)
{
	kl_lctx *L = s->L;
	char why[384], l1[64], l2[64];
	bool *again = norms_again(L);
	for (int32_t b = 0; b < L->ngr; b++) {
		for (int32_t a = 0; a < b; a++) {
			const kl_group *A = &L->gr[a], *B = &L->gr[b];
			if (!B->alive || !B->rmask || B->matmul || !A->alive || A->matmul ||
			    A->rmask != B->rmask || !same_dims(A, B) || again_in(L, again, A) ||
			    again_in(L, again, B))
				continue;
			if (try_merge(s, a, b, why, sizeof why)) {
				kl__lower_logf(L, "merged the sibling reduction %s into the kernel of %s",
				               kl__node_label(L, L->gr[b].first, l1, sizeof l1),
				               kl__node_label(L, L->gr[a].first, l2, sizeof l2));
				break;
			}
			kl__lower_logf(L, "refused the sibling reduction %s into the kernel of %s: %s",
			               kl__node_label(L, B->first, l1, sizeof l1),
			               kl__node_label(L, A->first, l2, sizeof l2), why);
		}
	}
	free(again);
}

kl_status kl__schedule(kl_lctx *L)
{
	const kl_graph *g = &L->g;
	size_t n = (size_t)g->n + 1;
	L->live = calloc(n, 1);
	L->mat = calloc(n, 1);
	L->mem = calloc(n, 1);
	L->stored = calloc(n, 1);
	L->nuse = calloc(n, sizeof(int32_t));
	L->home = malloc(sizeof(int32_t) * n);
	L->out_of = malloc(sizeof(int32_t) * n);
	L->lvl = malloc(sizeof(int32_t) * n);
	L->alias_of = malloc(sizeof(int32_t) * ((size_t)g->noutputs + 1));
	sched s = {.L = L};
	s.ext = calloc(n, 1);
	/* every group index ever made fits: at most two per node (dissolving) */
	s.v.mark = calloc(n * 3 + 64, sizeof(uint32_t));
	s.v.stack = malloc(sizeof(int32_t) * (n * 3 + 64));
	kl_status st = KL_ENOMEM;
	if (!L->live || !L->nuse || !L->mat || !L->mem || !L->stored || !L->home || !L->out_of || !L->lvl ||
	    !L->alias_of || !s.ext || !s.v.mark || !s.v.stack)
		goto done;
	for (size_t i = 0; i < n; i++) {
		L->home[i] = -1;
		L->out_of[i] = -1;
		L->lvl[i] = -1;
	}
	prepare(L);
	for (int32_t i = 0; i < g->n; i++)
		if (L->live[i])
			for (int j = 0; j < g->nodes[i].nin; j++)
				L->nuse[g->nodes[i].in[j]]++;
	if (!L->o->fusion)
		kl__lower_logf(L, "fusion is off: every op is its own kernel");
	for (int32_t i = 0; i < g->n; i++) {
		const kl_node *x = &g->nodes[i];
		if (!L->live[i] || x->op == KL_OP_INPUT || (kl__is_view((kl_op)x->op) && !L->mat[i]))
			continue;
		if (!schedule_node(&s, i))
			goto done;
	}
	if (L->o->fusion)
		merge_siblings(&s);
	st = finish(&s);
done:
	if (st == KL_ENOMEM && !L->err[0])
		snprintf(L->err, L->errcap, "kl__lower: out of memory scheduling kernels");
	free(s.ext);
	free(s.v.mark);
	free(s.v.stack);
	return st;
}
