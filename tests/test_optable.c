/* test_optable.c - the op table, walked whole (in the spirit of ggml's
 * test-backend-ops).
 *
 * test_table_complete: every op of the enum has a descriptor with every field
 * its category needs (reference, math, expression, dtype and shape rules,
 * eager family) and an entry in this file's walk; an op added to ops.def
 * without them fails here (a missing descriptor does not even link).
 *
 * test_walk: every op, every dtype it accepts (the others must fail with a
 * message naming the op and the dtype), shapes with broadcasting and edge
 * sizes (0-dim, 0, 1, odd), inputs permuted and sliced with a step, NaN and
 * infinities where the op defines them; each case run eagerly and compiled
 * (kl_compile: all cases of an op family in one function, so one compile
 * each) and held to the float64 reference of its traced graph; the result's
 * dtype must be the table's dtype rule. Every buffer the backend allocates
 * is fenced by guard bytes and poisoned before use (a proxy backend), so a
 * write out of bounds fails the case that made it.
 *
 * test_result_type: torch's promotion of 0-dim tensors and numbers (issue
 * 18 item 3), as a table of cases.
 *
 * KILN_TEST_DEVICE=cuda runs it all on CUDA device 0 (ctest's
 * test_optable_cuda; skipped without a device).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend/cpu/cpu.h"
#include "core/core.h"
#include "graph/optable.h"
#include "kltest.h"

static kl_ctx *ctx;
static int fails;

#define DT(x) (1u << (x))
#define ALL_DT 0x7fu
#define FLOAT_DT (DT(KL_F32) | DT(KL_F64) | DT(KL_F16) | DT(KL_BF16))
#define NOBOOL_DT (ALL_DT & ~DT(KL_BOOL))

/* ---- guard bytes: a proxy backend fences and poisons every allocation ------- */

#define GUARD 64
#define GUARD_BYTE 0xA5

typedef struct fenced {
	char *base; /* what the real backend gave */
	size_t n;   /* the bytes asked for */
} fenced;

static const kl_backend *real_be;
static kl_backend guarded_be;
static fenced *fences;
static int nfences, capfences;

static void fence_write(kl_ctx *c, char *p, int byte, size_t n)
{
	char buf[4096];
	memset(buf, byte, sizeof buf);
	for (size_t o = 0; o < n; o += sizeof buf)
		real_be->from_host(c, p + o, buf, n - o < sizeof buf ? n - o : sizeof buf);
}

/* false (and says so) when a guard of f was written */
static bool fence_ok(kl_ctx *c, const fenced *f)
{
	unsigned char g[2][GUARD];
	real_be->to_host(c, g[0], f->base, GUARD);
	real_be->to_host(c, g[1], f->base + GUARD + f->n, GUARD);
	for (int s = 0; s < 2; s++)
		for (int i = 0; i < GUARD; i++)
			if (g[s][i] != GUARD_BYTE) {
				fprintf(stderr, "FAIL guard bytes %s a %zu-byte buffer were written "
				        "(byte %d: 0x%02x)\n", s ? "after" : "before", f->n,
				        s ? i : i - GUARD, g[s][i]);
				return false;
			}
	return true;
}

static void *guarded_alloc(kl_ctx *c, size_t n)
{
	if (nfences == capfences) {
		int cap = capfences ? 2 * capfences : 256;
		fenced *p = realloc(fences, sizeof *p * (size_t)cap);
		if (!p)
			return NULL;
		fences = p;
		capfences = cap;
	}
	char *base = real_be->alloc(c, n + 2 * GUARD);
	if (!base)
		return NULL;
	fence_write(c, base, GUARD_BYTE, GUARD);
	fence_write(c, base + GUARD, 0xFF, n); /* poison: NaN in floats, -1 in ints */
	fence_write(c, base + GUARD + n, GUARD_BYTE, GUARD);
	fences[nfences++] = (fenced){base, n};
	return base + GUARD;
}

static void guarded_free(kl_ctx *c, void *p)
{
	if (!p)
		return;
	for (int i = 0; i < nfences; i++)
		if (fences[i].base + GUARD == (char *)p) {
			if (!fence_ok(c, &fences[i]))
				fails++;
			real_be->free(c, fences[i].base);
			fences[i] = fences[--nfences];
			return;
		}
	real_be->free(c, p);
}

/* every live buffer's guards intact? */
static bool fences_ok(const char *what)
{
	bool ok = true;
	for (int i = 0; i < nfences; i++)
		if (!fence_ok(ctx, &fences[i])) {
			fprintf(stderr, "  ... after %s\n", what);
			ok = false;
		}
	return ok;
}

/* ---- the walk's entries -------------------------------------------------------- */

typedef enum fam {
	F_INPUT,
	F_SOURCE,
	F_BINARY,
	F_UNARY,
	F_CAST,
	F_CLAMP,
	F_WHERE,
	F_REDUCE,
	F_RESHAPE,
	F_PERMUTE,
	F_EXPAND,
	F_SLICE,
	F_CONCAT,
	F_CONTIGUOUS,
	F_GATHER,
	F_MATMUL,
	F_SOFTMAX,
	F_NORM,
	F_SDPA,
	F_INDEX_ADD,
	F_CACHE_WRITE,
	F_GRAD_ONLY /* no public builder: made by a gradient rule, walked by its own test */
} fam;

typedef struct entry {
	fam fam;
	unsigned dts;      /* dtypes accepted; the others must fail */
	kltest_range r;    /* inputs' values */
	bool special;      /* the op defines NaN/inf inputs: run them too */
	double factor;     /* tolerance factor */
	const void *fn;    /* the public builder */
	const void *fs;    /* binary: the _scalar form */
} entry;

#define BIN(ID, f, r, dts) [KL_OP_##ID] = {F_BINARY, dts, r, true, 1, (const void *)kl_##f, (const void *)kl_##f##_scalar}
#define UN(ID, f, r, dts, sp, fac) [KL_OP_##ID] = {F_UNARY, dts, r, sp, fac, (const void *)kl_##f, NULL}
#define RED(ID, f, dts) [KL_OP_##ID] = {F_REDUCE, dts, KLTEST_SMALLINT, true, 4, (const void *)kl_##f, NULL}

