/* graph_slots.c - which CUDA graph of a variant serves a call: a variant whose
 * plan has dynamic dims keeps one graph (with its own temps' arena and
 * re-pointing state, runtime/cuda/exec_cuda.c) per vector of symbol values,
 * up to a limit, the least recently used one given up for a new vector. The
 * choice is plain host bookkeeping, here so that it is tested without a GPU.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime/runtime_int.h"

int kl__gslot_limit(void)
{
	const char *e = getenv("KILN_CUDA_GRAPHS_MAX");
	int v = e && *e ? atoi(e) : 0;
	return v >= 1 && v <= 1024 ? v : KL_GSLOT_DEFAULT;
}

int kl__gslot_pick(const int64_t *keys, const uint64_t *used, int n, int max, int nsyms,
                   const int64_t *syms, kl_gslot_pick_how *how)
{
	size_t kb = sizeof(int64_t) * (size_t)nsyms;
	for (int i = 0; i < n; i++)
		if (!memcmp(keys + (size_t)i * KL_GSLOT_KEY, syms, kb)) {
			*how = KL_GSLOT_HIT;
			return i;
		}
	if (n < max) {
		*how = KL_GSLOT_NEW;
		return n;
	}
	int lru = 0;
	for (int i = 1; i < n; i++)
		if (used[i] < used[lru])
			lru = i;
	*how = KL_GSLOT_EVICT;
	return lru;
}
