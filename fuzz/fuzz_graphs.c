/* fuzz_graphs.c - the small compiled functions whose cache entries the cache
 * targets mutate: between them their plans hold every step kind the CPU
 * runtime runs (generated kernels with pointwise, row and movement nodes,
 * products with epilogues, attention, cache writes) over views, broadcasts and several
 * dtypes. Sizes are tiny: the targets run each plan once per input. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "runtime/runtime_int.h" /* kl__cache_get */

#define OUT(i, e) ((out[i] = (e)) != NULL)
#define DONE(ctx, ok) ((ok) ? KL_OK : kl_last_status(ctx))

/* pointwise with broadcasting, a cast and a bool result */
static kl_status g_pointwise(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	kl_tensor *y = kl_add(kl_mul(in[0], in[1]), kl_sigmoid(in[0]));
	bool ok = OUT(0, kl_relu(y)) && OUT(1, kl_cast(kl_gt(y, in[1]), KL_F32)) &&
	          OUT(2, kl_exp(kl_cast(in[0], KL_BF16)));
	return DONE(ctx, ok);
}

/* rows: softmax, a sum and a variance over different axes, argmax */
static kl_status g_rows(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                        void *user)
{
	int ax0 = 0, ax1 = -1;
	bool ok = OUT(0, kl_softmax(in[0], -1)) && OUT(1, kl_sum(in[0], 1, &ax0, true)) &&
	          OUT(2, kl_var(kl_mul_scalar(in[0], 3.0), 1, &ax1, 1, false)) &&
	          OUT(3, kl_cast(kl_argmax(in[0], 1, false), KL_F32));
	return DONE(ctx, ok);
}

/* products: a linear with bias and activation, a batched matmul */
static kl_status g_matmul(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	bool ok = OUT(0, kl_gelu(kl_linear(in[0], in[1], in[2]))) &&
	          OUT(1, kl_add(kl_matmul(in[3], kl_transpose(in[3], 1, 2)),
	                        kl_matmul(in[0], kl_transpose(in[1], 0, 1))));
	return DONE(ctx, ok);
}

/* attention, causal, with a scale */
static kl_status g_attention(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	bool ok = OUT(0, kl_sdpa(in[0], in[1], in[2], true, 0.35)) &&
	          OUT(1, kl_sdpa(in[0], in[1], in[2], false, 0.2));
	return DONE(ctx, ok);
}

/* norms */
static kl_status g_norms(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	bool ok = OUT(0, kl_layer_norm(in[0], in[1], in[2], 1e-5)) &&
	          OUT(1, kl_rms_norm(kl_mul(in[0], in[0]), in[1], 1e-6));
	return DONE(ctx, ok);
}

/* movement: permute, slice, concat, reshape, expand, gather */
static kl_status g_movement(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	static const int perm[] = {1, 0};
	static const int64_t flat[] = {4, 5}, wide[] = {2, 4, 6};
	kl_tensor *t = kl_permute(in[0], perm);
	kl_tensor *parts[] = {kl_slice(t, 0, 0, 6, 2), kl_slice(t, 0, 1, 6, 3)};
	kl_tensor *cat = kl_concat(2, parts, 0);
	bool ok = OUT(0, kl_neg(kl_reshape(kl_contiguous(cat), 2, flat))) &&
	          OUT(1, kl_add(kl_expand(kl_slice(in[0], 0, 1, 2, 1), 3, wide), in[0])) &&
	          OUT(2, kl_mul_scalar(kl_gather(in[0], in[1]), 2.0));
	return DONE(ctx, ok);
}

/* cache writes: a copy with rows written (kl_cache_update) and the same
 * rows written in place into the cache input (kl_cache_write) */
static kl_status g_cache(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	bool ok = OUT(0, kl_cache_update(in[0], 2, in[1], kl_neg(in[2]))) &&
	          kl_cache_write(in[0], 2, in[1], in[2]) == KL_OK &&
	          OUT(1, kl_sum(in[0], 0, NULL, false));
	return DONE(ctx, ok);
}

