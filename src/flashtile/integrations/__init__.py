"""Integrations of flashtile with other libraries; each is a module imported on its own.

    flashtile.integrations.transformers    attn_implementation="flashtile" in Hugging Face transformers 5.x
"""
