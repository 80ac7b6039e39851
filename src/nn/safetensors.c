/* safetensors.c - reading and writing the safetensors weight format (the
 * files PyTorch and Hugging Face save), against the public API only. The
 * header is validated in full before any tensor is read; data is little-endian
 * and read as-is, so kiln assumes a little-endian host. */
#include "kiln.h"
#include "nn/json.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/stat.h>

#define ST_MAX_HEADER (100u * 1024 * 1024)

typedef struct st_entry {
	char *name;
	kl_dtype dt;
	int ndim;
	int64_t shape[KL_MAX_DIMS];
	int64_t begin, end;
} st_entry;

struct kl_safetensors {
	kl_ctx *ctx;
	FILE *f;
	char *path;
	int64_t data_start, data_len;
	int n;
	st_entry *e;
	kl__jval meta; /* the "__metadata__" object (n == 0 when absent) */
};

static const struct {
	const char *name;
	kl_dtype dt;
} st_dtypes[] = {
        {"F32", KL_F32}, {"F64", KL_F64}, {"F16", KL_F16},   {"BF16", KL_BF16},
        {"I32", KL_I32}, {"I64", KL_I64}, {"BOOL", KL_BOOL},
};

static const char *st_dtype_name(kl_dtype dt)
{
	for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
		if (st_dtypes[i].dt == dt)
			return st_dtypes[i].name;
	return NULL;
}

void kl_safetensors_close(kl_safetensors *st)
{
	if (!st)
		return;
	if (st->f)
		fclose(st->f);
	for (int i = 0; i < st->n; i++)
		free(st->e[i].name);
	free(st->e);
	kl__json_free(&st->meta);
	free(st->path);
	free(st);
}

/* Set a KL_EFORMAT error about tensor name of st's file; returns -1. */
static int bad(kl_safetensors *st, const char *name, const char *fmt, ...)
#if defined(__GNUC__)
        __attribute__((format(printf, 3, 4)))
#endif
        ;
static int bad(kl_safetensors *st, const char *name, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (name[0])
		kl_set_error(st->ctx, KL_EFORMAT, "kl_safetensors_open: %s: tensor '%s': %s",
		             st->path, name, msg);
	else
		kl_set_error(st->ctx, KL_EFORMAT, "kl_safetensors_open: %s: %s", st->path, msg);
	return -1;
}

/* Validate one header entry (name, its value) into *e. Returns 0, or sets
 * the error and returns -1. */
