/* json.c - the strict JSON subset reader behind json.h. Recursive descent
 * with a depth limit; every byte is bounds checked against len, so a header
 * that ends anywhere is a clean error. */
#include "nn/json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct jp {
	const unsigned char *s;
	size_t len, pos;
	char *err;
	size_t errcap;
} jp;

static int fail(jp *p, const char *fmt, ...)
{
	char msg[200];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	snprintf(p->err, p->errcap, "bad JSON at byte %zu: %s", p->pos, msg);
	return -1;
}

static void skip_ws(jp *p)
{
	while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' ||
	                           p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
		p->pos++;
}

void kl__json_free(kl__jval *v)
{
	if (!v)
		return;
	free(v->str);
	for (int i = 0; i < v->n; i++) {
		if (v->keys)
			free(v->keys[i]);
		if (v->items)
			kl__json_free(&v->items[i]);
	}
	free(v->keys);
	free(v->items);
	memset(v, 0, sizeof *v);
}

static int hex4(jp *p, unsigned *out)
{
	if (p->len - p->pos < 4)
		return fail(p, "truncated \\u escape");
	unsigned v = 0;
	for (int i = 0; i < 4; i++) {
		unsigned char c = p->s[p->pos + (size_t)i];
		unsigned d;
		if (c >= '0' && c <= '9')
			d = c - '0';
		else if (c >= 'a' && c <= 'f')
			d = c - 'a' + 10;
		else if (c >= 'A' && c <= 'F')
			d = c - 'A' + 10;
		else
			return fail(p, "bad hex digit in \\u escape");
		v = v * 16 + d;
	}
	p->pos += 4;
	*out = v;
	return 0;
}

