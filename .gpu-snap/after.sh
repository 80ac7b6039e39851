cd build || exit 1
b() { echo "=== $* ==="; env "$@" ./kiln bench --device cuda --workload $W 2>&1 | grep -E "reduce-overhead |default  "; }
W=softmax,layer_norm,rms_norm,rms_norm_prims,mlp24,decoder_token
b KILN_CUDA_WAVES=8
b X=default
