/* bench.c - `kiln bench`: runs each workload of the table in each mode it
 * supports (eager, kl_compile's modes), times it (first call, then the median of
 * repeated calls), measures the machine's copy bandwidth, and prints a table or
 * one JSON object a line; --cold times start-up (cold compile, warm process).
 */
/* nftw, to empty the cache directory --cold made */
#define _XOPEN_SOURCE 700

#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tools.h"

#define KT_MAX_OUTPUTS 4

/* Timed calls run until both bounds are met (unless --iters fixes the count). */
static const double MIN_TIME_MS = 500.0;
static const int MIN_ITERS = 3;
static const int MAX_ITERS = 100000;
static const double WARMUP_MS = 250.0;

typedef struct kt_opts {
	kl_device device;
	bool json;
	bool list;
	int iters;   /* 0: time-bounded */
	int threads; /* 0: all cores */
	const char *only[64];
	int nonly;
	bool cold;            /* measure a cold compile and a warm process's first call */
	bool first_call_only; /* hidden: the child process of --cold */
} kt_opts;

/* One workload being measured in one mode. */
typedef struct kt_run {
	kl_ctx *ctx;
	const kt_workload *w;
	kl_tensor *in[KT_MAX_INPUTS];
	kl_fn *fn; /* compiled modes: made by the first call, freed after the mode */
} kt_run;

/* A mode is how one call of a workload is made. The harness opens a scope
 * around each call, so whatever the call creates is freed when it ends. */
typedef struct kt_mode_desc {
	const char *name;
	kl_status (*call)(kt_run *r, const struct kt_mode_desc *m, kl_tensor **out);
	bool compiled;
	kl_mode kmode;
	/* kl_compile runs this mode exactly as default on the CPU (same kernels,
	 * same cache entries): its rows say so rather than pass for a variant. */
	bool cpu_as_default;
} kt_mode_desc;

static kl_status eager_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	(void)m;
	return r->w->body(r->ctx, r->in, r->w->nin, out, r->w->nout, NULL);
}

/* The first call compiles, inside the timing: the first-call column is what a
 * program pays to start (capture, lowering, cc or the disk cache, dlopen). */
static kl_status compiled_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	if (!r->fn) {
		kl_compile_opts co = {.mode = m->kmode};
		r->fn = kl_compile(r->ctx, r->w->body, NULL, r->w->nin, r->w->nout, &co);
		if (!r->fn)
			return kl_last_status(r->ctx);
	}
	return kl_fn_call(r->fn, r->in, out);
}

static const kt_mode_desc kt_modes[KT_NMODES] = {
	[KT_MODE_EAGER] = {"eager", eager_call, false, KL_MODE_DEFAULT, false},
	[KT_MODE_DEFAULT] = {"default", compiled_call, true, KL_MODE_DEFAULT, false},
	[KT_MODE_REDUCE_OVERHEAD] = {"reduce-overhead", compiled_call, true,
	                             KL_MODE_REDUCE_OVERHEAD, true},
	[KT_MODE_MAX_AUTOTUNE] = {"max-autotune", compiled_call, true, KL_MODE_MAX_AUTOTUNE, true},
};

/* One line of the report. Rates that do not apply are 0 and not printed. */
typedef struct kt_row {
	const char *workload, *device, *mode;
	int iters;
	double ms;            /* median of the timed calls */
	double first_call_ms; /* the very first call: allocation, compilation, caches */
	double speedup;       /* eager ms / ms on the same device; 0 when eager did not run */
	double gbps, tflops;
	double copy_gbps; /* the machine's copy bandwidth, beside a memory-bound row's gbps */
	double bytes, flops;
	double checksum; /* sum of the outputs of the first call */
	int kernels;     /* compiled modes: kernels and library calls per call; else -1 */
	bool as_default; /* a compiled mode that runs as default on this device */
} kt_row;

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int online_cpus(void)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN);
	return n > 0 ? (int)n : 1;
}

/* ---- the machine's memory bandwidth ------------------------------------------ */

typedef struct kt_copy_job {
	char *dst;
	const char *src;
	size_t n;
} kt_copy_job;

static void *copy_slice(void *p)
{
	kt_copy_job *j = p;
	memcpy(j->dst, j->src, j->n);
	return NULL;
}

