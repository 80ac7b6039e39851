/* nn_int.h - what the kl_nn module files share: parameter creation with
 * PyTorch's initializers, and the checks every forward call makes. Like the
 * modules, built on kiln.h only. */
#ifndef KILN_NN_INT_H
#define KILN_NN_INT_H

#include "kiln_nn.h"

/* A seed for the k-th tensor a module makes from its seed. */
uint64_t kl__nn_seed(uint64_t seed, uint64_t k);
/* A float dtype a module can hold, else an error naming fn. */
kl_status kl__nn_check_dtype(kl_ctx *ctx, const char *fn, kl_dtype dt);
/* The start of every module's init: m (size bytes) not NULL, then zeroed,
 * and dt a dtype it can hold; else the error, naming fn. */
kl_status kl__nn_init_begin(void *m, size_t size, kl_ctx *ctx, const char *fn, kl_dtype dt);
/* The end of every module's init: on failure (st) what it made is freed. */
kl_status kl__nn_init_end(kl_nn_module *m, kl_status st);
/* *slot = uniform in [-bound, bound) of dtype dt (drawn in f32, or f64), a
 * reference the module owns (in no scope). */
kl_status kl__nn_uniform(kl_ctx *ctx, kl_tensor **slot, kl_dtype dt, int ndim,
                         const int64_t *shape, double bound, uint64_t seed);
/* *slot = value everywhere, owned by the module. */
kl_status kl__nn_fill(kl_ctx *ctx, kl_tensor **slot, kl_dtype dt, int ndim, const int64_t *shape,
                      double value);
/* m is an initialized module of kind k, else NULL and an error naming fn
 * (on x's context when m has none). */
bool kl__nn_is(const kl_nn_module *m, kl_nn_kind k, const char *fn, kl_tensor *x);

#endif
