/* test_package_cuda.c - CUDA packages (issue 25). On the CPU (always, where
 * NVRTC can be opened): an MLP and the DecoderLayer (fused attention)
 * exported for sm_90 from a CPU context (cubins + PTX built by NVRTC, no
 * GPU), described, refused on a CPU context with the reason, damaged kernels
 * sections refused naming what is wrong, and the choice of cubin / PTX /
 * refusal for GPUs of other architectures. With KILN_TEST_DEVICE=cuda (a GPU;
 * skipped, 77, without one): packages exported on the GPU and on the CPU run
 * in a fresh process where NVRTC is never opened (KILN_NO_NVRTC=1), equal to
 * the compiled function, the second call capturing a CUDA graph and later
 * calls replaying it; a damaged cubin is refused by the driver naming the
 * section; load times are printed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kiln_nn.h"
#include "kltest.h"
#include "runtime/compiled.h"
#include "runtime/package.h"
#include "runtime/package_cuda.h"

static kl_ctx *ctx;   /* the test's device (CPU unless KILN_TEST_DEVICE=cuda) */
static kl_ctx *cpu;   /* always the CPU */
static char dir[256];
static bool have_nvrtc;
static kl_mode export_mode; /* kl_export_opts.mode of export_to */

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void path_of(char *buf, size_t cap, const char *name)
{
	snprintf(buf, cap, "%s/%s", dir, name);
}

/* ---- workloads -------------------------------------------------------------------- */

typedef struct mlp {
	kl_tensor *w1, *b1, *w2;
} mlp;

static kl_status mlp_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	const mlp *m = user;
	kl_tensor *h = kl_gelu(kl_add(kl_matmul(in[0], kl_transpose(m->w1, 0, 1)), m->b1));
	out[0] = kl_matmul(h, kl_transpose(m->w2, 0, 1));
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_status dec_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	out[0] = kl_nn_decoder_forward(user, in[0], false);
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_tensor *randn(kl_ctx *c, int ndim, const int64_t *shape, uint64_t seed)
{
	return kltest_rand(c, KL_F32, ndim, shape, KLTEST_NORMAL, KLTEST_CONTIG, seed);
}

static mlp make_mlp(kl_ctx *c)
{
	mlp m = {randn(c, 2, (int64_t[]){64, 32}, 11), randn(c, 1, (int64_t[]){64}, 12),
	         randn(c, 2, (int64_t[]){16, 64}, 13)};
	return m;
}

static void free_mlp(mlp *m)
{
	kl_release(m->w1);
	kl_release(m->b1);
	kl_release(m->w2);
}

/* Export fn on c for CUDA sm_<arch> (0: c's GPU) to dir/name; NULL
 * with the reason printed when it fails. */
static bool export_to(kl_ctx *c, const char *name, kl_fn_body fn, void *user, kl_tensor *x,
                      int ndims, const kl_dim_spec *dims, int arch)
{
	char path[512];
	path_of(path, sizeof path, name);
	kl_export_opts o = {.ndims = ndims, .dims = dims, .cuda_arch = arch, .mode = export_mode};
	double t0 = now_ms();
	kl_exported *e = kl_export(c, fn, user, 1, 1, &x, &o);
	if (!e || kl_exported_package(e, path) != KL_OK) {
		fprintf(stderr, "export %s: %s\n", name, kl_last_error(c));
		kl_exported_free(e);
		return false;
	}
	fprintf(stderr, "  exported %s for %s in %.1f ms\n", name, arch ? "sm_90" : "this GPU",
	        now_ms() - t0);
	kl_exported_free(e);
	return true;
}

static uint8_t *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	assert_non_null(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	uint8_t *b = malloc((size_t)n);
	assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	*len = (size_t)n;
	return b;
}

static void write_file(const char *path, const uint8_t *b, size_t n)
{
	FILE *f = fopen(path, "wb");
	assert_non_null(f);
	assert_int_equal(fwrite(b, 1, n, f), n);
	assert_int_equal(fclose(f), 0);
}

static uint64_t rd64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;
}

static void wr64(uint8_t *p, uint64_t v)
{
	memcpy(p, &v, 8);
}

/* every checksum recomputed, so that a mutation reaches the checks behind */
static void reseal(uint8_t *b)
{
	for (int s = 0; s < 4; s++) {
		uint8_t *e = b + 64 + 32 * s;
		wr64(e + 24, kl__pkg_sum(b + rd64(e + 8), rd64(e + 16)));
	}
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, b, 56);
	wr64(b + 56, kl__hash_bytes(h, b + 64, 128));
}

