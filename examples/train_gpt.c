/* train_gpt.c - a GPT-style language model trained from scratch in C: bytes
 * of a text file are the tokens (vocabulary 256), the model GPT-2's shape at
 * any size (token and position embeddings, N pre-norm blocks of LayerNorm
 * with bias, causal multi-head attention and a tanh-GELU MLP four times as
 * wide, a last LayerNorm, the output head tied to the token embedding), the
 * loss cross-entropy over the next byte, AdamW with a linear warm-up and a
 * cosine decay of the learning rate and the gradients clipped to a global
 * norm (weight decay on every parameter: one parameter group). The whole
 * step (forward, loss, backward, clipping, the update) is one
 * compiled function; the learning rate is a device scalar written before
 * each call, so the schedule never recompiles.
 *
 *   train_gpt TEXT [--steps N] [--layers N] [--d-model N] [--heads N]
 *             [--seq N] [--batch N] [--lr X] [--min-lr X] [--warmup N]
 *             [--clip X] [--weight-decay X] [--seed N] [--device cpu|cuda]
 *             [--dtype f32|bf16] [--print-every N] [--eager]
 *             [--save PATH] [--save-at N] [--resume PATH] [--check] [--json]
 *
 * Batches are drawn at offsets that depend only on (seed, step, row), so a
 * run resumed at step k sees the batches the uninterrupted run saw.
 * --save PATH writes a checkpoint when the run ends (or after step --save-at
 * N): PATH holds the parameters under GPT-2's names and "train.step" (i64),
 * PATH.optim the optimizer's state (kl_optim_save). --resume PATH loads both
 * (every name, shape and dtype checked against this model before anything
 * is written) and continues at the saved step.
 * --check: train --steps steps saving at half way, then resume from that
 * checkpoint in a fresh context and train to the end; exit 1 unless the
 * resumed losses equal the uninterrupted run's bitwise and the loss fell (the
 * mean of the last 10 steps at most 0.8 of the first step's).
 * --json: the progress lines go to stderr and stdout gets one JSON line with
 * the keys of `kiln bench --json` (workload "train_gpt", the median step as
 * median_us, tokens_per_s from it, the first step as first_call_s, the peak
 * memory), which bench/compare.py sets beside bench/peer_torch.py's same
 * model.
 */
#include <kiln.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define VOCAB 256
#define MAX_LAYERS 64
#define PER_BLOCK 12 /* ln_1 w b, attn c_attn w b, c_proj w b, ln_2 w b, mlp c_fc w b, c_proj w b */
#define MAX_PARAMS (4 + PER_BLOCK * MAX_LAYERS)
#define NAME_MAX_LEN 64
#define LN_EPS 1e-5
static const double PI = 3.14159265358979323846;

typedef struct opts {
	const char *text, *save, *resume;
	int steps, print_every, save_at, warmup;
	int64_t layers, d, heads, seq, batch;
	double lr, min_lr, clip, weight_decay;
	uint64_t seed;
	kl_device device;
	kl_dtype dtype;
	bool eager, check, json;
} opts;

/* The model: params[] in GPT-2's state-dict order; wte, wpe, then each
 * block's twelve, then ln_f's two. */
typedef struct gpt {
	const opts *o;
	int n;
	kl_tensor *p[MAX_PARAMS];
	char names[MAX_PARAMS][NAME_MAX_LEN];
	kl_optim *opt;
} gpt;

enum { WTE, WPE, BLOCK0 };
enum { LN1_W, LN1_B, ATTN_W, ATTN_B, APROJ_W, APROJ_B, LN2_W, LN2_B, FC_W, FC_B, MPROJ_W,
       MPROJ_B };

