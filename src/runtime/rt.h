/* rt.h - private to the runtime: the system-compiler JIT, the disk cache and
 * the memory planner that compile.c and exec.c put together.
 */
#ifndef KILN_RT_H
#define KILN_RT_H

#include <limits.h>

#include "runtime/compiled.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* ---- jit_cc.c: C source -> shared object -> kernel pointers ------------------ */

/* A hash naming the toolchain: the compiler's resolved path, size and
 * modification time, the flags, and the host CPU (-march=native code must
 * not be loaded on another CPU). Computed without running the compiler. */
uint64_t kl__jit_cc_identity(void);
/* Compile source into a shared object inside workdir (a private directory
 * the caller owns); *so_path receives its path. KL_ECOMPILE with the first
 * lines of the compiler's stderr on failure. */
kl_status kl__jit_cc_build(kl_ctx *ctx, const char *source, const char *workdir, char *so_path,
                           size_t cap);
/* dlopen so_path and look up each kernel. */
kl_status kl__jit_load(kl_ctx *ctx, const char *so_path, char *const *names, int32_t n, void **dl,
                       kl_kernel_fn *fns);
void kl__jit_unload(void *dl);
/* The digest of the plan a loaded binary was built for (compile.c appends
 * kl_plan_digest() to every CPU source); false when it has none. */
bool kl__jit_plan_digest(void *dl, uint64_t *out);

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
/* Checksum and size of a whole file. KL_EIO when it cannot be read. */
kl_status kl__file_digest(const char *path, uint64_t *hash, uint64_t *size);

/* program_io.c: the largest element index operand which (0 a, 1 b, 2 c) of a
 * product reaches; -1 when empty, -2 when it overflows. */
int64_t kl__mm_extent(const kl_matmul_step *mm, int which);
/* The same for an attention step's operand which (0 q, 1 k, 2 v, 3 o). */
int64_t kl__attn_extent(const kl_attn_step *a, int which);

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