static uint8_t *kernels_of(uint8_t *b, size_t *n)
{
	uint8_t *e = b + 64 + 32 * 2;
	*n = rd64(e + 16);
	return b + rd64(e + 8);
}

/* ---- on the CPU -------------------------------------------------------------------- */

static void export_cpu_packages(void)
{
	static bool done;
	if (done)
		return;
	done = true;
	mlp m = make_mlp(cpu);
	kl_tensor *x = randn(cpu, 2, (int64_t[]){8, 32}, 14);
	kl_dim_spec bd = {0, 0, "batch", 1, 64};
	assert_true(export_to(cpu, "mlp_cpu.klp", mlp_body, &m, x, 1, &bd, 90));
	kl_release(x);
	free_mlp(&m);
	kl_nn_decoder L;
	assert_int_equal(kl_nn_decoder_init(&L, cpu, 64, 4, 128, KL_F32, 7), KL_OK);
	kl_tensor *xd = randn(cpu, 3, (int64_t[]){2, 24, 64}, 15);
	kl_dim_spec dd[2] = {{0, 0, "batch", 1, 8}, {0, 1, "seq", 2, 128}};
	assert_true(export_to(cpu, "dec_cpu.klp", dec_body, &L, xd, 2, dd, 90));
	kl_release(xd);
	kl_nn_free(&L.base);
}

static void test_export_on_cpu(void **state)
{
	(void)state;
	if (!have_nvrtc)
		skip();
	export_cpu_packages();
	const char *names[2] = {"mlp_cpu.klp", "dec_cpu.klp"};
	for (int i = 0; i < 2; i++) {
		char path[512], out[512];
		path_of(path, sizeof path, names[i]);
		size_t len;
		uint8_t *b = read_file(path, &len);
		path_of(out, sizeof out, "describe.txt");
		FILE *f = fopen(out, "w+");
		double t0 = now_ms();
		assert_int_equal(kl_package_describe(cpu, b, len, f), KL_OK);
		double t1 = now_ms();
		fseek(f, 0, SEEK_SET);
		char text[16384];
		size_t n = fread(text, 1, sizeof text - 1, f);
		text[n] = 0;
		fclose(f);
		fprintf(stderr, "  %s: %zu bytes, checked (describe) in %.2f ms\n", names[i], len,
		        t1 - t0);
		assert_non_null(strstr(text, "target cuda-sm_90"));
		assert_non_null(strstr(text, "module 0  plan   cubin sm_90"));
		assert_non_null(strstr(text, "newer GPUs through the driver's JIT"));
		if (i == 1) /* fused attention's general kernel (f32) */
			assert_non_null(strstr(text, "fixed  cubin sm_90"));
		/* a CPU context cannot run it and says so */
		kl_clear_error(cpu);
		assert_null(kl_package_load_buffer(cpu, b, len));
		assert_non_null(strstr(kl_last_error(cpu), "needs a CUDA context"));
		assert_null(kl_package_load(cpu, path));
		assert_non_null(strstr(kl_last_error(cpu), "a CUDA package (sm_90)"));
		free(b);
	}
}

static void expect_bad(const uint8_t *b, size_t len, const char *why)
{
	kl_clear_error(cpu);
	FILE *f = fopen("/dev/null", "w");
	kl_status st = kl_package_describe(cpu, b, len, f);
	fclose(f);
	if (st == KL_OK || !strstr(kl_last_error(cpu), why))
		fprintf(stderr, "expected '%s', got '%s'\n", why,
		        st == KL_OK ? "(accepted)" : kl_last_error(cpu));
	assert_int_not_equal(st, KL_OK);
	assert_non_null(strstr(kl_last_error(cpu), why));
}

