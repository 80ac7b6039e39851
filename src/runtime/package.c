/* package.c - AOT packages: write one file holding a program's manifest,
 * plan, kernels and weights; load it (from a mapping or a buffer) checking
 * every byte before use; run it with its inputs checked against the
 * manifest. Nothing here compiles: the kernels are the shared object built
 * at export, loaded from memory.
 *
 * Layout (little-endian):
 *   0   "KILNPKG\0"
 *   8   u32 format version (KL_PKG_FORMAT), u32 header size (64)
 *   16  u64 file length
 *   24  u32 sections (4), u32 0
 *   32  char target[16] ("cpu-x86_64" or "cuda-sm_90", NUL padded)
 *   48  u64 the x86 features the kernels need (isa_names' bits: the host's
 *       at export, since they are built -march=native), 0 without kernels
 *       and for CUDA
 *   56  u64 checksum of bytes 0..56 and the section table
 *   64  section table: per section u32 kind, u32 0, u64 offset, u64 length,
 *       u64 checksum of its bytes; sections follow, 64-byte aligned:
 *       manifest, plan (plan_io.c), kernels (CPU: an ELF shared object;
 *       CUDA: cubins, PTX and launch choices, package_cuda.c), weights (a
 *       safetensors file, each tensor 64-byte aligned).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/le.h"
#include "runtime/package.h"
#include "runtime/package_cuda.h"
#include "runtime/runtime_int.h"

enum { SEC_MANIFEST = 1, SEC_PLAN, SEC_KERNELS, SEC_WEIGHTS, NSECT = 4 };
static const char *const sec_names[NSECT + 1] = {"", "manifest", "plan", "kernels", "weights"};
#define HDR 64u
#define TABLE (HDR + NSECT * 32u)
#define MAX_ITEMS 4096

const char *kl__pkg_host_target(void)
{
#if defined(__x86_64__)
	return "cpu-x86_64";
#elif defined(__aarch64__)
	return "cpu-aarch64";
#else
	return "cpu-unknown";
#endif
}

static uint16_t host_elf_machine(void)
{
#if defined(__x86_64__)
	return 62;
#elif defined(__aarch64__)
	return 183;
#else
	return 0;
#endif
}

/* The x86 features a kernels' shared object built with -march=native may
 * use, as bits of the header's word at 48; a host without one of them is
 * refused at load (running such code dies of SIGILL). */
static const char *const isa_names[] = {"sse4.2",  "avx",      "avx2",     "fma",     "bmi2",
                                        "avx512f", "avx512bw", "avx512vl", "avx512dq"};

static uint64_t host_isa(void)
{
	uint64_t m = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	__builtin_cpu_init();
	m |= (uint64_t)(__builtin_cpu_supports("sse4.2") != 0) << 0;
	m |= (uint64_t)(__builtin_cpu_supports("avx") != 0) << 1;
	m |= (uint64_t)(__builtin_cpu_supports("avx2") != 0) << 2;
	m |= (uint64_t)(__builtin_cpu_supports("fma") != 0) << 3;
	m |= (uint64_t)(__builtin_cpu_supports("bmi2") != 0) << 4;
	m |= (uint64_t)(__builtin_cpu_supports("avx512f") != 0) << 5;
	m |= (uint64_t)(__builtin_cpu_supports("avx512bw") != 0) << 6;
	m |= (uint64_t)(__builtin_cpu_supports("avx512vl") != 0) << 7;
	m |= (uint64_t)(__builtin_cpu_supports("avx512dq") != 0) << 8;
#endif
	return m;
}

/* the names of the features in mask, space-separated ("bit N" past the
 * table) */
static void isa_str(uint64_t mask, char *buf, size_t cap)
{
	size_t k = 0;
	buf[0] = 0;
	for (int i = 0; i < 64 && k < cap; i++) {
		if (!(mask >> i & 1))
			continue;
		int n = i < (int)(sizeof isa_names / sizeof isa_names[0])
		                ? snprintf(buf + k, cap - k, "%s%s", k ? " " : "", isa_names[i])
		                : snprintf(buf + k, cap - k, "%sbit %d", k ? " " : "", i);
		k += n > 0 ? (size_t)n : 0;
	}
}

/* A checksum fast enough for the weights (FNV-1a runs a byte at a time):
 * four lanes of 64-bit words, multiplied and rotated, then folded. */
uint64_t kl__pkg_sum(const uint8_t *p, size_t n)
{
	const uint64_t k1 = 0x9e3779b97f4a7c15ull, k2 = 0xc2b2ae3d27d4eb4full;
	uint64_t l[4] = {k1, k2, k1 ^ 0x165667b19e3779f9ull, k2 ^ (uint64_t)n};
	size_t i = 0;
	for (; i + 32 <= n; i += 32)
		for (int j = 0; j < 4; j++) {
			uint64_t w;
			memcpy(&w, p + i + 8 * j, 8);
			l[j] = (l[j] ^ w) * k1;
			l[j] = (l[j] << 29) | (l[j] >> 35);
		}
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, p + i, n - i);
	for (int j = 0; j < 4; j++)
		h = (h ^ l[j]) * k2;
	return h ^ (h >> 31);
}

/* ---- little-endian bytes ---------------------------------------------------- */

typedef struct wbuf {
	uint8_t *p;
	size_t n, cap;
	bool oom;
} wbuf;

static void w_bytes(wbuf *w, const void *b, size_t n)
{
	if (w->oom)
		return;
	if (w->n + n > w->cap) {
		size_t nc = w->cap ? w->cap : 1024;
		while (nc < w->n + n)
			nc *= 2;
		uint8_t *q = realloc(w->p, nc);
		if (!q) {
			w->oom = true;
			return;
		}
		w->p = q;
		w->cap = nc;
	}
	if (n)
		memcpy(w->p + w->n, b, n);
	w->n += n;
}

static void w_u32(wbuf *w, uint32_t v)
{
	uint8_t b[4];
	kl__le_put32(b, v);
	w_bytes(w, b, 4);
}

static void w_u64(wbuf *w, uint64_t v)
{
	uint8_t b[8];
	kl__le_put64(b, v);
	w_bytes(w, b, 8);
}

