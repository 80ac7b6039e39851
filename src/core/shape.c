/* shape.c - shape helpers: element counts, dense strides, printing, numpy
 * broadcasting.
 */
#include <inttypes.h>
#include <stdio.h>

#include "core/core.h"

int64_t kl__numel(int ndim, const int64_t *shape)
{
	int64_t n = 1;
	for (int i = 0; i < ndim; i++)
		n *= shape[i];
	return n;
}

void kl__contig_strides(int ndim, const int64_t *shape, int64_t *strides)
{
	int64_t s = 1;
	for (int i = ndim - 1; i >= 0; i--) {
		strides[i] = s;
		/* size-0 dims would zero every outer stride; torch keeps them >= 1 */
		s *= shape[i] > 1 ? shape[i] : 1;
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
