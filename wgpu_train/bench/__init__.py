"""Layer 7, measurements for `wgpu-train bench` and `wgpu-train tune`: kernels next to the adapter's FMA peak,
training throughput, Ray scaling."""
