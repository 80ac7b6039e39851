/* loader.h - the CUDA driver API, NVRTC and cuBLASLt, opened at run time with
 * dlopen so that kiln starts (and runs on the CPU) where none of them exist.
 * Only the toolkit's headers are needed to build; nothing links -lcuda.
 */
#ifndef KILN_CUDA_LOADER_H
#define KILN_CUDA_LOADER_H

#include <cublasLt.h>
#include <cuda.h>
#include <nvrtc.h>

#include "core/core.h"

/* The entry points kiln uses. Each X(fn) names the function as the toolkit's
 * headers spell it; the headers' macros turn it into the versioned symbol the
 * library exports (cuMemAlloc -> cuMemAlloc_v2, cuGraphInstantiate ->
 * cuGraphInstantiateWithFlags, ...), so the pointer type, the member name and
 * the dlsym string all follow the headers and cannot drift apart. Callers
 * write kl__cu.cuMemAlloc(...) and the same macro applies. */
#define KL_CU_DRIVER_FUNCS(X)                          \
	X(cuGetErrorName)                              \
	X(cuGetErrorString)                            \
	X(cuInit)                                      \
	X(cuDriverGetVersion)                          \
	X(cuDeviceGet)                                 \
	X(cuDeviceGetCount)                            \
	X(cuDeviceGetName)                             \
	X(cuDeviceGetAttribute)                        \
	X(cuDeviceTotalMem)                            \
	X(cuDevicePrimaryCtxRetain)                    \
	X(cuDevicePrimaryCtxRelease)                   \
	X(cuCtxSetCurrent)                             \
	X(cuCtxGetCurrent)                             \
	X(cuMemAlloc)                                  \
	X(cuMemFree)                                   \
	X(cuMemGetInfo)                                \
	X(cuMemcpyHtoDAsync)                           \
	X(cuMemcpyDtoHAsync)                           \
	X(cuMemcpyDtoDAsync)                           \
	X(cuMemsetD8Async)                             \
	X(cuStreamCreate)                              \
	X(cuStreamDestroy)                             \
	X(cuStreamSynchronize)                         \
	X(cuStreamBeginCapture)                        \
	X(cuStreamEndCapture)                          \
	X(cuStreamIsCapturing)                         \
	X(cuStreamGetCaptureInfo)                      \
	X(cuEventCreate)                               \
	X(cuEventDestroy)                              \
	X(cuEventRecord)                               \
	X(cuEventSynchronize)                          \
	X(cuEventElapsedTime)                          \
	X(cuModuleLoadData)                            \
	X(cuModuleUnload)                              \
	X(cuModuleGetFunction)                         \
	X(cuFuncSetAttribute)                          \
	X(cuFuncGetAttribute)                          \
	X(cuLaunchKernelEx)                            \
	X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
	X(cuTensorMapEncodeTiled)                      \
	X(cuGraphInstantiate)                          \
	X(cuGraphUpload)                               \
	X(cuGraphLaunch)                               \
	X(cuGraphDestroy)                              \
	X(cuGraphExecDestroy)                          \
	X(cuGraphGetNodes)                             \
	X(cuGraphNodeGetType)                          \
	X(cuGraphKernelNodeGetParams)                  \
	X(cuGraphExecKernelNodeSetParams)              \
	X(cuGraphMemcpyNodeGetParams)                  \
	X(cuGraphExecMemcpyNodeSetParams)

#define KL_NVRTC_FUNCS(X)            \
	X(nvrtcGetErrorString)       \
	X(nvrtcVersion)              \
	X(nvrtcGetNumSupportedArchs) \
	X(nvrtcGetSupportedArchs)    \
	X(nvrtcCreateProgram)        \
	X(nvrtcDestroyProgram)       \
	X(nvrtcCompileProgram)       \
	X(nvrtcGetPTXSize)           \
	X(nvrtcGetPTX)               \
	X(nvrtcGetCUBINSize)         \
	X(nvrtcGetCUBIN)             \
	X(nvrtcGetProgramLogSize)    \
	X(nvrtcGetProgramLog)

