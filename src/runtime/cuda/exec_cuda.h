/* exec_cuda.h - the state a compiled variant keeps on the GPU (exec_cuda.c), shared
 * with the autotuner (tune_cuda.c): module and kernels, the temps' arena, the
 * per-step launch choices, and the CUDA graph of reduce-overhead with the
 * bookkeeping that re-points its nodes when buffers move.
 */
#ifndef KILN_RT_CUDA_H
#define KILN_RT_CUDA_H

#include "backend/cuda/device.h"
#include "runtime/runtime_int.h"

typedef enum kl_gstate { KL_G_WARMUP = 0, KL_G_CAPTURE, KL_G_READY, KL_G_OFF } kl_gstate;

/* How a captured graph reaches buffer b. */
typedef enum kl_gbuf {
	KL_GB_DIRECT = 0, /* nodes hold its address; kernel nodes are re-pointed when it moves */
	KL_GB_PINNED,     /* a library call holds its address: it must not move */
	KL_GB_STAGED      /* a static copy inside the graph, the copy node re-pointed */
} kl_gbuf;

/* One CUDA graph of a variant and what replaying it needs: its temps' arena
 * (the graph addresses it) and the re-pointing state. A variant with static
 * dims has one; one with dynamic dims one per vector of symbol values (a
 * shape bucket), made on the first call at those sizes (warm-up, then
 * capture), the least recently used one given up past kl__gslot_limit(). */
typedef struct kl_cuda_gslot {
	kl_gstate gs;
	kl_cuda_graph graph;
	CUdeviceptr arena;
	size_t arena_cap;
	bool *must_stage;     /* per buffer: moved while pinned once, staged from now on */
	void **warm;          /* per buffer: its address at the warm-up call */
	void **bound;         /* per buffer: the address the graph now works on */
	uint8_t *how;         /* per buffer: kl_gbuf */
	CUdeviceptr *stat;    /* per buffer: its static copy when staged */
	size_t *stat_bytes;
	CUgraphNode *copy_node; /* per buffer: the copy in (input) or out (output) */
	CUDA_MEMCPY3D *copy_params;
	CUgraphNode *knode;     /* per step: its kernel node (NULL: none) */
	CUDA_KERNEL_NODE_PARAMS *kparams;
	const void *tail_id; /* the kl_run_tail captured after the steps (NULL: none) */
} kl_cuda_gslot;

typedef struct kl_cuda_rt {
	kl_ctx *ctx;
	kl_cuda_dev *dev;
	kl_cuda_module *mod;
	CUfunction *fns;
	int32_t nfns;
	uint64_t *args; /* the kl_args block: buffer pointers, then symbols */
	size_t nargs;
	/* kl__cuda_args_indirect: the block's copy in device memory, which the
	 * kernels take by address (0: they take the block by value) */
	CUdeviceptr dargs;
	/* launch choices per step (max-autotune; zero: the defaults) */
	uint32_t *gcap;    /* kernel steps: grid cap in blocks, 0 = the renderer's choice */
	int *fit;          /* kernel k: its blocks resident on one SM (occupancy), 0 = not asked */
	int waves;         /* KILN_CUDA_WAVES (0-64; -1 unset): every kernel's grid is at
	                    * most this many full waves, 0 no cap: a block per row group
	                    * (an A/B knob; read when the module loads). Unset: a row
	                    * step's own (kl_step.waves), else one */
	bool pw_flat;      /* KILN_CUDA_PW_FLAT (default 1; 0: off): a pointwise kernel's grid
	                    * holds every chunk, one a thread, not at most rt->waves waves */
	int64_t *pts;      /* step s: the points a thread of a pointwise step takes, 0 for
	                    * other steps (found once, when the module loads) */
	kl_lt_algo *algo;  /* matmul steps: cuBLASLt algorithm when has_algo */
	bool *has_algo;
	bool tuned;        /* choices made (timed or read back) for this variant */
	uint8_t *pkg_choices; /* a package's choices (tune_cuda.c's encoding), applied at the
	                       * first call when they suit this device and the buffers */
	size_t pkg_choices_len;
	/* CUDA graph replay: the slots (kl_cuda_gslot), g the one this call
	 * uses; keys/used: each slot's symbol values and last use
	 * (graph_slots.c); gs0: a new slot's state (KL_G_OFF: no graphs) */
	kl_cuda_gslot *slots, *g;
	int nslots, maxslots;
	int64_t *keys;
	uint64_t *used, calls, evictions;
	kl_gstate gs0;
	bool recording;       /* capturing: launch_steps notes each kernel's node */
	bool *mm_touch;       /* per buffer: a matmul step reads or writes it */
	bool *dirty;            /* per step, scratch */
	/* the attention backward's L from its forward (attention_cuda.c): per
	 * step, the pair (forward, backward over the same q and k) it belongs
	 * to, or -1 (lse_link; NULL where the program has symbolic dims); per
	 * pair, the rows' L in the device pool (lse_buf, 0 until the forward
	 * first runs) and whether the forward wrote it in this call's launches
	 * (lse_ok; its kernel may be one that cannot) */
	int32_t *lse_link;
	CUdeviceptr *lse_buf;
	bool *lse_ok;
	int32_t nlse;
	void **sb;              /* per buffer, scratch: the addresses the graph uses */
	/* counters of this variant */
	uint64_t captures, replays, kernel_updates, copy_updates;
	double capture_ms; /* the captures' time, all of them */
} kl_cuda_rt;

