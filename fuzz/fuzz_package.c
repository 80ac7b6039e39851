/* fuzz_package.c - libFuzzer target: an AOT package through the loader
 * (kl_package_load_buffer: header, format version, target, section
 * checksums, manifest, plan, manifest against plan, weights), then, when
 * accepted, kl_package_inspect and one run on zeros of the manifest's
 * traced input shapes; and every input through kl_package_describe (which
 * checks any target's sections, a CUDA package's kernels section included:
 * its modules, cubin headers, PTX text and launch choices).
 *
 * Mutations would almost all die at the checksums, so an input that looks
 * like a package (magic and a section table in range) is resealed first:
 * the manifest, plan and weights sections' checksums and the header's are
 * recomputed, and mutations reach the parsers behind them. The kernels'
 * checksum is left as the input has it: a package carries native code,
 * trusted like a shared library, and the fuzzer must not load mutated code.
 * A CUDA package's kernels are resealed too: this CPU process never hands
 * them to a driver (a CPU context refuses CUDA packages once every section
 * is checked). Seeds: packages of library steps only (products, attention),
 * exported by the target itself (no compiler needed), CUDA packages of the
 * same where NVRTC can be opened, plus the committed corpus (one with
 * generated kernels, CUDA ones with cubins and PTX). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "graph/graph.h"
#include "runtime/package.h"

static kl_ctx *ctx;
static FILE *devnull;

typedef struct mlp {
	kl_tensor *w1, *w2;
} mlp;

static kl_status mlp_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	const mlp *m = user;
	out[0] = kl_matmul(kl_relu(kl_matmul(in[0], m->w1)), m->w2);
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_status attn_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_sdpa(in[0], in[1], in[2], true, 0);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void seed(const char *dir, const char *name, kl_exported *e)
{
	if (!e)
		kf_die("kl_export: %s", kl_last_error(ctx));
	char path[4200];
	snprintf(path, sizeof path, "%s/%s", kf_scratch(), name);
	if (kl_exported_package(e, path) != KL_OK)
		kf_die("kl_exported_package: %s", kl_last_error(ctx));
	kl_exported_free(e);
	FILE *f = fopen(path, "rb");
	static char buf[1 << 20];
	size_t len = f ? fread(buf, 1, sizeof buf, f) : 0;
	if (f)
		fclose(f);
	remove(path);
	if (!len)
		kf_die("cannot read back %s", path);
	kf_write_seed(dir, name, buf, len);
}

static void write_seeds(const char *dir)
{
	kl_scope_begin(ctx);
	mlp m = {kl_randn(ctx, KL_F32, 2, (int64_t[]){8, 16}, 1),
	         kl_randn(ctx, KL_F32, 2, (int64_t[]){16, 4}, 2)};
	kl_tensor *x = kl_randn(ctx, KL_F32, 2, (int64_t[]){3, 8}, 3);
	kl_tensor *ps[2] = {m.w1, m.w2};
	const char *pn[2] = {"fc1.weight", "fc2.weight"};
	kl_export_opts o = {.nparams = 2, .params = ps, .param_names = pn};
	seed(dir, "seed-mlp.klp", kl_export(ctx, mlp_body, &m, 1, 1, &x, &o));
	kl_dim_spec ds = {0, 0, "batch", 1, 9};
	o.ndims = 1;
	o.dims = &ds;
	seed(dir, "seed-mlp-dyn.klp", kl_export(ctx, mlp_body, &m, 1, 1, &x, &o));
	kl_tensor *q[3];
	for (int i = 0; i < 3; i++)
		q[i] = kl_randn(ctx, KL_F32, 3, (int64_t[]){2, 5, 4}, 10 + (uint64_t)i);
	kl_dim_spec dq[3] = {{0, 1, "t", 2, 16}, {1, 1, "t", 2, 16}, {2, 1, "t", 2, 16}};
	kl_export_opts oq = {.ndims = 3, .dims = dq};
	seed(dir, "seed-attention.klp", kl_export(ctx, attn_body, NULL, 3, 1, q, &oq));
	/* CUDA packages (NVRTC, no GPU): where it cannot be opened, the
	 * committed ones serve */
	oq.cuda_arch = 90;
	kl_exported *ec = kl_export(ctx, attn_body, NULL, 3, 1, q, &oq);
	if (ec)
		seed(dir, "seed-attention-cuda.klp", ec);
	kl_clear_error(ctx);
	o.cuda_arch = 90;
	ec = kl_export(ctx, mlp_body, &m, 1, 1, &x, &o);
	if (ec)
		seed(dir, "seed-mlp-cuda.klp", ec);
	kl_clear_error(ctx);
	kl_scope_end(ctx);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argv;
	ctx = kf_ctx();
	/* A package's kernels built by gcc (-fopenmp) need libgomp; in this
	 * clang process (libomp) each load would map it and each unload unmap
	 * it, leaving its one-time start-up allocation behind as a leak. Kept
	 * loaded here, it starts once, as in a process built by gcc. */
	(void)dlopen("libgomp.so.1", RTLD_NOW | RTLD_GLOBAL);
	devnull = fopen("/dev/null", "w");
	if (!devnull)
		kf_die("cannot open /dev/null");
	const char *dir = kf_seed_dir();
	if (dir) {
		write_seeds(dir);
		kf_seeds_done(*argc);
	}
	return 0;
}

