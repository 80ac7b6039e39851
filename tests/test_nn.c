/* test_nn.c - the nn layer: safetensors round trips of every dtype and
 * layout, a file laid out as PyTorch's safetensors writes it, metadata, a
 * table of malformed files (each a clean KL_EFORMAT/KL_EIO, never a crash),
 * and atomic saving. Uses the public API only.
 */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/stat.h>

#include <cmocka.h>

#include "kiln.h"
#include "kltest.h"

static char g_dir[] = "/tmp/kiln-test-nn-XXXXXX";

static char *path_in_dir(const char *name)
{
	static char buf[4][512];
	static int k;
	k = (k + 1) % 4;
	snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
	return buf[k];
}

static void write_bytes(const char *path, const void *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	assert_non_null(f);
	assert_int_equal(fwrite(p, 1, n, f), n);
	assert_int_equal(fclose(f), 0);
}

static unsigned char *read_bytes(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	assert_non_null(f);
	fseek(f, 0, SEEK_END);
	long len = ftell(f);
	fseek(f, 0, SEEK_SET);
	unsigned char *p = malloc((size_t)len + 1);
	assert_non_null(p);
	assert_int_equal(fread(p, 1, (size_t)len, f), (size_t)len);
	fclose(f);
	*n = (size_t)len;
	return p;
}

/* A safetensors image: header length N (as given, or strlen(hdr) when
 * nlen < 0), the header text, then ndata bytes 0, 1, 2, ... */
static unsigned char *build(const char *hdr, int64_t nlen, size_t ndata, size_t *size)
{
	size_t hl = strlen(hdr);
	uint64_t n = nlen < 0 ? hl : (uint64_t)nlen;
	*size = 8 + hl + ndata;
	unsigned char *p = malloc(*size);
	assert_non_null(p);
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(n >> (8 * i));
	memcpy(p + 8, hdr, hl);
	for (size_t i = 0; i < ndata; i++)
		p[8 + hl + i] = (unsigned char)i;
	return p;
}

static unsigned char *host_bytes(kl_tensor *t, size_t *nb)
{
	*nb = (size_t)kl_numel(t) * kl_dtype_size(kl_tensor_dtype(t));
	unsigned char *p = malloc(*nb + 1);
	assert_non_null(p);
	assert_int_equal(kl_to_host(t, p, *nb), KL_OK);
	return p;
}

/* Number of entries in the test directory, to see no temporary file stays. */
static int dir_entries(void)
{
	DIR *d = opendir(g_dir);
	assert_non_null(d);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			n++;
	closedir(d);
	return n;
}

/* ---- round trips -------------------------------------------------------- */

