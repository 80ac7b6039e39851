/* train_ddp.c - train_decoder's loop on N processes, data parallel
 * (kiln_dist.h): each rank holds the DecoderLayer, takes its 1/N of the
 * batch, compiles forward + loss + backward as one function, then averages
 * the gradients across ranks (kl_ddp_sync_grads, in buckets) and steps
 * AdamW. The parameters start as rank 0's (kl_ddp_new broadcasts them).
 *
 *   train_ddp [--ranks N] [--steps N] [--d-model N] [--heads N] [--ffn N]
 *             [--seq N] [--batch N (per rank)] [--lr X] [--bucket-mb X]
 *             [--device cpu|cuda] [--eager] [--print-every N] [--check]
 *
 * --ranks N starts N copies of itself under mpirun (CPU: Open MPI moves the
 * gradients; CUDA: NCCL, one GPU a rank, its id passed through a file this
 * process makes); without it, run it under mpirun yourself, or as one rank.
 * --check: exit 1 unless every rank's parameters are bitwise equal to rank
 * 0's at the end and the loss fell by half.
 */
#include <kiln.h>
#include <kiln_dist.h>
#include <kiln_nn.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct opts {
	int steps, print_every, ranks;
	int64_t d, heads, ffn, seq, batch;
	double lr, bucket_mb;
	kl_device device;
	bool eager, check;
} opts;

typedef struct trainer {
	kl_nn_decoder layer;
	kl_tensor *leaves[16]; /* the tensors kl_backward fills */
	int nleaves;
} trainer;

/* forward, loss, backward: out[0] the loss of this rank's rows */
static kl_status fwd_bwd(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	(void)nin, (void)nout;
	trainer *t = user;
	kl_tensor *loss = kl_mse_loss(kl_nn_decoder_forward(&t->layer, in[0], true), in[1]);
	out[0] = loss;
	return loss ? kl_backward(loss, NULL) : kl_last_status(ctx);
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* every rank's copy of each parameter equal to rank 0's */
static bool same_everywhere(kl_comm *c, trainer *t)
{
	bool same = true;
	for (int i = 0; i < t->nleaves && same; i++) {
		kl_tensor *all = kl_comm_all_gather(c, t->leaves[i]);
		kl_tensor *f = all ? kl_cast(all, KL_F32) : NULL;
		int64_t n = kl_numel(t->leaves[i]), N = kl_comm_size(c);
		float *h = f ? malloc((size_t)(n * N) * sizeof *h) : NULL;
		same = h && kl_to_host(f, h, (size_t)(n * N) * sizeof *h) == KL_OK;
		for (int64_t r = 1; r < N && same; r++)
			same = !memcmp(h, h + r * n, (size_t)n * sizeof *h);
		free(h);
		kl_release(f), kl_release(all);
	}
	return same;
}

static int train(const opts *o)
{
	kl_ctx_opts co = {.device = o->device};
	const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
	if (!lr)
		lr = getenv("LOCAL_RANK");
	if (o->device == KL_CUDA && lr)
		co.index = atoi(lr);
	kl_ctx *ctx = kl_ctx_new(&co);
	if (!ctx) {
		fprintf(stderr, "train_ddp: kl_ctx_new: %s\n", kl_last_error(NULL));
		return 1;
	}
	trainer t;
	memset(&t, 0, sizeof t);
	kl_comm *c = NULL;
	kl_ddp *ddp = NULL;
	kl_optim *opt = NULL;
	kl_fn *f = NULL;
	kl_tensor *x = NULL, *label = NULL;
	int rc = 1;
	if (!(c = kl_comm_init(ctx, NULL)))
		goto fail;
	int me = kl_comm_rank(c), N = kl_comm_size(c);
	if (kl_nn_decoder_init(&t.layer, ctx, o->d, o->heads, o->ffn, KL_F32, 1 + (uint64_t)me) !=
	        KL_OK ||
	    kl_nn_requires_grad(&t.layer.base, true) != KL_OK)
		goto fail;
	kl_nn_param ps[16];
	int np = kl_nn_params(&t.layer.base, ps, 16);
	for (int i = 0; i < np && i < 16; i++)
		if (!strstr(ps[i].name, "gate_proj.") && !strstr(ps[i].name, "up_proj."))
			t.leaves[t.nleaves++] = *ps[i].slot;
	t.leaves[t.nleaves++] = t.layer.ffn.gate_up;
	if (!(ddp = kl_ddp_new(c, t.leaves, t.nleaves, (size_t)(o->bucket_mb * 1048576))))
		goto fail;
	kl_adamw_opts ao = kl_adamw_defaults();
	ao.lr = o->lr;
	if (!(opt = kl_nn_adamw(&t.layer.base, NULL, &ao)))
		goto fail;
	/* the global batch, the same on every rank; this rank's rows of it */
	int64_t gshape[3] = {o->batch * N, o->seq, o->d};
	kl_scope_begin(ctx);
	kl_tensor *gx = kl_randn(ctx, KL_F32, 3, gshape, 2), *gy = kl_randn(ctx, KL_F32, 3, gshape, 3);
	x = kl_retain(kl_contiguous(kl_slice(gx, 0, me * o->batch, (me + 1) * o->batch, 1)));
	label = kl_retain(kl_contiguous(kl_slice(gy, 0, me * o->batch, (me + 1) * o->batch, 1)));
	kl_scope_end(ctx);
	kl_compile_opts cop = {.disable = o->eager};
	if (!x || !label || !(f = kl_compile(ctx, fwd_bwd, &t, 2, 1, &cop)))
		goto fail;
	double t0 = now_ms(), first = 0, last = 0;
	for (int i = 0; i < o->steps; i++) {
		kl_tensor *in[2] = {x, label}, *loss = NULL;
		kl_status st = kl_fn_call(f, in, &loss);
		if (st == KL_OK)
			st = kl_ddp_sync_grads(ddp);
		if (st == KL_OK)
			st = kl_optim_step(opt);
		kl_nn_grad_clear(&t.layer.base);
		/* the whole batch's loss: the mean of the ranks' */
		if (st == KL_OK)
			st = kl_comm_all_reduce(c, loss, KL_REDUCE_MEAN);
		double l = 0;
		if (st == KL_OK)
			st = kl_item(loss, &l);
		kl_release(loss);
		if (st != KL_OK)
			goto fail;
		first = i ? first : l;
		last = l;
		if (me == 0 && (i % o->print_every == 0 || i == o->steps - 1))
			printf("step %4d  loss %.6f  (%.2f ms/step)\n", i, l, (now_ms() - t0) / (i + 1));
	}
	if (me == 0)
		printf("%d ranks (%s), %d steps, %s, %d buckets: %.2f ms a step\n", N,
		       kl_comm_backend_name(c), o->steps, o->eager ? "eager" : "compiled",
		       kl_ddp_buckets(ddp), (now_ms() - t0) / o->steps);
	rc = 0;
	if (o->check) {
		bool same = same_everywhere(c, &t);
		if (!same || !(last <= 0.5 * first)) {
			fprintf(stderr, "train_ddp --check: rank %d: %s\n", me,
			        !same ? "parameters differ across ranks" : "the loss did not halve");
			rc = 1;
		} else if (me == 0) {
			printf("check: loss %g -> %g, parameters equal on all %d ranks\n", first, last, N);
		}
	}
fail:
	if (rc == 1 && !o->check)
		fprintf(stderr, "train_ddp: %s\n", kl_last_error(ctx));
	kl_fn_free(f);
	kl_release(x), kl_release(label);
	kl_optim_free(opt);
	kl_ddp_free(ddp);
	if (t.layer.base.kind)
		kl_nn_free(&t.layer.base);
	kl_comm_free(c);
	kl_ctx_free(ctx);
	return rc;
}

/* --ranks N: this program again under mpirun -np N, without --ranks */
static int launch(int ranks, int argc, char **argv)
{
	char dir[] = "/tmp/kiln_ddp_XXXXXX", file[64], np[16];
	if (!mkdtemp(dir)) {
		perror("train_ddp: mkdtemp");
		return 1;
	}
	snprintf(file, sizeof file, "%s/nccl_id", dir);
	snprintf(np, sizeof np, "%d", ranks);
	setenv("KILN_DIST_FILE", file, 1);
	char **av = calloc((size_t)argc + 8, sizeof *av);
	int n = 0;
	av[n++] = "mpirun";
	av[n++] = "-np";
	av[n++] = np;
	av[n++] = "--oversubscribe";
	av[n++] = argv[0];
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--ranks")) {
			i++;
			continue;
		}
		av[n++] = argv[i];
	}
	pid_t pid = fork();
	if (pid == 0) {
		execvp("mpirun", av);
		perror("train_ddp: mpirun");
		_exit(127);
	}
	int status = 1;
	if (pid < 0 || waitpid(pid, &status, 0) < 0)
		status = 1;
	unlink(file);
	rmdir(dir);
	free(av);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

