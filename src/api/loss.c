/* loss.c - losses and training ops (kiln.h, "losses and training ops"):
 * mse_loss, cross_entropy and dropout, each a composite of public ops, so
 * that they run eagerly and inside compiled functions alike and gradients
 * flow through the ops' own rules. They live in the api layer rather than
 * nn for two things only it has: the public-call frame (errors name
 * kl_cross_entropy, not the op that failed inside it) and the trace state
 * (cross_entropy range-checks targets whose values are on the host, as
 * kl_gather does).
 */
#include "api/dispatch.h"

static bool check_in(kl_ctx **ctx, int n, kl_tensor *const *ts, const char *const *what)
{
	*ctx = NULL;
	for (int i = 0; i < n && !*ctx; i++)
		*ctx = ts[i] ? ts[i]->ctx : NULL;
	for (int i = 0; i < n; i++) {
		if (!ts[i]) {
			kl__err(*ctx, KL_EINVAL, "%s is NULL", what[i]);
			return false;
		}
		if (ts[i]->ctx != *ctx) {
			kl__err(*ctx, KL_EINVAL, "%s belongs to another context", what[i]);
			return false;
		}
	}
	return true;
}

kl_tensor *kl_mse_loss(kl_tensor *input, kl_tensor *target)
{
	KL_API("kl_mse_loss");
	kl_tensor *in[2] = {input, target};
	kl_ctx *ctx;
	if (!check_in(&ctx, 2, in, (const char *[]){"input", "target"}))
		return NULL;
	char a[192], b[192];
	kl__shape_str(a, sizeof a, input->ndim, input->shape);
	kl__shape_str(b, sizeof b, target->ndim, target->shape);
	if (!kl_dtype_is_float(input->dtype) || !kl_dtype_is_float(target->dtype)) {
		kl__err(ctx, KL_EINVAL, "input %s %s and target %s %s must both be float",
		        kl_dtype_name(input->dtype), a, kl_dtype_name(target->dtype), b);
		return NULL;
	}
	bool same = input->ndim == target->ndim;
	for (int d = 0; same && d < input->ndim; d++)
		same = input->shape[d] == target->shape[d];
	if (!same) {
		kl__err(ctx, KL_EINVAL, "input %s and target %s differ in shape (torch broadcasts "
		        "them with a warning; kiln refuses)", a, b);
		return NULL;
	}
	kl_scope_begin(ctx);
	kl_tensor *d = kl_sub(input, target);
	kl_tensor *sq = kl_retain(kl_mul(d, d));
	kl_scope_end(ctx);
	kl_tensor *r = sq ? kl_mean(sq, 0, NULL, false) : NULL;
	kl_release(sq);
	return r;
}

/* The targets' values when they are held now (kl__index_scan): each must be
 * a class or ignore_index. */
static bool targets_ok(kl_ctx *ctx, const kl_tensor *t, int64_t classes, int64_t ignore)
{
	int64_t i, v;
	if (kl__index_scan(ctx, "cross_entropy", t, classes, true, ignore, &i, &v) != KL_OK)
		return false;
	if (i >= 0) {
		kl__err(ctx, KL_EINVAL, "target[%lld] = %lld is not a class in [0, %lld) nor "
		        "ignore_index %lld", (long long)i, (long long)v, (long long)classes,
		        (long long)ignore);
		return false;
	}
	return true;
}

