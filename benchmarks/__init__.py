"""kvpatch's benchmarks, run from the repository root as ``python -m benchmarks.NAME``
(``benchmarks/gpu_check.sh`` runs the GPU check). They share a random model and the step
interleaving through :mod:`benchmarks.bench_cache`."""
