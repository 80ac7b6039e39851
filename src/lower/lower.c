/* lower.c - kl__lower_ir: runs the passes (decompose, symbolize, schedule)
 * and assembles the plan the runtime executes: the buffer table, one step per
 * kernel or library product in execution order, and each kernel's IR, which
 * the runtime's compile driver renders (runtime/render_plan.c).
 */
#include <stdlib.h>

#include "graph/optable.h"
#include "lower/lower_int.h"

static void lctx_free(kl_lctx *L)
{
	kl__graph_free(&L->g);
	free(L->orig);
	free(L->am);
	free(L->src_sym);
	free(L->sym);
	free(L->live);
	free(L->nuse);
	free(L->out_of);
	free(L->alias_of);
	free(L->mat);
	free(L->home);
	for (int32_t i = 0; i < L->ngr; i++) {
		free(L->gr[i].m);
		free(L->gr[i].copy);
	}
	free(L->gr);
	free(L->mem);
	free(L->lvl);
	free(L->bufof);
	free(L->cw_base);
	free(L->stored);
	free(L->order);
	free(L->mlead);
	free(L->mcol);
	free(L->mspan);
	free(L->relay);
	kl__sb_free(&L->log);
}

static double numel_of(const kl_node *x)
{
	double n = 1;
	for (int d = 0; d < x->ndim; d++)
		n *= (double)x->shape[d];
	return n;
}

double kl__traced_bytes(const kl_program *P, int32_t b)
{
	const kl_buf *bf = &P->bufs[b];
	double n = (double)kl_dtype_size(bf->dtype);
	for (int d = 0; d < bf->ndim; d++)
		n *= (double)bf->shape[d].v;
	return n;
}

/* ---- buffers ------------------------------------------------------------------------ */

static void fill_buf(const kl_lctx *L, kl_buf *b, int32_t n, kl_buf_role role, int32_t index)
{
	const kl_node *x = &L->g.nodes[n];
	memset(b, 0, sizeof(*b));
	b->role = role;
	b->index = index;
	b->dtype = (kl_dtype)x->dtype;
	b->ndim = x->ndim;
	for (int d = 0; d < x->ndim; d++) {
		b->shape[d].v = x->shape[d];
		b->shape[d].sym = L->sym[n * KL_MAX_DIMS + d];
	}
	b->alias = -1;
}

/* Does group gi read node v (directly, or through views it computes)? */
static bool group_reads(const kl_lctx *L, int32_t gi, int32_t v)
{
	const kl_group *G = &L->gr[gi];
	for (int32_t i = 0; i < G->nm; i++) {
		const kl_node *x = &L->g.nodes[G->m[i]];
		for (int j = 0; j < x->nin; j++)
			if (x->in[j] == v || kl__resolve(L, x->in[j]) == v)
				return true;
	}
	return false;
}

/* Which cache writes (kl_cache_write: KL_F_INPLACE) write straight into the
 * graph input whose memory receives their value when the graph ends
 * (L->cw_base): one whose cache operand is that input (or an earlier such
 * write) and whose every other reader of that operand runs before it.
 * Else the step copies the cache first and the value is written back. */
static kl_status plan_inplace(kl_lctx *L)
{
	const kl_graph *g = &L->g;
	L->cw_base = malloc(sizeof(int32_t) * ((size_t)g->n + 1));
	if (!L->cw_base)
		return KL_ENOMEM;
	for (int32_t n = 0; n < g->n; n++)
		L->cw_base[n] = -1;
	for (int32_t k = 0; k < L->norder; k++) {
		int32_t wi = L->order[k], n = L->gr[wi].m[0];
		const kl_node *x = &g->nodes[n];
		if (!L->gr[wi].matmul || x->op != KL_OP_CACHE_WRITE)
			continue;
		int32_t c = x->in[0], base = -1;
		char l1[64], why[160] = "";
		if (!(x->a.flags & KL_F_INPLACE))
			snprintf(why, sizeof why, "a copy (kl_cache_update)");
		else if (g->nodes[c].op == KL_OP_INPUT)
			for (int32_t i = 0; i < g->ninputs; i++)
				base = g->inputs[i] == c ? i : base; /* input i is buffer i */
		else if (g->nodes[c].op == KL_OP_CACHE_WRITE && L->cw_base[c] >= 0)
			base = L->cw_base[c];
		else
			snprintf(why, sizeof why, "its cache is no graph input");
		for (int32_t j = 0; base >= 0 && j < L->norder; j++) {
			int32_t gj = L->order[j];
			if (gj != wi && j > k && group_reads(L, gj, c)) {
				char l2[64];
				snprintf(why, sizeof why, "the step of %s reads the old value after it",
				         kl__node_label(L, L->gr[gj].first, l2, sizeof l2));
				base = -1;
			}
		}
		L->cw_base[n] = base;
		if (base < 0)
			kl__lower_logf(L, "cache write %s copies its cache first: %s",
			               kl__node_label(L, n, l1, sizeof l1), why);
	}
	return KL_OK;
}

