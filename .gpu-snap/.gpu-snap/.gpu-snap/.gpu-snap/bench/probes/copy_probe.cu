// copy_probe.cu - which way of streaming 1 GiB through an SM90 GPU reaches the
// copy engine's bandwidth? kiln's generated copy kernel (16-byte loads and
// stores, a grid-stride loop over one wave of blocks) measures 3.9 TB/s on an
// H200 where cudaMemcpy device-to-device measures 4.2, and its row kernels
// (layer norm, RMS norm: one read and one write per byte, like a copy) sit at
// 91% of that 3.9. This probe times the candidates side by side on the same
// buffers, each checked for the right result:
//   grid1       kiln's pointwise form today: one 16-byte chunk a thread an
//               iteration, a grid of one wave
//   grid4       the same, four chunks (a grid apart) loaded before storing
//   grid1_cs    grid1 with cache-streaming loads and stores (ld/st .cs)
//   flat1       no grid stride: a thread per chunk, as many blocks as needed
//   flat4       no grid stride, four adjacent chunks a thread
//   bulk        TMA bulk copies (cp.async.bulk) global -> shared -> global,
//               one thread a block driving a ring of 32 KiB stages
//   memcpy      cudaMemcpyAsync device to device
// Build and run on the GPU machine (not part of the library or its tests):
//   nvcc -O3 -arch=sm_90a -o copy_probe bench/probes/copy_probe.cu && ./copy_probe
#include "probe.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>


static const size_t BYTES = (size_t)1 << 30; // 1 GiB read, 1 GiB written
static const int BLOCK = 256;

__global__ void __launch_bounds__(BLOCK) k_grid1(const uint4 *__restrict__ in, uint4 *__restrict__ out, int64_t n)
{
	for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
		out[i] = __ldg(in + i);
}

__global__ void __launch_bounds__(BLOCK) k_grid4(const uint4 *__restrict__ in, uint4 *__restrict__ out, int64_t n)
{
	const int64_t g = (int64_t)gridDim.x * BLOCK;
	for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += 4 * g) {
		uint4 v[4];
#pragma unroll
		for (int u = 0; u < 4; u++)
			if (i + u * g < n)
				v[u] = __ldg(in + i + u * g);
#pragma unroll
		for (int u = 0; u < 4; u++)
			if (i + u * g < n)
				out[i + u * g] = v[u];
	}
}

__global__ void __launch_bounds__(BLOCK) k_grid1_cs(const uint4 *__restrict__ in, uint4 *__restrict__ out, int64_t n)
{
	for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (int64_t)gridDim.x * BLOCK)
		__stcs(out + i, __ldcs(in + i));
}

__global__ void __launch_bounds__(BLOCK) k_flat1(const uint4 *__restrict__ in, uint4 *__restrict__ out, int64_t n)
{
	int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x;
	if (i < n)
		out[i] = __ldg(in + i);
}

__global__ void __launch_bounds__(BLOCK) k_flat4(const uint4 *__restrict__ in, uint4 *__restrict__ out, int64_t n)
{
	// a block covers 4 * BLOCK chunks: thread t takes t, t + BLOCK, ... (coalesced)
	int64_t base = (int64_t)blockIdx.x * 4 * BLOCK + threadIdx.x;
	uint4 v[4];
#pragma unroll
	for (int u = 0; u < 4; u++)
		if (base + u * BLOCK < n)
			v[u] = __ldg(in + base + u * BLOCK);
#pragma unroll
	for (int u = 0; u < 4; u++)
		if (base + u * BLOCK < n)
			out[base + u * BLOCK] = v[u];
}

// ---- TMA bulk copies ------------------------------------------------------------------
#define TILE 32768 // bytes a stage
#define STAGES 4

__device__ __forceinline__ unsigned su32(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mb_wait(unsigned bar, unsigned parity)
{
	asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(bar),
	             "r"(parity)
	             : "memory");
}