static void test_bad_kernels_section(void **state)
{
	(void)state;
	if (!have_nvrtc)
		skip();
	export_cpu_packages();
	char path[512];
	path_of(path, sizeof path, "dec_cpu.klp");
	size_t len, kn;
	uint8_t *good = read_file(path, &len);
	uint8_t *b = malloc(len);
	/* every section's checksum still guards it */
	memcpy(b, good, len);
	kernels_of(b, &kn)[kn / 2] ^= 0x10;
	expect_bad(b, len, "the kernels section's checksum does not match");
	struct {
		size_t at; /* offset in the kernels section */
		uint8_t x; /* xor */
		const char *why;
	} cases[] = {
	        {0, 0x01, "not one (bad magic"},
	        {8, 0x01, "the CUDA kernels are for sm_91, the header says sm_90"},
	        {12, 0x40, "lists 66 modules"},
	        {16, 0x01, "bytes of choices where"},
	        {24, 0x02, "CUDA module 0 has role 2"},
	        {28, 0x01, "CUDA module 0 has role 0, flags 1"},
	        {24 + 16 + 5, 0x01, "CUDA module 0 lies outside its section"},
	        {24 + 64 + 18, 0x01, "cubin is not a CUDA ELF file"}, /* module 0's e_machine */
	        /* module 0's section headers past its end (e_shoff + 2^40), and
	         * its section count doubled past the table: the driver would
	         * follow either */
	        {24 + 64 + 45, 0x01, "cubin is not a CUDA ELF file"},
	        {24 + 64 + 61, 0x40, "cubin is not a CUDA ELF file"},
	};
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		memcpy(b, good, len);
		kernels_of(b, &kn)[cases[k].at] ^= cases[k].x;
		reseal(b);
		expect_bad(b, len, cases[k].why);
	}
	/* PTX that is not text: module 0's first PTX byte (after its cubin) */
	memcpy(b, good, len);
	uint8_t *ks = kernels_of(b, &kn);
	uint64_t c0 = rd64(ks + 24 + 16);
	ks[24 + 64 + c0] = 0;
	reseal(b);
	expect_bad(b, len, "PTX is not PTX text");
	/* the header's target: not an architecture, or CPU features on CUDA */
	memcpy(b, good, len);
	memcpy(b + 32, "cuda-sm_9\0", 10);
	reseal(b);
	expect_bad(b, len, "built for target cuda-sm_9");
	memcpy(b, good, len);
	b[48] = 1;
	reseal(b);
	expect_bad(b, len, "a CUDA package with CPU features");
	/* a kernels section of the MLP with the DecoderLayer's plan: module
	 * counts no longer fit when the plan has no kernels is covered by the
	 * plan-module rule; truncation at every cut through the section */
	for (size_t cut = 0; cut < 256; cut += 7) {
		kl_clear_error(cpu);
		FILE *f = fopen("/dev/null", "w");
		assert_int_not_equal(kl_package_describe(cpu, good, (size_t)(ks - b) + cut, f), KL_OK);
		fclose(f);
	}
	free(b);
	free(good);
}

static void test_pick_image(void **state)
{
	(void)state;
	static const uint8_t cubin[64] = {0x7f, 'E', 'L', 'F', 2, 1};
	kl_pkg_cuda c = {.arch = 90, .nmods = 1};
	c.mods[0] = (kl_pkg_cumod){.role = KL_PKG_MOD_PLAN, .cubin = cubin, .cubin_len = 64,
	                           .ptx = ".target sm_90", .ptx_len = 13};
	bool ptx = true;
	char why[256] = "";
	assert_int_equal(kl__pkg_cuda_pick(&c, 90, &ptx, why, sizeof why), KL_OK);
	assert_false(ptx);
	assert_int_equal(kl__pkg_cuda_pick(&c, 100, &ptx, why, sizeof why), KL_OK);
	assert_true(ptx);
	assert_int_equal(kl__pkg_cuda_pick(&c, 120, &ptx, why, sizeof why), KL_OK);
	assert_true(ptx);
	/* an older GPU: neither runs, and both architectures are named */
	assert_int_equal(kl__pkg_cuda_pick(&c, 80, &ptx, why, sizeof why), KL_EUNSUPPORTED);
	assert_non_null(strstr(why, "built for sm_90"));
	assert_non_null(strstr(why, "this GPU is sm_80"));
	c.mods[0].ptx_len = 0;
	assert_int_equal(kl__pkg_cuda_pick(&c, 100, &ptx, why, sizeof why), KL_EUNSUPPORTED);
	assert_non_null(strstr(why, "sm_90, without PTX; this GPU is sm_100"));
	/* targets */
	assert_int_equal(kl__pkg_cuda_target_arch("cuda-sm_90"), 90);
	assert_int_equal(kl__pkg_cuda_target_arch("cuda-sm_100"), 100);
	assert_int_equal(kl__pkg_cuda_target_arch("cuda-sm_9"), 0);
	assert_int_equal(kl__pkg_cuda_target_arch("cuda-sm_090"), 0);
	assert_int_equal(kl__pkg_cuda_target_arch("cuda-sm_1000"), 0);
	assert_int_equal(kl__pkg_cuda_target_arch("cpu-x86_64"), 0);
	/* kl_export's arch argument */
	mlp m = make_mlp(cpu);
	kl_tensor *x = randn(cpu, 2, (int64_t[]){8, 32}, 14);
	kl_clear_error(cpu);
	assert_null(kl_export(cpu, mlp_body, &m, 1, 1, &x, &(kl_export_opts){.cuda_arch = 7}));
	assert_non_null(strstr(kl_last_error(cpu), "cuda_arch 7 is not an architecture"));
	kl_release(x);
	free_mlp(&m);
}

