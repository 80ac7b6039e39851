/* export_decoder.c - export a stack of the seed's DecoderLayers (kiln_nn.h)
 * with a dynamic batch and a dynamic sequence dim, write it as an AOT
 * package, and compare it with the JIT path: results, load time (package
 * file to first result) and steady-state speed.
 *
 *   export_decoder [--layers N] [--d-model N] [--heads N] [--ffn N]
 *                  [--batch N] [--seq N] [--iters N] [--out DIR] [--device cuda]
 *
 * --device cuda: everything on CUDA device 0 (exits 77 without one): the
 * package holds cubins + PTX and loads with no NVRTC. --arch 90: only write
 * a CUDA package for sm_90 from this CPU (NVRTC, no GPU) and check it
 * (kl_package_describe); nothing runs.
 *
 * Writes DIR/decoder.klp, DIR/x.safetensors (an input at --batch x --seq,
 * another size than the one traced) and DIR/ref.safetensors (the JIT's
 * output for it): examples/package_server.c runs them with libkiln_rt.
 */
#include <kiln.h>
#include <kiln_nn.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

typedef struct stack {
	int n;
	kl_nn_decoder *layers;
} stack;

static kl_status body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin;
	(void)nout;
	const stack *s = user;
	kl_tensor *h = in[0];
	for (int i = 0; i < s->n && h; i++)
		h = kl_nn_decoder_forward(&s->layers[i], h, false);
	out[0] = h;
	return h ? KL_OK : kl_last_status(ctx);
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* median ms of iters calls of f (a kl_fn) or p (a package) */
static double time_calls(kl_fn *f, kl_package *p, kl_tensor *x, int iters)
{
	double *t = malloc(sizeof *t * (size_t)iters), med;
	for (int i = 0; i < iters; i++) {
		kl_tensor *y = NULL;
		double t0 = now_ms();
		kl_status st = f ? kl_fn_call(f, &x, &y) : kl_package_run(p, &x, &y);
		if (st == KL_OK)
			st = kl_ctx_synchronize(kl_tensor_ctx(x));
		t[i] = now_ms() - t0;
		kl_release(y);
		if (st != KL_OK)
			return -1;
	}
	qsort(t, (size_t)iters, sizeof *t, cmp_d);
	med = t[iters / 2];
	free(t);
	return med;
}

