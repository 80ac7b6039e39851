/* bench_cold.c - `kiln bench --cold`: start-up, measured twice, each time in
 * a fresh `kiln` process that has touched no device and no library before
 * (so that neither figure is flattered by what an earlier measurement loaded):
 * a first call of one workload's compiled form into an empty kernel cache (a
 * cold compile: capture, lowering, cc or NVRTC, the run), then the first
 * call of a second process that finds that cache filled (a warm process).
 * Each reports, apart from its first call, what making the context took
 * (kl_ctx_new: on CUDA the driver, the device's context, NVRTC and cuBLASLt
 * set-up), so that nothing moved out of the first call goes unreported.
 */
/* nftw, to empty the cache directory --cold made */
#define _XOPEN_SOURCE 700

#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

/* The workloads --cold measures without --workload: the FeedForward (issue
 * 4's start-up target) and the training step (issue 21's). */
static const char *const COLD_DEFAULT[] = {"swiglu_ffn", "train_decoder"};
#define NCOLD_DEFAULT ((int)(sizeof COLD_DEFAULT / sizeof COLD_DEFAULT[0]))

/* The i-th workload --cold measures, or NULL past the last; *n: how many. */
static const kt_workload *cold_workload(const kt_opts *o, int i, int *n)
{
	*n = o->nonly ? o->nonly : NCOLD_DEFAULT;
	if (i >= *n)
		return NULL;
	const char *name = o->nonly ? o->only[i] : COLD_DEFAULT[i];
	return kt_find_workload(o->device, name, strlen(name));
}

typedef struct kt_first {
	double ctx_ms;        /* kl_ctx_new, before the first call */
	double ms, second_ms; /* the first and second call */
	int kernels;
	size_t peak; /* the context's peak memory over both */
	char shape[48];
} kt_first;

/* A fresh context (its making timed on its own) runs w's compiled form once:
 * the ms of kl_compile plus the first kl_fn_call (capture, lowering, cc or
 * the disk cache, dlopen, run, and on a GPU the wait for it to finish); then
 * once more, so that the start-up cost can be told from the run. */
static int first_call_ms(const kt_opts *o, const kt_workload *w, kt_first *f)
{
	double t0 = kt_now_ms();
	kl_ctx *ctx = kt_open_ctx(o);
	double ctx_ms = kt_now_ms() - t0;
	if (!ctx)
		return 1;
	bool gpu = kl_ctx_device(ctx) == KL_CUDA;
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost = {.state = &r.state};
	int rc = 0;
	double sum = 0;
	const kt_mode_desc *m = &kt_modes[KT_MODE_DEFAULT];
	*f = (kt_first){.kernels = -1, .ctx_ms = ctx_ms};
	if (w->setup(ctx, w, r.in, &cost) != KL_OK) {
		fprintf(stderr, "kiln bench: %s: setup failed: %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if (kl_memory_reset_peak(ctx) != KL_OK ||
	           (f->ms = kt_timed_call(&r, m, gpu, &sum)) < 0) {
		fprintf(stderr, "kiln bench: %s (first call): %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	} else if (!isfinite(sum)) {
		fprintf(stderr, "kiln bench: %s: the output holds non-finite values\n", w->name);
		rc = 1;
	} else if ((f->second_ms = kt_timed_call(&r, m, gpu, NULL)) < 0) {
		fprintf(stderr, "kiln bench: %s (second call): %s\n", w->name, kl_last_error(ctx));
		rc = 1;
	}
	kl_memory_usage mu;
	if (kl_memory_stats(ctx, &mu) == KL_OK)
		f->peak = mu.peak;
	snprintf(f->shape, sizeof f->shape, "%s", cost.shape);
	if (r.fn) {
		f->kernels = kl_fn_last_kernels(r.fn);
		kl_fn_free(r.fn);
	}
	kt_release_inputs(&r);
	kl_ctx_free(ctx);
	return rc;
}

/* --first-call-only: what the child of --cold runs; one line for the parent. */
int kt_first_call_child(const kt_opts *o)
{
	int n;
	const kt_workload *w = cold_workload(o, 0, &n);
	if (!w) {
		fprintf(stderr, "kiln bench: no workload to time on %s\n", kt_device_name(o->device));
		return 1;
	}
	kt_first f;
	if (first_call_ms(o, w, &f) != 0)
		return 1;
	printf("ctx_ms %.6f first_call_ms %.6f second_call_ms %.6f kernels %d peak %zu shape %s\n",
	       f.ctx_ms, f.ms, f.second_ms, f.kernels, f.peak, f.shape[0] ? f.shape : "-");
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
 * already set in the environment it inherits) and reads its line; `which`
 * names the process in errors. */
static int child_process(const kt_opts *o, const kt_workload *w, const char *which, kt_first *f,
                         double *wall_ms)
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
	double t0 = kt_now_ms();
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
	*wall_ms = kt_now_ms() - t0;
	*f = (kt_first){.kernels = -1};
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
	    sscanf(line,
	           "ctx_ms %lf first_call_ms %lf second_call_ms %lf kernels %d peak %zu shape %47s",
	           &f->ctx_ms, &f->ms, &f->second_ms, &f->kernels, &f->peak, f->shape) != 6) {
		fprintf(stderr, "kiln bench: --cold: the %s process failed\n", which);
		return 1;
	}
	return 0;
}

