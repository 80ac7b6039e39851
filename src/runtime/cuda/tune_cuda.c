/* tune_cuda.c - max-autotune: on a variant's first call, time each step's
 * candidates on the call's own shapes and buffers (cuBLASLt's algorithms for
 * products, grid caps for generated kernels), keep the fastest, and store the
 * choices in the disk cache keyed by the variant and the device, so that the
 * next process reads them back instead of tuning again.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime/cuda/exec_cuda.h"

/* ---- the cache entry --------------------------------------------------------------- */

/* Little-endian host (as everywhere in kiln). Header: magic, version,
 * nsteps, device id; then one fixed-size record per step. */
#define TUNE_MAGIC "KLTUNE\0\0"
#define TUNE_VERSION 1u
#define TUNE_HEAD 24u
#define TUNE_ALGO_BYTES ((size_t)sizeof(cublasLtMatmulAlgo_t))
#define TUNE_REC (40u + TUNE_ALGO_BYTES)
/* a grid cap beyond any grid a kernel here launches */
#define TUNE_MAX_CAP (1u << 24)
#define TUNE_MAX_WORKSPACE ((uint64_t)1 << 32)

enum { REC_KERNEL = 1, REC_MATMUL = 2 };

static void put32(uint8_t *p, uint32_t v)
{
	memcpy(p, &v, 4);
}

static uint32_t get32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return v;
}

kl_status kl__tune_encode(const kl_program *p, uint64_t devid, const kl_tune_step *steps,
                          uint8_t **out, size_t *len)
{
	size_t n = TUNE_HEAD + (size_t)p->nsteps * TUNE_REC;
	uint8_t *b = calloc(1, n);
	*out = NULL;
	*len = 0;
	if (!b)
		return KL_ENOMEM;
	memcpy(b, TUNE_MAGIC, 8);
	put32(b + 8, TUNE_VERSION);
	put32(b + 12, (uint32_t)p->nsteps);
	memcpy(b + 16, &devid, 8);
	for (int32_t s = 0; s < p->nsteps; s++) {
		uint8_t *r = b + TUNE_HEAD + (size_t)s * TUNE_REC;
		const kl_tune_step *t = &steps[s];
		uint64_t ws = t->algo.workspace;
		put32(r, p->steps[s].kind == KL_STEP_MATMUL ? REC_MATMUL : REC_KERNEL);
		put32(r + 4, t->gcap);
		memcpy(r + 8, &t->ms, 4);
		put32(r + 12, t->has_algo ? 1u : 0u);
		memcpy(r + 16, &ws, 8);
		for (int j = 0; j < 4; j++)
			put32(r + 24 + 4 * j, t->has_algo ? t->algo.align[j] : 0);
		if (t->has_algo)
			memcpy(r + 40, &t->algo.algo, TUNE_ALGO_BYTES);
	}
	*out = b;
	*len = n;
	return KL_OK;
}

static bool pow2_le256(uint32_t v)
{
	return v >= 1 && v <= 256 && (v & (v - 1)) == 0;
}

