/* fuzz_cache.c - libFuzzer target: a CPU plan entry of kiln's disk cache,
 * read as runtime/compile.c reads one (kl__cache_get, then the payload's
 * 16-byte shared-object digest and size, then kl__program_deserialize, which
 * validates) and, when accepted, laid out by the memory planner
 * (kl__memplan_build) as kl_compile would.
 *
 * The input is the entry's payload; the target writes it with a correct
 * header through kl__cache_put, so the FNV checksums are always right and
 * mutations reach the plan parser. An input that starts with the entry magic
 * "KILNCACH" is written as a whole entry instead, header and all, to fuzz
 * the header checks. An accepted program must serialize back to the same
 * bytes. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "plan/plan.h"
#include "runtime/runtime_int.h"

#define KEY 0x6b696c6e66757a7aull
#define ENTRY "plan-6b696c6e66757a7a.klc"

static kl_ctx *ctx;
static char dir[4200];

static void write_seeds(const char *seeds)
{
	kf_plan plans[16];
	kf_make_plans(ctx, dir, plans);
	for (int g = 0; g < kf_ngraphs; g++) {
		char name[64];
		snprintf(name, sizeof name, "seed-%s.plan", kf_graphs[g].name);
		kf_write_seed(seeds, name, plans[g].payload, plans[g].len);
	}
	/* one whole entry, header included, for the header checks */
	char path[4400];
	snprintf(path, sizeof path, "%s/%s", dir, plans[0].entry);
	FILE *f = fopen(path, "rb");
	static uint8_t buf[1 << 16];
	size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
	if (f)
		fclose(f);
	if (n < 48)
		kf_die("cannot read back %s", path);
	kf_write_seed(seeds, "seed-entry.klc", buf, n);
	for (int g = 0; g < kf_ngraphs; g++)
		free(plans[g].payload);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	snprintf(dir, sizeof dir, "%s/cache", kf_scratch());
	setenv("KILN_CACHE_DIR", dir, 1);
	ctx = kf_ctx();
	if (!kl__cache_dir(ctx, dir, sizeof dir))
		kf_die("cannot use %s as a cache directory", dir);
	const char *seeds = kf_seed_dir();
	if (seeds) {
		write_seeds(seeds);
		kf_seeds_done(*argc);
	}
	return 0;
}

/* An accepted program: serialize it back, plan its memory. */
static void use_program(kl_program *p, const uint8_t *bytes, size_t len)
{
	uint8_t *again = NULL;
	size_t n = 0;
	if (kl__program_serialize(p, &again, &n) != KL_OK)
		kf_die("an accepted program does not serialize");
	if (n != len || memcmp(again, bytes, len) != 0)
		kf_die("an accepted program serializes to %zu other bytes (read %zu)", n, len);
	free(again);
	/* symbols take a small value, as a traced input's dims would */
	int64_t syms[KL_MAX_DIMS * 4];
	for (int i = 0; i < KL_MAX_DIMS * 4; i++)
		syms[i] = 3;
	/* as kl_compile would, then with every output lent (a training step's
	 * gradients: kl_compile_cfg.lent) */
	for (int lent = 0; lent < 2; lent++) {
		kl_memplan mp;
		if (kl__memplan_build(p, syms, lent ? INT32_MAX / 2 : 0, &mp) == KL_OK)
			kl__memplan_free(&mp);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size >= 8 && !memcmp(data, "KILNCACH", 8)) {
		char path[4400];
		snprintf(path, sizeof path, "%s/%s", dir, ENTRY);
		int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		if (fd < 0 || write(fd, data, size) != (ssize_t)size || close(fd) != 0)
			kf_die("cannot write %s", path);
	} else if (kl__cache_put(ctx, dir, ENTRY, KEY, data, size) != KL_OK) {
		kf_die("kl__cache_put failed");
	}
	void *payload = NULL;
	size_t len = 0;
	kl_status st = kl__cache_get(ctx, dir, ENTRY, KEY, &payload, &len);
	if (st != KL_OK) {
		if (st != KL_EFORMAT || payload)
			kf_die("kl__cache_get: status %s", kl_status_name(st));
		return 0;
	}
	if (len >= 16) {
		kl_program p;
		char err[256] = "";
		const uint8_t *bytes = (const uint8_t *)payload + 16;
		if (kl__program_deserialize(bytes, len - 16, &p, err, sizeof err) == KL_OK) {
			use_program(&p, bytes, len - 16);
			kl__program_free(&p);
		} else if (!err[0]) {
			kf_die("a program rejected without a reason");
		}
	}
	free(payload);
	return 0;
}
