/* cmd_export.c - `kiln export`, `kiln package`, `kiln run`, `kiln inspect`:
 * export a CPU bench workload (kl_export) and print its program, or write it
 * as an AOT package; run a package on inputs from a safetensors file and
 * write its outputs to another; print a package's manifest, kernels, sizes
 * and target.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tools.h"

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void export_usage(FILE *f, const char *cmd)
{
	fprintf(f,
	        "usage: kiln %s WORKLOAD [--dynamic INPUT:DIM:NAME:MIN:MAX]... [--device cuda "
	        "[--arch 90]] %s\n"
	        "  WORKLOAD: a CPU row of `kiln bench --list` (its first CPU row of that name)\n"
	        "  --dynamic: input INPUT's dim DIM is dynamic, named NAME, over [MIN, MAX]\n"
	        "  --device cuda: a CUDA package (cubins for sm_ARCH, default 90, with PTX),\n"
	        "  traced on the CPU and built by NVRTC: no GPU needed\n",
	        cmd,
	        !strcmp(cmd, "package")
	                ? "-o FILE.klp [--save-inputs x.safetensors] [--check]\n"
	                  "  -o: the package to write; --save-inputs: the example inputs, by the\n"
	                  "  package's input names (for kiln run); --check: run eager, compiled\n"
	                  "  and the package on the example inputs and compare"
	                : "[-o FILE]\n  prints the exported program (to FILE with -o)");
}

typedef struct exp_args {
	const kt_workload *w;
	kl_dim_spec dims[16];
	char names[16][64];
	int ndims;
	const char *out, *save_inputs;
	bool check;
	int cuda_arch; /* --device cuda: 90 unless --arch */
} exp_args;

static int parse_export(int argc, char **argv, exp_args *a, const char *cmd)
{
	memset(a, 0, sizeof *a);
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			export_usage(stdout, cmd);
			return 0;
		} else if (!strcmp(argv[i], "-o") && i + 1 < argc)
			a->out = argv[++i];
		else if (!strcmp(argv[i], "--save-inputs") && i + 1 < argc)
			a->save_inputs = argv[++i];
		else if (!strcmp(argv[i], "--check"))
			a->check = true;
		else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
			const char *d = argv[++i];
			if (strcmp(d, "cpu") != 0 && strcmp(d, "cuda") != 0) {
				fprintf(stderr, "kiln %s: unknown device '%s' (cpu, cuda)\n", cmd, d);
				return 2;
			}
			a->cuda_arch = !strcmp(d, "cuda") ? (a->cuda_arch ? a->cuda_arch : 90) : 0;
		} else if (!strcmp(argv[i], "--arch") && i + 1 < argc) {
			char *end;
			long v = strtol(argv[++i], &end, 10);
			if (*end || v < 30 || v > 999) {
				fprintf(stderr, "kiln %s: --arch wants an sm number (90), got '%s'\n", cmd,
				        argv[i]);
				return 2;
			}
			a->cuda_arch = (int)v;
		}
		else if (!strcmp(argv[i], "--dynamic") && i + 1 < argc && a->ndims < 16) {
			kl_dim_spec *d = &a->dims[a->ndims];
			long long mn, mx;
			int in, dim, n = 0;
			if (sscanf(argv[++i], "%d:%d:%63[A-Za-z0-9_.-]:%lld:%lld%n", &in, &dim,
			           a->names[a->ndims], &mn, &mx, &n) != 5 ||
			    argv[i][n] != '\0') {
				fprintf(stderr, "kiln %s: --dynamic wants INPUT:DIM:NAME:MIN:MAX, got '%s'\n",
				        cmd, argv[i]);
				return 2;
			}
			*d = (kl_dim_spec){in, dim, a->names[a->ndims], mn, mx};
			a->ndims++;
		} else if (argv[i][0] != '-' && !a->w) {
			for (int k = 0; k < kt_nworkloads && !a->w; k++)
				if (!strcmp(kt_workloads[k].name, argv[i]) &&
				    (kt_workloads[k].devices & KT_ON_CPU))
					a->w = &kt_workloads[k];
			if (!a->w) {
				fprintf(stderr, "kiln %s: no CPU workload '%s' (kiln bench --list)\n", cmd,
				        argv[i]);
				return 2;
			}
		} else {
			fprintf(stderr, "kiln %s: unknown argument '%s'\n\n", cmd, argv[i]);
			export_usage(stderr, cmd);
			return 2;
		}
	}
	if (a->check && a->cuda_arch) {
		fprintf(stderr, "kiln %s: --check runs the package here, a CUDA package needs a GPU "
		                "(kiln run --device cuda there)\n", cmd);
		return 2;
	}
	if (!a->w || (!strcmp(cmd, "package") && !a->out)) {
		export_usage(stderr, cmd);
		return 2;
	}
	return -1;
}

