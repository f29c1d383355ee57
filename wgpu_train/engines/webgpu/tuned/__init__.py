"""The tuned kernel families (GEMM, quantised GEMM, attention, cached attention), their candidates and the autotuner
that picks among them per adapter."""
