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
	int per_sm[4]; /* resident blocks an SM (the occupancy query's, else 8) */
	CUdeviceptr table, done;
	size_t table_cap;
} kl_cuda_optim;

/* One table entry, laid out as the kernel's kl_opt_item. */
typedef struct dev_item {
	uint64_t p, g, m, v, vmax, step;
	int64_t n, first;
} dev_item;

/* The kernel. A block takes a chunk of OPT_CHUNK elements of one parameter
 * at a time (a grid-stride walk over all chunks); its coefficients (bias
 * corrections: two pow() in double) are worked out again only when the
 * block's parameter changes. A chunk whose arrays are all 16-byte aligned
 * is moved in 16-byte vectors (8 bf16/f16, 4 f32, 2 f64 elements a load),
 * OPT_UNROLL vectors a thread loaded before any is stored, so that each
 * thread has OPT_UNROLL * 4 loads in flight (parameter, gradient, both
 * moments); the chunk's tail and unaligned arrays (views at odd offsets)
 * go one element at a time. Only the arrays the algorithm reads are
 * touched: SGD without momentum reads no moment. The per-element math is
 * kl_opt_one's, the same for both paths and as optim_cpu.c's. */
#define OPT_UNROLL 2
static const char optim_body[] =
        "struct kl_opt_item { T *p; const T *g; T *m; T *v; T *vmax; float *step;\n"
        "\tlong long n, first; };\n"
        "struct kl_opt_args {\n"
        "\tconst kl_opt_item *items; unsigned *done; const double *lr;\n"
        "\tlong long chunks; int n, algo, nesterov, amsgrad;\n"
        "\tdouble wd, mom, damp, b1, b2, eps;\n"
        "};\n"
        "#define VEC (16 / (int)sizeof(T))\n"
        "union kl_ov { uint4 u; T e[VEC]; };\n"
        "/* one element: p, m, v (as stored) and vm updated in place */\n"
        "__device__ __forceinline__ void kl_opt_one(const kl_opt_args &a, const R *coef, bool first,\n"
        "\t\tR &p, R g, R &m, R &v, R &vm) {\n"
        "\tif (a.algo == 2) {\n"
        "\t\tm = m + (R)(1.0 - a.b1) * (g - m);\n"
        "\t\tv = v * (R)a.b2 + (R)(1.0 - a.b2) * g * g;\n"
        "\t\tR vv = v;\n"
        "\t\tif (a.amsgrad) {\n"
        "\t\t\tvv = (vm != vm || vm > v) ? vm : v;\n"
        "\t\t\tvm = vv;\n"
        "\t\t}\n"
        "\t\tR den = sqrt(vv) / coef[2] + (R)a.eps;\n"
        "\t\tp = p * coef[0] - coef[1] * (m / den);\n"
        "\t} else {\n"
        "\t\tR d = a.wd != 0.0 ? g + (R)a.wd * p : g;\n"
        "\t\tif (a.mom != 0.0) {\n"
        "\t\t\tm = first ? d : m * (R)a.mom + (R)(1.0 - a.damp) * d;\n"
        "\t\t\td = a.nesterov ? d + (R)a.mom * m : m;\n"
        "\t\t}\n"
        "\t\tp = p - coef[1] * d;\n"
        "\t}\n"
        "}\n"
        "extern \"C\" __global__ void __launch_bounds__(" KL_STR(OPT_THREADS) ")\n"
        "kl_optim_step(kl_opt_args a) {\n"
        "\t__shared__ R coef[4]; /* decay, step size, sqrt(bc2) | lr; first */\n"
        "\t__shared__ int item;\n"
        "\tconst bool useM = a.algo == 2 || a.mom != 0.0, useV = a.algo == 2;\n"
        "\tconst bool useX = a.algo == 2 && a.amsgrad;\n"
        "\tint have = -1; /* the item coef was worked out for (thread 0's) */\n"
        "\tif (threadIdx.x == 0) coef[0] = coef[1] = coef[2] = coef[3] = (R)0;\n"
        "\tfor (long long c = blockIdx.x; c < a.chunks; c += gridDim.x) {\n"
        "\t\tif (threadIdx.x == 0) {\n"
        "\t\t\tint lo = 0, hi = a.n - 1; /* the last item whose first chunk <= c */\n"
        "\t\t\twhile (lo < hi) {\n"
        "\t\t\t\tint mid = (lo + hi + 1) / 2;\n"
        "\t\t\t\tif (a.items[mid].first <= c) lo = mid; else hi = mid - 1;\n"
        "\t\t\t}\n"
        "\t\t\titem = lo;\n"
        "\t\t\tif (lo != have) {\n"
        "\t\t\t\thave = lo;\n"
        "\t\t\t\tdouble lr = *a.lr, s = (double)*a.items[lo].step;\n"
        "\t\t\t\tif (a.algo == 2) {\n"
        "\t\t\t\t\tcoef[0] = (R)(1.0 - lr * a.wd);\n"
        "\t\t\t\t\tcoef[1] = (R)(lr / (1.0 - pow(a.b1, s + 1.0)));\n"
        "\t\t\t\t\tcoef[2] = (R)sqrt(1.0 - pow(a.b2, s + 1.0));\n"
        "\t\t\t\t} else {\n"
        "\t\t\t\t\tcoef[1] = (R)lr;\n"
        "\t\t\t\t\tcoef[3] = s == 0.0 ? (R)1 : (R)0;\n"
        "\t\t\t\t}\n"
        "\t\t\t}\n"
        "\t\t}\n"
        "\t\t__syncthreads();\n"
        "\t\tconst kl_opt_item it = a.items[item];\n"
        "\t\tconst R cf[3] = {coef[0], coef[1], coef[2]};\n"
        "\t\tconst bool first = coef[3] != (R)0;\n"
        "\t\tlong long base = (c - it.first) * " KL_STR(OPT_CHUNK) "LL;\n"
        "\t\tlong long lim = it.n - base;\n"
        "\t\tif (lim > " KL_STR(OPT_CHUNK) "LL) lim = " KL_STR(OPT_CHUNK) "LL;\n"
        "\t\tT *p = it.p + base, *m = it.m + base, *v = it.v + base, *x = it.vmax + base;\n"
        "\t\tconst T *g = it.g + base;\n"
        "\t\tunsigned long long al = (unsigned long long)p | (unsigned long long)g;\n"
        "\t\tif (useM) al |= (unsigned long long)m;\n"
        "\t\tif (useV) al |= (unsigned long long)v;\n"
        "\t\tif (useX) al |= (unsigned long long)x;\n"
        "\t\tconst int nv = (al & 15ull) == 0 ? (int)(lim / VEC) : 0;\n"
        "\t\tconst int U = " KL_STR(OPT_UNROLL) ", step = (int)blockDim.x;\n"
        "\t\tfor (int k0 = threadIdx.x; k0 < nv; k0 += U * step) {\n"
        "\t\t\tkl_ov P[U], G[U], M[U], V[U], X[U];\n"
        "#pragma unroll\n"
        "\t\t\tfor (int u = 0; u < U; u++) {\n"
        "\t\t\t\tint k = k0 + u * step;\n"
        "\t\t\t\tif (k >= nv) break;\n"
        "\t\t\t\tP[u].u = ((const uint4 *)p)[k];\n"
        "\t\t\t\tG[u].u = ((const uint4 *)g)[k];\n"
        "\t\t\t\tif (useM) M[u].u = ((const uint4 *)m)[k];\n"
        "\t\t\t\tif (useV) V[u].u = ((const uint4 *)v)[k];\n"
        "\t\t\t\tif (useX) X[u].u = ((const uint4 *)x)[k];\n"
        "\t\t\t}\n"
        "#pragma unroll\n"
        "\t\t\tfor (int u = 0; u < U; u++) {\n"
        "\t\t\t\tint k = k0 + u * step;\n"
        "\t\t\t\tif (k >= nv) break;\n"
        "#pragma unroll\n"
        "\t\t\t\tfor (int e = 0; e < VEC; e++) {\n"
        "\t\t\t\t\tR pe = ld(P[u].e[e]), me = useM ? ld(M[u].e[e]) : (R)0;\n"
        "\t\t\t\t\tR ve = useV ? ld(V[u].e[e]) : (R)0, xe = useX ? ld(X[u].e[e]) : (R)0;\n"
        "\t\t\t\t\tkl_opt_one(a, cf, first, pe, ld(G[u].e[e]), me, ve, xe);\n"
        "\t\t\t\t\tP[u].e[e] = st(pe);\n"
        "\t\t\t\t\tif (useM) M[u].e[e] = st(me);\n"
        "\t\t\t\t\tif (useV) V[u].e[e] = st(ve);\n"
        "\t\t\t\t\tif (useX) X[u].e[e] = st(xe);\n"
        "\t\t\t\t}\n"
        "\t\t\t\t((uint4 *)p)[k] = P[u].u;\n"
        "\t\t\t\tif (useM) ((uint4 *)m)[k] = M[u].u;\n"
        "\t\t\t\tif (useV) ((uint4 *)v)[k] = V[u].u;\n"
        "\t\t\t\tif (useX) ((uint4 *)x)[k] = X[u].u;\n"
        "\t\t\t}\n"
        "\t\t}\n"
        "\t\tfor (long long i = (long long)nv * VEC + threadIdx.x; i < lim; i += step) {\n"
        "\t\t\tR pe = ld(p[i]), me = useM ? ld(m[i]) : (R)0;\n"
        "\t\t\tR ve = useV ? ld(v[i]) : (R)0, xe = useX ? ld(x[i]) : (R)0;\n"
        "\t\t\tkl_opt_one(a, cf, first, pe, ld(g[i]), me, ve, xe);\n"
        "\t\t\tp[i] = st(pe);\n"
        "\t\t\tif (useM) m[i] = st(me);\n"
        "\t\t\tif (useV) v[i] = st(ve);\n"
        "\t\t\tif (useX) x[i] = st(xe);\n"
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
		/* the grid is as many blocks as the SMs hold at once: one wave,
		 * each block walking its chunks (no tail wave of idle SMs) */
		int nb = 0;
		if (kl__cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(&nb, O->fn[k], OPT_THREADS, 0) !=
		            CUDA_SUCCESS ||
		    nb <= 0)
			nb = 8;
		O->per_sm[k] = nb;
	}
	*out = O->fn[k];
	return KL_OK;
}

