/* bench.c - `kiln bench`: runs each workload of the device's table in each
 * mode it supports (eager, kl_compile's modes), times it (first call, then
 * the median of repeated calls), measures the device's copy bandwidth, and
 * prints a table or one JSON object a line. --cold (bench_cold.c) times
 * start-up instead.
 *
 * On the CPU a call is synchronous: each timed call is one sample. On CUDA
 * calls only enqueue work, so a sample is a batch of calls ended by a wait
 * for the device (a one-element read of the last output), divided by the
 * batch size: the throughput a program calling in a loop gets, as torch's
 * CUDA-event loops measure it.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

/* CPU: timed calls run until both bounds are met (unless --iters fixes the
 * count), after one warm-up call when the first was short. */
static const double MIN_TIME_MS = 500.0;
static const int MIN_ITERS = 3;
static const int MAX_ITERS = 100000;
static const double WARMUP_MS = 250.0;
/* CUDA: 20 warm-up calls, then 10 samples, each a batch of at least 5 calls
 * and about 2 ms of work. */
static const int GPU_WARMUP = 20;
static const int GPU_SAMPLES = 10;
static const int GPU_MIN_BATCH = 5;
static const int GPU_MAX_BATCH = 1000;
static const double GPU_BATCH_MS = 2.0;

static kl_status eager_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	(void)m;
	void *user = kt_state_user(&r->state);
	return r->w->body(r->ctx, r->in, r->w->nin, out, r->w->nout, user);
}

/* The first call compiles, inside the timing: the first-call column is what a
 * program pays to start (capture, lowering, cc/NVRTC or the disk cache, the
 * run). The workloads have no sync point, so they compile with .fullgraph:
 * a later call checks the guards and replays the plan without running the
 * body again, the serving-loop path (as torch.compile runs its guarded code,
 * not the Python function, once a frame is compiled). */
static kl_status compiled_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	if (!r->fn) {
		kl_compile_opts co = {.mode = m->kmode, .fullgraph = true};
		void *user = kt_state_user(&r->state);
		r->fn = kl_compile(r->ctx, r->w->body, user, r->w->nin, r->w->nout, &co);
		if (!r->fn)
			return kl_last_status(r->ctx);
	}
	return kl_fn_call(r->fn, r->in, out);
}

/* The dynamic plan against the static one at the same size: dims 0 and 1
 * of input 0 (batch and sequence) dynamic, and the first call (in the
 * first-call column) traces and compiles at another sequence length (half
 * the row's, plus one), so that the timed calls run a plan that was not
 * made for their size. */
static kl_status dynamic_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	if (!r->fn) {
		kl_compile_opts co = {.mode = m->kmode,
		                      .fullgraph = true,
		                      .ndynamic_dims = 1,
		                      .dynamic_dims = (uint32_t[]){KL_DIM(0) | KL_DIM(1)}};
		void *user = kt_state_user(&r->state);
		r->fn = kl_compile(r->ctx, r->w->body, user, r->w->nin, r->w->nout, &co);
		if (!r->fn)
			return kl_last_status(r->ctx);
		kl_tensor *in[KT_MAX_INPUTS];
		memcpy(in, r->in, sizeof(kl_tensor *) * (size_t)r->w->nin);
		int64_t t = kl_dim(r->in[0], 1);
		in[0] = kl_contiguous(kl_slice(r->in[0], 1, 0, t / 2 + 1, 1));
		kl_status st = in[0] ? kl_fn_call(r->fn, in, out) : kl_last_status(r->ctx);
		for (int k = 0; st == KL_OK && k < r->w->nout; k++)
			kl_release(out[k]);
		if (st != KL_OK)
			return st;
	}
	return kl_fn_call(r->fn, r->in, out);
}

/* The training rows' "compiled forward": the workload's forward to the loss
 * compiled (default mode), then, after the call, kl_backward on the loss (it
 * runs the backward the partition left, as one graph compiled at the first
 * kl_backward), the optimizer's fused step and the gradients cleared, as a
 * program does that compiles its model but not its training loop
 * (torch.compile on the module, the optimizer eager). */
static kl_status compiled_forward_call(kt_run *r, const kt_mode_desc *m, kl_tensor **out)
{
	kt_state *state = kt_state_user(&r->state);
	if (!r->w->forward || !state || !state->opt)
		return kl_set_error(r->ctx, KL_EINVAL,
		                    "bench %s: mode %s needs a training row (a forward body "
		                    "and an optimizer)",
		                    r->w->name, m->name);
	if (!r->fn) {
		kl_compile_opts co = {.mode = m->kmode, .fullgraph = true};
		r->fn = kl_compile(r->ctx, r->w->forward, state, r->w->nin, r->w->nout, &co);
		if (!r->fn)
			return kl_last_status(r->ctx);
	}
	kl_status st = kl_fn_call(r->fn, r->in, out);
	if (st == KL_OK)
		st = kl_backward(out[0], NULL);
	if (st == KL_OK)
		st = kl_optim_step(state->opt);
	kl_nn_grad_clear(&state->base);
	return st;
}