// Tiles t = blockIdx.x + k * gridDim.x; stage k % STAGES. Iteration k waits for
// tile k's load, stores it, then (once tile k-1's store has read its stage)
// loads tile k + STAGES - 1 into that stage: STAGES - 1 loads in flight.
__global__ void __launch_bounds__(32) k_bulk(const char *__restrict__ in, char *__restrict__ out, int64_t ntiles)
{
	extern __shared__ __align__(128) unsigned char sm[];
	__shared__ __align__(8) unsigned long long bars[STAGES];
	if (threadIdx.x != 0)
		return;
	for (int s = 0; s < STAGES; s++)
		asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(su32(&bars[s])) : "memory");
	asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
	int64_t mine = ntiles > blockIdx.x ? (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
	auto load = [&](int64_t k) {
		int s = (int)(k % STAGES);
		int64_t t = blockIdx.x + k * gridDim.x;
		unsigned bar = su32(&bars[s]);
		asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(TILE) : "memory");
		asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
		                     su32(sm + s * TILE)),
		             "l"(in + t * TILE), "r"(TILE), "r"(bar)
		             : "memory");
	};
	for (int64_t k = 0; k < STAGES - 1 && k < mine; k++)
		load(k);
	for (int64_t k = 0; k < mine; k++) {
		int s = (int)(k % STAGES);
		mb_wait(su32(&bars[s]), (unsigned)((k / STAGES) & 1));
		int64_t t = blockIdx.x + k * gridDim.x;
		asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(out + t * TILE),
		             "r"(su32(sm + s * TILE)), "r"(TILE)
		             : "memory");
		asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
		if (k + STAGES - 1 < mine) {
			// the stage it loads into held tile k - 1, whose store must have read it
			asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
			load(k + STAGES - 1);
		}
	}
	asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__global__ void k_fill(uint32_t *p, int64_t n, uint32_t seed)
{
	for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
		p[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

__global__ void k_diff(const uint32_t *a, const uint32_t *b, int64_t n, unsigned long long *bad)
{
	unsigned long long c = 0;
	for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
		c += a[i] != b[i];
	if (c)
		atomicAdd(bad, c);
}

int main(void)
{
	int dev = 0, sms = 0;
	CHECK(cudaSetDevice(dev));
	CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	cudaDeviceProp prop;
	CHECK(cudaGetDeviceProperties(&prop, dev));
	char *in = NULL, *out = NULL;
	unsigned long long *bad = NULL;
	CHECK(cudaMalloc(&in, BYTES));
	CHECK(cudaMalloc(&out, BYTES));
	CHECK(cudaMalloc(&bad, sizeof *bad));
	const int64_t words = (int64_t)(BYTES / 4), chunks = (int64_t)(BYTES / 16), tiles = (int64_t)(BYTES / TILE);
	k_fill<<<sms * 8, 256>>>((uint32_t *)in, words, 0x9e3779b9u);
	CHECK(cudaGetLastError());
	int per_sm = 0;
	CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_grid1, BLOCK, 0));
	const int wave = sms * per_sm;
	const int bulk_smem = STAGES * TILE;
	CHECK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem));
	int bulk_per_sm = 0;
	CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bulk_per_sm, k_bulk, 32, bulk_smem));
	printf("%s, %d SMs; 1 GiB read + 1 GiB written a call, median of 20 calls\n", prop.name, sms);
	cudaEvent_t e0, e1;
	CHECK(cudaEventCreate(&e0));
	CHECK(cudaEventCreate(&e1));
	for (int v = 0; v < 7; v++) {
		const char *name = "";
		auto run = [&]() {
			switch (v) {
			case 0: name = "grid1"; k_grid1<<<wave, BLOCK>>>((const uint4 *)in, (uint4 *)out, chunks); break;
			case 1: name = "grid4"; k_grid4<<<wave, BLOCK>>>((const uint4 *)in, (uint4 *)out, chunks); break;
			case 2: name = "grid1_cs"; k_grid1_cs<<<wave, BLOCK>>>((const uint4 *)in, (uint4 *)out, chunks); break;
			case 3: name = "flat1"; k_flat1<<<(unsigned)((chunks + BLOCK - 1) / BLOCK), BLOCK>>>((const uint4 *)in, (uint4 *)out, chunks); break;
			case 4: name = "flat4"; k_flat4<<<(unsigned)((chunks + 4 * BLOCK - 1) / (4 * BLOCK)), BLOCK>>>((const uint4 *)in, (uint4 *)out, chunks); break;
			case 5: name = "bulk"; k_bulk<<<sms * bulk_per_sm, 32, bulk_smem>>>(in, out, tiles); break;
			default: name = "memcpy"; CHECK(cudaMemcpyAsync(out, in, BYTES, cudaMemcpyDeviceToDevice)); break;
			}
		};
		CHECK(cudaMemset(out, 0, BYTES));
		run();
		CHECK(cudaGetLastError());
		CHECK(cudaMemset(bad, 0, sizeof *bad));
		k_diff<<<sms * 8, 256>>>((const uint32_t *)in, (const uint32_t *)out, words, bad);
		unsigned long long nbad = 0;
		CHECK(cudaMemcpy(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost));
		for (int w = 0; w < 3; w++)
			run();
		std::vector<float> ms;
		for (int r = 0; r < 20; r++) {
			CHECK(cudaEventRecord(e0));
			run();
			CHECK(cudaEventRecord(e1));
			CHECK(cudaEventSynchronize(e1));
			float t = 0;
			CHECK(cudaEventElapsedTime(&t, e0, e1));
			ms.push_back(t);
		}
		std::sort(ms.begin(), ms.end());
		double med = ms[ms.size() / 2];
		printf("%-9s %9.1f us  %.3f TB/s  %s\n", name, med * 1e3, 2.0 * BYTES / (med * 1e-3) * 1e-12,
		       nbad ? "WRONG RESULT" : "ok");
	}
	return 0;
}