/* gelu/silu at -inf are 0 in the limit but inf * 0 in their formulas: that
 * corner is left undefined, so they skip the special inputs */
static const entry walk[KL_NOPS] = {
	[KL_OP_INPUT] = {F_INPUT, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_FULL] = {F_SOURCE, ALL_DT, KLTEST_NORMAL, false, 0, NULL, NULL},
	[KL_OP_ARANGE] = {F_SOURCE, ALL_DT, KLTEST_NORMAL, false, 0, NULL, NULL},
	[KL_OP_RAND] = {F_SOURCE, FLOAT_DT, KLTEST_NORMAL, false, 0, NULL, NULL},
	[KL_OP_RANDN] = {F_SOURCE, FLOAT_DT, KLTEST_NORMAL, false, 1, NULL, NULL},
	BIN(ADD, add, KLTEST_NORMAL, ALL_DT),
	BIN(SUB, sub, KLTEST_NORMAL, NOBOOL_DT),
	BIN(MUL, mul, KLTEST_NORMAL, ALL_DT),
	BIN(DIV, div, KLTEST_NORMAL, ALL_DT),
	BIN(POW, pow, KLTEST_SMALLINT, ALL_DT),
	BIN(MAXIMUM, maximum, KLTEST_SMALLINT, ALL_DT),
	BIN(MINIMUM, minimum, KLTEST_SMALLINT, ALL_DT),
	BIN(EQ, eq, KLTEST_SMALLINT, ALL_DT),
	BIN(NE, ne, KLTEST_SMALLINT, ALL_DT),
	BIN(LT, lt, KLTEST_SMALLINT, ALL_DT),
	BIN(LE, le, KLTEST_SMALLINT, ALL_DT),
	BIN(GT, gt, KLTEST_SMALLINT, ALL_DT),
	BIN(GE, ge, KLTEST_SMALLINT, ALL_DT),
	UN(NEG, neg, KLTEST_NORMAL, NOBOOL_DT, true, 1),
	UN(ABS, abs, KLTEST_NORMAL, NOBOOL_DT, true, 1),
	UN(EXP, exp, KLTEST_NORMAL, ALL_DT, true, 2),
	UN(LOG, log, KLTEST_POS, ALL_DT, true, 2),
	UN(SQRT, sqrt, KLTEST_POS, ALL_DT, true, 1),
	UN(RSQRT, rsqrt, KLTEST_POS, ALL_DT, true, 2),
	UN(SIN, sin, KLTEST_NORMAL, ALL_DT, true, 2),
	UN(COS, cos, KLTEST_NORMAL, ALL_DT, true, 2),
	UN(TANH, tanh, KLTEST_NORMAL, ALL_DT, true, 2),
	UN(SIGMOID, sigmoid, KLTEST_NORMAL, ALL_DT, true, 2),
	UN(RELU, relu, KLTEST_NORMAL, NOBOOL_DT, true, 1),
	UN(GELU, gelu, KLTEST_NORMAL, ALL_DT, false, 2),
	UN(GELU_TANH, gelu_tanh, KLTEST_NORMAL, ALL_DT, false, 2),
	UN(SILU, silu, KLTEST_NORMAL, ALL_DT, false, 2),
	[KL_OP_CAST] = {F_CAST, ALL_DT, KLTEST_NORMAL, true, 1, NULL, NULL},
	[KL_OP_CLAMP] = {F_CLAMP, NOBOOL_DT, KLTEST_NORMAL, true, 1, NULL, NULL},
	[KL_OP_WHERE] = {F_WHERE, ALL_DT, KLTEST_NORMAL, true, 1, NULL, NULL},
	RED(SUM, sum, ALL_DT),
	RED(MEAN, mean, FLOAT_DT),
	RED(MAX, max, ALL_DT),
	RED(MIN, min, ALL_DT),
	[KL_OP_VAR] = {F_REDUCE, FLOAT_DT, KLTEST_NORMAL, true, 8, NULL, NULL},
	[KL_OP_ARGMAX] = {F_REDUCE, ALL_DT, KLTEST_SMALLINT, true, 0, NULL, NULL},
	[KL_OP_RESHAPE] = {F_RESHAPE, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_PERMUTE] = {F_PERMUTE, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_EXPAND] = {F_EXPAND, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_SLICE] = {F_SLICE, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_CONCAT] = {F_CONCAT, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_CONTIGUOUS] = {F_CONTIGUOUS, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_GATHER] = {F_GATHER, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	[KL_OP_MATMUL] = {F_MATMUL, NOBOOL_DT, KLTEST_SMALLINT, false, 4, NULL, NULL},
	[KL_OP_SOFTMAX] = {F_SOFTMAX, FLOAT_DT, KLTEST_NORMAL, false, 4, (const void *)kl_softmax, NULL},
	[KL_OP_LOG_SOFTMAX] = {F_SOFTMAX, FLOAT_DT, KLTEST_NORMAL, false, 4, (const void *)kl_log_softmax, NULL},
	[KL_OP_LAYER_NORM] = {F_NORM, FLOAT_DT, KLTEST_NORMAL, false, 8, NULL, NULL},
	[KL_OP_RMS_NORM] = {F_NORM, FLOAT_DT, KLTEST_NORMAL, false, 8, NULL, NULL},
	[KL_OP_ATTENTION] = {F_SDPA, FLOAT_DT, KLTEST_NORMAL, false, 8, NULL, NULL},
	[KL_OP_INDEX_ADD] = {F_INDEX_ADD, FLOAT_DT, KLTEST_NORMAL, false, 4, NULL, NULL},
	[KL_OP_CACHE_WRITE] = {F_CACHE_WRITE, ALL_DT, KLTEST_NORMAL, true, 0, NULL, NULL},
	/* sdpa's gradient: tests/test_attention_bwd.c and test_grad's sdpa_fused rows */
	[KL_OP_ATTENTION_BWD] = {F_GRAD_ONLY, FLOAT_DT, KLTEST_NORMAL, false, 0, NULL, NULL},
};
#undef BIN
#undef UN
#undef RED

/* ---- cases ------------------------------------------------------------------------ */

typedef struct shp {
	int n;
	int64_t d[4];
} shp;

/* One case: the op on inputs of these shapes, layouts and ranges; k says
 * which variant of the family's arguments (axes, scalar, target dtype). */
typedef struct kcase {
	kl_op op;
	kl_dtype dt;
	int k;
	int nin;
	shp s[3];
	kl_dtype idt[3];
	kltest_range r[3];
	kltest_layout l[3];
	double scalar; /* binary: the number of the _scalar form (k == 1) */
} kcase;

typedef kl_tensor *(*fn1)(kl_tensor *);
typedef kl_tensor *(*fn2)(kl_tensor *, kl_tensor *);
typedef kl_tensor *(*fns)(kl_tensor *, double);
typedef kl_tensor *(*fnr)(kl_tensor *, int, const int *, bool);
typedef kl_tensor *(*fnax)(kl_tensor *, int);

static const int red_axes[][3] = {{1, -1, 0}, {2, 0, 2}, {0, 0, 0}, {1, 0, 0}};
static const int red_naxes[] = {1, 2, 0, 1};

/* the op of case c on in[] through its public builder */
static kl_tensor *apply(kl_tensor *const *in, const void *p)
{
	const kcase *c = p;
	const entry *e = &walk[c->op];
	switch (e->fam) {
	case F_INPUT: return kl_retain(in[0]);
	case F_SOURCE: {
		int64_t sh[2] = {7, 5};
		switch (c->op) {
		case KL_OP_FULL: return kl_full(ctx, c->dt, 2, sh, c->k ? -2.5 : 3);
		case KL_OP_ARANGE: return kl_arange(ctx, c->dt, c->k ? 5 : 0, c->k ? -4 : 11, c->k ? -3 : 1);
		case KL_OP_RAND: return kl_rand(ctx, c->dt, 2, sh, 17 + (uint64_t)c->k);
		default: return kl_randn(ctx, c->dt, 2, sh, 29 + (uint64_t)c->k);
		}
	}
	case F_BINARY:
		return c->nin == 1 ? ((fns)e->fs)(in[0], c->scalar) : ((fn2)e->fn)(in[0], in[1]);
	case F_UNARY: return ((fn1)e->fn)(in[0]);
	case F_CAST: return kl_cast(in[0], (kl_dtype)((c->dt + 1 + 2 * c->k) % KL_NDTYPES));
	case F_CLAMP: return c->k ? kl_clamp(in[0], -INFINITY, 1) : kl_clamp(in[0], -1.5, 2.5);
	case F_WHERE: return kl_where(in[0], in[1], in[2]);
	case F_REDUCE: {
		const int *ax = red_axes[c->k];
		int na = red_naxes[c->k];
		bool keep = c->k & 1;
		if (c->op == KL_OP_VAR)
			return kl_var(in[0], na, ax, c->k == 2 ? 0 : 1, keep);
		if (c->op == KL_OP_ARGMAX)
			return kl_argmax(in[0], ax[0], keep);
		return ((fnr)e->fn)(in[0], na, ax, keep);
	}
	case F_RESHAPE:
		return c->k ? kl_reshape(in[0], 1, (int64_t[]){-1})
		            : kl_reshape(in[0], 3, (int64_t[]){5, 3, -1});
	case F_PERMUTE:
		return kl_permute(in[0], c->k ? (const int[]){1, 0} : (const int[]){2, 0, 1});
	case F_EXPAND:
		return kl_expand(in[0], 4, (int64_t[]){2, 3, 4, 5});
	case F_SLICE:
		return c->k ? kl_slice(in[0], 0, 0, 9, 2) : kl_slice(in[0], 1, 1, 12, 3);
	case F_CONCAT: return kl_concat(2, in, c->k ? 0 : 1);
	case F_CONTIGUOUS: return kl_contiguous(in[0]);
	case F_GATHER: return kl_gather(in[0], in[1]);
	case F_MATMUL: return kl_matmul(in[0], in[1]);
	case F_SOFTMAX: return ((fnax)e->fn)(in[0], c->k ? 1 : -1);
	case F_NORM:
		return c->op == KL_OP_LAYER_NORM ? kl_layer_norm(in[0], in[1], c->k ? NULL : in[2], 1e-5)
		                                 : kl_rms_norm(in[0], c->k ? NULL : in[1], 1e-6);
	case F_SDPA: return kl_sdpa(in[0], in[1], in[2], c->k == 1, c->k == 2 ? 0.25 : 0.35);
	case F_INDEX_ADD: return kl_index_add(in[0], in[1], in[2]);
	case F_CACHE_WRITE: return kl_cache_update(in[0], c->k == 0 ? 2 : c->k == 1 ? -2 : 1, in[1], in[2]);
	case F_GRAD_ONLY: return NULL;
	}
	return NULL;
}

static kcase mkcase(kl_op op, kl_dtype dt, int k, int nin, kltest_range r)
{
	kcase c;
	memset(&c, 0, sizeof c);
	c.op = op;
	c.dt = dt;
	c.k = k;
	c.nin = nin;
	for (int i = 0; i < 3; i++) {
		c.idt[i] = dt;
		c.r[i] = r;
		c.l[i] = (kltest_layout)((k + i) % 3);
	}
	return c;
}

#define S(...) ((shp){sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t), {__VA_ARGS__}})
#define S0 ((shp){0, {0}})

/* The cases of op in dtype dt into out[] (at most 16); returns how many. */
static int cases_of(kl_op op, kl_dtype dt, kcase *out)
{
	const entry *e = &walk[op];
	int n = 0;
	switch (e->fam) {
	case F_GRAD_ONLY:
		break;
	case F_INPUT:
		out[n] = mkcase(op, dt, 0, 1, e->r);
		out[n++].s[0] = S(7, 13);
		out[n] = mkcase(op, dt, 1, 1, e->r);
		out[n++].s[0] = S0;
		break;
	case F_SOURCE:
		for (int k = 0; k < 2; k++)
			out[n++] = mkcase(op, dt, k, 0, e->r);
		break;
	case F_BINARY: {
		static const shp bs[][2] = {
			{{0, {0}}, {0, {0}}},         {{1, {7}}, {1, {7}}},      {{3, {3, 1, 5}}, {2, {4, 5}}},
			{{2, {2, 0}}, {1, {1}}},      {{2, {1, 13}}, {2, {7, 1}}}, {{1, {1}}, {3, {2, 1, 3}}},
			{{2, {7, 13}}, {1, {13}}},    {{1, {64}}, {1, {64}}},
		};
		for (int i = 0; i < 8; i++) {
			out[n] = mkcase(op, dt, i, 2, e->r);
			out[n].s[0] = bs[i][0];
			out[n].s[1] = bs[i][1];
			if (i == 6 && e->special) /* NaN, infinities, signed zeros, int extremes */
				out[n].r[0] = out[n].r[1] = KLTEST_SPECIAL;
			if (i == 7) /* magnitudes 2^-12..2^12; ints over their range (wrap-around) */
				out[n].r[0] = out[n].r[1] = KLTEST_WIDE;
			if (i == 2 && op == KL_OP_POW)
				out[n].r[0] = KLTEST_POS, out[n].r[1] = KLTEST_NORMAL;
			n++;
		}
		static const double sc[] = {2, -1.5, INFINITY};
		for (int i = 0; i < 3; i++) {
			out[n] = mkcase(op, dt, 1, 1, i == 2 ? KLTEST_SPECIAL : e->r);
			out[n].s[0] = i == 0 ? S(9, 11) : S(13);
			out[n++].scalar = sc[i];
		}
		break;
	}
	case F_UNARY:
	case F_CAST:
	case F_CLAMP: {
		static const shp us[] = {{0, {0}}, {1, {7}}, {2, {7, 13}}, {1, {0}}, {3, {3, 1, 5}}};
		for (int i = 0; i < 5; i++) {
			out[n] = mkcase(op, dt, i % 2, 1, e->r);
			out[n++].s[0] = us[i];
		}
		kltest_range extra[2] = {KLTEST_WIDE, KLTEST_SPECIAL};
		for (int k = 0; k < (e->special ? 2 : 1); k++) {
			out[n] = mkcase(op, dt, k, 1, extra[k]);
			out[n++].s[0] = S(9, 11);
		}
		break;
	}
	case F_WHERE: {
		static const shp ws[][3] = {
			{{2, {7, 1}}, {2, {1, 13}}, {0, {0}}},
			{{1, {9}}, {1, {9}}, {1, {9}}},
			{{2, {0, 3}}, {1, {3}}, {1, {1}}},
		};
		for (int i = 0; i < 3; i++) {
			out[n] = mkcase(op, dt, i, 3, i == 1 && e->special ? KLTEST_SPECIAL : e->r);
			memcpy(out[n].s, ws[i], sizeof ws[i]);
			out[n].idt[0] = KL_BOOL;
			n++;
		}
		break;
	}
	case F_REDUCE: {
		static const shp rs[] = {{2, {7, 13}}, {3, {3, 4, 5}}, {1, {9}}, {3, {2, 0, 3}}};
		for (int k = 0; k < 4; k++) {
			if (k == 3 && kl__opdesc[op]->no_identity)
				continue; /* no identity: an empty row is an error */
			out[n] = mkcase(op, dt, k, 1, e->r);
			out[n++].s[0] = rs[k];
		}
		out[n] = mkcase(op, dt, 0, 1, KLTEST_SPECIAL);
		out[n++].s[0] = S(5, 11);
		break;
	}
	case F_RESHAPE:
		out[n] = mkcase(op, dt, 0, 1, e->r);
		out[n++].s[0] = S(3, 4, 5);
		out[n] = mkcase(op, dt, 1, 1, e->r);
		out[n++].s[0] = S(7, 13);
		break;
	case F_PERMUTE:
		out[n] = mkcase(op, dt, 0, 1, e->r);
		out[n++].s[0] = S(3, 4, 5);
		out[n] = mkcase(op, dt, 1, 1, e->r);
		out[n++].s[0] = S(7, 1);
		break;
	case F_EXPAND:
		out[n] = mkcase(op, dt, 0, 1, e->r);
		out[n++].s[0] = S(3, 1, 5);
		out[n] = mkcase(op, dt, 1, 1, e->r);
		out[n++].s[0] = S0;
		break;
	case F_SLICE:
		out[n] = mkcase(op, dt, 0, 1, e->r);
		out[n++].s[0] = S(7, 13);
		out[n] = mkcase(op, dt, 1, 1, e->r);
		out[n++].s[0] = S(9);
		break;
	case F_CONCAT:
		out[n] = mkcase(op, dt, 0, 2, e->r);
		out[n].s[0] = S(3, 4);
		out[n++].s[1] = S(3, 1);
		out[n] = mkcase(op, dt, 1, 2, e->r);
		out[n].s[0] = S(0, 5);
		out[n++].s[1] = S(2, 5);
		break;
	case F_CONTIGUOUS:
		for (int k = 0; k < 3; k++) {
			out[n] = mkcase(op, dt, k, 1, e->r);
			out[n++].s[0] = k == 2 ? S0 : S(7, 13);
		}
		break;
	case F_GATHER:
		for (int k = 0; k < 2; k++) {
			out[n] = mkcase(op, dt, k, 2, e->r);
			out[n].s[0] = k ? S(10) : S(10, 3);
			out[n].s[1] = k ? S(2, 3) : S(6);
			out[n].idt[1] = k ? KL_I32 : KL_I64;
			out[n].r[1] = KLTEST_POS; /* 1..9: inside the table */
			n++;
		}
		break;
	case F_MATMUL: {
		static const shp ms[][2] = {{{2, {5, 7}}, {2, {7, 3}}},
		                            {{3, {2, 3, 4}}, {3, {2, 4, 5}}},
		                            {{2, {1, 1}}, {2, {1, 1}}},
		                            {{2, {4, 0}}, {2, {0, 3}}}};
		for (int k = 0; k < 4; k++) {
			out[n] = mkcase(op, dt, k, 2, e->r);
			memcpy(out[n++].s, ms[k], sizeof ms[k]);
		}
		break;
	}
	case F_SOFTMAX:
		for (int k = 0; k < 2; k++) {
			out[n] = mkcase(op, dt, k, 1, e->r);
			out[n++].s[0] = k ? S(3, 4, 5) : S(7, 13);
		}
		break;
	case F_NORM:
		for (int k = 0; k < 2; k++) {
			int64_t D = k ? 8 : 12;
			out[n] = mkcase(op, dt, k, op == KL_OP_LAYER_NORM ? 3 - k : 2 - k, e->r);
			out[n].s[0] = k ? S(3, 4, 8) : S(5, 12);
			out[n].s[1] = out[n].s[2] = S(D);
			n++;
		}
		break;
	case F_SDPA:
		for (int k = 0; k < 3; k++) {
			out[n] = mkcase(op, dt, k, 3, e->r);
			out[n].s[0] = k == 1 ? S(2, 6, 8) : S(2, 5, 8);
			out[n].s[1] = k == 1 ? S(2, 6, 8) : S(2, 7, 8);
			out[n].s[2] = k == 1 ? S(2, 6, 4) : S(2, 7, 4);
			n++;
		}
		break;
	case F_CACHE_WRITE: { /* [R, A, T, I] at dim 2; [R, T, I] at dim -2; no rows */
		static const shp cs[][3] = {{{4, {4, 2, 12, 3}}, {1, {3}}, {4, {3, 2, 3, 3}}},
		                            {{3, {3, 12, 5}}, {1, {2}}, {3, {2, 1, 5}}},
		                            {{3, {2, 10, 2}}, {1, {0}}, {3, {0, 4, 2}}}};
		for (int k = 0; k < 3; k++) {
			out[n] = mkcase(op, dt, k, 3, e->r);
			memcpy(out[n].s, cs[k], sizeof cs[k]);
			out[n].idt[1] = k == 1 ? KL_I32 : KL_I64;
			out[n].r[1] = KLTEST_POS; /* 1..9: at most cap - s */
			n++;
		}
		break;
	}
	case F_INDEX_ADD: { /* repeated indices; a 1-d base; no indices at all */
		static const shp is[][3] = {{{2, {10, 3}}, {1, {6}}, {2, {6, 3}}},
		                            {{1, {10}}, {2, {2, 3}}, {2, {2, 3}}},
		                            {{2, {4, 3}}, {1, {0}}, {2, {0, 3}}}};
		for (int k = 0; k < 3; k++) {
			out[n] = mkcase(op, dt, k, 3, e->r);
			memcpy(out[n].s, is[k], sizeof is[k]);
			out[n].idt[1] = k == 1 ? KL_I32 : KL_I64;
			out[n].r[1] = KLTEST_POS; /* 1..9: inside the base */
			n++;
		}
		break;
	}
	}
	return n;
}

static int mk_inputs(const kcase *c, kl_tensor **in, uint64_t *seed)
{
	for (int i = 0; i < c->nin; i++) {
		in[i] = kltest_rand(ctx, c->idt[i], c->s[i].n, c->s[i].d, c->r[i],
		                    c->s[i].n ? c->l[i] : KLTEST_CONTIG, (*seed)++);
		if (!in[i]) {
			for (int j = 0; j < i; j++)
				kl_release(in[j]);
			return -1;
		}
	}
	return 0;
}

static void describe(char *w, size_t cap, const kcase *c, const char *mode)
{
	int o = snprintf(w, cap, "%s kl_%s %s k=%d", mode, kl__ops[c->op].name,
	                 kl_dtype_name(c->dt), c->k);
	for (int i = 0; i < c->nin && o > 0 && (size_t)o < cap; i++) {
		char b[96];
		o += snprintf(w + o, cap - (size_t)o, " %s%s/%d", kl_dtype_name(c->idt[i]),
		              kl__shape_str(b, sizeof b, c->s[i].n, c->s[i].d), (int)c->l[i]);
	}
	if (c->nin == 1 && walk[c->op].fam == F_BINARY && (size_t)o < cap)
		snprintf(w + o, cap - (size_t)o, " s=%g", c->scalar);
}

/* The table's dtype rule for case c, or KL_NDTYPES when the op has none. */
static kl_dtype rule_of(const kcase *c, kl_tensor *const *in)
{
	const kl_opdesc *d = kl__opdesc[c->op];
	if (!d->dtype || c->nin == 0)
		return KL_NDTYPES;
	kl_operands o = {.n = c->nin};
	for (int i = 0; i < c->nin; i++) {
		o.dt[i] = kl_tensor_dtype(in[i]);
		o.ndim[i] = kl_ndim(in[i]);
	}
	if (walk[c->op].fam == F_BINARY && c->nin == 1) {
		o.nscalar = 1;
		o.scalar[0] = c->scalar;
	} else if (walk[c->op].fam == F_CLAMP) {
		o.nscalar = 2;
		o.scalar[0] = c->k ? -INFINITY : -1.5;
		o.scalar[1] = c->k ? 1 : 2.5;
	} else if (walk[c->op].fam == F_NORM) {
		o.n = 1;
	}
	char why[160];
	return d->dtype(c->op, &o, why, sizeof why);
}

/* ---- the compiled side: every case of a batch in one function ------------------ */

typedef struct batch {
	kcase *cases;
	int ncases;
	int *first; /* index of each case's first input among the function's inputs */
} batch;

static kl_status batch_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)c, (void)nin;
	const batch *b = user;
	for (int i = 0; i < nout; i++) {
		out[i] = apply(in + b->first[i], &b->cases[i]);
		if (!out[i])
			return kl_last_status(ctx);
	}
	return KL_OK;
}