static void test_roundtrip_every_dtype(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	enum { PER = 4 };
	kl_tensor *ts[KL_NDTYPES * PER];
	char namebuf[KL_NDTYPES * PER][64];
	const char *names[KL_NDTYPES * PER];
	int n = 0;
	for (int d = 0; d < KL_NDTYPES; d++) {
		kl_dtype dt = (kl_dtype)d;
		const char *dn = kl_dtype_name(dt);
		kl_tensor *base = kltest_rand(ctx, dt, 2, (int64_t[]){3, 5},
		                              dt == KL_BOOL ? KLTEST_NORMAL : KLTEST_SPECIAL,
		                              KLTEST_CONTIG, 100 + (uint64_t)d);
		assert_non_null(base);
		ts[n] = base;
		snprintf(namebuf[n], 64, "%s.dense", dn);
		ts[n + 1] = kl_transpose(base, 0, 1);
		assert_non_null(ts[n + 1]);
		assert_false(kl_is_contiguous(ts[n + 1]));
		snprintf(namebuf[n + 1], 64, "%s.transposed \"q\\\"", dn);
		ts[n + 2] = kl_scalar(ctx, dt, 1.0);
		snprintf(namebuf[n + 2], 64, "%s.scalar/\xc3\xa9", dn);
		ts[n + 3] = kl_zeros(ctx, dt, 2, (int64_t[]){0, 7});
		snprintf(namebuf[n + 3], 64, "%s.empty", dn);
		for (int k = 0; k < PER; k++) {
			assert_non_null(ts[n + k]);
			names[n + k] = namebuf[n + k];
		}
		n += PER;
	}
	const char *path = path_in_dir("all.safetensors");
	assert_int_equal(kl_safetensors_save(ctx, path, n, names, ts), KL_OK);

	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_int_equal(kl_safetensors_count(st), n);
	assert_null(kl_safetensors_name(st, n));
	assert_null(kl_safetensors_metadata(st, "format"));
	for (int i = 0; i < n; i++) {
		assert_string_equal(kl_safetensors_name(st, i), names[i]);
		kl_tensor *r = kl_safetensors_get(st, names[i]);
		assert_non_null(r);
		assert_int_equal(kl_tensor_dtype(r), kl_tensor_dtype(ts[i]));
		assert_int_equal(kl_ndim(r), kl_ndim(ts[i]));
		for (int a = 0; a < kl_ndim(r); a++)
			assert_int_equal(kl_shape(r)[a], kl_shape(ts[i])[a]);
		size_t na, nb;
		unsigned char *a = host_bytes(ts[i], &na), *b = host_bytes(r, &nb);
		assert_int_equal(na, nb);
		if (na)
			assert_memory_equal(a, b, na);
		free(a);
		free(b);
		kl_release(r);
	}
	kl_safetensors_close(st);

	/* the data offsets are dense and the data starts 8-byte aligned */
	size_t sz;
	unsigned char *img = read_bytes(path, &sz);
	uint64_t hl = 0;
	for (int i = 7; i >= 0; i--)
		hl = hl << 8 | img[i];
	assert_int_equal(hl % 8, 0);
	size_t total = 0;
	for (int i = 0; i < n; i++)
		total += (size_t)kl_numel(ts[i]) * kl_dtype_size(kl_tensor_dtype(ts[i]));
	assert_int_equal(sz, 8 + hl + total);
	free(img);

	/* an empty file (no tensors) round trips too */
	assert_int_equal(kl_safetensors_save(ctx, path, 0, NULL, NULL), KL_OK);
	st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_int_equal(kl_safetensors_count(st), 0);
	kl_safetensors_close(st);
	for (int i = 0; i < n; i++)
		kl_release(ts[i]);
	unlink(path);
	kl_ctx_free(ctx);
}

/* The layout the Python safetensors library writes for
 * save_file({"weight": w, "bias": b}, metadata={"format": "pt"}): keys
 * sorted, data ordered by offset, the header padded with spaces to 8 bytes. */