/* Write l's pointer table into the device buffer *table of *cap bytes
 * (grown as needed: the stream orders the copy after the launch that last
 * read it) and load l's kernel; *chunks: the launch's chunks. */
static kl_status put_table(kl_ctx *ctx, kl_cuda_dev *d, const kl_optim_launch *l,
                           CUdeviceptr *table, size_t *cap, int64_t *chunks)
{
	int k = dt_slot(l->dtype);
	if (k < 0)
		return kl__err(ctx, KL_EINVAL, "kl_optim_step: parameters of dtype %s",
		               kl_dtype_name(l->dtype));
	CUfunction fn = NULL;
	kl_status st = get_fn(ctx, d, k, l->dtype, &fn);
	if (st != KL_OK)
		return st;
	size_t bytes = sizeof(dev_item) * (size_t)(l->n > 0 ? l->n : 1);
	dev_item *host = malloc(bytes);
	if (!host)
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	*chunks = kl__optim_table(l, OPT_CHUNK, host);
	if (bytes > *cap) {
		if (*table)
			kl__cuda_free(ctx, d, *table);
		*table = 0;
		*cap = 0;
		st = kl__cuda_malloc(ctx, d, bytes, table);
		if (st == KL_OK)
			*cap = bytes;
	}
	if (st == KL_OK)
		st = kl__cuda_h2d(ctx, d, *table, host, bytes);
	free(host);
	return st;
}

