/* test_runtime.c - the runtime on hand-written programs: the cc JIT and the
 * executor (kernels, BLAS products in every dtype, views, symbols), the
 * memory planner, program (de)serialization, and the disk cache: a warm
 * start in a fresh process, corrupt entries, two processes racing.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "graph/graph.h"
#include "graph/reference.h"
#include "kltest.h"
#include "lower/lower_int.h"
#include "runtime/compiled.h"
#include "runtime/runtime_int.h"

extern char **environ;

static const char *self_exe = "/proc/self/exe";

/* ---- graphs and programs by hand ----------------------------------------------- */

static int32_t g_input(kl_graph *g, const kl_tensor *t)
{
	kl_node n;
	memset(&n, 0, sizeof n);
	n.op = KL_OP_INPUT;
	n.dtype = (uint8_t)t->dtype;
	n.ndim = (uint8_t)t->ndim;
	memcpy(n.shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
	memcpy(n.strides, t->strides, sizeof(int64_t) * (size_t)t->ndim);
	int32_t id = kl__graph_add(g, &n);
	assert_true(id >= 0);
	assert_int_equal(kl__graph_add_input(g, id), 0);
	return id;
}

static int32_t g_node(kl_graph *g, kl_op op, kl_dtype dt, int nd, const int64_t *shape, int nin,
                      const int32_t *in, const kl_attrs *a)
{
	kl_node n;
	memset(&n, 0, sizeof n);
	n.op = (uint16_t)op;
	n.dtype = (uint8_t)dt;
	n.ndim = (uint8_t)nd;
	n.nin = (uint8_t)nin;
	memcpy(n.shape, shape, sizeof(int64_t) * (size_t)nd);
	for (int i = 0; i < nin; i++)
		n.in[i] = in[i];
	if (a)
		n.a = *a;
	int32_t id = kl__graph_add(g, &n);
	assert_true(id >= 0);
	return id;
}

static kl_buf pbuf(kl_buf_role role, int idx, kl_dtype dt, int nd, const int64_t *shape)
{
	kl_buf b;
	memset(&b, 0, sizeof b);
	b.role = role;
	b.index = idx;
	b.dtype = dt;
	b.ndim = nd;
	for (int d = 0; d < nd; d++)
		b.shape[d].v = shape[d];
	b.alias = -1;
	return b;
}

static kl_program prog_alloc(int nbufs, int nsteps, int nkernels)
{
	kl_program p;
	memset(&p, 0, sizeof p);
	p.bufs = calloc((size_t)nbufs + 1, sizeof *p.bufs);
	p.steps = calloc((size_t)nsteps + 1, sizeof *p.steps);
	p.kernel_names = calloc((size_t)nkernels + 1, sizeof(char *));
	assert_non_null(p.bufs);
	assert_non_null(p.steps);
	assert_non_null(p.kernel_names);
	p.nbufs = nbufs;
	p.nsteps = nsteps;
	p.nkernels = nkernels;
	for (int k = 0; k < nkernels; k++) {
		char name[16];
		snprintf(name, sizeof name, "k%d", k);
		p.kernel_names[k] = strdup(name);
	}
	return p;
}

static void prog_release(kl_program *p)
{
	for (int k = 0; k < p->nkernels; k++)
		free(p->kernel_names[k]);
	free(p->kernel_names);
	free(p->bufs);
	free(p->steps);
	free(p->source);
	free(p->fusion_log);
	memset(p, 0, sizeof *p);
}

static kl_step kstep(int kernel, int nreads, const int32_t *reads, int32_t write, int32_t node)
{
	kl_step s;
	memset(&s, 0, sizeof s);
	s.kind = KL_STEP_KERNEL;
	s.kernel = kernel;
	s.nreads = nreads;
	for (int i = 0; i < nreads; i++)
		s.reads[i] = reads[i];
	s.nwrites = 1;
	s.writes[0] = write;
	s.nnodes = 1;
	s.nodes[0] = node;
	snprintf(s.what, sizeof s.what, "pointwise");
	return s;
}

/* A matmul step over 2-D (or batched, b broadcast) operands with the
 * tensors' own strides. */
static kl_step mmstep(int32_t a, int32_t b, int32_t c, const kl_tensor *ta, const kl_tensor *tb,
                      int64_t m, int64_t n, int64_t k, int32_t node)
{
	kl_step s;
	memset(&s, 0, sizeof s);
	s.kind = KL_STEP_MATMUL;
	kl_matmul_step *mm = &s.mm;
	mm->a = a;
	mm->b = b;
	mm->c = c;
	mm->m = m;
	mm->n = n;
	mm->k = k;
	int ad = ta->ndim, bd = tb->ndim;
	mm->a_rs = ta->strides[ad - 2];
	mm->a_cs = ta->strides[ad - 1];
	mm->b_rs = tb->strides[bd - 2];
	mm->b_cs = tb->strides[bd - 1];
	mm->ldc = n;
	mm->alpha = 1;
	mm->beta = 0;
	if (ad == 3) {
		mm->nbatch = 1;
		mm->batch[0] = ta->shape[0];
		mm->a_bstride[0] = ta->strides[0];
		mm->b_bstride[0] = bd == 3 ? tb->strides[0] : 0;
		mm->c_bstride[0] = m * n;
	}
	s.nreads = 2;
	s.reads[0] = a;
	s.reads[1] = b;
	s.nwrites = 1;
	s.writes[0] = c;
	s.nnodes = 1;
	s.nodes[0] = node;
	s.flops = 2.0 * (double)(m * n * k * (ad == 3 ? ta->shape[0] : 1));
	snprintf(s.what, sizeof s.what, "matmul %lldx%lldx%lld", (long long)m, (long long)n,
	         (long long)k);
	return s;
}

/* Every output of g evaluated by the reference on in[] agrees with out[]. */
static void check_ref(const kl_graph *g, kl_tensor *const *in, kl_tensor *const *out, double factor)
{
	double **iv = calloc((size_t)g->ninputs + 1, sizeof *iv);
	double **ov = calloc((size_t)g->noutputs + 1, sizeof *ov);
	assert_non_null(iv);
	assert_non_null(ov);
	for (int i = 0; i < g->ninputs; i++)
		assert_non_null(iv[i] = kltest_read(in[i]));
	char err[256] = "";
	assert_int_equal(kl__ref_eval(g, (const double *const *)iv, ov, err, sizeof err), KL_OK);
	for (int j = 0; j < g->noutputs; j++) {
		const kl_node *n = &g->nodes[g->outputs[j]];
		assert_int_equal(kl_tensor_dtype(out[j]), n->dtype);
		assert_int_equal(kl_ndim(out[j]), n->ndim);
		assert_memory_equal(kl_shape(out[j]), n->shape, sizeof(int64_t) * n->ndim);
		double *got = kltest_read(out[j]);
		assert_non_null(got);
		assert_true(kltest_compare("runtime", (kl_dtype)n->dtype, n->ndim, n->shape, got,
		                           ov[j], factor));
		free(got);
		free(ov[j]);
	}
	for (int i = 0; i < g->ninputs; i++)
		free(iv[i]);
	free(iv);
	free(ov);
}

static kl_compiled *compile_given(kl_ctx *ctx, const kl_graph *g, const kl_program *p,
                                  const uint32_t *dyn)
{
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT,
	                      .fusion = true,
	                      .dyn_masks = dyn,
	                      .name = "test",
	                      .given = p};
	kl_compiled *c = kl__compile(ctx, g, &cfg);
	if (!c)
		fprintf(stderr, "kl__compile: %s\n", kl_last_error(ctx));
	return c;
}

/* Remove dir and everything in it (two levels: entries and build dirs). */
static void remove_tree(const char *dir)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	char p[PATH_MAX];
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= (int)sizeof p)
			continue;
		if (unlink(p) != 0)
			kl__rmtree_flat(p);
	}
	closedir(d);
	rmdir(dir);
}

/* A private, empty cache directory for one test. */
static void use_cache_dir(const char *name, char *out, size_t cap)
{
	static char base[PATH_MAX / 2];
	if (!base[0]) {
		const char *env = getenv("KILN_CACHE_DIR");
		if (env && *env)
			snprintf(base, sizeof base, "%s", env);
		else
			snprintf(base, sizeof base, "/tmp/kiln-test-runtime-%ld", (long)getuid());
		mkdir(base, 0700);
	}
	snprintf(out, cap, "%s/%s", base, name);
	remove_tree(out);
	assert_int_equal(mkdir(out, 0700), 0);
	setenv("KILN_CACHE_DIR", out, 1);
}

static kl_ctx *new_ctx(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	return ctx;
}

/* ---- the chain every cache test uses: relu((x * 2) @ w) ------------------------- */

static const char chain_src[] = "#include <stdint.h>\n"
                                "void k0(void *const *B, const int64_t *S)\n"
                                "{\n"
                                "\t(void)S;\n"
                                "\tconst float *x = (const float *)B[0];\n"
                                "\tfloat *t = (float *)B[2];\n"
                                "\tfor (int64_t i = 0; i < 24; i++)\n"
                                "\t\tt[i] = x[i] * 2.0f;\n"
                                "}\n"
                                "void k1(void *const *B, const int64_t *S)\n"
                                "{\n"
                                "\t(void)S;\n"
                                "\tconst float *y = (const float *)B[3];\n"
                                "\tfloat *z = (float *)B[4];\n"
                                "\tfor (int64_t i = 0; i < 20; i++)\n"
                                "\t\tz[i] = y[i] > 0.0f ? y[i] : 0.0f;\n"
                                "}\n";

