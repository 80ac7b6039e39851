/* json.h - a small strict JSON reader for the nn layer's file headers
 * (safetensors): objects, arrays, strings and integers only. Anything else,
 * duplicate keys, deep nesting or trailing bytes is an error, never a crash. */
#ifndef KILN_NN_JSON_H
#define KILN_NN_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef enum kl__jkind { KL__JOBJ, KL__JARR, KL__JSTR, KL__JINT } kl__jkind;

typedef struct kl__jval kl__jval;
struct kl__jval {
	kl__jkind kind;
	int64_t num;     /* KL__JINT */
	char *str;       /* KL__JSTR: NUL-terminated, no embedded NUL */
	int n;           /* members of an object or array */
	char **keys;     /* KL__JOBJ: n keys, in file order */
	kl__jval *items; /* n values */
};

#define KL__JSON_MAX_DEPTH 8

/* Parse len bytes into *out. Returns 0, or -1 with a message in err
 * ("byte 12: expected ':'"). Free with kl__json_free on success only. */
int kl__json_parse(const char *text, size_t len, kl__jval *out, char *err, size_t errcap);
void kl__json_free(kl__jval *v);
/* The member of object v named key, or NULL. */
const kl__jval *kl__json_get(const kl__jval *v, const char *key);

#endif
