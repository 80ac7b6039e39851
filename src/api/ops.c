/* ops.c - the public ops: argument checks with messages that name the op,
 * shapes and values; torch's shape, broadcasting and dtype-promotion rules;
 * then one node per op handed to kl__dispatch (eager run or trace record).
 * Composites that are not nodes of their own (linear) are built from ops.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "api/autograd.h"
#include "api/dispatch.h"
#include "graph/optable.h"
#include "runtime/compiled.h"

#define SB 192 /* room for one "[d0,...,d7]" */

static const char *shp(char *b, const kl_tensor *t)
{
	return kl__shape_str(b, SB, t->ndim, t->shape);
}

/* The context of an op's inputs. A NULL input fails; when another input
 * gives the context and it already holds an error, that earlier error is
 * kept at the end of the message, so a chain of calls reports its root
 * cause. Inputs of two contexts fail. */
static kl_ctx *ctx_of(const char *op, int n, kl_tensor *const *ts)
{
	kl_ctx *ctx = NULL;
	int first = -1;
	for (int i = 0; i < n; i++)
		if (ts[i]) {
			ctx = ts[i]->ctx;
			first = i;
			break;
		}
	for (int i = 0; i < n; i++) {
		if (ts[i])
			continue;
		if (ctx && ctx->status != KL_OK)
			kl__err(ctx, KL_EINVAL, "kl_%s: input %d is NULL (after: %s)", op, i,
			        ctx->err);
		else
			kl__err(ctx, KL_EINVAL, "kl_%s: input %d is NULL", op, i);
		return NULL;
	}
	for (int i = 0; i < n; i++)
		if (ts[i]->ctx != ctx) {
			kl__err(ctx, KL_EINVAL,
			        "kl_%s: inputs %d and %d belong to different contexts", op, first,
			        i);
			return NULL;
		}
	return ctx;
}

static void node_init(kl_node *n, kl_op op, kl_dtype dt, int ndim, const int64_t *shape, int nin)
{
	memset(n, 0, sizeof *n);
	n->op = (uint16_t)op;
	n->dtype = (uint8_t)dt;
	n->ndim = (uint8_t)ndim;
	n->nin = (uint8_t)nin;
	if (ndim > 0)
		memcpy(n->shape, shape, (size_t)ndim * sizeof *shape);
}

static int norm_axis(int axis, int ndim)
{
	return axis < 0 ? axis + ndim : axis;
}

static kl_status not_float(kl_ctx *ctx, const char *op, kl_dtype dt)
{
	return kl__err(ctx, KL_EINVAL, "kl_%s: dtype %s is not floating point", op,
	               kl_dtype_name(dt));
}

static kl_status bad_axis(kl_ctx *ctx, const char *op, int axis, const kl_tensor *t)
{
	char b[SB];
	return kl__err(ctx, KL_EINVAL, "kl_%s: axis %d out of range for shape %s", op, axis,
	               shp(b, t));
}

/* ---- creation ---------------------------------------------------------------- */

static kl_tensor *source(kl_ctx *ctx, kl_op op, kl_dtype dt, int ndim, const int64_t *shape,
                         const kl_attrs *a)
{
	const char *name = op == KL_OP_FULL ? "full" : kl__ops[op].name;
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl_%s: ctx is NULL", name);
		return NULL;
	}
	if ((unsigned)dt >= KL_NDTYPES) {
		kl__err(ctx, KL_EINVAL, "kl_%s: unknown dtype %d", name, (int)dt);
		return NULL;
	}
	if (ndim < 0 || ndim > KL_MAX_DIMS) {
		kl__err(ctx, KL_EINVAL, "kl_%s: ndim %d out of range [0,%d]", name, ndim,
		        KL_MAX_DIMS);
		return NULL;
	}
	if (ndim > 0 && !shape) {
		kl__err(ctx, KL_EINVAL, "kl_%s: shape is NULL for ndim %d", name, ndim);
		return NULL;
	}
	int bad;
	kl_shape_err e = kl__shape_check(ndim, shape, &bad);
	if (e != KL_SHAPE_OK) {
		char b[SB], why[128];
		kl__err(ctx, KL_EINVAL, "kl_%s: shape %s: %s", name,
		        kl__shape_str(b, SB, ndim, shape),
		        kl__shape_why(why, sizeof why, e, ndim, shape, bad));
		return NULL;
	}
	if ((op == KL_OP_RAND || op == KL_OP_RANDN) && !kl_dtype_is_float(dt)) {
		not_float(ctx, name, dt);
		return NULL;
	}
	kl_node nd;
	node_init(&nd, op, dt, ndim, shape, 0);
	nd.a = *a;
	return kl__dispatch(ctx, &nd, NULL);
}

kl_tensor *kl_full(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, double value)
{
	KL_API("kl_full");
	kl_attrs a = {.s = {value}};
	return source(ctx, KL_OP_FULL, dt, ndim, shape, &a);
}

kl_tensor *kl_zeros(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape)
{
	KL_API("kl_zeros");
	return kl_full(ctx, dt, ndim, shape, 0.0);
}

kl_tensor *kl_scalar(kl_ctx *ctx, kl_dtype dt, double value)
{
	KL_API("kl_scalar");
	return kl_full(ctx, dt, 0, NULL, value);
}

kl_tensor *kl_arange(kl_ctx *ctx, kl_dtype dt, double start, double stop, double step)
{
	KL_API("kl_arange");
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl_arange: ctx is NULL");
		return NULL;
	}
	if (!isfinite(start) || !isfinite(stop) || !isfinite(step) || step == 0) {
		kl__err(ctx, KL_EINVAL,
		        "kl_arange: start %g, stop %g and step %g must be finite "
		        "and step nonzero",
		        start, stop, step);
		return NULL;
	}
	/* like torch, a step pointing away from stop is an error, not empty */
	if ((stop - start) * step < 0) {
		kl__err(ctx, KL_EINVAL, "kl_arange: step %g does not lead from %g to %g", step,
		        start, stop);
		return NULL;
	}
	double len = ceil((stop - start) / step);
	if (len > (double)KL_MAX_NUMEL) {
		kl__err(ctx, KL_EINVAL, "kl_arange: %g elements is too many", len);
		return NULL;
	}
	int64_t n = (int64_t)len;
	kl_attrs a = {.s = {start, step}};
	return source(ctx, KL_OP_ARANGE, dt, 1, &n, &a);
}

kl_tensor *kl_rand(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, uint64_t seed)
{
	KL_API("kl_rand");
	kl_attrs a = {.seed = seed};
	return source(ctx, KL_OP_RAND, dt, ndim, shape, &a);
}

kl_tensor *kl_randn(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, uint64_t seed)
{
	KL_API("kl_randn");
	kl_attrs a = {.seed = seed};
	return source(ctx, KL_OP_RANDN, dt, ndim, shape, &a);
}

kl_tensor *kl__rand_keyed(kl_ctx *ctx, kl_op op, kl_dtype dt, int ndim, const int64_t *shape,
                          uint64_t key, const uint64_t *rng_offset)
{
	int32_t w[2] = {(int32_t)(uint32_t)key, (int32_t)(uint32_t)(key >> 32)};
	kl_tensor *r = NULL;
	kl_scope_begin(ctx);
	kl_tensor *k[2] = {kl_from_host(ctx, KL_I32, 0, NULL, &w[0], sizeof w[0]),
	                   kl_from_host(ctx, KL_I32, 0, NULL, &w[1], sizeof w[1])};
	if (k[0] && k[1]) {
		kl_node nd;
		node_init(&nd, op, dt, ndim, shape, 2);
		r = kl_retain(kl__dispatch(ctx, &nd, k));
	}
	/* the graph reads values of this call: a fullgraph replay repeats it
	 * only when it can make the next call's key (the generator's) */
	if (r && ctx->trace && !rng_offset)
		ctx->trace->per_call = true;
	if (r && ctx->trace && rng_offset && kl__trace_rng_draw(ctx, k, *rng_offset) != KL_OK) {
		kl_release(r);
		r = NULL;
	}
	kl_scope_end(ctx);
	return r;
}

