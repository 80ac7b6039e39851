/* export.c - kl_export: trace a function once into one whole graph (a
 * fullgraph kl_fn: a sync point is refused), keep its declared dynamic dims
 * symbolic, name its parameters, and compile it keeping the kernels'
 * binary (CPU) or lower it for CUDA and build cubins + PTX with NVRTC (CUDA
 * packages, on any machine); kl_exported_package writes the package
 * (runtime/package.c).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "capture/capture.h"
#include "runtime/package.h"
#include "runtime/package_cuda.h"

struct kl_exported {
	kl_ctx *ctx;
	kl_fn *f;         /* holds the captured parameters */
	kl_compiled *c;   /* the graph compiled again, its binary kept */
	kl_pkg_manifest m;
	kl_tensor **params; /* m.params' tensors (borrowed from f's variant) */
	uint8_t *kernels;   /* CUDA: the kernels section (package_cuda.c) */
	size_t kernels_len;
};

void kl_exported_free(kl_exported *e)
{
	if (!e)
		return;
	kl__compiled_free(e->c);
	kl_fn_free(e->f);
	kl__pkg_manifest_free(&e->m);
	free(e->params);
	free(e->kernels);
	free(e);
}

static kl_exported *fail(kl_exported *e)
{
	kl_exported_free(e);
	return NULL;
}

/* The declared dims: checked, and gathered into the manifest's dims (one per
 * name) and per input a mask and per dim the dim's index. */
static kl_status take_dims(kl_ctx *ctx, int nin, kl_tensor *const *ex, const kl_export_opts *o,
                           kl_pkg_manifest *m, uint32_t *masks)
{
	int n = o ? o->ndims : 0;
	if (n < 0 || (n > 0 && !o->dims))
		return kl__err(ctx, KL_EINVAL, "kl_export: ndims is %d but dims is NULL", n);
	m->dims = calloc((size_t)n + 1, sizeof *m->dims);
	if (!m->dims)
		return kl__err(ctx, KL_ENOMEM, "kl_export: out of memory");
	for (int k = 0; k < n; k++) {
		const kl_dim_spec *s = &o->dims[k];
		if (s->input < 0 || s->input >= nin || s->dim < 0 || s->dim >= ex[s->input]->ndim)
			return kl__err(ctx, KL_EINVAL,
			               "kl_export: dims[%d] names input %d dim %d, which the example "
			               "inputs do not have",
			               k, s->input, s->dim);
		if (!s->name || !kl__pkg_name_ok(s->name) || strlen(s->name) >= 64)
			return kl__err(ctx, KL_EINVAL,
			               "kl_export: dims[%d]'s name must be 1-63 bytes of "
			               "[A-Za-z0-9_.:/+-]",
			               k);
		int64_t v = ex[s->input]->shape[s->dim];
		if (s->min < 0 || s->max < s->min || v < s->min || v > s->max || v < 2)
			return kl__err(ctx, KL_EINVAL,
			               "kl_export: dim %s: the example's size %" PRId64
			               " must lie in [min, max] = [%" PRId64 ", %" PRId64
			               "], min >= 0, and be at least 2",
			               s->name, v, s->min, s->max);
		int j = 0;
		while (j < m->ndims && strcmp(m->dims[j].name, s->name) != 0)
			j++;
		if (j == m->ndims) {
			snprintf(m->dims[j].name, sizeof m->dims[j].name, "%s", s->name);
			m->dims[j].min = s->min;
			m->dims[j].max = s->max;
			m->ndims++;
		} else if (m->dims[j].min != s->min || m->dims[j].max != s->max)
			return kl__err(ctx, KL_EINVAL, "kl_export: dim %s is declared with two ranges",
			               s->name);
		if (m->in[s->input].dim[s->dim] >= 0)
			return kl__err(ctx, KL_EINVAL, "kl_export: input %d dim %d is declared twice",
			               s->input, s->dim);
		m->in[s->input].dim[s->dim] = j;
		masks[s->input] |= KL_DIM(s->dim);
	}
	return KL_OK;
}

/* t's name: the one given for it, else (a buffer that named parameters are
 * views of, e.g. a FeedForward's packed gate and up weights) their names
 * joined by '+', into buf; NULL when neither. */
