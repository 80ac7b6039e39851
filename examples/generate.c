/* generate.c - greedy generation with a KV cache and a batch that changes
 * every step (issue 23): a decoder-only model (token embedding, a stack of
 * the seed's DecoderLayers, a final RMSNorm, the embedding as the output
 * head) serves requests that join and leave; the batch of live requests
 * moves between 1 and --max-batch over the run.
 *
 *   generate [--steps N] [--layers N] [--d-model N] [--heads N] [--ffn N]
 *            [--vocab N] [--max-batch N] [--max-seq N] [--seed N]
 *            [--device cpu|cuda] [--check] [--json]
 *
 * The caches are [max-batch, heads, max-seq, head_dim] per layer, made once
 * (max-batch a bucket size: 1, 2, 4 or a multiple of 8 up to 256);
 * live requests hold rows 0..b-1 (a request that finishes hands its row to
 * the last one, whose rows are copied over).
 *  - prefill, one compiled function for every prompt length (the length a
 *    dynamic dim): the prompt's keys and values go into the request's cache
 *    row with kl_cache_write, attention over the prompt with kl_sdpa;
 *  - decode, one compiled function whose batch dim carries shape buckets
 *    (KL_BUCKETS_DEFAULT: b is padded up to 1, 2, 4, 8, 16, ...): each
 *    layer writes the new token's key and value at each row's position
 *    (kl_cache_write, in place) and attends over the cache's first rows
 *    with each row's valid length (kl_sdpa_lengths). One plan per bucket
 *    (on CUDA with reduce-overhead, one CUDA graph per bucket), all made
 *    in a warm-up before the first request. The decode is .fullgraph:
 *    after warm-up a step replays its bucket's plan without running
 *    decode() (the cache writes repeated by the replay; the caches are
 *    state, so prefills and row moves between steps keep the replay).
 * Printed: tokens per second, per-step decode latency, tokens per second of
 * each batch bucket, and the counters after warm-up: recompiles, CUDA
 * graph captures and graph launches, padded calls, fullgraph replays;
 * --json: the same as one JSON line at the end (for the bench).
 * --check: every finished request's tokens must equal what a full eager
 * forward over its whole sequence (no cache) picks at each position, and
 * after warm-up no recompile and no capture may happen; else exit 1.
 */
#include <kiln.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LAYERS 16

typedef struct opts {
	int steps, layers;
	int64_t d, heads, ffn, vocab, max_batch, max_seq;
	uint64_t seed;
	kl_device device;
	bool check, json;
} opts;

typedef struct model {
	const opts *o;
	kl_ctx *ctx;
	kl_nn_embedding emb;
	kl_nn_decoder layer[MAX_LAYERS];
	kl_nn_rmsnorm norm;
	kl_tensor *kc[MAX_LAYERS], *vc[MAX_LAYERS]; /* [R, H, T, dh] */
	/* prefill: the request's cache rows, views made before each call */
	kl_tensor *krow[MAX_LAYERS], *vrow[MAX_LAYERS];
} model;

/* q, k, v of x [B, S, d] as [B, H, S, dh] (dense k and v for the cache) */
static void qkv(const model *m, const kl_nn_decoder *l, kl_tensor *x, kl_tensor **q,
                kl_tensor **k, kl_tensor **v)
{
	int64_t B = kl_shape(x)[0], S = kl_shape(x)[1], d = m->o->d, H = m->o->heads;
	kl_tensor *p = kl_linear(kl_nn_rmsnorm_forward(&l->norm1, x), l->attn.in_proj_weight,
	                         l->attn.in_proj_bias);
	kl_tensor **outs[3] = {q, k, v};
	for (int i = 0; i < 3; i++) {
		kl_tensor *part = kl_reshape(kl_slice(p, 2, i * d, (i + 1) * d, 1), 4,
		                             (int64_t[]){B, S, H, d / H});
		*outs[i] = kl_permute(part, (int[]){0, 2, 1, 3});
	}
}

/* the rest of a layer after attention a [B, H, S, dh] */
static kl_tensor *finish_layer(const model *m, const kl_nn_decoder *l, kl_tensor *x,
                               kl_tensor *a)
{
	int64_t B = kl_shape(x)[0], S = kl_shape(x)[1];
	kl_tensor *h = kl_reshape(kl_permute(a, (int[]){0, 2, 1, 3}), 3,
	                          (int64_t[]){B, S, m->o->d});
	x = kl_add(x, kl_nn_linear_forward(&l->attn.out_proj, h));
	return kl_add(x, kl_nn_ffn_forward(&l->ffn, kl_nn_rmsnorm_forward(&l->norm2, x)));
}