static void build_chain(kl_ctx *ctx, kl_graph *g, kl_program *p, kl_tensor **in, uint64_t seed)
{
	int64_t xs[2] = {4, 6}, ws[2] = {6, 5}, ys[2] = {4, 5};
	in[0] = kltest_rand(ctx, KL_F32, 2, xs, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	in[1] = kltest_rand(ctx, KL_F32, 2, ws, KLTEST_NORMAL, KLTEST_CONTIG, seed + 1);
	assert_non_null(in[0]);
	assert_non_null(in[1]);
	kl__graph_init(g);
	int32_t x = g_input(g, in[0]), w = g_input(g, in[1]);
	kl_attrs two = {.s = {2.0}, .scalar_rhs = 1};
	int32_t t = g_node(g, KL_OP_MUL, KL_F32, 2, xs, 1, &x, &two);
	int32_t y = g_node(g, KL_OP_MATMUL, KL_F32, 2, ys, 2, (int32_t[]){t, w}, NULL);
	int32_t z = g_node(g, KL_OP_RELU, KL_F32, 2, ys, 1, &y, NULL);
	assert_int_equal(kl__graph_add_output(g, z), 0);

	*p = prog_alloc(5, 3, 2);
	p->bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 2, xs);
	p->bufs[1] = pbuf(KL_BUF_INPUT, 1, KL_F32, 2, ws);
	p->bufs[2] = pbuf(KL_BUF_TEMP, 0, KL_F32, 2, xs);
	p->bufs[3] = pbuf(KL_BUF_TEMP, 0, KL_F32, 2, ys);
	p->bufs[4] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 2, ys);
	p->steps[0] = kstep(0, 1, (int32_t[]){0}, 2, t);
	p->steps[1] = mmstep(2, 1, 3, in[0], in[1], 4, 5, 6, y);
	p->steps[2] = kstep(1, 1, (int32_t[]){3}, 4, z);
	p->source = strdup(chain_src);
}

/* Compile and run the chain once on ctx; returns whether it was correct. */
static kl_compiled *run_chain(kl_ctx *ctx)
{
	kl_graph g;
	kl_program p;
	kl_tensor *in[2], *out[1];
	build_chain(ctx, &g, &p, in, 7);
	kl_compiled *c = compile_given(ctx, &g, &p, NULL);
	if (c) {
		assert_int_equal(kl__compiled_run(ctx, c, in, out), KL_OK);
		assert_int_equal(c->last_launches, 3);
		check_ref(&g, in, out, 1);
		kl_release(out[0]);
	}
	kl_release(in[0]);
	kl_release(in[1]);
	prog_release(&p);
	kl__graph_free(&g);
	return c;
}

/* ---- JIT and executor ------------------------------------------------------------ */

static void test_kernels_and_strides(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("kernels", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	int64_t shape[2] = {3, 5};
	/* b is a strided view with an offset: the kernel indexes it with its
	 * traced strides from a pointer the executor already offset */
	kl_tensor *in[2] = {kltest_rand(ctx, KL_F32, 2, shape, KLTEST_NORMAL, KLTEST_CONTIG, 11),
	                    kltest_rand(ctx, KL_F32, 2, shape, KLTEST_NORMAL, KLTEST_STRIDED, 12)};
	assert_non_null(in[0]);
	assert_non_null(in[1]);
	const int64_t *bs = kl_strides(in[1]);
	assert_false(kl_is_contiguous(in[1]));
	kl_graph g;
	kl__graph_init(&g);
	int32_t a = g_input(&g, in[0]), b = g_input(&g, in[1]);
	int32_t s = g_node(&g, KL_OP_ADD, KL_F32, 2, shape, 2, (int32_t[]){a, b}, NULL);
	int32_t e = g_node(&g, KL_OP_EXP, KL_F32, 2, shape, 1, &s, NULL);
	assert_int_equal(kl__graph_add_output(&g, s), 0);
	assert_int_equal(kl__graph_add_output(&g, e), 0);

	kl_program p = prog_alloc(4, 2, 2);
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 2, shape);
	p.bufs[1] = pbuf(KL_BUF_INPUT, 1, KL_F32, 2, shape);
	p.bufs[2] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 2, shape);
	p.bufs[3] = pbuf(KL_BUF_OUTPUT, 1, KL_F32, 2, shape);
	p.steps[0] = kstep(0, 2, (int32_t[]){0, 1}, 2, s);
	p.steps[1] = kstep(1, 1, (int32_t[]){2}, 3, e);
	char src[2048];
	snprintf(src, sizeof src,
	         "#include <math.h>\n#include <stdint.h>\n"
	         "void k0(void *const *B, const int64_t *S)\n{\n\t(void)S;\n"
	         "\tconst float *a = B[0], *b = B[1];\n\tfloat *o = B[2];\n"
	         "\tfor (int64_t i = 0; i < 3; i++)\n\t\tfor (int64_t j = 0; j < 5; j++)\n"
	         "\t\t\to[i * 5 + j] = a[i * 5 + j] + b[i * %lld + j * %lld];\n}\n"
	         "void k1(void *const *B, const int64_t *S)\n{\n\t(void)S;\n"
	         "\tconst float *s = B[2];\n\tfloat *o = B[3];\n"
	         "\tfor (int64_t i = 0; i < 15; i++)\n\t\to[i] = expf(s[i]);\n}\n",
	         (long long)bs[0], (long long)bs[1]);
	p.source = strdup(src);
	long before = kl__jit_compiles();
	kl_compiled *c = compile_given(ctx, &g, &p, NULL);
	assert_non_null(c);
	assert_int_equal(kl__jit_compiles(), before + 1);
	assert_false(c->from_cache);
	kl_tensor *out[2];
	for (int rep = 0; rep < 2; rep++) {
		assert_int_equal(kl__compiled_run(ctx, c, in, out), KL_OK);
		check_ref(&g, in, out, 1);
		kl_release(out[0]);
		kl_release(out[1]);
	}
	assert_int_equal(c->last_launches, 2);
	assert_int_equal((int)c->runs, 2);

	/* wrong strides, shape or dtype: refused with the reason */
	kl_tensor *dense = kl_contiguous(in[1]);
	assert_int_equal(kl__compiled_run(ctx, c, (kl_tensor *[]){in[0], dense}, out), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "strides"));
	assert_null(out[0]);
	int64_t other[2] = {3, 4};
	kl_tensor *small = kl_zeros(ctx, KL_F32, 2, other);
	assert_int_equal(kl__compiled_run(ctx, c, (kl_tensor *[]){small, in[1]}, out), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "[3,4]"));
	kl_release(small);
	kl_release(dense);

	/* explain names the nodes of each step */
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	kl__compiled_explain(c, f, "");
	fclose(f);
	assert_non_null(strstr(buf, "k0 pointwise: add#2"));
	assert_non_null(strstr(buf, "k1 pointwise: exp#3"));
	assert_non_null(strstr(buf, "planned peak memory"));
	free(buf);

	kl__compiled_free(c);
	prog_release(&p);
	kl__graph_free(&g);
	kl_release(in[0]);
	kl_release(in[1]);
	kl_ctx_free(ctx);
}

static void test_chain_with_temps(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("chain", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	kl_compiled *c = run_chain(ctx);
	assert_non_null(c);
	/* t (96 B) and y (80 B) are both live across the matmul: two slots */
	assert_int_equal(c->plan.nslots, 2);
	assert_int_equal((int)c->plan.arena_bytes, 128 + 128);
	kl__compiled_free(c);
	kl_ctx_free(ctx);
}

static void test_compile_error(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("cc-error", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	int64_t shape[1] = {4};
	kl_tensor *x = kl_zeros(ctx, KL_F32, 1, shape);
	kl_graph g;
	kl__graph_init(&g);
	int32_t a = g_input(&g, x);
	int32_t r = g_node(&g, KL_OP_NEG, KL_F32, 1, shape, 1, &a, NULL);
	kl__graph_add_output(&g, r);
	kl_program p = prog_alloc(2, 1, 1);
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, shape);
	p.bufs[1] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 1, shape);
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, r);
	p.source = strdup("void k0(void *const *B, const long *S) { this is not C; }\n");
	kl_compile_cfg cfg = {.fusion = true, .given = &p};
	assert_null(kl__compile(ctx, &g, &cfg));
	assert_int_equal(kl_last_status(ctx), KL_ECOMPILE);
	assert_non_null(strstr(kl_last_error(ctx), "C compiler"));
	assert_non_null(strstr(kl_last_error(ctx), "error"));
	/* a missing kernel symbol is caught at load */
	free(p.source);
	p.source = strdup("void k9(void) {}\n");
	assert_null(kl__compile(ctx, &g, &cfg));
	assert_int_equal(kl_last_status(ctx), KL_ECOMPILE);
	assert_non_null(strstr(kl_last_error(ctx), "k0 is missing"));
	prog_release(&p);
	kl__graph_free(&g);
	kl_release(x);
	kl_ctx_free(ctx);
}

