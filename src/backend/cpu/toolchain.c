/* toolchain.c - the CPU toolchain (as nvrtc.c is CUDA's): generated C source -> the system compiler (spawned
 * directly, no shell, only kiln-made strings in its arguments) -> a shared
 * object -> dlopen -> one function pointer per kernel.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "backend/cpu/cpu.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

extern char **environ;

/* Fixed flags: the cache key hashes this list, so changing it rebuilds.
 * -fno-math-errno lets sqrtf become one instruction (no errno path) and
 * -fno-trapping-math lets if-conversion blend selects whose arms could trap,
 * so more simd loops vectorize; neither changes a value, and libkiln is built
 * with both. -lm (after the source) also links libmvec, whose vector expf
 * and tanhf the generated C declares. -fopenmp-simd: OpenMP's simd pragmas
 * only; the parallel nests call kiln's thread pool (pool.c), not libgomp. */
static const char *const cc_flags[] = {"-O3",    "-march=native",   "-fopenmp-simd", "-fno-math-errno",
                                       "-fno-trapping-math", "-shared", "-fPIC",    "-std=c11"};
#define NFLAGS ((int)(sizeof cc_flags / sizeof cc_flags[0]))

/* KILN_JIT_SANITIZE: build the generated kernels with AddressSanitizer
 * ("address"), UndefinedBehaviorSanitizer ("undefined") or both
 * ("address,undefined"), so that a kernel's stray access is reported where it
 * happens (the fuzz targets and sanitized test runs use it). The kernels then
 * call the sanitizer's runtime, which must already be in the process: kiln
 * built with -DKILN_SANITIZE=ON (or a fuzz target) by the compiler the JIT
 * runs. Only these fixed lists reach the compiler; any other value is an
 * error of kl_compile. The flags are part of the JIT's identity (cache key). */
#define MAX_SAN_FLAGS 3
typedef struct san_mode {
	const char *value;
	const char *probe[2]; /* runtime symbols the process must carry */
	const char *flags[MAX_SAN_FLAGS + 1];
} san_mode;
static const san_mode san_modes[] = {
	{"address", {"__asan_init", NULL}, {"-fsanitize=address", "-fno-omit-frame-pointer", NULL}},
	{"undefined",
	 {"__ubsan_handle_add_overflow", NULL},
	 {"-fsanitize=undefined", "-fno-sanitize-recover=undefined", NULL}},
	{"address,undefined",
	 {"__asan_init", "__ubsan_handle_add_overflow"},
	 {"-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
	  "-fno-omit-frame-pointer", NULL}},
};

/* The mode KILN_JIT_SANITIZE asks for: NULL when unset or empty; *bad when
 * its value is none of the above. */
static const san_mode *jit_sanitize(bool *bad)
{
	const char *e = getenv("KILN_JIT_SANITIZE");
	*bad = false;
	if (!e || !*e)
		return NULL;
	if (!strcmp(e, "undefined,address"))
		e = "address,undefined";
	for (size_t i = 0; i < sizeof san_modes / sizeof san_modes[0]; i++)
		if (!strcmp(e, san_modes[i].value))
			return &san_modes[i];
	*bad = true;
	return NULL;
}

static atomic_long jit_compiles;

long kl__jit_compiles(void)
{
	return atomic_load(&jit_compiles);
}

