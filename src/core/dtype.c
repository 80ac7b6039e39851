/* dtype.c - dtype names and sizes, torch's type promotion, and the exact
 * conversions between f32/f64 and the 16-bit float formats and integers that
 * every backend and the reference interpreter share.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "core/core.h"

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

static uint32_t f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static float bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

float kl__f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
	if (exp == 0x1f)
		return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf, NaN payload kept */
	if (exp != 0)
		return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
	if (mant == 0)
		return bits_f32(sign);
	/* subnormal: mant * 2^-24; shift the leading one up to the hidden bit */
	int e = -14;
	while (!(mant & 0x400)) {
		mant <<= 1;
		e--;
	}
	return bits_f32(sign | ((uint32_t)(e + 127) << 23) | ((mant & 0x3ff) << 13));
}

uint16_t kl__f32_to_f16(float f)
{
	uint32_t x = f32_bits(f);
	uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
	uint32_t ax = x & 0x7fffffffu;
	if (ax >= 0x7f800000u) {
		if (ax == 0x7f800000u)
			return sign | 0x7c00;
		return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff)); /* quiet NaN */
	}
	/* 65520 is halfway between 65504 (max f16, odd mantissa) and 65536:
	 * ties-to-even goes up, so it and everything above is inf */
	if (ax >= 0x477ff000u)
		return sign | 0x7c00;
	if (ax < 0x38800000u) {        /* below 2^-14: f16 subnormal or zero */
		if (ax <= 0x33000000u) /* <= 2^-25, half the least subnormal: tie to 0 */
			return sign;
		uint32_t mant = (ax & 0x7fffff) | 0x800000;
		int shift = 126 - (int)(ax >> 23); /* 14..24 */
		uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1),
		         half = 1u << (shift - 1);
		if (rem > half || (rem == half && (r & 1)))
			r++;
		return (uint16_t)(sign | r); /* r == 0x400 is the least normal: right */
	}
	uint32_t h = (ax >> 13) - (112u << 10), rem = ax & 0x1fff;
	if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
		h++; /* a carry into the exponent is the correct rounding */
	return (uint16_t)(sign | h);
}

float kl__bf16_to_f32(uint16_t h)
{
	return bits_f32((uint32_t)h << 16);
}

uint16_t kl__f32_to_bf16(float f)
{
	uint32_t x = f32_bits(f);
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40); /* keep sign and top payload, force quiet */
	x += 0x7fffu + ((x >> 16) & 1);              /* overflow to inf is the right rounding */
	return (uint16_t)(x >> 16);
}

/* double -> float rounded to odd: truncate, then set the last bit if
 * anything was lost. Rounding that to a format with at least two fewer
 * mantissa bits (f16: 11, bf16: 8) is then exactly the correct rounding of
 * the double, which double -> float (nearest) -> f16 is not. */
static float f32_round_odd(double v)
{
	float f = (float)v;
	if (isnan(v) || (double)f == v)
		return f;
	if (fabs((double)f) > fabs(v))
		f = nextafterf(f, 0.0f);
	return bits_f32(f32_bits(f) | 1u);
}

static uint16_t f64_to_f16(double v)
{
	return kl__f32_to_f16(f32_round_odd(v));
}

static uint16_t f64_to_bf16(double v)
{
	return kl__f32_to_bf16(f32_round_odd(v));
}

/* float -> integer conversion that C leaves undefined out of range:
 * saturate, and NaN becomes 0, the way the backends are told to */
static int32_t sat_i32(double v)
{
	if (isnan(v))
		return 0;
	if (v >= 2147483647.0)
		return INT32_MAX;
	if (v <= -2147483648.0)
		return INT32_MIN;
	return (int32_t)v;
}

static int64_t sat_i64(double v)
{
	if (isnan(v))
		return 0;
	if (v >= 9223372036854775808.0)
		return INT64_MAX;
	if (v <= -9223372036854775808.0)
		return INT64_MIN;
	return (int64_t)v;
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
		((uint16_t *)p)[i] = f64_to_f16(v);
		break;
	case KL_BF16:
		((uint16_t *)p)[i] = f64_to_bf16(v);
		break;
	case KL_I32:
		((int32_t *)p)[i] = sat_i32(v);
		break;
	case KL_I64:
		((int64_t *)p)[i] = sat_i64(v);
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
		return kl__f16_to_f32(f64_to_f16(v));
	case KL_BF16:
		return kl__bf16_to_f32(f64_to_bf16(v));
	case KL_I32:
		return sat_i32(v);
	case KL_I64:
		return (double)sat_i64(v);
	case KL_BOOL:
		return v != 0 ? 1.0 : 0.0;
	default:
		return v;
	}
}
