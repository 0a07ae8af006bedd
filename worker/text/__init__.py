"""Text in and out: the tokenizer, chat templates, the incremental detokenizer and the
OutputProcessor (stop checks, finishing, deltas)."""
