"""Building blocks shared by every model family: norm, gated MLP, paged self-attention, the decoder stack,
and the dispatch that picks the kernel backend (`kernel_choice.select_ops`)."""
