/* log.c - KILN_LOGS: named categories of diagnostics (graph breaks,
 * recompiles, fusion decisions, generated code, ...) printed to stderr with a
 * "[kiln:<category>]" prefix, the way TORCH_LOGS works.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/core.h"

static const char *const log_names[] = {"graph_breaks", "recompiles", "fusion",
                                        "output_code",  "cache",      "cudagraphs",
                                        "autotune",     "graph",      "startup"};
#define NLOGS ((int)(sizeof log_names / sizeof log_names[0]))

unsigned kl__parse_logs(const char *s)
{
	unsigned bits = 0;
	if (!s)
		return 0;
	while (*s) {
		while (*s == ',' || *s == ' ' || *s == '\t' || *s == '+')
			s++;
		size_t n = strcspn(s, ", \t");
		if (n == 3 && !strncmp(s, "all", 3))
			bits |= (1u << NLOGS) - 1;
		for (int i = 0; i < NLOGS; i++)
			if (strlen(log_names[i]) == n && !strncmp(s, log_names[i], n))
				bits |= 1u << i;
		s += n;
	}
	return bits;
}

void kl__log(const kl_ctx *ctx, unsigned cat, const char *fmt, ...)
{
	if (!ctx || !(ctx->logs & cat))
		return;
	const char *name = "log";
	for (int i = 0; i < NLOGS; i++)
		if (cat & (1u << i)) {
			name = log_names[i];
			break;
		}
	char msg[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	size_t n = strlen(msg);
	/* one fprintf per line keeps lines whole when several threads log */
	fprintf(stderr, "[kiln:%s] %s%s", name, msg, n && msg[n - 1] == '\n' ? "" : "\n");
}

double kl__now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}
