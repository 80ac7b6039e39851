/* explain.c - what a compiled function became, in words: kl_explain's report
 * (variants, guards, graphs and their breaks, kernels with the nodes fused
 * into each, memory) and the graph diff that recompile logs quote.
 */
#include <inttypes.h>
#include <stdio.h>

#include "capture/capture.h"

static const char *const mode_names[] = {"default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs"};

void kl__guard_str(const kl_guard *g, char *buf, size_t cap)
{
	size_t n = 0;
	n += (size_t)snprintf(buf + n, cap - n, "%s [", kl_dtype_name(g->dtype));
	for (int d = 0; d < g->ndim && n < cap; d++)
		n += (size_t)(g->dyn >> d & 1 ? snprintf(buf + n, cap - n, "%s*", d ? "," : "")
		                              : snprintf(buf + n, cap - n, "%s%" PRId64,
		                                         d ? "," : "", g->shape[d]));
	if (n >= cap)
		return;
	if (g->dyn) {
		snprintf(buf + n, cap - n, "] dense (* = dynamic dim)");
		return;
	}
	char s[128];
	snprintf(buf + n, cap - n, "] strides %s", kl__shape_str(s, sizeof s, g->ndim, g->strides));
}

static const char *op_name(int op)
{
	return op >= 0 && op < KL_NOPS ? kl__ops[op].name : "?";
}

void kl__graph_diff(const kl_graph *a, const kl_graph *b, char *buf, size_t cap)
{
	char x[128], y[128];
	if (a->ninputs != b->ninputs) {
		snprintf(buf, cap, "inputs: %d -> %d", (int)a->ninputs, (int)b->ninputs);
		return;
	}
	for (int32_t i = 0; i < a->ninputs; i++) {
		const kl_node *p = &a->nodes[a->inputs[i]], *q = &b->nodes[b->inputs[i]];
		if (p->dtype != q->dtype) {
			snprintf(buf, cap, "input %d dtype: %s -> %s", (int)i,
			         kl_dtype_name((kl_dtype)p->dtype),
			         kl_dtype_name((kl_dtype)q->dtype));
			return;
		}
		if (p->ndim != q->ndim) {
			snprintf(buf, cap, "input %d rank: %d -> %d", (int)i, p->ndim, q->ndim);
			return;
		}
		for (int d = 0; d < p->ndim; d++)
			if (p->shape[d] != q->shape[d]) {
				snprintf(buf, cap, "input %d dim %d: %" PRId64 " -> %" PRId64,
				         (int)i, d, p->shape[d], q->shape[d]);
				return;
			}
		if (memcmp(p->strides, q->strides, sizeof(int64_t) * p->ndim) != 0) {
			snprintf(buf, cap, "input %d strides: %s -> %s", (int)i,
			         kl__shape_str(x, sizeof x, p->ndim, p->strides),
			         kl__shape_str(y, sizeof y, q->ndim, q->strides));
			return;
		}
	}
	int32_t n = a->n < b->n ? a->n : b->n;
	for (int32_t i = 0; i < n; i++) {
		const kl_node *p = &a->nodes[i], *q = &b->nodes[i];
		const char *name = op_name(p->op);
		if (p->op != q->op) {
			snprintf(buf, cap, "node %d: op %s -> %s", (int)i, name, op_name(q->op));
			return;
		}
		if (p->dtype != q->dtype) {
			snprintf(buf, cap, "node %d (%s) dtype: %s -> %s", (int)i, name,
			         kl_dtype_name((kl_dtype)p->dtype),
			         kl_dtype_name((kl_dtype)q->dtype));
			return;
		}
		if (p->ndim != q->ndim ||
		    memcmp(p->shape, q->shape, sizeof(int64_t) * p->ndim) != 0) {
			snprintf(buf, cap, "node %d (%s) shape: %s -> %s", (int)i, name,
			         kl__shape_str(x, sizeof x, p->ndim, p->shape),
			         kl__shape_str(y, sizeof y, q->ndim, q->shape));
			return;
		}
		for (int k = 0; k < 2; k++)
			if (memcmp(&p->a.s[k], &q->a.s[k], sizeof(double)) != 0) {
				snprintf(buf, cap, "node %d (%s) scalar %d: %.9g -> %.9g", (int)i,
				         name, k, p->a.s[k], q->a.s[k]);
				return;
			}
		if (memcmp(&p->a, &q->a, sizeof p->a) != 0) {
			snprintf(buf, cap, "node %d (%s) attributes changed", (int)i, name);
			return;
		}
		if (p->nin != q->nin || memcmp(p->in, q->in, sizeof(int32_t) * p->nin) != 0) {
			snprintf(buf, cap, "node %d (%s) inputs rewired", (int)i, name);
			return;
		}
	}
	if (a->n != b->n) {
		snprintf(buf, cap, "%d nodes -> %d nodes (node %d %s)", (int)a->n, (int)b->n,
		         (int)n, a->n > b->n ? "dropped" : "added");
		return;
	}
	if (a->noutputs != b->noutputs ||
	    memcmp(a->outputs, b->outputs, sizeof(int32_t) * (size_t)a->noutputs) != 0) {
		snprintf(buf, cap, "outputs: %d -> %d tensors", (int)a->noutputs, (int)b->noutputs);
		return;
	}
	snprintf(buf, cap, "dynamic dims differ");
}

