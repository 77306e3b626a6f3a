"""Data: the embedded corpus, tokenizers, the token cache (prepare) and batches (loader)."""
