/* hooks_rt.c - what the runtime library (libkiln_rt) lends a CUDA context in
 * place of eager_cuda.c's hooks: the disk cache, and no eager generated
 * kernels (they need the compiler; an eager op no library call serves fails
 * with KL_EUNSUPPORTED). libkiln links eager_cuda.c instead.
 */
#include "runtime/compiled.h"
#include "runtime/runtime_int.h"

const kl_cuda_hooks kl__cuda_rt_hooks = {
        .cache_dir = kl__cache_dir,
        .cache_get = kl__cache_get,
        .cache_put = kl__cache_put,
};