static void w_str(wbuf *w, const char *s)
{
	w_u32(w, (uint32_t)strlen(s));
	w_bytes(w, s, strlen(s));
}

static void w_pad(wbuf *w, size_t align)
{
	static const uint8_t z[64];
	while (!w->oom && w->n % align)
		w_bytes(w, z, align - w->n % align > 64 ? 64 : align - w->n % align);
}

typedef struct rbuf {
	const uint8_t *p;
	size_t n, at;
	bool bad;
} rbuf;

static uint32_t r_u32(rbuf *r)
{
	if (r->bad || r->n - r->at < 4) {
		r->bad = true;
		return 0;
	}
	uint32_t v = kl__le_get32(r->p + r->at);
	r->at += 4;
	return v;
}

static uint64_t r_u64(rbuf *r)
{
	if (r->bad || r->n - r->at < 8) {
		r->bad = true;
		return 0;
	}
	uint64_t v = kl__le_get64(r->p + r->at);
	r->at += 8;
	return v;
}

/* A name of [A-Za-z0-9_.:/+-], 1..cap-1 bytes (names reach text output
 * only, never generated source). */
static bool r_name(rbuf *r, char *out, size_t cap)
{
	uint32_t n = r_u32(r);
	if (r->bad || n == 0 || n >= cap || r->n - r->at < n) {
		r->bad = true;
		return false;
	}
	memcpy(out, r->p + r->at, n);
	out[n] = '\0';
	r->at += n;
	if (!kl__pkg_name_ok(out)) {
		r->bad = true;
		return false;
	}
	return true;
}

bool kl__pkg_name_ok(const char *s)
{
	if (!s || !*s || strlen(s) >= KL_PKG_NAME_MAX)
		return false;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      strchr("_.:/+-", *s)))
			return false;
	return true;
}

void kl__pkg_manifest_free(kl_pkg_manifest *m)
{
	free(m->in);
	free(m->out);
	free(m->params);
	free(m->dims);
	free(m->gin);
	free(m->outsrc);
	memset(m, 0, sizeof *m);
}

/* ---- the manifest ------------------------------------------------------------ */

static void w_tensor(wbuf *w, const kl_pkg_tensor *t)
{
	w_str(w, t->name);
	w_u32(w, (uint32_t)t->dtype);
	w_u32(w, (uint32_t)t->ndim);
	for (int d = 0; d < t->ndim; d++) {
		w_u64(w, (uint64_t)t->shape[d]);
		w_u32(w, (uint32_t)t->dim[d]);
	}
	w_u64(w, t->off);
	w_u64(w, t->nbytes);
}

static void manifest_write(wbuf *w, const kl_pkg_manifest *m)
{
	w_str(w, m->target);
	w_u32(w, (uint32_t)m->ndims);
	for (int i = 0; i < m->ndims; i++) {
		w_str(w, m->dims[i].name);
		w_u64(w, (uint64_t)m->dims[i].min);
		w_u64(w, (uint64_t)m->dims[i].max);
	}
	w_u32(w, (uint32_t)m->nin);
	for (int i = 0; i < m->nin; i++)
		w_tensor(w, &m->in[i]);
	w_u32(w, (uint32_t)m->nout);
	for (int i = 0; i < m->nout; i++)
		w_tensor(w, &m->out[i]);
	w_u32(w, (uint32_t)m->nparams);
	for (int i = 0; i < m->nparams; i++)
		w_tensor(w, &m->params[i]);
	w_u32(w, (uint32_t)m->ngin);
	for (int i = 0; i < m->ngin; i++)
		w_u32(w, (uint32_t)m->gin[i]);
	for (int i = 0; i < m->nout; i++)
		w_u32(w, (uint32_t)m->outsrc[i]);
}

static bool r_tensor(rbuf *r, kl_pkg_tensor *t, int ndims)
{
	if (!r_name(r, t->name, sizeof t->name))
		return false;
	uint32_t dt = r_u32(r), nd = r_u32(r);
	if (r->bad || dt >= KL_NDTYPES || nd > KL_MAX_DIMS)
		return false;
	t->dtype = (kl_dtype)dt;
	t->ndim = (int32_t)nd;
	for (uint32_t d = 0; d < nd; d++) {
		t->shape[d] = (int64_t)r_u64(r);
		t->dim[d] = (int32_t)r_u32(r);
		if (t->shape[d] < 0 || t->shape[d] > ((int64_t)1 << 40) || t->dim[d] < -1 ||
		    t->dim[d] >= ndims)
			return false;
	}
	t->off = r_u64(r);
	t->nbytes = r_u64(r);
	return !r->bad;
}

static bool r_count(rbuf *r, int32_t *n)
{
	uint32_t v = r_u32(r);
	*n = (int32_t)v;
	return !r->bad && v <= MAX_ITEMS;
}

static kl_status manifest_read(const uint8_t *p, size_t n, kl_pkg_manifest *m, char *err,
                               size_t cap)
{
	rbuf r = {p, n, 0, false};
	memset(m, 0, sizeof *m);
	const char *what = "truncated or malformed";
	if (!r_name(&r, m->target, sizeof m->target) || !r_count(&r, &m->ndims))
		goto bad;
	m->dims = calloc((size_t)m->ndims + 1, sizeof *m->dims);
	if (!m->dims)
		goto oom;
	for (int i = 0; i < m->ndims; i++) {
		if (!r_name(&r, m->dims[i].name, sizeof m->dims[i].name))
			goto bad;
		m->dims[i].min = (int64_t)r_u64(&r);
		m->dims[i].max = (int64_t)r_u64(&r);
		if (m->dims[i].min < 0 || m->dims[i].max < m->dims[i].min) {
			what = "a dim range is empty";
			goto bad;
		}
	}
	kl_pkg_tensor **lists[3] = {&m->in, &m->out, &m->params};
	int32_t *counts[3] = {&m->nin, &m->nout, &m->nparams};
	for (int l = 0; l < 3; l++) {
		if (!r_count(&r, counts[l]))
			goto bad;
		*lists[l] = calloc((size_t)*counts[l] + 1, sizeof **lists[l]);
		if (!*lists[l])
			goto oom;
		for (int i = 0; i < *counts[l]; i++)
			if (!r_tensor(&r, &(*lists[l])[i], l == 2 ? 0 : m->ndims))
				goto bad;
	}
	if (!r_count(&r, &m->ngin))
		goto bad;
	m->gin = calloc((size_t)m->ngin + 1, sizeof *m->gin);
	m->outsrc = calloc((size_t)m->nout + 1, sizeof *m->outsrc);
	if (!m->gin || !m->outsrc)
		goto oom;
	for (int i = 0; i < m->ngin; i++) {
		m->gin[i] = (int32_t)r_u32(&r);
		if (m->gin[i] >= m->nin || m->gin[i] < -m->nparams) {
			what = "a graph input names no input or parameter";
			goto bad;
		}
	}
	for (int i = 0; i < m->nout; i++)
		m->outsrc[i] = (int32_t)r_u32(&r);
	if (r.bad)
		goto bad;
	if (r.at != n) {
		what = "trailing bytes";
		goto bad;
	}
	return KL_OK;
bad:
	kl__pkg_manifest_free(m);
	return kl__plan_fail(err, cap, "the manifest is %s", r.bad ? "truncated or malformed" : what);
oom:
	kl__pkg_manifest_free(m);
	snprintf(err, cap, "out of memory");
	return KL_ENOMEM;
}