/* The kernel over the table at `table` (put_table's): one launch, no
 * allocation and no copy, so a CUDA graph can capture it. */
static kl_status launch_over(kl_ctx *ctx, kl_cuda_dev *d, const kl_optim_launch *l,
                             CUdeviceptr table, int64_t chunks)
{
	int k = dt_slot(l->dtype);
	kl_cuda_optim *O = d->optim;
	if (k < 0 || !O || !O->fn[k])
		return kl__err(ctx, KL_ESTATE, "kl_optim_step: the %s kernel is not loaded",
		               kl_dtype_name(l->dtype));
	struct {
		CUdeviceptr items, done, lr;
		long long chunks;
		int n, algo, nesterov, amsgrad;
		double wd, mom, damp, b1, b2, eps;
	} args = {table,          O->done,      (CUdeviceptr)(uintptr_t)l->lr,
	          chunks,         l->n,         (int)l->algo,
	          l->nesterov,    l->amsgrad,   l->weight_decay,
	          l->momentum,    l->dampening, l->beta1,
	          l->beta2,       l->eps};
	int64_t wave = (int64_t)d->sm_count * O->per_sm[k];
	int64_t blocks = chunks < wave ? chunks : wave;
	unsigned grid[3] = {(unsigned)(blocks > 0 ? blocks : 1), 1, 1};
	unsigned block[3] = {OPT_THREADS, 1, 1};
	void *argv[] = {&args};
	return kl__cuda_launch(ctx, d, O->fn[k], grid, block, 0, argv, 0);
}

kl_status kl__cuda_optim_step(kl_ctx *ctx, const kl_optim_launch *l)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	if (l->n <= 0)
		return KL_OK;
	if (!d->optim && !(d->optim = calloc(1, sizeof *d->optim)))
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	int64_t chunks = 0;
	kl_status st = put_table(ctx, d, l, &d->optim->table, &d->optim->table_cap, &chunks);
	return st == KL_OK ? launch_over(ctx, d, l, d->optim->table, chunks) : st;
}

kl_status kl__cuda_optim_table(kl_ctx *ctx, const kl_optim_launch *l, void **table, size_t *cap)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	CUdeviceptr t = (CUdeviceptr)(uintptr_t)*table;
	int64_t chunks = 0;
	kl_status st = put_table(ctx, d, l, &t, cap, &chunks);
	*table = (void *)(uintptr_t)t;
	return st;
}

kl_status kl__cuda_optim_launch(kl_ctx *ctx, const kl_optim_launch *l, const void *table)
{
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	int64_t chunks = 0;
	for (int i = 0; i < l->n; i++)
		chunks += (l->items[i].n + OPT_CHUNK - 1) / OPT_CHUNK;
	return l->n <= 0 ? KL_OK : launch_over(ctx, d, l, (CUdeviceptr)(uintptr_t)table, chunks);
}
