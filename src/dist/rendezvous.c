/* rendezvous.c - handing rank 0's NCCL id to the other ranks over TCP, as
 * torchrun's MASTER_ADDR / MASTER_PORT: rank 0 listens, each other rank
 * connects (retrying until the timeout: rank 0 may start later) and reads
 * one message. Every read is bounded by the timeout (poll) and checked:
 * magic, version, the payload's length and rank 0's world size, so a peer
 * of another job or another world size is an error naming both values.
 * This moves one opaque blob, not tensors: no collective is built here.
 */
#include "dist/dist.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { RV_MAGIC = 0x4b4c5256, RV_VERSION = 1, RV_HDR = 16 };

static void put32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* wait until fd is ready for `events` or the deadline; false on timeout/error */
static bool wait_fd(int fd, short events, double deadline)
{
	for (;;) {
		double left = deadline - kl__dist_now();
		if (left <= 0)
			return false;
		struct pollfd p = {.fd = fd, .events = events};
		int r = poll(&p, 1, (int)(left * 1000) + 1);
		if (r > 0)
			return (p.revents & events) != 0;
		if (r < 0 && errno != EINTR)
			return false;
	}
}

static bool io_all(int fd, void *buf, size_t n, bool wr, double deadline)
{
	unsigned char *p = buf;
	while (n) {
		if (!wait_fd(fd, wr ? POLLOUT : POLLIN, deadline))
			return false;
		ssize_t k = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
		if (k < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (k <= 0)
			return false;
		p += k;
		n -= (size_t)k;
	}
	return true;
}

int kl__dist_tcp_listen(kl_ctx *ctx, int port, int *bound_port)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		kl_set_error(ctx, KL_EIO, "kl_comm_init: socket: %s", strerror(errno));
		return -1;
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
	                        .sin_addr.s_addr = htonl(INADDR_ANY)};
	socklen_t len = sizeof a;
	if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 64) != 0 ||
	    getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
		kl_set_error(ctx, KL_EIO, "kl_comm_init: rank 0 cannot listen on MASTER_PORT %d: %s",
		             port, strerror(errno));
		close(fd);
		return -1;
	}
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
	if (bound_port)
		*bound_port = ntohs(a.sin_port);
	return fd;
}

kl_status kl__dist_tcp_serve(kl_ctx *ctx, int fd, int size, double timeout, const void *blob,
                             size_t len)
{
	unsigned char hdr[RV_HDR];
	put32(hdr, RV_MAGIC);
	put32(hdr + 4, RV_VERSION);
	put32(hdr + 8, (uint32_t)size);
	put32(hdr + 12, (uint32_t)len);
	double deadline = kl__dist_now() + timeout;
	for (int served = 1; served < size; served++) {
		int c = -1;
		while (c < 0) {
			if (!wait_fd(fd, POLLIN, deadline)) {
				close(fd);
				return kl_set_error(ctx, KL_ESTATE,
				                    "kl_comm_init: rank 0 of %d: only %d of the %d other "
				                    "ranks connected within %g s",
				                    size, served - 1, size - 1, timeout);
			}
			c = accept(fd, NULL, NULL);
		}
		fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK);
		bool ok = io_all(c, hdr, sizeof hdr, true, deadline) &&
		          io_all(c, (void *)blob, len, true, deadline);
		close(c);
		if (!ok)
			served--; /* a peer that went away (or a stray): wait for another */
	}
	close(fd);
	return KL_OK;
}

kl_status kl__dist_tcp_fetch(kl_ctx *ctx, int rank, int size, const char *addr, int port,
                             double timeout, void *blob, size_t len)
{
	double deadline = kl__dist_now() + timeout;
	char ps[16];
	snprintf(ps, sizeof ps, "%d", port);
	struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
	int gr = getaddrinfo(addr, ps, &hints, &ai);
	if (gr != 0)
		return kl_set_error(ctx, KL_EINVAL, "kl_comm_init: rank %d: MASTER_ADDR \"%.64s\": %s",
		                    rank, addr, gai_strerror(gr));
	int spins = 0;
	for (;;) {
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
			fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
			unsigned char hdr[RV_HDR];
			bool ok = io_all(fd, hdr, sizeof hdr, false, deadline);
			kl_status st = KL_OK;
			if (!ok)
				st = kl_set_error(ctx, KL_ESTATE, "kl_comm_init: rank %d: rank 0 at %.64s:%d "
				                  "sent nothing within %g s", rank, addr, port, timeout);
			else if (get32(hdr) != RV_MAGIC || get32(hdr + 4) != RV_VERSION)
				st = kl_set_error(ctx, KL_EFORMAT, "kl_comm_init: rank %d: %.64s:%d is not a "
				                  "kiln rendezvous (magic %08x, version %u)", rank, addr, port,
				                  get32(hdr), get32(hdr + 4));
			else if (get32(hdr + 8) != (uint32_t)size)
				st = kl_set_error(ctx, KL_EINVAL, "kl_comm_init: rank %d: WORLD_SIZE is %d "
				                  "here but %u on rank 0", rank, size, get32(hdr + 8));
			else if (get32(hdr + 12) != len)
				st = kl_set_error(ctx, KL_EFORMAT, "kl_comm_init: rank %d: rank 0 sends %u "
				                  "bytes, not %zu", rank, get32(hdr + 12), len);
			else if (!io_all(fd, blob, len, false, deadline))
				st = kl_set_error(ctx, KL_ESTATE, "kl_comm_init: rank %d: rank 0's message "
				                  "was cut short", rank);
			close(fd);
			freeaddrinfo(ai);
			return st;
		}
		if (fd >= 0)
			close(fd);
		if (kl__dist_now() > deadline) {
			freeaddrinfo(ai);
			return kl_set_error(ctx, KL_ESTATE,
			                    "kl_comm_init: rank %d of %d: rank 0 did not listen at "
			                    "MASTER_ADDR %.64s, MASTER_PORT %d within %g s",
			                    rank, size, addr, port, timeout);
		}
		kl__dist_backoff(&spins);
	}
}
