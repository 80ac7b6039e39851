/* nvrtc.c - CUDA C source to a device image with NVRTC (in process, no GPU
 * needed), then to a loaded module and kernel launches through the driver.
 * One module per graph: a graph's kernels are one translation unit.
 */
#include "backend/cuda/device.h"

#include <stdio.h>
#include <stdlib.h>

void kl__cuda_image_free(kl_cuda_image *im)
{
	if (!im)
		return;
	free(im->data);
	free(im->log);
	free(im->ptx_text);
	memset(im, 0, sizeof *im);
}

kl_nvrtc_opts kl__nvrtc_opts_for(const kl_cuda_dev *d)
{
	return (kl_nvrtc_opts){.arch = d->cc_major * 10 + d->cc_minor};
}

static bool arch_listed(int arch)
{
	for (int i = 0; i < kl__nvrtc.narchs; i++)
		if (kl__nvrtc.archs[i] == arch)
			return true;
	return false;
}

/* The target for a device of architecture `arch`: the newest cubin target of
 * the same major version not above it (SASS runs on later minors of its
 * major), or, for a device newer than this NVRTC, PTX of its newest virtual
 * architecture for the driver to finish. */
static kl_status pick_target(kl_ctx *ctx, int arch, int *target, bool *ptx)
{
	int best = -1, newest = -1;
	for (int i = 0; i < kl__nvrtc.narchs; i++) {
		int a = kl__nvrtc.archs[i];
		if (a > newest)
			newest = a;
		if (a / 10 == arch / 10 && a <= arch && a > best)
			best = a;
	}
	if (best > 0) {
		*target = best;
		*ptx = false;
		return KL_OK;
	}
	if (newest > 0 && arch > newest) {
		*target = newest;
		*ptx = true;
		return KL_OK;
	}
	return kl__err(ctx, KL_EUNSUPPORTED,
	               "kl_cuda: NVRTC %d.%d cannot compile for sm_%d (it targets sm_%d..sm_%d)",
	               kl__nvrtc.major, kl__nvrtc.minor, arch,
	               kl__nvrtc.narchs ? kl__nvrtc.archs[0] : 0, newest);
}

/* The first lines of a log, for an error message. */
static void log_head(const char *log, char *out, size_t cap, int maxlines)
{
	size_t n = 0;
	int lines = 0;
	for (const char *p = log; *p && n + 1 < cap; p++) {
		if (*p == '\n' && ++lines >= maxlines)
			break;
		out[n++] = *p;
	}
	out[n] = 0;
	while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == ' '))
		out[--n] = 0;
}

#define NVRTC_TRY(ctx, call, what)                                                                \
	do {                                                                                      \
		nvrtcResult r_ = (call);                                                          \
		if (r_ != NVRTC_SUCCESS) {                                                        \
			s = kl__err(ctx, KL_ECOMPILE, "kl_cuda: nvrtc %s of %s failed: %s", what, \
			            name, kl__nvrtc.nvrtcGetErrorString(r_));                     \
			goto done;                                                                \
		}                                                                                 \
	} while (0)

