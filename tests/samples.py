"""Sample data shared by the tests: FlashInfer ``_metadata`` of an H200 host.

``H200_METADATA`` is what FlashInfer 0.7.2.post1 writes; ``SHORT_H200_METADATA``
is the shorter form most registry, CLI, merge and crash tests use (their
expected digests and outputs depend on it, so it stays as it is).
"""

H200_METADATA = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
    "gpu": "NVIDIA H200",
}


SHORT_H200_METADATA = {
    "flashinfer_version": "0.7.2",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "4.8.1",
    "gpu": "NVIDIA H200",
}


#: The keys ``import --format json`` adds for an import whose inputs share no key.
NO_DUPLICATES = {
    "dry_run": False,
    "on_conflict": "keep",
    "duplicates": 0,
    "conflicts": 0,
    "records_duplicates": 0,
    "records_conflicts": 0,
    "conflicting": [],
    "conflicting_records": [],
}
