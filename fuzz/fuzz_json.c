/* fuzz_json.c - libFuzzer target: nn/json.c, the strict JSON reader behind
 * every safetensors header. Any input either parses into a tree that keeps
 * json.h's promises (depth at most KL__JSON_MAX_DEPTH, unique keys that
 * kl__json_get finds, strings without embedded NUL) or fails with a message;
 * ASan/UBSan watch the rest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "nn/json.h"

static void walk(const kl__jval *v, int depth)
{
	if (depth > KL__JSON_MAX_DEPTH)
		kf_die("json: a tree %d deep (the limit is %d)", depth, KL__JSON_MAX_DEPTH);
	switch (v->kind) {
	case KL__JSTR:
		if (!v->str)
			kf_die("json: a string without text");
		(void)strlen(v->str); /* ASan: NUL-terminated inside its allocation */
		break;
	case KL__JINT:
		break;
	case KL__JOBJ:
		for (int i = 0; i < v->n; i++)
			if (kl__json_get(v, v->keys[i]) != &v->items[i])
				kf_die("json: key \"%s\" is not unique or not found", v->keys[i]);
		/* fall through: the members */
	case KL__JARR:
		if (v->n < 0 || (v->n > 0 && !v->items))
			kf_die("json: %d members without storage", v->n);
		for (int i = 0; i < v->n; i++)
			walk(&v->items[i], depth + 1);
		break;
	default:
		kf_die("json: node kind %d", (int)v->kind);
	}
}

static const char *const seeds[] = {
        "{}",
        "[]",
        "{\"a\":1,\"b\":[1,2,-3],\"c\":\"x\"}",
        ("{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],"
         "\"data_offsets\":[0,24]}}"),
        "{\"s\":\"tab\\t nl\\n quote\\\" back\\\\ slash\\/ u\\u00e9 pair\\ud83d\\ude00\"}",
        "[[[[[[[1]]]]]]]",
        "{\"n\":-9223372036854775808,\"m\":9223372036854775807,\"z\":0}",
        " \t\r\n{ \"k\" : [ ] , \"l\" : { } } \n",
        "{\"\\u0000\":1}",
        "{\"caf\xc3\xa9\":\"\xe2\x82\xac\"}",
};

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	const char *dir = kf_seed_dir();
	if (dir) {
		for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
			char name[32];
			snprintf(name, sizeof name, "seed-%02zu.json", i);
			kf_write_seed(dir, name, seeds[i], strlen(seeds[i]));
		}
		kf_seeds_done(*argc);
	}
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	kl__jval v;
	char err[256] = "";
	if (kl__json_parse((const char *)data, size, &v, err, sizeof err) == 0) {
		if (v.kind != KL__JOBJ && v.kind != KL__JARR && v.kind != KL__JSTR &&
		    v.kind != KL__JINT)
			kf_die("json: root kind %d", (int)v.kind);
		walk(&v, 0);
		kl__json_free(&v);
	} else if (!err[0]) {
		kf_die("json: rejected without a message");
	}
	return 0;
}
