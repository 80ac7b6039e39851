/* optim_cuda.c - the fused optimizer step on CUDA (kl_backend.optim_step):
 * every parameter of a launch updated by one kernel launch, apex's
 * multi-tensor apply. The host writes a pointer table (one 64-byte entry a
 * parameter: its arrays, step count, size and first chunk) into a device
 * buffer on the stream; the grid walks the flattened chunks of all
 * parameters, each block finding its parameter by binary search over the
 * first chunks. Step counts: every block reads a parameter's count before
 * it is incremented; the last block to finish (a device counter it resets)
 * increments them all, so the count moves in the same launch.
 *
 * The kernel source is fixed (kl__cuda_optim_source), compiled per dtype
 * through NVRTC and the disk cache like the attention kernels. It computes
 * in f32 (f64 for f64) and rounds once, as backend/cpu/optim_cpu.c does.
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/device.h"

#define OPT_CHUNK 4096
#define OPT_THREADS 256
#define STR_(x) #x
#define KL_STR(x) STR_(x)

typedef struct kl_cuda_optim {
	kl_cuda_module *mod[4];
	CUfunction fn[4];
	CUdeviceptr table, done;
	size_t table_cap;
} kl_cuda_optim;

/* One table entry, laid out as the kernel's kl_opt_item. */
typedef struct dev_item {
	uint64_t p, g, m, v, vmax, step;
	int64_t n, first;
} dev_item;

static const char optim_body[] =
        "struct kl_opt_item { T *p; const T *g; T *m; T *v; T *vmax; float *step;\n"
        "\tlong long n, first; };\n"
        "struct kl_opt_args {\n"
        "\tconst kl_opt_item *items; unsigned *done; const double *lr;\n"
        "\tlong long chunks; int n, algo, nesterov, amsgrad;\n"
        "\tdouble wd, mom, damp, b1, b2, eps;\n"
        "};\n"
        "extern \"C\" __global__ void __launch_bounds__(" KL_STR(OPT_THREADS) ")\n"
        "kl_optim_step(kl_opt_args a) {\n"
        "\t__shared__ R coef[4]; /* decay, step size, sqrt(bc2) | lr; first */\n"
        "\t__shared__ int item;\n"
        "\tfor (long long c = blockIdx.x; c < a.chunks; c += gridDim.x) {\n"
        "\t\tif (threadIdx.x == 0) {\n"
        "\t\t\tint lo = 0, hi = a.n - 1; /* the last item whose first chunk <= c */\n"
        "\t\t\twhile (lo < hi) {\n"
        "\t\t\t\tint mid = (lo + hi + 1) / 2;\n"
        "\t\t\t\tif (a.items[mid].first <= c) lo = mid; else hi = mid - 1;\n"
        "\t\t\t}\n"
        "\t\t\titem = lo;\n"
        "\t\t\tdouble lr = *a.lr, s = (double)*a.items[lo].step;\n"
        "\t\t\tif (a.algo == 2) {\n"
        "\t\t\t\tcoef[0] = (R)(1.0 - lr * a.wd);\n"
        "\t\t\t\tcoef[1] = (R)(lr / (1.0 - pow(a.b1, s + 1.0)));\n"
        "\t\t\t\tcoef[2] = (R)sqrt(1.0 - pow(a.b2, s + 1.0));\n"
        "\t\t\t} else {\n"
        "\t\t\t\tcoef[1] = (R)lr;\n"
        "\t\t\t\tcoef[3] = s == 0.0 ? (R)1 : (R)0;\n"
        "\t\t\t}\n"
        "\t\t}\n"
        "\t\t__syncthreads();\n"
        "\t\tconst kl_opt_item it = a.items[item];\n"
        "\t\tconst R decay = coef[0], ss = coef[1], bc2 = coef[2];\n"
        "\t\tconst bool first = coef[3] != (R)0;\n"
        "\t\tlong long base = (c - it.first) * " KL_STR(OPT_CHUNK) "LL;\n"
        "\t\tfor (int k = threadIdx.x; k < " KL_STR(OPT_CHUNK) "; k += blockDim.x) {\n"
        "\t\t\tlong long i = base + k;\n"
        "\t\t\tif (i >= it.n) break;\n"
        "\t\t\tR p = ld(it.p[i]), g = ld(it.g[i]);\n"
        "\t\t\tif (a.algo == 2) {\n"
        "\t\t\t\tR m = ld(it.m[i]), v = ld(it.v[i]);\n"
        "\t\t\t\tm = m + (R)(1.0 - a.b1) * (g - m);\n"
        "\t\t\t\tv = v * (R)a.b2 + (R)(1.0 - a.b2) * g * g;\n"
        "\t\t\t\tit.m[i] = st(m);\n"
        "\t\t\t\tit.v[i] = st(v);\n"
        "\t\t\t\tif (a.amsgrad) {\n"
        "\t\t\t\t\tR vm = ld(it.vmax[i]);\n"
        "\t\t\t\t\tv = (vm != vm || vm > v) ? vm : v;\n"
        "\t\t\t\t\tit.vmax[i] = st(v);\n"
        "\t\t\t\t}\n"
        "\t\t\t\tR den = sqrt(v) / bc2 + (R)a.eps;\n"
        "\t\t\t\tp = p * decay - ss * (m / den);\n"
        "\t\t\t} else {\n"
        "\t\t\t\tR d = a.wd != 0.0 ? g + (R)a.wd * p : g;\n"
        "\t\t\t\tif (a.mom != 0.0) {\n"
        "\t\t\t\t\tR b = first ? d : ld(it.m[i]) * (R)a.mom + (R)(1.0 - a.damp) * d;\n"
        "\t\t\t\t\tit.m[i] = st(b);\n"
        "\t\t\t\t\td = a.nesterov ? d + (R)a.mom * b : b;\n"
        "\t\t\t\t}\n"
        "\t\t\t\tp = p - ss * d;\n"
        "\t\t\t}\n"
        "\t\t\tit.p[i] = st(p);\n"
        "\t\t}\n"
        "\t\t__syncthreads(); /* coef and item are rewritten for the next chunk */\n"
        "\t}\n"
        "\t/* the last block to finish moves every step count (all blocks have\n"
        "\t * read them by then) and resets the counter for the next launch */\n"
        "\tif (threadIdx.x == 0) {\n"
        "\t\t__threadfence();\n"
        "\t\tif (atomicAdd(a.done, 1u) == gridDim.x - 1) {\n"
        "\t\t\tfor (int j = 0; j < a.n; j++) *a.items[j].step += 1.0f;\n"
        "\t\t\t*a.done = 0u;\n"
        "\t\t\t__threadfence();\n"
        "\t\t}\n"
        "\t}\n"
        "}\n";

