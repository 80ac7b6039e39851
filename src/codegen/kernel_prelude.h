/* kernel_prelude.h - the helper functions every generated translation unit starts with,
 * C or CUDA: half-precision conversions, NaN-propagating max/min, saturating
 * float->int casts, Philox. The including renderer defines KL_FN, the integer
 * types and the float macros first; the text is the same for both targets so
 * that their results agree bit for bit. */
#ifndef KILN_CODEGEN_HELPERS_H
#define KILN_CODEGEN_HELPERS_H

#include "core/half.h" /* KL_HALFCONV_TEXT: kl_h2f, kl_f2h, kl_bf2f, kl_f2bf */
#include "core/sat.h"  /* KL_SATCONV_TEXT: kl_f2i32, kl_f2i64, kl_sati32 */

#define KL_RENDER_HELPERS \
	KL_HALFCONV_TEXT \
	"KL_FN float kl_maxf(float a, float b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n" \
	"KL_FN float kl_minf(float a, float b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n" \
	"KL_FN double kl_maxd(double a, double b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n" \
	"KL_FN double kl_mind(double a, double b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n" \
	"/* sigmoid from z = exp(-|x|), which never overflows: 1 / (1 + z) for\n" \
	" * x >= 0, z / (1 + z) below, chosen by a select. One exp and one\n" \
	" * reciprocal a point and no branch: a GPU warp does not run both sides\n" \
	" * when its signs differ, and the C compiler vectorizes it. 1 + z is in\n" \
	" * [1, 2] (or NaN): a target may define KL_RCP12 first, a correctly\n" \
	" * rounded 1/d for that range without a general reciprocal's checks */\n" \
	"#ifndef KL_RCP12\n" \
	"#define KL_RCP12(d) (1.0f / (d))\n" \
	"#endif\n" \
	"KL_FN float kl_sigmoidf(float x)\n" \
	"{\n" \
	"\tfloat z = expf(-fabsf(x)), r = KL_RCP12(1.0f + z);\n" \
	"\treturn x >= 0.0f ? r : z * r;\n" \
	"}\n" \
	"KL_FN double kl_sigmoidd(double x)\n" \
	"{\n" \
	"\tdouble z = exp(-fabs(x)), r = 1.0 / (1.0 + z);\n" \
	"\treturn x >= 0.0 ? r : z * r;\n" \
	"}\n" \
	"KL_FN float kl_siluf(float x) { return x * kl_sigmoidf(x); }\n" \
	"KL_FN double kl_silud(double x) { return x * kl_sigmoidd(x); }\n" \
	"/* gelu and gelu_tanh without 1 + erf(x) or 1 + tanh(u), which cancel to\n" \
	" * nothing in the negative tail: erfc, and x * sigmoid(2u) */\n" \
	"KL_FN float kl_geluf(float x) { return 0.5f * x * erfcf(-x * 0.70710678118654752f); }\n" \
	"KL_FN double kl_gelud(double x) { return 0.5 * x * erfc(-x * 0.70710678118654752440); }\n" \
	"KL_FN float kl_gelu_tanhf(float x)\n" \
	"{\n" \
	"\treturn x * kl_sigmoidf(1.5957691216057307118f * (x + 0.044715f * x * x * x));\n" \
	"}\n" \
	"KL_FN double kl_gelu_tanhd(double x)\n" \
	"{\n" \
	"\treturn x * kl_sigmoidd(1.5957691216057307118 * (x + 0.044715 * x * x * x));\n" \
	"}\n" \
	KL_SATCONV_TEXT \
	"KL_FN int64_t kl_powi(int64_t a, int64_t b)\n" \
	"{\n" \
	"\tif (b < 0)\n" \
	"\t\treturn a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;\n" \
	"\tuint64_t r = 1, x = (uint64_t)a, e = (uint64_t)b;\n" \
	"\twhile (e) {\n" \
	"\t\tif (e & 1u)\n" \
	"\t\t\tr *= x;\n" \
	"\t\tx *= x;\n" \
	"\t\te >>= 1;\n" \
	"\t}\n" \
	"\treturn (int64_t)r;\n" \
	"}\n" \
	"KL_FN int64_t kl_divi(int64_t a, int64_t b) { return b == 0 ? 0 : (b == -1 ? (int64_t)(0ull - (uint64_t)a) : a / b); }\n" \
	"KL_FN int32_t kl_absi32(int32_t a) { return a < 0 ? (int32_t)(0u - (uint32_t)a) : a; }\n" \
	"KL_FN int64_t kl_absi64(int64_t a) { return a < 0 ? (int64_t)(0ull - (uint64_t)a) : a; }\n" \
	"KL_FN int64_t kl_clampi(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }\n" \
	"KL_FN void kl_philox(uint64_t seed, uint64_t ctr, uint32_t o[4])\n" \
	"{\n" \
	"\tuint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;\n" \
	"\tuint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);\n" \
	"\tfor (int r = 0; r < 10; r++) {\n" \
	"\t\tuint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;\n" \
	"\t\tuint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;\n" \
	"\t\tc1 = (uint32_t)p1;\n" \
	"\t\tc3 = (uint32_t)p0;\n" \
	"\t\tc0 = n0;\n" \
	"\t\tc2 = n2;\n" \
	"\t\tk0 += 0x9E3779B9u;\n" \
	"\t\tk1 += 0xBB67AE85u;\n" \
	"\t}\n" \
	"\to[0] = c0;\n" \
	"\to[1] = c1;\n" \
	"\to[2] = c2;\n" \
	"\to[3] = c3;\n" \
	"}\n" \
	"KL_FN uint64_t kl_rand_key(int32_t lo, int32_t hi)\n" \
	"{\n" \
	"\treturn (uint64_t)(uint32_t)lo | (uint64_t)(uint32_t)hi << 32;\n" \
	"}\n" \
	"KL_FN double kl_rand_uniform(uint64_t seed, uint64_t i)\n" \
	"{\n" \
	"\tuint32_t o[4];\n" \
	"\tkl_philox(seed, i, o);\n" \
	"\treturn (double)(o[0] >> 8) * (1.0 / 16777216.0);\n" \
	"}\n" \
	"KL_FN double kl_rand_normal(uint64_t seed, uint64_t i)\n" \
	"{\n" \
	"\tuint32_t o[4];\n" \
	"\tkl_philox(seed, i, o);\n" \
	"\tdouble u1 = ((double)(o[0] >> 8) + 1.0) * (1.0 / 16777216.0);\n" \
	"\tdouble u2 = (double)(o[1] >> 8) * (1.0 / 16777216.0);\n" \
	"\treturn sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);\n" \
	"}\n" \
	"\n"

#endif /* KILN_CODEGEN_HELPERS_H */
