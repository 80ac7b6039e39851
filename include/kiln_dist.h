/* kiln_dist.h - communicators and data-parallel training (libkiln_dist).
 *
 * A kl_comm joins the processes of one job. Two backends, each an existing
 * engine (kiln has no collective algorithms of its own):
 *  - KL_COMM_MPI: Open MPI (linked; programs start under `mpirun -np N`),
 *    tensors of any device, reduced on the host (floats as f32, f64 as f64,
 *    i32/i64 as themselves).
 *  - KL_COMM_NCCL: NCCL, loaded with dlopen (libnccl.so.2) like the rest of
 *    the CUDA stack, on tensors of a CUDA context, on its stream. Rank and
 *    size come from the environment as torchrun sets them (RANK, WORLD_SIZE;
 *    under mpirun OMPI_COMM_WORLD_RANK/SIZE), the NCCL id from rank 0 over
 *    TCP at MASTER_ADDR:MASTER_PORT (torchrun's variables), else through a
 *    file (opts.rendezvous_file, else $KILN_DIST_FILE) that rank 0 writes.
 * KL_COMM_AUTO picks NCCL for a CUDA context, MPI for a CPU one.
 *
 * Every collective is checked before it moves data: each rank's call (which
 * collective, its sequence number, dtype, shape, root) reaches rank 0, which
 * compares them and answers every rank. A rank that does not arrive within
 * opts.timeout_s (a rank that exited, hangs, or called another collective)
 * or arrives with another shape makes the call fail on the others with
 * KL_ESTATE and a message naming the call, this rank, the other rank and both
 * shapes, e.g.
 *     kl_comm_all_reduce: rank 0 of 2: call #7 [4,32] f32: rank 1 did not
 *     reach it within 5 s (it exited, hangs, or is in another collective)
 * After such an error the communicator is broken: every later call fails
 * at once (kl_comm_free still releases it). Errors are set on the context
 * the communicator was made for (kl_last_error(ctx)).
 */
#ifndef KILN_DIST_H
#define KILN_DIST_H

#include <kiln.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kl_comm kl_comm;

typedef enum kl_comm_backend { KL_COMM_AUTO = 0, KL_COMM_MPI, KL_COMM_NCCL } kl_comm_backend;
typedef enum kl_reduce_op { KL_REDUCE_SUM = 0, KL_REDUCE_MEAN } kl_reduce_op;

typedef struct kl_comm_opts {
	kl_comm_backend backend;
	/* seconds a collective waits for the other ranks before it fails
	 * (0: $KILN_DIST_TIMEOUT, else 300) */
	double timeout_s;
	/* NCCL's rendezvous file (NULL: MASTER_ADDR/MASTER_PORT if set, else
	 * $KILN_DIST_FILE) */
	const char *rendezvous_file;
} kl_comm_opts;

/* Join the job (MPI_Init on first use). NULL on failure, the reason in
 * kl_last_error(ctx): the backend missing, WORLD_SIZE/RANK disagreeing with
 * the launcher's, a rendezvous that timed out. */
kl_comm *kl_comm_init(kl_ctx *ctx, const kl_comm_opts *opts);
/* Leave (MPI_Finalize when the last communicator goes). NULL is fine. */
void kl_comm_free(kl_comm *c);
int kl_comm_rank(const kl_comm *c);
int kl_comm_size(const kl_comm *c);
/* "mpi" or "nccl" */
const char *kl_comm_backend_name(const kl_comm *c);

/* In place: t becomes the sum (or mean) of every rank's t. Same dtype and
 * shape on every rank. Bumps t's version as kl_copy does. */
kl_status kl_comm_all_reduce(kl_comm *c, kl_tensor *t, kl_reduce_op op);
/* In place: t becomes root's t. */
kl_status kl_comm_broadcast(kl_comm *c, kl_tensor *t, int root);
/* A new tensor [size * d0, d1, ...]: every rank's t, rank order, along dim 0
 * (torch's all_gather_into_tensor). t must have at least one dim. */
kl_tensor *kl_comm_all_gather(kl_comm *c, kl_tensor *t);
/* A new tensor [d0 / size, d1, ...]: rank r's block of the sum (or mean)
 * of every rank's t (torch's reduce_scatter_tensor). d0 % size == 0. */
kl_tensor *kl_comm_reduce_scatter(kl_comm *c, kl_tensor *t, kl_reduce_op op);
/* Waits until every rank calls it (same checks and timeout). */
kl_status kl_comm_barrier(kl_comm *c);

/* ---- data parallel ------------------------------------------------------
 * kl_ddp_new broadcasts params (n tensors, dense, the same list on every
 * rank) from rank 0, then kl_ddp_sync_grads, called between kl_backward and
 * the optimizer's step, replaces each parameter's .grad with the mean over
 * ranks, one all-reduce per bucket of consecutive parameters (in reverse
 * order, the order a backward produces them) of at most bucket_bytes
 * (0: 25 MB, as torch's DDP; a bucket holds one dtype). Every parameter
 * must have a .grad (KL_ESTATE naming it otherwise). With each rank on its own 1/N of the batch and a loss
 * that is a mean over the batch, the step is the single-process step on
 * the whole batch. */
typedef struct kl_ddp kl_ddp;
kl_ddp *kl_ddp_new(kl_comm *c, kl_tensor *const *params, int n, size_t bucket_bytes);
kl_status kl_ddp_sync_grads(kl_ddp *d);
/* buckets the last sync used (after kl_ddp_new: the planned count) */
int kl_ddp_buckets(const kl_ddp *d);
void kl_ddp_free(kl_ddp *d);

#ifdef __cplusplus
}
#endif

#endif /* KILN_DIST_H */