static const char *param_name(const kl_export_opts *o, const kl_tensor *t, char *buf, size_t cap)
{
	if (!o || !o->params || !o->param_names)
		return NULL;
	for (int i = 0; i < o->nparams; i++)
		if (o->params[i] == t)
			return o->param_names[i];
	size_t n = 0;
	buf[0] = '\0';
	for (int i = 0; i < o->nparams; i++)
		if (o->params[i] && o->params[i]->st && o->params[i]->st == t->st &&
		    o->param_names[i]) {
			int w = snprintf(buf + n, cap - n, "%s%s", n ? "+" : "", o->param_names[i]);
			if (w < 0 || (size_t)w >= cap - n)
				return NULL;
			n += (size_t)w;
		}
	return n ? buf : NULL;
}

static void fill_tensor(kl_pkg_tensor *pt, const char *name, kl_dtype dt, int ndim,
                        const int64_t *shape)
{
	snprintf(pt->name, sizeof pt->name, "%s", name);
	pt->dtype = dt;
	pt->ndim = ndim;
	for (int d = 0; d < ndim; d++) {
		pt->shape[d] = shape[d];
		pt->dim[d] = -1;
	}
	pt->nbytes = kl_dtype_size(dt);
	for (int d = 0; d < ndim; d++)
		pt->nbytes *= (uint64_t)shape[d];
}

