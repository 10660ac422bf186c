"""Stoker's inference engine: loader, model, kernels, paged KV cache, scheduler, sampler, tokenizer.

No I/O beyond reading the model folder. Importing this package is cheap: torch is imported only by the
modules that need it (the scheduler and block manager are pure Python).
"""
