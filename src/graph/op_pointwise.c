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
#include "graph/build.h"
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

/* ---- vector-Jacobian rules ------------------------------------------------------------
 * Each rule reads its forward node's operands (x = in[0], y = in[1] or the
 * number attrs.s[0]) and output, and builds its inputs' gradients from gout
 * with the node builders (graph/build.h). They may leave a gradient in the
 * output's shape and dtype: the sweep sums it down to its input's shape and
 * casts it to its input's dtype. */

typedef struct pw_ctx {
	kl_graph *g;
	int32_t out, x, y, c; /* c: where's third operand */
	bool scalar;          /* y is the number s */
	double s;
	kl_dtype dt;
} pw_ctx;

static pw_ctx pw_of(kl_graph *g, int32_t node)
{
	const kl_node *n = &g->nodes[node];
	pw_ctx p = {.g = g, .out = node, .x = n->in[0], .y = n->nin > 1 ? n->in[1] : -1,
	            .c = n->nin > 2 ? n->in[2] : -1, .scalar = n->a.scalar_rhs != 0,
	            .s = n->a.s[0], .dt = (kl_dtype)n->dtype};
	return p;
}

static kl_status done(int32_t *gin, int32_t a, int32_t b, bool want_b)
{
	gin[0] = a;
	gin[1] = want_b ? b : -1;
	return a < 0 || (want_b && b < 0) ? KL_EINVAL : KL_OK;
}

static int32_t zero0(const pw_ctx *p)
{
	return kl__gb_full(p->g, p->dt, 0, NULL, 0.0);
}

/* where(cond, v, 0) */
static int32_t keep_where(const pw_ctx *p, int32_t cond, int32_t v)
{
	return kl__gb_where(p->g, cond, v, zero0(p));
}

/* a compare of x with y (or the number s) */
static int32_t cmp(const pw_ctx *p, kl_op op, int32_t a)
{
	return p->scalar ? kl__gb_scalar(p->g, op, a, p->s) : kl__gb_binary(p->g, op, a, p->y);
}

/* a && b of two bool nodes */
static int32_t and_(const pw_ctx *p, int32_t a, int32_t b)
{
	return kl__gb_where(p->g, a, b, kl__gb_full(p->g, KL_BOOL, 0, NULL, 0.0));
}

static int32_t mul(kl_graph *g, int32_t a, int32_t b)
{
	return kl__gb_binary(g, KL_OP_MUL, a, b);
}

static kl_status vjp_add(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	return done(gin, go, go, !p.scalar);
}

static kl_status vjp_sub(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	return done(gin, go, p.scalar ? -1 : kl__gb_unary(g, KL_OP_NEG, go), !p.scalar);
}

static kl_status vjp_mul(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	if (p.scalar)
		return done(gin, kl__gb_scalar(g, KL_OP_MUL, go, p.s), -1, false);
	return done(gin, mul(g, go, p.y), mul(g, go, p.x), true);
}

/* d(x/y) = go / y, -go * out / y */
static kl_status vjp_div(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	if (p.scalar)
		return done(gin, kl__gb_scalar(g, KL_OP_DIV, go, p.s), -1, false);
	int32_t gx = kl__gb_binary(g, KL_OP_DIV, go, p.y);
	int32_t gy = kl__gb_unary(g, KL_OP_NEG, kl__gb_binary(g, KL_OP_DIV, mul(g, go, p.out), p.y));
	return done(gin, gx, gy, true);
}

/* torch's pow_backward: go * y * x^(y-1), 0 where y == 0; the exponent's
 * go * out * log(x), 0 where x == 0 and y >= 0 */
