"""Question answering data: what the benchmark, KVLink training and the yardsticks read.

* :mod:`kvrag.qa.example` -- ``QAExample`` (the one QA example type) and ``passage_text`` (the one
  rule for how a passage reads in a prompt);
* :mod:`kvrag.qa.files` -- QA data files in the public sets' released formats, read into examples;
* :mod:`kvrag.qa.synthetic` -- the seeded synthetic multi-document QA generator.

The package sits below the policies, the query engine and the benchmark, and imports none of
them (nor torch): training data and evaluation data come from the same place.
"""