#define CHECK(c)                                                                                   \
	do {                                                                                       \
		if (!(c)) {                                                                        \
			fprintf(stderr, "export_decoder: %s (%s)\n", kl_last_error(ctx), #c);      \
			return 1;                                                                  \
		}                                                                                  \
	} while (0)

int main(int argc, char **argv)
{
	int64_t layers = 4, d = 256, h = 4, ffn = 1024, batch = 3, seq = 50;
	int iters = 20;
	const char *dir = ".";
	kl_ctx_opts copts = {0};
	int arch = 0;
	for (int i = 1; i + 1 < argc; i += 2) {
		int64_t v = strtoll(argv[i + 1], NULL, 10);
		if (!strcmp(argv[i], "--layers")) layers = v;
		else if (!strcmp(argv[i], "--d-model")) d = v;
		else if (!strcmp(argv[i], "--heads")) h = v;
		else if (!strcmp(argv[i], "--ffn")) ffn = v;
		else if (!strcmp(argv[i], "--batch")) batch = v;
		else if (!strcmp(argv[i], "--seq")) seq = v;
		else if (!strcmp(argv[i], "--iters")) iters = (int)v;
		else if (!strcmp(argv[i], "--out")) dir = argv[i + 1];
		else if (!strcmp(argv[i], "--arch")) arch = (int)v;
		else if (!strcmp(argv[i], "--device") && !strcmp(argv[i + 1], "cuda"))
			copts.device = KL_CUDA;
		else return fprintf(stderr, "export_decoder: unknown option %s\n", argv[i]), 2;
	}
	double tc = now_ms();
	kl_ctx *ctx = kl_ctx_new(&copts);
	if (!ctx && copts.device == KL_CUDA)
		return fprintf(stderr, "export_decoder: skipped: %s\n", kl_last_error(NULL)), 77;
	CHECK(ctx);
	printf("context (%s) %.2f ms\n", copts.device == KL_CUDA ? "cuda:0" : "cpu", now_ms() - tc);
	stack s = {(int)layers, calloc((size_t)layers, sizeof(kl_nn_decoder))};
	/* parameters by their state-dict keys: an nn.ModuleList "layers" */
	int cap = (int)layers * 16, np = 0;
	kl_tensor **ps = calloc((size_t)cap, sizeof *ps);
	char (*names)[160] = calloc((size_t)cap, sizeof *names);
	const char **pn = calloc((size_t)cap, sizeof *pn);
	for (int i = 0; i < s.n; i++) {
		CHECK(kl_nn_decoder_init(&s.layers[i], ctx, d, h, ffn, KL_F32, 1000 + (uint64_t)i) == KL_OK);
		kl_nn_param p[16];
		int n = kl_nn_params(&s.layers[i].base, p, 16);
		for (int j = 0; j < n && np < cap; j++, np++) {
			snprintf(names[np], sizeof names[np], "layers.%d.%.120s", i, p[j].name);
			ps[np] = *p[j].slot;
			pn[np] = names[np];
		}
	}
	kl_tensor *ex = kl_randn(ctx, KL_F32, 3, (int64_t[]){2, 16, d}, 1);
	kl_dim_spec dims[2] = {{0, 0, "batch", 1, 64}, {0, 1, "seq", 1, 2048}};
	kl_export_opts o = {.ndims = 2, .dims = dims, .nparams = np, .params = ps, .param_names = pn,
	                    .cuda_arch = arch};
	double t0 = now_ms();
	kl_exported *e = kl_export(ctx, body, &s, 1, 1, &ex, &o);
	CHECK(e);
	char path[1024], xp[1024], rp[1024];
	snprintf(path, sizeof path, "%s/decoder.klp", dir);
	snprintf(xp, sizeof xp, "%s/x.safetensors", dir);
	snprintf(rp, sizeof rp, "%s/ref.safetensors", dir);
	CHECK(kl_exported_package(e, path) == KL_OK);
	double t1 = now_ms();
	struct stat st;
	CHECK(stat(path, &st) == 0);
	printf("%d layers, d_model %lld: exported and packaged in %.0f ms, package %.2f MB\n", s.n,
	       (long long)d, t1 - t0, (double)st.st_size / 1e6);
	if (arch && copts.device == KL_CPU) {
		/* a CUDA package built here: read and checked (best of 5), not run */
		FILE *pf = fopen(path, "rb"), *nul = fopen("/dev/null", "w");
		char *buf = malloc((size_t)st.st_size);
		CHECK(pf && nul && buf && fread(buf, 1, (size_t)st.st_size, pf) == (size_t)st.st_size);
		double best = 1e30;
		for (int r = 0; r < 5; r++) {
			double a = now_ms();
			CHECK(kl_package_describe(ctx, buf, (size_t)st.st_size, nul) == KL_OK);
			best = now_ms() - a < best ? now_ms() - a : best;
		}
		printf("sm_%d package checked (kl_package_describe, every section), best of 5: %.3f ms\n",
		       arch, best);
		fclose(pf);
		fclose(nul);
		free(buf);
		return 0;
	}
	/* the JIT path (dynamic dims as exported), and the input to serve */
	kl_compile_opts co = {.ndynamic_dims = 1, .dynamic_dims = (uint32_t[]){KL_DIM(0) | KL_DIM(1)}};
	kl_fn *f = kl_compile(ctx, body, &s, 1, 1, &co);
	kl_tensor *x = kl_randn(ctx, KL_F32, 3, (int64_t[]){batch, seq, d}, 2), *ref = NULL;
	CHECK(f && kl_fn_call(f, &x, &ref) == KL_OK);
	const char *xn = "input0", *rn = "output0";
	CHECK(kl_safetensors_save(ctx, xp, 1, &xn, &x) == KL_OK);
	CHECK(kl_safetensors_save(ctx, rp, 1, &rn, &ref) == KL_OK);
	/* package file to first result, in this process (its context made): a
	 * one-request load (1 x 8 tokens), best of 5; the load alone apart */
	double best = 1e30, best_load = 1e30, err = -1;
	kl_tensor *small = kl_randn(ctx, KL_F32, 3, (int64_t[]){1, 8, d}, 3);
	for (int r = 0; r < 5; r++) {
		double a = now_ms();
		kl_package *p = kl_package_load(ctx, path);
		double l = now_ms() - a;
		kl_tensor *y = NULL;
		float first;
		CHECK(p && kl_package_run(p, &small, &y) == KL_OK);
		CHECK(kl_to_host(kl_slice(kl_reshape(y, 1, (int64_t[]){8 * d}), 0, 0, 1, 1), &first,
		                 sizeof first) == KL_OK);
		double b = now_ms() - a;
		printf("  load %d: %.2f ms, first result %.2f ms\n", r, l, b);
		best = b < best ? b : best;
		best_load = l < best_load ? l : best_load;
		kl_release(y);
		y = NULL;
		CHECK(kl_package_run(p, &x, &y) == KL_OK);
		CHECK(kl_item(kl_max(kl_abs(kl_sub(y, ref)), 0, NULL, false), &err) == KL_OK);
		kl_release(y);
		kl_package_free(p);
	}
	kl_release(small);
	printf("package file -> first result (1x8 tokens), best of 5: %.2f ms (load alone %.2f ms);"
	       " max |package - JIT| at %lldx%lld: %.2e\n",
	       best, best_load, (long long)batch, (long long)seq, err);
	kl_package *p = kl_package_load(ctx, path);
	CHECK(p);
	double tj = time_calls(f, NULL, x, iters), tp = time_calls(NULL, p, x, iters);
	printf("steady state, median of %d: JIT %.3f ms, package %.3f ms\n", iters, tj, tp);
	kl_package_free(p);
	kl_release(ref);
	kl_release(x);
	kl_release(ex);
	kl_fn_free(f);
	kl_exported_free(e);
	for (int i = 0; i < s.n; i++)
		kl_nn_free(&s.layers[i].base);
	free(s.layers);
	free(ps);
	free(names);
	free(pn);
	kl_ctx_free(ctx);
	return err >= 0 && err < 1e-4 ? 0 : 1;
}
