/* fuzz_fn_call.c - libFuzzer target, end to end: a mutated plan entry planted
 * in the disk cache under the key of a real graph, then kl_compile and
 * kl_fn_call on that graph's inputs, which load the plan and run it with the
 * graph's shared object. The generated kernels are built with ASan and UBSan
 * (KILN_JIT_SANITIZE, by the compiler that built this target), so a plan that
 * makes a kernel step outside a buffer is caught in the kernel.
 *
 * The input is one byte choosing the graph (fuzz_graphs.c) and then the
 * serialized program; the target adds the graph's shared-object digest and
 * writes the entry through kl__cache_put (checksums always right). A plan
 * kiln rejects would send it back to the C compiler; the compiler the JIT
 * runs is a gate that builds for real during initialization and fails at
 * once while fuzzing (KILN_FUZZ_NO_CC), so a rejected plan costs no compile.
 * At exit the target prints how many plans were accepted and how many of
 * those gave outputs that differ from the true plan's. */
#define _GNU_SOURCE /* memmem */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_util.h"
#include "runtime/runtime_int.h"

#ifndef KILN_FUZZ_CC
#error "KILN_FUZZ_CC: the compiler that built this target (fuzz/CMakeLists.txt)"
#endif

#define MAX_IO 8

typedef struct want {
	kl_tensor *in[MAX_IO];
	int64_t nbytes[MAX_IO];
	uint8_t *bytes[MAX_IO]; /* the outputs of the true plan */
} want;

static kl_ctx *ctx;
static char dir[4200];
static kf_plan plans[16];
static want wants[16];
static long n_run, n_accepted, n_differ, n_fallback, n_failed;

static void report(void)
{
	fprintf(stderr,
	        "fuzz_fn_call: %ld plans planted: %ld loaded and ran (%ld with outputs unlike "
	        "the true plan's), %ld rejected and run another way, %ld failed with an "
	        "error\n",
	        n_run, n_accepted, n_differ, n_fallback, n_failed);
}

/* CC for the JIT: KILN_FUZZ_CC, unless KILN_FUZZ_NO_CC is set. */
static void make_cc_gate(void)
{
	char path[4300];
	snprintf(path, sizeof path, "%s/cc", kf_scratch());
	FILE *f = fopen(path, "w");
	if (!f ||
	    fprintf(f, "#!/bin/sh\n[ -n \"$KILN_FUZZ_NO_CC\" ] && exit 1\nexec %s \"$@\"\n",
	            KILN_FUZZ_CC) < 0 ||
	    fclose(f) != 0 || chmod(path, 0700) != 0)
		kf_die("cannot write %s", path);
	setenv("CC", path, 1);
}

/* Every shared object in the cache must carry ASan's checks: else the
 * kernels would run unchecked and the target would miss what it is for. */
static void check_kernels_sanitized(void)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;
	while (d && (e = readdir(d))) {
		if (strncmp(e->d_name, "so-", 3))
			continue;
		char path[4400];
		snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
		FILE *f = fopen(path, "rb");
		static char buf[1 << 20];
		size_t len = f ? fread(buf, 1, sizeof buf, f) : 0;
		if (f)
			fclose(f);
		if (!memmem(buf, len, "__asan_report", 13))
			kf_die("%s was built without AddressSanitizer (KILN_JIT_SANITIZE)", path);
		n++;
	}
	if (d)
		closedir(d);
	if (n == 0)
		kf_die("no shared object in %s", dir);
}

/* Plant graph g's entry: its shared object's digest, then program bytes. */
static void plant(int g, const uint8_t *prog, size_t len)
{
	static uint8_t *buf;
	static size_t cap;
	if (len + 16 > cap) {
		free(buf);
		cap = len + 16;
		if (!(buf = malloc(cap)))
			kf_die("out of memory");
	}
	memcpy(buf, plans[g].payload, 16);
	if (len)
		memcpy(buf + 16, prog, len);
	if (kl__cache_put(ctx, dir, plans[g].entry, plans[g].key, buf, len + 16) != KL_OK)
		kf_die("kl__cache_put failed");
}

