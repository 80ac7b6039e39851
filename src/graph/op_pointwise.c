/* op_pointwise.c - the descriptors of the pointwise ops: binary arithmetic,
 * comparisons, unary math, cast, clamp and where. Each op is one row below:
 * its float64 math (the reference's definition), its integer math where
 * integers have their own (wrapping at the width), and its generated-code
 * expression for float, double and integer compute types (see optable.h
 * for the $-placeholders). The dtype rule is the family's.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "core/sat.h"
#include "graph/optable.h"

/* ---- dtype rules ---------------------------------------------------------------- */

static bool is_int(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64;
}

static bool integral(double s)
{
	return isfinite(s) && s == trunc(s);
}

/* binary arithmetic: torch.result_type of the operands; true division of
 * integers gives the default float; bool - bool is refused (as torch) */
static kl_dtype dt_binary(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	kl_dtype dt = kl__result_type(in);
	if (op == KL_OP_SUB && dt == KL_BOOL) {
		snprintf(why, cap, "dtypes bool and bool are not supported");
		return KL_NDTYPES;
	}
	if (op == KL_OP_DIV && !kl_dtype_is_float(dt))
		dt = KL_F32;
	return dt;
}

/* comparisons give bool (they compare in the promoted type) */
static kl_dtype dt_compare(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)in, (void)why, (void)cap;
	return KL_BOOL;
}

/* neg, abs, relu keep ints and refuse bool */
static kl_dtype dt_unary(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	if (in->dt[0] == KL_BOOL) {
		snprintf(why, cap, "dtype bool is not supported");
		return KL_NDTYPES;
	}
	return in->dt[0];
}

/* float-only math turns bool and ints into the default float */
static kl_dtype dt_unary_float(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	return kl_dtype_is_float(in->dt[0]) ? in->dt[0] : KL_F32;
}

/* clamp keeps its operand's dtype, except that an int operand with a
 * non-integral finite bound becomes the default float (the bounds act as
 * numbers; an infinite bound leaves its side open and promotes nothing);
 * bool is refused. */
static kl_dtype dt_clamp(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op;
	kl_dtype dt = in->dt[0];
	if (dt == KL_BOOL) {
		snprintf(why, cap, "dtype bool is not supported");
		return KL_NDTYPES;
	}
	for (int i = 0; i < in->nscalar; i++)
		if (is_int(dt) && isfinite(in->scalar[i]) && !integral(in->scalar[i]))
			return KL_F32;
	return dt;
}

/* where: the promoted type of the two values (the condition is not counted) */
static kl_dtype dt_where(kl_op op, const kl_operands *in, char *why, size_t cap)
{
	(void)op, (void)why, (void)cap;
	kl_operands v = {.n = 2, .dt = {in->dt[1], in->dt[2]}, .ndim = {in->ndim[1], in->ndim[2]}};
	return kl__result_type(&v);
}

/* ---- shape rule: numpy broadcasting of the inputs gives the node's shape --- */

static bool sh_broadcast(const kl_node *n, const int *ndim, const int64_t *const *shape,
                         char *why, size_t cap)
{
	char b1[96], b2[96];
	int bnd = ndim[0];
	int64_t bsh[KL_MAX_DIMS] = {0};
	memcpy(bsh, shape[0], sizeof(int64_t) * (size_t)bnd);
	for (int i = 1; i < n->nin; i++) {
		int64_t t[KL_MAX_DIMS];
		int tn;
		if (!kl__broadcast(bnd, bsh, ndim[i], shape[i], &tn, t)) {
			snprintf(why, cap, "input shapes %s and %s do not broadcast",
			         kl__shape_str(b1, sizeof b1, bnd, bsh),
			         kl__shape_str(b2, sizeof b2, ndim[i], shape[i]));
			return false;
		}
		bnd = tn;
		memcpy(bsh, t, sizeof t);
	}
	bool same = bnd == n->ndim;
	for (int d = 0; same && d < bnd; d++)
		same = bsh[d] == n->shape[d];
	if (!same)
		snprintf(why, cap, "inputs broadcast to %s, node shape is %s",
		         kl__shape_str(b1, sizeof b1, bnd, bsh),
		         kl__shape_str(b2, sizeof b2, n->ndim, n->shape));
	return same;
}

/* ---- float64 math ------------------------------------------------------------------ */

#define M(name, expr)                                                                  \
	static double name(const kl_attrs *at, double a, double b, double c)           \
	{                                                                              \
		(void)at, (void)a, (void)b, (void)c;                                   \
		return (expr);                                                         \
	}

/* 1 + erf(z) and 1 + tanh(u) cancel to nothing for negative x; erfc and the
 * logistic form are the same functions without that loss, and the oracle
 * must be accurate in the tails too. */
