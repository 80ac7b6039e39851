/* kiln_nn.h - neural-network modules on kiln's public API (kl_nn).
 *
 * The modules of the seed chapter, written only with kiln.h's ops, as a user
 * would: Linear, RMSNorm, LayerNorm, Embedding, MultiheadAttention (batch
 * first, one fused in-projection), the SwiGLU FeedForward and the pre-norm
 * DecoderLayer. Their parameters carry PyTorch's state-dict names, so the
 * weights of the same torch modules saved as safetensors load into them.
 *
 * Modules. Each is a plain struct whose first member is a kl_nn_module
 * header; the caller owns the struct (stack or heap), the module owns its
 * parameter tensors (one reference each, in no scope). A module is used
 * through its header by the generic calls: kl_nn_load(&m.base, st, prefix),
 * kl_nn_save, kl_nn_params, kl_nn_free(&m.base).
 *   - kl_nn_*_init(m, ctx, ..., dtype, seed) sets m up with PyTorch's default
 *     initialization (same bounds and distributions, numbers from kl_rand /
 *     kl_randn keyed by seed; not torch's numbers). On failure it returns
 *     the status, leaves the error in kl_last_error(ctx) and frees whatever
 *     it made (kl_nn_free on the module is still safe).
 *   - Forward calls return a tensor like any kiln op: outside a scope the
 *     caller owns one reference, inside one the scope does; intermediates
 *     are released inside. NULL and an error on failure. They only call
 *     kiln ops, so they run eagerly and inside kl_compile alike.
 *
 * Attention. kl_nn_mha_forward computes, with q, k, v of shape [B, H, T, Dh]
 * (the in-projection's output reshaped and permuted),
 *     o = kl_sdpa(q, k, v, causal, 1 / sqrt(Dh));
 * one fused attention op (its causal mask a flag, so T may be a dynamic dim
 * of a compiled function; its gradient is the attention op's own rule);
 * then o is permuted back to [B, T, H * Dh] and goes through out_proj.
 */
#ifndef KILN_NN_H
#define KILN_NN_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kl_nn_kind {
	KL_NN_LINEAR = 1,
	KL_NN_RMSNORM,
	KL_NN_LAYERNORM,
	KL_NN_EMBEDDING,
	KL_NN_MHA,
	KL_NN_FFN,
	KL_NN_DECODER
} kl_nn_kind;

/* The header every module starts with. */
typedef struct kl_nn_module {
	kl_nn_kind kind;
	kl_ctx *ctx;
	kl_dtype dtype; /* of the parameters */
	bool training;  /* kl_nn_train; false (eval) after init */
} kl_nn_module;

/* One named parameter: the slot in its module that holds the tensor, and
 * the shape it must have. */
#define KL_NN_NAME_MAX 128
typedef struct kl_nn_param {
	char name[KL_NN_NAME_MAX]; /* PyTorch's state-dict key, without the prefix */
	kl_tensor **slot;
	int ndim;
	int64_t shape[2];
} kl_nn_param;

/* ---- the modules ------------------------------------------------------------ */

/* torch.nn.Linear: y = x @ weight^T + bias. weight [out, in], bias [out] or
 * NULL. Init: weight and bias uniform in +-1/sqrt(in) (kaiming-uniform with
 * a = sqrt(5), torch's default). Parameters "weight", "bias". */
typedef struct kl_nn_linear {
	kl_nn_module base;
	int64_t in_features, out_features;
	kl_tensor *weight, *bias;
} kl_nn_linear;
kl_status kl_nn_linear_init(kl_nn_linear *m, kl_ctx *ctx, int64_t in_features,
                            int64_t out_features, bool bias, kl_dtype dt, uint64_t seed);
kl_tensor *kl_nn_linear_forward(const kl_nn_linear *m, kl_tensor *x);

/* torch.nn.RMSNorm over the last dim: weight [dim], ones at init. eps < 0
 * means torch's eps=None: the machine epsilon of the input's dtype
 * (f32 2^-23, bf16 2^-7, f16 2^-10, f64 2^-52). Parameter "weight". */
typedef struct kl_nn_rmsnorm {
	kl_nn_module base;
	int64_t dim;
	double eps;
	kl_tensor *weight;
} kl_nn_rmsnorm;
kl_status kl_nn_rmsnorm_init(kl_nn_rmsnorm *m, kl_ctx *ctx, int64_t dim, double eps,
                             kl_dtype dt);
kl_tensor *kl_nn_rmsnorm_forward(const kl_nn_rmsnorm *m, kl_tensor *x);

