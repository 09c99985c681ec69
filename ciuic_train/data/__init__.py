"""Corpora, their token cache, tokenizers, and the sampler that cuts training windows."""
