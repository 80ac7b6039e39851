/* gemv_cuda.c - products with few rows (a decode step's x W^T at batch 1-4)
 * as one fixed kernel of kiln's own, in place of cuBLASLt.
 *
 * A product of m <= KL_GEMV_ROWS rows reads each weight element once and
 * does two flops with it: it is a read of the weight at the memory's speed
 * or nothing. cuBLASLt's kernels for m = 1 read the decode step's weights at
 * about 70% of the copy bandwidth kiln measures (decoder_token on an H100:
 * 2.14 TB/s against 3.03). Here a warp owns one output column: its lanes
 * read the column's weight row (k contiguous) 16 bytes at a time, 4 such
 * loads in flight a lane, each multiplied into every row of A (A is a few
 * KiB and stays in L1), the lanes' sums meet by shuffles, and lane 0 applies
 * the epilogue (alpha, beta * C, bias, relu or tanh GELU: cuBLASLt's) and
 * stores. One NVRTC module a dtype, compiled once through the disk cache
 * like the cache write's; a package carries it (pkg_cuda.c).
 *
 * kl__cuda_gemv_fits says which problems it takes: f16 or bf16 in and out,
 * one matrix (no batch), A with unit column stride, B with unit row stride
 * (a weight [n, k] read as its transpose), every row 16-byte aligned.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/device.h"

#define GV_WARPS 8 /* warps (columns) a block */
#define GV_STR_(x) #x
#define GV_STR(x) GV_STR_(x)

struct kl_cuda_gemv {
	kl_cuda_module *mod[2]; /* f16, bf16 */
	CUfunction fn[2];
	bool broken[2]; /* the module could not be had: cuBLASLt serves */
};