/* ---- on a GPU ---------------------------------------------------------------------- */

/* The child: load `pkg` with NVRTC hidden, run on x (from xs) 4 times,
 * compare with ref, check NVRTC never mapped and the graph replayed. */
static int gpu_child(const char *pkg, const char *xs, const char *ref)
{
	setenv("KILN_NO_NVRTC", "1", 1);
	double t0 = now_ms();
	kl_ctx *c = kl_ctx_new(&(kl_ctx_opts){.device = KL_CUDA});
	double t1 = now_ms();
	if (!c) {
		fprintf(stderr, "child: %s\n", kl_last_error(NULL));
		return 2;
	}
	kl_package *p = kl_package_load(c, pkg);
	double t2 = now_ms();
	kl_safetensors *sx = p ? kl_safetensors_open(c, xs) : NULL;
	kl_safetensors *sr = p ? kl_safetensors_open(c, ref) : NULL;
	kl_tensor *x = sx ? kl_safetensors_get(sx, "x") : NULL;
	kl_tensor *r = sr ? kl_safetensors_get(sr, "y") : NULL;
	int rc = x && r ? 0 : 3;
	double first = 0, last = 0;
	for (int it = 0; rc == 0 && it < 4; it++) {
		kl_tensor *y = NULL;
		double a = now_ms();
		if (kl_package_run(p, &x, &y) != KL_OK || kl_ctx_synchronize(c) != KL_OK) {
			rc = 4;
			break;
		}
		double dt = now_ms() - a;
		if (it == 0)
			first = dt;
		last = dt;
		double *yv = kltest_read(y), *rv = kltest_read(r);
		int64_t n = kl_numel(r);
		double worst = 0;
		for (int64_t i = 0; yv && rv && i < n; i++) {
			double d = yv[i] - rv[i];
			if (d != d) /* NaN never passes */
				worst = 1e30;
			else if ((d < 0 ? -d : d) > worst)
				worst = d < 0 ? -d : d;
		}
		if (!yv || !rv || kl_numel(y) != n || worst > 1e-4) {
			fprintf(stderr, "child: run %d differs from the compiled function by %g\n", it,
			        worst);
			rc = 5;
		}
		free(yv);
		free(rv);
		kl_release(y);
		/* a package replays a CUDA graph from its third call at one size;
		 * the second captures it and may launch what it captured (graph
		 * slots, static or one per size); never at the first */
		bool replay = kl__cuda_rt_replaying(kl__package_compiled(p));
		bool want = it >= 2 && !getenv("KILN_DISABLE_CUDAGRAPHS");
		bool known = it != 1;
		if (rc == 0 && known && replay != want) {
			fprintf(stderr, "child: run %d %s a CUDA graph\n", it,
			        want ? "did not replay" : "replayed");
			rc = 6;
		}
	}
	if (rc && rc < 5)
		fprintf(stderr, "child: %s\n", kl_last_error(c));
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[1024];
	while (maps && fgets(line, sizeof line, maps))
		if (strstr(line, "nvrtc")) {
			fprintf(stderr, "child: NVRTC is mapped: %s", line);
			rc = 7;
		}
	if (maps)
		fclose(maps);
	if (kl__rt_lowerings() != 0) {
		fprintf(stderr, "child: %ld lowerings\n", kl__rt_lowerings());
		rc = 8;
	}
	if (rc == 0)
		printf("  %s: context %.2f ms, load %.2f ms, first run %.2f ms (file to first result "
		       "%.2f ms), 4th run %.3f ms\n",
		       strrchr(pkg, '/') + 1, t1 - t0, t2 - t1, first, t2 - t1 + first, last);
	kl_release(x);
	kl_release(r);
	kl_safetensors_close(sx);
	kl_safetensors_close(sr);
	kl_package_free(p);
	kl_ctx_free(c);
	return rc;
}