static kl_tensor *blk(const gpt *m, int64_t l, int k)
{
	return m->p[BLOCK0 + PER_BLOCK * l + k];
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- the model ------------------------------------------------------------- */

/* std * randn, a leaf (no op recorded: nothing requires grad yet) */
static kl_tensor *normal(kl_ctx *ctx, kl_dtype dt, int64_t r, int64_t c, double std,
                         uint64_t seed)
{
	int64_t shape[2] = {r, c};
	kl_tensor *z = kl_randn(ctx, KL_F32, c ? 2 : 1, shape, seed);
	kl_tensor *s = z ? kl_mul_scalar(z, std) : NULL;
	kl_tensor *t = s ? kl_cast(s, dt) : NULL;
	kl_release(z);
	kl_release(s);
	return t;
}

static kl_tensor *constant(kl_ctx *ctx, kl_dtype dt, int64_t n, double v)
{
	return kl_full(ctx, dt, 1, &n, v);
}

/* GPT-2's initialization: weights normal(0, 0.02), the residual
 * projections' scaled by 1/sqrt(2 * layers), biases zero, LayerNorms ones
 * and zeros. */
static kl_status gpt_init(gpt *m, kl_ctx *ctx, const opts *o)
{
	memset(m, 0, sizeof *m);
	m->o = o;
	int64_t d = o->d;
	kl_dtype dt = o->dtype;
	double proj_std = 0.02 / sqrt(2.0 * (double)o->layers);
	uint64_t s = o->seed * 1000;
	m->p[WTE] = normal(ctx, dt, VOCAB, d, 0.02, s++);
	snprintf(m->names[WTE], NAME_MAX_LEN, "wte.weight");
	m->p[WPE] = normal(ctx, dt, o->seq, d, 0.01, s++);
	snprintf(m->names[WPE], NAME_MAX_LEN, "wpe.weight");
	static const char *const bnames[PER_BLOCK] = {
		"ln_1.weight",       "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
		"attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
		"mlp.c_fc.weight",   "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
	for (int64_t l = 0; l < o->layers; l++) {
		kl_tensor **b = &m->p[BLOCK0 + PER_BLOCK * l];
		b[LN1_W] = constant(ctx, dt, d, 1.0);
		b[LN1_B] = constant(ctx, dt, d, 0.0);
		b[ATTN_W] = normal(ctx, dt, 3 * d, d, 0.02, s++);
		b[ATTN_B] = constant(ctx, dt, 3 * d, 0.0);
		b[APROJ_W] = normal(ctx, dt, d, d, proj_std, s++);
		b[APROJ_B] = constant(ctx, dt, d, 0.0);
		b[LN2_W] = constant(ctx, dt, d, 1.0);
		b[LN2_B] = constant(ctx, dt, d, 0.0);
		b[FC_W] = normal(ctx, dt, 4 * d, d, 0.02, s++);
		b[FC_B] = constant(ctx, dt, 4 * d, 0.0);
		b[MPROJ_W] = normal(ctx, dt, d, 4 * d, proj_std, s++);
		b[MPROJ_B] = constant(ctx, dt, d, 0.0);
		for (int k = 0; k < PER_BLOCK; k++)
			snprintf(m->names[BLOCK0 + PER_BLOCK * l + k], NAME_MAX_LEN, "h.%lld.%s",
			         (long long)l, bnames[k]);
	}
	m->n = BLOCK0 + PER_BLOCK * (int)o->layers + 2;
	m->p[m->n - 2] = constant(ctx, dt, d, 1.0);
	snprintf(m->names[m->n - 2], NAME_MAX_LEN, "ln_f.weight");
	m->p[m->n - 1] = constant(ctx, dt, d, 0.0);
	snprintf(m->names[m->n - 1], NAME_MAX_LEN, "ln_f.bias");
	for (int i = 0; i < m->n; i++) {
		if (!m->p[i])
			return kl_last_status(ctx);
		kl_status st = kl_set_requires_grad(m->p[i], true);
		if (st != KL_OK)
			return st;
	}
	kl_adamw_opts ao = kl_adamw_defaults();
	ao.lr = o->lr;
	ao.weight_decay = o->weight_decay;
	const char *names[MAX_PARAMS];
	for (int i = 0; i < m->n; i++)
		names[i] = m->names[i];
	m->opt = kl_optim_adamw(ctx, m->n, m->p, names, &ao);
	return m->opt ? KL_OK : kl_last_status(ctx);
}

static void gpt_free(gpt *m)
{
	kl_optim_free(m->opt);
	for (int i = 0; i < m->n; i++)
		kl_release(m->p[i]);
	memset(m, 0, sizeof *m);
}

/* head h of part (0 q, 1 k, 2 v) of the fused product qkv [B, T, 3d]:
 * [B, H, T, d / H] */
static kl_tensor *heads(kl_tensor *qkv, int part, int64_t b, int64_t t, int64_t d, int64_t h)
{
	kl_tensor *s = kl_slice(qkv, 2, part * d, (part + 1) * d, 1);
	return kl_permute(kl_reshape(s, 4, (int64_t[]){b, t, h, d / h}), (int[]){0, 2, 1, 3});
}

/* logits [B * T, VOCAB] of idx [B, T] (i64) */
static kl_tensor *gpt_logits(const gpt *m, kl_ctx *ctx, kl_tensor *idx)
{
	const opts *o = m->o;
	int64_t b = kl_dim(idx, 0), t = kl_dim(idx, 1), d = o->d, h = o->heads;
	kl_tensor *pos = kl_arange(ctx, KL_I64, 0, (double)t, 1);
	kl_tensor *x = kl_add(kl_embedding(idx, m->p[WTE]), kl_embedding(pos, m->p[WPE]));
	for (int64_t l = 0; l < o->layers; l++) {
		kl_tensor *a = kl_layer_norm(x, blk(m, l, LN1_W), blk(m, l, LN1_B), LN_EPS);
		kl_tensor *qkv = kl_linear(a, blk(m, l, ATTN_W), blk(m, l, ATTN_B));
		kl_tensor *y = kl_sdpa(heads(qkv, 0, b, t, d, h), heads(qkv, 1, b, t, d, h),
		                       heads(qkv, 2, b, t, d, h), true, KL_SDPA_DEFAULT_SCALE);
		y = kl_reshape(kl_permute(y, (int[]){0, 2, 1, 3}), 3, (int64_t[]){b, t, d});
		x = kl_add(x, kl_linear(y, blk(m, l, APROJ_W), blk(m, l, APROJ_B)));
		kl_tensor *f = kl_layer_norm(x, blk(m, l, LN2_W), blk(m, l, LN2_B), LN_EPS);
		f = kl_gelu_tanh(kl_linear(f, blk(m, l, FC_W), blk(m, l, FC_B)));
		x = kl_add(x, kl_linear(f, blk(m, l, MPROJ_W), blk(m, l, MPROJ_B)));
	}
	x = kl_layer_norm(x, m->p[m->n - 2], m->p[m->n - 1], LN_EPS);
	/* the head tied to the token embedding: x @ wte^T */
	kl_tensor *logits = kl_linear(x, m->p[WTE], NULL);
	return kl_reshape(logits, 2, (int64_t[]){b * t, VOCAB});
}

/* One step: in = {idx [B, T], targets [B * T]} (i64); out[0] the loss before
 * the update, out[1] the gradients' global norm before clipping. The
 * gradients are scaled by min(1, clip / (norm + 1e-6)) (torch's
 * clip_grad_norm_), then AdamW steps and the gradients are cleared. */
static kl_status step(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin, (void)nout;
	gpt *m = user;
	kl_tensor *loss = kl_cross_entropy(gpt_logits(m, ctx, in[0]), in[1], KL_IGNORE_INDEX);
	kl_status st = loss ? kl_backward(loss, NULL) : kl_last_status(ctx);
	if (st != KL_OK)
		return st;
	kl_tensor *sq = NULL, *g[MAX_PARAMS];
	for (int i = 0; i < m->n; i++) {
		kl_tensor *gf = kl_cast(kl_grad(m->p[i]), KL_F32);
		kl_tensor *s = kl_sum(kl_mul(gf, gf), 0, NULL, false);
		sq = sq ? kl_add(sq, s) : s;
	}
	kl_tensor *norm = kl_sqrt(sq);
	kl_tensor *coef = kl_minimum_scalar(
	        kl_div(kl_scalar(ctx, KL_F32, m->o->clip), kl_add_scalar(norm, 1e-6)), 1.0);
	kl_tensor *c = kl_cast(coef, m->o->dtype);
	for (int i = 0; i < m->n; i++)
		g[i] = kl_mul(kl_grad(m->p[i]), c);
	for (int i = 0; i < m->n; i++)
		if (!g[i])
			return kl_last_status(ctx);
	st = kl_optim_step_grads(m->opt, g);
	for (int i = 0; i < m->n; i++)
		kl_grad_clear(m->p[i]);
	out[0] = loss;
	out[1] = norm;
	return st != KL_OK ? st : norm ? KL_OK : kl_last_status(ctx);
}

/* ---- data ------------------------------------------------------------------ */

typedef struct text {
	unsigned char *bytes;
	size_t n;
} text;

static int read_text(const char *path, text *t, int64_t seq)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "train_gpt: cannot open %s: %s\n", path, strerror(errno));
		return 1;
	}
	size_t cap = 1 << 16, n = 0;
	unsigned char *b = malloc(cap);
	while (b) {
		size_t k = fread(b + n, 1, cap - n, f);
		n += k;
		if (n < cap)
			break;
		unsigned char *nb = cap < ((size_t)1 << 40) ? realloc(b, cap * 2) : NULL;
		if (!nb) {
			free(b);
			b = NULL;
			break;
		}
		b = nb;
		cap *= 2;
	}
	bool err = ferror(f);
	fclose(f);
	if (!b || err) {
		free(b);
		fprintf(stderr, "train_gpt: cannot read %s%s\n", path, b ? "" : " (out of memory)");
		return 1;
	}
	if (n < (size_t)seq + 2) {
		free(b);
		fprintf(stderr, "train_gpt: %s has %zu bytes; --seq %lld needs at least %lld\n", path,
		        n, (long long)seq, (long long)seq + 2);
		return 1;
	}
	*t = (text){b, n};
	return 0;
}

static uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* step's batch: row r from offset mix(seed, step, r) */
static void batch_at(const text *t, const opts *o, int s, int64_t *x, int64_t *y)
{
	uint64_t span = t->n - (size_t)o->seq - 1;
	for (int64_t r = 0; r < o->batch; r++) {
		uint64_t off = mix(mix(mix(o->seed) ^ (uint64_t)s) ^ (uint64_t)r) % span;
		for (int64_t i = 0; i < o->seq; i++) {
			x[r * o->seq + i] = t->bytes[off + (uint64_t)i];
			y[r * o->seq + i] = t->bytes[off + (uint64_t)i + 1];
		}
	}
}

/* linear warm-up to lr over --warmup steps, then cosine down to min_lr */
static double lr_at(const opts *o, int s)
{
	if (s < o->warmup)
		return o->lr * (s + 1) / o->warmup;
	double p = o->steps > o->warmup ? (double)(s - o->warmup) / (o->steps - o->warmup) : 1.0;
	return o->min_lr + 0.5 * (o->lr - o->min_lr) * (1.0 + cos(PI * (p > 1 ? 1 : p)));
}

/* ---- checkpoints ----------------------------------------------------------- */

static void optim_path(char *buf, size_t cap, const char *path)
{
	snprintf(buf, cap, "%s.optim", path);
}

