"""Hugging Face Llama checkpoints in and out: llama_hf.py (a config.json's trainer flags, the
weights in Megatron-Core's terms), convert_hf_llama.py (the import and export commands)."""
