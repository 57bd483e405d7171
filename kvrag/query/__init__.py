"""The query engine, one module per step, in the order a prompt flows through them:

``lookup`` (the prompt's cached chunks: ``kvrag.layout.segment`` finds their texts, the store
tiers give their entries, ``kvrag.layout.align`` places them on the prompt's tokens) ->
``prefix`` (the exact K/V of the prompt's leading plain tokens) -> ``fusion`` (the
layer-by-layer prefill, calling the policy's hooks on the ``kvrag.layout.state`` it shares with
them) -> ``decode`` (token by token, streaming; ``constrain`` holds a reply to a JSON schema,
``batch`` decodes many requests in one step).

Above the policies (it calls their hooks) and below the facade; the data it shares with the
policies lives a layer down, in ``kvrag.layout``. Nothing is imported here."""