static const char *const dt_head[4] = {
        /* f32 */ "typedef float T; typedef float R;\n"
                  "__device__ __forceinline__ R ld(T x) { return x; }\n"
                  "__device__ __forceinline__ T st(R x) { return x; }\n",
        /* f64 */ "typedef double T; typedef double R;\n"
                  "__device__ __forceinline__ R ld(T x) { return x; }\n"
                  "__device__ __forceinline__ T st(R x) { return x; }\n",
        /* f16 */ "typedef kl_f16 T; typedef float R;\n"
                  "__device__ __forceinline__ R ld(T x) { return kl_f16_to_f32(x); }\n"
                  "__device__ __forceinline__ T st(R x) { return kl_f32_to_f16(x); }\n",
        /* bf16 */ "typedef kl_bf16 T; typedef float R;\n"
                   "__device__ __forceinline__ R ld(T x) { return kl_bf16_to_f32(x); }\n"
                   "__device__ __forceinline__ T st(R x) { return kl_f32_to_bf16(x); }\n",
};

static int dt_slot(kl_dtype dt)
{
	switch (dt) {
	case KL_F32: return 0;
	case KL_F64: return 1;
	case KL_F16: return 2;
	case KL_BF16: return 3;
	default: return -1;
	}
}

char *kl__cuda_optim_source(kl_dtype dt)
{
	int k = dt_slot(dt);
	if (k < 0)
		return NULL;
	kl_sb sb = {0};
	kl__sb_printf(&sb, "#include \"%s\"\n%s%s", KL_CUDA_PRELUDE_NAME, dt_head[k], optim_body);
	if (sb.oom) {
		kl__sb_free(&sb);
		return NULL;
	}
	return sb.s;
}