static const char gv_body[] =
        "#if KL_GV_DT == 2\n"
        "typedef kl_f16 T;\n"
        "__device__ __forceinline__ float2 cvt2(unsigned v) { return kl_f16x2_to_f32x2(v); }\n"
        "__device__ __forceinline__ float ld1(const T *p) { return kl_f16_to_f32(*p); }\n"
        "__device__ __forceinline__ void st1(T *p, float v) { *p = kl_f32_to_f16(v); }\n"
        "#else\n"
        "typedef kl_bf16 T;\n"
        "__device__ __forceinline__ float2 cvt2(unsigned v) { return kl_bf16x2_to_f32x2(v); }\n"
        "__device__ __forceinline__ float ld1(const T *p) { return kl_bf16_to_f32(*p); }\n"
        "__device__ __forceinline__ void st1(T *p, float v) { *p = kl_f32_to_bf16(v); }\n"
        "#endif\n"
        "#define ROWS " GV_STR(KL_GEMV_ROWS) "\n"
        "struct kl_gv_args {\n"
        "\tconst T *a, *b, *c, *bias;\n"
        "\tT *d;\n"
        "\tlong long m, n, k, a_rs, b_cs, ldc, ldd;\n"
        "\tfloat alpha, beta;\n"
        "\tint act, has_bias;\n"
        "};\n"
        "/* the dot of 8 elements of a and w, packed as 4 pairs */\n"
        "__device__ __forceinline__ float dot8(uint4 a, uint4 w) {\n"
        "\tfloat2 a0 = cvt2(a.x), a1 = cvt2(a.y), a2 = cvt2(a.z), a3 = cvt2(a.w);\n"
        "\tfloat2 w0 = cvt2(w.x), w1 = cvt2(w.y), w2 = cvt2(w.z), w3 = cvt2(w.w);\n"
        "\tfloat s = a0.x * w0.x;\n"
        "\ts = fmaf(a0.y, w0.y, s); s = fmaf(a1.x, w1.x, s); s = fmaf(a1.y, w1.y, s);\n"
        "\ts = fmaf(a2.x, w2.x, s); s = fmaf(a2.y, w2.y, s); s = fmaf(a3.x, w3.x, s);\n"
        "\treturn fmaf(a3.y, w3.y, s);\n"
        "}\n"
        "extern \"C\" __global__ void __launch_bounds__(" GV_STR(GV_WARPS) " * 32)\n"
        "kl_gemv(const kl_gv_args g) {\n"
        "\tkl_pdl_wait(); /* launched with KL_LAUNCH_PDL */\n"
        "\tint lane = threadIdx.x & 31;\n"
        "\tlong long col = (long long)blockIdx.x * " GV_STR(GV_WARPS) " + (threadIdx.x >> 5);\n"
        "\tif (col >= g.n) return;\n"
        "\tconst T *w = g.b + col * g.b_cs;\n"
        "\tfloat acc[ROWS];\n"
        "#pragma unroll\n"
        "\tfor (int r = 0; r < ROWS; r++) acc[r] = 0.0f;\n"
        "\t/* 4 loads of 16 bytes a lane in flight: 2 KiB of the row a warp */\n"
        "\tlong long kk = (long long)lane * 8;\n"
        "\tfor (; kk + 3 * 256 < g.k; kk += 4 * 256) {\n"
        "\t\tuint4 wv[4];\n"
        "#pragma unroll\n"
        "\t\tfor (int u = 0; u < 4; u++) wv[u] = kl_ld16(w + kk + u * 256);\n"
        "#pragma unroll\n"
        "\t\tfor (int r = 0; r < ROWS; r++) {\n"
        "\t\t\tif (r >= g.m) break;\n"
        "\t\t\tconst T *ar = g.a + r * g.a_rs + kk;\n"
        "#pragma unroll\n"
        "\t\t\tfor (int u = 0; u < 4; u++) acc[r] += dot8(kl_ld16(ar + u * 256), wv[u]);\n"
        "\t\t}\n"
        "\t}\n"
        "\tfor (; kk < g.k; kk += 256) {\n"
        "\t\tuint4 wv = kl_ld16(w + kk);\n"
        "#pragma unroll\n"
        "\t\tfor (int r = 0; r < ROWS; r++) {\n"
        "\t\t\tif (r >= g.m) break;\n"
        "\t\t\tacc[r] += dot8(kl_ld16(g.a + r * g.a_rs + kk), wv);\n"
        "\t\t}\n"
        "\t}\n"
        "#pragma unroll\n"
        "\tfor (int r = 0; r < ROWS; r++) {\n"
        "\t\tif (r >= g.m) break;\n"
        "\t\tfloat v = kl_warp_sum(acc[r]);\n"
        "\t\tif (lane != 0) continue;\n"
        "\t\tv *= g.alpha;\n"
        "\t\tif (g.beta != 0.0f) v += g.beta * ld1(g.c + r * g.ldc + col);\n"
        "\t\tif (g.has_bias) v += ld1(g.bias + col);\n"
        "\t\tif (g.act == 1) v = v > 0.0f || v != v ? v : 0.0f;\n"
        "\t\telse if (g.act == 2) {\n"
        "\t\t\t/* x * sigmoid(2u) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) */\n"
        "\t\t\tfloat u2 = 1.5957691216057308f * (v + 0.044715f * v * v * v);\n"
        "\t\t\tv = v / (1.0f + expf(-u2));\n"
        "\t\t}\n"
        "\t\tst1(g.d + r * g.ldd + col, v);\n"
        "\t}\n"
        "}\n";

char *kl__cuda_gemv_source(kl_dtype dt)
{
	if (dt != KL_F16 && dt != KL_BF16)
		return NULL;
	kl_sb sb = {0};
	kl__sb_printf(&sb, "#include \"%s\"\n#define KL_GV_DT %d\n%s", KL_CUDA_PRELUDE_NAME,
	              dt == KL_F16 ? 2 : 3, gv_body);
	if (sb.oom) {
		kl__sb_free(&sb);
		return NULL;
	}
	return sb.s;
}

void kl__cuda_gemv_release(kl_cuda_dev *d)
{
	kl_cuda_gemv *G = d->gemv;
	if (!G)
		return;
	for (int i = 0; i < 2; i++)
		kl__cuda_module_free(G->mod[i]);
	free(G);
	d->gemv = NULL;
}

static atomic_uint_fast64_t n_launches;

uint64_t kl__cuda_gemv_launches(void) { return (uint64_t)atomic_load(&n_launches); }

static bool al16(CUdeviceptr p) { return (p & 15u) == 0; }

