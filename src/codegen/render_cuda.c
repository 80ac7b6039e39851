/* render_cuda.c - the CUDA C renderer: kernels for NVRTC (with kiln_prelude.cuh),
 * the same expression spellings and helpers as the C renderer (so the math,
 * NaN rules, casts and Philox agree bit for bit), its own loop walker.
 *
 * Launch contract with the runtime: every kernel takes one by-value
 * `kl_args` (all buffer pointers of the program, then the symbol values) and
 * runs with 256 threads per block on any grid: pointwise kernels are
 * grid-stride loops over the flattened iteration space; reductions give
 * each outer point ("row") a group of G threads (a warp for short rows, the
 * block otherwise) that reduce through warp shuffles and shared memory.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/helpers.h"
#include "codegen/render.h"

#define BLOCK 256

static const char prelude[] =
        "#include \"kiln_prelude.cuh\"\n"
        "typedef long long int64_t;\n"
        "typedef unsigned long long uint64_t;\n"
        "typedef int int32_t;\n"
        "typedef unsigned int uint32_t;\n"
        "typedef unsigned short uint16_t;\n"
        "typedef unsigned char uint8_t;\n"
        "#define INT32_MIN (-2147483647 - 1)\n"
        "#define INT32_MAX 2147483647\n"
        "#define INT64_MIN (-9223372036854775807LL - 1)\n"
        "#define INT64_MAX 9223372036854775807LL\n"
        "#define INT64_C(x) x##LL\n"
        "#define UINT64_C(x) x##ULL\n"
        "#define NAN __int_as_float(0x7fffffff)\n"
        "#define INFINITY __int_as_float(0x7f800000)\n"
        "#define KL_FN static __device__ __forceinline__\n"
        "\n" KL_RENDER_HELPERS
        /* the C renderer's vectorizable stand-ins for libm: CUDA's own are fast */
        "KL_FN float kl_expf(float x) { return expf(x); }\n"
        "KL_FN float kl_tanhf(float x) { return tanhf(x); }\n"
        "/* a double to a 16-bit float in one rounding (f32 in between would round twice) */\n"
        "KL_FN uint16_t kl_d2h(double d) { uint16_t h; asm(\"cvt.rn.f16.f64 %0, %1;\" : \"=h\"(h) : \"d\"(d)); return h; }\n"
        "KL_FN uint16_t kl_d2bf(double d) { uint16_t h; asm(\"cvt.rn.bf16.f64 %0, %1;\" : \"=h\"(h) : \"d\"(d)); return h; }\n"
        "/* group reductions: G threads (a warp, or the block of 256) end with the\n"
        " * same value in every thread; sh: 8 words of shared memory */\n"
        "struct kl_add_op { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };\n"
        "struct kl_max_op { template <class T> __device__ T operator()(T a, T b) const { return b > a ? b : a; } };\n"
        "struct kl_min_op { template <class T> __device__ T operator()(T a, T b) const { return b < a ? b : a; } };\n"
        "struct kl_or_op { template <class T> __device__ T operator()(T a, T b) const { return a | b; } };\n"
        "template <int G, class T, class F>\n"
        "__device__ __forceinline__ T kl_gred(T v, F f, unsigned long long *sh)\n"
        "{\n"
        "\tfor (int o = 16; o > 0; o >>= 1)\n"
        "\t\tv = f(v, __shfl_xor_sync(0xffffffffu, v, o));\n"
        "\tif (G > 32) {\n"
        "\t\t__syncthreads();\n"
        "\t\tif ((threadIdx.x & 31) == 0)\n"
        "\t\t\t((T *)sh)[threadIdx.x >> 5] = v;\n"
        "\t\t__syncthreads();\n"
        "\t\tv = ((T *)sh)[0];\n"
        "\t\tfor (int i = 1; i < G / 32; i++)\n"
        "\t\t\tv = f(v, ((T *)sh)[i]);\n"
        "\t}\n"
        "\treturn v;\n"
        "}\n"
        "/* argmax: the first maximum, the first NaN winning over everything */\n"
        "template <class T> __device__ __forceinline__ bool kl_arg_take(T v, long long i, T o, long long oi)\n"
        "{\n"
        "\tbool vn = v != v, on = o != o;\n"
        "\treturn vn ? (on && oi < i) : (on || o > v || (o == v && oi < i));\n"
        "}\n"
        "template <int G, class T>\n"
        "__device__ __forceinline__ void kl_gargmax(T &v, long long &ix, unsigned long long *sh,\n"
        "                                           long long *shi)\n"
        "{\n"
        "\tfor (int o = 16; o > 0; o >>= 1) {\n"
        "\t\tT ov = __shfl_xor_sync(0xffffffffu, v, o);\n"
        "\t\tlong long oi = __shfl_xor_sync(0xffffffffu, ix, o);\n"
        "\t\tif (kl_arg_take(v, ix, ov, oi)) { v = ov; ix = oi; }\n"
        "\t}\n"
        "\tif (G > 32) {\n"
        "\t\t__syncthreads();\n"
        "\t\tif ((threadIdx.x & 31) == 0) {\n"
        "\t\t\t((T *)sh)[threadIdx.x >> 5] = v;\n"
        "\t\t\tshi[threadIdx.x >> 5] = ix;\n"
        "\t\t}\n"
        "\t\t__syncthreads();\n"
        "\t\tv = ((T *)sh)[0];\n"
        "\t\tix = shi[0];\n"
        "\t\tfor (int i = 1; i < G / 32; i++)\n"
        "\t\t\tif (kl_arg_take(v, ix, ((T *)sh)[i], shi[i])) { v = ((T *)sh)[i]; ix = shi[i]; }\n"
        "\t}\n"
        "}\n"
        "\n";

