"""Sample data shared by the tests: FlashInfer ``_metadata`` of an H200 host."""

H200_METADATA = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
    "gpu": "NVIDIA H200",
}