static void test_pytorch_layout(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	char hdr[512] =
	        "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"caf\\u00E9 \\ud83d\\ude00\\n\","
	        "\"esc\":\"\\\"\\\\\\/\\b\\f\\r\\t\"},"
	        "\"bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
	        "\"steps\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
	        "\"weight\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[16,24]}}";
	while (strlen(hdr) % 8)
		strcat(hdr, " ");
	const float bias[2] = {0.5f, -3.25f};
	const int64_t steps = 123456789012345LL;
	const uint16_t w[4] = {0x3F80, 0xC000, 0x0000, 0x7F80}; /* 1, -2, 0, +inf */
	unsigned char data[24];
	memcpy(data, bias, 8);
	memcpy(data + 8, &steps, 8);
	memcpy(data + 16, w, 8);
	size_t sz;
	unsigned char *img = build(hdr, -1, 0, &sz);
	img = realloc(img, sz + 24);
	assert_non_null(img);
	memcpy(img + sz, data, 24);
	const char *path = path_in_dir("torch.safetensors");
	write_bytes(path, img, sz + 24);
	free(img);

	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_int_equal(kl_safetensors_count(st), 3);
	assert_string_equal(kl_safetensors_name(st, 0), "bias");
	assert_string_equal(kl_safetensors_name(st, 2), "weight");
	assert_string_equal(kl_safetensors_metadata(st, "format"), "pt");
	assert_string_equal(kl_safetensors_metadata(st, "note"), "caf\xc3\xa9 \xf0\x9f\x98\x80\n");
	assert_string_equal(kl_safetensors_metadata(st, "esc"), "\"\\/\b\f\r\t");
	assert_null(kl_safetensors_metadata(st, "bias"));

	/* the error setter the nn layer reports through */
	assert_int_equal(kl_set_error(ctx, KL_EIO, "x %d", 5), KL_EIO);
	assert_string_equal(kl_last_error(ctx), "x 5");
	assert_int_equal(kl_last_status(ctx), KL_EIO);
	kl_clear_error(ctx);

	kl_tensor *b = kl_safetensors_get(st, "bias");
	kl_tensor *s = kl_safetensors_get(st, "steps");
	kl_tensor *wt = kl_safetensors_get(st, "weight");
	assert_non_null(b);
	assert_non_null(s);
	assert_non_null(wt);
	float bb[2];
	assert_int_equal(kl_to_host(b, bb, sizeof bb), KL_OK);
	assert_true(bb[0] == 0.5f && bb[1] == -3.25f);
	assert_int_equal(kl_ndim(s), 0);
	double sv;
	assert_int_equal(kl_item(s, &sv), KL_OK);
	int64_t s64;
	assert_int_equal(kl_to_host(s, &s64, 8), KL_OK);
	assert_true(s64 == steps);
	assert_int_equal(kl_tensor_dtype(wt), KL_BF16);
	double *wv = kltest_read(wt);
	assert_non_null(wv);
	assert_true(wv[0] == 1.0 && wv[1] == -2.0 && wv[2] == 0.0 && wv[3] > 1e300);
	free(wv);

	/* a missing name is an error naming it and the file */
	assert_null(kl_safetensors_get(st, "nope"));
	assert_non_null(strstr(kl_last_error(ctx), "no tensor 'nope' in"));
	assert_non_null(strstr(kl_last_error(ctx), "torch.safetensors"));
	kl_release(b);
	kl_release(s);
	kl_release(wt);
	kl_safetensors_close(st);
	unlink(path);

	/* BOOL bytes other than 0/1 are rejected when read */
	size_t bsz;
	unsigned char *bimg = build("{\"m\":{\"dtype\":\"BOOL\",\"shape\":[3],"
	                            "\"data_offsets\":[0,3]}}",
	                            -1, 3, &bsz);
	bimg[bsz - 1] = 7;
	write_bytes(path, bimg, bsz);
	free(bimg);
	st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_null(kl_safetensors_get(st, "m"));
	assert_int_equal(kl_last_status(ctx), KL_EFORMAT);
	assert_non_null(strstr(kl_last_error(ctx), "not 0 or 1"));
	kl_safetensors_close(st);
	unlink(path);
	kl_ctx_free(ctx);
}

/* ---- malformed files ----------------------------------------------------- */

static void expect_reject(kl_ctx *ctx, const char *path, const char *what, const char *want)
{
	kl_clear_error(ctx);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	if (st) {
		kl_safetensors_close(st);
		fail_msg("%s: accepted", what);
	}
	kl_status s = kl_last_status(ctx);
	const char *msg = kl_last_error(ctx);
	if ((s != KL_EFORMAT && s != KL_EIO) || !strstr(msg, "kl_safetensors_open") ||
	    (want && !strstr(msg, want)))
		fail_msg("%s: status %s, message '%s' (wanted '%s')", what, kl_status_name(s), msg,
		         want ? want : "");
}

