/* ctx.c - contexts: teardown of their tensors (api/context.c makes and frees
 * contexts, setting devices up),
 * the error path (per-context message, thread-local for failures with no
 * context), scopes as autorelease pools, version and status names.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"

/* Failures that have no context to hold them: kl_ctx_new, and ops whose
 * inputs are all NULL. One per thread, like errno. */
static _Thread_local char tl_err[KL_ERR_CAP];
static _Thread_local kl_status tl_status;

/* The public call in progress on this thread (KL_API), or NULL. */
static _Thread_local const char *tl_api;

const char *kl__api_enter(const char *name)
{
	if (tl_api)
		return NULL; /* nested: the outer call keeps its name */
	tl_api = name;
	return name;
}

void kl__api_leave(const char *const *frame)
{
	if (*frame)
		tl_api = NULL;
}

/* msg under the name of the call in progress: its leading "kl_<ident>: " (an
 * inner op's, the allocator's) replaced, or the name put in front. */
static void name_by_api(char *msg, size_t cap)
{
	size_t skip = 0;
	if (strncmp(msg, "kl_", 3) == 0) {
		size_t k = 3;
		while ((msg[k] >= 'a' && msg[k] <= 'z') || (msg[k] >= 'A' && msg[k] <= 'Z') ||
		       (msg[k] >= '0' && msg[k] <= '9') || msg[k] == '_')
			k++;
		if (msg[k] == ':' && msg[k + 1] == ' ')
			skip = k + 2;
	}
	char out[KL_ERR_CAP];
	size_t an = strlen(tl_api), rest = strlen(msg + skip);
	if (an > sizeof out / 2)
		an = sizeof out / 2;
	memcpy(out, tl_api, an);
	memcpy(out + an, ": ", 2);
	if (rest > sizeof out - an - 3)
		rest = sizeof out - an - 3; /* truncated, as vsnprintf would */
	memcpy(out + an + 2, msg + skip, rest);
	out[an + 2 + rest] = '\0';
	memcpy(msg, out, an + 3 + rest < cap ? an + 3 + rest : cap);
	msg[cap - 1] = '\0';
}

kl_status kl__err(kl_ctx *ctx, kl_status status, const char *fmt, ...)
{
	/* format apart first: callers may pass ctx->err itself as an argument
	 * (the "after: <previous>" chaining) */
	char msg[KL_ERR_CAP];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (tl_api)
		name_by_api(msg, sizeof msg);
	if (ctx) {
		memcpy(ctx->err, msg, sizeof msg);
		ctx->status = status;
	} else {
		memcpy(tl_err, msg, sizeof msg);
		tl_status = status;
	}
	return status;
}

kl_status kl__err_value(kl_ctx *ctx, const char *op, const char *what, int64_t i, int64_t v,
                        int64_t hi, int dim)
{
	return kl__err(ctx, KL_EINVAL, "%s: %s[%lld] = %lld disagrees with the cache: k holds %lld "
	               "keys (dim %d)", op, what, (long long)i, (long long)v, (long long)hi, dim);
}

kl_status kl_set_error(kl_ctx *ctx, kl_status status, const char *fmt, ...)
{
	char msg[KL_ERR_CAP];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return kl__err(ctx, status, "%s", msg);
}

const char *kl_last_error(const kl_ctx *ctx)
{
	return ctx ? ctx->err : tl_err;
}

kl_status kl_last_status(const kl_ctx *ctx)
{
	return ctx ? ctx->status : tl_status;
}

void kl_clear_error(kl_ctx *ctx)
{
	if (ctx) {
		ctx->status = KL_OK;
		ctx->err[0] = '\0';
	} else {
		tl_status = KL_OK;
		tl_err[0] = '\0';
	}
}

const char *kl_status_name(kl_status s)
{
	switch (s) {
	case KL_OK:
		return "KL_OK";
	case KL_EINVAL:
		return "KL_EINVAL";
	case KL_ENOMEM:
		return "KL_ENOMEM";
	case KL_EDEVICE:
		return "KL_EDEVICE";
	case KL_EIO:
		return "KL_EIO";
	case KL_EFORMAT:
		return "KL_EFORMAT";
	case KL_EUNSUPPORTED:
		return "KL_EUNSUPPORTED";
	case KL_ECOMPILE:
		return "KL_ECOMPILE";
	case KL_ESTATE:
		return "KL_ESTATE";
	}
	return "KL_E?";
}

const char *kl_version(void)
{
	return KL_VERSION_STRING;
}

/* Frees every tensor still alive, so a context is a memory arena as well:
 * every storage is referenced only by tensors of its context, so dropping
 * each tensor's storage reference frees all storage too. */
void kl__ctx_free_tensors(kl_ctx *ctx)
{
	kl_tensor *t = ctx->live;
	while (t) {
		kl_tensor *next = t->next;
		if (t->st && --t->st->refs == 0) {
			ctx->be->free(ctx, t->st->data);
			free(t->st);
		}
		free(t);
		t = next;
	}
	ctx->live = NULL;
	for (int i = 0; i < ctx->nscopes; i++)
		free(ctx->scopes[i].items);
	free(ctx->scopes);
	ctx->scopes = NULL;
	ctx->nscopes = ctx->cap_scopes = 0;
}

kl_device kl_ctx_device(const kl_ctx *ctx)
{
	return ctx ? ctx->device : KL_CPU;
}

int kl_ctx_threads(const kl_ctx *ctx)
{
	return ctx && ctx->nthreads > 0 ? ctx->nthreads : 1;
}

kl_status kl_memory_stats(kl_ctx *ctx, kl_memory_usage *out)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_memory_stats: ctx is NULL");
	if (!out)
		return kl__err(ctx, KL_EINVAL, "kl_memory_stats: out is NULL");
	ctx->be->memory(ctx, out, false);
	return KL_OK;
}

kl_status kl_memory_reset_peak(kl_ctx *ctx)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl_memory_reset_peak: ctx is NULL");
	kl_memory_usage u;
	ctx->be->memory(ctx, &u, true);
	return KL_OK;
}

void kl_scope_begin(kl_ctx *ctx)
{
	if (!ctx)
		return;
	if (ctx->nscopes == ctx->cap_scopes) {
		int nc = ctx->cap_scopes ? ctx->cap_scopes * 2 : 8;
		kl_scope *s = realloc(ctx->scopes, (size_t)nc * sizeof *s);
		if (!s) {
			/* not opened: new tensors go to the enclosing scope */
			kl__err(ctx, KL_ENOMEM, "kl_scope_begin: out of memory");
			return;
		}
		ctx->scopes = s;
		ctx->cap_scopes = nc;
	}
	ctx->scopes[ctx->nscopes++] = (kl_scope){0};
}

void kl_scope_end(kl_ctx *ctx)
{
	if (!ctx)
		return;
	if (ctx->nscopes == 0) {
		kl__err(ctx, KL_ESTATE, "kl_scope_end: no scope is open");
		return;
	}
	kl_scope s = ctx->scopes[--ctx->nscopes];
	/* newest first, so views go before their bases (not required, since
	 * storage is counted separately, but it frees memory soonest) */
	for (int i = s.n - 1; i >= 0; i--) {
		s.items[i]->scoped--;
		kl_release(s.items[i]);
	}
	free(s.items);
}
