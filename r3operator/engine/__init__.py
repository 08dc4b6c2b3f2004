"""Code that runs inside a vLLM process: the plugin vLLM loads, the worker extension that takes weights, LLM kwargs."""
