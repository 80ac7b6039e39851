/* memplan.c - the memory planner: each TEMP buffer lives from the step that
 * first touches it to the last step that reads it; buffers whose lives do not
 * overlap share a slot (best fit among the free ones), and the slots are laid
 * out back to back in one arena per compiled variant.
 */
#include <stdlib.h>

#include "runtime/runtime_int.h"

size_t kl__buf_bytes(const kl_buf *b, const int64_t *syms)
{
	size_t n = kl_dtype_size(b->dtype);
	for (int d = 0; d < b->ndim; d++) {
		int64_t v = kl__dim_value(&b->shape[d], syms);
		if (v < 0 || __builtin_mul_overflow(n, (size_t)v, &n))
			return SIZE_MAX;
	}
	return n;
}

static size_t align_up(size_t n)
{
	if (n > SIZE_MAX - KL_ARENA_ALIGN)
		return SIZE_MAX;
	return (n + KL_ARENA_ALIGN - 1) & ~(size_t)(KL_ARENA_ALIGN - 1);
}

void kl__memplan_free(kl_memplan *mp)
{
	free(mp->slot);
	free(mp->off);
	memset(mp, 0, sizeof *mp);
}

typedef struct slot {
	size_t size;
	bool busy;
} slot;

/* Whether output buffer b is lent: one of the last `lent` outputs, dense
 * (no view), written by a step, and no output before them a view of it
 * (that view would outlive the call) */
static bool lendable(const kl_program *p, int32_t b, int32_t nout, int32_t lent)
{
	const kl_buf *bf = &p->bufs[b];
	if (bf->role != KL_BUF_OUTPUT || bf->alias >= 0 || bf->index < nout - lent)
		return false;
	for (int32_t k = 0; k < p->nbufs; k++)
		if (p->bufs[k].role == KL_BUF_OUTPUT && p->bufs[k].alias == b &&
		    p->bufs[k].index < nout - lent)
			return false;
	return true;
}

kl_status kl__memplan_build(const kl_program *p, const int64_t *syms, int32_t lent,
                            kl_memplan *mp)
{
	memset(mp, 0, sizeof *mp);
	int32_t nb = p->nbufs;
	int32_t *first = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1));
	int32_t *last = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1));
	size_t *need = malloc(sizeof(size_t) * (size_t)(nb ? nb : 1));
	slot *slots = malloc(sizeof(slot) * (size_t)(nb ? nb : 1));
	mp->slot = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1));
	mp->off = calloc((size_t)(nb ? nb : 1), sizeof(size_t));
	kl_status st = KL_OK;
	int32_t nout = 0;
	for (int32_t b = 0; b < nb; b++)
		if (p->bufs[b].role == KL_BUF_OUTPUT && p->bufs[b].index >= nout)
			nout = p->bufs[b].index + 1;
	if (!first || !last || !need || !slots || !mp->slot || !mp->off) {
		st = KL_ENOMEM;
		goto done;
	}
	for (int32_t b = 0; b < nb; b++) {
		first[b] = last[b] = -1;
		mp->slot[b] = -1;
		need[b] = 0;
		const kl_buf *buf = &p->bufs[b];
		if (buf->role == KL_BUF_TEMP || (lent > 0 && lendable(p, b, nout, lent))) {
			need[b] = align_up(kl__buf_bytes(buf, syms));
			if (need[b] == SIZE_MAX) {
				st = KL_ENOMEM;
				goto done;
			}
		} else if (buf->role == KL_BUF_OUTPUT && buf->alias < 0) {
			size_t by = kl__buf_bytes(buf, syms);
			mp->out_bytes = by == SIZE_MAX ? SIZE_MAX : mp->out_bytes + by;
		}
	}
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		for (int i = 0; i < sp->nwrites + sp->nreads; i++) {
			int32_t b = i < sp->nwrites ? sp->writes[i] : sp->reads[i - sp->nwrites];
			if (first[b] < 0)
				first[b] = s;
			last[b] = s;
		}
	}
	/* a lent output lives to the call's end; one no step writes is made
	 * as any output is */
	for (int32_t b = 0; b < nb; b++) {
		if (p->bufs[b].role != KL_BUF_OUTPUT || need[b] == 0)
			continue;
		if (first[b] < 0) {
			size_t by = kl__buf_bytes(&p->bufs[b], syms);
			mp->out_bytes = by == SIZE_MAX ? SIZE_MAX : mp->out_bytes + by;
			need[b] = 0;
		} else {
			last[b] = p->nsteps;
			mp->nlent++;
		}
	}
	int32_t nslots = 0;
	size_t live = 0;
	for (int32_t s = 0; s < p->nsteps; s++) {
		/* allocate what this step starts to use before freeing what it stops
		 * using: a kernel's output never shares memory with its inputs */
		for (int32_t b = 0; b < nb; b++) {
			if (first[b] != s || need[b] == 0)
				continue;
			int32_t best = -1, largest = -1;
			for (int32_t k = 0; k < nslots; k++) {
				if (slots[k].busy)
					continue;
				if (slots[k].size >= need[b] &&
				    (best < 0 || slots[k].size < slots[best].size))
					best = k;
				if (largest < 0 || slots[k].size > slots[largest].size)
					largest = k;
			}
			if (best < 0 && largest >= 0) {
				/* growing a free slot costs less than a new one */
				best = largest;
				slots[best].size = need[b];
			}
			if (best < 0) {
				best = nslots++;
				slots[best].size = need[b];
			}
			slots[best].busy = true;
			mp->slot[b] = best;
			mp->temp_bytes += need[b];
			live += need[b];
		}
		if (live > mp->live_bytes)
			mp->live_bytes = live;
		for (int32_t b = 0; b < nb; b++)
			if (last[b] == s && mp->slot[b] >= 0) {
				slots[mp->slot[b]].busy = false;
				live -= need[b];
			}
	}
	size_t *slot_off = malloc(sizeof(size_t) * (size_t)(nslots ? nslots : 1));
	if (!slot_off) {
		st = KL_ENOMEM;
		goto done;
	}
	size_t total = 0;
	for (int32_t k = 0; k < nslots; k++) {
		slot_off[k] = total;
		total += slots[k].size;
	}
	for (int32_t b = 0; b < nb; b++)
		if (mp->slot[b] >= 0)
			mp->off[b] = slot_off[mp->slot[b]];
	free(slot_off);
	mp->nslots = nslots;
	mp->arena_bytes = total;
done:
	free(first);
	free(last);
	free(need);
	free(slots);
	if (st != KL_OK)
		kl__memplan_free(mp);
	return st;
}
