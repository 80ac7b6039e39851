/* kernel_prelude.h - the helper functions every generated translation unit starts with,
 * C or CUDA: half-precision conversions, NaN-propagating max/min, saturating
 * float->int casts, Philox. The including renderer defines KL_FN, the integer
 * types and the float macros first; the text is the same for both targets so
 * that their results agree bit for bit. */
#ifndef KILN_CODEGEN_HELPERS_H
#define KILN_CODEGEN_HELPERS_H

#include "core/sat.h" /* KL_SATCONV_TEXT: kl_f2i32, kl_f2i64, kl_sati32 */

#define KL_RENDER_HELPERS \
	"KL_FN float kl_h2f(uint16_t h)\n" \
	"{\n" \
	"\tuint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;\n" \
	"\tif (e == 0) {\n" \
	"\t\tfloat v = (float)m * 5.9604644775390625e-08f;\n" \
	"\t\treturn s ? -v : v;\n" \
	"\t}\n" \
	"\tx = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112u) << 23) | (m << 13));\n" \
	"\tfloat f;\n" \
	"\tmemcpy(&f, &x, 4);\n" \
	"\treturn f;\n" \
	"}\n" \
	"KL_FN uint16_t kl_f2h(float f)\n" \
	"{\n" \
	"\tuint32_t x;\n" \
	"\tmemcpy(&x, &f, 4);\n" \
	"\tuint32_t s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;\n" \
	"\tif (a > 0x7f800000u)\n" \
	"\t\treturn (uint16_t)(s | 0x7e00u | ((a >> 13) & 0x3ffu));\n" \
	"\tif (a >= 0x477ff000u)\n" \
	"\t\treturn (uint16_t)(s | 0x7c00u);\n" \
	"\tif (a < 0x38800000u) {\n" \
	"\t\tfloat v = fabsf(f) * 16777216.0f;\n" \
	"\t\tuint32_t m = (uint32_t)v;\n" \
	"\t\tfloat r = v - (float)m;\n" \
	"\t\tif (r > 0.5f || (r == 0.5f && (m & 1u)))\n" \
	"\t\t\tm++;\n" \
	"\t\treturn (uint16_t)(s | m);\n" \
	"\t}\n" \
	"\ta -= 0x38000000u;\n" \
	"\ta += 0x0fffu + ((a >> 13) & 1u);\n" \
	"\treturn (uint16_t)(s | (a >> 13));\n" \
	"}\n" \
	"KL_FN float kl_bf2f(uint16_t h)\n" \
	"{\n" \
	"\tuint32_t x = (uint32_t)h << 16;\n" \
	"\tfloat f;\n" \
	"\tmemcpy(&f, &x, 4);\n" \
	"\treturn f;\n" \
	"}\n" \
	"KL_FN uint16_t kl_f2bf(float f)\n" \
	"{\n" \
	"\tuint32_t x;\n" \
	"\tmemcpy(&x, &f, 4);\n" \
	"\tif ((x & 0x7fffffffu) > 0x7f800000u)\n" \
	"\t\treturn (uint16_t)((x >> 16) | 0x40u);\n" \
	"\tx += 0x7fffu + ((x >> 16) & 1u);\n" \
	"\treturn (uint16_t)(x >> 16);\n" \
	"}\n" \
	"KL_FN float kl_maxf(float a, float b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n" \
	"KL_FN float kl_minf(float a, float b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n" \
	"KL_FN double kl_maxd(double a, double b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n" \
	"KL_FN double kl_mind(double a, double b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n" \
	"/* sigmoid from z = exp(-|x|), which never overflows: 1 / (1 + z) for\n" \
	" * x >= 0, z / (1 + z) below, chosen by a select. One exp and one\n" \
	" * reciprocal a point and no branch: a GPU warp does not run both sides\n" \
	" * when its signs differ, and the C compiler vectorizes it */\n" \
	"KL_FN float kl_sigmoidf(float x)\n" \
	"{\n" \
	"\tfloat z = expf(-fabsf(x)), r = 1.0f / (1.0f + z);\n" \
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