static kl_status make_bufs(kl_lctx *L, kl_program *P)
{
	const kl_graph *g = &L->g;
	int32_t cap = g->ninputs + g->noutputs + 16;
	P->bufs = malloc(sizeof(kl_buf) * (size_t)cap);
	L->bufof = malloc(sizeof(int32_t) * ((size_t)g->n + 1));
	if (!P->bufs || !L->bufof)
		return KL_ENOMEM;
	for (int32_t n = 0; n < g->n; n++)
		L->bufof[n] = -1;
	for (int32_t i = 0; i < g->ninputs; i++) {
		fill_buf(L, &P->bufs[i], g->inputs[i], KL_BUF_INPUT, i);
		L->bufof[g->inputs[i]] = i;
	}
	for (int32_t j = 0; j < g->noutputs; j++) {
		int32_t o = g->outputs[j], b = g->ninputs + j;
		fill_buf(L, &P->bufs[b], o, KL_BUF_OUTPUT, j);
		if (L->alias_of[j] < 0 && g->nodes[o].op == KL_OP_CACHE_WRITE && L->cw_base &&
		    L->cw_base[o] >= 0 && L->bufof[o] < 0) {
			/* written in place: the output is the input itself */
			kl_buf *bf = &P->bufs[b];
			bf->alias = L->cw_base[o];
			kl__contig_strides(bf->ndim, g->nodes[o].shape, bf->view_strides);
			L->bufof[o] = L->cw_base[o];
			continue;
		}
		if (L->alias_of[j] < 0) {
			L->bufof[o] = b;
			continue;
		}
		kl_buf *bf = &P->bufs[b];
		bf->alias = L->alias_of[j];
		int32_t base;
		if (L->out_of[o] >= 0 && L->out_of[o] != j) { /* the same node twice */
			kl__contig_strides(bf->ndim, g->nodes[o].shape, bf->view_strides);
			bf->view_offset = 0;
		} else if (!kl__view_of(L, o, &base, bf->view_strides, &bf->view_offset)) {
			snprintf(L->err, L->errcap, "kl__lower: internal error: output %d alias", j);
			return KL_EINVAL;
		}
	}
	P->nbufs = g->ninputs + g->noutputs;
	for (int32_t n = 0; L->cw_base && n < g->n; n++)
		if (g->nodes[n].op == KL_OP_CACHE_WRITE && L->cw_base[n] >= 0 && L->bufof[n] < 0)
			L->bufof[n] = L->cw_base[n]; /* in place, read again later in the graph */
	for (int32_t k = 0; k < L->norder; k++) {
		const kl_group *G = &L->gr[L->order[k]];
		for (int32_t i = 0; i < G->nm; i++) {
			int32_t n = G->m[i];
			if (G->copy[i] || !L->stored[n] || L->bufof[n] >= 0)
				continue;
			if (P->nbufs == cap) {
				cap *= 2;
				kl_buf *p = realloc(P->bufs, sizeof(kl_buf) * (size_t)cap);
				if (!p)
					return KL_ENOMEM;
				P->bufs = p;
			}
			fill_buf(L, &P->bufs[P->nbufs], n, KL_BUF_TEMP, -1);
			L->bufof[n] = P->nbufs++;
		}
	}
	return KL_OK;
}

/* ---- steps -------------------------------------------------------------------------- */

static void add_node(kl_step *sp, int32_t orig)
{
	for (int32_t i = 0; i < sp->nnodes; i++)
		if (sp->nodes[i] == orig)
			return;
	if (sp->nnodes < KL_STEP_MAX_NODES)
		sp->nodes[sp->nnodes++] = orig;
}

static void add_id(int32_t *ids, int32_t *n, int32_t cap, int32_t b)
{
	for (int32_t i = 0; i < *n; i++)
		if (ids[i] == b)
			return;
	if (*n < cap)
		ids[(*n)++] = b;
}

/* A [.., rows, cols] operand as strides of its buffer */
static bool operand(const kl_lctx *L, int32_t c, int32_t *buf, int64_t *st, int64_t *off)
{
	int32_t base;
	if (!kl__stored_view(L, c, &base, st, off))
		return false;
	*buf = L->bufof[base];
	return *buf >= 0;
}

/* The epilogue of product group G (members after the MATMUL node) into mm;
 * sr receives the residual's strides in the product's dims. */
static kl_status epilogue(kl_lctx *L, const kl_group *G, kl_step *sp, int64_t *sr, char *desc,
                          size_t cap)
{
	kl_matmul_step *mm = &sp->mm;
	const kl_node *p = &L->g.nodes[G->m[0]];
	size_t dl = 0;
	desc[0] = 0;
	for (int32_t i = 1; i < G->nm; i++) {
		int32_t n = G->m[i], other, base;
		const kl_node *x = &L->g.nodes[n];
		char why[256];
		int64_t st[KL_MAX_DIMS], off;
		kl_epart part = kl__epilogue_part(L, n, G->m[i - 1], &other, why, sizeof why);
		const char *tag = "";
		switch (part) {
		case KL_EPART_ALPHA:
			mm->alpha *= x->a.s[0];
			tag = "*alpha";
			break;
		case KL_EPART_BIAS:
			if (!operand(L, other, &mm->bias, st, &off))
				goto bad;
			mm->has_bias = true;
			mm->bias_off = off;
			tag = "+bias";
			add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, mm->bias);
			sp->bytes += (double)mm->n * (double)kl_dtype_size((kl_dtype)x->dtype);
			break;
		case KL_EPART_RESID:
			if (!kl__stored_view(L, other, &base, sr, &off) ||
			    (mm->r = L->bufof[base]) < 0)
				goto bad;
			mm->has_r = true;
			mm->r_off = off;
			mm->beta = 1;
			tag = "+residual";
			add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, mm->r);
			sp->bytes += numel_of(p) * (double)kl_dtype_size((kl_dtype)x->dtype);
			break;
		case KL_EPART_ACT:
			mm->act = kl__epilogue_act(x);
			tag = kl__ops[kl__mm_act_op[mm->act]].name;
			break;
		default:
			goto bad;
		}
		sp->flops += numel_of(p);
		add_node(sp, L->orig[n]);
		int w = snprintf(desc + dl, cap - dl, "%s%s", part == KL_EPART_ACT ? "+" : "", tag);
		if (w > 0 && (size_t)w < cap - dl)
			dl += (size_t)w;
		continue;
	bad:
		snprintf(L->err, L->errcap, "kl__lower: internal error: epilogue of matmul: %s",
		         part == KL_EPART_NONE ? why : "operand layout");
		return KL_EINVAL;
	}
	return KL_OK;
}

