/* fuzz_util.h - what kiln's libFuzzer targets share: seed writing, a quiet
 * CPU context, the small graphs whose cache entries the cache targets mutate,
 * and the invariants every failed call must keep (a status and a message).
 *
 * Every target writes its own seeds when KILN_FUZZ_SEEDS names a directory:
 * LLVMFuzzerInitialize writes them there before libFuzzer reads its corpus
 * directories, so fuzz/run.sh starts each run from seeds this build made (they
 * follow the current plan format) as well as from the committed corpus. Run
 * without arguments, a target only writes its seeds and exits (that is how
 * fuzz/corpus/ was made).
 */
#ifndef KILN_FUZZ_UTIL_H
#define KILN_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "kiln.h"

/* Stop the process with a message: an invariant of the target broke. */
_Noreturn void kf_die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* KILN_FUZZ_SEEDS, or NULL when the target should fuzz. */
const char *kf_seed_dir(void);
void kf_write_seed(const char *dir, const char *name, const void *data, size_t len);
/* After writing seeds: exit when the target was run without arguments. */
void kf_seeds_done(int argc);

/* A one-thread CPU context (the fuzz machines are small); dies on failure. */
kl_ctx *kf_ctx(void);

/* A private scratch directory, made once per process and removed at exit:
 * under $KILN_FUZZ_SCRATCH (fuzz/run.sh makes one per run and removes it,
 * crash or not), else /dev/shm (so that per-input files cost no disk I/O),
 * else $TMPDIR. */
const char *kf_scratch(void);

/* After a failed call: the status must not be KL_OK and the message must be
 * non-empty (dies otherwise); a message that does not name op is counted and
 * its first instance printed at exit. Clears the error. */
void kf_check_failure(kl_ctx *ctx, const char *op);

/* ---- the graphs (fuzz_graphs.c) -------------------------------------------- */

typedef struct kf_graph {
	const char *name;
	kl_fn_body body;
	int nin, nout;
	kl_tensor *(*make_input)(kl_ctx *ctx, int i);
} kf_graph;

extern const kf_graph kf_graphs[];
extern const int kf_ngraphs;

/* A graph's plan entry as kiln's cache stores it (runtime/compile.c): the key
 * of its entry, and its payload: the shared object's digest and size (16
 * bytes) and then the serialized program. */
typedef struct kf_plan {
	char entry[96]; /* the entry's file name: plan-<key>.klc */
	uint64_t key;
	uint8_t *payload;
	size_t len;
} kf_plan;

/* Compile and call each graph once through ctx with the cache at dir
 * (KILN_CACHE_DIR must already name it) and read back the plan entry that
 * each wrote. plans[] has kf_ngraphs entries. Dies on any failure. */
void kf_make_plans(kl_ctx *ctx, const char *dir, kf_plan *plans);

#endif
