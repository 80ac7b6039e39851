/* pool.c - kiln's CPU thread pool (issue 22): the parallel loops of the CPU
 * kernels and of the generated C run here, not on OpenMP's team.
 *
 * Why its own: libgomp's waiting threads spin for milliseconds (its default)
 * or sleep at once (OMP_WAIT_POLICY=passive). On a machine busy with other
 * work, a spinning worker holds a core the thread it waits for needs, and a
 * compiled call of two dozen small products took 300x its quiet time; sleeping
 * at once costs a futex wake-up per region on a quiet machine (4-6x on the
 * small workloads). Here an idle worker spins (long on a quiet machine, briefly
 * on a busy one: wait_next_region) after each region,
 * which catches the next region of a call, then sleeps on a futex. The work of
 * a region is cut into chunks that the caller and the workers claim one at a
 * time, so a worker the scheduler has not run yet delays nothing: the caller
 * takes its chunks, and a region on a loaded machine degrades to the caller's
 * single-thread speed instead of waiting for a thread that is not running.
 *
 * One region runs at a time (a second caller, or a region inside a chunk,
 * runs its loop inline); workers start on first use and live for the process.
 * The thread count a context uses by default is the cores this process may
 * run on: its affinity mask, capped by a cgroup CPU quota (kl__cpu_cores).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"

/* How long a caller waiting for the last chunk, or an idle worker on a busy
 * machine, spins before it sleeps: longer than the gap between the regions
 * of one call (a few microseconds of serial glue), short against a
 * scheduler's time slice. */
#define SPIN_NS 50000
/* The back-off from the pool on a busy machine (kl__par_for): a wait for
 * the last chunk past BACKOFF_MIN_NS (and twice the caller's own work)
 * turns regions serial for BACKOFF_FIRST_NS, doubling to BACKOFF_MAX_NS. */
#define BACKOFF_MIN_NS 200000
#define BACKOFF_FIRST_NS 10000000
#define BACKOFF_MAX_NS 160000000
/* Chunks per thread of a region: late threads leave their share to others. */
#define CHUNKS_PER_THREAD 4