kl_status kl__tune_decode(const kl_program *p, uint64_t devid, const void *data, size_t len,
                          kl_tune_step *steps, char *why, size_t cap)
{
	const uint8_t *b = data;
	why[0] = 0;
	uint64_t id = 0;
	if (len < TUNE_HEAD || memcmp(b, TUNE_MAGIC, 8) != 0) {
		snprintf(why, cap, "not a tuning entry (%zu bytes, bad magic)", len);
		return KL_EFORMAT;
	}
	if (get32(b + 8) != TUNE_VERSION) {
		snprintf(why, cap, "format version %u, this kiln writes %u", get32(b + 8),
		         TUNE_VERSION);
		return KL_EFORMAT;
	}
	if (get32(b + 12) != (uint32_t)p->nsteps) {
		snprintf(why, cap, "%u steps, the variant has %d", get32(b + 12), (int)p->nsteps);
		return KL_EFORMAT;
	}
	memcpy(&id, b + 16, 8);
	if (id != devid) {
		snprintf(why, cap, "tuned on another device (id %016llx, this one %016llx)",
		         (unsigned long long)id, (unsigned long long)devid);
		return KL_EFORMAT;
	}
	if (len != TUNE_HEAD + (size_t)p->nsteps * TUNE_REC) {
		snprintf(why, cap, "%zu bytes for %d steps, want %zu", len, (int)p->nsteps,
		         TUNE_HEAD + (size_t)p->nsteps * TUNE_REC);
		return KL_EFORMAT;
	}
	for (int32_t s = 0; s < p->nsteps; s++) {
		const uint8_t *r = b + TUNE_HEAD + (size_t)s * TUNE_REC;
		kl_tune_step *t = &steps[s];
		bool mm = p->steps[s].kind == KL_STEP_MATMUL;
		uint32_t kind = get32(r), has = get32(r + 12);
		uint64_t ws;
		memset(t, 0, sizeof *t);
		t->gcap = get32(r + 4);
		memcpy(&t->ms, r + 8, 4);
		memcpy(&ws, r + 16, 8);
		if (kind != (mm ? REC_MATMUL : REC_KERNEL)) {
			snprintf(why, cap, "step %d is a %s, the entry has kind %u", (int)s,
			         mm ? "matmul" : "kernel", kind);
			return KL_EFORMAT;
		}
		if (!isfinite(t->ms) || t->ms < 0) {
			snprintf(why, cap, "step %d: time %g ms", (int)s, (double)t->ms);
			return KL_EFORMAT;
		}
		if (has > 1 || (has && !mm)) {
			snprintf(why, cap, "step %d: algorithm flag %u on a %s", (int)s, has,
			         mm ? "matmul" : "kernel");
			return KL_EFORMAT;
		}
		if ((mm && t->gcap != 0) || t->gcap > TUNE_MAX_CAP) {
			snprintf(why, cap, "step %d: grid cap %u on a %s", (int)s, t->gcap,
			         mm ? "matmul" : "kernel");
			return KL_EFORMAT;
		}
		if (!has) {
			if (ws != 0) {
				snprintf(why, cap, "step %d: workspace %llu without an algorithm",
				         (int)s, (unsigned long long)ws);
				return KL_EFORMAT;
			}
			continue;
		}
		if (ws > TUNE_MAX_WORKSPACE) {
			snprintf(why, cap, "step %d: workspace %llu bytes", (int)s,
			         (unsigned long long)ws);
			return KL_EFORMAT;
		}
		t->has_algo = true;
		t->algo.workspace = (size_t)ws;
		for (int j = 0; j < 4; j++) {
			t->algo.align[j] = get32(r + 24 + 4 * j);
			if (!pow2_le256(t->algo.align[j])) {
				snprintf(why, cap, "step %d: operand alignment %u", (int)s,
				         t->algo.align[j]);
				return KL_EFORMAT;
			}
		}
		memcpy(&t->algo.algo, r + 40, TUNE_ALGO_BYTES);
	}
	return KL_OK;
}

uint64_t kl__tune_device_id(kl_ctx *ctx, const kl_cuda_dev *d)
{
	uint64_t v[6] = {(uint64_t)d->cc_major, (uint64_t)d->cc_minor, (uint64_t)d->sm_count,
	                 (uint64_t)d->total_mem, 0, 0};
	if (kl__cuda_load_cublaslt(ctx) == KL_OK)
		v[4] = (uint64_t)kl__lt.version;
	else
		kl_clear_error(ctx);
	v[5] = (uint64_t)kl__cu.version;
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, d->name, strnlen(d->name, sizeof d->name));
	return kl__hash_bytes(h, v, sizeof v);
}

void kl__tune_entry(uint64_t key, uint64_t devid, char *name, size_t cap, uint64_t *ekey)
{
	uint64_t k[2] = {key, devid};
	*ekey = kl__hash_bytes(KL_HASH_SEED, k, sizeof k);
	snprintf(name, cap, "tune-%016llx-%016llx.klt", (unsigned long long)key,
	         (unsigned long long)devid);
}

/* ---- timing ------------------------------------------------------------------------ */

typedef struct tuner {
	kl_ctx *ctx;
	kl_compiled *c;
	void *const *B;
	const int64_t *syms;
	CUevent e0, e1;
	bool tty;
} tuner;

