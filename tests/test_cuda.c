/* test_cuda.c - the CUDA layer: the loader's errors, NVRTC compiles (no GPU
 * needed), the caching allocator and cuBLASLt's row-major geometry on the
 * host; with a GPU, copies, a generated kernel, cuBLASLt with epilogues and
 * CUDA graphs, each checked against the host in double precision.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "backend/cuda/backend.h"
#include "capture/trace.h"
#include "backend/cpu/cpu.h"
#include "core/core.h"
#include "graph/graph.h"
#include "kltest.h"

#ifdef KILN_HAVE_CUDA
#include <dlfcn.h>

#include <dirent.h>
#include <unistd.h>

#include "backend/cuda/device.h"
#include "runtime/cuda/exec_cuda.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"

/* ---- shared kernels --------------------------------------------------------------- */

/* f16 vector add, 8 elements (16 bytes) per thread, scalar tail */
static const char VADD_SRC[] =
        "#include \"kiln_prelude.cuh\"\n"
        "extern \"C\" __global__ void vadd(const kl_f16 *a, const kl_f16 *b, kl_f16 *c,\n"
        "\tkl_i64 n) {\n"
        "\tkl_i64 i = ((kl_i64)blockIdx.x * blockDim.x + threadIdx.x) * 8;\n"
        "\tif (i + 8 <= n) {\n"
        "\t\tuint4 x = kl_ld16(a + i), y = kl_ld16(b + i), z;\n"
        "\t\tconst unsigned *xs = (const unsigned *)&x, *ys = (const unsigned *)&y;\n"
        "\t\tunsigned *zs = (unsigned *)&z;\n"
        "\t\tfor (int j = 0; j < 4; j++) {\n"
        "\t\t\tfloat2 p = kl_f16x2_to_f32x2(xs[j]), q = kl_f16x2_to_f32x2(ys[j]);\n"
        "\t\t\tzs[j] = kl_f32x2_to_f16x2(p.x + q.x, p.y + q.y);\n"
        "\t\t}\n"
        "\t\tkl_st16(c + i, z);\n"
        "\t} else {\n"
        "\t\tfor (; i < n; i++)\n"
        "\t\t\tc[i] = kl_f32_to_f16(kl_f16_to_f32(a[i]) + kl_f16_to_f32(b[i]));\n"
        "\t}\n"
        "}\n"
        /* row sums of bf16 rows through the block reduction */
        "extern \"C\" __global__ void rowsum(const kl_bf16 *x, float *out, int cols) {\n"
        "\t__shared__ float scratch[32];\n"
        "\tconst kl_bf16 *row = x + (kl_i64)blockIdx.x * cols;\n"
        "\tfloat v = 0.0f;\n"
        "\tfor (int j = threadIdx.x; j < cols; j += blockDim.x) v += kl_bf16_to_f32(row[j]);\n"
        "\tfloat s = kl_block_sum(v, scratch);\n"
        "\tif (threadIdx.x == 0) out[blockIdx.x] = s;\n"
        "}\n"
        /* a slow producer that lets its dependants start at once, and a
         * consumer that must see all of its writes (programmatic launch) */
        "extern \"C\" __global__ void pdl_slow(float *y, int n, int spin) {\n"
        "\tkl_pdl_wait();\n"
        "\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "\tfloat v = (float)i;\n"
        "\tfor (int k = 0; k < spin; k++) v = v * 0.999999f + 1e-6f * (float)i;\n"
        "\tif (i < n) y[i] = v + 1.0f;\n"
        "}\n"
        "extern \"C\" __global__ void pdl_next(float *z, const float *y, int n) {\n"
        "\tkl_pdl_wait();\n"
        "\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "\tif (i < n) z[i] = 2.0f * y[i];\n"
        "}\n"
        "extern \"C\" __global__ void axpb(float *y, const float *x, float a, float b, int n) {\n"
        "\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "\tif (i < n) y[i] = a * x[i] + b;\n"
        "}\n";

/* ---- the loader ------------------------------------------------------------------- */

static void test_driver_missing(void **state)
{
	(void)state;
	char err[KL_ERR_CAP];
	void *lib = NULL;
	kl_cu_driver tab;
	static const kl_loader_sym syms[] = {{"cuInit", offsetof(kl_cu_driver, cuInit)}};
	const char *bogus[] = {"libkiln-test-no-such-cuda.so.1"};
	kl_status s =
	        kl__loader_open("CUDA driver", bogus, 1, syms, 1, &tab, &lib, err, sizeof err);
	assert_int_equal(s, KL_EDEVICE);
	assert_null(lib);
	assert_non_null(strstr(err, "no CUDA driver found (libkiln-test-no-such-cuda.so.1: "));
	assert_non_null(strstr(err, "No such file"));
	assert_int_equal(err[strlen(err) - 1], ')');

	/* a library that opens but is not the one wanted */
	const char *libm[] = {"libm.so.6"};
	s = kl__loader_open("CUDA driver", libm, 1, syms, 1, &tab, &lib, err, sizeof err);
	assert_int_equal(s, KL_EDEVICE);
	assert_non_null(strstr(err, "libm.so.6 lacks cuInit"));

	/* the real library, through a context */
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const kl_backend *be = ctx->be;
	s = kl__cuda_load_driver(ctx);
	if (s == KL_OK) {
		int n = -1;
		assert_int_equal(kl__cuda_device_count(ctx, &n), KL_OK);
		print_message(
		        "test_cuda: a CUDA driver %d is present (%d device%s): the missing-driver "
		        "message was checked on a made-up library name only\n",
		        kl__cu.version, n, n == 1 ? "" : "s");
	} else {
		assert_int_equal(s, KL_EDEVICE);
		const char *m = kl_last_error(ctx);
		bool no_lib = strstr(m, "no CUDA driver found (") == m;
		bool no_dev = strstr(m, "no CUDA device found (") == m;
		assert_true(no_lib || no_dev);
		if (no_lib && !getenv("KILN_LIBCUDA"))
			assert_non_null(strstr(m, "(libcuda.so.1: "));
		/* a CUDA context cannot be made, and the CPU one is untouched */
		char first[KL_ERR_CAP];
		snprintf(first, sizeof first, "%s", m);
		kl_clear_error(ctx);
		assert_int_equal(kl__cuda_ctx_init(ctx, 0, &kl__cuda_rt_hooks), KL_EDEVICE);
		assert_string_equal(kl_last_error(ctx), first);
		assert_ptr_equal(ctx->be, be);
		assert_null(ctx->backend_state);
		assert_int_equal(ctx->device, KL_CPU);
		kl__cuda_ctx_fini(ctx); /* harmless on a context it never set up */
	}
	kl_ctx_free(ctx);
}

/* The toolkit's stub libcuda exports every symbol of the real driver: every
 * versioned name kiln asks for must be among them. */
static void test_driver_symbols(void **state)
{
	(void)state;
	const char *home = getenv("CUDA_HOME");
	char path[512];
	snprintf(path, sizeof path, "%s/lib64/stubs/libcuda.so", home ? home : "/usr/local/cuda");
	FILE *f = fopen(path, "rb");
	if (!f) {
		print_message("test_cuda: skipped, no stub libcuda at %s to check symbol names "
		              "against\n",
		              path);
		skip();
	}
	fclose(f);
	kl_cu_driver tab;
	void *lib = NULL;
	char err[KL_ERR_CAP];
	const char *names[] = {path};
	kl_status s = kl__loader_open("CUDA driver", names, 1, kl__cuda_driver_syms,
	                              kl__cuda_driver_nsyms, &tab, &lib, err, sizeof err);
	if (s != KL_OK)
		print_message("%s\n", err);
	assert_int_equal(s, KL_OK);
	assert_non_null(tab.cuGraphExecKernelNodeSetParams);
	assert_true(kl__cuda_driver_nsyms > 40);
	/* the names are the versioned ones the headers map to */
	bool v2 = false, v3 = false;
	for (int i = 0; i < kl__cuda_driver_nsyms; i++) {
		v2 = v2 || !strcmp(kl__cuda_driver_syms[i].name, "cuMemAlloc_v2");
		v3 = v3 || !strcmp(kl__cuda_driver_syms[i].name, "cuStreamGetCaptureInfo_v3");
	}
	assert_true(v2 && v3);
	dlclose(lib);
}

/* ---- NVRTC without a GPU ---------------------------------------------------------- */

static bool nvrtc_or_skip(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_status s = kl__cuda_load_nvrtc(ctx);
	if (s != KL_OK)
		print_message("test_cuda: skipped, NVRTC is not loadable here: %s\n",
		              kl_last_error(ctx));
	kl_ctx_free(ctx);
	return s == KL_OK;
}

/* The fused optimizer's kernel compiles for every float dtype (sm_90), and
 * its pointer table gives each parameter its pointers and first chunk, a
 * parameter of n elements ceil(n / chunk) chunks (an empty one none). */
static void test_optim_kernel_host(void **state)
{
	(void)state;
	int64_t ns[5] = {10, 0, 4096, 4097, 1};
	float steps[5];
	char bufs[5][8];
	kl_optim_item items[5];
	for (int i = 0; i < 5; i++)
		items[i] = (kl_optim_item){.p = bufs[i], .g = bufs[i] + 1, .m = bufs[i] + 2,
		                           .step = &steps[i], .n = ns[i]};
	kl_optim_launch l = {.algo = KL_ALGO_ADAMW, .dtype = KL_F32, .n = 5, .items = items};
	assert_int_equal(kl__optim_table_entry(), 64);
	uint64_t tab[5][8];
	assert_int_equal(kl__optim_table(&l, 4096, tab), 1 + 0 + 1 + 2 + 1);
	int64_t first[5] = {0, 1, 1, 2, 4};
	for (int i = 0; i < 5; i++) {
		assert_int_equal(tab[i][0], (uint64_t)(uintptr_t)bufs[i]);
		assert_int_equal(tab[i][1], (uint64_t)(uintptr_t)(bufs[i] + 1));
		assert_int_equal(tab[i][2], (uint64_t)(uintptr_t)(bufs[i] + 2));
		assert_int_equal(tab[i][3], 0);
		assert_int_equal(tab[i][5], (uint64_t)(uintptr_t)&steps[i]);
		assert_int_equal((int64_t)tab[i][6], ns[i]);
		assert_int_equal((int64_t)tab[i][7], first[i]);
	}
	assert_null(kl__cuda_optim_source(KL_I32));
	if (!nvrtc_or_skip())
		return;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_dtype dts[4] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	for (int k = 0; k < 4; k++) {
		char *src = kl__cuda_optim_source(dts[k]);
		assert_non_null(src);
		kl_cuda_image im;
		kl_nvrtc_opts o = {.arch = 90};
		if (kl__nvrtc_compile(ctx, src, "kiln_optim.cu", &o, &im) != KL_OK)
			fail_msg("%s: %s\n%s", kl_dtype_name(dts[k]), kl_last_error(ctx),
			         im.log ? im.log : "");
		assert_memory_equal(im.data, "\177ELF", 4);
		kl__cuda_image_free(&im);
		free(src);
	}
	kl_ctx_free(ctx);
}

/* The cache write kernel (cache_write_cuda.c) compiles for sm_90. */
static void test_cache_write_kernel_host(void **state)
{
	(void)state;
	if (!nvrtc_or_skip())
		return;
	kl_ctx *ctx = kl_ctx_new(NULL);
	char *src = kl__cuda_cache_write_source();
	assert_non_null(src);
	kl_cuda_image im;
	kl_nvrtc_opts o = {.arch = 90};
	if (kl__nvrtc_compile(ctx, src, "kiln_cache_write.cu", &o, &im) != KL_OK)
		fail_msg("%s\n%s", kl_last_error(ctx), im.log ? im.log : "");
	assert_memory_equal(im.data, "\177ELF", 4);
	kl__cuda_image_free(&im);
	free(src);
	kl_ctx_free(ctx);
}

/* The few-row product's kernel (gemv_cuda.c) compiles for sm_90 in each
 * dtype it serves, without warnings, and says which problems it takes. */
