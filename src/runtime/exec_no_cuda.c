/* exec_no_cuda.c - the runtime's CUDA half (src/runtime/cuda/) in a kiln built
 * without the CUDA backend (KILN_CUDA=OFF; backend/cuda/backend_no_cuda.c stands in
 * for the backend).
 */
#include <string.h>

#include "runtime/compiled.h"
#include "runtime/package_cuda.h"

/* The runtime's CUDA half: unreachable without a CUDA context, which this
 * build cannot make; each still answers with the same reason. */
static kl_status absent(kl_ctx *ctx)
{
	return kl__err(ctx, KL_EDEVICE,
	               "kl_compile: this kiln was built without the CUDA backend (KILN_CUDA=OFF)");
}

uint64_t kl__cuda_rt_identity(kl_ctx *ctx)
{
	(void)ctx;
	return 0;
}

kl_status kl__cuda_rt_build(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t *bin_hash,
                            uint64_t *bin_size)
{
	(void)c;
	(void)dir;
	*bin_hash = *bin_size = 0;
	return absent(ctx);
}

kl_status kl__cuda_rt_load(kl_ctx *ctx, kl_compiled *c, const char *dir, uint64_t bin_hash,
                           uint64_t bin_size)
{
	(void)c;
	(void)dir;
	(void)bin_hash;
	(void)bin_size;
	return absent(ctx);
}

void kl__cuda_rt_prepare(kl_ctx *ctx, kl_compiled *c)
{
	(void)ctx;
	(void)c;
}

kl_status kl__cuda_rt_arena(kl_ctx *ctx, kl_compiled *c, size_t bytes, void **base)
{
	(void)c;
	(void)bytes;
	*base = NULL;
	return absent(ctx);
}

kl_status kl__cuda_rt_run(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                          const kl_run_tail *tail, int *tail_launches,
                          kl_tensor *const *inputs, const kl_value_check *chk, int nchk)
{
	(void)inputs;
	(void)chk;
	(void)nchk;
	(void)c;
	(void)tail;
	(void)tail_launches;
	(void)B;
	(void)syms;
	return absent(ctx);
}

kl_status kl__cuda_rt_time_steps(kl_ctx *ctx, kl_compiled *c, void *const *B,
                                 const int64_t *syms, double *us)
{
	(void)c;
	(void)B;
	(void)syms;
	(void)us;
	return kl__err(ctx, KL_EUNSUPPORTED, "kl_profile: kiln was built without CUDA");
}

bool kl__cuda_rt_replaying(const kl_compiled *c)
{
	(void)c;
	return false;
}

long kl__cuda_rt_captures(const kl_compiled *c, double *ms)
{
	(void)c;
	*ms = 0;
	return 0;
}

long kl__cuda_rt_replays(const kl_compiled *c)
{
	(void)c;
	return 0;
}

void kl__cuda_rt_free(kl_compiled *c)
{
	(void)c;
}

const kl_cuda_hooks kl__cuda_rt_hooks = {0};

kl_status kl__cuda_rt_from_image(kl_ctx *ctx, kl_compiled *c, const struct kl_cuda_image *im)
{
	(void)c;
	(void)im;
	return absent(ctx);
}

/* ---- runtime/cuda/pkg_cuda.c ---- */

kl_status kl__pkg_cuda_build(kl_ctx *ctx, const char *fn, const kl_program *prog, int arch,
                             kl_pkg_cuda *sec)
{
	(void)prog;
	memset(sec, 0, sizeof *sec);
	return kl__err(ctx, KL_EDEVICE,
	               "%s: CUDA packages (sm_%d) need NVRTC: this kiln is built without the CUDA "
	               "backend (KILN_CUDA=OFF) or is the runtime library",
	               fn, arch);
}

void kl__pkg_cuda_images_free(kl_pkg_cuda *sec)
{
	sec->nmods = 0;
}

kl_status kl__pkg_cuda_load(kl_ctx *ctx, const char *fn, kl_compiled *c, const kl_pkg_cuda *sec)
{
	(void)c;
	return kl__err(ctx, KL_EDEVICE,
	               "%s: a CUDA package (sm_%d) needs the CUDA backend, which this kiln is built "
	               "without",
	               fn, sec->arch);
}

kl_status kl__pkg_cuda_choices(kl_ctx *ctx, const kl_compiled *c, uint8_t **out, size_t *len)
{
	(void)ctx;
	(void)c;
	*out = NULL;
	*len = 0;
	return KL_OK;
}