kl_exported *kl_export(kl_ctx *ctx, kl_fn_body fn, void *user, int nin, int nout,
                       kl_tensor *const *example, const kl_export_opts *o)
{
	if (!ctx)
		return NULL;
	if (!fn || nin < 0 || nout < 1 || (nin > 0 && !example))
		return kl__err(ctx, KL_EINVAL,
		               "kl_export: fn, example and nout >= 1 are required (nin %d, nout %d)",
		               nin, nout),
		       NULL;
	int arch = o ? o->cuda_arch : 0;
	if (ctx->device == KL_CUDA && arch == 0)
		arch = kl__cuda_arch(ctx);
	if (arch != 0 && (arch < 30 || arch > 999 || arch % 10 > 9))
		return kl__err(ctx, KL_EINVAL,
		               "kl_export: cuda_arch %d is not an architecture (90 for sm_90)", arch),
		       NULL;
	if (ctx->device != KL_CPU && ctx->device != KL_CUDA)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_export: packages are built on a CPU or CUDA context"),
		       NULL;
	kl_exported *e = calloc(1, sizeof *e);
	uint32_t *masks = calloc((size_t)nin + 1, sizeof *masks);
	if (!e || !masks) {
		free(masks);
		free(e);
		return kl__err(ctx, KL_ENOMEM, "kl_export: out of memory"), NULL;
	}
	e->ctx = ctx;
	kl_pkg_manifest *m = &e->m;
	if (arch)
		snprintf(m->target, sizeof m->target, "cuda-sm_%d", arch);
	else
		snprintf(m->target, sizeof m->target, "%s", kl__pkg_host_target());
	m->nin = nin;
	m->nout = nout;
	m->in = calloc((size_t)nin + 1, sizeof *m->in);
	m->out = calloc((size_t)nout + 1, sizeof *m->out);
	m->outsrc = calloc((size_t)nout + 1, sizeof *m->outsrc);
	if (!m->in || !m->out || !m->outsrc) {
		free(masks);
		kl__err(ctx, KL_ENOMEM, "kl_export: out of memory");
		return fail(e);
	}
	for (int i = 0; i < nin; i++) {
		kl_tensor *x = example[i];
		char nm[32];
		snprintf(nm, sizeof nm, "input%d", i);
		const char *name = o && o->input_names ? o->input_names[i] : nm;
		if (!x || !x->st || x->ctx != ctx || !kl_is_contiguous(x)) {
			free(masks);
			kl__err(ctx, KL_EINVAL,
			        "kl_export: example input %d must be a dense, materialized tensor of "
			        "this context",
			        i);
			return fail(e);
		}
		if (!kl__pkg_name_ok(name)) {
			free(masks);
			kl__err(ctx, KL_EINVAL, "kl_export: input %d's name must be [A-Za-z0-9_.:/+-]", i);
			return fail(e);
		}
		fill_tensor(&m->in[i], name, x->dtype, x->ndim, x->shape);
	}
	if (take_dims(ctx, nin, example, o, m, masks) != KL_OK) {
		free(masks);
		return fail(e);
	}
	kl_compile_opts co = {.mode = o ? o->mode : KL_MODE_DEFAULT,
	                      .fullgraph = true,
	                      .ndynamic_dims = nin,
	                      .dynamic_dims = masks};
	e->f = kl_compile(ctx, fn, user, nin, nout, &co);
	kl_tensor **outs = calloc((size_t)nout, sizeof *outs);
	bool grad = kl_set_grad_enabled(ctx, false);
	kl_status st = !e->f ? kl_last_status(ctx)
	               : !outs ? kl__err(ctx, KL_ENOMEM, "kl_export: out of memory")
	                       : kl_fn_call(e->f, example, outs);
	kl_set_grad_enabled(ctx, grad);
	free(masks);
	if (st != KL_OK) {
		char msg[512];
		snprintf(msg, sizeof msg, "%s", kl_last_error(ctx));
		kl__err(ctx, st, "kl_export: tracing fn failed: %s", msg);
		free(outs);
		return fail(e);
	}
	for (int k = 0; k < nout; k++)
		kl_release(outs[k]);
	free(outs);
	kl_variant *v = e->f->last;
	if (!v || v->nsegs != 1 || !v->segs[0].e || !v->replay || v->segs[0].after[0] ||
	    v->nrng > 0) {
		kl__err(ctx, KL_EUNSUPPORTED,
		        "kl_export: fn is not one whole graph of pure ops (%s)",
		        !v || !v->segs || !v->nsegs || !v->segs[0].e ? "it computes nothing lazily"
		        : v->segs[0].after[0]                        ? v->segs[0].after
		        : v->nrng > 0 ? "it draws from the context's generator (kl_dropout_rng in "
		                        "training mode): a package would repeat one mask"
		                      : "it writes in place or records for autograd");
		return fail(e);
	}
	const kl_compiled *c0 = v->segs[0].e->c;
	const kl_graph *g = &c0->g;
	/* every declared dim stayed a symbol */
	for (int i = 0; i < g->ninputs; i++) {
		if (v->in_src[i] < 0)
			continue;
		const kl_pkg_tensor *t = &m->in[v->in_src[i]];
		for (int d = 0; d < t->ndim; d++) {
			if (t->dim[d] < 0)
				continue;
			if (c0->src_sym && c0->src_sym[(size_t)g->inputs[i] * KL_MAX_DIMS + d] > 0)
				continue;
			const char *why = "the compiled graph keeps it static";
			for (int s = 0; s < c0->nspec; s++)
				if (c0->spec[s].input == i && c0->spec[s].dim == d)
					why = c0->spec[s].why;
			kl__err(ctx, KL_EUNSUPPORTED,
			        "kl_export: dim %s (input '%s' dim %d) cannot stay dynamic: %s",
			        m->dims[t->dim[d]].name, t->name, d, why);
			return fail(e);
		}
	}
	/* compiled again with the binary's bytes kept (a disk-cache hit) */
	uint32_t *gm = calloc((size_t)g->ninputs + 1, sizeof *gm);
	if (!gm) {
		kl__err(ctx, KL_ENOMEM, "kl_export: out of memory");
		return fail(e);
	}
	bool any = false;
	for (int i = 0; c0->src_sym && i < g->ninputs; i++)
		for (int d = 0; d < g->nodes[g->inputs[i]].ndim; d++)
			if (c0->src_sym[(size_t)g->inputs[i] * KL_MAX_DIMS + d] > 0) {
				gm[i] |= KL_DIM(d);
				any = true;
			}
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT,
	                      .fusion = e->f->fusion,
	                      .dyn_masks = any ? gm : NULL,
	                      .name = e->f->name,
	                      .keep_binary = !arch,
	                      .lower_for_cuda = arch != 0};
	e->c = kl__compile(ctx, g, &cfg);
	free(gm);
	if (!e->c)
		return fail(e);
	if (arch) {
		/* cubins + PTX; the launch choices the traced variant made when it
		 * ran on this GPU (max-autotune) */
		kl_pkg_cuda sec;
		kl_status bs = kl__pkg_cuda_build(ctx, "kl_export", &e->c->prog, arch, &sec);
		uint8_t *ch = NULL;
		size_t chn = 0;
		if (bs == KL_OK && c0->cuda && c0->prog.nsteps == e->c->prog.nsteps)
			bs = kl__pkg_cuda_choices(ctx, c0, &ch, &chn);
		sec.choices = ch;
		sec.choices_len = chn;
		if (bs == KL_OK && kl__pkg_cuda_write(&sec, &e->kernels, &e->kernels_len) != KL_OK)
			bs = kl__err(ctx, KL_ENOMEM, "kl_export: out of memory");
		free(ch);
		kl__pkg_cuda_images_free(&sec);
		if (bs != KL_OK)
			return fail(e);
	}
	const kl_program *p = &e->c->prog;
	if (p->nkernels > 0 && !arch && !e->c->bin) {
		kl__err(ctx, KL_EIO, "kl_export: the kernels' binary could not be read back");
		return fail(e);
	}
	/* parameters: the captured tensors, by name */
	m->nparams = v->ncaptured;
	m->params = calloc((size_t)m->nparams + 1, sizeof *m->params);
	e->params = calloc((size_t)m->nparams + 1, sizeof *e->params);
	m->ngin = g->ninputs;
	m->gin = calloc((size_t)g->ninputs + 1, sizeof *m->gin);
	if (!m->params || !e->params || !m->gin) {
		kl__err(ctx, KL_ENOMEM, "kl_export: out of memory");
		return fail(e);
	}
	for (int k = 0; k < v->ncaptured; k++) {
		kl_tensor *t = v->captured[k];
		char nm[32];
		snprintf(nm, sizeof nm, "captured.%d", k);
		char joined[KL_PKG_NAME_MAX];
		const char *name = param_name(o, t, joined, sizeof joined);
		if (!name)
			name = nm;
		if (!kl__pkg_name_ok(name)) {
			kl__err(ctx, KL_EINVAL,
			        "kl_export: parameter name '%.40s' must be 1-127 bytes of "
			        "[A-Za-z0-9_.:/+-]",
			        name);
			return fail(e);
		}
		for (int j = 0; j < k; j++)
			if (!strcmp(m->params[j].name, name)) {
				kl__err(ctx, KL_EINVAL, "kl_export: two parameters are named '%s'", name);
				return fail(e);
			}
		if (!t->st || !kl_is_contiguous(t)) {
			kl__err(ctx, KL_EUNSUPPORTED,
			        "kl_export: parameter '%s' is not dense (packages hold dense weights)",
			        name);
			return fail(e);
		}
		fill_tensor(&m->params[k], name, t->dtype, t->ndim, t->shape);
		e->params[k] = t;
	}
	for (int i = 0; i < g->ninputs; i++)
		m->gin[i] = v->in_src[i];
	/* outputs: graph outputs, shapes as the plan computes them */
	for (int k = 0; k < nout; k++) {
		char nm[32];
		snprintf(nm, sizeof nm, "output%d", k);
		const char *name = o && o->output_names ? o->output_names[k] : nm;
		if (v->out_src[k] < 0) {
			kl__err(ctx, KL_EUNSUPPORTED,
			        "kl_export: output %d is an input or parameter returned as is (return "
			        "a copy: kl_contiguous)",
			        k);
			return fail(e);
		}
		if (!kl__pkg_name_ok(name)) {
			kl__err(ctx, KL_EINVAL, "kl_export: output %d's name must be [A-Za-z0-9_.:/+-]", k);
			return fail(e);
		}
		m->outsrc[k] = v->out_src[k];
		const kl_buf *bf = NULL;
		for (int32_t b = 0; b < p->nbufs && !bf; b++)
			if (p->bufs[b].role == KL_BUF_OUTPUT && p->bufs[b].index == m->outsrc[k])
				bf = &p->bufs[b];
		if (!bf) {
			kl__err(ctx, KL_EFORMAT, "kl_export: output %d is missing from the plan", k);
			return fail(e);
		}
		int64_t shape[KL_MAX_DIMS];
		for (int d = 0; d < bf->ndim; d++)
			shape[d] = bf->shape[d].v;
		fill_tensor(&m->out[k], name, bf->dtype, bf->ndim, shape);
		for (int d = 0; d < bf->ndim; d++) {
			int32_t s = bf->shape[d].sym;
			if (s <= 0)
				continue;
			int32_t gi = p->sym_input[s - 1];
			int32_t src = v->in_src[gi];
			m->out[k].dim[d] = src >= 0 ? m->in[src].dim[p->sym_dim[s - 1]] : -1;
		}
	}
	return e;
}