static int save_ckpt(gpt *m, kl_ctx *ctx, const char *path, int next_step)
{
	const char *names[MAX_PARAMS + 1];
	kl_tensor *ts[MAX_PARAMS + 1];
	for (int i = 0; i < m->n; i++) {
		names[i] = m->names[i];
		ts[i] = m->p[i];
	}
	int64_t one = 1, st = next_step;
	names[m->n] = "train.step";
	ts[m->n] = kl_from_host(ctx, KL_I64, 1, &one, &st, sizeof st);
	char op[4096];
	optim_path(op, sizeof op, path);
	kl_status s = ts[m->n] ? kl_safetensors_save(ctx, path, m->n + 1, names, ts)
	                       : kl_last_status(ctx);
	if (s == KL_OK)
		s = kl_optim_save(m->opt, op);
	kl_release(ts[m->n]);
	if (s != KL_OK) {
		fprintf(stderr, "train_gpt: saving %s: %s\n", path, kl_last_error(ctx));
		return 1;
	}
	return 0;
}

/* "f32 [256, 64]" */
static void shape_text(const kl_tensor *t, char *buf, size_t cap)
{
	int at = snprintf(buf, cap, "%s [", kl_dtype_name(kl_tensor_dtype(t)));
	for (int k = 0; k < kl_ndim(t) && at > 0 && (size_t)at < cap; k++)
		at += snprintf(buf + at, cap - (size_t)at, "%s%lld", k ? ", " : "",
		               (long long)kl_dim(t, k));
	if (at > 0 && (size_t)at < cap)
		snprintf(buf + at, cap - (size_t)at, "]");
}

/* Loads a checkpoint into m: every parameter present with this model's shape
 * and dtype, and a step in [0, steps], all checked before anything is
 * written. *next_step: the step to continue at. */
