"""Text in, token windows out: corpus readers, tokenizers, packed datasets and the DP-aware loader."""
