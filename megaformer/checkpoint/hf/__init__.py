"""Hugging Face conversion: adapters for LlamaForCausalLM, GPT2LMHeadModel, GPTNeoXForCausalLM
(``llama``, ``gpt2``, ``gpt_neox``), a streaming safetensors reader/writer (``stream``), tokenizer
files (``tokenizer_files``) and the two directions (``convert``)."""