static kl_status matmul_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp)
{
	int32_t n = G->m[0];
	const kl_node *x = &L->g.nodes[n];
	kl_matmul_step *mm = &sp->mm;
	int k = x->ndim;
	int64_t sa[KL_MAX_DIMS], sb[KL_MAX_DIMS], sc[KL_MAX_DIMS], sr[KL_MAX_DIMS];
	char desc[48];
	if (!operand(L, x->in[0], &mm->a, sa, &mm->a_off) ||
	    !operand(L, x->in[1], &mm->b, sb, &mm->b_off)) {
		snprintf(L->err, L->errcap, "kl__lower: internal error: matmul operand layout");
		return KL_EINVAL;
	}
	/* the product is stored where its last epilogue value goes */
	mm->c = L->bufof[G->m[G->nm - 1]];
	mm->alpha = 1;
	mm->beta = 0;
	kl_status st = epilogue(L, G, sp, sr, desc, sizeof desc);
	if (st != KL_OK)
		return st;
	kl__contig_strides(k, x->shape, sc);
	mm->m = x->shape[k - 2];
	mm->n = x->shape[k - 1];
	mm->k = L->g.nodes[x->in[0]].shape[k - 1];
	mm->a_rs = sa[k - 2];
	mm->a_cs = sa[k - 1];
	mm->b_rs = sb[k - 2];
	mm->b_cs = sb[k - 1];
	mm->ldc = mm->n;
	if (mm->has_r)
		mm->r_ld = mm->m > 1 ? sr[k - 2] : mm->n;
	double batch = 1;
	bool b_shared = true; /* B is the same matrix for every batch */
	for (int d = 0; d < k - 2; d++) {
		if (x->shape[d] == 1)
			continue;
		int i = mm->nbatch++;
		mm->batch[i] = x->shape[d];
		mm->a_bstride[i] = sa[d];
		mm->b_bstride[i] = sb[d];
		mm->c_bstride[i] = sc[d];
		mm->r_bstride[i] = mm->has_r ? sr[d] : 0;
		batch *= (double)x->shape[d];
		b_shared &= sb[d] == 0;
	}
	/* [batch.., m, k] @ [k, n] whose A rows run on across batches: one
	 * product. A one-row matrix (m == 1: a decode step's [b, 1, d] @ W^T)
	 * has no row stride of its own (a size-1 dim's stride is 0): its rows
	 * are the innermost batch dim's, so b products of one row fold into
	 * one product of b rows whenever the batch dims chain. */
	if (mm->nbatch > 0 && b_shared && mm->a_cs == 1) {
		bool rows = true, one = mm->m == 1;
		int64_t ars = one ? mm->a_bstride[mm->nbatch - 1] : mm->a_rs;
		int64_t rld = one && mm->has_r ? mm->r_bstride[mm->nbatch - 1] : mm->r_ld;
		int64_t want = ars * mm->m, rwant = rld * mm->m;
		for (int i = mm->nbatch - 1; i >= 0 && rows; i--) {
			rows = mm->a_bstride[i] == want && (!mm->has_r || mm->r_bstride[i] == rwant);
			want *= mm->batch[i];
			rwant *= mm->batch[i];
		}
		if (rows && ars > 0 && (!mm->has_r || rld > 0)) {
			mm->m = (int64_t)((double)mm->m * batch);
			mm->nbatch = 0;
			mm->a_rs = ars;
			if (mm->has_r)
				mm->r_ld = rld;
		}
	}
	add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, mm->a);
	add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, mm->b);
	sp->writes[0] = mm->c;
	sp->nwrites = 1;
	double es = (double)kl_dtype_size((kl_dtype)x->dtype);
	double kk = (double)mm->k;
	sp->flops += 2.0 * batch * (double)x->shape[k - 2] * (double)mm->n * kk;
	sp->bytes += kl__traced_bytes(P, mm->a) + kl__traced_bytes(P, mm->b) + numel_of(x) * es;
	if (mm->nbatch)
		snprintf(sp->what, sizeof(sp->what), "bmm %.0fx%lldx%lldx%lld%s%s", batch,
		         (long long)mm->m, (long long)mm->n, (long long)mm->k, desc[0] ? " " : "",
		         desc);
	else
		snprintf(sp->what, sizeof(sp->what), "matmul %lldx%lldx%lld%s%s", (long long)mm->m,
		         (long long)mm->n, (long long)mm->k, desc[0] ? " " : "", desc);
	return KL_OK;
}

/* the src nodes an attention step computes: a hand-written pattern's chain */
static void add_attention_nodes(const kl_lctx *L, int32_t n, kl_step *sp)
{
	int32_t o = L->orig[n];
	const kl_attn_match *am = L->am ? &L->am[o] : NULL;
	if (am && am->q >= 0)
		for (int i = 0; i < am->nchain; i++)
			add_node(sp, am->chain[i]);
	else
		add_node(sp, o);
}

