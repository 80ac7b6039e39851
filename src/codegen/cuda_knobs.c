/* cuda_knobs.c - the CUDA renderer's environment knobs (render.h,
 * row_onepass.h): read by the renderer and by the runtime, which launches
 * what the renderer made (the points a pointwise thread takes) and keys its
 * cache on them; apart so that the runtime library has them without the
 * renderer.
 */
#include <stdlib.h>
#include <string.h>

#include "codegen/render.h"
#include "codegen/row_onepass.h"

int kl__cuda_row_group(void)
{
	const char *e = getenv("KILN_CUDA_ROW_GROUP");
	int g = e ? atoi(e) : 0;
	return g == 32 || g == 64 || g == 128 || g == KL_CUDA_BLOCK ? g : 0;
}

kl_cuda_dot kl__cuda_dot_knobs(void)
{
	kl_cuda_dot d = {4, 131072, 1, 0, -1, 1};
	const char *e = getenv("KILN_CUDA_DOT_CHUNKS");
	if (e && atoi(e) >= 1 && atoi(e) <= 8)
		d.chunks = atoi(e);
	if ((e = getenv("KILN_CUDA_DOT_THREADS")) && atol(e) >= 0 && atol(e) <= (1L << 24))
		d.threads = (int)atol(e);
	if ((e = getenv("KILN_CUDA_DOT_F32")) && (atoi(e) == 0 || atoi(e) == 1))
		d.f32 = atoi(e);
	if ((e = getenv("KILN_CUDA_ROW_MINBLOCKS")) && atoi(e) >= 1 && atoi(e) <= 8)
		d.minb = atoi(e);
	if ((e = getenv("KILN_CUDA_ROW_HOLD")) && (strcmp(e, "0") == 0 || strcmp(e, "1") == 0))
		d.hold = atoi(e);
	if ((e = getenv("KILN_CUDA_PW_UNROLL")) &&
	    (!strcmp(e, "1") || !strcmp(e, "2") || !strcmp(e, "4") || !strcmp(e, "8")))
		d.pw = atoi(e);
	return d;
}

int kl__cuda_row_onepass(void)
{
	/* off unless asked for: on an H200 (2026-12-03, 16384 x 4096 bf16) the
	 * pairs took softmax from 84.4 to 155.9 us and layer norm from 89.0 to
	 * 291.9 us (eager) against the two-reduction kernels */
	const char *e = getenv("KILN_CUDA_ROW_ONEPASS");
	return e && strcmp(e, "1") == 0 ? 1 : 0;
}