static kl_status body_square_add(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                 int nout, void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_relu(kl_add(kl_mul(in[0], in[0]), kl_mul_scalar(in[0], -3.0)));
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* Whether some so-*.so in dir carries ASan's checks. */
static bool cache_has_asan_kernels(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	bool found = false;
	while (d && !found && (e = readdir(d))) {
		if (strncmp(e->d_name, "so-", 3))
			continue;
		char path[PATH_MAX + 300];
		snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
		FILE *f = fopen(path, "rb");
		static char buf[1 << 20];
		size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
		if (f)
			fclose(f);
		for (size_t i = 0; i + 13 <= n && !found; i++)
			found = !memcmp(buf + i, "__asan_report", 13);
	}
	if (d)
		closedir(d);
	return found;
}

/* KILN_JIT_SANITIZE: a value outside its list is kl_compile's error naming the
 * knob; a sanitizer whose runtime the process lacks is refused, never loaded
 * (an ASan object dlopen'ed into a plain process aborts it); in a sanitized
 * process (the ASan test build) the kernels carry the checks and compute
 * what the plain kernels do. */
static void test_jit_sanitize(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("jit-sanitize", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	kl_tensor *x = kltest_rand(ctx, KL_F32, 1, (int64_t[]){37}, KLTEST_NORMAL, KLTEST_CONTIG, 5);
	kl_tensor *out[1], *want[1];
	kl_fn *f = kl_compile(ctx, body_square_add, NULL, 1, 1, NULL);
	assert_int_equal(kl_fn_call(f, &x, want), KL_OK);
	kl_fn_free(f);

	setenv("KILN_JIT_SANITIZE", "adress", 1);
	f = kl_compile(ctx, body_square_add, NULL, 1, 1, NULL);
	assert_int_equal(kl_fn_call(f, &x, out), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "KILN_JIT_SANITIZE must be address"));
	kl_fn_free(f);
	kl_clear_error(ctx);

	void *self = dlopen(NULL, RTLD_NOW);
	assert_non_null(self);
	bool runtimes = dlsym(self, "__asan_init") && dlsym(self, "__ubsan_handle_add_overflow");
	dlclose(self);
	setenv("KILN_JIT_SANITIZE", "address,undefined", 1);
	f = kl_compile(ctx, body_square_add, NULL, 1, 1, NULL);
	kl_status st = kl_fn_call(f, &x, out);
	if (!runtimes) {
		assert_int_equal(st, KL_EINVAL);
		assert_non_null(strstr(kl_last_error(ctx), "needs a process built with"));
		assert_false(cache_has_asan_kernels(dir));
	} else {
		assert_int_equal(st, KL_OK);
		assert_true(cache_has_asan_kernels(dir));
		float a[37], b[37];
		assert_int_equal(kl_to_host(out[0], a, sizeof a), KL_OK);
		assert_int_equal(kl_to_host(want[0], b, sizeof b), KL_OK);
		assert_memory_equal(a, b, sizeof a);
		kl_release(out[0]);
	}
	kl_fn_free(f);
	unsetenv("KILN_JIT_SANITIZE");
	kl_release(want[0]);
	kl_release(x);
	kl_ctx_free(ctx);
}

/* One MATMUL step, no generated code, in dtype dt with A laid out as la. */
static void matmul_case(kl_ctx *ctx, kl_dtype dt, kltest_layout la, kltest_layout lb, bool batch,
                        uint64_t seed)
{
	int64_t as[3] = {2, 3, 4}, bs[2] = {4, 5}, cs[3] = {2, 3, 5}, be[3] = {2, 4, 5};
	int nd = batch ? 3 : 2;
	const int64_t *ash = batch ? as : as + 1, *csh = batch ? cs : cs + 1;
	kl_tensor *in[2] = {kltest_rand(ctx, dt, nd, ash, KLTEST_NORMAL, la, seed),
	                    kltest_rand(ctx, dt, 2, bs, KLTEST_NORMAL, lb, seed + 1)};
	assert_non_null(in[0]);
	assert_non_null(in[1]);
	kl_graph g;
	kl__graph_init(&g);
	int32_t a = g_input(&g, in[0]), b = g_input(&g, in[1]);
	if (batch)
		b = g_node(&g, KL_OP_EXPAND, dt, 3, be, 1, &b, NULL);
	int32_t m = g_node(&g, KL_OP_MATMUL, dt, nd, csh, 2, (int32_t[]){a, b}, NULL);
	kl__graph_add_output(&g, m);
	kl_program p = prog_alloc(3, 1, 0);
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, dt, nd, ash);
	p.bufs[1] = pbuf(KL_BUF_INPUT, 1, dt, 2, bs);
	p.bufs[2] = pbuf(KL_BUF_OUTPUT, 0, dt, nd, csh);
	p.steps[0] = mmstep(0, 1, 2, in[0], in[1], 3, 5, 4, m);
	kl_compiled *c = compile_given(ctx, &g, &p, NULL);
	assert_non_null(c);
	kl_tensor *out[1];
	assert_int_equal(kl__compiled_run(ctx, c, in, out), KL_OK);
	check_ref(&g, in, out, 2);
	kl_release(out[0]);
	kl__compiled_free(c);
	prog_release(&p);
	kl__graph_free(&g);
	kl_release(in[0]);
	kl_release(in[1]);
}

static void test_matmul_dtypes_layouts(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("matmul", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	const kl_dtype dts[] = {KL_F32, KL_F64, KL_F16, KL_BF16, KL_I32, KL_I64};
	const kltest_layout lays[] = {KLTEST_CONTIG, KLTEST_PERMUTED, KLTEST_STRIDED};
	long before = kl__jit_compiles();
	uint64_t seed = 100;
	for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
		for (int la = 0; la < 3; la++)
			for (int batch = 0; batch < 2; batch++)
				matmul_case(ctx, dts[d], lays[la], lays[(la + 1) % 3], batch,
				            seed += 7);
	/* library calls only: nothing was compiled */
	assert_int_equal(kl__jit_compiles(), before);
	kl_ctx_free(ctx);
}

static void test_view_outputs(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("views", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	int64_t xs[2] = {2, 3}, ts[2] = {3, 2};
	kl_tensor *in[1] = {kltest_rand(ctx, KL_F64, 2, xs, KLTEST_NORMAL, KLTEST_CONTIG, 5)};
	kl_graph g;
	kl__graph_init(&g);
	int32_t x = g_input(&g, in[0]);
	kl_attrs perm = {.v = {1, 0}};
	int32_t t = g_node(&g, KL_OP_PERMUTE, KL_F64, 2, ts, 1, &x, &perm);
	kl__graph_add_output(&g, t);
	kl__graph_add_output(&g, x);
	kl_program p = prog_alloc(3, 0, 0);
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F64, 2, xs);
	p.bufs[1] = pbuf(KL_BUF_OUTPUT, 0, KL_F64, 2, ts);
	p.bufs[1].alias = 0;
	p.bufs[1].view_strides[0] = 1;
	p.bufs[1].view_strides[1] = 3;
	p.bufs[2] = pbuf(KL_BUF_OUTPUT, 1, KL_F64, 2, xs);
	p.bufs[2].alias = 0;
	p.bufs[2].view_strides[0] = 3;
	p.bufs[2].view_strides[1] = 1;
	kl_compiled *c = compile_given(ctx, &g, &p, NULL);
	assert_non_null(c);
	kl_tensor *out[2];
	assert_int_equal(kl__compiled_run(ctx, c, in, out), KL_OK);
	assert_ptr_equal(out[0]->st, in[0]->st);
	assert_int_equal(kl_strides(out[0])[0], 1);
	check_ref(&g, in, out, 1);
	kl_release(out[0]);
	kl_release(out[1]);
	kl__compiled_free(c);
	prog_release(&p);
	kl__graph_free(&g);
	kl_release(in[0]);
	kl_ctx_free(ctx);
}

/* A symbol: x is [N,4] for any N; t = 2x lives in the arena, whose size
 * follows N. */
static void test_symbolic_program(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("symbols", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	int64_t xs[2] = {3, 4};
	kl_tensor *x0 = kltest_rand(ctx, KL_F32, 2, xs, KLTEST_NORMAL, KLTEST_CONTIG, 21);
	kl_graph g;
	kl__graph_init(&g);
	int32_t x = g_input(&g, x0);
	kl_attrs two = {.s = {2.0}, .scalar_rhs = 1};
	int32_t t = g_node(&g, KL_OP_MUL, KL_F32, 2, xs, 1, &x, &two);
	int32_t r = g_node(&g, KL_OP_RELU, KL_F32, 2, xs, 1, &t, NULL);
	kl__graph_add_output(&g, r);
	kl_program p = prog_alloc(3, 2, 2);
	for (int b = 0; b < 3; b++) {
		p.bufs[b] = pbuf(b == 0   ? KL_BUF_INPUT
		                 : b == 1 ? KL_BUF_TEMP
		                          : KL_BUF_OUTPUT,
		                 0, KL_F32, 2, xs);
		p.bufs[b].shape[0].sym = 1;
	}
	p.nsyms = 1;
	p.sym_input[0] = 0;
	p.sym_dim[0] = 0;
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, t);
	p.steps[1] = kstep(1, 1, (int32_t[]){1}, 2, r);
	p.source = strdup("#include <stdint.h>\n"
	                  "void k0(void *const *B, const int64_t *S)\n{\n"
	                  "\tconst float *x = B[0];\n\tfloat *t = B[1];\n"
	                  "\tfor (int64_t i = 0; i < S[0] * 4; i++)\n\t\tt[i] = 2.0f * x[i];\n}\n"
	                  "void k1(void *const *B, const int64_t *S)\n{\n"
	                  "\tconst float *t = B[1];\n\tfloat *o = B[2];\n"
	                  "\tfor (int64_t i = 0; i < S[0] * 4; i++)\n"
	                  "\t\to[i] = t[i] > 0 ? t[i] : 0;\n}\n");
	uint32_t dyn[1] = {1};
	kl_compiled *c = compile_given(ctx, &g, &p, dyn);
	assert_non_null(c);
	assert_true(c->dynamic);
	const int64_t sizes[] = {3, 5, 2, 9};
	for (int i = 0; i < 4; i++) {
		int64_t s[2] = {sizes[i], 4};
		kl_tensor *in =
		        kltest_rand(ctx, KL_F32, 2, s, KLTEST_NORMAL, KLTEST_CONTIG, 30 + i);
		kl_tensor *out;
		assert_int_equal(kl__compiled_run(ctx, c, &in, &out), KL_OK);
		assert_int_equal(kl_dim(out, 0), sizes[i]);
		assert_true(c->arena_cap >= (size_t)sizes[i] * 16);
		kl_graph gi;
		kl__graph_copy(&gi, &g);
		for (int32_t n = 0; n < gi.n; n++)
			gi.nodes[n].shape[0] = sizes[i];
		gi.nodes[0].strides[0] = 4;
		check_ref(&gi, &in, &out, 1);
		kl__graph_free(&gi);
		kl_release(out);
		kl_release(in);
	}
	kl__compiled_free(c);
	prog_release(&p);
	kl__graph_free(&g);
	kl_release(x0);
	kl_ctx_free(ctx);
}

/* ---- memory planner -------------------------------------------------------------- */

static void test_memplan_reuse(void **state)
{
	(void)state;
	/* x -> t1 -> t2 -> t3 -> t4 -> out: only two temps live at once */
	int64_t sh[1] = {100};
	kl_program p = prog_alloc(6, 5, 5);
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, sh);
	for (int b = 1; b <= 4; b++)
		p.bufs[b] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sh);
	p.bufs[5] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 1, sh);
	for (int s = 0; s < 5; s++)
		p.steps[s] = kstep(s, 1, (int32_t[]){s}, s + 1, s);
	kl_memplan mp;
	int64_t syms[1] = {0};
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_equal(mp.nslots, 2);
	assert_int_equal((int)mp.arena_bytes, 2 * 448);
	assert_int_equal((int)mp.temp_bytes, 4 * 448);
	assert_int_equal((int)mp.out_bytes, 400);
	assert_int_equal(mp.slot[1], mp.slot[3]);
	assert_int_equal(mp.slot[2], mp.slot[4]);
	assert_int_not_equal(mp.slot[1], mp.slot[2]);
	assert_int_equal(mp.slot[0], -1);
	assert_int_equal(mp.slot[5], -1);
	kl__memplan_free(&mp);

	/* best fit: a freed big slot and a freed small one; a small temp takes
	 * the small one */
	int64_t big[1] = {1000}, small[1] = {10};
	p.bufs[1] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, big);
	p.bufs[2] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, small);
	p.bufs[3] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, small);
	p.bufs[4] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, big);
	/* steps: t1 = f(x); t2 = f(x); t3 = f(t1, t2); t4 = f(t3); out = f(t4) */
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, 0);
	p.steps[1] = kstep(1, 1, (int32_t[]){0}, 2, 1);
	p.steps[2] = kstep(2, 2, (int32_t[]){1, 2}, 3, 2);
	p.steps[3] = kstep(3, 1, (int32_t[]){3}, 4, 3);
	p.steps[4] = kstep(4, 1, (int32_t[]){4}, 5, 4);
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_not_equal(mp.slot[3], mp.slot[1]);
	assert_int_not_equal(mp.slot[3], mp.slot[2]); /* both still read by the step writing t3 */
	assert_int_equal(mp.slot[4], mp.slot[1]);     /* t4 (big) reuses t1's slot */
	assert_true(mp.arena_bytes < mp.temp_bytes);
	kl__memplan_free(&mp);
	prog_release(&p);
}