/* ---- pointwise --------------------------------------------------------------- */

/* The op table's dtype rule for the tensors ts[0..n) and numbers sc[0..ns);
 * KL_NDTYPES after setting the error. */
static kl_dtype rule_dtype(kl_ctx *ctx, kl_op op, int n, kl_tensor *const *ts, int ns,
                           const double *sc)
{
	kl_operands in = {.n = n, .nscalar = ns};
	for (int i = 0; i < n; i++) {
		in.dt[i] = ts[i]->dtype;
		in.ndim[i] = ts[i]->ndim;
	}
	for (int i = 0; i < ns; i++)
		in.scalar[i] = sc[i];
	char why[160];
	kl_dtype dt = kl__opdesc[op]->dtype(op, &in, why, sizeof why);
	if (dt == KL_NDTYPES)
		kl__err(ctx, KL_EINVAL, "kl_%s: %s", kl__ops[op].name, why);
	return dt;
}

/* A 0-dim operand that torch's rule did not let promote the result (f32
 * 0-dim with an f16 tensor: f16) is cast to the type the op computes in, as
 * torch casts every operand to the common dtype: the backends and the
 * reference then see the operand the op means. Only such narrowing casts
 * are added; a wider result type reads narrower operands as before.
 * tmp[i] receives the cast (to discard), or NULL. */
static bool cast_zero_dim(int n, kl_tensor **ts, kl_tensor **tmp, kl_dtype common)
{
	for (int i = 0; i < n; i++) {
		tmp[i] = NULL;
		if (ts[i]->ndim != 0 || ts[i]->dtype == common ||
		    kl_promote_types(ts[i]->dtype, common) == common)
			continue;
		tmp[i] = kl_cast(ts[i], common);
		if (!tmp[i])
			return false;
		ts[i] = tmp[i];
	}
	return true;
}

static void discard_all(int n, kl_tensor **tmp)
{
	for (int i = 0; i < n; i++)
		if (tmp[i])
			kl__tensor_discard(tmp[i]);
}

/* Elementwise over the broadcast of in[0..nin), result dtype dt, operands
 * first brought to the common dtype where torch's rule asks for it. */
static kl_tensor *pointwise_node(kl_ctx *ctx, kl_op op, kl_dtype dt, kl_dtype common, int nin,
                                 kl_tensor **in, int nd, const int64_t *shape)
{
	kl_tensor *tmp[3];
	kl_tensor *r = NULL;
	if (cast_zero_dim(nin, in, tmp, common)) {
		kl_node n;
		node_init(&n, op, dt, nd, shape, nin);
		r = kl__dispatch(ctx, &n, in);
	}
	discard_all(nin, tmp);
	return r;
}

static kl_tensor *binary(kl_op op, kl_tensor *a, kl_tensor *b)
{
	const char *name = kl__ops[op].name;
	kl_tensor *in[2] = {a, b};
	kl_ctx *ctx = ctx_of(name, 2, in);
	if (!ctx)
		return NULL;
	int nd;
	int64_t shape[KL_MAX_DIMS];
	if (!kl__broadcast(a->ndim, a->shape, b->ndim, b->shape, &nd, shape)) {
		char b0[SB], b1[SB];
		kl__err(ctx, KL_EINVAL, "kl_%s: shapes %s and %s do not broadcast", name,
		        shp(b0, a), shp(b1, b));
		return NULL;
	}
	kl_dtype dt = rule_dtype(ctx, op, 2, in, 0, NULL);
	if (dt == KL_NDTYPES)
		return NULL;
	/* arithmetic computes in its result dtype (true division: a float one);
	 * a comparison in the operands' common dtype (the backend's business),
	 * giving bool */
	kl_operands ops = {.n = 2, .dt = {a->dtype, b->dtype}, .ndim = {a->ndim, b->ndim}};
	kl_dtype common = kl__ops[op].cat == KL_CAT_COMPARE ? kl__result_type(&ops) : dt;
	return pointwise_node(ctx, op, dt, common, 2, in, nd, shape);
}

/* A scalar acts like a Python number: it raises the result's dtype only
 * across categories. An integral s is int-like: bool tensor -> i64, int and
 * float tensors keep theirs. A non-integral s (or inf/NaN) is float-like:
 * bool/int tensors -> f32, float tensors keep theirs (f16 + 2.5 -> f16). */
static kl_tensor *binary_scalar(kl_op op, kl_tensor *a, double s)
{
	const char *name = kl__ops[op].name;
	kl_ctx *ctx = ctx_of(name, 1, &a);
	if (!ctx)
		return NULL;
	kl_dtype dt = rule_dtype(ctx, op, 1, &a, 1, &s);
	if (dt == KL_NDTYPES)
		return NULL;
	kl_node n;
	node_init(&n, op, dt, a->ndim, a->shape, 1);
	n.a.scalar_rhs = 1;
	n.a.s[0] = s;
	return kl__dispatch(ctx, &n, &a);
}

