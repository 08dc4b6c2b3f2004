"""One module per pinned vLLM version: the option strings of its `vllm serve` parser
(scripts/gen-vllm-cli-table.py writes them from vLLM itself)."""
