/* bench_serve.c - `kiln bench --serve MODE --workload W`: one workload, set up
 * and called once (compiled, for a compiled mode), then timed on request, so
 * that another process can interleave its own calls with kiln's in batches
 * milliseconds apart (bench/pair_ort.py puts ONNX Runtime beside it). On a
 * shared machine whose speed drifts from second to second, two whole runs
 * one after the other measure the drift as much as the code; two batches a
 * few milliseconds apart see the same machine.
 *
 * Protocol, a line each way: once ready, one line
 *   ready WORKLOAD SHAPE DTYPE MODE FIRST_CALL_MS
 * then for each line read holding a count N (1 to 1000000), N calls and
 *   N MEDIAN_MS MIN_MS
 * (each call timed alone, as the table's CPU rows are); "q" or the end of
 * the input ends it. A line that is neither is an error that ends it, said on
 * stderr. Errors of the calls end it too (exit 1).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* For each count read, that many calls timed alone and their median and
 * least; 0 at q or the end of input, 2 at a bad line, 1 when a call fails */
static int serve_loop(kt_run *r, const kt_mode_desc *m, bool gpu)
{
	char line[64];
	while (fgets(line, sizeof line, stdin)) {
		line[strcspn(line, "\r\n")] = '\0';
		if (!strcmp(line, "q"))
			return 0;
		int n;
		if (!kt_parse_count(line, &n, 1)) {
			fprintf(stderr, "kiln bench: --serve: expected a count of calls (1 to 1000000) "
			                "or q, not '%s'\n", line);
			return 2;
		}
		double *t = malloc((size_t)n * sizeof *t);
		if (!t) {
			fprintf(stderr, "kiln bench: --serve: out of memory\n");
			return 1;
		}
		int i = 0;
		while (i < n && (t[i] = kt_timed_call(r, m, gpu, NULL)) >= 0)
			i++;
		if (i < n) {
			free(t);
			fprintf(stderr, "kiln bench: --serve %s: %s\n", r->w->name,
			        kl_last_error(r->ctx));
			return 1;
		}
		double med = kt_median(t, n);
		printf("%d %.6f %.6f\n", n, med, t[0]);
		fflush(stdout);
		free(t);
	}
	return 0;
}

int kt_serve_main(const kt_opts *o)
{
	if (o->nonly != 1) {
		fprintf(stderr, "kiln bench: --serve times one workload: name it with --workload\n");
		return 2;
	}
	const kt_workload *w = kt_find_workload(o->device, o->only[0], strlen(o->only[0]));
	const kt_mode_desc *m = &kt_modes[o->serve_mode];
	if (!w)
		return 2; /* parse_opts said why; the row's mode is checked once --shape picked it */
	kl_ctx *ctx = kt_open_ctx(o);
	if (!ctx)
		return 1;
	bool gpu = kl_ctx_device(ctx) == KL_CUDA;
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost = {.state = &r.state};
	double sum = 0, first = -1;
	int rc = 0;
	/* the row --shape names: the rows of one name are adjacent in the table */
	kl_status st;
	while ((st = w->setup(ctx, w, r.in, &cost)) == KL_OK && o->serve_shape &&
	       strcmp(cost.shape, o->serve_shape) != 0) {
		kt_release_inputs(&r);
		if (w + 1 >= kt_workloads + kt_nworkloads || strcmp(w[1].name, w->name) != 0 ||
		    !(w[1].devices & (1u << o->device))) {
			fprintf(stderr, "kiln bench: --serve: %s has no row of shape '%s' on %s (see "
			                "kiln bench --device %s --workload %s)\n",
			        w->name, o->serve_shape, kt_device_name(o->device),
			        kt_device_name(o->device), w->name);
			kl_ctx_free(ctx);
			return 2;
		}
		r = (kt_run){.ctx = ctx, .w = ++w};
		cost = (kt_cost){.state = &r.state};
	}
	if (st != KL_OK) {
		fprintf(stderr, "kiln bench: %s: setup failed: %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if (!(w->modes & KT_MODE_BIT(o->serve_mode))) {
		fprintf(stderr, "kiln bench: --serve: %s %s does not run in mode %s\n", w->name,
		        cost.shape, m->name);
		rc = 2;
	} else if ((first = kt_timed_call(&r, m, gpu, &sum)) < 0 ||
	           kt_timed_call(&r, m, gpu, NULL) < 0) {
		fprintf(stderr, "kiln bench: --serve %s: %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if (!isfinite(sum)) {
		fprintf(stderr, "kiln bench: %s: the output holds non-finite values\n", w->name);
		rc = 1;
	} else {
		printf("ready %s %s %s %s %.6f\n", w->name, cost.shape, kl_dtype_name(w->dtype),
		       m->name, first);
		fflush(stdout);
		rc = serve_loop(&r, m, gpu);
	}
	if (r.fn)
		kl_fn_free(r.fn);
	kt_release_inputs(&r);
	kl_ctx_free(ctx);
	return rc;
}