/* ---- writing ------------------------------------------------------------------- */

static const char *st_dtype(kl_dtype dt)
{
	static const char *const names[KL_NDTYPES] = {"F32", "F64", "F16", "BF16",
	                                              "I32", "I64", "BOOL"};
	return names[dt];
}

/* The weights as a safetensors file: tensors by decreasing element size
 * (then as given), each at a 64-byte aligned offset of a data section that
 * starts 64-byte aligned, so that a mapping can lend them in place. The
 * manifest's params get their offsets into the data. */
static kl_status weights_write(kl_ctx *ctx, wbuf *w, kl_pkg_manifest *m, kl_tensor *const *params)
{
	int n = m->nparams;
	int *order = malloc(sizeof *order * (size_t)(n ? n : 1));
	if (!order)
		return KL_ENOMEM;
	int k = 0;
	for (size_t sz = 8; sz >= 1; sz /= 2)
		for (int i = 0; i < n; i++)
			if (kl_dtype_size(m->params[i].dtype) == sz)
				order[k++] = i;
	uint64_t off = 0;
	for (int j = 0; j < k; j++) {
		kl_pkg_tensor *t = &m->params[order[j]];
		off = (off + 63) & ~(uint64_t)63;
		t->off = off;
		off += t->nbytes;
	}
	/* JSON: names are [A-Za-z0-9_.:/+-] (checked at export), no escaping */
	wbuf js = {0};
	const char *head = "{\"__metadata__\":{\"format\":\"kiln-package\"}";
	w_bytes(&js, head, strlen(head));
	uint64_t prev_end = 0;
	for (int j = 0; j < k; j++) {
		const kl_pkg_tensor *t = &m->params[order[j]];
		char buf[512];
		int len;
		if (t->off > prev_end) { /* safetensors wants every byte covered: name the gap */
			len = snprintf(buf, sizeof buf,
			               ",\"__pad%d\":{\"dtype\":\"U8\",\"shape\":[%" PRIu64
			               "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
			               j, t->off - prev_end, prev_end, t->off);
			w_bytes(&js, buf, (size_t)len);
		}
		len = snprintf(buf, sizeof buf, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name,
		               st_dtype(t->dtype));
		w_bytes(&js, buf, (size_t)len);
		for (int d = 0; d < t->ndim; d++) {
			len = snprintf(buf, sizeof buf, "%s%" PRId64, d ? "," : "", t->shape[d]);
			w_bytes(&js, buf, (size_t)len);
		}
		len = snprintf(buf, sizeof buf, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
		               t->off, t->off + t->nbytes);
		w_bytes(&js, buf, (size_t)len);
		prev_end = t->off + t->nbytes;
	}
	w_bytes(&js, "}", 1);
	/* pad the header with spaces so that the data starts 64-byte aligned */
	while (!js.oom && (w->n + 8 + js.n) % 64)
		w_bytes(&js, " ", 1);
	kl_status st = js.oom ? KL_ENOMEM : KL_OK;
	if (st == KL_OK) {
		w_u64(w, js.n);
		w_bytes(w, js.p, js.n);
		size_t data0 = w->n;
		for (int j = 0; j < k && !w->oom && st == KL_OK; j++) {
			const kl_pkg_tensor *t = &m->params[order[j]];
			while (!w->oom && w->n < data0 + t->off)
				w_bytes(w, "", 1);
			kl_tensor *src = params[order[j]];
			void *host = malloc(t->nbytes ? t->nbytes : 1);
			if (!host)
				st = KL_ENOMEM;
			else if ((st = kl_to_host(src, host, t->nbytes)) == KL_OK)
				w_bytes(w, host, t->nbytes);
			free(host);
		}
	}
	free(js.p);
	free(order);
	if (st == KL_OK && w->oom)
		st = KL_ENOMEM;
	if (st == KL_ENOMEM)
		kl__err(ctx, KL_ENOMEM, "kl_exported_package: out of memory");
	return st;
}

