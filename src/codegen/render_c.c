/* render_c.c - the C renderer: spellings for OpenMP C and the helpers every
 * generated C translation unit begins with (half-precision conversions,
 * NaN-propagating max/min, saturating float->int casts, Philox).
 *
 * The math here is the contract with the CPU backend and the reference: f16
 * and bf16 convert in registers with round-to-nearest-even, integer
 * arithmetic wraps (done in unsigned types), float->int saturates with NaN
 * -> 0, and rand/randn reproduce kl__rand_uniform/kl__rand_normal bit for bit.
 */
#include <math.h>
#include <string.h>

#include "codegen/render.h"

static const char prelude[] =
	"#include <math.h>\n"
	"#include <stdint.h>\n"
	"#include <string.h>\n"
	"/* a simd loop the vectorizer declines is not an error */\n"
	"#if defined(__clang__)\n"
	"#pragma clang diagnostic ignored \"-Wpass-failed\"\n"
	"#elif defined(__GNUC__)\n"
	"#pragma GCC diagnostic ignored \"-Wopenmp-simd\"\n"
	"#endif\n"
	"#if defined(__GNUC__)\n"
	"#define KL_FN static inline __attribute__((unused))\n"
	"#else\n"
	"#define KL_FN static inline\n"
	"#endif\n"
	"\n"
	"KL_FN float kl_h2f(uint16_t h)\n"
	"{\n"
	"\tuint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;\n"
	"\tif (e == 0) {\n"
	"\t\tfloat v = (float)m * 5.9604644775390625e-08f;\n"
	"\t\treturn s ? -v : v;\n"
	"\t}\n"
	"\tx = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112u) << 23) | (m << 13));\n"
	"\tfloat f;\n"
	"\tmemcpy(&f, &x, 4);\n"
	"\treturn f;\n"
	"}\n"
	"KL_FN uint16_t kl_f2h(float f)\n"
	"{\n"
	"\tuint32_t x;\n"
	"\tmemcpy(&x, &f, 4);\n"
	"\tuint32_t s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;\n"
	"\tif (a > 0x7f800000u)\n"
	"\t\treturn (uint16_t)(s | 0x7e00u | ((a >> 13) & 0x3ffu));\n"
	"\tif (a >= 0x477ff000u)\n"
	"\t\treturn (uint16_t)(s | 0x7c00u);\n"
	"\tif (a < 0x38800000u) {\n"
	"\t\tfloat v = fabsf(f) * 16777216.0f;\n"
	"\t\tuint32_t m = (uint32_t)v;\n"
	"\t\tfloat r = v - (float)m;\n"
	"\t\tif (r > 0.5f || (r == 0.5f && (m & 1u)))\n"
	"\t\t\tm++;\n"
	"\t\treturn (uint16_t)(s | m);\n"
	"\t}\n"
	"\ta -= 0x38000000u;\n"
	"\ta += 0x0fffu + ((a >> 13) & 1u);\n"
	"\treturn (uint16_t)(s | (a >> 13));\n"
	"}\n"
	"KL_FN float kl_bf2f(uint16_t h)\n"
	"{\n"
	"\tuint32_t x = (uint32_t)h << 16;\n"
	"\tfloat f;\n"
	"\tmemcpy(&f, &x, 4);\n"
	"\treturn f;\n"
	"}\n"
	"KL_FN uint16_t kl_f2bf(float f)\n"
	"{\n"
	"\tuint32_t x;\n"
	"\tmemcpy(&x, &f, 4);\n"
	"\tif ((x & 0x7fffffffu) > 0x7f800000u)\n"
	"\t\treturn (uint16_t)((x >> 16) | 0x40u);\n"
	"\tx += 0x7fffu + ((x >> 16) & 1u);\n"
	"\treturn (uint16_t)(x >> 16);\n"
	"}\n"
	"KL_FN float kl_maxf(float a, float b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n"
	"KL_FN float kl_minf(float a, float b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n"
	"KL_FN double kl_maxd(double a, double b) { return a != a ? a : b != b ? b : a > b ? a : b; }\n"
	"KL_FN double kl_mind(double a, double b) { return a != a ? a : b != b ? b : a < b ? a : b; }\n"
	"KL_FN float kl_sigmoidf(float x)\n"
	"{\n"
	"\tif (x >= 0.0f)\n"
	"\t\treturn 1.0f / (1.0f + expf(-x));\n"
	"\tfloat z = expf(x);\n"
	"\treturn z / (1.0f + z);\n"
	"}\n"
	"KL_FN double kl_sigmoidd(double x)\n"
	"{\n"
	"\tif (x >= 0.0)\n"
	"\t\treturn 1.0 / (1.0 + exp(-x));\n"
	"\tdouble z = exp(x);\n"
	"\treturn z / (1.0 + z);\n"
	"}\n"
	"KL_FN float kl_siluf(float x) { return x * kl_sigmoidf(x); }\n"
	"KL_FN double kl_silud(double x) { return x * kl_sigmoidd(x); }\n"
	"KL_FN float kl_geluf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }\n"
	"KL_FN double kl_gelud(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440)); }\n"
	"KL_FN float kl_gelu_tanhf(float x)\n"
	"{\n"
	"\treturn 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * (x + 0.044715f * x * x * x)));\n"
	"}\n"
	"KL_FN double kl_gelu_tanhd(double x)\n"
	"{\n"
	"\treturn 0.5 * x * (1.0 + tanh(0.79788456080286535588 * (x + 0.044715 * x * x * x)));\n"
	"}\n"
	"KL_FN int32_t kl_f2i32(double v)\n"
	"{\n"
	"\tif (v != v)\n"
	"\t\treturn 0;\n"
	"\tif (v >= 2147483647.0)\n"
	"\t\treturn INT32_MAX;\n"
	"\tif (v <= -2147483648.0)\n"
	"\t\treturn INT32_MIN;\n"
	"\treturn (int32_t)v;\n"
	"}\n"
	"KL_FN int32_t kl_sati32(int64_t v) { return v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : (int32_t)v; }\n"
	"KL_FN int64_t kl_f2i64(double v)\n"
	"{\n"
	"\tif (v != v)\n"
	"\t\treturn 0;\n"
	"\tif (v >= 9223372036854775807.0)\n"
	"\t\treturn INT64_MAX;\n"
	"\tif (v <= -9223372036854775808.0)\n"
	"\t\treturn INT64_MIN;\n"
	"\treturn (int64_t)v;\n"
	"}\n"
	"KL_FN int64_t kl_powi(int64_t a, int64_t b)\n"
	"{\n"
	"\tif (b < 0)\n"
	"\t\treturn a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;\n"
	"\tuint64_t r = 1, x = (uint64_t)a, e = (uint64_t)b;\n"
	"\twhile (e) {\n"
	"\t\tif (e & 1u)\n"
	"\t\t\tr *= x;\n"
	"\t\tx *= x;\n"
	"\t\te >>= 1;\n"
	"\t}\n"
	"\treturn (int64_t)r;\n"
	"}\n"
	"KL_FN int64_t kl_divi(int64_t a, int64_t b) { return b == 0 ? 0 : (b == -1 ? (int64_t)(0ull - (uint64_t)a) : a / b); }\n"
	"KL_FN int32_t kl_absi32(int32_t a) { return a < 0 ? (int32_t)(0u - (uint32_t)a) : a; }\n"
	"KL_FN int64_t kl_absi64(int64_t a) { return a < 0 ? (int64_t)(0ull - (uint64_t)a) : a; }\n"
	"KL_FN int64_t kl_clampi(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }\n"
	"KL_FN void kl_philox(uint64_t seed, uint64_t ctr, uint32_t o[4])\n"
	"{\n"
	"\tuint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;\n"
	"\tuint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);\n"
	"\tfor (int r = 0; r < 10; r++) {\n"
	"\t\tuint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;\n"
	"\t\tuint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;\n"
	"\t\tc1 = (uint32_t)p1;\n"
	"\t\tc3 = (uint32_t)p0;\n"
	"\t\tc0 = n0;\n"
	"\t\tc2 = n2;\n"
	"\t\tk0 += 0x9E3779B9u;\n"
	"\t\tk1 += 0xBB67AE85u;\n"
	"\t}\n"
	"\to[0] = c0;\n"
	"\to[1] = c1;\n"
	"\to[2] = c2;\n"
	"\to[3] = c3;\n"
	"}\n"
	"KL_FN double kl_rand_uniform(uint64_t seed, uint64_t i)\n"
	"{\n"
	"\tuint32_t o[4];\n"
	"\tkl_philox(seed, i, o);\n"
	"\treturn (double)(o[0] >> 8) * (1.0 / 16777216.0);\n"
	"}\n"
	"KL_FN double kl_rand_normal(uint64_t seed, uint64_t i)\n"
	"{\n"
	"\tuint32_t o[4];\n"
	"\tkl_philox(seed, i, o);\n"
	"\tdouble u1 = ((double)(o[0] >> 8) + 1.0) * (1.0 / 16777216.0);\n"
	"\tdouble u2 = (double)(o[1] >> 8) * (1.0 / 16777216.0);\n"
	"\treturn sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);\n"
	"}\n"
	"\n";