static int parse_entry(kl_safetensors *st, const char *name, const kl__jval *v, st_entry *e)
{
	if (!name[0])
		return bad(st, "", "a tensor has an empty name");
	if (v->kind != KL__JOBJ)
		return bad(st, name, "entry is not an object");
	const kl__jval *dt = kl__json_get(v, "dtype"), *sh = kl__json_get(v, "shape"),
	               *off = kl__json_get(v, "data_offsets");
	for (int i = 0; i < v->n; i++) {
		const char *k = v->keys[i];
		if (strcmp(k, "dtype") && strcmp(k, "shape") && strcmp(k, "data_offsets"))
			return bad(st, name, "unknown key '%s'", k);
	}
	if (!dt || !sh || !off)
		return bad(st, name, "missing key '%s'",
		           !dt   ? "dtype"
		           : !sh ? "shape"
		                 : "data_offsets");
	if (dt->kind != KL__JSTR)
		return bad(st, name, "dtype is not a string");
	size_t k;
	for (k = 0; k < sizeof st_dtypes / sizeof st_dtypes[0]; k++)
		if (!strcmp(st_dtypes[k].name, dt->str))
			break;
	if (k == sizeof st_dtypes / sizeof st_dtypes[0])
		return bad(st, name,
		           "dtype '%.40s' is not supported by kiln "
		           "(F32 F64 F16 BF16 I32 I64 BOOL)",
		           dt->str);
	e->dt = st_dtypes[k].dt;
	if (sh->kind != KL__JARR)
		return bad(st, name, "shape is not an array");
	if (sh->n > KL_MAX_DIMS)
		return bad(st, name, "shape has %d dims (kiln allows %d)", sh->n, KL_MAX_DIMS);
	e->ndim = sh->n;
	for (int i = 0; i < sh->n; i++) {
		const kl__jval *d = &sh->items[i];
		if (d->kind != KL__JINT || d->num < 0)
			return bad(st, name, "shape[%d] is not an integer >= 0", i);
		e->shape[i] = d->num;
	}
	/* kiln's one shape rule (kl_shape_nbytes): a shape it accepts has a byte
	 * size of at most 2^62, so the offset arithmetic below is safe */
	size_t nbytes;
	if (kl_shape_nbytes(e->dt, e->ndim, e->shape, &nbytes) != KL_OK) {
		const char *why = kl_last_error(NULL), *p = "kl_shape_nbytes: ";
		return bad(st, name, "%s", strncmp(why, p, strlen(p)) ? why : why + strlen(p));
	}
	int64_t bytes = (int64_t)nbytes;
	if (off->kind != KL__JARR || off->n != 2 || off->items[0].kind != KL__JINT ||
	    off->items[1].kind != KL__JINT)
		return bad(st, name, "data_offsets is not [begin, end]");
	e->begin = off->items[0].num;
	e->end = off->items[1].num;
	long long b0 = (long long)e->begin, b1 = (long long)e->end;
	if (e->begin < 0 || e->end < e->begin)
		return bad(st, name, "data_offsets [%lld,%lld] are not 0 <= begin <= end", b0, b1);
	if (e->end > st->data_len)
		return bad(st, name, "data_offsets [%lld,%lld] overrun the data (%lld bytes)", b0,
		           b1, (long long)st->data_len);
	if (e->end - e->begin != bytes)
		return bad(st, name,
		           "data_offsets [%lld,%lld] hold %lld bytes but %s of that "
		           "shape needs %lld",
		           b0, b1, b1 - b0, dt->str, (long long)bytes);
	e->name = strdup(name);
	if (!e->name) {
		kl_set_error(st->ctx, KL_ENOMEM, "kl_safetensors_open: out of memory");
		return -1;
	}
	return 0;
}

static int cmp_begin(const void *a, const void *b)
{
	const st_entry *x = *(const st_entry *const *)a, *y = *(const st_entry *const *)b;
	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return (x->end > y->end) - (x->end < y->end);
}

/* Parse and validate the header text; fills st->e, st->n and st->meta. */
static int parse_header(kl_safetensors *st, const char *text, size_t len)
{
	kl_ctx *ctx = st->ctx;
	const char *P = "kl_safetensors_open";
	char jerr[256];
	kl__jval root;
	if (kl__json_parse(text, len, &root, jerr, sizeof jerr))
		return kl_set_error(ctx, KL_EFORMAT, "%s: %s: header: %s", P, st->path, jerr), -1;
	int rc = -1;
	if (root.kind != KL__JOBJ) {
		kl_set_error(ctx, KL_EFORMAT, "%s: %s: header is not a JSON object", P, st->path);
		goto out;
	}
	st->e = calloc((size_t)root.n + 1, sizeof *st->e);
	if (!st->e) {
		kl_set_error(ctx, KL_ENOMEM, "%s: out of memory", P);
		goto out;
	}
	for (int i = 0; i < root.n; i++) {
		if (!strcmp(root.keys[i], "__metadata__")) {
			const kl__jval *m = &root.items[i];
			if (m->kind != KL__JOBJ) {
				kl_set_error(ctx, KL_EFORMAT,
				             "%s: %s: __metadata__ is not an object", P, st->path);
				goto out;
			}
			for (int j = 0; j < m->n; j++) {
				if (m->items[j].kind != KL__JSTR) {
					kl_set_error(ctx, KL_EFORMAT,
					             "%s: %s: __metadata__ '%s' is not a "
					             "string",
					             P, st->path, m->keys[j]);
					goto out;
				}
			}
			st->meta = root.items[i];
			memset(&root.items[i], 0, sizeof root.items[i]);
			root.items[i].kind = KL__JINT;
			continue;
		}
		if (parse_entry(st, root.keys[i], &root.items[i], &st->e[st->n]))
			goto out;
		st->n++;
	}
	/* overlap: sorted by begin, each range must start at or after the last end */
	st_entry **by = malloc(((size_t)st->n + 1) * sizeof *by);
	if (!by) {
		kl_set_error(ctx, KL_ENOMEM, "%s: out of memory", P);
		goto out;
	}
	for (int i = 0; i < st->n; i++)
		by[i] = &st->e[i];
	qsort(by, (size_t)st->n, sizeof *by, cmp_begin);
	for (int i = 1; i < st->n; i++) {
		if (by[i]->begin < by[i - 1]->end) {
			kl_set_error(ctx, KL_EFORMAT,
			             "%s: %s: tensor '%s': data_offsets [%lld,%lld] "
			             "overlap tensor '%s' [%lld,%lld]",
			             P, st->path, by[i]->name, (long long)by[i]->begin,
			             (long long)by[i]->end, by[i - 1]->name,
			             (long long)by[i - 1]->begin, (long long)by[i - 1]->end);
			free(by);
			goto out;
		}
	}
	free(by);
	rc = 0;
out:
	kl__json_free(&root);
	return rc;
}

