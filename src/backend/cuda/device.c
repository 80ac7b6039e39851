/* device.c - one CUDA device on its primary context: properties, the stream,
 * the caching allocator's raw side (cuMemAlloc/cuMemFree), copies, events,
 * and the error path that turns CUresult codes into kl__err messages.
 */
#include "backend/cuda/device.h"

#include <stdio.h>
#include <stdlib.h>

/* "src/backend/cuda/device.c" out of whatever absolute path the build used */
static const char *short_file(const char *file)
{
	const char *s = strstr(file, "src/");
	return s ? s : file;
}

kl_status kl__cu_check(kl_ctx *ctx, CUresult r, const char *call, const char *file, int line)
{
	if (r == CUDA_SUCCESS)
		return KL_OK;
	const char *name = NULL, *str = NULL;
	if (kl__cu.cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
		name = "unknown CUDA error";
	if (kl__cu.cuGetErrorString(r, &str) != CUDA_SUCCESS || !str)
		str = "no description";
	return kl__err(ctx, r == CUDA_ERROR_OUT_OF_MEMORY ? KL_ENOMEM : KL_EDEVICE,
	               "kl_cuda: %s failed: %s (%d: %s) at %s:%d", call, name, (int)r, str,
	               short_file(file), line);
}

kl_status kl__cuda_device_count(kl_ctx *ctx, int *n)
{
	*n = 0;
	kl_status s = kl__cuda_load_driver(ctx);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuDeviceGetCount, n);
	return KL_OK;
}

kl_status kl__cuda_bind(kl_ctx *ctx, kl_cuda_dev *d)
{
	CUcontext cur = NULL;
	if (kl__cu.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == d->cu)
		return KL_OK;
	KL_CU_TRY(ctx, cuCtxSetCurrent, d->cu);
	return KL_OK;
}

/* ---- the allocator's raw side ------------------------------------------------------ */

static kl_status raw_alloc(kl_ctx *ctx, void *user, size_t nbytes, uint64_t *out)
{
	kl_cuda_dev *d = user;
	if (d->capturing)
		return kl__err(
		        ctx, KL_ESTATE,
		        "kl_cuda: %zu bytes requested during CUDA graph capture and no cached "
		        "block fits; run the captured region once before capturing it",
		        nbytes);
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	CUdeviceptr p = 0;
	double t0 = kl__now_ms();
	CUresult r = kl__cu.cuMemAlloc(&p, nbytes);
	/* the pool grows only while a program finds its working set */
	kl__log(d->ctx, KL_LOG_STARTUP, "cuMemAlloc %zu bytes: %.3f ms%s", nbytes,
	        kl__now_ms() - t0, r == CUDA_SUCCESS ? "" : " (failed)");
	if (r == CUDA_ERROR_OUT_OF_MEMORY)
		return KL_ENOMEM; /* the pool frees its cache and retries */
	s = kl__cu_check(ctx, r, "cuMemAlloc", __FILE__, __LINE__);
	if (s != KL_OK)
		return s;
	*out = (uint64_t)p;
	return KL_OK;
}

static void raw_free(void *user, uint64_t p)
{
	kl_cuda_dev *d = user;
	/* Nothing to report to: a failing cuMemFree means the context is gone. */
	if (kl__cuda_bind(NULL, d) == KL_OK)
		kl__cu.cuMemFree((CUdeviceptr)p);
}

kl_status kl__cuda_malloc(kl_ctx *ctx, kl_cuda_dev *d, size_t nbytes, CUdeviceptr *out)
{
	uint64_t p = 0;
	kl_status s = kl__pool_alloc(ctx, &d->pool, nbytes, &p);
	*out = (CUdeviceptr)p;
	return s;
}

kl_status kl__cuda_free(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr p)
{
	if (!p)
		return KL_OK;
	return kl__pool_free(ctx, &d->pool, (uint64_t)p);
}

/* ---- open / close -------------------------------------------------------------------- */

