/* pkg_cuda.c - the CUDA half of packages: at export, the plan's source and
 * the fixed kernels its attention and product steps may launch compiled
 * with NVRTC for one architecture (cubin + PTX; no GPU needed); at load, the image the GPU
 * runs given to the driver (no NVRTC), fixed modules handed to the device,
 * the exporting GPU's launch choices kept for the first call, CUDA graphs on.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/cuda/exec_cuda.h"
#include "runtime/package_cuda.h"

void kl__pkg_cuda_images_free(kl_pkg_cuda *sec)
{
	for (int i = 0; i < sec->nmods; i++) {
		free((void *)sec->mods[i].cubin);
		free((void *)sec->mods[i].ptx);
	}
	sec->nmods = 0;
}

/* compile src into module slot sec->nmods (cubin + PTX) */
static kl_status add_module(kl_ctx *ctx, const char *fn, kl_pkg_cuda *sec, const char *src,
                            const char *name, int role, bool arch_specific)
{
	if (sec->nmods >= KL_PKG_CUDA_MODS)
		return kl__err(ctx, KL_EUNSUPPORTED, "%s: more than %d CUDA modules", fn,
		               KL_PKG_CUDA_MODS);
	kl_nvrtc_opts o = {.arch = sec->arch, .arch_specific = arch_specific, .want_ptx = true};
	/* the plan's kernels round like the C target and the reference (as
	 * kl__cuda_rt_build compiles them) */
	o.no_fmad = role == KL_PKG_MOD_PLAN;
	kl_cuda_image im;
	kl_status st = kl__nvrtc_compile(ctx, src, name, &o, &im);
	if (st == KL_OK && (im.ptx || im.arch != sec->arch)) {
		st = kl__err(ctx, KL_EUNSUPPORTED,
		             "%s: this NVRTC builds no sm_%d cubin (it offered %s_%d)", fn, sec->arch,
		             im.ptx ? "compute" : "sm", im.arch);
	}
	if (st != KL_OK) {
		kl__cuda_image_free(&im);
		return st;
	}
	kl_pkg_cumod *m = &sec->mods[sec->nmods++];
	m->role = role;
	m->arch_specific = arch_specific;
	m->src_key = role == KL_PKG_MOD_FIXED ? kl__cuda_module_src_key(src) : 0;
	m->cubin = im.data;
	m->cubin_len = im.size;
	/* an sm_NNa cubin's PTX runs on no other GPU: not kept */
	m->ptx = arch_specific ? NULL : im.ptx_text;
	m->ptx_len = arch_specific ? 0 : im.ptx_size;
	if (arch_specific)
		free(im.ptx_text);
	free(im.log);
	return KL_OK;
}

kl_status kl__pkg_cuda_build(kl_ctx *ctx, const char *fn, const kl_program *prog, int arch,
                             kl_pkg_cuda *sec)
{
	memset(sec, 0, sizeof *sec);
	sec->arch = arch;
	kl_status st = KL_OK;
	if (prog->nkernels > 0)
		st = add_module(ctx, fn, sec, prog->source, "kiln_graph.cu", KL_PKG_MOD_PLAN, false);
	/* fused attention: every variant a step of this dtype and head dim may
	 * pick on a GPU of this architecture (the choice is made at launch) */
	for (int32_t s = 0; st == KL_OK && s < prog->nsteps; s++) {
		const kl_step *sp = &prog->steps[s];
		if (sp->kind != KL_STEP_ATTENTION)
			continue;
		kl_dtype dt = prog->bufs[sp->at.q].dtype;
		int hd = sp->at.d == sp->at.dv && (sp->at.d == 64 || sp->at.d == 128) ? (int)sp->at.d : 0;
		bool half = dt == KL_F16 || dt == KL_BF16;
		int vars[5][2] = {{0, 0}, {hd, 0}, {hd, 1}, {hd, 2}, {hd, 3}};
		int nv = half && hd ? (arch == 90 ? 5 : 2) : 1;
		for (int v = 0; st == KL_OK && v < nv; v++) {
			char *src = kl__cuda_attention_source(dt, vars[v][0], vars[v][1]);
			if (!src) {
				st = kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
				break;
			}
			uint64_t key = kl__cuda_module_src_key(src);
			bool have = false;
			for (int i = 0; i < sec->nmods; i++)
				have |= sec->mods[i].role == KL_PKG_MOD_FIXED && sec->mods[i].src_key == key;
			if (!have)
				st = add_module(ctx, fn, sec, src, "kiln_attention.cu", KL_PKG_MOD_FIXED,
				                vars[v][1] != 0);
			free(src);
		}
	}
	/* products of f16/bf16: the few-row kernel (gemv_cuda.c) a call with a
	 * batch of 1-4 rows launches */
	for (int di = 0; st == KL_OK && di < 2; di++) {
		kl_dtype dt = di ? KL_BF16 : KL_F16;
		bool used = false;
		for (int32_t s = 0; s < prog->nsteps && !used; s++)
			used = prog->steps[s].kind == KL_STEP_MATMUL &&
			       prog->bufs[prog->steps[s].mm.a].dtype == dt;
		if (!used)
			continue;
		char *src = kl__cuda_gemv_source(dt);
		if (!src)
			st = kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		else
			st = add_module(ctx, fn, sec, src, "kiln_gemv.cu", KL_PKG_MOD_FIXED, false);
		free(src);
	}
	/* cache writes: their kernel and the value check's (cache_write_cuda.c) */
	bool cw = false;
	for (int32_t s = 0; s < prog->nsteps && !cw; s++)
		cw = prog->steps[s].kind == KL_STEP_CACHE_WRITE;
	if (st == KL_OK && cw) {
		char *src = kl__cuda_cache_write_source();
		if (!src)
			st = kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		else
			st = add_module(ctx, fn, sec, src, "kiln_cache_write.cu", KL_PKG_MOD_FIXED,
			                false);
		free(src);
	}
	if (st != KL_OK)
		kl__pkg_cuda_images_free(sec);
	return st;
}