static kl_status attention_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp)
{
	int32_t n = G->m[0];
	const kl_node *x = &L->g.nodes[n];
	kl_attn_step *a = &sp->at;
	int r = x->ndim;
	int64_t st[4][KL_MAX_DIMS], off[4], so[KL_MAX_DIMS];
	int32_t ids[4];
	int nop = x->nin == 4 ? 4 : 3; /* with the lengths */
	for (int i = 0; i < nop; i++)
		if (!operand(L, x->in[i], &ids[i], st[i], &off[i])) {
			snprintf(L->err, L->errcap, "kl__lower: internal error: attention operand layout");
			return KL_EINVAL;
		}
	a->q = ids[0];
	a->k = ids[1];
	a->v = ids[2];
	/* into the attention's own dense buffer, or the copy's that it took */
	a->o = L->bufof[G->m[G->nm - 1]];
	kl__contig_strides(r, x->shape, so);
	if (G->nm > 1) {
		char why[160];
		if (!kl__attention_layout(L, n, G->m[1], so, why, sizeof why)) {
			snprintf(L->err, L->errcap, "kl__lower: internal error: attention layout: %s",
			         why);
			return KL_EINVAL;
		}
	}
	a->tq = x->shape[r - 2];
	a->dv = x->shape[r - 1];
	a->tk = L->g.nodes[x->in[1]].shape[r - 2];
	a->d = L->g.nodes[x->in[0]].shape[r - 1];
	a->q_off = off[0];
	a->k_off = off[1];
	a->v_off = off[2];
	a->q_rs = st[0][r - 2];
	a->q_cs = st[0][r - 1];
	a->k_rs = st[1][r - 2];
	a->k_cs = st[1][r - 1];
	a->v_rs = st[2][r - 2];
	a->v_cs = st[2][r - 1];
	a->o_rs = so[r - 2];
	a->scale = x->a.s[0];
	a->causal = (x->a.flags & KL_F_CAUSAL) != 0;
	double batch = 1;
	a->len = -1;
	if (nop == 4) {
		a->len = ids[3];
		a->len_dt = (int32_t)L->g.nodes[x->in[3]].dtype;
		a->len_off = off[3];
		a->len_st = st[3][0];
		/* every batch entry but that of dim 0 (none when it has size 1) */
		a->len_inner = 0;
	}
	for (int d = 0; d < r - 2; d++) {
		if (x->shape[d] == 1)
			continue;
		if (nop == 4 && d > 0)
			a->len_inner++;
		int i = a->nbatch++;
		a->batch[i] = x->shape[d];
		a->q_bs[i] = st[0][d];
		a->k_bs[i] = st[1][d];
		a->v_bs[i] = st[2][d];
		a->o_bs[i] = so[d];
		batch *= (double)x->shape[d];
	}
	for (int i = 0; i < nop; i++)
		add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, ids[i]);
	sp->writes[0] = a->o;
	sp->nwrites = 1;
	/* two products; a causal mask skips about half of them */
	double pairs = (double)a->tq * (double)a->tk;
	if (a->causal) {
		double lo = (double)(a->tk - a->tq); /* query i sees min(tk, max(0, i + lo + 1)) keys */
		pairs = 0;
		for (int64_t i = 0; i < a->tq; i++) {
			double c = (double)i + lo + 1;
			pairs += c < 0 ? 0 : c > (double)a->tk ? (double)a->tk : c;
		}
	}
	sp->flops = 2.0 * batch * pairs * (double)(a->d + a->dv);
	for (int i = 0; i < nop; i++)
		sp->bytes += kl__traced_bytes(P, ids[i]);
	sp->bytes += kl__traced_bytes(P, a->o);
	snprintf(sp->what, sizeof(sp->what), "attention %.0fx%lldx%lldx%lld%s%s", batch,
	         (long long)a->tq, (long long)a->tk, (long long)a->d, a->causal ? " causal" : "",
	         nop == 4 ? " lengths" : "");
	return KL_OK;
}

/* sdpa_bwd: the attention step in its backward mode (kl_attn_step.bwd),
 * reading q, k, v, o, do and writing the packed [dq; dk; dv] densely, or,
 * when the scheduler gave it the concatenation of the three (a packed qkv
 * product's gradient, kl__attention_bwd_layout), each where that holds it */