static void test_gemv_kernel_host(void **state)
{
	(void)state;
	assert_null(kl__cuda_gemv_source(KL_F32));
	kl_gemm g = {.ab = KL_BF16, .cd = KL_BF16, .m = 1, .n = 2048, .k = 2048, .a_rs = 2048,
	             .a_cs = 1, .b_rs = 1, .b_cs = 2048, .ldc = 2048, .ldd = 2048, .batch = 1,
	             .alpha = 1, .a = 0x10000, .b = 0x20000, .d = 0x30000};
	assert_true(kl__cuda_gemv_fits(&g));
	kl_gemm h = g;
	h.m = KL_GEMV_ROWS + 1; /* more rows: cuBLASLt */
	assert_false(kl__cuda_gemv_fits(&h));
	h = g;
	h.k = 2044; /* rows not a whole number of 16-byte loads */
	assert_false(kl__cuda_gemv_fits(&h));
	h = g;
	h.b_rs = 2048; /* B row-major: its columns are not contiguous */
	h.b_cs = 1;
	assert_false(kl__cuda_gemv_fits(&h));
	h = g;
	h.b += 2; /* misaligned */
	assert_false(kl__cuda_gemv_fits(&h));
	h = g;
	h.cd = KL_F32; /* f32 out of bf16: cuBLASLt */
	assert_false(kl__cuda_gemv_fits(&h));
	h = g;
	h.epi = KL_EPI_BIAS; /* a bias epilogue without its bias */
	assert_false(kl__cuda_gemv_fits(&h));
	h.bias = 0x40000;
	assert_true(kl__cuda_gemv_fits(&h));
	if (!nvrtc_or_skip())
		return;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_dtype dts[2] = {KL_F16, KL_BF16};
	for (int i = 0; i < 2; i++) {
		char *src = kl__cuda_gemv_source(dts[i]);
		assert_non_null(src);
		kl_cuda_image im;
		kl_nvrtc_opts o = {.arch = 90};
		if (kl__nvrtc_compile(ctx, src, "kiln_gemv.cu", &o, &im) != KL_OK)
			fail_msg("%s: %s\n%s", kl_dtype_name(dts[i]), kl_last_error(ctx),
			         im.log ? im.log : "");
		assert_memory_equal(im.data, "\177ELF", 4);
		if (im.log && strstr(im.log, "warning"))
			fail_msg("%s: warnings:\n%s", kl_dtype_name(dts[i]), im.log);
		kl__cuda_image_free(&im);
		free(src);
	}
	kl_ctx_free(ctx);
}

static void test_nvrtc_cubin(void **state)
{
	(void)state;
	if (!nvrtc_or_skip())
		skip();
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_cuda_image im;
	kl_nvrtc_opts o = {.arch = 90};
	assert_int_equal(kl__nvrtc_compile(ctx, VADD_SRC, "vadd.cu", &o, &im), KL_OK);
	const unsigned char *b = im.data;
	assert_false(im.ptx);
	assert_int_equal(im.arch, 90);
	assert_true(im.size > 64);
	assert_memory_equal(b, "\177ELF", 4);
	assert_int_equal(b[18] | (b[19] << 8), 190); /* e_machine: EM_CUDA */
	kl__cuda_image_free(&im);
	assert_null(im.data);

	/* sm_90a, fast math, line info, a register cap: all accepted */
	o = (kl_nvrtc_opts){.arch = 90,
	                    .arch_specific = true,
	                    .fast_math = true,
	                    .lineinfo = true,
	                    .max_regs = 64};
	assert_int_equal(kl__nvrtc_compile(ctx, VADD_SRC, "vadd.cu", &o, &im), KL_OK);
	assert_memory_equal(im.data, "\177ELF", 4);
	kl__cuda_image_free(&im);

	/* sm_91 has no cubin target: sm_90's SASS serves it */
	o = (kl_nvrtc_opts){.arch = 91};
	assert_int_equal(kl__nvrtc_compile(ctx, VADD_SRC, "vadd.cu", &o, &im), KL_OK);
	assert_int_equal(im.arch, 90);
	assert_false(im.ptx);
	kl__cuda_image_free(&im);

	/* a device newer than this NVRTC gets PTX for the driver to finish */
	o = (kl_nvrtc_opts){.arch = 990};
	assert_int_equal(kl__nvrtc_compile(ctx, VADD_SRC, "vadd.cu", &o, &im), KL_OK);
	assert_true(im.ptx);
	assert_non_null(strstr(im.data, ".entry vadd"));
	assert_non_null(strstr(im.data, ".target sm_"));
	kl__cuda_image_free(&im);

	/* one older than any target is refused, plainly */
	o = (kl_nvrtc_opts){.arch = 30};
	assert_int_equal(kl__nvrtc_compile(ctx, VADD_SRC, "vadd.cu", &o, &im), KL_EUNSUPPORTED);
	assert_non_null(strstr(kl_last_error(ctx), "cannot compile for sm_30"));
	assert_null(im.data);
	kl__cuda_image_free(&im);
	kl_ctx_free(ctx);
}

static void test_nvrtc_error(void **state)
{
	(void)state;
	if (!nvrtc_or_skip())
		skip();
	kl_ctx *ctx = kl_ctx_new(NULL);
	const char *bad = "#include \"kiln_prelude.cuh\"\n"
	                  "extern \"C\" __global__ void k(float *x) {\n"
	                  "\tx[0] = kiln_undeclared_thing + 1.0f;\n"
	                  "}\n";
	kl_cuda_image im;
	kl_nvrtc_opts o = {.arch = 90};
	assert_int_equal(kl__nvrtc_compile(ctx, bad, "bad.cu", &o, &im), KL_ECOMPILE);
	const char *m = kl_last_error(ctx);
	assert_non_null(strstr(m, "bad.cu"));
	assert_non_null(strstr(m, "sm_90"));
	assert_non_null(strstr(m, "kiln_undeclared_thing"));
	assert_non_null(strstr(m, "(3)")); /* the line of the error */
	assert_null(im.data);
	assert_non_null(im.log);
	assert_non_null(strstr(im.log, "error"));
	kl__cuda_image_free(&im);
	kl_ctx_free(ctx);
}

/* ---- the caching allocator, over a host allocator --------------------------------- */

typedef struct fake_mem {
	size_t cap, used;
	int64_t live;
	uint64_t allocs, frees;
} fake_mem;

static kl_status fake_alloc(kl_ctx *ctx, void *user, size_t n, uint64_t *out)
{
	(void)ctx;
	fake_mem *f = user;
	if (f->used + n > f->cap)
		return KL_ENOMEM;
	size_t *p = malloc(n + sizeof(size_t) * 2);
	if (!p)
		return KL_ENOMEM;
	p[0] = n;
	f->used += n;
	f->live++;
	f->allocs++;
	*out = (uint64_t)(uintptr_t)(p + 2);
	return KL_OK;
}

static void fake_free(void *user, uint64_t ptr)
{
	fake_mem *f = user;
	size_t *p = (size_t *)(uintptr_t)ptr - 2;
	f->used -= p[0];
	f->live--;
	f->frees++;
	free(p);
}

static void test_pool_classes(void **state)
{
	(void)state;
	assert_int_equal(kl__pool_class(0), 0);
	assert_int_equal(kl__pool_class(512), 0);
	assert_int_equal(kl__pool_class_size(0), 512);
	assert_int_equal(kl__pool_class_size(kl__pool_class(513)), 576);
	assert_int_equal(kl__pool_class_size(kl__pool_class(1024)), 1024);
	assert_int_equal(kl__pool_class_size(kl__pool_class(1025)), 1152);
	assert_int_equal(kl__pool_class_size(kl__pool_class((size_t)1 << 30)), (size_t)1 << 30);
	uint64_t rng = 7;
	int prev = 0;
	for (size_t n = 1; n < (size_t)1 << 20; n += 1 + n / 16) {
		int c = kl__pool_class(n);
		size_t sz = kl__pool_class_size(c);
		assert_true(c >= prev);
		assert_true(sz >= n);
		assert_true(n <= 512 || (double)sz <= (double)n * 1.125);
		assert_true(c == 0 || kl__pool_class_size(c - 1) < n);
		prev = c;
	}
	for (int i = 0; i < 1000; i++) {
		size_t n = (size_t)(kltest_next(&rng) >> 24); /* up to 2^40 */
		size_t sz = kl__pool_class_size(kl__pool_class(n));
		assert_true(sz >= n && (n <= 512 || (double)sz <= (double)n * 1.125));
	}
	assert_int_equal(kl__pool_class((size_t)1 << 62), -1);
}

static void test_pool_reuse(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	fake_mem fm = {.cap = 1 << 20};
	kl_pool p;
	kl__pool_init(&p, fake_alloc, fake_free, &fm);
	uint64_t a = 0, b = 0, c = 0;
	assert_int_equal(kl__pool_alloc(ctx, &p, 1000, &a), KL_OK);
	assert_int_equal(p.st.in_use, 1024);
	assert_int_equal(kl__pool_free(ctx, &p, a), KL_OK);
	assert_int_equal(p.st.in_use, 0);
	assert_int_equal(p.st.reserved, 1024);
	/* same class: the cached block comes back, no raw call */
	assert_int_equal(kl__pool_alloc(ctx, &p, 1010, &b), KL_OK);
	assert_true(a == b);
	assert_int_equal(p.st.raw_allocs, 1);
	assert_int_equal(p.st.hits, 1);
	/* another class: a new block */
	assert_int_equal(kl__pool_alloc(ctx, &p, 5000, &c), KL_OK);
	assert_true(c != b);
	assert_int_equal(p.st.raw_allocs, 2);
	assert_int_equal(p.st.in_use, 1024 + 5120);
	assert_int_equal(p.st.peak, 1024 + 5120);

	/* double free and foreign pointers are refused and change nothing */
	assert_int_equal(kl__pool_free(ctx, &p, c), KL_OK);
	assert_int_equal(kl__pool_free(ctx, &p, c), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "already free"));
	assert_int_equal(kl__pool_free(ctx, &p, 0x1234), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "not from this context"));
	assert_int_equal(p.st.in_use, 1024);
	assert_int_equal(p.st.peak, 1024 + 5120);
	kl__pool_reset_peak(&p);
	assert_int_equal(p.st.peak, 1024);

	/* out of memory: the cache is given back, then the request retried */
	uint64_t big = 0;
	fm.cap = fm.used + (1 << 19);
	assert_int_equal(kl__pool_alloc(ctx, &p, (1 << 19) + 1000, &big), KL_ENOMEM);
	assert_non_null(strstr(kl_last_error(ctx), "out of device memory"));
	fm.cap = 1024 + (1 << 19) + 4096;
	assert_int_equal(kl__pool_alloc(ctx, &p, 1 << 19, &big), KL_OK);
	assert_int_equal(fm.live, 2); /* b, big: the cached 5120 block was released */
	assert_int_equal(p.st.reserved, 1024 + (1 << 19));
	assert_int_equal(kl__pool_free(ctx, &p, big), KL_OK);
	assert_int_equal(kl__pool_trim(&p), (size_t)1 << 19);
	assert_int_equal(fm.live, 1);

	kl__pool_fini(&p); /* b is still live: fini frees it too */
	assert_int_equal(fm.live, 0);
	assert_int_equal(fm.used, 0);
	assert_int_equal(p.st.raw_allocs, p.st.raw_frees);
	kl_ctx_free(ctx);
}

/* random alloc/free/trim against a model of which blocks are live */
static void test_pool_random(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	fake_mem fm = {.cap = (size_t)1 << 40};
	kl_pool p;
	kl__pool_init(&p, fake_alloc, fake_free, &fm);
	enum { NLIVE = 300 };
	uint64_t live[NLIVE];
	size_t sizes[NLIVE];
	int n = 0;
	uint64_t rng = 12345;
	for (int it = 0; it < 20000; it++) {
		uint64_t r = kltest_next(&rng);
		if (r % 997 == 0) {
			size_t cached = p.st.reserved - p.st.in_use;
			assert_int_equal(kl__pool_trim(&p), cached);
		} else if (n < NLIVE && (n == 0 || r % 3 != 0)) {
			size_t sz = (size_t)1 << (kltest_next(&rng) % 16);
			sz += kltest_next(&rng) % sz;
			assert_int_equal(kl__pool_alloc(ctx, &p, sz, &live[n]), KL_OK);
			for (int j = 0; j < n; j++)
				assert_true(live[j] != live[n]);
			sizes[n++] = sz;
		} else {
			int j = (int)(kltest_next(&rng) % (uint64_t)n);
			assert_int_equal(kl__pool_free(ctx, &p, live[j]), KL_OK);
			live[j] = live[n - 1];
			sizes[j] = sizes[n - 1];
			n--;
		}
		if (it % 100 == 0) {
			size_t in_use = 0;
			for (int j = 0; j < n; j++)
				in_use += kl__pool_class_size(kl__pool_class(sizes[j]));
			assert_int_equal(p.st.in_use, in_use);
			assert_int_equal(p.st.reserved, fm.used);
			assert_true(p.st.peak >= in_use);
		}
	}
	assert_true(p.st.hits > 1000);
	for (int j = 0; j < n; j++)
		assert_int_equal(kl__pool_free(ctx, &p, live[j]), KL_OK);
	assert_int_equal(p.st.in_use, 0);
	kl__pool_fini(&p);
	assert_int_equal(fm.live, 0);
	kl_ctx_free(ctx);
}