kl_status kl_exported_print(const kl_exported *e, FILE *out)
{
	if (!e || !out)
		return KL_EINVAL;
	const kl_pkg_manifest *m = &e->m;
	fprintf(out, "kiln exported program (target %s)\n", m->target);
	for (int i = 0; i < m->ndims; i++)
		fprintf(out, "  dim %s in [%" PRId64 ", %" PRId64 "]\n", m->dims[i].name, m->dims[i].min,
		        m->dims[i].max);
	const char *titles[3] = {"input", "output", "param"};
	const kl_pkg_tensor *lists[3] = {m->in, m->out, m->params};
	int counts[3] = {m->nin, m->nout, m->nparams};
	for (int l = 0; l < 3; l++)
		for (int i = 0; i < counts[l]; i++) {
			const kl_pkg_tensor *t = &lists[l][i];
			fprintf(out, "  %-6s %-32s %-4s [", titles[l], t->name, kl_dtype_name(t->dtype));
			for (int d = 0; d < t->ndim; d++) {
				if (t->dim[d] >= 0)
					fprintf(out, "%s%s", d ? ", " : "", m->dims[t->dim[d]].name);
				else
					fprintf(out, "%s%" PRId64, d ? ", " : "", t->shape[d]);
			}
			fprintf(out, "]\n");
		}
	/* the constraints the trace relied on: the sizes it kept, tied dims */
	fprintf(out, "  constraints: every dim not listed above is static at its traced size\n");
	for (int s = 0; s < e->c->nspec; s++)
		fprintf(out, "    graph input %d dim %d = %" PRId64 ": %s\n", (int)e->c->spec[s].input,
		        (int)e->c->spec[s].dim, e->c->spec[s].value, e->c->spec[s].why);
	fprintf(out, "  graph:\n");
	kl__graph_print(&e->c->g, out);
	return KL_OK;
}

