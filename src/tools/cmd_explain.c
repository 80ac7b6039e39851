/* cmd_explain.c - `kiln explain`: compile example programs and print what kl_explain
 * says of them (graphs, breaks, guards, kernels and the nodes fused into each,
 * bytes, FLOPs, planned peak memory). The examples are the bench workloads plus
 * one program that breaks its graph at a host sync.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools.h"

/* relu(a*b + c), then a host sync (kl_item), then a norm scaled by the synced
 * value: two graphs, the break attributed to kl_item. */
static kl_status break_demo(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	kl_tensor *y = kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
	double total = 0;
	kl_status s = kl_item(kl_mean(y, 0, NULL, false), &total);
	if (s != KL_OK)
		return s;
	out[0] = kl_mul_scalar(kl_rms_norm(y, NULL, 1e-6), total);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static kl_status break_demo_setup(kl_ctx *ctx, const kt_workload *w, kl_tensor **in,
                                  kt_cost *cost)
{
	(void)w;
	int64_t shape[2] = {256, 512};
	for (int i = 0; i < 3; i++)
		if (!(in[i] = kl_randn(ctx, KL_F32, 2, shape, 100 + (uint64_t)i)))
			return kl_last_status(ctx);
	*cost = (kt_cost){0};
	return KL_OK;
}

static const kt_workload demo = {"graph_break",
                                 "relu(a*b+c); kl_item(mean); rms_norm * mean",
                                 KT_ON_CPU | KT_ON_CUDA,
                                 0,
                                 KL_F32,
                                 {256, 512},
                                 3,
                                 1,
                                 break_demo_setup,
                                 break_demo,
                                 NULL};

static const struct {
	const char *name;
	kl_mode mode;
} modes[] = {
	{"default", KL_MODE_DEFAULT},
	{"reduce-overhead", KL_MODE_REDUCE_OVERHEAD},
	{"max-autotune", KL_MODE_MAX_AUTOTUNE},
	{"max-autotune-no-cudagraphs", KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: kiln explain [--device cpu|cuda] [--mode MODE] [--fullgraph] [WORKLOAD...]\n"
	           "  compiles each workload (all when none is named), calls it once and prints\n"
	           "  kl_explain. MODE: default, reduce-overhead, max-autotune,\n"
	           "  max-autotune-no-cudagraphs. Workloads:\n");
	fprintf(f, "    %-16s %s\n", demo.name, demo.what);
	/* one line a name: the CPU row's, else the first CUDA row's */
	for (int i = 0; i < kt_nworkloads; i++) {
		const kt_workload *w = &kt_workloads[i];
		bool seen = false;
		for (int j = 0; j < i; j++)
			seen |= !strcmp(kt_workloads[j].name, w->name);
		if (!seen)
			fprintf(f, "    %-16s %s%s\n", w->name, w->what,
			        w->devices & KT_ON_CPU ? "" : " (cuda only)");
	}
}

static int explain_one(kl_ctx *ctx, const kt_workload *w, const kl_compile_opts *opts)
{
	kl_tensor *in[KT_MAX_INPUTS] = {0}, *out[KT_MAX_INPUTS] = {0};
	kt_state state = {0};
	kt_cost cost = {.state = &state};
	int rc = 1;
	kl_fn *f = NULL;
	printf("=== %s: %s\n", w->name, w->what);
	if (w->setup(ctx, w, in, &cost) != KL_OK)
		goto done;
	if (!(f = kl_compile(ctx, w->body, kt_state_user(&state), w->nin, w->nout, opts)))
		goto done;
	if (kl_fn_call(f, in, out) != KL_OK)
		goto done;
	if (kl_explain(f, stdout) != KL_OK)
		goto done;
	rc = 0;
done:
	if (rc)
		fprintf(stderr, "kiln explain: %s: %s\n", w->name, kl_last_error(ctx));
	for (int i = 0; i < KT_MAX_INPUTS; i++) {
		kl_release(in[i]);
		kl_release(out[i]);
	}
	kl_fn_free(f);
	kt_state_free(&state);
	printf("\n");
	return rc;
}

int kt_explain_main(int argc, char **argv)
{
	kl_ctx_opts copts = {.device = KL_CPU};
	kl_compile_opts opts = {.mode = KL_MODE_DEFAULT};
	const char *names[64];
	int nnames = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(a, "--device") && i + 1 < argc) {
			const char *d = argv[++i];
			if (!strcmp(d, "cpu"))
				copts.device = KL_CPU;
			else if (!strcmp(d, "cuda"))
				copts.device = KL_CUDA;
			else {
				fprintf(stderr, "kiln explain: unknown device '%s' (cpu, cuda)\n", d);
				return 2;
			}
		} else if (!strcmp(a, "--mode") && i + 1 < argc) {
			const char *m = argv[++i];
			size_t k = 0;
			while (k < sizeof modes / sizeof modes[0] && strcmp(modes[k].name, m))
				k++;
			if (k == sizeof modes / sizeof modes[0]) {
				fprintf(stderr, "kiln explain: unknown mode '%s'\n", m);
				return 2;
			}
			opts.mode = modes[k].mode;
		} else if (!strcmp(a, "--fullgraph")) {
			opts.fullgraph = true;
		} else if (a[0] == '-') {
			fprintf(stderr, "kiln explain: unknown option '%s'\n", a);
			usage(stderr);
			return 2;
		} else if (nnames < 64) {
			names[nnames++] = a;
		}
	}
	const kt_workload *queue[128];
	int nqueue = 0;
	for (int n = 0; n < nnames; n++) {
		const kt_workload *w = !strcmp(names[n], demo.name) ? &demo : NULL;
		for (int i = 0; !w && i < kt_nworkloads; i++)
			if ((kt_workloads[i].devices & (1u << copts.device)) &&
			    !strcmp(names[n], kt_workloads[i].name))
				w = &kt_workloads[i];
		if (!w) {
			fprintf(stderr, "kiln explain: unknown workload '%s'\n", names[n]);
			return 2;
		}
		queue[nqueue++] = w;
	}
	if (nnames == 0) {
		queue[nqueue++] = &demo;
		for (int i = 0; i < kt_nworkloads && nqueue < 128; i++)
			if (kt_workloads[i].devices & (1u << copts.device))
				queue[nqueue++] = &kt_workloads[i];
	}
	kl_ctx *ctx = kl_ctx_new(&copts);
	if (!ctx) {
		fprintf(stderr, "kiln explain: %s\n", kl_last_error(NULL));
		return 1;
	}
	int rc = 0;
	for (int i = 0; i < nqueue; i++)
		rc |= explain_one(ctx, queue[i], &opts);
	kl_ctx_free(ctx);
	return rc;
}
