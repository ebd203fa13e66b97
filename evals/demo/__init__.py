"""The bundled demo MoE model: procedural financial-agent corpus, tokenizer and training."""
