/* pool.h - the caching allocator behind CUDA device memory: size-class free
 * lists over blocks from a raw allocator (cuMemAlloc), so that after warm-up
 * the hot path never calls into the driver, and a CUDA graph capture (which
 * forbids cuMemAlloc) can still allocate. Device-agnostic, so tests drive it
 * with a host allocator.
 */
#ifndef KILN_CUDA_POOL_H
#define KILN_CUDA_POOL_H

#include "core/core.h"

/* Classes: 512 bytes, then 8 steps per power of two (at most 12.5% waste). */
#define KL_POOL_MIN 512u
#define KL_POOL_NCLASS 320

/* Returns KL_OK, or KL_ENOMEM with no message (the pool then frees its
 * cached blocks and retries), or another status with the message set. */
typedef kl_status (*kl_pool_raw_alloc)(kl_ctx *ctx, void *user, size_t nbytes, uint64_t *out);
typedef void (*kl_pool_raw_free)(void *user, uint64_t p);

typedef struct kl_pool_stats {
	size_t in_use;       /* bytes of live blocks (class sizes) */
	size_t peak;         /* highest in_use since init or kl__pool_reset_peak */
	size_t reserved;     /* bytes held from the raw allocator (live + cached) */
	uint64_t raw_allocs; /* calls into the raw allocator that succeeded */
	uint64_t raw_frees;
	uint64_t hits; /* allocations served from a free list */
} kl_pool_stats;

typedef struct kl_pool_slot {
	uint64_t ptr; /* 0: empty */
	uint32_t cls;
	uint32_t live;
} kl_pool_slot;

typedef struct kl_pool_list {
	uint64_t *ptrs;
	int32_t n, cap;
} kl_pool_list;

typedef struct kl_pool {
	kl_pool_raw_alloc raw_alloc;
	kl_pool_raw_free raw_free;
	void *user;
	kl_pool_list free[KL_POOL_NCLASS];
	kl_pool_slot *slots; /* every block held, live or cached: open addressing */
	size_t nslots, cap_slots;
	kl_pool_stats st;
} kl_pool;

void kl__pool_init(kl_pool *p, kl_pool_raw_alloc ra, kl_pool_raw_free rf, void *user);
/* Frees every block, live or cached, back to the raw allocator. */
void kl__pool_fini(kl_pool *p);
/* A block of at least nbytes (0 counts as 1), aligned as the raw allocator's. */
kl_status kl__pool_alloc(kl_ctx *ctx, kl_pool *p, size_t nbytes, uint64_t *out);
/* Returns a block to its free list; a pointer the pool did not hand out (or
 * one freed twice) is KL_EINVAL and changes nothing. */
kl_status kl__pool_free(kl_ctx *ctx, kl_pool *p, uint64_t ptr);
/* Gives every cached block back to the raw allocator; returns the bytes freed. */
size_t kl__pool_trim(kl_pool *p);
void kl__pool_reset_peak(kl_pool *p);
/* The class a request falls in, and the bytes a block of that class holds. */
int kl__pool_class(size_t nbytes);
size_t kl__pool_class_size(int cls);

#endif /* KILN_CUDA_POOL_H */
