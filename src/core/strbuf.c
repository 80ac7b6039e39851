/* strbuf.c - kl_sb, the growable string every text producer in kiln uses
 * (lowering's fusion log, the renderers, explain).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"

static bool sb_grow(kl_sb *sb, size_t need)
{
	if (sb->oom)
		return false;
	if (sb->n + need + 1 <= sb->cap)
		return true;
	size_t cap = sb->cap ? sb->cap : 256;
	while (cap < sb->n + need + 1)
		cap *= 2;
	char *p = realloc(sb->s, cap);
	if (!p) {
		sb->oom = true;
		return false;
	}
	sb->s = p;
	sb->cap = cap;
	return true;
}

void kl__sb_printf(kl_sb *sb, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	char tmp[256];
	int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	if (n < 0 || !sb_grow(sb, (size_t)n))
		return;
	if ((size_t)n < sizeof(tmp)) {
		memcpy(sb->s + sb->n, tmp, (size_t)n + 1);
	} else {
		va_start(ap, fmt);
		vsnprintf(sb->s + sb->n, (size_t)n + 1, fmt, ap);
		va_end(ap);
	}
	sb->n += (size_t)n;
}

void kl__sb_puts(kl_sb *sb, const char *s)
{
	size_t n = strlen(s);
	if (!sb_grow(sb, n))
		return;
	memcpy(sb->s + sb->n, s, n + 1);
	sb->n += n;
}

void kl__sb_free(kl_sb *sb)
{
	free(sb->s);
	memset(sb, 0, sizeof(*sb));
}

const char *kl__sb_str(const kl_sb *sb)
{
	return sb->s ? sb->s : "";
}