static kl_tensor *randn(kl_ctx *ctx, int nd, const int64_t *shape, uint64_t seed)
{
	return kl_randn(ctx, KL_F32, nd, shape, seed);
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

static kl_tensor *in_pointwise(kl_ctx *ctx, int i)
{
	return i == 0 ? randn(ctx, 2, SHAPE(4, 6), 11) : randn(ctx, 1, SHAPE(6), 12);
}

static kl_tensor *in_rows(kl_ctx *ctx, int i)
{
	return randn(ctx, 2, SHAPE(5, 7), 21);
}

static kl_tensor *in_matmul(kl_ctx *ctx, int i)
{
	switch (i) {
	case 0:
		return randn(ctx, 2, SHAPE(3, 5), 31);
	case 1:
		return randn(ctx, 2, SHAPE(3, 5), 32);
	case 2:
		return randn(ctx, 1, SHAPE(3), 33);
	default:
		return randn(ctx, 3, SHAPE(2, 3, 5), 34);
	}
}

static kl_tensor *in_attention(kl_ctx *ctx, int i)
{
	return i == 0 ? randn(ctx, 3, SHAPE(2, 4, 8), 41)
	              : randn(ctx, 3, SHAPE(2, 6, 8), 42 + (uint64_t)i);
}

static kl_tensor *in_norms(kl_ctx *ctx, int i)
{
	return i == 0 ? randn(ctx, 2, SHAPE(3, 16), 51)
	              : randn(ctx, 1, SHAPE(16), 52 + (uint64_t)i);
}

static kl_tensor *in_movement(kl_ctx *ctx, int i)
{
	/* the indices 3, 2, 1, 0 */
	return i == 0 ? randn(ctx, 2, SHAPE(4, 6), 61) : kl_arange(ctx, KL_I64, 3, -1, -1);
}

static kl_tensor *in_cache(kl_ctx *ctx, int i)
{
	/* a [3, 2, 6, 4] cache, positions 1 and 2, two rows of one position */
	return i == 0   ? randn(ctx, 4, SHAPE(3, 2, 6, 4), 71)
	       : i == 1 ? kl_arange(ctx, KL_I64, 1, 3, 1)
	                : randn(ctx, 4, SHAPE(2, 2, 1, 4), 72);
}

const kf_graph kf_graphs[] = {
        {"pointwise", g_pointwise, 2, 3, in_pointwise},
        {"rows", g_rows, 1, 4, in_rows},
        {"matmul", g_matmul, 4, 2, in_matmul},
        {"attention", g_attention, 3, 2, in_attention},
        {"norms", g_norms, 3, 2, in_norms},
        {"movement", g_movement, 2, 3, in_movement},
        {"cache", g_cache, 3, 2, in_cache},
};
const int kf_ngraphs = (int)(sizeof kf_graphs / sizeof kf_graphs[0]);

/* The one plan-*.klc in dir that is not among the first `known` of names. */
static int new_entry(const char *dir, char names[][96], int known)
{
	DIR *d = opendir(dir);
	if (!d)
		kf_die("cannot list %s: %s", dir, strerror(errno));
	struct dirent *e;
	int found = -1;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, "plan-", 5) || strlen(e->d_name) >= 96)
			continue;
		bool seen = false;
		for (int i = 0; i < known && !seen; i++)
			seen = !strcmp(names[i], e->d_name);
		if (seen)
			continue;
		if (found >= 0)
			kf_die("graph %d wrote more than one plan entry", known);
		snprintf(names[known], 96, "%s", e->d_name);
		found = known;
	}
	closedir(d);
	return found;
}

void kf_make_plans(kl_ctx *ctx, const char *dir, kf_plan *plans)
{
	char names[16][96];
	for (int g = 0; g < kf_ngraphs; g++) {
		const kf_graph *G = &kf_graphs[g];
		kl_tensor *in[8], *out[8];
		for (int i = 0; i < G->nin; i++)
			if (!(in[i] = G->make_input(ctx, i)))
				kf_die("%s: input %d: %s", G->name, i, kl_last_error(ctx));
		kl_fn *f = kl_compile(ctx, G->body, NULL, G->nin, G->nout, NULL);
		if (!f || kl_fn_call(f, in, out) != KL_OK)
			kf_die("%s: %s", G->name, kl_last_error(ctx));
		for (int i = 0; i < G->nout; i++)
			kl_release(out[i]);
		for (int i = 0; i < G->nin; i++)
			kl_release(in[i]);
		kl_fn_free(f);
		if (new_entry(dir, names, g) != g)
			kf_die("%s: no plan entry appeared in %s", G->name, dir);
		/* the entry's name is plan-<key in hex>.klc (runtime/compile.c) */
		kf_plan *p = &plans[g];
		snprintf(p->entry, sizeof p->entry, "%s", names[g]);
		if (sscanf(names[g], "plan-%16" SCNx64 ".klc", &p->key) != 1)
			kf_die("cannot read the key of %s", names[g]);
		void *payload;
		if (kl__cache_get(ctx, dir, p->entry, p->key, &payload, &p->len) != KL_OK)
			kf_die("%s: cannot read back %s", G->name, p->entry);
		p->payload = payload;
	}
}
