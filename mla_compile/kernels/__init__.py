"""GPU kernels (Triton) and the optional FlashInfer adapter. `dispatch` is what the ops' CUDA impls call."""