/* ---- cuBLASLt geometry on the host ------------------------------------------------ */

/* Element (r, c) of cuBLASLt's op(X) for X stored column-major rows x cols. */
static double op_at(const double *x, int trans, int64_t ld, int64_t r, int64_t c)
{
	return trans ? x[c + r * ld] : x[r + c * ld];
}

/* D = A @ B by the column-major recipe the geometry gives, compared with
 * the row-major definition. Values are small integers: both sums are exact. */
static void check_geometry(int64_t M, int64_t N, int64_t K, bool at, bool bt, int64_t pad)
{
	int64_t a_rs = at ? 1 : K + pad, a_cs = at ? M + pad : 1;
	int64_t b_rs = bt ? 1 : N + pad, b_cs = bt ? K + pad : 1;
	int64_t asz = at ? (M + pad) * K : M * (K + pad), bsz = bt ? (K + pad) * N : K * (N + pad);
	int64_t ldd = N + pad;
	double *a = calloc((size_t)asz, sizeof *a), *b = calloc((size_t)bsz, sizeof *b);
	double *d = calloc((size_t)(M * ldd), sizeof *d);
	uint64_t rng = (uint64_t)(M * 1000 + N * 100 + K * 10 + at * 2 + bt);
	for (int64_t i = 0; i < asz; i++)
		a[i] = (double)(kltest_next(&rng) % 7) - 3;
	for (int64_t i = 0; i < bsz; i++)
		b[i] = (double)(kltest_next(&rng) % 7) - 3;
	kl_gemm g = {.m = M,
	             .n = N,
	             .k = K,
	             .a_rs = a_rs,
	             .a_cs = a_cs,
	             .b_rs = b_rs,
	             .b_cs = b_cs,
	             .ldc = ldd,
	             .ldd = ldd,
	             .batch = 1};
	kl_lt_geom o;
	char why[256];
	assert_int_equal(kl__lt_geometry(&g, &o, why, sizeof why), KL_OK);
	assert_int_equal(o.m, N);
	assert_int_equal(o.n, M);
	assert_int_equal(o.k, K);
	/* stored shapes must fit their leading dimensions */
	assert_true(o.lda >= (int64_t)o.a_rows && o.ldb >= (int64_t)o.b_rows);
	assert_true((o.trans_a ? o.a_cols : o.a_rows) == (uint64_t)N);
	assert_true((o.trans_b ? o.b_cols : o.b_rows) == (uint64_t)K);
	/* cuBLASLt: D'(i, j) = sum_p op(A')(i, p) op(B')(p, j), D' col-major m x n;
	 * its A' is our b and its B' our a */
	for (int64_t i = 0; i < o.m; i++)
		for (int64_t j = 0; j < o.n; j++) {
			double s = 0;
			for (int64_t p = 0; p < o.k; p++)
				s += op_at(b, o.trans_a, o.lda, i, p) *
				     op_at(a, o.trans_b, o.ldb, p, j);
			d[i + j * o.ldd] = s;
		}
	for (int64_t r = 0; r < M; r++)
		for (int64_t c = 0; c < N; c++) {
			double s = 0;
			for (int64_t p = 0; p < K; p++)
				s += a[r * a_rs + p * a_cs] * b[p * b_rs + c * b_cs];
			assert_true(d[r * ldd + c] == s);
		}
	free(a);
	free(b);
	free(d);
}

static void test_lt_geometry(void **state)
{
	(void)state;
	static const int64_t dims[][3] = {{4, 5, 6}, {1, 7, 3}, {6, 1, 5}, {3, 4, 1},
	                                  {1, 1, 1}, {9, 2, 8}, {1, 5, 1}, {17, 13, 11}};
	for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
		for (int at = 0; at < 2; at++)
			for (int bt = 0; bt < 2; bt++)
				for (int pad = 0; pad < 3; pad += 2)
					check_geometry(dims[i][0], dims[i][1], dims[i][2], at, bt,
					               pad);

	/* strides with no unit step, and a broadcast row, are refused */
	kl_gemm g = {.m = 4,
	             .n = 5,
	             .k = 6,
	             .a_rs = 12,
	             .a_cs = 2,
	             .b_rs = 5,
	             .b_cs = 1,
	             .ldc = 5,
	             .ldd = 5,
	             .batch = 1};
	kl_lt_geom o;
	char why[256];
	assert_int_equal(kl__lt_geometry(&g, &o, why, sizeof why), KL_EUNSUPPORTED);
	assert_non_null(strstr(why, "operand A strides [12,2]"));
	g.a_rs = 6;
	g.a_cs = 1;
	g.b_rs = 0; /* every row of B the same: cuBLASLt has no such layout */
	assert_int_equal(kl__lt_geometry(&g, &o, why, sizeof why), KL_EUNSUPPORTED);
	g.b_rs = 5;
	g.ldd = 4;
	assert_int_equal(kl__lt_geometry(&g, &o, why, sizeof why), KL_EINVAL);
	assert_non_null(strstr(why, "row stride 4 of D"));
	g.ldd = 5;
	g.k = 0;
	assert_int_equal(kl__lt_geometry(&g, &o, why, sizeof why), KL_EINVAL);
}

static void test_cublaslt_loads(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_status s = kl__cuda_load_cublaslt(ctx);
	if (s != KL_OK) {
		assert_int_equal(s, KL_EDEVICE);
		assert_non_null(strstr(kl_last_error(ctx), "no cuBLASLt found ("));
		print_message("test_cuda: skipped, cuBLASLt is not loadable here: %s\n",
		              kl_last_error(ctx));
		kl_ctx_free(ctx);
		skip();
	}
	assert_true(kl__lt.version >= 120000);
	assert_non_null(kl__lt.cublasLtMatmul);
	kl_ctx_free(ctx);
}


/* ---- max-autotune entries (no GPU) ------------------------------------------------- */

/* a program of three steps: kernel, matmul, kernel (only the kinds matter) */
static void tune_prog(kl_program *p, kl_step *steps, int n)
{
	memset(p, 0, sizeof *p);
	memset(steps, 0, sizeof *steps * (size_t)n);
	for (int s = 0; s < n; s++)
		steps[s].kind = s == 1 ? KL_STEP_MATMUL : KL_STEP_KERNEL;
	p->steps = steps;
	p->nsteps = n;
}

static bool rejects(const kl_program *p, uint64_t devid, const uint8_t *b, size_t len,
                    const char *want)
{
	kl_tune_step back[3];
	char why[KL_ERR_CAP];
	kl_status s = kl__tune_decode(p, devid, b, len, back, why, sizeof why);
	if (s != KL_EFORMAT || !strstr(why, want)) {
		print_message("decode gave %d (%s), want KL_EFORMAT with '%s'\n", (int)s, why, want);
		return false;
	}
	return true;
}

static void test_tune_entry(void **state)
{
	(void)state;
	kl_program p;
	kl_step st[3];
	tune_prog(&p, st, 3);
	kl_tune_step t[3];
	memset(t, 0, sizeof t);
	uint64_t rng = 3;
	t[0].gcap = 264;
	t[0].ms = 0.25f;
	t[1].has_algo = true;
	t[1].ms = 1.5f;
	t[1].algo.workspace = 1 << 20;
	for (size_t i = 0; i < sizeof t[1].algo.algo.data / sizeof t[1].algo.algo.data[0]; i++)
		t[1].algo.algo.data[i] = kltest_next(&rng);
	t[1].algo.align[0] = t[1].algo.align[1] = 256;
	t[1].algo.align[2] = t[1].algo.align[3] = 16;
	t[2].ms = 0.125f;
	uint64_t devid = 0x1234abcd5678ef00ull;
	uint8_t *b = NULL;
	size_t len = 0;
	assert_int_equal(kl__tune_encode(&p, devid, t, &b, &len), KL_OK);
	kl_tune_step back[3];
	char why[KL_ERR_CAP];
	assert_int_equal(kl__tune_decode(&p, devid, b, len, back, why, sizeof why), KL_OK);
	assert_int_equal(back[0].gcap, 264);
	assert_false(back[0].has_algo);
	assert_true(back[1].has_algo);
	assert_memory_equal(&back[1].algo.algo, &t[1].algo.algo, sizeof t[1].algo.algo);
	assert_int_equal(back[1].algo.workspace, 1 << 20);
	assert_int_equal(back[1].algo.align[0], 256);
	assert_int_equal(back[1].algo.align[3], 16);
	assert_true(back[2].ms == 0.125f && back[2].gcap == 0);

	/* every way an entry can fail to fit is refused with its reason */
	assert_true(rejects(&p, devid + 1, b, len, "tuned on another device"));
	assert_true(rejects(&p, devid, b, len - 1, "bytes for 3 steps"));
	assert_true(rejects(&p, devid, b, 10, "not a tuning entry"));
	kl_program p2;
	kl_step st2[2];
	tune_prog(&p2, st2, 2);
	assert_true(rejects(&p2, devid, b, len, "3 steps, the variant has 2"));
	st[1].kind = KL_STEP_KERNEL; /* the variant's step 1 is a kernel now */
	assert_true(rejects(&p, devid, b, len, "step 1 is a kernel"));
	st[1].kind = KL_STEP_MATMUL;
	size_t rec = (len - 24) / 3;
	uint8_t *c = malloc(len);
	struct {
		size_t off;
		uint32_t v;
		const char *want;
	} bad[] = {
	        {8, 2, "format version 2"},
	        {24 + 4, 1u << 30, "step 0: grid cap"},        /* gcap too large */
	        {24 + rec + 4, 64, "step 1: grid cap 64 on a matmul"},
	        {24 + 12, 1, "step 0: algorithm flag 1 on a kernel"},
	        {24 + rec + 12, 7, "step 1: algorithm flag 7"},
	        {24 + rec + 24, 3, "step 1: operand alignment 3"},
	        {24 + rec + 8, 0x7fc00000u, "step 1: time nan"}, /* NaN ms */
	        {24 + 2 * rec + 16, 5, "step 2: workspace 5 without an algorithm"},
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		memcpy(c, b, len);
		memcpy(c + bad[i].off, &bad[i].v, 4);
		assert_true(rejects(&p, devid, c, len, bad[i].want));
	}
	free(c);
	free(b);

	/* names and keys: per variant and device */
	char n1[96], n2[96];
	uint64_t k1, k2, k3;
	kl__tune_entry(1, devid, n1, sizeof n1, &k1);
	kl__tune_entry(2, devid, n2, sizeof n2, &k2);
	assert_string_not_equal(n1, n2);
	assert_true(k1 != k2);
	kl__tune_entry(1, devid + 1, n2, sizeof n2, &k3);
	assert_true(k1 != k3);
	assert_non_null(strstr(n1, "tune-0000000000000001-1234abcd5678ef00.klt"));
}

/* The bodies the GPU graph tests compile lower as those tests assume: a
 * product reading an input and writing an output, kernels reading that
 * output, the moving input and other inputs. */
static kl_status body_mm(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user);
static kl_status body_kernels(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user);

static void lower_body(kl_fn_body f, int nin, int nout, kl_tensor *const *in, kl_program *P)
{
	kl_ctx *ctx = kl_tensor_ctx(in[0]);
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *outs[4] = {NULL};
	assert_int_equal(f(ctx, in, nin, outs, nout, NULL), KL_OK);
	kl_trace *tr = kl__trace_end(ctx, nout, outs);
	kl_scope_end(ctx);
	assert_non_null(tr);
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
	char err[512];
	assert_int_equal(kl__lower(&tr->g, &o, P, err, sizeof err), KL_OK);
	kl__trace_free(tr);
}