#define KL_CUBLASLT_FUNCS(X)                    \
	X(cublasLtCreate)                       \
	X(cublasLtDestroy)                      \
	X(cublasLtGetVersion)                   \
	X(cublasLtGetStatusName)                \
	X(cublasLtGetStatusString)              \
	X(cublasLtMatmul)                       \
	X(cublasLtMatmulDescCreate)             \
	X(cublasLtMatmulDescDestroy)            \
	X(cublasLtMatmulDescSetAttribute)       \
	X(cublasLtMatrixLayoutCreate)           \
	X(cublasLtMatrixLayoutDestroy)          \
	X(cublasLtMatrixLayoutSetAttribute)     \
	X(cublasLtMatmulPreferenceCreate)       \
	X(cublasLtMatmulPreferenceDestroy)      \
	X(cublasLtMatmulPreferenceSetAttribute) \
	X(cublasLtMatmulAlgoGetHeuristic)       \
	X(cublasLtMatmulAlgoCheck)

#define KL_LOADER_FIELD(fn) __typeof__(fn) *fn;

typedef struct kl_cu_driver {
	void *lib;
	int version; /* cuDriverGetVersion: 13000 for CUDA 13.0 */
	KL_CU_DRIVER_FUNCS(KL_LOADER_FIELD)
} kl_cu_driver;

typedef struct kl_nvrtc_api {
	void *lib;
	int major, minor;
	int narchs;
	int archs[64]; /* sm numbers this NVRTC can target, ascending */
	KL_NVRTC_FUNCS(KL_LOADER_FIELD)
} kl_nvrtc_api;

typedef struct kl_cublaslt_api {
	void *lib;
	size_t version; /* cublasLtGetVersion: 130100 for 13.1 */
	KL_CUBLASLT_FUNCS(KL_LOADER_FIELD)
} kl_cublaslt_api;

/* The process-wide tables, valid after the matching load call returned KL_OK. */
extern kl_cu_driver kl__cu;
extern kl_nvrtc_api kl__nvrtc;
extern kl_cublaslt_api kl__lt;

/* Open the library once per process (thread-safe); a later call repeats the
 * first outcome. On failure sets a KL_EDEVICE message on ctx such as
 *   no CUDA driver found (libcuda.so.1: cannot open shared object file ...)
 * The driver loader also runs cuInit(0). */
kl_status kl__cuda_load_driver(kl_ctx *ctx);
kl_status kl__cuda_load_nvrtc(kl_ctx *ctx);
kl_status kl__cuda_load_cublaslt(kl_ctx *ctx);

/* The loaders' core, exposed so tests can point it at names that do not
 * exist: tries names[0..n-1] (a name with a '/' is a path), fills the table
 * behind `lib`/`fns`, or writes the reason into err. `what` is the phrase of
 * the message ("CUDA driver"). Does not touch the process-wide tables. */
typedef struct kl_loader_sym {
	const char *name;
	size_t offset; /* of the function pointer in the table */
} kl_loader_sym;
kl_status kl__loader_open(const char *what, const char *const *names, int nnames,
                          const kl_loader_sym *syms, int nsyms, void *table, void **lib, char *err,
                          size_t errcap);

/* The driver's symbol table (for tests: checked against the toolkit's stub
 * libcuda, which exports every symbol of the real driver). */
extern const kl_loader_sym kl__cuda_driver_syms[];
extern const int kl__cuda_driver_nsyms;

/* The names each loader tries, in order (NULL-terminated); an environment
 * override (KILN_LIBCUDA, KILN_LIBNVRTC, KILN_LIBCUBLASLT: a path) comes first. */
extern const char *const kl__cuda_driver_names[];
extern const char *const kl__nvrtc_names[];
extern const char *const kl__cublaslt_names[];

#endif /* KILN_CUDA_LOADER_H */
