/* optim_cpu.c - the fused optimizer step on the CPU: every parameter of a
 * launch (kl_optim_launch, built by api/optim.c) in one parallel loop over
 * fixed-size chunks of all of them, so that a model of many small tensors
 * keeps every thread busy. Each chunk's update is a simd loop in f32 (f64
 * for f64 parameters); f16/bf16 chunks are widened into local f32 arrays,
 * updated and rounded back once, as torch's fused kernels do (opmath).
 */
#include <stdlib.h>

#include "backend/cpu/cpu.h"

#define OPT_CHUNK 2048

/* What one parameter's update needs besides its arrays, from its step. */
typedef struct opt_coef {
	double decay;     /* AdamW: 1 - lr * weight_decay */
	double step_size; /* AdamW: lr / (1 - beta1^step); SGD: lr */
	double bc2_sqrt;  /* AdamW: sqrt(1 - beta2^step) */
	bool first;       /* SGD: the momentum buffer starts as the gradient */
} opt_coef;

/* torch.optim.SGD's update of n elements in type R. */
#define DEFINE_SGD(NAME, R)                                                                \
	static void NAME(const kl_optim_launch *l, const opt_coef *c, R *p, const R *g, R *m,  \
	                 int64_t n)                                                             \
	{                                                                                      \
		const R wd = (R)l->weight_decay, mom = (R)l->momentum;                         \
		const R damp = (R)(1.0 - l->dampening), lr = (R)c->step_size;                   \
		const bool first = c->first, nest = l->nesterov, use_m = l->momentum != 0;     \
		KL_SIMD                                                                        \
		for (int64_t i = 0; i < n; i++) {                                              \
			R d = wd != 0 ? g[i] + wd * p[i] : g[i];                               \
			if (use_m) {                                                           \
				R b = first ? d : m[i] * mom + damp * d;                       \
				m[i] = b;                                                      \
				d = nest ? d + mom * b : b;                                    \
			}                                                                      \
			p[i] = p[i] - lr * d;                                                  \
		}                                                                              \
	}

/* torch.optim.AdamW's update (decoupled decay, bias correction, eps added
 * after the square root) of n elements in type R. */
#define DEFINE_ADAMW(NAME, R, SQRT, MAX)                                                   \
	static void NAME(const kl_optim_launch *l, const opt_coef *c, R *p, const R *g, R *m,  \
	                 R *v, R *vmax, int64_t n)                                              \
	{                                                                                      \
		const R decay = (R)c->decay, w1 = (R)(1.0 - l->beta1), b2 = (R)l->beta2;        \
		const R w2 = (R)(1.0 - l->beta2), eps = (R)l->eps;                              \
		const R ss = (R)c->step_size, bc2 = (R)c->bc2_sqrt;                              \
		const bool ams = l->amsgrad;                                                   \
		KL_SIMD                                                                        \
		for (int64_t i = 0; i < n; i++) {                                              \
			R gi = g[i];                                                           \
			R mi = m[i] + w1 * (gi - m[i]);                                        \
			R vi = v[i] * b2 + w2 * gi * gi;                                       \
			m[i] = mi;                                                             \
			v[i] = vi;                                                             \
			if (ams)                                                               \
				vmax[i] = vi = MAX(vmax[i], vi);                               \
			R den = SQRT(vi) / bc2 + eps;                                          \
			p[i] = p[i] * decay - ss * (mi / den);                                 \
		}                                                                              \
	}

/* NaN-propagating maximum, as torch.maximum */
static inline float max_f(float a, float b)
{
	return a != a || a > b ? a : b;
}
static inline double max_d(double a, double b)
{
	return a != a || a > b ? a : b;
}

DEFINE_SGD(sgd_f32, float)
DEFINE_SGD(sgd_f64, double)
DEFINE_ADAMW(adamw_f32, float, sqrtf, max_f)
DEFINE_ADAMW(adamw_f64, double, sqrt, max_d)

static inline float ld16(kl_dtype dt, const uint16_t *x, int64_t i)
{
	return dt == KL_F16 ? kl__f16_to_f32(x[i]) : kl__bf16_to_f32(x[i]);
}

static inline uint16_t st16(kl_dtype dt, float f)
{
	return dt == KL_F16 ? kl__f32_to_f16(f) : kl__f32_to_bf16(f);
}