/* A copy far larger than any cache, split across threads: what the memory
 * system sustains reading one stream and writing another. Returns GB/s of
 * bytes read plus bytes written, or 0 if the buffers cannot be had. The
 * fastest copy counts, as in STREAM: on a shared machine the slower ones
 * measure the neighbours, and a roofline that is too low flatters every row
 * set against it. */
static double copy_bandwidth(int nthreads, double *bytes_out, double *ms_out, int *reps_out)
{
	const size_t n = (size_t)256 << 20;
	char *src = malloc(n), *dst = malloc(n);
	if (!src || !dst) {
		free(src);
		free(dst);
		return 0;
	}
	/* Touch every page first so the timed copies measure memory, not faults. */
	memset(src, 1, n);
	memset(dst, 0, n);
	if (nthreads > 64)
		nthreads = 64;
	kt_copy_job jobs[64];
	pthread_t tid[64];
	size_t slice = n / (size_t)nthreads;
	double samples[64];
	int reps = 0;
	double start = now_ms();
	while (reps < 64 && (reps < 5 || now_ms() - start < 300.0)) {
		double t0 = now_ms();
		for (int i = 0; i < nthreads; i++) {
			size_t off = (size_t)i * slice;
			jobs[i] = (kt_copy_job){dst + off, src + off,
			                        i == nthreads - 1 ? n - off : slice};
		}
		bool spawned[64] = {false};
		for (int i = 1; i < nthreads; i++)
			spawned[i] = pthread_create(&tid[i], NULL, copy_slice, &jobs[i]) == 0;
		copy_slice(&jobs[0]);
		for (int i = 1; i < nthreads; i++) {
			if (spawned[i])
				pthread_join(tid[i], NULL);
			else
				copy_slice(&jobs[i]);
		}
		samples[reps++] = now_ms() - t0;
	}
	free(src);
	free(dst);
	double ms = samples[0];
	for (int i = 1; i < reps; i++)
		ms = samples[i] < ms ? samples[i] : ms;
	*bytes_out = 2.0 * (double)n;
	*ms_out = ms;
	*reps_out = reps;
	return *bytes_out / (ms * 1e-3) * 1e-9;
}

/* ---- printing ------------------------------------------------------------------ */

#define TABLE_FMT "%-16s %-6s %-16s %10s %10s %9s %16s %7s %10s %7s\n"

static void print_table_header(void)
{
	printf(TABLE_FMT, "workload", "device", "mode", "ms", "iter/s", "vs eager", "rate", "of bw",
	       "first ms", "kernels");
}

static void print_row_table(const kt_row *r)
{
	char mode[32], ms[32], ips[32], sp[32], rate[32], bw[32], first[32], kern[16];
	snprintf(mode, sizeof(mode), "%s%s", r->mode, r->as_default ? "*" : "");
	if (r->kernels >= 0)
		snprintf(kern, sizeof(kern), "%d", r->kernels);
	else
		snprintf(kern, sizeof(kern), "-");
	snprintf(ms, sizeof(ms), "%.3f", r->ms);
	snprintf(ips, sizeof(ips), "%.2f", 1e3 / r->ms);
	snprintf(first, sizeof(first), "%.3f", r->first_call_ms);
	if (r->speedup > 0)
		snprintf(sp, sizeof(sp), "%.2fx", r->speedup);
	else
		snprintf(sp, sizeof(sp), "-");
	if (r->gbps > 0)
		snprintf(rate, sizeof(rate), "%.2f GB/s", r->gbps);
	else if (r->tflops > 0)
		snprintf(rate, sizeof(rate), "%.4f TFLOP/s", r->tflops);
	else
		snprintf(rate, sizeof(rate), "-");
	if (r->gbps > 0 && r->copy_gbps > 0)
		snprintf(bw, sizeof(bw), "%.0f%%", 100.0 * r->gbps / r->copy_gbps);
	else
		snprintf(bw, sizeof(bw), "-");
	printf(TABLE_FMT, r->workload, r->device, mode, ms, ips, sp, rate, bw, first, kern);
}

/* Names come from the tables in this program, never from input, so they need
 * no escaping; every number printed is finite (the harness checks). */