/* Random programs: buffers whose lives overlap never overlap in memory. */
static void test_memplan_random(void **state)
{
	(void)state;
	uint64_t rng = 42;
	/* the second half: sizes from a few, and steps marked in place (the
	 * planner writes one where its input dies there, same size) */
	for (int trial = 0; trial < 400; trial++) {
		bool few = trial >= 200;
		int nb = 2 + (int)(kltest_next(&rng) % 30), ns = nb - 1;
		kl_program p = prog_alloc(nb, ns, ns);
		int64_t sh[1] = {1};
		p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, sh);
		for (int b = 1; b < nb; b++) {
			sh[0] = few ? 16 << (2 * (kltest_next(&rng) % 3))
			            : 1 + (int64_t)(kltest_next(&rng) % 300);
			p.bufs[b] =
			        pbuf(b == nb - 1 ? KL_BUF_OUTPUT : KL_BUF_TEMP, 0, KL_F32, 1, sh);
		}
		/* step s writes buffer s+1 and reads up to 3 earlier ones */
		for (int s = 0; s < ns; s++) {
			int32_t reads[3];
			int nr = 1 + (int)(kltest_next(&rng) % 3);
			for (int r = 0; r < nr; r++)
				reads[r] = (int32_t)(kltest_next(&rng) % (uint64_t)(s + 1));
			p.steps[s] = kstep(s, nr, reads, s + 1, 0);
			p.steps[s].inplace = few && kltest_next(&rng) % 2;
		}
		int64_t syms[1] = {0};
		kl_memplan mp;
		assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
		int first[40], last[40];
		for (int b = 0; b < nb; b++)
			first[b] = last[b] = -1;
		for (int s = 0; s < ns; s++) {
			const kl_step *sp = &p.steps[s];
			for (int i = 0; i < sp->nreads + sp->nwrites; i++) {
				int b = i < sp->nreads ? sp->reads[i] : sp->writes[i - sp->nreads];
				if (first[b] < 0)
					first[b] = s;
				last[b] = s;
			}
		}
		for (int a = 1; a < nb - 1; a++)
			for (int b = a + 1; b < nb - 1; b++) {
				bool live = !(last[a] < first[b] || last[b] < first[a]);
				/* b written in place of a, which died there */
				const kl_step *wb = &p.steps[b - 1];
				if (wb->inplace && wb->reads[0] == a && last[a] == b - 1 &&
				    mp.off[a] == mp.off[b] &&
				    kl__buf_bytes(&p.bufs[a], syms) == kl__buf_bytes(&p.bufs[b], syms))
					live = false;
				size_t ea = mp.off[a] + kl__buf_bytes(&p.bufs[a], syms);
				size_t eb = mp.off[b] + kl__buf_bytes(&p.bufs[b], syms);
				bool mem = mp.off[a] < eb && mp.off[b] < ea;
				assert_false(live && mem);
				assert_true(ea <= mp.arena_bytes && eb <= mp.arena_bytes);
			}
		assert_true(mp.arena_bytes <= mp.temp_bytes);
		kl__memplan_free(&mp);
		prog_release(&p);
	}
}

/* Lent outputs (kl_compile_cfg.lent): the last outputs get arena slots from
 * the step that writes them to the call's end and are not counted as
 * outputs; one an earlier output is a view of is not lent. */
static void test_memplan_lent(void **state)
{
	(void)state;
	kl_program p = prog_alloc(6, 4, 4);
	int64_t sh[1] = {100};
	/* in -> t1 -> out0 (returned), t1 -> out1, t1 -> out2 (both lent) */
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, sh);
	p.bufs[1] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sh);
	p.bufs[2] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 1, sh);
	p.bufs[3] = pbuf(KL_BUF_OUTPUT, 1, KL_F32, 1, sh);
	p.bufs[4] = pbuf(KL_BUF_OUTPUT, 2, KL_F32, 1, sh);
	p.bufs[5] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sh);
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, 0);
	p.steps[1] = kstep(1, 1, (int32_t[]){1}, 3, 1);
	p.steps[2] = kstep(2, 1, (int32_t[]){1}, 5, 2);
	p.steps[3] = kstep(3, 1, (int32_t[]){5}, 4, 3);
	p.nsteps = 4;
	int64_t syms[1] = {0};
	kl_memplan mp;
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_equal(mp.nlent, 0);
	assert_int_equal((int)mp.out_bytes, 1200);
	assert_int_equal(mp.slot[3], -1);
	kl__memplan_free(&mp);
	assert_int_equal(kl__memplan_build(&p, syms, 2, &mp), KL_OK);
	assert_int_equal(mp.nlent, 2);
	assert_int_equal((int)mp.out_bytes, 400); /* out0 alone (no step writes it) */
	assert_true(mp.slot[3] >= 0 && mp.slot[4] >= 0);
	/* out1 lives from step 1 to the end: t5 (steps 2-3) cannot share it,
	 * nor out2 (step 3 on) */
	assert_int_not_equal(mp.slot[3], mp.slot[5]);
	assert_int_not_equal(mp.slot[3], mp.slot[4]);
	assert_int_not_equal(mp.slot[3], mp.slot[1]);
	kl__memplan_free(&mp);
	/* out0 a view of out2: out2 is not lent (the view outlives the call) */
	p.bufs[2].alias = 4;
	assert_int_equal(kl__memplan_build(&p, syms, 2, &mp), KL_OK);
	assert_int_equal(mp.nlent, 1);
	assert_int_equal(mp.slot[4], -1);
	assert_true(mp.slot[3] >= 0);
	kl__memplan_free(&mp);
	p.bufs[2].alias = -1;
	prog_release(&p);
}

