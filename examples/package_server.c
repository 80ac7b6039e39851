/* package_server.c - a server-style program that links only libkiln_rt (no
 * compiler, no lowering): load an AOT package, then answer requests of any
 * batch and sequence length its manifest allows.
 *   package_server PACKAGE INPUTS.safetensors REFERENCE.safetensors [cuda]
 * runs the package on INPUTS' "input0" and checks the result against
 * REFERENCE's "output0" (as examples/export_decoder.c wrote them); cuda: on
 * CUDA device 0 (a CUDA package).
 */
#include <kiln.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int main(int argc, char **argv)
{
	if (argc != 4 && argc != 5)
		return fprintf(stderr, "usage: package_server PACKAGE INPUTS REFERENCE [cuda]\n"), 2;
	double t0 = now_ms();
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = argc == 5 ? KL_CUDA : KL_CPU});
	double t1 = now_ms();
	kl_package *pkg = ctx ? kl_package_load(ctx, argv[1]) : NULL;
	kl_safetensors *in = pkg ? kl_safetensors_open(ctx, argv[2]) : NULL;
	kl_safetensors *ref = in ? kl_safetensors_open(ctx, argv[3]) : NULL;
	kl_tensor *x = ref ? kl_safetensors_get(in, "input0") : NULL, *y = NULL;
	kl_tensor *want = x ? kl_safetensors_get(ref, "output0") : NULL;
	double t2 = now_ms();
	if (!want || kl_package_run(pkg, &x, &y) != KL_OK)
		return fprintf(stderr, "package_server: %s\n", kl_last_error(ctx)), 1;
	/* reading the result back is part of the first result; compared on the
	 * host (libkiln_rt has no generated eager kernels on CUDA) */
	size_t n = (size_t)kl_numel(want);
	float *a = malloc(n * 4 + 4), *b = malloc(n * 4 + 4);
	double err = a && b && kl_numel(y) == (int64_t)n && kl_to_host(y, a, n * 4) == KL_OK &&
	                             kl_to_host(want, b, n * 4) == KL_OK ? 0 : -1;
	for (size_t i = 0; err >= 0 && i < n; i++)
		err = fabs((double)a[i] - b[i]) > err || a[i] != a[i] ? fabs((double)a[i] - b[i]) : err;
	double t3 = now_ms();
	printf("context %.2f ms; package load + first result %.2f ms (of it reading inputs "
	       "%.2f ms); max error %.2e\n", t1 - t0, t3 - t1, t2 - t1, err);
	free(a);
	free(b);
	kl_release(y);
	kl_package_free(pkg);
	kl_safetensors_close(in);
	kl_safetensors_close(ref);
	kl_ctx_free(ctx);
	return err >= 0 && err < 1e-4 ? 0 : 1;
}
