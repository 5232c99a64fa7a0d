"""Text in and out: the GGUF tokenizer, chat templates, the incremental detokenizer and stop strings."""
