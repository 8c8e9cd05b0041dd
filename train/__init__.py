"""Scripts that build the model zoo: corpus, tokenizer, held-out prompts, training (see train/README.md)."""
