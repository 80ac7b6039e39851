/* dist_test.c - libkiln_dist under mpirun (ctest runs it with 2 and 4
 * processes; not a test_*.c, which ctest would run as one process).
 *
 *   dist_test collectives  every collective and dtype against a float64
 *                          reference (each rank makes every rank's input
 *                          from its seed), and bad arguments
 *   dist_test train        the DecoderLayer (d 32) trained 10 steps with
 *                          kl_ddp: parameters bitwise equal across ranks
 *                          after every step, and rank 0 checks them and the
 *                          loss against a single-process run on the whole
 *                          batch (N x each rank's)
 *   dist_test train_adamw  the same with AdamW (see g_adamw's tolerance)
 *   dist_test rendezvous   the TCP hand-over of NCCL's id (MASTER_ADDR/PORT)
 *                          rank 0 to the others, a world size that differs,
 *                          nobody connecting, nobody listening
 *   dist_test mismatch     one rank all-reduces another shape: every rank
 *                          fails naming the rank and the collective
 *   dist_test exit         the last rank leaves after 2 collectives: the
 *                          others fail on the 3rd naming it, within the
 *                          timeout (never a hang)
 * Exit 0 on success; each failure prints "rank R: ..." and exits 1.
 */
#include <kiln.h>
#include <kiln_dist.h>
#include <kiln_nn.h>

#include "dist/dist.h" /* the TCP rendezvous, tested directly */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_rank = -1;
/* train_adamw: AdamW, whose update (lr * m / sqrt(v)) can move a parameter
 * whose gradient is rounding noise by about lr a step (its sign is noise),
 * so its parameters are held to |diff| <= lr * steps, and at most 1% of each
 * parameter's elements may differ by more than 1e-5 (the loss curve to 1e-5
 * as with SGD); train: SGD with momentum, whose update is linear in the
 * gradient: 2e-5 relative. */
static bool g_adamw;
#define LR_ADAMW 1e-3
static int g_fail;

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "rank %d: %s:%d: ", g_rank, __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                        \
			fputc('\n', stderr);                                 \
			g_fail = 1;                                          \
		}                                                            \
	} while (0)

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double *host_f64(kl_tensor *t)
{
	int64_t n = kl_numel(t);
	double *out = malloc((size_t)n * sizeof *out + 8);
	bool grad = kl_set_grad_enabled(kl_tensor_ctx(t), false); /* t may be a parameter */
	kl_tensor *w = kl_cast(t, KL_F64);
	kl_set_grad_enabled(kl_tensor_ctx(t), grad);
	if (!w || kl_to_host(w, out, (size_t)n * sizeof *out) != KL_OK) {
		CHECK(0, "host_f64: %s", kl_last_error(kl_tensor_ctx(t)));
		memset(out, 0, (size_t)n * sizeof *out);
	}
	kl_release(w);
	return out;
}

/* rank r's input: randn from seed, cast to dt */
static kl_tensor *input(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, int r,
                        uint64_t seed)
{
	kl_tensor *x = kl_randn(ctx, KL_F64, ndim, shape, seed * 100 + (uint64_t)r);
	if (dt == KL_I64 || dt == KL_I32) {
		kl_tensor *y = kl_mul_scalar(x, 100);
		kl_release(x);
		x = y;
	}
	kl_tensor *out = kl_cast(x, dt);
	kl_release(x);
	return out;
}

static double tol_of(kl_dtype dt)
{
	return dt == KL_F64 ? 1e-12 : dt == KL_F32 ? 1e-5 : dt == KL_BF16 ? 2e-2 : 0.5;
}

/* |got - want| <= tol * (1 + |want|) everywhere, NaN never passing */
static void check_close(const char *what, const double *got, const double *want, int64_t n,
                        double tol)
{
	for (int64_t i = 0; i < n; i++)
		if (!(fabs(got[i] - want[i]) <= tol * (1 + fabs(want[i])))) {
			CHECK(0, "%s: element %lld: got %.9g, want %.9g", what, (long long)i, got[i],
			      want[i]);
			return;
		}
}

