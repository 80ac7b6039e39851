/* tools.h - what the files of the `kiln` command share: the subcommands' entry
 * points and the bench harness's workload table. The command uses the public
 * API (kiln.h) only, like any other program built on libkiln.
 */
#ifndef KILN_TOOLS_H
#define KILN_TOOLS_H

#include <stdbool.h>

#include "kiln.h"
#include "kiln_nn.h"

/* ---- subcommands ---------------------------------------------------------- */

int kt_bench_main(int argc, char **argv);
int kt_explain_main(int argc, char **argv);
/* cmd_export.c */
int kt_export_main(int argc, char **argv);
int kt_package_main(int argc, char **argv);
int kt_run_main(int argc, char **argv);
int kt_inspect_main(int argc, char **argv);

/* ---- bench: modes and workloads ---------------------------------------- */

/* How a workload's body is run. Each mode is a row of the harness's mode
 * table (bench.c); a workload lists the modes it supports as a bit set. The
 * compiled modes hand the body to kl_compile with the kl_mode of their name. */
typedef enum kt_mode {
	KT_MODE_EAGER = 0,
	KT_MODE_DEFAULT,         /* kl_compile, KL_MODE_DEFAULT */
	KT_MODE_REDUCE_OVERHEAD, /* KL_MODE_REDUCE_OVERHEAD: on the CPU, as default */
	KT_MODE_MAX_AUTOTUNE,    /* KL_MODE_MAX_AUTOTUNE: on the CPU, as default */
	KT_MODE_DYNAMIC,         /* default with dims 0 and 1 of input 0 dynamic, the plan
	                          * traced at another size first (issue 23) */
	KT_MODE_COMPILED_FORWARD, /* training rows: the workload's forward (to the loss)
	                           * compiled, then kl_backward and the optimizer's step
	                           * called after it, as torch.compile on the model alone */
	KT_NMODES
} kt_mode;
#define KT_MODE_BIT(m) (1u << (m))

/* What a body reads besides its inputs: a kl_nn module (its structure and
 * weights, as a program holds them), the training rows' optimizer over its
 * parameters, and leaves that require grad (attention_bwd's q, k, v), made
 * by the workload's setup and handed to the body as user, eagerly and to
 * kl_compile (which bakes them in, as examples/decoder_stack.c does; a
 * training step updates them in place). The harness frees it with
 * kt_state_free after the workload's last mode; an untouched (zeroed) state
 * holds nothing, and the body gets NULL. */
#define KT_STACK 4
typedef struct kt_state {
	union {
		kl_nn_module base;
		kl_nn_decoder decoder;
	};
	kl_optim *opt;
	kl_tensor *leaf[3];
	/* decode_step: a stack of layers and each layer's key and value caches */
	kl_nn_decoder stack[KT_STACK];
	kl_tensor *cache[2 * KT_STACK];
	int nstack;
} kt_state;

/* The body's user for a run whose state is state: state, or NULL when the
 * setup made nothing there. */
void *kt_state_user(kt_state *state);
/* Release what state holds and zero it. */
void kt_state_free(kt_state *state);

/* The work one call of a workload does. bytes is the least traffic any
 * implementation needs (each input read once, each output written once), so
 * GB/s compares modes fairly and shows how far a mode is from the memory
 * roofline; flops counts multiply-adds as two. */
typedef struct kt_cost {
	double bytes;
	double flops;
	bool memory_bound; /* report GB/s; otherwise TFLOP/s */
	char shape[48];    /* the sizes, as the peers print them: "4096x4096" */
	/* In: where the setup may make the workload's module; NULL where the
	 * harness keeps none (a setup that needs one then fails, saying so). */
	kt_state *state;
} kt_cost;

#define KT_MAX_INPUTS 64

/* Devices a table row runs on. */
#define KT_ON_CPU (1u << KL_CPU)
#define KT_ON_CUDA (1u << KL_CUDA)

typedef struct kt_workload kt_workload;
struct kt_workload {
	const char *name; /* rows of one name on one device differ in size */
	const char *what; /* one line for --list */
	unsigned devices; /* KT_ON_* */
	unsigned modes;   /* KT_MODE_BIT per supported mode */
	kl_dtype dtype;
	int64_t dims[5]; /* the sizes; what each means is the setup's business */
	int nin, nout;
	/* Make the inputs (from kl_randn, never zeros) of w's dtype and sizes and
	 * state the cost of one call. in[] receives nin references the harness
	 * releases. */
	kl_status (*setup)(kl_ctx *ctx, const kt_workload *w, kl_tensor **in, kt_cost *cost);
	/* One call. Written as a kl_fn_body so that compiled modes can hand it to
	 * kl_compile unchanged; eager mode runs it inside a scope, which frees
	 * its intermediates and outputs. */
	kl_fn_body body;
	/* Training rows (KT_MODE_COMPILED_FORWARD): body's forward alone, to the
	 * loss (out[0]); the harness compiles it, then calls kl_backward on the
	 * loss, kl_optim_step on the state's optimizer and clears the module's
	 * gradients. NULL elsewhere. */
	kl_fn_body forward;
};

extern const kt_workload kt_workloads[];
extern const int kt_nworkloads;
/* The CUDA bandwidth row: a compiled copy of a 1 GiB tensor (the device's
 * streaming ceiling as kiln's own kernels reach it). */
extern const kt_workload kt_copy_workload;

#endif /* KILN_TOOLS_H */