static kl_status attention_bwd_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp)
{
	int32_t n = G->m[0];
	const kl_node *x = &L->g.nodes[n];
	kl_attn_step *a = &sp->at;
	int r = x->ndim;
	int64_t st[5][KL_MAX_DIMS], off[5], so[KL_MAX_DIMS];
	int32_t ids[5];
	kl_bwd_layout lay;
	if (G->nm > 1) {
		char why[160];
		if (!kl__attention_bwd_layout(L, n, G->m[1], &lay, why, sizeof why)) {
			snprintf(L->err, L->errcap,
			         "kl__lower: internal error: attention backward layout: %s", why);
			return KL_EINVAL;
		}
		add_node(sp, L->orig[G->m[1]]);
	}
	for (int i = 0; i < 5; i++)
		if (!operand(L, x->in[i], &ids[i], st[i], &off[i])) {
			snprintf(L->err, L->errcap,
			         "kl__lower: internal error: attention backward operand layout");
			return KL_EINVAL;
		}
	a->bwd = 1;
	a->len = -1; /* no lengths: kl__vjp_sdpa emits sdpa_bwd only without them */
	a->q = ids[0];
	a->k = ids[1];
	a->v = ids[2];
	a->fo = ids[3];
	a->go = ids[4];
	a->o = L->bufof[G->m[G->nm - 1]];
	kl__contig_strides(r, x->shape, so);
	a->tq = L->g.nodes[x->in[0]].shape[r - 2];
	a->tk = L->g.nodes[x->in[1]].shape[r - 2];
	a->d = a->dv = x->shape[r - 1];
	a->q_off = off[0];
	a->k_off = off[1];
	a->v_off = off[2];
	a->fo_off = off[3];
	a->go_off = off[4];
	a->q_rs = st[0][r - 2];
	a->q_cs = st[0][r - 1];
	a->k_rs = st[1][r - 2];
	a->k_cs = st[1][r - 1];
	a->v_rs = st[2][r - 2];
	a->v_cs = st[2][r - 1];
	a->fo_rs = st[3][r - 2];
	a->go_rs = st[4][r - 2];
	a->fo_cs = a->go_cs = 1; /* fuse.c copies a row whose elements are not adjacent */
	a->o_rs = G->nm > 1 ? lay.st[0][r - 2] : so[r - 2];
	a->scale = x->a.s[0];
	a->causal = (x->a.flags & KL_F_CAUSAL) != 0;
	double batch = 1;
	for (int d = 0; d < r - 2; d++) {
		if (x->shape[d] == 1)
			continue;
		int i = a->nbatch++;
		a->batch[i] = x->shape[d];
		a->q_bs[i] = st[0][d];
		a->k_bs[i] = st[1][d];
		a->v_bs[i] = st[2][d];
		a->fo_bs[i] = st[3][d];
		a->go_bs[i] = st[4][d];
		a->o_bs[i] = G->nm > 1 ? lay.st[0][d] : so[d];
		if (G->nm > 1) {
			a->dk_bs[i] = lay.st[1][d];
			a->dv_bs[i] = lay.st[2][d];
		}
		batch *= (double)x->shape[d];
	}
	if (G->nm > 1) {
		a->dq_off = lay.off[0];
		a->dk_off = lay.off[1];
		a->dv_off = lay.off[2];
		a->dk_rs = lay.st[1][r - 2];
		a->dv_rs = lay.st[2][r - 2];
	} else {
		kl__attn_bwd_packed(a);
	}
	for (int i = 0; i < 5; i++)
		add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, ids[i]);
	sp->writes[0] = a->o;
	sp->nwrites = 1;
	double pairs = (double)a->tq * (double)a->tk;
	if (a->causal) {
		double lo = (double)(a->tk - a->tq);
		pairs = 0;
		for (int64_t i = 0; i < a->tq; i++) {
			double c = (double)i + lo + 1;
			pairs += c < 0 ? 0 : c > (double)a->tk ? (double)a->tk : c;
		}
	}
	/* five products: S (recomputed twice: once for the row statistics),
	 * dP, dV, dQ, dK */
	sp->flops = 2.0 * batch * pairs * (double)a->d * 6;
	for (int i = 0; i < 5; i++)
		sp->bytes += kl__traced_bytes(P, ids[i]);
	sp->bytes += kl__traced_bytes(P, a->o);
	snprintf(sp->what, sizeof(sp->what), "attention bwd %.0fx%lldx%lldx%lld%s%s", batch,
	         (long long)a->tq, (long long)a->tk, (long long)a->d, a->causal ? " causal" : "",
	         G->nm > 1 ? " into concat" : "");
	return KL_OK;
}

static kl_status cache_write_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp)
{
	int32_t n = G->m[0];
	const kl_node *x = &L->g.nodes[n];
	kl_cw_step *c = &sp->cw;
	int32_t ids[3];
	int64_t vst[KL_MAX_DIMS], voff = 0;
	for (int i = 0; i < 3; i++) {
		int64_t st[KL_MAX_DIMS], off;
		/* the values may be a view (fuse.c: rows dense, any offset) */
		if (!operand(L, x->in[i], &ids[i], i == 2 ? vst : st, i == 2 ? &voff : &off) ||
		    (i < 2 && off != 0)) {
			snprintf(L->err, L->errcap, "kl__lower: internal error: cache write operand %d", i);
			return KL_EINVAL;
		}
	}
	const kl_node *cn = &L->g.nodes[x->in[0]], *pn = &L->g.nodes[x->in[1]],
	              *vn = &L->g.nodes[x->in[2]];
	/* the sizes as the shapes give them (symbolic_step builds the step
	 * again at other sizes, where rows may pass R: the runtime checks) */
	kl_cw_geom geo = {.rows = vn->shape[0], .R = cn->shape[0], .cap = cn->shape[x->a.axis],
	                  .s = vn->shape[x->a.axis], .outer = 1, .inner = 1};
	(void)pn;
	for (int d = 1; d < x->a.axis; d++)
		geo.outer *= cn->shape[d];
	for (int d = x->a.axis + 1; d < cn->ndim; d++)
		geo.inner *= cn->shape[d];
	c->cache = ids[0];
	c->pos = ids[1];
	c->val = ids[2];
	c->out = L->bufof[n];
	c->rows = geo.rows;
	c->R = geo.R;
	c->outer = geo.outer;
	c->cap = geo.cap;
	c->s = geo.s;
	c->inner = geo.inner;
	c->val_off = voff;
	c->val_rs = vn->shape[0] > 1 ? vst[0] : geo.outer * geo.s * geo.inner;
	c->axis = x->a.axis;
	bool inplace = c->out == c->cache;
	for (int i = inplace ? 1 : 0; i < 3; i++)
		add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, ids[i]);
	sp->writes[0] = c->out;
	sp->nwrites = 1;
	double es = (double)kl_dtype_size((kl_dtype)x->dtype);
	double rowsz = (double)geo.rows * (double)geo.outer * (double)geo.s * (double)geo.inner;
	sp->bytes = 2.0 * rowsz * es + kl__traced_bytes(P, ids[1]);
	if (!inplace)
		sp->bytes += 2.0 * kl__traced_bytes(P, c->out);
	snprintf(sp->what, sizeof(sp->what), "cache write %lldx%lld%s", (long long)geo.rows,
	         (long long)geo.s, inplace ? " in place" : " (copy)");
	return KL_OK;
}

/* ---- library steps over symbolic dims ----------------------------------------------- */

typedef kl_status (*step_builder)(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp);

/* Give every symbolic dim of the decomposed graph the value val[k] of its
 * symbol k (val[0] unused). */
static void set_syms(kl_lctx *L, const int64_t *val)
{
	for (int32_t n = 0; n < L->g.n; n++)
		for (int d = 0; d < L->g.nodes[n].ndim; d++)
			if (L->sym[n * KL_MAX_DIMS + d] > 0)
				L->g.nodes[n].shape[d] = val[L->sym[n * KL_MAX_DIMS + d]];
}