/* A kernel that writes in place (kl_step.inplace) as its input's last
 * reader: its output lies where the input did; not when a later step reads
 * the input, nor when their sizes differ. */
static void test_memplan_inplace(void **state)
{
	(void)state;
	kl_program p = prog_alloc(5, 3, 3);
	int64_t sh[1] = {256}, other[1] = {64};
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, sh);
	p.bufs[1] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sh);
	p.bufs[2] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sh);
	p.bufs[3] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 1, sh);
	p.bufs[4] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, other);
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, 0);    /* t1 = f(x) */
	p.steps[1] = kstep(1, 2, (int32_t[]){1, 0}, 2, 1); /* t2 = g(t1, x), in place */
	p.steps[1].inplace = true;
	p.steps[2] = kstep(2, 1, (int32_t[]){2}, 3, 2); /* out = h(t2) */
	p.nsteps = 3;
	int64_t syms[1] = {0};
	kl_memplan mp;
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_equal(mp.ninplace, 1);
	assert_true(mp.off[1] == mp.off[2]);
	assert_int_equal((int)mp.arena_bytes, 1024);
	kl__memplan_free(&mp);
	/* t1 read again after: t2 gets memory of its own */
	p.steps[2] = kstep(2, 2, (int32_t[]){2, 1}, 3, 2);
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_equal(mp.ninplace, 0);
	assert_true(mp.off[1] != mp.off[2]);
	kl__memplan_free(&mp);
	/* other sizes: not in place (lowering never marks such a step; the
	 * planner checks all the same) */
	p.steps[1] = kstep(1, 2, (int32_t[]){1, 0}, 4, 1);
	p.steps[1].inplace = true;
	p.steps[2] = kstep(2, 1, (int32_t[]){4}, 3, 2);
	assert_int_equal(kl__memplan_build(&p, syms, 0, &mp), KL_OK);
	assert_int_equal(mp.ninplace, 0);
	kl__memplan_free(&mp);
	prog_release(&p);
}

/* Step order (lower/step_order.c): a step that frees more temp memory than
 * it makes runs before the next one in order that makes more than it frees;
 * every dependency through a buffer is kept. */
static void test_step_order(void **state)
{
	(void)state;
	/* the backward of y = x W: dx = dy W' (makes dx), dW = x' dy (the last
	 * reader of x, an output): dW runs first */
	kl_program p = prog_alloc(7, 4, 4);
	int64_t big[1] = {1000}, sm[1] = {10};
	p.bufs[0] = pbuf(KL_BUF_INPUT, 0, KL_F32, 1, sm);   /* input */
	p.bufs[1] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, big);   /* x */
	p.bufs[2] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sm);    /* dy */
	p.bufs[3] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, big);   /* dx */
	p.bufs[4] = pbuf(KL_BUF_OUTPUT, 0, KL_F32, 1, sm);  /* dW */
	p.bufs[5] = pbuf(KL_BUF_OUTPUT, 1, KL_F32, 1, sm);  /* from dx */
	p.bufs[6] = pbuf(KL_BUF_TEMP, 0, KL_F32, 1, sm);
	p.steps[0] = kstep(0, 1, (int32_t[]){0}, 1, 0);    /* x */
	p.steps[1] = kstep(1, 2, (int32_t[]){0, 1}, 2, 1); /* dy */
	p.steps[2] = kstep(2, 1, (int32_t[]){2}, 3, 2);    /* dx */
	p.steps[3] = kstep(3, 2, (int32_t[]){1, 2}, 4, 3); /* dW */
	p.nsteps = 4;
	p.nsymf = 1;
	p.symf = calloc(1, sizeof *p.symf);
	assert_non_null(p.symf);
	p.symf[0].step = 3;
	assert_int_equal(kl__order_steps(&p), KL_OK);
	static const int want[4] = {0, 1, 3, 2};
	for (int k = 0; k < 4; k++)
		assert_int_equal(p.steps[k].kernel, want[k]);
	assert_int_equal(p.symf[0].step, 2); /* it follows its step */
	free(p.symf);
	p.symf = NULL;
	p.nsymf = 0;
	prog_release(&p);

	/* random programs, some writing in place: each step still comes after
	 * the last writer of every buffer it touches, and a write after every
	 * read of the value it overwrites */
	uint64_t rng = 7;
	for (int trial = 0; trial < 300; trial++) {
		int nb = 3 + (int)(kltest_next(&rng) % 20), ns = 2 + (int)(kltest_next(&rng) % 20);
		kl_program q = prog_alloc(nb, ns, ns);
		for (int b = 0; b < nb; b++) {
			int64_t sh[1] = {1 + (int64_t)(kltest_next(&rng) % 500)};
			q.bufs[b] = pbuf(b == 0 ? KL_BUF_INPUT : KL_BUF_TEMP, 0, KL_F32, 1, sh);
		}
		for (int s = 0; s < ns; s++) {
			int32_t reads[3];
			int nr = 1 + (int)(kltest_next(&rng) % 3);
			for (int r = 0; r < nr; r++)
				reads[r] = (int32_t)(kltest_next(&rng) % (uint64_t)nb);
			q.steps[s] = kstep(s, nr, reads,
			                   1 + (int32_t)(kltest_next(&rng) % (uint64_t)(nb - 1)), s);
		}
		q.nsteps = ns;
		kl_step *orig = malloc(sizeof *orig * (size_t)ns);
		assert_non_null(orig);
		memcpy(orig, q.steps, sizeof *orig * (size_t)ns);
		assert_int_equal(kl__order_steps(&q), KL_OK);
		int at[64];
		for (int k = 0; k < ns; k++)
			at[q.steps[k].kernel] = k;
		for (int j = 0; j < ns; j++)
			for (int i = 0; i < j; i++) {
				const kl_step *a = &orig[i], *b = &orig[j];
				bool dep = false;
				for (int r = 0; r < b->nreads; r++)
					dep |= b->reads[r] == a->writes[0];
				dep |= b->writes[0] == a->writes[0];
				for (int r = 0; r < a->nreads; r++)
					dep |= a->reads[r] == b->writes[0];
				if (dep && at[i] > at[j])
					fail_msg("trial %d: step %d ran before step %d, which it depends on",
					         trial, j, i);
			}
		free(orig);
		prog_release(&q);
	}
}

/* ---- programs as bytes ---------------------------------------------------------- */

static void test_program_bytes(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_graph g;
	kl_program p;
	kl_tensor *in[2];
	build_chain(ctx, &g, &p, in, 3);
	p.fusion_log = strdup("refused: matmul -> relu (no epilogue on the CPU)\n");
	char err[256];
	assert_int_equal(kl__program_validate(&p, 2, 1, err, sizeof err), KL_OK);
	uint8_t *bytes;
	size_t len;
	assert_int_equal(kl__program_serialize(&p, &bytes, &len), KL_OK);
	kl_program q;
	assert_int_equal(kl__program_deserialize(bytes, len, &q, err, sizeof err), KL_OK);
	assert_null(q.source);
	assert_int_equal(q.nbufs, p.nbufs);
	assert_int_equal(q.nsteps, p.nsteps);
	assert_memory_equal(q.bufs, p.bufs, sizeof *p.bufs * (size_t)p.nbufs);
	assert_memory_equal(q.steps, p.steps, sizeof *p.steps * (size_t)p.nsteps);
	assert_string_equal(q.kernel_names[1], "k1");
	assert_string_equal(q.fusion_log, p.fusion_log);
	uint8_t *again;
	size_t len2;
	assert_int_equal(kl__program_serialize(&q, &again, &len2), KL_OK);
	assert_int_equal(len2, len);
	assert_memory_equal(again, bytes, len);
	free(again);
	prog_release(&q);

	/* every truncation is refused */
	for (size_t n = 0; n < len; n++) {
		assert_int_equal(kl__program_deserialize(bytes, n, &q, err, sizeof err),
		                 KL_EFORMAT);
		assert_null(q.bufs);
	}
	/* flipped bytes: refused, or a program that still validates */
	uint64_t rng = 9;
	uint8_t *mut = malloc(len);
	for (int t = 0; t < 3000; t++) {
		memcpy(mut, bytes, len);
		for (int k = 0; k < 1 + t % 3; k++)
			mut[kltest_next(&rng) % len] ^= (uint8_t)(1u << (kltest_next(&rng) % 8));
		if (kl__program_deserialize(mut, len, &q, err, sizeof err) == KL_OK) {
			assert_int_equal(kl__program_validate(&q, -1, -1, err, sizeof err), KL_OK);
			prog_release(&q);
		}
	}
	free(mut);
	free(bytes);

	/* targeted: what validation must catch */
	kl_program bad = p;
	kl_buf bufs[5];
	kl_step steps[3];
	memcpy(bufs, p.bufs, sizeof bufs);
	memcpy(steps, p.steps, sizeof steps);
	bad.bufs = bufs;
	bad.steps = steps;
	char *names[2] = {"k0", "K1"};
	bad.kernel_names = names;
	assert_int_equal(kl__program_validate(&bad, 2, 1, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "[a-z0-9_]"));
	names[1] = "k1";
	steps[0].writes[0] = 9;
	assert_int_equal(kl__program_validate(&bad, 2, 1, err, sizeof err), KL_EFORMAT);
	steps[0].writes[0] = 2;
	steps[2].reads[0] = 2;
	steps[0] = steps[2]; /* reads t before anything wrote it */
	assert_int_equal(kl__program_validate(&bad, 2, 1, err, sizeof err), KL_EFORMAT);
	memcpy(steps, p.steps, sizeof steps);
	steps[1].mm.m = 5; /* the product would read past t */
	assert_int_equal(kl__program_validate(&bad, 2, 1, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "reaches"));
	memcpy(steps, p.steps, sizeof steps);
	assert_int_equal(kl__program_validate(&bad, 3, 2, err, sizeof err), KL_EFORMAT);
	bufs[4].index = 1;
	assert_int_equal(kl__program_validate(&bad, 2, 1, err, sizeof err), KL_EFORMAT);

	prog_release(&p);
	kl__graph_free(&g);
	kl_release(in[0]);
	kl_release(in[1]);
	kl_ctx_free(ctx);
}

