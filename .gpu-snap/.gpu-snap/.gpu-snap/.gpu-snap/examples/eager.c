/* eager.c - the smallest kiln program: make random tensors, compute
 * relu(a*b + c) eagerly on the CPU, read the result back and check it.
 * Build: cc eager.c $(pkg-config --cflags --libs kiln)
 */
#include <kiln.h>
#include <stdio.h>
#include <stdlib.h>

#define N 4

int main(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL); /* CPU, all cores */
	if (!ctx) {
		fprintf(stderr, "kl_ctx_new: %s\n", kl_last_error(NULL));
		return 1;
	}

	const int64_t shape[2] = {N, N};
	kl_tensor *a = kl_randn(ctx, KL_F32, 2, shape, 1);
	kl_tensor *b = kl_randn(ctx, KL_F32, 2, shape, 2);
	kl_tensor *c = kl_randn(ctx, KL_F32, 2, shape, 3);

	/* Ops run as they are called. Intermediates are released by the scope;
	 * a failure anywhere in the chain makes y NULL. */
	kl_scope_begin(ctx);
	kl_tensor *y = kl_retain(kl_relu(kl_add(kl_mul(a, b), c)));
	kl_scope_end(ctx);

	float ha[N * N], hb[N * N], hc[N * N], hy[N * N];
	int rc = 1;
	if (!y || kl_to_host(a, ha, sizeof(ha)) || kl_to_host(b, hb, sizeof(hb)) ||
	    kl_to_host(c, hc, sizeof(hc)) || kl_to_host(y, hy, sizeof(hy))) {
		fprintf(stderr, "kiln: %s\n", kl_last_error(ctx));
		goto done;
	}

	double maxerr = 0;
	for (int i = 0; i < N * N; i++) {
		float want = ha[i] * hb[i] + hc[i];
		double err = (double)hy[i] - (want > 0 ? want : 0);
		err = err < 0 ? -err : err;
		maxerr = err > maxerr ? err : maxerr;
	}
	printf("relu(a*b + c) =\n");
	for (int r = 0; r < N; r++)
		printf("  %9.6f %9.6f %9.6f %9.6f\n", hy[r * N], hy[r * N + 1], hy[r * N + 2],
		       hy[r * N + 3]);
	printf("max error vs plain C: %.3g\n", maxerr);
	rc = maxerr <= 1e-5 ? 0 : 1;
	printf("%s\n", rc ? "eager: MISMATCH" : "eager: ok");

done:
	kl_release(y);
	kl_release(c);
	kl_release(b);
	kl_release(a);
	kl_ctx_free(ctx);
	return rc;
}
