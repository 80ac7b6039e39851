/* fuzz_safetensors.c - libFuzzer target: a whole safetensors file through the
 * public reader (kl_safetensors_open, then every tensor through
 * kl_safetensors_get and kl_to_host, and the metadata). The input is the
 * file: it lives in a memfd, opened by its /proc/self/fd path, so that no
 * disk is touched per input. A rejected file must leave a status and a
 * message; an accepted tensor must hold exactly its declared bytes. */
#define _GNU_SOURCE /* memfd_create */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_util.h"

static kl_ctx *ctx;
static int fd = -1;
static char path[64];

static void write_seeds(const char *dir)
{
	static const int64_t s23[] = {2, 3}, s0[] = {0, 4}, s1[] = {5};
	kl_scope_begin(ctx); /* the tensors and their intermediates */
	kl_tensor *ts[] = {
	        kl_randn(ctx, KL_F32, 2, s23, 1),
	        kl_cast(kl_randn(ctx, KL_F32, 1, s1, 2), KL_BF16),
	        kl_cast(kl_randn(ctx, KL_F32, 1, s1, 3), KL_F16),
	        kl_scalar(ctx, KL_F64, 2.5),
	        kl_full(ctx, KL_I64, 1, s1, -7),
	        kl_full(ctx, KL_I32, 2, s0, 1),
	        kl_gt_scalar(kl_randn(ctx, KL_F32, 2, s23, 4), 0.0),
	};
	const char *names[] = {"w", "b.bf16", "h.f16", "scalar", "ids", "empty", "mask"};
	const int n = (int)(sizeof ts / sizeof ts[0]);
	char file[4200];
	for (int k = 1; k <= n; k++) {
		/* the first k tensors, saved by kiln itself, read back as the seed */
		snprintf(file, sizeof file, "%s/seed-%d.safetensors", kf_scratch(), k);
		if (kl_safetensors_save(ctx, file, k, names, ts) != KL_OK)
			kf_die("kl_safetensors_save: %s", kl_last_error(ctx));
		FILE *f = fopen(file, "rb");
		char buf[8192];
		size_t len = f ? fread(buf, 1, sizeof buf, f) : 0;
		if (f)
			fclose(f);
		unlink(file);
		if (!len)
			kf_die("cannot read back %s", file);
		char name[32];
		snprintf(name, sizeof name, "seed-%d.safetensors", k);
		kf_write_seed(dir, name, buf, len);
	}
	/* a header with __metadata__ and padding spaces, written by hand */
	static const char hdr[] = "{\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\"},"
	                          "\"x\":{\"dtype\":\"F32\",\"shape\":[2],"
	                          "\"data_offsets\":[0,8]}}    ";
	uint8_t buf[8 + sizeof hdr - 1 + 8] = {0};
	buf[0] = (uint8_t)(sizeof hdr - 1);
	memcpy(buf + 8, hdr, sizeof hdr - 1);
	kf_write_seed(dir, "seed-meta.safetensors", buf, sizeof buf);
	kl_scope_end(ctx);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	ctx = kf_ctx();
	const char *dir = kf_seed_dir();
	if (dir) {
		write_seeds(dir);
		kf_seeds_done(*argc);
	}
	fd = memfd_create("kiln-fuzz-safetensors", 0);
	if (fd < 0)
		kf_die("memfd_create failed");
	snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
	return 0;
}

static void check_tensor(kl_safetensors *st, const char *name)
{
	kl_tensor *t = kl_safetensors_get(st, name);
	if (!t) {
		kf_check_failure(ctx, "kl_safetensors_get");
		return;
	}
	size_t nb = (size_t)kl_numel(t) * kl_dtype_size(kl_tensor_dtype(t));
	void *host = malloc(nb ? nb : 1);
	if (!host)
		kf_die("out of memory for %zu bytes", nb);
	if (kl_to_host(t, host, nb) != KL_OK)
		kf_die("kl_to_host of tensor '%s' failed: %s", name, kl_last_error(ctx));
	free(host);
	kl_release(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != (ssize_t)size)
		kf_die("cannot write the memfd");
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	if (!st) {
		kf_check_failure(ctx, "kl_safetensors_open");
		return 0;
	}
	int n = kl_safetensors_count(st);
	for (int i = 0; i < n; i++) {
		const char *name = kl_safetensors_name(st, i);
		if (!name)
			kf_die("tensor %d of %d has no name", i, n);
		check_tensor(st, name);
	}
	if (kl_safetensors_name(st, n) || kl_safetensors_name(st, -1))
		kf_die("kl_safetensors_name answers out of range");
	check_tensor(st, "no such tensor \x01");
	(void)kl_safetensors_metadata(st, "format");
	kl_safetensors_close(st);
	return 0;
}
