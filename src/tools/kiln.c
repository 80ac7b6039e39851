/* kiln.c - the `kiln` command: version, help, and dispatch to subcommands
 * (each in its own file under src/tools/).
 */
#include <stdio.h>
#include <string.h>

#include "tools.h"

typedef struct kt_command {
	const char *name;
	const char *what;
	int (*main)(int argc, char **argv);
} kt_command;

static const kt_command commands[] = {
	{"bench", "time the benchmark workloads (kiln bench --help)", kt_bench_main},
	{"explain", "compile example programs and explain them (kiln explain --help)",
	 kt_explain_main},
	{"export", "export a bench workload and print its program (kiln export --help)",
	 kt_export_main},
	{"package", "export a bench workload as an AOT package (kiln package --help)",
	 kt_package_main},
	{"run", "run a package: kiln run PACKAGE --input x.safetensors --output y.safetensors",
	 kt_run_main},
	{"inspect", "print a package's manifest, kernels, sizes and target", kt_inspect_main},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: kiln [--version] [--help] <command> [args]\n\ncommands:\n");
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		fprintf(f, "  %-8s %s\n", commands[i].name, commands[i].what);
	fprintf(f,
	        "\nenvironment:\n"
	        "  KILN_CACHE_DIR  the kernel cache (default $XDG_CACHE_HOME/kiln)\n"
	        "  KILN_LOGS       comma-separated log categories: graph_breaks, recompiles,\n"
	        "                  fusion, output_code, cache, cudagraphs, autotune, graph,\n"
	        "                  startup, all\n");
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		return 2;
	}
	const char *cmd = argv[1];
	if (!strcmp(cmd, "--version") || !strcmp(cmd, "-V")) {
		printf("kiln %s\n", kl_version());
		return 0;
	}
	if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
		usage(stdout);
		return 0;
	}
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		if (!strcmp(cmd, commands[i].name))
			return commands[i].main(argc - 1, argv + 1);
	fprintf(stderr, "kiln: unknown command '%s'\n\n", cmd);
	usage(stderr);
	return 2;
}