static double sigmoid(double x)
{
	return 1.0 / (1.0 + exp(-x));
}

static double gelu_tanh(double x)
{
	const double k = sqrt(2.0 / 3.14159265358979323846);
	/* 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) */
	return x / (1.0 + exp(-2.0 * k * (x + 0.044715 * x * x * x)));
}

static double clamp(const kl_attrs *at, double x)
{
	if (isnan(x))
		return x;
	double r = x < at->s[0] ? at->s[0] : x;
	return r > at->s[1] ? at->s[1] : r;
}

M(m_add, a + b)
M(m_sub, a - b)
M(m_mul, a * b)
M(m_div, a / b)
M(m_pow, pow(a, b))
M(m_maximum, isnan(a) || isnan(b) ? NAN : a > b ? a : b)
M(m_minimum, isnan(a) || isnan(b) ? NAN : a < b ? a : b)
M(m_eq, a == b)
M(m_ne, a != b)
M(m_lt, a < b)
M(m_le, a <= b)
M(m_gt, a > b)
M(m_ge, a >= b)
M(m_neg, -a)
M(m_abs, fabs(a))
M(m_exp, exp(a))
M(m_log, log(a))
M(m_sqrt, sqrt(a))
M(m_rsqrt, 1.0 / sqrt(a))
M(m_sin, sin(a))
M(m_cos, cos(a))
M(m_tanh, tanh(a))
M(m_sigmoid, sigmoid(a))
M(m_relu, isnan(a) ? a : (a > 0 ? a : 0.0))
M(m_gelu, 0.5 * a * erfc(-a / sqrt(2.0)))
M(m_gelu_tanh, gelu_tanh(a))
M(m_silu, a * sigmoid(a))
M(m_cast, a) /* the rounding to the node's dtype is the cast */
M(m_clamp, clamp(at, a))
M(m_where, a != 0 ? b : c)
#undef M

/* ---- integer math: exact, wrapping like C integers of the width ------------------ */

static uint64_t ipow(int64_t base, int64_t e)
{
	if (e < 0) {
		if (base == 1)
			return 1;
		if (base == -1)
			return (e & 1) ? (uint64_t)-1 : 1;
		return 0;
	}
	uint64_t r = 1, b = (uint64_t)base;
	while (e) {
		if (e & 1)
			r *= b;
		b *= b;
		e >>= 1;
	}
	return r;
}

#define I(name, expr)                                                                  \
	static double name(kl_dtype dt, int64_t a, int64_t b)                          \
	{                                                                              \
		(void)dt, (void)a, (void)b;                                            \
		return (expr);                                                         \
	}
I(i_add, kl__wrap_to(dt, (uint64_t)a + (uint64_t)b))
I(i_sub, kl__wrap_to(dt, (uint64_t)a - (uint64_t)b))
I(i_mul, kl__wrap_to(dt, (uint64_t)a * (uint64_t)b))
I(i_pow, kl__wrap_to(dt, ipow(a, b)))
I(i_maximum, (double)(a > b ? a : b))
I(i_minimum, (double)(a < b ? a : b))
I(i_neg, kl__wrap_to(dt, 0 - (uint64_t)a))
I(i_abs, a < 0 ? kl__wrap_to(dt, 0 - (uint64_t)a) : (double)a)
I(i_relu, a > 0 ? (double)a : 0.0)
#undef I

/* ---- the rows ---------------------------------------------------------------------- */

#define PW(ID, DT, MATH, IMATH, EF, ED, EI, ...)                                          \
	const kl_opdesc kl__desc_##ID = {.dtype = DT,                                     \
	                                 .shape = sh_broadcast,                           \
	                                 .ref = kl__ref_pointwise,                        \
	                                 .math = MATH,                                    \
	                                 .imath = IMATH,                                  \
	                                 .expr_f = EF,                                    \
	                                 .expr_d = ED,                                    \
	                                 .expr_i = EI,                                    \
	                                 .eager = KL_EAGER_POINTWISE,                     \
	                                 .vjp = NULL,                                     \
	                                 __VA_ARGS__};

/* binary: float and double spell alike ($f, $t pick the variant) */
#define BIN(ID, MATH, IMATH, EFD, EI) PW(ID, dt_binary, MATH, IMATH, EFD, EFD, EI)
BIN(ADD, m_add, i_add, "($a + $b)", "($s)(($u)$a + ($u)$b)")
BIN(SUB, m_sub, i_sub, "($a - $b)", "($s)(($u)$a - ($u)$b)")
BIN(MUL, m_mul, i_mul, "($a * $b)", "($s)(($u)$a * ($u)$b)")
BIN(DIV, m_div, NULL, "($a / $b)", "($s)kl_divi($a, $b)")
BIN(POW, m_pow, i_pow, "pow$f($a, $b)", "($s)kl_powi($a, $b)")
BIN(MAXIMUM, m_maximum, i_maximum, "kl_max$t($a, $b)", "($a > $b ? $a : $b)")
BIN(MINIMUM, m_minimum, i_minimum, "kl_min$t($a, $b)", "($a < $b ? $a : $b)")
#undef BIN

