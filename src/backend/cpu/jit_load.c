/* jit_load.c - loading the CPU kernels' shared object: from a path (the
 * disk cache) or from bytes in memory (a package), then one function
 * pointer per kernel. No compiler here: the runtime library (libkiln_rt)
 * carries this file and not toolchain.c.
 */
#define _GNU_SOURCE /* memfd_create */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"

kl_status kl__jit_symbols(kl_ctx *ctx, const char *fn, kl_status code, void *h, char *const *names,
                          int32_t n, kl_kernel_fn *fns)
{
	for (int32_t i = 0; i < n; i++) {
		void *sym = dlsym(h, names[i]);
		if (!sym)
			return kl__err(ctx, code, "%s: kernel %s is missing from its binary", fn,
			               names[i]);
		/* POSIX guarantees object and function pointers convert; C does not,
		 * so go through memcpy rather than a cast the compiler flags */
		memcpy(&fns[i], &sym, sizeof sym);
	}
	return KL_OK;
}

/* the generated C's parallel nests run on kiln's thread pool (pool.c): its
 * entry point goes into each loaded binary's kl_jit_par_for */
static void bind_pool(void *h)
{
	void *par = dlsym(h, "kl_jit_par_for");
	if (par) {
		void (*fn)(int64_t, kl_par_fn, void *) = kl__par_for_call;
		memcpy(par, &fn, sizeof fn);
	}
}

kl_status kl__jit_load(kl_ctx *ctx, const char *so_path, char *const *names, int32_t n, void **dl,
                       kl_kernel_fn *fns)
{
	*dl = NULL;
	void *h = dlopen(so_path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *e = dlerror();
		return kl__err(ctx, KL_ECOMPILE, "kl_compile: cannot load %s: %s", so_path,
		               e ? e : "dlopen failed");
	}
	kl_status st = kl__jit_symbols(ctx, "kl_compile", KL_ECOMPILE, h, names, n, fns);
	if (st != KL_OK) {
		dlclose(h);
		return st;
	}
	bind_pool(h);
	*dl = h;
	return KL_OK;
}

bool kl__jit_plan_digest(void *dl, uint64_t *out)
{
	void *sym = dl ? dlsym(dl, "kl_plan_digest") : NULL;
	if (!sym)
		return false;
	unsigned long long (*fn)(void);
	memcpy(&fn, &sym, sizeof sym); /* as kl__jit_load does */
	*out = (uint64_t)fn();
	return true;
}

void kl__jit_unload(void *dl)
{
	if (dl)
		dlclose(dl);
}

static bool write_fd(int fd, const uint8_t *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		p += w;
		n -= (size_t)w;
	}
	return true;
}

kl_status kl__jit_load_image(kl_ctx *ctx, const char *fn, const void *bytes, size_t len, void **dl)
{
	*dl = NULL;
	char path[64];
	int fd = memfd_create("kiln-kernels", MFD_CLOEXEC);
	if (fd < 0)
		return kl__err(ctx, KL_EIO, "%s: cannot create an in-memory file: %s", fn,
		               strerror(errno));
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	if (!write_fd(fd, bytes, len)) {
		int e = errno;
		close(fd);
		return kl__err(ctx, KL_EIO, "%s: cannot write the kernels: %s", fn,
		               strerror(e));
	}
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	close(fd); /* the mapping keeps the image */
	if (!h) {
		const char *e = dlerror();
		return kl__err(ctx, KL_EFORMAT, "%s: cannot load the kernels: %s", fn,
		               e ? e : "dlopen failed");
	}
	bind_pool(h);
	*dl = h;
	return KL_OK;
}
