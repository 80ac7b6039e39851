/* row_onepass.h - two passes of a row kernel that one cross-thread
 * reduction can serve: the patterns, found in the kernel IR (not by the name
 * of the op that made them), that a renderer whose rows are split over
 * threads reduces with one merge of per-thread partial results.
 *
 *   LSE: pass p reduces m = max(v), pass p+1 s = sum(exp(v - M)), M = m
 *        through float casts (softmax, log_softmax): a thread keeps its own
 *        (max, sum of exp(v - own max)); the pairs merge, each sum rescaled
 *        by exp(own max - merged max).
 *   VAR: pass p reduces s = sum(v), pass p+1 q = sum((v - M)^2), M = s / n
 *        through float casts (layer norm, var): a thread keeps its own
 *        (count, sum, squared deviations from its own mean); they merge with
 *        Chan's parallel formula, and q = M2 + n (s/n - M)^2 after.
 *
 * In both, v in pass p+1 is the same expression as in pass p, the value M
 * feeds nothing else in pass p+1 but that chain (LSE: row-local arrays may
 * hold a rounding of the exp, rescaled where they are read), and each of
 * the two passes has one accumulator.
 */
#ifndef KILN_ROW_ONEPASS_H
#define KILN_ROW_ONEPASS_H

#include "lower/kernel_ir.h"

typedef enum kl_onepass_kind { KL_ONEPASS_NONE, KL_ONEPASS_LSE, KL_ONEPASS_VAR } kl_onepass_kind;

typedef struct kl_onepass {
	kl_onepass_kind kind;
	int p;          /* the first of the two passes */
	int32_t acc_a;  /* pass p's accumulator (max or sum) */
	int32_t acc_b;  /* pass p+1's (a sum) */
	int32_t m;      /* M, the value pass p+1 subtracts (block 2p) */
	int64_t n;      /* VAR: the count M divides by (the row length) */
	/* LSE: per row-local array that pass p+1 fills, the instruction whose
	 * value it holds (the exp or a rounding of it), else -1 */
	int32_t held[KIR_MAX_LOCAL];
	int32_t exp;    /* LSE: the exp */
} kl_onepass;

/* KILN_CUDA_ROW_ONEPASS: 1 (the default) unless it is "0". Part of the
 * compiled programs' cache key. */
int kl__cuda_row_onepass(void);

/* Passes p and p + 1 of row kernel k (live: kl__render_live) as one of the
 * patterns above; rn: the static row length (0: not static). False (and
 * op->kind NONE) when they are not, or when out of memory. */
bool kl__onepass_match(const kir_kernel *k, const uint8_t *live, int p, int64_t rn,
                       kl_onepass *op);

#endif /* KILN_ROW_ONEPASS_H */
