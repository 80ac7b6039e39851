/* view.c - movement ops as index arithmetic: the index of a view's input
 * given an index of the view (reshape, permute, expand, slice), the strides
 * a node's buffer is read with, and a chain of views folded into plain
 * strides when that is possible (matrix-product operands, aliased outputs).
 */
#include "lower/lower_int.h"

bool kl__reshape_ix(kl_ixa *a, int nin, const int64_t *ish, int nout, const int64_t *osh,
                    const int32_t *J, int32_t *I)
{
	int32_t zero = kl__ix_const(a, 0);
	if (kl__numel(nin, ish) == 0) {
		for (int i = 0; i < nin; i++)
			I[i] = zero;
		return zero >= 0;
	}
	int i = 0, j = 0;
	while (i < nin || j < nout) {
		if (i < nin && ish[i] == 1) {
			I[i++] = zero;
			continue;
		}
		if (j < nout && osh[j] == 1) {
			j++;
			continue;
		}
		if (i >= nin || j >= nout)
			return false;
		int i0 = i, j0 = j;
		int64_t pin = ish[i++], pout = osh[j++];
		while (pin != pout) {
			if (pin < pout) {
				if (i >= nin)
					return false;
				pin *= ish[i++];
			} else {
				if (j >= nout)
					return false;
				pout *= osh[j++];
			}
		}
		if (i - i0 == 1 && j - j0 == 1) {
			I[i0] = J[j0];
			continue;
		}
		int32_t lin = zero;
		int64_t cs = 1;
		for (int jj = j - 1; jj >= j0; jj--) {
			lin = kl__ix_add(a, lin, kl__ix_scale(a, J[jj], cs));
			cs *= osh[jj];
		}
		cs = 1;
		for (int ii = i - 1; ii >= i0; ii--) {
			I[ii] = ish[ii] == 1 ? zero
			                     : kl__ix_mod(a, kl__ix_div(a, lin, cs), ish[ii]);
			cs *= ish[ii];
		}
	}
	return !a->failed;
}

bool kl__move_index(const kl_lctx *L, kl_ixa *a, int32_t m, const int32_t *J, int32_t *I)
{
	const kl_node *o = &L->g.nodes[m];
	const kl_node *in = &L->g.nodes[o->in[0]];
	switch ((kl_op)o->op) {
	case KL_OP_RESHAPE:
		return kl__reshape_ix(a, in->ndim, in->shape, o->ndim, o->shape, J, I);
	case KL_OP_PERMUTE:
		for (int d = 0; d < o->ndim; d++)
			I[o->a.v[d]] = J[d];
		return true;
	case KL_OP_EXPAND: {
		int off = o->ndim - in->ndim;
		for (int d = 0; d < in->ndim; d++)
			I[d] = in->shape[d] == 1 ? kl__ix_const(a, 0) : J[d + off];
		return !a->failed;
	}
	case KL_OP_SLICE:
		for (int d = 0; d < o->ndim; d++)
			I[d] = J[d];
		I[o->a.axis] = kl__ix_addc(a, kl__ix_scale(a, J[o->a.axis], o->a.v[2]), o->a.v[0]);
		return !a->failed;
	case KL_OP_CONTIGUOUS:
		for (int d = 0; d < o->ndim; d++)
			I[d] = J[d];
		return true;
	default:
		return false;
	}
}

static bool has_sym(const kl_lctx *L, int32_t n)
{
	for (int d = 0; d < L->g.nodes[n].ndim; d++)
		if (L->sym[n * KL_MAX_DIMS + d] > 0)
			return true;
	return false;
}

void kl__base_strides(const kl_lctx *L, int32_t n, kl_mono *st)
{
	const kl_node *x = &L->g.nodes[n];
	if (x->op == KL_OP_INPUT && !has_sym(L, n)) {
		for (int d = 0; d < x->ndim; d++)
			st[d] = (kl_mono){.c = x->strides[d], .ns = 0};
		return;
	}
	kl__mono_dense(x->ndim, x->shape, &L->sym[n * KL_MAX_DIMS], st);
}

bool kl__view_of(const kl_lctx *L, int32_t n, int32_t *base, int64_t *strides, int64_t *offset)
{
	return kl__view_to(L, n, -1, base, strides, offset);
}

bool kl__view_to(const kl_lctx *L, int32_t n, int32_t stop, int32_t *base, int64_t *strides,
                 int64_t *offset)
{
	const kl_node *x = &L->g.nodes[n];
	kl_ixa a;
	kl__ixa_init(&a);
	int32_t I[KL_MAX_DIMS], J[KL_MAX_DIMS];
	bool ok = true;
	for (int d = 0; d < x->ndim; d++) {
		a.var_hi[d] = x->shape[d] - 1;
		I[d] = x->shape[d] == 1 ? kl__ix_const(&a, 0) : kl__ix_var(&a, d);
	}
	int32_t c = n;
	while (ok && c != stop && kl__is_view((kl_op)L->g.nodes[c].op)) {
		ok = kl__move_index(L, &a, c, I, J);
		c = L->g.nodes[c].in[0];
		memcpy(I, J, sizeof(I));
	}
	*base = c;
	kl_mono st[KL_MAX_DIMS];
	kir_addr ad;
	if (ok) {
		/* symbolic dims at their current values (lowering's library steps
		 * find which fields follow the symbols by changing those values) */
		if (has_sym(L, c))
			kl__mono_dense(L->g.nodes[c].ndim, L->g.nodes[c].shape, NULL, st);
		else
			kl__base_strides(L, c, st);
		ok = kl__ix_linearize(&a, L->g.nodes[c].ndim, I, st, &ad) && ad.ns == 0;
	}
	if (ok) {
		const kl_ix *e = kl__ix_get(&a, ad.ix);
		*offset = e->c;
		for (int d = 0; d < x->ndim; d++)
			strides[d] = 0;
		for (int t = 0; t < e->nt && ok; t++) {
			const kl_atom *at = &a.atoms[e->at[t]];
			if (at->kind != KL_AT_VAR)
				ok = false;
			else
				strides[at->var] = e->k[t];
		}
	}
	kl__ixa_free(&a);
	return ok;
}