kl_safetensors *kl_safetensors_open(kl_ctx *ctx, const char *path)
{
	const char *P = "kl_safetensors_open";
	if (!ctx || !path) {
		kl_set_error(ctx, KL_EINVAL, "%s: ctx and path must not be NULL", P);
		return NULL;
	}
	kl_safetensors *st = calloc(1, sizeof *st);
	char *hdr = NULL;
	if (!st || !(st->path = strdup(path))) {
		free(st);
		kl_set_error(ctx, KL_ENOMEM, "%s: out of memory", P);
		return NULL;
	}
	st->ctx = ctx;
	/* O_NONBLOCK: open() of a FIFO would wait for a writer forever; only a
	 * regular file is read (then the flag is cleared again) */
	struct stat sb;
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC), fl = -1;
	if (fd < 0 || fstat(fd, &sb) != 0 || (fl = fcntl(fd, F_GETFL)) < 0) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot open: %s", P, path, strerror(errno));
		if (fd >= 0)
			close(fd);
		goto fail;
	}
	if (!S_ISREG(sb.st_mode)) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot open: %s, not a regular file", P, path,
		             S_ISFIFO(sb.st_mode)  ? "a FIFO"
		             : S_ISDIR(sb.st_mode) ? "a directory"
		                                   : "a device or socket");
		close(fd);
		goto fail;
	}
	if (fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0 || !(st->f = fdopen(fd, "rb"))) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot open: %s", P, path, strerror(errno));
		close(fd);
		goto fail;
	}
	if (fseeko(st->f, 0, SEEK_END)) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot seek: %s", P, path, strerror(errno));
		goto fail;
	}
	off_t fsize = ftello(st->f);
	if (fsize < 0 || fseeko(st->f, 0, SEEK_SET)) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot size the file: %s", P, path,
		             strerror(errno));
		goto fail;
	}
	unsigned char lenb[8];
	if (fsize < 8) {
		kl_set_error(ctx, KL_EFORMAT,
		             "%s: %s: file is %lld bytes, shorter than the 8-byte "
		             "header length",
		             P, path, (long long)fsize);
		goto fail;
	}
	if (fread(lenb, 1, 8, st->f) != 8) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot read the header length", P, path);
		goto fail;
	}
	uint64_t hlen = 0;
	for (int i = 7; i >= 0; i--)
		hlen = hlen << 8 | lenb[i];
	if (hlen > ST_MAX_HEADER || hlen > (uint64_t)fsize - 8) {
		kl_set_error(ctx, KL_EFORMAT,
		             "%s: %s: header length %llu is larger than %s "
		             "(%lld bytes)",
		             P, path, (unsigned long long)hlen,
		             hlen > ST_MAX_HEADER ? "the 100 MB limit" : "the rest of the file",
		             hlen > ST_MAX_HEADER ? (long long)ST_MAX_HEADER
		                                  : (long long)fsize - 8);
		goto fail;
	}
	if (hlen < 2) {
		kl_set_error(ctx, KL_EFORMAT,
		             "%s: %s: header length %llu is too short for a JSON "
		             "object",
		             P, path, (unsigned long long)hlen);
		goto fail;
	}
	hdr = malloc((size_t)hlen);
	if (!hdr) {
		kl_set_error(ctx, KL_ENOMEM, "%s: %s: out of memory for a %llu-byte header", P,
		             path, (unsigned long long)hlen);
		goto fail;
	}
	if (fread(hdr, 1, (size_t)hlen, st->f) != (size_t)hlen) {
		kl_set_error(ctx, KL_EIO, "%s: %s: cannot read the header", P, path);
		goto fail;
	}
	st->data_start = 8 + (int64_t)hlen;
	st->data_len = (int64_t)fsize - st->data_start;
	if (parse_header(st, hdr, (size_t)hlen))
		goto fail;
	free(hdr);
	return st;
