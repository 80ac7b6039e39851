/* decoder_stack.c - a stack of the seed chapter's DecoderLayers (kiln_nn.h),
 * timed eagerly and compiled, printed as the chapter's table.
 *
 *   decoder_stack [--layers N] [--d-model N] [--heads N] [--ffn N] [--seq N]
 *                 [--batch N] [--device cpu|cuda] [--dtype f32|bf16]
 *                 [--weights FILE] [--causal] [--iters N]
 *
 * Weights are initialized as PyTorch does (seeded), or loaded from a
 * safetensors file holding the state dict of an nn.ModuleList of the seed's
 * DecoderLayer under "layers.<i>." (torch's names for model.layers[i]); a
 * file of one DecoderLayer's state dict (no "layers.0." keys, such as
 * tests/fixtures/decoder_small_f32.safetensors) gives every layer the same
 * weights.
 * Each mode runs a warm-up, then --iters timed calls; the result of every
 * compiled mode is checked against eager's.
 */
#include <kiln.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct stack {
	int n;
	kl_nn_decoder *layers;
	bool causal;
} stack;

static kl_tensor *stack_forward(const stack *s, kl_tensor *x)
{
	kl_ctx *ctx = kl_tensor_ctx(x);
	kl_tensor *h = kl_retain(x);
	for (int i = 0; i < s->n && h; i++) {
		kl_scope_begin(ctx);
		kl_tensor *y = kl_retain(kl_nn_decoder_forward(&s->layers[i], h, s->causal));
		kl_scope_end(ctx);
		kl_release(h);
		h = y;
	}
	return h;
}

static kl_status body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin;
	(void)nout;
	out[0] = stack_forward(user, in[0]);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* Regional compilation: one compiled function per layer, all of the same
 * structure. The first compiles; the others find its plan and binary in the
 * kernel cache (no code generation, no compiler) and only bind their own
 * weights. */
typedef struct layer_ref {
	const stack *s;
	int i;
} layer_ref;

static kl_status layer_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	(void)nin;
	(void)nout;
	const layer_ref *r = user;
	out[0] = kl_nn_decoder_forward(&r->s->layers[r->i], in[0], r->s->causal);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* wait until t (and everything issued before it) has been computed: on CUDA
 * a call returns once its work is queued, so a timing ends with a wait */
static kl_status sync_on(kl_tensor *t)
{
	return kl_ctx_synchronize(kl_tensor_ctx(t));
}

/* one call of mode: f == NULL is eager. A new reference to the output. */
static kl_tensor *run_once(const stack *s, kl_fn *f, kl_tensor *x)
{
	if (!f)
		return stack_forward(s, x);
	kl_tensor *out = NULL;
	return kl_fn_call(f, &x, &out) == KL_OK ? out : NULL;
}

/* the stack through one compiled function per layer; a new reference */
static kl_tensor *run_regional(kl_fn *const *lf, int n, kl_tensor *x)
{
	kl_tensor *h = kl_retain(x);
	for (int i = 0; i < n && h; i++) {
		kl_tensor *y = NULL;
		kl_status st = kl_fn_call(lf[i], &h, &y);
		kl_release(h);
		h = st == KL_OK ? y : NULL;
	}
	return h;
}

/* whether f's variant came from the kernel cache, as its explain says */
static bool from_cache(kl_fn *f)
{
	char *text = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&text, &len);
	bool hit = false;
	if (m) {
		hit = kl_explain(f, m) == KL_OK;
		fclose(m);
		hit = hit && text && strstr(text, "from the disk cache") != NULL;
	}
	free(text);
	return hit;
}

/* median-free simple timing: warm-up calls, then iters calls and a sync */
static double time_mode(const stack *s, kl_fn *f, kl_tensor *x, int iters, kl_tensor **last)
{
	for (int i = 0; i < 3; i++) {
		kl_tensor *y = run_once(s, f, x);
		if (!y || sync_on(y) != KL_OK)
			return -1;
		kl_release(y);
	}
	double t0 = now_ms();
	kl_tensor *y = NULL;
	for (int i = 0; i < iters; i++) {
		kl_release(y);
		if (!(y = run_once(s, f, x)))
			return -1;
	}
	if (sync_on(y) != KL_OK)
		return -1;
	double ms = (now_ms() - t0) / iters;
	*last = y;
	return ms;
}

