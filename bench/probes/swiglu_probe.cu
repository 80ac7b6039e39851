// swiglu_probe.cu - can one Hopper kernel compute h = silu(x Wg^T) * (x Wu^T)
// for the DecoderLayer's FFN (x 4096 x 2048, Wg and Wu 8192 x 2048, bf16) faster
// than kiln's two steps, cuBLASLt's gate/up product (331-410 us on an H200,
// 4096 x 16384 x 2048) and the silu-mul kernel (55-60 us)? The fused kernel
// never writes the 134 MB gate/up product nor reads it back.
//
// The kernel: 128 x 128 tiles of h (128 rows of x against 128 rows of Wg and
// the same 128 of Wu), a block a tile or persistent (one block an SM walking
// the tiles, its stage ring going on across them), the tiles in m-fast or
// n-fast order; 384 threads: warpgroup 0 the producer (one
// thread issues the TMA loads of a 64-wide K step, x's 128 x 64 tile and Wg's
// and Wu's 128 x 64 tiles, into STAGES mbarrier-guarded stages, 128-byte
// swizzle), warpgroups 1 and 2 the consumers (64 rows each, two m64n128k16
// accumulators: gate and up, 128 registers). A consumer keeps one K step's
// products in flight and releases a stage once the products that read it are
// done. The epilogue is silu(g) * u in registers, stored as bf16 pairs.
//
// Each variant is checked against float64 dot products at 4096 random outputs
// and timed; for scale, the same kernel with a single accumulator (gate only:
// half the FLOPs, the same loads of x) is a plain GEMM of that structure.
// Build and run on the GPU machine (not part of the library or its tests):
//   nvcc -O3 -arch=sm_90a -std=c++17 -o swiglu_probe bench/probes/swiglu_probe.cu && ./swiglu_probe
#include <cuda.h>
#include <cuda_bf16.h>
#include "probe.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { M = 4096, N = 8192, K = 2048, BM = 128, BN = 128, BK = 64, STAGES = 4 };
enum { TILE = BM * BK * 2 };                       // bytes of one 128 x 64 bf16 tile
enum { STAGE = 3 * TILE };                         // x, Wg, Wu
enum { SMEM = STAGES * STAGE + 1024 + 2 * STAGES * 8 };