/* Compare t (released here) with ref (dt, nd, shape). */
static bool same(const char *what, kl_tensor *t, const double *ref, kl_dtype dt, int nd,
                 const int64_t *shape, double factor)
{
	char b1[96], b2[96];
	if (!t) {
		fprintf(stderr, "FAIL %s: no result: %s\n", what, kl_last_error(ctx));
		return false;
	}
	bool ok = kl_tensor_dtype(t) == dt && kl_ndim(t) == nd &&
	          memcmp(kl_shape(t), shape, sizeof(int64_t) * (size_t)nd) == 0;
	if (!ok) {
		fprintf(stderr, "FAIL %s: result %s %s, reference %s %s\n", what,
		        kl_dtype_name(kl_tensor_dtype(t)),
		        kl__shape_str(b1, sizeof b1, kl_ndim(t), kl_shape(t)), kl_dtype_name(dt),
		        kl__shape_str(b2, sizeof b2, nd, shape));
	} else {
		double *got = kltest_read(t);
		ok = got && kltest_compare(what, dt, nd, shape, got, ref, factor);
		free(got);
	}
	kl_release(t);
	return ok;
}

typedef struct refval {
	double *v;
	int nd;
	int64_t shape[KL_MAX_DIMS];
	kl_dtype dt;
} refval;

