/* sync_points.c - the sync points: copying tensors to the host (kl_to_host,
 * kl_item), printing them the way torch does (kl_print), and host callbacks
 * (kl_host_call). Inside a trace each one asks the capture layer (sync_hook)
 * to materialize the graph so far: a graph break.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "api/dispatch.h"

/* Make t readable: inside a trace the capture layer runs the graph so far
 * (or refuses, in fullgraph mode); with no hook that is an error. */
static kl_status sync_point(kl_ctx *ctx, const char *op, int n, kl_tensor *const *ts)
{
	if (ctx->trace) {
		if (!ctx->sync_hook)
			return kl__err(ctx, KL_ESTATE, "%s: sync point inside a trace", op);
		kl_status st = ctx->sync_hook(ctx, op, n, ts);
		if (st != KL_OK)
			return st;
	}
	for (int i = 0; i < n; i++)
		if (!ts[i]->st)
			return kl__err(ctx, KL_ESTATE,
			               "%s: input %d is a lazy tensor of a finished trace", op, i);
	return KL_OK;
}

/* Copy t densely (row-major) to dst; a strided tensor is first gathered
 * into a dense temporary through the backend's CONTIGUOUS. */
static kl_status copy_out(kl_ctx *ctx, kl_tensor *t, void *dst, size_t nbytes)
{
	if (nbytes == 0)
		return KL_OK;
	if (kl_is_contiguous(t))
		return ctx->be->to_host(ctx, dst, kl__tensor_data(t), nbytes);
	kl_tensor *d = kl__eager_contiguous(ctx, t);
	if (!d)
		return ctx->status;
	kl_status st = ctx->be->to_host(ctx, dst, kl__tensor_data(d), nbytes);
	kl__tensor_discard(d);
	return st;
}

kl_status kl_to_host(kl_tensor *t, void *dst, size_t nbytes)
{
	if (!t)
		return kl__err(NULL, KL_EINVAL, "kl_to_host: input 0 is NULL");
	kl_ctx *ctx = t->ctx;
	size_t want = 0; /* a tensor's shape always passes (core/shape.h) */
	kl__shape_nbytes(t->ndim, t->shape, kl_dtype_size(t->dtype), &want);
	char b[192];
	if (nbytes != want)
		return kl__err(ctx, KL_EINVAL,
		               "kl_to_host: nbytes %zu does not match %s %s (%zu bytes)", nbytes,
		               kl_dtype_name(t->dtype),
		               kl__shape_str(b, sizeof b, t->ndim, t->shape), want);
	if (!dst && nbytes)
		return kl__err(ctx, KL_EINVAL, "kl_to_host: dst is NULL");
	kl_status st = sync_point(ctx, "kl_to_host", 1, &t);
	if (st != KL_OK)
		return st;
	return copy_out(ctx, t, dst, nbytes);
}

kl_status kl_item(kl_tensor *t, double *out)
{
	if (!t)
		return kl__err(NULL, KL_EINVAL, "kl_item: input 0 is NULL");
	kl_ctx *ctx = t->ctx;
	char b[192];
	if (kl_numel(t) != 1)
		return kl__err(ctx, KL_EINVAL, "kl_item: shape %s has %lld elements, not 1",
		               kl__shape_str(b, sizeof b, t->ndim, t->shape),
		               (long long)kl_numel(t));
	if (!out)
		return kl__err(ctx, KL_EINVAL, "kl_item: out is NULL");
	kl_status st = sync_point(ctx, "kl_item", 1, &t);
	if (st != KL_OK)
		return st;
	/* one element: its position is the offset whatever the strides */
	unsigned char v[8];
	st = ctx->be->to_host(ctx, v, kl__tensor_data(t), kl_dtype_size(t->dtype));
	if (st != KL_OK)
		return st;
	*out = kl__load(v, t->dtype, 0);
	return KL_OK;
}

kl_status kl_ctx_synchronize(kl_ctx *ctx)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_ctx_synchronize: ctx is NULL");
	/* inside a compiled function the graph so far must run before there is
	 * anything to wait for: a sync point like kl_item */
	kl_status st = sync_point(ctx, "kl_ctx_synchronize", 0, NULL);
	if (st != KL_OK)
		return st;
	return ctx->be->synchronize ? ctx->be->synchronize(ctx) : KL_OK;
}