__device__ __forceinline__ unsigned smem_u32(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

// K-major operand, 128-byte swizzle, 8-row groups 1024 bytes apart
__device__ __forceinline__ unsigned long long desc(unsigned addr)
{
	return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) |
	       ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void mb_init(unsigned bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_expect(unsigned bar, unsigned bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
	             : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned bar)
{
	asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned bar, unsigned parity)
{
	asm volatile("{\n.reg .pred p;\nsw_spin:\n"
	             "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra sw_spin;\n}\n" ::"r"(bar),
	             "r"(parity)
	             : "memory");
}
__device__ __forceinline__ void tma2(unsigned dst, const CUtensorMap *map, int c0, int c1, unsigned bar)
{
	asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
	             "{%2, %3}], [%4];\n" ::"r"(dst),
	             "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
	             : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
template <int N_> __device__ __forceinline__ void hold(float (&r)[N_][4])
{
#pragma unroll
	for (int i = 0; i < N_; i++)
#pragma unroll
		for (int j = 0; j < 4; j++)
			asm volatile("" : "+f"(r[i][j])::"memory");
}

#define D4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
__device__ __forceinline__ void mma128(float (&d)[16][4], unsigned long long da, unsigned long long db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
	             "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
	             "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
	             "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
	             "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
	             "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"
	             " %64, %65, p, 1, 1, 0, 0;\n}\n"
	             : D4(0), D4(1), D4(2), D4(3), D4(4), D4(5), D4(6), D4(7), D4(8), D4(9), D4(10), D4(11),
	               D4(12), D4(13), D4(14), D4(15)
	             : "l"(da), "l"(db), "r"(acc));
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// FUSED: h = silu(x Wg^T) * (x Wu^T); else h = x Wg^T (the comparison GEMM)
template <bool FUSED>
__global__ void __launch_bounds__(384, 1)
swiglu(const __grid_constant__ CUtensorMap mx, const __grid_constant__ CUtensorMap mg,
       const __grid_constant__ CUtensorMap mu, __nv_bfloat16 *h, int mfast)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) // wgmma and setmaxnreg: sm_90a only (nvcc's
                                       // -arch=sm_90a also makes compute_90 PTX)
	extern __shared__ uint4 smem[];
	unsigned char *sb = (unsigned char *)smem;
	sb += (1024 - (smem_u32(sb) & 1023)) & 1023;
	const unsigned base = smem_u32(sb), bars = base + STAGES * STAGE;
	const unsigned full = bars, empty = bars + 8 * STAGES;
	const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
	// tiles w = blockIdx.x, + gridDim.x, ... (a grid of one block a tile, or
	// persistent: one block an SM walking the tiles; the stage ring and its
	// parities go on across tiles, so the producer loads the next tile while
	// the consumers store this one). mfast: consecutive tiles take consecutive
	// row tiles of x against one column tile of the weights (a wave reads a
	// few weight tiles and all of x, which stay in L2); else consecutive weight
	// tiles against one x tile (a wave reads most of the 64 MB of weights,
	// more than L2 holds)
	const int mt = M / BM, ntiles = mt * (N / BN);
	const int nk = K / BK;
	const unsigned bytes = FUSED ? STAGE : 2 * TILE;
	if (tid == 0) {
		for (int s = 0; s < STAGES; s++) {
			mb_init(full + 8 * s, 1);
			mb_init(empty + 8 * s, 8);
		}
		asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
	}
	__syncthreads();
	if (wg == 0) {
		asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
		if (tid == 0) {
			int gk = 0; // k steps loaded so far, across tiles
			for (int w = blockIdx.x; w < ntiles; w += gridDim.x) {
				const int m0 = (mfast ? w % mt : w / (N / BN)) * BM;
				const int n0 = (mfast ? w / mt : w % (N / BN)) * BN;
				for (int t = 0; t < nk; t++, gk++) {
					int s = gk % STAGES;
					if (gk >= STAGES)
						mb_wait(empty + 8 * s, ((gk / STAGES) - 1) & 1);
					unsigned st = base + s * STAGE;
					mb_expect(full + 8 * s, bytes);
					tma2(st, &mx, t * BK, m0, full + 8 * s);
					tma2(st + TILE, &mg, t * BK, n0, full + 8 * s);
					if (FUSED)
						tma2(st + 2 * TILE, &mu, t * BK, n0, full + 8 * s);
				}
			}
		}
		return;
	}
	asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
	const int c = wg - 1; // consumer 0 or 1: rows c * 64 .. + 64 of the tile
	int gk = 0;
	for (int w = blockIdx.x; w < ntiles; w += gridDim.x) {
		const int m0 = (mfast ? w % mt : w / (N / BN)) * BM;
		const int n0 = (mfast ? w / mt : w % (N / BN)) * BN;
		float g[16][4], u[16][4];
#pragma unroll
		for (int i = 0; i < 16; i++)
#pragma unroll
			for (int j = 0; j < 4; j++)
				g[i][j] = u[i][j] = 0.f;
		for (int t = 0; t < nk; t++, gk++) {
			int s = gk % STAGES;
			mb_wait(full + 8 * s, (gk / STAGES) & 1);
			unsigned st = base + s * STAGE;
			unsigned long long da = desc(st + c * 64 * 128), dg = desc(st + TILE), du = desc(st + 2 * TILE);
			hold(g);
			if (FUSED)
				hold(u);
			wg_fence();
#pragma unroll
			for (int kk = 0; kk < BK / 16; kk++) {
				// k16 step kk: 32 bytes along a 128-byte swizzled row
				mma128(g, da + 2 * kk, dg + 2 * kk, 1);
				if (FUSED)
					mma128(u, da + 2 * kk, du + 2 * kk, 1);
			}
			wg_commit();
			wg_wait1(); // the products of the step before are done: release its stage
			hold(g);
			if (FUSED)
				hold(u);
			if (t > 0 && lane == 0)
				mb_arrive(empty + 8 * ((gk - 1) % STAGES));
		}
		wg_wait0();
		hold(g);
		if (FUSED)
			hold(u);
		if (lane == 0)
			mb_arrive(empty + 8 * ((gk - 1) % STAGES));
		// the epilogue: thread (warp, lane) holds rows r and r + 8, columns
		// 8 n + 2 (lane % 4) + {0, 1} of each 8-column group n
		const int r = m0 + c * 64 + warp * 16 + (lane >> 2);
#pragma unroll
		for (int n = 0; n < 16; n++) {
			int col = n0 + n * 8 + 2 * (lane & 3);
#pragma unroll
			for (int hh = 0; hh < 2; hh++) {
				float a0 = g[n][2 * hh], a1 = g[n][2 * hh + 1];
				if (FUSED) {
					a0 = silu(a0) * u[n][2 * hh];
					a1 = silu(a1) * u[n][2 * hh + 1];
				}
				__nv_bfloat162 v = __floats2bfloat162_rn(a0, a1);
				*(__nv_bfloat162 *)(h + (size_t)(r + 8 * hh) * N + col) = v;
			}
		}
	}
#endif
}

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                              CUtensorMapFloatOOBfill);