kl_status kl__nvrtc_compile(kl_ctx *ctx, const char *src, const char *name,
                            const kl_nvrtc_opts *opts, kl_cuda_image *out)
{
	memset(out, 0, sizeof *out);
	kl_status s = kl__cuda_load_nvrtc(ctx);
	if (s != KL_OK)
		return s;
	if (!src || !opts)
		return kl__err(ctx, KL_EINVAL, "kl_cuda: nvrtc compile without %s",
		               src ? "options" : "source");
	if (!name)
		name = "kiln.cu";
	int target = 0;
	bool ptx = false;
	if ((s = pick_target(ctx, opts->arch, &target, &ptx)) != KL_OK)
		return s;

	char archopt[48], regopt[40];
	/* The 'a' variant runs only on its exact architecture. */
	bool specific = opts->arch_specific && !ptx && target == opts->arch && arch_listed(target);
	snprintf(archopt, sizeof archopt, "--gpu-architecture=%s_%d%s", ptx ? "compute" : "sm",
	         target, specific ? "a" : "");
	const char *argv[12];
	int argc = 0;
	argv[argc++] = archopt;
	argv[argc++] = "-default-device";
	argv[argc++] = "--std=c++17";
	if (opts->fast_math)
		argv[argc++] = "--use_fast_math";
	if (opts->lineinfo)
		argv[argc++] = "-lineinfo";
	if (opts->no_fmad)
		argv[argc++] = "--fmad=false";
	if (opts->ptxas_info)
		argv[argc++] = "--ptxas-options=-v";
	if (opts->max_regs > 0) {
		snprintf(regopt, sizeof regopt, "--maxrregcount=%d", opts->max_regs);
		argv[argc++] = regopt;
	}

	const char *hdr_src[1] = {kl__cuda_prelude};
	const char *hdr_name[1] = {KL_CUDA_PRELUDE_NAME};
	nvrtcProgram prog = NULL;
	NVRTC_TRY(ctx, kl__nvrtc.nvrtcCreateProgram(&prog, src, name, 1, hdr_src, hdr_name),
	          "create");
	nvrtcResult cr = kl__nvrtc.nvrtcCompileProgram(prog, argc, argv);

	size_t logsz = 0;
	if (kl__nvrtc.nvrtcGetProgramLogSize(prog, &logsz) == NVRTC_SUCCESS && logsz > 1) {
		out->log = malloc(logsz);
		if (out->log && kl__nvrtc.nvrtcGetProgramLog(prog, out->log) != NVRTC_SUCCESS) {
			free(out->log);
			out->log = NULL;
		}
	}
	if (cr != NVRTC_SUCCESS) {
		char head[640];
		log_head(out->log ? out->log : "(no log)", head, sizeof head, 8);
		s = kl__err(ctx, KL_ECOMPILE,
		            "kl_cuda: nvrtc compiling %s for %s_%d failed (%s):\n%s", name,
		            ptx ? "compute" : "sm", target, kl__nvrtc.nvrtcGetErrorString(cr),
		            head);
		goto done;
	}

	size_t sz = 0;
	if (ptx)
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetPTXSize(prog, &sz), "PTX size");
	else
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetCUBINSize(prog, &sz), "CUBIN size");
	out->data = malloc(sz ? sz : 1);
	if (!out->data) {
		s = kl__err(ctx, KL_ENOMEM, "kl_cuda: out of memory for a %zu-byte image", sz);
		goto done;
	}
	if (ptx)
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetPTX(prog, out->data), "PTX");
	else
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetCUBIN(prog, out->data), "CUBIN");
	out->size = sz;
	out->ptx = ptx;
	out->arch = target;
	if (opts->want_ptx && !ptx) {
		size_t pn = 0;
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetPTXSize(prog, &pn), "PTX size");
		if (!(out->ptx_text = calloc(1, pn + 1))) {
			s = kl__err(ctx, KL_ENOMEM, "kl_cuda: out of memory for %zu bytes of PTX", pn);
			goto done;
		}
		NVRTC_TRY(ctx, kl__nvrtc.nvrtcGetPTX(prog, out->ptx_text), "PTX");
		out->ptx_size = strlen(out->ptx_text);
	}
	s = KL_OK;
done:
	if (prog)
		kl__nvrtc.nvrtcDestroyProgram(&prog);
	if (s != KL_OK) {
		free(out->data);
		free(out->ptx_text);
		out->data = NULL;
		out->ptx_text = NULL;
		out->size = out->ptx_size = 0;
	}
	return s;
}

/* ---- modules ------------------------------------------------------------------------ */

kl_status kl__cuda_module_load(kl_ctx *ctx, kl_cuda_dev *d, const kl_cuda_image *im,
                               kl_cuda_module **out)
{
	*out = NULL;
	if (!im || !im->data)
		return kl__err(ctx, KL_EINVAL, "kl_cuda: loading an empty module image");
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	kl_cuda_module *m = calloc(1, sizeof *m);
	if (!m)
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory");
	if ((s = KL_CU(ctx, cuModuleLoadData, &m->mod, im->data)) != KL_OK) {
		free(m);
		return s;
	}
	m->dev = d;
	*out = m;
	return KL_OK;
}

kl_status kl__cuda_module_build(kl_ctx *ctx, kl_cuda_dev *d, const char *src, const char *name,
                                kl_cuda_module **out)
{
	*out = NULL;
	kl_nvrtc_opts o = kl__nvrtc_opts_for(d);
	kl_cuda_image im;
	kl_status s = kl__nvrtc_compile(ctx, src, name, &o, &im);
	if (s == KL_OK)
		s = kl__cuda_module_load(ctx, d, &im, out);
	kl__cuda_image_free(&im);
	return s;
}