static uint64_t rd64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;
}

static void reseal(uint8_t *b, size_t len)
{
	if (len < 192 || memcmp(b, "KILNPKG", 8) != 0)
		return;
	for (int s = 0; s < 4; s++) {
		uint8_t *e = b + 64 + 32 * s;
		uint64_t off = rd64(e + 8), n = rd64(e + 16);
		if ((s == 2 && memcmp(b + 32, "cuda-", 5) != 0) || off > len || n > len - off)
			continue;
		uint64_t sum = kl__pkg_sum(b + off, n);
		memcpy(e + 24, &sum, 8);
	}
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, b, 56);
	h = kl__hash_bytes(h, b + 64, 128);
	memcpy(b + 56, &h, 8);
}

/* The multiply-adds of c's library steps at their traced sizes, saturating:
 * a plan may ask for any work too (zero batch strides make a huge product
 * over a small buffer), which the fuzzer skips rather than times out on. */
static double plan_work(const kl_compiled *c)
{
	double w = 0;
	for (int32_t s = 0; s < c->prog.nsteps; s++) {
		const kl_step *sp = &c->prog.steps[s];
		double b = 1;
		if (sp->kind == KL_STEP_MATMUL) {
			for (int i = 0; i < sp->mm.nbatch; i++)
				b *= (double)sp->mm.batch[i];
			w += b * (double)sp->mm.m * (double)sp->mm.n * ((double)sp->mm.k + 1);
		} else if (sp->kind == KL_STEP_ATTENTION) {
			for (int i = 0; i < sp->at.nbatch; i++)
				b *= (double)sp->at.batch[i];
			w += b * (double)sp->at.tq * ((double)sp->at.tk + 1) *
			     ((double)sp->at.d + (double)sp->at.dv + 1);
		} else if (sp->kind == KL_STEP_CACHE_WRITE)
			w += (double)sp->cw.rows * (double)sp->cw.outer * (double)sp->cw.s *
			     (double)sp->cw.inner;
	}
	return w;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint8_t *b = malloc(size ? size : 1);
	if (!b)
		return 0;
	memcpy(b, data, size);
	reseal(b, size);
	if (kl_package_describe(ctx, b, size, devnull) != KL_OK)
		kf_check_failure(ctx, "kl_package_describe");
	kl_package *p = kl_package_load_buffer(ctx, b, size);
	free(b); /* the package keeps nothing of the buffer */
	if (!p) {
		kf_check_failure(ctx, "kl_package_load_buffer");
		return 0;
	}
	kl_package_inspect(p, devnull);
	const kl_pkg_manifest *m = kl__package_manifest(p);
	const kl_compiled *c = kl__package_compiled(p);
	kl_scope_begin(ctx);
	kl_tensor *in[64] = {0}, *out[64] = {0};
	/* a plan may ask for any memory or work (a package is trusted like a
	 * shared library): runs needing more than 64 MiB or 1e8 multiply-adds
	 * are skipped, not fuzzed into libFuzzer's limits (kiln answers
	 * KL_ENOMEM when it gets no memory) */
	bool ok = m->nin <= 64 && m->nout <= 64 &&
	          c->plan.arena_bytes + c->plan.out_bytes < ((size_t)64 << 20) &&
	          plan_work(c) < 1e8;
	for (int i = 0; ok && i < m->nin; i++) {
		const kl_pkg_tensor *t = &m->in[i];
		uint64_t n = 1;
		for (int d = 0; d < t->ndim; d++)
			n *= (uint64_t)t->shape[d] + 1;
		ok = n < (1u << 20) && (in[i] = kl_zeros(ctx, t->dtype, t->ndim, t->shape));
	}
	if (ok && kl_package_run(p, in, out) != KL_OK)
		kf_check_failure(ctx, "kl_package_run");
	for (int k = 0; ok && k < m->nout; k++)
		kl_release(out[k]);
	kl_scope_end(ctx);
	kl_clear_error(ctx);
	kl_package_free(p);
	return 0;
}
