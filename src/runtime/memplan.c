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
 * (no view), and no output before them a view of it (viewed[b]: that view
 * would outlive the call) */
static bool lendable(const kl_buf *bf, int32_t nout, int32_t lent, bool viewed)
{
	return bf->role == KL_BUF_OUTPUT && bf->alias < 0 && bf->index >= nout - lent && !viewed;
}

/* The slots above stack each slot's largest buffer one after another; a
 * buffer shorter-lived than its slot's largest wastes the rest of it. Laid
 * out by offset instead, largest first, each at the lowest offset clear of
 * every buffer placed whose life meets its own, the arena is often
 * smaller (the classic greedy-by-size placement): mp->off and arena_bytes
 * take that layout when it is. A buffer written in place of another
 * (head[]) lies where that one does: the chain is placed as one. */
static kl_status pack_by_size(int32_t nb, const int32_t *first, const int32_t *last,
                              const size_t *need, const int32_t *head, kl_memplan *mp)
{
	int32_t *item = malloc(sizeof *item * (size_t)(nb ? nb : 1));
	int32_t *end = malloc(sizeof *end * (size_t)(nb ? nb : 1));
	size_t *off = malloc(sizeof *off * (size_t)(nb ? nb : 1));
	int32_t *near = malloc(sizeof *near * (size_t)(nb ? nb : 1));
	if (!item || !end || !off || !near) {
		free(item), free(end), free(off), free(near);
		return KL_ENOMEM;
	}
	int32_t ni = 0;
	for (int32_t b = 0; b < nb; b++)
		end[b] = last[b];
	for (int32_t b = 0; b < nb; b++)
		if (mp->slot[b] >= 0 && head[b] != b && last[b] > end[head[b]])
			end[head[b]] = last[b];
	for (int32_t b = 0; b < nb; b++)
		if (mp->slot[b] >= 0 && head[b] == b)
			item[ni++] = b;
	/* largest first; ties by first use */
	for (int32_t i = 1; i < ni; i++)
		for (int32_t j = i; j > 0; j--) {
			int32_t x = item[j - 1], y = item[j];
			if (need[x] > need[y] || (need[x] == need[y] && first[x] <= first[y]))
				break;
			item[j - 1] = y;
			item[j] = x;
		}
	size_t total = 0;
	for (int32_t i = 0; i < ni; i++) {
		int32_t b = item[i], nn = 0;
		/* the placed ones alive with it, by offset */
		for (int32_t j = 0; j < i; j++) {
			int32_t c = item[j];
			if (first[c] <= end[b] && first[b] <= end[c]) {
				int32_t k = nn++;
				while (k > 0 && off[near[k - 1]] > off[c]) {
					near[k] = near[k - 1];
					k--;
				}
				near[k] = c;
			}
		}
		size_t at = 0;
		for (int32_t k = 0; k < nn; k++) {
			int32_t c = near[k];
			if (at + need[b] <= off[c])
				break;
			if (off[c] + need[c] > at)
				at = off[c] + need[c];
		}
		off[b] = at;
		if (at + need[b] > total)
			total = at + need[b];
	}
	if (total < mp->arena_bytes) {
		for (int32_t b = 0; b < nb; b++)
			if (mp->slot[b] >= 0)
				mp->off[b] = off[head[b]];
		mp->arena_bytes = total;
	}
	free(item), free(end), free(off), free(near);
	return KL_OK;
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
	bool *taken = calloc((size_t)(nb ? nb : 1), sizeof(bool)); /* its slot went on to a write */
	int32_t *head = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1)); /* in-place chains */
	bool *viewed = calloc((size_t)(nb ? nb : 1), sizeof(bool));
	mp->slot = malloc(sizeof(int32_t) * (size_t)(nb ? nb : 1));
	mp->off = calloc((size_t)(nb ? nb : 1), sizeof(size_t));
	kl_status st = KL_OK;
	int32_t nout = 0;
	for (int32_t b = 0; b < nb; b++)
		if (p->bufs[b].role == KL_BUF_OUTPUT && p->bufs[b].index >= nout)
			nout = p->bufs[b].index + 1;
	if (!first || !last || !need || !slots || !taken || !head || !viewed || !mp->slot || !mp->off) {
		st = KL_ENOMEM;
		goto done;
	}
	/* the buffers a returned output is a view of */
	for (int32_t b = 0; b < nb && lent > 0; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->role == KL_BUF_OUTPUT && bf->alias >= 0 && bf->alias < nb &&
		    bf->index < nout - lent)
			viewed[bf->alias] = true;
	}
	for (int32_t b = 0; b < nb; b++) {
		first[b] = last[b] = -1;
		head[b] = b;
		mp->slot[b] = -1;
		need[b] = 0;
		const kl_buf *buf = &p->bufs[b];
		if (buf->role == KL_BUF_TEMP || (lent > 0 && lendable(buf, nout, lent, viewed[b]))) {
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
		/* a kernel that writes in place (kl_step.inplace) as its input's last
		 * reader: its output takes that input's slot */
		const kl_step *sp = &p->steps[s];
		if (sp->kind == KL_STEP_KERNEL && sp->inplace && sp->nreads > 0 && sp->nwrites == 1) {
			int32_t r = sp->reads[0], w = sp->writes[0];
			if (p->bufs[r].role == KL_BUF_TEMP && p->bufs[w].role == KL_BUF_TEMP &&
			    last[r] == s && first[w] == s && mp->slot[r] >= 0 && need[r] == need[w]) {
				mp->slot[w] = mp->slot[r];
				taken[r] = true;
				head[w] = head[r];
				mp->temp_bytes += need[w];
				mp->ninplace++;
			}
		}
		/* allocate what this step starts to use before freeing what it stops
		 * using: a kernel's output never shares memory with its inputs
		 * (unless it writes in place, above) */
		for (int32_t b = 0; b < nb; b++) {
			if (first[b] != s || need[b] == 0 || mp->slot[b] >= 0)
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
			if (last[b] == s && mp->slot[b] >= 0 && !taken[b]) {
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
	st = pack_by_size(nb, first, last, need, head, mp);
done:
	free(first);
	free(last);
	free(need);
	free(slots);
	free(taken);
	free(head);
	free(viewed);
	if (st != KL_OK)
		kl__memplan_free(mp);
	return st;
}