static int spawn_child(const char *pkg, const char *xs, const char *ref)
{
	fflush(NULL);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		execl("/proc/self/exe", "test_package_cuda", "--child", pkg, xs, ref, (char *)NULL);
		_exit(127);
	}
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/* the compiled function's output on x (on the GPU), saved with x */
static void save_ref(kl_fn_body fn, void *user, kl_tensor *x, const char *xs, const char *ref)
{
	kl_fn *f = kl_compile(ctx, fn, user, 1, 1, NULL);
	assert_non_null(f);
	kl_tensor *y = NULL;
	assert_int_equal(kl_fn_call(f, &x, &y), KL_OK);
	assert_int_equal(kl_safetensors_save(ctx, xs, 1, (const char *[]){"x"}, &x), KL_OK);
	assert_int_equal(kl_safetensors_save(ctx, ref, 1, (const char *[]){"y"}, &y), KL_OK);
	kl_release(y);
	kl_fn_free(f);
}

static void test_gpu_roundtrip(void **state)
{
	(void)state;
	if (kl_ctx_device(ctx) != KL_CUDA)
		skip();
	char pkg[512], xs[512], ref[512];
	/* the MLP: exported on this GPU */
	mlp m = make_mlp(ctx);
	kl_tensor *x = randn(ctx, 2, (int64_t[]){8, 32}, 14);
	kl_dim_spec bd = {0, 0, "batch", 1, 64};
	assert_true(export_to(ctx, "mlp_gpu.klp", mlp_body, &m, x, 1, &bd, 0));
	kl_tensor *x2 = randn(ctx, 2, (int64_t[]){13, 32}, 16); /* another batch */
	path_of(xs, sizeof xs, "mlp_x.safetensors");
	path_of(ref, sizeof ref, "mlp_ref.safetensors");
	save_ref(mlp_body, &m, x2, xs, ref);
	path_of(pkg, sizeof pkg, "mlp_gpu.klp");
	assert_int_equal(spawn_child(pkg, xs, ref), 0);
	/* static, traced under max-autotune: the package carries the launch
	 * choices; a CUDA graph captured at the second call, replayed after */
	export_mode = KL_MODE_MAX_AUTOTUNE;
	assert_true(export_to(ctx, "mlp_static_gpu.klp", mlp_body, &m, x, 0, NULL, 0));
	export_mode = KL_MODE_DEFAULT;
	{
		path_of(pkg, sizeof pkg, "mlp_static_gpu.klp");
		size_t len;
		uint8_t *b = read_file(pkg, &len);
		char text[16384] = "";
		FILE *f = fmemopen(text, sizeof text - 1, "w");
		assert_int_equal(kl_package_describe(ctx, b, len, f), KL_OK);
		fclose(f);
		free(b);
		const char *lc = strstr(text, "launch choices: ");
		assert_non_null(lc);
		fprintf(stderr, "  mlp_static_gpu.klp: %.40s\n", lc);
		assert_true(atoi(lc + 16) > 0);
	}
	path_of(xs, sizeof xs, "mlp_static_x.safetensors");
	path_of(ref, sizeof ref, "mlp_static_ref.safetensors");
	save_ref(mlp_body, &m, x, xs, ref);
	path_of(pkg, sizeof pkg, "mlp_static_gpu.klp");
	assert_int_equal(spawn_child(pkg, xs, ref), 0);
	kl_release(x);
	kl_release(x2);
	free_mlp(&m);
	/* the DecoderLayer (fused attention): built on this GPU and on the CPU */
	kl_nn_decoder L;
	assert_int_equal(kl_nn_decoder_init(&L, ctx, 64, 4, 128, KL_F32, 7), KL_OK);
	kl_tensor *xd = randn(ctx, 3, (int64_t[]){2, 24, 64}, 15);
	kl_dim_spec dd[2] = {{0, 0, "batch", 1, 8}, {0, 1, "seq", 2, 128}};
	assert_true(export_to(ctx, "dec_gpu.klp", dec_body, &L, xd, 2, dd, 0));
	kl_tensor *xd2 = randn(ctx, 3, (int64_t[]){3, 40, 64}, 17);
	path_of(xs, sizeof xs, "dec_x.safetensors");
	path_of(ref, sizeof ref, "dec_ref.safetensors");
	save_ref(dec_body, &L, xd2, xs, ref);
	path_of(pkg, sizeof pkg, "dec_gpu.klp");
	assert_int_equal(spawn_child(pkg, xs, ref), 0);
	kl_release(xd);
	kl_release(xd2);
	kl_nn_free(&L.base);
}