kl_status kl__pkg_write(kl_ctx *ctx, const kl_pkg_manifest *m0, const kl_program *prog,
                        const uint8_t *so, size_t so_len, kl_tensor *const *params,
                        uint8_t **out, size_t *out_len)
{
	*out = NULL;
	*out_len = 0;
	kl_pkg_manifest m = *m0; /* params get their offsets: a private copy */
	m.params = malloc(sizeof *m.params * (size_t)(m0->nparams ? m0->nparams : 1));
	if (!m.params)
		return kl__err(ctx, KL_ENOMEM, "kl_exported_package: out of memory");
	memcpy(m.params, m0->params, sizeof *m.params * (size_t)m0->nparams);
	wbuf w = {0}, wts = {0}, man = {0};
	uint8_t *plan = NULL;
	size_t plan_len = 0;
	kl_status st = weights_write(ctx, &wts, &m, params);
	if (st == KL_OK) {
		manifest_write(&man, &m);
		st = kl__program_serialize(prog, &plan, &plan_len);
	}
	if (st == KL_OK && !man.oom) {
		const uint8_t *sp[NSECT] = {man.p, plan, so, wts.p};
		size_t sn[NSECT] = {man.n, plan_len, so_len, wts.n};
		uint8_t zero[TABLE] = {0};
		w_bytes(&w, zero, TABLE);
		uint64_t offs[NSECT];
		for (int s = 0; s < NSECT; s++) {
			w_pad(&w, 64);
			offs[s] = w.n;
			w_bytes(&w, sp[s], sn[s]);
		}
		if (!w.oom) {
			memcpy(w.p, "KILNPKG", 8);
			kl__le_put64(w.p + 8, KL_PKG_FORMAT | ((uint64_t)HDR << 32));
			kl__le_put64(w.p + 16, w.n);
			kl__le_put64(w.p + 24, NSECT);
			/* the header's 16 bytes: the target, NUL padded (15 at most) */
			memset(w.p + 32, 0, 16);
			memcpy(w.p + 32, m.target, strnlen(m.target, 15));
			kl__le_put64(w.p + 48,
			             so_len && !kl__pkg_cuda_target_arch(m.target) ? host_isa() : 0);
			for (int s = 0; s < NSECT; s++) {
				uint8_t *e = w.p + HDR + 32 * s;
				kl__le_put64(e, (uint64_t)(s + 1));
				kl__le_put64(e + 8, offs[s]);
				kl__le_put64(e + 16, sn[s]);
				kl__le_put64(e + 24, kl__pkg_sum(w.p + offs[s], sn[s]));
			}
			uint64_t h = kl__hash_bytes(KL_HASH_SEED, w.p, 56);
			kl__le_put64(w.p + 56, kl__hash_bytes(h, w.p + HDR, TABLE - HDR));
		}
	}
	if (st == KL_OK && (w.oom || man.oom))
		st = kl__err(ctx, KL_ENOMEM, "kl_exported_package: out of memory");
	free(plan);
	free(man.p);
	free(wts.p);
	free(m.params);
	if (st != KL_OK) {
		free(w.p);
		return st;
	}
	*out = w.p;
	*out_len = w.n;
	return KL_OK;
}

/* ---- loading ------------------------------------------------------------------- */

struct kl_pkg {
	kl_ctx *ctx;
	kl_pkg_manifest m;
	kl_compiled *c;
	kl_tensor **params;
	void *map; /* owned mapping (own_map), else NULL */
	size_t map_len;
	size_t sec_len[NSECT + 1];
	uint64_t isa; /* the header's CPU features */
	int arch;     /* CUDA packages: the cubins' architecture, else 0 */
	kl_pkg_cuda cu; /* CUDA: the kernels section (its pointers valid while opening) */
	kl_program prog; /* describe: the plan (no variant made) */
};

static uint64_t numel_of(const kl_pkg_tensor *t, const int64_t *shape)
{
	uint64_t n = 1;
	for (int d = 0; d < t->ndim; d++)
		n *= (uint64_t)(shape ? shape[d] : t->shape[d]);
	return n;
}

/* The manifest against the plan: every graph input is the manifest's
 * input or parameter of its dtype and rank, each symbol one named dim,
 * static sizes equal, outputs alike. */
static kl_status check_against_plan(const kl_pkg_manifest *m, const kl_program *p, char *err,
                                    size_t cap)
{
	int32_t symdim[KL_MAX_DIMS * 4];
	for (int k = 0; k < KL_MAX_DIMS * 4; k++)
		symdim[k] = -1;
	for (int k = 0; k < p->nsyms; k++) {
		int32_t gi = p->sym_input[k];
		if (gi < 0 || gi >= m->ngin || m->gin[gi] < 0)
			return kl__plan_fail(err, cap, "symbol %d follows no dynamic input dim", k + 1);
		const kl_pkg_tensor *t = &m->in[m->gin[gi]];
		if (p->sym_dim[k] < 0 || p->sym_dim[k] >= t->ndim || t->dim[p->sym_dim[k]] < 0)
			return kl__plan_fail(err, cap,
			                     "symbol %d is dim %d of input '%s', which the manifest "
			                     "declares static",
			                     k + 1, (int)p->sym_dim[k], t->name);
		symdim[k] = t->dim[p->sym_dim[k]];
	}
	int32_t ngout = 0;
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->role == KL_BUF_TEMP)
			continue;
		const kl_pkg_tensor *t;
		const char *kind = "input";
		if (bf->role == KL_BUF_INPUT) {
			if (bf->index >= m->ngin)
				return kl__plan_fail(err, cap, "plan input %d is not in the manifest",
				                     (int)bf->index);
			int32_t s = m->gin[bf->index];
			t = s >= 0 ? &m->in[s] : &m->params[-1 - s];
			kind = s >= 0 ? "input" : "parameter";
		} else {
			if (bf->index + 1 > ngout)
				ngout = bf->index + 1;
			int k = 0;
			while (k < m->nout && m->outsrc[k] != bf->index)
				k++;
			if (k == m->nout)
				continue; /* a graph output no program output returns */
			t = &m->out[k];
			kind = "output";
		}
		if (t->dtype != bf->dtype || t->ndim != bf->ndim)
			return kl__plan_fail(err, cap,
			                     "%s '%s' is %s of rank %d in the manifest, %s of rank %d "
			                     "in the plan",
			                     kind, t->name, kl_dtype_name(t->dtype), (int)t->ndim,
			                     kl_dtype_name(bf->dtype), bf->ndim);
		for (int d = 0; d < bf->ndim; d++) {
			const kl_symdim *sd = &bf->shape[d];
			/* traced sizes equal too: the memory plan made at load is the
			 * manifest's */
			bool ok = t->shape[d] == sd->v &&
			          (sd->sym > 0 ? sd->sym <= p->nsyms && t->dim[d] == symdim[sd->sym - 1]
			                       : t->dim[d] < 0);
			if (!ok)
				return kl__plan_fail(err, cap,
				                     "%s '%s' dim %d does not match the plan's (%s)", kind,
				                     t->name, d, sd->sym > 0 ? "symbolic" : "static");
		}
	}
	for (int k = 0; k < m->nout; k++)
		if (m->outsrc[k] < 0 || m->outsrc[k] >= ngout)
			return kl__plan_fail(err, cap, "output '%s' is not one of the plan's %d",
			                     m->out[k].name, (int)ngout);
	for (int i = 0; i < m->nparams; i++) {
		const kl_pkg_tensor *t = &m->params[i];
		uint64_t n = numel_of(t, NULL);
		if (n > ((uint64_t)1 << 40) || n * kl_dtype_size(t->dtype) != t->nbytes)
			return kl__plan_fail(err, cap, "parameter '%s' has %" PRIu64 " bytes for its shape",
			                     t->name, t->nbytes);
	}
	return KL_OK;
}