static kl_status read_props(kl_ctx *ctx, kl_cuda_dev *d)
{
	static const struct {
		CUdevice_attribute attr;
		size_t off;
	} props[] = {
	        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, offsetof(kl_cuda_dev, cc_major)},
	        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, offsetof(kl_cuda_dev, cc_minor)},
	        {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, offsetof(kl_cuda_dev, sm_count)},
	        {CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, offsetof(kl_cuda_dev, l2_bytes)},
	        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
	         offsetof(kl_cuda_dev, smem_per_block)},
	        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
	         offsetof(kl_cuda_dev, smem_per_block_optin)},
	        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
	         offsetof(kl_cuda_dev, smem_per_sm)},
	        {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK,
	         offsetof(kl_cuda_dev, regs_per_block)},
	        {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
	         offsetof(kl_cuda_dev, max_threads_per_block)},
	        {CU_DEVICE_ATTRIBUTE_WARP_SIZE, offsetof(kl_cuda_dev, warp_size)},
	};
	for (size_t i = 0; i < sizeof props / sizeof props[0]; i++) {
		int v = 0;
		KL_CU_TRY(ctx, cuDeviceGetAttribute, &v, props[i].attr, d->dev);
		memcpy((char *)d + props[i].off, &v, sizeof v);
	}
	KL_CU_TRY(ctx, cuDeviceGetName, d->name, (int)sizeof d->name, d->dev);
	KL_CU_TRY(ctx, cuDeviceTotalMem, &d->total_mem, d->dev);
	return KL_OK;
}

kl_status kl__cuda_dev_open(kl_ctx *ctx, int index, kl_cuda_dev **out)
{
	*out = NULL;
	int n = 0;
	kl_status s = kl__cuda_device_count(ctx, &n);
	if (s != KL_OK)
		return s;
	if (n == 0)
		return kl__err(ctx, KL_EDEVICE, "no CUDA device found (the driver reports none)");
	if (index < 0 || index >= n)
		return kl__err(ctx, KL_EDEVICE,
		               "CUDA device %d does not exist (%d device%s: 0..%d)", index, n,
		               n == 1 ? "" : "s", n - 1);
	kl_cuda_dev *d = calloc(1, sizeof *d);
	if (!d)
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory");
	d->ctx = ctx;
	d->index = index;
	kl__pool_init(&d->pool, raw_alloc, raw_free, d);
	double t0 = kl__now_ms(), t1, t2, t3;
	if ((s = KL_CU(ctx, cuDeviceGet, &d->dev, index)) != KL_OK)
		goto fail_free;
	if ((s = KL_CU(ctx, cuDevicePrimaryCtxRetain, &d->cu, d->dev)) != KL_OK)
		goto fail_free;
	if ((s = KL_CU(ctx, cuCtxSetCurrent, d->cu)) != KL_OK)
		goto fail_release;
	t1 = kl__now_ms();
	if ((s = read_props(ctx, d)) != KL_OK)
		goto fail_release;
	t2 = kl__now_ms();
	if ((s = KL_CU(ctx, cuStreamCreate, &d->stream, CU_STREAM_NON_BLOCKING)) != KL_OK)
		goto fail_release;
	t3 = kl__now_ms();
	const char *e = getenv("KILN_CUDA_PDL");
	d->pdl = d->cc_major >= 9 && !(e && strcmp(e, "0") == 0);
	kl__log(ctx, KL_LOG_STARTUP,
	        "CUDA device %d (%s, sm_%d%d): primary context %.3f ms, properties %.3f ms, "
	        "stream %.3f ms; programmatic dependent launch %s",
	        index, d->name, d->cc_major, d->cc_minor, t1 - t0, t2 - t1, t3 - t2,
	        d->pdl ? "on" : "off");
	*out = d;
	return KL_OK;
fail_release:
	kl__cu.cuDevicePrimaryCtxRelease(d->dev);
fail_free:
	free(d);
	return s;
}