static void print_dynamic(const kl_fn *f, FILE *out)
{
	if (f->o.dynamic == KL_DYNAMIC_ALL) {
		fputs("dynamic: all dims requested (KL_DYNAMIC_ALL; each variant says which stayed "
		      "symbolic)",
		      out);
		return;
	}
	bool any = false;
	for (int i = 0; i < f->nin; i++)
		if (f->dyn[i]) {
			fprintf(out, "%sinput %d dims", any ? "; " : "dynamic: ", i);
			for (int d = 0; d < KL_MAX_DIMS; d++)
				if (f->dyn[i] >> d & 1)
					fprintf(out, " %d", d);
			any = true;
		}
	if (!any)
		fputs("static shapes", out);
}

/* The dims the caller marked dynamic, as variant v compiled them: symbolic
 * (one plan for every size) or specialised, with why. */
static void print_dims(const kl_fn *f, const kl_variant *v, FILE *out)
{
	bool head = false;
	for (int i = 0; i < f->nin; i++)
		for (int d = 0; d < v->g[i].ndim; d++) {
			if (!(f->dyn[i] >> d & 1))
				continue;
			if (!head)
				fputs("    dynamic dims:\n", out);
			head = true;
			if (v->g[i].dyn >> d & 1) {
				fprintf(out, "      input %d dim %d: symbolic (traced at %" PRId64
				             "; every size runs this variant's plan)\n",
				        i, d, v->g[i].shape[d]);
				continue;
			}
			const kl_vspec *sp = NULL;
			for (int k = 0; k < v->nspec && !sp; k++)
				if (v->spec[k].input == i && v->spec[k].dim == d)
					sp = &v->spec[k];
			if (sp)
				fprintf(out, "      input %d dim %d: specialised to %" PRId64 ": %s\n", i,
				        d, sp->value, sp->why);
			else
				fprintf(out, "      input %d dim %d: specialised to %" PRId64 "\n", i, d,
				        v->g[i].shape[d]);
		}
}

