/* render_c.c - the C renderer: spellings for C with OpenMP simd pragmas only
 * (no OpenMP runtime: the parallel nests are outlined for kiln's thread pool,
 * render.c) and the helpers every generated C translation unit begins with
 * (half-precision conversions, NaN-propagating max/min, saturating
 * float->int casts, Philox).
 *
 * The math here is the contract with the CPU backend and the reference: f16
 * and bf16 convert in registers with round-to-nearest-even, integer
 * arithmetic wraps (done in unsigned types), float->int saturates with NaN
 * -> 0, and rand/randn reproduce kl__rand_uniform/kl__rand_normal bit for bit.
 */
#include <math.h>
#include <string.h>

#include "codegen/kernel_prelude.h"
#include "codegen/render.h"
#include "graph/optable.h"

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
	KL_RENDER_HELPERS
	/* double -> float rounded to odd, so that rounding that to f16/bf16 is
	 * the correct rounding of the double (as kl__f64_to_f16 does) */
	"KL_FN float kl_d2f_odd(double v)\n"
	"{\n"
	"\tfloat f = (float)v;\n"
	"\tif (v != v || (double)f == v)\n"
	"\t\treturn f;\n"
	"\tuint32_t u;\n"
	"\tmemcpy(&u, &f, 4);\n"
	"\tif (fabs((double)f) > fabs(v))\n"
	"\t\tu--;\n"
	"\tu |= 1u;\n"
	"\tmemcpy(&f, &u, 4);\n"
	"\treturn f;\n"
	"}\n"
	/* libm's expf, tanhf and erfcf (exact GELU) are a call per element,
	 * which keeps the simd loops around them scalar: glibc declares the
	 * vector forms libmvec has (within 4 ulp, NaN and inf as the scalar
	 * ones) only under -ffast-math, so declare them here; the .so is linked
	 * with -lm, which brings libmvec. */
	"#if defined(__x86_64__) && defined(__GLIBC__)\n"
	"#if __GLIBC_PREREQ(2, 22)\n"
	"#pragma omp declare simd notinbranch\n"
	"float expf(float);\n"
	"#endif\n"
	"#if __GLIBC_PREREQ(2, 35)\n"
	"#pragma omp declare simd notinbranch\n"
	"float tanhf(float);\n"
	"#pragma omp declare simd notinbranch\n"
	"float erfcf(float);\n"
	"#endif\n"
	"#endif\n"
	/* exp of a float value, inlined so that a simd loop around it is
	 * vectorized in place (libmvec's expf is a call per vector and cost
	 * softmax as much as its memory traffic): n = round(x log2 e) by the
	 * 1.5 * 2^23 rounding trick, r = x - n ln2 in two fmas, exp(r) a
	 * degree-6 fit of relative error 2e-9 on [-ln2/2, ln2/2] (fitted for
	 * kiln), then 2^n as two factors, so a result below FLT_MIN rounds once
	 * to its subnormal and one past FLT_MAX is inf: k's bits are
	 * 0x4B400000 + n, so b = n + 254 takes one subtraction and the biased
	 * exponents are b >> 1 = n/2 + 127 (rounded down) and b - (b >> 1) =
	 * n - n/2 + 127. Within 1.06 ulp of
	 * exp over every float (checked exhaustively against double exp);
	 * NaN stays NaN (the clamps pass it), -inf is 0, +inf is inf. The
	 * clamps keep n*ln2 exact enough and both factors normal; each is one
	 * compare and blend of the argument itself. */
	"KL_FN float kl_expf(float x)\n"
	"{\n"
	"\tfloat lo = x < -120.0f ? -120.0f : x;\n"
	"\tfloat c = x > 100.0f ? 100.0f : lo;\n"
	"\tfloat k = fmaf(c, 1.44269502162933349609375f, 12582912.0f);\n"
	"\tfloat n = k - 12582912.0f;\n"
	"\tfloat r = fmaf(n, -0.693145751953125f, c);\n"
	"\tr = fmaf(n, -1.428606765330187045e-06f, r);\n"
	"\tfloat p = 0.001384365362593157f;\n"
	"\tp = fmaf(p, r, 0.008374155460233571f);\n"
	"\tp = fmaf(p, r, 0.04166800204193069f);\n"
	"\tp = fmaf(p, r, 0.16666431260829737f);\n"
	"\tp = fmaf(p, r, 0.4999999420898756f);\n"
	"\tp = fmaf(p, r, 1.0000000321654536f);\n"
	"\tp = fmaf(p, r, 1.0f);\n"
	"\tint32_t b;\n"
	"\tmemcpy(&b, &k, 4);\n"
	"\tb -= 0x4B400000 - 254;\n"
	"\tint32_t b1 = b >> 1;\n"
	"\tuint32_t s1 = (uint32_t)b1 << 23, s2 = (uint32_t)(b - b1) << 23;\n"
	"\tfloat f1, f2;\n"
	"\tmemcpy(&f1, &s1, 4);\n"
	"\tmemcpy(&f2, &s2, 4);\n"
	"\treturn p * f1 * f2;\n"
	"}\n"
	/* kl_expf over a row, summed: e[i] = exp(x[i] - m), the float sum of
	 * them returned, pf[0, n) prefetched 256 elements at a time meanwhile
	 * (the next row: the memory works while the exps compute), x f32
	 * (kl_expsum_f32), f16 (_f16) or bf16 (_bf16). With AVX-512 (GCC's
	 * builtins) 16 lanes follow kl_expf step for step, but each clamp is
	 * one max or min (NaN, their second operand, passes) and 2^n one
	 * vscalefps (which rounds a subnormal result once, as the two factors
	 * do): the same bits (checked over every float) in 14 vector
	 * instructions for 16 lanes where kl_expf's simd loop takes 21; f16
	 * widens by vcvtph2ps (exact, as kl_h2f; a signaling NaN comes out
	 * quiet), bf16 by a shift as kl_bf2f; the lanes are summed once a row. With AVX2, FMA
	 * and F16C (GCC) 8 lanes do the same with kl_expf's two-factor 2^n (the
	 * same bits as kl_expf over every float, checked), f16 widened by the
	 * 256-bit vcvtph2ps. Elsewhere a simd loop of kl_expf a chunk. */
	"#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)\n"
	"#define KL_V16 1\n"
	"typedef float kl_v16f __attribute__((vector_size(64)));\n"
	"typedef short kl_v16h __attribute__((vector_size(32)));\n"
	"#define KL_FMA16(a, b, c) __builtin_ia32_vfmaddps512_mask((a), (b), (c), 0xFFFF, 4)\n"
	"KL_FN kl_v16f kl_ld16_f32(const float *p)\n"
	"{ kl_v16f v; memcpy(&v, p, sizeof v); return v; }\n"
	"KL_FN kl_v16f kl_ld16_f16(const uint16_t *p)\n"
	"{ kl_v16h h; memcpy(&h, p, sizeof h); "
	"return __builtin_ia32_vcvtph2ps512_mask(h, (kl_v16f){0}, 0xFFFF, 4); }\n"
	"KL_FN kl_v16f kl_ld16_bf16(const uint16_t *p)\n"
	"{\n"
	"\ttypedef unsigned short kl_v16uh __attribute__((vector_size(32)));\n"
	"\ttypedef unsigned kl_v16u __attribute__((vector_size(64)));\n"
	"\tkl_v16uh h;\n"
	"\tmemcpy(&h, p, sizeof h);\n"
	"\tkl_v16u u = __builtin_convertvector(h, kl_v16u) << 16;\n"
	"\tkl_v16f v;\n"
	"\tmemcpy(&v, &u, sizeof v);\n"
	"\treturn v;\n"
	"}\n"
	"KL_FN kl_v16f kl_exp16(kl_v16f v)\n"
	"{\n"
	"\tconst kl_v16f z = {0}, big = z + 12582912.0f;\n"
	"\tv = __builtin_ia32_maxps512_mask(z - 120.0f, v, v, 0xFFFF, 4);\n"
	"\tv = __builtin_ia32_minps512_mask(z + 100.0f, v, v, 0xFFFF, 4);\n"
	"\tkl_v16f t = KL_FMA16(v, z + 1.44269502162933349609375f, big) - big;\n"
	"\tkl_v16f r = KL_FMA16(t, z - 0.693145751953125f, v);\n"
	"\tr = KL_FMA16(t, z - 1.428606765330187045e-06f, r);\n"
	"\tkl_v16f p = KL_FMA16(z + 0.001384365362593157f, r, z + 0.008374155460233571f);\n"
	"\tp = KL_FMA16(p, r, z + 0.04166800204193069f);\n"
	"\tp = KL_FMA16(p, r, z + 0.16666431260829737f);\n"
	"\tp = KL_FMA16(p, r, z + 0.4999999420898756f);\n"
	"\tp = KL_FMA16(p, r, z + 1.0000000321654536f);\n"
	"\tp = KL_FMA16(p, r, z + 1.0f);\n"
	"\treturn __builtin_ia32_scalefps512_mask(p, t, p, 0xFFFF, 4);\n"
	"}\n"
	"#define KL_EXPSUM_V16(LD16, LD1)\\\n"
	"\t\tfor (; i + 16 <= ce; i += 16) {\\\n"
	"\t\t\tkl_v16f p = kl_exp16(LD16(x + i) - m);\\\n"
	"\t\t\tmemcpy(e + i, &p, sizeof p);\\\n"
	"\t\t\tacc += p;\\\n"
	"\t\t}\n"
	"#define KL_EXPSUM_SUM() for (int j = 0; j < 16; j++) s += acc[j]\n"
	"#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__GNUC__) && !defined(__clang__)\n"
	"#define KL_V8 1\n"
	"typedef float kl_v8f __attribute__((vector_size(32)));\n"
	"typedef int kl_v8i __attribute__((vector_size(32)));\n"
	"typedef short kl_v8h __attribute__((vector_size(16)));\n"
	"#define KL_FMA8(a, b, c) __builtin_ia32_vfmaddps256((a), (b), (c))\n"
	"KL_FN kl_v8f kl_ld8_f32(const float *p)\n"
	"{ kl_v8f v; memcpy(&v, p, sizeof v); return v; }\n"
	"KL_FN kl_v8f kl_ld8_f16(const uint16_t *p)\n"
	"{ kl_v8h h; memcpy(&h, p, sizeof h); return __builtin_ia32_vcvtph2ps256(h); }\n"
	"KL_FN kl_v8f kl_ld8_bf16(const uint16_t *p)\n"
	"{\n"
	"\ttypedef unsigned short kl_v8uh __attribute__((vector_size(16)));\n"
	"\ttypedef unsigned kl_v8u __attribute__((vector_size(32)));\n"
	"\tkl_v8uh h;\n"
	"\tmemcpy(&h, p, sizeof h);\n"
	"\tkl_v8u u = __builtin_convertvector(h, kl_v8u) << 16;\n"
	"\tkl_v8f v;\n"
	"\tmemcpy(&v, &u, sizeof v);\n"
	"\treturn v;\n"
	"}\n"
	"KL_FN kl_v8f kl_exp8(kl_v8f v)\n"
	"{\n"
	"\tconst kl_v8f z = {0}, big = z + 12582912.0f;\n"
	"\tv = __builtin_ia32_maxps256(z - 120.0f, v);\n"
	"\tv = __builtin_ia32_minps256(z + 100.0f, v);\n"
	"\tkl_v8f k = KL_FMA8(v, z + 1.44269502162933349609375f, big);\n"
	"\tkl_v8f t = k - big;\n"
	"\tkl_v8f r = KL_FMA8(t, z - 0.693145751953125f, v);\n"
	"\tr = KL_FMA8(t, z - 1.428606765330187045e-06f, r);\n"
	"\tkl_v8f p = KL_FMA8(z + 0.001384365362593157f, r, z + 0.008374155460233571f);\n"
	"\tp = KL_FMA8(p, r, z + 0.04166800204193069f);\n"
	"\tp = KL_FMA8(p, r, z + 0.16666431260829737f);\n"
	"\tp = KL_FMA8(p, r, z + 0.4999999420898756f);\n"
	"\tp = KL_FMA8(p, r, z + 1.0000000321654536f);\n"
	"\tp = KL_FMA8(p, r, z + 1.0f);\n"
	"\tkl_v8i b, b1;\n"
	"\tmemcpy(&b, &k, sizeof b);\n"
	"\tb -= 0x4B400000 - 254;\n"
	"\tb1 = b >> 1;\n"
	"\tkl_v8i e1 = b1 << 23, e2 = (b - b1) << 23;\n"
	"\tkl_v8f f1, f2;\n"
	"\tmemcpy(&f1, &e1, sizeof f1);\n"
	"\tmemcpy(&f2, &e2, sizeof f2);\n"
	"\treturn p * f1 * f2;\n"
	"}\n"
	"#define KL_EXPSUM_V16(LD16, LD1)\\\n"
	"\t\tfor (; i + 8 <= ce; i += 8) {\\\n"
	"\t\t\tkl_v8f p = kl_exp8(LD16(x + i) - m);\\\n"
	"\t\t\tmemcpy(e + i, &p, sizeof p);\\\n"
	"\t\t\tacc += p;\\\n"
	"\t\t}\n"
	"#define KL_EXPSUM_SUM() for (int j = 0; j < 8; j++) s += acc[j]\n"
	"#define kl_v16f kl_v8f\n"
	"#define kl_ld16_f32 kl_ld8_f32\n"
	"#define kl_ld16_f16 kl_ld8_f16\n"
	"#define kl_ld16_bf16 kl_ld8_bf16\n"
	"#else\n"
	"#define KL_EXPSUM_V16(LD16, LD1)\\\n"
	"\t\tfloat a = 0;\\\n"
	"\t\t_Pragma(\"omp simd reduction(+:a)\")\\\n"
	"\t\tfor (int64_t j = c; j < ce; j++) {\\\n"
	"\t\t\tfloat v = kl_expf(LD1(x[j]) - m);\\\n"
	"\t\t\te[j] = v;\\\n"
	"\t\t\ta += v;\\\n"
	"\t\t}\\\n"
	"\t\ts += a;\\\n"
	"\t\ti = ce;\n"
	"#define KL_EXPSUM_SUM() (void)0\n"
	"typedef float kl_v16f;\n"
	"#endif\n"
	"#if defined(__GNUC__) || defined(__clang__)\n"
	"#define KL_PREFETCH(p) __builtin_prefetch((p), 0, 3)\n"
	"#else\n"
	"#define KL_PREFETCH(p) (void)(p)\n"
	"#endif\n"
	"#define KL_EXPSUM_FN(NAME, T, LD16, LD1)\\\n"
	"KL_FN float NAME(float *restrict e, const T *restrict x, float m, int64_t n, const T *pf)\\\n"
	"{\\\n"
	"\tfloat s = 0;\\\n"
	"\tint64_t i = 0;\\\n"
	"\tkl_v16f acc = {0};\\\n"
	"\t(void)acc;\\\n"
	"\tfor (int64_t c = 0; c < n; c += 256) {\\\n"
	"\t\tint64_t ce = c + 256 < n ? c + 256 : n;\\\n"
	"\t\tfor (int64_t j = c; pf && j < ce; j += (int64_t)(64 / sizeof(T)))\\\n"
	"\t\t\tKL_PREFETCH(pf + j);\\\n"
	"\t\tKL_EXPSUM_V16(LD16, LD1)\\\n"
	"\t}\\\n"
	"\tKL_EXPSUM_SUM();\\\n"
	"\tfor (; i < n; i++) {\\\n"
	"\t\tfloat v = kl_expf(LD1(x[i]) - m);\\\n"
	"\t\te[i] = v;\\\n"
	"\t\ts += v;\\\n"
	"\t}\\\n"
	"\treturn s;\\\n"
	"}\n"
	"#define kl_f2f(v) (v)\n"
	"KL_EXPSUM_FN(kl_expsum_f32, float, kl_ld16_f32, kl_f2f)\n"
	"KL_EXPSUM_FN(kl_expsum_f16, uint16_t, kl_ld16_f16, kl_h2f)\n"
	"KL_EXPSUM_FN(kl_expsum_bf16, uint16_t, kl_ld16_bf16, kl_bf2f)\n"
	/* d[i] = s[i] * m rounded to f16 (as kl_f2h: vcvtps2ph rounds to
	 * nearest even, NaN stays NaN): a row's last pass out of a row-local
	 * array, one vector of 16 a step with AVX-512, of 8 with AVX2 and F16C
	 * (the scalar loop left softmax f16 at 1.9x f32's time on the Zen 3) */
	"KL_FN void kl_scale_f16(uint16_t *restrict d, const float *restrict s, float m, int64_t n)\n"
	"{\n"
	"\tint64_t i = 0;\n"
	"#if defined(KL_V16)\n"
	"\tfor (int64_t v = 0; v < n / 16; v++) {\n"
	"\t\tkl_v16h h = __builtin_ia32_vcvtps2ph512_mask(kl_ld16_f32(s + 16 * v) * m, 0, "
	"(kl_v16h){0}, 0xFFFF);\n"
	"\t\tmemcpy(d + 16 * v, &h, sizeof h);\n"
	"\t}\n"
	"\ti = n / 16 * 16;\n"
	"#elif defined(KL_V8)\n"
	"\tfor (int64_t v = 0; v < n / 8; v++) {\n"
	"\t\tkl_v8h h = __builtin_ia32_vcvtps2ph256(kl_ld8_f32(s + 8 * v) * m, 0);\n"
	"\t\tmemcpy(d + 8 * v, &h, sizeof h);\n"
	"\t}\n"
	"\ti = n / 8 * 8;\n"
	"#endif\n"
	"\tfor (; i < n; i++)\n"
	"\t\td[i] = kl_f2h(s[i] * m);\n"
	"}\n"
	/* kiln's thread pool (pool.c), set when the binary is loaded: the
	 * parallel nests are functions of an env and a range [lo, hi) of their
	 * first loop (render.c outlines them) */
	"typedef struct kl_penv {\n"
	"\tvoid *const *B;\n"
	"\tconst int64_t *S;\n"
	"} kl_penv;\n"
	"void (*kl_jit_par_for)(int64_t, void (*)(void *, int64_t, int64_t), void *);\n"
	/* a row out with non-temporal stores (no read-for-ownership of the
	 * destination), fenced so the stores are visible when the kernel
	 * returns, times m: a row whose last pass only scales a row-local array
	 * by one value (softmax's normalization) has the multiply ride on the
	 * stream, one pass over the row fewer. pf: the next row's input (may
	 * be NULL), fetched a line per 16 elements meanwhile, since the row's
	 * exp pass leaves the memory idle for longer than the prefetchers
	 * wait (a prefetch does not fault, past the buffer or not) */
	"KL_FN void kl_stream_scale_f32(float *restrict d, const float *restrict s, float m, "
	"int64_t n, const float *pf)\n"
	"{\n"
	"\tint64_t i = 0;\n"
	"#if defined(__AVX__) && (defined(__GNUC__) || defined(__clang__))\n"
	"\ttypedef float kl_v8f __attribute__((vector_size(32)));\n"
	"\tfor (; i < n && ((uintptr_t)(d + i) & 31u); i++)\n"
	"\t\td[i] = s[i] * m;\n"
	"\tfor (; i + 8 <= n; i += 8) {\n"
	"\t\tkl_v8f v;\n"
	"\t\tmemcpy(&v, s + i, sizeof v);\n"
	"\t\tv = v * m;\n"
	"\t\tif (pf && (i & 15) == 0)\n"
	"\t\t\t__builtin_prefetch(pf + i, 0, 3);\n"
	"#if defined(__clang__)\n"
	"\t\t__builtin_nontemporal_store(v, (kl_v8f *)(void *)(d + i));\n"
	"#else\n"
	"\t\t__builtin_ia32_movntps256(d + i, v);\n"
	"#endif\n"
	"\t}\n"
	"\t__builtin_ia32_sfence();\n"
	"#else\n"
	"\t(void)pf;\n"
	"#endif\n"
	"\tfor (; i < n; i++)\n"
	"\t\td[i] = s[i] * m;\n"
	"}\n"
	/* the plain copy out: m = 1 and no prefetch fold away once inlined */
	"KL_FN void kl_stream_f32(float *restrict d, const float *restrict s, int64_t n)\n"
	"{ kl_stream_scale_f32(d, s, 1.0f, n, NULL); }\n"
	/* a line per 16 floats of [p, p + n) into the cache (the next row's
	 * input, a chunk at a time inside the exp pass) */
	"KL_FN void kl_prefetch_f32(const float *p, int64_t n)\n"
	"{\n"
	"#if defined(__GNUC__) || defined(__clang__)\n"
	"\tfor (int64_t i = 0; i < n; i += 16)\n"
	"\t\t__builtin_prefetch(p + i, 0, 3);\n"
	"#else\n"
	"\t(void)p, (void)n;\n"
	"#endif\n"
	"}\n";

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
		int64_t v = kl__f2i64(k);
		if (dt == KL_I32) {
			/* saturate like every float -> int conversion (kl__store) */
			if (v <= INT32_MIN)
				kl__sb_puts(sb, "INT32_MIN");
			else if (v >= INT32_MAX)
				kl__sb_puts(sb, "INT32_MAX");
			else
				kl__sb_printf(sb, "((int32_t)%d)", (int)v);
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
		/* the round trip in one helper (half.h's, branch-free) */
		kl__sb_puts(sb, to == KL_F16 ? "kl_rh(" : "kl_rbf(");
		if (from == KL_F64) /* one correct rounding, not two */
			kl__sb_printf(sb, "kl_d2f_odd(%s)", a);
		else
			to_float(sb, from, a);
		kl__sb_puts(sb, ")");
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

/* An op's expression from the op table, for compute type dt, with the
 * operands a and b: the one spelling of each op for the C and CUDA targets.
 * An op without an expression for dt gets a name that does not exist, so
 * the kernel fails to compile instead of computing something else (the op
 * table test rejects such a table first). */
static void c_expr(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b)
{
	const kl_opdesc *d = op < KL_NOPS ? kl__opdesc[op] : NULL;
	bool dbl = dt == KL_F64, fl = is_f(dt) || dbl;
	const char *e = !d ? NULL : dbl ? d->expr_d : fl ? d->expr_f : d->expr_i;
	if (!e) {
		kl__sb_printf(sb, "kl_no_expression_for_op_%d_dtype_%d", (int)op, (int)dt);
		return;
	}
	while (*e) {
		const char *p = strchr(e, '$');
		if (!p || !p[1]) {
			kl__sb_puts(sb, e);
			return;
		}
		if (p > e)
			kl__sb_printf(sb, "%.*s", (int)(p - e), e);
		e = p + 2;
		switch (p[1]) {
		case 'a': kl__sb_puts(sb, a); break;
		case 'b': kl__sb_puts(sb, b); break;
		case 'f': kl__sb_puts(sb, dbl ? "" : "f"); break;
		case 't': kl__sb_puts(sb, dbl ? "d" : "f"); break;
		case 's':
			kl__sb_puts(sb, dt == KL_I64 ? "int64_t" : dt == KL_I32 ? "int32_t" : "int");
			break;
		case 'u': kl__sb_puts(sb, dt == KL_I64 ? "uint64_t" : "uint32_t"); break;
		case 'w': kl__sb_puts(sb, dt == KL_I64 ? "64" : "32"); break;
		default: kl__sb_printf(sb, "$%c", p[1]); break;
		}
	}
}

static void c_unary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a)
{
	if (op == KL_OP_EXP && is_f(dt)) { /* the prelude's, vectorized inline */
		kl__sb_printf(sb, "kl_expf(%s)", a);
		return;
	}
	c_expr(sb, op, dt, a, "");
}