/* Milliseconds per run of step s with the choices now in the runtime: one
 * run, then about two milliseconds of them (3 to 100) between events e0 and
 * e1. Plain launches, whatever graph the variant holds. */
static kl_status time_one(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                          int32_t s, CUevent e0, CUevent e1, float *ms)
{
	kl_cuda_rt *rt = c->dev;
	kl_status st = kl__cuda_rt_launch(ctx, c, B, syms, s, s + 1);
	if (st == KL_OK)
		st = kl__cuda_event_record(ctx, rt->dev, e0);
	if (st == KL_OK)
		st = kl__cuda_rt_launch(ctx, c, B, syms, s, s + 1);
	if (st == KL_OK)
		st = kl__cuda_event_record(ctx, rt->dev, e1);
	float one = 0;
	if (st == KL_OK)
		st = kl__cuda_event_ms(ctx, e0, e1, &one);
	if (st != KL_OK)
		return st;
	int reps = one > 0 ? (int)(2.0f / one) : 100;
	reps = reps < 3 ? 3 : reps > 100 ? 100 : reps;
	if ((st = kl__cuda_event_record(ctx, rt->dev, e0)) != KL_OK)
		return st;
	for (int i = 0; i < reps && st == KL_OK; i++)
		st = kl__cuda_rt_launch(ctx, c, B, syms, s, s + 1);
	if (st == KL_OK && (st = kl__cuda_event_record(ctx, rt->dev, e1)) == KL_OK &&
	    (st = kl__cuda_event_ms(ctx, e0, e1, ms)) == KL_OK)
		*ms /= (float)reps;
	return st;
}

static kl_status time_step(tuner *t, int32_t s, float *ms)
{
	return time_one(t->ctx, t->c, t->B, t->syms, s, t->e0, t->e1, ms);
}

kl_status kl__cuda_rt_time_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                 const int64_t *syms, double *us)
{
	kl_cuda_rt *rt = c->dev;
	CUevent e0 = NULL, e1 = NULL;
	kl_status st = kl__cuda_bind(ctx, rt->dev);
	if (st == KL_OK)
		st = kl__cuda_event_new(ctx, rt->dev, &e0);
	if (st == KL_OK)
		st = kl__cuda_event_new(ctx, rt->dev, &e1);
	for (int32_t s = 0; s < c->prog.nsteps && st == KL_OK; s++) {
		float ms = 0;
		/* the steps before it again, untimed: its inputs as the call made
		 * them, where a later step reused their memory (exec.c,
		 * profile_steps) */
		if (s > 0)
			st = kl__cuda_rt_launch(ctx, c, B, syms, 0, s);
		if (st == KL_OK)
			st = time_one(ctx, c, B, syms, s, e0, e1, &ms);
		us[s] = (double)ms * 1e3;
	}
	kl__cuda_event_free(rt->dev, e0);
	kl__cuda_event_free(rt->dev, e1);
	return st;
}

static void progress(const tuner *t, int32_t s, const char *what, int n)
{
	if (!t->tty)
		return;
	fprintf(stderr, "\rkiln: max-autotune: step %d/%d (%s): %d candidates\033[K", (int)s + 1,
	        (int)t->c->prog.nsteps, what, n);
	fflush(stderr);
}

/* Before a log line: the progress line goes, so the two do not mix. */
static void clear_line(const tuner *t)
{
	if (t->tty && (t->ctx->logs & KL_LOG_AUTOTUNE)) {
		fprintf(stderr, "\r\033[K");
		fflush(stderr);
	}
}

/* A candidate replaces the default only when clearly faster. */
static bool beats(float ms, float best, bool best_is_default)
{
	return best_is_default ? ms < best * 0.97f : ms < best;
}

