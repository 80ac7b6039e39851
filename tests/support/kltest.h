/* kltest.h - helpers shared by every kiln test: random inputs of any dtype,
 * range and memory layout, reading tensors back as doubles, and checking an
 * op's result against the float64 reference interpreter.
 *
 * Typical use, inside a cmocka test:
 *
 *     static kl_tensor *apply_add(kl_tensor *const *in, const void *p)
 *     { return kl_add(in[0], in[1]); }
 *     ...
 *     kl_tensor *in[2] = {
 *         kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 5}, KLTEST_NORMAL, KLTEST_CONTIG, 1),
 *         kltest_rand(ctx, KL_F16, 1, (int64_t[]){5}, KLTEST_NORMAL, KLTEST_STRIDED, 2)};
 *     assert_true(kltest_check_op(ctx, "add", apply_add, 2, in, NULL, 1.0));
 *
 * Functions that check return true on success; on failure they print what
 * went wrong (op, shapes, dtypes, worst element) to stderr and return false,
 * so a table-driven test can count failures and report all of them.
 */
#ifndef KLTEST_H
#define KLTEST_H

#include <stdbool.h>
#include <stdint.h>

#include "kiln.h"

/* Value distributions. Values are always exactly representable in the
 * tensor's dtype; bool tensors are random 0/1 under every range. */
typedef enum kltest_range {
	KLTEST_NORMAL,   /* floats uniform in [-2, 2); ints in [-20, 20] */
	KLTEST_POS,      /* floats in [0.25, 3); ints in [1, 9]: log, sqrt, pow bases */
	KLTEST_SMALLINT, /* integers in [-3, 3] in every dtype, so ties and equality occur */
	KLTEST_SPECIAL,  /* NORMAL mixed with NaN, +-inf, +-0, huge, tiny and .5 values;
	                  * ints: NORMAL mixed with the dtype's extremes, 0 and -1 */
	KLTEST_WIDE      /* floats of magnitudes 2^-12 .. 2^12, either sign; ints span the
	                  * dtype's whole range (overflow and wrap-around) */
} kltest_range;

/* Memory layouts. Non-contiguous tensors are views made with the public
 * ops; the gaps of a STRIDED view hold poison (NaN, or a large integer), so
 * a kernel that ignores strides or offsets produces wrong values. 0-dim
 * tensors are always contiguous. */
typedef enum kltest_layout {
	KLTEST_CONTIG,
	KLTEST_PERMUTED, /* permute() of a tensor stored with its dims reversed;
	                  * with fewer than 2 dims: STRIDED */
	KLTEST_STRIDED   /* slice() with step 2 on the last dim and offset 1 on the first */
} kltest_layout;

/* A tensor of the given dtype/shape filled from seed (deterministic), or
 * NULL (message printed). The caller owns the reference. */
/* The context a test binary runs on: CUDA device 0 when KILN_TEST_DEVICE=cuda
 * (exits 77, ctest's skip, when it cannot be had, saying why), else the CPU.
 * NULL only when the CPU context fails. */
kl_ctx *kltest_ctx_from_env(const char *test);

kl_tensor *kltest_rand(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, kltest_range r,
                       kltest_layout layout, uint64_t seed);

/* A tensor holding vals (numel doubles, row-major, rounded to dt) in the
 * given layout. */
kl_tensor *kltest_from_values(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape,
                              const double *vals, kltest_layout layout);

/* The values of any tensor, row-major, as a malloc'd array of numel doubles
 * (at least one element allocated), or NULL (message printed). A sync point. */
double *kltest_read(kl_tensor *t);

/* The base tolerance for results of dtype dt: f64 1e-12, f32 1e-5,
 * f16 2e-3, bf16 1e-2; 0 (exact) for integers and bool. */
double kltest_tol(kl_dtype dt);

/* Compare out against ref (numel of shape elements of dtype dt).
 * Integers and bool must match exactly. Floats: NaN in ref needs NaN in out,
 * an infinity in ref needs the same infinity, NaN or inf in out where ref is
 * finite fails; finite elements need |out - ref| <= atol + rtol * |ref| with
 * rtol = tol(dt) * factor and atol = rtol * median(|ref|) (the typical
 * magnitude: room for results that cancel to near zero, not inflated by a
 * few huge specials), and the whole array ||out - ref|| / ||ref|| <= rtol.
 * factor > 1 for long reductions etc.; 0 demands exact equality. */
bool kltest_compare(const char *what, kl_dtype dt, int ndim, const int64_t *shape,
                    const double *out, const double *ref, double factor);
/* kltest_compare with atol at least atol_min: for results whose error
 * bound is known in absolute terms (an f32 dot of K terms: its rounding
 * grows with K and the terms' magnitudes, not with the result's, which
 * may cancel to near zero). */
bool kltest_compare_atol(const char *what, kl_dtype dt, int ndim, const int64_t *shape,
                         const double *out, const double *ref, double factor, double atol_min);

/* An op under test: builds a tensor from in[] (and its own parameters) with
 * kl_ ops only. It may create intermediates freely: they are released. */
typedef kl_tensor *(*kltest_apply_fn)(kl_tensor *const *in, const void *param);

/* Run apply under a trace (kl__trace_begin/end) and evaluate the recorded
 * graph with kl__ref_eval on the values of the trace's inputs. Returns the
 * malloc'd reference values and the output's ndim/shape/dtype, or NULL
 * (message printed). ctx: the context apply works on. */
double *kltest_reference(kl_ctx *ctx, const char *what, kltest_apply_fn apply, kl_tensor *const *in,
                         const void *param, int *ndim, int64_t *shape, kl_dtype *dt);

/* The op checker: runs apply eagerly and compares its result (shape, dtype
 * exactly; values per kltest_compare with factor) with kltest_reference.
 * nin: entries of in[], printed on failure. */
bool kltest_check_op(kl_ctx *ctx, const char *what, kltest_apply_fn apply, int nin,
                     kl_tensor *const *in, const void *param, double factor);
/* kltest_check_op comparing per kltest_compare_atol */
bool kltest_check_op_atol(kl_ctx *ctx, const char *what, kltest_apply_fn apply, int nin,
                          kl_tensor *const *in, const void *param, double factor,
                          double atol_min);

/* result must be NULL (a non-NULL result is released), the context's status
 * not KL_OK, and kl_last_error(ctx) must contain every string of the
 * NULL-terminated list. Use through KLTEST_EXPECT_ERROR, which clears the
 * context's error first and evaluates to the bool:
 *     ok &= KLTEST_EXPECT_ERROR(ctx, kl_add(a, b), "kl_add", "[4,3]", "[5]"); */
bool kltest_expect_error(kl_ctx *ctx, kl_tensor *result, const char *expr, ...);
#define KLTEST_EXPECT_ERROR(ctx, expr, ...)                                                        \
	(kl_clear_error(ctx),                                                                      \
	 kltest_expect_error((ctx), (expr), #expr, __VA_ARGS__, (const char *)NULL))

/* splitmix64: the deterministic generator behind kltest_rand, for tests that
 * draw their own cases. */
uint64_t kltest_next(uint64_t *state);
double kltest_uniform(uint64_t *state); /* [0, 1) */

#endif
