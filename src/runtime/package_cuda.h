/* package_cuda.h - the kernels section of a CUDA package (package_cuda.c):
 * the plan's module and the fixed kernels' modules (fused attention) as
 * cubins for one architecture, each with its PTX for newer GPUs, and the
 * launch choices (cuBLASLt algorithms, grid caps) the exporting GPU made.
 * Parsing and the choice of image need no CUDA; building (NVRTC) and loading
 * (the driver) live in runtime/cuda/pkg_cuda.c.
 */
#ifndef KILN_PACKAGE_CUDA_H
#define KILN_PACKAGE_CUDA_H

#include "runtime/compiled.h"

#define KL_PKG_CUDA_MODS 64

enum { KL_PKG_MOD_PLAN = 0, KL_PKG_MOD_FIXED = 1 };

/* One module; pointers into the package's bytes. */
typedef struct kl_pkg_cumod {
	int role;           /* KL_PKG_MOD_PLAN: the plan's kernels; FIXED: a fixed kernel's */
	bool arch_specific; /* a cubin for sm_NNa: runs on that architecture only */
	uint64_t src_key;   /* FIXED: kl__cuda_module_src_key of its source */
	const uint8_t *cubin;
	size_t cubin_len;
	const char *ptx; /* not NUL-terminated; may be empty */
	size_t ptx_len;
} kl_pkg_cumod;

typedef struct kl_pkg_cuda {
	int arch; /* the cubins' architecture: 90 for sm_90 */
	int nmods;
	kl_pkg_cumod mods[KL_PKG_CUDA_MODS];
	const uint8_t *choices; /* tune_cuda.c's encoding; NULL when none were made */
	size_t choices_len;
} kl_pkg_cuda;

/* "cuda-sm_NN" -> NN (a number in [30, 999]), else 0. */
int kl__pkg_cuda_target_arch(const char *target);

/* Parse and check the section (n bytes at p): magic, counts, every length
 * inside it, each cubin a 64-bit CUDA ELF file, each PTX printable text
 * naming its target; a plan with kernels (nkernels > 0) has exactly one plan
 * module, a plan without none. KL_EFORMAT with the reason in why. */
kl_status kl__pkg_cuda_parse(const uint8_t *p, size_t n, int arch, int32_t nkernels,
                             kl_pkg_cuda *out, char *why, size_t cap);

/* Serialize: the modules (their cubin/ptx pointers and lengths) and the
 * choices into a malloc'd buffer. */
kl_status kl__pkg_cuda_write(const kl_pkg_cuda *c, uint8_t **out, size_t *len);

/* Which image a GPU of architecture dev_arch runs: the cubin (same major
 * version, minor not below), the PTX (a newer GPU; the driver compiles it),
 * or none: KL_EUNSUPPORTED naming both architectures in why. */
kl_status kl__pkg_cuda_pick(const kl_pkg_cuda *c, int dev_arch, bool *use_ptx, char *why,
                            size_t cap);

/* ---- runtime/cuda/pkg_cuda.c (exec_no_cuda.c: refused) -------------------- */

/* Compile prog's source and the fixed kernels its attention steps may
 * launch with NVRTC for sm_<arch> (cubin + PTX); no GPU needed. *mods
 * (malloc'd images, KL_PKG_CUDA_MODS at most) go into sec->mods; free them
 * with kl__pkg_cuda_images_free. Errors name fn. */
kl_status kl__pkg_cuda_build(kl_ctx *ctx, const char *fn, const kl_program *prog, int arch,
                             kl_pkg_cuda *sec);
void kl__pkg_cuda_images_free(kl_pkg_cuda *sec);
/* c (from kl__compiled_from_plan on a CUDA context): its modules from the
 * section (the image the device runs, no NVRTC), fixed modules registered
 * with the device, the choices applied when made on this kind of device,
 * CUDA graphs on (captured at the second call, replayed from the third)
 * unless KILN_DISABLE_CUDAGRAPHS=1. */
kl_status kl__pkg_cuda_load(kl_ctx *ctx, const char *fn, kl_compiled *c, const kl_pkg_cuda *sec);
/* The launch choices c's runs made (max-autotune), encoded; *len 0 when
 * none were made. */
kl_status kl__pkg_cuda_choices(kl_ctx *ctx, const kl_compiled *c, uint8_t **out, size_t *len);

#endif /* KILN_PACKAGE_CUDA_H */