static void print_row_json(const kt_row *r)
{
	printf("{\"workload\":\"%s\",\"device\":\"%s\",\"mode\":\"%s\",\"ms\":%.6g,\"iters\":%d,"
	       "\"iter_per_s\":%.6g",
	       r->workload, r->device, r->mode, r->ms, r->iters, 1e3 / r->ms);
	if (r->first_call_ms > 0)
		printf(",\"first_call_ms\":%.6g,\"first_call_s\":%.6g", r->first_call_ms,
		       r->first_call_ms * 1e-3);
	if (r->kernels >= 0)
		printf(",\"kernels\":%d", r->kernels);
	if (r->as_default)
		printf(",\"as_mode\":\"default\"");
	if (r->speedup > 0)
		printf(",\"speedup\":%.4g", r->speedup);
	if (r->gbps > 0)
		printf(",\"gbps\":%.6g", r->gbps);
	if (r->tflops > 0)
		printf(",\"tflops\":%.6g", r->tflops);
	if (r->copy_gbps > 0 && r->gbps > 0 && strcmp(r->mode, "copy") != 0)
		printf(",\"copy_gbps\":%.6g,\"bw_frac\":%.4g", r->copy_gbps,
		       r->gbps / r->copy_gbps);
	if (r->bytes > 0)
		printf(",\"bytes\":%.0f", r->bytes);
	if (r->flops > 0)
		printf(",\"flops\":%.0f", r->flops);
	if (strcmp(r->mode, "copy") != 0)
		printf(",\"checksum\":%.9g", r->checksum);
	printf("}\n");
}

static void print_row(const kt_opts *o, const kt_row *r)
{
	if (o->json)
		print_row_json(r);
	else
		print_row_table(r);
	fflush(stdout);
}

/* ---- measuring one workload in one mode --------------------------------------- */

/* Sum of every element of the outputs: a cheap fingerprint that modes of one
 * workload must agree on, and a check that the workload computed numbers. */
static kl_status checksum(kl_ctx *ctx, kl_tensor **out, int nout, double *sum)
{
	*sum = 0;
	for (int i = 0; i < nout; i++) {
		double v;
		kl_tensor *s = kl_sum(out[i], 0, NULL, false);
		kl_status st = s ? kl_item(s, &v) : kl_last_status(ctx);
		if (st != KL_OK)
			return st;
		*sum += v;
	}
	return KL_OK;
}

/* One call inside its own scope; returns its wall time in ms, or -1 on error.
 * Freeing what the call made counts: a program pays for it on every call. */
static double timed_call(kt_run *r, const kt_mode_desc *m, double *sum)
{
	kl_tensor *out[KT_MAX_OUTPUTS] = {NULL};
	double t0 = now_ms();
	kl_scope_begin(r->ctx);
	kl_status st = m->call(r, m, out);
	double t1 = now_ms();
	if (st == KL_OK && sum)
		st = checksum(r->ctx, out, r->w->nout, sum);
	double t2 = now_ms();
	kl_scope_end(r->ctx);
	/* kl_fn_call hands out plain references, which the scope does not own */
	if (m->compiled)
		for (int i = 0; i < r->w->nout; i++)
			if (out[i])
				kl_release(out[i]);
	double t3 = now_ms();
	return st == KL_OK ? (t1 - t0) + (t3 - t2) : -1;
}

static int run_mode(kt_run *r, const kt_mode_desc *m, const kt_opts *o, kt_row *row)
{
	row->first_call_ms = timed_call(r, m, &row->checksum);
	if (row->first_call_ms < 0)
		return -1;
	if (!isfinite(row->checksum)) {
		fprintf(stderr, "kiln bench: %s (%s): the output holds non-finite values\n",
		        r->w->name, m->name);
		return 1;
	}
	/* One more untimed call settles pools and caches, unless the first call
	 * was long enough to have done that itself. */
	if (!o->iters && row->first_call_ms < WARMUP_MS && timed_call(r, m, NULL) < 0)
		return -1;

	int cap = o->iters ? o->iters : 64, n = 0;
	double *t = malloc((size_t)cap * sizeof(*t));
	if (!t) {
		fprintf(stderr, "kiln bench: out of memory\n");
		return 1;
	}
	double start = now_ms();
	for (;;) {
		if (o->iters
		            ? n == o->iters
		            : (n >= MIN_ITERS && now_ms() - start >= MIN_TIME_MS) || n == MAX_ITERS)
			break;
		if (n == cap) {
			double *nt = realloc(t, (size_t)cap * 2 * sizeof(*t));
			if (!nt) {
				free(t);
				fprintf(stderr, "kiln bench: out of memory\n");
				return 1;
			}
			t = nt;
			cap *= 2;
		}
		if ((t[n++] = timed_call(r, m, NULL)) < 0) {
			free(t);
			return -1;
		}
	}
	row->iters = n;
	row->ms = median(t, n);
	free(t);
	/* A call faster than the clock resolution still gets a finite rate. */
	if (row->ms <= 0)
		row->ms = 1e-6;
	return 0;
}

