cd build || exit 1
W=softmax,layer_norm,rms_norm,rms_norm_prims
b() { echo "=== $* ==="; env "$@" ./kiln bench --device cuda --workload $W 2>&1 | grep -E "reduce-overhead |default  "; }
b X=default
b KILN_CUDA_WAVES=4 KILN_CUDA_ROW_HOLD=1 KILN_CUDA_ROW_MINBLOCKS=4
b KILN_CUDA_WAVES=12
b KILN_CUDA_WAVES=16
b KILN_CUDA_ROW_MINBLOCKS=6
b X=default2
W=mlp24,decoder_token,decoder_layer
b X=default
b KILN_CUDA_WAVES=4
b X=default2
b KILN_CUDA_WAVES=4
W=attention,attention_causal
b X=default
