/* loader.c - dlopen/dlsym of libcuda, libnvrtc and libcublasLt into the
 * function tables of loader.h, once per process, with an error that says which
 * library is missing and why.
 */
#include "backend/cuda/loader.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kl_cu_driver kl__cu;
kl_nvrtc_api kl__nvrtc;
kl_cublaslt_api kl__lt;

#define KL_STR_(x) #x
#define KL_STR(x) KL_STR_(x)

/* CUDA 13's libraries first; 12's keep the same C API for what kiln calls.
 * Absolute paths last, for toolkits whose lib dir is not on the loader path. */
const char *const kl__cuda_driver_names[] = {"libcuda.so.1", NULL};
const char *const kl__nvrtc_names[] = {"libnvrtc.so.13",
                                       "libnvrtc.so.12",
                                       "libnvrtc.so",
                                       "/usr/local/cuda/lib64/libnvrtc.so.13",
                                       "/usr/local/cuda/lib64/libnvrtc.so",
                                       NULL};
const char *const kl__cublaslt_names[] = {"libcublasLt.so.13",
                                          "libcublasLt.so.12",
                                          "libcublasLt.so",
                                          "/usr/local/cuda/lib64/libcublasLt.so.13",
                                          "/usr/local/cuda/lib64/libcublasLt.so",
                                          NULL};

kl_status kl__loader_open(const char *what, const char *const *names, int nnames,
                          const kl_loader_sym *syms, int nsyms, void *table, void **lib, char *err,
                          size_t errcap)
{
	size_t used = 0;
	void *h = NULL;
	const char *name = NULL;
	err[0] = 0;
	used = (size_t)snprintf(err, errcap, "no %s found (", what);
	for (int i = 0; i < nnames && !h; i++) {
		name = names[i];
		h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
		if (!h && used < errcap) {
			const char *why = dlerror();
			size_t nl = strlen(name);
			/* glibc's message starts with the name again */
			if (why && strncmp(why, name, nl) == 0 && why[nl] == ':' &&
			    why[nl + 1] == ' ')
				why += nl + 2;
			used += (size_t)snprintf(err + used, errcap - used, "%s%s: %s",
			                         i ? "; " : "", name, why ? why : "unknown error");
		}
	}
	if (!h) {
		if (used < errcap)
			snprintf(err + used, errcap - used, ")");
		return KL_EDEVICE;
	}
	for (int i = 0; i < nsyms; i++) {
		void *p = dlsym(h, syms[i].name);
		if (!p) {
			snprintf(err, errcap,
			         "%s %s lacks %s: the library is older than the CUDA 13.0 "
			         "headers kiln was built with",
			         what, name, syms[i].name);
			dlclose(h);
			return KL_EDEVICE;
		}
		/* POSIX guarantees a function pointer survives the trip through void *. */
		memcpy((char *)table + syms[i].offset, &p, sizeof p);
	}
	*lib = h;
	err[0] = 0;
	return KL_OK;
}

/* Candidate list: the environment override, then the defaults. */
static int names_with_env(const char *env, const char *const *defaults, const char **out, int cap)
{
	int n = 0;
	const char *e = getenv(env);
	if (e && *e)
		out[n++] = e;
	for (int i = 0; defaults[i] && n < cap; i++)
		out[n++] = defaults[i];
	return n;
}

/* ---- the driver ----------------------------------------------------------- */

#define NSYMS(a) ((int)(sizeof(a) / sizeof((a)[0])))

#define KL_SYM_DRIVER(fn) {KL_STR(fn), offsetof(kl_cu_driver, fn)},
const kl_loader_sym kl__cuda_driver_syms[] = {KL_CU_DRIVER_FUNCS(KL_SYM_DRIVER)};
const int kl__cuda_driver_nsyms = NSYMS(kl__cuda_driver_syms);
#define KL_SYM_NVRTC(fn) {KL_STR(fn), offsetof(kl_nvrtc_api, fn)},
static const kl_loader_sym nvrtc_syms[] = {KL_NVRTC_FUNCS(KL_SYM_NVRTC)};
#define KL_SYM_LT(fn) {KL_STR(fn), offsetof(kl_cublaslt_api, fn)},
static const kl_loader_sym lt_syms[] = {KL_CUBLASLT_FUNCS(KL_SYM_LT)};

