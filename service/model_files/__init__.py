"""Model files on disk: resolve a model argument to a Hugging Face directory the worker can
load, fetching the default model and converting GGUF files once into the cache."""