static void mm_inputs(kl_ctx *ctx, uint64_t seed, kl_tensor **in)
{
	in[0] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	in[1] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){32, 24}, KLTEST_NORMAL, KLTEST_CONTIG,
	                    seed + 1);
	in[2] = kltest_rand(ctx, KL_F32, 1, (int64_t[]){24}, KLTEST_NORMAL, KLTEST_CONTIG, seed + 2);
}

static void test_graph_bodies_lower(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_tensor *in[3];
	mm_inputs(ctx, 5, in);
	kl_program P;
	lower_body(body_mm, 3, 3, in, &P);
	int mm_out = 0, kernels = 0;
	for (int32_t s = 0; s < P.nsteps; s++) {
		const kl_step *sp = &P.steps[s];
		if (sp->kind == KL_STEP_MATMUL) {
			mm_out += P.bufs[sp->mm.c].role == KL_BUF_OUTPUT &&
			          P.bufs[sp->mm.a].role == KL_BUF_INPUT &&
			          P.bufs[sp->mm.a].index == 0;
		} else {
			kernels++;
		}
	}
	assert_int_equal(mm_out, 1);
	assert_true(kernels >= 1);
	kl__program_free(&P);
	kl_tensor *kin[2] = {
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, 8),
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 32}, KLTEST_NORMAL, KLTEST_CONTIG, 9)};
	lower_body(body_kernels, 2, 2, kin, &P);
	kl_release(kin[0]);
	kl_release(kin[1]);
	for (int32_t s = 0; s < P.nsteps; s++)
		assert_int_equal(P.steps[s].kind, KL_STEP_KERNEL);
	kl__program_free(&P);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	kl_ctx_free(ctx);
}

/* ---- with a GPU ------------------------------------------------------------------- */

static kl_ctx *gctx;
static kl_cuda_dev *gdev;
static char gwhy[KL_ERR_CAP];

static int gpu_setup(void **state)
{
	(void)state;
	gctx = kl_ctx_new(NULL);
	if (!gctx)
		return -1;
	if (kl__cuda_dev_open(gctx, 0, &gdev) != KL_OK) {
		snprintf(gwhy, sizeof gwhy, "%s", kl_last_error(gctx));
		gdev = NULL;
		print_message("test_cuda: GPU tests skipped: %s\n", gwhy);
	} else {
		print_message("test_cuda: device 0: %s, sm_%d%d, %d SMs, %zu MiB, L2 %d KiB, "
		              "smem/block %d (opt-in %d)\n",
		              gdev->name, gdev->cc_major, gdev->cc_minor, gdev->sm_count,
		              gdev->total_mem >> 20, gdev->l2_bytes >> 10, gdev->smem_per_block,
		              gdev->smem_per_block_optin);
	}
	return 0;
}

static int gpu_teardown(void **state)
{
	(void)state;
	kl__cuda_dev_close(gdev);
	gdev = NULL;
	kl_ctx_free(gctx);
	return 0;
}

#define NEED_GPU()                                                                    \
	do {                                                                          \
		if (!gdev) {                                                          \
			print_message("test_cuda: %s skipped: %s\n", __func__, gwhy); \
			skip();                                                       \
		}                                                                     \
	} while (0)

static void test_gpu_alloc(void **state)
{
	(void)state;
	NEED_GPU();
	kl_pool_stats before = gdev->pool.st;
	CUdeviceptr a = 0, b = 0, c = 0;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, 3 << 20, &a), KL_OK);
	assert_true(a % 256 == 0);
	assert_int_equal(kl__cuda_free(gctx, gdev, a), KL_OK);
	uint64_t raw = gdev->pool.st.raw_allocs;
	/* warm: the same class again and again, no cuMemAlloc */
	for (int i = 0; i < 100; i++) {
		assert_int_equal(kl__cuda_malloc(gctx, gdev, (3 << 20) - i, &b), KL_OK);
		assert_true(b == a);
		assert_int_equal(kl__cuda_free(gctx, gdev, b), KL_OK);
	}
	assert_int_equal(gdev->pool.st.raw_allocs, raw);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, 1000, &c), KL_OK);
	assert_true(gdev->pool.st.in_use == before.in_use + 1024);
	assert_true(gdev->pool.st.peak >= before.in_use + (3 << 20));
	assert_int_equal(kl__cuda_free(gctx, gdev, c), KL_OK);
	assert_int_equal(kl__cuda_free(gctx, gdev, c), KL_EINVAL);

	/* the backend table, through a context made CUDA */
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_int_equal(kl__cuda_ctx_init(ctx, 0, &kl__cuda_rt_hooks), KL_OK);
	assert_int_equal(ctx->device, KL_CUDA);
	assert_string_equal(ctx->be->name, "cuda");
	/* the device opened with cuBLASLt's workspace, from the same pool */
	kl_memory_usage mu;
	assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
	size_t base = mu.in_use;
	assert_non_null(kl__cuda_dev_of(ctx)->lt);
	assert_true(base >= (4u << 20));
	void *p = ctx->be->alloc(ctx, 4096);
	assert_non_null(p);
	ctx->be->free(ctx, p);
	void *q = ctx->be->alloc(ctx, 4000);
	assert_ptr_equal(p, q);
	/* kl_memory_stats reads the device's pool */
	assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
	assert_int_equal(mu.in_use, base + 4096);
	assert_true(mu.peak >= base + 4096 && mu.reserved >= base + 4096);
	ctx->be->free(ctx, q);
	assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
	assert_int_equal(mu.in_use, base);
	assert_true(mu.peak >= base + 4096);
	assert_int_equal(kl_memory_reset_peak(ctx), KL_OK);
	assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
	assert_int_equal(mu.peak, base);
	assert_true(mu.reserved >= base + 4096); /* the block stays cached */
	kl__cuda_ctx_fini(ctx);
	assert_null(ctx->backend_state);
	kl__cuda_ctx_fini(ctx);
	ctx->be = &kl__cpu_backend;
	kl_ctx_free(ctx);

	/* a device index that does not exist */
	kl_cuda_dev *none = NULL;
	assert_int_equal(kl__cuda_dev_open(gctx, 4096, &none), KL_EDEVICE);
	assert_non_null(strstr(kl_last_error(gctx), "CUDA device 4096 does not exist"));
	assert_null(none);
}

static void test_gpu_copies(void **state)
{
	(void)state;
	NEED_GPU();
	static const size_t sizes[] = {1, 1000, (1 << 20) + 3, 33 << 20};
	uint64_t rng = 99;
	for (size_t t = 0; t < sizeof sizes / sizeof sizes[0]; t++) {
		size_t n = sizes[t];
		unsigned char *h = malloc(n), *back = malloc(n);
		for (size_t i = 0; i < n; i++)
			h[i] = (unsigned char)kltest_next(&rng);
		memset(back, 0xA5, n);
		CUdeviceptr d1, d2;
		assert_int_equal(kl__cuda_malloc(gctx, gdev, n, &d1), KL_OK);
		assert_int_equal(kl__cuda_malloc(gctx, gdev, n, &d2), KL_OK);
		assert_int_equal(kl__cuda_memset(gctx, gdev, d2, 0x5A, n), KL_OK);
		assert_int_equal(kl__cuda_h2d(gctx, gdev, d1, h, n), KL_OK);
		assert_int_equal(kl__cuda_d2d(gctx, gdev, d2, d1, n / 2), KL_OK);
		assert_int_equal(kl__cuda_d2h(gctx, gdev, back, d2, n), KL_OK);
		assert_memory_equal(back, h, n / 2);
		for (size_t i = n / 2; i < n; i++)
			assert_int_equal(back[i], 0x5A);
		assert_int_equal(kl__cuda_d2h(gctx, gdev, back, d1, n), KL_OK);
		assert_memory_equal(back, h, n);
		kl__cuda_free(gctx, gdev, d1);
		kl__cuda_free(gctx, gdev, d2);
		free(h);
		free(back);
	}
	size_t fb = 0, tot = 0;
	assert_int_equal(kl__cuda_mem_info(gctx, gdev, &fb, &tot), KL_OK);
	assert_true(fb > 0 && fb <= tot);
}

static void test_gpu_kernel(void **state)
{
	(void)state;
	NEED_GPU();
	kl_cuda_module *m = NULL;
	assert_int_equal(kl__cuda_module_build(gctx, gdev, VADD_SRC, "vadd.cu", &m), KL_OK);
	CUfunction vadd, rowsum, missing;
	assert_int_equal(kl__cuda_module_fn(gctx, m, "vadd", &vadd), KL_OK);
	assert_int_equal(kl__cuda_module_fn(gctx, m, "rowsum", &rowsum), KL_OK);
	assert_int_equal(kl__cuda_module_fn(gctx, m, "nope", &missing), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(gctx), "no kernel named nope"));

	/* vadd over 8-wide chunks plus a tail of 5 */
	int64_t n = (1 << 20) + 5;
	size_t nb = (size_t)n * 2;
	uint16_t *a = malloc(nb), *b = malloc(nb), *c = malloc(nb);
	uint64_t rng = 5;
	for (int64_t i = 0; i < n; i++) {
		a[i] = kl__f32_to_f16((float)(kltest_uniform(&rng) * 8 - 4));
		b[i] = kl__f32_to_f16((float)(kltest_uniform(&rng) * 8 - 4));
	}
	CUdeviceptr da, db, dc;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &da), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &db), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &dc), KL_OK);
	assert_int_equal(kl__cuda_h2d(gctx, gdev, da, a, nb), KL_OK);
	assert_int_equal(kl__cuda_h2d(gctx, gdev, db, b, nb), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, dc, 0xFF, nb), KL_OK); /* NaN poison */
	void *args[] = {&da, &db, &dc, &n};
	unsigned threads = 256, blocks = (unsigned)((n / 8 + 1 + threads - 1) / threads);
	assert_int_equal(kl__cuda_launch(gctx, gdev, vadd, (unsigned[3]){blocks, 1, 1},
	                                 (unsigned[3]){threads, 1, 1}, 0, args, 0),
	                 KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, c, dc, nb), KL_OK);
	int64_t bad = 0;
	for (int64_t i = 0; i < n; i++) {
		/* both sides: exact f32 sum of two f16, rounded to nearest even once */
		uint16_t want = kl__f32_to_f16(kl__f16_to_f32(a[i]) + kl__f16_to_f32(b[i]));
		bad += c[i] != want;
	}
	assert_int_equal(bad, 0);

	/* row sums through the block reduction */
	int rows = 37, cols = 1000;
	uint16_t *x = malloc((size_t)rows * cols * 2);
	float sums[37];
	for (int i = 0; i < rows * cols; i++)
		x[i] = kl__f32_to_bf16((float)(kltest_uniform(&rng) * 2 - 1));
	CUdeviceptr dx, ds;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, (size_t)rows * cols * 2, &dx), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, sizeof sums, &ds), KL_OK);
	assert_int_equal(kl__cuda_h2d(gctx, gdev, dx, x, (size_t)rows * cols * 2), KL_OK);
	void *rargs[] = {&dx, &ds, &cols};
	assert_int_equal(kl__cuda_launch(gctx, gdev, rowsum, (unsigned[3]){(unsigned)rows, 1, 1},
	                                 (unsigned[3]){128, 1, 1}, 0, rargs, 0),
	                 KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, sums, ds, sizeof sums), KL_OK);
	for (int r = 0; r < rows; r++) {
		double s = 0;
		for (int j = 0; j < cols; j++)
			s += kl__bf16_to_f32(x[r * cols + j]);
		assert_true(fabs(sums[r] - s) <= 1e-4 * cols);
	}

	/* too much shared memory is refused before the launch */
	assert_int_equal(kl__cuda_launch(gctx, gdev, vadd, (unsigned[3]){1, 1, 1},
	                                 (unsigned[3]){32, 1, 1},
	                                 (unsigned)gdev->smem_per_block_optin + 1, args, 0),
	                 KL_EINVAL);
	kl__cuda_free(gctx, gdev, da);
	kl__cuda_free(gctx, gdev, db);
	kl__cuda_free(gctx, gdev, dc);
	kl__cuda_free(gctx, gdev, dx);
	kl__cuda_free(gctx, gdev, ds);
	kl__cuda_module_free(m);
	free(a);
	free(b);
	free(c);
	free(x);
}