static bool elf_ok(const uint8_t *b, size_t n, char *why, size_t cap)
{
	if (n < 64 || memcmp(b, "\x7f" "ELF", 4) != 0) {
		snprintf(why, cap, "the kernels are not an ELF file");
		return false;
	}
	if (b[4] != 2 || b[5] != 1) {
		snprintf(why, cap, "the kernels are not 64-bit little-endian ELF");
		return false;
	}
	uint16_t type = (uint16_t)(b[16] | b[17] << 8), mach = (uint16_t)(b[18] | b[19] << 8);
	if (type != 3) {
		snprintf(why, cap, "the kernels are not a shared object (ELF type %u)", type);
		return false;
	}
	if (mach != host_elf_machine()) {
		snprintf(why, cap, "the kernels are for ELF machine %u, this host is %u", mach,
		         host_elf_machine());
		return false;
	}
	return true;
}

void kl__pkg_free(kl_pkg *p)
{
	if (!p)
		return;
	for (int i = 0; p->params && i < p->m.nparams; i++)
		kl_release(p->params[i]);
	free(p->params);
	kl__compiled_free(p->c);
	kl__program_free(&p->prog);
	kl__pkg_manifest_free(&p->m);
	if (p->map)
		munmap(p->map, p->map_len);
	free(p);
}

const kl_pkg_manifest *kl__pkg_manifest(const kl_pkg *p)
{
	return &p->m;
}