static bool is_f(kl_dtype dt)
{
	return dt == KL_F32 || dt == KL_F16 || dt == KL_BF16;
}

static void c_constant(kl_sb *sb, kl_dtype dt, double k)
{
	switch (dt) {
	case KL_F32:
	case KL_F16:
	case KL_BF16:
	case KL_F64: {
		const char *t = dt == KL_F64 ? "double" : "float";
		if (isnan(k))
			kl__sb_printf(sb, "((%s)NAN)", t);
		else if (isinf(k))
			kl__sb_printf(sb, "(%s(%s)INFINITY)", k < 0 ? "-" : "", t);
		else
			kl__sb_printf(sb, "((%s)%.17g)", t, k);
		return;
	}
	case KL_BOOL:
		kl__sb_puts(sb, k != 0 ? "1" : "0");
		return;
	default: {
		int64_t v;
		if (isnan(k))
			v = 0;
		else if (k >= 9223372036854775807.0)
			v = INT64_MAX;
		else if (k <= -9223372036854775808.0)
			v = INT64_MIN;
		else
			v = (int64_t)k;
		if (dt == KL_I32) {
			int32_t w = (int32_t)(uint32_t)(uint64_t)v;
			if (w == INT32_MIN)
				kl__sb_puts(sb, "INT32_MIN");
			else
				kl__sb_printf(sb, "((int32_t)%d)", (int)w);
		} else if (v == INT64_MIN) {
			kl__sb_puts(sb, "INT64_MIN");
		} else {
			kl__sb_printf(sb, "INT64_C(%lld)", (long long)v);
		}
		return;
	}
	}
}