/* The cases [0, n) (inputs in[], first[i] the first of case i) compiled as
 * one function and called once, each result held to ref[i]. */
static void run_compiled(kcase *cs, int n, kl_tensor **in, int total, int *first,
                         const refval *ref)
{
	char w[256];
	/* compiled: one function for the whole batch */
	batch b = {cs, n, first};
	snprintf(w, sizeof w, "compiled batch kl_%s..kl_%s (%d cases)", kl__ops[cs[0].op].name,
	         kl__ops[cs[n - 1].op].name, n);
	kl_fn *f = kl_compile(ctx, batch_body, &b, total, n, NULL);
	kl_tensor **outs = calloc((size_t)n, sizeof *outs);
	assert_non_null(outs);
	kl_status st = f ? kl_fn_call(f, in, outs) : kl_last_status(ctx);
	if (st != KL_OK) {
		fprintf(stderr, "FAIL %s: %s\n", w, kl_last_error(ctx));
		fails++;
	} else {
		for (int i = 0; i < n; i++) {
			char wi[256];
			describe(wi, sizeof wi, &cs[i], "compiled");
			if (ref[i].v && !same(wi, outs[i], ref[i].v, ref[i].dt, ref[i].nd, ref[i].shape,
			                      walk[cs[i].op].factor))
				fails++;
			else if (!ref[i].v)
				kl_release(outs[i]);
		}
		if (!fences_ok(w))
			fails++;
	}
	kl_fn_free(f);
	free(outs);
}

