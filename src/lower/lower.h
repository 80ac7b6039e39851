/* lower.h - the compiler middle: a traced graph in, a plan (kl_program) and
 * its kernels' IR out.
 *
 * kl__lower_ir decomposes composites, assigns symbolic dims, fuses nodes into
 * kernels (fuse.c) and builds each kernel's loop IR (kernel_ir.h). Lowering ends
 * there: the runtime's compile driver renders the IR (codegen/) into the
 * plan's source (kl__lower, runtime/render_plan.c). See docs/design.md.
 */
#ifndef KILN_LOWER_H
#define KILN_LOWER_H

#include "core/core.h"
#include "lower/kernel_ir.h"
#include "plan/plan.h"

typedef enum kl_target { KL_TARGET_C = 0, KL_TARGET_CUDA = 1 } kl_target;
typedef struct kl_lower_opts {
	kl_target target;
	bool fusion;                  /* false: every op its own kernel (KILN_DISABLE_FUSION / eager-like) */
	const uint32_t *dyn_masks;    /* per graph input (g->inputs order): bitmask of dynamic dims; may be NULL */
	const kl_ctx *log_ctx;        /* for kl__log(ctx, KL_LOG_FUSION, ...) of refused fusions; may be NULL */
	bool no_attention;            /* the target has no attention step: sdpa decomposes, none is fused */
} kl_lower_opts;
/* What lowering produces: the plan, its source still NULL and its kernel
 * steps' row grid (row_per, waves, rowdims) still zero, which the renderer
 * fills; kernels[i] is the IR of kernel i (prog.nkernels, in step order). */
typedef struct kl_lowered {
	kl_program prog;
	kir_kernel *kernels;
	int32_t nkernels; /* kernels held (prog.nkernels until prog is moved out) */
	uint8_t *early; /* CUDA: what kir_kernel.early points to (owned here) */
} kl_lowered;
/* On failure out is empty and err says why. */
kl_status kl__lower_ir(const kl_graph *g, const kl_lower_opts *o, kl_lowered *out, char *err,
                       size_t errcap);
/* Frees the kernels, early and the plan (move prog out first to keep it). */
void kl__lowered_free(kl_lowered *lw);
/* Symbolic dims: sym[node * KL_MAX_DIMS + d] = 0 (static) or k > 0 (symbol k). Dims of INPUT nodes
 * whose mask bit is set become symbols (a dim whose traced value is 0 or 1 stays static: it is
 * specialized, like Dynamo). Returns the number of symbols, or -1 with a reason in err when a dynamic
 * dim flows somewhere the compiler cannot keep symbolic (the caller then compiles statically). Also
 * fills sym_input/sym_dim (length >= return value) with where each symbol comes from. */
int kl__graph_symbolize(const kl_graph *g, const uint32_t *dyn_masks, int32_t *sym, int32_t *sym_input,
                        int32_t *sym_dim, char *err, size_t errcap);

/* Specialise only what must be static: out (ninputs masks) is dyn_masks
 * less each dynamic dim that meets a static size, one at a time, so that
 * specialising one dim never turns the others static; each such dim goes
 * to spec (up to cap, *nspec of them). KL_OK unless a dynamic input cannot
 * be dynamic at all (err says why: not dense, too many symbols). */
kl_status kl__graph_specialize(const kl_graph *g, const uint32_t *dyn_masks, uint32_t *out,
                               kl_spec *spec, int cap, int *nspec, char *err, size_t errcap);

#endif /* KILN_LOWER_H */
