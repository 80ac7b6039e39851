/* shape.c - overflow-checked shape arithmetic (see shape.h for the rule every
 * shape is held to). Every product here goes through __builtin_mul_overflow
 * or is bounded by KL_MAX_NUMEL before it is formed.
 */
#include "core/core.h"
#include "core/shape.h"

#include <inttypes.h>
#include <stdio.h>

/* The product of max(d, 1) over the dims, or false past KL_MAX_NUMEL. */
static bool span(int ndim, const int64_t *shape, int64_t *out)
{
	int64_t s = 1;
	for (int i = 0; i < ndim; i++) {
		int64_t d = shape[i] > 1 ? shape[i] : 1;
		if (!kl__mul_i64(s, d, &s) || s > KL_MAX_NUMEL)
			return false;
	}
	*out = s;
	return true;
}

kl_shape_err kl__shape_check(int ndim, const int64_t *shape, int *bad)
{
	if (bad)
		*bad = -1;
	if (ndim < 0 || ndim > KL_MAX_DIMS)
		return KL_SHAPE_NDIM;
	for (int i = 0; i < ndim; i++)
		if (shape[i] < 0) {
			if (bad)
				*bad = i;
			return KL_SHAPE_NEGATIVE;
		}
	int64_t s;
	return span(ndim, shape, &s) ? KL_SHAPE_OK : KL_SHAPE_TOO_LARGE;
}

const char *kl__shape_why(char *buf, size_t cap, kl_shape_err e, int ndim, const int64_t *shape,
                          int bad)
{
	switch (e) {
	case KL_SHAPE_OK:
		snprintf(buf, cap, "valid");
		break;
	case KL_SHAPE_NDIM:
		snprintf(buf, cap, "ndim %d is outside [0,%d]", ndim, KL_MAX_DIMS);
		break;
	case KL_SHAPE_NEGATIVE:
		if (bad >= 0 && bad < ndim)
			snprintf(buf, cap, "dim %d is %lld (dims must be >= 0)", bad,
			         (long long)shape[bad]);
		else
			snprintf(buf, cap, "a dim is negative");
		break;
	case KL_SHAPE_TOO_LARGE:
		snprintf(buf, cap,
		         "its dims multiply past 2^59 (KL_MAX_NUMEL; a zero dim counts as 1)");
		break;
	case KL_SHAPE_INFER:
		snprintf(buf, cap,
		         "the -1 cannot be inferred (no size gives the element count, a second "
		         "-1, or a zero dim beside it)");
		break;
	case KL_SHAPE_MISMATCH:
		snprintf(buf, cap, "the element counts differ");
		break;
	}
	return buf;
}

bool kl__dims_product(int n, const int64_t *dims, int64_t *out)
{
	bool zero = false;
	int64_t p = 1;
	for (int i = 0; i < n; i++) {
		if (dims[i] < 0)
			return false;
		zero |= dims[i] == 0;
	}
	if (zero) {
		*out = 0;
		return true;
	}
	for (int i = 0; i < n; i++)
		if (!kl__mul_i64(p, dims[i], &p) || p > KL_MAX_NUMEL)
			return false;
	*out = p;
	return true;
}

int64_t kl__numel(int ndim, const int64_t *shape)
{
	int64_t n = 1;
	for (int i = 0; i < ndim; i++)
		if (shape[i] == 0)
			return 0;
	for (int i = 0; i < ndim; i++)
		if (!kl__mul_i64(n, shape[i], &n))
			return INT64_MAX;
	return n;
}

bool kl__contig_strides(int ndim, const int64_t *shape, int64_t *strides)
{
	int64_t s = 1;
	bool ok = true;
	for (int i = ndim - 1; i >= 0; i--) {
		strides[i] = s;
		/* size-0 dims would zero every outer stride; torch keeps them >= 1 */
		if (!kl__mul_i64(s, shape[i] > 1 ? shape[i] : 1, &s)) {
			s = INT64_MAX;
			ok = false;
		}
	}
	return ok;
}