static int load_ckpt(gpt *m, kl_ctx *ctx, const char *path, int *next_step)
{
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	if (!st) {
		fprintf(stderr, "train_gpt: --resume: %s\n", kl_last_error(ctx));
		return 1;
	}
	int rc = 1;
	kl_tensor *got[MAX_PARAMS] = {NULL}, *stp = NULL;
	if (kl_safetensors_count(st) != m->n + 1) {
		fprintf(stderr, "train_gpt: --resume: %s holds %d tensors; this model has %d "
		                "parameters and train.step (check --layers)\n",
		        path, kl_safetensors_count(st), m->n);
		goto out;
	}
	for (int i = 0; i < m->n; i++) {
		got[i] = kl_safetensors_get(st, m->names[i]);
		if (!got[i]) {
			fprintf(stderr, "train_gpt: --resume: %s\n", kl_last_error(ctx));
			goto out;
		}
		bool same = kl_tensor_dtype(got[i]) == kl_tensor_dtype(m->p[i]) && kl_ndim(got[i]) == kl_ndim(m->p[i]);
		for (int k = 0; same && k < kl_ndim(got[i]); k++)
			same = kl_dim(got[i], k) == kl_dim(m->p[i], k);
		if (!same) {
			char have[64], want[64];
			shape_text(got[i], have, sizeof have);
			shape_text(m->p[i], want, sizeof want);
			fprintf(stderr, "train_gpt: --resume: %s in %s is %s, this model's %s (check "
			                "--d-model, --seq, --dtype)\n",
			        m->names[i], path, have, want);
			goto out;
		}
	}
	int64_t s = -1;
	stp = kl_safetensors_get(st, "train.step");
	if (!stp || kl_tensor_dtype(stp) != KL_I64 || kl_numel(stp) != 1 ||
	    kl_to_host(stp, &s, sizeof s) != KL_OK || s < 0 || s > m->o->steps) {
		fprintf(stderr, "train_gpt: --resume: %s: train.step must be one i64 in [0, %d]%s\n",
		        path, m->o->steps, s >= 0 ? " (--steps is below the saved step)" : "");
		goto out;
	}
	char op[4096];
	optim_path(op, sizeof op, path);
	/* the optimizer's file is checked whole before it writes anything; the
	 * parameters are written after it, so a bad file changes nothing */
	if (kl_optim_load(m->opt, op) != KL_OK) {
		fprintf(stderr, "train_gpt: --resume: %s\n", kl_last_error(ctx));
		goto out;
	}
	for (int i = 0; i < m->n; i++)
		if (kl_copy(m->p[i], got[i]) != KL_OK) {
			fprintf(stderr, "train_gpt: --resume: %s\n", kl_last_error(ctx));
			goto out;
		}
	*next_step = (int)s;
	rc = 0;
out:
	for (int i = 0; i < m->n; i++)
		kl_release(got[i]);
	kl_release(stp);
	kl_safetensors_close(st);
	return rc;
}

/* ---- the loop -------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

/* --json: one line with `kiln bench --json`'s keys. FLOPs of a step: six per
 * parameter a token in the blocks' products and the tied head, and the
 * causal attention's products (forward 2 B T^2 d a layer, three times with
 * the backward). */