const kt_mode_desc kt_modes[KT_NMODES] = {
	[KT_MODE_EAGER] = {"eager", eager_call, false, KL_MODE_DEFAULT, false},
	[KT_MODE_DEFAULT] = {"default", compiled_call, true, KL_MODE_DEFAULT, false},
	[KT_MODE_REDUCE_OVERHEAD] = {"reduce-overhead", compiled_call, true,
	                             KL_MODE_REDUCE_OVERHEAD, true},
	[KT_MODE_MAX_AUTOTUNE] = {"max-autotune", compiled_call, true, KL_MODE_MAX_AUTOTUNE, true},
	[KT_MODE_DYNAMIC] = {"dynamic", dynamic_call, true, KL_MODE_DEFAULT, false},
	[KT_MODE_COMPILED_FORWARD] = {"compiled-forward", compiled_forward_call, true,
	                              KL_MODE_DEFAULT, false},
};

/* One line of the report. Figures that do not apply are negative (kernels,
 * first call, peak) or 0 (rates) and print as null or "-". */
typedef struct kt_row {
	const char *workload, *device, *mode;
	const char *dtype; /* NULL: not a tensor workload (the host memcpy) */
	char shape[48];
	int iters;
	double ms;            /* median of the timed calls */
	double first_call_ms; /* the very first call: allocation, compilation, caches */
	double speedup;       /* eager ms / ms on the same device; 0 when eager did not run */
	double gbps, tflops;  /* the row's own rate: memory-bound rows gbps, others tflops */
	double copy_gbps;     /* the device's copy bandwidth, beside a memory-bound row's gbps */
	double bytes, flops;
	double checksum;      /* sum of the outputs of the first call */
	bool has_checksum;
	int kernels;          /* compiled modes: kernels and library calls per call; else -1 */
	bool as_default;      /* a compiled mode that runs as default on this device */
	double peak_bytes;    /* the context's peak memory over the mode's calls; -1: unknown */
	double host_ms;       /* CUDA: the median over the samples of the host's time a
	                       * call, the batch's calls issued, before its wait; near
	                       * ms, the row is bound by the host, not the device.
	                       * 0: not measured (CPU rows) */
} kt_row;

double kt_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