kl_pkg *kl__pkg_open(kl_ctx *ctx, const char *fn, void *data, size_t len, bool own_map,
                     bool describe)
{
	double t_open = kl__now_ms(), t_checked = 0, t_weights = 0, t_plan = 0;
	kl_pkg *p = calloc(1, sizeof *p);
	if (!p) {
		if (own_map)
			munmap(data, len);
		kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		return NULL;
	}
	p->ctx = ctx;
	if (own_map) {
		p->map = data;
		p->map_len = len;
	}
	const uint8_t *b = data;
	char why[256] = "";
	kl_status st = KL_EFORMAT;
	kl_program prog = {0};
	void *dl = NULL;
	const uint8_t *sec[NSECT + 1] = {0};
	if (len < TABLE || memcmp(b, "KILNPKG", 8) != 0) {
		snprintf(why, sizeof why, len < TABLE ? "too short to be a package (%zu bytes)"
		                                      : "not a kiln package (bad magic)", len);
		goto fail;
	}
	if (kl__le_get32(b + 8) != KL_PKG_FORMAT || kl__le_get32(b + 12) != HDR) {
		snprintf(why, sizeof why, "package format version %u, this kiln reads version %u",
		         kl__le_get32(b + 8), KL_PKG_FORMAT);
		goto fail;
	}
	if (kl__le_get64(b + 16) != len) {
		snprintf(why, sizeof why, "%s: the header says %" PRIu64 " bytes, the file has %zu",
		         kl__le_get64(b + 16) > len ? "truncated" : "trailing bytes", kl__le_get64(b + 16), len);
		goto fail;
	}
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, b, 56);
	if (kl__le_get64(b + 56) != kl__hash_bytes(h, b + HDR, TABLE - HDR) || kl__le_get64(b + 24) != NSECT ||
	    b[47] != 0) {
		snprintf(why, sizeof why, "header checksum mismatch");
		goto fail;
	}
	p->arch = kl__pkg_cuda_target_arch((const char *)b + 32);
	if (p->arch && kl__le_get64(b + 48) != 0) {
		snprintf(why, sizeof why, "a CUDA package with CPU features");
		goto fail;
	}
	if (!p->arch && strcmp((const char *)b + 32, kl__pkg_host_target()) != 0) {
		snprintf(why, sizeof why, "built for target %.15s, this host is %s",
		         (const char *)b + 32, kl__pkg_host_target());
		goto fail;
	}
	uint64_t lacks = describe ? 0 : kl__le_get64(b + 48) & ~host_isa();
	if (lacks) {
		char names[160];
		isa_str(lacks, names, sizeof names);
		snprintf(why, sizeof why, "its kernels need CPU features this host lacks: %s", names);
		goto fail;
	}
	p->isa = kl__le_get64(b + 48);
	for (int s = 0; s < NSECT; s++) {
		const uint8_t *e = b + HDR + 32 * s;
		uint64_t off = kl__le_get64(e + 8), n = kl__le_get64(e + 16);
		if (kl__le_get64(e) != (uint64_t)(s + 1) || off < TABLE || off > len || n > len - off ||
		    off % 64) {
			snprintf(why, sizeof why, "section %d is out of the file", s);
			goto fail;
		}
		if (kl__pkg_sum(b + off, n) != kl__le_get64(e + 24)) {
			snprintf(why, sizeof why, "the %s section's checksum does not match (damaged file)",
			         sec_names[s + 1]);
			goto fail;
		}
		sec[s + 1] = b + off;
		p->sec_len[s + 1] = n;
	}
	st = manifest_read(sec[SEC_MANIFEST], p->sec_len[SEC_MANIFEST], &p->m, why, sizeof why);
	if (st != KL_OK)
		goto fail;
	if (strcmp(p->m.target, (const char *)b + 32) != 0) {
		st = KL_EFORMAT;
		snprintf(why, sizeof why, "the manifest's target %s is not the header's", p->m.target);
		goto fail;
	}
	st = kl__program_deserialize(sec[SEC_PLAN], p->sec_len[SEC_PLAN], &prog, why, sizeof why);
	if (st == KL_OK) {
		int32_t nout = 0;
		for (int32_t i = 0; i < prog.nbufs; i++)
			if (prog.bufs[i].role == KL_BUF_OUTPUT && prog.bufs[i].index + 1 > nout)
				nout = prog.bufs[i].index + 1;
		st = kl__program_validate(&prog, p->m.ngin, nout, why, sizeof why);
		if (st == KL_OK)
			st = check_against_plan(&p->m, &prog, why, sizeof why);
	}
	if (st != KL_OK)
		goto fail;
	/* the kernels: checked here, loaded below */
	if (p->arch) {
		st = kl__pkg_cuda_parse(sec[SEC_KERNELS], p->sec_len[SEC_KERNELS], p->arch, prog.nkernels,
		                        &p->cu, why, sizeof why);
		if (st != KL_OK)
			goto fail;
	} else if (prog.nkernels > 0) {
		if (!elf_ok(sec[SEC_KERNELS], p->sec_len[SEC_KERNELS], why, sizeof why)) {
			st = KL_EFORMAT;
			goto fail;
		}
	} else if (p->sec_len[SEC_KERNELS] != 0) {
		st = KL_EFORMAT;
		snprintf(why, sizeof why, "kernels without a plan that calls them");
		goto fail;
	}
	/* the weights: a safetensors file whose data the manifest indexes */
	const uint8_t *w = sec[SEC_WEIGHTS];
	size_t wn = p->sec_len[SEC_WEIGHTS];
	uint64_t jn = wn >= 8 ? kl__le_get64(w) : 0;
	if (wn < 8 || jn > wn - 8) {
		snprintf(why, sizeof why, "the weights are not a safetensors file");
		st = KL_EFORMAT;
		goto fail;
	}
	const uint8_t *wdata = w + 8 + jn;
	uint64_t wdn = wn - 8 - jn;
	for (int i = 0; i < p->m.nparams; i++) {
		const kl_pkg_tensor *t = &p->m.params[i];
		if (t->off > wdn || t->nbytes > wdn - t->off) {
			snprintf(why, sizeof why, "parameter '%s' lies outside the weights", t->name);
			st = KL_EFORMAT;
			goto fail;
		}
	}
	if (describe) {
		p->prog = prog;
		return p;
	}
	t_checked = kl__now_ms();
	if (p->arch && ctx->device != KL_CUDA) {
		kl__err(ctx, KL_EUNSUPPORTED,
		        "%s: a CUDA package (sm_%d) needs a CUDA context; this one is the CPU "
		        "(kl_package_describe and kiln inspect read it anywhere)",
		        fn, p->arch);
		goto fail_set;
	}
	if (!p->arch && ctx->device != KL_CPU) {
		kl__err(ctx, KL_EUNSUPPORTED, "%s: a CPU package (%s) needs a CPU context", fn,
		        p->m.target);
		goto fail_set;
	}
	if (!p->arch && prog.nkernels > 0) {
		st = kl__jit_load_image(ctx, fn, sec[SEC_KERNELS], p->sec_len[SEC_KERNELS], &dl);
		if (st != KL_OK) {
			kl__pkg_free(p);
			kl__program_free(&prog);
			return NULL;
		}
		uint8_t *bytes = NULL;
		size_t blen = 0;
		uint64_t have = 0;
		if (kl__program_serialize(&prog, &bytes, &blen) != KL_OK ||
		    !kl__jit_plan_digest(dl, &have) ||
		    have != kl__hash_bytes(KL_HASH_SEED, bytes, blen)) {
			free(bytes);
			snprintf(why, sizeof why, "the kernels were built for another plan");
			st = KL_EFORMAT;
			goto fail;
		}
		free(bytes);
	}
	p->params = calloc((size_t)p->m.nparams + 1, sizeof *p->params);
	if (!p->params) {
		st = kl__err(ctx, KL_ENOMEM, "%s: out of memory", fn);
		goto fail_set;
	}
	for (int i = 0; i < p->m.nparams; i++) {
		const kl_pkg_tensor *t = &p->m.params[i];
		const uint8_t *src = wdata + t->off;
		/* borrowed in place on the CPU; CUDA copies them to the device */
		bool aligned = ((uintptr_t)src % 64) == 0 && ctx->device == KL_CPU;
		/* in no scope: the package holds them */
		kl_scope_begin(ctx);
		kl_tensor *x = own_map && aligned
		                   ? kl__tensor_borrow(ctx, t->dtype, t->ndim, t->shape, (void *)src,
		                                       (size_t)t->nbytes)
		                   : kl_from_host(ctx, t->dtype, t->ndim, t->shape, src,
		                                  (size_t)t->nbytes);
		p->params[i] = kl_retain(x);
		kl_scope_end(ctx);
		if (!p->params[i]) {
			st = kl_last_status(ctx);
			goto fail_set;
		}
	}
	t_weights = kl__now_ms();
	/* graph outputs: the plan's output count */
	int32_t ngout = 0;
	for (int32_t i = 0; i < prog.nbufs; i++)
		if (prog.bufs[i].role == KL_BUF_OUTPUT && prog.bufs[i].index + 1 > ngout)
			ngout = prog.bufs[i].index + 1;
	p->c = kl__compiled_from_plan(ctx, fn, &prog, dl, p->m.ngin, ngout);
	dl = NULL;
	if (!p->c) {
		st = kl_last_status(ctx);
		goto fail_set;
	}
	t_plan = kl__now_ms();
	if (p->arch) {
		/* reduce-overhead: the second call captures a CUDA graph, later
		 * ones replay it */
		p->c->mode = KL_MODE_REDUCE_OVERHEAD;
		if (kl__pkg_cuda_load(ctx, fn, p->c, &p->cu) != KL_OK)
			goto fail_set;
	}
	kl__log(ctx, KL_LOG_STARTUP,
	        "%s: %zu bytes checked %.3f ms, %d weights uploaded %.3f ms, plan %.3f ms, "
	        "kernels %.3f ms",
	        fn, len, t_checked - t_open, p->m.nparams, t_weights - t_checked, t_plan - t_weights,
	        kl__now_ms() - t_plan);
	return p;
fail:
	kl__err(ctx, st == KL_OK ? KL_EFORMAT : st, "%s: bad package: %s", fn, why);
fail_set:
	kl__jit_unload(dl);
	kl__program_free(&prog);
	kl__pkg_free(p);
	return NULL;
}