/* torch.nn.LayerNorm over the last dim: weight ones, bias zeros (or no bias
 * with bias == false). Parameters "weight", "bias". */
typedef struct kl_nn_layernorm {
	kl_nn_module base;
	int64_t dim;
	double eps;
	kl_tensor *weight, *bias;
} kl_nn_layernorm;
kl_status kl_nn_layernorm_init(kl_nn_layernorm *m, kl_ctx *ctx, int64_t dim, double eps,
                               bool bias, kl_dtype dt);
kl_tensor *kl_nn_layernorm_forward(const kl_nn_layernorm *m, kl_tensor *x);

/* torch.nn.Embedding: weight [num, dim] standard normal at init; forward
 * takes i32/i64 indices of any shape (kl_embedding). Parameter "weight". */
typedef struct kl_nn_embedding {
	kl_nn_module base;
	int64_t num, dim;
	kl_tensor *weight;
} kl_nn_embedding;
kl_status kl_nn_embedding_init(kl_nn_embedding *m, kl_ctx *ctx, int64_t num, int64_t dim,
                               kl_dtype dt, uint64_t seed);
kl_tensor *kl_nn_embedding_forward(const kl_nn_embedding *m, kl_tensor *idx);

/* torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True) with its
 * defaults (bias, no add_bias_kv, kdim = vdim = d_model, no dropout in
 * eval). Parameters "in_proj_weight" [3d, d], "in_proj_bias" [3d],
 * "out_proj.weight" [d, d], "out_proj.bias" [d]. Init as torch: in_proj
 * xavier-uniform, out_proj.weight uniform +-1/sqrt(d), biases zero. */
typedef struct kl_nn_mha {
	kl_nn_module base;
	int64_t d_model, n_heads;
	kl_tensor *in_proj_weight, *in_proj_bias;
	kl_nn_linear out_proj;
} kl_nn_mha;
kl_status kl_nn_mha_init(kl_nn_mha *m, kl_ctx *ctx, int64_t d_model, int64_t n_heads,
                         kl_dtype dt, uint64_t seed);
/* query [B, T, d], key and value [B, S, d] -> [B, T, d] (torch's attn
 * output, need_weights=False). When query == key == value (the same
 * tensor) the in-projection is one product with in_proj_weight; otherwise
 * three with its row blocks. causal: position i attends to j <= i (torch's
 * attn_mask = triu(-inf, 1), T == S required). */
kl_tensor *kl_nn_mha_forward(const kl_nn_mha *m, kl_tensor *query, kl_tensor *key,
                             kl_tensor *value, bool causal);
/* One decode step of self-attention over a KV cache: x [B, 1, d] (one new
 * token a row); k_cache and v_cache [R, H, T, d/H] (R >= B, dense, the
 * module's dtype) hold every row's earlier keys and values. The token's key
 * and value are written in place at pos[b] of row b (kl_cache_write, pos
 * [B] KL_I64), then the token attends over the first lengths[b] positions
 * of its row (kl_sdpa_lengths, lengths [B] KL_I64, normally pos + 1): rows
 * B..R-1 are neither read nor written. Written for kl_compile with the
 * caches as state: a step neither copies the caches nor changes shape. */
kl_tensor *kl_nn_mha_decode(const kl_nn_mha *m, kl_tensor *x, kl_tensor *k_cache,
                            kl_tensor *v_cache, kl_tensor *pos, kl_tensor *lengths);

/* The seed's SwiGLU FeedForward: down_proj(silu(gate_proj(x)) * up_proj(x)),
 * three Linears without bias. Parameters "gate_proj.weight" [ffn, d],
 * "up_proj.weight" [ffn, d], "down_proj.weight" [d, ffn]. The gate and up
 * weights are the two row halves of one [2 * ffn, d] buffer, gate_up (their
 * parameter tensors are views of it; kl_nn_load writes each key into its
 * half), and the forward slices that buffer, so that a compiled forward
 * computes both projections as one product (no copy). */
typedef struct kl_nn_ffn {
	kl_nn_module base;
	kl_nn_linear gate_proj, up_proj, down_proj;
	kl_tensor *gate_up; /* [2 * ffn, d]: gate_proj.weight, then up_proj.weight */
} kl_nn_ffn;
kl_status kl_nn_ffn_init(kl_nn_ffn *m, kl_ctx *ctx, int64_t d_model, int64_t ffn_dim,
                         kl_dtype dt, uint64_t seed);