static kl_status vjp_pow(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	if (p.scalar) {
		if (p.s == 0)
			return done(gin, kl__gb_scalar(g, KL_OP_MUL, go, 0.0), -1, false);
		int32_t d = kl__gb_scalar(g, KL_OP_MUL, kl__gb_scalar(g, KL_OP_POW, p.x, p.s - 1), p.s);
		return done(gin, mul(g, go, d), -1, false);
	}
	int32_t ym1 = kl__gb_scalar(g, KL_OP_SUB, p.y, 1.0);
	int32_t d = mul(g, p.y, kl__gb_binary(g, KL_OP_POW, p.x, ym1));
	int32_t gx = kl__gb_where(g, kl__gb_scalar(g, KL_OP_EQ, p.y, 0.0), zero0(&p), mul(g, go, d));
	int32_t x0 = and_(&p, kl__gb_scalar(g, KL_OP_EQ, p.x, 0.0), kl__gb_scalar(g, KL_OP_GE, p.y, 0.0));
	int32_t gy = kl__gb_where(g, x0, zero0(&p),
	                          mul(g, go, mul(g, p.out, kl__gb_unary(g, KL_OP_LOG, p.x))));
	return done(gin, gx, gy, true);
}

/* maximum / minimum: the gradient goes to the operand that won; a tie
 * splits it half and half (torch) */
static kl_status vjp_extremum(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	bool mx = g->nodes[node].op == KL_OP_MAXIMUM;
	int32_t tie = cmp(&p, KL_OP_EQ, p.x);
	int32_t half = kl__gb_scalar(g, KL_OP_MUL, go, 0.5);
	int32_t xw = cmp(&p, mx ? KL_OP_GT : KL_OP_LT, p.x);
	int32_t gx = kl__gb_where(g, tie, half, keep_where(&p, xw, go));
	int32_t gy = -1;
	if (!p.scalar) {
		int32_t yw = cmp(&p, mx ? KL_OP_LT : KL_OP_GT, p.x);
		gy = kl__gb_where(g, tie, half, keep_where(&p, yw, go));
	}
	return done(gin, gx, gy, !p.scalar);
}

static kl_status vjp_neg(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	(void)node;
	return done(gin, kl__gb_unary(g, KL_OP_NEG, go), -1, false);
}

/* go * sign(x), 0 at 0 */
static kl_status vjp_abs(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	int32_t neg = keep_where(&p, kl__gb_scalar(g, KL_OP_LT, p.x, 0.0), kl__gb_unary(g, KL_OP_NEG, go));
	return done(gin, kl__gb_where(g, kl__gb_scalar(g, KL_OP_GT, p.x, 0.0), go, neg), -1, false);
}