static const char *dim_label(const kl_pkg_manifest *m, const kl_pkg_tensor *t, int d, char *buf,
                             size_t cap)
{
	if (t->dim[d] >= 0)
		snprintf(buf, cap, "%s", m->dims[t->dim[d]].name);
	else
		snprintf(buf, cap, "%" PRId64, t->shape[d]);
	return buf;
}

kl_status kl__pkg_run(kl_pkg *p, kl_tensor *const *in, kl_tensor **out)
{
	kl_ctx *ctx = p->ctx;
	const kl_pkg_manifest *m = &p->m;
	int64_t val[MAX_ITEMS];
	int32_t from[MAX_ITEMS];
	for (int i = 0; i < m->ndims; i++)
		from[i] = -1;
	for (int k = 0; k < m->nout; k++)
		out[k] = NULL;
	for (int i = 0; i < m->nin; i++) {
		const kl_pkg_tensor *t = &m->in[i];
		const kl_tensor *x = in[i];
		char sh[128], lb[80];
		if (!x)
			return kl__err(ctx, KL_EINVAL, "kl_package_run: input %d ('%s') is NULL", i,
			               t->name);
		if (x->ctx != ctx)
			return kl__err(ctx, KL_EINVAL,
			               "kl_package_run: input '%s' is on another context", t->name);
		if (x->dtype != t->dtype || x->ndim != t->ndim)
			return kl__err(ctx, KL_EINVAL,
			               "kl_package_run: input '%s' is %s %s; the package takes %s of "
			               "rank %d",
			               t->name, kl_dtype_name(x->dtype),
			               kl__shape_str(sh, sizeof sh, x->ndim, x->shape),
			               kl_dtype_name(t->dtype), (int)t->ndim);
		for (int d = 0; d < t->ndim; d++) {
			int64_t v = x->shape[d];
			if (t->dim[d] < 0) {
				if (v != t->shape[d])
					return kl__err(ctx, KL_EINVAL,
					               "kl_package_run: input '%s' dim %d is %" PRId64
					               "; the package takes %" PRId64 " (static)",
					               t->name, d, v, t->shape[d]);
				continue;
			}
			const kl_pkg_dim *dm = &m->dims[t->dim[d]];
			if (v < dm->min || v > dm->max)
				return kl__err(ctx, KL_EINVAL,
				               "kl_package_run: input '%s' dim %d (%s) is %" PRId64
				               ", outside its range [%" PRId64 ", %" PRId64 "]",
				               t->name, d, dm->name, v, dm->min, dm->max);
			int32_t j = t->dim[d];
			if (from[j] >= 0 && val[j] != v)
				return kl__err(ctx, KL_EINVAL,
				               "kl_package_run: dim %s is %" PRId64 " in input '%s' but %" PRId64
				               " in input '%s'",
				               dm->name, v, t->name, val[j], m->in[from[j]].name);
			from[j] = i;
			val[j] = v;
		}
		(void)lb;
		if (!x->st)
			return kl__err(ctx, KL_EINVAL,
			               "kl_package_run: input '%s' is a lazy tensor of a trace "
			               "(run packages outside compiled functions)",
			               t->name);
		if (!kl__strides_contiguous(x->ndim, x->shape, x->strides))
			return kl__err(ctx, KL_EINVAL,
			               "kl_package_run: input '%s' has strides %s; the package takes "
			               "dense inputs (kl_contiguous)",
			               t->name, kl__shape_str(sh, sizeof sh, x->ndim, x->strides));
	}
	kl_tensor **gin = malloc(sizeof *gin * (size_t)(m->ngin + 1));
	kl_tensor **gout = calloc((size_t)p->c->nout + 1, sizeof *gout);
	kl_status st = KL_OK;
	if (!gin || !gout)
		st = kl__err(ctx, KL_ENOMEM, "kl_package_run: out of memory");
	for (int i = 0; st == KL_OK && i < m->ngin; i++) {
		int32_t s = m->gin[i];
		gin[i] = s >= 0 ? in[s] : p->params[-1 - s];
	}
	if (st == KL_OK)
		st = kl__compiled_run(ctx, p->c, gin, gout);
	if (st == KL_OK) {
		for (int k = 0; k < m->nout; k++)
			out[k] = kl_retain(gout[m->outsrc[k]]);
	}
	for (int j = 0; j < p->c->nout && gout; j++)
		kl_release(gout[j]);
	free(gin);
	free(gout);
	return st;
}

static void print_tensor(FILE *f, const kl_pkg_manifest *m, const kl_pkg_tensor *t)
{
	fprintf(f, "    %-32s %-4s [", t->name, kl_dtype_name(t->dtype));
	for (int d = 0; d < t->ndim; d++) {
		char lb[80];
		fprintf(f, "%s%s", d ? ", " : "", dim_label(m, t, d, lb, sizeof lb));
	}
	fprintf(f, "]\n");
}