/* Compile and call graph g; 1 when it ran, and then whether the outputs match. */
static int call(int g, bool *same, bool keep)
{
	const kf_graph *G = &kf_graphs[g];
	kl_tensor *out[MAX_IO] = {0};
	kl_fn *f = kl_compile(ctx, G->body, NULL, G->nin, G->nout, NULL);
	if (!f)
		kf_die("kl_compile: %s", kl_last_error(ctx));
	kl_status st = kl_fn_call(f, wants[g].in, out);
	*same = true;
	if (st != KL_OK) {
		kf_check_failure(ctx, "kl_");
	} else {
		for (int i = 0; i < G->nout; i++) {
			int64_t nb =
			        kl_numel(out[i]) * (int64_t)kl_dtype_size(kl_tensor_dtype(out[i]));
			uint8_t *host = malloc((size_t)(nb ? nb : 1));
			if (!host || kl_to_host(out[i], host, (size_t)nb) != KL_OK)
				kf_die("%s: output %d cannot be read: %s", G->name, i,
				       kl_last_error(ctx));
			if (keep) {
				wants[g].nbytes[i] = nb;
				wants[g].bytes[i] = host;
				continue;
			}
			if (nb != wants[g].nbytes[i] || memcmp(host, wants[g].bytes[i], (size_t)nb))
				*same = false;
			free(host);
		}
		for (int i = 0; i < G->nout; i++)
			kl_release(out[i]);
	}
	kl_fn_free(f);
	return st == KL_OK;
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	snprintf(dir, sizeof dir, "%s/cache", kf_scratch());
	setenv("KILN_CACHE_DIR", dir, 1);
	setenv("KILN_JIT_SANITIZE", "address,undefined", 1);
	unsetenv("KILN_FUZZ_NO_CC");
	make_cc_gate();
	ctx = kf_ctx();
	if (!kl__cache_dir(ctx, dir, sizeof dir))
		kf_die("cannot use %s as a cache directory", dir);
	kf_make_plans(ctx, dir, plans);
	check_kernels_sanitized();
	const char *seeds = kf_seed_dir();
	if (seeds) {
		for (int g = 0; g < kf_ngraphs; g++) {
			char name[64];
			snprintf(name, sizeof name, "seed-%s", kf_graphs[g].name);
			uint8_t *s = malloc(plans[g].len - 15);
			s[0] = (uint8_t)g;
			memcpy(s + 1, plans[g].payload + 16, plans[g].len - 16);
			kf_write_seed(seeds, name, s, plans[g].len - 15);
			free(s);
		}
		kf_seeds_done(*argc);
	}
	/* the true plans must load from the cache and run: else the target
	 * would fuzz the compiler's fallback, not the loader */
	setenv("KILN_FUZZ_NO_CC", "1", 1);
	for (int g = 0; g < kf_ngraphs; g++) {
		for (int i = 0; i < kf_graphs[g].nin; i++)
			if (!(wants[g].in[i] = kf_graphs[g].make_input(ctx, i)))
				kf_die("%s: input %d: %s", kf_graphs[g].name, i,
				       kl_last_error(ctx));
		long hits = kl__rt_cache_hits();
		bool same;
		plant(g, plans[g].payload + 16, plans[g].len - 16);
		if (!call(g, &same, true) || kl__rt_cache_hits() != hits + 1)
			kf_die("%s: the true plan did not load from the cache: %s",
			       kf_graphs[g].name, kl_last_error(ctx));
	}
	atexit(report);
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	int g = data[0] % kf_ngraphs;
	plant(g, data + 1, size - 1);
	long hits = kl__rt_cache_hits();
	bool same;
	n_run++;
	if (call(g, &same, false)) {
		if (kl__rt_cache_hits() != hits) {
			n_accepted++;
			n_differ += !same;
		} else {
			n_fallback++;
		}
	} else {
		n_failed++;
	}
	return 0;
}