bool kl__shape_nbytes(int ndim, const int64_t *shape, size_t elsize, size_t *nbytes)
{
	if (kl__shape_check(ndim, shape, NULL) != KL_SHAPE_OK)
		return false;
	/* numel <= 2^59 here; the product is still checked for any elsize */
	return !__builtin_mul_overflow((uint64_t)kl__numel(ndim, shape), (uint64_t)elsize, nbytes);
}

bool kl__slice_len(int64_t size, int64_t *start, int64_t *stop, int64_t step, int64_t *len)
{
	if (step < 1 || size < 0)
		return false;
	int64_t a = *start, b = *stop;
	/* a < -size means a + size < 0: no overflow, a + size is formed only
	 * for a in [-size, 0) */
	if (a < 0)
		a = a < -size ? 0 : a + size;
	if (b < 0)
		b = b < -size ? 0 : b + size;
	if (a > size)
		a = size;
	if (b > size)
		b = size;
	if (b < a)
		b = a;
	*start = a;
	*stop = b;
	/* ceil((b - a) / step) without b - a + step - 1, which overflows for
	 * large steps */
	*len = b == a ? 0 : 1 + (b - a - 1) / step;
	return true;
}

bool kl__slice_stride(int64_t stride, int64_t step, int64_t len, int64_t *out)
{
	if (len < 2) {
		*out = stride;
		return true;
	}
	return kl__mul_i64(stride, step, out);
}

kl_shape_err kl__reshape_shape(int64_t numel, int ndim, const int64_t *want, int64_t *out, int *bad)
{
	if (bad)
		*bad = -1;
	if (ndim < 0 || ndim > KL_MAX_DIMS)
		return KL_SHAPE_NDIM;
	int infer = -1;
	for (int i = 0; i < ndim; i++) {
		out[i] = want[i];
		if (want[i] == -1) {
			if (infer >= 0)
				return KL_SHAPE_INFER;
			infer = i;
			out[i] = 1; /* a placeholder for the product below */
		} else if (want[i] < 0) {
			if (bad)
				*bad = i;
			return KL_SHAPE_NEGATIVE;
		}
	}
	int64_t known;
	if (!kl__dims_product(ndim, out, &known))
		return KL_SHAPE_TOO_LARGE;
	if (infer >= 0) {
		if (known == 0)
			return KL_SHAPE_INFER;
		if (numel % known)
			return KL_SHAPE_INFER;
		out[infer] = numel / known;
		known = numel;
	}
	if (known != numel)
		return KL_SHAPE_MISMATCH;
	return kl__shape_check(ndim, out, bad);
}

bool kl__broadcast(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout, int64_t *out)
{
	int n = na > nb ? na : nb;
	if (n > KL_MAX_DIMS)
		return false;
	for (int i = 0; i < n; i++) {
		int ia = na - n + i, ib = nb - n + i;
		int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
		if (da == db || db == 1)
			out[i] = da;
		else if (da == 1)
			out[i] = db;
		else
			return false;
	}
	*nout = n;
	return true;
}

void kl__broadcast_strides(int ndim, const int64_t *shape, const int64_t *strides, int ondim,
                           const int64_t *oshape, int64_t *ostrides)
{
	for (int i = 0; i < ondim; i++) {
		int j = ndim - ondim + i;
		if (j < 0 || (shape[j] == 1 && oshape[i] != 1))
			ostrides[i] = 0;
		else
			ostrides[i] = strides[j];
	}
}
const char *kl__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
	size_t k = 0;
	if (cap == 0)
		return buf;
	buf[0] = '\0';
	k += (size_t)snprintf(buf + k, cap - k, "[");
	for (int i = 0; i < ndim && k < cap; i++)
		k += (size_t)snprintf(buf + k, cap - k, "%s%" PRId64, i ? "," : "", shape[i]);
	if (k < cap)
		snprintf(buf + k, cap - k, "]");
	return buf;
}

