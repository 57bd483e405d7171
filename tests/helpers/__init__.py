"""What the test files share that is not a fixture: corpora and prompts (``corpus``), tiny
random-weight models of every family (``fusion``), model comparisons (``models``), stored entries
(``store_entries``), Redis servers (``redis_servers``), HTTP servers (``serve``), streams
(``streams``), the benchmark scripts (``scripts``) and tokenizer cases (``splice``). Fixtures
live in the conftest.py files."""
