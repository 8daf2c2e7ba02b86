"""GPU kernels (Triton, Gluon on sm_90) and the optional FlashMLA / FlashInfer adapters. `dispatch` is what the ops'
CUDA impls call; `dispatch.select_decode_kernel` decides which decode kernel runs. Kernels import nothing above
them (no ops, no passes): tools/import_graph.py checks it."""