/* Elements [off, off + n) of item it, in place. */
static void update(const kl_optim_launch *l, const opt_coef *c, const kl_optim_item *it,
                   int64_t off, int64_t n)
{
	bool adam = l->algo == KL_ALGO_ADAMW;
	if (l->dtype == KL_F64 || l->dtype == KL_F32) {
		size_t es = kl_dtype_size(l->dtype);
#define AT(ptr) ((ptr) ? (void *)((char *)(ptr) + (size_t)off * es) : NULL)
		void *p = AT(it->p), *m = AT(it->m), *v = AT(it->v), *vm = AT(it->vmax);
		const void *g = AT((void *)(uintptr_t)it->g);
#undef AT
		if (l->dtype == KL_F64 && adam)
			adamw_f64(l, c, p, g, m, v, vm, n);
		else if (l->dtype == KL_F64)
			sgd_f64(l, c, p, g, m, n);
		else if (adam)
			adamw_f32(l, c, p, g, m, v, vm, n);
		else
			sgd_f32(l, c, p, g, m, n);
		return;
	}
	/* f16 / bf16: widen the chunk, update it in f32, round back once */
	float buf[5][OPT_CHUNK];
	void *arr[5] = {it->p, (void *)(uintptr_t)it->g, it->m, it->v, it->vmax};
	for (int a = 0; a < 5; a++)
		if (arr[a])
			for (int64_t i = 0; i < n; i++)
				buf[a][i] = ld16(l->dtype, (const uint16_t *)arr[a] + off, i);
	if (adam)
		adamw_f32(l, c, buf[0], buf[1], buf[2], buf[3], buf[4], n);
	else
		sgd_f32(l, c, buf[0], buf[1], buf[2], n);
	for (int a = 0; a < 5; a++)
		if (arr[a] && a != 1)
			for (int64_t i = 0; i < n; i++)
				((uint16_t *)arr[a] + off)[i] = st16(l->dtype, buf[a][i]);
}

typedef struct opt_job {
	const kl_optim_launch *l;
	const opt_coef *c;
	const int64_t *first;
} opt_job;

static void opt_chunks(void *arg, int64_t k0, int64_t k1)
{
	const opt_job *j = arg;
	const kl_optim_launch *l = j->l;
	for (int64_t k = k0; k < k1; k++) {
		int lo = 0, hi = l->n - 1; /* the last item whose first chunk is <= k */
		while (lo < hi) {
			int mid = (lo + hi + 1) / 2;
			if (j->first[mid] <= k)
				lo = mid;
			else
				hi = mid - 1;
		}
		const kl_optim_item *it = &l->items[lo];
		int64_t off = (k - j->first[lo]) * OPT_CHUNK;
		int64_t n = it->n - off < OPT_CHUNK ? it->n - off : OPT_CHUNK;
		update(l, &j->c[lo], it, off, n);
	}
}

kl_status kl__cpu_optim_step(kl_ctx *ctx, const kl_optim_launch *l)
{
	if (l->n <= 0)
		return KL_OK;
	if (!kl_dtype_is_float(l->dtype))
		return kl__err(ctx, KL_EINVAL, "kl_optim_step: parameters of dtype %s",
		               kl_dtype_name(l->dtype));
	opt_coef *c = malloc(sizeof *c * (size_t)l->n);
	int64_t *first = malloc(sizeof *first * (size_t)(l->n + 1));
	if (!c || !first) {
		free(c);
		free(first);
		return kl__err(ctx, KL_ENOMEM, "kl_optim_step: out of memory");
	}
	/* every step count moves first (torch: state_steps += 1), then the
	 * coefficients follow from it; chunk k of the flattened work belongs to
	 * the item i with first[i] <= k < first[i + 1] */
	double lr = *l->lr;
	first[0] = 0;
	for (int i = 0; i < l->n; i++) {
		const kl_optim_item *it = &l->items[i];
		float s = *it->step;
		c[i].first = s == 0;
		s += 1;
		*it->step = s;
		if (l->algo == KL_ALGO_ADAMW) {
			c[i].decay = 1.0 - lr * l->weight_decay;
			c[i].step_size = lr / (1.0 - pow(l->beta1, s));
			c[i].bc2_sqrt = sqrt(1.0 - pow(l->beta2, s));
		} else {
			c[i].step_size = lr;
		}
		first[i + 1] = first[i] + (it->n + OPT_CHUNK - 1) / OPT_CHUNK;
	}
	int64_t chunks = first[l->n];
	int nt = kl__cpu_threads(ctx);
	if (chunks * OPT_CHUNK < KL_CPU_PAR_MIN)
		nt = 1;
	opt_job j = {l, c, first};
	kl__par_for(nt, chunks, opt_chunks, &j);
	free(c);
	free(first);
	return KL_OK;
}