const char *kt_device_name(kl_device dev)
{
	return dev == KL_CUDA ? "cuda" : "cpu";
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

double kt_median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- the CPU's memory bandwidth ----------------------------------------------- */

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
static double host_copy_bandwidth(int nthreads, double *bytes_out, double *ms_out, int *reps_out)
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
	double start = kt_now_ms();
	while (reps < 64 && (reps < 5 || kt_now_ms() - start < 300.0)) {
		double t0 = kt_now_ms();
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
		samples[reps++] = kt_now_ms() - t0;
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

#define TABLE_FMT "%-16s %-6s %-5s %-23s %-16s %11s %10s %9s %15s %6s %10s %7s %9s %9s\n"

static void print_table_header(void)
{
	printf(TABLE_FMT, "workload", "device", "dtype", "shape", "mode", "time", "iter/s",
	       "vs eager", "rate", "of bw", "first ms", "kernels", "peak MiB", "host us");
}

static void format_time(char *buf, size_t cap, double ms)
{
	if (ms < 1.0)
		snprintf(buf, cap, "%.2f us", ms * 1e3);
	else
		snprintf(buf, cap, "%.3f ms", ms);
}

static void format_rate(char *buf, size_t cap, const kt_row *r)
{
	if (r->gbps >= 1000)
		snprintf(buf, cap, "%.3f TB/s", r->gbps * 1e-3);
	else if (r->gbps > 0)
		snprintf(buf, cap, "%.2f GB/s", r->gbps);
	else if (r->tflops > 0)
		snprintf(buf, cap, "%.3g TFLOP/s", r->tflops);
	else
		snprintf(buf, cap, "-");
}

static void print_row_table(const kt_row *r)
{
	char mode[32], tm[32], ips[32], sp[32], rate[32], bw[32], first[32], kern[16], peak[32],
	        host[32];
	snprintf(mode, sizeof(mode), "%s%s", r->mode, r->as_default ? "*" : "");
	if (r->kernels >= 0)
		snprintf(kern, sizeof(kern), "%d", r->kernels);
	else
		snprintf(kern, sizeof(kern), "-");
	format_time(tm, sizeof tm, r->ms);
	snprintf(ips, sizeof(ips), "%.2f", 1e3 / r->ms);
	if (r->first_call_ms >= 0)
		snprintf(first, sizeof(first), "%.3f", r->first_call_ms);
	else
		snprintf(first, sizeof(first), "-");
	if (r->speedup > 0)
		snprintf(sp, sizeof(sp), "%.2fx", r->speedup);
	else
		snprintf(sp, sizeof(sp), "-");
	format_rate(rate, sizeof rate, r);
	if (r->gbps > 0 && r->copy_gbps > 0)
		snprintf(bw, sizeof(bw), "%.0f%%", 100.0 * r->gbps / r->copy_gbps);
	else
		snprintf(bw, sizeof(bw), "-");
	if (r->peak_bytes >= 0)
		snprintf(peak, sizeof(peak), "%.1f", r->peak_bytes / (1024.0 * 1024.0));
	else
		snprintf(peak, sizeof(peak), "-");
	if (r->host_ms > 0)
		snprintf(host, sizeof(host), "%.2f", r->host_ms * 1e3);
	else
		snprintf(host, sizeof(host), "-");
	printf(TABLE_FMT, r->workload, r->device, r->dtype ? r->dtype : "-", r->shape, mode, tm,
	       ips, sp, rate, bw, first, kern, peak, host);
}

/* Names come from the tables in this program, never from input, so they need
 * no escaping; every number printed is finite (the harness checks). Every row
 * has the keys workload, device, dtype, shape, mode, median_us, first_call_s,
 * kernels, bytes, flops, bw_tbs and peak_bytes (null where they do not
 * apply), the keys bench/compare.py and the peers share. */
static void print_row_json(const kt_row *r)
{
	printf("{\"workload\":\"%s\",\"device\":\"%s\",", r->workload, r->device);
	if (r->dtype)
		printf("\"dtype\":\"%s\",", r->dtype);
	else
		printf("\"dtype\":null,");
	printf("\"shape\":\"%s\",\"mode\":\"%s\",\"median_us\":%.6g,\"ms\":%.6g,\"iters\":%d,"
	       "\"iter_per_s\":%.6g",
	       r->shape, r->mode, r->ms * 1e3, r->ms, r->iters, 1e3 / r->ms);
	if (r->first_call_ms >= 0)
		printf(",\"first_call_ms\":%.6g,\"first_call_s\":%.6g", r->first_call_ms,
		       r->first_call_ms * 1e-3);
	else
		printf(",\"first_call_s\":null");
	if (r->kernels >= 0)
		printf(",\"kernels\":%d", r->kernels);
	else
		printf(",\"kernels\":null");
	if (r->as_default)
		printf(",\"as_mode\":\"default\"");
	if (r->speedup > 0)
		printf(",\"speedup\":%.4g", r->speedup);
	printf(",\"bytes\":%.0f", r->bytes);
	if (r->flops > 0)
		printf(",\"flops\":%.0f", r->flops);
	else
		printf(",\"flops\":null");
	printf(",\"bw_tbs\":%.6g", r->bytes / (r->ms * 1e-3) * 1e-12);
	if (r->host_ms > 0)
		printf(",\"host_us\":%.6g", r->host_ms * 1e3);
	if (r->gbps > 0)
		printf(",\"gbps\":%.6g", r->gbps);
	if (r->tflops > 0)
		printf(",\"tflops\":%.6g", r->tflops);
	if (r->copy_gbps > 0 && r->gbps > 0 && strcmp(r->mode, "copy") != 0)
		printf(",\"copy_gbps\":%.6g,\"bw_frac\":%.4g", r->copy_gbps,
		       r->gbps / r->copy_gbps);
	if (r->peak_bytes >= 0)
		printf(",\"peak_bytes\":%.0f", r->peak_bytes);
	else
		printf(",\"peak_bytes\":null");
	if (r->has_checksum)
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

/* ---- one timed call ------------------------------------------------------------ */

/* Sum of every element of the outputs (in f32: an f16 sum of millions of
 * elements overflows): a cheap fingerprint that modes of one workload must
 * agree on, and a check that the workload computed numbers. */
static kl_status checksum(kl_ctx *ctx, kl_tensor **out, int nout, double *sum)
{
	*sum = 0;
	for (int i = 0; i < nout; i++) {
		double v;
		kl_tensor *s = kl_sum(kl_cast(out[i], KL_F32), 0, NULL, false);
		kl_status st = s ? kl_item(s, &v) : kl_last_status(ctx);
		if (st != KL_OK)
			return st;
		*sum += v;
	}
	return KL_OK;
}

/* Waits until t is computed: reading one element of it back is a sync point
 * that waits for the device's stream (the views are freed with the scope). */
static kl_status wait_for(kl_ctx *ctx, kl_tensor *t)
{
	kl_tensor *v = t;
	for (int d = 0; v && d < kl_ndim(t); d++)
		v = kl_slice(v, d, 0, 1, 1);
	double x;
	return v ? kl_item(v, &x) : kl_last_status(ctx);
}

/* One call in its own scope; with sync, then a wait for its first output
 * (*issued, when not NULL: the clock when the call returned, before the
 * wait); with sum, the outputs' checksum (untimed). Returns ms, or -1. */
static double one_call(kt_run *r, const kt_mode_desc *m, bool sync, double *sum, double *issued)
{
	kl_tensor *out[KT_MAX_OUTPUTS] = {NULL};
	double t0 = kt_now_ms();
	kl_scope_begin(r->ctx);
	kl_status st = m->call(r, m, out);
	if (issued)
		*issued = kt_now_ms();
	if (st == KL_OK && sync)
		st = wait_for(r->ctx, out[0]);
	double t1 = kt_now_ms();
	if (st == KL_OK && sum)
		st = checksum(r->ctx, out, r->w->nout, sum);
	double t2 = kt_now_ms();
	kl_scope_end(r->ctx);
	/* kl_fn_call hands out plain references, which the scope does not own */
	if (m->compiled)
		for (int i = 0; i < r->w->nout; i++)
			if (out[i])
				kl_release(out[i]);
	double t3 = kt_now_ms();
	return st == KL_OK ? (t1 - t0) + (t3 - t2) : -1;
}

double kt_timed_call(kt_run *r, const kt_mode_desc *m, bool sync, double *sum)
{
	return one_call(r, m, sync, sum, NULL);
}

/* n calls back to back, then a wait for the last one's output; ms per call,
 * or -1. *host (when not NULL): ms per call until the wait, the host's share
 * (the calls issued, the device maybe still behind). */
static double timed_batch(kt_run *r, const kt_mode_desc *m, int n, double *host)
{
	double t0 = kt_now_ms(), t1 = t0;
	for (int i = 0; i < n; i++)
		if (one_call(r, m, i == n - 1, NULL, i == n - 1 ? &t1 : NULL) < 0)
			return -1;
	if (host)
		*host = (t1 - t0) / n;
	return (kt_now_ms() - t0) / n;
}

/* ---- measuring one workload in one mode --------------------------------------- */

static double *grow(double *t, int *cap)
{
	double *nt = realloc(t, (size_t)*cap * 2 * sizeof(*t));
	if (!nt) {
		free(t);
		fprintf(stderr, "kiln bench: out of memory\n");
		return NULL;
	}
	*cap *= 2;
	return nt;
}

/* CPU: each call is a sample. Returns 0, -1 (the error is on the context) or
 * 1 (reported already). */
static int time_host(kt_run *r, const kt_mode_desc *m, const kt_opts *o, kt_row *row)
{
	/* One more untimed call settles pools and caches, unless the first call
	 * was long enough to have done that itself. */
	int warm = o->warmup >= 0 ? o->warmup : !o->iters && row->first_call_ms < WARMUP_MS;
	for (int i = 0; i < warm; i++)
		if (kt_timed_call(r, m, false, NULL) < 0)
			return -1;
	int cap = 64, n = 0;
	double *t = malloc((size_t)cap * sizeof(*t));
	if (!t) {
		fprintf(stderr, "kiln bench: out of memory\n");
		return 1;
	}
	double start = kt_now_ms();
	for (;;) {
		if (o->iters ? n == o->iters
		             : (n >= MIN_ITERS && kt_now_ms() - start >= MIN_TIME_MS) ||
		                       n == MAX_ITERS)
			break;
		if (n == cap && !(t = grow(t, &cap)))
			return 1;
		if ((t[n++] = kt_timed_call(r, m, false, NULL)) < 0) {
			free(t);
			return -1;
		}
	}
	row->iters = n;
	row->ms = kt_median(t, n);
	free(t);
	return 0;
}

/* CUDA: warm-up calls, then samples that are batches of calls ended by a
 * wait: 10 batches sized to about 2 ms each (at least 5 calls), or with
 * --iters N exactly N calls in batches of N / 10. */
static int time_device(kt_run *r, const kt_mode_desc *m, const kt_opts *o, kt_row *row)
{
	int warm = o->warmup >= 0 ? o->warmup : GPU_WARMUP;
	double est = row->first_call_ms;
	if (warm > 0) {
		double w = timed_batch(r, m, warm, NULL);
		if (w < 0)
			return -1;
		est = w;
	}
	int batch, total;
	if (o->iters) {
		total = o->iters;
		batch = total / GPU_SAMPLES > 1 ? total / GPU_SAMPLES : 1;
	} else {
		double b = est > 0 ? ceil(GPU_BATCH_MS / est) : GPU_MAX_BATCH;
		batch = b < GPU_MIN_BATCH ? GPU_MIN_BATCH : b > GPU_MAX_BATCH ? GPU_MAX_BATCH : (int)b;
		total = batch * GPU_SAMPLES;
	}
	/* the samples, as many as batches: device time (t) and the host's share
	 * (h) of each */
	int ns = (total + batch - 1) / batch, n = 0;
	double *t = malloc(2 * (size_t)ns * sizeof(*t));
	if (!t) {
		fprintf(stderr, "kiln bench: out of memory\n");
		return 1;
	}
	double *h = t + ns;
	for (int done = 0; done < total; done += batch, n++) {
		int k = total - done < batch ? total - done : batch;
		if ((t[n] = timed_batch(r, m, k, &h[n])) < 0) {
			free(t);
			return -1;
		}
	}
	row->iters = total;
	row->ms = kt_median(t, n);
	row->host_ms = kt_median(h, n);
	free(t);
	return 0;
}

/* --profile: kl_profile's table for the mode's function (the default mode's),
 * as text to print after its row; a failure is said in the text. */
static char *profile_text(kt_run *r)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *ps = open_memstream(&buf, &len);
	if (!ps)
		return NULL;
	if (kl_profile(r->fn, r->in, ps) != KL_OK) {
		fprintf(ps, "kiln bench: kl_profile: %s\n", kl_last_error(r->ctx));
		kl_clear_error(r->ctx);
	}
	fclose(ps);
	return buf;
}

static int run_mode(kt_run *r, const kt_mode_desc *m, const kt_opts *o, kt_row *row)
{
	bool gpu = kl_ctx_device(r->ctx) == KL_CUDA;
	if (kl_memory_reset_peak(r->ctx) != KL_OK)
		return -1;
	double sum = 0;
	row->first_call_ms = kt_timed_call(r, m, gpu, &sum);
	if (row->first_call_ms < 0)
		return -1;
	row->checksum = sum;
	row->has_checksum = true;
	if (!isfinite(row->checksum)) {
		fprintf(stderr, "kiln bench: %s %s (%s): the output holds non-finite values\n",
		        r->w->name, row->shape, m->name);
		return 1;
	}
	int rc = gpu ? time_device(r, m, o, row) : time_host(r, m, o, row);
	if (rc != 0)
		return rc;
	/* A call faster than the clock resolution still gets a finite rate. */
	if (row->ms <= 0)
		row->ms = 1e-6;
	kl_memory_usage mu;
	if (kl_memory_stats(r->ctx, &mu) != KL_OK)
		return -1;
	row->peak_bytes = (double)mu.peak;
	return 0;
}

void kt_release_inputs(kt_run *r)
{
	for (int i = 0; i < r->w->nin; i++)
		if (r->in[i]) {
			kl_release(r->in[i]);
			r->in[i] = NULL;
		}
	kt_state_free(&r->state);
}

/* Runs workload w in every mode it supports; returns the number of failures. */
static int run_workload(kl_ctx *ctx, const kt_workload *w, const kt_opts *o, double copy_gbps)
{
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost = {.state = &r.state};
	int failures = 0;
	if (w->setup(ctx, w, r.in, &cost) != KL_OK) {
		fprintf(stderr, "kiln bench: %s: setup failed: %s\n", w->name, kl_last_error(ctx));
		kl_clear_error(ctx);
		kt_release_inputs(&r);
		return 1;
	}
	double eager_ms = 0;
	for (int m = 0; m < KT_NMODES; m++) {
		if (!(w->modes & KT_MODE_BIT(m)))
			continue;
		kt_row row = {.workload = w->name,
		              .device = kt_device_name(kl_ctx_device(ctx)),
		              .dtype = kl_dtype_name(w->dtype),
		              .mode = kt_modes[m].name,
		              .kernels = -1,
		              .peak_bytes = -1,
		              .as_default = kt_modes[m].cpu_as_default &&
		                            kl_ctx_device(ctx) == KL_CPU};
		snprintf(row.shape, sizeof row.shape, "%s", cost.shape);
		int rc = run_mode(&r, &kt_modes[m], o, &row);
		if (rc == 0 && r.fn)
			row.kernels = kl_fn_last_kernels(r.fn);
		char *prof = rc == 0 && r.fn && o->profile && m == KT_MODE_DEFAULT
		                     ? profile_text(&r)
		                     : NULL;
		if (r.fn) {
			kl_fn_free(r.fn);
			r.fn = NULL;
		}
		if (rc != 0) {
			if (rc < 0)
				fprintf(stderr, "kiln bench: %s %s (%s): %s\n", w->name, cost.shape,
				        kt_modes[m].name, kl_last_error(ctx));
			kl_clear_error(ctx);
			failures++;
			free(prof);
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
		if (prof)
			fputs(prof, stdout);
		free(prof);
	}
	kt_release_inputs(&r);
	return failures;
}

/* ---- the copy ceiling on CUDA ----------------------------------------------------- */

/* kt_copy_workload compiled and timed like any row: GB/s of bytes read plus
 * written, or 0 when it could not be measured (said on stderr). */
static double device_copy_bandwidth(kl_ctx *ctx, const kt_opts *o)
{
	const kt_workload *w = &kt_copy_workload;
	kt_run r = {.ctx = ctx, .w = w};
	kt_cost cost = {0};
	kt_row row = {.workload = w->name,
	              .device = kt_device_name(kl_ctx_device(ctx)),
	              .dtype = kl_dtype_name(w->dtype),
	              .mode = "copy",
	              .kernels = -1,
	              .peak_bytes = -1};
	int rc = -1;
	if (w->setup(ctx, w, r.in, &cost) == KL_OK) {
		snprintf(row.shape, sizeof row.shape, "%s", cost.shape);
		rc = run_mode(&r, &kt_modes[KT_MODE_DEFAULT], o, &row);
	}
	if (rc == 0 && r.fn)
		row.kernels = kl_fn_last_kernels(r.fn);
	kl_fn_free(r.fn);
	kt_release_inputs(&r);
	if (rc < 0)
		fprintf(stderr, "kiln bench: %s: %s\n", w->name, kl_last_error(ctx));
	kl_clear_error(ctx);
	if (rc != 0)
		return 0;
	if (row.kernels < 1) {
		fprintf(stderr, "kiln bench: %s: the copy launched no kernel (it became a view), "
		                "so it measured nothing\n", w->name);
		return 0;
	}
	row.bytes = cost.bytes;
	row.gbps = cost.bytes / (row.ms * 1e-3) * 1e-9;
	row.copy_gbps = row.gbps;
	if (o->json)
		print_row(o, &row);
	else
		printf("device copy bandwidth: %.3f TB/s (a compiled copy of %s %s, %.0f MiB read + "
		       "written, median of %d calls)\n\n",
		       row.gbps * 1e-3, cost.shape, row.dtype, cost.bytes / (1024.0 * 1024.0),
		       row.iters);
	return row.gbps;
}

/* ---- options ---------------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
	        "usage: kiln bench [--device cpu|cuda] [--json] [--workload NAME]... [--iters N]\n"
	        "                  [--warmup N] [--threads N] [--list] [--cold] [--probe]\n"
	        "                  [--profile] [--serve MODE [--shape S]]\n"
	        "\n"
	        "Times each workload of the device's table in each mode it supports: a first\n"
	        "call, then the median of repeated calls. Modes: eager, then kl_compile in\n"
	        "default, reduce-overhead and max-autotune, each with .fullgraph (and, for\n"
	        "the rows that list it, dynamic: default with x's batch and sequence dims\n"
	        "dynamic, compiled at another sequence length first): later calls\n"
	        "replay the plan without running the body (the first call compiles: its time\n"
	        "is the first-call column; the kernels column is kl_fn_last_kernels; peak is\n"
	        "kl_memory_stats over the mode's calls, inputs included). Memory-bound rows\n"
	        "report the least traffic the workload needs (each input read once, each\n"
	        "output written once) per second, beside the device's copy bandwidth;\n"
	        "contractions report TFLOP/s.\n"
	        "The CPU rows are f32; a timed call is a sample (>= %.1f s and >= %d calls,\n"
	        "or exactly N with --iters). The CUDA rows are ANCHORS.md's f16/bf16\n"
	        "problems; after %d warm-up calls a sample is a batch of calls (>= %d, about\n"
	        "%.0f ms) ended by a wait for the device, %d samples (--iters N: N calls).\n"
	        "The host us column (CUDA) is the host's time a call before the batch's\n"
	        "wait: near the time column, the host, not the device, sets the pace.\n"
	        "\n"
	        "  --device D     cpu (default) or cuda\n"
	        "  --json         one JSON object per line instead of a table\n"
	        "  --workload W   only W (repeat, or a comma-separated list); see --list\n"
	        "  --iters N      exactly N timed calls after the warm-up\n"
	        "  --warmup N     N warm-up calls (default: CPU 1 when the first call was\n"
	        "                 short, CUDA %d)\n"
	        "  --threads N    CPU worker threads (default: the cores this process may\n"
	        "                 use: affinity mask, cgroup quota)\n"
	        "  --cold         instead of the table: the first call of one workload's\n"
	        "                 compiled form (default swiglu_ffn) with an empty kernel\n"
	        "                 cache (a cold compile), then in a second process that\n"
	        "                 finds the cache warm\n"
	        "  --list         list the device's workloads and exit\n"
	        "  --probe        make a context for the device and exit: 0 when it works\n"
	        "  --profile      after each default-mode row, kl_profile's table: each step\n"
	        "                 of the compiled call timed alone (not with --json)\n"
	        "  --serve MODE   one --workload in MODE (eager, default, ...), set up and\n"
	        "                 called once, then timed on request for another process:\n"
	        "                 reads a count N a line, runs N calls and answers\n"
	        "                 \"N MEDIAN_MS MIN_MS\"; q or the end of input ends it\n"
	        "                 (bench/pair_ort.py interleaves ONNX Runtime with it)\n"
	        "  --shape S      with --serve: the workload's row whose shape column is S\n"
	        "                 (default: its first row)\n",
	        MIN_TIME_MS / 1e3, MIN_ITERS, GPU_WARMUP, GPU_MIN_BATCH, GPU_BATCH_MS, GPU_SAMPLES,
	        GPU_WARMUP);
}

bool kt_parse_count(const char *s, int *out, int min)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < min || v > 1000000)
		return false;
	*out = (int)v;
	return true;
}

const kt_workload *kt_find_workload(kl_device dev, const char *name, size_t len)
{
	for (int i = 0; i < kt_nworkloads; i++)
		if ((kt_workloads[i].devices & (1u << dev)) && strlen(kt_workloads[i].name) == len &&
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

/* --workload names are checked once the device is known (after every option). */
static int check_names(const kt_opts *o)
{
	if (o->profile && (o->json || o->cold)) {
		fprintf(stderr, "kiln bench: --profile prints tables: not with %s\n",
		        o->json ? "--json" : "--cold");
		return -1;
	}
	if (o->serve_shape && !o->serve) {
		fprintf(stderr, "kiln bench: --shape picks the row --serve times: only with --serve\n");
		return -1;
	}
	for (int i = 0; i < o->nonly; i++) {
		const char *p = o->only[i];
		if (!kt_find_workload(o->device, p, strlen(p))) {
			fprintf(stderr, "kiln bench: unknown workload '%s' on %s (see --list)\n", p,
			        kt_device_name(o->device));
			return -1;
		}
	}
	return 0;
}

static int parse_opts(int argc, char **argv, kt_opts *o, char *names, size_t cap)
{
	size_t used = 0;
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
		} else if (!strcmp(a, "--probe")) {
			o->probe = true;
		} else if (!strcmp(a, "--profile")) {
			o->profile = true;
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
		} else if ((v = opt_value(argc, argv, &i, "--serve"))) {
			int m = 0;
			while (m < KT_NMODES && strcmp(kt_modes[m].name, v) != 0)
				m++;
			if (m == KT_NMODES) {
				fprintf(stderr, "kiln bench: --serve wants a mode (");
				for (int k = 0; k < KT_NMODES; k++)
					fprintf(stderr, "%s%s", k ? ", " : "", kt_modes[k].name);
				fprintf(stderr, "), not '%s'\n", v);
				return -1;
			}
			o->serve = true;
			o->serve_mode = m;
		} else if ((v = opt_value(argc, argv, &i, "--shape"))) {
			o->serve_shape = v;
		} else if ((v = opt_value(argc, argv, &i, "--iters"))) {
			if (!kt_parse_count(v, &o->iters, 1))
				return fprintf(stderr,
				               "kiln bench: --iters wants a count, not '%s'\n", v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--warmup"))) {
			if (!kt_parse_count(v, &o->warmup, 0))
				return fprintf(stderr,
				               "kiln bench: --warmup wants a count, not '%s'\n", v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--threads"))) {
			if (!kt_parse_count(v, &o->threads, 1))
				return fprintf(stderr,
				               "kiln bench: --threads wants a count, not '%s'\n",
				               v),
				       -1;
		} else if ((v = opt_value(argc, argv, &i, "--workload"))) {
			for (const char *p = v; *p;) {
				size_t len = strcspn(p, ",");
				if (o->nonly == (int)(sizeof(o->only) / sizeof(o->only[0])) ||
				    used + len + 1 > cap)
					return fprintf(stderr, "kiln bench: too many --workload\n"),
					       -1;
				memcpy(names + used, p, len);
				names[used + len] = '\0';
				o->only[o->nonly++] = names + used;
				used += len + 1;
				p += len + (p[len] == ',');
			}
		} else {
			fprintf(stderr, "kiln bench: unknown or incomplete option '%s'\n", a);
			return -1;
		}
	}
	return check_names(o);
}

static bool selected(const kt_opts *o, const kt_workload *w)
{
	if (!(w->devices & (1u << o->device)))
		return false;
	if (!o->nonly)
		return true;
	for (int i = 0; i < o->nonly; i++)
		if (!strcmp(o->only[i], w->name))
			return true;
	return false;
}

kl_ctx *kt_open_ctx(const kt_opts *o)
{
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = o->device, .nthreads = o->threads});
	if (!ctx) {
		const char *msg = kl_last_error(NULL);
		fprintf(stderr, "kiln bench: %s\n",
		        msg && *msg ? msg : "cannot create a context for the device");
	}
	return ctx;
}

/* The CPU's bandwidth: a header line, or the memory_bandwidth row in JSON. */
static double host_bandwidth_row(const kt_opts *o, int threads)
{
	double bytes = 0, ms = 0;
	int reps = 0;
	double gbps = host_copy_bandwidth(threads, &bytes, &ms, &reps);
	if (o->json) {
		if (gbps > 0) {
			kt_row bw = {.workload = "memory_bandwidth",
			             .device = "cpu",
			             .mode = "copy",
			             .iters = reps,
			             .ms = ms,
			             .first_call_ms = -1,
			             .gbps = gbps,
			             .copy_gbps = gbps,
			             .bytes = bytes,
			             .kernels = -1,
			             .peak_bytes = -1};
			snprintf(bw.shape, sizeof bw.shape, "%.0f MiB memcpy",
			         bytes / 2 / (1024.0 * 1024.0));
			print_row(o, &bw);
		}
	} else if (gbps > 0) {
		printf("memory bandwidth: %.2f GB/s (256 MiB memcpy on %d threads, bytes read + "
		       "written, best of %d)\n\n",
		       gbps, threads, reps);
	} else {
		printf("memory bandwidth: not measured (no memory for the buffers)\n\n");
	}
	return gbps;
}

int kt_bench_main(int argc, char **argv)
{
	kt_opts o = {.device = KL_CPU, .warmup = -1};
	char names[4096];
	if (parse_opts(argc, argv, &o, names, sizeof names) != 0) {
		usage(stderr);
		return 2;
	}
	if (o.list) {
		for (int i = 0; i < kt_nworkloads; i++)
			if (kt_workloads[i].devices & (1u << o.device))
				printf("%-16s %s\n", kt_workloads[i].name, kt_workloads[i].what);
		return 0;
	}
	if (o.first_call_only)
		return kt_first_call_child(&o);
	if (o.cold)
		return kt_cold_main(&o);
	if (o.serve)
		return kt_serve_main(&o);

	kl_ctx *ctx = kt_open_ctx(&o);
	if (!ctx)
		return 1;
	if (o.probe) {
		printf("kiln bench: %s works\n", kt_device_name(o.device));
		kl_ctx_free(ctx);
		return 0;
	}
	bool gpu = kl_ctx_device(ctx) == KL_CUDA;
	/* the context's: --threads, else the cores this process may use
	 * (affinity mask, cgroup quota), not the machine's online count */
	int threads = kl_ctx_threads(ctx);
	if (!o.json) {
		if (gpu)
			printf("kiln %s bench: device cuda\n", kl_version());
		else
			printf("kiln %s bench: device cpu, %d threads\n", kl_version(), threads);
	}
	double copy_gbps = gpu ? device_copy_bandwidth(ctx, &o) : host_bandwidth_row(&o, threads);
	if (!o.json)
		print_table_header();

	/* On the CPU the copy runs again before each workload and rows are set
	 * against the best so far: a neighbour's load during the first copy must
	 * not make later rows look closer to the roofline than they are. The GPU
	 * is not shared with the build, so one measurement stands. */
	int failures = gpu && copy_gbps <= 0, nrun = 0;
	double first_gbps = copy_gbps;
	for (int i = 0; i < kt_nworkloads; i++) {
		if (!selected(&o, &kt_workloads[i]))
			continue;
		if (!gpu && nrun++ && copy_gbps > 0) {
			double b, ms;
			int reps;
			double g = host_copy_bandwidth(threads, &b, &ms, &reps);
			copy_gbps = g > copy_gbps ? g : copy_gbps;
		}
		failures += run_workload(ctx, &kt_workloads[i], &o, copy_gbps);
	}
	if (!o.json && copy_gbps > first_gbps)
		printf("\nmemory bandwidth, best copy of the run: %.2f GB/s (each row's \"of bw\" "
		       "uses the best\nmeasured before it)\n",
		       copy_gbps);
	if (!o.json && !gpu)
		printf("\n* on the CPU kl_compile runs this mode as default (same kernels, same "
		       "cache entries):\n  measured again, not a variant\n");
	kl_ctx_free(ctx);
	return failures ? 1 : 0;
}