/* the unary rules whose derivative is one expression of x and out */
static int32_t d_unary(const pw_ctx *p, kl_op op)
{
	kl_graph *g = p->g;
	int32_t x = p->x, y = p->out;
	switch (op) {
	case KL_OP_EXP:
		return y;
	case KL_OP_LOG:
		return kl__gb_binary(g, KL_OP_DIV, kl__gb_full(g, p->dt, 0, NULL, 1.0), x);
	case KL_OP_SQRT: /* 1 / (2 sqrt x) */
		return kl__gb_binary(g, KL_OP_DIV, kl__gb_full(g, p->dt, 0, NULL, 0.5), y);
	case KL_OP_RSQRT: /* -x^(-3/2) / 2 = -out^3 / 2 */
		return kl__gb_scalar(g, KL_OP_MUL, mul(g, y, mul(g, y, y)), -0.5);
	case KL_OP_SIN:
		return kl__gb_unary(g, KL_OP_COS, x);
	case KL_OP_COS:
		return kl__gb_unary(g, KL_OP_NEG, kl__gb_unary(g, KL_OP_SIN, x));
	case KL_OP_TANH: /* 1 - out^2 */
		return kl__gb_scalar(g, KL_OP_ADD, kl__gb_unary(g, KL_OP_NEG, mul(g, y, y)), 1.0);
	case KL_OP_SIGMOID: /* out (1 - out), from the saved output */
		return mul(g, y, kl__gb_scalar(g, KL_OP_ADD, kl__gb_unary(g, KL_OP_NEG, y), 1.0));
	case KL_OP_GELU: {
		/* Phi(x) + x phi(x); Phi(x) = gelu(x) / x (1/2 at 0: kiln has no erf) */
		int32_t Phi = kl__gb_where(g, kl__gb_scalar(g, KL_OP_EQ, x, 0.0),
		                           kl__gb_full(g, p->dt, 0, NULL, 0.5),
		                           kl__gb_binary(g, KL_OP_DIV, y, x));
		int32_t x2 = kl__gb_scalar(g, KL_OP_MUL, mul(g, x, x), -0.5);
		int32_t phi = kl__gb_scalar(g, KL_OP_MUL, kl__gb_unary(g, KL_OP_EXP, x2),
		                            0.3989422804014327); /* 1/sqrt(2 pi) */
		return kl__gb_binary(g, KL_OP_ADD, Phi, mul(g, x, phi));
	}
	case KL_OP_GELU_TANH: {
		/* y = x/2 (1 + t), t = tanh(k (x + c x^3)):
		 * y' = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 c x^2) */
		const double k = 0.7978845608028654, c = 0.044715;
		int32_t x2 = mul(g, x, x);
		int32_t u = kl__gb_scalar(g, KL_OP_MUL,
		                          mul(g, x, kl__gb_scalar(g, KL_OP_ADD,
		                                                  kl__gb_scalar(g, KL_OP_MUL, x2, c), 1.0)),
		                          k);
		int32_t t = kl__gb_unary(g, KL_OP_TANH, u);
		int32_t a = kl__gb_scalar(g, KL_OP_MUL, kl__gb_scalar(g, KL_OP_ADD, t, 1.0), 0.5);
		int32_t omt2 = kl__gb_scalar(g, KL_OP_ADD, kl__gb_unary(g, KL_OP_NEG, mul(g, t, t)), 1.0);
		int32_t du = kl__gb_scalar(g, KL_OP_MUL,
		                           kl__gb_scalar(g, KL_OP_ADD, kl__gb_scalar(g, KL_OP_MUL, x2, 3 * c), 1.0),
		                           0.5 * k);
		return kl__gb_binary(g, KL_OP_ADD, a, mul(g, x, mul(g, omt2, du)));
	}
	case KL_OP_SILU: { /* s (1 + x (1 - s)) */
		int32_t s = kl__gb_unary(g, KL_OP_SIGMOID, x);
		int32_t oms = kl__gb_scalar(g, KL_OP_ADD, kl__gb_unary(g, KL_OP_NEG, s), 1.0);
		return mul(g, s, kl__gb_scalar(g, KL_OP_ADD, mul(g, x, oms), 1.0));
	}
	default:
		return -1;
	}
}

static kl_status vjp_unary(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	return done(gin, mul(g, go, d_unary(&p, (kl_op)g->nodes[node].op)), -1, false);
}

/* torch's threshold_backward: go where out > 0 */
static kl_status vjp_relu(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	return done(gin, keep_where(&p, kl__gb_scalar(g, KL_OP_GT, p.out, 0.0), go), -1, false);
}

/* the gradient cast back: the sweep casts it to the operand's dtype */
static kl_status vjp_cast(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	(void)g, (void)node;
	return done(gin, go, -1, false);
}

/* go where lo <= x <= hi (torch: the bounds pass the gradient) */
static kl_status vjp_clamp(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	double lo = g->nodes[node].a.s[0], hi = g->nodes[node].a.s[1];
	int32_t in = and_(&p, kl__gb_scalar(g, KL_OP_GE, p.x, lo), kl__gb_scalar(g, KL_OP_LE, p.x, hi));
	return done(gin, keep_where(&p, in, go), -1, false);
}

