"""The policy trainers (HF/FSDP, Megatron) and what they share: batches, router replay, logprobs, GRPO loss."""