/* sum (or mean) over every rank's input, as f64 */
static double *reference_sum(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, int N,
                             uint64_t seed, bool mean)
{
	kl_tensor *x0 = input(ctx, dt, ndim, shape, 0, seed);
	int64_t n = kl_numel(x0);
	kl_release(x0);
	double *want = calloc((size_t)n + 1, sizeof *want);
	for (int r = 0; r < N; r++) {
		kl_tensor *x = input(ctx, dt, ndim, shape, r, seed);
		double *h = host_f64(x);
		for (int64_t i = 0; i < n; i++)
			want[i] += h[i];
		free(h);
		kl_release(x);
	}
	if (mean)
		for (int64_t i = 0; i < n; i++)
			want[i] /= N;
	return want;
}

static void collectives(kl_ctx *ctx, kl_comm *c)
{
	int N = kl_comm_size(c), me = kl_comm_rank(c);
	const kl_dtype dts[] = {KL_F32, KL_F64, KL_BF16, KL_F16, KL_I64, KL_I32};
	int64_t shape[2] = {2 * N, 3};
	char what[96];
	for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
		kl_dtype dt = dts[di];
		bool is_float = dt != KL_I64 && dt != KL_I32;
		double tol = tol_of(dt);
		uint64_t seed = 7 + di;
		int64_t n = shape[0] * shape[1];
		for (int mean = 0; mean <= (is_float ? 1 : 0); mean++) {
			kl_tensor *t = input(ctx, dt, 2, shape, me, seed);
			kl_status st = kl_comm_all_reduce(c, t, mean ? KL_REDUCE_MEAN : KL_REDUCE_SUM);
			CHECK(st == KL_OK, "all_reduce %s: %s", kl_dtype_name(dt), kl_last_error(ctx));
			double *want = reference_sum(ctx, dt, 2, shape, N, seed, mean);
			double *got = host_f64(t);
			snprintf(what, sizeof what, "all_reduce %s %s", kl_dtype_name(dt),
			         mean ? "mean" : "sum");
			check_close(what, got, want, n, tol);
			free(want), free(got);
			kl_release(t);
		}
		/* broadcast from the last rank */
		kl_tensor *t = input(ctx, dt, 2, shape, me, seed);
		CHECK(kl_comm_broadcast(c, t, N - 1) == KL_OK, "broadcast: %s", kl_last_error(ctx));
		kl_tensor *src = input(ctx, dt, 2, shape, N - 1, seed);
		double *got = host_f64(t), *want = host_f64(src);
		snprintf(what, sizeof what, "broadcast %s", kl_dtype_name(dt));
		check_close(what, got, want, n, 0);
		free(got), free(want);
		kl_release(src);
		/* all-gather: every rank's block in rank order */
		kl_release(t);
		t = input(ctx, dt, 2, shape, me, seed);
		kl_tensor *g = kl_comm_all_gather(c, t);
		CHECK(g && kl_dim(g, 0) == 2 * N * N && kl_dim(g, 1) == 3 &&
		          kl_tensor_dtype(g) == dt,
		      "all_gather %s: %s", kl_dtype_name(dt), g ? "shape" : kl_last_error(ctx));
		if (g) {
			got = host_f64(g);
			for (int r = 0; r < N; r++) {
				kl_tensor *x = input(ctx, dt, 2, shape, r, seed);
				want = host_f64(x);
				snprintf(what, sizeof what, "all_gather %s block %d", kl_dtype_name(dt), r);
				check_close(what, got + (size_t)r * (size_t)n, want, n, 0);
				free(want);
				kl_release(x);
			}
			free(got);
		}
		kl_release(g);
		/* reduce-scatter: this rank's 2 rows of the sum */
		kl_tensor *rs = kl_comm_reduce_scatter(c, t, KL_REDUCE_SUM);
		CHECK(rs && kl_dim(rs, 0) == 2 && kl_tensor_dtype(rs) == dt, "reduce_scatter %s: %s",
		      kl_dtype_name(dt), rs ? "shape" : kl_last_error(ctx));
		if (rs) {
			want = reference_sum(ctx, dt, 2, shape, N, seed, false);
			got = host_f64(rs);
			snprintf(what, sizeof what, "reduce_scatter %s", kl_dtype_name(dt));
			check_close(what, got, want + (size_t)me * 6, 6, tol);
			free(want), free(got);
		}
		kl_release(rs);
		kl_release(t);
	}
	/* bad arguments fail on the calling rank alone, naming the call */
	kl_tensor *t = input(ctx, KL_F32, 2, shape, me, 1);
	CHECK(kl_comm_broadcast(c, t, N) == KL_EINVAL &&
	          strstr(kl_last_error(ctx), "kl_comm_broadcast: root"),
	      "bad root: %s", kl_last_error(ctx));
	int64_t odd[2] = {2 * N + 1, 3};
	kl_tensor *u = input(ctx, KL_F32, 2, odd, me, 1);
	CHECK(N == 1 || (!kl_comm_reduce_scatter(c, u, KL_REDUCE_SUM) &&
	                 strstr(kl_last_error(ctx), "kl_comm_reduce_scatter: dim 0")),
	      "odd reduce_scatter: %s", kl_last_error(ctx));
	CHECK(kl_comm_all_reduce(c, NULL, KL_REDUCE_SUM) == KL_EINVAL &&
	          strstr(kl_last_error(ctx), "kl_comm_all_reduce: tensor is NULL"),
	      "NULL: %s", kl_last_error(ctx));
	kl_tensor *ints = kl_cast(t, KL_I32);
	CHECK(kl_comm_all_reduce(c, ints, KL_REDUCE_MEAN) == KL_EINVAL,
	      "mean of ints: %s", kl_last_error(ctx));
	kl_release(ints), kl_release(u), kl_release(t);
	/* still usable after refused calls */
	CHECK(kl_comm_barrier(c) == KL_OK, "barrier: %s", kl_last_error(ctx));
}