kl_status kl_exported_package(kl_exported *e, const char *path)
{
	if (!e)
		return KL_EINVAL;
	kl_ctx *ctx = e->ctx;
	if (!path)
		return kl__err(ctx, KL_EINVAL, "kl_exported_package: path is NULL");
	uint8_t *bytes = NULL;
	size_t len = 0;
	kl_status st = e->kernels ? kl__pkg_write(ctx, &e->m, &e->c->prog, e->kernels,
	                                          e->kernels_len, e->params, &bytes, &len)
	                          : kl__pkg_write(ctx, &e->m, &e->c->prog, e->c->bin,
	                                          e->c->bin_len, e->params, &bytes, &len);
	if (st != KL_OK)
		return st;
	char tmp[4096];
	if (snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid()) >= (int)sizeof tmp) {
		free(bytes);
		return kl__err(ctx, KL_EINVAL, "kl_exported_package: path too long");
	}
	FILE *f = fopen(tmp, "wb");
	bool ok = f && fwrite(bytes, 1, len, f) == len;
	int err = errno;
	if (f && fclose(f) != 0 && ok) {
		ok = false;
		err = errno;
	}
	free(bytes);
	if (!ok || rename(tmp, path) != 0) {
		if (ok)
			err = errno;
		remove(tmp);
		return kl__err(ctx, KL_EIO, "kl_exported_package: cannot write %s: %s", path,
		               strerror(err));
	}
	return KL_OK;
}