/* ---- expressions: the C renderer's spellings ------------------------------------- */

static void cu_constant(kl_sb *sb, kl_dtype dt, double k)
{
	kl__render_c.constant(sb, dt, k);
}

static void cu_cast(kl_sb *sb, kl_dtype to, kl_dtype from, const char *a)
{
	if (from == KL_F64 && (to == KL_F16 || to == KL_BF16)) {
		kl__sb_printf(sb, to == KL_F16 ? "kl_h2f(kl_d2h(%s))" : "kl_bf2f(kl_d2bf(%s))", a);
		return;
	}
	kl__render_c.cast(sb, to, from, a);
}

static void cu_unary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a)
{
	kl__render_c.unary(sb, op, dt, a);
}

static void cu_binary(kl_sb *sb, kl_op op, kl_dtype dt, const char *a, const char *b)
{
	kl__render_c.binary(sb, op, dt, a, b);
}

static void cu_rand(kl_sb *sb, kl_op op, uint64_t seed, const char *index)
{
	kl__render_c.rand(sb, op, seed, index);
}

static int cu_acc_vars(kl_op op, kl_dtype in, kl_accvar *vars)
{
	return kl__render_c.acc_vars(op, in, vars);
}

static void cu_acc_update(kl_sb *sb, kl_op op, kl_dtype in, const char *acc, const char *ix,
                          const char *v, const char *pos)
{
	kl__render_c.acc_update(sb, op, in, acc, ix, v, pos);
}

static void cu_acc_read(kl_sb *sb, kl_op op, kl_dtype in, kl_dtype dt, const char *acc,
                        const char *ix)
{
	kl__render_c.acc_read(sb, op, in, dt, acc, ix);
}

static bool cu_acc_clause(kl_sb *sb, kl_op op, kl_dtype in, const char *acc)
{
	(void)sb;
	(void)op;
	(void)in;
	(void)acc;
	return false;
}

/* ---- the walker ---------------------------------------------------------------------- */

typedef struct cctx {
	const kl_renderer *r;
	const kir_kernel *k;
	kl_sb *sb;
	uint8_t *live;
	int depth;
	int G;  /* threads per row (reductions) */
	int nj; /* row-cache slots per thread (0: no row cache) */
} cctx;

static void ind(cctx *c)
{
	for (int i = 0; i < c->depth; i++)
		kl__sb_puts(c->sb, "\t");
}

static bool unit(const kir_kernel *k, int d)
{
	return k->dims[d].sym == 0 && k->dims[d].v == 1;
}

