/* dtype.c - dtype names and sizes, torch's type promotion, and the exact
 * conversions between f32/f64 and the 16-bit float formats and integers that
 * every backend and the reference interpreter share.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "core/core.h"
#include "core/sat.h"

static const char *const dtype_names[KL_NDTYPES] = {"f32", "f64", "f16", "bf16",
                                                    "i32", "i64", "bool"};
static const size_t dtype_sizes[KL_NDTYPES] = {4, 8, 2, 2, 4, 8, 1};

const char *kl_dtype_name(kl_dtype dt)
{
	return (unsigned)dt < KL_NDTYPES ? dtype_names[dt] : "?";
}

size_t kl_dtype_size(kl_dtype dt)
{
	return (unsigned)dt < KL_NDTYPES ? dtype_sizes[dt] : 0;
}

bool kl_dtype_is_float(kl_dtype dt)
{
	return dt == KL_F32 || dt == KL_F64 || dt == KL_F16 || dt == KL_BF16;
}

/* bool < int < float; a wider category wins outright (i64 + f16 -> f16, as
 * in torch); within a category the wider type wins, and the two 16-bit
 * floats, neither of which holds the other, meet at f32. */
kl_dtype kl_promote_types(kl_dtype a, kl_dtype b)
{
	if (a == b)
		return a;
	int ca = a == KL_BOOL ? 0 : kl_dtype_is_float(a) ? 2 : 1;
	int cb = b == KL_BOOL ? 0 : kl_dtype_is_float(b) ? 2 : 1;
	if (ca != cb)
		return ca > cb ? a : b;
	if (ca == 1)
		return KL_I64; /* i32 with i64 */
	if (a == KL_F64 || b == KL_F64)
		return KL_F64;
	return KL_F32; /* f32 with a 16-bit float, or f16 with bf16 */
}

double kl__load(const void *p, kl_dtype dt, int64_t i)
{
	switch (dt) {
	case KL_F32:
		return ((const float *)p)[i];
	case KL_F64:
		return ((const double *)p)[i];
	case KL_F16:
		return kl__f16_to_f32(((const uint16_t *)p)[i]);
	case KL_BF16:
		return kl__bf16_to_f32(((const uint16_t *)p)[i]);
	case KL_I32:
		return ((const int32_t *)p)[i];
	case KL_I64:
		return (double)((const int64_t *)p)[i];
	case KL_BOOL:
		return ((const uint8_t *)p)[i] ? 1.0 : 0.0;
	default:
		return 0.0;
	}
}

void kl__store(void *p, kl_dtype dt, int64_t i, double v)
{
	switch (dt) {
	case KL_F32:
		((float *)p)[i] = (float)v;
		break;
	case KL_F64:
		((double *)p)[i] = v;
		break;
	case KL_F16:
		((uint16_t *)p)[i] = kl__f64_to_f16(v);
		break;
	case KL_BF16:
		((uint16_t *)p)[i] = kl__f64_to_bf16(v);
		break;
	case KL_I32:
		((int32_t *)p)[i] = kl__f2i32(v);
		break;
	case KL_I64:
		((int64_t *)p)[i] = kl__f2i64(v);
		break;
	case KL_BOOL:
		((uint8_t *)p)[i] = v != 0; /* NaN is true, as bool(nan) in torch */
		break;
	default:
		break;
	}
}

double kl__round_to(kl_dtype dt, double v)
{
	switch (dt) {
	case KL_F32:
		return (float)v;
	case KL_F64:
		return v;
	case KL_F16:
		return kl__f16_to_f32(kl__f64_to_f16(v));
	case KL_BF16:
		return kl__bf16_to_f32(kl__f64_to_bf16(v));
	case KL_I32:
		return kl__f2i32(v);
	case KL_I64:
		return (double)kl__f2i64(v);
	case KL_BOOL:
		return v != 0 ? 1.0 : 0.0;
	default:
		return v;
	}
}