/* Steps a and b alike but for their symbolic fields and costs. */
static bool same_form(const kl_step *a, const kl_step *b)
{
	kl_step x, y;
	memcpy(&x, a, sizeof x);
	memcpy(&y, b, sizeof y);
	for (int f = 0; f < kl__step_nfields(); f++)
		*kl__step_field(&x, f) = *kl__step_field(&y, f) = 0;
	x.bytes = y.bytes = x.flops = y.flops = 0;
	memset(x.what, 0, sizeof x.what);
	memset(y.what, 0, sizeof y.what);
	return memcmp(&x, &y, sizeof x) == 0;
}

/* The library step sp (built by fn at the traced sizes) over symbolic dims:
 * each of its sizes, strides and offsets is found to be a constant times a
 * product of powers of symbols (a [b, t, t] score matrix's batch stride is
 * t * t) by building it again with each symbol doubled (the field grows by
 * 2^e), then checked with every symbol at 3v + 1 at once; those that vary become
 * P->symf entries, which the runtime evaluates per call. A step whose
 * fields are no such products, or whose form changes with the sizes, is an
 * error (never a wrong plan). */
static kl_status symbolic_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp,
                               step_builder fn)
{
	if (L->nsyms == 0)
		return KL_OK;
	int nf = kl__step_nfields(), ns = L->nsyms;
	int64_t base[KL_MAX_DIMS * 4 + 1] = {0}, val[KL_MAX_DIMS * 4 + 1];
	for (int32_t n = 0; n < L->g.n; n++)
		for (int d = 0; d < L->g.nodes[n].ndim; d++)
			if (L->sym[n * KL_MAX_DIMS + d] > 0)
				base[L->sym[n * KL_MAX_DIMS + d]] = L->g.nodes[n].shape[d];
	/* ex[f * (ns + 1) + k]: the power of symbol k in field f */
	int8_t *ex = calloc((size_t)nf * (size_t)(ns + 1), 1);
	kl_step *tmp = malloc(sizeof *tmp);
	if (!ex || !tmp) {
		free(ex);
		free(tmp);
		return KL_ENOMEM;
	}
	kl_status st = KL_OK;
	const char *bad = NULL;
	for (int k = 1; k <= ns + 1 && st == KL_OK && !bad; k++) {
		memcpy(val, base, sizeof val);
		if (k <= ns)
			val[k] = 2 * base[k];
		else
			for (int j = 1; j <= ns; j++)
				val[j] = 3 * base[j] + 1;
		set_syms(L, val);
		memset(tmp, 0, sizeof *tmp);
		tmp->kind = sp->kind;
		tmp->kernel = sp->kernel;
		for (int i = 0; i < sp->nnodes; i++)
			tmp->nodes[i] = sp->nodes[i];
		tmp->nnodes = sp->nnodes;
		st = fn(L, P, G, tmp);
		if (st == KL_OK && !same_form(sp, tmp))
			bad = "its form changes with the sizes";
		for (int f = 0; st == KL_OK && !bad && f < nf; f++) {
			int64_t v0 = *kl__step_field(sp, f), v1 = *kl__step_field(tmp, f);
			int8_t *e = &ex[(size_t)f * (size_t)(ns + 1)];
			if (k <= ns) {
				int p = 0;
				for (int64_t r = v0; v0 != 0 && r != v1 && p < 4; p++)
					r *= 2;
				if (v0 == 0 ? v1 != 0 : p == 4)
					bad = "a size or stride is no product of dynamic dims";
				e[k] = (int8_t)p;
				continue;
			}
			/* every symbol at once: c * product of the new values */
			int64_t c = v0, want;
			for (int j = 1; j <= ns && !bad; j++)
				for (int p = 0; p < e[j] && !bad; p++) {
					if (c % base[j] != 0)
						bad = "a size or stride is no product of dynamic dims";
					else
						c /= base[j];
				}
			want = c;
			for (int j = 1; j <= ns && !bad; j++)
				for (int p = 0; p < e[j]; p++)
					want *= val[j];
			if (!bad && want != v1)
				bad = "a size or stride is no product of dynamic dims";
		}
	}
	set_syms(L, base);
	for (int f = 0; st == KL_OK && !bad && f < nf; f++) {
		const int8_t *pw = &ex[(size_t)f * (size_t)(ns + 1)];
		kl_symf e = {.step = P->nsteps - 1, .field = f, .c = *kl__step_field(sp, f)};
		int n = 0;
		for (int j = 1; j <= ns; j++)
			for (int p = 0; p < pw[j]; p++, n++)
				if (n < KL_MAX_DIMS) {
					e.c /= base[j];
					e.s[n] = (int8_t)j;
				}
		if (n > KL_MAX_DIMS)
			bad = "a size is a product of too many dynamic dims";
		e.ns = n;
		if (e.ns == 0)
			continue;
		if (bad)
			break;
		kl_symf *p = realloc(P->symf, sizeof(kl_symf) * ((size_t)P->nsymf + 1));
		if (!p) {
			st = KL_ENOMEM;
			break;
		}
		P->symf = p;
		P->symf[P->nsymf++] = e;
	}
	free(ex);
	free(tmp);
	if (st == KL_OK && bad) {
		char l[64];
		snprintf(L->err, L->errcap, "kl__lower: %s over dynamic dims: %s",
		         kl__node_label(L, G->m[0], l, sizeof(l)), bad);
		st = KL_EUNSUPPORTED;
	}
	return st;
}

