"""Commands that read a config or a sweep without training: the memory plan, the ablation report."""