static kl_status tune_kernel(tuner *t, int32_t s, kl_tune_step *out)
{
	kl_cuda_rt *rt = t->c->dev;
	const kl_step *sp = &t->c->prog.steps[s];
	static const uint32_t per_sm[] = {0, 1, 2, 4, 8, 16};
	const int n = (int)(sizeof per_sm / sizeof per_sm[0]);
	uint32_t sms = (uint32_t)(rt->dev->sm_count > 0 ? rt->dev->sm_count : 1);
	char what[96];
	snprintf(what, sizeof what, "%s %s", sp->what, t->c->prog.kernel_names[sp->kernel]);
	progress(t, s, what, n);
	float best = 0, base = 0;
	uint32_t pick = 0;
	for (int i = 0; i < n; i++) {
		uint32_t capv = per_sm[i] * sms;
		float ms = 0;
		rt->gcap[s] = capv;
		kl_status st = time_step(t, s, &ms);
		if (st != KL_OK) {
			if (i == 0)
				return st; /* the default itself fails: that is an error */
			kl__log(t->ctx, KL_LOG_AUTOTUNE, "step %d: grid cap %u fails: %s", (int)s,
			        capv, kl_last_error(t->ctx));
			kl_clear_error(t->ctx);
			continue;
		}
		if (i == 0)
			base = best = ms;
		else if (beats(ms, best, pick == 0)) {
			best = ms;
			pick = capv;
		}
	}
	rt->gcap[s] = pick;
	out->gcap = pick;
	out->ms = best;
	clear_line(t);
	if (pick)
		kl__log(t->ctx, KL_LOG_AUTOTUNE,
		        "step %d/%d (%s): grid cap %u blocks (%u per SM), %.4f ms (default grid "
		        "%.4f ms)",
		        (int)s + 1, (int)t->c->prog.nsteps, what, pick, pick / sms, (double)best,
		        (double)base);
	else
		kl__log(t->ctx, KL_LOG_AUTOTUNE,
		        "step %d/%d (%s): the default grid, %.4f ms (%d caps timed)", (int)s + 1,
		        (int)t->c->prog.nsteps, what, (double)best, n - 1);
	return KL_OK;
}

static kl_status step_gemm(tuner *t, int32_t s, kl_gemm *g, bool *lib)
{
	const kl_program *p = &t->c->prog;
	const kl_matmul_step *mm = &p->steps[s].mm;
	return kl__lt_step_gemm(t->ctx, mm, p->bufs[mm->a].dtype, p->bufs[mm->c].dtype,
	                        (CUdeviceptr)(uintptr_t)t->B[mm->a],
	                        (CUdeviceptr)(uintptr_t)t->B[mm->b],
	                        (CUdeviceptr)(uintptr_t)t->B[mm->c],
	                        mm->has_r ? (CUdeviceptr)(uintptr_t)t->B[mm->r] : 0,
	                        mm->has_bias ? (CUdeviceptr)(uintptr_t)t->B[mm->bias] : 0, g, lib);
}

#define TUNE_ALGOS 16
#define TUNE_ROUNDS 2

