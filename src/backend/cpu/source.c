/* source.c - CPU eager kernels for the ops that make values from nothing:
 * full, arange, rand and randn. Element i of rand/randn is a function of
 * (seed, i) only, so the fill splits over threads freely.
 */

#include "backend/cpu/cpu.h"

/* elements [lo, hi) of a source into out */
typedef struct fill_job {
	const kl_node *n;
	uint64_t seed; /* rand/randn: the key (the attribute or the key inputs) */
	char *out;
} fill_job;

static void fill(const kl_node *n, uint64_t seed, char *out, int64_t lo, int64_t hi);

static void fill_chunk(void *arg, int64_t lo, int64_t hi)
{
	const fill_job *j = arg;
	fill(j->n, j->seed, j->out, lo, hi);
}

static void fill(const kl_node *n, uint64_t seed, char *out, int64_t lo, int64_t hi)
{
	kl_dtype dt = (kl_dtype)n->dtype;
	switch ((kl_op)n->op) {
	case KL_OP_FULL: {
		/* one value, rounded once, copied bytewise */
		char v[8];
		size_t es = kl_dtype_size(dt);
		kl__store(v, dt, 0, n->a.s[0]);
		if (dt == KL_F32) {
			float f;
			memcpy(&f, v, 4);
			float *o = (float *)(void *)out;
			KL_SIMD
			for (int64_t i = lo; i < hi; i++)
				o[i] = f;
		} else if (es == 1) {
			memset(out + lo, v[0], (size_t)(hi - lo));
		} else {
			for (int64_t i = lo; i < hi; i++)
				memcpy(out + i * (int64_t)es, v, es);
		}
		break;
	}
	case KL_OP_ARANGE: {
		double s0 = n->a.s[0], s1 = n->a.s[1];
		if (dt == KL_F32) {
			float *o = (float *)(void *)out;
			KL_SIMD
			for (int64_t i = lo; i < hi; i++)
				o[i] = (float)(s0 + (double)i * s1);
		} else if (dt == KL_F64) {
			double *o = (double *)(void *)out;
			KL_SIMD
			for (int64_t i = lo; i < hi; i++)
				o[i] = s0 + (double)i * s1;
		} else {
			for (int64_t i = lo; i < hi; i++)
				kl__store(out, dt, i, s0 + (double)i * s1);
		}
		break;
	}
	case KL_OP_RAND: {
		/* kl__rand_uniform_as keeps [0, 1) in the 16-bit floats too */
		if (dt == KL_F32) {
			float *o = (float *)(void *)out;
			for (int64_t i = lo; i < hi; i++)
				o[i] = (float)kl__rand_uniform_as(dt, seed, (uint64_t)i);
		} else {
			for (int64_t i = lo; i < hi; i++)
				kl__store(out, dt, i, kl__rand_uniform_as(dt, seed, (uint64_t)i));
		}
		break;
	}
	case KL_OP_RANDN:
		if (dt == KL_F32) {
			float *o = (float *)(void *)out;
			for (int64_t i = lo; i < hi; i++)
				o[i] = (float)kl__rand_normal(seed, (uint64_t)i);
		} else {
			for (int64_t i = lo; i < hi; i++)
				kl__store(out, dt, i, kl__rand_normal(seed, (uint64_t)i));
		}
		break;
	default:
		break;
	}
}

kl_status kl__cpu_source(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	if (n->op != KL_OP_FULL && n->op != KL_OP_ARANGE && n->op != KL_OP_RAND &&
	    n->op != KL_OP_RANDN)
		return kl__err(ctx, KL_EINVAL, "kl_%s: not a source the cpu backend runs",
		               kl__cpu_opname(n));
	if (n->dtype >= KL_NDTYPES)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: unknown dtype %d", kl__cpu_opname(n),
		               (int)n->dtype);
	int64_t total = kl__numel(n->ndim, n->shape);
	char *o = kl__tensor_data(out);
	uint64_t seed = n->a.seed;
	if (n->nin == 2) { /* rand/randn keyed at run time: two 0-dim i32 words */
		if (in[0]->dtype != KL_I32 || in[1]->dtype != KL_I32 || in[0]->ndim || in[1]->ndim)
			return kl__err(ctx, KL_EINVAL, "kl_%s: the key must be two 0-dim i32 words",
			               kl__cpu_opname(n));
		int32_t lo, hi;
		memcpy(&lo, kl__tensor_data(in[0]), 4);
		memcpy(&hi, kl__tensor_data(in[1]), 4);
		seed = kl__rand_key(lo, hi);
	}
	int nt = kl__cpu_threads(ctx);
	/* rand/randn cost a Philox round per element: parallel pays earlier */
	int64_t par = (n->op == KL_OP_RAND || n->op == KL_OP_RANDN) ? 4096 : KL_CPU_PAR_MIN;
	if (nt > 1 && total >= par) {
		fill_job j = {n, seed, o};
		kl__par_for(nt, total, fill_chunk, &j);
	} else {
		fill(n, seed, o, 0, total);
	}
	return KL_OK;
}