static bool is_exe(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* name as execvp would find it (a name with '/' is taken as a path). */
static bool resolve_exe(const char *name, char *out, size_t cap)
{
	if (!name || !*name)
		return false;
	for (const char *p = name; *p; p++)
		if (*p == ' ' || *p == '\t' || *p == '\n')
			return false; /* "ccache gcc" and the like: not a single program */
	if (strchr(name, '/')) {
		if (!is_exe(name) || strlen(name) >= cap)
			return false;
		strcpy(out, name);
		return true;
	}
	const char *path = getenv("PATH");
	if (!path || !*path)
		path = "/usr/local/bin:/usr/bin:/bin";
	while (*path) {
		const char *colon = strchr(path, ':');
		size_t len = colon ? (size_t)(colon - path) : strlen(path);
		int n = len ? snprintf(out, cap, "%.*s/%s", (int)len, path, name)
		            : snprintf(out, cap, "./%s", name);
		if (n > 0 && (size_t)n < cap && is_exe(out))
			return true;
		if (!colon)
			break;
		path = colon + 1;
	}
	return false;
}

/* $CC, else cc on PATH, else the compiler kiln was built with. */
static bool cc_path(char *out, size_t cap)
{
	if (resolve_exe(getenv("CC"), out, cap))
		return true;
	if (resolve_exe("cc", out, cap))
		return true;
#ifdef KILN_CC
	if (resolve_exe(KILN_CC, out, cap))
		return true;
#endif
	return false;
}

static uint64_t cpu_identity(uint64_t h)
{
#if defined(__x86_64__) || defined(__i386__)
	unsigned a, b, c, d, max;
	if (__get_cpuid(0, &max, &b, &c, &d)) {
		unsigned vendor[3] = {b, d, c};
		h = kl__hash_bytes(h, vendor, sizeof vendor);
		if (max >= 1 && __get_cpuid(1, &a, &b, &c, &d)) {
			/* leaf 1 ebx holds the APIC id, which differs per core */
			unsigned sig[3] = {a, c, d};
			h = kl__hash_bytes(h, sig, sizeof sig);
		}
		if (max >= 7) {
			__cpuid_count(7, 0, a, b, c, d);
			unsigned ext[3] = {b, c, d};
			h = kl__hash_bytes(h, ext, sizeof ext);
		}
	}
#else
	static const char arch[] = "non-x86";
	h = kl__hash_bytes(h, arch, sizeof arch);
#endif
	return h;
}

static pthread_mutex_t ident_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t ident_env, ident_val;
static bool ident_ok;

uint64_t kl__jit_cc_identity(void)
{
	/* resolving walks PATH; do it again only when CC or PATH changed */
	const char *cc = getenv("CC"), *path = getenv("PATH");
	bool bad;
	const san_mode *san = jit_sanitize(&bad);
	uint64_t env = KL_HASH_SEED;
	env = kl__hash_bytes(env, cc ? cc : "", cc ? strlen(cc) + 1 : 1);
	env = kl__hash_bytes(env, path ? path : "", path ? strlen(path) + 1 : 1);
	const char *sv = getenv("KILN_JIT_SANITIZE");
	env = kl__hash_bytes(env, sv ? sv : "", sv ? strlen(sv) + 1 : 1);
	pthread_mutex_lock(&ident_mu);
	if (ident_ok && ident_env == env) {
		uint64_t v = ident_val;
		pthread_mutex_unlock(&ident_mu);
		return v;
	}
	char exe[PATH_MAX];
	uint64_t h = KL_HASH_SEED;
	if (cc_path(exe, sizeof exe)) {
		struct stat st;
		h = kl__hash_bytes(h, exe, strlen(exe) + 1);
		if (stat(exe, &st) == 0) {
			int64_t meta[3] = {(int64_t)st.st_size, (int64_t)st.st_mtime,
			                   (int64_t)st.st_ino};
			h = kl__hash_bytes(h, meta, sizeof meta);
		}
	}
	for (int i = 0; i < NFLAGS; i++)
		h = kl__hash_bytes(h, cc_flags[i], strlen(cc_flags[i]) + 1);
	for (int i = 0; san && san->flags[i]; i++)
		h = kl__hash_bytes(h, san->flags[i], strlen(san->flags[i]) + 1);
	if (bad) /* a key no entry has: the build, which reports the value, runs */
		h = kl__hash_bytes(h, "bad KILN_JIT_SANITIZE", 22);
	h = cpu_identity(h);
	ident_env = env;
	ident_val = h;
	ident_ok = true;
	pthread_mutex_unlock(&ident_mu);
	return h;
}

static kl_status write_file(kl_ctx *ctx, const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
	if (fd < 0)
		return kl__err(ctx, KL_EIO, "kl_compile: cannot create %s: %s", path,
		               strerror(errno));
	size_t len = strlen(text), done = 0;
	while (done < len) {
		ssize_t w = write(fd, text + done, len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			int e = errno;
			close(fd);
			return kl__err(ctx, KL_EIO, "kl_compile: cannot write %s: %s", path,
			               strerror(e));
		}
		done += (size_t)w;
	}
	if (close(fd) != 0)
		return kl__err(ctx, KL_EIO, "kl_compile: cannot write %s: %s", path,
		               strerror(errno));
	return KL_OK;
}

/* The first lines of the compiler's diagnostics, for the error message. */
static void read_head(const char *path, char *buf, size_t cap)
{
	buf[0] = '\0';
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	size_t n = fread(buf, 1, cap - 1, f);
	fclose(f);
	buf[n] = '\0';
	int lines = 0;
	for (size_t i = 0; i < n; i++)
		if (buf[i] == '\n' && ++lines == 8) {
			buf[i] = '\0';
			break;
		}
	n = strlen(buf);
	while (n > 0 && buf[n - 1] == '\n')
		buf[--n] = '\0';
}

/* Paths we hand the compiler must not read as options. */
static bool safe_arg(const char *p)
{
	return p[0] != '-' && p[0] != '\0';
}

kl_status kl__jit_cc_build(kl_ctx *ctx, const char *source, const char *workdir, char *so_path,
                           size_t cap)
{
	char exe[PATH_MAX], src[PATH_MAX], log[PATH_MAX];
	if (!cc_path(exe, sizeof exe))
		return kl__err(ctx, KL_ECOMPILE,
		               "kl_compile: no C compiler found ($CC, cc on PATH, or the build's "
		               "compiler)");
	if (!safe_arg(workdir) || snprintf(src, sizeof src, "%s/k.c", workdir) >= (int)sizeof src ||
	    snprintf(log, sizeof log, "%s/cc.log", workdir) >= (int)sizeof log ||
	    snprintf(so_path, cap, "%s/k.so", workdir) >= (int)cap)
		return kl__err(ctx, KL_EINVAL,
		               "kl_compile: build directory path too long or invalid");
	bool bad;
	const san_mode *san = jit_sanitize(&bad);
	if (bad)
		return kl__err(ctx, KL_EINVAL,
		               "kl_compile: KILN_JIT_SANITIZE must be address, undefined or "
		               "address,undefined");
	if (san) {
		/* without the runtime in the process the kernels would not load
		 * (or, for ASan, would abort the process as they load) */
		void *self = dlopen(NULL, RTLD_NOW);
		for (int i = 0; i < 2 && san->probe[i]; i++)
			if (!self || !dlsym(self, san->probe[i])) {
				if (self)
					dlclose(self);
				return kl__err(ctx, KL_EINVAL,
				               "kl_compile: KILN_JIT_SANITIZE=%s needs a process "
				               "built with that sanitizer (%s is missing)",
				               san->value, san->probe[i]);
			}
		dlclose(self);
	}
	kl_status s = write_file(ctx, src, source);
	if (s != KL_OK)
		return s;

	const char *argv[NFLAGS + MAX_SAN_FLAGS + 8];
	int argc = 0;
	argv[argc++] = exe;
	for (int i = 0; i < NFLAGS; i++)
		argv[argc++] = cc_flags[i];
	for (int i = 0; san && san->flags[i]; i++)
		argv[argc++] = san->flags[i];
	argv[argc++] = "-o";
	argv[argc++] = so_path;
	argv[argc++] = src;
	argv[argc++] = "-lm";
	argv[argc] = NULL;

	posix_spawn_file_actions_t fa;
	if (posix_spawn_file_actions_init(&fa) != 0)
		return kl__err(ctx, KL_ENOMEM, "kl_compile: posix_spawn_file_actions_init failed");
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	posix_spawn_file_actions_addopen(&fa, 2, log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	pid_t pid;
	int rc = posix_spawn(&pid, exe, &fa, NULL, (char *const *)argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	if (rc != 0)
		return kl__err(ctx, KL_ECOMPILE, "kl_compile: cannot start the C compiler %s: %s",
		               exe, strerror(rc));
	atomic_fetch_add(&jit_compiles, 1);
	int status = 0;
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return kl__err(ctx, KL_ECOMPILE, "kl_compile: waiting for %s: %s", exe,
			               strerror(errno));
	}
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		return KL_OK;
	char diag[768];
	read_head(log, diag, sizeof diag);
	if (WIFSIGNALED(status))
		return kl__err(ctx, KL_ECOMPILE,
		               "kl_compile: the C compiler %s was killed by signal "
		               "%d:\n%s",
		               exe, WTERMSIG(status), diag);
	return kl__err(ctx, KL_ECOMPILE, "kl_compile: the C compiler %s failed (exit %d):\n%s", exe,
	               WIFEXITED(status) ? WEXITSTATUS(status) : -1, diag);
}