uint8_t *kl__cuda_image_payload(const kl_cuda_image *im, size_t *len)
{
	uint8_t *payload = malloc(im->size + 1);
	*len = payload ? im->size + 1 : 0;
	if (payload) {
		payload[0] = im->ptx ? 1 : 0;
		memcpy(payload + 1, im->data, im->size);
	}
	return payload;
}

bool kl__cuda_image_from_payload(const void *payload, size_t len, kl_cuda_image *im)
{
	memset(im, 0, sizeof *im);
	if (len < 2)
		return false;
	const uint8_t *p = payload;
	im->data = calloc(1, len); /* PTX is text the driver wants NUL-terminated */
	if (!im->data)
		return false;
	memcpy(im->data, p + 1, len - 1);
	im->size = len - 1;
	im->ptx = p[0] == 1;
	return true;
}

/* the image from the disk cache entry `entry` */
static bool cached_image(kl_ctx *ctx, const char *dir, const char *entry, uint64_t key,
                         kl_cuda_image *im)
{
	void *payload = NULL;
	size_t len = 0;
	const kl_cuda_hooks *h = &kl__cuda_dev_of(ctx)->hooks;
	bool ok = h->cache_get(ctx, dir, entry, key, &payload, &len) == KL_OK &&
	          kl__cuda_image_from_payload(payload, len, im);
	if (!ok)
		kl_clear_error(ctx);
	free(payload);
	return ok;
}

uint64_t kl__cuda_module_src_key(const char *src)
{
	return kl__hash_bytes(KL_HASH_SEED, src, strlen(src));
}

typedef struct kl_cuda_pkgmod {
	uint64_t src_key;
	bool arch_specific;
	kl_cuda_image im;
} kl_cuda_pkgmod;

kl_status kl__cuda_pkgmod_add(kl_ctx *ctx, kl_cuda_dev *d, uint64_t src_key, bool arch_specific,
                              const kl_cuda_image *im)
{
	for (int i = 0; i < d->npkgmods; i++)
		if (d->pkgmods[i].src_key == src_key && d->pkgmods[i].arch_specific == arch_specific)
			return KL_OK; /* a package loaded before brought it */
	kl_cuda_pkgmod *n = realloc(d->pkgmods, sizeof *n * (size_t)(d->npkgmods + 1));
	if (!n)
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of memory");
	d->pkgmods = n;
	kl_cuda_pkgmod *e = &n[d->npkgmods];
	memset(e, 0, sizeof *e);
	e->src_key = src_key;
	e->arch_specific = arch_specific;
	/* PTX is text the driver wants NUL-terminated */
	if (!(e->im.data = calloc(1, im->size + 1)))
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of memory");
	memcpy(e->im.data, im->data, im->size);
	e->im.size = im->size;
	e->im.ptx = im->ptx;
	e->im.arch = im->arch;
	d->npkgmods++;
	return KL_OK;
}

void kl__cuda_pkgmod_release(kl_cuda_dev *d)
{
	for (int i = 0; i < d->npkgmods; i++)
		kl__cuda_image_free(&d->pkgmods[i].im);
	free(d->pkgmods);
	d->pkgmods = NULL;
	d->npkgmods = 0;
}