static size_t put_utf8(unsigned char *o, unsigned cp)
{
	if (cp < 0x80) {
		o[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (unsigned char)(0xC0 | (cp >> 6));
		o[1] = (unsigned char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (unsigned char)(0xE0 | (cp >> 12));
		o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
		o[2] = (unsigned char)(0x80 | (cp & 0x3F));
		return 3;
	}
	o[0] = (unsigned char)(0xF0 | (cp >> 18));
	o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
	o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
	o[3] = (unsigned char)(0x80 | (cp & 0x3F));
	return 4;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 (overlongs,
 * surrogates and code points past U+10FFFF are invalid). */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
	unsigned c = s[0];
	size_t k;
	unsigned cp, min;
	if (c < 0x80)
		return 1;
	if ((c & 0xE0) == 0xC0) {
		k = 2, cp = c & 0x1F, min = 0x80;
	} else if ((c & 0xF0) == 0xE0) {
		k = 3, cp = c & 0x0F, min = 0x800;
	} else if ((c & 0xF8) == 0xF0) {
		k = 4, cp = c & 0x07, min = 0x10000;
	} else {
		return 0;
	}
	if (n < k)
		return 0;
	for (size_t i = 1; i < k; i++) {
		if ((s[i] & 0xC0) != 0x80)
			return 0;
		cp = (cp << 6) | (s[i] & 0x3F);
	}
	if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
		return 0;
	return k;
}

static int parse_string(jp *p, char **out)
{
	p->pos++; /* the opening quote */
	/* decoded text is never longer than its source */
	size_t start = p->pos, cap = 1;
	for (size_t i = start; i < p->len && p->s[i] != '"'; i++, cap++) {
		if (p->s[i] == '\\') {
			i++;
			cap++;
		}
	}
	unsigned char *o = malloc(cap + 4);
	if (!o)
		return fail(p, "out of memory");
	size_t n = 0;
	for (;;) {
		if (p->pos >= p->len) {
			free(o);
			return fail(p, "unterminated string");
		}
		unsigned char c = p->s[p->pos];
		if (c == '"') {
			p->pos++;
			break;
		}
		if (c < 0x20) {
			free(o);
			return fail(p, "control character 0x%02x in string", c);
		}
		if (c != '\\') {
			size_t k = utf8_seq(p->s + p->pos, p->len - p->pos);
			if (!k) {
				free(o);
				return fail(p, "invalid UTF-8 in string");
			}
			memcpy(o + n, p->s + p->pos, k);
			n += k;
			p->pos += k;
			continue;
		}
		if (p->pos + 1 >= p->len) {
			free(o);
			return fail(p, "unterminated escape");
		}
		unsigned char e = p->s[p->pos + 1];
		p->pos += 2;
		unsigned cp;
		switch (e) {
		case '"':
			cp = '"';
			break;
		case '\\':
			cp = '\\';
			break;
		case '/':
			cp = '/';
			break;
		case 'b':
			cp = '\b';
			break;
		case 'f':
			cp = '\f';
			break;
		case 'n':
			cp = '\n';
			break;
		case 'r':
			cp = '\r';
			break;
		case 't':
			cp = '\t';
			break;
		case 'u':
			if (hex4(p, &cp)) {
				free(o);
				return -1;
			}
			if (cp >= 0xDC00 && cp <= 0xDFFF) {
				free(o);
				return fail(p, "lone low surrogate \\u%04X", cp);
			}
			if (cp >= 0xD800 && cp <= 0xDBFF) {
				unsigned lo;
				if (p->len - p->pos < 2 || p->s[p->pos] != '\\' ||
				    p->s[p->pos + 1] != 'u') {
					free(o);
					return fail(p, "high surrogate \\u%04X without its pair",
					            cp);
				}
				p->pos += 2;
				if (hex4(p, &lo)) {
					free(o);
					return -1;
				}
				if (lo < 0xDC00 || lo > 0xDFFF) {
					free(o);
					return fail(p, "bad surrogate pair");
				}
				cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
			}
			if (cp == 0) {
				free(o);
				return fail(p, "\\u0000 in string");
			}
			break;
		default:
			free(o);
			return fail(p, "bad escape '\\%c'", e >= 0x20 && e < 0x7F ? e : '?');
		}
		/* an escape's source (>= 2 bytes, 6 or 12 for \u) covers its UTF-8 */
		n += put_utf8(o + n, cp);
	}
	o[n] = 0;
	*out = (char *)o;
	return 0;
}

static int parse_int(jp *p, int64_t *out)
{
	int neg = 0;
	if (p->s[p->pos] == '-') {
		neg = 1;
		p->pos++;
	}
	if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9')
		return fail(p, "expected a digit");
	if (p->s[p->pos] == '0' && p->pos + 1 < p->len && p->s[p->pos + 1] >= '0' &&
	    p->s[p->pos + 1] <= '9')
		return fail(p, "leading zero in number");
	uint64_t v = 0;
	const uint64_t lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
	while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
		unsigned d = p->s[p->pos] - '0';
		if (v > (lim - d) / 10)
			return fail(p, "integer out of range");
		v = v * 10 + d;
		p->pos++;
	}
	if (p->pos < p->len && (p->s[p->pos] == '.' || p->s[p->pos] == 'e' || p->s[p->pos] == 'E'))
		return fail(p, "only integers are accepted");
	*out = neg ? (v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v) : (int64_t)v;
	return 0;
}

static int parse_value(jp *p, kl__jval *v, int depth);

/* Append one member; grows arrays geometrically. */
static int push(jp *p, kl__jval *v, int *cap, char *key)
{
	if (v->n == *cap) {
		int nc = *cap ? *cap * 2 : 4;
		if (nc > (1 << 24))
			return fail(p, "too many members");
		kl__jval *ni = realloc(v->items, (size_t)nc * sizeof *ni);
		if (!ni)
			return fail(p, "out of memory");
		v->items = ni;
		if (v->kind == KL__JOBJ) {
			char **nk = realloc(v->keys, (size_t)nc * sizeof *nk);
			if (!nk)
				return fail(p, "out of memory");
			v->keys = nk;
		}
		*cap = nc;
	}
	memset(&v->items[v->n], 0, sizeof v->items[0]);
	if (v->kind == KL__JOBJ)
		v->keys[v->n] = key;
	v->n++;
	return 0;
}

static int parse_container(jp *p, kl__jval *v, int depth)
{
	int obj = p->s[p->pos] == '{';
	char close = obj ? '}' : ']';
	v->kind = obj ? KL__JOBJ : KL__JARR;
	int cap = 0;
	p->pos++;
	skip_ws(p);
	if (p->pos < p->len && p->s[p->pos] == close) {
		p->pos++;
		return 0;
	}
	for (;;) {
		char *key = NULL;
		skip_ws(p);
		if (obj) {
			if (p->pos >= p->len || p->s[p->pos] != '"')
				return fail(p, "expected a string key");
			if (parse_string(p, &key))
				return -1;
			for (int i = 0; i < v->n; i++) {
				if (!strcmp(v->keys[i], key)) {
					int r = fail(p, "duplicate key \"%.80s\"", key);
					free(key);
					return r;
				}
			}
			skip_ws(p);
			if (p->pos >= p->len || p->s[p->pos] != ':') {
				free(key);
				return fail(p, "expected ':'");
			}
			p->pos++;
		}
		if (push(p, v, &cap, key)) {
			free(key);
			return -1;
		}
		if (parse_value(p, &v->items[v->n - 1], depth + 1))
			return -1;
		skip_ws(p);
		if (p->pos >= p->len)
			return fail(p, "unterminated %s", obj ? "object" : "array");
		if (p->s[p->pos] == ',') {
			p->pos++;
			continue;
		}
		if (p->s[p->pos] == close) {
			p->pos++;
			return 0;
		}
		return fail(p, "expected ',' or '%c'", close);
	}
}

static int parse_value(jp *p, kl__jval *v, int depth)
{
	memset(v, 0, sizeof *v);
	if (depth > KL__JSON_MAX_DEPTH)
		return fail(p, "nesting deeper than %d", KL__JSON_MAX_DEPTH);
	skip_ws(p);
	if (p->pos >= p->len)
		return fail(p, "unexpected end");
	unsigned char c = p->s[p->pos];
	if (c == '{' || c == '[')
		return parse_container(p, v, depth);
	if (c == '"') {
		v->kind = KL__JSTR;
		return parse_string(p, &v->str);
	}
	if (c == '-' || (c >= '0' && c <= '9')) {
		v->kind = KL__JINT;
		return parse_int(p, &v->num);
	}
	return fail(p, "unexpected character '%c'", c >= 0x20 && c < 0x7F ? c : '?');
}

int kl__json_parse(const char *text, size_t len, kl__jval *out, char *err, size_t errcap)
{
	jp p = {(const unsigned char *)text, len, 0, err, errcap};
	if (parse_value(&p, out, 0)) {
		kl__json_free(out);
		return -1;
	}
	skip_ws(&p);
	if (p.pos != len) {
		kl__json_free(out);
		return fail(&p, "trailing bytes after the value");
	}
	return 0;
}

const kl__jval *kl__json_get(const kl__jval *v, const char *key)
{
	if (!v || v->kind != KL__JOBJ)
		return NULL;
	for (int i = 0; i < v->n; i++)
		if (!strcmp(v->keys[i], key))
			return &v->items[i];
	return NULL;
}