void kl__capture_explain(const kl_fn *f, FILE *out)
{
	fprintf(out, "kl_fn %s: %d inputs, %d outputs, mode %s%s%s, ", f->name, f->nin, f->nout,
	        mode_names[f->o.mode], f->o.fullgraph ? ", fullgraph" : "",
	        f->o.disable ? ", disabled" : "");
	print_dynamic(f, out);
	fprintf(out, ", recompile limit %d%s\n", f->limit,
	        f->fusion ? "" : ", fusion off (KILN_DISABLE_FUSION)");
	if (f->nbk > 0) {
		fprintf(out, "  buckets (batch padded up to the nearest): %d sizes, %" PRId64 "..%" PRId64
		        "; batch dims:", f->nbk, f->bk[0], f->bk[f->nbk - 1]);
		for (int i = 0; i < f->nin; i++)
			if (f->bk_in[i] >= 0)
				fprintf(out, " input %d dim %d", i, f->bk_in[i]);
		fprintf(out, "; %ld calls padded\n", f->padded_calls);
	}
	if (f->o.mode != KL_MODE_DEFAULT && f->ctx->device == KL_CPU)
		fprintf(out,
		        "  note: mode %s behaves as default on the CPU (no CUDA graphs, no "
		        "autotuning): the same plans run\n",
		        mode_names[f->o.mode]);
	if (f->o.disable)
		fputs("  disabled: fn runs eagerly on every call (one kernel per op)\n", out);
	fprintf(out,
	        "  calls: %ld (%ld replayed without calling fn, %ld eager, %ld failed); compiles: "
	        "%d; variants: %d; ",
	        f->calls, f->replays, f->eager_calls, f->failed_calls, f->compiles, f->nvars);
	if (f->last_kernels < 0)
		fputs(f->last_failed ? "the last call failed; none has succeeded yet\n"
		                     : "not called yet\n",
		      out);
	else if (f->last_failed)
		fprintf(out, "the last call failed; the last that succeeded launched %d kernels\n",
		        f->last_kernels);
	else
		fprintf(out, "last call launched %d kernels\n", f->last_kernels);
	if (f->eager) {
		int best = 0;
		for (int i = 1; i < 8; i++)
			if (f->tally[i].count > f->tally[best].count)
				best = i;
		fprintf(out,
		        "  over the recompile limit: runs eagerly now; guard '%s' kept failing "
		        "(last: %s)\n",
		        f->tally[best].name, f->last_fail);
	}
	char buf[256];
	/* CUDA graphs: a call's graphs are its captured pieces */
	bool graphs = kl__fn_graphs(f);
	for (int vi = 0; vi < f->nvars; vi++) {
		const kl_variant *v = f->vars[vi];
		fprintf(out, "  variant %d: %ld calls%s", v->id, v->calls,
		        v->replay ? ", replays its plan without calling fn (fullgraph)" : "");
		if (v->replay && v->nw > 0)
			fprintf(out, ", repeating its %d write%s in place", v->nw, v->nw == 1 ? "" : "s");
		fputc('\n', out);
		fputs("    guards:\n", out);
		for (int i = 0; i < f->nin; i++) {
			kl__guard_str(&v->g[i], buf, sizeof buf);
			fprintf(out, "      input %d: %s\n", i, buf);
		}
		print_dims(f, v, out);
		if (v->bw_taped && v->bw_joint)
			fprintf(out,
			        "    saved for a kl_backward after the call: %d tensors, %" PRId64
			        " bytes (min-cut of the joint graph; %d values computed again in the "
			        "backward)\n",
			        v->bw_saved, v->bw_bytes, v->bw_recompute);
		else if (v->bw_taped)
			fprintf(out,
			        "    saved for a kl_backward after the call: %d tensors, %" PRId64
			        " bytes (every taped value: no joint graph)\n",
			        v->bw_saved, v->bw_bytes);
		if (v->nsegs == 0)
			fputs("    no graph recorded yet\n", out);
		for (int s = 0; s < v->nsegs; s++) {
			const kl_seg *sg = &v->segs[s];
			fprintf(out, "    graph %d: %d ops", s, sg->nops);
			if (sg->reason[0])
				fprintf(out,
				        ", ended by a graph break: %s (after op %s#%d); the graph "
				        "so far ran and graph %d continued",
				        sg->reason, op_name(sg->last_op), sg->last_node, s + 1);
			else
				fputs(", ended at fn's return", out);
			if (sg->e)
				fprintf(out, "; key %016" PRIx64 "\n", sg->e->key);
			else
				fputs("; nothing lazy to compute\n", out);
			if (sg->e)
				kl__compiled_explain(sg->e->c, out, "      ");
			if (sg->e && graphs) {
				double ms = 0;
				long nc = kl__cuda_rt_captures(sg->e->c, &ms);
				fprintf(out,
				        "      CUDA graph (piece %d of %d): %ld captured (%.2f ms), %ld "
				        "launches\n",
				        s + 1, v->nsegs, nc, ms, kl__cuda_rt_replays(sg->e->c));
			}
			if (sg->after[0])
				fprintf(out, "      then, once the graph ran: %s\n", sg->after);
		}
		/* the call as pieces: each graph one CUDA graph launch, the host
		 * work of a break (a sync point, a host call) between them */
		if (graphs && v->nsegs > 1) {
			fputs("    pieces:", out);
			for (int s = 0; s < v->nsegs; s++)
				fprintf(out, "%s CUDA graph %d%s%s", s ? " |" : "", s,
				        v->segs[s].reason[0] ? " | host: " : "",
				        v->segs[s].reason[0] ? v->segs[s].reason : "");
			fputc('\n', out);
		}
		if (v->bw_taped && f->ctx->explain_backward)
			f->ctx->explain_backward(f->ctx, out, "    ");
	}
}
