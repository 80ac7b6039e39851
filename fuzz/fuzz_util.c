/* fuzz_util.c - see fuzz_util.h. */
#include "fuzz_util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/runtime_int.h" /* kl__rmtree_flat */

void kf_die(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("fuzz target: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	abort();
}

const char *kf_seed_dir(void)
{
	const char *d = getenv("KILN_FUZZ_SEEDS");
	return d && *d ? d : NULL;
}

void kf_write_seed(const char *dir, const char *name, const void *data, size_t len)
{
	char path[4096];
	if (mkdir(dir, 0700) != 0 && errno != EEXIST)
		kf_die("cannot create %s: %s", dir, strerror(errno));
	snprintf(path, sizeof path, "%s/%s", dir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0)
		kf_die("cannot write %s", path);
}

void kf_seeds_done(int argc)
{
	if (argc <= 1)
		exit(0);
}

kl_ctx *kf_ctx(void)
{
	kl_ctx_opts o = {.device = KL_CPU, .nthreads = 1};
	kl_ctx *ctx = kl_ctx_new(&o);
	if (!ctx)
		kf_die("kl_ctx_new: %s", kl_last_error(NULL));
	return ctx;
}

static char scratch[4096];

/* the scratch tree: files, and directories of files (the cache) */
static void remove_scratch(void)
{
	DIR *d = opendir(scratch);
	if (d) {
		struct dirent *e;
		char p[4200];
		while ((e = readdir(d)))
			if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
			    snprintf(p, sizeof p, "%s/%s", scratch, e->d_name) < (int)sizeof p)
				kl__rmtree_flat(
				        p); /* a directory; a plain file is unlinked below */
		closedir(d);
	}
	kl__rmtree_flat(scratch);
}

const char *kf_scratch(void)
{
	if (scratch[0])
		return scratch;
	const char *tmp = getenv("TMPDIR"), *run = getenv("KILN_FUZZ_SCRATCH");
	const char *bases[] = {run && run[0] == '/' ? run : "/dev/shm", "/dev/shm",
	                       tmp && tmp[0] == '/' ? tmp : "/tmp", "/tmp"};
	for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
		snprintf(scratch, sizeof scratch, "%s/kiln-fuzz-XXXXXX", bases[i]);
		if (mkdtemp(scratch)) {
			atexit(remove_scratch);
			return scratch;
		}
	}
	kf_die("cannot make a scratch directory: %s", strerror(errno));
}

static long n_unnamed;
static char first_unnamed[512];

static void report_unnamed(void)
{
	if (n_unnamed)
		fprintf(stderr,
		        "fuzz target: %ld failure messages did not name the call made; "
		        "the first: %s\n",
		        n_unnamed, first_unnamed);
}

void kf_check_failure(kl_ctx *ctx, const char *op)
{
	const char *msg = kl_last_error(ctx);
	if (kl_last_status(ctx) == KL_OK)
		kf_die("%s failed with status KL_OK (message: \"%s\")", op, msg);
	if (!msg[0])
		kf_die("%s failed (%s) with an empty message", op,
		       kl_status_name(kl_last_status(ctx)));
	if (!strstr(msg, op) && n_unnamed++ == 0) {
		snprintf(first_unnamed, sizeof first_unnamed, "%s: \"%s\"", op, msg);
		atexit(report_unnamed);
	}
	kl_clear_error(ctx);
}