bool kl__cuda_gemv_fits(const kl_gemm *g)
{
	if ((g->ab != KL_F16 && g->ab != KL_BF16) || g->cd != g->ab || g->batch != 1 ||
	    g->m < 1 || g->m > KL_GEMV_ROWS || g->n < 1 || g->n > (int64_t)INT32_MAX ||
	    g->k < 1 || g->k % 8)
		return false;
	if (g->m > 1 && g->a_cs != 1)
		return false;
	if (g->k > 1 && g->b_rs != 1)
		return false;
	if ((g->m > 1 && g->a_rs % 8) || (g->n > 1 && g->b_cs % 8) || !al16(g->a) || !al16(g->b))
		return false;
	switch (g->epi) {
	case KL_EPI_DEFAULT:
	case KL_EPI_RELU:
	case KL_EPI_GELU:
		return true;
	case KL_EPI_BIAS:
	case KL_EPI_RELU_BIAS:
	case KL_EPI_GELU_BIAS:
		return g->bias != 0;
	}
	return false;
}

static kl_status get_fn(kl_ctx *ctx, kl_cuda_dev *d, int di, CUfunction *out)
{
	if (!d->gemv && !(d->gemv = calloc(1, sizeof *d->gemv)))
		return kl__err(ctx, KL_ENOMEM, "kl_matmul: out of memory");
	kl_cuda_gemv *G = d->gemv;
	if (!G->mod[di]) {
		char *src = kl__cuda_gemv_source(di ? KL_BF16 : KL_F16);
		if (!src)
			return kl__err(ctx, KL_ENOMEM, "kl_matmul: out of memory");
		kl_cuda_module *m = NULL;
		kl_status st = kl__cuda_module_cached(ctx, d, src, "kiln_gemv.cu", false, &m);
		free(src);
		if (st == KL_OK)
			st = kl__cuda_module_fn(ctx, m, "kl_gemv", &G->fn[di]);
		if (st != KL_OK) {
			kl__cuda_module_free(m);
			return st;
		}
		G->mod[di] = m;
	}
	*out = G->fn[di];
	return KL_OK;
}

kl_status kl__cuda_gemv(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, bool *done)
{
	*done = false;
	int di = g->ab == KL_BF16;
	if (d->gemv && d->gemv->broken[di])
		return KL_OK;
	CUfunction f = NULL;
	if (get_fn(ctx, d, di, &f) != KL_OK) {
		/* no NVRTC and no package module (a package written before this
		 * kernel existed): the library product serves, as it did */
		kl__log(ctx, KL_LOG_FUSION, "kl_matmul: the few-row kernel is not available (%s): "
		        "cuBLASLt", kl_last_error(ctx));
		kl_clear_error(ctx);
		if (d->gemv)
			d->gemv->broken[di] = true;
		return KL_OK;
	}
	struct {
		CUdeviceptr a, b, c, bias, d;
		long long m, n, k, a_rs, b_cs, ldc, ldd;
		float alpha, beta;
		int act, has_bias;
	} args = {g->a, g->b, g->beta != 0 ? g->c : 0, g->bias, g->d, g->m, g->n, g->k, g->a_rs,
	          g->b_cs, g->ldc, g->ldd, (float)g->alpha, (float)g->beta, 0, 0};
	switch (g->epi) {
	case KL_EPI_RELU_BIAS:
		args.has_bias = 1; /* fall through */
	case KL_EPI_RELU:
		args.act = 1;
		break;
	case KL_EPI_GELU_BIAS:
		args.has_bias = 1; /* fall through */
	case KL_EPI_GELU:
		args.act = 2;
		break;
	case KL_EPI_BIAS:
		args.has_bias = 1;
		break;
	case KL_EPI_DEFAULT:
		break;
	}
	if (!args.has_bias)
		args.bias = 0;
	void *argv[1] = {&args};
	unsigned grid[3] = {(unsigned)((g->n + GV_WARPS - 1) / GV_WARPS), 1, 1};
	unsigned block[3] = {GV_WARPS * 32, 1, 1};
	kl_status st = kl__cuda_launch(ctx, d, f, grid, block, 0, argv, KL_LAUNCH_PDL);
	*done = st == KL_OK;
	if (*done)
		atomic_fetch_add(&n_launches, 1);
	return st;
}