/* ---- the disk cache ----------------------------------------------------------- */

/* Run this test binary as `mode dir` with KILN_LOGS=cache; its stderr is
 * returned (malloc'd), its exit status in *status. */
static char *spawn_self(const char *mode, const char *dir, int *status)
{
	int pfd[2];
	assert_int_equal(pipe(pfd), 0);
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, pfd[1], 2);
	posix_spawn_file_actions_addclose(&fa, pfd[0]);
	char *argv[] = {(char *)self_exe, (char *)mode, (char *)dir, NULL};
	pid_t pid;
	assert_int_equal(posix_spawn(&pid, self_exe, &fa, NULL, argv, environ), 0);
	posix_spawn_file_actions_destroy(&fa);
	close(pfd[1]);
	size_t cap = 4096, n = 0;
	char *out = malloc(cap);
	ssize_t r;
	while ((r = read(pfd[0], out + n, cap - n - 1)) > 0 || (r < 0 && errno == EINTR)) {
		if (r > 0)
			n += (size_t)r;
		if (cap - n < 2)
			out = realloc(out, cap *= 2);
	}
	out[n] = '\0';
	close(pfd[0]);
	while (waitpid(pid, status, 0) < 0 && errno == EINTR)
		;
	return out;
}

/* The child of the warm-start test: compile the chain again, expecting no
 * compiler run. Exit status 0 when it ran from the cache and was right. */
static int child_warm(const char *dir)
{
	setenv("KILN_CACHE_DIR", dir, 1);
	setenv("KILN_LOGS", "cache", 1);
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx)
		return 2;
	kl_compiled *c = run_chain(ctx);
	int rc = c && c->from_cache && kl__jit_compiles() == 0 && kl__rt_lowerings() == 0 ? 0 : 1;
	fprintf(stderr, "child: compiles %ld lowerings %ld from_cache %d\n", kl__jit_compiles(),
	        kl__rt_lowerings(), c ? (int)c->from_cache : -1);
	kl__compiled_free(c);
	kl_ctx_free(ctx);
	return rc;
}

/* The child of the race test: wait for the start signal (stdin closing),
 * then compile and run the chain into an empty shared cache. */
static int child_race(const char *dir)
{
	setenv("KILN_CACHE_DIR", dir, 1);
	char b;
	while (read(0, &b, 1) > 0)
		;
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx)
		return 2;
	kl_compiled *c = run_chain(ctx);
	int rc = c ? 0 : 1;
	kl__compiled_free(c);
	kl_ctx_free(ctx);
	return rc;
}

static void test_cache_warm_process(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("warm", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	long before = kl__jit_compiles();
	kl_compiled *c = run_chain(ctx);
	assert_non_null(c);
	assert_false(c->from_cache);
	assert_int_equal(kl__jit_compiles(), before + 1);
	kl__compiled_free(c);
	/* the same process again: a hit */
	c = run_chain(ctx);
	assert_true(c->from_cache);
	assert_int_equal(kl__jit_compiles(), before + 1);
	kl__compiled_free(c);
	kl_ctx_free(ctx);

	int status;
	char *err = spawn_self("--warm-child", dir, &status);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		fprintf(stderr, "child stderr:\n%s\n", err);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_non_null(strstr(err, "[kiln:cache] hit plan-"));
	assert_null(strstr(err, "miss"));
	free(err);
}

/* Run fn with stderr going to a string. */
static char *with_stderr(kl_compiled *(*fn)(kl_ctx *), kl_ctx *ctx, kl_compiled **res)
{
	fflush(stderr);
	char path[] = "/tmp/kiln-test-stderr-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	unlink(path);
	int saved = dup(2);
	dup2(fd, 2);
	*res = fn(ctx);
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	off_t n = lseek(fd, 0, SEEK_END);
	char *s = calloc((size_t)n + 1, 1);
	assert_int_equal(pread(fd, s, (size_t)n, 0), n);
	close(fd);
	return s;
}

/* Damage every entry whose name starts with prefix: truncate it, or flip
 * one bit of byte flip_at. */
static void corrupt_file(const char *dir, const char *prefix, off_t truncate_to, long flip_at)
{
	char path[PATH_MAX];
	int n = 0;
	DIR *d = opendir(dir);
	assert_non_null(d);
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, prefix, strlen(prefix)) != 0)
			continue;
		n++;
		assert_true(snprintf(path, sizeof path, "%s/%s", dir, e->d_name) <
		            (int)sizeof path);
		if (truncate_to >= 0)
			assert_int_equal(truncate(path, truncate_to), 0);
		if (flip_at >= 0) {
			int fd = open(path, O_RDWR);
			assert_true(fd >= 0);
			unsigned char c;
			off_t end = lseek(fd, 0, SEEK_END);
			off_t at = flip_at < end ? flip_at : end - 1;
			assert_int_equal(pread(fd, &c, 1, at), 1);
			c ^= 0x40;
			assert_int_equal(pwrite(fd, &c, 1, at), 1);
			close(fd);
		}
	}
	closedir(d);
	assert_true(n >= 1);
}