static void print_json(const opts *o, kl_ctx *ctx, double *ms, int n, double first_loss,
                       double last_loss)
{
	double first = ms[0];
	double med = first;
	if (n > 1) {
		qsort(ms + 1, (size_t)n - 1, sizeof *ms, cmp_double);
		int k = n - 1;
		med = k % 2 ? ms[1 + k / 2] : 0.5 * (ms[k / 2] + ms[1 + k / 2]);
	}
	double tok = (double)o->batch * (double)o->seq, d = (double)o->d, l = (double)o->layers;
	double flops = 6 * tok * (12 * l * d * d + VOCAB * d) +
	               6 * l * (double)o->batch * (double)o->seq * (double)o->seq * d;
	kl_memory_usage mu = {0};
	kl_memory_stats(ctx, &mu);
	printf("{\"workload\":\"train_gpt\",\"device\":\"%s\",\"dtype\":\"%s\","
	       "\"shape\":\"L%lld,d%lld,h%lld,seq%lld,b%lld\",\"mode\":\"%s\","
	       "\"median_us\":%.6g,\"ms\":%.6g,\"iters\":%d,\"first_call_s\":%.6g,"
	       "\"kernels\":null,\"bytes\":null,\"flops\":%.0f,\"bw_tbs\":null,"
	       "\"tflops\":%.6g,\"tokens_per_s\":%.6g,\"loss_first\":%.6g,\"loss_last\":%.6g,"
	       "\"peak_bytes\":%zu}\n",
	       o->device == KL_CUDA ? "cuda" : "cpu", kl_dtype_name(o->dtype), (long long)o->layers,
	       (long long)o->d, (long long)o->heads, (long long)o->seq, (long long)o->batch,
	       o->eager ? "eager" : "default", med * 1e3, med, n - 1, first * 1e-3, flops,
	       flops / (med * 1e-3) * 1e-12, tok / (med * 1e-3), first_loss, last_loss, mu.peak);
	fflush(stdout);
}

/* Train from step `from` (0, or the checkpoint's with resume) to `to`;
 * losses[s] for each step run. save: after step save_at - 1 (or at the end,
 * save_at <= 0). */
static int train(const opts *o, const text *data, const char *resume, const char *save,
                 int save_at, int to, double *losses, bool quiet)
{
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = o->device});
	if (!ctx) {
		fprintf(stderr, "train_gpt: kl_ctx_new: %s\n", kl_last_error(NULL));
		return 1;
	}
	gpt m;
	int rc = 1, from = 0;
	double *step_ms = NULL;
	kl_fn *f = NULL;
	int64_t *x = malloc(sizeof *x * (size_t)(o->batch * o->seq));
	int64_t *y = malloc(sizeof *y * (size_t)(o->batch * o->seq));
	if (!x || !y) {
		fprintf(stderr, "train_gpt: out of memory\n");
		goto done;
	}
	if (gpt_init(&m, ctx, o) != KL_OK) {
		fprintf(stderr, "train_gpt: %s\n", kl_last_error(ctx));
		goto done;
	}
	if (resume && load_ckpt(&m, ctx, resume, &from) != 0)
		goto free_model;
	if (!(f = kl_compile(ctx, step, &m, 2, 2, &(kl_compile_opts){.disable = o->eager}))) {
		fprintf(stderr, "train_gpt: kl_compile: %s\n", kl_last_error(ctx));
		goto free_model;
	}
	FILE *log = o->json ? stderr : stdout;
	if (!quiet) {
		int64_t np = 0;
		for (int i = 0; i < m.n; i++)
			np += kl_numel(m.p[i]);
		fprintf(log, "train_gpt: %lld parameters (%lld layers, d %lld, %lld heads, seq %lld), "
		       "batch %lld, %s, %s; %zu bytes of text; steps %d to %d\n",
		       (long long)np, (long long)o->layers, (long long)o->d, (long long)o->heads,
		       (long long)o->seq, (long long)o->batch, kl_dtype_name(o->dtype),
		       o->eager ? "eager" : "compiled", data->n, from, to);
	}
	int64_t xs[2] = {o->batch, o->seq}, ys = o->batch * o->seq;
	size_t nb = sizeof *x * (size_t)ys;
	double t0 = now_ms(), tw = t0, ts = t0;
	int timed = 0;
	if (!(step_ms = malloc(sizeof *step_ms * (size_t)(to - from + 1)))) {
		fprintf(stderr, "train_gpt: out of memory\n");
		goto free_model;
	}
	for (int s = from; s < to; s++) {
		batch_at(data, o, s, x, y);
		kl_tensor *in[2] = {kl_from_host(ctx, KL_I64, 2, xs, x, nb),
		                    kl_from_host(ctx, KL_I64, 1, &ys, y, nb)};
		kl_tensor *out[2] = {NULL, NULL};
		double norm = 0;
		kl_status st = in[0] && in[1] ? kl_optim_set_lr(m.opt, lr_at(o, s)) : KL_ENOMEM;
		if (st == KL_OK)
			st = kl_fn_call(f, in, out);
		if (st == KL_OK)
			st = kl_item(out[0], &losses[s]);
		if (st == KL_OK)
			st = kl_item(out[1], &norm);
		kl_release(in[0]);
		kl_release(in[1]);
		kl_release(out[0]);
		kl_release(out[1]);
		if (st != KL_OK) {
			fprintf(stderr, "train_gpt: step %d: %s\n", s, kl_last_error(ctx));
			goto free_model;
		}
		double te = now_ms();
		step_ms[s - from] = te - ts;
		ts = te;
		if (s == from) /* the first step compiles: tokens/s from the second on */
			tw = te;
		else
			timed++;
		if (!quiet && ((s - from) % o->print_every == 0 || s == to - 1)) {
			double el = now_ms() - tw;
			fprintf(log, "step %5d  loss %.4f  grad norm %.3f  lr %.2e  %.0f tokens/s\n", s,
			       losses[s], norm, lr_at(o, s),
			       timed ? (double)timed * (double)ys / (el * 1e-3) : 0.0);
		}
		if (save && save_at > 0 && s == save_at - 1 && save_ckpt(&m, ctx, save, s + 1))
			goto free_model;
	}
	if (save && save_at <= 0 && save_ckpt(&m, ctx, save, to))
		goto free_model;
	if (!quiet)
		fprintf(log, "%d steps in %.1f s (the first with its compile %.1f s)\n", to - from,
		        (now_ms() - t0) * 1e-3, (tw - t0) * 1e-3);
	if (!quiet && o->json)
		print_json(o, ctx, step_ms, to - from, losses[from], losses[to - 1]);
	rc = 0;
