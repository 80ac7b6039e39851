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
/* A fresh private directory for building (inside the cache dir when there is
 * one, else under $TMPDIR); remove it with kl__rmtree_flat. */
kl_status kl__cache_workdir(kl_ctx *ctx, const char *cachedir, char *buf, size_t cap);
/* Remove a directory and the plain files directly inside it. */
void kl__rmtree_flat(const char *dir);
/* Read entry `name` (header checked: magic, format, key, length, checksum).
 * KL_OK: *payload is malloc'd. KL_EIO: absent. KL_EFORMAT: present but
 * corrupt (logged under KILN_LOGS=cache; the caller rebuilds it). */
kl_status kl__cache_get(const kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        void **payload, size_t *len);
/* Write entry `name` atomically (unique temp file, fsync, rename). */
kl_status kl__cache_put(kl_ctx *ctx, const char *dir, const char *name, uint64_t key,
                        const void *payload, size_t len);
/* Move a finished file into place atomically (fsync, rename, fsync dir). */
kl_status kl__cache_publish(kl_ctx *ctx, const char *tmp_path, const char *final_path);
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
kl_status kl__memplan_build(const kl_program *p, const int64_t *syms, kl_memplan *mp);
void kl__memplan_free(kl_memplan *mp);

#define KL_ARENA_ALIGN 64

#endif /* KILN_RT_H */