/* ---- cuBLASLt on the GPU ---------------------------------------------------------- */

static double gelu_tanh(double x)
{
	return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

typedef struct gemm_case {
	kl_dtype ab, cd;
	int64_t m, n, k, batch;
	bool bt; /* B handed over as [n, k] (a linear layer's weight) */
	kl_epilogue epi;
	double alpha, beta, tol;
	bool tf32;
} gemm_case;

static CUdeviceptr upload(const double *v, int64_t n, kl_dtype dt)
{
	size_t nb = (size_t)n * kl_dtype_size(dt);
	void *h = malloc(nb);
	for (int64_t i = 0; i < n; i++)
		kl__store(h, dt, i, v[i]);
	CUdeviceptr d = 0;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &d), KL_OK);
	assert_int_equal(kl__cuda_h2d(gctx, gdev, d, h, nb), KL_OK);
	assert_int_equal(kl__cuda_sync(gctx, gdev), KL_OK);
	free(h);
	return d;
}

static double *fill(int64_t n, kl_dtype dt, uint64_t *rng)
{
	double *v = malloc((size_t)n * sizeof *v);
	for (int64_t i = 0; i < n; i++)
		v[i] = kl__round_to(dt, kltest_uniform(rng) * 2 - 1);
	return v;
}

static void run_gemm_case(const gemm_case *t, uint64_t seed, int nalgos)
{
	int64_t M = t->m, N = t->n, K = t->k, B = t->batch;
	uint64_t rng = seed;
	double *a = fill(B * M * K, t->ab, &rng), *b = fill(B * K * N, t->ab, &rng);
	double *c = fill(B * M * N, t->cd, &rng), *bias = fill(N, t->cd, &rng);
	bool has_bias =
	        t->epi == KL_EPI_BIAS || t->epi == KL_EPI_RELU_BIAS || t->epi == KL_EPI_GELU_BIAS;
	kl_gemm g = {.ab = t->ab,
	             .cd = t->cd,
	             .m = M,
	             .n = N,
	             .k = K,
	             .batch = B,
	             .a_rs = K,
	             .a_cs = 1,
	             .b_rs = t->bt ? 1 : N,
	             .b_cs = t->bt ? K : 1,
	             .ldc = N,
	             .ldd = N,
	             .a_bs = M * K,
	             .b_bs = K * N,
	             .c_bs = M * N,
	             .d_bs = M * N,
	             .epi = t->epi,
	             .alpha = t->alpha,
	             .beta = t->beta,
	             .allow_tf32 = t->tf32};
	g.a = upload(a, B * M * K, t->ab);
	g.b = upload(b, B * K * N, t->ab);
	g.c = t->beta != 0 ? upload(c, B * M * N, t->cd) : 0;
	g.bias = has_bias ? upload(bias, N, t->cd) : 0;
	size_t dbytes = (size_t)(B * M * N) * kl_dtype_size(t->cd);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, dbytes, &g.d), KL_OK);

	double *ref = malloc((size_t)(B * M * N) * sizeof *ref);
	double refmax = 0;
	for (int64_t q = 0; q < B; q++)
		for (int64_t i = 0; i < M; i++)
			for (int64_t j = 0; j < N; j++) {
				double s = 0;
				for (int64_t p = 0; p < K; p++) {
					double bv = t->bt ? b[q * K * N + j * K + p]
					                  : b[q * K * N + p * N + j];
					s += a[q * M * K + i * K + p] * bv;
				}
				double v = t->alpha * s + t->beta * c[q * M * N + i * N + j];
				if (has_bias)
					v += bias[j];
				if (t->epi == KL_EPI_RELU || t->epi == KL_EPI_RELU_BIAS)
					v = v > 0 ? v : 0;
				if (t->epi == KL_EPI_GELU || t->epi == KL_EPI_GELU_BIAS)
					v = gelu_tanh(v);
				ref[q * M * N + i * N + j] = v;
				refmax = fmax(refmax, fabs(v));
			}

	kl_lt_algo algos[8];
	int nal = 0;
	if (nalgos > 0) {
		assert_int_equal(kl__lt_heuristics(gctx, gdev, &g, nalgos, algos, &nal), KL_OK);
		assert_true(nal >= 1 && nal <= nalgos);
	}
	void *h = malloc(dbytes);
	for (int run = 0; run < (nal ? nal : 1); run++) {
		assert_int_equal(kl__cuda_memset(gctx, gdev, g.d, 0xFF, dbytes), KL_OK); /* NaN */
		assert_int_equal(kl__lt_matmul(gctx, gdev, &g, nal ? &algos[run] : NULL), KL_OK);
		assert_int_equal(kl__cuda_d2h(gctx, gdev, h, g.d, dbytes), KL_OK);
		double num = 0, den = 0, worst = 0;
		for (int64_t i = 0; i < B * M * N; i++) {
			double v = kl__load(h, t->cd, i), e = fabs(v - ref[i]);
			assert_false(isnan(v));
			num += e * e;
			den += ref[i] * ref[i];
			worst = fmax(worst, e);
		}
		double rel = sqrt(num / (den > 0 ? den : 1));
		if (rel > t->tol || worst > 4 * t->tol * refmax)
			print_message(
			        "gemm %s->%s %lldx%lldx%lld batch %lld epi %d algo %d: rel err "
			        "%.3g, worst %.3g of max %.3g\n",
			        kl_dtype_name(t->ab), kl_dtype_name(t->cd), (long long)M,
			        (long long)N, (long long)K, (long long)B, (int)t->epi, run, rel,
			        worst, refmax);
		assert_true(rel <= t->tol);
		assert_true(worst <= 4 * t->tol * refmax);
		if (nal) { /* what an autotuner would compare them by */
			float ms = -1;
			assert_int_equal(kl__lt_time(gctx, gdev, &g, &algos[run], 3, &ms), KL_OK);
			assert_true(ms > 0 && ms < 1000);
		}
	}
	kl__cuda_free(gctx, gdev, g.a);
	kl__cuda_free(gctx, gdev, g.b);
	kl__cuda_free(gctx, gdev, g.c);
	kl__cuda_free(gctx, gdev, g.bias);
	kl__cuda_free(gctx, gdev, g.d);
	free(a);
	free(b);
	free(c);
	free(bias);
	free(ref);
	free(h);
}

static void test_gpu_gemm(void **state)
{
	(void)state;
	NEED_GPU();
	static const gemm_case cases[] = {
	        /* the brief's case: bf16, bias + GELU epilogue, beta * C residual */
	        {KL_BF16, KL_BF16, 128, 256, 192, 1, false, KL_EPI_GELU_BIAS, 0.5, 1.0, 1e-2,
	         false},
	        {KL_BF16, KL_F32, 72, 40, 56, 3, true, KL_EPI_BIAS, 1.0, 0.5, 1e-2, false},
	        {KL_F16, KL_F16, 33, 24, 40, 2, false, KL_EPI_RELU_BIAS, 1.0, 0.0, 5e-3, false},
	        {KL_BF16, KL_BF16, 64, 64, 64, 1, true, KL_EPI_GELU, 2.0, 0.0, 1e-2, false},
	        {KL_F16, KL_F16, 48, 32, 96, 1, false, KL_EPI_RELU, 1.0, 1.0, 5e-3, false},
	        {KL_F32, KL_F32, 64, 48, 80, 2, false, KL_EPI_DEFAULT, 1.0, 0.25, 1e-5, false},
	        {KL_F64, KL_F64, 20, 30, 40, 1, true, KL_EPI_DEFAULT, 1.0, 0.0, 1e-12, false},
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
		run_gemm_case(&cases[i], 1000 + i, 0);
	/* 1-4 rows against a weight [n, k]: kiln's few-row kernel (gemv_cuda.c),
	 * its 4-loads-a-lane loop (k >= 1024) and its tail, every epilogue */
	static const gemm_case few[] = {
	        {KL_BF16, KL_BF16, 1, 2048, 2048, 1, true, KL_EPI_DEFAULT, 1.0, 0.0, 1e-2, false},
	        {KL_BF16, KL_BF16, 1, 200, 2056, 1, true, KL_EPI_BIAS, 1.0, 1.0, 1e-2, false},
	        {KL_F16, KL_F16, 2, 96, 1032, 1, true, KL_EPI_GELU_BIAS, 0.5, 0.0, 5e-3, false},
	        {KL_BF16, KL_BF16, 3, 64, 40, 1, true, KL_EPI_RELU_BIAS, 1.0, 0.5, 1e-2, false},
	        {KL_F16, KL_F16, 4, 130, 4104, 1, true, KL_EPI_RELU, 2.0, 1.0, 5e-3, false},
	        {KL_BF16, KL_BF16, 4, 33, 8, 1, true, KL_EPI_GELU, 1.0, 0.0, 1e-2, false},
	};
	uint64_t g0 = kl__cuda_gemv_launches();
	for (size_t i = 0; i < sizeof few / sizeof few[0]; i++)
		run_gemm_case(&few[i], 2000 + i, 0);
	assert_int_equal(kl__cuda_gemv_launches() - g0, sizeof few / sizeof few[0]);
	/* every candidate the heuristic offers computes the same product */
	run_gemm_case(&cases[0], 77, 4);
	run_gemm_case(&cases[5], 78, 4);
	/* tf32 is allowed to lose precision, not correctness */
	gemm_case tf = cases[5];
	tf.tol = 5e-3;
	tf.tf32 = true;
	run_gemm_case(&tf, 79, 0);

	/* a product cuBLASLt cannot take, refused with the reason */
	kl_gemm bad = {.ab = KL_I32, .cd = KL_I32, .m = 4, .n = 4, .k = 4, .batch = 1};
	assert_int_equal(kl__lt_matmul(gctx, gdev, &bad, NULL), KL_EUNSUPPORTED);
	assert_non_null(strstr(kl_last_error(gctx), "i32 matrix products"));
}

/* two batch dims that do not nest: the outer one loops, the inner is strided */
static void test_gpu_gemm_nd(void **state)
{
	(void)state;
	NEED_GPU();
	int64_t M = 16, N = 24, K = 32, B0 = 2, B1 = 3;
	uint64_t rng = 3;
	/* A stored [B1][B0][M][K] but read as [B0][B1]; B shared by every batch */
	double *a = fill(B0 * B1 * M * K, KL_F32, &rng), *b = fill(K * N, KL_F32, &rng);
	kl_gemm g = {.ab = KL_F32,
	             .cd = KL_F32,
	             .m = M,
	             .n = N,
	             .k = K,
	             .a_rs = K,
	             .a_cs = 1,
	             .b_rs = N,
	             .b_cs = 1,
	             .ldd = N,
	             .alpha = 1.0};
	g.a = upload(a, B0 * B1 * M * K, KL_F32);
	g.b = upload(b, K * N, KL_F32);
	size_t dbytes = (size_t)(B0 * B1 * M * N) * 4;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, dbytes, &g.d), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, g.d, 0xFF, dbytes), KL_OK);
	int64_t batch[2] = {B0, B1}, abs_[2] = {M * K, B0 * M * K}, bbs[2] = {0, 0};
	int64_t dbs[2] = {B1 * M * N, M * N};
	assert_int_equal(kl__lt_matmul_nd(gctx, gdev, &g, 2, batch, abs_, bbs, dbs, dbs), KL_OK);
	float *h = malloc(dbytes);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, h, g.d, dbytes), KL_OK);
	for (int64_t i0 = 0; i0 < B0; i0++)
		for (int64_t i1 = 0; i1 < B1; i1++)
			for (int64_t i = 0; i < M; i++)
				for (int64_t j = 0; j < N; j++) {
					double s = 0;
					for (int64_t p = 0; p < K; p++)
						s += a[i0 * abs_[0] + i1 * abs_[1] + i * K + p] *
						     b[p * N + j];
					double v = h[i0 * dbs[0] + i1 * dbs[1] + i * N + j];
					assert_true(fabs(v - s) <= 1e-4 * (1 + fabs(s)));
				}

	/* a runtime step: C[q] += 0.5 * R[1 + q] @ b^T in place, where R is the
	 * result above ([B0*B1][M][N]) entered one matrix in, and b ([K][N]) is
	 * read transposed: an M x N by N x K product */
	kl_matmul_step mm;
	memset(&mm, 0, sizeof mm);
	mm.m = M;
	mm.n = K;
	mm.k = N;
	mm.nbatch = 1;
	mm.batch[0] = B1;
	mm.a_bstride[0] = M * N;
	mm.b_bstride[0] = 0;
	mm.c_bstride[0] = M * K;
	mm.a_off = M * N;
	mm.a_rs = N;
	mm.a_cs = 1;
	mm.b_rs = 1; /* element (p, j) of b^T is b[j][p], at p + j * N */
	mm.b_cs = N;
	mm.ldc = K;
	mm.alpha = 0.5;
	mm.beta = 1.0;
	double *c0 = fill(B1 * M * K, KL_F32, &rng);
	CUdeviceptr dc = upload(c0, B1 * M * K, KL_F32);
	assert_int_equal(kl__lt_matmul_step(gctx, gdev, &mm, KL_F32, KL_F32, g.d, g.b, dc, 0, 0, NULL),
	                 KL_OK);
	float *hc = malloc((size_t)(B1 * M * K) * 4);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, hc, dc, (size_t)(B1 * M * K) * 4), KL_OK);
	for (int64_t q = 0; q < B1; q++)
		for (int64_t i = 0; i < M; i++)
			for (int64_t j = 0; j < K; j++) {
				double s = 0;
				for (int64_t p = 0; p < N; p++)
					s += (double)h[M * N + q * M * N + i * N + p] *
					     b[j * N + p];
				double want = 0.5 * s + c0[q * M * K + i * K + j];
				assert_true(fabs(hc[q * M * K + i * K + j] - want) <=
				            1e-4 * (1 + fabs(want)));
			}
	kl__cuda_free(gctx, gdev, dc);
	free(c0);
	free(hc);

	kl__cuda_free(gctx, gdev, g.a);
	kl__cuda_free(gctx, gdev, g.b);
	kl__cuda_free(gctx, gdev, g.d);
	free(a);
	free(b);
	free(h);
}