int64_t kl__optim_table(const kl_optim_launch *l, int64_t chunk, void *out)
{
	dev_item *t = out;
	int64_t first = 0;
	for (int i = 0; i < l->n; i++) {
		const kl_optim_item *it = &l->items[i];
		t[i] = (dev_item){
		        .p = (uint64_t)(uintptr_t)it->p,
		        .g = (uint64_t)(uintptr_t)it->g,
		        .m = (uint64_t)(uintptr_t)it->m,
		        .v = (uint64_t)(uintptr_t)it->v,
		        .vmax = (uint64_t)(uintptr_t)it->vmax,
		        .step = (uint64_t)(uintptr_t)it->step,
		        .n = it->n,
		        .first = first,
		};
		first += (it->n + chunk - 1) / chunk;
	}
	return first;
}

size_t kl__optim_table_entry(void)
{
	return sizeof(dev_item);
}

void kl__cuda_optim_release(kl_cuda_dev *d)
{
	kl_cuda_optim *O = d->optim;
	if (!O)
		return;
	for (int k = 0; k < 4; k++)
		kl__cuda_module_free(O->mod[k]);
	if (O->table)
		kl__cuda_free(NULL, d, O->table);
	if (O->done)
		kl__cuda_free(NULL, d, O->done);
	free(O);
	d->optim = NULL;
}

static kl_status get_fn(kl_ctx *ctx, kl_cuda_dev *d, int k, kl_dtype dt, CUfunction *out)
{
	if (!d->optim && !(d->optim = calloc(1, sizeof *d->optim)))
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	kl_cuda_optim *O = d->optim;
	if (!O->done) {
		kl_status st = kl__cuda_malloc(ctx, d, sizeof(unsigned), &O->done);
		if (st == KL_OK)
			st = kl__cuda_memset(ctx, d, O->done, 0, sizeof(unsigned));
		if (st != KL_OK)
			return st;
	}
	if (!O->mod[k]) {
		char *src = kl__cuda_optim_source(dt);
		if (!src)
			return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
		kl_cuda_module *m = NULL;
		kl_status st = kl__cuda_module_cached(ctx, d, src, "kiln_optim.cu", false, &m);
		free(src);
		if (st == KL_OK)
			st = kl__cuda_module_fn(ctx, m, "kl_optim_step", &O->fn[k]);
		if (st != KL_OK) {
			kl__cuda_module_free(m);
			return st;
		}
		O->mod[k] = m;
	}
	*out = O->fn[k];
	return KL_OK;
}

kl_status kl__cuda_optim_step(kl_ctx *ctx, const kl_optim_launch *l)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	int k = dt_slot(l->dtype);
	if (k < 0)
		return kl__err(ctx, KL_EINVAL, "kl_optim_step: parameters of dtype %s",
		               kl_dtype_name(l->dtype));
	if (l->n <= 0)
		return KL_OK;
	CUfunction fn = NULL;
	kl_status st = get_fn(ctx, d, k, l->dtype, &fn);
	if (st != KL_OK)
		return st;
	kl_cuda_optim *O = d->optim;
	size_t bytes = sizeof(dev_item) * (size_t)l->n;
	dev_item *host = malloc(bytes);
	if (!host)
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	int64_t chunks = kl__optim_table(l, OPT_CHUNK, host);
	/* the table's buffer grows; the stream orders the copy after the
	 * launch that last read it */
	if (bytes > O->table_cap) {
		if (O->table)
			kl__cuda_free(ctx, d, O->table);
		O->table = 0;
		O->table_cap = 0;
		st = kl__cuda_malloc(ctx, d, bytes, &O->table);
		if (st == KL_OK)
			O->table_cap = bytes;
	}
	if (st == KL_OK)
		st = kl__cuda_h2d(ctx, d, O->table, host, bytes);
	free(host);
	if (st != KL_OK)
		return st;
	struct {
		CUdeviceptr items, done, lr;
		long long chunks;
		int n, algo, nesterov, amsgrad;
		double wd, mom, damp, b1, b2, eps;
	} args = {O->table,       O->done,      (CUdeviceptr)(uintptr_t)l->lr,
	          chunks,         l->n,         (int)l->algo,
	          l->nesterov,    l->amsgrad,   l->weight_decay,
	          l->momentum,    l->dampening, l->beta1,
	          l->beta2,       l->eps};
	int64_t blocks = chunks < (int64_t)d->sm_count * 8 ? chunks : (int64_t)d->sm_count * 8;
	unsigned grid[3] = {(unsigned)(blocks > 0 ? blocks : 1), 1, 1};
	unsigned block[3] = {OPT_THREADS, 1, 1};
	void *argv[] = {&args};
	return kl__cuda_launch(ctx, d, fn, grid, block, 0, argv, 0);
}