static void test_cache_corrupt(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("corrupt", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_CACHE;
	kl_compiled *c = run_chain(ctx);
	assert_non_null(c);
	kl__compiled_free(c); /* unmaps the .so before it is damaged below */

	struct {
		const char *prefix;
		off_t trunc;
		long flip;
		const char *expect;
	} cases[] = {
	        {"plan-", -1, 100, "corrupt (checksum mismatch): rebuilding"},
	        {"plan-", 20, -1, "corrupt (truncated header): rebuilding"},
	        {"plan-", -1, 3, "corrupt (bad magic): rebuilding"},
	        {"so-", 100, -1, "corrupt (size mismatch): rebuilding"},
	        {"so-", -1, 2000, "corrupt (checksum mismatch): rebuilding"},
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		corrupt_file(dir, cases[i].prefix, cases[i].trunc, cases[i].flip);
		long before = kl__jit_compiles();
		char *log = with_stderr(run_chain, ctx, &c);
		assert_non_null(c);
		if (!strstr(log, cases[i].expect))
			fprintf(stderr, "case %zu log:\n%s\n", i, log);
		assert_non_null(strstr(log, cases[i].expect));
		assert_false(c->from_cache);
		assert_int_equal(kl__jit_compiles(), before + 1);
		free(log);
		kl__compiled_free(c);
		/* rebuilt: the next one hits */
		c = run_chain(ctx);
		assert_true(c->from_cache);
		kl__compiled_free(c);
	}
	kl_ctx_free(ctx);
}

/* ---- plans that do not match their graph; files that are not files ------------ */

typedef void (*plan_edit)(kl_program *p);

/* Rewrite the plan entry under key with edit applied to its program, the
 * checksums fixed up (kl__cache_put writes a fresh header), so that only a
 * check of the plan against its graph can tell. */
static void forge_plan(kl_ctx *ctx, const char *dir, uint64_t key, plan_edit edit)
{
	char name[64], err[256] = "";
	snprintf(name, sizeof name, "plan-%016" PRIx64 ".klc", key);
	void *payload;
	size_t len;
	assert_int_equal(kl__cache_get(ctx, dir, name, key, &payload, &len), KL_OK);
	kl_program p;
	assert_int_equal(kl__program_deserialize((uint8_t *)payload + 16, len - 16, &p, err,
	                                         sizeof err),
	                 KL_OK);
	edit(&p);
	uint8_t *bytes, *out;
	size_t n;
	assert_int_equal(kl__program_serialize(&p, &bytes, &n), KL_OK);
	assert_non_null(out = malloc(n + 16));
	memcpy(out, payload, 16); /* the binary's digest and size */
	memcpy(out + 16, bytes, n);
	assert_int_equal(kl__cache_put(ctx, dir, name, key, out, n + 16), KL_OK);
	free(out);
	free(bytes);
	free(payload);
	kl__program_free(&p);
}

static kl_buf *buf_of(kl_program *p, kl_buf_role role)
{
	for (int32_t b = 0; b < p->nbufs; b++)
		if (p->bufs[b].role == role)
			return &p->bufs[b];
	fail_msg("no buffer of role %d", (int)role);
	return NULL;
}

static void edit_out_narrow(kl_program *p)
{
	buf_of(p, KL_BUF_OUTPUT)->shape[1].v = 1; /* [4, 5] -> [4, 1]: 16 of 80 bytes */
}

static void edit_out_huge(kl_program *p)
{
	kl_buf *b = buf_of(p, KL_BUF_OUTPUT);
	b->shape[0].v = (int64_t)1 << 20; /* 4 TiB if it were allocated */
	b->shape[1].v = (int64_t)1 << 20;
}

static void edit_out_dtype(kl_program *p)
{
	buf_of(p, KL_BUF_OUTPUT)->dtype = KL_F64;
}

static void edit_temp_huge(kl_program *p)
{
	buf_of(p, KL_BUF_TEMP)->shape[0].v = (int64_t)1 << 40;
}

static void edit_swap_kernels(kl_program *p)
{
	p->steps[0].kernel = 1; /* each step runs the other's kernel */
	p->steps[2].kernel = 0;
}

static void edit_step_node(kl_program *p)
{
	p->steps[0].nodes[0] = 1000;
}

static void test_cache_forged_plan(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("forged", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_CACHE;
	kl_compiled *c = run_chain(ctx);
	assert_non_null(c);
	uint64_t key = c->key;
	kl__compiled_free(c);
	struct {
		plan_edit edit;
		const char *expect;
	} cases[] = {
	        {edit_out_narrow, "output 0 is f32 [4,1] in the plan, f32 [4,5] in the graph"},
	        {edit_out_huge, "output 0 is f32 [1048576,1048576] in the plan"},
	        {edit_out_dtype, "output 0 is f64 [4,5] in the plan, f32 [4,5]"},
	        {edit_temp_huge, "no value of this graph holds more than 120"},
	        {edit_step_node, "step 0 names node 1000 of a 5-node graph"},
	        /* consistent with the graph, but not with the kernels */
	        {edit_swap_kernels, "its binary was built for another plan"},
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		forge_plan(ctx, dir, key, cases[i].edit);
		char *log = with_stderr(run_chain, ctx, &c); /* run_chain checks the result */
		assert_non_null(c);
		if (!strstr(log, cases[i].expect) || !strstr(log, "rejected"))
			fprintf(stderr, "case %zu log:\n%s\n", i, log);
		assert_non_null(strstr(log, "rejected"));
		assert_non_null(strstr(log, cases[i].expect));
		assert_false(c->from_cache); /* compiled fresh, and rewritten */
		free(log);
		kl__compiled_free(c);
		c = run_chain(ctx);
		assert_true(c->from_cache);
		kl__compiled_free(c);
	}
	kl_ctx_free(ctx);
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "test_runtime: timed out: an open() blocked on a FIFO\n";
	if (write(2, msg, sizeof msg - 1) < 0)
		_exit(3);
	_exit(3);
}

/* A FIFO planted at the plan's and at the binary's name: kl_compile neither
 * blocks in open() (the alarm turns a hang into a failure) nor trusts it. */
static void test_cache_fifo(void **state)
{
	(void)state;
	char dir[PATH_MAX], path[PATH_MAX];
	use_cache_dir("fifo", dir, sizeof dir);
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_CACHE;
	kl_compiled *c = run_chain(ctx);
	assert_non_null(c);
	kl__compiled_free(c);
	signal(SIGALRM, on_alarm);
	const char *prefixes[] = {"so-", "plan-"};
	const char *expect[] = {"corrupt (missing or not a regular file)",
	                        "unreadable (a FIFO, not a regular file)"};
	for (int i = 0; i < 2; i++) {
		DIR *d = opendir(dir);
		assert_non_null(d);
		struct dirent *e;
		int n = 0;
		while ((e = readdir(d)))
			if (!strncmp(e->d_name, prefixes[i], strlen(prefixes[i]))) {
				assert_true(snprintf(path, sizeof path, "%s/%s", dir, e->d_name) <
				            (int)sizeof path);
				assert_int_equal(unlink(path), 0);
				assert_int_equal(mkfifo(path, 0600), 0);
				n++;
			}
		closedir(d);
		assert_int_equal(n, 1);
		alarm(20);
		char *log = with_stderr(run_chain, ctx, &c);
		alarm(0);
		assert_non_null(c);
		assert_false(c->from_cache);
		if (!strstr(log, expect[i]))
			fprintf(stderr, "case %d log:\n%s\n", i, log);
		assert_non_null(strstr(log, expect[i]));
		free(log);
		kl__compiled_free(c);
	}
	signal(SIGALRM, SIG_DFL);
	kl_ctx_free(ctx);
}

static int count_entries(const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	assert_non_null(d);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
		    !strncmp(e->d_name, prefix, strlen(prefix)))
			n++;
	closedir(d);
	return n;
}

/* Compile and run the chain twice with the cache at dir: both right, built
 * fresh, the warning (containing want) once, the temp dir left empty. */
static void expect_uncached(kl_ctx *ctx, const char *dir, const char *tmpdir, const char *want)
{
	setenv("KILN_CACHE_DIR", dir, 1);
	for (int round = 0; round < 2; round++) {
		kl_compiled *c;
		char *log = with_stderr(run_chain, ctx, &c);
		if (!c)
			fail_msg("cache %s: kl__compile failed: %s", dir, kl_last_error(ctx));
		assert_false(c->from_cache);
		const char *w = strstr(log, "kiln: warning: the cache directory");
		if (round == 0 && (!w || !strstr(w, want) || strstr(w + 1, "kiln: warning")))
			fail_msg("cache %s: want one warning with '%s'; stderr:\n%s", dir, want, log);
		if (round == 1 && w)
			fail_msg("cache %s: warned a second time:\n%s", dir, log);
		assert_int_equal(count_entries(tmpdir, ""), 0); /* the build dir is gone */
		free(log);
		kl__compiled_free(c);
	}
}

/* A cache directory that cannot be written (read-only, not creatable, full)
 * costs the cache, not the compile: built in a private temp dir, run
 * uncached, one warning with the reason. */
static void test_cache_unwritable(void **state)
{
	(void)state;
	char dir[PATH_MAX], tmpdir[PATH_MAX], file[PATH_MAX + 16], under[PATH_MAX + 32];
	use_cache_dir("unwritable-tmp", tmpdir, sizeof tmpdir);
	use_cache_dir("unwritable", dir, sizeof dir);
	char *old_tmp = getenv("TMPDIR") ? strdup(getenv("TMPDIR")) : NULL;
	setenv("TMPDIR", tmpdir, 1);
	kl_ctx *ctx = new_ctx();
	/* ours, mode 0500, a directory, and unwritable even by root */
	expect_uncached(ctx, "/proc/self/fd", tmpdir, "not writable (cannot create a file: ");

	/* a read-only directory: chmod does not stop root (CAP_DAC_OVERRIDE),
	 * so only where a probe file cannot be made */
	assert_int_equal(chmod(dir, 0500), 0);
	snprintf(file, sizeof file, "%s/probe", dir);
	int fd = open(file, O_WRONLY | O_CREAT | O_EXCL, 0600);
	if (fd >= 0) {
		close(fd);
		unlink(file);
		fprintf(stderr, "(privileged: chmod 0500 does not stop writes; /proc/self/fd "
		                "stood in for the read-only directory)\n");
	} else
		expect_uncached(ctx, dir, tmpdir, "Permission denied");
	assert_int_equal(chmod(dir, 0700), 0);

	/* a cache path under a regular file cannot be created */
	snprintf(file, sizeof file, "%s/plain", dir);
	assert_true((fd = open(file, O_WRONLY | O_CREAT, 0600)) >= 0);
	close(fd);
	snprintf(under, sizeof under, "%s/kiln", file);
	expect_uncached(ctx, under, tmpdir, "(cannot create it: Not a directory)");
	unlink(file);

	/* a full disk: every write into the cache fails with ENOSPC */
	kl__cache_fail_writes = ENOSPC;
	expect_uncached(ctx, dir, tmpdir, "No space left on device");
	kl__cache_fail_writes = 0;
	assert_int_equal(count_entries(dir, ""), 0); /* no entry, no temp file */

	if (old_tmp)
		setenv("TMPDIR", old_tmp, 1);
	else
		unsetenv("TMPDIR");
	free(old_tmp);
	kl_ctx_free(ctx);
}

static void test_cache_race(void **state)
{
	(void)state;
	char dir[PATH_MAX];
	use_cache_dir("race", dir, sizeof dir);
	int gate[2];
	assert_int_equal(pipe(gate), 0);
	pid_t pids[2];
	for (int i = 0; i < 2; i++) {
		posix_spawn_file_actions_t fa;
		posix_spawn_file_actions_init(&fa);
		posix_spawn_file_actions_adddup2(&fa, gate[0], 0);
		posix_spawn_file_actions_addclose(&fa, gate[1]);
		char *argv[] = {(char *)self_exe, "--race-child", dir, NULL};
		assert_int_equal(posix_spawn(&pids[i], self_exe, &fa, NULL, argv, environ), 0);
		posix_spawn_file_actions_destroy(&fa);
	}
	close(gate[0]);
	close(gate[1]); /* both start now */
	for (int i = 0; i < 2; i++) {
		int status;
		while (waitpid(pids[i], &status, 0) < 0 && errno == EINTR)
			;
		assert_true(WIFEXITED(status));
		assert_int_equal(WEXITSTATUS(status), 0);
	}
	/* what they left is a whole, valid entry */
	kl_ctx *ctx = new_ctx();
	long before = kl__jit_compiles();
	kl_compiled *c = run_chain(ctx);
	assert_true(c->from_cache);
	assert_int_equal(kl__jit_compiles(), before);
	kl__compiled_free(c);
	kl_ctx_free(ctx);
}

/* ---- weights kept packed across calls (CPU products, matmul_step.c) ------------- */

typedef struct pk_user {
	kl_tensor *w, *b; /* captured: read from memory at every call */
} pk_user;

/* gelu(x W^T + b) with W and b the inputs (nin 3) or captured (nin 1) */
static kl_status body_packed(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nout;
	pk_user *u = user;
	kl_tensor *w = nin == 3 ? in[1] : u->w, *b = nin == 3 ? in[2] : u->b;
	out[0] = kl_gelu(kl_linear(in[0], w, b));
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* got against gelu(x W^T + b) in double */
static void pk_check(const char *what, kl_tensor *x, kl_tensor *w, kl_tensor *b, kl_tensor *got)
{
	int64_t m = kl_shape(x)[0], k = kl_shape(x)[1], n = kl_shape(w)[0];
	double *xv = kltest_read(x), *wv = kltest_read(w), *bv = kltest_read(b),
	       *gv = kltest_read(got), *ref = malloc(sizeof *ref * (size_t)(m * n));
	assert_non_null(ref);
	for (int64_t i = 0; i < m; i++)
		for (int64_t j = 0; j < n; j++) {
			double t = bv[j];
			for (int64_t p = 0; p < k; p++)
				t += xv[i * k + p] * wv[j * k + p];
			ref[i * n + j] = 0.5 * t * erfc(-t / sqrt(2.0));
		}
	kl_dtype dt = kl_tensor_dtype(got);
	assert_true(kltest_compare(what, dt, 2, (int64_t[]){m, n}, gv, ref,
	                           dt == KL_F32 ? 4.0 : 2.0));
	free(xv);
	free(wv);
	free(bv);
	free(gv);
	free(ref);
}

static bool pk_explained(kl_fn *f)
{
	char *text = NULL;
	size_t len = 0;
	FILE *mf = open_memstream(&text, &len);
	assert_non_null(mf);
	assert_int_equal(kl_explain(f, mf), KL_OK);
	fclose(mf);
	bool kept = strstr(text, "weights kept packed across calls") != NULL;
	free(text);
	return kept;
}

/* A compiled Linear keeps its weight packed from call to call and packs it
 * again whenever the weight's memory changed: a write in place (kl_copy,
 * its version moves), another tensor in the same input, a tensor freed and
 * a new one made (perhaps at the same address). Each call is compared with
 * the product in double; f16 and bf16 run through their f32 copies (the
 * weight not widened again while its packing holds). */
static void test_packed_weights(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	const kl_dtype dts[] = {KL_F32, KL_F16, KL_BF16};
	__builtin_cpu_init();
	bool packs = __builtin_cpu_supports("x86-64-v3"); /* gemm_mid runs: AVX2 or AVX-512 */
	for (int di = 0; di < 3; di++) {
		kl_dtype dt = dts[di];
		int64_t m = 24, k = 96, n = 160;
		uint64_t sd = 40 + 10 * (uint64_t)di;
		kl_tensor *x = kltest_rand(ctx, dt, 2, (int64_t[]){m, k}, KLTEST_NORMAL,
		                           KLTEST_CONTIG, sd);
		kl_tensor *w1 = kltest_rand(ctx, dt, 2, (int64_t[]){n, k}, KLTEST_NORMAL,
		                            KLTEST_CONTIG, sd + 1);
		kl_tensor *w2 = kltest_rand(ctx, dt, 2, (int64_t[]){n, k}, KLTEST_NORMAL,
		                            KLTEST_CONTIG, sd + 2);
		kl_tensor *b = kltest_rand(ctx, dt, 1, (int64_t[]){n}, KLTEST_NORMAL, KLTEST_CONTIG,
		                           sd + 3);
		kl_tensor *out[1];
		/* the weight an input: w1 three times (packed at the second
		 * call), w2 twice, w1 twice */
		kl_fn *f = kl_compile(ctx, body_packed, NULL, 3, 1,
		                      &(kl_compile_opts){.fullgraph = true});
		kl_tensor *seq[7] = {w1, w1, w1, w2, w2, w1, w1};
		for (int c = 0; c < 7; c++) {
			kl_tensor *in[3] = {x, seq[c], b};
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			pk_check("input weight", x, seq[c], b, out[0]);
			kl_release(out[0]);
		}
		if (packs)
			assert_true(pk_explained(f));
		/* w1 written in place between calls (twice: packed again) */
		assert_int_equal(kl_copy(w1, w2), KL_OK);
		kl_tensor *in[3] = {x, w1, b};
		for (int c = 0; c < 2; c++) {
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			pk_check("weight written in place", x, w1, b, out[0]);
			kl_release(out[0]);
		}
		/* a new weight, made after the old one was freed */
		kl_release(w1);
		w1 = kltest_rand(ctx, dt, 2, (int64_t[]){n, k}, KLTEST_NORMAL, KLTEST_CONTIG,
		                 sd + 4);
		in[1] = w1;
		for (int c = 0; c < 2; c++) {
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			pk_check("a new weight", x, w1, b, out[0]);
			kl_release(out[0]);
		}
		/* written in place after every call (as a training step's
		 * optimizer does): never packed for one use, always right */
		for (int c = 0; c < 3; c++) {
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			pk_check("weight rewritten every call", x, w1, b, out[0]);
			kl_release(out[0]);
			kl_tensor *t = kl_mul_scalar(w1, -0.75);
			assert_int_equal(kl_copy(w1, t), KL_OK);
			kl_release(t);
		}
		kl_fn_free(f);

		/* the weight's rows symbolic: views of one storage at the same
		 * offset and version, other row counts from call to call (each
		 * twice: packed at the second) */
		f = kl_compile(ctx, body_packed, NULL, 3, 1,
		               &(kl_compile_opts){.fullgraph = true,
		                                  .ndynamic_dims = 3,
		                                  .dynamic_dims = (uint32_t[]){0, 1u, 1u}});
		const int64_t rows[] = {96, 160, 128, 160};
		for (int c = 0; c < 8; c++) {
			int64_t r = rows[c / 2];
			kl_tensor *wv = kl_slice(w1, 0, 0, r, 1), *bv = kl_slice(b, 0, 0, r, 1);
			kl_tensor *vin[3] = {x, wv, bv};
			assert_int_equal(kl_fn_call(f, vin, out), KL_OK);
			pk_check("views of one weight, rows symbolic", x, wv, bv, out[0]);
			kl_release(out[0]);
			kl_release(wv);
			kl_release(bv);
		}
		kl_fn_stats fs;
		assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
		assert_int_equal(fs.compiles, 1);
		kl_fn_free(f);

		/* the weight captured: a write in place fails the guard, the
		 * plan is bound again and packs the new values */
		pk_user u = {w2, b};
		f = kl_compile(ctx, body_packed, &u, 1, 1, &(kl_compile_opts){.fullgraph = true});
		for (int c = 0; c < 2; c++) {
			assert_int_equal(kl_fn_call(f, &x, out), KL_OK);
			pk_check("captured weight", x, w2, b, out[0]);
			kl_release(out[0]);
		}
		assert_int_equal(kl_copy(w2, w1), KL_OK);
		for (int c = 0; c < 2; c++) {
			assert_int_equal(kl_fn_call(f, &x, out), KL_OK);
			pk_check("captured weight written in place", x, w2, b, out[0]);
			kl_release(out[0]);
		}
		kl_fn_free(f);
		kl_release(x);
		kl_release(w1);
		kl_release(w2);
		kl_release(b);
	}
	kl_ctx_free(ctx);
}

int main(int argc, char **argv)
{
	if (argc >= 3 && !strcmp(argv[1], "--warm-child"))
		return child_warm(argv[2]);
	if (argc >= 3 && !strcmp(argv[1], "--race-child"))
		return child_race(argv[2]);
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_kernels_and_strides),
	        cmocka_unit_test(test_chain_with_temps),
	        cmocka_unit_test(test_compile_error),
	        cmocka_unit_test(test_jit_sanitize),
	        cmocka_unit_test(test_matmul_dtypes_layouts),
	        cmocka_unit_test(test_view_outputs),
	        cmocka_unit_test(test_symbolic_program),
	        cmocka_unit_test(test_memplan_reuse),
	        cmocka_unit_test(test_memplan_random),
	        cmocka_unit_test(test_memplan_lent),
	        cmocka_unit_test(test_memplan_inplace),
	        cmocka_unit_test(test_step_order),
	        cmocka_unit_test(test_program_bytes),
	        cmocka_unit_test(test_cache_warm_process),
	        cmocka_unit_test(test_cache_corrupt),
	        cmocka_unit_test(test_cache_race),
	        cmocka_unit_test(test_cache_forged_plan),
	        cmocka_unit_test(test_cache_fifo),
	        cmocka_unit_test(test_cache_unwritable),
	        cmocka_unit_test(test_packed_weights),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
