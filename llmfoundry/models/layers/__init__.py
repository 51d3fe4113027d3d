"""The pieces every model family shares: the position schemes (ALiBi, RoPE), the attention mask
description and its kernels (torch, sdpa, flex, flash; grouped-query attention, document
masking), the KV cache decoding extends, and the chunked next-token loss. A family's model.py
composes them; nothing here names a family."""
