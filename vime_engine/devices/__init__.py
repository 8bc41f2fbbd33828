"""The device a run uses and the process's memory: `accelerator` (cpu / cuda / npu chosen once, its environment
and preparation, each process's share of the CPU cores), `megatron_on_cpu` (megatron-core's CUDA calls on
a CPU-only machine) and `host_memory` (freed heap handed back to the OS).
Both the trainer (train/) and the runtime import them; they import nothing of the engine."""