/* max |a - b| / (1 + max |b|) over every element; -1 when they differ in
 * shape or cannot be read */
static double rel_err(kl_tensor *a, kl_tensor *b)
{
	int n = kl_ndim(a);
	if (n != kl_ndim(b) || memcmp(kl_shape(a), kl_shape(b), sizeof(int64_t) * (size_t)n) != 0)
		return -1;
	size_t cnt = (size_t)kl_numel(a);
	float *x = malloc(cnt * sizeof *x + 1), *y = malloc(cnt * sizeof *y + 1);
	kl_tensor *xa = kl_cast(a, KL_F32), *yb = kl_cast(b, KL_F32);
	double err = -1, mag = 0, d = 0;
	if (x && y && xa && yb && kl_to_host(xa, x, cnt * sizeof *x) == KL_OK &&
	    kl_to_host(yb, y, cnt * sizeof *y) == KL_OK) {
		for (size_t i = 0; i < cnt; i++) {
			if (isnan(x[i]) != isnan(y[i]))
				d = INFINITY;
			else if (!isnan(x[i]) && fabs((double)x[i] - y[i]) > d)
				d = fabs((double)x[i] - y[i]);
			mag = fabs((double)y[i]) > mag ? fabs((double)y[i]) : mag;
		}
		err = d / (1 + mag);
	}
	kl_release(xa);
	kl_release(yb);
	free(x);
	free(y);
	return err;
}

