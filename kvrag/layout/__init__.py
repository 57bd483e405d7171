"""A prompt's layout, the data the query engine and the policies both read, below them both:

``prompt`` (the RAG prompt: chat messages -> the prompt string), ``segment`` (where cached
chunk texts stand in it, by characters), ``align`` (which of its tokens each chunk serves) and
``state`` (the pieces, the token ``Layout``, the ``FusionState`` a fused prefill shares with the
policy hooks, the ``FusionStats`` it reports).

Nothing here imports the policies or the query engine (``kvrag.query``) that calls them, and
nothing is imported here: a policy reading ``kvrag.layout.state`` loads no segmenter."""