static kl_status tune_matmul(tuner *t, int32_t s, kl_tune_step *out)
{
	kl_cuda_rt *rt = t->c->dev;
	const kl_matmul_step *mm = &t->c->prog.steps[s].mm;
	kl_gemm g;
	bool lib = false;
	kl_status st = step_gemm(t, s, &g, &lib);
	if (st != KL_OK || !lib)
		return st;
	kl_lt_algo cand[TUNE_ALGOS];
	int n = 0;
	if ((st = kl__lt_heuristics(t->ctx, rt->dev, &g, TUNE_ALGOS, cand, &n)) != KL_OK)
		return st;
	char what[96];
	snprintf(what, sizeof what, "matmul %lldx%lldx%lld%s", (long long)mm->m, (long long)mm->n,
	         (long long)mm->k, g.batch > 1 ? " batched" : "");
	progress(t, s, what, n);
	/* TUNE_ROUNDS rounds over the heuristic's choice (ms[0]) and the
	 * candidates (ms[1 + i]; -1 where one fails), each keeping its best: a
	 * product of a few hundred microseconds times in a few runs, and the
	 * clocks move between one candidate's runs and the next's */
	float ms[TUNE_ALGOS + 1];
	for (int r = 0; r < TUNE_ROUNDS; r++)
		for (int i = -1; i < n; i++) {
			if (r > 0 && ms[i + 1] < 0)
				continue;
			float one = 0;
			rt->has_algo[s] = i >= 0;
			if (i >= 0)
				rt->algo[s] = cand[i];
			if ((st = time_step(t, s, &one)) != KL_OK) {
				if (i < 0)
					return st; /* the heuristic's own choice fails: an error */
				kl__log(t->ctx, KL_LOG_AUTOTUNE, "step %d: algorithm %d of %d fails: %s",
				        (int)s, i + 1, n, kl_last_error(t->ctx));
				kl_clear_error(t->ctx);
				ms[i + 1] = -1;
				continue;
			}
			ms[i + 1] = r == 0 || one < ms[i + 1] ? one : ms[i + 1];
		}
	float base = ms[0], best = base;
	int pick = -1;
	for (int i = 0; i < n; i++)
		if (ms[i + 1] >= 0 && beats(ms[i + 1], best, pick < 0)) {
			best = ms[i + 1];
			pick = i;
		}
	rt->has_algo[s] = pick >= 0;
	if (pick >= 0)
		rt->algo[s] = cand[pick];
	out->has_algo = pick >= 0;
	if (pick >= 0)
		out->algo = cand[pick];
	out->ms = best;
	clear_line(t);
	if (pick >= 0)
		kl__log(t->ctx, KL_LOG_AUTOTUNE,
		        "step %d/%d (%s): cuBLASLt algorithm %d of %d (workspace %zu bytes), %.4f "
		        "ms (heuristic's choice %.4f ms)",
		        (int)s + 1, (int)t->c->prog.nsteps, what, pick + 1, n,
		        cand[pick].workspace, (double)best, (double)base);
	else
		kl__log(t->ctx, KL_LOG_AUTOTUNE,
		        "step %d/%d (%s): the heuristic's choice, %.4f ms (%d algorithms timed)",
		        (int)s + 1, (int)t->c->prog.nsteps, what, (double)best, n);
	return KL_OK;
}

/* Stored algorithms must run this call's products. */
static kl_status check_algos(tuner *t, const kl_tune_step *steps, char *why, size_t cap)
{
	kl_cuda_rt *rt = t->c->dev;
	for (int32_t s = 0; s < t->c->prog.nsteps; s++) {
		if (!steps[s].has_algo)
			continue;
		kl_gemm g;
		bool lib = false;
		char w[256] = "";
		kl_status st = step_gemm(t, s, &g, &lib);
		if (st != KL_OK)
			return st;
		if (!lib) {
			snprintf(why, cap, "step %d calls no library, the entry holds an algorithm",
			         (int)s);
			return KL_EFORMAT;
		}
		st = kl__lt_algo_check(t->ctx, rt->dev, &g, &steps[s].algo, w, sizeof w);
		if (st == KL_EFORMAT) {
			snprintf(why, cap, "step %d: the stored algorithm does not run: %s", (int)s,
			         w);
			return KL_EFORMAT;
		}
		if (st != KL_OK)
			return st;
	}
	return KL_OK;
}

static void apply(kl_cuda_rt *rt, const kl_program *p, const kl_tune_step *steps)
{
	for (int32_t s = 0; s < p->nsteps; s++) {
		rt->gcap[s] = steps[s].gcap;
		rt->has_algo[s] = steps[s].has_algo;
		if (steps[s].has_algo)
			rt->algo[s] = steps[s].algo;
	}
}

/* Read the choices back: KL_OK when applied; KL_EIO when there is no
 * entry; KL_EFORMAT when there is one we cannot use (logged, counted). */
static kl_status fetch(tuner *t, const char *dir, const char *name, uint64_t ekey, uint64_t devid,
                       kl_tune_step *steps)
{
	kl_compiled *c = t->c;
	void *payload = NULL;
	size_t len = 0;
	kl_status st = kl__cache_get(t->ctx, dir, name, ekey, &payload, &len);
	if (st == KL_EIO)
		return st;
	char why[KL_ERR_CAP] = "damaged (the cache log, KILN_LOGS=cache, says how)";
	if (st == KL_OK) {
		st = kl__tune_decode(&c->prog, devid, payload, len, steps, why, sizeof why);
		if (st == KL_OK)
			st = check_algos(t, steps, why, sizeof why);
	}
	free(payload);
	if (st == KL_OK) {
		apply(c->dev, &c->prog, steps);
		kl__cuda_count_tune(1);
		kl__log(t->ctx, KL_LOG_AUTOTUNE, "read the choices of %d steps from %s",
		        (int)c->prog.nsteps, name);
		return KL_OK;
	}
	if (st != KL_EFORMAT)
		return st;
	kl__cuda_count_tune(2);
	kl__log(t->ctx, KL_LOG_AUTOTUNE, "entry %s rejected (%s): tuning again", name, why);
	return KL_EFORMAT;
}