static void print_cold_json(const kt_workload *w, const char *dev, const char *mode,
                            const kt_first *f, const char *shape, double process_ms)
{
	printf("{\"workload\":\"%s\",\"device\":\"%s\",\"dtype\":\"%s\",\"shape\":\"%s\","
	       "\"mode\":\"%s\",\"median_us\":null,\"first_call_ms\":%.6g,\"first_call_s\":%.6g,"
	       "\"second_call_ms\":%.6g,\"ctx_ms\":%.6g,\"kernels\":%d,\"bytes\":null,"
	       "\"flops\":null,\"bw_tbs\":null,\"peak_bytes\":%zu,\"process_ms\":%.6g}\n",
	       w->name, dev, kl_dtype_name(w->dtype), shape, mode, f->ms, f->ms * 1e-3,
	       f->second_ms, f->ctx_ms, f->kernels, f->peak, process_ms);
}

/* One workload's two processes. KILN_CACHE_DIR points at a new empty
 * directory for both child processes, so the first figure is a real compile
 * (cc or NVRTC included) and the second a real disk-cache hit in a process
 * that has compiled nothing. This process opens no device itself. */
static int cold_one(const kt_opts *o, const kt_workload *w)
{
	const char *tmp = getenv("TMPDIR");
	char dir[4096];
	snprintf(dir, sizeof(dir), "%s/kiln-cold-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
	if (!mkdtemp(dir)) {
		fprintf(stderr, "kiln bench: --cold: cannot make a cache directory: %s\n",
		        strerror(errno));
		return 1;
	}
	int rc = 1;
	kt_first cold, warm;
	double cold_wall = 0, warm_wall = 0;
	if (setenv("KILN_CACHE_DIR", dir, 1) != 0) {
		fprintf(stderr, "kiln bench: --cold: setenv: %s\n", strerror(errno));
		goto out;
	}
	if (child_process(o, w, "first (cold)", &cold, &cold_wall) != 0 ||
	    child_process(o, w, "second (warm)", &warm, &warm_wall) != 0)
		goto out;
	const char *dev = kt_device_name(o->device);
	if (o->json) {
		print_cold_json(w, dev, "cold_compile", &cold, cold.shape, cold_wall);
		print_cold_json(w, dev, "warm_process", &warm, cold.shape, warm_wall);
	} else {
		printf("kiln %s bench --cold: %s %s %s on %s, each in a fresh process\n",
		       kl_version(), w->name, cold.shape, kl_dtype_name(w->dtype), dev);
		printf("cold compile (empty kernel cache), first call: %10.3f ms  (second call "
		       "%.3f ms; %d kernels)\n",
		       cold.ms, cold.second_ms, cold.kernels);
		printf("  its context creation (kl_ctx_new), before:   %10.3f ms  (whole process "
		       "%.1f ms)\n",
		       cold.ctx_ms, cold_wall);
		printf("warm process (cache filled), first call:       %10.3f ms  (second call "
		       "%.3f ms; %d kernels)\n",
		       warm.ms, warm.second_ms, warm.kernels);
		printf("  its context creation (kl_ctx_new), before:   %10.3f ms  (whole process "
		       "%.1f ms)\n",
		       warm.ctx_ms, warm_wall);
	}
	fflush(stdout);
	rc = 0;
out:
	nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
	return rc;
}

/* --cold: each workload (--workload's, else swiglu_ffn and train_decoder)
 * in its own pair of processes with its own empty cache. */
int kt_cold_main(const kt_opts *o)
{
	int n, failures = 0, printed = 0;
	cold_workload(o, 0, &n);
	for (int i = 0; i < n; i++) {
		const kt_workload *w = cold_workload(o, i, &n);
		if (!w) {
			fprintf(stderr, "kiln bench: --cold: no workload %s on %s\n",
			        o->nonly ? o->only[i] : COLD_DEFAULT[i], kt_device_name(o->device));
			failures++;
			continue;
		}
		if (printed && !o->json)
			printf("\n");
		int rc = cold_one(o, w);
		failures += rc;
		printed += !rc;
	}
	return failures ? 1 : 0;
}