/* a (of dtype from) as a float value */
static void to_float(kl_sb *sb, kl_dtype from, const char *a)
{
	if (is_f(from))
		kl__sb_puts(sb, a);
	else
		kl__sb_printf(sb, "(float)(%s)", a);
}

static void c_cast(kl_sb *sb, kl_dtype to, kl_dtype from, const char *a)
{
	if (to == from) {
		kl__sb_puts(sb, a);
		return;
	}
	switch (to) {
	case KL_F16:
	case KL_BF16:
		kl__sb_puts(sb, to == KL_F16 ? "kl_h2f(kl_f2h(" : "kl_bf2f(kl_f2bf(");
		to_float(sb, from, a);
		kl__sb_puts(sb, "))");
		return;
	case KL_F32:
		to_float(sb, from, a);
		return;
	case KL_F64:
		kl__sb_printf(sb, "(double)(%s)", a);
		return;
	case KL_I32:
		if (is_f(from) || from == KL_F64)
			kl__sb_printf(sb, "kl_f2i32((double)(%s))", a);
		else if (from == KL_I64)
			kl__sb_printf(sb, "kl_sati32(%s)", a);
		else
			kl__sb_printf(sb, "(int32_t)(%s)", a);
		return;
	case KL_I64:
		if (is_f(from) || from == KL_F64)
			kl__sb_printf(sb, "kl_f2i64((double)(%s))", a);
		else
			kl__sb_printf(sb, "(int64_t)(%s)", a);
		return;
	case KL_BOOL:
		kl__sb_printf(sb, "((%s) != 0)", a);
		return;
	default:
		kl__sb_puts(sb, a);
	}
}