kl_status kl__cuda_tune(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms)
{
	kl_cuda_rt *rt = c->dev;
	const kl_program *p = &c->prog;
	if (p->nsteps == 0)
		return KL_OK;
	if (c->dynamic) {
		kl__log(ctx, KL_LOG_AUTOTUNE,
		        "skip: the variant has dynamic dims (its sizes change per call): default "
		        "launch choices");
		return KL_OK;
	}
	kl_tune_step *steps = calloc((size_t)p->nsteps, sizeof *steps);
	if (!steps)
		return kl__err(ctx, KL_ENOMEM, "max-autotune: out of memory");
	uint64_t devid = kl__tune_device_id(ctx, rt->dev), ekey = 0;
	char name[96], dir[PATH_MAX];
	kl__tune_entry(c->key, devid, name, sizeof name, &ekey);
	bool have_dir = kl__cache_dir(ctx, dir, sizeof dir);
	tuner t = {.ctx = ctx, .c = c, .B = B, .syms = syms, .tty = isatty(STDERR_FILENO) == 1};
	if (rt->pkg_choices) {
		/* a package's: used when they suit, else the default choices (a
		 * loaded package never times candidates) */
		char why[KL_ERR_CAP] = "";
		kl_status pst = kl__tune_decode(p, devid, rt->pkg_choices, rt->pkg_choices_len, steps,
		                                why, sizeof why);
		if (pst == KL_OK)
			pst = check_algos(&t, steps, why, sizeof why);
		if (pst == KL_OK) {
			apply(rt, p, steps);
			kl__cuda_count_tune(1);
		} else {
			kl__cuda_count_tune(2);
		}
		kl__log(ctx, KL_LOG_AUTOTUNE, "the package's choices of %d steps %s%s%s",
		        (int)p->nsteps, pst == KL_OK ? "applied" : "not used (", why,
		        pst == KL_OK ? "" : "): default choices");
		free(steps);
		return pst == KL_OK || pst == KL_EFORMAT ? KL_OK : pst;
	}
	kl_status st = have_dir ? fetch(&t, dir, name, ekey, devid, steps) : KL_EIO;
	if (st == KL_OK || (st != KL_EIO && st != KL_EFORMAT)) {
		free(steps);
		return st;
	}
	memset(steps, 0, sizeof *steps * (size_t)p->nsteps);
	st = kl__cuda_event_new(ctx, rt->dev, &t.e0);
	if (st == KL_OK)
		st = kl__cuda_event_new(ctx, rt->dev, &t.e1);
	for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++)
		/* attention steps launch their own kernels: nothing to choose */
		st = p->steps[s].kind == KL_STEP_MATMUL   ? tune_matmul(&t, s, &steps[s])
		     : p->steps[s].kind == KL_STEP_KERNEL ? tune_kernel(&t, s, &steps[s])
		                                          : KL_OK;
	if (t.tty) {
		fprintf(stderr, "\r\033[K");
		fflush(stderr);
	}
	kl__cuda_event_free(rt->dev, t.e0);
	kl__cuda_event_free(rt->dev, t.e1);
	if (st == KL_OK) {
		kl__cuda_count_tune(0);
		uint8_t *bytes = NULL;
		size_t len = 0;
		if (have_dir && kl__tune_encode(p, devid, steps, &bytes, &len) == KL_OK &&
		    kl__cache_put(ctx, dir, name, ekey, bytes, len) == KL_OK)
			kl__log(ctx, KL_LOG_AUTOTUNE, "stored the choices of %d steps in %s",
			        (int)p->nsteps, name);
		free(bytes);
	}
	free(steps);
	return st;
}