#define CMP(ID, MATH, E) PW(ID, dt_compare, MATH, NULL, E, E, E)
CMP(EQ, m_eq, "($a == $b)")
CMP(NE, m_ne, "($a != $b)")
CMP(LT, m_lt, "($a < $b)")
CMP(LE, m_le, "($a <= $b)")
CMP(GT, m_gt, "($a > $b)")
CMP(GE, m_ge, "($a >= $b)")
#undef CMP

/* unary with an integer form */
PW(NEG, dt_unary, m_neg, i_neg, "(-$a)", "(-$a)", "($s)(($u)0 - ($u)($a))")
PW(ABS, dt_unary, m_abs, i_abs, "fabs$f($a)", "fabs$f($a)", "kl_absi$w($a)")
PW(RELU, dt_unary, m_relu, i_relu, "($a < 0 ? 0 : $a)", "($a < 0 ? 0 : $a)",
   "($a < 0 ? ($s)0 : $a)")

/* float-only unary math: computed in float whatever the operand */
#define UF(ID, MATH, E) PW(ID, dt_unary_float, MATH, NULL, E, E, NULL)
UF(EXP, m_exp, "exp$f($a)")
UF(LOG, m_log, "log$f($a)")
UF(SQRT, m_sqrt, "sqrt$f($a)")
UF(RSQRT, m_rsqrt, "(1.0$f / sqrt$f($a))")
UF(SIN, m_sin, "sin$f($a)")
UF(COS, m_cos, "cos$f($a)")
UF(TANH, m_tanh, "tanh$f($a)")
UF(SIGMOID, m_sigmoid, "kl_sigmoid$t($a)")
UF(GELU, m_gelu, "kl_gelu$t($a)")
UF(GELU_TANH, m_gelu_tanh, "kl_gelu_tanh$t($a)")
UF(SILU, m_silu, "kl_silu$t($a)")
#undef UF

/* built by lowering from other instructions, so no expression of their own:
 * cast is a conversion, clamp a maximum and a minimum, where a select */
PW(CAST, NULL, m_cast, NULL, NULL, NULL, NULL, .raw = true, .composed = true)
PW(CLAMP, dt_clamp, m_clamp, NULL, NULL, NULL, NULL, .raw = true, .composed = true)
PW(WHERE, dt_where, m_where, NULL, NULL, NULL, NULL, .composed = true)
#undef PW

/* ---- one element ------------------------------------------------------------------ */

double kl__op_eval(kl_op op, const kl_attrs *at, kl_dtype dt, double a, double b, double c)
{
	const kl_opdesc *d = kl__opdesc[op];
	kl_cat cat = kl__ops[op].cat;
	if (cat == KL_CAT_COMPARE || cat == KL_CAT_WHERE || d->raw)
		return d->math(at, a, b, c);
	a = kl__round_to(dt, a);
	b = kl__round_to(dt, b);
	if (is_int(dt) && d->imath)
		return d->imath(dt, kl__f2i64(a), kl__f2i64(b));
	return d->math(at, a, b, c);
}

/* ---- torch.result_type --------------------------------------------------------------- */

static int category(kl_dtype dt)
{
	return dt == KL_BOOL ? 0 : kl_dtype_is_float(dt) ? 2 : 1;
}

static kl_dtype promote(kl_dtype acc, kl_dtype dt)
{
	return acc == KL_NDTYPES ? dt : kl_promote_types(acc, dt);
}

/* torch's combine_categories: the lower class counts only when its category
 * is above the higher class's (KL_NDTYPES: no operand of that class) */
static kl_dtype combine(kl_dtype higher, kl_dtype lower)
{
	if (higher == KL_NDTYPES)
		return lower;
	if (lower == KL_NDTYPES || category(lower) <= category(higher))
		return higher;
	return kl_promote_types(higher, lower);
}

kl_dtype kl__result_type(const kl_operands *in)
{
	kl_dtype dim = KL_NDTYPES, zero = KL_NDTYPES, num = KL_NDTYPES;
	for (int i = 0; i < in->n; i++) {
		if (in->ndim[i] > 0)
			dim = promote(dim, in->dt[i]);
		else
			zero = promote(zero, in->dt[i]);
	}
	for (int i = 0; i < in->nscalar; i++)
		num = promote(num, integral(in->scalar[i]) ? KL_I64 : KL_F32);
	kl_dtype r = combine(dim, combine(zero, num));
	return r == KL_NDTYPES ? KL_F32 : r;
}