static void test_truncated_everywhere(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *a = kl_arange(ctx, KL_F32, 0, 6, 1);
	kl_tensor *b = kl_full(ctx, KL_I32, 1, (int64_t[]){2}, 7);
	const char *names[2] = {"a", "b"};
	const char *path = path_in_dir("full.safetensors");
	assert_int_equal(kl_safetensors_save(ctx, path, 2, names, (kl_tensor *[]){a, b}), KL_OK);
	size_t sz;
	unsigned char *img = read_bytes(path, &sz);
	const char *cut = path_in_dir("cut.safetensors");
	for (size_t k = 0; k < sz; k++) {
		char what[64];
		snprintf(what, sizeof what, "truncated to %zu of %zu bytes", k, sz);
		write_bytes(cut, img, k);
		expect_reject(ctx, cut, what, NULL);
	}
	write_bytes(cut, img, sz);
	kl_safetensors *st = kl_safetensors_open(ctx, cut);
	assert_non_null(st);
	kl_safetensors_close(st);
	free(img);
	unlink(cut);
	unlink(path);
	expect_reject(ctx, path_in_dir("does-not-exist"), "missing file", "cannot open");
	assert_int_equal(kl_last_status(ctx), KL_EIO);
	kl_release(a);
	kl_release(b);
	kl_ctx_free(ctx);
}

#define E(name, dt, shape, off) \
	"\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" off "}"