static void describe(const kl_lctx *L, const kl_group *G, kl_step *sp)
{
	static const kl_op rows[] = {KL_OP_SOFTMAX, KL_OP_LOG_SOFTMAX, KL_OP_LAYER_NORM,
	                             KL_OP_RMS_NORM};
	if (G->rmask) {
		for (int32_t i = 0; i < G->nm; i++) {
			kl_op so = (kl_op)L->src->nodes[L->orig[G->m[i]]].op;
			for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++)
				if (so == rows[r]) {
					snprintf(sp->what, sizeof(sp->what), "row %s", kl__ops[so].name);
					return;
				}
			if (so == KL_OP_MATMUL) {
				snprintf(sp->what, sizeof(sp->what), "matmul (generated, dynamic)");
				return;
			}
		}
		for (int32_t i = 0; i < G->nm; i++) {
			const kl_node *x = &L->g.nodes[G->m[i]];
			if (kl__is_reduction(x)) {
				kl_op so = (kl_op)L->src->nodes[L->orig[G->m[i]]].op;
				snprintf(sp->what, sizeof(sp->what), "reduce %s", kl__ops[so].name);
				return;
			}
		}
	}
	bool copy = true;
	for (int32_t i = 0; i < G->nm; i++)
		copy &= kl__is_view((kl_op)L->g.nodes[G->m[i]].op);
	snprintf(sp->what, sizeof(sp->what), "%s", copy ? "copy" : "pointwise");
}

/* Whether buffer b of a pointwise kernel is loaded only at the element the
 * kernel stores (ix: the store's address), never gathered */
static bool loads_at(const kir_kernel *k, int32_t b, int32_t ix)
{
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc == KIR_LOAD && in->buf == b && (in->a >= 0 || in->ad.ns != 0 || in->ad.ix != ix))
			return false;
	}
	return true;
}

/* A pointwise kernel that stores one temp at one address and loads another
 * temp of the same dtype and shape only there (each element read by the
 * thread that then writes it) may write into that temp's memory when it is
 * the temp's last reader: the memory planner decides (memplan.c). The temp
 * goes first in sp->reads and sp->inplace is set. The SwiGLU backward's
 * gradient of the gate, computed from the hidden layer's gradient, takes
 * its memory: train_decoder at 4x1024x2048 bf16, 67 MB less at the peak. */
static void inplace_read(const kl_program *P, kir_kernel *k, kl_step *sp)
{
	if (k->rmask != 0 || k->nlocal != 0 || sp->nwrites != 1)
		return;
	int32_t w = sp->writes[0], ix = -1;
	if (P->bufs[w].role != KL_BUF_TEMP)
		return;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc != KIR_STORE)
			continue;
		if (in->buf != w || in->ad.ns != 0 || (ix >= 0 && in->ad.ix != ix))
			return;
		ix = in->ad.ix;
	}
	if (ix < 0)
		return;
	for (int32_t r = 0; r < sp->nreads; r++) {
		if (!kl__inplace_bufs(&P->bufs[sp->reads[r]], &P->bufs[w]) ||
		    !loads_at(k, sp->reads[r], ix))
			continue;
		int32_t t = sp->reads[0];
		sp->reads[0] = sp->reads[r];
		sp->reads[r] = t;
		sp->inplace = true;
		k->shares = sp->reads[0];
		return;
	}
}

/* Kernel step sp of group G: its kernel IR goes to *k (kept for the
 * renderer, kernel number P->nkernels), its name to P->kernel_names. */
static kl_status kernel_step(kl_lctx *L, kl_program *P, const kl_group *G, kl_step *sp,
                             kir_kernel *k, const uint8_t *early)
{
	char why[256];
	bool built = kl__kbuild(L, G, false, k, why, sizeof(why));
	k->early = early;
	if (!built) {
		char l[64];
		snprintf(L->err, L->errcap, "kl__lower: internal error: kernel of %s: %s",
		         kl__node_label(L, G->first, l, sizeof(l)), why);
		kl__kir_free(k);
		return KL_EINVAL;
	}
	char name[32];
	snprintf(name, sizeof(name), "k%d", (int)P->nkernels);
	char **names = realloc(P->kernel_names, sizeof(char *) * ((size_t)P->nkernels + 1));
	if (!names) {
		kl__kir_free(k);
		return KL_ENOMEM;
	}
	P->kernel_names = names;
	names[P->nkernels] = strdup(name);
	if (!names[P->nkernels]) {
		kl__kir_free(k);
		return KL_ENOMEM;
	}
	sp->kind = KL_STEP_KERNEL;
	sp->kernel = P->nkernels++;
	for (int32_t i = 0; i < k->nins; i++) {
		const kir_ins *in = &k->ins[i];
		if (in->opc == KIR_LOAD)
			add_id(sp->reads, &sp->nreads, KL_NODE_MAX_IN * 2, in->buf);
		else if (in->opc == KIR_STORE)
			add_id(sp->writes, &sp->nwrites, 2, in->buf);
	}
	for (int32_t i = 0; i < sp->nreads; i++)
		sp->bytes += kl__traced_bytes(P, sp->reads[i]);
	for (int32_t i = 0; i < sp->nwrites; i++)
		sp->bytes += kl__traced_bytes(P, sp->writes[i]);
	inplace_read(P, k, sp);
	for (int32_t i = 0; i < G->nm; i++) {
		const kl_node *x = &L->g.nodes[G->m[i]];
		add_node(sp, L->orig[G->m[i]]);
		if (kl__is_view((kl_op)x->op))
			continue;
		sp->flops += kl__is_reduction(x) ? numel_of(&L->g.nodes[x->in[0]]) : numel_of(x);
	}
	describe(L, G, sp);
	return KL_OK;
}

