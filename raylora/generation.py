"""Greedy answers of a loaded model with Hugging Face ``generate``, one conversation at a time (the quickstart's and
the demo's "before" answers)."""

from __future__ import annotations

import torch


def generate(model, tokenizer, messages: list[dict], device: torch.device, max_new_tokens: int = 48) -> str:
    """Greedy answer to a conversation, decoded without special tokens."""
    return answer(model, tokenizer, messages, device, max_new_tokens)[0]


@torch.no_grad()
def answer(model, tokenizer, messages: list[dict], device: torch.device, max_new_tokens: int) -> tuple[str, int]:
    """Greedy answer to a conversation: its text (without special tokens) and the number of tokens generated."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    output = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    new = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), int(new.numel())