static void emit_block(cctx *c, int blk)
{
	const kir_kernel *k = c->k;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->blk != blk || !c->live[i])
			continue;
		if (in->opc == KIR_LSTORE) {
			ind(c);
			kl__sb_printf(c->sb, "lc%d[j] = t%d;\n", (int)in->acc, (int)in->a);
		} else if (in->opc == KIR_LLOAD) {
			ind(c);
			kl__sb_printf(c->sb, "%s t%d = lc%d[j];\n", c->r->ctype[in->dt], (int)i,
			              (int)in->acc);
		} else {
			kl__render_ins(c->r, k, i, c->depth, c->sb);
		}
	}
}

/* Sets the loop variables of the dims in mask from the flat index q (the
 * innermost dim fastest); unit dims are 0. */
static void decompose(cctx *c, uint32_t mask, const char *q)
{
	const kir_kernel *k = c->k;
	int first = -1;
	for (int d = 0; d < k->ndim && first < 0; d++)
		if ((mask & (1u << d)) && !unit(k, d))
			first = d;
	ind(c);
	kl__sb_printf(c->sb, "int64_t q = %s;\n", q);
	for (int d = k->ndim - 1; d >= 0; d--) {
		if (!(mask & (1u << d)))
			continue;
		ind(c);
		if (unit(k, d)) {
			kl__sb_printf(c->sb, "const int64_t i%d = 0;\n", d);
			continue;
		}
		if (d == first) {
			kl__sb_printf(c->sb, "const int64_t i%d = q;\n", d);
			continue;
		}
		kl__sb_printf(c->sb, "const int64_t i%d = q %% (", d);
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
		ind(c);
		kl__sb_puts(c->sb, "q /= (");
		kl__render_dim(c->r, k, d, c->sb);
		kl__sb_puts(c->sb, ");\n");
	}
	ind(c);
	kl__sb_puts(c->sb, "(void)q;\n");
}

static void render_pointwise(cctx *c)
{
	const kir_kernel *k = c->k;
	uint32_t all = k->ndim ? (uint32_t)((1ull << k->ndim) - 1) : 0;
	kl_sb n = {0};
	double v;
	kl__render_extent(c->r, k, all, &n, &v);
	ind(c);
	kl__sb_printf(c->sb, "const int64_t n = %s;\n", kl__sb_str(&n));
	kl__sb_free(&n);
	ind(c);
	kl__sb_printf(c->sb,
	              "for (int64_t L = (int64_t)blockIdx.x * %d + threadIdx.x; L < n; "
	              "L += (int64_t)gridDim.x * %d)\n",
	              BLOCK, BLOCK);
	ind(c);
	kl__sb_puts(c->sb, "{\n");
	c->depth++;
	decompose(c, all, "L");
	emit_block(c, 0);
	while (c->depth > 1) {
		c->depth--;
		ind(c);
		kl__sb_puts(c->sb, "}\n");
	}
}

/* the group reduction of every accumulator pass p updates */
static void combine(cctx *c, int p)
{
	const kir_kernel *k = c->k;
	uint8_t *done = calloc((size_t)k->nacc + 1, 1);
	if (!done) {
		c->sb->oom = true;
		return;
	}
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc != KIR_ACC || in->blk != 2 * p - 1 || !c->live[i] || done[in->acc])
			continue;
		done[in->acc] = 1;
		kl_accvar v[2];
		kl_op op = (kl_op)in->op;
		int nv = c->r->acc_vars(op, (kl_dtype)in->in_dt, v);
		ind(c);
		if (op == KL_OP_ARGMAX) {
			kl__sb_printf(c->sb,
			              "{ long long ai_ = acc%di; kl_gargmax<%d>(acc%d, ai_, kl_sh, "
			              "kl_shi); acc%di = ai_; }\n",
			              (int)in->acc, c->G, (int)in->acc, (int)in->acc);
			continue;
		}
		const char *f = op == KL_OP_SUM   ? "kl_add_op"
		                : op == KL_OP_MAX ? "kl_max_op"
		                                  : "kl_min_op";
		kl__sb_printf(c->sb, "acc%d = kl_gred<%d>(acc%d, %s(), kl_sh);\n", (int)in->acc,
		              c->G, (int)in->acc, f);
		if (nv > 1) {
			ind(c);
			kl__sb_printf(c->sb, "acc%d%s = kl_gred<%d>(acc%d%s, kl_or_op(), kl_sh);\n",
			              (int)in->acc, v[1].suffix, c->G, (int)in->acc, v[1].suffix);
		}
	}
	free(done);
}