/* Runs the cases [0, n) eagerly (each against its reference, guards checked
 * after each) and then compiled, all in one function. */
static void run_batch(kcase *cs, int n, uint64_t *seed, bool compile)
{
	if (n <= 0)
		return;
	char w[256];
	int total = 0;
	for (int i = 0; i < n; i++)
		total += cs[i].nin;
	kl_tensor **in = calloc((size_t)(total > 0 ? total : 1), sizeof *in);
	size_t nc = (size_t)(unsigned)n;
	int *first = calloc(nc, sizeof *first);
	refval *ref = calloc(nc, sizeof *ref);
	assert_true(in && first && ref);
	int at = 0;
	for (int i = 0; i < n; i++) {
		first[i] = at;
		assert_int_equal(mk_inputs(&cs[i], in + at, seed), 0);
		at += cs[i].nin;
	}
	for (int i = 0; i < n; i++) {
		const kcase *c = &cs[i];
		describe(w, sizeof w, c, "eager");
		kl_clear_error(ctx);
		ref[i].v = kltest_reference(ctx, w, apply, in + first[i], c, &ref[i].nd,
		                            ref[i].shape, &ref[i].dt);
		if (!ref[i].v) {
			fails++;
			continue;
		}
		kl_dtype rule = rule_of(c, in + first[i]);
		if (rule != KL_NDTYPES && rule != ref[i].dt) {
			fprintf(stderr, "FAIL %s: the table's dtype rule gives %s, the op %s\n", w,
			        kl_dtype_name(rule), kl_dtype_name(ref[i].dt));
			fails++;
		}
		kl_scope_begin(ctx);
		kl_tensor *out = apply(in + first[i], c);
		if (out)
			kl_retain(out);
		kl_scope_end(ctx);
		if (!same(w, out, ref[i].v, ref[i].dt, ref[i].nd, ref[i].shape, walk[c->op].factor))
			fails++;
		if (!fences_ok(w))
			fails++;
	}
	/* a CUDA program passes every buffer to each kernel in one 4 KiB
	 * parameter block (lower.c refuses past 500 buffers and symbols, with
	 * that message), so on CUDA a batch compiles in chunks */
	int chunk = kl_ctx_device(ctx) == KL_CUDA ? 40 : n;
	for (int i0 = 0; compile && i0 < n; i0 += chunk) {
		int m = n - i0 < chunk ? n - i0 : chunk, base = first[i0];
		int *sub = calloc((size_t)m, sizeof *sub);
		assert_non_null(sub);
		for (int j = 0; j < m; j++)
			sub[j] = first[i0 + j] - base;
		run_compiled(cs + i0, m, in + base, (i0 + m < n ? first[i0 + m] : total) - base, sub,
		             ref + i0);
		free(sub);
	}
	for (int i = 0; i < total; i++)
		kl_release(in[i]);
	for (int i = 0; i < n; i++)
		free(ref[i].v);
	free(ref);
	free(first);
	free(in);
}