/* ---- training ---------------------------------------------------------------- */

enum { D = 32, HEADS = 4, FFN = 64, SEQ = 8, PER_RANK = 2, STEPS = 10, MAXP = 16 };

typedef struct model {
	kl_nn_decoder layer;
	kl_optim *opt;
	kl_tensor *leaves[MAXP]; /* what kl_backward fills: gate_up, not its views */
	int nleaves;
} model;

static kl_status model_init(model *m, kl_ctx *ctx, uint64_t seed)
{
	memset(m, 0, sizeof *m);
	kl_status st = kl_nn_decoder_init(&m->layer, ctx, D, HEADS, FFN, KL_F32, seed);
	if (st == KL_OK)
		st = kl_nn_requires_grad(&m->layer.base, true);
	kl_nn_param ps[MAXP];
	int n = st == KL_OK ? kl_nn_params(&m->layer.base, ps, MAXP) : 0;
	for (int i = 0; i < n && i < MAXP; i++)
		if (!strstr(ps[i].name, "gate_proj.weight") && !strstr(ps[i].name, "up_proj.weight"))
			m->leaves[m->nleaves++] = *ps[i].slot;
	m->leaves[m->nleaves++] = m->layer.ffn.gate_up;
	kl_adamw_opts ao = kl_adamw_defaults();
	ao.lr = LR_ADAMW;
	kl_sgd_opts so = kl_sgd_defaults();
	so.lr = 0.05;
	so.momentum = 0.9;
	if (st == KL_OK && !(m->opt = g_adamw ? kl_nn_adamw(&m->layer.base, NULL, &ao)
	                                      : kl_nn_sgd(&m->layer.base, NULL, &so)))
		st = kl_last_status(ctx);
	return st;
}

static void model_free(model *m)
{
	kl_optim_free(m->opt);
	kl_nn_free(&m->layer.base);
}

/* rows [r0, r0 + rows) of step s's global batch (x and label) */
static void batch(kl_ctx *ctx, int s, int64_t global, int64_t r0, int64_t rows, kl_tensor **x,
                  kl_tensor **y)
{
	int64_t shape[3] = {global, SEQ, D};
	kl_scope_begin(ctx);
	kl_tensor *gx = kl_randn(ctx, KL_F32, 3, shape, 1000 + (uint64_t)s);
	kl_tensor *gy = kl_randn(ctx, KL_F32, 3, shape, 2000 + (uint64_t)s);
	*x = kl_retain(kl_contiguous(kl_slice(gx, 0, r0, r0 + rows, 1)));
	*y = kl_retain(kl_contiguous(kl_slice(gy, 0, r0, r0 + rows, 1)));
	kl_scope_end(ctx);
}

/* one step; the loss of this process's rows into *loss */
static kl_status step(model *m, kl_ddp *ddp, kl_tensor *x, kl_tensor *y, double *loss)
{
	kl_ctx *ctx = kl_tensor_ctx(x);
	kl_scope_begin(ctx);
	kl_tensor *l = kl_mse_loss(kl_nn_decoder_forward(&m->layer, x, true), y);
	kl_status st = l ? kl_item(l, loss) : kl_last_status(ctx);
	if (st == KL_OK)
		st = kl_backward(l, NULL);
	if (st == KL_OK && ddp)
		st = kl_ddp_sync_grads(ddp);
	if (st == KL_OK)
		st = kl_optim_step(m->opt);
	kl_nn_grad_clear(&m->layer.base);
	kl_scope_end(ctx);
	return st;
}

