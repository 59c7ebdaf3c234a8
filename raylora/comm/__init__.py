"""Gradient communication: DDP communication hooks and the byte accounting that measures them."""
