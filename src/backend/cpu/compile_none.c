/* compile_none.c - the runtime library's (libkiln_rt) stand-in for the CPU
 * toolchain (toolchain.c): it runs plans whose kernels come built (AOT
 * packages) and never invokes a compiler, so a compile is refused with a
 * clear error. libkiln carries toolchain.c instead.
 */
#include "backend/cpu/cpu.h"

uint64_t kl__jit_cc_identity(void)
{
	return 0x6b696c6e2d72746eull; /* no compiler: one fixed identity */
}

kl_status kl__jit_cc_build(kl_ctx *ctx, const char *source, const char *workdir, char *so_path,
                           size_t cap)
{
	(void)source;
	(void)workdir;
	if (cap)
		so_path[0] = '\0';
	return kl__err(ctx, KL_EUNSUPPORTED,
	               "kl_compile: this is libkiln_rt, the runtime library: it runs AOT packages "
	               "(kl_package_load) and compiles nothing; link libkiln to compile");
}

long kl__jit_compiles(void)
{
	return 0;
}