void kl__cuda_dev_close(kl_cuda_dev *d)
{
	if (!d)
		return;
	if (kl__cuda_bind(NULL, d) == KL_OK) {
		if (d->capturing) {
			CUgraph g = NULL;
			if (kl__cu.cuStreamEndCapture(d->stream, &g) == CUDA_SUCCESS && g)
				kl__cu.cuGraphDestroy(g);
		}
		kl__cu.cuStreamSynchronize(d->stream);
	}
	kl__lt_release(d);
	kl__cuda_attention_release(d);
	kl__cuda_optim_release(d);
	kl__cuda_cache_write_release(d);
	kl__cuda_gemv_release(d);
	kl__cuda_pkgmod_release(d);
	kl__pool_fini(&d->pool);
	if (d->stream)
		kl__cu.cuStreamDestroy(d->stream);
	kl__cu.cuDevicePrimaryCtxRelease(d->dev);
	free(d);
}

/* ---- copies ------------------------------------------------------------------------- */

/* Waits for the stream; the startup log times the device's first wait (what
 * the work queued so far, the first call's included, took to finish). */
static kl_status stream_sync(kl_ctx *ctx, kl_cuda_dev *d, const char *why)
{
	double t0 = kl__now_ms();
	KL_CU_TRY(ctx, cuStreamSynchronize, d->stream);
	if (!d->synced) {
		d->synced = true;
		kl__log(ctx ? ctx : d->ctx, KL_LOG_STARTUP,
		        "first stream synchronize (%s): %.3f ms", why, kl__now_ms() - t0);
	}
	return KL_OK;
}

kl_status kl__cuda_h2d(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, const void *src, size_t n)
{
	if (!n)
		return KL_OK;
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuMemcpyHtoDAsync, dst, src, n, d->stream);
	return KL_OK;
}

kl_status kl__cuda_d2h(kl_ctx *ctx, kl_cuda_dev *d, void *dst, CUdeviceptr src, size_t n)
{
	if (!n)
		return KL_OK;
	if (d->capturing)
		return kl__err(ctx, KL_ESTATE,
		               "kl_cuda: a copy to the host cannot be part of a "
		               "CUDA graph capture (it must wait for the device)");
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuMemcpyDtoHAsync, dst, src, n, d->stream);
	return stream_sync(ctx, d, "copy to the host");
}

kl_status kl__cuda_d2d(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	if (!n)
		return KL_OK;
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuMemcpyDtoDAsync, dst, src, n, d->stream);
	return KL_OK;
}

kl_status kl__cuda_memset(kl_ctx *ctx, kl_cuda_dev *d, CUdeviceptr dst, unsigned char v, size_t n)
{
	if (!n)
		return KL_OK;
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuMemsetD8Async, dst, v, n, d->stream);
	return KL_OK;
}

kl_status kl__cuda_sync(kl_ctx *ctx, kl_cuda_dev *d)
{
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	return stream_sync(ctx, d, "synchronize");
}

kl_status kl__cuda_mem_info(kl_ctx *ctx, kl_cuda_dev *d, size_t *free_bytes, size_t *total)
{
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuMemGetInfo, free_bytes, total);
	return KL_OK;
}

/* ---- events ------------------------------------------------------------------------- */

kl_status kl__cuda_event_new(kl_ctx *ctx, kl_cuda_dev *d, CUevent *ev)
{
	kl_status s = kl__cuda_bind(ctx, d);
	if (s != KL_OK)
		return s;
	KL_CU_TRY(ctx, cuEventCreate, ev, CU_EVENT_DEFAULT);
	return KL_OK;
}

kl_status kl__cuda_event_record(kl_ctx *ctx, kl_cuda_dev *d, CUevent ev)
{
	KL_CU_TRY(ctx, cuEventRecord, ev, d->stream);
	return KL_OK;
}

kl_status kl__cuda_event_ms(kl_ctx *ctx, CUevent start, CUevent end, float *ms)
{
	KL_CU_TRY(ctx, cuEventSynchronize, end);
	KL_CU_TRY(ctx, cuEventElapsedTime, ms, start, end);
	return KL_OK;
}

void kl__cuda_event_free(kl_cuda_dev *d, CUevent ev)
{
	if (ev && kl__cuda_bind(NULL, d) == KL_OK)
		kl__cu.cuEventDestroy(ev);
}