/* no gradient to the condition */
static kl_status vjp_where(kl_graph *g, int32_t node, int32_t go, int32_t *gin)
{
	pw_ctx p = pw_of(g, node);
	int32_t cond = p.x;
	int32_t z = zero0(&p);
	gin[0] = -1;
	gin[1] = kl__gb_where(g, cond, go, z);
	gin[2] = kl__gb_where(g, cond, z, go);
	return gin[1] < 0 || gin[2] < 0 ? KL_EINVAL : KL_OK;
}

/* ---- the rows ---------------------------------------------------------------------- */

#define PW(ID, DT, MATH, IMATH, EF, ED, EI, VJP, ...)                                        \
	const kl_opdesc kl__desc_##ID = {.dtype = DT,                                     \
	                                 .shape = sh_broadcast,                           \
	                                 .ref = kl__ref_pointwise,                        \
	                                 .math = MATH,                                    \
	                                 .imath = IMATH,                                  \
	                                 .expr_f = EF,                                    \
	                                 .expr_d = ED,                                    \
	                                 .expr_i = EI,                                    \
	                                 .eager = KL_EAGER_POINTWISE,                     \
	                                 .vjp = VJP,                                      \
	                                 __VA_ARGS__};

/* binary: float and double spell alike ($f, $t pick the variant) */
#define BIN(ID, MATH, IMATH, EFD, EI, VJP) PW(ID, dt_binary, MATH, IMATH, EFD, EFD, EI, VJP)
BIN(ADD, m_add, i_add, "($a + $b)", "($s)(($u)$a + ($u)$b)", vjp_add)
BIN(SUB, m_sub, i_sub, "($a - $b)", "($s)(($u)$a - ($u)$b)", vjp_sub)
BIN(MUL, m_mul, i_mul, "($a * $b)", "($s)(($u)$a * ($u)$b)", vjp_mul)
BIN(DIV, m_div, NULL, "($a / $b)", "($s)kl_divi($a, $b)", vjp_div)
BIN(POW, m_pow, i_pow, "pow$f($a, $b)", "($s)kl_powi($a, $b)", vjp_pow)
BIN(MAXIMUM, m_maximum, i_maximum, "kl_max$t($a, $b)", "($a > $b ? $a : $b)", vjp_extremum)
BIN(MINIMUM, m_minimum, i_minimum, "kl_min$t($a, $b)", "($a < $b ? $a : $b)", vjp_extremum)
#undef BIN

/* comparisons give bool: no gradient */
#define CMP(ID, MATH, E) PW(ID, dt_compare, MATH, NULL, E, E, E, NULL)
CMP(EQ, m_eq, "($a == $b)")
CMP(NE, m_ne, "($a != $b)")
CMP(LT, m_lt, "($a < $b)")
CMP(LE, m_le, "($a <= $b)")
CMP(GT, m_gt, "($a > $b)")
CMP(GE, m_ge, "($a >= $b)")
#undef CMP

/* unary with an integer form */
PW(NEG, dt_unary, m_neg, i_neg, "(-$a)", "(-$a)", "($s)(($u)0 - ($u)($a))", vjp_neg)
PW(ABS, dt_unary, m_abs, i_abs, "fabs$f($a)", "fabs$f($a)", "kl_absi$w($a)", vjp_abs)
PW(RELU, dt_unary, m_relu, i_relu, "($a < 0 ? 0 : $a)", "($a < 0 ? 0 : $a)",
   "($a < 0 ? ($s)0 : $a)", vjp_relu)

/* float-only unary math: computed in float whatever the operand */
#define UF(ID, MATH, E) PW(ID, dt_unary_float, MATH, NULL, E, E, NULL, vjp_unary)
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
PW(CAST, NULL, m_cast, NULL, NULL, NULL, NULL, vjp_cast, .raw = true, .composed = true)
PW(CLAMP, dt_clamp, m_clamp, NULL, NULL, NULL, NULL, vjp_clamp, .raw = true, .composed = true)
PW(WHERE, dt_where, m_where, NULL, NULL, NULL, NULL, vjp_where, .composed = true)
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