/* ---- tests ------------------------------------------------------------------------ */

static int setup(void **state)
{
	(void)state;
	ctx = kltest_ctx_from_env("test_optable");
	if (!ctx)
		return -1;
	real_be = ctx->be;
	guarded_be = *real_be;
	guarded_be.alloc = guarded_alloc;
	guarded_be.free = guarded_free;
	ctx->be = &guarded_be;
	return 0;
}

static int teardown(void **state)
{
	(void)state;
	/* tensors still alive are freed by kl_ctx_free through the real backend:
	 * hand it the real blocks */
	for (kl_tensor *t = ctx->live; t; t = t->next)
		for (int i = 0; t->st && i < nfences; i++)
			if (fences[i].base + GUARD == (char *)t->st->data) {
				t->st->data = fences[i].base;
				fences[i] = fences[--nfences];
				break;
			}
	ctx->be = real_be;
	for (int i = 0; i < nfences; i++)
		real_be->free(ctx, fences[i].base);
	nfences = 0;
	free(fences);
	kl_ctx_free(ctx);
	return 0;
}

static void test_table_complete(void **state)
{
	(void)state;
	_Static_assert(sizeof walk / sizeof walk[0] == KL_NOPS, "one walk entry per op");
	for (int op = 0; op < KL_NOPS; op++) {
		const char *name = kl__ops[op].name;
		const kl_opdesc *d = kl__opdesc[op];
		kl_cat cat = kl__ops[op].cat;
		if (!d) {
			fprintf(stderr, "FAIL kl_%s has no descriptor\n", name);
			fails++;
			continue;
		}
		if (op != KL_OP_INPUT && walk[op].fam == F_INPUT) {
			fprintf(stderr, "FAIL kl_%s has no entry in test_optable's walk\n", name);
			fails++;
		}
		if (op != KL_OP_INPUT && (!d->ref || d->eager == KL_EAGER_NONE)) {
			fprintf(stderr, "FAIL kl_%s: no reference or no eager implementation\n", name);
			fails++;
		}
		if (kl__op_pointwise((kl_op)op)) {
			bool ints = (walk[op].dts & (DT(KL_I32) | DT(KL_I64) | DT(KL_BOOL))) &&
			            cat != KL_CAT_UNARY_FLOAT;
			if (!d->math || !d->shape || (op != KL_OP_CAST && !d->dtype) ||
			    (!d->composed && (!d->expr_f || !d->expr_d || (ints && !d->expr_i)))) {
				fprintf(stderr, "FAIL pointwise kl_%s lacks math, shape/dtype rule or a "
				        "generated-code expression\n", name);
				fails++;
			}
		}
		if (cat == KL_CAT_REDUCE && (!d->row || !d->dtype || !d->shape)) {
			fprintf(stderr, "FAIL reduction kl_%s lacks its row, dtype or shape rule\n",
			        name);
			fails++;
		}
		if (op != KL_OP_INPUT && !d->shape) {
			fprintf(stderr, "FAIL kl_%s lacks its shape rule\n", name);
			fails++;
		}
		if ((cat == KL_CAT_CONTRACT || cat == KL_CAT_COMPOSITE) && !d->dtype) {
			fprintf(stderr, "FAIL kl_%s lacks its dtype rule\n", name);
			fails++;
		}
	}
	assert_int_equal(fails, 0);
}