kl_tensor *kl_cross_entropy(kl_tensor *logits, kl_tensor *target, int64_t ignore_index)
{
	KL_API("kl_cross_entropy");
	kl_tensor *in[2] = {logits, target};
	kl_ctx *ctx;
	if (!check_in(&ctx, 2, in, (const char *[]){"logits", "target"}))
		return NULL;
	char a[192], b[192];
	kl__shape_str(a, sizeof a, logits->ndim, logits->shape);
	kl__shape_str(b, sizeof b, target->ndim, target->shape);
	if (logits->ndim != 2 || !kl_dtype_is_float(logits->dtype)) {
		kl__err(ctx, KL_EINVAL, "logits are %s %s; need float [N, C]",
		        kl_dtype_name(logits->dtype), a);
		return NULL;
	}
	if (target->ndim != 1 || (target->dtype != KL_I32 && target->dtype != KL_I64) ||
	    target->shape[0] != logits->shape[0]) {
		kl__err(ctx, KL_EINVAL, "target is %s %s; logits %s need i32 or i64 [%lld]",
		        kl_dtype_name(target->dtype), b, a, (long long)logits->shape[0]);
		return NULL;
	}
	int64_t n = logits->shape[0], c = logits->shape[1];
	if (c < 1) {
		kl__err(ctx, KL_EINVAL, "logits %s have no classes", a);
		return NULL;
	}
	if (!targets_ok(ctx, target, c, ignore_index))
		return NULL;
	kl_dtype dt = logits->dtype;
	kl_scope_begin(ctx);
	/* row i's loss: -log_softmax(logits)[i, target[i]], picked by a one-hot
	 * mask (0 for an ignored row, NaN for a target that is no class) */
	kl_tensor *lsm = kl_log_softmax(logits, 1);
	kl_tensor *onehot = kl_eq(kl_reshape(target, 2, (int64_t[]){n, 1}),
	                          kl_arange(ctx, target->dtype, 0, (double)c, 1));
	kl_tensor *zero = kl_scalar(ctx, dt, 0.0);
	kl_tensor *picked = kl_sum(kl_where(onehot, lsm, zero), 1, (int[]){1}, false);
	kl_tensor *hits = kl_sum(kl_cast(onehot, dt), 1, (int[]){1}, false);
	kl_tensor *valid = kl_ne_scalar(target, (double)ignore_index);
	kl_tensor *row = kl_where(valid,
	                          kl_where(kl_gt_scalar(hits, 0.5), kl_neg(picked),
	                                   kl_scalar(ctx, dt, NAN)),
	                          zero);
	kl_tensor *total = kl_retain(kl_sum(row, 0, NULL, false));
	kl_tensor *count = kl_retain(kl_sum(kl_cast(valid, dt), 0, NULL, false));
	kl_scope_end(ctx);
	/* every row ignored: 0 / 0, NaN as torch */
	kl_tensor *r = total && count ? kl_div(total, count) : NULL;
	kl_release(total);
	kl_release(count);
	return r;
}

/* kl_dropout and kl_dropout_rng: rng says the key is the context
 * generator's (its offset moves when a mask is drawn). */
static kl_tensor *dropout(kl_tensor *x, double p, uint64_t seed, uint64_t offset, bool training,
                          bool rng)
{
	kl_ctx *ctx;
	if (!check_in(&ctx, 1, &x, (const char *[]){"x"}))
		return NULL;
	char a[192];
	kl__shape_str(a, sizeof a, x->ndim, x->shape);
	if (!kl_dtype_is_float(x->dtype)) {
		kl__err(ctx, KL_EINVAL, "x is %s %s; dropout needs a float tensor",
		        kl_dtype_name(x->dtype), a);
		return NULL;
	}
	if (!(p >= 0 && p <= 1)) {
		kl__err(ctx, KL_EINVAL, "dropout probability has to be between 0 and 1, but got %g",
		        p);
		return NULL;
	}
	if (!training || p == 0)
		return kl_reshape(x, x->ndim, x->shape); /* x itself, a new handle */
	if (p == 1)
		return kl_mul_scalar(x, 0.0);
	if (rng) {
		seed = ctx->rng_seed;
		offset = ctx->rng_offset++;
	}
	/* the mask's generator key: Philox of (seed, offset), so that each
	 * (seed, offset) pair draws its own stream of kl_rand */
	uint64_t key = kl__philox_key(seed, offset);
	kl_scope_begin(ctx);
	/* in a trace the key is an input of the graph, not an attribute: every
	 * (seed, offset) runs the same compiled graph */
	kl_tensor *r = ctx->trace ? kl__rand_keyed(ctx, KL_OP_RAND, KL_F32, x->ndim, x->shape, key,
	                                           rng ? &offset : NULL)
	                          : kl_retain(kl_rand(ctx, KL_F32, x->ndim, x->shape, key));
	/* torch: input * (bernoulli(1 - p) / (1 - p)) */
	kl_tensor *noise = kl_retain(kl_div_scalar(kl_cast(kl_ge_scalar(r, p), x->dtype), 1.0 - p));
	kl_release(r);
	kl_scope_end(ctx);
	kl_tensor *y = noise ? kl_mul(x, noise) : NULL;
	kl_release(noise);
	return y;
}

kl_tensor *kl_dropout(kl_tensor *x, double p, uint64_t seed, uint64_t offset, bool training)
{
	KL_API("kl_dropout");
	return dropout(x, p, seed, offset, training, false);
}

kl_tensor *kl_dropout_rng(kl_tensor *x, double p, bool training)
{
	KL_API("kl_dropout_rng");
	return dropout(x, p, 0, 0, training, true);
}