static void c_unary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a)
{
	bool d = dt == KL_F64;
	const char *f = d ? "" : "f";
	const char *fn = NULL;
	if (!is_f(dt) && !d) {
		const char *u = dt == KL_I64 ? "uint64_t" : "uint32_t";
		const char *s = dt == KL_I64 ? "int64_t" : "int32_t";
		switch (op) {
		case KL_OP_NEG:
			kl__sb_printf(sb, "(%s)((%s)0 - (%s)(%s))", s, u, u, a);
			return;
		case KL_OP_ABS:
			kl__sb_printf(sb, "kl_absi%s(%s)", dt == KL_I64 ? "64" : "32", a);
			return;
		case KL_OP_RELU:
			kl__sb_printf(sb, "(%s < 0 ? (%s)0 : %s)", a, s, a);
			return;
		default:
			kl__sb_puts(sb, a);
			return;
		}
	}
	switch (op) {
	case KL_OP_NEG:
		kl__sb_printf(sb, "(-%s)", a);
		return;
	case KL_OP_ABS:
		fn = "fabs";
		break;
	case KL_OP_EXP:
		fn = "exp";
		break;
	case KL_OP_LOG:
		fn = "log";
		break;
	case KL_OP_SQRT:
		fn = "sqrt";
		break;
	case KL_OP_RSQRT:
		kl__sb_printf(sb, "(1.0%s / sqrt%s(%s))", f, f, a);
		return;
	case KL_OP_SIN:
		fn = "sin";
		break;
	case KL_OP_COS:
		fn = "cos";
		break;
	case KL_OP_TANH:
		fn = "tanh";
		break;
	case KL_OP_SIGMOID:
		kl__sb_printf(sb, "kl_sigmoid%s(%s)", d ? "d" : "f", a);
		return;
	case KL_OP_RELU:
		kl__sb_printf(sb, "(%s < 0 ? 0 : %s)", a, a);
		return;
	case KL_OP_GELU:
		kl__sb_printf(sb, "kl_gelu%s(%s)", d ? "d" : "f", a);
		return;
	case KL_OP_GELU_TANH:
		kl__sb_printf(sb, "kl_gelu_tanh%s(%s)", d ? "d" : "f", a);
		return;
	case KL_OP_SILU:
		kl__sb_printf(sb, "kl_silu%s(%s)", d ? "d" : "f", a);
		return;
	default:
		kl__sb_puts(sb, a);
		return;
	}
	kl__sb_printf(sb, "%s%s(%s)", fn, f, a);
}

