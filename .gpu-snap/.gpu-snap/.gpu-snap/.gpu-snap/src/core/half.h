/* half.h - f16 and bf16 conversions, inline so that per-element loops in the
 * backends inline them; the one implementation in the library (generated
 * kernels carry their own copy in the source they emit). Round to nearest
 * even; NaN stays NaN (quiet, top payload bits kept); f64 narrows in one
 * correct rounding through float rounded to odd.
 */
#ifndef KILN_HALF_H
#define KILN_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t kl__f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static inline float kl__bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static inline float kl__f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t em = h & 0x7fffu;
	if (em >= 0x7c00u) /* inf, NaN: all-ones exponent, mantissa moved up */
		return kl__bits_f32(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
	if (em < 0x0400u) { /* zero, subnormal: exact as mantissa * 2^-24 */
		float f = (float)em * 0x1p-24f;
		return sign ? -f : f;
	}
	return kl__bits_f32(sign | ((em << 13) + ((uint32_t)(127 - 15) << 23)));
}

static inline uint16_t kl__f32_to_f16(float f)
{
	uint32_t x = kl__f32_bits(f);
	uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
	uint32_t ax = x & 0x7fffffffu;
	if (ax > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
		return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
	if (ax >= 0x477ff000u) /* >= 65520 rounds to infinity */
		return (uint16_t)(sign | 0x7c00u);
	if (ax < 0x38800000u) {
		/* below 2^-14: adding 0.5 makes the FPU round at the f16
		 * subnormal spacing (2^-24 is the ulp of 0.5f) */
		float a = kl__bits_f32(ax) + 0.5f;
		return (uint16_t)(sign | (kl__f32_bits(a) - 0x3f000000u));
	}
	/* rebias the exponent and round the 13 dropped bits to nearest even */
	ax += 0xc8000fffu + ((ax >> 13) & 1u);
	return (uint16_t)(sign | (ax >> 13));
}

static inline float kl__bf16_to_f32(uint16_t h)
{
	return kl__bits_f32((uint32_t)h << 16);
}

static inline uint16_t kl__f32_to_bf16(float f)
{
	uint32_t x = kl__f32_bits(f);
	if ((x & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((x >> 16) | 0x40u);
	x += 0x7fffu + ((x >> 16) & 1u);
	return (uint16_t)(x >> 16);
}

/* double to f16/bf16 in one correct rounding, as kl__store does it: round
 * to float with the sticky "round to odd" rule first, so that the second
 * rounding cannot land on a false tie. */
static inline float kl__f64_to_f32_odd(double v)
{
	float f = (float)v;
	if (!(v == v) || (double)f == v)
		return f;
	uint32_t u = kl__f32_bits(f);
	if (fabs((double)f) > fabs(v))
		u--; /* step the magnitude toward zero: truncation */
	return kl__bits_f32(u | 1u);
}

static inline uint16_t kl__f64_to_f16(double v)
{
	return kl__f32_to_f16(kl__f64_to_f32_odd(v));
}

static inline uint16_t kl__f64_to_bf16(double v)
{
	return kl__f32_to_bf16(kl__f64_to_f32_odd(v));
}

#endif /* KILN_HALF_H */
