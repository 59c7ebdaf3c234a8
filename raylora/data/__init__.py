"""Instruction data: reading, normalising to messages, chat rendering, tokenising with prompt masks."""