/* greedy next token at every position of x [B, S, d]: [B, S] i64 */
static kl_tensor *pick(const model *m, kl_tensor *x)
{
	kl_tensor *logits = kl_matmul(kl_nn_rmsnorm_forward(&m->norm, x),
	                              kl_transpose(m->emb.weight, 0, 1));
	return kl_argmax(logits, -1, false);
}

/* in: tokens [1, S], pos [1] (zeros); out: the next token at each position */
static kl_status prefill(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                         int nout, void *user)
{
	(void)nin, (void)nout;
	model *m = user;
	kl_tensor *x = kl_nn_embedding_forward(&m->emb, in[0]);
	for (int i = 0; i < m->o->layers && x; i++) {
		const kl_nn_decoder *l = &m->layer[i];
		kl_tensor *q, *k, *v;
		qkv(m, l, x, &q, &k, &v);
		kl_status st = kl_cache_write(m->krow[i], 2, in[1], k);
		if (st == KL_OK)
			st = kl_cache_write(m->vrow[i], 2, in[1], v);
		if (st != KL_OK)
			return st;
		x = finish_layer(m, l, x, kl_sdpa(q, k, v, true, KL_SDPA_DEFAULT_SCALE));
	}
	out[0] = x ? pick(m, x) : NULL;
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* in: tokens [B], pos [B] (where each row's token goes), lengths [B]
 * (pos + 1); out: the next token of each row [B] */
static kl_status decode(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                        int nout, void *user)
{
	(void)nin, (void)nout;
	model *m = user;
	int64_t B = kl_shape(in[0])[0];
	kl_tensor *x = kl_reshape(kl_nn_embedding_forward(&m->emb, in[0]), 3,
	                          (int64_t[]){B, 1, m->o->d});
	for (int i = 0; i < m->o->layers && x; i++)
		x = kl_nn_decoder_decode(&m->layer[i], x, m->kc[i], m->vc[i], in[1], in[2]);
	out[0] = x ? kl_reshape(pick(m, x), 1, (int64_t[]){B}) : NULL;
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* ---- requests ------------------------------------------------------------------ */

typedef struct request {
	int id, prompt_len, gen_len, len; /* len: tokens in the cache so far */
	int64_t *tokens;                  /* prompt then generated, prompt_len + gen_len */
	int ngen;
} request;

static uint64_t rng_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static int fail(kl_ctx *ctx, const char *what)
{
	fprintf(stderr, "generate: %s: %s\n", what, kl_last_error(ctx));
	return 1;
}

/* The eager, cache-free reference: the tokens a full causal forward over
 * r's sequence picks at each generated position. */
static int check_request(model *m, const request *r, int *bad)
{
	kl_ctx *ctx = m->ctx;
	int n = r->prompt_len + r->ngen;
	kl_scope_begin(ctx);
	kl_tensor *t = kl_from_host(ctx, KL_I64, 2, (int64_t[]){1, n}, r->tokens,
	                            sizeof(int64_t) * (size_t)n);
	kl_tensor *x = kl_nn_embedding_forward(&m->emb, t);
	for (int i = 0; i < m->o->layers; i++)
		x = kl_nn_decoder_forward(&m->layer[i], x, true);
	kl_tensor *p = x ? pick(m, x) : NULL;
	int64_t *want = malloc(sizeof(int64_t) * (size_t)n);
	int rc = !p || !want || kl_to_host(p, want, sizeof(int64_t) * (size_t)n) != KL_OK;
	for (int j = 0; !rc && j < r->ngen; j++)
		if (want[r->prompt_len - 1 + j] != r->tokens[r->prompt_len + j]) {
			if (*bad < 5)
				fprintf(stderr,
				        "generate: request %d token %d: the cached decode picked %lld, a full "
				        "forward %lld\n",
				        r->id, j, (long long)r->tokens[r->prompt_len + j],
				        (long long)want[r->prompt_len - 1 + j]);
			++*bad;
		}
	free(want);
	kl_scope_end(ctx);
	return rc ? fail(ctx, "reference forward") : 0;
}

static int parse(int argc, char **argv, opts *o)
{
	*o = (opts){.steps = 200, .layers = 2, .d = 64, .heads = 4, .ffn = 128, .vocab = 256,
	            .max_batch = 64, .max_seq = 96, .seed = 1, .device = KL_CPU};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		long long n = v ? atoll(v) : 0;
		if (!strcmp(a, "--check") || !strcmp(a, "--json")) {
			*(a[2] == 'c' ? &o->check : &o->json) = true;
			continue;
		}
		if (!v)
			goto usage;
		i++;
		if (!strcmp(a, "--steps"))
			o->steps = (int)n;
		else if (!strcmp(a, "--layers"))
			o->layers = (int)n;
		else if (!strcmp(a, "--d-model"))
			o->d = n;
		else if (!strcmp(a, "--heads"))
			o->heads = n;
		else if (!strcmp(a, "--ffn"))
			o->ffn = n;
		else if (!strcmp(a, "--vocab"))
			o->vocab = n;
		else if (!strcmp(a, "--max-batch"))
			o->max_batch = n;
		else if (!strcmp(a, "--max-seq"))
			o->max_seq = n;
		else if (!strcmp(a, "--seed"))
			o->seed = (uint64_t)n;
		else if (!strcmp(a, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
			o->device = strcmp(v, "cpu") ? KL_CUDA : KL_CPU;
		else
			goto usage;
	}
	if (o->steps < 1 || o->layers < 1 || o->layers > MAX_LAYERS || o->d < 1 || o->heads < 1 ||
	    o->d % o->heads || o->ffn < 1 || o->vocab < 2 || o->max_batch < 1 ||
	    o->max_batch > 256 || (o->max_batch > 4 && o->max_batch % 8) ||
	    (o->max_batch == 3) || o->max_seq < 48)
		goto usage;
	return 0;
usage:
	fprintf(stderr, "usage: generate [--steps N] [--layers 1..16] [--d-model N] [--heads N "
	                "dividing it] [--ffn N] [--vocab N] [--max-batch 1, 2, 4 or 8..256 by 8 (a bucket)] [--max-seq >= 48] "
	                "[--seed N] [--device cpu|cuda] [--check] [--json]\n");
	return 2;
}

int main(int argc, char **argv)
{
	opts o;
	int rc = parse(argc, argv, &o);
	if (rc)
		return rc;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = o.device});
	if (!ctx)
		return fprintf(stderr, "generate: kl_ctx_new: %s\n", kl_last_error(NULL)), 1;
	model m = {.o = &o, .ctx = ctx};
	int64_t R = o.max_batch, T = o.max_seq, H = o.heads, dh = o.d / o.heads;
	if (kl_nn_embedding_init(&m.emb, ctx, o.vocab, o.d, KL_F32, o.seed) != KL_OK ||
	    kl_nn_rmsnorm_init(&m.norm, ctx, o.d, -1, KL_F32) != KL_OK)
		return fail(ctx, "model");
	for (int i = 0; i < o.layers; i++) {
		if (kl_nn_decoder_init(&m.layer[i], ctx, o.d, o.heads, o.ffn, KL_F32,
		                       o.seed + 100 + (uint64_t)i) != KL_OK)
			return fail(ctx, "model");
		m.kc[i] = kl_zeros(ctx, KL_F32, 4, (int64_t[]){R, H, T, dh});
		m.vc[i] = kl_zeros(ctx, KL_F32, 4, (int64_t[]){R, H, T, dh});
		if (!m.kc[i] || !m.vc[i])
			return fail(ctx, "caches");
	}
	kl_mode mode = o.device == KL_CUDA ? KL_MODE_REDUCE_OVERHEAD : KL_MODE_DEFAULT;
	/* the prefill runs plain launches: it writes a different cache row
	 * each call (a graph would be captured again whenever that moves), and
	 * a CUDA graph per prompt length buys little on a compute-bound step */
	kl_fn *pf = kl_compile(ctx, prefill, &m, 2, 1,
	                       &(kl_compile_opts){.mode = KL_MODE_DEFAULT, .ndynamic_dims = 1,
	                                          .dynamic_dims = (uint32_t[]){KL_DIM(1)}});
	kl_fn *df = kl_compile(ctx, decode, &m, 3, 1,
	                       &(kl_compile_opts){.mode = mode,
	                                          .fullgraph = true,
	                                          .nbuckets = KL_BUCKETS_DEFAULT,
	                                          .bucket_in_dims = (int[]){0, 0, 0},
	                                          .bucket_out_dims = (int[]){0}});
	if (!pf || !df)
		return fail(ctx, "kl_compile");

	/* warm-up: every bucket up to max-batch, ahead of the first request
	 * (rows past the live ones are free, and a prefill rewrites a row's
	 * positions before use): example inputs at batch 1, token 0 written at
	 * position 0, one key long */
	double t0 = now_ms();
	int nwarm = 0;
	for (int64_t B = 1; B <= R; B = B < 4 ? B * 2 : B == 4 ? 8 : B + 8)
		nwarm++;
	{
		int64_t zero = 0, one = 1;
		kl_scope_begin(ctx);
		kl_tensor *zt = kl_from_host(ctx, KL_I64, 1, (int64_t[]){1}, &zero, sizeof zero);
		kl_tensor *zp = kl_from_host(ctx, KL_I64, 1, (int64_t[]){1}, &zero, sizeof zero);
		kl_tensor *ones = kl_from_host(ctx, KL_I64, 1, (int64_t[]){1}, &one, sizeof one);
		kl_status st = zt && zp && ones ? kl_fn_warmup(df, (kl_tensor *[]){zt, zp, ones}, R)
		                                : kl_last_status(ctx);
		kl_scope_end(ctx);
		if (st != KL_OK)
			return fail(ctx, "kl_fn_warmup");
	}
	kl_fn_stats w0;
	kl_fn_get_stats(df, &w0);
	printf("warm-up: %d decode buckets (1..%lld) in %.1f ms: %d compiles, %ld CUDA graph "
	       "captures (%.2f ms capturing)\n",
	       nwarm, (long long)R, now_ms() - t0, w0.compiles, w0.graph_captures, w0.capture_ms);

	/* the run */
	uint64_t rs = o.seed * 7919 + 1;
	int cap_req = 4096, nreq = 0, live = 0, done = 0, bad = 0;
	request *req = calloc((size_t)cap_req, sizeof *req);
	int *slot = calloc((size_t)R, sizeof *slot); /* row -> request */
	double *lat = calloc((size_t)o.steps, sizeof *lat);
	int64_t *tok = malloc(sizeof(int64_t) * (size_t)R), *pos = malloc(sizeof(int64_t) * (size_t)R),
	        *len = malloc(sizeof(int64_t) * (size_t)R), *next = malloc(sizeof(int64_t) * (size_t)R);
	if (!req || !slot || !lat || !tok || !pos || !len || !next)
		return fprintf(stderr, "generate: out of memory\n"), 1;
	long decoded = 0, prefills = 0;
	/* per batch bucket (its size): decode steps, tokens, milliseconds */
	long bk_steps[257] = {0}, bk_tok[257] = {0};
	double bk_ms[257] = {0};
	int bmin = (int)R, bmax = 0;
	double prefill_ms = 0, decode_ms = 0;
	kl_fn_stats p0;
	kl_fn_get_stats(pf, &p0);
	for (int step = 0; step < o.steps; step++) {
		/* the target batch rises to max-batch and falls back, twice */
		double ph = 0.5 - 0.5 * cos(4 * 3.14159265358979 * step / o.steps);
		int target = 1 + (int)lround(ph * (double)(R - 1));
		while (live < target && nreq < cap_req) {
			request *r = &req[nreq];
			r->id = nreq++;
			r->prompt_len = 4 + (int)(rng_next(&rs) % 13);
			r->gen_len = 8 + (int)(rng_next(&rs) % 24); /* prompt + gen <= 47 <= T */
			r->tokens = malloc(sizeof(int64_t) * (size_t)(r->prompt_len + r->gen_len));
			if (!r->tokens)
				return fprintf(stderr, "generate: out of memory\n"), 1;
			for (int j = 0; j < r->prompt_len; j++)
				r->tokens[j] = (int64_t)(rng_next(&rs) % (uint64_t)o.vocab);
			/* prefill into row `live` */
			double a = now_ms();
			kl_scope_begin(ctx);
			for (int i = 0; i < o.layers; i++) {
				m.krow[i] = kl_slice(m.kc[i], 0, live, live + 1, 1);
				m.vrow[i] = kl_slice(m.vc[i], 0, live, live + 1, 1);
			}
			kl_tensor *pt = kl_from_host(ctx, KL_I64, 2, (int64_t[]){1, r->prompt_len},
			                             r->tokens, sizeof(int64_t) * (size_t)r->prompt_len);
			kl_tensor *p0t = kl_zeros(ctx, KL_I64, 1, (int64_t[]){1}), *out = NULL;
			kl_status st = kl_fn_call(pf, (kl_tensor *[]){pt, p0t}, &out);
			int64_t *nx = malloc(sizeof(int64_t) * (size_t)r->prompt_len);
			if (st == KL_OK)
				st = nx ? kl_to_host(out, nx, sizeof(int64_t) * (size_t)r->prompt_len)
				        : KL_ENOMEM;
			kl_release(out);
			kl_scope_end(ctx);
			if (st != KL_OK)
				return fail(ctx, "prefill");
			r->tokens[r->prompt_len] = nx[r->prompt_len - 1];
			free(nx);
			r->ngen = 1;
			r->len = r->prompt_len;
			slot[live++] = r->id;
			prefill_ms += now_ms() - a;
			prefills++;
		}
		/* one decode step over the live rows */
		int b = live;
		bmin = b < bmin ? b : bmin;
		bmax = b > bmax ? b : bmax;
		for (int i = 0; i < b; i++) {
			request *r = &req[slot[i]];
			tok[i] = r->tokens[r->prompt_len + r->ngen - 1];
			pos[i] = r->len;
			len[i] = r->len + 1;
		}
		double a = now_ms();
		kl_scope_begin(ctx);
		kl_tensor *in[3] = {
		        kl_from_host(ctx, KL_I64, 1, (int64_t[]){b}, tok, sizeof(int64_t) * (size_t)b),
		        kl_from_host(ctx, KL_I64, 1, (int64_t[]){b}, pos, sizeof(int64_t) * (size_t)b),
		        kl_from_host(ctx, KL_I64, 1, (int64_t[]){b}, len, sizeof(int64_t) * (size_t)b)};
		kl_tensor *out = NULL;
		kl_status st = kl_fn_call(df, in, &out);
		if (st == KL_OK)
			st = kl_to_host(out, next, sizeof(int64_t) * (size_t)b);
		kl_release(out);
		kl_scope_end(ctx);
		if (st != KL_OK)
			return fail(ctx, "decode");
		lat[step] = now_ms() - a;
		decode_ms += lat[step];
		decoded += b;
		int bk = b <= 1 ? 1 : b <= 2 ? 2 : b <= 4 ? 4 : (b + 7) / 8 * 8;
		bk_steps[bk]++;
		bk_tok[bk] += b;
		bk_ms[bk] += lat[step];
		/* tokens in; finished requests leave, the last row moving into theirs */
		for (int i = 0; i < b; i++) {
			request *r = &req[slot[i]];
			r->len++;
			r->tokens[r->prompt_len + r->ngen++] = next[i];
		}
		for (int i = live - 1; i >= 0; i--) {
			request *r = &req[slot[i]];
			if (r->ngen < r->gen_len)
				continue;
			if (o.check && check_request(&m, r, &bad))
				return 1;
			done++;
			int last = live - 1;
			if (i != last) {
				kl_scope_begin(ctx);
				for (int l = 0; l < o.layers && st == KL_OK; l++) {
					st = kl_copy(kl_slice(m.kc[l], 0, i, i + 1, 1),
					             kl_slice(m.kc[l], 0, last, last + 1, 1));
					if (st == KL_OK)
						st = kl_copy(kl_slice(m.vc[l], 0, i, i + 1, 1),
						             kl_slice(m.vc[l], 0, last, last + 1, 1));
				}
				kl_scope_end(ctx);
				if (st != KL_OK)
					return fail(ctx, "moving a row");
				slot[i] = slot[last];
			}
			live--;
		}
	}
	kl_fn_stats d1, p1;
	kl_fn_get_stats(df, &d1);
	kl_fn_get_stats(pf, &p1);
	qsort(lat, (size_t)o.steps, sizeof *lat, cmp_d);
	printf("generate: %d layers, d %lld, %lld heads, vocab %lld, caches [%lld, %lld, %lld, "
	       "%lld] x %d, %s\n",
	       o.layers, (long long)o.d, (long long)H, (long long)o.vocab, (long long)R,
	       (long long)H, (long long)T, (long long)dh, 2 * o.layers,
	       o.device == KL_CUDA ? "cuda (reduce-overhead)" : "cpu");
	printf("decode: %d steps, batch %d..%d, %ld tokens in %.1f ms: %.0f tokens/s; per step "
	       "p50 %.3f ms, p90 %.3f ms, max %.3f ms\n",
	       o.steps, bmin, bmax, decoded, decode_ms, decoded / (decode_ms / 1e3),
	       lat[o.steps / 2], lat[o.steps * 9 / 10], lat[o.steps - 1]);
	printf("prefill: %ld prompts of 4..16 tokens in %.1f ms (%d compile%s for every length)\n",
	       prefills, prefill_ms, p1.compiles, p1.compiles == 1 ? "" : "s");
	printf("requests: %d joined, %d finished%s\n", nreq, done,
	       o.check ? (bad ? "; CHECK FAILED: tokens differ from a full forward"
	                      : "; every token equal to a full forward's") : "");
	long recompiles = (long)(d1.compiles - w0.compiles) + (p1.compiles > 1 ? p1.compiles - 1 : 0);
	long recaptures = (d1.graph_captures - w0.graph_captures) +
	                  (p1.graph_captures > 1 ? p1.graph_captures - 1 : 0);
	long launches = d1.graph_replays - w0.graph_replays;
	printf("after warm-up: %ld recompiles, %ld CUDA graph re-captures, %ld decode graph "
	       "launches, %ld of %ld decode calls padded to a bucket, %ld replayed without "
	       "tracing (fullgraph)\n",
	       recompiles, recaptures, launches, d1.padded_calls - w0.padded_calls, (long)o.steps,
	       d1.replays - w0.replays);
	printf("per bucket (batch: steps, tokens/s, ms a step):");
	for (int k = 1; k <= 256; k++)
		if (bk_steps[k])
			printf(" %d: %ld, %.0f, %.3f;", k, bk_steps[k], bk_tok[k] / (bk_ms[k] / 1e3),
			       bk_ms[k] / (double)bk_steps[k]);
	printf("\n");
	if (o.json) {
		printf("{\"example\": \"generate\", \"device\": \"%s\", \"layers\": %d, \"d_model\": "
		       "%lld, \"heads\": %lld, \"steps\": %d, \"tokens\": %ld, \"decode_ms\": %.3f, "
		       "\"tokens_per_s\": %.1f, \"p50_ms\": %.4f, \"p90_ms\": %.4f, \"max_ms\": %.4f, "
		       "\"recompiles\": %ld, \"recaptures\": %ld, \"graph_launches\": %ld, "
		       "\"padded_calls\": %ld, \"fullgraph_replays\": %ld, \"buckets\": [",
		       o.device == KL_CUDA ? "cuda" : "cpu", o.layers, (long long)o.d, (long long)H,
		       o.steps, decoded, decode_ms, decoded / (decode_ms / 1e3), lat[o.steps / 2],
		       lat[o.steps * 9 / 10], lat[o.steps - 1], recompiles, recaptures, launches,
		       d1.padded_calls - w0.padded_calls, d1.replays - w0.replays);
		const char *sep = "";
		for (int k = 1; k <= 256; k++)
			if (bk_steps[k]) {
				printf("%s{\"batch\": %d, \"steps\": %ld, \"tokens_per_s\": %.1f, "
				       "\"ms_per_step\": %.4f}",
				       sep, k, bk_steps[k], bk_tok[k] / (bk_ms[k] / 1e3),
				       bk_ms[k] / (double)bk_steps[k]);
				sep = ", ";
			}
		printf("]}\n");
	}
	rc = 0;
	if (o.check && (bad || recompiles || recaptures || done == 0)) {
		fprintf(stderr, "generate: --check failed: %d tokens differ, %ld recompiles, %ld "
		                "re-captures, %d requests finished\n",
		        bad, recompiles, recaptures, done);
		rc = 1;
	}
	for (int i = 0; i < nreq; i++)
		free(req[i].tokens);
	free(req);
	free(slot);
	free(lat);
	free(tok);
	free(pos);
	free(len);
	free(next);
	kl_fn_free(pf);
	kl_fn_free(df);
	kl_ctx_free(ctx);
	return rc;
}