/* Runs workload w in every mode it supports; returns the number of failures. */
static int run_workload(kl_ctx *ctx, const kt_workload *w, const kt_opts *o, double copy_gbps)
{
	const char *dev = kl_ctx_device(ctx) == KL_CUDA ? "cuda" : "cpu";
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost = {0};
	int failures = 0;
	if (w->setup(ctx, r.in, &cost) != KL_OK) {
		fprintf(stderr, "kiln bench: %s: setup failed: %s\n", w->name, kl_last_error(ctx));
		failures = 1;
		goto out;
	}
	double eager_ms = 0;
	for (int m = 0; m < KT_NMODES; m++) {
		if (!(w->modes & KT_MODE_BIT(m)))
			continue;
		kt_row row = {.workload = w->name,
		              .device = dev,
		              .mode = kt_modes[m].name,
		              .kernels = -1,
		              .as_default = kt_modes[m].cpu_as_default &&
		                            kl_ctx_device(ctx) == KL_CPU};
		int rc = run_mode(&r, &kt_modes[m], o, &row);
		if (rc == 0 && r.fn)
			row.kernels = kl_fn_last_kernels(r.fn);
		if (r.fn) {
			kl_fn_free(r.fn);
			r.fn = NULL;
		}
		if (rc != 0) {
			if (rc < 0)
				fprintf(stderr, "kiln bench: %s (%s): %s\n", w->name,
				        kt_modes[m].name, kl_last_error(ctx));
			kl_clear_error(ctx);
			failures++;
			continue;
		}
		if (m == KT_MODE_EAGER)
			eager_ms = row.ms;
		row.speedup = eager_ms > 0 ? eager_ms / row.ms : 0;
		row.bytes = cost.bytes;
		row.flops = cost.flops;
		if (cost.memory_bound) {
			row.gbps = cost.bytes / (row.ms * 1e-3) * 1e-9;
			row.copy_gbps = copy_gbps;
		} else {
			row.tflops = cost.flops / (row.ms * 1e-3) * 1e-12;
		}
		print_row(o, &row);
	}
out:
	for (int i = 0; i < w->nin; i++)
		if (r.in[i])
			kl_release(r.in[i]);
	return failures;
}

/* ---- cold start: a first compile, and a new process's first call -------------- */

static const kt_workload *cold_workload(const kt_opts *o)
{
	const char *name = o->nonly ? o->only[0] : "swiglu_ffn";
	for (int i = 0; i < kt_nworkloads; i++)
		if (!strcmp(kt_workloads[i].name, name))
			return &kt_workloads[i];
	return &kt_workloads[0];
}

/* A fresh context runs w's compiled form once: the ms of kl_compile plus the
 * first kl_fn_call (capture, lowering, cc or the disk cache, dlopen, run);
 * then once more, so that the start-up cost can be told from the run. */