free_model:
	free(step_ms);
	kl_fn_free(f);
	gpt_free(&m);
done:
	free(x);
	free(y);
	kl_ctx_free(ctx);
	return rc;
}

/* ---- options ---------------------------------------------------------------- */

static int64_t arg_int(const char *s, const char *name, int64_t min)
{
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 10);
	if (errno || end == s || *end || v < min || v > (1ll << 31)) {
		fprintf(stderr, "train_gpt: %s needs an integer >= %lld, not '%s'\n", name,
		        (long long)min, s);
		exit(2);
	}
	return v;
}

static double arg_num(const char *s, const char *name)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v) || v < 0) {
		fprintf(stderr, "train_gpt: %s needs a finite number >= 0, not '%s'\n", name, s);
		exit(2);
	}
	return v;
}

static void usage(void)
{
	fprintf(stderr, "usage: train_gpt TEXT [--steps N] [--layers N] [--d-model N] [--heads N] "
	                "[--seq N] [--batch N]\n"
	                "  [--lr X] [--min-lr X] [--warmup N] [--clip X] [--weight-decay X] "
	                "[--seed N]\n"
	                "  [--device cpu|cuda] [--dtype f32|bf16] [--print-every N] [--eager]\n"
	                "  [--save PATH] [--save-at N] [--resume PATH] [--check] [--json]\n");
}