/* The dtypes op refuses must fail with a message naming the op and the dtype. */
static void check_refused(kl_op op, uint64_t *seed)
{
	const entry *e = &walk[op];
	char w[64];
	snprintf(w, sizeof w, "kl_%s", kl__ops[op].name);
	for (int dt = 0; dt < KL_NDTYPES; dt++) {
		if (e->dts & DT(dt))
			continue;
		kcase c[16];
		if (cases_of(op, (kl_dtype)dt, c) == 0)
			continue;
		kl_tensor *in[3];
		if (mk_inputs(&c[0], in, seed) != 0) {
			fails++;
			continue;
		}
		kl_clear_error(ctx);
		if (!kltest_expect_error(ctx, apply(in, &c[0]), w, w, kl_dtype_name(dt),
		                         (const char *)NULL))
			fails++;
		for (int i = 0; i < c[0].nin; i++)
			kl_release(in[i]);
	}
}

/* Every op's cases; the ops of one category are compiled as one function
 * (one compiler run each: the walk's cost is mostly the C compiler's). */
static void test_walk(void **state)
{
	(void)state;
	uint64_t seed = 1;
	const char *only = getenv("KILN_OPTABLE_OP"); /* debugging: one op by name */
	kcase *cs = calloc((size_t)16 * KL_NDTYPES * KL_NOPS, sizeof *cs);
	assert_non_null(cs);
	int n = 0;
	double t0 = kl__now_ms();
	for (int op = 0; op < KL_NOPS; op++) {
		if (only && strcmp(only, kl__ops[op].name) != 0)
			continue;
		check_refused((kl_op)op, &seed);
		for (int dt = 0; dt < KL_NDTYPES; dt++)
			if (walk[op].dts & DT(dt))
				n += cases_of((kl_op)op, (kl_dtype)dt, cs + n);
		if (op + 1 < KL_NOPS && kl__ops[op + 1].cat == kl__ops[op].cat && !only)
			continue;
		run_batch(cs, n, &seed, true);
		if (getenv("KILN_OPTABLE_TIMES"))
			fprintf(stderr, "up to kl_%s: %d cases, %.0f ms\n", kl__ops[op].name, n,
			        kl__now_ms() - t0);
		n = 0;
		t0 = kl__now_ms();
	}
	free(cs);
	assert_int_equal(fails, 0);
}

/* The CPU's eager engines for an op they have no loop for: the op table's
 * math (pointwise) and row rule (reductions). Every pointwise op's and every
 * reduction's cases again with that path forced. */
static void test_walk_generic_eager(void **state)
{
	(void)state;
	if (kl_ctx_device(ctx) != KL_CPU)
		skip();
	uint64_t seed = 7;
	kcase *cs = calloc((size_t)16 * KL_NDTYPES, sizeof *cs);
	assert_non_null(cs);
	kl__cpu_pw_generic_only = true;
	kl__cpu_rd_generic_only = true;
	for (int op = 0; op < KL_NOPS; op++) {
		if (!kl__op_pointwise((kl_op)op) && kl__ops[op].cat != KL_CAT_REDUCE)
			continue;
		int n = 0;
		for (int dt = 0; dt < KL_NDTYPES; dt++)
			if (walk[op].dts & DT(dt))
				n += cases_of((kl_op)op, (kl_dtype)dt, cs + n);
		run_batch(cs, n, &seed, false);
	}
	kl__cpu_pw_generic_only = false;
	kl__cpu_rd_generic_only = false;
	free(cs);
	assert_int_equal(fails, 0);
}

/* ---- torch.result_type for 0-dim tensors and numbers ------------------------------ */

typedef struct rt_case {
	kl_dtype a, b; /* operand dtypes */
	int na, nb;    /* their ranks (0: a 0-dim tensor) */
	kl_dtype want; /* torch's result (checked against torch.result_type) */
} rt_case;