static int first_call_ms(const kt_opts *o, const kt_workload *w, double *ms, double *second_ms,
                         int *kernels)
{
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = o->device, .nthreads = o->threads});
	if (!ctx) {
		const char *msg = kl_last_error(NULL);
		fprintf(stderr, "kiln bench: %s\n",
		        msg && *msg ? msg : "cannot create a context for the device");
		return 1;
	}
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost;
	int rc = 0;
	double sum = 0;
	if (w->setup(ctx, r.in, &cost) != KL_OK) {
		fprintf(stderr, "kiln bench: %s: setup failed: %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if ((*ms = timed_call(&r, &kt_modes[KT_MODE_DEFAULT], &sum)) < 0) {
		fprintf(stderr, "kiln bench: %s (first call): %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if (!isfinite(sum)) {
		fprintf(stderr, "kiln bench: %s: the output holds non-finite values\n", w->name);
		rc = 1;
	} else if ((*second_ms = timed_call(&r, &kt_modes[KT_MODE_DEFAULT], NULL)) < 0) {
		fprintf(stderr, "kiln bench: %s (second call): %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	}
	if (r.fn) {
		*kernels = kl_fn_last_kernels(r.fn);
		kl_fn_free(r.fn);
	}
	kl_ctx_free(ctx);
	return rc;
}

/* --first-call-only: what the child of --cold runs; one line for the parent. */
static int first_call_child(const kt_opts *o)
{
	const kt_workload *w = cold_workload(o);
	double ms = 0, second = 0;
	int kernels = -1;
	if (first_call_ms(o, w, &ms, &second, &kernels) != 0)
		return 1;
	printf("first_call_ms %.6f second_call_ms %.6f kernels %d\n", ms, second, kernels);
	return 0;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

extern char **environ;

/* Runs this very program as `kiln bench --first-call-only` (KILN_CACHE_DIR is
 * already set in the environment it inherits) and reads its line. */
static int warm_process(const kt_opts *o, const kt_workload *w, double *ms, double *second_ms,
                        int *kernels, double *wall_ms)
{
	char exe[4096];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n <= 0) {
		fprintf(stderr, "kiln bench: --cold: cannot find this program (/proc/self/exe)\n");
		return 1;
	}
	exe[n] = '\0';
	char threads[32];
	snprintf(threads, sizeof(threads), "%d", o->threads);
	char *args[12];
	int na = 0;
	args[na++] = exe;
	args[na++] = "bench";
	args[na++] = "--first-call-only";
	args[na++] = "--workload";
	args[na++] = (char *)w->name;
	if (o->threads) {
		args[na++] = "--threads";
		args[na++] = threads;
	}
	if (o->device == KL_CUDA) {
		args[na++] = "--device";
		args[na++] = "cuda";
	}
	args[na] = NULL;
	int fd[2];
	if (pipe(fd) != 0) {
		fprintf(stderr, "kiln bench: --cold: pipe: %s\n", strerror(errno));
		return 1;
	}
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, fd[1], STDOUT_FILENO);
	posix_spawn_file_actions_addclose(&fa, fd[0]);
	posix_spawn_file_actions_addclose(&fa, fd[1]);
	pid_t pid;
	fflush(stdout);
	double t0 = now_ms();
	int err = posix_spawn(&pid, exe, &fa, NULL, args, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(fd[1]);
	if (err) {
		close(fd[0]);
		fprintf(stderr, "kiln bench: --cold: cannot run %s: %s\n", exe, strerror(err));
		return 1;
	}
	char line[256] = {0};
	size_t got = 0;
	ssize_t k;
	while (got < sizeof(line) - 1 &&
	       (k = read(fd[0], line + got, sizeof(line) - 1 - got)) != 0) {
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			break;
		got += (size_t)k;
	}
	close(fd[0]);
	int status;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	*wall_ms = now_ms() - t0;
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
	    sscanf(line, "first_call_ms %lf second_call_ms %lf kernels %d", ms, second_ms,
	           kernels) != 3) {
		fprintf(stderr, "kiln bench: --cold: the second process failed\n");
		return 1;
	}
	return 0;
}

/* --cold: KILN_CACHE_DIR points at a new empty directory for this process and
 * the child, so the first figure is a real compile (cc included) and the
 * second a real disk-cache hit in a process that has compiled nothing. */
static int cold_main(const kt_opts *o)
{
	const kt_workload *w = cold_workload(o);
	const char *tmp = getenv("TMPDIR");
	char dir[4096];
	snprintf(dir, sizeof(dir), "%s/kiln-cold-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
	if (!mkdtemp(dir)) {
		fprintf(stderr, "kiln bench: --cold: cannot make a cache directory: %s\n",
		        strerror(errno));
		return 1;
	}
	int rc = 1;
	double cold_ms = 0, cold2_ms = 0, warm_ms = 0, warm2_ms = 0, wall_ms = 0;
	int cold_k = -1, warm_k = -1;
	if (setenv("KILN_CACHE_DIR", dir, 1) != 0) {
		fprintf(stderr, "kiln bench: --cold: setenv: %s\n", strerror(errno));
		goto out;
	}
	if (first_call_ms(o, w, &cold_ms, &cold2_ms, &cold_k) != 0 ||
	    warm_process(o, w, &warm_ms, &warm2_ms, &warm_k, &wall_ms) != 0)
		goto out;
	const char *dev = o->device == KL_CUDA ? "cuda" : "cpu";
	if (o->json) {
		printf("{\"workload\":\"%s\",\"device\":\"%s\",\"mode\":\"cold_compile\","
		       "\"first_call_ms\":%.6g,\"first_call_s\":%.6g,\"second_call_ms\":%.6g,"
		       "\"kernels\":%d}\n",
		       w->name, dev, cold_ms, cold_ms * 1e-3, cold2_ms, cold_k);
		printf("{\"workload\":\"%s\",\"device\":\"%s\",\"mode\":\"warm_process\","
		       "\"first_call_ms\":%.6g,\"first_call_s\":%.6g,\"second_call_ms\":%.6g,"
		       "\"kernels\":%d,\"process_ms\":%.6g}\n",
		       w->name, dev, warm_ms, warm_ms * 1e-3, warm2_ms, warm_k, wall_ms);
	} else {
		printf("kiln %s bench --cold: %s on %s\n", kl_version(), w->name, dev);
		printf("cold compile (empty kernel cache), first call: %10.3f ms  (second call "
		       "%.3f ms; %d kernels)\n",
		       cold_ms, cold2_ms, cold_k);
		printf("warm process (cache filled), first call:       %10.3f ms  (second call "
		       "%.3f ms; whole process %.1f ms)\n",
		       warm_ms, warm2_ms, wall_ms);
	}
	rc = 0;
out:
	nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	return rc;
}

/* ---- options ---------------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
	        "usage: kiln bench [--device cpu|cuda] [--json] [--workload NAME]... [--iters N]\n"
	        "                  [--threads N] [--list] [--cold]\n"
	        "\n"
	        "Times each workload in each mode it supports: a first call, then the median\n"
	        "of repeated calls (>= %.1f s and >= %d calls, or exactly N with --iters).\n"
	        "Modes: eager, then kl_compile in default, reduce-overhead and max-autotune\n"
	        "(the first call compiles: its time is the first-call column; the kernels\n"
	        "column is kl_fn_last_kernels). Memory-bound rows report GB/s of the least\n"
	        "traffic the workload needs (each input read once, each output written once)\n"
	        "beside the machine's copy bandwidth; contractions report TFLOP/s.\n"
	        "\n"
	        "  --device D     cpu (default) or cuda\n"
	        "  --json         one JSON object per line instead of a table\n"
	        "  --workload W   only W (repeat, or a comma-separated list); see --list\n"
	        "  --iters N      exactly N timed calls after the first\n"
	        "  --threads N    CPU worker threads (default: all cores)\n"
	        "  --cold         instead of the table: the first call of one workload's\n"
	        "                 compiled form (default swiglu_ffn) with an empty kernel\n"
	        "                 cache (a cold compile), then in a second process that\n"
	        "                 finds the cache warm\n"
	        "  --list         list the workloads and exit\n",
	        MIN_TIME_MS / 1e3, MIN_ITERS);
}

static bool parse_count(const char *s, int *out)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 1 || v > 1000000)
		return false;
	*out = (int)v;
	return true;
}

static const kt_workload *find_workload(const char *name, size_t len)
{
	for (int i = 0; i < kt_nworkloads; i++)
		if (strlen(kt_workloads[i].name) == len &&
		    !strncmp(kt_workloads[i].name, name, len))
			return &kt_workloads[i];
	return NULL;
}

/* Accepts "--opt value" and "--opt=value"; returns the value or NULL. */
static const char *opt_value(int argc, char **argv, int *i, const char *opt)
{
	size_t n = strlen(opt);
	if (strncmp(argv[*i], opt, n) != 0)
		return NULL;
	if (argv[*i][n] == '=')
		return argv[*i] + n + 1;
	if (argv[*i][n] == '\0' && *i + 1 < argc)
		return argv[++*i];
	return NULL;
}

static int parse_opts(int argc, char **argv, kt_opts *o)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v;
		if (!strcmp(a, "--json")) {
			o->json = true;
		} else if (!strcmp(a, "--cold")) {
			o->cold = true;
		} else if (!strcmp(a, "--first-call-only")) {
			o->first_call_only = true;
		} else if (!strcmp(a, "--list")) {
			o->list = true;
		} else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			exit(0);
		} else if ((v = opt_value(argc, argv, &i, "--device"))) {
			if (!strcmp(v, "cpu"))
				o->device = KL_CPU;
			else if (!strcmp(v, "cuda"))
				o->device = KL_CUDA;
			else
				return fprintf(stderr,
				               "kiln bench: unknown device '%s' (cpu, cuda)\n", v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--iters"))) {
			if (!parse_count(v, &o->iters))
				return fprintf(stderr,
				               "kiln bench: --iters wants a count, not '%s'\n", v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--threads"))) {
			if (!parse_count(v, &o->threads))
				return fprintf(stderr,
				               "kiln bench: --threads wants a count, not '%s'\n",
				               v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--workload"))) {
			for (const char *p = v; *p;) {
				size_t len = strcspn(p, ",");
				if (!find_workload(p, len)) {
					fprintf(stderr, "kiln bench: unknown workload '%.*s'"
					                " (see --list)\n",
					        (int)len, p);
					return -1;
				}
				if (o->nonly == (int)(sizeof(o->only) / sizeof(o->only[0])))
					return fprintf(stderr, "kiln bench: too many --workload\n"),
					       -1;
				o->only[o->nonly++] = find_workload(p, len)->name;
				p += len + (p[len] == ',');
			}
		} else {
			fprintf(stderr, "kiln bench: unknown or incomplete option '%s'\n", a);
			return -1;
		}
	}
	return 0;
}

static bool selected(const kt_opts *o, const kt_workload *w)
{
	if (!o->nonly)
		return true;
	for (int i = 0; i < o->nonly; i++)
		if (!strcmp(o->only[i], w->name))
			return true;
	return false;
}

int kt_bench_main(int argc, char **argv)
{
	kt_opts o = {.device = KL_CPU};
	if (parse_opts(argc, argv, &o) != 0) {
		usage(stderr);
		return 2;
	}
	if (o.list) {
		for (int i = 0; i < kt_nworkloads; i++)
			printf("%-16s %s\n", kt_workloads[i].name, kt_workloads[i].what);
		return 0;
	}
	if (o.first_call_only)
		return first_call_child(&o);
	if (o.cold)
		return cold_main(&o);

	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = o.device, .nthreads = o.threads});
	if (!ctx) {
		const char *msg = kl_last_error(NULL);
		fprintf(stderr, "kiln bench: %s\n",
		        msg && *msg ? msg : "cannot create a context for the device");
		return 1;
	}
	const char *dev = kl_ctx_device(ctx) == KL_CUDA ? "cuda" : "cpu";

	int threads = o.threads ? o.threads : online_cpus();
	double copy_bytes = 0, copy_ms = 0;
	int copy_reps = 0;
	double copy_gbps = copy_bandwidth(threads, &copy_bytes, &copy_ms, &copy_reps);
	if (o.json) {
		if (copy_gbps > 0) {
			kt_row bw = {.workload = "memory_bandwidth",
			             .device = "cpu",
			             .mode = "copy",
			             .iters = copy_reps,
			             .ms = copy_ms,
			             .gbps = copy_gbps,
			             .copy_gbps = copy_gbps,
			             .bytes = copy_bytes,
			             .kernels = -1};
			print_row(&o, &bw);
		}
	} else {
		printf("kiln %s bench: device %s, %d threads\n", kl_version(), dev, threads);
		if (copy_gbps > 0)
			printf("memory bandwidth: %.2f GB/s (256 MiB memcpy on %d threads, "
			       "bytes read + written, best of %d)\n\n",
			       copy_gbps, threads, copy_reps);
		else
			printf("memory bandwidth: not measured (no memory for the buffers)\n\n");
		print_table_header();
	}

	/* The copy runs again before each workload and rows are set against the
	 * best so far: a neighbour's load during the first copy must not make
	 * later rows look closer to the roofline than they are. */
	int failures = 0, nrun = 0;
	double first_gbps = copy_gbps;
	for (int i = 0; i < kt_nworkloads; i++) {
		if (!selected(&o, &kt_workloads[i]))
			continue;
		if (nrun++ && copy_gbps > 0) {
			double b, ms;
			int reps;
			double g = copy_bandwidth(threads, &b, &ms, &reps);
			copy_gbps = g > copy_gbps ? g : copy_gbps;
		}
		failures += run_workload(ctx, &kt_workloads[i], &o, copy_gbps);
	}
	if (!o.json && copy_gbps > first_gbps)
		printf("\nmemory bandwidth, best copy of the run: %.2f GB/s (each row's \"of bw\" "
		       "uses the best\nmeasured before it)\n",
		       copy_gbps);
	if (!o.json && kl_ctx_device(ctx) == KL_CPU)
		printf("\n* on the CPU kl_compile runs this mode as default (same kernels, same "
		       "cache entries):\n  measured again, not a variant\n");
	kl_ctx_free(ctx);
	return failures ? 1 : 0;
}