static double max_rel_diff(kl_tensor *a, kl_tensor *b)
{
	int64_t n = kl_numel(a);
	kl_tensor *fa = kl_cast(a, KL_F32), *fb = kl_cast(b, KL_F32);
	float *ha = malloc(sizeof(float) * (size_t)(n + 1)), *hb = malloc(sizeof(float) * (size_t)(n + 1));
	double worst = -1, scale = 0;
	if (fa && fb && ha && hb && kl_to_host(fa, ha, sizeof(float) * (size_t)n) == KL_OK &&
	    kl_to_host(fb, hb, sizeof(float) * (size_t)n) == KL_OK) {
		worst = 0;
		for (int64_t i = 0; i < n; i++)
			scale = fmax(scale, fabs(hb[i]));
		for (int64_t i = 0; i < n; i++)
			worst = fmax(worst, fabs((double)ha[i] - hb[i]) / (scale > 0 ? scale : 1));
	}
	free(ha);
	free(hb);
	kl_release(fa);
	kl_release(fb);
	return worst;
}

static int usage(const char *argv0)
{
	fprintf(stderr, "usage: %s [--layers N] [--d-model N] [--heads N] [--ffn N] [--seq N] "
	        "[--batch N] [--device cpu|cuda] [--dtype f32|bf16] [--weights FILE] [--causal] "
	        "[--iters N]\n", argv0);
	return 2;
}

