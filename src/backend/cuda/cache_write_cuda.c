/* cache_write_cuda.c - cache writes on CUDA (graph/ops.def's cache_write,
 * the plan's KL_STEP_CACHE_WRITE): rows of values copied into a cache at
 * positions read from device memory, so a compiled decode step (and its
 * CUDA graph) writes only the new rows, whatever the positions.
 *
 * One fixed kernel (kl__cuda_cache_write_source), compiled once through
 * NVRTC and the disk cache like the optimizer's. It copies elements by their
 * size (the dtype does not matter), one thread an element. Every block
 * reads all the positions before it writes anything, so a write with one
 * position outside [0, cap - s] writes nothing at all (no row, no block
 * races ahead): the first bad row, its position and the step's tag go into
 * a device error word, which kl__cuda_err_word reads when the call ends
 * (and clears). While the word is set, the later cache writes of the call
 * write nothing either (the CPU stops at the refused step). The check is on
 * the device so the step stays one launch inside a CUDA graph.
 *
 * The same module holds the value check (kl_check_range: a compiled
 * replay's kl_sdpa_lengths lengths against the cache), launched before the
 * call's steps into the same word, so a call with bad lengths writes no
 * cache either and its host waits once, at the end, not also before.
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/device.h"

#define CW_THREADS 256

typedef struct kl_cuda_cw {
	kl_cuda_module *mod;
	CUfunction fn, check;
	CUdeviceptr err; /* [0]: the first bad row + 1 (0: none), [1]: its position, [2]: tag */
} kl_cuda_cw;

static const char cw_body[] =
        "template <typename E>\n"
        "__device__ __forceinline__ void kl_cw_copy(char *out, const char *val, long long d,\n"
        "                                           long long e)\n"
        "{ ((E *)out)[d] = ((const E *)val)[e]; }\n"
        "__device__ __forceinline__ long long kl_cw_pos(const void *pos, int pos64, long long i)\n"
        "{ return pos64 ? ((const long long *)pos)[i] : (long long)((const int *)pos)[i]; }\n"
        "extern \"C\" __global__ void __launch_bounds__(256)\n"
        "kl_cache_write(char *out, const char *val, const void *pos, int pos64,\n"
        "               long long rows, long long outer, long long cap, long long s,\n"
        "               long long inner, long long vrs, int es, unsigned long long *err,\n"
        "               unsigned long long tag)\n"
        "{\n"
        "\t/* every block reads every position before any element is written, and\n"
        "\t * all blocks decide alike: a bad position writes nothing, on any row.\n"
        "\t * A write refused earlier in this call (err set) stops this one too. */\n"
        "\tint bad = 0;\n"
        "\tfor (long long i = threadIdx.x; i < rows; i += blockDim.x) {\n"
        "\t\tlong long p = kl_cw_pos(pos, pos64, i);\n"
        "\t\tbad |= p < 0 || p > cap - s;\n"
        "\t}\n"
        "\tif (threadIdx.x == 0)\n"
        "\t\tbad |= *(volatile unsigned long long *)err != 0ull;\n"
        "\tif (__syncthreads_or(bad)) {\n"
        "\t\tif (blockIdx.x != 0 || threadIdx.x != 0)\n"
        "\t\t\treturn;\n"
        "\t\tfor (long long i = 0; i < rows; i++) {\n"
        "\t\t\tlong long p = kl_cw_pos(pos, pos64, i);\n"
        "\t\t\tif (p < 0 || p > cap - s) {\n"
        "\t\t\t\tif (atomicCAS(err, 0ull, (unsigned long long)(i + 1)) == 0ull) {\n"
        "\t\t\t\t\terr[1] = (unsigned long long)p;\n"
        "\t\t\t\t\terr[2] = tag;\n"
        "\t\t\t\t}\n"
        "\t\t\t\tbreak;\n"
        "\t\t\t}\n"
        "\t\t}\n"
        "\t\treturn;\n"
        "\t}\n"
        "\tlong long n = rows * outer * s * inner;\n"
        "\tfor (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;\n"
        "\t     e += (long long)gridDim.x * blockDim.x) {\n"
        "\t\tlong long k = e % inner, t = e / inner;\n"
        "\t\tlong long j = t % s;\n"
        "\t\tt /= s;\n"
        "\t\tlong long a = t % outer, i = t / outer;\n"
        "\t\tlong long d = ((i * outer + a) * cap + kl_cw_pos(pos, pos64, i) + j) * inner + k;\n"
        "\t\tlong long v = i * vrs + e - i * outer * s * inner; /* rows vrs apart */\n"
        "\t\tswitch (es) {\n"
        "\t\tcase 1: kl_cw_copy<unsigned char>(out, val, d, v); break;\n"
        "\t\tcase 2: kl_cw_copy<unsigned short>(out, val, d, v); break;\n"
        "\t\tcase 4: kl_cw_copy<unsigned int>(out, val, d, v); break;\n"
        "\t\tdefault: kl_cw_copy<unsigned long long>(out, val, d, v); break;\n"
        "\t\t}\n"
        "\t}\n"
        "}\n"
        "/* a value check: the first of v[0..n) (stride st) outside [0, hi] into the\n"
        " * error word, unless it holds an error already; one block */\n"
        "extern \"C\" __global__ void __launch_bounds__(256)\n"
        "kl_check_range(const void *v, int v64, long long n, long long st, long long hi,\n"
        "               unsigned long long *err, unsigned long long tag)\n"
        "{\n"
        "\t__shared__ long long first;\n"
        "\tif (threadIdx.x == 0)\n"
        "\t\tfirst = n;\n"
        "\t__syncthreads();\n"
        "\tfor (long long i = threadIdx.x; i < n; i += blockDim.x) {\n"
        "\t\tlong long x = kl_cw_pos(v, v64, i * st);\n"
        "\t\tif (x < 0 || x > hi) {\n"
        "\t\t\tatomicMin(&first, i);\n"
        "\t\t\tbreak;\n"
        "\t\t}\n"
        "\t}\n"
        "\t__syncthreads();\n"
        "\tif (threadIdx.x == 0 && first < n &&\n"
        "\t    atomicCAS(err, 0ull, (unsigned long long)(first + 1)) == 0ull) {\n"
        "\t\terr[1] = (unsigned long long)kl_cw_pos(v, v64, first * st);\n"
        "\t\terr[2] = tag;\n"
        "\t}\n"
        "}\n";

