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

/* The conversions, written once as a macro so that the same text is
 * compiled into kiln (kl__f16_to_f32, kl__f32_to_f16, kl__bf16_to_f32,
 * kl__f32_to_bf16, and the round trips kl__f32_round_f16 / _bf16: a float
 * rounded to the half type's values, still a float) and, stringified, into
 * the prelude of every generated C translation unit (kl_h2f, kl_f2h, kl_rh,
 * kl_bf2f, kl_f2bf, kl_rbf), as sat.h does for float -> int: the library
 * and generated code cannot drift. No branch: every case is computed and
 * one picked by selects, so that a simd loop over them vectorizes (the
 * branchy forms kept an f16 kernel scalar, relu(a*b + c) 4096^2 at 10x the
 * f32 time). An f16 value widens as its bits moved up, times 2^112 (exact:
 * a subnormal becomes the f32 value m 2^-24), inf and NaN given the full
 * exponent; narrowing rounds the 13 dropped bits to nearest even by integer
 * adds, a value below 2^-14 adds 0.5 (the FPU then rounds at the f16
 * subnormal spacing, 2^-24 being the ulp of 0.5), 65520 and up is inf, NaN
 * keeps its top payload bits and is made quiet. bf16 is f32's top half,
 * rounded the same way. A round trip equals the narrowing then the widening
 * bit for bit (test_core checks every float).
 *
 * KL_HALFCONV_DEFS(Q, H2F, F2H, RH, BF2F, F2BF, RBF): Q qualifies each
 * function (static inline; the generated text's KL_FN), the rest are their
 * names. */
#define KL_HALFCONV_DEFS(Q, H2F, F2H, RH, BF2F, F2BF, RBF)                                             \
	Q float H2F(uint16_t h)                                                                \
	{                                                                                      \
		uint32_t o = (uint32_t)(h & 0x7fffu) << 13, r;                                 \
		float f;                                                                       \
		memcpy(&f, &o, 4);                                                             \
		f *= 5.192296858534827628530496329220096e33f; /* 2^112 */                      \
		memcpy(&r, &f, 4);                                                             \
		r = o >= 0x0f800000u ? r | 0x7f800000u : r;                                    \
		r |= (uint32_t)(h & 0x8000u) << 16;                                            \
		memcpy(&f, &r, 4);                                                             \
		return f;                                                                      \
	}                                                                                      \
	Q uint16_t F2H(float f)                                                                \
	{                                                                                      \
		uint32_t x, ax, sub;                                                           \
		memcpy(&x, &f, 4);                                                             \
		ax = x & 0x7fffffffu;                                                          \
		float a;                                                                       \
		memcpy(&a, &ax, 4);                                                            \
		a += 0.5f;                                                                     \
		memcpy(&sub, &a, 4);                                                           \
		sub -= 0x3f000000u;                                                            \
		uint32_t nrm = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;                   \
		uint32_t r = ax > 0x7f800000u    ? 0x7e00u | ((ax >> 13) & 0x3ffu)             \
		             : ax >= 0x477ff000u ? 0x7c00u                                     \
		             : ax < 0x38800000u  ? sub                                         \
		                                 : nrm;                                        \
		return (uint16_t)(((x >> 16) & 0x8000u) | r);                                  \
	}                                                                                      \
	Q float RH(float x)                                                                    \
	{                                                                                      \
		uint32_t u, a, sub, r;                                                         \
		memcpy(&u, &x, 4);                                                             \
		a = u & 0x7fffffffu;                                                           \
		float f;                                                                       \
		memcpy(&f, &a, 4);                                                             \
		f = (f + 0.5f) - 0.5f;                                                         \
		memcpy(&sub, &f, 4);                                                           \
		uint32_t nrm = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;                  \
		r = a > 0x7f800000u    ? (a | 0x00400000u) & 0xffffe000u                       \
		    : a >= 0x477ff000u ? 0x7f800000u                                           \
		    : a < 0x38800000u  ? sub                                                   \
		                       : nrm;                                                  \
		r |= u & 0x80000000u;                                                          \
		memcpy(&f, &r, 4);                                                             \
		return f;                                                                      \
	}                                                                                      \
	Q float BF2F(uint16_t h)                                                               \
	{                                                                                      \
		uint32_t x = (uint32_t)h << 16;                                                \
		float f;                                                                       \
		memcpy(&f, &x, 4);                                                             \
		return f;                                                                      \
	}                                                                                      \
	Q uint16_t F2BF(float f)                                                               \
	{                                                                                      \
		uint32_t x;                                                                    \
		memcpy(&x, &f, 4);                                                             \
		uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;                           \
		return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40u : r);    \
	}                                                                                      \
	Q float RBF(float x)                                                                   \
	{                                                                                      \
		uint32_t u;                                                                    \
		memcpy(&u, &x, 4);                                                             \
		u = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x00400000u                          \
		                                    : u + 0x7fffu + ((u >> 16) & 1u);          \
		u &= 0xffff0000u;                                                              \
		memcpy(&x, &u, 4);                                                             \
		return x;                                                                      \
	}

KL_HALFCONV_DEFS(static inline, kl__f16_to_f32, kl__f32_to_f16, kl__f32_round_f16,
                 kl__bf16_to_f32, kl__f32_to_bf16, kl__f32_round_bf16)

#define KL_HALF_STR_(...) #__VA_ARGS__
#define KL_HALF_XSTR_(...) KL_HALF_STR_(__VA_ARGS__)
/* the definitions as generated-source text (KL_FN is the prelude's qualifier) */
#define KL_HALFCONV_TEXT KL_HALF_XSTR_(KL_HALFCONV_DEFS(KL_FN, kl_h2f, kl_f2h, kl_rh, kl_bf2f, kl_f2bf, kl_rbf)) "\n"

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