static void train(kl_ctx *ctx, kl_comm *c)
{
	int N = kl_comm_size(c), me = kl_comm_rank(c);
	int64_t global = (int64_t)N * PER_RANK;
	model m, ref;
	/* each rank starts from its own seed: kl_ddp_new must broadcast rank 0's */
	CHECK(model_init(&m, ctx, 42 + (uint64_t)me) == KL_OK, "init: %s", kl_last_error(ctx));
	kl_ddp *ddp = kl_ddp_new(c, m.leaves, m.nleaves, 4096); /* small buckets: several */
	CHECK(ddp, "kl_ddp_new: %s", kl_last_error(ctx));
	if (!ddp)
		return;
	CHECK(kl_ddp_buckets(ddp) > 1, "one bucket only");
	kl_ctx *rctx = NULL;
	if (me == 0) {
		rctx = kl_ctx_new(NULL);
		CHECK(model_init(&ref, rctx, 42) == KL_OK, "ref init: %s", kl_last_error(rctx));
	}
	double max_param_diff = 0, max_loss_diff = 0;
	int64_t adamw_off = 0;
	for (int s = 0; s < STEPS; s++) {
		kl_tensor *x, *y;
		batch(ctx, s, global, (int64_t)me * PER_RANK, PER_RANK, &x, &y);
		double loss = 0;
		CHECK(step(&m, ddp, x, y, &loss) == KL_OK, "step %d: %s", s, kl_last_error(ctx));
		kl_release(x), kl_release(y);
		/* the global loss: the mean of the ranks' (equal) shares */
		kl_tensor *lt = kl_scalar(ctx, KL_F64, loss);
		CHECK(kl_comm_all_reduce(c, lt, KL_REDUCE_MEAN) == KL_OK, "loss: %s",
		      kl_last_error(ctx));
		kl_item(lt, &loss);
		kl_release(lt);
		/* every rank's parameters bitwise equal to the others' */
		for (int i = 0; i < m.nleaves; i++) {
			kl_tensor *all = kl_comm_all_gather(c, m.leaves[i]);
			CHECK(all, "gather: %s", kl_last_error(ctx));
			if (!all)
				break;
			int64_t n = kl_numel(m.leaves[i]);
			float *h = malloc((size_t)(n * N) * sizeof *h);
			kl_to_host(all, h, (size_t)(n * N) * sizeof *h);
			for (int r = 1; r < N; r++)
				CHECK(memcmp(h, h + r * n, (size_t)n * sizeof *h) == 0,
				      "step %d: parameter %d differs between rank 0 and rank %d", s, i, r);
			free(h);
			kl_release(all);
		}
		if (me != 0)
			continue;
		/* the single process on the whole batch */
		double rloss = 0;
		batch(rctx, s, global, 0, global, &x, &y);
		CHECK(step(&ref, NULL, x, y, &rloss) == KL_OK, "ref step %d: %s", s,
		      kl_last_error(rctx));
		kl_release(x), kl_release(y);
		max_loss_diff = fmax(max_loss_diff, fabs(loss - rloss) / fabs(rloss));
		CHECK(fabs(loss - rloss) <= 1e-5 * fabs(rloss), "step %d: loss %.9g, single %.9g", s,
		      loss, rloss);
		for (int i = 0; i < m.nleaves; i++) {
			double *a = host_f64(m.leaves[i]), *b = host_f64(ref.leaves[i]);
			int64_t n = kl_numel(m.leaves[i]);
			for (int64_t j = 0; j < n; j++)
				max_param_diff = fmax(max_param_diff, fabs(a[j] - b[j]));
			char what[64];
			snprintf(what, sizeof what, "step %d parameter %d vs single", s, i);
			if (g_adamw) {
				/* the key third of in_proj_bias has a gradient of exactly 0
				 * (adding one vector to every key shifts a query's scores
				 * by one constant, which softmax ignores): what reaches
				 * AdamW there is rounding noise, its sign different in the
				 * two runs, and each step moves it by about lr */
				bool kbias = m.leaves[i] == m.layer.attn.in_proj_bias;
				int64_t off = 0;
				for (int64_t j = 0; j < n; j++) {
					if (kbias && j >= D && j < 2 * D)
						continue;
					off += !(fabs(a[j] - b[j]) <= 1e-5);
					if (!(fabs(a[j] - b[j]) <= LR_ADAMW * (s + 1))) {
						CHECK(0, "%s: element %lld: %.9g vs %.9g", what,
						      (long long)j, a[j], b[j]);
						break;
					}
				}
				adamw_off += off;
				CHECK(off * 100 <= n, "%s: %lld of %lld elements differ by > 1e-5", what,
				      (long long)off, (long long)n);
			} else {
				check_close(what, a, b, n, 2e-5);
			}
			free(a), free(b);
		}
	}
	if (me == 0) {
		printf("%s: %d ranks x %d rows, %d steps, %d buckets: max |param - single| %.3g, "
		       "max loss rel diff %.3g, elements off by > 1e-5: %lld\n",
		       g_adamw ? "train_adamw" : "train", N, PER_RANK, STEPS, kl_ddp_buckets(ddp), max_param_diff, max_loss_diff,
		       (long long)adamw_off);
		model_free(&ref);
		kl_ctx_free(rctx);
	}
	kl_ddp_free(ddp);
	model_free(&m);
}

