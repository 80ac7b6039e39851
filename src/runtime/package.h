/* package.h - AOT packages (package.c): one versioned, checksummed file
 * holding a manifest (inputs, outputs, dtypes, dynamic dims with their
 * ranges, parameters, target), a plan (plan_io.c's serialization, the one
 * the disk cache uses), the kernels' shared object and the weights (a
 * safetensors file). Written by export (capture/export.c), loaded and run by
 * the runtime library with no compiler.
 */
#ifndef KILN_PACKAGE_H
#define KILN_PACKAGE_H

#include "runtime/compiled.h"

#define KL_PKG_FORMAT 1u
#define KL_PKG_NAME_MAX 128

/* A tensor of the manifest: an input or output of the program (dims
 * static or named dynamic: dim[d] >= 0 is manifest dim dim[d]), or a
 * parameter (static; off/nbytes: its bytes in the weights' data). */
typedef struct kl_pkg_tensor {
	char name[KL_PKG_NAME_MAX];
	kl_dtype dtype;
	int32_t ndim;
	int64_t shape[KL_MAX_DIMS]; /* traced sizes */
	int32_t dim[KL_MAX_DIMS];   /* -1 static, else the dynamic dim's index */
	uint64_t off, nbytes;
} kl_pkg_tensor;

typedef struct kl_pkg_dim {
	char name[64];
	int64_t min, max;
} kl_pkg_dim;

typedef struct kl_pkg_manifest {
	char target[32]; /* "cpu-x86_64", ... (kl__pkg_host_target) */
	int32_t nin, nout, nparams, ndims;
	kl_pkg_tensor *in, *out, *params;
	kl_pkg_dim *dims;
	/* per plan graph input: >= 0 program input, else parameter -1 - src */
	int32_t ngin;
	int32_t *gin;
	/* per program output: the plan's graph output it is */
	int32_t *outsrc;
} kl_pkg_manifest;

/* The checksum of each section (fast enough for weights). */
uint64_t kl__pkg_sum(const uint8_t *p, size_t n);
/* A name a manifest may hold: 1..127 bytes of [A-Za-z0-9_.:/+-]. */
bool kl__pkg_name_ok(const char *s);
void kl__pkg_manifest_free(kl_pkg_manifest *m);
/* The target this process runs: "cpu-<arch>". */
const char *kl__pkg_host_target(void);

/* Write a package to a malloc'd buffer: the manifest, the plan, the
 * kernels' shared object (so, may be empty when the plan has no kernels),
 * the parameters' data (params[i] for m->params[i], any layout). */
kl_status kl__pkg_write(kl_ctx *ctx, const kl_pkg_manifest *m, const kl_program *prog,
                        const uint8_t *so, size_t so_len, kl_tensor *const *params,
                        uint8_t **out, size_t *out_len);

typedef struct kl_pkg kl_pkg;
/* Check and load a package from len bytes at data: header, format version,
 * checksums, target, the manifest against the plan, the kernels' ELF
 * header and their plan digest. own_map: data is an mmap the package now
 * owns (unmapped with it; weights are borrowed from it), else the bytes
 * are the caller's and the weights are copied. NULL with ctx's error
 * (naming `fn`) on failure. describe: every section checked, nothing loaded
 * (no kernels, weights or variant; any target): only kl__pkg_print and
 * kl__pkg_free apply. A CUDA package opens on a CUDA context only, a CPU
 * package on a CPU one. */
kl_pkg *kl__pkg_open(kl_ctx *ctx, const char *fn, void *data, size_t len, bool own_map,
                     bool describe);
void kl__pkg_free(kl_pkg *p);
const kl_pkg_manifest *kl__pkg_manifest(const kl_pkg *p);
/* Run with inputs checked against the manifest (dtype, rank, static sizes,
 * dynamic dims in range and tied dims equal). */
kl_status kl__pkg_run(kl_pkg *p, kl_tensor *const *in, kl_tensor **out);
/* The manifest of a loaded public package (fuzz target, tools' tests). */
const kl_pkg_manifest *kl__package_manifest(const kl_package *p);
/* Its compiled plan (memory plan at the traced sizes: arena_bytes, out_bytes). */
const kl_compiled *kl__package_compiled(const kl_package *p);
/* Manifest, kernels, section sizes, target as text. */
void kl__pkg_print(const kl_pkg *p, FILE *f);

#endif /* KILN_PACKAGE_H */