/* kl_matmul on a CUDA context, through the backend's exec, against the host */
static void test_gpu_eager_matmul(void **state)
{
	(void)state;
	NEED_GPU();
	kl_ctx *gpu = kl_ctx_new(NULL);
	assert_int_equal(kl__cuda_ctx_init(gpu, 0, &kl__cuda_rt_hooks), KL_OK);
	int64_t sa[3] = {2, 5, 7}, sb[2] = {7, 3};
	uint64_t rng = 11;
	double *va = fill(70, KL_F32, &rng), *vb = fill(21, KL_F32, &rng);
	float fa[70], fb[21], out[30];
	for (int i = 0; i < 70; i++)
		fa[i] = (float)va[i];
	for (int i = 0; i < 21; i++)
		fb[i] = (float)vb[i];
	kl_tensor *ga = kl_from_host(gpu, KL_F32, 3, sa, fa, sizeof fa),
	          *gb = kl_from_host(gpu, KL_F32, 2, sb, fb, sizeof fb);
	assert_non_null(ga);
	assert_non_null(gb);
	kl_tensor *gc = kl_matmul(ga, gb);
	assert_non_null(gc);
	assert_int_equal(kl_to_host(gc, out, sizeof out), KL_OK);
	for (int q = 0; q < 2; q++)
		for (int i = 0; i < 5; i++)
			for (int j = 0; j < 3; j++) {
				double s = 0;
				for (int p = 0; p < 7; p++)
					s += va[q * 35 + i * 7 + p] * vb[p * 3 + j];
				assert_true(fabs(out[q * 15 + i * 3 + j] - s) <=
				            1e-5 * (1 + fabs(s)));
			}
	/* other ops run once the CUDA renderer exists; until then they say why not */
	kl_tensor *sum = kl_add(ga, ga);
	if (!sum) {
		assert_int_equal(kl_last_status(gpu), KL_EUNSUPPORTED);
		assert_non_null(strstr(kl_last_error(gpu), "kl_add: eager execution on CUDA"));
		assert_non_null(strstr(kl_last_error(gpu), "renderer"));
	} else {
		float twice[70];
		assert_int_equal(kl_to_host(sum, twice, sizeof twice), KL_OK);
		for (int i = 0; i < 70; i++)
			assert_true(twice[i] == 2 * fa[i]);
		kl_release(sum);
	}
	kl_release(ga);
	kl_release(gb);
	kl_release(gc);
	kl__cuda_ctx_fini(gpu);
	gpu->be = &kl__cpu_backend;
	kl_ctx_free(gpu);
	free(va);
	free(vb);
}

static void test_gpu_graph(void **state)
{
	(void)state;
	NEED_GPU();
	kl_cuda_module *m = NULL;
	assert_int_equal(kl__cuda_module_build(gctx, gdev, VADD_SRC, "graph.cu", &m), KL_OK);
	CUfunction axpb;
	assert_int_equal(kl__cuda_module_fn(gctx, m, "axpb", &axpb), KL_OK);
	int n = 10000;
	size_t nb = (size_t)n * 4;
	float *x = malloc(nb), *y = malloc(nb);
	for (int i = 0; i < n; i++)
		x[i] = (float)i * 0.25f - 100;
	CUdeviceptr dx, d1, d2, d3, spare;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &dx), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &d1), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &d2), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &d3), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, 12345, &spare), KL_OK);
	assert_int_equal(kl__cuda_free(gctx, gdev, spare), KL_OK);
	assert_int_equal(kl__cuda_h2d(gctx, gdev, dx, x, nb), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, d1, 0, nb), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, d2, 0, nb), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, d3, 0, nb), KL_OK);
	assert_int_equal(kl__cuda_sync(gctx, gdev), KL_OK);

	/* y1 = 2x + 1, y2 = 3 y1: captured, not run */
	float a1 = 2, b1 = 1, a2 = 3, b2 = 0;
	unsigned grid[3] = {(unsigned)(n + 255) / 256, 1, 1}, block[3] = {256, 1, 1};
	kl_cuda_graph g = {0};
	CUgraphNode n1, n2;
	assert_int_equal(kl__cuda_capture_begin(gctx, gdev), KL_OK);
	assert_int_equal(kl__cuda_capture_begin(gctx, gdev), KL_ESTATE);
	void *args1[] = {&d1, &dx, &a1, &b1, &n};
	assert_int_equal(kl__cuda_launch(gctx, gdev, axpb, grid, block, 0, args1, 0), KL_OK);
	assert_int_equal(kl__cuda_capture_last_node(gctx, gdev, &n1), KL_OK);
	void *args2[] = {&d2, &d1, &a2, &b2, &n};
	assert_int_equal(kl__cuda_launch(gctx, gdev, axpb, grid, block, 0, args2, 0), KL_OK);
	assert_int_equal(kl__cuda_capture_last_node(gctx, gdev, &n2), KL_OK);
	/* allocation inside a capture: cached blocks only */
	CUdeviceptr inside = 0;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, 12345, &inside), KL_OK);
	assert_true(inside == spare);
	assert_int_equal(kl__cuda_free(gctx, gdev, inside), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, (size_t)7 << 30, &inside), KL_ESTATE);
	assert_non_null(strstr(kl_last_error(gctx), "during CUDA graph capture"));
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d2, nb), KL_ESTATE);
	assert_int_equal(kl__cuda_capture_end(gctx, gdev, &g), KL_OK);
	assert_true(n1 != n2);

	CUgraphNode *kn = NULL;
	int nk = 0;
	assert_int_equal(kl__cuda_graph_kernel_nodes(gctx, &g, &kn, &nk), KL_OK);
	assert_int_equal(nk, 2);
	assert_true((kn[0] == n1 && kn[1] == n2) || (kn[0] == n2 && kn[1] == n1));
	free(kn);

	/* nothing ran during capture */
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d2, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_true(y[i] == 0);

	for (int rep = 0; rep < 3; rep++)
		assert_int_equal(kl__cuda_graph_launch(gctx, gdev, &g), KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d2, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_true(y[i] == 3 * (2 * x[i] + 1));

	/* new scalars for node 1, a new output pointer for node 2 */
	float a1b = 5, b1b = -1;
	void *args1b[] = {&d1, &dx, &a1b, &b1b, &n};
	void *args2b[] = {&d3, &d1, &a2, &b2, &n};
	assert_int_equal(kl__cuda_graph_set_args(gctx, &g, n1, args1b), KL_OK);
	assert_int_equal(kl__cuda_graph_set_args(gctx, &g, n2, args2b), KL_OK);
	assert_int_equal(kl__cuda_graph_launch(gctx, gdev, &g), KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d3, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_true(y[i] == 3 * (5 * x[i] - 1));
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d2, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_true(y[i] == 3 * (2 * x[i] + 1)); /* untouched since */

	/* a second capture into the same graph object replaces it */
	assert_int_equal(kl__cuda_capture_begin(gctx, gdev), KL_OK);
	assert_int_equal(kl__cuda_launch(gctx, gdev, axpb, grid, block, 0, args1, 0), KL_OK);
	assert_int_equal(kl__cuda_capture_end(gctx, gdev, &g), KL_OK);
	assert_int_equal(kl__cuda_graph_launch(gctx, gdev, &g), KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, y, d1, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_true(y[i] == 2 * x[i] + 1);
	assert_int_equal(kl__cuda_capture_end(gctx, gdev, &g), KL_ESTATE);

	kl__cuda_graph_free(&g);
	kl__cuda_free(gctx, gdev, dx);
	kl__cuda_free(gctx, gdev, d1);
	kl__cuda_free(gctx, gdev, d2);
	kl__cuda_free(gctx, gdev, d3);
	kl__cuda_module_free(m);
	free(x);
	free(y);
}

/* Programmatic dependent launch: a consumer flagged KL_LAUNCH_PDL starts
 * while a slow producer (which triggers its dependants at once) still runs,
 * and must still read every value the producer wrote: run directly and as
 * a captured graph, outputs poisoned before each run. */
static void test_gpu_pdl(void **state)
{
	(void)state;
	NEED_GPU();
	kl_cuda_module *m = NULL;
	assert_int_equal(kl__cuda_module_build(gctx, gdev, VADD_SRC, "pdl.cu", &m), KL_OK);
	CUfunction slow, next;
	assert_int_equal(kl__cuda_module_fn(gctx, m, "pdl_slow", &slow), KL_OK);
	assert_int_equal(kl__cuda_module_fn(gctx, m, "pdl_next", &next), KL_OK);
	int n = 1 << 20, spin = 4000;
	size_t nb = (size_t)n * 4;
	float *want = malloc(nb), *got = malloc(nb);
	assert_non_null(want);
	assert_non_null(got);
	CUdeviceptr y, z;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &y), KL_OK);
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &z), KL_OK);
	unsigned grid[3] = {(unsigned)(n + 255) / 256, 1, 1}, block[3] = {256, 1, 1};
	void *a1[] = {&y, &n, &spin}, *a2[] = {&z, &y, &n};
	/* the reference: the same chain, plain launches */
	assert_int_equal(kl__cuda_memset(gctx, gdev, z, 0xFF, nb), KL_OK);
	assert_int_equal(kl__cuda_launch(gctx, gdev, slow, grid, block, 0, a1, 0), KL_OK);
	assert_int_equal(kl__cuda_launch(gctx, gdev, next, grid, block, 0, a2, 0), KL_OK);
	assert_int_equal(kl__cuda_d2h(gctx, gdev, want, z, nb), KL_OK);
	for (int i = 0; i < n; i++)
		assert_false(isnan(want[i]));
	for (int rep = 0; rep < 3; rep++) {
		assert_int_equal(kl__cuda_memset(gctx, gdev, y, 0xFF, nb), KL_OK);
		assert_int_equal(kl__cuda_memset(gctx, gdev, z, 0xFF, nb), KL_OK);
		assert_int_equal(kl__cuda_launch(gctx, gdev, slow, grid, block, 0, a1, KL_LAUNCH_PDL),
		                 KL_OK);
		assert_int_equal(kl__cuda_launch(gctx, gdev, next, grid, block, 0, a2, KL_LAUNCH_PDL),
		                 KL_OK);
		assert_int_equal(kl__cuda_d2h(gctx, gdev, got, z, nb), KL_OK);
		assert_memory_equal(got, want, nb);
	}
	kl_cuda_graph g = {0};
	assert_int_equal(kl__cuda_capture_begin(gctx, gdev), KL_OK);
	assert_int_equal(kl__cuda_launch(gctx, gdev, slow, grid, block, 0, a1, KL_LAUNCH_PDL), KL_OK);
	assert_int_equal(kl__cuda_launch(gctx, gdev, next, grid, block, 0, a2, KL_LAUNCH_PDL), KL_OK);
	assert_int_equal(kl__cuda_capture_end(gctx, gdev, &g), KL_OK);
	for (int rep = 0; rep < 3; rep++) {
		assert_int_equal(kl__cuda_memset(gctx, gdev, y, 0xFF, nb), KL_OK);
		assert_int_equal(kl__cuda_memset(gctx, gdev, z, 0xFF, nb), KL_OK);
		assert_int_equal(kl__cuda_graph_launch(gctx, gdev, &g), KL_OK);
		assert_int_equal(kl__cuda_d2h(gctx, gdev, got, z, nb), KL_OK);
		assert_memory_equal(got, want, nb);
	}
	kl__cuda_graph_free(&g);
	kl__cuda_free(gctx, gdev, y);
	kl__cuda_free(gctx, gdev, z);
	kl__cuda_module_free(m);
	free(want);
	free(got);
}