/* ---- faults ---------------------------------------------------------------------- */

static void mismatch(kl_ctx *ctx, kl_comm *c)
{
	int N = kl_comm_size(c), me = kl_comm_rank(c);
	int64_t shape[2] = {4, me == 1 ? 33 : 32};
	kl_tensor *t = kl_zeros(ctx, KL_F32, 2, shape);
	double t0 = now_s();
	kl_status st = kl_comm_all_reduce(c, t, KL_REDUCE_SUM);
	const char *e = kl_last_error(ctx);
	CHECK(st == KL_ESTATE, "mismatch went through");
	CHECK(strstr(e, "kl_comm_all_reduce: rank ") && strstr(e, me == 1 ? "but rank 0 called"
	                                                                  : "but rank 1 called"),
	      "message: %s", e);
	CHECK(strstr(e, me == 1 ? "[4,32]" : "[4,33]"), "message lacks the other shape: %s", e);
	CHECK(now_s() - t0 < 5, "took %.1f s", now_s() - t0);
	/* broken from now on */
	CHECK(kl_comm_barrier(c) == KL_ESTATE && strstr(kl_last_error(ctx), "broken"),
	      "after: %s", kl_last_error(ctx));
	if (me == 0)
		printf("mismatch (%d ranks): %s\n", N, e);
	kl_release(t);
}

static void exit_early(kl_ctx *ctx, kl_comm *c, double timeout)
{
	int N = kl_comm_size(c), me = kl_comm_rank(c);
	int64_t shape[1] = {8};
	for (int i = 0; i < 3; i++) {
		if (me == N - 1 && i == 2)
			return; /* leaves: main frees the communicator and exits */
		kl_tensor *u = kl_full(ctx, KL_F32, 1, shape, 1.0);
		double t0 = now_s();
		kl_status st = kl_comm_all_reduce(c, u, KL_REDUCE_SUM);
		double took = now_s() - t0;
		if (i < 2) {
			CHECK(st == KL_OK, "collective %d: %s", i, kl_last_error(ctx));
		} else {
			char want[64];
			snprintf(want, sizeof want, "rank %d did not reach it", N - 1);
			CHECK(st == KL_ESTATE && strstr(kl_last_error(ctx), want) &&
			          strstr(kl_last_error(ctx), "kl_comm_all_reduce"),
			      "got: %s", kl_last_error(ctx));
			CHECK(took < 2 * timeout + 1, "took %.1f s (timeout %g)", took, timeout);
			if (me == 0)
				printf("exit (%d ranks) after %.2f s: %s\n", N, took, kl_last_error(ctx));
		}
		kl_release(u);
	}
}

