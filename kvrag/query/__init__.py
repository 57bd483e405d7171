"""The query path, one module per step, in the order a prompt flows through them:

``prompt`` (chat messages -> the prompt string) -> ``lookup`` (the prompt's cached chunks:
``segment`` finds their texts, the store tiers give their entries, ``align`` places them on
the prompt's tokens) -> ``fusion`` (the layer-by-layer prefill, calling the policy's hooks on
the ``state`` it shares with them) -> ``decode`` (token by token, streaming).

Nothing is imported here: ``kvrag.policies`` read ``kvrag.query.state`` without loading the
engine that calls them."""
