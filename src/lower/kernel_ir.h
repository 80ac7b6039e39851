/* kernel_ir.h - the loop-level kernel IR: what one generated kernel does, as data.
 *
 * A kernel iterates a space of dims F (static or symbolic). With rmask == 0 it
 * is pointwise: every instruction runs once per point of F. Otherwise the
 * dims in rmask are reduced: the outer dims (the others) form the parallel
 * loop, and inside it the kernel makes `npass` passes over the reduced dims,
 * each pass accumulating some reductions that later passes and the stores
 * then read (softmax: pass 1 max, pass 2 sum of exp, pass 3 write).
 *
 * Instructions are in SSA form, each value numbered by its instruction; each
 * sits in a block: block 0 runs once per outer point before the first pass,
 * block 2p-1 is the body of pass p, block 2p runs after pass p. Index
 * arithmetic lives in a small arena of affine expressions over the loop
 * variables, with floor-division / modulo / clamp atoms for reshapes and
 * concatenation, simplified and interned so equal indices compare by id.
 */
#ifndef KILN_KIR_H
#define KILN_KIR_H

#include <string.h>

#include "plan/plan.h"

/* ---- index expressions ---------------------------------------------------- */

#define KL_IX_MAXT 32
#define KL_IX_UNKNOWN INT64_MAX /* an upper bound that is not known (symbolic) */

typedef enum kl_atom_kind {
	KL_AT_VAR,  /* loop variable `var` */
	KL_AT_DIV,  /* e / a (floor; e >= 0) */
	KL_AT_MOD,  /* e % a (e >= 0) */
	KL_AT_CLAMP /* min(max(e, a), b) */
} kl_atom_kind;

typedef struct kl_atom {
	uint8_t kind;
	int32_t var;
	int32_t e;    /* operand expression */
	int64_t a, b;
	int64_t lo, hi; /* value range; hi may be KL_IX_UNKNOWN */
	uint32_t vars;  /* loop variables it depends on (bit per var) */
} kl_atom;

/* c + sum k[i] * atom at[i], atoms sorted by id, no zero coefficient */
typedef struct kl_ix {
	int64_t c;
	int32_t nt;
	int32_t at[KL_IX_MAXT];
	int64_t k[KL_IX_MAXT];
	int64_t lo, hi;
	uint32_t vars;
} kl_ix;

typedef struct kl_ixa {
	kl_atom *atoms;
	int32_t natoms, cap_atoms;
	kl_ix *ex;
	int32_t nex, cap_ex;
	int64_t var_hi[KL_MAX_DIMS]; /* extent - 1 of each loop var, KL_IX_UNKNOWN if symbolic */
	bool failed;                 /* out of memory or an expression grew past KL_IX_MAXT */
} kl_ixa;

void kl__ixa_init(kl_ixa *a);
void kl__ixa_free(kl_ixa *a);
/* Each returns an interned expression id, or -1 once a->failed. */
int32_t kl__ix_const(kl_ixa *a, int64_t c);
int32_t kl__ix_var(kl_ixa *a, int var);
int32_t kl__ix_add(kl_ixa *a, int32_t x, int32_t y);
int32_t kl__ix_scale(kl_ixa *a, int32_t x, int64_t k);
int32_t kl__ix_addc(kl_ixa *a, int32_t x, int64_t c);
int32_t kl__ix_div(kl_ixa *a, int32_t x, int64_t d);
int32_t kl__ix_mod(kl_ixa *a, int32_t x, int64_t d);
int32_t kl__ix_clamp(kl_ixa *a, int32_t x, int64_t lo, int64_t hi);
static inline const kl_ix *kl__ix_get(const kl_ixa *a, int32_t id)
{
	return &a->ex[id];
}
/* The expression is k * var + c for a single var (k may be 0): true and fills them. */
bool kl__ix_affine1(const kl_ixa *a, int32_t id, int *var, int64_t *k, int64_t *c);

/* A product of a constant and symbols: c * S[s[0]-1] * ... (a dense stride). */
typedef struct kl_mono {
	int64_t c;
	int8_t ns;
	int8_t s[KL_MAX_DIMS];
} kl_mono;

/* An element address: ix + sum six[i] * sst[i] (the second part only when
 * strides are symbolic). */
typedef struct kir_addr {
	int32_t ix;
	int32_t ns;
	int32_t six[KL_MAX_DIMS];
	kl_mono sst[KL_MAX_DIMS];
} kir_addr;

