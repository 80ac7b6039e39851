/* pool.c - the caching allocator: size classes, per-class free lists, and an
 * open-addressing table of every block held so that free() knows a block's
 * class and refuses pointers it never handed out.
 */
#include "backend/cuda/pool.h"

#include <stdlib.h>

void kl__pool_init(kl_pool *p, kl_pool_raw_alloc ra, kl_pool_raw_free rf, void *user)
{
	memset(p, 0, sizeof *p);
	p->raw_alloc = ra;
	p->raw_free = rf;
	p->user = user;
}

int kl__pool_class(size_t nbytes)
{
	if (nbytes <= KL_POOL_MIN)
		return 0;
	int k = 63 - __builtin_clzll((unsigned long long)(nbytes - 1)); /* 2^k < n <= 2^(k+1) */
	size_t base = (size_t)1 << k, step = base >> 3;
	size_t j = (nbytes - base + step - 1) / step; /* 1..8 */
	int cls = (k - 9) * 8 + (int)j;
	return cls < KL_POOL_NCLASS ? cls : -1;
}

size_t kl__pool_class_size(int cls)
{
	if (cls <= 0)
		return KL_POOL_MIN;
	int k = 9 + (cls - 1) / 8;
	size_t j = (size_t)((cls - 1) % 8 + 1);
	return ((size_t)1 << k) + j * ((size_t)1 << (k - 3));
}

/* ---- the block table -------------------------------------------------------- */