char *kl__cuda_cache_write_source(void)
{
	kl_sb sb = {0};
	kl__sb_printf(&sb, "#include \"%s\"\n%s", KL_CUDA_PRELUDE_NAME, cw_body);
	if (sb.oom) {
		kl__sb_free(&sb);
		return NULL;
	}
	return sb.s;
}

void kl__cuda_cache_write_release(kl_cuda_dev *d)
{
	kl_cuda_cw *W = d->cw;
	if (!W)
		return;
	kl__cuda_module_free(W->mod);
	if (W->err)
		kl__cuda_free(NULL, d, W->err);
	free(W);
	d->cw = NULL;
}

static kl_status get_fn(kl_ctx *ctx, kl_cuda_dev *d, kl_cuda_cw **out)
{
	if (!d->cw && !(d->cw = calloc(1, sizeof *d->cw)))
		return kl__err(ctx, KL_ENOMEM, "kl_cache_write: out of memory");
	kl_cuda_cw *W = d->cw;
	if (!W->err) {
		kl_status st = kl__cuda_malloc(ctx, d, 3 * sizeof(uint64_t), &W->err);
		if (st == KL_OK)
			st = kl__cuda_memset(ctx, d, W->err, 0, 3 * sizeof(uint64_t));
		if (st != KL_OK)
			return st;
	}
	if (!W->mod) {
		char *src = kl__cuda_cache_write_source();
		if (!src)
			return kl__err(ctx, KL_ENOMEM, "kl_cache_write: out of memory");
		kl_cuda_module *m = NULL;
		kl_status st = kl__cuda_module_cached(ctx, d, src, "kiln_cache_write.cu", false, &m);
		free(src);
		if (st == KL_OK)
			st = kl__cuda_module_fn(ctx, m, "kl_cache_write", &W->fn);
		if (st == KL_OK)
			st = kl__cuda_module_fn(ctx, m, "kl_check_range", &W->check);
		if (st != KL_OK) {
			kl__cuda_module_free(m);
			return st;
		}
		W->mod = m;
	}
	*out = W;
	return KL_OK;
}

kl_status kl__cuda_cache_write_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_cw_step *c,
                                    kl_dtype dt, kl_dtype pdt, CUdeviceptr cache,
                                    CUdeviceptr pos, CUdeviceptr val, CUdeviceptr out,
                                    uint64_t tag)
{
	kl_cuda_cw *W = NULL;
	kl_status st = get_fn(ctx, d, &W);
	if (st != KL_OK)
		return st;
	int es = (int)kl_dtype_size(dt);
	if (out != cache)
		st = kl__cuda_d2d(ctx, d, out, cache,
		                  (size_t)(c->R * c->outer * c->cap * c->inner) * (size_t)es);
	int64_t n = c->rows * c->outer * c->s * c->inner;
	if (st != KL_OK || n == 0)
		return st;
	struct {
		CUdeviceptr out, val, pos;
		int pos64;
		long long rows, outer, cap, s, inner, vrs;
		int es;
		CUdeviceptr err;
		unsigned long long tag;
	} args;
	void *argv[] = {&args.out,   &args.val,   &args.pos, &args.pos64, &args.rows,
	                &args.outer, &args.cap,   &args.s,   &args.inner, &args.vrs,
	                &args.es,    &args.err,   &args.tag};
	args.out = out;
	args.val = val;
	args.pos = pos;
	args.pos64 = pdt == KL_I64;
	args.rows = c->rows;
	args.outer = c->outer;
	args.cap = c->cap;
	args.s = c->s;
	args.inner = c->inner;
	args.vrs = c->val_rs;
	args.es = es;
	args.err = W->err;
	args.tag = tag;
	int64_t blocks = (n + CW_THREADS - 1) / CW_THREADS, most = (int64_t)d->sm_count * 32;
	if (most > 0 && blocks > most)
		blocks = most;
	unsigned grid[3] = {(unsigned)(blocks > 0 ? blocks : 1), 1, 1};
	unsigned block[3] = {CW_THREADS, 1, 1};
	return kl__cuda_launch(ctx, d, W->fn, grid, block, 0, argv, 0);
}

