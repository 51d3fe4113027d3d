"""The pieces every model family shares: the decoder (decoder.py: a family's model is a
`DecoderLM` of its config's `DecoderSpec`), the position schemes (ALiBi, RoPE), the attention
mask description and its kernels (torch, sdpa, flex, flash; grouped-query attention, document
masking), the feed-forward layers and the KV cache decoding extends. Nothing here names a
family."""