/* Dense (row-major) strides of a shape whose dims may be symbols. */
void kl__mono_dense(int ndim, const int64_t *shape, const int32_t *sym, kl_mono *st);
/* The address of index ix in a buffer with strides st; false when the arena failed. */
bool kl__ix_linearize(kl_ixa *a, int ndim, const int32_t *ix, const kl_mono *st, kir_addr *out);

/* ---- instructions ---------------------------------------------------------- */

typedef enum kir_opc {
	KIR_LOAD,     /* buf at ad, converted to dt's compute type (a >= 0: a gather, below) */
	KIR_STORE,    /* a into buf at ad (dt: the buffer's dtype) */
	KIR_CONST,    /* k as dt */
	KIR_INDEX,    /* the int64 value of address ad */
	KIR_IDXLT,    /* bool: ad.ix < (int64)k */
	KIR_UNARY,    /* op(a) in dt */
	KIR_BINARY,   /* op(a, b) in dt (a, b already dt); compares: a, b in in_dt, dt BOOL */
	KIR_WHERE,    /* a (bool) ? b : c */
	KIR_CAST,     /* a from in_dt to dt (to f16/bf16: rounded, still held as f32) */
	KIR_RAND,     /* f64 uniform (op RAND) or normal (op RANDN) of (seed, a); b, c >= 0:
	               * the key is kl__rand_key(b, c) (i32 values), not seed */
	KIR_ACC_INIT, /* accumulator acc of reduction op over values of in_dt */
	KIR_ACC,      /* accumulate a into acc; b: the element's position (ARGMAX) */
	KIR_ACC_READ, /* the reduction's result as dt */
	KIR_LSTORE,   /* a into row-local array acc at ad.ix (a pass keeps a row for a later one) */
	KIR_LLOAD     /* row-local array acc at ad.ix */
} kir_opc;

#define KIR_MAX_LOCAL 8
#define KIR_ROW_CACHE 4096 /* elements a row-local array may hold */

typedef struct kir_ins {
	uint8_t opc;
	uint8_t dt;
	uint8_t in_dt;
	uint8_t blk;
	uint16_t op;  /* kl_op */
	bool inner;   /* depends on the reduced loop variables */
	int32_t a, b, c;
	int32_t buf;
	int32_t acc;
	double k;
	uint64_t seed;
	kir_addr ad;
	/* KIR_LOAD with a >= 0 (a gather): the address is ad plus
	 * clamp(a, 0, grows - 1) * gst, a the row index (an int value) */
	kl_mono gst, grows;
} kir_ins;

typedef struct kir_kernel {
	int ndim;
	kl_symdim dims[KL_MAX_DIMS];
	uint32_t rmask; /* reduced dims of F; 0: pointwise */
	int npass;      /* passes over the reduced dims (incl. a final store pass) */
	kl_ixa ixa;     /* var i is dim i of F */
	kir_ins *ins;
	int32_t nins, cap;
	int32_t nacc;
	int nloads;     /* distinct graph nodes loaded (buffers read) */
	int nlocal;     /* row-local arrays, each row_n elements of local_dt */
	uint8_t local_dt[KIR_MAX_LOCAL];
	int64_t row_n;
	/* CUDA: early[b] != 0 when buffer b may be read before kl_pdl_wait (no
	 * step of the program writes it, and this kernel's step is not the
	 * first: the kernel before it is one of the program's); NULL: none.
	 * Owned by the caller. */
	const uint8_t *early;
	/* a buffer it loads whose memory its store may take (lower.c,
	 * inplace_read), -1 none: the renderer reads it as memory that is
	 * written (no read-only cache) */
	int32_t shares;
} kir_kernel;

void kl__kir_init(kir_kernel *k);
void kl__kir_free(kir_kernel *k);
/* Appends; returns the value id or -1 when out of memory. */
int32_t kl__kir_push(kir_kernel *k, const kir_ins *in);
/* Debug listing. */
void kl__kir_print(const kir_kernel *k, FILE *f);

/* the dtype values of dt are computed in: f16/bf16 compute in f32 */
static inline kl_dtype kl__compute_dt(kl_dtype dt)
{
	return (dt == KL_F16 || dt == KL_BF16) ? KL_F32 : dt;
}

#endif /* KILN_KIR_H */