int main(int argc, char **argv)
{
	opts o = {.steps = 200, .print_every = 20, .warmup = 20, .layers = 2, .d = 64, .heads = 4,
	          .seq = 64, .batch = 8, .lr = 3e-3, .min_lr = 3e-4, .clip = 1.0,
	          .weight_decay = 0.1, .seed = 1, .device = KL_CPU, .dtype = KL_F32};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--eager") || !strcmp(a, "--check") || !strcmp(a, "--json")) {
			*(!strcmp(a, "--eager") ? &o.eager : !strcmp(a, "--check") ? &o.check : &o.json) =
			        true;
			continue;
		}
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage();
			return 0;
		}
		if (a[0] != '-') {
			if (o.text) {
				fprintf(stderr, "train_gpt: one text file, not '%s' too\n", a);
				return 2;
			}
			o.text = a;
			continue;
		}
		if (!v) {
			fprintf(stderr, "train_gpt: %s needs a value\n", a);
			usage();
			return 2;
		}
		i++;
		if (!strcmp(a, "--steps"))
			o.steps = (int)arg_int(v, a, 1);
		else if (!strcmp(a, "--print-every"))
			o.print_every = (int)arg_int(v, a, 1);
		else if (!strcmp(a, "--warmup"))
			o.warmup = (int)arg_int(v, a, 0);
		else if (!strcmp(a, "--save-at"))
			o.save_at = (int)arg_int(v, a, 1);
		else if (!strcmp(a, "--layers"))
			o.layers = arg_int(v, a, 1);
		else if (!strcmp(a, "--d-model"))
			o.d = arg_int(v, a, 1);
		else if (!strcmp(a, "--heads"))
			o.heads = arg_int(v, a, 1);
		else if (!strcmp(a, "--seq"))
			o.seq = arg_int(v, a, 1);
		else if (!strcmp(a, "--batch"))
			o.batch = arg_int(v, a, 1);
		else if (!strcmp(a, "--seed"))
			o.seed = (uint64_t)arg_int(v, a, 0);
		else if (!strcmp(a, "--lr"))
			o.lr = arg_num(v, a);
		else if (!strcmp(a, "--min-lr"))
			o.min_lr = arg_num(v, a);
		else if (!strcmp(a, "--clip"))
			o.clip = arg_num(v, a);
		else if (!strcmp(a, "--weight-decay"))
			o.weight_decay = arg_num(v, a);
		else if (!strcmp(a, "--save"))
			o.save = v;
		else if (!strcmp(a, "--resume"))
			o.resume = v;
		else if (!strcmp(a, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
			o.device = !strcmp(v, "cuda") ? KL_CUDA : KL_CPU;
		else if (!strcmp(a, "--dtype") && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
			o.dtype = !strcmp(v, "bf16") ? KL_BF16 : KL_F32;
		else {
			fprintf(stderr, "train_gpt: unknown option or value: %s %s\n", a, v);
			usage();
			return 2;
		}
	}
	if (!o.text) {
		usage();
		return 2;
	}
	if (o.d % o.heads || o.layers > MAX_LAYERS || o.clip <= 0) {
		fprintf(stderr, "train_gpt: --d-model %lld must be a multiple of --heads %lld, "
		                "--layers at most %d, --clip above 0\n",
		        (long long)o.d, (long long)o.heads, MAX_LAYERS);
		return 2;
	}
	if (o.save_at > o.steps) {
		fprintf(stderr, "train_gpt: --save-at %d is past --steps %d\n", o.save_at, o.steps);
		return 2;
	}
	text data;
	if (read_text(o.text, &data, o.seq))
		return 1;
	double *l1 = calloc((size_t)o.steps, sizeof *l1), *l2 = calloc((size_t)o.steps, sizeof *l2);
	int rc = 1;
	if (!l1 || !l2) {
		fprintf(stderr, "train_gpt: out of memory\n");
		goto out;
	}
	if (!o.check) {
		rc = train(&o, &data, o.resume, o.save, o.save_at, o.steps, l1, false);
		goto out;
	}
	/* --check: the whole run saving half way, then the second half resumed */
	char path[4096];
	const char *tmp = getenv("TMPDIR");
	snprintf(path, sizeof path, "%s/train_gpt_check_%ld.safetensors",
	         tmp && *tmp ? tmp : "/tmp", (long)getpid());
	int half = o.steps / 2 > 0 ? o.steps / 2 : 1;
	if (train(&o, &data, NULL, path, half, o.steps, l1, false) ||
	    train(&o, &data, path, NULL, 0, o.steps, l2, true))
		goto cleanup;
	rc = 0;
	for (int s = half; s < o.steps; s++)
		if (memcmp(&l1[s], &l2[s], sizeof l1[s])) {
			fprintf(stderr, "train_gpt --check: step %d: resumed loss %.9g, uninterrupted "
			                "%.9g\n", s, l2[s], l1[s]);
			rc = 1;
			break;
		}
	int k = o.steps < 10 ? o.steps : 10;
	double last = 0;
	for (int s = o.steps - k; s < o.steps; s++)
		last += l1[s] / k;
	if (!(last <= 0.8 * l1[0])) {
		fprintf(stderr, "train_gpt --check: the loss went from %g to %g (mean of the last "
		                "%d), not below 0.8 of the first\n", l1[0], last, k);
		rc = 1;
	}
	if (rc == 0)
		printf("check: loss %.4f -> %.4f; steps %d to %d resumed from the checkpoint equal "
		       "the uninterrupted run bitwise\n", l1[0], last, half, o.steps);
cleanup:
	remove(path);
	{
		char op[4096 + 8];
		snprintf(op, sizeof op, "%s.optim", path);
		remove(op);
	}
out:
	free(l1);
	free(l2);
	free(data.bytes);
	return rc;
}