fail:
	free(hdr);
	kl_safetensors_close(st);
	return NULL;
}

int kl_safetensors_count(const kl_safetensors *st)
{
	return st ? st->n : 0;
}

const char *kl_safetensors_name(const kl_safetensors *st, int i)
{
	return st && i >= 0 && i < st->n ? st->e[i].name : NULL;
}

const char *kl_safetensors_metadata(const kl_safetensors *st, const char *key)
{
	if (!st || !key)
		return NULL;
	const kl__jval *v = kl__json_get(&st->meta, key);
	return v ? v->str : NULL;
}

kl_tensor *kl_safetensors_get(kl_safetensors *st, const char *name)
{
	const char *P = "kl_safetensors_get";
	if (!st || !name) {
		if (st)
			kl_set_error(st->ctx, KL_EINVAL, "%s: name must not be NULL", P);
		return NULL;
	}
	const st_entry *e = NULL;
	for (int i = 0; i < st->n && !e; i++)
		if (!strcmp(st->e[i].name, name))
			e = &st->e[i];
	if (!e) {
		kl_set_error(st->ctx, KL_EINVAL, "%s: no tensor '%s' in %s", P, name, st->path);
		return NULL;
	}
	size_t nb = (size_t)(e->end - e->begin);
	unsigned char *buf = malloc(nb ? nb : 1);
	if (!buf) {
		kl_set_error(st->ctx, KL_ENOMEM, "%s: %s: tensor '%s': out of memory for %zu bytes",
		             P, st->path, name, nb);
		return NULL;
	}
	if (nb && (fseeko(st->f, (off_t)(st->data_start + e->begin), SEEK_SET) ||
	           fread(buf, 1, nb, st->f) != nb)) {
		free(buf);
		kl_set_error(st->ctx, KL_EIO,
		             "%s: %s: tensor '%s': cannot read %zu bytes (was the "
		             "file changed?)",
		             P, st->path, name, nb);
		return NULL;
	}
	if (e->dt == KL_BOOL) {
		for (size_t i = 0; i < nb; i++) {
			if (buf[i] > 1) {
				unsigned bad = buf[i];
				free(buf);
				kl_set_error(st->ctx, KL_EFORMAT,
				             "%s: %s: tensor '%s': BOOL byte %zu "
				             "is %u, not 0 or 1",
				             P, st->path, name, i, bad);
				return NULL;
			}
		}
	}
	kl_tensor *t = kl_from_host(st->ctx, e->dt, e->ndim, e->shape, buf, nb);
	free(buf);
	if (!t) /* the call made was this one: say so, keeping the reason */
		kl_set_error(st->ctx, kl_last_status(st->ctx), "%s: %s: tensor '%s': %s", P,
		             st->path, name, kl_last_error(st->ctx));
	return t;
}

/* ---- writing -------------------------------------------------------------- */