kl_status kl__pkg_cuda_load(kl_ctx *ctx, const char *fn, kl_compiled *c, const kl_pkg_cuda *sec)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	int dev_arch = d->cc_major * 10 + d->cc_minor;
	bool use_ptx = false;
	char why[256];
	if (kl__pkg_cuda_pick(sec, dev_arch, &use_ptx, why, sizeof why) != KL_OK)
		return kl__err(ctx, KL_EUNSUPPORTED, "%s: %s", fn, why);
	kl_cuda_image im;
	memset(&im, 0, sizeof im);
	kl_status st = KL_OK;
	for (int i = 0; st == KL_OK && i < sec->nmods; i++) {
		const kl_pkg_cumod *m = &sec->mods[i];
		if (m->role != KL_PKG_MOD_FIXED)
			continue;
		if (m->arch_specific && dev_arch != sec->arch)
			continue; /* runs on its own architecture only */
		if (use_ptx && !m->ptx_len)
			continue;
		kl_cuda_image fi = {.data = (void *)(use_ptx ? (const void *)m->ptx : m->cubin),
		                    .size = use_ptx ? m->ptx_len : m->cubin_len,
		                    .ptx = use_ptx,
		                    .arch = sec->arch};
		st = kl__cuda_pkgmod_add(ctx, d, m->src_key, m->arch_specific, &fi);
	}
	for (int i = 0; st == KL_OK && i < sec->nmods; i++) {
		const kl_pkg_cumod *m = &sec->mods[i];
		if (m->role != KL_PKG_MOD_PLAN)
			continue;
		size_t n = use_ptx ? m->ptx_len : m->cubin_len;
		/* a private copy: NUL-terminated for PTX, aligned for the cubin */
		if (!(im.data = calloc(1, n + 1)))
			st = kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		else {
			memcpy(im.data, use_ptx ? (const void *)m->ptx : m->cubin, n);
			im.size = n;
			im.ptx = use_ptx;
			im.arch = sec->arch;
		}
	}
	if (st == KL_OK) {
		st = kl__cuda_rt_from_image(ctx, c, &im);
		if (st != KL_OK) {
			char msg[KL_ERR_CAP];
			snprintf(msg, sizeof msg, "%s", kl_last_error(ctx));
			st = kl__err(ctx, st, "%s: the kernels section's %s does not load: %s", fn,
			             use_ptx ? "PTX" : "cubin", msg);
		}
	}
	kl__cuda_image_free(&im);
	if (st != KL_OK)
		return st;
	kl_cuda_rt *rt = c->dev;
	if (sec->choices_len) {
		if (!(rt->pkg_choices = malloc(sec->choices_len)))
			return kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		memcpy(rt->pkg_choices, sec->choices, sec->choices_len);
		rt->pkg_choices_len = sec->choices_len;
	}
	kl__cuda_rt_prepare(ctx, c);
	kl__log(ctx, KL_LOG_STARTUP, "%s: sm_%d %s on sm_%d, %d modules, %zu bytes of choices", fn,
	        sec->arch, use_ptx ? "PTX" : "cubin", dev_arch, sec->nmods, sec->choices_len);
	return KL_OK;
}

kl_status kl__pkg_cuda_choices(kl_ctx *ctx, const kl_compiled *c, uint8_t **out, size_t *len)
{
	*out = NULL;
	*len = 0;
	const kl_cuda_rt *rt = c->dev;
	if (!c->cuda || !rt || !rt->tuned || c->prog.nsteps == 0)
		return KL_OK;
	kl_tune_step *steps = calloc((size_t)c->prog.nsteps, sizeof *steps);
	if (!steps)
		return kl__err(ctx, KL_ENOMEM, "kl_exported_package: out of memory");
	for (int32_t s = 0; s < c->prog.nsteps; s++) {
		steps[s].gcap = rt->gcap[s];
		steps[s].has_algo = rt->has_algo[s];
		if (rt->has_algo[s])
			steps[s].algo = rt->algo[s];
	}
	kl_status st = kl__tune_encode(&c->prog, kl__tune_device_id(ctx, rt->dev), steps, out, len);
	free(steps);
	return st == KL_OK ? st : kl__err(ctx, st, "kl_exported_package: out of memory");
}