kl_status kl_host_call(kl_ctx *ctx, kl_host_fn fn, kl_tensor *const *ts, int n, void *user)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_host_call: ctx is NULL");
	if (!fn)
		return kl__err(ctx, KL_EINVAL, "kl_host_call: fn is NULL");
	if (n < 0 || (n > 0 && !ts))
		return kl__err(ctx, KL_EINVAL, "kl_host_call: bad tensor list (n = %d)", n);
	for (int i = 0; i < n; i++) {
		if (!ts[i])
			return kl__err(ctx, KL_EINVAL, "kl_host_call: input %d is NULL", i);
		if (ts[i]->ctx != ctx)
			return kl__err(ctx, KL_EINVAL,
			               "kl_host_call: input %d belongs to another context", i);
	}
	kl_status st = sync_point(ctx, "kl_host_call", n, ts);
	if (st != KL_OK)
		return st;
	st = fn(ctx, ts, n, user);
	if (st != KL_OK && ctx->status == KL_OK)
		kl__err(ctx, st, "kl_host_call: the callback returned %s", kl_status_name(st));
	return st;
}

/* ---- printing ---------------------------------------------------------------- */

/* torch's layout: nested brackets aligned under "tensor(", every element
 * padded to one width, rows wrapped at 80 columns, and above 1000 elements
 * only 3 items at each edge of every dim with "..." between. Floats use
 * 4 decimals, or scientific notation when the magnitudes span too much,
 * or "1." style when all are integral. */
enum { PR_INT, PR_BOOL, PR_FIX, PR_SCI, PR_INTF };
#define PR_EDGE 3
#define PR_LIMIT 1000
#define PR_LINE 80

typedef struct stats {
	double maxabs, minabs; /* over finite values; minabs over nonzero ones */
	bool any, all_int;
} stats;

typedef struct printer {
	FILE *f;
	const void *data;
	kl_dtype dt;
	int ndim;
	const int64_t *shape;
	int64_t strides[KL_MAX_DIMS];
	bool summarize;
	int mode, width;
	stats st;
} printer;

static int fmt_elem(const printer *p, char *buf, size_t cap, double v)
{
	switch (p->mode) {
	case PR_BOOL:
		return snprintf(buf, cap, "%s", v != 0 ? "true" : "false");
	case PR_INT:
		return snprintf(buf, cap, "%.0f", v);
	default:
		break;
	}
	if (isnan(v))
		return snprintf(buf, cap, "nan");
	if (isinf(v))
		return snprintf(buf, cap, "%sinf", v < 0 ? "-" : "");
	if (p->mode == PR_INTF)
		return snprintf(buf, cap, "%.0f.", v);
	if (p->mode == PR_SCI)
		return snprintf(buf, cap, "%.4e", v);
	return snprintf(buf, cap, "%.4f", v);
}

/* calls fn on every element that will be shown */
static void visit(printer *p, int d, int64_t base, void (*fn)(printer *, double))
{
	if (d == p->ndim) {
		fn(p, kl__load(p->data, p->dt, base));
		return;
	}
	int64_t n = p->shape[d];
	for (int64_t i = 0; i < n; i++) {
		if (p->summarize && n > 2 * PR_EDGE && i == PR_EDGE)
			i = n - PR_EDGE;
		visit(p, d + 1, base + i * p->strides[d], fn);
	}
}

static void scan_elem(printer *p, double v)
{
	if (!isfinite(v))
		return;
	double a = fabs(v);
	if (v != trunc(v))
		p->st.all_int = false;
	if (a > p->st.maxabs)
		p->st.maxabs = a;
	if (a != 0 && (!p->st.any || a < p->st.minabs)) {
		p->st.minabs = a;
		p->st.any = true;
	}
}

static void width_elem(printer *p, double v)
{
	char buf[64];
	int w = fmt_elem(p, buf, sizeof buf, v);
	if (w > p->width)
		p->width = w;
}

static void print_elem(const printer *p, double v)
{
	char buf[64];
	fmt_elem(p, buf, sizeof buf, v);
	fprintf(p->f, "%*s", p->width, buf);
}

