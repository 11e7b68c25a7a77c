"""What the CUDA-only kernels share: float conversions for the activation dtypes (prepended to
each kernel's header; each kernel is its own compilation unit, so nothing clashes), and the
backend check.
"""


def cuda_backend() -> str | None:
    """'cuda' where the default device runs MLX's CUDA backend, else None (the kernels that
    exist only for CUDA: `qmv_rows`, `sdpa_small_q`, `sdpa_vector_rows`)."""
    from dspark_flow.kernels.qmm_small_m import kernel_backend

    return "cuda" if kernel_backend() == "cuda" else None


# to_f: any activation type to float; from_f<U>: float back to the output type.
CUDA_FLOAT_CONVERSIONS = r"""
__device__ __forceinline__ float df_to_f(float v) { return v; }
__device__ __forceinline__ float df_to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float df_to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename U> __device__ __forceinline__ U df_from_f(float v);
template <> __device__ __forceinline__ float df_from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half df_from_f<__half>(float v) {
  return __float2half(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 df_from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
"""