kl_status kl__cuda_module_cached(kl_ctx *ctx, kl_cuda_dev *d, const char *src, const char *name,
                                 bool arch_specific, kl_cuda_module **out)
{
	*out = NULL;
	uint64_t key = kl__cuda_module_src_key(src);
	for (int i = 0; i < d->npkgmods; i++)
		if (d->pkgmods[i].src_key == key && d->pkgmods[i].arch_specific == arch_specific) {
			kl__log(ctx, KL_LOG_CACHE, "%s: module from a package", name);
			return kl__cuda_module_load(ctx, d, &d->pkgmods[i].im, out);
		}
	kl_nvrtc_opts o = kl__nvrtc_opts_for(d);
	o.arch_specific = arch_specific;
	/* the entry's key: the source and everything that picks the target */
	int tag[2] = {o.arch, arch_specific ? 1 : 0};
	key = kl__hash_bytes(key, tag, sizeof tag);
	char dir[1024], entry[64];
	/* the disk cache is lent by the runtime (kl_cuda_hooks): none, no caching */
	bool have_dir = d->hooks.cache_dir && d->hooks.cache_get && d->hooks.cache_put &&
	                d->hooks.cache_dir(ctx, dir, sizeof dir);
	snprintf(entry, sizeof entry, "mod-%016llx.klm", (unsigned long long)key);
	kl_cuda_image im;
	memset(&im, 0, sizeof im);
	if (have_dir && cached_image(ctx, dir, entry, key, &im)) {
		kl__log(ctx, KL_LOG_CACHE, "%s: module from %s", name, entry);
		kl_status s = kl__cuda_module_load(ctx, d, &im, out);
		kl__cuda_image_free(&im);
		if (s == KL_OK)
			return KL_OK;
		kl__log(ctx, KL_LOG_CACHE, "%s: cached module does not load (%s): rebuilding", name,
		        kl_last_error(ctx));
		kl_clear_error(ctx);
		memset(&im, 0, sizeof im);
	}
	kl_status s = kl__nvrtc_compile(ctx, src, name, &o, &im);
	if (s == KL_OK && have_dir) {
		size_t len;
		uint8_t *payload = kl__cuda_image_payload(&im, &len);
		if (payload && d->hooks.cache_put(ctx, dir, entry, key, payload, len) == KL_OK)
			kl__log(ctx, KL_LOG_CACHE, "wrote %s (%zu bytes)", entry, len);
		else
			kl_clear_error(ctx);
		free(payload);
	}
	if (s == KL_OK)
		s = kl__cuda_module_load(ctx, d, &im, out);
	kl__cuda_image_free(&im);
	return s;
}

kl_status kl__cuda_module_fn(kl_ctx *ctx, kl_cuda_module *m, const char *fn, CUfunction *out)
{
	*out = NULL;
	CUresult r = kl__cu.cuModuleGetFunction(out, m->mod, fn);
	if (r == CUDA_ERROR_NOT_FOUND)
		return kl__err(ctx, KL_EINVAL,
		               "kl_cuda: the module has no kernel named %s (is it "
		               "declared extern \"C\" __global__?)",
		               fn);
	return kl__cu_check(ctx, r, "cuModuleGetFunction", __FILE__, __LINE__);
}

void kl__cuda_module_free(kl_cuda_module *m)
{
	if (!m)
		return;
	if (kl__cuda_bind(NULL, m->dev) == KL_OK)
		kl__cu.cuModuleUnload(m->mod);
	free(m);
}

static kl_status smem_fits(kl_ctx *ctx, const kl_cuda_dev *d, unsigned smem)
{
	if (smem > (unsigned)d->smem_per_block_optin)
		return kl__err(ctx, KL_EINVAL,
		               "kl_cuda: a kernel asks for %u bytes of shared memory; %s allows %d "
		               "per block",
		               smem, d->name, d->smem_per_block_optin);
	return KL_OK;
}

kl_status kl__cuda_fn_smem(kl_ctx *ctx, kl_cuda_dev *d, CUfunction f, unsigned smem)
{
	kl_status s = smem_fits(ctx, d, smem);
	if (s == KL_OK && smem > (unsigned)d->smem_per_block)
		s = KL_CU(ctx, cuFuncSetAttribute, f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
		          (int)smem);
	return s;
}

kl_status kl__cuda_launch(kl_ctx *ctx, kl_cuda_dev *d, CUfunction f, const unsigned grid[3],
                          const unsigned block[3], unsigned smem, void **args, unsigned flags)
{
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK || (s = smem_fits(ctx, d, smem)) != KL_OK)
		return s;
	CUlaunchAttribute at;
	memset(&at, 0, sizeof at);
	at.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
	at.value.programmaticStreamSerializationAllowed = 1;
	CUlaunchConfig cfg = {.gridDimX = grid[0],
	                      .gridDimY = grid[1],
	                      .gridDimZ = grid[2],
	                      .blockDimX = block[0],
	                      .blockDimY = block[1],
	                      .blockDimZ = block[2],
	                      .sharedMemBytes = smem,
	                      .hStream = d->stream,
	                      .attrs = &at,
	                      .numAttrs = (flags & KL_LAUNCH_PDL) && d->pdl ? 1u : 0u};
	KL_CU_TRY(ctx, cuLaunchKernelEx, &cfg, f, args, NULL);
	return KL_OK;
}