kl_tensor *kl_nn_ffn_forward(const kl_nn_ffn *m, kl_tensor *x);

/* The seed's pre-norm DecoderLayer:
 *     h = attn(norm1(x)); x = x + h; x = x + ffn(norm2(x))
 * norm1/norm2 are RMSNorm(d_model) with torch's default eps (eps < 0 above).
 * Parameters "norm1.weight", "norm2.weight", "attn.in_proj_weight",
 * "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
 * "ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight". */
typedef struct kl_nn_decoder {
	kl_nn_module base;
	kl_nn_rmsnorm norm1, norm2;
	kl_nn_mha attn;
	kl_nn_ffn ffn;
} kl_nn_decoder;
kl_status kl_nn_decoder_init(kl_nn_decoder *m, kl_ctx *ctx, int64_t d_model, int64_t n_heads,
                             int64_t ffn_dim, kl_dtype dt, uint64_t seed);
/* x [B, T, d_model] -> [B, T, d_model]; causal as in kl_nn_mha_forward. */
kl_tensor *kl_nn_decoder_forward(const kl_nn_decoder *m, kl_tensor *x, bool causal);
/* The layer on one new token a row, attention through kl_nn_mha_decode
 * over the layer's caches (same arguments): x [B, 1, d] -> [B, 1, d]. */
kl_tensor *kl_nn_decoder_decode(const kl_nn_decoder *m, kl_tensor *x, kl_tensor *k_cache,
                                kl_tensor *v_cache, kl_tensor *pos, kl_tensor *lengths);

/* ---- every module ----------------------------------------------------------- */

/* The module's parameters in state-dict order (torch's named_parameters),
 * up to cap of them; returns how many it has (more than cap: only cap were
 * written), or -1 for a module that is not initialized. */
int kl_nn_params(kl_nn_module *m, kl_nn_param *out, int cap);
/* Mark (or unmark) the tensors the module's forward reads as leaves that
 * require gradients (kl_set_requires_grad): every parameter, except that a
 * FeedForward's gate and up weights are marked through the gate_up buffer
 * they are views of (the forward slices it). kl_optim_step over a module's
 * optimizer (kl_nn_adamw) gives each view its rows of gate_up's gradient. */
kl_status kl_nn_requires_grad(kl_nn_module *m, bool on);
/* Clear the gradients of those tensors (set to none, torch's
 * zero_grad(set_to_none=True)). */
void kl_nn_grad_clear(kl_nn_module *m);

/* Load every parameter from st under prefix + name (prefix may be "" or
 * NULL; "layers.0." for a stack). Like torch's load_state_dict (strict):
 * a missing key, a shape that differs or a non-float tensor is an error
 * naming the key, the shapes and dtypes, and nothing is changed; float
 * data of another float dtype is cast to the module's dtype (torch's
 * copy_). Keys of st that the module does not use are ignored. The values
 * are written into the existing parameter tensors (kl_copy), as torch
 * copies into its parameters: an optimizer built over them stays valid. */
kl_status kl_nn_load(kl_nn_module *m, kl_safetensors *st, const char *prefix);

/* Write the module's parameters as a safetensors file (state-dict names
 * with prefix), which torch's safetensors.torch.load_file reads. */
kl_status kl_nn_save(kl_nn_module *m, const char *path, const char *prefix);

/* torch's module.train(on) / module.eval(): sets the training flag of m and
 * every submodule. Training mode is what turns dropout on in a module that
 * has it; none of these modules does today (MultiheadAttention's dropout is
 * torch's default 0), so the flag changes no forward yet: it is the switch
 * a module with dropout reads (kl_dropout(x, p, seed, step, training)). */
kl_status kl_nn_train(kl_nn_module *m, bool on);
bool kl_nn_is_training(const kl_nn_module *m);

/* An optimizer over every parameter of m (kl_nn_params' order), its state
 * named by the parameters' state-dict keys with prefix in front (prefix may
 * be NULL): torch's AdamW(model.parameters()) and SGD. opts NULL: torch's
 * defaults. */
kl_optim *kl_nn_adamw(kl_nn_module *m, const char *prefix, const kl_adamw_opts *opts);
kl_optim *kl_nn_sgd(kl_nn_module *m, const char *prefix, const kl_sgd_opts *opts);

/* Release the module's tensors; the struct may then be initialized again.
 * Safe on a zeroed or already freed module. */
void kl_nn_free(kl_nn_module *m);

#ifdef __cplusplus
}
#endif
#endif /* KILN_NN_H */