static void test_gpu_timing(void **state)
{
	(void)state;
	NEED_GPU();
	CUevent e0, e1;
	assert_int_equal(kl__cuda_event_new(gctx, gdev, &e0), KL_OK);
	assert_int_equal(kl__cuda_event_new(gctx, gdev, &e1), KL_OK);
	CUdeviceptr p;
	size_t nb = 64 << 20;
	assert_int_equal(kl__cuda_malloc(gctx, gdev, nb, &p), KL_OK);
	assert_int_equal(kl__cuda_event_record(gctx, gdev, e0), KL_OK);
	assert_int_equal(kl__cuda_memset(gctx, gdev, p, 1, nb), KL_OK);
	assert_int_equal(kl__cuda_event_record(gctx, gdev, e1), KL_OK);
	float ms = -1;
	assert_int_equal(kl__cuda_event_ms(gctx, e0, e1, &ms), KL_OK);
	assert_true(ms >= 0 && ms < 10000);
	kl__cuda_free(gctx, gdev, p);
	kl__cuda_event_free(gdev, e0);
	kl__cuda_event_free(gdev, e1);
}


/* ---- compiled functions through CUDA graphs and max-autotune ------------------------ */

/* out0 = x @ w (a product writing an output), out1 = relu(out0 + b) and
 * out2 = x * x (kernels reading that output and the moving input) */
static kl_status body_mm(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_matmul(in[0], in[1]);
	out[1] = kl_relu(kl_add(out[0], in[2]));
	out[2] = kl_mul(in[0], in[0]);
	return out[0] && out[1] && out[2] ? KL_OK : kl_last_status(ctx);
}

/* kernels only */
static kl_status body_kernels(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_relu(kl_add(kl_mul(in[0], in[1]), in[0]));
	out[1] = kl_exp(kl_mul(in[1], in[1]));
	return out[0] && out[1] ? KL_OK : kl_last_status(ctx);
}

typedef struct gcase_fn {
	const char *name;
	kl_fn_body f;
	int nin, nout;
	int64_t in_shape[3][2];
	int64_t out_shape[3][2];
	int nmove; /* inputs 0..nmove-1 are fresh in the moving phase; the rest stay (weights) */
	bool has_mm;
} gcase_fn;

static const gcase_fn GC_MM = {"matmul+kernels", body_mm, 3, 3,
                               {{16, 32}, {32, 24}, {1, 24}}, {{16, 24}, {16, 24}, {16, 32}},
                               1, true};
static const gcase_fn GC_K = {"kernels only", body_kernels, 2, 2,
                              {{16, 32}, {16, 32}, {0, 0}}, {{16, 32}, {16, 32}, {0, 0}},
                              2, false};

static kl_tensor *gc_input(kl_ctx *ctx, const gcase_fn *g, int i, uint64_t seed)
{
	bool vec = g->in_shape[i][0] == 1; /* a bias: 1-D */
	kl_tensor *t = kltest_rand(ctx, KL_F32, vec ? 1 : 2, vec ? &g->in_shape[i][1] : g->in_shape[i],
	                           KLTEST_NORMAL, KLTEST_CONTIG, seed);
	assert_non_null(t);
	return t;
}

typedef struct gc_pick {
	const gcase_fn *g;
	int which;
} gc_pick;

static kl_tensor *gc_apply(kl_tensor *const *in, const void *param)
{
	const gc_pick *p = param;
	kl_tensor *outs[3] = {NULL};
	if (p->g->f(kl_tensor_ctx(in[0]), in, p->g->nin, outs, p->g->nout, NULL) != KL_OK)
		return NULL;
	return outs[p->which];
}

/* every output of a call against the float64 reference */
static void gc_check(const gcase_fn *g, kl_tensor *const *in, kl_tensor **out, const char *phase,
                     int call)
{
	kl_ctx *ctx = kl_tensor_ctx(in[0]);
	for (int j = 0; j < g->nout; j++) {
		gc_pick pk = {g, j};
		char what[160];
		snprintf(what, sizeof what, "%s, %s call %d, output %d", g->name, phase, call, j);
		int nd;
		int64_t shape[KL_MAX_DIMS];
		kl_dtype rdt;
		double *ref = kltest_reference(ctx, what, gc_apply, in, &pk, &nd, shape, &rdt);
		assert_non_null(ref);
		double *got = kltest_read(out[j]);
		assert_non_null(got);
		bool ok = kl_tensor_dtype(out[j]) == rdt && kltest_compare(what, rdt, nd, shape, got,
		                                                            ref, 8);
		free(ref);
		free(got);
		if (!ok)
			fail_msg("%s differs from the reference", what);
	}
}

/* NaN-filled blocks of each output's size, freed just before a call: the
 * caching allocator hands them to the call's outputs, so an output the
 * graph does not write reads back as NaN. */
static void gc_poison(kl_ctx *ctx, const gcase_fn *g)
{
	kl_tensor *p[3] = {NULL};
	for (int j = 0; j < g->nout; j++) {
		p[j] = kl_full(ctx, KL_F32, 2, g->out_shape[j], NAN);
		assert_non_null(p[j]);
	}
	for (int j = 0; j < g->nout; j++)
		kl_release(p[j]);
}

static kl_ctx *gpu_ctx_or_skip(const char *test)
{
	kl_ctx_opts o = {.device = KL_CUDA};
	kl_ctx *ctx = kl_ctx_new(&o);
	if (!ctx) {
		print_message("test_cuda: %s skipped: %s\n", test, kl_last_error(NULL));
		skip();
	}
	return ctx;
}

#define GC_CALLS 8

/* A reduce-overhead function called first with the same inputs (outputs
 * released between calls), then with fresh inputs and outputs at new
 * addresses each call; every call checked. In each phase's steady state
 * (its last 4 calls) nothing is captured again and every call replays. */
static void run_graph_case(const gcase_fn *g)
{
	kl_ctx *ctx = gpu_ctx_or_skip(g->name);
	bool graphs = !getenv("KILN_DISABLE_CUDAGRAPHS");
	kl_compile_opts co = {.mode = KL_MODE_REDUCE_OVERHEAD};
	kl_fn *fn = kl_compile(ctx, g->f, NULL, g->nin, g->nout, &co);
	assert_non_null(fn);
	kl_tensor *in[3] = {NULL};
	for (int i = 0; i < g->nin; i++)
		in[i] = gc_input(ctx, g, i, 100 + (uint64_t)i);
	kl_cuda_counters c0, mid, c1;
	kl__cuda_counters(&c0);
	for (int call = 0; call < GC_CALLS; call++) {
		if (call == GC_CALLS - 4)
			kl__cuda_counters(&mid);
		kl_tensor *out[3] = {NULL};
		gc_poison(ctx, g);
		if (kl_fn_call(fn, in, out) != KL_OK)
			fail_msg("%s same-address call %d: %s", g->name, call, kl_last_error(ctx));
		if (graphs && call >= 1)
			assert_int_equal(kl_fn_last_kernels(fn), 1);
		gc_check(g, in, out, "same-address", call);
		for (int j = 0; j < g->nout; j++)
			kl_release(out[j]);
	}
	kl__cuda_counters(&c1);
	if (graphs) {
		print_message("test_cuda: %s, same addresses: %ld captures, %ld replays, %ld kernel "
		              "and %ld copy updates\n",
		              g->name, c1.captures - c0.captures, c1.replays - c0.replays,
		              c1.kernel_updates - c0.kernel_updates,
		              c1.copy_updates - c0.copy_updates);
		assert_int_equal(c1.captures - mid.captures, 0);
		assert_int_equal(c1.replays - mid.replays, 4);
		assert_int_equal(c1.replays - c0.replays, GC_CALLS - 1);
		assert_true(c1.captures - c0.captures >= 1);
		if (!g->has_mm)
			assert_int_equal(c1.captures - c0.captures, 1);
	}

	/* fresh inputs and outputs, all kept alive: every address is new */
	kl_tensor *keep[GC_CALLS * 6];
	int nkeep = 0;
	kl__cuda_counters(&c0);
	for (int call = 0; call < GC_CALLS; call++) {
		if (call == GC_CALLS - 4)
			kl__cuda_counters(&mid);
		for (int i = 0; i < g->nmove; i++) {
			keep[nkeep++] = in[i];
			in[i] = gc_input(ctx, g, i, 1000 + 10 * (uint64_t)call + (uint64_t)i);
		}
		kl_tensor *out[3] = {NULL};
		gc_poison(ctx, g);
		if (kl_fn_call(fn, in, out) != KL_OK)
			fail_msg("%s moving call %d: %s", g->name, call, kl_last_error(ctx));
		if (graphs)
			assert_int_equal(kl_fn_last_kernels(fn), 1);
		gc_check(g, in, out, "moving", call);
		for (int j = 0; j < g->nout; j++)
			keep[nkeep++] = out[j];
	}
	kl__cuda_counters(&c1);
	if (graphs) {
		print_message("test_cuda: %s, moving: %ld captures, %ld replays, %ld kernel and %ld "
		              "copy updates\n",
		              g->name, c1.captures - c0.captures, c1.replays - c0.replays,
		              c1.kernel_updates - c0.kernel_updates,
		              c1.copy_updates - c0.copy_updates);
		assert_int_equal(c1.captures - mid.captures, 0);
		assert_int_equal(c1.replays - c0.replays, GC_CALLS);
		/* outputs move every call: their kernels are re-pointed every call */
		assert_true(c1.kernel_updates - mid.kernel_updates >= 4);
		if (g->has_mm) {
			/* at most one re-capture per buffer the product holds (x, and the
			 * output, which may first move a call later): each becomes staged */
			assert_true(c1.captures - c0.captures <= 2);
			/* x and the product's output move: their copy nodes are re-pointed */
			assert_true(c1.copy_updates - mid.copy_updates >= 8);
		} else {
			assert_int_equal(c1.captures - c0.captures, 0);
			assert_int_equal(c1.copy_updates - c0.copy_updates, 0);
		}
	}
	for (int i = 0; i < nkeep; i++)
		kl_release(keep[i]);
	for (int i = 0; i < g->nin; i++)
		kl_release(in[i]);
	kl_fn_free(fn);
	kl_ctx_free(ctx);
}

static void test_gpu_graph_matmul_moving(void **state)
{
	(void)state;
	run_graph_case(&GC_MM);
}

static void test_gpu_graph_kernels_moving(void **state)
{
	(void)state;
	run_graph_case(&GC_K);
}

/* Remove the tuning entries of the cache dir; with found != NULL, the name
 * of the one entry there instead (removing nothing). */
static int tune_entries(const char *dir, char *found, size_t cap)
{
	DIR *d = opendir(dir);
	int n = 0;
	if (!d)
		return 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, "tune-", 5) != 0)
			continue;
		n++;
		if (found) {
			snprintf(found, cap, "%s", e->d_name);
		} else {
			char path[4096 + 512];
			snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
			unlink(path);
		}
	}
	closedir(d);
	return n;
}