static void rendezvous(kl_ctx *ctx, kl_comm *c)
{
	int N = kl_comm_size(c), me = kl_comm_rank(c);
	unsigned char blob[128], got[128];
	for (int i = 0; i < 128; i++)
		blob[i] = (unsigned char)(i * 37 + 11);
	for (int round = 0; round < 2; round++) {
		/* rank 0 listens on a free port and tells the others which */
		int port = 0, fd = -1;
		if (me == 0) {
			fd = kl__dist_tcp_listen(ctx, 0, &port);
			CHECK(fd >= 0, "listen: %s", kl_last_error(ctx));
		}
		kl_tensor *pt = kl_scalar(ctx, KL_I64, port);
		CHECK(kl_comm_broadcast(c, pt, 0) == KL_OK, "port: %s", kl_last_error(ctx));
		double pv = 0;
		kl_item(pt, &pv);
		kl_release(pt);
		port = (int)pv;
		if (me == 0) {
			kl_status st = kl__dist_tcp_serve(ctx, fd, N, 10, blob, sizeof blob);
			CHECK(st == KL_OK, "serve: %s", kl_last_error(ctx));
		} else {
			/* round 1: the last rank believes in one rank more */
			bool liar = round == 1 && me == N - 1;
			memset(got, 0, sizeof got);
			kl_status st = kl__dist_tcp_fetch(ctx, me, liar ? N + 1 : N, "127.0.0.1", port,
			                                  10, got, sizeof got);
			if (liar) {
				char want[96];
				snprintf(want, sizeof want, "WORLD_SIZE is %d here but %d on rank 0", N + 1,
				         N);
				CHECK(st == KL_EINVAL && strstr(kl_last_error(ctx), want), "liar: %s",
				      kl_last_error(ctx));
			} else {
				CHECK(st == KL_OK && !memcmp(got, blob, sizeof blob), "fetch: %s",
				      st ? kl_last_error(ctx) : "wrong bytes");
			}
		}
		CHECK(kl_comm_barrier(c) == KL_OK, "barrier: %s", kl_last_error(ctx));
	}
	/* nobody connects / nobody listens: errors within the timeout */
	double t0 = now_s();
	if (me == 0) {
		int port = 0, fd = kl__dist_tcp_listen(ctx, 0, &port);
		kl_status st = kl__dist_tcp_serve(ctx, fd, N, 0.3, blob, sizeof blob);
		CHECK(st == KL_ESTATE && strstr(kl_last_error(ctx), "connected within"), "serve: %s",
		      kl_last_error(ctx));
	} else {
		/* a port rank 0 listened on and closed: nobody there */
		int port = 0, fd = kl__dist_tcp_listen(ctx, 0, &port);
		close(fd);
		kl_status st = kl__dist_tcp_fetch(ctx, me, N, "127.0.0.1", port, 0.3, got, sizeof got);
		CHECK(st == KL_ESTATE && strstr(kl_last_error(ctx), "did not listen at MASTER_ADDR"),
		      "fetch: %s", kl_last_error(ctx));
	}
	CHECK(now_s() - t0 < 3, "took %.1f s", now_s() - t0);
	CHECK(kl_comm_barrier(c) == KL_OK, "barrier: %s", kl_last_error(ctx));
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: dist_test collectives|train|mismatch|exit\n");
		return 2;
	}
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx) {
		fprintf(stderr, "kl_ctx_new: %s\n", kl_last_error(NULL));
		return 1;
	}
	double timeout = 2;
	kl_comm_opts o = {.backend = KL_COMM_MPI, .timeout_s = timeout};
	kl_comm *c = kl_comm_init(ctx, &o);
	if (!c) {
		fprintf(stderr, "kl_comm_init: %s\n", kl_last_error(ctx));
		kl_ctx_free(ctx);
		return 1;
	}
	g_rank = kl_comm_rank(c);
	if (!strcmp(argv[1], "collectives"))
		collectives(ctx, c);
	else if (!strcmp(argv[1], "train") || !strcmp(argv[1], "train_adamw"))
		g_adamw = argv[1][5] != 0, train(ctx, c);
	else if (!strcmp(argv[1], "rendezvous"))
		rendezvous(ctx, c);
	else if (!strcmp(argv[1], "mismatch"))
		mismatch(ctx, c);
	else if (!strcmp(argv[1], "exit"))
		exit_early(ctx, c, timeout);
	else
		CHECK(0, "unknown mode %s", argv[1]);
	/* every tensor the test and libkiln_dist made is gone (LeakSanitizer is
	 * off under mpirun: Open MPI's own leaks cannot be told apart) */
	kl_memory_usage mu = {0};
	CHECK(kl_memory_stats(ctx, &mu) == KL_OK && mu.in_use == 0, "%zu bytes of tensors left",
	      mu.in_use);
	if (!g_fail && g_rank == 0)
		printf("dist_test %s: %d ranks ok\n", argv[1], kl_comm_size(c));
	kl_comm_free(c);
	kl_ctx_free(ctx);
	return g_fail;
}