static int do_export(int argc, char **argv, const char *cmd)
{
	exp_args a;
	int rc = parse_export(argc, argv, &a, cmd);
	if (rc >= 0)
		return rc;
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx) {
		fprintf(stderr, "kiln %s: %s\n", cmd, kl_last_error(NULL));
		return 1;
	}
	kt_state state;
	memset(&state, 0, sizeof state);
	kt_cost cost = {.state = &state};
	kl_tensor *in[KT_MAX_INPUTS] = {0};
	const kt_workload *w = a.w;
	kl_exported *e = NULL;
	kl_package *p = NULL;
	rc = 1;
	if (w->setup(ctx, w, in, &cost) != KL_OK)
		goto out;
	void *user = kt_state_user(&state);
	kl_nn_param np[64];
	kl_tensor *ps[64];
	const char *pn[64];
	int n = user ? kl_nn_params(&state.base, np, 64) : 0;
	for (int i = 0; i < n && i < 64; i++) {
		ps[i] = *np[i].slot;
		pn[i] = np[i].name;
	}
	kl_export_opts o = {.ndims = a.ndims,
	                    .dims = a.dims,
	                    .nparams = n < 64 ? n : 64,
	                    .params = ps,
	                    .param_names = pn,
	                    .cuda_arch = a.cuda_arch};
	double t0 = now_ms();
	e = kl_export(ctx, w->body, user, w->nin, w->nout, in, &o);
	if (!e)
		goto out;
	double t1 = now_ms();
	if (!strcmp(cmd, "export")) {
		FILE *f = a.out ? fopen(a.out, "w") : stdout;
		if (!f) {
			fprintf(stderr, "kiln export: cannot write %s\n", a.out);
			goto out;
		}
		kl_exported_print(e, f);
		if (a.out)
			fclose(f);
		rc = 0;
		goto out;
	}
	if (kl_exported_package(e, a.out) != KL_OK)
		goto out;
	fprintf(stderr, "kiln package: %s: exported in %.1f ms, packaged in %.1f ms\n", a.out,
	        t1 - t0, now_ms() - t1);
	if (a.save_inputs) {
		const char *names[KT_MAX_INPUTS];
		char buf[KT_MAX_INPUTS][32];
		for (int i = 0; i < w->nin; i++) {
			snprintf(buf[i], sizeof buf[i], "input%d", i);
			names[i] = buf[i];
		}
		if (kl_safetensors_save(ctx, a.save_inputs, w->nin, names, in) != KL_OK)
			goto out;
	}
	if (a.check) {
		p = kl_package_load(ctx, a.out);
		if (!p)
			goto out;
		kl_tensor *eo[8] = {0}, *po[8] = {0}, *co[8] = {0};
		kl_fn *f = kl_compile(ctx, w->body, user, w->nin, w->nout, NULL);
		kl_scope_begin(ctx);
		kl_status st = w->body(ctx, in, w->nin, eo, w->nout, user);
		for (int k = 0; st == KL_OK && k < w->nout; k++)
			kl_retain(eo[k]);
		kl_scope_end(ctx);
		if (st == KL_OK && f)
			st = kl_fn_call(f, in, co);
		if (st == KL_OK)
			st = kl_package_run(p, in, po);
		if (st == KL_OK) {
			rc = 0;
			for (int k = 0; k < w->nout; k++) {
				double ec = rel_err(co[k], eo[k]), ep = rel_err(po[k], eo[k]);
				printf("%s output %d: compiled vs eager %.2e, package vs eager %.2e\n", w->name,
				       k, ec, ep);
				if (ec < 0 || ep < 0 || ec > 1e-3 || ep > 1e-3)
					rc = 1;
			}
		}
		for (int k = 0; k < w->nout; k++) {
			kl_release(eo[k]);
			kl_release(po[k]);
			kl_release(co[k]);
		}
		kl_fn_free(f);
		goto out;
	}
	rc = 0;
out:
	if (rc == 1 && kl_last_status(ctx) != KL_OK)
		fprintf(stderr, "kiln %s: %s\n", cmd, kl_last_error(ctx));
	kl_package_free(p);
	kl_exported_free(e);
	for (int i = 0; i < KT_MAX_INPUTS; i++)
		kl_release(in[i]);
	if (state.base.ctx)
		kl_nn_free(&state.base);
	kl_ctx_free(ctx);
	return rc;
}

int kt_export_main(int argc, char **argv)
{
	return do_export(argc, argv, "export");
}

int kt_package_main(int argc, char **argv)
{
	return do_export(argc, argv, "package");
}

int kt_inspect_main(int argc, char **argv)
{
	if (argc != 2 || argv[1][0] == '-') {
		fprintf(argc == 2 && !strcmp(argv[1], "--help") ? stdout : stderr,
		        "usage: kiln inspect PACKAGE\n");
		return argc == 2 && !strcmp(argv[1], "--help") ? 0 : 2;
	}
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx)
		return 1;
	/* read, not loaded: any target (a CUDA package on a machine without a
	 * GPU), every section checked */
	FILE *f = fopen(argv[1], "rb");
	uint8_t *buf = NULL;
	long n = -1;
	if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
	    (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) != (size_t)n)
		n = -1;
	if (f)
		fclose(f);
	int rc = 1;
	if (!f || n < 0 || !buf)
		fprintf(stderr, "kiln inspect: cannot read %s\n", argv[1]);
	else if (kl_package_describe(ctx, buf, (size_t)n, stdout) != KL_OK)
		fprintf(stderr, "kiln inspect: %s\n", kl_last_error(ctx));
	else
		rc = 0;
	free(buf);
	kl_ctx_free(ctx);
	return rc;
}

