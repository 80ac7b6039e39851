/* runtime_int.h - private to the runtime: the compile driver's lowering and
 * rendering, the disk cache and the memory planner that compile.c and exec.c
 * put together.
 */
#ifndef KILN_RT_H
#define KILN_RT_H

#include <limits.h>

#include "lower/lower.h"
#include "runtime/compiled.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* ---- cache.c: the content-addressed disk cache ----------------------------- */

/* The cache directory (created 0700), or false when there is none we can
 * trust (not ours, writable by others, not creatable): then nothing is read
 * from or written to disk. */
bool kl__cache_dir(const kl_ctx *ctx, char *buf, size_t cap);
/* A fresh private directory for building under $TMPDIR (mkdtemp; inside the
 * cache dir only when the temp dir has no room); remove it with
 * kl__rmtree_flat. Building never writes into the cache directory: a
 * read-only or full cache only loses the entries (kl__cache_put). */
kl_status kl__cache_workdir(kl_ctx *ctx, const char *cachedir, char *buf, size_t cap);
/* Remove a directory and the plain files directly inside it. */
void kl__rmtree_flat(const char *dir);
/* Read entry `name` (header checked: magic, format, key, length, checksum).
 * KL_OK: *payload is malloc'd. KL_EIO: absent. KL_EFORMAT: present but
 * corrupt (logged under KILN_LOGS=cache; the caller rebuilds it). */
kl_status kl__cache_get(const kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        void **payload, size_t *len);
/* Write entry `name` atomically (unique temp file, fsync, rename). KL_EIO
 * when the directory cannot take it (read-only, full): logged, and the first
 * such failure per directory is a warning on stderr; the caller goes on
 * uncached. */
kl_status kl__cache_put(kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        const void *payload, size_t len);
/* Copy the size bytes of file src into the cache as `name`, the same way
 * (a binary: its digest is checked by whoever loads it). */
kl_status kl__cache_put_file(kl_ctx *ctx, const char *dir, const char *name, const char *src,
                             uint64_t size);
/* Tests only: nonzero makes every write into a cache directory fail with
 * this errno (ENOSPC: a full disk). */
extern int kl__cache_fail_writes;
/* The whole of a regular file, malloc'd (never blocks on a FIFO). KL_EIO
 * when it cannot be read. */
kl_status kl__file_read(const char *path, uint8_t **bytes, size_t *len);
/* Checksum and size of a whole file. KL_EIO when it cannot be read. */
kl_status kl__file_digest(const char *path, uint64_t *hash, uint64_t *size);

/* ---- render_plan.c: the compile driver's lowering and rendering ------------ */

/* Lower g (kl__lower_ir), then render its kernels for o->target into one
 * translation unit: out is the whole plan, source included. On failure out
 * is empty and err says why. */
kl_status kl__lower(const kl_graph *g, const kl_lower_opts *o, kl_program *out, char *err,
                    size_t errcap);

/* ---- memplan.c: TEMP buffers into arena slots by liveness ------------------ */

/* Bytes of buffer b with symbols at syms (dense layout). */
size_t kl__buf_bytes(const kl_buf *b, const int64_t *syms);
/* Value of dim d: its constant, or its symbol's value. */
static inline int64_t kl__dim_value(const kl_symdim *d, const int64_t *syms)
{
	return d->sym > 0 ? syms[d->sym - 1] : d->v;
}
/* The slots of p's TEMP buffers at syms, and of its last `lent` outputs
 * (kl_compile_cfg.lent): those live in the arena from their first step to
 * the call's end, and the call lends them to its caller (exec.c) */
kl_status kl__memplan_build(const kl_program *p, const int64_t *syms, int32_t lent,
                            kl_memplan *mp);
void kl__memplan_free(kl_memplan *mp);

#define KL_ARENA_ALIGN 64

/* graph_slots.c: the CUDA graph of a variant with dynamic dims that serves a
 * call. keys: n vectors of KL_GSLOT_KEY symbol values (the first nsyms
 * used), used: each one's last use (larger: later). Returns the slot for
 * syms: its own (KL_GSLOT_HIT), a new one, n (KL_GSLOT_NEW, when n < max),
 * or the least recently used one, to be given up (KL_GSLOT_EVICT). */
#define KL_GSLOT_KEY (KL_MAX_DIMS * 4)
#define KL_GSLOT_DEFAULT 32
typedef enum kl_gslot_pick_how { KL_GSLOT_HIT, KL_GSLOT_NEW, KL_GSLOT_EVICT } kl_gslot_pick_how;
int kl__gslot_pick(const int64_t *keys, const uint64_t *used, int n, int max, int nsyms,
                   const int64_t *syms, kl_gslot_pick_how *how);
/* KILN_CUDA_GRAPHS_MAX (1-1024), else KL_GSLOT_DEFAULT: the graphs a
 * variant with dynamic dims keeps */
int kl__gslot_limit(void);

#endif /* KILN_RT_H */