kl_status kl__cuda_value_check(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr v, kl_dtype dt,
                               int64_t n, int64_t stride, int64_t hi, uint64_t tag)
{
	kl_cuda_cw *W = NULL;
	kl_status st = get_fn(ctx, d, &W);
	if (st != KL_OK || n <= 0)
		return st;
	struct {
		CUdeviceptr v;
		int v64;
		long long n, st, hi;
		CUdeviceptr err;
		unsigned long long tag;
	} a = {v, dt == KL_I64, n, stride, hi, W->err, tag};
	void *argv[] = {&a.v, &a.v64, &a.n, &a.st, &a.hi, &a.err, &a.tag};
	unsigned grid[3] = {1, 1, 1}, block[3] = {CW_THREADS, 1, 1};
	return kl__cuda_launch(ctx, d, W->check, grid, block, 0, argv, 0);
}

kl_status kl__cuda_err_word(kl_ctx *ctx, kl_cuda_dev *d, uint64_t e[3])
{
	e[0] = e[1] = e[2] = 0;
	kl_cuda_cw *W = d->cw;
	if (!W || !W->err)
		return KL_OK;
	kl_status st = kl__cuda_d2h(ctx, d, e, W->err, 3 * sizeof *e);
	if (st != KL_OK || e[0] == 0)
		return st;
	return kl__cuda_memset(ctx, d, W->err, 0, 3 * sizeof *e);
}

kl_status kl__cuda_cache_write_check(kl_ctx *ctx, kl_cuda_dev *d, const kl_step *steps,
                                     int32_t nsteps)
{
	uint64_t e[3];
	kl_status st = kl__cuda_err_word(ctx, d, e);
	return st != KL_OK || e[0] == 0 ? st : kl__cuda_cache_write_err(ctx, e, steps, nsteps);
}

kl_status kl__cuda_cache_write_err(kl_ctx *ctx, const uint64_t e[3], const kl_step *steps,
                                   int32_t nsteps)
{
	/* the tag is the step's index + 1 */
	const kl_cw_step *c = e[2] >= 1 && e[2] <= (uint64_t)nsteps &&
	                                      steps[e[2] - 1].kind == KL_STEP_CACHE_WRITE
	                              ? &steps[e[2] - 1].cw
	                              : NULL;
	if (!c)
		return kl__err(ctx, KL_EINVAL, "kl_cache_write: row %lld writes at %lld, outside the "
		               "cache; nothing was written", (long long)(e[0] - 1),
		               (long long)(int64_t)e[1]);
	return kl__err(ctx, KL_EINVAL, "kl_cache_write: row %lld writes %lld position%s at %lld, "
	               "outside the cache: positions along dim %d must lie in [0, %lld] (capacity "
	               "%lld); nothing was written",
	               (long long)(e[0] - 1), (long long)c->s, c->s == 1 ? "" : "s",
	               (long long)(int64_t)e[1], c->axis, (long long)(c->cap - c->s),
	               (long long)c->cap);
}

kl_status kl__cuda_cache_write_eager(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in,
                                     kl_tensor *out)
{
	kl_cw_geom g;
	char why[400];
	for (int i = 0; i < 3; i++)
		if (!kl__strides_contiguous(in[i]->ndim, in[i]->shape, in[i]->strides))
			return kl__err(ctx, KL_EINVAL, "kl_cache_write: operand %d is not dense", i);
	if (!kl__cache_write_geom(n->a.axis, in[0]->ndim, in[0]->shape, in[1]->ndim, in[1]->shape,
	                          in[2]->ndim, in[2]->shape, &g, why, sizeof why))
		return kl__err(ctx, KL_EINVAL, "kl_cache_write: %s", why);
	kl_step one = {.kind = KL_STEP_CACHE_WRITE,
	               .cw = {.rows = g.rows, .R = g.R, .outer = g.outer, .cap = g.cap,
	                      .s = g.s, .inner = g.inner, .val_rs = g.vrs, .axis = n->a.axis}};
	const kl_cw_step *c = &one.cw;
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	kl_status st = kl__cuda_cache_write_step(
	        ctx, d, c, out->dtype, in[1]->dtype, (CUdeviceptr)(uintptr_t)kl__tensor_data(in[0]),
	        (CUdeviceptr)(uintptr_t)kl__tensor_data(in[1]),
	        (CUdeviceptr)(uintptr_t)kl__tensor_data(in[2]),
	        (CUdeviceptr)(uintptr_t)kl__tensor_data(out), 1);
	return st == KL_OK ? kl__cuda_cache_write_check(ctx, d, &one, 1) : st;
}
