/* bench.h - what the two halves of `kiln bench` share: the options, one
 * workload being run in one mode, the mode table and one timed call.
 * bench.c measures the table of workloads; bench_cold.c measures start-up.
 */
#ifndef KILN_BENCH_H
#define KILN_BENCH_H

#include "tools.h"

#define KT_MAX_OUTPUTS 4

typedef struct kt_opts {
	kl_device device;
	bool json;
	bool list;
	bool probe;  /* make a context for the device, say whether it works, exit */
	int iters;   /* 0: time-bounded (CPU) or 10 batches of >= 5 calls (CUDA) */
	int warmup;  /* -1: the device's default */
	int threads; /* 0: all cores */
	const char *only[64];
	int nonly;
	bool cold;            /* measure a cold compile and a warm process's first call */
	bool first_call_only; /* hidden: the child process of --cold */
	bool profile;         /* kl_profile's table after each default-mode row */
	bool serve;           /* --serve: one workload timed on request (bench_serve.c) */
	int serve_mode;       /* its kt_mode */
	const char *serve_shape; /* --shape: which row of the workload (its shape column) */
} kt_opts;

/* One workload being measured in one mode. */
typedef struct kt_run {
	kl_ctx *ctx;
	const kt_workload *w;
	kl_tensor *in[KT_MAX_INPUTS];
	kl_fn *fn; /* compiled modes: made by the first call, freed after the mode */
	kt_state state; /* the setup's module, if it made one (kt_cost.state) */
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

extern const kt_mode_desc kt_modes[KT_NMODES];

double kt_now_ms(void);
/* One call inside its own scope; returns its wall time in ms, or -1 with the
 * error on r->ctx. sync: the time includes waiting for the device to finish
 * (a one-element read of the output; CUDA runs asynchronously). sum: also
 * the sum of every output element (as f32), outside the time. Freeing what
 * the call made counts: a program pays for it on every call. */
double kt_timed_call(kt_run *r, const kt_mode_desc *m, bool sync, double *sum);
/* The first row named name (len bytes) that runs on dev, or NULL. */
const kt_workload *kt_find_workload(kl_device dev, const char *name, size_t len);
const char *kt_device_name(kl_device dev);
/* The median of v[0, n) (sorted in place, so v[0] is then the least). */
double kt_median(double *v, int n);
/* A count from min to 1000000 in s (all of it); false if it is none. */
bool kt_parse_count(const char *s, int *out, int min);
/* A context for o's device and threads, or NULL (said on stderr). */
kl_ctx *kt_open_ctx(const kt_opts *o);
/* Release r's inputs and the setup's state (kt_state_free). */
void kt_release_inputs(kt_run *r);

/* bench_cold.c: --cold, and its child process (--first-call-only). */
int kt_cold_main(const kt_opts *o);
int kt_first_call_child(const kt_opts *o);
/* bench_serve.c: --serve MODE */
int kt_serve_main(const kt_opts *o);

#endif /* KILN_BENCH_H */
