/* shape.h - overflow-checked shape arithmetic, the one place where kiln
 * multiplies dims: element counts, contiguous strides, byte sizes, slice
 * lengths, reshape targets and broadcasting.
 *
 * The rule every tensor shape and every graph node's shape is held to
 * (kl__shape_check): ndim in [0, KL_MAX_DIMS], every dim >= 0, and the
 * dims multiply to at most KL_MAX_NUMEL with a zero dim counted as 1. A shape
 * that passes has a numel, contiguous strides and a byte size (numel * 8 at
 * most 2^62) that fit an int64_t, and so does any product of a subset of its
 * dims: code that walks a checked shape (loops over rows, stride sums) cannot
 * overflow, and an empty tensor cannot hide a loop of 2^62 empty rows.
 *
 * Every checked function here returns false (or a kl_shape_err other than
 * KL_SHAPE_OK) instead of overflowing; none of them formats a message, so
 * that each caller names its own public call. Leaf module: it includes
 * nothing of kiln but the public header.
 */
#ifndef KILN_SHAPE_H
#define KILN_SHAPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kiln.h"

typedef enum kl_shape_err {
	KL_SHAPE_OK = 0,
	KL_SHAPE_NDIM,      /* ndim outside [0, KL_MAX_DIMS] */
	KL_SHAPE_NEGATIVE,  /* a dim below 0 */
	KL_SHAPE_TOO_LARGE, /* the dims (zeros counted as 1) multiply past KL_MAX_NUMEL */
	KL_SHAPE_INFER,     /* reshape: a -1 that cannot be inferred, or two of them */
	KL_SHAPE_MISMATCH   /* reshape: the element counts differ */
} kl_shape_err;

/* Checks a shape against the rule above. *bad (may be NULL) gets the dim at
 * fault for KL_SHAPE_NEGATIVE, else -1. */
kl_shape_err kl__shape_check(int ndim, const int64_t *shape, int *bad);
/* Why a shape was refused, as a phrase for a message: "dim 1 is -3",
 * "more than 2^59 elements (KL_MAX_NUMEL; a zero dim counts as 1)". */
const char *kl__shape_why(char *buf, size_t cap, kl_shape_err e, int ndim, const int64_t *shape,
                          int bad);

/* a * b for dims and strides; false when the result leaves int64_t */
static inline bool kl__mul_i64(int64_t a, int64_t b, int64_t *out)
{
	return !__builtin_mul_overflow(a, b, out);
}

/* The product of n dims (each >= 0), exact: 0 when any dim is 0 whatever the
 * others. False when a dim is negative or the product passes KL_MAX_NUMEL. */
bool kl__dims_product(int n, const int64_t *dims, int64_t *out);

/* numel of a shape that passed kl__shape_check (always exact then). On an
 * unchecked shape it saturates at INT64_MAX instead of wrapping. */
int64_t kl__numel(int ndim, const int64_t *shape);

/* Row-major strides in elements; size-0 and size-1 dims step like size 1,
 * as in torch. True for every checked shape; false when a stride would
 * leave int64_t (the strides are then saturated, never wrapped). */
bool kl__contig_strides(int ndim, const int64_t *shape, int64_t *strides);

/* numel * elsize of a dense tensor: false for a shape kl__shape_check
 * refuses or a byte size beyond SIZE_MAX. */
bool kl__shape_nbytes(int ndim, const int64_t *shape, size_t elsize, size_t *nbytes);

/* Python's a[start:stop:step] over a dim of size (>= 0), step >= 1: negative
 * bounds count from the end, then both clamp to [0, size] and stop to
 * >= start (torch's rule). *start and *stop are replaced by the normalized
 * bounds; *len is the number of elements taken, ceil((stop - start) / step),
 * computed without overflow for any step up to INT64_MAX. False for
 * step < 1 or size < 0. */
bool kl__slice_len(int64_t size, int64_t *start, int64_t *stop, int64_t step, int64_t *len);
/* The stride of a sliced dim: stride * step when the slice takes two or more
 * elements (then it cannot overflow for a checked base), else stride itself
 * (never stepped along). False on overflow. */
bool kl__slice_stride(int64_t stride, int64_t step, int64_t len, int64_t *out);

/* The target of a reshape of numel elements: want[] may hold one -1, which is
 * inferred. out[] gets the shape (ndim entries). KL_SHAPE_NEGATIVE for a dim
 * below -1 (*bad names it), KL_SHAPE_INFER for a second -1, a -1 beside a
 * zero product or one no size satisfies, KL_SHAPE_TOO_LARGE when the known dims pass KL_MAX_NUMEL or
 * the result fails kl__shape_check, KL_SHAPE_MISMATCH when the counts differ. */
kl_shape_err kl__reshape_shape(int64_t numel, int ndim, const int64_t *want, int64_t *out, int *bad);

/* Two shapes are the same: equal ranks, equal dims. */
static inline bool kl__shape_eq(int na, const int64_t *a, int nb, const int64_t *b)
{
	if (na != nb)
		return false;
	for (int d = 0; d < na; d++)
		if (a[d] != b[d])
			return false;
	return true;
}

/* numpy broadcasting of two shapes; false if they do not broadcast. The
 * result's size is not checked here: it is a node shape, which dispatch
 * checks with kl__shape_check like every other. */
bool kl__broadcast(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out);
/* Strides that read a tensor of (ndim, shape, strides) as the broadcast
 * shape (ondim, oshape): 0 along broadcast dims. */
void kl__broadcast_strides(int ndim, const int64_t *shape, const int64_t *strides, int ondim,
                           const int64_t *oshape, int64_t *ostrides);

#endif /* KILN_SHAPE_H */
