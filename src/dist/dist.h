/* dist.h - the communicator's state, shared by the MPI (comm.c) and NCCL
 * (nccl.c) halves of the dist layer, and the call descriptions both check
 * across ranks before they move data. Built on the public API (kiln.h). */
#ifndef KILN_DIST_INT_H
#define KILN_DIST_INT_H

#include <kiln.h>
#include <kiln_dist.h>

#include <stdbool.h>
#include <stdint.h>

/* the collectives, as the call description names them */
typedef enum dist_kind {
	DIST_ALL_REDUCE = 1,
	DIST_BROADCAST,
	DIST_ALL_GATHER,
	DIST_REDUCE_SCATTER,
	DIST_BARRIER,
	DIST_NKINDS
} dist_kind;

/* One rank's call: what every rank must agree on before data moves. */
enum { DIST_HDR_LEN = 5 + KL_MAX_DIMS };
typedef struct dist_call {
	int64_t v[DIST_HDR_LEN]; /* kind, seq, dtype, root/op, ndim, shape... */
} dist_call;

struct kl_nccl; /* nccl.c */

struct kl_comm {
	kl_ctx *ctx;
	kl_comm_backend backend;
	int rank, size;
	double timeout_s;
	uint64_t seq;   /* collectives called so far */
	bool broken;    /* an earlier call failed across ranks */
	char why[400];  /* that failure, repeated by every later call */
	void *mpi;      /* comm.c: a duplicate of MPI_COMM_WORLD */
	struct kl_nccl *nccl;
};

const char *kl__dist_kind_name(dist_kind k);
void kl__dist_call_make(dist_call *c, dist_kind k, uint64_t seq, const kl_tensor *t, int64_t arg);
/* "#7 f32 [4,32]" into buf */
const char *kl__dist_call_str(const dist_call *c, char *buf, size_t cap);
/* Mark c broken with a message naming the call and this rank; returns
 * KL_ESTATE after setting it on c->ctx. */
kl_status kl__dist_fail(kl_comm *c, dist_kind k, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Seconds since an arbitrary start (CLOCK_MONOTONIC). */
double kl__dist_now(void);
/* Sleep a little while polling (grows from 20 us to 1 ms with *spins). */
void kl__dist_backoff(int *spins);

/* rendezvous.c: rank 0's blob (the NCCL id) to the other ranks over TCP.
 * listen: a socket on port (0: any; *bound_port says which), -1 and the
 * error set on failure. serve: hand blob to size - 1 ranks, then close fd.
 * fetch: connect to addr:port (retrying) and read the blob. Each step is
 * bounded by timeout seconds and fails naming the rank and the values. */
int kl__dist_tcp_listen(kl_ctx *ctx, int port, int *bound_port);
kl_status kl__dist_tcp_serve(kl_ctx *ctx, int fd, int size, double timeout, const void *blob,
                             size_t len);
kl_status kl__dist_tcp_fetch(kl_ctx *ctx, int rank, int size, const char *addr, int port,
                             double timeout, void *blob, size_t len);

/* nccl.c: KL_EDEVICE naming what is missing when NCCL cannot be used */
kl_status kl__nccl_init(kl_comm *c, const kl_comm_opts *opts);
void kl__nccl_free(kl_comm *c);
/* the collective on CUDA tensors (in, out dense; out NULL for in place) */
kl_status kl__nccl_run(kl_comm *c, dist_kind k, const dist_call *call, kl_tensor *in,
                       kl_tensor *out, kl_reduce_op op, int root);

#endif /* KILN_DIST_INT_H */