static void c_binary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b)
{
	c_expr(sb, op, dt, a, b);
}

static void c_rand(kl_sb *sb, kl_op op, uint64_t seed, const char *key, const char *index)
{
	kl__sb_printf(sb, "kl_rand_%s(", op == KL_OP_RANDN ? "normal" : "uniform");
	if (key)
		kl__sb_puts(sb, key);
	else
		kl__sb_printf(sb, "UINT64_C(%llu)", (unsigned long long)seed);
	kl__sb_printf(sb, ", (uint64_t)%s)", index);
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
	default: /* not a reduction the renderers know: fail to compile, never skip it */
		kl__sb_printf(sb, "kl_no_accumulator_for_op_%d;", (int)op);
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
	.buf_decl_fmt = "\t%s%s *restrict b%d = (%s%s *)B[%d];\n\t(void)b%d;\n",
	.buf_decl_alias_fmt = "\t%s%s *b%d = (%s%s *)B[%d];\n\t(void)b%d;\n",
	.index_t = "int64_t",
	.simd_fmt = "#pragma omp simd collapse(%d)%s",
	.sym_fmt = "S[%d]",
	.par_threshold = 32768,
	/* past the last-level cache a result row streams out (8 MiB: above what
	 * this class of machine keeps in L3 per socket slice) */
	.stream_min_bytes = 8.0 * 1024 * 1024,
	/* a softmax row's exp-sum in float: a double add per element (two
	 * conversions and two adds a vector) held the 4096-wide f32 softmax
	 * behind its memory traffic; 8192 terms of [0, 1] over 16 lanes are
	 * 512 adds a lane */
	.exp_sum_float_max = 8192,
	.exp_sum_row = true,
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