int main(int argc, char **argv)
{
	long layers = 4, d = 256, heads = 4, ffn = 0, seq = 128, batch = 2, iters = 10;
	const char *device = "cpu", *dtype = "f32", *weights = NULL;
	bool causal = false;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		long *num = !strcmp(a, "--layers") ? &layers : !strcmp(a, "--d-model") ? &d
		          : !strcmp(a, "--heads") ? &heads : !strcmp(a, "--ffn") ? &ffn
		          : !strcmp(a, "--seq") ? &seq : !strcmp(a, "--batch") ? &batch
		          : !strcmp(a, "--iters") ? &iters : NULL;
		if (!strcmp(a, "--causal")) {
			causal = true;
		} else if (num && v) {
			char *end;
			*num = strtol(v, &end, 10);
			if (*end || *num < 1)
				return usage(argv[0]);
			i++;
		} else if (!strcmp(a, "--device") && v) {
			device = argv[++i];
		} else if (!strcmp(a, "--dtype") && v) {
			dtype = argv[++i];
		} else if (!strcmp(a, "--weights") && v) {
			weights = argv[++i];
		} else {
			return usage(argv[0]);
		}
	}
	if (!ffn)
		ffn = 4 * d;
	kl_dtype dt = !strcmp(dtype, "bf16") ? KL_BF16 : KL_F32;
	if (strcmp(dtype, "bf16") && strcmp(dtype, "f32"))
		return usage(argv[0]);
	kl_ctx_opts o = {.device = !strcmp(device, "cuda") ? KL_CUDA : KL_CPU};
	if (strcmp(device, "cuda") && strcmp(device, "cpu"))
		return usage(argv[0]);
	kl_ctx *ctx = kl_ctx_new(&o);
	if (!ctx) {
		fprintf(stderr, "decoder_stack: %s\n", kl_last_error(NULL));
		return 1;
	}
	int rc = 1;
	stack s = {.n = (int)layers, .causal = causal};
	s.layers = calloc((size_t)layers, sizeof *s.layers);
	kl_safetensors *st = weights ? kl_safetensors_open(ctx, weights) : NULL;
	kl_tensor *x = NULL, *ref = NULL;
	kl_fn *fns[2] = {NULL, NULL}, **lf = NULL;
	layer_ref *refs = NULL;
	if (!s.layers || (weights && !st))
		goto fail;
	bool stacked = false;
	for (int i = 0; st && i < kl_safetensors_count(st); i++)
		stacked |= strncmp(kl_safetensors_name(st, i), "layers.0.", 9) == 0;
	for (int i = 0; i < s.n; i++) {
		if (kl_nn_decoder_init(&s.layers[i], ctx, d, heads, ffn, dt, 1000 + (uint64_t)i))
			goto fail;
		char prefix[32] = "";
		if (stacked)
			snprintf(prefix, sizeof prefix, "layers.%d.", i);
		if (st && kl_nn_load(&s.layers[i].base, st, prefix) != KL_OK)
			goto fail;
	}
	x = kl_cast(kl_randn(ctx, KL_F32, 3, (int64_t[]){batch, seq, d}, 7), dt);
	if (!x)
		goto fail;

	printf("DecoderLayer stack: %ld layers, d_model %ld, %ld heads, ffn %ld, batch %ld, seq "
	       "%ld, %s, %s%s, %s weights\n\n", layers, d, heads, ffn, batch, seq, dtype, device,
	       causal ? ", causal" : "", st ? "loaded" : "initialized");
	double t_eager = time_mode(&s, NULL, x, (int)iters, &ref);
	if (t_eager < 0)
		goto fail;
	printf("%-40s  %.3f ms  (%.0f iter/s)\n", "Eager (baseline)", t_eager, 1000 / t_eager);
	static const struct {
		const char *label;
		kl_mode mode;
	} modes[2] = {{"kiln compile (default)", KL_MODE_DEFAULT},
	              {"kiln compile reduce-overhead", KL_MODE_REDUCE_OVERHEAD}};
	double t[2];
	/* on the CPU reduce-overhead is the default mode: only CUDA times it */
	int nmodes = o.device == KL_CUDA ? 2 : 1;
	for (int m = 0; m < nmodes; m++) {
		kl_compile_opts co = {.mode = modes[m].mode};
		fns[m] = kl_compile(ctx, body, &s, 1, 1, &co);
		kl_tensor *y = NULL;
		if (!fns[m] || (t[m] = time_mode(&s, fns[m], x, (int)iters, &y)) < 0)
			goto fail;
		double diff = max_rel_diff(y, ref);
		kl_release(y);
		printf("%-40s  %.3f ms  (%.0f iter/s)  max |diff| vs eager %.2e\n", modes[m].label,
		       t[m], 1000 / t[m], diff);
		if (!(diff >= 0 && diff <= (dt == KL_BF16 ? 5e-2 : 1e-3))) {
			fprintf(stderr, "decoder_stack: %s differs from eager by %.3g\n",
			        modes[m].label, diff);
			goto fail;
		}
	}
	/* regional compilation: a compiled function per layer (the blocks are
	 * identical, so one compile serves them all) */
	double first0 = 0, first_rest = 0, t_reg = -1;
	int hits = 0;
	lf = calloc((size_t)s.n, sizeof *lf);
	refs = calloc((size_t)s.n, sizeof *refs);
	if (!lf || !refs)
		goto fail;
	kl_tensor *h = kl_retain(x);
	for (int i = 0; i < s.n && h; i++) {
		refs[i] = (layer_ref){&s, i};
		kl_compile_opts co = {.mode = KL_MODE_DEFAULT};
		lf[i] = kl_compile(ctx, layer_body, &refs[i], 1, 1, &co);
		kl_tensor *y = NULL;
		double t0 = now_ms();
		if (!lf[i] || kl_fn_call(lf[i], &h, &y) != KL_OK || sync_on(y) != KL_OK) {
			kl_release(h);
			kl_release(y);
			goto fail;
		}
		double ms = now_ms() - t0;
		kl_release(h);
		h = y;
		if (i == 0)
			first0 = ms;
		else
			first_rest += ms;
		hits += i > 0 && from_cache(lf[i]);
	}
	kl_release(h);
	{
		kl_tensor *y = NULL;
		double t0 = now_ms();
		for (long i = 0; i < iters; i++) {
			kl_release(y);
			if (!(y = run_regional(lf, s.n, x)))
				goto fail;
		}
		if (sync_on(y) != KL_OK) {
			kl_release(y);
			goto fail;
		}
		t_reg = (now_ms() - t0) / (double)iters;
		double diff = max_rel_diff(y, ref);
		kl_release(y);
		printf("%-40s  %.3f ms  (%.0f iter/s)  max |diff| vs eager %.2e\n",
		       "kiln compile, regional (per layer)", t_reg, 1000 / t_reg, diff);
		if (!(diff >= 0 && diff <= (dt == KL_BF16 ? 5e-2 : 1e-3))) {
			fprintf(stderr, "decoder_stack: regional differs from eager by %.3g\n", diff);
			goto fail;
		}
	}
	printf("regional compilation: layer 0's first call %.1f ms (%s); layers 1-%d: %.1f ms in "
	       "all, %d of %d from the kernel cache\n",
	       first0, from_cache(lf[0]) ? "from the kernel cache too" : "it compiles", s.n - 1,
	       first_rest, hits, s.n - 1);
	printf("\n");
	for (int m = 0; m < nmodes; m++) {
		char label[96];
		snprintf(label, sizeof label, "Speedup (%s vs eager):", modes[m].label + 5);
		printf("%-44s %.2fx\n", label, t_eager / t[m]);
	}
	rc = 0;
	goto done;
fail:
	fprintf(stderr, "decoder_stack: %s\n", kl_last_error(ctx));
done:
	for (int m = 0; m < 2; m++)
		kl_fn_free(fns[m]);
	for (int i = 0; lf && i < s.n; i++)
		kl_fn_free(lf[i]);
	free(lf);
	free(refs);
	kl_release(ref);
	kl_release(x);
	for (int i = 0; s.layers && i < s.n; i++)
		kl_nn_free(&s.layers[i].base);
	free(s.layers);
	kl_safetensors_close(st);
	kl_ctx_free(ctx);
	return rc;
}
