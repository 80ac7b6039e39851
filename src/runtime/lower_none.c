/* lower_none.c - the runtime library's (libkiln_rt) stand-in for lowering
 * (lower/, codegen/, render_plan.c): libkiln_rt runs plans that come built
 * in AOT packages, so anything that would lower a graph is refused. libkiln
 * carries the real ones instead.
 */
#include <stdio.h>

#include "runtime/runtime_int.h"

#define NO_LOWERING                                                                                \
	"this is libkiln_rt, the runtime library: it runs AOT packages and lowers nothing (link "  \
	"libkiln to compile)"

kl_status kl__lower(const kl_graph *g, const kl_lower_opts *o, kl_program *out, char *err,
                    size_t errcap)
{
	(void)g;
	(void)o;
	memset(out, 0, sizeof *out);
	snprintf(err, errcap, NO_LOWERING);
	return KL_EUNSUPPORTED;
}

int kl__graph_symbolize(const kl_graph *g, const uint32_t *dyn_masks, int32_t *sym,
                        int32_t *sym_input, int32_t *sym_dim, char *err, size_t errcap)
{
	(void)g;
	(void)dyn_masks;
	(void)sym;
	(void)sym_input;
	(void)sym_dim;
	snprintf(err, errcap, NO_LOWERING);
	return -1;
}

kl_status kl__graph_specialize(const kl_graph *g, const uint32_t *dyn_masks, uint32_t *out,
                               kl_spec *spec, int cap, int *nspec, char *err, size_t errcap)
{
	(void)g;
	(void)dyn_masks;
	(void)out;
	(void)spec;
	(void)cap;
	*nspec = 0;
	snprintf(err, errcap, NO_LOWERING);
	return KL_EUNSUPPORTED;
}