/* one checked call of fn on in (outputs poisoned first), then in and the
 * outputs released */
static void checked_call(kl_ctx *ctx, kl_fn *fn, const gcase_fn *g, kl_tensor **in,
                         kl_tensor **out, const char *what, int call)
{
	gc_poison(ctx, g);
	if (kl_fn_call(fn, in, out) != KL_OK)
		fail_msg("%s call %d: %s", what, call, kl_last_error(ctx));
	gc_check(g, in, out, what, call);
	for (int j = 0; j < g->nout; j++)
		kl_release(out[j]);
	for (int i = 0; i < g->nin; i++)
		kl_release(in[i]);
}

/* one process's worth: a fresh context compiles the function in mode and
 * calls it three times with fresh inputs, every call checked */
static void tuned_run(kl_mode mode, uint64_t seed)
{
	const gcase_fn *g = &GC_MM;
	kl_ctx *ctx = gpu_ctx_or_skip("autotune");
	kl_compile_opts co = {.mode = mode};
	kl_fn *fn = kl_compile(ctx, g->f, NULL, g->nin, g->nout, &co);
	assert_non_null(fn);
	for (int call = 0; call < 3; call++) {
		kl_tensor *in[3], *out[3] = {NULL};
		for (int i = 0; i < g->nin; i++)
			in[i] = gc_input(ctx, g, i, seed + 10 * (uint64_t)call + (uint64_t)i);
		checked_call(ctx, fn, g, in, out,
		             mode == KL_MODE_MAX_AUTOTUNE ? "max-autotune" : "no-cudagraphs", call);
	}
	kl_fn_free(fn);
	kl_ctx_free(ctx);
}

static void expect_tune(const kl_cuda_counters *a, const kl_cuda_counters *b, long tunes,
                        long hits, long rejects)
{
	print_message("test_cuda: autotune: %ld tuned, %ld read back, %ld rejected\n",
	              b->tunes - a->tunes, b->tune_hits - a->tune_hits,
	              b->tune_rejects - a->tune_rejects);
	assert_int_equal(b->tunes - a->tunes, tunes);
	assert_int_equal(b->tune_hits - a->tune_hits, hits);
	assert_int_equal(b->tune_rejects - a->tune_rejects, rejects);
}

static void test_gpu_autotune(void **state)
{
	(void)state;
	NEED_GPU();
	char dir[4096];
	if (!kl__cache_dir(gctx, dir, sizeof dir)) {
		print_message("test_cuda: %s skipped: no usable disk cache directory\n", __func__);
		skip();
	}
	const kl_mode modes[] = {KL_MODE_MAX_AUTOTUNE, KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS};
	for (int m = 0; m < 2; m++) {
		tune_entries(dir, NULL, 0);
		kl_cuda_counters a, b;
		/* the first process tunes and stores its choices */
		kl__cuda_counters(&a);
		tuned_run(modes[m], 300);
		kl__cuda_counters(&b);
		expect_tune(&a, &b, 1, 0, 0);
		char name[256];
		assert_int_equal(tune_entries(dir, name, sizeof name), 1);
		/* the second reads them back: nothing is timed */
		tuned_run(modes[m], 400);
		kl__cuda_counters(&a);
		expect_tune(&b, &a, 0, 1, 0);

		/* a damaged entry (a payload byte flipped) is rejected and tuned again */
		char path[4096 + 256];
		snprintf(path, sizeof path, "%s/%s", dir, name);
		FILE *f = fopen(path, "r+b");
		assert_non_null(f);
		assert_int_equal(fseek(f, -3, SEEK_END), 0);
		int ch = fgetc(f);
		assert_int_equal(fseek(f, -3, SEEK_END), 0);
		fputc(ch ^ 0x5a, f);
		fclose(f);
		tuned_run(modes[m], 500);
		kl__cuda_counters(&b);
		expect_tune(&a, &b, 1, 0, 1);

		/* an intact entry whose contents do not fit the variant: rejected too */
		unsigned long long key = 0, devid = 0;
		assert_int_equal(sscanf(name, "tune-%16llx-%16llx.klt", &key, &devid), 2);
		char n2[96];
		uint64_t ekey;
		kl__tune_entry(key, devid, n2, sizeof n2, &ekey);
		assert_string_equal(n2, name);
		static const char junk[] = "KLTUNE\0\0 but not for this variant";
		assert_int_equal(kl__cache_put(gctx, dir, name, ekey, junk, sizeof junk), KL_OK);
		tuned_run(modes[m], 600);
		kl__cuda_counters(&a);
		expect_tune(&b, &a, 1, 0, 1);
		/* and the entry written in its place is read back */
		tuned_run(modes[m], 700);
		kl__cuda_counters(&b);
		expect_tune(&a, &b, 0, 1, 0);
	}
}

/* kl_profile on the GPU: a reduce-overhead function (its graph captured and
 * replayed) gets one table, every step timed by device events, and replays
 * correctly after */
static void test_gpu_profile(void **state)
{
	(void)state;
	NEED_GPU();
	const gcase_fn *g = &GC_MM;
	kl_ctx *ctx = gpu_ctx_or_skip("profile");
	kl_fn *fn = kl_compile(ctx, g->f, NULL, g->nin, g->nout,
	                       &(kl_compile_opts){.mode = KL_MODE_REDUCE_OVERHEAD});
	assert_non_null(fn);
	for (int call = 0; call < 4; call++) {
		kl_tensor *in[3], *out[3] = {NULL};
		for (int i = 0; i < g->nin; i++)
			in[i] = gc_input(ctx, g, i, 900 + 10 * (uint64_t)call + (uint64_t)i);
		if (call == 2) {
			char *buf = NULL;
			size_t len = 0;
			FILE *m = open_memstream(&buf, &len);
			if (kl_profile(fn, in, m) != KL_OK)
				fail_msg("kl_profile: %s", kl_last_error(ctx));
			fclose(m);
			print_message("%s", buf);
			const char *t = strstr(buf, "kiln profile: graph 0: ");
			int nsteps = 0, rows = 0;
			assert_non_null(t);
			assert_int_equal(sscanf(t, "kiln profile: graph 0: %d steps", &nsteps), 1);
			assert_non_null(strstr(t, "device events"));
			for (const char *l = strchr(t, '\n'); l && l[1]; l = strchr(l + 1, '\n')) {
				int idx;
				double us;
				if (sscanf(l + 1, " [%d] %lf us", &idx, &us) == 2) {
					assert_int_equal(idx, rows);
					assert_true(us > 0 && us < 1e6);
					rows++;
				}
			}
			assert_true(nsteps >= 1);
			assert_int_equal(rows, nsteps);
			assert_null(strstr(buf, "graph 2"));
			free(buf);
		}
		checked_call(ctx, fn, g, in, out, "reduce-overhead around kl_profile", call);
	}
	kl_fn_free(fn);
	kl_ctx_free(ctx);
}

/* Asking for more than the device holds is KL_ENOMEM naming the call made,
 * never a crash: kl_empty of 1.5 times the device's memory, and kl_add whose
 * broadcast output ([r,1] + [1,r]) is that big while its inputs are small.
 * The context stays usable and holds no more than before. */
static void test_gpu_oom(void **state)
{
	(void)state;
	NEED_GPU();
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CUDA});
	assert_non_null(ctx);
	assert_true(gdev->total_mem > 0);
	int64_t n = (int64_t)(gdev->total_mem / 4 / 2 * 3); /* f32 elements */
	int64_t r = (int64_t)sqrt((double)n) + 1;           /* r * r >= n */
	kl_memory_usage before, after;
	assert_int_equal(kl_memory_stats(ctx, &before), KL_OK);

	assert_null(kl_empty(ctx, KL_F32, 1, &n));
	print_message("test_cuda: kl_empty of %lld f32: %s\n", (long long)n, kl_last_error(ctx));
	assert_int_equal(kl_last_status(ctx), KL_ENOMEM);
	assert_non_null(strstr(kl_last_error(ctx), "kl_empty"));
	assert_non_null(strstr(kl_last_error(ctx), "out of"));
	kl_clear_error(ctx);

	kl_tensor *a = kl_full(ctx, KL_F32, 2, (const int64_t[]){r, 1}, 1.0);
	kl_tensor *b = kl_full(ctx, KL_F32, 2, (const int64_t[]){1, r}, 2.0);
	assert_non_null(a);
	assert_non_null(b);
	assert_null(kl_add(a, b));
	print_message("test_cuda: kl_add of [%lld,1] and [1,%lld]: %s\n", (long long)r,
	              (long long)r, kl_last_error(ctx));
	assert_int_equal(kl_last_status(ctx), KL_ENOMEM);
	assert_non_null(strstr(kl_last_error(ctx), "kl_add"));
	kl_clear_error(ctx);

	/* still usable: a small broadcast add of slices of the same inputs */
	kl_tensor *sa = kl_slice(a, 0, 0, 3, 1), *sb = kl_slice(b, 1, 0, 2, 1);
	kl_tensor *c = kl_add(sa, sb);
	assert_non_null(c);
	float host[6];
	assert_int_equal(kl_to_host(c, host, sizeof host), KL_OK);
	for (int i = 0; i < 6; i++)
		assert_true(host[i] == 3.0f);
	kl_release(c);
	kl_release(sa);
	kl_release(sb);
	kl_release(a);
	kl_release(b);
	assert_int_equal(kl_memory_stats(ctx, &after), KL_OK);
	assert_int_equal(after.in_use, before.in_use);
	kl_ctx_free(ctx);
}

int main(void)
{
	const struct CMUnitTest host[] = {
	        cmocka_unit_test(test_driver_missing), cmocka_unit_test(test_driver_symbols),
	        cmocka_unit_test(test_nvrtc_cubin),    cmocka_unit_test(test_nvrtc_error),
	        cmocka_unit_test(test_pool_classes),   cmocka_unit_test(test_pool_reuse),
	        cmocka_unit_test(test_pool_random),    cmocka_unit_test(test_lt_geometry),
	        cmocka_unit_test(test_cublaslt_loads), cmocka_unit_test(test_tune_entry),
	        cmocka_unit_test(test_graph_bodies_lower), cmocka_unit_test(test_optim_kernel_host),
	        cmocka_unit_test(test_cache_write_kernel_host),
	        cmocka_unit_test(test_gemv_kernel_host),
	};
	const struct CMUnitTest gpu[] = {
	        cmocka_unit_test(test_gpu_alloc),   cmocka_unit_test(test_gpu_copies),
	        cmocka_unit_test(test_gpu_kernel),  cmocka_unit_test(test_gpu_gemm),
	        cmocka_unit_test(test_gpu_gemm_nd), cmocka_unit_test(test_gpu_eager_matmul),
	        cmocka_unit_test(test_gpu_graph),   cmocka_unit_test(test_gpu_timing),
	        cmocka_unit_test(test_gpu_pdl),
	        cmocka_unit_test(test_gpu_graph_matmul_moving),
	        cmocka_unit_test(test_gpu_graph_kernels_moving),
	        cmocka_unit_test(test_gpu_autotune),
	        cmocka_unit_test(test_gpu_profile),
	        cmocka_unit_test(test_gpu_oom),
	};
	int fails = cmocka_run_group_tests_name("cuda_host", host, NULL, NULL);
	fails += cmocka_run_group_tests_name("cuda_gpu", gpu, gpu_setup, gpu_teardown);
	return fails;
}

#else /* !KILN_HAVE_CUDA */

/* Built without the CUDA backend: a CUDA context must fail and say why. */
static void test_cuda_absent(void **state)
{
	(void)state;
	print_message("test_cuda: kiln was built without the CUDA backend (KILN_CUDA=OFF, no CUDA "
	              "toolkit headers at configure time): only the refusal is tested\n");
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const kl_backend *be = ctx->be;
	assert_int_equal(kl__cuda_ctx_init(ctx, 0, NULL), KL_EDEVICE);
	assert_non_null(strstr(kl_last_error(ctx), "KILN_CUDA=OFF"));
	assert_ptr_equal(ctx->be, be);
	kl__cuda_ctx_fini(ctx);
	kl_ctx_free(ctx);
}

int main(void)
{
	const struct CMUnitTest tests[] = {cmocka_unit_test(test_cuda_absent)};
	return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