static int64_t arg_int(const char *s, const char *name)
{
	char *end;
	long long v = strtoll(s, &end, 10);
	if (*end || v < 1) {
		fprintf(stderr, "train_ddp: %s needs a positive integer, not '%s'\n", name, s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	opts o = {.steps = 100, .print_every = 10, .d = 64, .heads = 4, .ffn = 256, .seq = 16,
	          .batch = 2, .lr = 1e-3, .bucket_mb = 25, .device = KL_CPU};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--eager") || !strcmp(a, "--check")) {
			*(a[2] == 'e' ? &o.eager : &o.check) = true;
			continue;
		}
		if (!v) {
			fprintf(stderr, "train_ddp: %s needs a value\n", a);
			return 2;
		}
		i++;
		if (!strcmp(a, "--ranks"))
			o.ranks = (int)arg_int(v, a);
		else if (!strcmp(a, "--steps"))
			o.steps = (int)arg_int(v, a);
		else if (!strcmp(a, "--print-every"))
			o.print_every = (int)arg_int(v, a);
		else if (!strcmp(a, "--d-model"))
			o.d = arg_int(v, a);
		else if (!strcmp(a, "--heads"))
			o.heads = arg_int(v, a);
		else if (!strcmp(a, "--ffn"))
			o.ffn = arg_int(v, a);
		else if (!strcmp(a, "--seq"))
			o.seq = arg_int(v, a);
		else if (!strcmp(a, "--batch"))
			o.batch = arg_int(v, a);
		else if (!strcmp(a, "--lr"))
			o.lr = atof(v);
		else if (!strcmp(a, "--bucket-mb") && atof(v) > 0)
			o.bucket_mb = atof(v);
		else if (!strcmp(a, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
			o.device = !strcmp(v, "cuda") ? KL_CUDA : KL_CPU;
		else {
			fprintf(stderr, "train_ddp: unknown option or value: %s %s\n", a, v);
			return 2;
		}
	}
	if (o.ranks > 0 && !getenv("OMPI_COMM_WORLD_SIZE"))
		return launch(o.ranks, argc, argv);
	return train(&o);
}