static void print_rec(const printer *p, int d, int64_t base, int indent)
{
	int64_t n = p->shape[d];
	bool cut = p->summarize && n > 2 * PR_EDGE;
	fputc('[', p->f);
	if (d == p->ndim - 1) {
		int per_line = (PR_LINE - indent) / (p->width + 2);
		if (per_line < 1 || cut)
			per_line = (int)(cut ? 2 * PR_EDGE + 1 : 1);
		int col = 0;
		for (int64_t i = 0; i < n; i++) {
			if (i > 0) {
				if (col == per_line) {
					fprintf(p->f, ",\n%*s", indent + 1, "");
					col = 0;
				} else {
					fputs(", ", p->f);
				}
			}
			if (cut && i == PR_EDGE) {
				fputs(" ...", p->f); /* torch pads it so */
				col++;
				i = n - PR_EDGE - 1;
				continue;
			}
			print_elem(p, kl__load(p->data, p->dt, base + i * p->strides[d]));
			col++;
		}
	} else {
		for (int64_t i = 0; i < n; i++) {
			if (i > 0) {
				fputc(',', p->f);
				for (int k = 0; k < p->ndim - d - 1; k++)
					fputc('\n', p->f);
				fprintf(p->f, "%*s", indent + 1, "");
			}
			if (cut && i == PR_EDGE) {
				fputs("...", p->f);
				i = n - PR_EDGE - 1;
				continue;
			}
			print_rec(p, d + 1, base + i * p->strides[d], indent + 1);
		}
	}
	fputc(']', p->f);
}

static void print_values(printer *p)
{
	if (p->dt == KL_BOOL) {
		p->mode = PR_BOOL;
	} else if (!kl_dtype_is_float(p->dt)) {
		p->mode = PR_INT;
	} else {
		p->st = (stats){0, 0, false, true};
		visit(p, 0, 0, scan_elem);
		stats s = p->st;
		/* torch's _Formatter: integral values switch to scientific only
		 * on range, others also when tiny */
		if (s.any && (s.maxabs / s.minabs > 1000 || s.maxabs > 1e8 ||
		              (!s.all_int && s.minabs < 1e-4)))
			p->mode = PR_SCI;
		else if (s.all_int)
			p->mode = PR_INTF;
		else
			p->mode = PR_FIX;
	}
	p->width = 0;
	visit(p, 0, 0, width_elem);
	const int indent = 7; /* strlen("tensor(") */
	if (p->ndim == 0)
		print_elem(p, kl__load(p->data, p->dt, 0));
	else
		print_rec(p, 0, 0, indent);
}

kl_status kl_print(kl_tensor *t, FILE *f)
{
	if (!t)
		return kl__err(NULL, KL_EINVAL, "kl_print: input 0 is NULL");
	kl_ctx *ctx = t->ctx;
	if (!f)
		return kl__err(ctx, KL_EINVAL, "kl_print: FILE is NULL");
	kl_status st = sync_point(ctx, "kl_print", 1, &t);
	if (st != KL_OK)
		return st;
	int64_t numel = kl_numel(t);
	char shape[192];
	kl__shape_str(shape, sizeof shape, t->ndim, t->shape);
	if (numel == 0) {
		fprintf(f, "tensor([], size=%s, dtype=%s)\n", shape, kl_dtype_name(t->dtype));
		return KL_OK;
	}
	size_t nbytes = 0;
	kl__shape_nbytes(t->ndim, t->shape, kl_dtype_size(t->dtype), &nbytes);
	void *host = malloc(nbytes);
	if (!host)
		return kl__err(ctx, KL_ENOMEM, "kl_print: out of memory for %zu bytes", nbytes);
	st = copy_out(ctx, t, host, nbytes);
	if (st != KL_OK) {
		free(host);
		return st;
	}
	printer p = {.f = f,
	             .data = host,
	             .dt = t->dtype,
	             .ndim = t->ndim,
	             .shape = t->shape,
	             .summarize = numel > PR_LIMIT};
	kl__contig_strides(t->ndim, t->shape, p.strides);
	fputs("tensor(", f);
	print_values(&p);
	fprintf(f, ", size=%s, dtype=%s)\n", shape, kl_dtype_name(t->dtype));
	free(host);
	return KL_OK;
}
