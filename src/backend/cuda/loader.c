/* loader.c - dlopen/dlsym of libcuda, libnvrtc and libcublasLt into the
 * function tables of loader.h, once per process, with an error that says which
 * library is missing and why.
 */
#include "backend/cuda/loader.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
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

/* kl__loader_open, also saying which name opened (*loaded, on success). */
static kl_status loader_open_named(const char *what, const char *const *names, int nnames,
                                   const kl_loader_sym *syms, int nsyms, void *table, void **lib,
                                   char *err, size_t errcap, const char **loaded)
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
	*loaded = name;
	err[0] = 0;
	return KL_OK;
}

kl_status kl__loader_open(const char *what, const char *const *names, int nnames,
                          const kl_loader_sym *syms, int nsyms, void *table, void **lib, char *err,
                          size_t errcap)
{
	const char *loaded = NULL;
	return loader_open_named(what, names, nnames, syms, nsyms, table, lib, err, errcap,
	                         &loaded);
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
	/* for KILN_LOGS=startup: what opened, how long dlopen + dlsym took, and
	 * the library's own start (cuInit; 0 for the others) */
	const char *name;
	int nsyms;
	double open_ms, init_ms;
	atomic_bool logged; /* the startup log has told the load */
} load_state;

static load_state driver_state = {.once = PTHREAD_ONCE_INIT};
static load_state nvrtc_state = {.once = PTHREAD_ONCE_INIT};
static load_state lt_state = {.once = PTHREAD_ONCE_INIT};

static kl_status open_timed(load_state *s, const char *what, const char *const *names, int n,
                            const kl_loader_sym *syms, int nsyms, void *table, void **lib)
{
	double t0 = kl__now_ms();
	s->nsyms = nsyms;
	s->status = loader_open_named(what, names, n, syms, nsyms, table, lib, s->err,
	                              sizeof s->err, &s->name);
	s->open_ms = kl__now_ms() - t0;
	return s->status;
}

static void load_driver_once(void)
{
	const char *names[8];
	int n = names_with_env("KILN_LIBCUDA", kl__cuda_driver_names, names, 8);
	load_state *s = &driver_state;
	if (open_timed(s, "CUDA driver", names, n, kl__cuda_driver_syms, kl__cuda_driver_nsyms,
	               &kl__cu, &kl__cu.lib) != KL_OK)
		return;
	double t0 = kl__now_ms();
	CUresult r = kl__cu.cuInit(0);
	s->init_ms = kl__now_ms() - t0;
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
	/* KILN_NO_NVRTC=1: never opened, as where it is absent (a process that
	 * runs packages proves it needs no compiler); the runtime library
	 * (KILN_RT) never opens it */
	const char *no = getenv("KILN_NO_NVRTC");
#ifdef KILN_RT
	no = "rt";
#endif
	if (no && (strcmp(no, "1") == 0 || strcmp(no, "rt") == 0)) {
		snprintf(s->err, sizeof s->err, "NVRTC not opened: %s",
		         strcmp(no, "rt") == 0 ? "the runtime library (libkiln_rt) runs no compiler"
		                               : "KILN_NO_NVRTC=1 is set");
		s->status = KL_EDEVICE;
		return;
	}
	if (open_timed(s, "NVRTC", names, n, nvrtc_syms, NSYMS(nvrtc_syms), &kl__nvrtc,
	               &kl__nvrtc.lib) != KL_OK)
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
	if (open_timed(s, "cuBLASLt", names, n, lt_syms, NSYMS(lt_syms), &kl__lt, &kl__lt.lib) ==
	    KL_OK)
		kl__lt.version = kl__lt.cublasLtGetVersion();
}

/* The first context that asks with KILN_LOGS=startup hears how long the
 * process's one load took (which may have been for an earlier context). */
static void log_load(kl_ctx *ctx, load_state *s, const char *what, bool now)
{
	if (!ctx || !(ctx->logs & KL_LOG_STARTUP) || atomic_exchange(&s->logged, true))
		return;
	char init[64] = "";
	if (s->init_ms > 0)
		snprintf(init, sizeof init, ", cuInit %.3f ms", s->init_ms);
	kl__log(ctx, KL_LOG_STARTUP, "%s %s: dlopen + %d symbols %.3f ms%s%s%s", what,
	        s->name ? s->name : "(not found)", s->nsyms, s->open_ms, init,
	        s->status == KL_OK ? "" : " (failed)",
	        now ? "" : " (loaded earlier in this process)");
}

static kl_status finish(kl_ctx *ctx, load_state *s, const char *what, double t0)
{
	/* the once-call took the time: this caller did the load */
	log_load(ctx, s, what, kl__now_ms() - t0 >= s->open_ms + s->init_ms);
	if (s->status == KL_OK)
		return KL_OK;
	return kl__err(ctx, s->status, "%s", s->err);
}

kl_status kl__cuda_load_driver(kl_ctx *ctx)
{
	double t0 = kl__now_ms();
	pthread_once(&driver_state.once, load_driver_once);
	return finish(ctx, &driver_state, "CUDA driver", t0);
}

kl_status kl__cuda_load_nvrtc(kl_ctx *ctx)
{
	double t0 = kl__now_ms();
	pthread_once(&nvrtc_state.once, load_nvrtc_once);
	return finish(ctx, &nvrtc_state, "NVRTC", t0);
}

kl_status kl__cuda_load_cublaslt(kl_ctx *ctx)
{
	double t0 = kl__now_ms();
	pthread_once(&lt_state.once, load_lt_once);
	return finish(ctx, &lt_state, "cuBLASLt", t0);
}