/* Steps [s0, s1) on the stream with the variant's launch choices. */
kl_status kl__cuda_rt_launch(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms,
                             int32_t s0, int32_t s1);

/* Process-wide counters (tests, bench): graphs captured, replays, kernel
 * and copy nodes re-pointed; variants timed by the autotuner, choices read
 * back from the disk cache, entries rejected. */
typedef struct kl_cuda_counters {
	long captures, replays, kernel_updates, copy_updates;
	long tunes, tune_hits, tune_rejects;
} kl_cuda_counters;
void kl__cuda_counters(kl_cuda_counters *out);
void kl__cuda_count_tune(int which); /* 0: tuned, 1: cache hit, 2: entry rejected */

/* ---- tune_cuda.c ------------------------------------------------------------- */

/* One step's choice as stored: grid cap (kernels) or algorithm (matmuls). */
typedef struct kl_tune_step {
	uint32_t gcap;
	bool has_algo;
	kl_lt_algo algo;
	float ms; /* its time when chosen */
} kl_tune_step;

/* The entry's bytes for a program of nsteps steps on device devid. */
kl_status kl__tune_encode(const kl_program *p, uint64_t devid, const kl_tune_step *steps,
                          uint8_t **out, size_t *len);
/* Parse and check an entry against p and devid: KL_EFORMAT with the reason
 * in why when anything does not fit (size, version, device, step kinds,
 * values out of range). steps: p->nsteps entries. */
kl_status kl__tune_decode(const kl_program *p, uint64_t devid, const void *data, size_t len,
                          kl_tune_step *steps, char *why, size_t cap);
/* A hash naming the device for tuned choices: its name, architecture, SM
 * count, memory, the cuBLASLt version. */
uint64_t kl__tune_device_id(kl_ctx *ctx, const kl_cuda_dev *d);
/* The entry name and cache key of variant `key` on device devid. */
void kl__tune_entry(uint64_t key, uint64_t devid, char *name, size_t cap, uint64_t *ekey);

/* Make c's launch choices on the call's buffers: read them from the disk
 * cache, or time the candidates (cuBLASLt's algorithms per product, grid
 * caps per kernel) and store the fastest. Leaves the buffers that steps
 * write in an unspecified state: run the steps afterwards. */
kl_status kl__cuda_tune(kl_ctx *ctx, kl_compiled *c, void *const *B, const int64_t *syms);

#endif /* KILN_RT_CUDA_H */