#define BINARY(fn, OP)                                      \
	kl_tensor *kl_##fn(kl_tensor *a, kl_tensor *b)      \
	{                                                   \
		KL_API("kl_" #fn);                          \
		return binary(KL_OP_##OP, a, b);            \
	}                                                   \
	kl_tensor *kl_##fn##_scalar(kl_tensor *a, double s) \
	{                                                   \
		KL_API("kl_" #fn "_scalar");                \
		return binary_scalar(KL_OP_##OP, a, s);     \
	}
BINARY(add, ADD)
BINARY(sub, SUB)
BINARY(mul, MUL)
BINARY(div, DIV)
BINARY(pow, POW)
BINARY(maximum, MAXIMUM)
BINARY(minimum, MINIMUM)
BINARY(eq, EQ)
BINARY(ne, NE)
BINARY(lt, LT)
BINARY(le, LE)
BINARY(gt, GT)
BINARY(ge, GE)
#undef BINARY

/* Float-only math (exp, tanh, gelu, ...) turns bool/int into f32 as torch
 * does; neg/abs/relu keep ints and refuse bool. */
static kl_tensor *unary(kl_op op, kl_tensor *a)
{
	const char *name = kl__ops[op].name;
	kl_ctx *ctx = ctx_of(name, 1, &a);
	if (!ctx)
		return NULL;
	kl_dtype dt = rule_dtype(ctx, op, 1, &a, 0, NULL);
	if (dt == KL_NDTYPES)
		return NULL;
	kl_node n;
	node_init(&n, op, dt, a->ndim, a->shape, 1);
	return kl__dispatch(ctx, &n, &a);
}

#define UNARY(fn, OP)                        \
	kl_tensor *kl_##fn(kl_tensor *a)     \
	{                                    \
		KL_API("kl_" #fn);           \
		return unary(KL_OP_##OP, a); \
	}
UNARY(neg, NEG)
UNARY(abs, ABS)
UNARY(exp, EXP)
UNARY(log, LOG)
UNARY(sqrt, SQRT)
UNARY(rsqrt, RSQRT)
UNARY(sin, SIN)
UNARY(cos, COS)
UNARY(tanh, TANH)
UNARY(sigmoid, SIGMOID)
UNARY(relu, RELU)
UNARY(gelu, GELU)
UNARY(gelu_tanh, GELU_TANH)
UNARY(silu, SILU)
#undef UNARY

kl_tensor *kl_where(kl_tensor *cond, kl_tensor *a, kl_tensor *b)
{
	KL_API("kl_where");
	kl_tensor *in[3] = {cond, a, b};
	kl_ctx *ctx = ctx_of("where", 3, in);
	if (!ctx)
		return NULL;
	int n1, n2;
	int64_t s1[KL_MAX_DIMS], s2[KL_MAX_DIMS];
	if (!kl__broadcast(cond->ndim, cond->shape, a->ndim, a->shape, &n1, s1) ||
	    !kl__broadcast(n1, s1, b->ndim, b->shape, &n2, s2)) {
		char b0[SB], b1[SB], b2[SB];
		kl__err(ctx, KL_EINVAL, "kl_where: shapes %s, %s and %s do not broadcast",
		        shp(b0, cond), shp(b1, a), shp(b2, b));
		return NULL;
	}
	kl_dtype dt = rule_dtype(ctx, KL_OP_WHERE, 3, in, 0, NULL);
	if (dt == KL_NDTYPES)
		return NULL;
	return pointwise_node(ctx, KL_OP_WHERE, dt, dt, 3, in, n2, s2);
}

kl_tensor *kl_cast(kl_tensor *a, kl_dtype dt)
{
	KL_API("kl_cast");
	kl_ctx *ctx = ctx_of("cast", 1, &a);
	if (!ctx)
		return NULL;
	if ((unsigned)dt >= KL_NDTYPES) {
		kl__err(ctx, KL_EINVAL, "kl_cast: unknown dtype %d", (int)dt);
		return NULL;
	}
	/* a cast to its own dtype is a new handle on the same data in eager
	 * mode, like torch's .to(); a trace keeps the node (lowering drops it) */
	if (dt == a->dtype && !ctx->trace && a->st && !kl__requires_grad(a))
		return kl__tensor_view(a, a->ndim, a->shape, a->strides, a->offset);
	kl_node n;
	node_init(&n, KL_OP_CAST, dt, a->ndim, a->shape, 1);
	return kl__dispatch(ctx, &n, &a);
}

/* clamp keeps a's dtype, except that an int tensor with a non-integral
 * finite bound becomes f32 (as torch promotes with a float scalar); bool is
 * refused. Infinite bounds leave that side open. */
kl_tensor *kl_clamp(kl_tensor *a, double lo, double hi)
{
	KL_API("kl_clamp");
	kl_ctx *ctx = ctx_of("clamp", 1, &a);
	if (!ctx)
		return NULL;
	kl_dtype dt = rule_dtype(ctx, KL_OP_CLAMP, 1, &a, 2, (const double[]){lo, hi});
	if (dt == KL_NDTYPES)
		return NULL;
	if (isnan(lo) || isnan(hi)) {
		kl__err(ctx, KL_EINVAL, "kl_clamp: bounds %g and %g must not be NaN", lo, hi);
		return NULL;
	}
	kl_node n;
	node_init(&n, KL_OP_CLAMP, dt, a->ndim, a->shape, 1);
	n.a.s[0] = lo;
	n.a.s[1] = hi;
	return kl__dispatch(ctx, &n, &a);
}

/* ---- reductions -------------------------------------------------------------- */

/* Reduced dims of size 0: sum gives 0 and mean/var NaN (the backends' job),
 * but max/min/argmax have no identity, so they fail as in torch. */
static kl_tensor *reduce(kl_op op, kl_tensor *a, int naxes, const int *axes, bool keepdim,
                         int correction)
{
	const char *name = kl__ops[op].name;
	kl_ctx *ctx = ctx_of(name, 1, &a);
	if (!ctx)
		return NULL;
	char b0[SB];
	if (naxes < 0 || naxes > KL_MAX_DIMS || (naxes > 0 && !axes)) {
		kl__err(ctx, KL_EINVAL, "kl_%s: bad axis list (%d axes) for shape %s", name, naxes,
		        shp(b0, a));
		return NULL;
	}
	uint32_t mask = 0;
	for (int i = 0; i < naxes; i++) {
		/* a 0-dim tensor accepts axis 0 / -1 and reduces nothing, as torch */
		if (a->ndim == 0 && (axes[i] == 0 || axes[i] == -1))
			continue;
		int ax = norm_axis(axes[i], a->ndim);
		if (ax < 0 || ax >= a->ndim) {
			bad_axis(ctx, name, axes[i], a);
			return NULL;
		}
		if (mask & (1u << ax)) {
			kl__err(ctx, KL_EINVAL, "kl_%s: axis %d repeated for shape %s", name,
			        axes[i], shp(b0, a));
			return NULL;
		}
		mask |= 1u << ax;
	}
	if (naxes == 0)
		mask = a->ndim ? (1u << a->ndim) - 1 : 0;
	kl_dtype dt = rule_dtype(ctx, op, 1, &a, 0, NULL);
	if (dt == KL_NDTYPES)
		return NULL;
	if (kl__opdesc[op]->no_identity) {
		for (int d = 0; d < a->ndim; d++)
			if ((mask & (1u << d)) && a->shape[d] == 0) {
				kl__err(ctx, KL_EINVAL,
				        "kl_%s: reduction over an empty axis %d of shape %s", name,
				        d, shp(b0, a));
				return NULL;
			}
	}
	int64_t shape[KL_MAX_DIMS];
	int nd = 0;
	for (int d = 0; d < a->ndim; d++) {
		if (!(mask & (1u << d)))
			shape[nd++] = a->shape[d];
		else if (keepdim)
			shape[nd++] = 1;
	}
	kl_node n;
	node_init(&n, op, dt, nd, shape, 1);
	n.a.axes = mask;
	n.a.keepdim = keepdim;
	n.a.correction = correction;
	if (op == KL_OP_ARGMAX && a->ndim > 0)
		n.a.axis = norm_axis(axes[0], a->ndim);
	return kl__dispatch(ctx, &n, &a);
}

kl_tensor *kl_sum(kl_tensor *a, int naxes, const int *axes, bool keepdim)
{
	KL_API("kl_sum");
	return reduce(KL_OP_SUM, a, naxes, axes, keepdim, 0);
}

kl_tensor *kl_mean(kl_tensor *a, int naxes, const int *axes, bool keepdim)
{
	KL_API("kl_mean");
	return reduce(KL_OP_MEAN, a, naxes, axes, keepdim, 0);
}

kl_tensor *kl_max(kl_tensor *a, int naxes, const int *axes, bool keepdim)
{
	KL_API("kl_max");
	return reduce(KL_OP_MAX, a, naxes, axes, keepdim, 0);
}

kl_tensor *kl_min(kl_tensor *a, int naxes, const int *axes, bool keepdim)
{
	KL_API("kl_min");
	return reduce(KL_OP_MIN, a, naxes, axes, keepdim, 0);
}

kl_tensor *kl_var(kl_tensor *a, int naxes, const int *axes, int correction, bool keepdim)
{
	KL_API("kl_var");
	if (a && correction < 0) {
		kl__err(a->ctx, KL_EINVAL, "kl_var: correction %d must be >= 0", correction);
		return NULL;
	}
	return reduce(KL_OP_VAR, a, naxes, axes, keepdim, correction);
}

kl_tensor *kl_argmax(kl_tensor *a, int axis, bool keepdim)
{
	KL_API("kl_argmax");
	return reduce(KL_OP_ARGMAX, a, 1, &axis, keepdim, 0);
}

/* ---- movement ---------------------------------------------------------------- */

kl_tensor *kl_reshape(kl_tensor *a, int ndim, const int64_t *shape)
{
	KL_API("kl_reshape");
	kl_ctx *ctx = ctx_of("reshape", 1, &a);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (ndim < 0 || ndim > KL_MAX_DIMS || (ndim > 0 && !shape)) {
		kl__err(ctx, KL_EINVAL, "kl_reshape: bad target ndim %d", ndim);
		return NULL;
	}
	int64_t out[KL_MAX_DIMS];
	int bad;
	int64_t numel = kl_numel(a);
	kl_shape_err e = kl__reshape_shape(numel, ndim, shape, out, &bad);
	if (e != KL_SHAPE_OK) {
		char why[128];
		kl__err(ctx, KL_EINVAL, "kl_reshape: cannot reshape %s (%lld elements) to %s: %s",
		        shp(b0, a), (long long)numel, kl__shape_str(b1, SB, ndim, shape),
		        kl__shape_why(why, sizeof why, e, ndim, shape, bad));
		return NULL;
	}
	kl_node n;
	node_init(&n, KL_OP_RESHAPE, a->dtype, ndim, out, 1);
	return kl__dispatch(ctx, &n, &a);
}

kl_tensor *kl_permute(kl_tensor *a, const int *perm)
{
	KL_API("kl_permute");
	kl_ctx *ctx = ctx_of("permute", 1, &a);
	if (!ctx)
		return NULL;
	char b0[SB];
	if (!perm && a->ndim > 0) {
		kl__err(ctx, KL_EINVAL, "kl_permute: perm is NULL for shape %s", shp(b0, a));
		return NULL;
	}
	kl_node n;
	node_init(&n, KL_OP_PERMUTE, a->dtype, a->ndim, a->shape, 1);
	uint32_t seen = 0;
	for (int i = 0; i < a->ndim; i++) {
		int p = norm_axis(perm[i], a->ndim);
		if (p < 0 || p >= a->ndim || (seen & (1u << p))) {
			kl__err(ctx, KL_EINVAL,
			        "kl_permute: perm entry %d (%d) is out of range or "
			        "repeated for shape %s",
			        i, perm[i], shp(b0, a));
			return NULL;
		}
		seen |= 1u << p;
		n.a.v[i] = p;
		n.shape[i] = a->shape[p];
	}
	return kl__dispatch(ctx, &n, &a);
}

kl_tensor *kl_transpose(kl_tensor *a, int d0, int d1)
{
	KL_API("kl_transpose");
	kl_ctx *ctx = ctx_of("transpose", 1, &a);
	if (!ctx)
		return NULL;
	int x = norm_axis(d0, a->ndim), y = norm_axis(d1, a->ndim);
	if (x < 0 || x >= a->ndim || y < 0 || y >= a->ndim) {
		bad_axis(ctx, "transpose", (x < 0 || x >= a->ndim) ? d0 : d1, a);
		return NULL;
	}
	int perm[KL_MAX_DIMS];
	for (int i = 0; i < a->ndim; i++)
		perm[i] = i;
	perm[x] = y;
	perm[y] = x;
	return kl_permute(a, perm);
}

kl_tensor *kl_expand(kl_tensor *a, int ndim, const int64_t *shape)
{
	KL_API("kl_expand");
	kl_ctx *ctx = ctx_of("expand", 1, &a);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (ndim < a->ndim || ndim > KL_MAX_DIMS || (ndim > 0 && !shape)) {
		kl__err(ctx, KL_EINVAL, "kl_expand: cannot expand %s to %d dims", shp(b0, a), ndim);
		return NULL;
	}
	int64_t out[KL_MAX_DIMS];
	int lead = ndim - a->ndim;
	for (int i = 0; i < ndim; i++) {
		int j = i - lead;
		int64_t want = shape[i];
		bool ok;
		if (j < 0) {
			ok = want >= 0; /* new leading dims need a size */
		} else {
			if (want == -1)
				want = a->shape[j];
			ok = want >= 0 && (want == a->shape[j] || a->shape[j] == 1);
		}
		if (!ok) {
			kl__err(ctx, KL_EINVAL, "kl_expand: cannot expand %s to %s", shp(b0, a),
			        kl__shape_str(b1, SB, ndim, shape));
			return NULL;
		}
		out[i] = want;
	}
	kl_node n;
	node_init(&n, KL_OP_EXPAND, a->dtype, ndim, out, 1);
	return kl__dispatch(ctx, &n, &a);
}

/* Python slicing: negative bounds count from the end, out-of-range bounds
 * clamp, an empty range gives size 0 (kl__slice_len). attrs.v = normalized
 * start, clamped stop (>= start), step ([start, start + len) by 1 when at most
 * one element is taken). */
kl_tensor *kl_slice(kl_tensor *a, int axis, int64_t start, int64_t stop, int64_t step)
{
	KL_API("kl_slice");
	kl_ctx *ctx = ctx_of("slice", 1, &a);
	if (!ctx)
		return NULL;
	int ax = norm_axis(axis, a->ndim);
	if (ax < 0 || ax >= a->ndim) {
		bad_axis(ctx, "slice", axis, a);
		return NULL;
	}
	if (step < 1) {
		kl__err(ctx, KL_EINVAL, "kl_slice: step %lld must be >= 1", (long long)step);
		return NULL;
	}
	int64_t len;
	kl__slice_len(a->shape[ax], &start, &stop, step, &len); /* step >= 1 checked */
	kl_node n;
	node_init(&n, KL_OP_SLICE, a->dtype, a->ndim, a->shape, 1);
	n.shape[ax] = len;
	n.a.axis = ax;
	/* a slice that takes at most one element never steps: as [start,
	 * start + len) with step 1 it keeps the view's stride (and every index
	 * built from it) free of step * stride */
	if (len < 2) {
		stop = start + len;
		step = 1;
	}
	n.a.v[0] = start;
	n.a.v[1] = stop;
	n.a.v[2] = step;
	return kl__dispatch(ctx, &n, &a);
}

kl_tensor *kl_contiguous(kl_tensor *a)
{
	KL_API("kl_contiguous");
	kl_ctx *ctx = ctx_of("contiguous", 1, &a);
	if (!ctx)
		return NULL;
	if (!ctx->trace && a->st && kl_is_contiguous(a) && !kl__requires_grad(a))
		return kl__tensor_view(a, a->ndim, a->shape, a->strides, a->offset);
	kl_node n;
	node_init(&n, KL_OP_CONTIGUOUS, a->dtype, a->ndim, a->shape, 1);
	return kl__dispatch(ctx, &n, &a);
}

/* Indices whose values are held now (eager on any device, or a tensor made
 * before the trace) must lie in [0, rows) (kl__index_scan); false after
 * setting the error. */
static bool indices_in_range(kl_ctx *ctx, const char *op, const char *what, const kl_tensor *idx,
                             int64_t rows, const char *unit)
{
	int64_t e, v;
	if (kl__index_scan(ctx, op, idx, rows, false, 0, &e, &v) != KL_OK)
		return false;
	if (e >= 0) {
		kl__err(ctx, KL_EINVAL, "kl_%s: index %lld (element %lld) out of range for "
		        "%s of %lld %s", op, (long long)v, (long long)e, what,
		        (long long)rows, unit);
		return false;
	}
	return true;
}

/* index_select on dim 0. The indices are checked here whenever their values
 * are held now (eager on any device, or a tensor made before the trace), and
 * by the CPU backend; compiled code clamps an index to [0, rows - 1]. */
kl_tensor *kl_gather(kl_tensor *table, kl_tensor *idx)
{
	KL_API("kl_gather");
	kl_tensor *in[2] = {table, idx};
	kl_ctx *ctx = ctx_of("gather", 2, in);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (idx->dtype != KL_I32 && idx->dtype != KL_I64) {
		kl__err(ctx, KL_EINVAL, "kl_gather: indices have dtype %s, need i32 or i64",
		        kl_dtype_name(idx->dtype));
		return NULL;
	}
	if (table->ndim < 1 || idx->ndim + table->ndim - 1 > KL_MAX_DIMS) {
		kl__err(ctx, KL_EINVAL, "kl_gather: table %s and indices %s: the table needs a "
		        "dim and the result at most %d", shp(b0, table), shp(b1, idx), KL_MAX_DIMS);
		return NULL;
	}
	int64_t nidx = kl__numel(idx->ndim, idx->shape), rows = table->shape[0];
	if (rows == 0 && nidx > 0) {
		kl__err(ctx, KL_EINVAL, "kl_gather: table %s has no rows to index with %s",
		        shp(b0, table), shp(b1, idx));
		return NULL;
	}
	if (!indices_in_range(ctx, "gather", "a table", idx, rows, "rows"))
		return NULL;
	int64_t shape[KL_MAX_DIMS];
	int nd = 0;
	for (int d = 0; d < idx->ndim; d++)
		shape[nd++] = idx->shape[d];
	for (int d = 1; d < table->ndim; d++)
		shape[nd++] = table->shape[d];
	kl_node n;
	node_init(&n, KL_OP_GATHER, table->dtype, nd, shape, 2);
	return kl__dispatch(ctx, &n, in);
}

kl_tensor *kl_embedding(kl_tensor *idx, kl_tensor *weight)
{
	KL_API("kl_embedding");
	return kl_gather(weight, idx);
}

/* torch.index_add(base, 0, idx, src) with idx of any shape: out = base, then
 * out[idx[i], ...] += src[i, ...] for each element i of idx, summed in a
 * fixed order (deterministic). The gradient of kl_gather. */
kl_tensor *kl_index_add(kl_tensor *base, kl_tensor *idx, kl_tensor *src)
{
	KL_API("kl_index_add");
	kl_tensor *in[3] = {base, idx, src};
	kl_ctx *ctx = ctx_of("index_add", 3, in);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB], b2[SB];
	if (base->ndim < 1 || idx->ndim + base->ndim - 1 > KL_MAX_DIMS ||
	    !kl__index_add_shapes_ok(base->ndim, base->shape, base->ndim, base->shape, idx->ndim,
	                             idx->shape, src->ndim, src->shape)) {
		kl__err(ctx, KL_EINVAL, "kl_index_add: base %s, indices %s and source %s do not "
		        "match (the base needs a dim; the source is the indices' shape then the "
		        "base's dims after the first)", shp(b0, base), shp(b1, idx), shp(b2, src));
		return NULL;
	}
	kl_dtype dt = rule_dtype(ctx, KL_OP_INDEX_ADD, 3, in, 0, NULL);
	if (dt == KL_NDTYPES)
		return NULL;
	int64_t nidx = kl__numel(idx->ndim, idx->shape), rows = base->shape[0];
	if (rows == 0 && nidx > 0) {
		kl__err(ctx, KL_EINVAL, "kl_index_add: base %s has no rows to index with %s",
		        shp(b0, base), shp(b1, idx));
		return NULL;
	}
	if (!indices_in_range(ctx, "index_add", "a base", idx, rows, "rows"))
		return NULL;
	kl_node n;
	node_init(&n, KL_OP_INDEX_ADD, dt, base->ndim, base->shape, 3);
	return kl__dispatch(ctx, &n, in);
}

/* ---- cache_write: rows written at run-time positions -------------------------------- */

/* Check kl_cache_update / kl_cache_write's operands and fill their node:
 * positions checked on the host when they are there now (eager; the
 * compiled steps check them on the device). */
static bool cache_write_node(kl_ctx *ctx, const char *op, kl_tensor *const *in, int axis,
                             kl_node *n)
{
	kl_tensor *cache = in[0], *pos = in[1], *val = in[2];
	char why[400];
	kl_cw_geom g;
	int ax = norm_axis(axis, cache->ndim);
	if (pos->dtype != KL_I32 && pos->dtype != KL_I64) {
		kl__err(ctx, KL_EINVAL, "kl_%s: positions have dtype %s, need i32 or i64", op,
		        kl_dtype_name(pos->dtype));
		return false;
	}
	if (val->dtype != cache->dtype) {
		kl__err(ctx, KL_EINVAL, "kl_%s: values are %s, the cache %s (cast them first)", op,
		        kl_dtype_name(val->dtype), kl_dtype_name(cache->dtype));
		return false;
	}
	if (!kl__cache_write_geom(ax, cache->ndim, cache->shape, pos->ndim, pos->shape, val->ndim,
	                          val->shape, &g, why, sizeof why)) {
		kl__err(ctx, KL_EINVAL, "kl_%s: %s", op, why);
		return false;
	}
	node_init(n, KL_OP_CACHE_WRITE, cache->dtype, cache->ndim, cache->shape, 3);
	n->a.axis = ax;
	if (ctx->trace || !pos->st || g.rows == 0)
		return true;
	kl_tensor *dense = kl_retain(kl_is_contiguous(pos) ? pos : kl__eager_contiguous(ctx, pos));
	int64_t *host = malloc(sizeof(int64_t) * (size_t)g.rows);
	bool ok = dense && host;
	if (ok && ctx->be->to_host(ctx, host, kl__tensor_data(dense),
	                           (size_t)g.rows * kl_dtype_size(pos->dtype)) != KL_OK)
		ok = false;
	for (int64_t i = g.rows - 1; ok && i >= 0; i--) { /* widen i32 in place, from the end */
		int64_t p = pos->dtype == KL_I32 ? ((const int32_t *)(const void *)host)[i] : host[i];
		host[i] = p;
	}
	for (int64_t i = 0; ok && i < g.rows; i++)
		if (host[i] < 0 || host[i] > g.cap - g.s) {
			kl__err(ctx, KL_EINVAL, "kl_%s: row %lld writes %lld position%s at %lld, outside "
			        "the cache: positions along dim %d must lie in [0, %lld] (capacity %lld)",
			        op, (long long)i, (long long)g.s, g.s == 1 ? "" : "s",
			        (long long)host[i], ax, (long long)(g.cap - g.s), (long long)g.cap);
			free(host);
			kl_release(dense);
			return false;
		}
	if (!ok && ctx->status == KL_OK)
		kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory reading the positions", op);
	free(host);
	kl_release(dense);
	return ok;
}

/* operands dense for the eager kernels (a new reference each, or NULL) */
static bool dense_operands(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **d, int n)
{
	for (int i = 0; i < n; i++) {
		/* (the copy belongs to the open scope: one more reference) */
		d[i] = kl_retain(ctx->trace || kl_is_contiguous(in[i]) ? in[i]
		                                                       : kl__eager_contiguous(ctx, in[i]));
		if (!d[i]) {
			for (int j = 0; j < i; j++)
				kl_release(d[j]);
			return false;
		}
	}
	return true;
}

kl_tensor *kl_cache_update(kl_tensor *cache, int axis, kl_tensor *pos, kl_tensor *values)
{
	KL_API("kl_cache_update");
	kl_tensor *in[3] = {cache, pos, values}, *d[3];
	kl_ctx *ctx = ctx_of("cache_update", 3, in);
	kl_node n;
	if (!ctx || !cache_write_node(ctx, "cache_update", in, axis, &n) ||
	    !dense_operands(ctx, in, d, 3))
		return NULL;
	kl_tensor *r = kl__dispatch(ctx, &n, d);
	for (int i = 0; i < 3; i++)
		kl_release(d[i]);
	return r;
}

kl_status kl_cache_write(kl_tensor *cache, int axis, kl_tensor *pos, kl_tensor *values)
{
	KL_API("kl_cache_write");
	kl_tensor *in[3] = {cache, pos, values}, *d[3];
	kl_ctx *ctx = ctx_of("cache_write", 3, in);
	if (!ctx)
		return kl_last_status(cache ? cache->ctx : pos ? pos->ctx : values ? values->ctx : NULL);
	char b0[SB];
	if (!cache->st)
		return kl__err(ctx, KL_ESTATE, "kl_cache_write: the cache is a lazy tensor; write "
		               "into a tensor that existed before the call (kl_zeros, then pass it "
		               "in or reach it through user state)");
	if (!kl_is_contiguous(cache))
		return kl__err(ctx, KL_EINVAL, "kl_cache_write: the cache %s is not dense (strides "
		               "%s): allocate it as its own tensor", shp(b0, cache),
		               kl__shape_str(b0, SB, cache->ndim, cache->strides));
	kl_node n;
	if (!cache_write_node(ctx, "cache_write", in, axis, &n) || !dense_operands(ctx, in, d, 3))
		return kl_last_status(ctx);
	kl_status st = KL_OK;
	if (ctx->trace) {
		/* the graph's value of the cache after the write, written back
		 * into its memory when the graph ends: in place, no copy, where
		 * lowering finds nothing reads the old value after it */
		n.a.flags = KL_F_INPLACE;
		kl_tensor *v = kl__dispatch(ctx, &n, d);
		st = v ? kl__trace_write(ctx, cache, v) : kl_last_status(ctx);
	} else if ((st = ctx->be->exec(ctx, &n, d, cache)) == KL_OK) {
		kl__storage_written(cache->st);
	}
	for (int i = 0; i < 3; i++)
		kl_release(d[i]);
	return st;
}

/* torch.nn.functional.one_hot: eq(idx[..., None], arange(n)) as i64. */
kl_tensor *kl_one_hot(kl_tensor *idx, int64_t n)
{
	KL_API("kl_one_hot");
	kl_ctx *ctx = ctx_of("one_hot", 1, &idx);
	if (!ctx)
		return NULL;
	char b0[SB];
	if (idx->dtype != KL_I32 && idx->dtype != KL_I64) {
		kl__err(ctx, KL_EINVAL, "kl_one_hot: indices have dtype %s, need i32 or i64",
		        kl_dtype_name(idx->dtype));
		return NULL;
	}
	if (n < 0 || n > KL_MAX_NUMEL || idx->ndim + 1 > KL_MAX_DIMS) {
		kl__err(ctx, KL_EINVAL, "kl_one_hot: %lld classes for indices %s (need 0 <= n and "
		        "at most %d dims in the result)", (long long)n, shp(b0, idx), KL_MAX_DIMS);
		return NULL;
	}
	if (!indices_in_range(ctx, "one_hot", "a one-hot", idx, n, "classes"))
		return NULL;
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)idx->ndim);
	shape[idx->ndim] = 1;
	kl_tensor *col = kl_reshape(idx, idx->ndim + 1, shape);
	kl_tensor *ar = col ? kl_arange(ctx, idx->dtype, 0, (double)n, 1) : NULL;
	kl_tensor *eq = ar ? kl_eq(col, ar) : NULL;
	kl_tensor *r = eq ? kl_cast(eq, KL_I64) : NULL;
	kl__tensor_discard(col);
	kl__tensor_discard(ar);
	kl__tensor_discard(eq);
	return r;
}

/* Inputs of another dtype are cast to the promoted one first; more inputs
 * than a node holds become a chain (each link takes the previous result
 * and up to KL_NODE_MAX_IN - 1 more). */
kl_tensor *kl_concat(int n, kl_tensor *const *ts, int axis)
{
	KL_API("kl_concat");
	if (n < 1 || !ts) {
		kl__err(NULL, KL_EINVAL, "kl_concat: needs at least one tensor (n = %d)", n);
		return NULL;
	}
	kl_ctx *ctx = ctx_of("concat", n, ts);
	if (!ctx)
		return NULL;
	const kl_tensor *t0 = ts[0];
	char b0[SB], b1[SB];
	int ax = norm_axis(axis, t0->ndim);
	if (ax < 0 || ax >= t0->ndim) {
		bad_axis(ctx, "concat", axis, t0);
		return NULL;
	}
	kl_dtype dt = t0->dtype;
	for (int i = 1; i < n; i++) {
		const kl_tensor *t = ts[i];
		bool ok = t->ndim == t0->ndim;
		for (int d = 0; ok && d < t0->ndim; d++)
			ok = d == ax || t->shape[d] == t0->shape[d];
		if (!ok) {
			kl__err(ctx, KL_EINVAL,
			        "kl_concat: shapes %s and %s (input %d) differ outside "
			        "axis %d",
			        shp(b0, t0), shp(b1, t), i, ax);
			return NULL;
		}
		dt = kl_promote_types(dt, t->dtype);
	}
	kl_tensor *cur = NULL; /* the chain so far, owned here */
	int i = 0;
	while (i < n) {
		kl_tensor *in[KL_NODE_MAX_IN];
		bool owned[KL_NODE_MAX_IN] = {false};
		int k = 0;
		if (cur) {
			in[k] = cur;
			owned[k++] = true;
		}
		kl_status st = KL_OK;
		while (k < KL_NODE_MAX_IN && i < n) {
			kl_tensor *t = ts[i++];
			if (t->dtype != dt) {
				t = kl_cast(t, dt);
				if (!t) {
					st = KL_EINVAL;
					break;
				}
				owned[k] = true;
			}
			in[k++] = t;
		}
		kl_tensor *r = NULL;
		if (st == KL_OK) {
			kl_node nd;
			int64_t shape[KL_MAX_DIMS];
			memcpy(shape, t0->shape, sizeof shape);
			shape[ax] = 0;
			for (int j = 0; j < k; j++)
				shape[ax] += in[j]->shape[ax];
			node_init(&nd, KL_OP_CONCAT, dt, t0->ndim, shape, k);
			nd.a.axis = ax;
			r = kl__dispatch(ctx, &nd, in);
		}
		for (int j = 0; j < k; j++)
			if (owned[j])
				kl__tensor_discard(in[j]);
		if (!r)
			return NULL;
		cur = r;
	}
	return cur;
}

/* ---- contractions -------------------------------------------------------------- */

/* torch.matmul: a 1-D operand is made a matrix (a: [1,K], b: [K,1]) and the
 * extra dim dropped from the result; batch dims broadcast, and both operands
 * are expanded to the common batch shape so that the node's inputs agree. */
kl_tensor *kl_matmul(kl_tensor *a, kl_tensor *b)
{
	KL_API("kl_matmul");
	kl_tensor *in[2] = {a, b};
	kl_ctx *ctx = ctx_of("matmul", 2, in);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (a->ndim == 0 || b->ndim == 0) {
		kl__err(ctx, KL_EINVAL, "kl_matmul: shapes %s and %s: both need at least 1 dim",
		        shp(b0, a), shp(b1, b));
		return NULL;
	}
	if (a->dtype != b->dtype) {
		kl__err(ctx, KL_EINVAL, "kl_matmul: dtypes %s and %s differ",
		        kl_dtype_name(a->dtype), kl_dtype_name(b->dtype));
		return NULL;
	}
	if (a->dtype == KL_BOOL) {
		kl__err(ctx, KL_EINVAL, "kl_matmul: dtype bool is not supported");
		return NULL;
	}
	int64_t k_a = a->shape[a->ndim - 1];
	int64_t k_b = b->ndim == 1 ? b->shape[0] : b->shape[b->ndim - 2];
	if (k_a != k_b) {
		kl__err(ctx, KL_EINVAL,
		        "kl_matmul: shapes %s and %s do not match (inner dims %lld "
		        "and %lld)",
		        shp(b0, a), shp(b1, b), (long long)k_a, (long long)k_b);
		return NULL;
	}
	int64_t m = a->ndim == 1 ? 1 : a->shape[a->ndim - 2];
	int64_t nn = b->ndim == 1 ? 1 : b->shape[b->ndim - 1];
	int nba = a->ndim > 2 ? a->ndim - 2 : 0, nbb = b->ndim > 2 ? b->ndim - 2 : 0;
	int nb;
	int64_t batch[KL_MAX_DIMS];
	if (!kl__broadcast(nba, a->shape, nbb, b->shape, &nb, batch) || nb + 2 > KL_MAX_DIMS) {
		kl__err(ctx, KL_EINVAL, "kl_matmul: batch dims of %s and %s do not broadcast",
		        shp(b0, a), shp(b1, b));
		return NULL;
	}
	/* each operand as [batch..., rows, cols], through reshape/expand */
	kl_tensor *ops[2] = {NULL, NULL};
	int64_t rows[2] = {m, k_a}, cols[2] = {k_a, nn};
	for (int s = 0; s < 2; s++) {
		kl_tensor *t = in[s];
		int64_t shape[KL_MAX_DIMS];
		memcpy(shape, batch, sizeof shape);
		shape[nb] = rows[s];
		shape[nb + 1] = cols[s];
		bool same = t->ndim == nb + 2;
		for (int d = 0; same && d < nb + 2; d++)
			same = t->shape[d] == shape[d];
		if (same)
			continue;
		kl_tensor *mat = t;
		if (t->ndim == 1) {
			int64_t ms[2] = {rows[s], cols[s]};
			mat = kl_reshape(t, 2, ms);
			if (!mat)
				goto fail;
			if (nb == 0) { /* already [rows, cols] */
				ops[s] = mat;
				continue;
			}
		}
		ops[s] = kl_expand(mat, nb + 2, shape);
		if (mat != t)
			kl__tensor_discard(mat);
		if (!ops[s])
			goto fail;
	}
	kl_tensor *args[2] = {ops[0] ? ops[0] : a, ops[1] ? ops[1] : b};
	int64_t oshape[KL_MAX_DIMS];
	memcpy(oshape, batch, sizeof oshape);
	oshape[nb] = m;
	oshape[nb + 1] = nn;
	kl_node n;
	node_init(&n, KL_OP_MATMUL, a->dtype, nb + 2, oshape, 2);
	kl_tensor *r = kl__dispatch(ctx, &n, args);
	kl__tensor_discard(ops[0]);
	kl__tensor_discard(ops[1]);
	if (!r || (a->ndim > 1 && b->ndim > 1))
		return r;
	/* drop the dims the 1-D operands gained */
	int64_t fshape[KL_MAX_DIMS];
	int fd = 0;
	for (int d = 0; d < nb; d++)
		fshape[fd++] = batch[d];
	if (a->ndim > 1)
		fshape[fd++] = m;
	if (b->ndim > 1)
		fshape[fd++] = nn;
	kl_tensor *f = kl_reshape(r, fd, fshape);
	kl__tensor_discard(r);
	return f;
fail:
	kl__tensor_discard(ops[0]);
	kl__tensor_discard(ops[1]);
	return NULL;
}

kl_tensor *kl_linear(kl_tensor *x, kl_tensor *w, kl_tensor *bias)
{
	KL_API("kl_linear");
	kl_tensor *in[2] = {x, w};
	kl_ctx *ctx = ctx_of("linear", 2, in);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (bias && bias->ctx != ctx) {
		kl__err(ctx, KL_EINVAL, "kl_linear: inputs 0 and 2 belong to different contexts");
		return NULL;
	}
	if (w->ndim != 2 || x->ndim < 1 || x->shape[x->ndim - 1] != w->shape[1]) {
		kl__err(ctx, KL_EINVAL,
		        "kl_linear: x %s and weight %s do not match (weight must be "
		        "[out, in] with in = x's last dim)",
		        shp(b0, x), shp(b1, w));
		return NULL;
	}
	if (bias && (bias->ndim != 1 || bias->shape[0] != w->shape[0])) {
		kl__err(ctx, KL_EINVAL,
		        "kl_linear: bias %s does not match weight %s (must be [%lld])",
		        shp(b0, bias), shp(b1, w), (long long)w->shape[0]);
		return NULL;
	}
	kl_tensor *wt = kl_transpose(w, 0, 1);
	if (!wt)
		return NULL;
	kl_tensor *y = kl_matmul(x, wt);
	kl__tensor_discard(wt);
	if (!y || !bias)
		return y;
	kl_tensor *r = kl_add(y, bias);
	kl__tensor_discard(y);
	return r;
}

/* ---- composites ------------------------------------------------------------------ */

static kl_tensor *softmax_like(kl_op op, kl_tensor *a, int axis)
{
	const char *name = kl__ops[op].name;
	kl_ctx *ctx = ctx_of(name, 1, &a);
	if (!ctx)
		return NULL;
	if (!kl_dtype_is_float(a->dtype)) {
		not_float(ctx, name, a->dtype);
		return NULL;
	}
	int ax = norm_axis(axis, a->ndim);
	if (ax < 0 || ax >= a->ndim) {
		bad_axis(ctx, name, axis, a);
		return NULL;
	}
	kl_node n;
	node_init(&n, op, a->dtype, a->ndim, a->shape, 1);
	n.a.axis = ax;
	return kl__dispatch(ctx, &n, &a);
}

kl_tensor *kl_softmax(kl_tensor *a, int axis)
{
	KL_API("kl_softmax");
	return softmax_like(KL_OP_SOFTMAX, a, axis);
}

kl_tensor *kl_log_softmax(kl_tensor *a, int axis)
{
	KL_API("kl_log_softmax");
	return softmax_like(KL_OP_LOG_SOFTMAX, a, axis);
}

/* torch.logsumexp: m + log(sum(exp(a - m))) with m the max over the axes
 * (0 where it is infinite, so that a row of -inf gives -inf and a row with
 * +inf gives +inf, as torch). Built from public ops; its gradient is the
 * softmax over the axes (the max's share cancels: sum(exp(a - m)) / s = 1). */
kl_tensor *kl_logsumexp(kl_tensor *a, int naxes, const int *axes, bool keepdim)
{
	KL_API("kl_logsumexp");
	kl_ctx *ctx = ctx_of("logsumexp", 1, &a);
	if (!ctx)
		return NULL;
	kl_tensor *x = a, *xf = NULL;
	if (!kl_dtype_is_float(a->dtype)) /* torch: integers to the default float */
		x = xf = kl_cast(a, KL_F32);
	kl_tensor *m = x ? kl_max(x, naxes, axes, true) : NULL;
	kl_tensor *am = m ? kl_abs(m) : NULL;
	kl_tensor *fin = am ? kl_lt_scalar(am, INFINITY) : NULL;
	kl_tensor *zero = fin ? kl_zeros(ctx, x->dtype, 0, NULL) : NULL;
	kl_tensor *ms = zero ? kl_where(fin, m, zero) : NULL;
	kl_tensor *z = ms ? kl_sub(x, ms) : NULL;
	kl_tensor *e = z ? kl_exp(z) : NULL;
	kl_tensor *s = e ? kl_sum(e, naxes, axes, true) : NULL;
	kl_tensor *l = s ? kl_log(s) : NULL;
	kl_tensor *r = l ? kl_add(l, ms) : NULL;
	kl_tensor *tmp[] = {xf, m, am, fin, zero, ms, z, e, s, l};
	for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++)
		kl__tensor_discard(tmp[i]);
	if (!r || keepdim)
		return r;
	/* the reduced dims dropped, as kl_sum would with keepdim false */
	int64_t shape[KL_MAX_DIMS];
	int nd = 0;
	uint32_t red = 0;
	for (int i = 0; i < naxes; i++)
		red |= 1u << norm_axis(axes[i], a->ndim);
	for (int d = 0; d < a->ndim; d++)
		if (naxes > 0 && !(red >> d & 1))
			shape[nd++] = a->shape[d];
	kl_tensor *f = kl_reshape(r, nd, shape);
	kl__tensor_discard(r);
	return f;
}

/* x must be float; weight and bias (optional) are [last dim of x] of any
 * float dtype; the result has x's dtype. Node inputs: x[, weight][, bias]. */
static kl_tensor *norm(kl_op op, kl_tensor *x, kl_tensor *w, kl_tensor *bias, double eps)
{
	const char *name = kl__ops[op].name;
	kl_ctx *ctx = ctx_of(name, 1, &x);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB];
	if (!kl_dtype_is_float(x->dtype)) {
		not_float(ctx, name, x->dtype);
		return NULL;
	}
	if (x->ndim < 1) {
		kl__err(ctx, KL_EINVAL, "kl_%s: x must have at least 1 dim, got shape []", name);
		return NULL;
	}
	if (!isfinite(eps) || eps < 0) {
		kl__err(ctx, KL_EINVAL, "kl_%s: eps %g must be finite and >= 0", name, eps);
		return NULL;
	}
	kl_tensor *in[3] = {x};
	int nin = 1;
	uint8_t flags = 0;
	kl_tensor *opt[2] = {w, bias};
	const char *what[2] = {"weight", "bias"};
	for (int i = 0; i < 2; i++) {
		kl_tensor *t = opt[i];
		if (!t)
			continue;
		if (t->ctx != ctx) {
			kl__err(ctx, KL_EINVAL, "kl_%s: x and %s belong to different contexts",
			        name, what[i]);
			return NULL;
		}
		if (!kl_dtype_is_float(t->dtype)) {
			kl__err(ctx, KL_EINVAL, "kl_%s: %s dtype %s is not floating point", name,
			        what[i], kl_dtype_name(t->dtype));
			return NULL;
		}
		if (t->ndim != 1 || t->shape[0] != x->shape[x->ndim - 1]) {
			kl__err(ctx, KL_EINVAL, "kl_%s: %s %s does not match x %s (must be [%lld])",
			        name, what[i], shp(b0, t), shp(b1, x),
			        (long long)x->shape[x->ndim - 1]);
			return NULL;
		}
		in[nin++] = t;
		flags |= i == 0 ? KL_F_HAS_WEIGHT : KL_F_HAS_BIAS;
	}
	kl_node n;
	node_init(&n, op, x->dtype, x->ndim, x->shape, nin);
	n.a.axis = x->ndim - 1;
	n.a.s[0] = eps;
	n.a.flags = flags;
	return kl__dispatch(ctx, &n, in);
}

kl_tensor *kl_layer_norm(kl_tensor *x, kl_tensor *weight, kl_tensor *bias, double eps)
{
	KL_API("kl_layer_norm");
	return norm(KL_OP_LAYER_NORM, x, weight, bias, eps);
}

kl_tensor *kl_rms_norm(kl_tensor *x, kl_tensor *weight, double eps)
{
	KL_API("kl_rms_norm");
	return norm(KL_OP_RMS_NORM, x, weight, NULL, eps);
}

/* One ATTENTION node (graph/ops.def) for kl_sdpa and kl_sdpa_lengths: q, k
 * and v cast to their promoted float dtype, lengths (NULL: none) as given. */
static kl_tensor *sdpa(const char *name, kl_tensor *q, kl_tensor *k, kl_tensor *v,
                       kl_tensor *lengths, bool causal, double scale)
{
	kl_tensor *in[4] = {q, k, v, lengths};
	kl_ctx *ctx = ctx_of(name + 3, lengths ? 4 : 3, in);
	if (!ctx)
		return NULL;
	char b0[SB], b1[SB], b2[SB];
	kl_dtype dt = kl_promote_types(kl_promote_types(q->dtype, k->dtype), v->dtype);
	if (!kl_dtype_is_float(dt)) {
		not_float(ctx, name + 3, dt);
		return NULL;
	}
	if (!isfinite(scale)) {
		kl__err(ctx, KL_EINVAL,
		        "%s: scale %g must be finite (KL_SDPA_DEFAULT_SCALE, 0, asks for "
		        "1/sqrt(head_dim))",
		        name, scale);
		return NULL;
	}
	int nd = q->ndim;
	bool ok = nd >= 2 && k->ndim == nd && v->ndim == nd;
	for (int d = 0; ok && d < nd - 2; d++)
		ok = k->shape[d] == q->shape[d] && v->shape[d] == q->shape[d];
	if (!ok) {
		kl__err(ctx, KL_EINVAL,
		        "%s: q %s, k %s and v %s need the same rank (>= 2) and batch dims", name,
		        shp(b0, q), shp(b1, k), shp(b2, v));
		return NULL;
	}
	if (k->shape[nd - 1] != q->shape[nd - 1] || v->shape[nd - 2] != k->shape[nd - 2]) {
		kl__err(ctx, KL_EINVAL,
		        "%s: q %s, k %s and v %s do not match (q and k share the head dim "
		        "%lld, k and v the key count %lld)",
		        name, shp(b0, q), shp(b1, k), shp(b2, v), (long long)q->shape[nd - 1],
		        (long long)k->shape[nd - 2]);
		return NULL;
	}
	if (lengths) {
		if (lengths->dtype != KL_I32 && lengths->dtype != KL_I64) {
			kl__err(ctx, KL_EINVAL, "%s: lengths have dtype %s, need i32 or i64", name,
			        kl_dtype_name(lengths->dtype));
			return NULL;
		}
		if (nd < 3 || lengths->ndim != 1 || lengths->shape[0] != q->shape[0]) {
			kl__err(ctx, KL_EINVAL,
			        "%s: q %s and lengths %s: q needs a batch dim first and one "
			        "length per batch row",
			        name, shp(b0, q), shp(b1, lengths));
			return NULL;
		}
		/* the lengths must fit the keys: checked now eagerly, and in a
		 * compiled function before each run of the graph (replays too)
		 * when they are a tensor the graph reads; lengths the graph
		 * computes are not checked (the kernels clamp them to [0, Tk]) */
		int64_t tk = k->shape[nd - 2];
		if (lengths->st && q->shape[0] > 0) {
			kl_status st = ctx->trace ? kl__trace_check(ctx, lengths, tk, nd - 2, name,
			                                            "lengths")
			                          : kl__check_values(ctx, lengths, tk, nd - 2, name,
			                                             "lengths");
			if (st != KL_OK)
				return NULL;
		}
	}
	kl_tensor *args[4] = {q, k, v, lengths};
	bool owned[3] = {false, false, false};
	kl_tensor *r = NULL;
	for (int i = 0; i < 3; i++)
		if (in[i]->dtype != dt) {
			args[i] = kl_cast(in[i], dt);
			if (!args[i])
				goto done;
			owned[i] = true;
		}
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, q->shape, sizeof(int64_t) * (size_t)nd);
	shape[nd - 1] = v->shape[nd - 1];
	kl_node n;
	node_init(&n, KL_OP_ATTENTION, dt, nd, shape, lengths ? 4 : 3);
	/* torch's scale=None: the node always holds the scale it applies */
	if (scale == KL_SDPA_DEFAULT_SCALE)
		scale = q->shape[nd - 1] > 0 ? 1.0 / sqrt((double)q->shape[nd - 1]) : 1.0;
	n.a.s[0] = scale;
	n.a.flags = (causal ? KL_F_CAUSAL : 0) | (lengths ? KL_F_LENGTHS : 0);
	r = kl__dispatch(ctx, &n, args);
done:
	for (int i = 0; i < 3; i++)
		if (owned[i])
			kl__tensor_discard(args[i]);
	return r;
}

kl_tensor *kl_sdpa_lengths(kl_tensor *q, kl_tensor *k, kl_tensor *v, kl_tensor *lengths,
                           bool causal, double scale)
{
	KL_API("kl_sdpa_lengths");
	if (!lengths) { /* "input 3 is NULL" */
		kl_tensor *in[4] = {q, k, v, lengths};
		(void)ctx_of("sdpa_lengths", 4, in);
		return NULL;
	}
	return sdpa("kl_sdpa_lengths", q, k, v, lengths, causal, scale);
}

kl_tensor *kl_sdpa(kl_tensor *q, kl_tensor *k, kl_tensor *v, bool causal, double scale)
{
	KL_API("kl_sdpa");
	return sdpa("kl_sdpa", q, k, v, NULL, causal, scale);
}