static void render_rows(cctx *c)
{
	const kir_kernel *k = c->k;
	uint32_t outer = 0, inner = 0;
	for (int d = 0; d < k->ndim; d++) {
		if (k->rmask & (1u << d))
			inner |= 1u << d;
		else
			outer |= 1u << d;
	}
	kl_sb rows = {0}, rn = {0};
	double nrows, vr;
	kl__render_extent(c->r, k, outer, &rows, &nrows);
	bool rstat = kl__render_extent(c->r, k, inner, &rn, &vr);
	c->G = rstat && vr <= 64 ? 32 : BLOCK;
	c->nj = k->nlocal ? (int)((k->row_n + c->G - 1) / c->G) : 0;
	int per = BLOCK / c->G;
	ind(c);
	kl__sb_printf(c->sb, "__shared__ unsigned long long kl_sh[%d];\n", BLOCK / 32);
	ind(c);
	kl__sb_printf(c->sb, "__shared__ long long kl_shi[%d];\n", BLOCK / 32);
	ind(c);
	kl__sb_puts(c->sb, "(void)kl_sh;\n");
	ind(c);
	kl__sb_puts(c->sb, "(void)kl_shi;\n");
	ind(c);
	kl__sb_printf(c->sb, "const int64_t nrows = %s, rn = %s;\n", kl__sb_str(&rows),
	              kl__sb_str(&rn));
	ind(c);
	kl__sb_printf(c->sb, "const int lane = threadIdx.x %% %d;\n", c->G);
	/* every thread of a group runs the same number of iterations: the
	 * shuffles and barriers inside see full groups */
	ind(c);
	kl__sb_printf(c->sb,
	              "for (int64_t row = (int64_t)blockIdx.x * %d + threadIdx.x / %d; "
	              "row < nrows; row += (int64_t)gridDim.x * %d)\n",
	              per, c->G, per);
	ind(c);
	kl__sb_puts(c->sb, "{\n");
	c->depth++;
	decompose(c, outer, "row");
	for (int d = 0; d < k->ndim; d++)
		if (inner & (1u << d)) {
			ind(c);
			kl__sb_printf(c->sb, "int64_t i%d = 0;\n", d);
		}
	for (int i = 0; i < k->nlocal; i++) {
		ind(c);
		kl__sb_printf(c->sb, "%s lc%d[%d];\n", c->r->ctype[k->local_dt[i]], i, c->nj);
	}
	emit_block(c, 0);
	for (int p = 1; p <= k->npass; p++) {
		ind(c);
		if (c->nj) {
			kl__sb_puts(c->sb, "#pragma unroll\n");
			ind(c);
			kl__sb_printf(c->sb, "for (int j = 0; j < %d; j++)\n", c->nj);
			ind(c);
			kl__sb_puts(c->sb, "{\n");
			c->depth++;
			ind(c);
			kl__sb_printf(c->sb, "const int64_t r = lane + (int64_t)j * %d;\n", c->G);
			ind(c);
			kl__sb_puts(c->sb, "if (r >= rn)\n");
			ind(c);
			kl__sb_puts(c->sb, "\tbreak;\n");
		} else {
			kl__sb_printf(c->sb, "for (int64_t r = lane; r < rn; r += %d)\n", c->G);
			ind(c);
			kl__sb_puts(c->sb, "{\n");
			c->depth++;
		}
		/* the reduced dims from the flat position in the row */
		ind(c);
		kl__sb_puts(c->sb, "int64_t q = r;\n");
		int first = -1;
		for (int d = 0; d < k->ndim && first < 0; d++)
			if ((inner & (1u << d)) && !unit(k, d))
				first = d;
		for (int d = k->ndim - 1; d >= 0; d--) {
			if (!(inner & (1u << d)) || unit(k, d))
				continue;
			ind(c);
			if (d == first) {
				kl__sb_printf(c->sb, "i%d = q;\n", d);
				continue;
			}
			kl__sb_printf(c->sb, "i%d = q %% (", d);
			kl__render_dim(c->r, k, d, c->sb);
			kl__sb_puts(c->sb, ");\n");
			ind(c);
			kl__sb_puts(c->sb, "q /= (");
			kl__render_dim(c->r, k, d, c->sb);
			kl__sb_puts(c->sb, ");\n");
		}
		ind(c);
		kl__sb_puts(c->sb, "(void)q;\n");
		emit_block(c, 2 * p - 1);
		c->depth--;
		ind(c);
		kl__sb_puts(c->sb, "}\n");
		combine(c, p);
		emit_block(c, 2 * p);
	}
	c->depth--;
	ind(c);
	kl__sb_puts(c->sb, "}\n");
	kl__sb_free(&rows);
	kl__sb_free(&rn);
}