static struct {
	pthread_mutex_t busy;    /* held by the region's caller */
	pthread_mutex_t grow;    /* starting workers */
	int nworkers;            /* started (under grow) */
	_Atomic int want;        /* workers the region may use */
	_Atomic uint32_t gen;    /* region number: workers sleep on it */
	_Atomic int sleepers;    /* workers asleep (or going to sleep) on gen */
	_Atomic uint64_t ticket; /* gen << 32 | next chunk */
	_Atomic uintptr_t fn, arg;
	_Atomic int64_t n, nchunks;
	_Atomic uint32_t done; /* chunks finished: the caller sleeps on it */
	_Atomic int waiting;    /* the caller is asleep (or going to sleep) on done */
	int64_t serial_until;   /* regions run on their caller until then (under busy) */
	int64_t backoff;        /* the last back-off, ns (under busy) */
} P = {.busy = PTHREAD_MUTEX_INITIALIZER, .grow = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int in_region;

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
	syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr, int n)
{
	syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Idle spins are short (SPIN_NS) until then: set when a spin was preempted
 * or a region backed off (wait_next_region, kl__par_for). */
static _Atomic int64_t short_until;
#define PREEMPT_NS 200000
#define SHORT_FOR_NS 100000000

/* Spin until *w differs from old, for at most limit ns; true when it did.
 * A spin the scheduler interrupted (two looks at the clock PREEMPT_NS
 * apart) means other work wants the core: it stops, and idle spins stay
 * short for SHORT_FOR_NS. */
static bool spin_until_changed(_Atomic uint32_t *w, uint32_t old, int64_t limit)
{
	int64_t t0 = 0, last = 0;
	for (int i = 1;; i++) {
		if (atomic_load_explicit(w, memory_order_acquire) != old)
			return true;
		cpu_relax();
		if ((i & 63) == 0) {
			int64_t t = now_ns();
			if (!t0)
				t0 = t;
			if (last && t - last > PREEMPT_NS) {
				atomic_store_explicit(&short_until, t + SHORT_FOR_NS,
				                      memory_order_relaxed);
				return false;
			}
			if (t - t0 > limit)
				return false;
			last = t;
		}
	}
}

/* Claim and run chunks of region g until none is left. */
static void run_chunks(uint32_t g)
{
	for (;;) {
		uint64_t t = atomic_load(&P.ticket);
		if ((uint32_t)(t >> 32) != g)
			return;
		/* acquire: a field of the next region read here orders its
		 * caller's closing of the ticket (kl__par_for) before the claim
		 * below, which then fails */
		kl_par_fn fn = (kl_par_fn)atomic_load_explicit(&P.fn, memory_order_acquire);
		void *arg = (void *)atomic_load_explicit(&P.arg, memory_order_acquire);
		int64_t n = atomic_load_explicit(&P.n, memory_order_acquire);
		int64_t nch = atomic_load_explicit(&P.nchunks, memory_order_acquire);
		int64_t c = (int64_t)(t & 0xffffffffu);
		if (c >= nch)
			return;
		/* the fields are region g's when the claim succeeds: another
		 * region writes them only after every chunk of g was claimed and
		 * after closing the ticket, either of which moves it past t */
		if (!atomic_compare_exchange_weak(&P.ticket, &t, t + 1))
			continue;
		fn(arg, n * c / nch, n * (c + 1) / nch);
		uint32_t d = atomic_fetch_add(&P.done, 1) + 1;
		if (d == (uint32_t)nch && atomic_load(&P.waiting))
			futex_wake(&P.done, 1);
	}
}

/* An idle worker spins for the next region, then sleeps. On a quiet
 * machine the spin is long (IDLE_SPIN_NS): a region whose worker sleeps
 * starts with a futex wake of a halted core, which on a VM costs 50-100 us,
 * and more once the host has seen the core idle for a while (a 2-thread
 * DecoderLayer call took 4.5-7 ms after 100 ms of idling, 2.5 ms when called
 * every 30 ms, 5 ms on one thread). Where other work wants the cores, a
 * long spin takes their time (the DecoderLayer with two `yes` running: 8-9
 * ms against 4.3-5 with short spins), so the spin is short (SPIN_NS) while
 * the machine has more runnable threads than cores (sampled every
 * BUSY_SAMPLE_NS from /proc/loadavg) and while short_until holds. */
#define IDLE_SPIN_NS 2000000
#define BUSY_SAMPLE_NS 5000000

/* More runnable threads than online cores, by /proc/loadavg's 4th field
 * (running/total); false where it cannot be read. Sampled at most every
 * BUSY_SAMPLE_NS. */
static bool machine_busy(int64_t t)
{
	static _Atomic int64_t next;
	static _Atomic int busy;
	if (t < atomic_load_explicit(&next, memory_order_relaxed))
		return atomic_load_explicit(&busy, memory_order_relaxed);
	atomic_store_explicit(&next, t + BUSY_SAMPLE_NS, memory_order_relaxed);
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	char buf[128];
	int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return false;
	buf[n] = 0;
	/* "0.52 0.58 0.59 2/123 4567": the running count follows the third space */
	const char *q = buf;
	for (int sp = 0; sp < 3 && q; sp++)
		if ((q = strchr(q, ' ')))
			q++;
	int b = q && ncpu > 0 && strtol(q, NULL, 10) > ncpu;
	atomic_store_explicit(&busy, b, memory_order_relaxed);
	return b;
}

static bool wait_next_region(uint32_t seen)
{
	int64_t t = now_ns();
	bool brief = t < atomic_load_explicit(&short_until, memory_order_relaxed) || machine_busy(t);
	return spin_until_changed(&P.gen, seen, brief ? SPIN_NS : IDLE_SPIN_NS);
}

static void *worker(void *p)
{
	int id = (int)(intptr_t)p;
	in_region = 1; /* a region inside a chunk runs inline */
	uint32_t seen = atomic_load(&P.gen);
	for (;;) {
		if (!wait_next_region(seen)) {
			atomic_fetch_add(&P.sleepers, 1);
			while (atomic_load(&P.gen) == seen)
				futex_wait(&P.gen, seen);
			atomic_fetch_sub(&P.sleepers, 1);
		}
		seen = atomic_load(&P.gen);
		if (id < atomic_load(&P.want))
			run_chunks(seen);
	}
	return NULL;
}

/* Start workers up to n (as many as the system gives); returns how many run. */
static int grow(int n)
{
	pthread_mutex_lock(&P.grow);
	while (P.nworkers < n) {
		pthread_t t;
		pthread_attr_t a;
		pthread_attr_init(&a);
		pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
		int rc = pthread_create(&t, &a, worker, (void *)(intptr_t)P.nworkers);
		pthread_attr_destroy(&a);
		if (rc != 0)
			break;
		P.nworkers++;
	}
	int got = P.nworkers;
	pthread_mutex_unlock(&P.grow);
	return got < n ? got : n;
}

bool kl__par_active(void)
{
	return in_region != 0;
}

/* the thread count of the generated code's regions: the running call's */
static _Thread_local int call_threads;

void kl__par_set_threads(int nt)
{
	call_threads = nt;
}

int kl__par_threads(void)
{
	return call_threads > 0 ? call_threads : kl__cpu_cores();
}

void kl__par_for_call(int64_t n, kl_par_fn fn, void *arg)
{
	kl__par_for(kl__par_threads(), n, fn, arg);
}

void kl__par_for(int nt, int64_t n, kl_par_fn fn, void *arg)
{
	if (n <= 0)
		return;
	if (nt > KL_MAX_THREADS)
		nt = KL_MAX_THREADS;
	if (nt <= 1 || n == 1 || in_region || pthread_mutex_trylock(&P.busy) != 0) {
		fn(arg, 0, n);
		return;
	}
	int64_t t0 = now_ns();
	if (t0 < P.serial_until) { /* backing off: see below */
		pthread_mutex_unlock(&P.busy);
		fn(arg, 0, n);
		return;
	}
	int w = grow(nt - 1);
	if (w <= 0) {
		pthread_mutex_unlock(&P.busy);
		fn(arg, 0, n);
		return;
	}
	in_region = 1;
	int64_t nch = (int64_t)(w + 1) * CHUNKS_PER_THREAD;
	if (nch > n)
		nch = n;
	if (nch > INT32_MAX)
		nch = INT32_MAX;
	uint32_t g = atomic_load(&P.gen) + 1;
	/* Close the ticket before the fields change: a worker still in the
	 * last region's run_chunks may have read its ticket (all claimed) and
	 * then read this region's larger nchunks; its claim must fail, or it
	 * runs a chunk of this region twice and done overshoots nchunks (a
	 * hang in the wait below: seen in kiln bench, a region of 2 chunks
	 * followed by one of 8). No chunk index reaches 0xffffffff. */
	atomic_store(&P.ticket, (uint64_t)g << 32 | 0xffffffffu);
	atomic_store_explicit(&P.fn, (uintptr_t)fn, memory_order_release);
	atomic_store_explicit(&P.arg, (uintptr_t)arg, memory_order_release);
	atomic_store_explicit(&P.n, n, memory_order_release);
	atomic_store_explicit(&P.nchunks, nch, memory_order_release);
	atomic_store(&P.done, 0);
	atomic_store(&P.waiting, 0);
	atomic_store(&P.want, w);
	atomic_store(&P.ticket, (uint64_t)g << 32);
	atomic_store(&P.gen, g);
	if (atomic_load(&P.sleepers) > 0)
		futex_wake(&P.gen, INT_MAX);
	run_chunks(g);
	int64_t t1 = now_ns();
	/* the chunks others claimed: spin, then sleep until the last is done */
	uint32_t d;
	while ((d = atomic_load(&P.done)) != (uint32_t)nch) {
		if (spin_until_changed(&P.done, d, SPIN_NS))
			continue;
		atomic_store(&P.waiting, 1);
		d = atomic_load(&P.done);
		if (d != (uint32_t)nch)
			futex_wait(&P.done, d);
		atomic_store(&P.waiting, 0);
	}
	/* A caller that waited for the others much longer than it worked is on
	 * a machine whose cores are taken (a worker was preempted holding a
	 * chunk): the next regions run on the caller alone for a while, the
	 * while doubling as long as the machine stays busy, so that a loaded
	 * machine costs at most about the single-thread time. */
	int64_t t2 = now_ns(), waited = t2 - t1, worked = t1 - t0;
	if (waited > BACKOFF_MIN_NS && waited > 2 * worked) {
		P.backoff = P.backoff ? (P.backoff < BACKOFF_MAX_NS ? 2 * P.backoff : P.backoff)
		                      : BACKOFF_FIRST_NS;
		P.serial_until = t2 + P.backoff;
		atomic_store_explicit(&short_until, t2 + SHORT_FOR_NS, memory_order_relaxed);
	} else {
		P.backoff = 0;
	}
	in_region = 0;
	pthread_mutex_unlock(&P.busy);
}

/* ---- the cores this process may use ------------------------------------------- */

static double read_quota(const char *path, bool v2)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	char a[32] = {0};
	long long q = 0, per = 0;
	int got = v2 ? fscanf(f, "%31s %lld", a, &per) : fscanf(f, "%lld", &q);
	fclose(f);
	if (v2) {
		if (got != 2 || a[0] == 'm') /* "max": no quota */
			return 0;
		q = strtoll(a, NULL, 10);
	} else {
		if (got != 1 || q <= 0)
			return 0;
		f = fopen("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "r");
		if (!f)
			return 0;
		got = fscanf(f, "%lld", &per);
		fclose(f);
		if (got != 1)
			return 0;
	}
	return q > 0 && per > 0 ? (double)q / (double)per : 0;
}

int kl__cpu_cores(void)
{
	static _Atomic int cached;
	int c = atomic_load(&cached);
	if (c > 0)
		return c;
	cpu_set_t set;
	c = 0;
	if (sched_getaffinity(0, sizeof set, &set) == 0)
		c = CPU_COUNT(&set);
	if (c <= 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);
		c = n > 0 ? (int)n : 1;
	}
	double q = read_quota("/sys/fs/cgroup/cpu.max", true);
	if (q <= 0)
		q = read_quota("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", false);
	if (q > 0 && q < c) {
		int qc = (int)q;
		c = qc + (q - qc > 0.5) > 0 ? qc + (q - qc > 0.5) : 1;
	}
	if (c > KL_MAX_THREADS)
		c = KL_MAX_THREADS;
	atomic_store(&cached, c);
	return c;
}