void kl__pkg_print(const kl_pkg *p, FILE *f)
{
	const kl_pkg_manifest *m = &p->m;
	char isa[160];
	isa_str(p->isa, isa, sizeof isa);
	if (p->arch)
		fprintf(f, "kiln package, format %u, target %s\n", KL_PKG_FORMAT, m->target);
	else
		fprintf(f, "kiln package, format %u, target %s, CPU features %s\n", KL_PKG_FORMAT,
		        m->target, p->isa ? isa : "none required");
	fprintf(f, "  sections: manifest %zu B, plan %zu B, kernels %zu B, weights %zu B\n",
	        p->sec_len[SEC_MANIFEST], p->sec_len[SEC_PLAN], p->sec_len[SEC_KERNELS],
	        p->sec_len[SEC_WEIGHTS]);
	fprintf(f, "  dynamic dims:%s\n", m->ndims ? "" : " none");
	for (int i = 0; i < m->ndims; i++)
		fprintf(f, "    %s in [%" PRId64 ", %" PRId64 "]\n", m->dims[i].name, m->dims[i].min,
		        m->dims[i].max);
	fprintf(f, "  inputs:\n");
	for (int i = 0; i < m->nin; i++)
		print_tensor(f, m, &m->in[i]);
	fprintf(f, "  outputs:\n");
	for (int i = 0; i < m->nout; i++)
		print_tensor(f, m, &m->out[i]);
	uint64_t wb = 0;
	for (int i = 0; i < m->nparams; i++)
		wb += m->params[i].nbytes;
	fprintf(f, "  parameters: %d (%" PRIu64 " bytes)\n", (int)m->nparams, wb);
	for (int i = 0; i < m->nparams; i++)
		print_tensor(f, m, &m->params[i]);
	const kl_program *pr = p->c ? &p->c->prog : &p->prog;
	fprintf(f, "  plan: %d steps, %d buffers, %d symbols, %d generated kernels\n",
	        (int)pr->nsteps, (int)pr->nbufs, (int)pr->nsyms, (int)pr->nkernels);
	for (int32_t s = 0; s < pr->nsteps; s++)
		fprintf(f, "    step %-3d %s%s%s\n", (int)s, pr->steps[s].what,
		        pr->steps[s].kind == KL_STEP_KERNEL ? "  kernel " : "",
		        pr->steps[s].kind == KL_STEP_KERNEL ? pr->kernel_names[pr->steps[s].kernel]
		                                            : "");
	if (!p->arch)
		return;
	const kl_pkg_cuda *cu = &p->cu;
	fprintf(f, "  CUDA modules: %d, cubins for sm_%d; launch choices: %zu bytes%s\n", cu->nmods,
	        cu->arch, cu->choices_len, cu->choices_len ? "" : " (cuBLASLt heuristics at load)");
	for (int i = 0; i < cu->nmods; i++) {
		const kl_pkg_cumod *md = &cu->mods[i];
		fprintf(f, "    module %-2d %-6s cubin sm_%d%s %zu B, PTX %zu B%s", i,
		        md->role == KL_PKG_MOD_PLAN ? "plan" : "fixed", cu->arch,
		        md->arch_specific ? "a" : "", md->cubin_len, md->ptx_len,
		        md->ptx_len ? " (newer GPUs through the driver's JIT)" : "");
		if (md->role == KL_PKG_MOD_FIXED)
			fprintf(f, ", source %016" PRIx64, md->src_key);
		fprintf(f, "\n");
	}
}

/* ---- the public calls ----------------------------------------------------------- */

struct kl_package {
	kl_pkg *p;
};

static kl_package *wrap(kl_ctx *ctx, kl_pkg *p)
{
	if (!p)
		return NULL;
	kl_package *w = malloc(sizeof *w);
	if (!w) {
		kl__pkg_free(p);
		kl__err(ctx, KL_ENOMEM, "kl_package_load: out of memory");
		return NULL;
	}
	w->p = p;
	return w;
}

kl_package *kl_package_load(kl_ctx *ctx, const char *path)
{
	if (!ctx)
		return NULL;
	if (!path) {
		kl__err(ctx, KL_EINVAL, "kl_package_load: path is NULL");
		return NULL;
	}
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0) {
		kl__err(ctx, KL_EIO, "kl_package_load: cannot open %s: %s", path, strerror(errno));
		if (fd >= 0)
			close(fd);
		return NULL;
	}
	if (!S_ISREG(st.st_mode) || st.st_size < (off_t)TABLE) {
		close(fd);
		kl__err(ctx, S_ISREG(st.st_mode) ? KL_EFORMAT : KL_EIO,
		        "kl_package_load: bad package: %s is %s", path,
		        S_ISREG(st.st_mode) ? "too short to be a package" : "not a regular file");
		return NULL;
	}
	/* private and writable: a write into a borrowed weight copies its page,
	 * never the file */
	void *map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	close(fd);
	if (map == MAP_FAILED) {
		kl__err(ctx, KL_EIO, "kl_package_load: cannot map %s: %s", path, strerror(errno));
		return NULL;
	}
	return wrap(ctx, kl__pkg_open(ctx, "kl_package_load", map, (size_t)st.st_size, true, false));
}

kl_package *kl_package_load_buffer(kl_ctx *ctx, const void *data, size_t len)
{
	if (!ctx)
		return NULL;
	if (!data) {
		kl__err(ctx, KL_EINVAL, "kl_package_load_buffer: data is NULL");
		return NULL;
	}
	return wrap(ctx, kl__pkg_open(ctx, "kl_package_load_buffer", (void *)(uintptr_t)data, len,
	                              false, false));
}

const kl_pkg_manifest *kl__package_manifest(const kl_package *p)
{
	return &p->p->m;
}

const kl_compiled *kl__package_compiled(const kl_package *p)
{
	return p->p->c;
}

int kl_package_ninputs(const kl_package *p)
{
	return p ? p->p->m.nin : -1;
}

int kl_package_noutputs(const kl_package *p)
{
	return p ? p->p->m.nout : -1;
}

const char *kl_package_input_name(const kl_package *p, int i)
{
	return p && i >= 0 && i < p->p->m.nin ? p->p->m.in[i].name : NULL;
}

const char *kl_package_output_name(const kl_package *p, int i)
{
	return p && i >= 0 && i < p->p->m.nout ? p->p->m.out[i].name : NULL;
}

kl_status kl_package_run(kl_package *p, kl_tensor *const *in, kl_tensor **out)
{
	if (!p)
		return KL_EINVAL;
	if ((!in && p->p->m.nin > 0) || !out)
		return kl__err(p->p->ctx, KL_EINVAL, "kl_package_run: %s is NULL", out ? "in" : "out");
	return kl__pkg_run(p->p, in, out);
}

kl_status kl_package_inspect(const kl_package *p, FILE *out)
{
	if (!p || !out)
		return KL_EINVAL;
	kl__pkg_print(p->p, out);
	return KL_OK;
}

void kl_package_free(kl_package *p)
{
	if (!p)
		return;
	kl__pkg_free(p->p);
	free(p);
}

kl_status kl_package_describe(kl_ctx *ctx, const void *data, size_t len, FILE *out)
{
	if (!ctx)
		return KL_EINVAL;
	if (!data || !out)
		return kl__err(ctx, KL_EINVAL, "kl_package_describe: %s is NULL", data ? "out" : "data");
	kl_pkg *p = kl__pkg_open(ctx, "kl_package_describe", (void *)(uintptr_t)data, len, false,
	                         true);
	if (!p)
		return kl_last_status(ctx);
	/* the kernels section's pointers are the caller's bytes: valid here */
	kl__pkg_print(p, out);
	kl__pkg_free(p);
	return KL_OK;
}
