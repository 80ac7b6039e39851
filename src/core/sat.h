/* sat.h - the one float -> integer conversion of kiln: toward zero,
 * saturating at the type's bounds, NaN to 0 (a plain C cast is undefined out
 * of range). Written once as a macro so that the same text is compiled into
 * kiln (kl__f2i32, kl__f2i64, kl__sati32) and, stringified, into the prelude
 * of every generated C and CUDA translation unit (kl_f2i32, kl_f2i64,
 * kl_sati32): the library, the reference and generated code cannot drift.
 *
 * KL_SATCONV_DEFS(Q, P): Q qualifies each function (static inline; the
 * generated text's KL_FN), P prefixes its name.
 */
#ifndef KILN_SAT_H
#define KILN_SAT_H

#include <stdint.h>

#define KL_SATCONV_DEFS(Q, P)                                                                  \
	Q int32_t P##f2i32(double v)                                                           \
	{                                                                                      \
		if (v != v)                                                                    \
			return 0;                                                              \
		if (v >= 2147483647.0)                                                         \
			return INT32_MAX;                                                      \
		if (v <= -2147483648.0)                                                        \
			return INT32_MIN;                                                      \
		return (int32_t)v;                                                             \
	}                                                                                      \
	Q int64_t P##f2i64(double v)                                                           \
	{                                                                                      \
		if (v != v)                                                                    \
			return 0;                                                              \
		if (v >= 9223372036854775807.0)                                                \
			return INT64_MAX;                                                      \
		if (v <= -9223372036854775808.0)                                               \
			return INT64_MIN;                                                      \
		return (int64_t)v;                                                             \
	}                                                                                      \
	Q int32_t P##sati32(int64_t v)                                                         \
	{                                                                                      \
		return v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v;     \
	}

KL_SATCONV_DEFS(static inline, kl__)

#define KL_SAT_STR_(...) #__VA_ARGS__
#define KL_SAT_XSTR_(...) KL_SAT_STR_(__VA_ARGS__)
/* the definitions as generated-source text (KL_FN is the prelude's qualifier) */
#define KL_SATCONV_TEXT KL_SAT_XSTR_(KL_SATCONV_DEFS(KL_FN, kl_)) "\n"

#endif /* KILN_SAT_H */