static CUtensorMap map2(encode_fn enc, void *p, int rows, int cols)
{
	CUtensorMap m;
	cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, str[1] = {(cuuint64_t)cols * 2};
	cuuint32_t box[2] = {BK, BM}, es[2] = {1, 1};
	CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p, dim, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
	                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
	                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
	if (r != CUDA_SUCCESS) {
		fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", (int)r);
		exit(1);
	}
	return m;
}

static float bf(uint16_t v)
{
	uint32_t x = (uint32_t)v << 16;
	float f;
	memcpy(&f, &x, 4);
	return f;
}

static uint16_t to_bf(float f)
{
	uint32_t x;
	memcpy(&x, &f, 4);
	x += 0x7fffu + ((x >> 16) & 1u);
	return (uint16_t)(x >> 16);
}

int main(void)
{
	size_t nx = (size_t)M * K, nw = (size_t)N * K, nh = (size_t)M * N;
	uint16_t *hx = (uint16_t *)malloc(nx * 2), *hg = (uint16_t *)malloc(nw * 2), *hu = (uint16_t *)malloc(nw * 2);
	uint16_t *hh = (uint16_t *)malloc(nh * 2);
	uint64_t st = 12345;
	auto rnd = [&]() {
		st = st * 6364136223846793005ull + 1442695040888963407ull;
		return ((float)(st >> 40) / (float)(1 << 24)) * 2.f - 1.f;
	};
	for (size_t i = 0; i < nx; i++)
		hx[i] = to_bf(rnd());
	for (size_t i = 0; i < nw; i++) {
		hg[i] = to_bf(rnd() * 0.05f);
		hu[i] = to_bf(rnd() * 0.05f);
	}
	void *dx, *dg, *du, *dh;
	CHECK(cudaMalloc(&dx, nx * 2));
	CHECK(cudaMalloc(&dg, nw * 2));
	CHECK(cudaMalloc(&du, nw * 2));
	CHECK(cudaMalloc(&dh, nh * 2));
	CHECK(cudaMemcpy(dx, hx, nx * 2, cudaMemcpyHostToDevice));
	CHECK(cudaMemcpy(dg, hg, nw * 2, cudaMemcpyHostToDevice));
	CHECK(cudaMemcpy(du, hu, nw * 2, cudaMemcpyHostToDevice));
	encode_fn enc = NULL;
	cudaDriverEntryPointQueryResult q;
	CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&enc, 12000, cudaEnableDefault,
	                                       &q));
	if (!enc) {
		fprintf(stderr, "no cuTensorMapEncodeTiled\n");
		return 1;
	}
	CUtensorMap mx = map2(enc, dx, M, K), mg = map2(enc, dg, N, K), mu = map2(enc, du, N, K);
	CHECK(cudaFuncSetAttribute(swiglu<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
	CHECK(cudaFuncSetAttribute(swiglu<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
	// setmaxnreg moves registers within the block's pool: 40 * 128 + 232 *
	// 256 of them, which a kernel of fewer than 168 a thread does not hold
	// (the consumers' increase would wait forever)
	for (int f = 0; f < 2; f++) {
		cudaFuncAttributes fa;
		CHECK(cudaFuncGetAttributes(&fa, f ? (const void *)swiglu<true> : (const void *)swiglu<false>));
		printf("swiglu_probe: %s: %d registers, %zu bytes local\n", f ? "fused" : "gate only", fa.numRegs,
		       fa.localSizeBytes);
		if (fa.numRegs < 168) {
			printf("swiglu_probe: fewer than 168 registers: not launched\n");
			return 1;
		}
	}
	dim3 block(384);
	cudaEvent_t e0, e1;
	CHECK(cudaEventCreate(&e0));
	CHECK(cudaEventCreate(&e1));
	// variant: fused (1) or gate only (0); raster m-fast (1) or n-fast (0);
	// persistent (1: one block an SM) or a block a tile (0)
	int sms = 0;
	CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
	const int ntiles = (M / BM) * (N / BN);
	const int variants[5][3] = {{1, 0, 0}, {1, 1, 0}, {1, 1, 1}, {0, 1, 0}, {0, 1, 1}};
	for (int vi = 0; vi < 5; vi++) {
		int fused = variants[vi][0], mfast = variants[vi][1], persist = variants[vi][2];
		dim3 grid(persist ? (sms < ntiles ? sms : ntiles) : ntiles);
		auto launch = [&]() {
			if (fused)
				swiglu<true><<<grid, block, SMEM>>>(mx, mg, mu, (__nv_bfloat16 *)dh, mfast);
			else
				swiglu<false><<<grid, block, SMEM>>>(mx, mg, mu, (__nv_bfloat16 *)dh, mfast);
		};
		CHECK(cudaMemset(dh, 0xff, nh * 2)); // poison: NaN bf16
		launch();
		CHECK(cudaGetLastError());
		CHECK(cudaDeviceSynchronize());
		CHECK(cudaMemcpy(hh, dh, nh * 2, cudaMemcpyDeviceToHost));
		// 4096 random outputs against float64 dots
		double worst = 0;
		int bad = 0;
		for (int i = 0; i < 4096; i++) {
			int r = (int)((rnd() * 0.5f + 0.5f) * (M - 1)), cidx = (int)((rnd() * 0.5f + 0.5f) * (N - 1));
			double sg = 0, su = 0;
			for (int k = 0; k < K; k++) {
				double xv = bf(hx[(size_t)r * K + k]);
				sg += xv * bf(hg[(size_t)cidx * K + k]);
				su += xv * bf(hu[(size_t)cidx * K + k]);
			}
			double want = fused ? sg / (1 + exp(-sg)) * su : sg;
			double got = bf(hh[(size_t)r * N + cidx]);
			double err = fabs(got - want) / (fabs(want) + 1e-3);
			if (!(err <= 2e-2))
				bad++;
			if (err > worst || got != got)
				worst = got != got ? INFINITY : err;
		}
		int reps = 20;
		for (int i = 0; i < 3; i++)
			launch();
		CHECK(cudaEventRecord(e0));
		for (int i = 0; i < reps; i++)
			launch();
		CHECK(cudaEventRecord(e1));
		CHECK(cudaEventSynchronize(e1));
		float ms = 0;
		CHECK(cudaEventElapsedTime(&ms, e0, e1));
		double us = ms * 1e3 / reps, flops = 2.0 * M * (double)K * N * (fused ? 2 : 1);
		printf("swiglu_probe: %-28s %-7s %-10s %8.1f us  %6.1f TFLOP/s  check: %d of 4096 off by > 2%%, "
		       "worst %.3g\n",
		       fused ? "fused gate/up + silu*mul" : "gate only (one accumulator)", mfast ? "m-fast" : "n-fast",
		       persist ? "persistent" : "tile/block", us, flops / us * 1e-6, bad, worst);
	}
	return 0;
}
