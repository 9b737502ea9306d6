"""Building blocks shared by language models (embeddings)."""