static kl_status assemble(kl_lctx *L, kl_lowered *out)
{
	kl_program *P = &out->prog;
	kl_status st = plan_inplace(L);
	if (st == KL_OK)
		st = make_bufs(L, P);
	if (st != KL_OK)
		return st;
	P->steps = calloc((size_t)L->norder + 1, sizeof(kl_step));
	out->kernels = calloc((size_t)L->norder + 1, sizeof(kir_kernel));
	if (!P->steps || !out->kernels)
		return KL_ENOMEM;
	/* (a CUDA program whose buffers and symbols do not fit the kernel
	 * parameter block passes them through device memory:
	 * kl__cuda_args_indirect) */
	/* the program's inputs: no step writes them, so a CUDA kernel after the
	 * first step may start reading them before the step before it ends
	 * (the runtime launches a range's first step without overlap) */
	uint8_t *early = NULL;
	if (L->o->target == KL_TARGET_CUDA && P->nbufs > 0) {
		if (!(early = out->early = calloc((size_t)P->nbufs, 1)))
			return KL_ENOMEM;
		for (int32_t b = 0; b < P->nbufs; b++)
			early[b] = P->bufs[b].role == KL_BUF_INPUT;
		/* except those a cache write writes in place */
		for (int32_t n = 0; n < L->g.n; n++)
			if (L->g.nodes[n].op == KL_OP_CACHE_WRITE && L->cw_base[n] >= 0)
				early[L->cw_base[n]] = 0;
	}
	for (int32_t k = 0; k < L->norder && st == KL_OK; k++) {
		const kl_group *G = &L->gr[L->order[k]];
		kl_step *sp = &P->steps[P->nsteps++];
		if (G->matmul && L->g.nodes[G->m[0]].op == KL_OP_CACHE_WRITE) {
			sp->kind = KL_STEP_CACHE_WRITE;
			sp->kernel = -1;
			add_node(sp, L->orig[G->m[0]]);
			st = cache_write_step(L, P, G, sp);
			if (st == KL_OK)
				st = symbolic_step(L, P, G, sp, cache_write_step);
		} else if (G->matmul && L->g.nodes[G->m[0]].op == KL_OP_ATTENTION_BWD) {
			sp->kind = KL_STEP_ATTENTION;
			sp->kernel = -1;
			add_node(sp, L->orig[G->m[0]]);
			st = attention_bwd_step(L, P, G, sp);
			if (st == KL_OK)
				st = symbolic_step(L, P, G, sp, attention_bwd_step);
		} else if (G->matmul && L->g.nodes[G->m[0]].op == KL_OP_ATTENTION) {
			sp->kind = KL_STEP_ATTENTION;
			sp->kernel = -1;
			add_attention_nodes(L, G->m[0], sp);
			st = attention_step(L, P, G, sp);
			if (st == KL_OK)
				st = symbolic_step(L, P, G, sp, attention_step);
		} else if (G->matmul) {
			sp->kind = KL_STEP_MATMUL;
			sp->kernel = -1;
			add_node(sp, L->orig[G->m[0]]);
			st = matmul_step(L, P, G, sp);
			if (st == KL_OK)
				st = symbolic_step(L, P, G, sp, matmul_step);
		} else {
			st = kernel_step(L, P, G, sp, &out->kernels[P->nkernels],
			                 P->nsteps > 1 ? early : NULL);
			out->nkernels = P->nkernels;
		}
	}
	if (st == KL_OK)
		st = kl__order_steps(P);
	P->nsyms = L->nsyms;
	memcpy(P->sym_input, L->sym_input, sizeof(P->sym_input));
	memcpy(P->sym_dim, L->sym_dim, sizeof(P->sym_dim));
	return st;
}

void kl__lowered_free(kl_lowered *lw)
{
	for (int32_t i = 0; lw->kernels && i < lw->nkernels; i++)
		kl__kir_free(&lw->kernels[i]);
	free(lw->kernels);
	free(lw->early);
	kl__program_free(&lw->prog);
	memset(lw, 0, sizeof(*lw));
}

kl_status kl__lower_ir(const kl_graph *g, const kl_lower_opts *o, kl_lowered *out, char *err,
                       size_t errcap)
{
	memset(out, 0, sizeof(*out));
	char dummy[8];
	if (!err || !errcap) {
		err = dummy;
		errcap = sizeof(dummy);
	}
	err[0] = 0;
	kl_lctx L;
	memset(&L, 0, sizeof(L));
	L.o = o;
	L.src = g;
	L.err = err;
	L.errcap = errcap;
	kl_status st = KL_OK;
	if (o->target != KL_TARGET_C && o->target != KL_TARGET_CUDA) {
		snprintf(err, errcap, "kl__lower: unknown target %d", (int)o->target);
		return KL_EUNSUPPORTED;
	}
	if (o->dyn_masks) {
		L.src_sym = calloc((size_t)g->n * KL_MAX_DIMS + 1, sizeof(int32_t));
		int32_t si[KL_MAX_DIMS * 4], sd[KL_MAX_DIMS * 4];
		char why[256];
		if (!L.src_sym) {
			st = KL_ENOMEM;
			goto done;
		}
		int ns = kl__graph_symbolize(g, o->dyn_masks, L.src_sym, si, sd, why, sizeof(why));
		if (ns < 0) {
			snprintf(err, errcap, "kl__lower: cannot keep dims dynamic: %s", why);
			st = KL_EUNSUPPORTED;
			goto done;
		}
	}
	st = kl__attention_match(&L);
	if (st == KL_OK)
		st = kl__merge_plan(&L);
	if (st == KL_OK)
		st = kl__decompose(&L);
	if (st == KL_OK)
		st = kl__symbolize_lowered(&L);
	if (st == KL_OK)
		st = kl__schedule(&L);
	if (st == KL_OK)
		st = assemble(&L, out);
	if (st == KL_OK && L.log.n) {
		out->prog.fusion_log = L.log.s;
		L.log.s = NULL;
	}
done:
	if (st == KL_ENOMEM && !err[0])
		snprintf(err, errcap, "kl__lower: out of memory");
	if (st != KL_OK)
		kl__lowered_free(out);
	lctx_free(&L);
	return st;
}