typedef struct load_state {
	pthread_once_t once;
	kl_status status;
	char err[KL_ERR_CAP];
} load_state;

static load_state driver_state = {PTHREAD_ONCE_INIT, KL_OK, ""};
static load_state nvrtc_state = {PTHREAD_ONCE_INIT, KL_OK, ""};
static load_state lt_state = {PTHREAD_ONCE_INIT, KL_OK, ""};

static void load_driver_once(void)
{
	const char *names[8];
	int n = names_with_env("KILN_LIBCUDA", kl__cuda_driver_names, names, 8);
	load_state *s = &driver_state;
	s->status =
	        kl__loader_open("CUDA driver", names, n, kl__cuda_driver_syms,
	                        kl__cuda_driver_nsyms, &kl__cu, &kl__cu.lib, s->err, sizeof s->err);
	if (s->status != KL_OK)
		return;
	CUresult r = kl__cu.cuInit(0);
	if (r != CUDA_SUCCESS) {
		const char *name = "?", *str = "?";
		kl__cu.cuGetErrorName(r, &name);
		kl__cu.cuGetErrorString(r, &str);
		if (r == CUDA_ERROR_STUB_LIBRARY)
			snprintf(s->err, sizeof s->err,
			         "no CUDA driver found (the libcuda found is the toolkit's stub "
			         "library: cuInit returned CUDA_ERROR_STUB_LIBRARY)");
		else if (r == CUDA_ERROR_NO_DEVICE)
			snprintf(s->err, sizeof s->err, "no CUDA device found (cuInit: %s: %s)",
			         name, str);
		else
			snprintf(s->err, sizeof s->err,
			         "the CUDA driver failed to start (cuInit: %s: %s)", name, str);
		s->status = KL_EDEVICE;
		return;
	}
	kl__cu.cuDriverGetVersion(&kl__cu.version);
}

static void load_nvrtc_once(void)
{
	const char *names[16];
	int n = names_with_env("KILN_LIBNVRTC", kl__nvrtc_names, names, 16);
	load_state *s = &nvrtc_state;
	s->status = kl__loader_open("NVRTC", names, n, nvrtc_syms, NSYMS(nvrtc_syms), &kl__nvrtc,
	                            &kl__nvrtc.lib, s->err, sizeof s->err);
	if (s->status != KL_OK)
		return;
	kl__nvrtc.nvrtcVersion(&kl__nvrtc.major, &kl__nvrtc.minor);
	int na = 0;
	if (kl__nvrtc.nvrtcGetNumSupportedArchs(&na) != NVRTC_SUCCESS || na <= 0 || na > 64) {
		snprintf(s->err, sizeof s->err, "NVRTC %d.%d reports %d target architectures",
		         kl__nvrtc.major, kl__nvrtc.minor, na);
		s->status = KL_EDEVICE;
		return;
	}
	kl__nvrtc.nvrtcGetSupportedArchs(kl__nvrtc.archs);
	kl__nvrtc.narchs = na;
}

static void load_lt_once(void)
{
	const char *names[16];
	int n = names_with_env("KILN_LIBCUBLASLT", kl__cublaslt_names, names, 16);
	load_state *s = &lt_state;
	s->status = kl__loader_open("cuBLASLt", names, n, lt_syms, NSYMS(lt_syms), &kl__lt,
	                            &kl__lt.lib, s->err, sizeof s->err);
	if (s->status == KL_OK)
		kl__lt.version = kl__lt.cublasLtGetVersion();
}

static kl_status finish(kl_ctx *ctx, const load_state *s)
{
	if (s->status == KL_OK)
		return KL_OK;
	return kl__err(ctx, s->status, "%s", s->err);
}

kl_status kl__cuda_load_driver(kl_ctx *ctx)
{
	pthread_once(&driver_state.once, load_driver_once);
	return finish(ctx, &driver_state);
}

kl_status kl__cuda_load_nvrtc(kl_ctx *ctx)
{
	pthread_once(&nvrtc_state.once, load_nvrtc_once);
	return finish(ctx, &nvrtc_state);
}

kl_status kl__cuda_load_cublaslt(kl_ctx *ctx)
{
	pthread_once(&lt_state.once, load_lt_once);
	return finish(ctx, &lt_state);
}
