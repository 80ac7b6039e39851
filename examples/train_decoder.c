/* train_decoder.c - the seed chapter's training loop in C: a DecoderLayer
 * (kiln_nn.h) fitted to a fixed label with an MSE loss and AdamW, the whole
 * step (forward, loss, backward, the optimizer's update) one compiled
 * function, the loss printed every --print-every steps.
 *
 *   train_decoder [--steps N] [--d-model N] [--heads N] [--ffn N] [--seq N]
 *                 [--batch N] [--lr X] [--seed N] [--device cpu|cuda]
 *                 [--dtype f32|bf16] [--eager] [--replay] [--print-every N] [--check]
 *
 * --replay: compile the step .fullgraph in reduce-overhead: from the second
 * step on each call replays the plan with the fused AdamW as its tail (on
 * CUDA one CUDA graph launch a step) instead of running the step's body.
 *
 * --check: train twice from the same seed in fresh contexts and exit 1
 * unless the two runs' losses are bitwise equal at every step and the last
 * loss is at most half the first.
 */
#include <kiln.h>
#include <kiln_nn.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct opts {
	int steps, print_every;
	int64_t d, heads, ffn, seq, batch;
	double lr;
	uint64_t seed;
	kl_device device;
	kl_dtype dtype;
	bool eager, check, replay;
} opts;

typedef struct trainer {
	kl_nn_decoder layer;
	kl_optim *opt;
} trainer;

/* one training step; out[0]: the loss before the update */
static kl_status step(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin, (void)nout;
	trainer *t = user;
	kl_tensor *loss = kl_mse_loss(kl_nn_decoder_forward(&t->layer, in[0], true), in[1]);
	kl_status st = loss ? kl_backward(loss, NULL) : kl_last_status(ctx);
	if (st == KL_OK)
		st = kl_optim_step(t->opt);
	kl_nn_grad_clear(&t->layer.base);
	out[0] = loss;
	return st;
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Train o->steps steps in a fresh context; losses[i]: step i's loss.
 * Returns 0 or prints the error and returns 1. */
static int train(const opts *o, double *losses, bool quiet)
{
	kl_ctx_opts co = {.device = o->device};
	kl_ctx *ctx = kl_ctx_new(&co);
	if (!ctx) {
		fprintf(stderr, "train_decoder: kl_ctx_new: %s\n", kl_last_error(NULL));
		return 1;
	}
	trainer t;
	memset(&t, 0, sizeof t);
	int rc = 1;
	kl_fn *f = NULL;
	kl_tensor *x = NULL, *label = NULL;
	int64_t shape[3] = {o->batch, o->seq, o->d};
	if (kl_nn_decoder_init(&t.layer, ctx, o->d, o->heads, o->ffn, o->dtype, o->seed) != KL_OK ||
	    kl_nn_requires_grad(&t.layer.base, true) != KL_OK)
		goto fail;
	kl_adamw_opts ao = kl_adamw_defaults();
	ao.lr = o->lr;
	if (!(t.opt = kl_nn_adamw(&t.layer.base, NULL, &ao)))
		goto fail;
	x = kl_randn(ctx, o->dtype, 3, shape, o->seed + 1);
	label = kl_randn(ctx, o->dtype, 3, shape, o->seed + 2);
	if (!x || !label)
		goto fail;
	kl_compile_opts cop = {.disable = o->eager,
	                       .fullgraph = o->replay,
	                       .mode = o->replay ? KL_MODE_REDUCE_OVERHEAD : KL_MODE_DEFAULT};
	if (!(f = kl_compile(ctx, step, &t, 2, 1, &cop)))
		goto fail;
	double t0 = now_ms();
	for (int i = 0; i < o->steps; i++) {
		kl_tensor *in[2] = {x, label}, *loss = NULL;
		if (kl_fn_call(f, in, &loss) != KL_OK || kl_item(loss, &losses[i]) != KL_OK) {
			kl_release(loss);
			goto fail;
		}
		kl_release(loss);
		if (!quiet && (i % o->print_every == 0 || i == o->steps - 1))
			printf("step %4d  loss %.6f  (%.2f ms/step)\n", i, losses[i],
			       (now_ms() - t0) / (i + 1));
	}
	if (!quiet)
		printf("%d steps, %s, %s: %.2f ms a step; the step's graphs:\n", o->steps,
		       o->eager    ? "eager"
		       : o->replay ? "compiled, replayed"
		                   : "compiled",
		       kl_dtype_name(o->dtype), (now_ms() - t0) / o->steps);
	if (!quiet && !o->eager)
		kl_explain(f, stdout);
	rc = 0;
fail:
	if (rc)
		fprintf(stderr, "train_decoder: %s\n", kl_last_error(ctx));
	kl_fn_free(f);
	kl_release(x);
	kl_release(label);
	kl_optim_free(t.opt);
	if (t.layer.base.kind)
		kl_nn_free(&t.layer.base);
	kl_ctx_free(ctx);
	return rc;
}

static int64_t arg_int(const char *s, const char *name)
{
	char *end;
	long long v = strtoll(s, &end, 10);
	if (*end || v < 1) {
		fprintf(stderr, "train_decoder: %s needs a positive integer, not '%s'\n", name, s);
		exit(2);
	}
	return v;
}

int main(int argc, char **argv)
{
	opts o = {.steps = 200, .print_every = 10, .d = 64, .heads = 4, .ffn = 256, .seq = 16,
	          .batch = 2, .lr = 1e-3, .seed = 1, .device = KL_CPU, .dtype = KL_F32};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--eager")) {
			o.eager = true;
			continue;
		}
		if (!strcmp(a, "--replay")) {
			o.replay = true;
			continue;
		}
		if (!strcmp(a, "--check")) {
			o.check = true;
			continue;
		}
		if (!v) {
			fprintf(stderr, "train_decoder: %s needs a value (see the usage at the top of "
			                "examples/train_decoder.c)\n", a);
			return 2;
		}
		i++;
		if (!strcmp(a, "--steps"))
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
		else if (!strcmp(a, "--seed"))
			o.seed = (uint64_t)arg_int(v, a);
		else if (!strcmp(a, "--lr"))
			o.lr = atof(v);
		else if (!strcmp(a, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
			o.device = !strcmp(v, "cuda") ? KL_CUDA : KL_CPU;
		else if (!strcmp(a, "--dtype") && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
			o.dtype = !strcmp(v, "bf16") ? KL_BF16 : KL_F32;
		else {
			fprintf(stderr, "train_decoder: unknown option or value: %s %s\n", a, v);
			return 2;
		}
	}
	double *l1 = calloc((size_t)o.steps, sizeof *l1), *l2 = calloc((size_t)o.steps, sizeof *l2);
	if (!l1 || !l2 || train(&o, l1, false))
		return 1;
	int rc = 0;
	if (o.check) {
		if (train(&o, l2, true))
			return 1;
		if (memcmp(l1, l2, sizeof *l1 * (size_t)o.steps)) {
			fprintf(stderr, "train_decoder --check: two runs from seed %llu differ\n",
			        (unsigned long long)o.seed);
			rc = 1;
		}
		if (!(l1[o.steps - 1] <= 0.5 * l1[0])) {
			fprintf(stderr, "train_decoder --check: the loss went from %g to %g, not down "
			                "by half\n", l1[0], l1[o.steps - 1]);
			rc = 1;
		}
		if (rc == 0)
			printf("check: loss %g -> %g, two runs bitwise equal\n", l1[0], l1[o.steps - 1]);
	}
	free(l1);
	free(l2);
	return rc;
}