int kt_run_main(int argc, char **argv)
{
	const char *pkg = NULL, *inp = NULL, *outp = NULL;
	int repeat = 1;
	kl_ctx_opts co = {0};
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--device") && i + 1 < argc &&
		    (!strcmp(argv[i + 1], "cpu") || !strcmp(argv[i + 1], "cuda")))
			co.device = !strcmp(argv[++i], "cuda") ? KL_CUDA : KL_CPU;
		else if (!strcmp(argv[i], "--repeat") && i + 1 < argc && atoi(argv[i + 1]) >= 1)
			repeat = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--input") && i + 1 < argc)
			inp = argv[++i];
		else if (!strcmp(argv[i], "--output") && i + 1 < argc)
			outp = argv[++i];
		else if (argv[i][0] != '-' && !pkg)
			pkg = argv[i];
		else {
			fprintf(stderr, "kiln run: unknown argument '%s'\n", argv[i]);
			pkg = NULL;
			break;
		}
	}
	if (!pkg || !inp || !outp) {
		fprintf(stderr, "usage: kiln run PACKAGE --input x.safetensors --output y.safetensors "
		                "[--device cuda] [--repeat N]\n"
		                "  inputs by the package's input names (kiln inspect lists them);\n"
		                "  --device cuda for a CUDA package; --repeat: run N times (a CUDA\n"
		                "  package captures a CUDA graph at the second run, replays it after)\n");
		return 2;
	}
	double tc = now_ms();
	kl_ctx *ctx = kl_ctx_new(&co);
	if (!ctx) {
		fprintf(stderr, "kiln run: %s\n", kl_last_error(NULL));
		return 1;
	}
	int rc = 1;
	double t0 = now_ms();
	kl_package *p = kl_package_load(ctx, pkg);
	double t1 = now_ms();
	kl_safetensors *st = p ? kl_safetensors_open(ctx, inp) : NULL;
	int nin = p ? kl_package_ninputs(p) : 0, nout = p ? kl_package_noutputs(p) : 0;
	kl_tensor **in = calloc((size_t)nin + 1, sizeof *in), **out = calloc((size_t)nout + 1, sizeof *out);
	const char **names = calloc((size_t)nout + 1, sizeof *names);
	if (!st || !in || !out || !names)
		goto done;
	for (int i = 0; i < nin; i++)
		if (!(in[i] = kl_safetensors_get(st, kl_package_input_name(p, i))))
			goto done;
	double t2 = now_ms(), first = 0, last = 0;
	for (int r = 0; r < repeat; r++) {
		for (int k = 0; r > 0 && k < nout; k++) {
			kl_release(out[k]);
			out[k] = NULL;
		}
		double r0 = now_ms();
		if (kl_package_run(p, in, out) != KL_OK)
			goto done;
		if (co.device == KL_CUDA)
			kl_ctx_synchronize(ctx);
		last = now_ms() - r0;
		if (r == 0)
			first = last;
	}
	double t3 = t2 + first;
	for (int k = 0; k < nout; k++)
		names[k] = kl_package_output_name(p, k);
	if (kl_safetensors_save(ctx, outp, nout, names, out) != KL_OK)
		goto done;
	fprintf(stderr,
	        "kiln run: context %.2f ms; loaded %s in %.2f ms; first run %.2f ms (file to first "
	        "result %.2f ms); last of %d runs %.3f ms; wrote %s\n",
	        t0 - tc, pkg, t1 - t0, t3 - t2, t1 - t0 + (t2 - t1) + (t3 - t2), repeat, last, outp);
	rc = 0;
done:
	if (rc)
		fprintf(stderr, "kiln run: %s\n", kl_last_error(ctx));
	for (int i = 0; in && i < nin; i++)
		kl_release(in[i]);
	for (int k = 0; out && k < nout; k++)
		kl_release(out[k]);
	free(in);
	free(out);
	free(names);
	kl_safetensors_close(st);
	kl_package_free(p);
	kl_ctx_free(ctx);
	return rc;
}