static const struct bad {
	const char *what;
	const char *hdr;
	int64_t nlen; /* header length to claim; -1: the real one */
	size_t ndata;
	const char *want;
} bad_files[] = {
        {"unterminated object", "{" E("a", "F32", "[2]", "[0,8]"), -1, 8, "unterminated object"},
        {"trailing garbage", "{" E("a", "F32", "[2]", "[0,8]") "}x", -1, 8, "trailing bytes"},
        {"header is an array", "[1,2]", -1, 0, "not a JSON object"},
        {"header is a number", "12", -1, 0, "not a JSON object"},
        {"duplicate names",
         "{" E("a", "F32", "[2]", "[0,8]") "," E("a", "F32", "[2]", "[8,16]") "}", -1, 16,
         "duplicate key \"a\""},
        {"unknown dtype U8", "{" E("a", "U8", "[2]", "[0,2]") "}", -1, 2,
         "tensor 'a': dtype 'U8' is not supported"},
        {"unknown dtype F8", "{" E("w", "F8_E4M3", "[2]", "[0,2]") "}", -1, 2, "'F8_E4M3'"},
        {"dtype not a string", "{\"a\":{\"dtype\":5,\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 8,
         "dtype is not a string"},
        {"shape not an array", "{" E("a", "F32", "2", "[0,8]") "}", -1, 8, "shape is not an array"},
        {"negative dim", "{" E("a", "F32", "[-2]", "[0,8]") "}", -1, 8, "shape[0] is not"},
        {"fractional dim", "{" E("a", "F32", "[1.5]", "[0,8]") "}", -1, 8, "only integers"},
        {"string dim", "{" E("a", "F32", "[\"2\"]", "[0,8]") "}", -1, 8, "shape[0] is not"},
        {"too many dims", "{" E("a", "F32", "[1,1,1,1,1,1,1,1,1]", "[0,4]") "}", -1, 4, "9 dims"},
        {"size mismatch", "{" E("a", "F32", "[2]", "[0,4]") "}", -1, 8,
         "hold 4 bytes but F32 of that shape needs 8"},
        {"offsets overrun", "{" E("a", "F32", "[4]", "[0,16]") "}", -1, 8,
         "data_offsets [0,16] overrun the data (8 bytes)"},
        {"offsets reversed", "{" E("a", "F32", "[0]", "[8,0]") "}", -1, 8, "not 0 <= begin"},
        {"negative offset", "{" E("a", "F32", "[2]", "[-8,0]") "}", -1, 8, "not 0 <= begin"},
        {"one offset", "{" E("a", "F32", "[2]", "[0]") "}", -1, 8, "not [begin, end]"},
        {"huge end offset", "{" E("a", "F32", "[2]", "[0,9223372036854775807]") "}", -1, 8,
         "overrun"},
        {"overlap", "{" E("a", "F32", "[2]", "[0,8]") "," E("b", "F32", "[2]", "[4,12]") "}", -1,
         16, "overlap tensor 'a'"},
        {"missing data_offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", -1, 8,
         "missing key 'data_offsets'"},
        {"extra key", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}",
         -1, 8, "unknown key 'x'"},
        {"empty name", "{" E("", "F32", "[2]", "[0,8]") "}", -1, 8, "empty name"},
        {"entry not an object", "{\"a\":5}", -1, 0, "entry is not an object"},
        {"metadata not strings", "{\"__metadata__\":{\"k\":1}}", -1, 0, "'k' is not a string"},
        {"metadata not an object", "{\"__metadata__\":[]}", -1, 0, "__metadata__ is not an object"},
        {"deep nesting", "{\"__metadata__\":{\"k\":[[[[[[[[[[\"x\"]]]]]]]]]]}}", -1, 0, "nesting"},
        {"bad escape", "{\"a\\q\":5}", -1, 0, "bad escape"},
        {"invalid UTF-8", "{\"a\xff\":5}", -1, 0, "invalid UTF-8"},
        {"overlong UTF-8", "{\"a\xc0\xaf\":5}", -1, 0, "invalid UTF-8"},
        {"lone surrogate", "{\"a\\ud800\":5}", -1, 0, "surrogate"},
        {"truncated \\u", "{\"a\\u12", -1, 0, "\\u escape"},
        {"NUL escape", "{\"a\\u0000b\":5}", -1, 0, "\\u0000"},
        {"raw control char", "{\"a\tb\":5}", -1, 0, "control character"},
        {"true literal", "{\"a\":true}", -1, 0, "unexpected character 't'"},
        {"byte-size overflow", "{" E("a", "F64", "[4611686018427387904,4]", "[0,8]") "}", -1, 8,
         "multiply past 2^59"},
        {"empty, huge dims", "{" E("a", "F32", "[0,4611686018427387904,4611686018427387904]",
                                   "[0,0]") "}", -1, 0, "multiply past 2^59"},
        {"integer out of range", "{" E("a", "F32", "[99999999999999999999]", "[0,8]") "}", -1, 8,
         "out of range"},
        {"leading zero", "{" E("a", "F32", "[02]", "[0,8]") "}", -1, 8, "leading zero"},
        {"missing colon", "{\"a\" 5}", -1, 0, "expected ':'"},
        {"missing comma", "{\"a\":{\"dtype\":\"F32\" \"shape\":[2]}}", -1, 0, "expected ','"},
        {"blank header", "        ", -1, 0, "unexpected end"},
        {"header too short", "{", -1, 0, "too short"},
        {"N past the file", "{}", 100, 4, "larger than the rest of the file"},
        {"N absurd", "{}", (int64_t)1 << 40, 0, "100 MB limit"},
        {"N negative as i64", "{}", -2, 0, "100 MB limit"},
};

static void test_malformed_table(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const char *path = path_in_dir("bad.safetensors");
	size_t nbad = sizeof bad_files / sizeof bad_files[0];
	assert_true(nbad >= 25);
	for (size_t i = 0; i < nbad; i++) {
		const struct bad *b = &bad_files[i];
		size_t sz;
		/* -2: all bits set, a u64 no signed reading makes sensible */
		int64_t nl = b->nlen == -2 ? INT64_MAX : b->nlen;
		unsigned char *img = build(b->hdr, nl, b->ndata, &sz);
		if (b->nlen == -2)
			memset(img, 0xff, 8);
		write_bytes(path, img, sz);
		free(img);
		expect_reject(ctx, path, b->what, b->want);
		assert_int_equal(kl_last_status(ctx), KL_EFORMAT);
	}
	/* a file of fewer than 8 bytes */
	write_bytes(path, "\x02\0\0", 3);
	expect_reject(ctx, path, "3-byte file", "shorter than the 8-byte");
	/* a directory is not a file */
	expect_reject(ctx, g_dir, "a directory", NULL);
	unlink(path);
	kl_ctx_free(ctx);
}