static size_t slot_hash(uint64_t ptr, size_t cap)
{
	return (size_t)((ptr * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

static kl_pool_slot *slot_find(kl_pool *p, uint64_t ptr)
{
	if (!p->cap_slots)
		return NULL;
	for (size_t i = slot_hash(ptr, p->cap_slots);; i = (i + 1) & (p->cap_slots - 1)) {
		if (p->slots[i].ptr == ptr)
			return &p->slots[i];
		if (!p->slots[i].ptr)
			return NULL;
	}
}

static void slot_put(kl_pool_slot *slots, size_t cap, kl_pool_slot s)
{
	size_t i = slot_hash(s.ptr, cap);
	while (slots[i].ptr)
		i = (i + 1) & (cap - 1);
	slots[i] = s;
}

static bool slots_reserve(kl_pool *p)
{
	if ((p->nslots + 1) * 2 <= p->cap_slots)
		return true;
	size_t cap = p->cap_slots ? p->cap_slots * 2 : 64;
	kl_pool_slot *ns = calloc(cap, sizeof *ns);
	if (!ns)
		return false;
	for (size_t i = 0; i < p->cap_slots; i++)
		if (p->slots[i].ptr)
			slot_put(ns, cap, p->slots[i]);
	free(p->slots);
	p->slots = ns;
	p->cap_slots = cap;
	return true;
}

/* Linear probing deletion: shift later members of the run back so that no
 * lookup stops early at the hole. */
static void slot_remove(kl_pool *p, kl_pool_slot *s)
{
	size_t cap = p->cap_slots, i = (size_t)(s - p->slots);
	p->slots[i].ptr = 0;
	for (size_t j = (i + 1) & (cap - 1); p->slots[j].ptr; j = (j + 1) & (cap - 1)) {
		size_t h = slot_hash(p->slots[j].ptr, cap);
		/* may move to i when its home h is not in (i, j] cyclically */
		bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
		if (!stays) {
			p->slots[i] = p->slots[j];
			p->slots[j].ptr = 0;
			i = j;
		}
	}
	p->nslots--;
}

/* ---- alloc / free -------------------------------------------------------------- */

static kl_status raw_alloc_retry(kl_ctx *ctx, kl_pool *p, size_t sz, uint64_t *out)
{
	kl_status s = p->raw_alloc(ctx, p->user, sz, out);
	if (s == KL_ENOMEM && kl__pool_trim(p) > 0)
		s = p->raw_alloc(ctx, p->user, sz, out);
	if (s == KL_ENOMEM)
		return kl__err(ctx, KL_ENOMEM,
		               "kl_cuda: out of device memory allocating %zu bytes (%zu in use, "
		               "peak %zu)",
		               sz, p->st.in_use, p->st.peak);
	return s;
}

kl_status kl__pool_alloc(kl_ctx *ctx, kl_pool *p, size_t nbytes, uint64_t *out)
{
	int cls = kl__pool_class(nbytes ? nbytes : 1);
	if (cls < 0)
		return kl__err(ctx, KL_ENOMEM,
		               "kl_cuda: allocation of %zu bytes is larger than any "
		               "device memory",
		               nbytes);
	size_t sz = kl__pool_class_size(cls);
	kl_pool_list *fl = &p->free[cls];
	if (fl->n > 0) {
		uint64_t ptr = fl->ptrs[--fl->n];
		kl_pool_slot *s = slot_find(p, ptr);
		s->live = 1;
		p->st.hits++;
		p->st.in_use += sz;
		if (p->st.in_use > p->st.peak)
			p->st.peak = p->st.in_use;
		*out = ptr;
		return KL_OK;
	}
	if (!slots_reserve(p))
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory for the block table");
	uint64_t ptr = 0;
	kl_status s = raw_alloc_retry(ctx, p, sz, &ptr);
	if (s != KL_OK)
		return s;
	slot_put(p->slots, p->cap_slots, (kl_pool_slot){ptr, (uint32_t)cls, 1});
	p->nslots++;
	p->st.raw_allocs++;
	p->st.reserved += sz;
	p->st.in_use += sz;
	if (p->st.in_use > p->st.peak)
		p->st.peak = p->st.in_use;
	*out = ptr;
	return KL_OK;
}

kl_status kl__pool_free(kl_ctx *ctx, kl_pool *p, uint64_t ptr)
{
	kl_pool_slot *s = slot_find(p, ptr);
	if (!s || !s->live)
		return kl__err(ctx, KL_EINVAL, "kl_cuda: free of device pointer 0x%llx that is %s",
		               (unsigned long long)ptr,
		               s ? "already free" : "not from this context");
	kl_pool_list *fl = &p->free[s->cls];
	if (fl->n == fl->cap) {
		int32_t cap = fl->cap ? fl->cap * 2 : 8;
		uint64_t *np = realloc(fl->ptrs, (size_t)cap * sizeof *np);
		if (!np) {
			/* no room to cache it: give it back instead */
			size_t sz = kl__pool_class_size((int)s->cls);
			slot_remove(p, s);
			p->raw_free(p->user, ptr);
			p->st.raw_frees++;
			p->st.in_use -= sz;
			p->st.reserved -= sz;
			return KL_OK;
		}
		fl->ptrs = np;
		fl->cap = cap;
	}
	s->live = 0;
	fl->ptrs[fl->n++] = ptr;
	p->st.in_use -= kl__pool_class_size((int)s->cls);
	return KL_OK;
}

size_t kl__pool_trim(kl_pool *p)
{
	size_t freed = 0;
	for (int c = 0; c < KL_POOL_NCLASS; c++) {
		kl_pool_list *fl = &p->free[c];
		for (int32_t i = 0; i < fl->n; i++) {
			kl_pool_slot *s = slot_find(p, fl->ptrs[i]);
			if (s)
				slot_remove(p, s);
			p->raw_free(p->user, fl->ptrs[i]);
			p->st.raw_frees++;
			freed += kl__pool_class_size(c);
		}
		fl->n = 0;
	}
	p->st.reserved -= freed;
	return freed;
}

void kl__pool_reset_peak(kl_pool *p)
{
	p->st.peak = p->st.in_use;
}

void kl__pool_fini(kl_pool *p)
{
	for (size_t i = 0; i < p->cap_slots; i++) {
		if (p->slots[i].ptr) {
			p->raw_free(p->user, p->slots[i].ptr);
			p->st.raw_frees++;
		}
	}
	for (int c = 0; c < KL_POOL_NCLASS; c++)
		free(p->free[c].ptrs);
	free(p->slots);
	kl_pool_stats st = p->st;
	kl_pool_raw_alloc ra = p->raw_alloc;
	kl_pool_raw_free rf = p->raw_free;
	void *user = p->user;
	kl__pool_init(p, ra, rf, user);
	/* keep the counters: callers read them after fini to check for leaks */
	p->st.raw_allocs = st.raw_allocs;
	p->st.raw_frees = st.raw_frees;
	p->st.peak = st.peak;
}
