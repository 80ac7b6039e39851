// probe.h - what the stand-alone probes under bench/probes share: a CUDA
// runtime call that fails ends the probe with the call and the error.
#ifndef KILN_PROBE_H
#define KILN_PROBE_H
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                          \
	do {                                                                              \
		cudaError_t e_ = (x);                                                     \
		if (e_ != cudaSuccess) {                                                  \
			fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,        \
			        cudaGetErrorString(e_));                                  \
			exit(1);                                                          \
		}                                                                         \
	} while (0)

#endif