static void cu_walk(const kl_renderer *r, const kir_kernel *k, const char *name, kl_sb *sb)
{
	cctx c = {.r = r, .k = k, .sb = sb, .depth = 1};
	if (!(c.live = kl__render_live(k))) {
		sb->oom = true;
		return;
	}
	kl__sb_printf(sb, r->kernel_fmt, name);
	kl__sb_puts(sb, "\n{\n");
	bool empty = false;
	for (int d = 0; d < k->ndim; d++)
		empty |= k->dims[d].sym == 0 && k->dims[d].v == 0 && !(k->rmask & (1u << d));
	if (!empty) {
		kl__render_buf_decls(r, k, c.live, sb);
		if (k->rmask == 0)
			render_pointwise(&c);
		else
			render_rows(&c);
	}
	kl__sb_puts(sb, "}\n\n");
	free(c.live);
}

const kl_renderer kl__render_cuda = {
        .name = "cuda",
        .prelude = prelude,
        .ctype = {[KL_F32] = "float",
                  [KL_F64] = "double",
                  [KL_F16] = "float",
                  [KL_BF16] = "float",
                  [KL_I32] = "int32_t",
                  [KL_I64] = "int64_t",
                  [KL_BOOL] = "int"},
        .mtype = {[KL_F32] = "float",
                  [KL_F64] = "double",
                  [KL_F16] = "uint16_t",
                  [KL_BF16] = "uint16_t",
                  [KL_I32] = "int32_t",
                  [KL_I64] = "int64_t",
                  [KL_BOOL] = "uint8_t"},
        .load_fmt = {[KL_F32] = "%s",
                     [KL_F64] = "%s",
                     [KL_F16] = "kl_h2f(%s)",
                     [KL_BF16] = "kl_bf2f(%s)",
                     [KL_I32] = "%s",
                     [KL_I64] = "%s",
                     [KL_BOOL] = "(%s != 0)"},
        .store_fmt = {[KL_F32] = "%s",
                      [KL_F64] = "%s",
                      [KL_F16] = "kl_f2h(%s)",
                      [KL_BF16] = "kl_f2bf(%s)",
                      [KL_I32] = "%s",
                      [KL_I64] = "%s",
                      [KL_BOOL] = "(uint8_t)(%s != 0)"},
        .kernel_fmt = "extern \"C\" __global__ void __launch_bounds__(256) %s(const kl_args A)",
        .buf_decl_fmt = "\t%s%s *__restrict__ b%d = (%s%s *)A.b[%d];\n",
        .index_t = "int64_t",
        .par_for_fmt = "",
        .par_for_simd_fmt = "",
        .simd_fmt = "",
        .if_fmt = "",
        .sym_fmt = "A.s[%d]",
        .par_threshold = 0,
        .constant = cu_constant,
        .cast = cu_cast,
        .unary = cu_unary,
        .binary = cu_binary,
        .rand = cu_rand,
        .acc_vars = cu_acc_vars,
        .acc_update = cu_acc_update,
        .acc_read = cu_acc_read,
        .acc_clause = cu_acc_clause,
        .walk = cu_walk,
};
