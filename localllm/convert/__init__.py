"""Hugging Face checkpoints <-> GGUF: `convert_hf` (a config.json + *.safetensors + tokenizer directory
of the llama, qwen2 or gemma3 family -> a GGUF llama.cpp and localllm load) and its inverse `export_hf`
(a GGUF -> such a directory, used by the tests to make checkpoints from the models we have)."""