/* A CUDA package built on the CPU (same weights as the GPU's MLP, by seed)
 * runs on the GPU equal to the JIT path; a cubin damaged inside is refused
 * by the loader's ELF check before the driver could follow its tables. */
static void test_gpu_cpu_built(void **state)
{
	(void)state;
	if (kl_ctx_device(ctx) != KL_CUDA)
		skip();
	char pkg[512], xs[512], ref[512];
	mlp m = make_mlp(cpu);
	kl_tensor *x = randn(cpu, 2, (int64_t[]){8, 32}, 14);
	kl_dim_spec bd = {0, 0, "batch", 1, 64};
	assert_true(export_to(cpu, "mlp_cpu_for_gpu.klp", mlp_body, &m, x, 1, &bd, 90));
	kl_release(x);
	free_mlp(&m);
	path_of(pkg, sizeof pkg, "mlp_cpu_for_gpu.klp");
	path_of(xs, sizeof xs, "mlp_x.safetensors");
	path_of(ref, sizeof ref, "mlp_ref.safetensors");
	assert_int_equal(spawn_child(pkg, xs, ref), 0);
	/* a cubin damaged inside (its header intact, checksums recomputed) */
	size_t len, kn;
	uint8_t *b = read_file(pkg, &len);
	uint8_t *ks = kernels_of(b, &kn);
	uint64_t cn = rd64(ks + 24 + 16);
	uint8_t *cubin0 = ks + 24 + 32 * (uint64_t)(ks[12] | ks[13] << 8); /* after the entries */
	for (uint64_t i = 64; i < cn; i += 97)
		cubin0[i] ^= 0xa5;
	reseal(b);
	char bad[512];
	path_of(bad, sizeof bad, "damaged.klp");
	write_file(bad, b, len);
	free(b);
	/* every 97th byte from 64 on reaches the section headers: refused
	 * before the driver sees it */
	kl_clear_error(ctx);
	kl_package *p = kl_package_load(ctx, bad);
	fprintf(stderr, "  damaged cubin: %s\n", p ? "loaded" : kl_last_error(ctx));
	assert_null(p);
	assert_non_null(strstr(kl_last_error(ctx), "CUDA module 0's cubin is not a CUDA ELF file"));
}

int main(int argc, char **argv)
{
	if (argc == 5 && !strcmp(argv[1], "--child"))
		return gpu_child(argv[2], argv[3], argv[4]);
	ctx = kltest_ctx_from_env("test_package_cuda");
	cpu = ctx && kl_ctx_device(ctx) == KL_CPU ? ctx : kl_ctx_new(NULL);
	if (!ctx || !cpu)
		return 1;
	/* a probe: an export for sm_90 needs NVRTC (and a kiln built with the
	 * CUDA backend) */
	mlp m = make_mlp(cpu);
	kl_tensor *x = randn(cpu, 2, (int64_t[]){8, 32}, 14);
	kl_exported *e = kl_export(cpu, mlp_body, &m, 1, 1, &x, &(kl_export_opts){.cuda_arch = 90});
	have_nvrtc = e != NULL;
	if (!have_nvrtc)
		fprintf(stderr, "test_package_cuda: no CUDA package can be built here (%s): the "
		                "CPU-side CUDA package tests are skipped\n",
		        kl_last_error(cpu));
	kl_exported_free(e);
	kl_release(x);
	free_mlp(&m);
	const char *tmp = getenv("TMPDIR");
	snprintf(dir, sizeof dir, "%s/kiln-pkgcuda-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
	if (!mkdtemp(dir))
		return 1;
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_export_on_cpu),
	        cmocka_unit_test(test_bad_kernels_section),
	        cmocka_unit_test(test_pick_image),
	        cmocka_unit_test(test_gpu_roundtrip),
	        cmocka_unit_test(test_gpu_cpu_built),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	char cmd[400];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		rc = rc ? rc : 1;
	if (cpu != ctx)
		kl_ctx_free(cpu);
	kl_ctx_free(ctx);
	return rc;
}