static void c_binary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b)
{
	static const char *cmp[] = {"==", "!=", "<", "<=", ">", ">="};
	if (op >= KL_OP_EQ && op <= KL_OP_GE) {
		kl__sb_printf(sb, "(%s %s %s)", a, cmp[op - KL_OP_EQ], b);
		return;
	}
	bool fl = is_f(dt) || dt == KL_F64;
	const char *sfx = dt == KL_F64 ? "d" : "f";
	if (fl) {
		switch (op) {
		case KL_OP_ADD:
			kl__sb_printf(sb, "(%s + %s)", a, b);
			return;
		case KL_OP_SUB:
			kl__sb_printf(sb, "(%s - %s)", a, b);
			return;
		case KL_OP_MUL:
			kl__sb_printf(sb, "(%s * %s)", a, b);
			return;
		case KL_OP_DIV:
			kl__sb_printf(sb, "(%s / %s)", a, b);
			return;
		case KL_OP_POW:
			kl__sb_printf(sb, "pow%s(%s, %s)", dt == KL_F64 ? "" : "f", a, b);
			return;
		case KL_OP_MAXIMUM:
			kl__sb_printf(sb, "kl_max%s(%s, %s)", sfx, a, b);
			return;
		case KL_OP_MINIMUM:
			kl__sb_printf(sb, "kl_min%s(%s, %s)", sfx, a, b);
			return;
		default:
			kl__sb_puts(sb, a);
			return;
		}
	}
	const char *s = dt == KL_I64 ? "int64_t" : dt == KL_I32 ? "int32_t" : "int";
	const char *u = dt == KL_I64 ? "uint64_t" : "uint32_t";
	switch (op) {
	case KL_OP_ADD:
		kl__sb_printf(sb, "(%s)((%s)%s + (%s)%s)", s, u, a, u, b);
		return;
	case KL_OP_SUB:
		kl__sb_printf(sb, "(%s)((%s)%s - (%s)%s)", s, u, a, u, b);
		return;
	case KL_OP_MUL:
		kl__sb_printf(sb, "(%s)((%s)%s * (%s)%s)", s, u, a, u, b);
		return;
	case KL_OP_DIV:
		kl__sb_printf(sb, "(%s)kl_divi(%s, %s)", s, a, b);
		return;
	case KL_OP_POW:
		kl__sb_printf(sb, "(%s)kl_powi(%s, %s)", s, a, b);
		return;
	case KL_OP_MAXIMUM:
		kl__sb_printf(sb, "(%s > %s ? %s : %s)", a, b, a, b);
		return;
	case KL_OP_MINIMUM:
		kl__sb_printf(sb, "(%s < %s ? %s : %s)", a, b, a, b);
		return;
	default:
		kl__sb_puts(sb, a);
		return;
	}
}

static void c_rand(kl_sb *sb, kl_op op, uint64_t seed, const char *index)
{
	kl__sb_printf(sb, "kl_rand_%s(UINT64_C(%llu), (uint64_t)%s)",
	              op == KL_OP_RANDN ? "normal" : "uniform", (unsigned long long)seed, index);
}

static bool int_like(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64 || dt == KL_BOOL;
}

/* Float max/min keep a NaN flag beside the value so that the loop stays a
 * plain max (vectorizable as an OpenMP reduction) while NaN still wins. */
static int c_acc_vars(kl_op op, kl_dtype in, kl_accvar *v)
{
	bool fl = !int_like(in);
	const char *t = kl__render_c.ctype[in];
	switch (op) {
	case KL_OP_SUM:
		v[0] = (kl_accvar){"", fl ? "double" : "uint64_t", "0"};
		return 1;
	case KL_OP_MAX:
	case KL_OP_ARGMAX:
		v[0] = (kl_accvar){"", t,
		                   fl                ? "-INFINITY"
		                   : in == KL_I32    ? "INT32_MIN"
		                   : in == KL_I64    ? "INT64_MIN"
		                                     : "-1"};
		break;
	case KL_OP_MIN:
		v[0] = (kl_accvar){"", t,
		                   fl                ? "INFINITY"
		                   : in == KL_I32    ? "INT32_MAX"
		                   : in == KL_I64    ? "INT64_MAX"
		                                     : "2"};
		break;
	default:
		v[0] = (kl_accvar){"", t, "0"};
		return 1;
	}
	if (op == KL_OP_ARGMAX) {
		v[1] = (kl_accvar){"i", "int64_t", "0"};
		return 2;
	}
	if (fl) {
		v[1] = (kl_accvar){"n", "int", "0"};
		return 2;
	}
	return 1;
}

static void c_acc_update(kl_sb *sb, kl_op op, kl_dtype in, const char *acc, const char *ix,
                         const char *v, const char *pos)
{
	bool fl = !int_like(in);
	char a[64], n[64];
	snprintf(a, sizeof(a), "%s%s", acc, ix);
	snprintf(n, sizeof(n), "%s%s%s", acc, op == KL_OP_ARGMAX ? "i" : "n", ix);
	switch (op) {
	case KL_OP_SUM:
		if (fl)
			kl__sb_printf(sb, "%s += (double)%s;", a, v);
		else
			kl__sb_printf(sb, "%s += (uint64_t)(int64_t)%s;", a, v);
		return;
	case KL_OP_MAX:
	case KL_OP_MIN:
		kl__sb_printf(sb, "%s = %s %s %s ? %s : %s;", a, v, op == KL_OP_MAX ? ">" : "<", a, v,
		              a);
		if (fl)
			kl__sb_printf(sb, " %s |= %s != %s;", n, v, v);
		return;
	case KL_OP_ARGMAX:
		/* the first maximum; the first NaN wins and stays */
		if (fl)
			kl__sb_printf(sb, "if (%s == %s && (%s != %s || %s > %s)) { %s = %s; %s = %s; }",
			              a, a, v, v, v, a, a, v, n, pos);
		else
			kl__sb_printf(sb, "if (%s > %s) { %s = %s; %s = %s; }", v, a, a, v, n, pos);
		return;
	default:
		return;
	}
}