static void test_result_type(void **state)
{
	(void)state;
	/* torch.add(torch.ones(3, dtype=a)[ or torch.tensor(1, dtype=a) for rank 0],
	 * ...).dtype, from PyTorch's type promotion rules */
	static const rt_case tc[] = {
		{KL_F16, KL_F32, 1, 0, KL_F16},   /* same category: the 0-dim does not promote */
		{KL_F32, KL_F16, 0, 1, KL_F16},
		{KL_BF16, KL_F64, 2, 0, KL_BF16},
		{KL_I32, KL_I64, 1, 0, KL_I32},   /* int_tensor + long_zerodim: int32 */
		{KL_I32, KL_F64, 1, 0, KL_F64},   /* higher category: the 0-dim's own dtype */
		{KL_I64, KL_F16, 1, 0, KL_F16},
		{KL_BOOL, KL_I32, 1, 0, KL_I32},
		{KL_BOOL, KL_F16, 1, 0, KL_F16},
		{KL_I32, KL_BOOL, 1, 0, KL_I32},
		{KL_F16, KL_I64, 1, 0, KL_F16},
		{KL_F16, KL_F32, 0, 0, KL_F32},   /* all 0-dim: plain promotion */
		{KL_I32, KL_I64, 0, 0, KL_I64},
		{KL_F16, KL_F32, 1, 1, KL_F32},   /* all dimensioned: plain promotion */
		{KL_BF16, KL_F16, 1, 1, KL_F32},
		{KL_I64, KL_F16, 1, 1, KL_F16},
	};
	char w[160];
	for (size_t i = 0; i < sizeof tc / sizeof tc[0]; i++) {
		const rt_case *c = &tc[i];
		kl_tensor *a = kltest_rand(ctx, c->a, c->na, (int64_t[]){3, 2}, KLTEST_SMALLINT,
		                           KLTEST_CONTIG, 100 + i);
		kl_tensor *b = kltest_rand(ctx, c->b, c->nb, (int64_t[]){3, 2}, KLTEST_SMALLINT,
		                           KLTEST_CONTIG, 200 + i);
		kl_tensor *r = kl_add(a, b);
		kl_tensor *m = kl_mul(b, a);
		if (!r || !m || kl_tensor_dtype(r) != c->want || kl_tensor_dtype(m) != c->want) {
			fprintf(stderr, "FAIL result type of %s[%d] + %s[%d]: %s, torch gives %s\n",
			        kl_dtype_name(c->a), c->na, kl_dtype_name(c->b), c->nb,
			        r ? kl_dtype_name(kl_tensor_dtype(r)) : kl_last_error(ctx),
			        kl_dtype_name(c->want));
			fails++;
		} else {
			/* and the values are the op's in that dtype */
			kl_tensor *in[2] = {a, b};
			snprintf(w, sizeof w, "add %s[%d] %s[%d]", kl_dtype_name(c->a), c->na,
			         kl_dtype_name(c->b), c->nb);
			const kcase k = {.op = KL_OP_ADD, .nin = 2};
			if (!kltest_check_op(ctx, w, apply, 2, in, &k, 1))
				fails++;
		}
		kl_release(r);
		kl_release(m);
		kl_release(a);
		kl_release(b);
	}

	/* the case: a -inf mask value as an f32 scalar keeps f16 scores f16,
	 * so the product after it still takes them */
	kl_tensor *s = kltest_rand(ctx, KL_F16, 2, (int64_t[]){4, 4}, KLTEST_NORMAL, KLTEST_CONTIG, 7);
	kl_tensor *mask = kltest_rand(ctx, KL_BOOL, 2, (int64_t[]){4, 4}, KLTEST_NORMAL,
	                              KLTEST_CONTIG, 8);
	kl_tensor *ninf = kl_scalar(ctx, KL_F32, -INFINITY);
	kl_tensor *wm = kl_where(mask, s, ninf);
	if (!wm || kl_tensor_dtype(wm) != KL_F16) {
		fprintf(stderr, "FAIL kl_where(mask, f16, f32 0-dim) is %s, torch keeps f16\n",
		        wm ? kl_dtype_name(kl_tensor_dtype(wm)) : kl_last_error(ctx));
		fails++;
	} else {
		kl_scope_begin(ctx);
		if (!kl_matmul(kl_softmax(wm, -1), s)) {
			fprintf(stderr, "FAIL the product after the masked scores: %s\n",
			        kl_last_error(ctx));
			fails++;
		}
		kl_scope_end(ctx);
		kl_tensor *in[3] = {mask, s, ninf};
		const kcase k = {.op = KL_OP_WHERE, .nin = 3};
		if (!kltest_check_op(ctx, "where(mask, f16, -inf f32 0-dim)", apply, 3, in, &k, 0))
			fails++;
	}
	kl_release(wm);
	kl_release(ninf);
	kl_release(mask);
	kl_release(s);
	/* numbers: the default dtype of their category, only across categories */
	static const struct {
		kl_dtype a;
		double s;
		kl_dtype want;
	} sc[] = {{KL_I32, 2, KL_I32}, {KL_I32, 2.5, KL_F32}, {KL_BOOL, 3, KL_I64},
	          {KL_F16, 2.5, KL_F16}, {KL_BOOL, 0.5, KL_F32}, {KL_BF16, 1e30, KL_BF16}};
	for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
		kl_tensor *a = kltest_rand(ctx, sc[i].a, 1, (int64_t[]){3}, KLTEST_SMALLINT,
		                           KLTEST_CONTIG, 300 + i);
		kl_tensor *r = kl_add_scalar(a, sc[i].s);
		if (!r || kl_tensor_dtype(r) != sc[i].want) {
			fprintf(stderr, "FAIL %s + %g: %s, torch gives %s\n", kl_dtype_name(sc[i].a),
			        sc[i].s, r ? kl_dtype_name(kl_tensor_dtype(r)) : kl_last_error(ctx),
			        kl_dtype_name(sc[i].want));
			fails++;
		}
		kl_release(r);
		kl_release(a);
	}
	assert_int_equal(fails, 0);
}

static int reset(void **state)
{
	(void)state;
	fails = 0;
	kl_clear_error(ctx);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup(test_table_complete, reset),
		cmocka_unit_test_setup(test_result_type, reset),
		cmocka_unit_test_setup(test_walk, reset),
		cmocka_unit_test_setup(test_walk_generic_eager, reset),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