/* Random byte edits of a valid file: each either opens (and then every
 * tensor reads or fails cleanly) or is rejected with a message. */
static void test_mutations_never_crash(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *a = kl_arange(ctx, KL_F32, 0, 6, 1);
	kl_tensor *m = kl_full(ctx, KL_BOOL, 2, (int64_t[]){2, 2}, 1);
	const char *path = path_in_dir("base.safetensors"), *mut = path_in_dir("mut.safetensors");
	assert_int_equal(kl_safetensors_save(ctx, path, 2, (const char *[]){"a", "mask"},
	                                     (kl_tensor *[]){a, m}),
	                 KL_OK);
	size_t sz;
	unsigned char *img = read_bytes(path, &sz), *buf = malloc(sz);
	assert_non_null(buf);
	uint64_t x = 0x9E3779B97F4A7C15ull;
	int opened = 0, rejected = 0;
	for (int it = 0; it < 3000; it++) {
		memcpy(buf, img, sz);
		int edits = 1 + it % 3;
		for (int e = 0; e < edits; e++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			/* mostly the header, where the structure is */
			size_t at = (size_t)(x >> 32) % (it % 4 ? sz - 24 : sz);
			buf[at] = (unsigned char)(x >> 8);
		}
		write_bytes(mut, buf, sz);
		kl_clear_error(ctx);
		kl_safetensors *st = kl_safetensors_open(ctx, mut);
		if (!st) {
			assert_true(kl_last_status(ctx) == KL_EFORMAT ||
			            kl_last_status(ctx) == KL_EIO);
			assert_true(kl_last_error(ctx)[0] != 0);
			rejected++;
			continue;
		}
		opened++;
		for (int i = 0; i < kl_safetensors_count(st); i++) {
			kl_tensor *t = kl_safetensors_get(st, kl_safetensors_name(st, i));
			if (t)
				kl_release(t);
			else
				assert_int_equal(kl_last_status(ctx), KL_EFORMAT);
		}
		kl_safetensors_close(st);
	}
	assert_true(opened > 0 && rejected > 0);
	free(buf);
	free(img);
	unlink(mut);
	unlink(path);
	kl_release(a);
	kl_release(m);
	kl_ctx_free(ctx);
}

/* ---- saving --------------------------------------------------------------- */