static void c_acc_read(kl_sb *sb, kl_op op, kl_dtype in, kl_dtype dt, const char *acc,
                       const char *ix)
{
	const char *t = kl__render_c.ctype[dt];
	if (op == KL_OP_ARGMAX)
		kl__sb_printf(sb, "%si%s", acc, ix);
	else if (dt == KL_BOOL)
		kl__sb_printf(sb, "(%s%s != 0)", acc, ix);
	else if ((op == KL_OP_MAX || op == KL_OP_MIN) && !int_like(in))
		kl__sb_printf(sb, "%sn%s ? (%s)NAN : (%s)%s%s", acc, ix, t, t, acc, ix);
	else
		kl__sb_printf(sb, "(%s)%s%s", t, acc, ix);
}

static bool c_acc_clause(kl_sb *sb, kl_op op, kl_dtype in, const char *acc)
{
	switch (op) {
	case KL_OP_SUM:
		kl__sb_printf(sb, " reduction(+:%s)", acc);
		return true;
	case KL_OP_MAX:
	case KL_OP_MIN:
		kl__sb_printf(sb, " reduction(%s:%s)", op == KL_OP_MAX ? "max" : "min", acc);
		if (!int_like(in))
			kl__sb_printf(sb, " reduction(|:%sn)", acc);
		return true;
	default:
		return false;
	}
}

const kl_renderer kl__render_c = {
	.name = "c",
	.prelude = prelude,
	.ctype = {[KL_F32] = "float", [KL_F64] = "double", [KL_F16] = "float", [KL_BF16] = "float",
	          [KL_I32] = "int32_t", [KL_I64] = "int64_t", [KL_BOOL] = "int"},
	.mtype = {[KL_F32] = "float", [KL_F64] = "double", [KL_F16] = "uint16_t",
	          [KL_BF16] = "uint16_t", [KL_I32] = "int32_t", [KL_I64] = "int64_t",
	          [KL_BOOL] = "uint8_t"},
	.load_fmt = {[KL_F32] = "%s", [KL_F64] = "%s", [KL_F16] = "kl_h2f(%s)",
	             [KL_BF16] = "kl_bf2f(%s)", [KL_I32] = "%s", [KL_I64] = "%s",
	             [KL_BOOL] = "(%s != 0)"},
	.store_fmt = {[KL_F32] = "%s", [KL_F64] = "%s", [KL_F16] = "kl_f2h(%s)",
	              [KL_BF16] = "kl_f2bf(%s)", [KL_I32] = "%s", [KL_I64] = "%s",
	              [KL_BOOL] = "(uint8_t)(%s != 0)"},
	.kernel_fmt = "void %s(void *const *B, const int64_t *S)",
	.restrict_kw = "restrict",
	.index_t = "int64_t",
	.par_for_fmt = "#pragma omp parallel for collapse(%d)%s",
	.par_for_simd_fmt = "#pragma omp parallel for simd collapse(%d)%s",
	.simd_fmt = "#pragma omp simd collapse(%d)%s",
	.if_fmt = " if(%s)",
	.sym_fmt = "S[%d]",
	.par_threshold = 32768,
	.constant = c_constant,
	.cast = c_cast,
	.unary = c_unary,
	.binary = c_binary,
	.rand = c_rand,
	.acc_vars = c_acc_vars,
	.acc_update = c_acc_update,
	.acc_read = c_acc_read,
	.acc_clause = c_acc_clause,
};