static int name_ok(const char *s)
{
	const unsigned char *u = (const unsigned char *)s;
	if (!*u)
		return 0;
	while (*u) {
		if (*u < 0x20 || *u == 0x7F)
			return 0;
		unsigned c = *u;
		size_t k = c < 0x80             ? 1
		           : (c & 0xE0) == 0xC0 ? 2
		           : (c & 0xF0) == 0xE0 ? 3
		           : (c & 0xF8) == 0xF0 ? 4
		                                : 0;
		if (!k)
			return 0;
		unsigned cp = k == 1 ? c : k == 2 ? c & 0x1F : k == 3 ? c & 0x0F : c & 0x07;
		for (size_t i = 1; i < k; i++) {
			if ((u[i] & 0xC0) != 0x80)
				return 0;
			cp = cp << 6 | (u[i] & 0x3F);
		}
		static const unsigned min[5] = {0, 0, 0x80, 0x800, 0x10000};
		if (cp < min[k] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
			return 0;
		u += k;
	}
	return 1;
}

/* A growable text buffer for the header. */
typedef struct sbuf {
	char *s;
	size_t n, cap;
	int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
	if (b->oom)
		return;
	if (b->n + n + 1 > b->cap) {
		size_t nc = b->cap ? b->cap : 256;
		while (nc < b->n + n + 1)
			nc *= 2;
		char *ns = realloc(b->s, nc);
		if (!ns) {
			b->oom = 1;
			return;
		}
		b->s = ns;
		b->cap = nc;
	}
	memcpy(b->s + b->n, s, n);
	b->n += n;
	b->s[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s)
{
	sb_put(b, s, strlen(s));
}

/* Names are already checked free of control characters: only '"' and '\'
 * need escaping. */
static void sb_quoted(sbuf *b, const char *s)
{
	sb_put(b, "\"", 1);
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			sb_put(b, "\\", 1);
		sb_put(b, s, 1);
	}
	sb_put(b, "\"", 1);
}

static int write_all(int fd, const void *p, size_t n)
{
	const char *c = p;
	while (n) {
		ssize_t w = write(fd, c, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

kl_status kl_safetensors_save(kl_ctx *ctx, const char *path, int n, const char *const *names,
                              kl_tensor *const *ts)
{
	const char *P = "kl_safetensors_save";
	if (!ctx || !path || n < 0 || (n > 0 && (!names || !ts)))
		return kl_set_error(ctx, KL_EINVAL,
		                    "%s: ctx, path, names and tensors must be given "
		                    "and n (%d) >= 0",
		                    P, n);
	/* everything is checked before the temporary file exists */
	for (int i = 0; i < n; i++) {
		if (!names[i] || !name_ok(names[i]))
			return kl_set_error(ctx, KL_EINVAL,
			                    "%s: %s: name %d ('%s') must be non-empty "
			                    "UTF-8 without control characters",
			                    P, path, i, names[i] ? names[i] : "(null)");
		if (!strcmp(names[i], "__metadata__"))
			return kl_set_error(ctx, KL_EINVAL, "%s: %s: '__metadata__' is reserved", P,
			                    path);
		if (!ts[i])
			return kl_set_error(ctx, KL_EINVAL, "%s: %s: tensor '%s' is NULL", P, path,
			                    names[i]);
		if (kl_tensor_ctx(ts[i]) != ctx)
			return kl_set_error(ctx, KL_EINVAL,
			                    "%s: %s: tensor '%s' belongs to another "
			                    "context",
			                    P, path, names[i]);
		for (int j = 0; j < i; j++)
			if (!strcmp(names[i], names[j]))
				return kl_set_error(ctx, KL_EINVAL,
				                    "%s: %s: name '%s' appears twice", P, path,
				                    names[i]);
	}
	sbuf h = {0};
	int64_t off = 0;
	char num[64];
	sb_str(&h, "{");
	for (int i = 0; i < n; i++) {
		kl_dtype dt = kl_tensor_dtype(ts[i]);
		const int64_t *sh = kl_shape(ts[i]);
		size_t nbytes = 0; /* a live tensor's shape always passes */
		kl_shape_nbytes(dt, kl_ndim(ts[i]), sh, &nbytes);
		int64_t bytes = (int64_t)nbytes;
		if (i)
			sb_str(&h, ",");
		sb_quoted(&h, names[i]);
		sb_str(&h, ":{\"dtype\":\"");
		sb_str(&h, st_dtype_name(dt));
		sb_str(&h, "\",\"shape\":[");
		for (int d = 0; d < kl_ndim(ts[i]); d++) {
			snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)sh[d]);
			sb_str(&h, num);
		}
		snprintf(num, sizeof num, "],\"data_offsets\":[%lld,%lld]}", (long long)off,
		         (long long)(off + bytes));
		sb_str(&h, num);
		off += bytes;
	}
	sb_str(&h, "}");
	/* pad with spaces so the data starts 8-byte aligned, as safetensors does */
	while (!h.oom && h.n % 8)
		sb_put(&h, " ", 1);
	if (h.oom) {
		free(h.s);
		return kl_set_error(ctx, KL_ENOMEM, "%s: out of memory for the header", P);
	}

	size_t plen = strlen(path);
	char *tmp = malloc(plen + 64);
	if (!tmp) {
		free(h.s);
		return kl_set_error(ctx, KL_ENOMEM, "%s: out of memory", P);
	}
	/* open() with O_EXCL rather than mkstemp: a new file then gets the
	 * umask's mode, not 0600; a file replaced keeps its own mode. */
	static atomic_uint serial;
	int fd = -1;
	for (int tries = 0; tries < 100 && fd < 0; tries++) {
		snprintf(tmp, plen + 64, "%s.tmp.%ld.%u", path, (long)getpid(),
		         atomic_fetch_add(&serial, 1u));
		fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
		if (fd < 0 && errno != EEXIST)
			break;
	}
	if (fd < 0) {
		kl_status s =
		        kl_set_error(ctx, KL_EIO, "%s: %s: cannot create a temporary file: %s", P,
		                     path, strerror(errno));
		free(tmp);
		free(h.s);
		return s;
	}
	struct stat old;
	if (stat(path, &old) == 0 && S_ISREG(old.st_mode))
		(void)fchmod(fd, old.st_mode & 07777);
	kl_status s = KL_OK;
	unsigned char lenb[8];
	for (int i = 0; i < 8; i++)
		lenb[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
	if (write_all(fd, lenb, 8) || write_all(fd, h.s, h.n))
		s = kl_set_error(ctx, KL_EIO, "%s: %s: write failed: %s", P, tmp, strerror(errno));
	for (int i = 0; i < n && s == KL_OK; i++) {
		size_t nb = 0;
		kl_shape_nbytes(kl_tensor_dtype(ts[i]), kl_ndim(ts[i]), kl_shape(ts[i]), &nb);
		void *buf = malloc(nb ? nb : 1);
		if (!buf) {
			s = kl_set_error(ctx, KL_ENOMEM,
			                 "%s: %s: tensor '%s': out of memory for %zu "
			                 "bytes",
			                 P, path, names[i], nb);
			break;
		}
		if (kl_to_host(ts[i], buf, nb) != KL_OK) {
			/* keep the message kl_to_host left, named by tensor */
			s = kl_set_error(ctx, kl_last_status(ctx), "%s: %s: tensor '%s': %s", P,
			                 path, names[i], kl_last_error(ctx));
		} else if (write_all(fd, buf, nb)) {
			s = kl_set_error(ctx, KL_EIO, "%s: %s: write failed: %s", P, tmp,
			                 strerror(errno));
		}
		free(buf);
	}
	if (s == KL_OK && fsync(fd))
		s = kl_set_error(ctx, KL_EIO, "%s: %s: fsync failed: %s", P, tmp, strerror(errno));
	if (close(fd) && s == KL_OK)
		s = kl_set_error(ctx, KL_EIO, "%s: %s: close failed: %s", P, tmp, strerror(errno));
	if (s == KL_OK && rename(tmp, path))
		s = kl_set_error(ctx, KL_EIO, "%s: %s: cannot rename %s over it: %s", P, path, tmp,
		                 strerror(errno));
	if (s != KL_OK) {
		unlink(tmp);
	} else {
		/* make the rename itself durable: fsync the directory (best effort) */
		char *slash = strrchr(tmp, '/');
		if (slash)
			slash[slash == tmp ? 1 : 0] = 0;
		int dfd = open(slash ? tmp : ".", O_RDONLY);
		if (dfd >= 0) {
			(void)fsync(dfd);
			close(dfd);
		}
	}
	free(tmp);
	free(h.s);
	return s;
}