static void test_save_failures_keep_old_file(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const char *path = path_in_dir("keep.safetensors");
	kl_tensor *a = kl_arange(ctx, KL_F64, 0, 4, 1);
	kl_tensor *b = kl_full(ctx, KL_F16, 2, (int64_t[]){2, 2}, -1.5);
	assert_int_equal(
	        kl_safetensors_save(ctx, path, 1, (const char *[]){"a"}, (kl_tensor *[]){a}),
	        KL_OK);
	size_t n0;
	unsigned char *before = read_bytes(path, &n0);
	int entries = dir_entries();

	static const struct {
		const char *n0, *n1, *want;
	} cases[] = {
	        {"x", "x", "appears twice"},
	        {"x", "", "must be non-empty"},
	        {"x", "bad\nname", "control characters"},
	        {"x", "bad\xff", "UTF-8"},
	        {"x", "\xed\xa0\x80", "UTF-8"}, /* an encoded surrogate */
	        {"__metadata__", "y", "reserved"},
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		const char *names[2] = {cases[i].n0, cases[i].n1};
		assert_int_equal(kl_safetensors_save(ctx, path, 2, names, (kl_tensor *[]){a, b}),
		                 KL_EINVAL);
		assert_non_null(strstr(kl_last_error(ctx), cases[i].want));
		assert_non_null(strstr(kl_last_error(ctx), "kl_safetensors_save"));
	}
	assert_int_equal(kl_safetensors_save(ctx, path, 2, (const char *[]){"a", "b"},
	                                     (kl_tensor *[]){a, NULL}),
	                 KL_EINVAL);
	assert_int_equal(kl_safetensors_save(ctx, path, -1, NULL, NULL), KL_EINVAL);
	assert_int_equal(kl_safetensors_save(ctx, path_in_dir("no/such/dir.st"), 1,
	                                     (const char *[]){"a"}, (kl_tensor *[]){a}),
	                 KL_EIO);

	size_t n1;
	unsigned char *after = read_bytes(path, &n1);
	assert_int_equal(n0, n1);
	assert_memory_equal(before, after, n0);
	assert_int_equal(dir_entries(), entries); /* no temporary file left behind */
	free(after);

	/* a good save replaces it, keeping the old file's mode */
	assert_int_equal(chmod(path, 0640), 0);
	assert_int_equal(kl_safetensors_save(ctx, path, 2, (const char *[]){"b", "a"},
	                                     (kl_tensor *[]){b, a}),
	                 KL_OK);
	struct stat sb;
	assert_int_equal(stat(path, &sb), 0);
	assert_int_equal(sb.st_mode & 0777, 0640);
	assert_int_equal(dir_entries(), entries);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_int_equal(kl_safetensors_count(st), 2);
	assert_string_equal(kl_safetensors_name(st, 0), "b");
	kl_tensor *r = kl_safetensors_get(st, "b");
	assert_non_null(r);
	double *v = kltest_read(r);
	assert_non_null(v);
	for (int i = 0; i < 4; i++)
		assert_true(v[i] == -1.5);
	free(v);
	kl_release(r);
	kl_safetensors_close(st);
	free(before);
	unlink(path);
	kl_release(a);
	kl_release(b);
	kl_ctx_free(ctx);
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "test_nn: timed out: kl_safetensors_open blocked\n";
	if (write(2, msg, sizeof msg - 1) < 0)
		_exit(3);
	_exit(3);
}

/* A FIFO, a directory and a device are refused with a reason at once; a
 * FIFO used to block in fopen until a writer came (the alarm turns a hang
 * back into a failure). */
static void test_open_not_a_file(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const char *fifo = path_in_dir("pipe.safetensors");
	assert_int_equal(mkfifo(fifo, 0600), 0);
	static const struct {
		const char *path, *want;
	} cases[] = {
	        {NULL, "a FIFO, not a regular file"},
	        {".", "a directory, not a regular file"},
	        {"/dev/null", "a device or socket, not a regular file"},
	};
	signal(SIGALRM, on_alarm);
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		const char *path = cases[i].path ? cases[i].path : fifo;
		alarm(20);
		kl_safetensors *st = kl_safetensors_open(ctx, path);
		alarm(0);
		assert_null(st);
		assert_int_equal(kl_last_status(ctx), KL_EIO);
		const char *msg = kl_last_error(ctx);
		if (!strstr(msg, cases[i].want) || !strstr(msg, "kl_safetensors_open"))
			fail_msg("case %zu: %s", i, msg);
	}
	signal(SIGALRM, SIG_DFL);
	unlink(fifo);
	kl_ctx_free(ctx);
}

int main(void)
{
	if (!mkdtemp(g_dir)) {
		perror("mkdtemp");
		return 1;
	}
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_roundtrip_every_dtype),
	        cmocka_unit_test(test_pytorch_layout),
	        cmocka_unit_test(test_truncated_everywhere),
	        cmocka_unit_test(test_malformed_table),
	        cmocka_unit_test(test_mutations_never_crash),
	        cmocka_unit_test(test_save_failures_keep_old_file),
	        cmocka_unit_test(test_open_not_a_file),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	rmdir(g_dir);
	return rc;
}
