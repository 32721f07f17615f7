"""Model files in and out: ``gguf`` (GGUF read and dequantise), ``gguf_tokenizer`` (a tokenizer built
from GGUF metadata), ``safetensors`` (Hugging Face weights in and out) and ``load`` (one entry point
that picks the source: the bundled offline model, a local directory or a hub id)."""
